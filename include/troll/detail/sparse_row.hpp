// troll/detail/sparse_row.hpp — per-row maths of sparse rows with a remainder bucket (math.md §4),
// written once for host and device: the running top-K of sparsify, its mergeable partial state
// (vocabulary shards), the prefix rule that finalises it, and the union-alignment arithmetic.
// No std containers, exceptions or allocation: scratch arrays are fixed-size members or come in
// from the caller.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../config.hpp"
#include "../sparsify_state.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE

/// How far from 1 the total mass Σ_S p_i + r of a sparse row may be (float rows 1e-4, double rows
/// 1e-6): far above what rounding the log-probs of a normalised row to T gives (about 1e-7 for
/// float, 1e-16 for double; 1e-6 lets double rows come from float computations), far below any
/// real error. Rows inside it are used as given (the maths renormalises the lumped row); rows
/// outside it are rejected.
template <class T>
TROLL_HOST_DEVICE constexpr double sparse_mass_tolerance() {
  return sizeof(T) < sizeof(double) ? 1e-4 : 1e-6;
}

namespace detail {

/// Σ_i exp(log_probs[i]) + exp(log_remainder) over count entries, in double.
template <class T>
TROLL_HOST_DEVICE inline double sparse_row_mass(const T* log_probs, int count, double log_remainder) {
  double mass = ::exp(log_remainder);
  for (int i = 0; i < count; ++i) mass += ::exp(static_cast<double>(log_probs[i]));
  return mass;
}

TROLL_HOST_DEVICE inline void push(log_sum_state& st, double w) {
  if (w == neg_inf()) return;
  if (w > st.m) {
    st.s = st.s * ::exp(st.m - w) + 1.0;
    st.m = w;
  } else {
    st.s += ::exp(w - st.m);
  }
}

/// Adds a block summary (max m, Σ exp(w − m) = s) to a state.
TROLL_HOST_DEVICE inline void push_block(log_sum_state& st, double m, double s) {
  if (m == neg_inf()) return;
  if (m > st.m) {
    st.s = st.s * ::exp(st.m - m) + s;
    st.m = m;
  } else {
    st.s += s * ::exp(m - st.m);
  }
}

TROLL_HOST_DEVICE inline log_sum_state merge(const log_sum_state& a, const log_sum_state& b) {
  log_sum_state r = a;
  push_block(r, b.m, b.s);
  return r;
}

/// log Σ e^{w_i} of a log_sum_state relative to a reference: (m − ref) + log s, formed without
/// the absolute log-sum (−inf for an empty state). Exact to a few ulps of the result for any
/// finite m and ref (logits at float's ±3e38 included: their difference is formed in double).
TROLL_HOST_DEVICE inline double log_sum_relative(const log_sum_state& st, double ref) {
  return st.m == neg_inf() ? neg_inf() : (st.m - ref) + ::log(st.s);
}

/// The bucket weight in sparsify_backward, g_R·p_k/r: as g_R·e^{−log r}·p_k (one exponential
/// per logit) while −log r stays below this, else as g_R·e^{(z_k − tail_ref) − tail} (a second
/// one). e^{−log r} carries log r's rounding times |log r|: at r = e^{−590} that left 381·2⁻⁵³ of
/// max |∂L/∂z| (the limit was 600 before the thirty-fourth session); below 32 it is a few ulps.
/// CPU and CUDA take the same choice.
inline constexpr double light_bucket_log = 32.0;

/// The normalisers of a sparse row gathered from dense logits z, each held relative to its own
/// reference (the largest logit it sums over) so that no absolute log-sum is ever formed:
///     total = log Σ_j e^{z_j − ref},          ref = max_j z_j,
///     tail  = log Σ_{j∉S} e^{z_j − tail_ref},  tail_ref = max_{j∉S} z_j (−inf: no tail mass).
/// A token's log-probability is (z_k − ref) − total, the row's remainder
/// ((tail_ref − ref) + tail) − total, and a tail token's share of the tail p_k / r =
/// e^{(z_k − tail_ref) − tail}: each exact to a few ulps of its own scale for any finite logits,
/// however large (an absolute log Σ e^z near 3e38 keeps none of its fractional digits, and a
/// tail sum relative to a distant row maximum none of the tail's shape). sparsify_finalize
/// exports it per row as sparsify_log_sums_width doubles {ref, total, tail_ref, tail};
/// sparsify_shard_backward takes them back.
struct row_log_sums {
  double ref = 0.0;
  double total = neg_inf();
  double tail_ref = neg_inf();
  double tail = neg_inf();

  /// log p of a token of logit z.
  TROLL_HOST_DEVICE double log_prob(double z) const { return (z - ref) - total; }
  /// log r as exact_log_sums found it wherever the tail's mass relative to the row's maximum
  /// is above 1e-300 (−log1p(Σ_S p / r), no cancellation between `tail` and `total`); NaN: not
  /// known.
  double direct_log_r = quiet_nan();

  /// log r, the tail's share of the row (−inf for an empty tail), from the four normalisers
  /// alone (what every consumer of sparsify_finalize's log_sums computes).
  TROLL_HOST_DEVICE double log_remainder() const {
    return tail_ref == neg_inf() ? neg_inf() : ((tail_ref - ref) + tail) - total;
  }
  /// The log r a sparse row stores: direct_log_r where known, else log_remainder(). The
  /// difference ((tail_ref − ref) + tail) − total cancels to an absolute error of ~eps·log V:
  /// a large relative error of a log r of −1e-5 (r close to 1: a short support of small mass,
  /// δ near 1, flat rows), and still 8 eps (11 ulps) at r just below 1/2 (log r ≈ −0.69, V =
  /// 20,000). It is only taken where the tail's mass underflows (log r below about −690,
  /// where its relative error is that of its own size).
  TROLL_HOST_DEVICE double stored_log_remainder() const {
    return direct_log_r == direct_log_r ? direct_log_r : log_remainder();
  }
};

/// A sum of non-negative terms kept as an unevaluated pair hi + lo (double-double, TwoSum).
/// Summing n terms this way is within n²·eps² of the exact sum whatever their order, so the
/// double it rounds to (value()) does not depend on how the terms were split or ordered — what
/// makes the sums of vocabulary shards equal to those of the whole row (exact_log_sums).
struct exact_sum {
  double hi = 0.0;
  double lo = 0.0;

  TROLL_HOST_DEVICE double value() const { return hi + lo; }
};

/// s ← s + x with the rounding error of the addition kept in s.lo (Knuth's TwoSum: no
/// multiplication, so nothing for the compiler to contract into an FMA).
TROLL_HOST_DEVICE inline void exact_add(exact_sum& s, double x) {
  const double t = s.hi + x;
  const double b = t - s.hi;
  s.lo += (s.hi - (t - b)) + (x - b);
  s.hi = t;
}

TROLL_HOST_DEVICE inline exact_sum exact_add(exact_sum a, const exact_sum& b) {
  exact_add(a, b.hi);
  a.lo += b.lo;
  const double hi = a.hi + a.lo;  // renormalise (Fast2Sum)
  a.lo = a.lo - (hi - a.hi);
  a.hi = hi;
  return a;
}

/// The canonical log-sums of a sparse row gathered from dense logits z, from its support's
/// logits `support_z` (n of them, any order; −inf entries carry no mass) and its tail — the
/// tokens outside the support — given as m_tail = max_{j∉S} z_j and tail = Σ_{j∉S} e^{z_j − m_tail}
/// (an exact_sum; m_tail = −inf for an empty or massless tail), each relative to its own largest
/// logit (row_log_sums): m = max(z_S, m_tail),
///     total = log(Σ_S e^{z_i − m} + tail · e^{m_tail − m}),   tail_ref = m_tail,  tail = log(tail).
/// Every input is a function of the row's values and its support alone, never of how the row
/// was split into shards or scanned, and the support's terms are summed exactly too: the sparse
/// rows of sparsify, of merged vocabulary shards, and the normalisers of their backward passes
/// (log_sums_outside) agree to the last bit (up to a tie in the final rounding, ~n²·eps² away).
/// A row whose every logit is −inf gets ref = 0 and total = tail = −inf.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Z>
TROLL_HOST_DEVICE inline row_log_sums exact_log_sums(const Z& support_z, int n, double m_tail, const exact_sum& tail) {
  const double t = tail.value();
  const bool has_tail = m_tail > neg_inf() && t > 0.0;
  double m = has_tail ? m_tail : neg_inf();
  for (int i = 0; i < n; ++i)
    if (support_z[i] > m) m = support_z[i];
  row_log_sums out;
  if (m == neg_inf()) return out;
  out.ref = m;
  if (has_tail) out.tail_ref = m_tail, out.tail = ::log(t);
  exact_sum s;
  for (int i = 0; i < n; ++i)
    if (support_z[i] > neg_inf()) exact_add(s, ::exp(support_z[i] - m));
  const exact_sum support = s;
  const double tail_mass = has_tail ? t * ::exp(m_tail - m) : 0.0;
  if (has_tail) exact_add(s, tail_mass);
  // s ≥ 1 (the largest term is e^0 = 1, or the tail's t ≥ 1 when the tail holds the maximum), and
  // s.hi − 1 is exact: log1p keeps the relative accuracy of a total close to 0 (a near-
  // deterministic row, whose top log-probability is −total ≈ −Σ_{others} p: log(s) would round
  // 1 + 1e-22 to 1 and write 0).
  out.total = ::log1p((s.hi - 1.0) + s.lo);
  // log r = −log1p(Σ_S e^{z−m} / (tail · e^{m_tail − m})) for any tail mass the quotient can take
  // (Σ_S e^{z−m} ≤ 1024, so it stays below 1e303): exact to a few ulps for r near 1 and near 1/2
  // alike. It used to be taken only for tails of at least half the mass.
  if (has_tail && tail_mass > 1e-300) out.direct_log_r = -::log1p(support.value() / tail_mass);
  return out;
}

/// The token order of sparsify: larger logit first, ties to the lower index.
TROLL_HOST_DEVICE inline bool ranks_before(const sparse_candidate& a, const sparse_candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.index < b.index);
}

/// Sorts a[0..n) best first (ranks_before) by heapsort: O(n log n), no recursion, no scratch.
/// The heap's root is the best element; moving it to the back leaves worst-first order, which
/// is then reversed.
TROLL_HOST_DEVICE inline void swap_candidates(sparse_candidate* a, int i, int j) {
  const sparse_candidate tmp = a[i];
  a[i] = a[j];
  a[j] = tmp;
}

/// Moves a[root] down a binary heap of `size` until no child ranks above its parent, where
/// `above(x, y)` says x belongs above y (the heap's order).
template <class Above>
TROLL_HOST_DEVICE void sift_down(sparse_candidate* a, int size, int root, Above above) {
  for (;;) {
    int top = root;
    const int l = 2 * root + 1, r = l + 1;
    if (l < size && above(a[l], a[top])) top = l;
    if (r < size && above(a[r], a[top])) top = r;
    if (top == root) return;
    swap_candidates(a, root, top);
    root = top;
  }
}

TROLL_HOST_DEVICE inline void sort_best_first(sparse_candidate* a, int n) {
  auto best_above = [](const sparse_candidate& x, const sparse_candidate& y) { return ranks_before(x, y); };
  for (int i = n / 2 - 1; i >= 0; --i) sift_down(a, n, i, best_above);
  for (int end = n - 1; end > 0; --end) {
    swap_candidates(a, 0, end);
    sift_down(a, end, 0, best_above);
  }
  for (int i = 0, j = n - 1; i < j; ++i, --j) swap_candidates(a, i, j);
}

}  // namespace detail

namespace detail {

/// A merged state of a row whose every logit is −inf: no candidate, an empty outside sum, and no
/// finite sampled token (a sampled token of logit −inf is held but gives no support). finalize
/// cannot make a distribution of it; sparsify_finalize rejects it as sparsify rejects the row.
TROLL_HOST_DEVICE inline bool state_has_no_support(const sparsify_state& s) {
  return s.size == 0 && s.outside.m == neg_inf() && !(s.has_sampled && s.sampled_logit > neg_inf());
}

/// Moves heap[root] down until the min-heap property (worst at the root) holds.
TROLL_HOST_DEVICE inline void sift_down_worst(sparse_candidate* heap, int size, int root) {
  sift_down(heap, size, root, [](const sparse_candidate& x, const sparse_candidate& y) { return ranks_before(y, x); });
}

TROLL_HOST_DEVICE inline void sift_up_worst(sparse_candidate* heap, int at) {
  while (at > 0) {
    const int parent = (at - 1) / 2;
    if (!ranks_before(heap[parent], heap[at])) return;
    swap_candidates(heap, parent, at);
    at = parent;
  }
}

/// An empty state for a row of `vocab` tokens with heap capacity k and sampled token `sampled`
/// (−1: none) that will see the tokens [begin, end) (empty until they are scanned).
TROLL_HOST_DEVICE inline void reset(sparsify_state& st, int k, sparse_index sampled, sparse_index vocab,
                                    sparse_index begin, sparse_index end) {
  st.k = k;
  st.size = 0;
  st.sampled = sampled;
  st.has_sampled = false;
  st.sampled_logit = 0.0;
  st.outside = log_sum_state{};
  st.vocab = vocab;
  st.range_count = 1;
  st.covered[0] = sparse_token_range{begin, end};
  for (int i = 1; i < sparsify_max_ranges; ++i) st.covered[i] = sparse_token_range{0, 0};
}

/// The logit below which (or at which) a token seen *after* every token in the heap cannot enter
/// it: −inf while the heap has room, +inf for a heap of no slots (k = 0, which the public entry
/// points reject). Tokens arriving in increasing index order enter iff their logit is strictly
/// above it.
TROLL_HOST_DEVICE inline double entry_threshold(const sparsify_state& st) {
  if (st.size < st.k) return neg_inf();
  return st.k > 0 ? st.heap[0].logit : inf();
}

/// Offers one token (not the sampled one) to the state: it enters the heap (evicting the worst
/// into the outside sum) or joins the outside sum.
TROLL_HOST_DEVICE inline void offer(sparsify_state& st, const sparse_candidate& c) {
  if (st.size < st.k) {
    st.heap[st.size] = c;
    sift_up_worst(st.heap, st.size);
    ++st.size;
    return;
  }
  if (st.k > 0 && ranks_before(c, st.heap[0])) {
    push(st.outside, st.heap[0].logit);
    st.heap[0] = c;
    sift_down_worst(st.heap, st.size, 0);
  } else {
    push(st.outside, c.logit);
  }
}

/// Offers any token, routing the sampled one aside.
TROLL_HOST_DEVICE inline void offer_token(sparsify_state& st, double logit, sparse_index index) {
  if (index == st.sampled) {
    st.has_sampled = true;
    st.sampled_logit = logit;
    return;
  }
  offer(st, sparse_candidate{logit, index});
}

/// The union of the covered ranges of a and b into out (2 · sparsify_max_ranges slots), sorted
/// and coalesced. Returns the number of ranges, or −1 when the two overlap (then `overlap` is
/// the first token both cover).
TROLL_HOST_DEVICE inline int union_coverage(const sparsify_state& a, const sparsify_state& b,
                                            sparse_token_range* out, long long& overlap) {
  int i = 0, j = 0, n = 0;
  const int na = a.range_count, nb = b.range_count;
  while (i < na || j < nb) {
    const bool take_a = j >= nb || (i < na && a.covered[i].begin < b.covered[j].begin);
    const sparse_token_range next = take_a ? a.covered[i++] : b.covered[j++];
    if (n > 0 && next.begin < out[n - 1].end) {
      overlap = next.begin;
      return -1;
    }
    if (n > 0 && next.begin == out[n - 1].end) {
      out[n - 1].end = next.end;
    } else {
      out[n++] = next;
    }
  }
  return n;
}

/// into ← the state of the union of the (disjoint) token sets of `into` and `from`. Both must be
/// valid (check_state), with the same k, sampled token and vocabulary, and coverages whose union
/// fits in sparsify_max_ranges ranges (check_merge).
TROLL_HOST_DEVICE inline void merge_into(sparsify_state& into, const sparsify_state& from) {
  for (int i = 0; i < from.size; ++i) offer(into, from.heap[i]);
  into.outside = merge(into.outside, from.outside);
  if (from.has_sampled) {
    into.has_sampled = true;
    into.sampled_logit = from.sampled_logit;
  }
  sparse_token_range ranges[2 * sparsify_max_ranges];
  long long overlap = 0;
  const int n = union_coverage(into, from, ranges, overlap);
  into.range_count = n;
  for (int i = 0; i < sparsify_max_ranges; ++i) into.covered[i] = i < n ? ranges[i] : sparse_token_range{0, 0};
}

/// Which of sparsify_finalize's log-sums of a row ({ref, total, tail_ref, tail}, row_log_sums)
/// keeps sparsify_shard_backward from using them, or −1 when none does: ref and total finite;
/// tail_ref −inf (no tail mass, then tail −inf too) or finite and not above ref; a finite tail
/// with a finite tail_ref; the tail's mass ((tail_ref − ref) + tail) not above the total.
TROLL_HOST_DEVICE inline int log_sums_problem(const double* sums) {
  if (!(sums[0] - sums[0] == 0.0)) return 0;
  if (!(sums[1] - sums[1] == 0.0)) return 1;
  if (sums[2] != sums[2] || sums[2] > sums[0]) return 2;
  if (sums[2] == neg_inf()) return sums[3] == neg_inf() ? -1 : 3;
  if (!(sums[3] - sums[3] == 0.0) || ((sums[2] - sums[0]) + sums[3]) > sums[1]) return 3;
  return -1;
}

/// What can be wrong with a sparsify_state, alone (check_state), with the state it is merged
/// with (check_merge), or as a whole row (check_whole_row). `entry` and `value` as commented.
enum class state_problem_kind : int {
  none = 0,
  bad_k,            // k outside [1, sparsify_max_k] (value = k; 0: a row sparsify_shard rejected)
  bad_size,         // size outside [0, k] or above the tokens covered (value = size)
  bad_vocab,        // vocab outside [1, 2^31) (value = vocab)
  bad_ranges,       // covered[entry] malformed: count outside [1, max], empty, past V, unsorted or adjacent
  bad_sampled,      // the sampled id (value) is outside [−1, V), or held but not covered
  sampled_logit,    // the held sampled token's logit (value) is NaN or +inf
  sampled_unseen,   // the state covers the sampled token (value) but does not hold it
  heap_logit,       // heap[entry]'s logit (value) is not finite
  heap_index,       // heap[entry]'s token id (value) is not covered by the state, or is the sampled one
  heap_duplicate,   // heap[entry] repeats token id `value`
  heap_order,       // heap[entry]'s parent ranks before it (the heap's worst-at-root order is broken)
  bad_outside,      // the outside log-sum (value = its max) is NaN, +inf, has a bad scale, or is not below the heap
  k_mismatch,       // merge: the states' k differ (value = the other k)
  sampled_mismatch, // merge: the states' sampled tokens differ (value = the other one)
  vocab_mismatch,   // merge / finalize: vocabularies differ (value = the other V)
  overlap,          // merge: both states cover token `value` (the same shard merged twice?)
  too_many_ranges,  // merge: the union needs more than sparsify_max_ranges ranges (value = its count)
  incomplete,       // finalize: token `value` is not covered (entry = tokens covered)
};

struct state_problem {
  state_problem_kind kind = state_problem_kind::none;
  long long entry = 0;
  double value = 0.0;

  TROLL_HOST_DEVICE explicit operator bool() const { return kind != state_problem_kind::none; }
};

TROLL_HOST_DEVICE inline state_problem make_state_problem(state_problem_kind kind, long long entry, double value) {
  state_problem p;
  p.kind = kind;
  p.entry = entry;
  p.value = value;
  return p;
}

/// Whether token `index` lies in one of the state's covered ranges (which must be valid).
TROLL_HOST_DEVICE inline bool covers(const sparsify_state& s, long long index) {
  for (int i = 0; i < s.range_count; ++i)
    if (index >= s.covered[i].begin && index < s.covered[i].end) return true;
  return false;
}



/// What finalize found wrong with a state.
enum class finalize_problem { none, all_masked, sampled_missing };

/// Turns a whole-row state into the sparse row (math.md §4): order the heap and the sampled token
/// by logit (ties to the lower index), keep the shortest prefix whose mass reaches 1 − δ, at most
/// K tokens, then the sampled token if missing. Writes `count` entries of indices / log-probs
/// (normalised over the whole vocabulary) and the log of the exact tail mass,
///     log r = log Σ_{j∉S} e^{z_j} − log Σ_j e^{z_j},
/// from merged log-sum-exp states only (never 1 − Σ). `log_delta` = log δ (−inf for δ = 0).
/// The state's heap is consumed (sorted in place). Returns the problem, writing nothing, when
/// every logit is −inf or the sampled token was never seen. When `log_sums` is given it receives
/// the row's row_log_sums as sparsify_log_sums_width doubles {ref, log Σ_j e^{z_j − ref},
/// tail_ref, log Σ_{j∉S} e^{z_j − tail_ref}}, ref the row's and tail_ref the tail's largest logit (what the backward of vocabulary
/// shards needs: troll::sparsify_shard_backward). Values are formed relative to ref. `forced_keep` ≥ 0 replaces the δ
/// rule's prefix length by one the caller decided (sparsify: keep_with_margin, exact tail sum).
/// The logits of a finalised support, read from finalize's sorted list: the first `keep`
/// entries, then the sampled one when it ranks beyond them.
struct finalized_support_logits {
  const sparse_candidate* list;
  int keep;
  int sampled_pos;

  TROLL_HOST_DEVICE double operator[](int i) const { return i < keep ? list[i].logit : list[sampled_pos].logit; }
};

/// Sorts list[0, n) best first (unless `sorted`: it is already) and inserts the state's sampled
/// token in order when it holds one (list has a spare slot). Returns the new n; sampled_pos is
/// the sampled token's place (−1: none).
TROLL_HOST_DEVICE inline int sort_with_sampled(const sparsify_state& st, sparse_candidate* list, int n,
                                               int& sampled_pos, bool sorted = false) {
  if (!sorted) sort_best_first(list, n);
  sampled_pos = -1;
  if (!st.has_sampled) return n;
  const sparse_candidate s{st.sampled_logit, st.sampled};
  int at = n;
  while (at > 0 && ranks_before(s, list[at - 1])) {
    list[at] = list[at - 1];
    --at;
  }
  list[at] = s;
  sampled_pos = at;
  return n + 1;
}

template <class T>
TROLL_HOST_DEVICE finalize_problem finalize(sparsify_state& st, double log_delta, sparse_index* indices,
                                            T* log_probs, int& count, T& log_remainder,
                                            double* log_sums = nullptr, double* tail_max = nullptr,
                                            const exact_sum* exact_tail = nullptr, int forced_keep = -1,
                                            bool heap_sorted = false) {
  if (st.sampled >= 0 && !st.has_sampled) return finalize_problem::sampled_missing;
  sparse_candidate* list = st.heap;  // heap, then the sampled token, sorted best first
  int sampled_pos = -1;
  const int n = sort_with_sampled(st, list, st.size, sampled_pos, heap_sorted);
  log_sum_state total = st.outside;
  for (int i = 0; i < n; ++i) push(total, list[i].logit);
  if (total.m == neg_inf()) return finalize_problem::all_masked;
  // Every log-sum relative to the row's largest logit (never an absolute log Σ e^z).
  const double ref = total.m, log_total = ::log(total.s);

  // rest(j) = log-mass of everything ranked after the first j tokens (outside ∪ list[j..n)).
  // Scan backwards, remembering the smallest j ≤ K whose rest is within δ.
  const int limit = n < st.k ? n : st.k;
  log_sum_state rest = st.outside;
  for (int i = n - 1; i >= limit; --i) push(rest, list[i].logit);
  int keep = limit;
  for (int j = limit - 1; forced_keep < 0 && j >= 1; --j) {
    push(rest, list[j].logit);  // now rest = rest(j)
    if (log_sum_relative(rest, ref) - log_total <= log_delta) {
      keep = j;
    } else {
      break;  // rest(j) grows as j falls: no shorter prefix qualifies
    }
  }
  if (forced_keep >= 0) keep = forced_keep;
  // The tail: rest(keep) without the sampled token when it ranks beyond the prefix.
  log_sum_state tail = st.outside;
  for (int i = keep; i < n; ++i)
    if (i != sampled_pos) push(tail, list[i].logit);

  // The tail's largest logit: a max, exact whatever the order the tokens came in.
  double m_tail = st.outside.m;
  for (int i = keep; i < n; ++i)
    if (i != sampled_pos && list[i].logit > m_tail) m_tail = list[i].logit;
  if (tail_max) *tail_max = m_tail;
  // The canonical sums from the tail's exact sum (sparsify, two-stage sparsify_finalize). Without
  // it (one-stage sparsify_finalize, the objectives' new rows) the tail's running sum stands in
  // (tail.m is m_tail: push keeps the exact maximum): the same formulas — log1p of the total, the
  // direct log r — so a top log-probability near 0 and a log r near 0 keep their relative digits
  // (log(s) and the difference of log-sums had kept only absolute ones: 2.7e-9 relative on a
  // near-deterministic row of 1e5 logits); only the tail's sum is a plain accumulation.
  const exact_sum running_tail{tail.m > neg_inf() ? tail.s : 0.0, 0.0};
  const finalized_support_logits z{list, keep, sampled_pos};
  const row_log_sums sums =
      exact_log_sums(z, keep + (sampled_pos >= keep ? 1 : 0), m_tail, exact_tail ? *exact_tail : running_tail);
  int c = 0;
  for (int i = 0; i < keep; ++i) {
    indices[c] = list[i].index;
    log_probs[c] = T(sums.log_prob(list[i].logit));
    ++c;
  }
  if (sampled_pos >= keep) {
    indices[c] = list[sampled_pos].index;
    log_probs[c] = T(sums.log_prob(list[sampled_pos].logit));
    ++c;
  }
  count = c;
  log_remainder = T(sums.stored_log_remainder());
  if (log_sums) {
    log_sums[0] = sums.ref;
    log_sums[1] = sums.total;
    log_sums[2] = sums.tail_ref;
    log_sums[3] = sums.tail;
  }
  return finalize_problem::none;
}

/// Whether a value formed in double is a masked (−inf) output in T: the backward passes ignore
/// the upstream gradient there (docs/api.md).
template <class T>
TROLL_HOST_DEVICE inline bool masked_value(double value) {
  return !(static_cast<double>(static_cast<T>(value)) > neg_inf());
}

/// log of one tail token's probability under a uniform tail: log(r / m); −inf for an empty tail.
TROLL_HOST_DEVICE inline double tail_log_value(double log_remainder, long long tail_count) {
  return tail_count > 0 ? log_remainder - ::log(double(tail_count)) : neg_inf();
}

/// The remainder after `tail_from − tail_to` uniform tail tokens were moved into the support:
/// log(r · tail_to / tail_from); −inf when nothing is left of the tail. Where few tokens moved
/// (tail_to ≥ tail_from / 2) the factor is log1p(−moved / tail_from): log of the rounded quotient
/// carried an ulp of 1, which a remainder close to 1 (log r ~ −1e-5, a tail of 1e5 near-uniform
/// tokens) turned into a 1e-13 relative error of the bucket's log-mass.
TROLL_HOST_DEVICE inline double shrink_log_remainder(double log_remainder, long long tail_from,
                                                     long long tail_to) {
  if (tail_to <= 0 || log_remainder == neg_inf()) return neg_inf();
  const double factor = 2 * tail_to >= tail_from ? ::log1p(-double(tail_from - tail_to) / double(tail_from))
                                                 : ::log(double(tail_to) / double(tail_from));
  return log_remainder + factor;
}

/// A sparse row's count is usable: 0 ≤ count ≤ min(capacity k_max, vocab V, sparse_max_entries)
/// (the count_range check of the CPU's check_sparse_row and of the device's warp checks).
TROLL_HOST_DEVICE inline bool sparse_count_fits(long long count, std::size_t capacity, std::size_t vocab) {
  return !(count < 0 || count > static_cast<long long>(capacity) || count > static_cast<long long>(vocab) ||
           count > sparse_max_entries);
}

/// (index, position) pair for membership tests by sorted search.
struct index_slot {
  sparse_index index;
  int position;
};

/// The upstream gradient of a gathered sparse row as its backward counts it: `sum` = Σ_U g_k +
/// g_R as an exact_sum (so that G − g_k keeps its digits: sparse_scatter_row), g_R counted only
/// where the row's tail holds mass (`tail_has_mass`: tail_ref > −inf), g_k only where the
/// gathered row's value is not −inf (counted_entry). A massless bucket (the support covers every
/// token of mass) and a −inf entry (a masked token) are masked outputs, whose upstream gradients
/// the backward passes ignore (docs/api.md); before, such a g moved every entry's gradient.
/// `bucket` is the counted g_R. The entries are summed in `sorted` order (by index), the same in
/// the whole row's backward and in every shard's (both backends: the CUDA scatters' thread 0
/// calls it on the block's shared slots).
struct counted_grad {
  exact_sum sum;
  double bucket = 0.0;
};

/// Support entry `position`'s upstream gradient as the backward counts it: 0 where the gathered
/// row's value `values[position]` is −inf (a masked output), else g. The rule reads the values
/// rather than the logits so that a vocabulary shard's backward, which holds the whole sparse
/// row but only its own logits, counts the same entries as the whole row's.
template <class T>
TROLL_HOST_DEVICE inline double counted_entry(const T* g, const T* values, int position) {
  return static_cast<double>(values[position]) > neg_inf() ? static_cast<double>(g[position]) : 0.0;
}

template <class T>
TROLL_HOST_DEVICE inline counted_grad count_grad(const T* g, const T* values, const index_slot* sorted, int n,
                                                 double g_remainder, bool tail_has_mass) {
  counted_grad c;
  for (int i = 0; i < n; ++i) exact_add(c.sum, counted_entry(g, values, sorted[i].position));
  if (tail_has_mass) {
    c.bucket = g_remainder;
    exact_add(c.sum, g_remainder);
  }
  return c;
}

/// Sorts slots[0..n) by index (heapsort).
TROLL_HOST_DEVICE inline void sort_by_index(index_slot* a, int n) {
  auto sift = [&](int root, int size) {
    for (;;) {
      int big = root;
      const int l = 2 * root + 1, r = l + 1;
      if (l < size && a[l].index > a[big].index) big = l;
      if (r < size && a[r].index > a[big].index) big = r;
      if (big == root) return;
      const index_slot tmp = a[root];
      a[root] = a[big];
      a[big] = tmp;
      root = big;
    }
  };
  for (int i = n / 2 - 1; i >= 0; --i) sift(i, n);
  for (int end = n - 1; end > 0; --end) {
    const index_slot tmp = a[0];
    a[0] = a[end];
    a[end] = tmp;
    sift(0, end);
  }
}

/// Slot holding `index` in slots[0..n) sorted by index, or −1.
TROLL_HOST_DEVICE inline int find_slot(const index_slot* slots, int n, sparse_index index) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (slots[mid].index < index) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && slots[lo].index == index ? lo : -1;
}

/// The union U = S_new ∪ S_old in a fixed order: the new row's entries in its order, then the
/// old row's entries missing from the new row, in the old row's order. For each u < |U| writes
/// indices[u], new_position[u] and old_position[u] (the entry's place in either row, −1 where
/// absent). `scratch` holds old_count slots. Returns |U|.
TROLL_HOST_DEVICE inline int union_support(const sparse_index* new_indices, int new_count,
                                           const sparse_index* old_indices, int old_count,
                                           index_slot* scratch, sparse_index* indices,
                                           int* new_position, int* old_position) {
  for (int i = 0; i < old_count; ++i) scratch[i] = index_slot{old_indices[i], i};
  sort_by_index(scratch, old_count);
  int u = 0;
  for (int i = 0; i < new_count; ++i) {
    indices[u] = new_indices[i];
    new_position[u] = i;
    old_position[u] = -1;
    const int slot = find_slot(scratch, old_count, new_indices[i]);
    if (slot >= 0) {
      old_position[u] = scratch[slot].position;
      scratch[slot].position = -1;  // matched: not old-only
    }
    ++u;
  }
  for (int i = 0; i < old_count; ++i) {
    const int slot = find_slot(scratch, old_count, old_indices[i]);
    if (scratch[slot].position < 0) continue;
    indices[u] = old_indices[i];
    new_position[u] = -1;
    old_position[u] = i;
    ++u;
  }
  return u;
}

/// |S_a ∪ S_b| without writing the union (`scratch` holds b_count slots).
TROLL_HOST_DEVICE inline int union_size(const sparse_index* a, int a_count, const sparse_index* b,
                                        int b_count, index_slot* scratch) {
  for (int i = 0; i < b_count; ++i) scratch[i] = index_slot{b[i], i};
  sort_by_index(scratch, b_count);
  int shared = 0;
  for (int i = 0; i < a_count; ++i) shared += find_slot(scratch, b_count, a[i]) >= 0 ? 1 : 0;
  return a_count + b_count - shared;
}


/// Every field of one state, in this order: k, vocab, covered ranges, size, sampled token, heap
/// entries (finite logit, covered id other than the sampled one, worst-at-root order, distinct
/// ids), the outside sum (m not NaN or +inf; s = 0 when m = −inf, else finite and > 0; tokens go
/// outside only once the heap is full, and none ranks before the heap's worst). Reads nothing
/// beyond the struct. `scratch` holds sparsify_max_k slots.
TROLL_HOST_DEVICE inline state_problem check_state(const sparsify_state& s, index_slot* scratch) {
  using kind = state_problem_kind;
  if (s.k < 1 || s.k > sparsify_max_k) return make_state_problem(kind::bad_k, 0, double(s.k));
  if (s.vocab < 1) return make_state_problem(kind::bad_vocab, 0, double(s.vocab));
  if (s.range_count < 1 || s.range_count > sparsify_max_ranges)
    return make_state_problem(kind::bad_ranges, -1, double(s.range_count));
  long long seen = 0;
  for (int i = 0; i < s.range_count; ++i) {
    const sparse_token_range c = s.covered[i];
    const bool sorted = i == 0 || c.begin > s.covered[i - 1].end;  // disjoint and not adjacent
    if (c.begin < 0 || c.begin >= c.end || c.end > s.vocab || !sorted)
      return make_state_problem(kind::bad_ranges, i, double(c.begin));
    seen += static_cast<long long>(c.end) - c.begin;
  }
  if (s.size < 0 || s.size > s.k || s.size > seen) return make_state_problem(kind::bad_size, 0, double(s.size));
  if (s.sampled < -1 || s.sampled >= s.vocab || (s.has_sampled && (s.sampled < 0 || !covers(s, s.sampled))))
    return make_state_problem(kind::bad_sampled, 0, double(s.sampled));
  if (s.has_sampled && !(s.sampled_logit < inf()))
    return make_state_problem(kind::sampled_logit, 0, s.sampled_logit);
  if (!s.has_sampled && s.sampled >= 0 && covers(s, s.sampled))
    return make_state_problem(kind::sampled_unseen, 0, double(s.sampled));
  for (int i = 0; i < s.size; ++i) {
    const sparse_candidate c = s.heap[i];
    if (!(c.logit > neg_inf() && c.logit < inf())) return make_state_problem(kind::heap_logit, i, c.logit);
    if (c.index == s.sampled || !covers(s, c.index)) return make_state_problem(kind::heap_index, i, double(c.index));
    if (i > 0 && ranks_before(s.heap[(i - 1) / 2], s.heap[i]))  // a parent better than its child
      return make_state_problem(kind::heap_order, i, double(c.index));
    scratch[i] = index_slot{c.index, i};
  }
  sort_by_index(scratch, s.size);
  for (int i = 1; i < s.size; ++i) {
    if (scratch[i].index == scratch[i - 1].index) {
      const int later = scratch[i].position > scratch[i - 1].position ? scratch[i].position : scratch[i - 1].position;
      return make_state_problem(kind::heap_duplicate, later, double(scratch[i].index));
    }
  }
  const log_sum_state o = s.outside;
  const bool scale_ok = o.m == neg_inf() ? o.s == 0.0 : (o.s > 0.0 && o.s < inf());
  const bool below_heap = o.m == neg_inf() || (s.size == s.k && !(o.m > s.heap[0].logit));
  if (o.m != o.m || !(o.m < inf()) || !scale_ok || !below_heap)
    return make_state_problem(kind::bad_outside, 0, o.m);
  return state_problem{};
}

/// What keeps two valid states from merging: k, sampled token, vocabulary, overlapping coverage,
/// or a union of more than sparsify_max_ranges ranges.
TROLL_HOST_DEVICE inline state_problem check_merge(const sparsify_state& into, const sparsify_state& from) {
  using kind = state_problem_kind;
  if (into.k != from.k) return make_state_problem(kind::k_mismatch, 0, double(from.k));
  if (into.sampled != from.sampled) return make_state_problem(kind::sampled_mismatch, 0, double(from.sampled));
  if (into.vocab != from.vocab) return make_state_problem(kind::vocab_mismatch, 0, double(from.vocab));
  sparse_token_range ranges[2 * sparsify_max_ranges];
  long long overlap = 0;
  const int n = union_coverage(into, from, ranges, overlap);
  if (n < 0) return make_state_problem(kind::overlap, 0, double(overlap));
  if (n > sparsify_max_ranges) return make_state_problem(kind::too_many_ranges, 0, double(n));
  return state_problem{};
}

/// What keeps a valid state from being finalised into a row of `vocab` tokens with heap capacity
/// k: a different k, a different vocabulary, or tokens it has not seen (the first one).
TROLL_HOST_DEVICE inline state_problem check_whole_row(const sparsify_state& s, int k, long long vocab) {
  using kind = state_problem_kind;
  if (s.k != k) return make_state_problem(kind::k_mismatch, 0, double(s.k));
  if (s.vocab != vocab) return make_state_problem(kind::vocab_mismatch, 0, double(s.vocab));
  long long seen = 0;
  for (int i = 0; i < s.range_count; ++i) seen += static_cast<long long>(s.covered[i].end) - s.covered[i].begin;
  if (seen != vocab) {
    const long long first = s.covered[0].begin > 0 ? 0 : s.covered[0].end;
    return make_state_problem(kind::incomplete, seen, double(first));
  }
  return state_problem{};
}

}  // namespace detail
TROLL_END_NAMESPACE
