// troll/detail/cpu/sparse_kernels.hpp — the CPU backend's per-row passes of the sparse path:
// the streaming sparsify scan, the checks of a sparse row, the exact log-sums of a dense row
// outside a support, the lumped (|U|+1)-category rows the dense maths runs on, and the scatter of
// a sparse gradient to dense logits. Scratch lives on the stack; nothing allocates.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../sparse_problem.hpp"
#include "../sparse_row.hpp"
#include "exact_sums.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

// The arithmetic of sparsify's block scan: float logits are compared, maximised and
// exponentiated in float (sixteen lanes of AVX-512, eight of AVX2, where double has half as many;
// the same choice as the device kernel), partial sums of a few terms per lane too, every longer
// sum in double. Double logits stay in double.

/// The largest value of type V not above the double x: for every V value y, y > x exactly when
/// y > threshold_below<V>(x), so the scan's test in V selects what the double test would. (Every
/// caller passes a heap logit that came from a V, which converts exactly; the rounding and the
/// range cases keep the equivalence for any double.) NaN stays NaN: nothing beats it.
template <class V>
inline V threshold_below(double x) {
  constexpr V most = std::numeric_limits<V>::max();
  constexpr V infinity = std::numeric_limits<V>::infinity();
  if (!(x == x)) return static_cast<V>(x);
  if (x > static_cast<double>(most)) return x == static_cast<double>(infinity) ? infinity : most;
  if (x < -static_cast<double>(most)) return -infinity;
  V v = static_cast<V>(x);
  if (static_cast<double>(v) > x) v = std::nextafter(v, -infinity);
  return v;
}

/// Σ x[0..count) in double, in eight interleaved partial sums the compiler vectorises without
/// reassociating anything (each lane's order is fixed).
template <class T>
inline double sum_in_double(const T* x, Eigen::Index count) {
  constexpr int lanes = 8;
  double part[lanes] = {};
  Eigen::Index k = 0;
  for (; k + lanes <= count; k += lanes)
    for (int j = 0; j < lanes; ++j) part[j] += static_cast<double>(x[k + j]);
  double total = 0.0;
  for (; k < count; ++k) total += static_cast<double>(x[k]);
  for (int j = 0; j < lanes; ++j) total += part[j];
  return total;
}

/// max of p[0..n) in T, whole packets then a scalar tail.
template <class T>
inline T packet_max(const T* p, Eigen::Index n) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr Eigen::Index lanes = Eigen::Index(sizeof(packet) / sizeof(T));
  T most = -std::numeric_limits<T>::infinity();
  Eigen::Index k = 0;
  if (n >= lanes) {
    packet acc = ploadu<packet>(p);
    for (k = lanes; k + lanes <= n; k += lanes) acc = pmax(acc, ploadu<packet>(p + k));
    most = predux_max(acc);
  }
  for (; k < n; ++k) most = p[k] > most ? p[k] : most;
  return most;
}

/// packet_max that also tells whether some entry is NaN or +inf (`bad`): every lane's "x < +inf"
/// AND-reduced alongside the max, so a scan validates the values it reads anyway.
template <class T>
inline T packet_max_checked(const T* p, Eigen::Index n, bool& bad) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr Eigen::Index lanes = Eigen::Index(sizeof(packet) / sizeof(T));
  constexpr T infinity = std::numeric_limits<T>::infinity();
  T most = -infinity;
  bool odd = false;
  Eigen::Index k = 0;
  if (n >= lanes) {
    const packet top = pset1<packet>(infinity);
    packet acc = ploadu<packet>(p);
    packet fine = pcmp_lt(acc, top);  // all bits set where x < +inf (not NaN, not +inf)
    for (k = lanes; k + lanes <= n; k += lanes) {
      const packet x = ploadu<packet>(p + k);
      acc = pmax(acc, x);
      fine = pand(fine, pcmp_lt(x, top));
    }
    most = predux_max(acc);
    odd = predux_any(pcmp_eq(fine, pzero(fine)));  // a lane with a cleared mask
  }
  for (; k < n; ++k) {
    odd = odd || !(p[k] < infinity);
    most = p[k] > most ? p[k] : most;
  }
  bad = odd;
  return most;
}

/// What sparsify_scan found while it validated a row (sparsify's one pass): a NaN or +inf entry
/// (the scan stops there), and whether any entry is above −inf.
struct scan_check {
  bool bad = false;
  bool any_finite = false;
};

/// Σ_k e^{p_k − m} over p[0..n) as one packet of partial sums per lane, the exponentials and the
/// partial sums in T (each lane adds at most chunk / lanes terms), stored to `lane_sums`; the
/// last partial packet is padded with −inf (an e^{−inf} of Eigen's is tiny, not 0: harmless in a
/// sum that holds e^0 = 1).
template <class T>
inline void packet_exp_sums(const T* p, Eigen::Index n, T m, T* lane_sums) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr Eigen::Index lanes = Eigen::Index(sizeof(packet) / sizeof(T));
  const packet pm = pset1<packet>(m);
  packet acc = pset1<packet>(T(0));
  Eigen::Index k = 0;
  for (; k + lanes <= n; k += lanes) acc = padd(acc, pexp(psub(ploadu<packet>(p + k), pm)));
  if (k < n) {
    T last[lanes];
    for (Eigen::Index j = 0; j < lanes; ++j) last[j] = k + j < n ? p[k + j] : -std::numeric_limits<T>::infinity();
    acc = padd(acc, pexp(psub(ploadu<packet>(last), pm)));
  }
  pstoreu(lane_sums, acc);
}

/// Feeds the tokens [offset, offset + size) of a row (z points at token `offset`) into a
/// sparsify state, block by block, in two passes over each block (held in L1): first the max of
/// each 64-token chunk, where a chunk that beats the heap's entry threshold (a few chunks of a
/// row once the heap is full) or holds the sampled token is copied and walked token by token,
/// its candidates sent through offer() and blanked; then the exponentials of every other token,
/// read in place, into the outside log-sum-exp as one block summary (exponentials and partial
/// sums of at most 64 / lanes terms in T, the block sum in double). Every token lands in exactly
/// one place.
///
/// With `check` (sparsify), the same pass validates the row: a chunk holding a NaN or +inf sets
/// check->bad and ends the scan (the state is then meaningless), and check->any_finite records
/// whether some entry is above −inf.
template <class T>
inline void sparsify_scan(const T* z, std::size_t size, std::size_t offset, sparsify_state& st,
                          scan_check* check = nullptr) {
  using packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr Eigen::Index lanes = Eigen::Index(sizeof(packet) / sizeof(T));
  constexpr Eigen::Index chunk = 64;
  constexpr Eigen::Index chunks_per_block = block_size / chunk;
  static_assert(chunk % lanes == 0 && block_size % chunk == 0, "chunks hold whole packets");
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  T copy[block_size];                             // the walked chunks, candidates blanked
  T lane_sums[chunks_per_block * lanes];          // packet_exp_sums of each chunk
  bool walked[chunks_per_block];
  T chunk_max[chunks_per_block];
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    if (check && check->bad) return;
    const T* row = z + begin;
    const long long first = static_cast<long long>(offset + begin);
    const long long local_sampled = st.sampled >= 0 ? static_cast<long long>(st.sampled) - first : -1;
    const Eigen::Index chunks = (count + chunk - 1) / chunk;
    T m = minus_inf;
    for (Eigen::Index c = 0; c < chunks; ++c) {
      const Eigen::Index from = c * chunk, n = count - from < chunk ? count - from : chunk;
      const bool holds_sampled = local_sampled >= from && local_sampled < from + n;
      const T threshold = threshold_below<T>(entry_threshold(st));
      T most;
      if (check) {
        bool bad = false;
        most = packet_max_checked(row + from, n, bad);
        if (bad) {
          check->bad = true;
          return;
        }
        check->any_finite = check->any_finite || most > minus_inf;
      } else {
        most = packet_max(row + from, n);
      }
      walked[c] = holds_sampled || most > threshold;
      if (walked[c]) {
        T* a = copy + from;
        for (Eigen::Index k = 0; k < n; ++k) a[k] = row[from + k];
        if (holds_sampled) {
          st.has_sampled = true;
          st.sampled_logit = static_cast<double>(a[local_sampled - from]);
          a[local_sampled - from] = minus_inf;
        }
        // Token by token only inside the packets whose max beats the threshold.
        for (Eigen::Index p = 0; p < n; p += lanes) {
          const Eigen::Index end = p + lanes < n ? p + lanes : n;
          if (!(packet_max(a + p, end - p) > threshold)) continue;
          for (Eigen::Index k = p; k < end; ++k) {
            if (!(a[k] > threshold)) continue;
            offer(st, sparse_candidate{static_cast<double>(a[k]), static_cast<sparse_index>(first + from + k)});
            a[k] = minus_inf;  // placed: keep it out of the block summary below
          }
        }
        most = packet_max(a, n);
      }
      chunk_max[c] = most;
      m = most > m ? most : m;
    }
    if (m == minus_inf) return;
    Eigen::Index used = 0;
    for (Eigen::Index c = 0; c < chunks; ++c) {
      if (chunk_max[c] == minus_inf) continue;  // nothing left in it
      const Eigen::Index from = c * chunk, n = count - from < chunk ? count - from : chunk;
      packet_exp_sums((walked[c] ? copy : row) + from, n, m, lane_sums + used);
      used += lanes;
    }
    push_block(st.outside, static_cast<double>(m), sum_in_double(lane_sums, used));
  });
}

/// Checks one sparse row: count within [0, min(capacity, V, sparse_max_entries)], indices in
/// [0, V) and distinct, log-probs and log-remainder not NaN and ≤ 0, no remainder mass when the
/// support covers the vocabulary, some mass somewhere, and last a total mass Σ_S p_i + r within
/// sparse_mass_tolerance<T>() of 1 (callers that read only the support drop the value problems).
/// `scratch` holds sparse_max_entries slots.
template <class T>
inline sparse_problem check_sparse_row(const sparse_index* indices, const T* log_probs, long long count,
                                       T log_remainder, std::size_t capacity, std::size_t vocab,
                                       const char* operand, index_slot* scratch) {
  sparse_problem p;
  p.operand = operand;
  if (count < 0 || count > static_cast<long long>(capacity) || count > static_cast<long long>(vocab) ||
      count > sparse_max_entries) {
    p.kind = sparse_problem_kind::count_range;
    p.value = double(count);
    return p;
  }
  const int n = static_cast<int>(count);
  bool any_mass = false;
  for (int i = 0; i < n; ++i) {
    const long long index = indices[i];
    if (index < 0 || index >= static_cast<long long>(vocab)) {
      p.kind = sparse_problem_kind::index_range;
      p.entry = i;
      p.value = double(index);
      return p;
    }
    const double l = static_cast<double>(log_probs[i]);
    if (l != l) {
      p.kind = sparse_problem_kind::nan_value;
      p.entry = i;
      return p;
    }
    if (l > 0.0) {
      p.kind = sparse_problem_kind::above_one;
      p.entry = i;
      p.value = l;
      return p;
    }
    any_mass = any_mass || l > neg_inf();
    scratch[i] = index_slot{indices[i], i};
  }
  const double r = static_cast<double>(log_remainder);
  if (r != r || r > 0.0) {
    p.kind = r != r ? sparse_problem_kind::nan_value : sparse_problem_kind::above_one;
    p.entry = -1;
    p.value = r;
    return p;
  }
  if (static_cast<std::size_t>(n) == vocab && r > neg_inf()) {
    p.kind = sparse_problem_kind::remainder_no_tail;
    p.value = r;
    return p;
  }
  if (!any_mass && !(r > neg_inf())) {
    p.kind = sparse_problem_kind::no_mass;
    return p;
  }
  sort_by_index(scratch, n);
  for (int i = 1; i < n; ++i) {
    if (scratch[i].index == scratch[i - 1].index) {
      const int later = scratch[i].position > scratch[i - 1].position ? scratch[i].position
                                                                      : scratch[i - 1].position;
      p.kind = sparse_problem_kind::duplicate;
      p.entry = later;
      p.value = double(scratch[i].index);
      return p;
    }
  }
  const double mass = sparse_row_mass(log_probs, n, r);
  if (!(mass >= 1.0 - sparse_mass_tolerance<T>() && mass <= 1.0 + sparse_mass_tolerance<T>())) {
    p.kind = sparse_problem_kind::mass;
    p.entry = -1;
    p.value = mass;
    p.other = sparse_mass_tolerance<T>();
  }
  return p;
}

/// The canonical log Σ_j e^{z_j} over all tokens and over the tokens outside a support given
/// as slots sorted by index (detail::exact_log_sums): two passes over the row (the tail's max,
/// then its exact sum) and the support's logits. The same bits as sparsify's values and as the
/// merged vocabulary shards' log_sums, however the row is split. Exact: the tail sum never
/// subtracts.
template <class T>
inline void log_sums_outside(const T* z, std::size_t size, const index_slot* sorted, int n,
                             double& log_total, double& log_tail) {
  const double m_tail = tail_max(z, size, 0, sorted, n);
  const exact_sum tail = tail_exp_sum(z, size, 0, sorted, n, m_tail);
  struct support_logits {
    const T* z;
    const index_slot* sorted;
    double operator[](int i) const { return static_cast<double>(z[sorted[i].index]); }
  };
  exact_log_sums(support_logits{z, sorted}, n, m_tail, tail, log_total, log_tail);
}

/// Backward of gathering a sparse row from dense logits (math.md §4): with upstream g on the
/// support U and g_R on the bucket log-mass log r = log Σ_{k∉U} p_k,
///     ∂L/∂z_k = [k∈U] g_k + [k∉U] g_R p_k / r − p_k (Σ_U g_i + g_R),
/// written for the tokens [first, first + size) of the row (z and out point at token `first`)
/// given the row's log-sums log_total = log Σ_j e^{z_j} and log_tail = log Σ_{j∉U} e^{z_j} and
/// sum_g = Σ_U g_i + g_R. `sorted` holds the slots of the support tokens inside that range,
/// sorted by (global) index (position = entry in g). O(size), one pass.
template <class T>
inline void sparse_scatter_row(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                               const T* g, double g_remainder, double sum_g, double log_total, double log_tail,
                               T* out) {
  const bool tail_term = log_tail > neg_inf() && g_remainder != 0.0;
  // p_k / r = p_k · e^{log_total − log_tail}: one exponential per logit unless r is so small
  // that the factor would overflow (then exp(z_k − log_tail) directly).
  const double log_inv_r = log_total - log_tail;
  const bool scale_tail = log_inv_r < 600.0;
  const double g_over_r = scale_tail ? g_remainder * std::exp(log_inv_r) : 0.0;
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array a = load(z, begin, count);
    // packet_exp: a token's p_k does not depend on where its block starts (a shard's columns are
    // those of the whole row's gradient, bit for bit), and masked logits get 0.
    block_array p(count);
    packet_exp(a.data(), count, log_total, p.data());
    block_array value = -sum_g * p;
    if (tail_term) {
      if (scale_tail) {
        value += g_over_r * p;
      } else {
        block_array scaled(count);
        packet_exp(a.data(), count, log_tail, scaled.data());
        value += g_remainder * scaled;
      }
    }
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      const Eigen::Index k = Eigen::Index(std::size_t(sorted[next].index) - first - begin);
      value[k] = static_cast<double>(g[sorted[next].position]) - sum_g * p[k];
      ++next;
    }
    store(out, begin, count, value);
  });
}

/// sparse_scatter_row over a whole row (first = 0), its log-sums taken in one pass first. O(V).
template <class T>
inline void sparsify_backward_row(const T* z, std::size_t size, const index_slot* sorted, int n,
                                  const T* g, double g_remainder, T* out) {
  double log_total = 0.0, log_tail = 0.0;
  log_sums_outside(z, size, sorted, n, log_total, log_tail);
  double sum_g = g_remainder;
  for (int i = 0; i < n; ++i) sum_g += static_cast<double>(g[i]);
  sparse_scatter_row(z, size, 0, sorted, n, g, g_remainder, sum_g, log_total, log_tail, out);
}

/// The lumped (|U|+1)-category logits of one aligned side: the support's log-probs, then the
/// bucket's log-mass (−inf when the tail is empty). Returns |U| + 1.
template <class T>
inline int lumped_row(const T* log_probs, int count, T log_remainder, long long tail_count,
                      double* out) {
  for (int i = 0; i < count; ++i) out[i] = static_cast<double>(log_probs[i]);
  out[count] = tail_count > 0 ? static_cast<double>(log_remainder) : neg_inf();
  return count + 1;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
