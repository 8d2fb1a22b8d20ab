// troll/detail/cpu/exact_sums.hpp — the CPU passes behind the canonical log-sums of sparse rows
// (detail::exact_log_sums): the largest logit and the exact sum Σ e^{z − m} over the tokens of a
// range that lie outside a support. The value each token adds depends on its logit and m only —
// never on where a block or a vocabulary shard starts — and the terms are summed exactly, so any
// split of a row into shards gives the same sum as the whole row. Double rows: each term is
// Eigen's packet exp (a short tail padded into a full packet), the terms summed as an
// exact_sum. Float rows: each term is tail_term_fixed (a float exponential at the full vector
// width, rounded to a multiple of 2^−50), the terms summed as 64-bit integers.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
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
    V in[std::size_t(lanes)], res[std::size_t(lanes)];
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
    V values[std::size_t(lanes)];
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

#if defined(__AVX512F__)
/// The support's lanes among the 16 tokens from i (relative to `first`), off `keep`.
inline __mmask16 drop_support(__mmask16 keep, std::size_t i, std::size_t first, const index_slot* sorted, int n,
                              int& next) {
  while (next < n && std::size_t(sorted[next].index) - first < i + 16) {
    keep = __mmask16(keep & ~(1u << (std::size_t(sorted[next].index) - first - i)));
    ++next;
  }
  return keep;
}
#endif

/// The canonical tail terms of float rows: token j adds q_j · 2^−tail_fixed_bits, where q_j is
/// e^{z_j − m} (m: the tail's largest logit) in float, scaled by 2^50 and rounded to the nearest
/// integer — a function of z_j and m alone, in every build, shard and pass. So that the float
/// exponential keeps its digits, z_j − m is formed exactly (a TwoSum in float: d + d_lo), reduced
/// by k·ln 2 in two parts (the first exact), and e^r comes from a degree-6 polynomial on
/// |r| ≤ ln 2 / 2: within 1.5 float ulps of e^{z_j − m} (measured 1.43; tests/test_exp_kernels.cpp
/// checks ≤ 2.5 against long double). Rounding z_j − m alone would cost |z_j − m|·2⁻²⁴. Terms below 2^−51 (z_j − m below about −35.4) round to 0; the sum of the
/// integers is exact (int64 lanes, then an exact_sum of multiples of 2^−50), so it does not depend
/// on the order or split of its terms. The rounding to the grid moves the tail's sum (≥ 1: its
/// largest term is 1) by at most n·2^−51 of it.
constexpr int tail_fixed_bits = 50;

struct tail_exp_coefficients {
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693147182464599609375f;  // float(ln 2): d − k·ln2_hi is exact
  static constexpr float ln2_lo = -1.9046542999577679e-09f;  // ln 2 − ln2_hi, rounded
  // e^r ≈ 1 + c1·r + … + c6·r⁶ on [−ln 2/2, ln 2/2] (fitted for this kernel, relative error)
  static constexpr float c1 = 1.0f, c2 = 0.4999999403953552f, c3 = 0.16666431725025177f,
                         c4 = 0.04166800156235695f, c5 = 0.008374163880944252f, c6 = 0.0013843643246218562f;
  static constexpr float lowest = -60.0f;  // below: the term is 0 (it would round to 0 anyway)
};

/// q_j for one token (the definition; the packet kernels do the same operations in the same
/// order). z = −inf or z − m below −60 gives 0; m is a float logit of the row.
inline std::int64_t tail_term_fixed(float z, float m) {
  using c = tail_exp_coefficients;
  const float d = z - m;
  if (!(d >= c::lowest)) return 0;
  const float bv = d - z, av = d - bv;
  const float d_lo = (z - av) + (-m - bv);  // z − m = d + d_lo exactly (TwoSum)
  const float k = std::nearbyint(d * c::log2e);
  const float r = std::fma(k, -c::ln2_hi, d) + std::fma(k, -c::ln2_lo, d_lo);
  float p = std::fma(c::c6, r, c::c5);
  p = std::fma(p, r, c::c4);
  p = std::fma(p, r, c::c3);
  p = std::fma(p, r, c::c2);
  p = std::fma(p, r, c::c1);
  p = std::fma(p, r, 1.0f);
  return static_cast<std::int64_t>(std::llrint(std::ldexp(p, static_cast<int>(k) + tail_fixed_bits)));
}

/// Adds a non-negative integer count of 2^−tail_fixed_bits to an exact_sum, exactly (two halves
/// of 32 bits, each a double without rounding; the sums stay on the 2^−50 grid within 106 bits).
inline void add_fixed(exact_sum& s, std::uint64_t q) {
  if (q == 0) return;
  exact_sum part;
  static_assert(tail_fixed_bits == 50, "the scales below are 2^(32 − 50) and 2^−50");
  exact_add(part, double(q >> 32) * 0x1p-18);
  exact_add(part, double(q & 0xFFFFFFFFu) * 0x1p-50);
  s = exact_add(s, part);
}

/// The float tail sum token by token (builds without AVX-512 or AVX2 + FMA): the same terms.
inline exact_sum tail_fixed_sum_scalar(const float* z, std::size_t size, std::size_t first, const index_slot* sorted,
                                       int n, double m) {
  exact_sum total;
  if (m == neg_inf()) return total;
  const float shift = static_cast<float>(m);
  std::uint64_t acc = 0;
  int next = 0;
  for (std::size_t j = 0; j < size; ++j) {
    if (next < n && std::size_t(sorted[next].index) - first == j) {
      ++next;
      continue;
    }
    acc += std::uint64_t(tail_term_fixed(z[j], shift));
    if ((j & 4095u) == 4095u) add_fixed(total, acc), acc = 0;
  }
  add_fixed(total, acc);
  return total;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
/// tail_term_fixed on 16 lanes (the same operations), lanes not in `keep` 0, as two int64 packets.
inline void tail_terms_fixed(__m512 zv, __m512 mv, __mmask16 keep, __m512i& q0, __m512i& q1) {
  using c = tail_exp_coefficients;
  const __m512 d = _mm512_sub_ps(zv, mv);
  keep = __mmask16(keep & _mm512_cmp_ps_mask(d, _mm512_set1_ps(c::lowest), _CMP_GE_OQ));
  const __m512 bv = _mm512_sub_ps(d, zv), av = _mm512_sub_ps(d, bv);
  const __m512 d_lo = _mm512_add_ps(_mm512_sub_ps(zv, av), _mm512_sub_ps(_mm512_sub_ps(_mm512_setzero_ps(), mv), bv));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(c::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_fmadd_ps(k, _mm512_set1_ps(-c::ln2_hi), d),
                                 _mm512_fmadd_ps(k, _mm512_set1_ps(-c::ln2_lo), d_lo));
  // The polynomial times 2^50 (every coefficient scaled: each fused multiply-add then gives 2^50
  // times its unscaled result, bit for bit, as no step nears float's range ends), so that the
  // scaling by 2^{k+50} is scalef by k alone: one addition fewer per packet.
  constexpr float scale = float(std::uint64_t(1) << tail_fixed_bits);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c::c6 * scale), r, _mm512_set1_ps(c::c5 * scale));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::c4 * scale));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::c3 * scale));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::c2 * scale));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::c1 * scale));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(scale));
  const __m512 y = _mm512_scalef_ps(p, k);
  q0 = _mm512_maskz_cvtps_epi64(__mmask8(keep), _mm512_castps512_ps256(y));
  q1 = _mm512_maskz_cvtps_epi64(__mmask8(keep >> 8), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
}

/// The float tail sum with AVX-512: 32 tokens a step, the support's lanes and a partial last
/// packet masked, the integers in four int64 packets (at most 4,096 terms a lane between
/// flushes: < 2^63), flushed exactly into the exact_sum. `ahead` (optional, size tokens): the
/// row read next, asked into the cache (T0) at the pace of this pass, the same offsets as the
/// tokens of this step (its scan then starts from cache; measured on a Zen 4 core: sparsify
/// −7%, where T1 or half the row gained nothing).
inline exact_sum tail_fixed_sum_avx512(const float* z, std::size_t size, std::size_t first, const index_slot* sorted,
                                       int n, double m, const float* ahead = nullptr) {
  exact_sum total;
  if (m == neg_inf()) return total;
  const __m512 mv = _mm512_set1_ps(static_cast<float>(m));
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  auto flush = [&] {
    alignas(64) std::uint64_t q[32];
    _mm512_store_si512(q, a0), _mm512_store_si512(q + 8, a1), _mm512_store_si512(q + 16, a2), _mm512_store_si512(q + 24, a3);
    for (int j = 0; j < 32; ++j) add_fixed(total, q[j]);
    a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  };
  int next = 0, steps = 0;
  for (std::size_t i = 0; i < size; i += 32) {
    const std::size_t left = size - i;
    const __mmask16 valid0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __mmask16 valid1 = left >= 32 ? __mmask16(0xFFFF) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1u);
    const __mmask16 keep0 = drop_support(valid0, i, first, sorted, n, next);
    const __mmask16 keep1 = drop_support(valid1, i + 16, first, sorted, n, next);
    // Whole packets are plain loads (masked loads defeat the hardware prefetcher).
    const __m512 z0 = valid0 == 0xFFFF ? _mm512_loadu_ps(z + i) : _mm512_maskz_loadu_ps(valid0, z + i);
    const __m512 z1 = valid1 == 0xFFFF ? _mm512_loadu_ps(z + i + 16) : _mm512_maskz_loadu_ps(valid1, left > 16 ? z + i + 16 : z + i);
    __m512i q0, q1, q2, q3;
    tail_terms_fixed(z0, mv, keep0, q0, q1);
    tail_terms_fixed(z1, mv, keep1, q2, q3);
    a0 = _mm512_add_epi64(a0, q0), a1 = _mm512_add_epi64(a1, q1);
    a2 = _mm512_add_epi64(a2, q2), a3 = _mm512_add_epi64(a3, q3);
    if (ahead && i + 16 < size) {  // two lines of the next row, no address past its end
      _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + i + 16), _MM_HINT_T0);
    }
    if (++steps == 4096) flush(), steps = 0;
  }
  flush();
  return total;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512DQ__))
/// tail_term_fixed on 8 lanes with AVX2 (the same operations; 2^{k+50} built in the exponent
/// field, the product exact), as the 8 terms y = q_j (floats holding integers' reals, 0 off `keep`).
inline __m256 tail_terms_fixed(__m256 zv, __m256 mv, __m256 keep) {
  using c = tail_exp_coefficients;
  const __m256 d = _mm256_sub_ps(zv, mv);
  keep = _mm256_and_ps(keep, _mm256_cmp_ps(d, _mm256_set1_ps(c::lowest), _CMP_GE_OQ));
  const __m256 bv = _mm256_sub_ps(d, zv), av = _mm256_sub_ps(d, bv);
  const __m256 d_lo = _mm256_add_ps(_mm256_sub_ps(zv, av), _mm256_sub_ps(_mm256_sub_ps(_mm256_setzero_ps(), mv), bv));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(c::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_fmadd_ps(k, _mm256_set1_ps(-c::ln2_hi), d),
                                 _mm256_fmadd_ps(k, _mm256_set1_ps(-c::ln2_lo), d_lo));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(c::c6), r, _mm256_set1_ps(c::c5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::c4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::c3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::c2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::c1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // k + 50 + 127 ∈ [30, 177] for d ∈ [−60, 0]; masked lanes may hold anything (zeroed below)
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(_mm256_add_ps(k, _mm256_set1_ps(float(tail_fixed_bits + 127)))), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/// The float tail sum with AVX2 + FMA: 16 tokens a step (two packets, four int64 accumulators);
/// each term (< 2^51) goes to double and through + 1.5·2^52, whose bits are then the rounded
/// integer plus a constant (taken off at each flush); flushed exactly every 4,096 steps. A step
/// with no support token and 16 tokens left takes its terms without a lane mask; the others (a
/// few per row) build it from the support's slots and the row's end (the last step's missing
/// tokens read as 0, their terms masked to 0). `ahead`: as tail_fixed_sum_avx512's, one line a
/// step (measured on a Zen 3 core: sparsify's fastest runs 6–12% faster, its medians 0–6%).
inline exact_sum tail_fixed_sum_avx2(const float* z, std::size_t size, std::size_t first, const index_slot* sorted,
                                     int n, double m, const float* ahead = nullptr) {
  exact_sum total;
  if (m == neg_inf()) return total;
  const __m256 mv = _mm256_set1_ps(static_cast<float>(m));
  const __m256d magic = _mm256_set1_pd(6755399441055744.0);  // 1.5·2^52
  const std::uint64_t magic_bits = 0x4338000000000000u;
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 every_lane = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  std::uint64_t steps = 0;  // terms (each carrying magic_bits) in every lane since the last flush
  auto flush = [&] {
    alignas(32) std::uint64_t q[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), a0), _mm256_store_si256(reinterpret_cast<__m256i*>(q + 4), a1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8), a2), _mm256_store_si256(reinterpret_cast<__m256i*>(q + 12), a3);
    for (int j = 0; j < 16; ++j) add_fixed(total, q[j] - steps * magic_bits);
    a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, steps = 0;
  };
  auto accumulate = [&](const __m256& y, __m256i& low, __m256i& high) {
    low = _mm256_add_epi64(low, _mm256_castpd_si256(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(y)), magic)));
    high = _mm256_add_epi64(high, _mm256_castpd_si256(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)), magic)));
  };
  auto lanes_of = [&](unsigned keep) {  // bit j of keep → lane j all ones
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(keep)), lane_bits), lane_bits));
  };
  int next = 0;
  for (std::size_t i = 0; i < size; i += 16) {
    const std::size_t left = size - i;
    __m256 z0, z1, keep0 = every_lane, keep1 = every_lane;
    if (left >= 16) {
      z0 = _mm256_loadu_ps(z + i), z1 = _mm256_loadu_ps(z + i + 8);
    } else {
      alignas(32) float last[16] = {};
      for (std::size_t j = 0; j < left; ++j) last[j] = z[i + j];
      z0 = _mm256_load_ps(last), z1 = _mm256_load_ps(last + 8);
    }
    if (left < 16 || (next < n && std::size_t(sorted[next].index) - first < i + 16)) {
      unsigned keep = left >= 16 ? 0xFFFFu : (1u << left) - 1u;
      while (next < n && std::size_t(sorted[next].index) - first < i + 16) {
        keep &= ~(1u << (std::size_t(sorted[next].index) - first - i));
        ++next;
      }
      keep0 = lanes_of(keep & 0xFFu), keep1 = lanes_of(keep >> 8);
    }
    accumulate(tail_terms_fixed(z0, mv, keep0), a0, a1);
    accumulate(tail_terms_fixed(z1, mv, keep1), a2, a3);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);  // one line a step
    if (++steps == 4096) flush();
  }
  flush();
  return total;
}
#endif

/// Σ e^{z_j − m} over the tokens [first, first + size) outside the support, as an exact_sum.
/// Float rows: the terms tail_term_fixed (AVX-512 with DQ: 16 lanes; AVX2 + FMA: 8; otherwise
/// token by token), summed exactly as integers. Double rows, below.
/// Block by block (held in L1): each term through Eigen's packet exp into a buffer, the lanes
/// below the packet exp's range redone with std::exp (only a block that holds one; as
/// packet_exp), the support's own terms zeroed, then the buffer added to TwoSum lanes in double
/// packets — a loop without calls, so the lanes stay in registers. A term's value depends on z_j and m only, and the exact_sum's
/// value does not depend on the order of its terms, so any split of the row (vocabulary shards)
/// gives the same sum. m = −inf (or a tail of masked tokens only) gives an empty sum.
///
/// `ahead` (optional, size tokens; double rows only): the row to be read next, asked into the
/// cache line by line at the pace of this pass (sparsify: the next row's scan then reads it from
/// cache while this pass's arithmetic hides the memory's latency). Prefetches change no value.
/// Float rows prefetch the whole next row into L1 (T0) with AVX-512 or AVX2. On the Zen 5 core of
/// earlier measurements half or a quarter of the next row gained nothing; on a Zen 4 core the
/// whole row with T0 took sparsify from 6.0–6.5 to 5.6–5.9 ms per 64 rows (T1: no gain).
template <class T>
inline exact_sum tail_exp_sum(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                              double m, const T* ahead = nullptr) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  constexpr T lowest = sizeof(T) == sizeof(double) ? T(-709.0) : T(-87.0);
  static_assert(block_size % lanes == 0, "blocks hold whole packets");
  if constexpr (std::is_same<T, float>::value) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
    return tail_fixed_sum_avx512(z, size, first, sorted, n, m, ahead);
#elif defined(__AVX2__) && defined(__FMA__)
    return tail_fixed_sum_avx2(z, size, first, sorted, n, m, ahead);
#else
    (void)ahead;
    return tail_fixed_sum_scalar(z, size, first, sorted, n, m);
#endif
  }
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
      T last[std::size_t(lanes)];
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
