// troll/detail/cpu/sparse_kernels.hpp — the CPU backend's per-row passes of the sparse path:
// the streaming sparsify scan, the checks of a sparse row, the exact log-sums of a dense row
// outside a support, the lumped (|U|+1)-category rows the dense maths runs on, and the scatter of
// a sparse gradient to dense logits. Scratch lives on the stack; nothing allocates.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../row_problem.hpp"
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
    T last[std::size_t(lanes)];
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
  T lane_sums[std::size_t(chunks_per_block * lanes)];          // packet_exp_sums of each chunk
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

/// The running top K of sparsify_scan_topk, without a heap: up to K kept candidates and up to
/// `extra` new ones; when the buffer is full, nth_element keeps the K best (ranks_before; the
/// order is total, so which K survive does not depend on when this happens) and the others only
/// raise out_max. `threshold` is the K-th best logit at the last selection (−inf until K were
/// kept), rounded into T by threshold_below: a later token can enter only above it (a tie
/// ranks after, having the larger index). No exponential anywhere.
template <class T>
struct topk_buffer {
  static constexpr int extra = 128;
  static constexpr int slack = 64;  // a group of AVX-512 packets may store this many past `full`
  int k = 0;
  int count = 0;
  double out_max = neg_inf();  // the max of the candidates dropped
  T threshold = -std::numeric_limits<T>::infinity();
  T values[sparsify_max_k + extra + slack];  // the candidates, structure of arrays
  sparse_index indices[sparsify_max_k + extra + slack];

  int full() const { return k + extra; }
  /// Keeps the K best candidates (ties to the lower index: the buffer is in token order, and
  /// stays so), dropping the others into out_max, and raises the threshold to the K-th value.
  /// The K-th value is found by a bitwise search on order-preserving unsigned keys of the values
  /// (a count of the keys at or above each trial key: no data-dependent branch), then one stable
  /// compaction.
  void select() {
#if defined(__AVX512F__)
    if constexpr (std::is_same<T, float>::value) {
      if (select_packets()) return;
    }
#endif
    using key_type = typename std::conditional<sizeof(T) == 4, std::uint32_t, std::uint64_t>::type;
    constexpr int bits = int(8 * sizeof(T));
    if (count > k) {
      key_type keys[sparsify_max_k + extra + slack];
      for (int i = 0; i < count; ++i) {
        const T v = values[i] + T(0);  // −0 → +0: equal logits get equal keys
        key_type u;
        std::memcpy(&u, &v, sizeof(T));
        keys[i] = (u >> (bits - 1)) ? key_type(~u) : key_type(u | (key_type(1) << (bits - 1)));
      }
      key_type kth = 0;  // the largest key with at least K keys at or above it
      for (int bit = bits - 1; bit >= 0; --bit) {
        const key_type trial = kth | (key_type(1) << bit);
        int at_or_above = 0;
        for (int i = 0; i < count; ++i) at_or_above += keys[i] >= trial ? 1 : 0;
        kth = at_or_above >= k ? trial : kth;
      }
      int above = 0;
      for (int i = 0; i < count; ++i) above += keys[i] > kth ? 1 : 0;
      int ties_left = k - above, kept = 0;
      for (int i = 0; i < count; ++i) {
        const bool keep = keys[i] > kth || (keys[i] == kth && ties_left-- > 0);
        if (keep) {
          values[kept] = values[i];
          indices[kept] = indices[i];
          ++kept;
        } else {
          out_max = static_cast<double>(values[i]) > out_max ? static_cast<double>(values[i]) : out_max;
        }
      }
      count = kept;
    }
    if (count == k && k > 0) {
      T worst = values[0];
      for (int i = 1; i < count; ++i) worst = values[i] < worst ? values[i] : worst;
      threshold = worst;  // a T: exactly threshold_below<T> of its double
    }
  }
#if defined(__AVX512F__)
  /// select() for float buffers with AVX-512, the same result: the keys 16 at a time, the bitwise
  /// search only below the highest bit in which the keys differ (the bits above are the same in
  /// every key, so the search would take them as they are), the compaction by compress stores.
  /// Returns false, having changed nothing, when the K-th key is tied with one that would be
  /// dropped: the scalar select then breaks the tie by token order.
  bool select_packets() {
    if (count <= k || k <= 0) return false;
    constexpr int capacity = sparsify_max_k + extra + slack;
    alignas(64) std::uint32_t keys[capacity + 16];
    const int packets = (count + 15) / 16;
    auto valid_lanes = [this](int p) {  // the lanes of packet p below count
      const int left = count - 16 * p;
      return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    };
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
    __m512i all_and = _mm512_set1_epi32(-1), all_or = _mm512_setzero_si512();
    for (int p = 0; p < packets; ++p) {
      const __mmask16 valid = valid_lanes(p);
      // −0 → +0, then the order-preserving key: negative values' bits flipped, others' sign set
      const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, values + 16 * p), _mm512_setzero_ps());
      const __m512i u = _mm512_castps_si512(v);
      const __mmask16 negative = _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());
      __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), negative, u, _mm512_set1_epi32(-1));
      key = _mm512_maskz_mov_epi32(valid, key);  // padding: key 0, below every trial key
      _mm512_store_si512(keys + 16 * p, key);
      all_and = _mm512_mask_and_epi32(all_and, valid, all_and, key);
      all_or = _mm512_or_si512(all_or, key);
    }
    const std::uint32_t common_and = std::uint32_t(_mm512_reduce_and_epi32(all_and));
    const std::uint32_t differ = common_and ^ std::uint32_t(_mm512_reduce_or_epi32(all_or));
    if (differ == 0) return false;  // every key equal: a tie, broken by token order
    const int top_bit = 31 - __builtin_clz(differ);
    // the bits above top_bit as every key has them, the rest searched (2u << 31 wraps to 0)
    std::uint32_t kth = common_and & ~((2u << top_bit) - 1u);
    for (int bit = top_bit; bit >= 0; --bit) {
      const std::uint32_t trial = kth | (1u << bit);
      const __m512i tv = _mm512_set1_epi32(int(trial));
      int at_or_above = 0;
      for (int p = 0; p < packets; ++p)
        at_or_above += __builtin_popcount(unsigned(_mm512_cmpge_epu32_mask(_mm512_load_si512(keys + 16 * p), tv)));
      kth = at_or_above >= k ? trial : kth;
    }
    const __m512i kv = _mm512_set1_epi32(int(kth));
    int above = 0, equal = 0;
    for (int p = 0; p < packets; ++p) {
      const __m512i key = _mm512_load_si512(keys + 16 * p);
      above += __builtin_popcount(unsigned(_mm512_cmpgt_epu32_mask(key, kv)));
      equal += __builtin_popcount(unsigned(_mm512_cmpeq_epu32_mask(key, kv)));
    }
    if (above + equal != k) return false;  // the K-th key tied with a dropped one
    int kept = 0;
    __m512 dropped = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), worst = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    for (int p = 0; p < packets; ++p) {
      const __mmask16 valid = valid_lanes(p);
      const __mmask16 keep = __mmask16(valid & _mm512_cmpge_epu32_mask(_mm512_load_si512(keys + 16 * p), kv));
      const __m512 v = _mm512_maskz_loadu_ps(valid, values + 16 * p);
      const __m512i ids = _mm512_maskz_loadu_epi32(valid, indices + 16 * p);
      dropped = _mm512_mask_max_ps(dropped, __mmask16(valid & ~keep), dropped, v);
      worst = _mm512_mask_min_ps(worst, keep, worst, v);
      // in place: kept ≤ 16·p, so the stores never pass the packet being read
      const int n_keep = __builtin_popcount(keep);
      const __mmask16 first = __mmask16((1u << n_keep) - 1u);
      _mm512_mask_storeu_ps(values + kept, first, _mm512_maskz_compress_ps(keep, v));
      _mm512_mask_storeu_epi32(indices + kept, first, _mm512_maskz_compress_epi32(keep, ids));
      kept += n_keep;
    }
    const double most_dropped = static_cast<double>(_mm512_reduce_max_ps(dropped));
    out_max = most_dropped > out_max ? most_dropped : out_max;
    count = kept;
    threshold = _mm512_reduce_min_ps(worst);
    return true;
  }
#endif
  /// After candidates were appended: selects when the buffer is full, or when it first holds K.
  void settle() {
    if (count >= full() || (count >= k && threshold == -std::numeric_limits<T>::infinity())) select();
  }
  void add(T logit, long index) {
    values[count] = logit;
    indices[count] = static_cast<sparse_index>(index);
    ++count;
    settle();
  }
  /// The kept candidates into st.heap in token order, everything else dropped. Not heap-ordered:
  /// sparsify_row's only reader, ordered_support, sorts them best first (a heap built here would
  /// be undone by that sort).
  void into(sparsify_state& st) {
    select();
    for (int i = 0; i < count; ++i) st.heap[i] = sparse_candidate{static_cast<double>(values[i]), indices[i]};
    st.size = count;
  }
};

/// Offers the tokens [from, to) of a whole row (z points at token 0) one by one: the sampled token
/// is recorded, a token above the buffer's threshold becomes a candidate, every other one only
/// raises `rest` (the max of the tokens left outside that never were candidates). Returns false
/// at a NaN or +inf (the row is bad).
template <class T>
inline bool scan_tokens(const T* z, long from, long to, sparsify_state& st, topk_buffer<T>& top, T& rest) {
  constexpr T infinity = std::numeric_limits<T>::infinity();
  for (long i = from; i < to; ++i) {
    const T x = z[i];
    if (!(x < infinity)) return false;
    if (i == long(st.sampled)) {
      st.has_sampled = true;
      st.sampled_logit = static_cast<double>(x);
    } else if (x > top.threshold) {
      top.add(x, i);
    } else if (x > rest) {
      rest = x;
    }
  }
  return true;
}

/// sparsify's one read of a whole row: the top K (into st.heap), the sampled token's logit and the row's
/// checks (a NaN or +inf sets check.bad and ends the scan; check.any_finite), but no
/// exponentials. Returns the max of the tokens outside the heap and the sampled token (st.outside
/// stays empty: sparsify takes the tail's exact sum afterwards).
///
/// Groups of four packets are tested against the top-K buffer's threshold as a whole (and for
/// NaN / +inf); a group without a candidate, the sampled token or a bad value only raises a
/// packet max. With AVX-512 (float) a group that has candidates adds them to the buffer straight
/// from the compare masks; elsewhere it is walked token by token.
template <class T>
inline double sparsify_scan_topk(const T* z, std::size_t size, sparsify_state& st, scan_check& check) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  constexpr long group = 4 * lanes;
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const long n = static_cast<long>(size), sampled = static_cast<long>(st.sampled);
  topk_buffer<T> top;
  top.k = st.k;
  T rest_scalar = minus_inf;
  long i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value && lanes == 16) {
    const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    constexpr long prefetch_distance = 2048;  // tokens (8 KiB) ahead
    const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 rest = _mm512_set1_ps(minus_inf);
    for (; i + group <= n; i += group) {
      if (i + prefetch_distance + group <= n)  // keeps loads in flight across the groups' branches
        for (long line = 0; line < group; line += 16) _mm_prefetch(reinterpret_cast<const char*>(z + i + prefetch_distance + line), _MM_HINT_T0);
      const __m512 x0 = _mm512_loadu_ps(z + i), x1 = _mm512_loadu_ps(z + i + 16);
      const __m512 x2 = _mm512_loadu_ps(z + i + 32), x3 = _mm512_loadu_ps(z + i + 48);
      const __m512 t = _mm512_set1_ps(top.threshold);
      const __m512 most = _mm512_max_ps(_mm512_max_ps(x0, x1), _mm512_max_ps(x2, x3));
      const unsigned nan = unsigned(_mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q)) | _mm512_cmp_ps_mask(x2, x3, _CMP_UNORD_Q);
      if (!(nan | _mm512_cmp_ps_mask(most, t, _CMP_GT_OQ)) && !(sampled >= i && sampled < i + group)) {
        rest = _mm512_max_ps(rest, most);
        continue;
      }
      if (nan || _mm512_cmp_ps_mask(most, infinity, _CMP_EQ_OQ)) {
        check.bad = true;
        return 0.0;
      }
      // The group's candidates (above the threshold it was tested against) compressed into the
      // buffer, values and token ids; every other lane, the sampled token's aside, into `rest`.
      const __m512 xs[4] = {x0, x1, x2, x3};
      for (long p = 0; p < 4; ++p) {
        const long base = i + 16 * p;
        unsigned own = 0;
        if (sampled >= base && sampled < base + 16) {
          own = 1u << unsigned(sampled - base);
          st.has_sampled = true;
          st.sampled_logit = static_cast<double>(z[sampled]);
        }
        const unsigned cand = unsigned(_mm512_cmp_ps_mask(xs[p], t, _CMP_GT_OQ)) & ~own;
        rest = _mm512_mask_max_ps(rest, __mmask16(~(cand | own)), rest, xs[p]);
        if (!cand) continue;
        const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(int(base)), lane_ids);
        _mm512_storeu_ps(top.values + top.count, _mm512_maskz_compress_ps(__mmask16(cand), xs[p]));
        _mm512_storeu_si512(top.indices + top.count, _mm512_maskz_compress_epi32(__mmask16(cand), ids));
        top.count += __builtin_popcount(cand);
      }
      top.settle();
    }
    rest_scalar = _mm512_reduce_max_ps(rest);
  } else
#elif defined(__AVX2__)
  if constexpr (std::is_same<T, float>::value && lanes == 8) {
    // The AVX-512 path's tests with AVX2's compares: the group's max against the threshold, NaN
    // by two unordered compares, +inf through the max (caught on the candidate path). A group
    // with candidates adds them from the compare's bit mask (tested against the threshold the
    // group started with, as above); only the tail of the row is walked token by token.
    const __m256 infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256 lowest = _mm256_set1_ps(minus_inf);
    const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    constexpr long prefetch_distance = 2048;  // tokens (8 KiB) ahead
    __m256 rest = lowest;
    for (; i + group <= n; i += group) {
      if (i + prefetch_distance + group <= n)
        for (long line = 0; line < group; line += 16) _mm_prefetch(reinterpret_cast<const char*>(z + i + prefetch_distance + line), _MM_HINT_T0);
      const __m256 x0 = _mm256_loadu_ps(z + i), x1 = _mm256_loadu_ps(z + i + 8);
      const __m256 x2 = _mm256_loadu_ps(z + i + 16), x3 = _mm256_loadu_ps(z + i + 24);
      const __m256 t = _mm256_set1_ps(top.threshold);
      const __m256 most = _mm256_max_ps(_mm256_max_ps(x0, x1), _mm256_max_ps(x2, x3));
      const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q), _mm256_cmp_ps(x2, x3, _CMP_UNORD_Q));
      const __m256 flagged = _mm256_or_ps(nan, _mm256_cmp_ps(most, t, _CMP_GT_OQ));
      if (_mm256_testz_ps(flagged, flagged) && !(sampled >= i && sampled < i + group)) {
        rest = _mm256_max_ps(rest, most);
        continue;
      }
      if (!_mm256_testz_ps(nan, nan) || _mm256_movemask_ps(_mm256_cmp_ps(most, infinity, _CMP_EQ_OQ))) {
        check.bad = true;
        return 0.0;
      }
      const __m256 xs[4] = {x0, x1, x2, x3};
      for (long p = 0; p < 4; ++p) {
        const long base = i + 8 * p;
        __m256 taken = _mm256_cmp_ps(xs[p], t, _CMP_GT_OQ);  // candidates, then the sampled lane too
        unsigned own = 0;
        if (sampled >= base && sampled < base + 8) {
          own = 1u << unsigned(sampled - base);
          st.has_sampled = true;
          st.sampled_logit = static_cast<double>(z[sampled]);
          taken = _mm256_or_ps(taken, _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane_ids, _mm256_set1_epi32(int(sampled - base)))));
        }
        rest = _mm256_max_ps(rest, _mm256_blendv_ps(xs[p], lowest, taken));
        for (unsigned cand = unsigned(_mm256_movemask_ps(taken)) & ~own; cand != 0; cand &= cand - 1u) {
          const long at = base + __builtin_ctz(cand);
          top.values[top.count] = z[at];
          top.indices[top.count] = static_cast<sparse_index>(at);
          ++top.count;
        }
      }
      top.settle();
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(rest), _mm256_extractf128_ps(rest, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    rest_scalar = _mm_cvtss_f32(half);
  } else
#endif
  {
    const packet infinity = pset1<packet>(std::numeric_limits<T>::infinity());
    packet rest = pset1<packet>(minus_inf);
    for (; i + group <= n; i += group) {
      const packet x0 = ploadu<packet>(z + i), x1 = ploadu<packet>(z + i + lanes);
      const packet x2 = ploadu<packet>(z + i + 2 * lanes), x3 = ploadu<packet>(z + i + 3 * lanes);
      const packet t = pset1<packet>(top.threshold);
      const packet fine = pand(pand(pcmp_lt(x0, infinity), pcmp_lt(x1, infinity)),
                               pand(pcmp_lt(x2, infinity), pcmp_lt(x3, infinity)));
      const packet hit = por(por(pcmp_lt(t, x0), pcmp_lt(t, x1)), por(pcmp_lt(t, x2), pcmp_lt(t, x3)));
      if (!predux_any(hit) && !predux_any(pcmp_eq(fine, pzero(fine))) && !(sampled >= i && sampled < i + group)) {
        rest = pmax(rest, pmax(pmax(x0, x1), pmax(x2, x3)));
        continue;
      }
      if (!scan_tokens(z, i, i + group, st, top, rest_scalar)) {
        check.bad = true;
        return 0.0;
      }
    }
    const T most = predux_max(rest);
    rest_scalar = most > rest_scalar ? most : rest_scalar;
  }
  if (!scan_tokens(z, i, n, st, top, rest_scalar)) {
    check.bad = true;
    return 0.0;
  }
  top.into(st);
  const double rest_max = static_cast<double>(rest_scalar);
  const double m_out = top.out_max > rest_max ? top.out_max : rest_max;
  check.any_finite = st.size > 0 || m_out > neg_inf() || (st.has_sampled && st.sampled_logit > neg_inf());
  return m_out;
}

/// finalize's list for a whole-row state: the heap sorted best first in place (finalize is then
/// told so, and does not sort it again), copied with the sampled token inserted in order (list
/// holds k + 1 slots). Returns n; sampled_pos is the sampled token's place (−1: none).
inline int ordered_support(sparsify_state& st, sparse_candidate* list, int& sampled_pos) {
  sort_best_first(st.heap, st.size);
  for (int i = 0; i < st.size; ++i) list[i] = st.heap[i];
  return sort_with_sampled(st, list, st.size, sampled_pos, true);
}

/// How far sparsify's δ rule may be from finalize's on the scan's block sums, in log-mass: those
/// sums carry a relative error below ~1e-5 (float exponentials, float arguments z − m rounded
/// with |z − m| ≤ 87), the exact tail sum a similar one; 1e-3 leaves a factor of 40.
inline constexpr double keep_margin = 1e-3;

/// finalize's δ rule (the shortest prefix of list, at most k, whose rest is within δ) decided on
/// the tail's exact sum: `tail` = Σ e^{z − m_tail} over the outside tokens and list[limit..n)
/// except the sampled one (limit = min(n, k)). Returns the prefix length, or −1 when some rest
/// the rule looks at lies within keep_margin of log δ (there finalize's block sums could decide
/// the other way: the caller redoes the row that way). An empty rest is decided exactly.
inline int keep_with_margin(const sparse_candidate* list, int n, int sampled_pos, int k, double m_tail,
                            const exact_sum& tail, double log_delta) {
  const int limit = n < k ? n : k;
  log_sum_state base;
  if (m_tail > neg_inf() && tail.value() > 0.0) base = log_sum_state{m_tail, tail.value()};
  log_sum_state total = base;
  for (int i = 0; i < n; ++i)
    if (i < limit || i == sampled_pos) push(total, list[i].logit);
  if (total.m == neg_inf()) return limit;
  const double ref = total.m, log_total = std::log(total.s);  // relative to the row's largest logit
  log_sum_state rest = base;
  if (sampled_pos >= limit) push(rest, list[sampled_pos].logit);
  int keep = limit;
  for (int j = limit - 1; j >= 1; --j) {
    push(rest, list[j].logit);
    const double d = log_sum_relative(rest, ref) - log_total;
    if (d == neg_inf()) {
      keep = j;
      continue;
    }
    if (log_delta == neg_inf()) break;
    if (std::fabs(d - log_delta) <= keep_margin) return -1;
    if (d > log_delta) break;
    keep = j;
  }
  return keep;
}

/// sparsify of one whole row (z, V = size tokens) into indices / log_probs (room for k + 1) and
/// log_remainder; false when the row is bad (a NaN or +inf, or every logit −inf), with nothing
/// meaningful written. One read of the row from memory (sparsify_scan_topk: the support, the
/// checks, the outside max, no exponentials), then the tail's exact sum (tail_exp_sum: the one
/// exponential per token) while the row is in cache, the δ rule decided on it
/// (keep_with_margin), a second tail sum only when δ shortens the prefix. `fast = false` (and a
/// δ decision within the margin) takes the path of block sums in the scan (sparsify_scan) and
/// finalize's own δ rule: the same bits, what the tests compare against. `next_row` (optional):
/// the row sparsify reads next, prefetched during the tail sum.
template <class T>
inline bool sparsify_row(const T* z, std::size_t size, int k, sparse_index sampled, double log_delta,
                         sparse_index* indices, T* log_probs, int& count, T& log_remainder, bool fast = true,
                         const T* next_row = nullptr) {
  const auto vocab = static_cast<sparse_index>(size);
  sparsify_state st;
  reset(st, k, sampled, vocab, 0, vocab);
  scan_check check;
  index_slot slots[sparsify_max_k + 1];
  if (fast) {
    const double m_out = sparsify_scan_topk(z, size, st, check);
    if (check.bad || !check.any_finite) return false;
    // Only the outside's max and emptiness are read below (a forced prefix, the exact tail).
    st.outside = m_out > neg_inf() ? log_sum_state{m_out, 1.0} : log_sum_state{};
    sparse_candidate list[sparsify_max_k + 1];
    int sampled_pos = -1;
    const int n = ordered_support(st, list, sampled_pos);
    auto tail_for = [&](int keep, const T* ahead) {  // finalize's tail for a prefix of `keep` tokens
      double m_tail = st.outside.m;
      int c = 0;
      for (int i = 0; i < n; ++i) {
        if (i < keep || i == sampled_pos) {
          slots[c] = index_slot{list[i].index, c};
          ++c;
        } else if (list[i].logit > m_tail) {
          m_tail = list[i].logit;
        }
      }
      sort_by_index(slots, c);
      return std::pair<exact_sum, double>(tail_exp_sum(z, size, 0, slots, c, m_tail, ahead), m_tail);
    };
    const int limit = n < k ? n : k;
    std::pair<exact_sum, double> tail = tail_for(limit, next_row);
    const int keep = keep_with_margin(list, n, sampled_pos, k, tail.second, tail.first, log_delta);
    if (keep >= 0) {
      if (keep != limit) tail = tail_for(keep, nullptr);
      finalize(st, log_delta, indices, log_probs, count, log_remainder, nullptr, nullptr, &tail.first, keep, true);
      return true;
    }
    reset(st, k, sampled, vocab, 0, vocab);  // a δ decision too close to call: the block sums decide
    check = scan_check{};
  }
  sparsify_scan(z, size, 0, st, &check);
  if (check.bad || !check.any_finite) return false;
  // The scan picks the support; its values come from the canonical sums (exact_log_sums): the
  // tail's max from the state, the tail's exact sum from a second pass over the row (in cache).
  const sparsify_state scanned = st;
  double m_tail = 0.0;
  finalize(st, log_delta, indices, log_probs, count, log_remainder, nullptr, &m_tail);
  for (int i = 0; i < count; ++i) slots[i] = index_slot{indices[i], i};
  sort_by_index(slots, count);
  const exact_sum tail = tail_exp_sum(z, size, 0, slots, count, m_tail);
  st = scanned;
  finalize(st, log_delta, indices, log_probs, count, log_remainder, nullptr, nullptr, &tail);
  return true;
}

/// Checks one sparse row: count within [0, min(capacity, V, sparse_max_entries)], then entry by
/// entry (index in [0, V), log-prob not NaN and ≤ 0), the log-remainder not NaN and ≤ 0, no
/// remainder mass when the support covers the vocabulary, some mass somewhere, distinct indices,
/// and last a total mass Σ_S p_i + r within sparse_mass_tolerance<T>() of 1. As the device's
/// warp_check_sparse_row: `remainder_rules` = false skips the remainder and mass rules (a support
/// whose values are not read), and a null `log_probs` skips the entry value rules too (only the
/// indices are read). `scratch` holds sparse_max_entries slots.
template <class T>
inline row_problem check_sparse_row(const sparse_index* indices, const T* log_probs, long long count,
                                       T log_remainder, std::size_t capacity, std::size_t vocab,
                                       const char* operand, index_slot* scratch, bool remainder_rules = true) {
  row_problem p;
  p.operand = operand;
  if (!sparse_count_fits(count, capacity, vocab)) {
    p.kind = row_error::sparse_count;
    p.value = double(count);
    return p;
  }
  const int n = static_cast<int>(count);
  bool any_mass = false;
  for (int i = 0; i < n; ++i) {
    const long long index = indices[i];
    if (index < 0 || index >= static_cast<long long>(vocab)) {
      p.kind = row_error::sparse_index;
      p.entry = i;
      p.value = double(index);
      return p;
    }
    const double l = log_probs != nullptr ? static_cast<double>(log_probs[i]) : neg_inf();
    if (l != l) {
      p.kind = row_error::sparse_nan;
      p.entry = i;
      return p;
    }
    if (l > 0.0) {
      p.kind = row_error::sparse_above_one;
      p.entry = i;
      p.value = l;
      return p;
    }
    any_mass = any_mass || l > neg_inf();
    scratch[i] = index_slot{indices[i], i};
  }
  const double r = static_cast<double>(log_remainder);
  if (remainder_rules && (r != r || r > 0.0)) {
    p.kind = r != r ? row_error::sparse_nan : row_error::sparse_above_one;
    p.entry = -1;
    p.value = r;
    return p;
  }
  if (remainder_rules && static_cast<std::size_t>(n) == vocab && r > neg_inf()) {
    p.kind = row_error::sparse_no_tail;
    p.value = r;
    return p;
  }
  if (remainder_rules && !any_mass && !(r > neg_inf())) {
    p.kind = row_error::sparse_no_mass;
    return p;
  }
  sort_by_index(scratch, n);
  for (int i = 1; i < n; ++i) {
    if (scratch[i].index == scratch[i - 1].index) {
      const int later = scratch[i].position > scratch[i - 1].position ? scratch[i].position
                                                                      : scratch[i - 1].position;
      p.kind = row_error::sparse_duplicate;
      p.entry = later;
      p.value = double(scratch[i].index);
      return p;
    }
  }
  if (!remainder_rules) return row_problem{};
  const double mass = sparse_row_mass(log_probs, n, r);
  if (!(mass >= 1.0 - sparse_mass_tolerance<T>() && mass <= 1.0 + sparse_mass_tolerance<T>())) {
    p.kind = row_error::sparse_mass;
    p.entry = -1;
    p.value = mass;
    p.other = sparse_mass_tolerance<T>();
  }
  return p;
}

/// The canonical log-sums (row_log_sums: relative to the row's largest logit) over all tokens and
/// over the tokens outside a support given as slots sorted by index (detail::exact_log_sums): two
/// passes over the row (the tail's max, then its exact sum) and the support's logits. The same
/// bits as sparsify's values and as the merged vocabulary shards' log_sums, however the row is
/// split. Exact: the tail sum never subtracts.
template <class T>
inline row_log_sums log_sums_outside(const T* z, std::size_t size, const index_slot* sorted, int n) {
  const double m_tail = tail_max(z, size, 0, sorted, n);
  const exact_sum tail = tail_exp_sum(z, size, 0, sorted, n, m_tail);
  struct support_logits {
    const T* z;
    const index_slot* sorted;
    double operator[](int i) const { return static_cast<double>(z[sorted[i].index]); }
  };
  return exact_log_sums(support_logits{z, sorted}, n, m_tail, tail);
}

/// Backward of gathering a sparse row from dense logits (math.md §4): with upstream g on the
/// support U and g_R on the bucket log-mass log r = log Σ_{k∉U} p_k (counted as counted_grad
/// says: G = Σ_U g_i + g_R over the counted ones),
///     ∂L/∂z_k = [k∈U] g_k + [k∉U] g_R p_k / r − p_k G,
/// written for the tokens [first, first + size) of the row (z and out point at token `first`)
/// given the row's log-sums (row_log_sums: p_k = e^{(z_k − ref) − total}, p_k / r =
/// e^{(z_k − tail_ref) − tail}). A support entry is formed as g_k (1 − p_k) − p_k (G − g_k), with
/// 1 − p_k = −expm1(log p_k) and G − g_k from the exact sum: g_k − p_k G cancelled on a
/// near-deterministic row (1 − p_k below the rounding of p_k G: 3.5e-5 relative at a gap of 30,
/// 0 for 3.8e-17 at 40). A support entry whose logit is −inf (a masked input) gets 0; one whose
/// gathered value `values[position]` is −inf (a masked output) counts its g as 0 (counted_entry).
/// `sorted` holds the slots of the support tokens inside that range, sorted by (global) index
/// (position = entry in g). O(size), one pass. Returns whether every written entry fits T (false
/// when a true entry overflows: an upstream gradient near the type's largest value; the caller
/// throws, as the other derivatives' last guard does).
template <class T>
inline bool sparse_scatter_row(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                               const T* g, const T* values, const counted_grad& counted, const row_log_sums& sums,
                               T* out) {
  const double ref = sums.ref, log_total = sums.total, sum_g = counted.sum.value();
  const double g_remainder = counted.bucket;
  const bool tail_term = sums.tail_ref > neg_inf() && g_remainder != 0.0;
  // p_k / r = p_k · e^{−log r}: one exponential per logit while the bucket is not light
  // (light_bucket_log, sparse_row.hpp) and g_R / r fits; else g_R · e^{(z_k − tail_ref) − tail}, a
  // second exponential, relative to the tail's own max, whose factor p_k / r ≤ 1.
  const double log_inv_r = -sums.log_remainder();
  const double g_over_r = log_inv_r < light_bucket_log ? g_remainder * std::exp(log_inv_r) : 0.0;
  const bool scale_tail = log_inv_r < light_bucket_log && fits_in<double>(g_over_r);
  // A tail entry's factor g_R / r − G, formed as g_R (1/r − 1) − (G − g_R): with the bucket
  // holding nearly all the mass, 1/r − 1 = expm1(−log r) keeps its digits where e^{−log r} − 1
  // did not (0 for 4.2e-18 at a logit gap of 40, 1.3e-4 off at 30), and G − g_R is the exact sum's.
  const double tail_factor =
      g_remainder * std::expm1(log_inv_r) - ((counted.sum.hi - g_remainder) + counted.sum.lo);
  constexpr double limit = largest_finite<T>();
  bool fits = true;
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array a = load(z, begin, count);
    // packet_exp: a token's p_k does not depend on where its block starts (a shard's columns are
    // those of the whole row's gradient, bit for bit), and masked logits get 0.
    block_array p(count);
    packet_exp(a.data(), count, ref, p.data(), log_total);
    block_array value = -sum_g * p;
    if (tail_term) {
      if (scale_tail) {
        value = tail_factor * p;
      } else {
        block_array scaled(count);
        packet_exp(a.data(), count, sums.tail_ref, scaled.data(), sums.tail);
        value += g_remainder * scaled;
      }
    }
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      const Eigen::Index k = Eigen::Index(std::size_t(sorted[next].index) - first - begin);
      const double log_p = sums.log_prob(a[k]);
      if (!(a[k] > neg_inf())) {
        value[k] = 0.0;
      } else {
        const double gk = counted_entry(g, values, sorted[next].position);
        const double rest = (counted.sum.hi - gk) + counted.sum.lo;  // G − g_k
        value[k] = gk * -std::expm1(log_p) - p[k] * rest;
      }
      ++next;
    }
    fits = fits && (value.abs() <= limit).all();
    store(out, begin, count, value);
  });
  return fits;
}

/// sparse_scatter_row over a whole row (first = 0), its log-sums taken in one pass first. O(V).
/// `values`: the gathered row's values by position (their −inf entries are masked outputs).
/// Returns whether every entry fits T.
template <class T>
inline bool sparsify_backward_row(const T* z, std::size_t size, const index_slot* sorted, int n,
                                  const T* g, const T* values, double g_remainder, T* out) {
  const row_log_sums sums = log_sums_outside(z, size, sorted, n);
  const counted_grad counted = count_grad(g, values, sorted, n, g_remainder, sums.tail_ref > neg_inf());
  return sparse_scatter_row(z, size, 0, sorted, n, g, values, counted, sums, out);
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
