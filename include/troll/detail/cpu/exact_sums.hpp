// troll/detail/cpu/exact_sums.hpp — the CPU passes behind the canonical log-sums of sparse rows
// (detail::exact_log_sums): the largest logit and the exact sum Σ e^{z − m} over the tokens of a
// range that lie outside a support. The value each token adds depends on its logit and m only —
// one exponential (Eigen's packet exp on every lane, a short tail padded into a full packet),
// never on where a block or a vocabulary shard starts — and the terms are summed as an
// exact_sum, so any split of a row into shards gives the same sum as the whole row.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <limits>
#include <cstddef>
#include <type_traits>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// out[i] = e^{(x[i] − shift) − offset} for i < count, in V (float or double), every entry through
/// the same packet exponential (a partial last packet is padded), so an entry's value does not
/// depend on its position. The reference `shift` comes off first, so that logits of any
/// magnitude keep their digits (shift: the row's largest logit, offset: a log-sum relative to it,
/// row_log_sums); offset = 0 gives e^{x − shift} bit for bit. Arguments below the packet exp's
/// range (where Eigen 3.4's vectorised exp returns a tiny constant, −inf included) are redone
/// with std::exp, which gives the subnormal or 0; only a block that holds one pays.
template <class V>
inline void packet_exp(const V* x, Eigen::Index count, V shift, V* out, V offset = V(0)) {
  using packet = typename Eigen::internal::packet_traits<V>::type;
  constexpr Eigen::Index lanes = Eigen::internal::packet_traits<V>::size;
  constexpr V lowest = sizeof(V) == sizeof(double) ? V(-709.0) : V(-87.0);
  const packet s = Eigen::internal::pset1<packet>(shift);
  const packet o = Eigen::internal::pset1<packet>(offset);
  using namespace Eigen::internal;
  Eigen::Index i = 0;
  packet low = pset1<packet>(V(0));
  for (; i + lanes <= count; i += lanes) {
    const packet d = psub(psub(ploadu<packet>(x + i), s), o);
    low = pmin(low, d);
    pstoreu(out + i, pexp(d));
  }
  if (i < count) {
    V in[lanes], res[lanes];
    for (Eigen::Index j = 0; j < lanes; ++j) in[j] = i + j < count ? x[i + j] : shift;
    const packet d = psub(psub(ploadu<packet>(in), s), o);
    low = pmin(low, d);
    pstoreu(res, pexp(d));
    for (Eigen::Index j = 0; i + j < count; ++j) out[i + j] = res[j];
  }
  if (count > 0 && !(predux_min(low) >= lowest)) {
    for (Eigen::Index k = 0; k < count; ++k) {
      const V d = (x[k] - shift) - offset;
      if (!(d >= lowest)) out[k] = std::exp(d);
    }
  }
}

/// max z_j over the tokens [first, first + size) outside the support (−inf when none); z points
/// at token `first`, `sorted` holds the support's slots inside the range, by index.
template <class T>
inline double tail_max(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n) {
  alignas(64) double x[block_size];
  double m = neg_inf();
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    for (Eigen::Index k = 0; k < count; ++k) x[k] = static_cast<double>(z[begin + std::size_t(k)]);
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      x[std::size_t(sorted[next].index) - first - begin] = neg_inf();
      ++next;
    }
    const double b = Eigen::Map<const Eigen::ArrayXd>(x, count).maxCoeff();
    if (b > m) m = b;
  });
  return m;
}

/// The double packets of the TwoSum lanes of tail_exp_sum: hi + lo per lane.
using sum_packet = Eigen::internal::packet_traits<double>::type;

/// (hi, lo) ← (hi, lo) + v lane by lane, Knuth's TwoSum (no multiplication: nothing to contract).
inline void two_sum_lanes(sum_packet& hi, sum_packet& lo, const sum_packet& v) {
  using namespace Eigen::internal;
  const sum_packet t = padd(hi, v);
  const sum_packet b = psub(t, hi);
  lo = padd(lo, padd(psub(hi, psub(t, b)), psub(v, b)));
  hi = t;
}

/// Adds a packet of V terms to the TwoSum lanes (two pairs, kept in registers): a double packet
/// to the first, a float packet as its two halves widened (exactly) to double.
template <class Packet>
inline void add_terms(sum_packet& hi0, sum_packet& lo0, sum_packet& hi1, sum_packet& lo1, const Packet& e) {
  using namespace Eigen::internal;
  using V = typename unpacket_traits<Packet>::type;
  constexpr int lanes = int(sizeof(Packet) / sizeof(V));
  constexpr int wide = int(sizeof(sum_packet) / sizeof(double));
  if constexpr (std::is_same<V, double>::value) {
    two_sum_lanes(hi0, lo0, e);
  } else {
#if defined(__AVX512F__)
    if constexpr (sizeof(Packet) == sizeof(__m512) && sizeof(sum_packet) == sizeof(__m512d)) {
      const __m512 v = e;
      two_sum_lanes(hi0, lo0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      two_sum_lanes(hi1, lo1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
      return;
    }
#endif
    V values[lanes];
    pstoreu(values, e);
    for (int part = 0; part * wide < lanes; ++part) {
      double d[wide] = {};
      for (int j = 0; j < wide && part * wide + j < lanes; ++j) d[j] = double(values[part * wide + j]);
      if (part % 2 == 0) {
        two_sum_lanes(hi0, lo0, ploadu<sum_packet>(d));
      } else {
        two_sum_lanes(hi1, lo1, ploadu<sum_packet>(d));
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__FMA__)
/// Eigen 3.4's AVX-512 float exponential (`pexp<Packet16f>`: the same operations in the same
/// order, so the same bits) for arguments in [−87, 0], where Eigen's clamps and its final max
/// change nothing and 2^m (m ≥ −126) times the polynomial is a normal float: the scaling is one
/// `scalef` instead of the exponent-field construction and multiply. 13 operations, not 19.
/// Outside [−87, 0] the value is unspecified (tail_exp_sum_avx512 redoes those lanes).
inline __m512 exp_eigen_bounded(__m512 x) {
  const __m512 m = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.6931471805599453f), x);
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 r3 = _mm512_mul_ps(r2, r);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
  __m512 y1 = _mm512_fmadd_ps(_mm512_set1_ps(4.1665795894E-2f), r, _mm512_set1_ps(1.6666665459E-1f));
  const __m512 y2 = _mm512_add_ps(r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y1 = _mm512_fmadd_ps(y1, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, r3, y1);
  y = _mm512_fmadd_ps(y, r2, y2);
  return _mm512_scalef_ps(y, m);
}

/// (hi, lo) ← (hi, lo) + v lane by lane when hi ≥ 1 ≥ v ≥ 0 (Fast2Sum: hi + v rounded, and the
/// rounding error v − ((hi + v) − hi), exact because hi's exponent is at least v's).
inline void fast_two_sum_lanes(__m512d& hi, __m512d& lo, __m512d v) {
  const __m512d t = _mm512_add_pd(hi, v);
  lo = _mm512_add_pd(lo, _mm512_sub_pd(v, _mm512_sub_pd(t, hi)));
  hi = t;
}

/// One packet of tail terms: z − shift through exp_eigen_bounded, the lanes not in `keep` zeroed;
/// `far` collects the kept lanes below −87 (finite: e^{−inf} = 0 adds nothing), whose terms are
/// left out here and added by the caller's scalar pass.
inline __m512 tail_terms(const float* z, __mmask16 valid, __mmask16 keep, __m512 shift, __mmask16& far) {
  // A whole packet is a plain load: masked loads from memory defeat the hardware prefetcher
  // (3× slower over rows not in cache on this Zen 5).
  const __m512 d = _mm512_sub_ps(valid == 0xFFFF ? _mm512_loadu_ps(z) : _mm512_maskz_loadu_ps(valid, z), shift);
  const __mmask16 low = _mm512_mask_cmp_ps_mask(keep, d, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  far = __mmask16(far | (low & _mm512_cmp_ps_mask(d, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ)));
  return _mm512_maskz_mov_ps(__mmask16(keep & ~low), exp_eigen_bounded(d));
}

/// The support's lanes among the 16 tokens from i (relative to `first`), off `keep`.
inline __mmask16 drop_support(__mmask16 keep, std::size_t i, std::size_t first, const index_slot* sorted, int n,
                              int& next) {
  while (next < n && std::size_t(sorted[next].index) - first < i + 16) {
    keep = __mmask16(keep & ~(1u << (std::size_t(sorted[next].index) - first - i)));
    ++next;
  }
  return keep;
}

/// tail_exp_sum for float rows with AVX-512: the same terms (Eigen's packet exp of z − shift,
/// bit for bit; std::exp below −87; the support's zeroed), in one loop over the row without a
/// buffer: a packet's support lanes and a partial last packet are masked loads. The terms (each
/// in [0, 1]) go to four Fast2Sum lanes of eight doubles that start at 1 — so hi ≥ 1 ≥ v and
/// 4 operations per add instead of TwoSum's 7, and four independent chains — and the offsets
/// come off exactly at the end (h − 1 is exact for h ≥ 1). Terms below −87 (rare: masked or
/// hopeless tokens) are added by a scalar pass, only where the row has one. Which lane adds a
/// term changes with the split of the row anyway (shards start anywhere); the exact_sum's value
/// does not. No prefetch of the next row (tail_exp_sum's `ahead`): here it made sparsify ~7%
/// slower, the next row's lines pushing this row's out of L2 before this pass read them.
inline exact_sum tail_exp_sum_avx512(const float* z, std::size_t size, std::size_t first, const index_slot* sorted,
                                     int n, double m) {
  exact_sum total;
  if (m == neg_inf()) return total;
  const float shift = static_cast<float>(m);
  const __m512 ps = _mm512_set1_ps(shift);
  __m512d hi0 = _mm512_set1_pd(1.0), hi1 = hi0, hi2 = hi0, hi3 = hi0;
  __m512d lo0 = _mm512_setzero_pd(), lo1 = lo0, lo2 = lo0, lo3 = lo0;
  __mmask16 far = 0;
  int next = 0;
  for (std::size_t i = 0; i < size; i += 32) {
    const std::size_t left = size - i;
    const __mmask16 valid0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __mmask16 valid1 = left >= 32 ? __mmask16(0xFFFF) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1u);
    const __mmask16 keep0 = drop_support(valid0, i, first, sorted, n, next);
    const __mmask16 keep1 = drop_support(valid1, i + 16, first, sorted, n, next);
    const __m512 e0 = tail_terms(z + i, valid0, keep0, ps, far);
    const __m512 e1 = tail_terms(left > 16 ? z + i + 16 : z + i, valid1, keep1, ps, far);
    fast_two_sum_lanes(hi0, lo0, _mm512_cvtps_pd(_mm512_castps512_ps256(e0)));
    fast_two_sum_lanes(hi1, lo1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e0), 1))));
    fast_two_sum_lanes(hi2, lo2, _mm512_cvtps_pd(_mm512_castps512_ps256(e1)));
    fast_two_sum_lanes(hi3, lo3, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e1), 1))));
  }
  const __m512d one = _mm512_set1_pd(1.0);
  alignas(64) double h[32], l[32];
  _mm512_store_pd(h, _mm512_sub_pd(hi0, one)), _mm512_store_pd(h + 8, _mm512_sub_pd(hi1, one));
  _mm512_store_pd(h + 16, _mm512_sub_pd(hi2, one)), _mm512_store_pd(h + 24, _mm512_sub_pd(hi3, one));
  _mm512_store_pd(l, lo0), _mm512_store_pd(l + 8, lo1), _mm512_store_pd(l + 16, lo2), _mm512_store_pd(l + 24, lo3);
  for (int j = 0; j < 32; ++j) total = exact_add(total, exact_sum{h[j], l[j]});
  if (far) {  // the terms below −87 (subnormal or 0), one by one
    int s = 0;
    for (std::size_t j = 0; j < size; ++j) {
      while (s < n && std::size_t(sorted[s].index) - first < j) ++s;
      if (s < n && std::size_t(sorted[s].index) - first == j) continue;
      const float d = z[j] - shift;
      if (d < -87.0f && d > -std::numeric_limits<float>::infinity()) exact_add(total, double(std::exp(d)));
    }
  }
  return total;
}
#endif

/// Σ e^{z_j − m} over the tokens [first, first + size) outside the support, as an exact_sum.
/// Block by block (held in L1): each term through Eigen's packet exp in T (float rows: eight or
/// sixteen lanes, as sparsify's scan) into a buffer, the lanes below the packet exp's range
/// redone with std::exp (only a block that holds one; as packet_exp), the support's own terms
/// zeroed, then the buffer added to TwoSum lanes in double packets — a loop without calls, so
/// the lanes stay in registers. A term's value depends on z_j and m only, and the exact_sum's
/// value does not depend on the order of its terms, so any split of the row (vocabulary shards)
/// gives the same sum. m = −inf (or a tail of masked tokens only) gives an empty sum.
///
/// `ahead` (optional, size tokens): the row to be read next, asked into the cache line by line
/// at the pace of this pass (sparsify: the next row's scan then reads it from cache while this
/// pass's arithmetic hides the memory's latency). Prefetches change no value.
template <class T>
inline exact_sum tail_exp_sum(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                              double m, const T* ahead = nullptr) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  constexpr T lowest = sizeof(T) == sizeof(double) ? T(-709.0) : T(-87.0);
  static_assert(block_size % lanes == 0, "blocks hold whole packets");
#if defined(__AVX512F__) && defined(__FMA__)
  if constexpr (std::is_same<T, float>::value && sizeof(packet) == sizeof(__m512))
    {
    (void)ahead;  // not prefetched here: the next row's lines evicted this row's from L2 (slower)
    return tail_exp_sum_avx512(z, size, first, sorted, n, m);
  }
#endif
  exact_sum total;
  if (m == neg_inf()) return total;
  const T shift = static_cast<T>(m);  // m is one of the row's logits: exact in T
  const packet ps = pset1<packet>(shift);
  sum_packet hi0 = pset1<sum_packet>(0.0), lo0 = hi0, hi1 = hi0, lo1 = hi0;
  alignas(64) T e[block_size];
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count_in_block) {
    const long count = static_cast<long>(count_in_block);
    const long whole = count - count % lanes;
    const T* x = z + begin;
#if defined(__GNUC__)
    if (ahead) {
      constexpr long per_line = long(64 / sizeof(T));
      for (long k = 0; k < count; k += per_line) __builtin_prefetch(ahead + begin + std::size_t(k), 0, 2);
    }
#endif
    packet low = pset1<packet>(T(0));  // the least argument (no NaN: the logits are checked)
    for (long k = 0; k < whole; k += lanes) {
      const packet d = psub(ploadu<packet>(x + k), ps);
      low = pmin(low, d);
      pstore(e + k, pexp(d));
    }
    long padded = whole;
    if (whole < count) {  // a partial last packet: padded with the shift, whose terms are zeroed
      T last[lanes];
      for (long j = 0; j < lanes; ++j) last[j] = whole + j < count ? x[whole + j] : shift;
      const packet d = psub(ploadu<packet>(last), ps);
      low = pmin(low, d);
      pstore(e + whole, pexp(d));
      padded = whole + lanes;
    }
    if (predux_min(low) < lowest) {
      for (long k = 0; k < count; ++k)
        if (!(x[k] - shift >= lowest)) e[k] = std::exp(x[k] - shift);
    }
    for (long k = count; k < padded; ++k) e[k] = T(0);
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      e[std::size_t(sorted[next].index) - first - begin] = T(0);  // the support's own terms
      ++next;
    }
    for (long k = 0; k < padded; k += lanes) add_terms(hi0, lo0, hi1, lo1, pload<packet>(e + k));
  });
  constexpr int wide = int(sizeof(sum_packet) / sizeof(double));
  double h[2 * wide], l[2 * wide];
  pstoreu(h, hi0), pstoreu(h + wide, hi1);
  pstoreu(l, lo0), pstoreu(l + wide, lo1);
  for (int j = 0; j < 2 * wide; ++j) total = exact_add(total, exact_sum{h[j], l[j]});
  return total;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
