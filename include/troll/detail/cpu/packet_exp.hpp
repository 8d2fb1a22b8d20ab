// troll/detail/cpu/packet_exp.hpp — the CPU backend's packet exponentials: e^x on a double packet
// in the ranges the passes need (exp_nonpositive, exp_bounded, exp_in_range: AVX-512's
// sixteen-entry table kernel, AVX2's two-entry one, a portable kernel elsewhere; never Eigen 3.4's
// pexp, which divides and returns ~5.6e-309 below −709.8), expm1 near zero, and exp_any, which
// falls back to std::exp lane by lane outside the packet kernels' range. Each is within 1.5 ulp
// (tests/test_exp_kernels.cpp).
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "../../config.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The argument reduction of the double exponentials below: x (clamped below to `lowest`) =
/// n·ln 2 + r with |r| ≤ ln 2 / 2; returns r, and n as a double.
template <class Packet>
inline Packet exp_reduce(const Packet& x, Packet& n, double lowest) {
  using namespace Eigen::internal;
  const Packet clamped = pmax(x, pset1<Packet>(lowest));
  n = pfloor(pmadd(clamped, pset1<Packet>(1.4426950408889634), pset1<Packet>(0.5)));
  // r = x − n·ln 2 in two parts (the first exact for |n| < 2^11).
  Packet r = psub(clamped, pmul(n, pset1<Packet>(0.693145751953125)));
  return psub(r, pmul(n, pset1<Packet>(1.42860682030941723212e-6)));
}

/// 1/k!, k = 0..17: the Taylor polynomial of e^r uses k = 0..13 (truncation below 1e-17 relative
/// on |r| ≤ ln 2 / 2), expm1_near_zero_packet k = 1..17.
struct exp_taylor {
  static constexpr double inverse_factorial[18] = {1.0,
                                                   1.0,
                                                   1.0 / 2,
                                                   1.0 / 6,
                                                   1.0 / 24,
                                                   1.0 / 120,
                                                   1.0 / 720,
                                                   1.0 / 5040,
                                                   1.0 / 40320,
                                                   1.0 / 362880,
                                                   1.0 / 3628800,
                                                   1.0 / 39916800,
                                                   1.0 / 479001600,
                                                   1.0 / 6227020800.0,
                                                   1.0 / 87178291200.0,
                                                   1.0 / 1307674368000.0,
                                                   1.0 / 20922789888000.0,
                                                   1.0 / 355687428096000.0};
};

/// The shared arithmetic of exp_nonpositive's and exp_bounded's own kernels (AVX-512's and
/// AVX2's double packets, with fused multiply-adds): n (as a double) and e^r in Horner form.
template <class Packet>
inline Packet exp_reduced_polynomial(const Packet& x, Packet& n, double lowest = -700.0) {
  using namespace Eigen::internal;
  const Packet r = exp_reduce(x, n, lowest);
  Packet p = pset1<Packet>(exp_taylor::inverse_factorial[13]);
  for (int k = 12; k >= 0; --k) p = pmadd(p, r, pset1<Packet>(exp_taylor::inverse_factorial[k]));
  return p;
}

/// e^x for x ∈ [lowest, highest] (clamped to it; lowest ≥ −708, highest ≤ 708) on the other
/// packets — SSE2 (baseline x86-64), NEON, or a scalar double: the same reduction and Taylor
/// coefficients, e^r written 1 + (r + r²·q) so that the last rounding dominates where pmadd is
/// not fused (SSE2: two roundings each; the full Horner form measured 1.13 ulp there, this one
/// 0.94), and 2^n by Eigen's pldexp (exact: every result is a normal double). Within 1 ulp
/// (tests/test_exp_kernels.cpp, test_tilt_kernels.cpp in a baseline build). Eigen 3.4's own pexp
/// is not used: 1.64 ulp on SSE2, and ~5.6e-309 in place of 0 below −709.8 (−inf included).
template <class Packet>
inline Packet exp_portable(const Packet& x, double lowest, double highest) {
  using namespace Eigen::internal;
  static_assert(std::is_same<typename unpacket_traits<Packet>::type, double>::value, "double packets only");
  Packet n;
  const Packet r = exp_reduce(pmin(x, pset1<Packet>(highest)), n, lowest);
  Packet q = pset1<Packet>(exp_taylor::inverse_factorial[13]);
  for (int k = 12; k >= 2; --k) q = pmadd(q, r, pset1<Packet>(exp_taylor::inverse_factorial[k]));
  const Packet e = padd(pset1<Packet>(1.0), padd(r, pmul(pmul(r, r), q)));
  return pldexp(e, n);
}

/// e^x for x ∈ [−700, 64] (inputs below are clamped to −700): x = n·ln 2 + r with |r| ≤ ln 2 / 2,
/// e^r by its Taylor polynomial of degree 13 (truncation below 1e-17 relative) in Horner form,
/// and 2^n built in the exponent bits; within about 1 ulp, a rational-free and division-free
/// path several times cheaper than Eigen 3.4's pexp. Packets other than AVX-512's and AVX2's
/// double packets take exp_portable (within 1 ulp as well): never Eigen 3.4's vectorised exp,
/// which returns ~5.6e-309, not e^{−700}, below −709.8 (−inf included).
template <class Packet>
inline Packet exp_nonpositive(const Packet& x) {
  return exp_portable(x, -700.0, 708.0);
}

#if defined(__AVX512F__)
/// p·2^n for an integral n (as a double) ∈ [−1022, 1023]: the biased exponent n + 1023 in the
/// exponent field.
inline __m512d times_power_of_two(const __m512d& p, const __m512d& n) {
  const __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n)),
                                                          _mm512_set1_epi64(1023)),
                                         52);
  return _mm512_mul_pd(p, _mm512_castsi512_pd(bits));
}
#endif
#if defined(__AVX2__)
inline __m256d times_power_of_two(const __m256d& p, const __m256d& n) {
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)),
                                                          _mm256_set1_epi64x(1023)),
                                         52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
}
#endif

/// e^x by exp_reduced_polynomial and 2^n in the exponent bits (x ≥ `lowest`, clamped; AVX-512's
/// and AVX2's double packets, where times_power_of_two is defined).
template <class Packet>
inline Packet exp_reduced_scaled(const Packet& x, double lowest) {
  Packet n;
  const Packet p = exp_reduced_polynomial(x, n, lowest);
  return times_power_of_two(p, n);  // n ∈ [−1010, 93]
}

#if defined(__AVX512F__)
inline __m512d exp_nonpositive(const __m512d& x) { return exp_reduced_scaled(x, -700.0); }
#endif
#if defined(__AVX2__) && (defined(__AVX512F__) || !defined(__FMA__))
// (AVX2 + FMA without AVX-512: the table kernel below, after exp_bounded's)
inline __m256d exp_nonpositive(const __m256d& x) { return exp_reduced_scaled(x, -700.0); }
#endif

/// e^x for x ∈ [−708, 708] (inputs outside are clamped to the nearest end; NaN is not an input):
/// the range the one-pass tilted reduction needs, where every result is a normal double. With
/// AVX-512: x = (n/16)·ln 2 + r with |r| ≤ ln 2 / 32, e^x = 2^{⌊n/16⌋} · 2^{(n mod 16)/16} · e^r
/// with the sixteen 2^{j/16} (correctly rounded) held in two registers and picked by one
/// permutation, and e^r by its Taylor polynomial of degree 7 (truncation below 1.3e-18 relative), added to the
/// table entry with one rounding: within 1.5 ulp of the exact value (1.01 measured) (tests/test_exp_kernels.cpp), about half the multiply-adds of
/// exp_nonpositive's degree 13. AVX2 + FMA: a two-entry table and a fitted polynomial of degree 10
/// (the kernel below; 0.86 ulp measured); AVX2 without FMA: the degree-13 polynomial; other
/// packets: exp_portable (SSE2, NEON: within 1 ulp, 0.94 measured on SSE2).
template <class Packet>
inline Packet exp_bounded(const Packet& x) {
  return exp_portable(x, -708.0, 708.0);
}

#if defined(__AVX512F__)
/// exp_bounded's AVX-512 kernel without the clamp (exp_in_range below).
TROLL_PACKET_INLINE __m512d exp_in_range(const __m512d& clamped) {
  // n = round(x·16/ln 2), |n| ≤ 16,342, by the shifter 1.5·2^52: the sum's low mantissa bits
  // hold n in two's complement, and subtracting the shifter again gives n as a double, exactly.
  const __m512d shifter = _mm512_set1_pd(6755399441055744.0);
  const __m512d shifted = _mm512_fmadd_pd(clamped, _mm512_set1_pd(23.083120654223414), shifter);
  const __m512d n = _mm512_sub_pd(shifted, shifter);
  const __m512i ni = _mm512_castpd_si512(shifted);
  // r = x − n·(ln 2/16) in two parts: the first has 15 significant bits, so n times it is exact.
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(0.693145751953125 / 16), clamped);
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.42860682030941723212e-6 / 16), r);
  // e^r − 1, Taylor to degree 7 in Horner form
  __m512d p = _mm512_set1_pd(1.0 / 5040);
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 720));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 120));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 24));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 6));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(0.5));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
  const __m512d expm1_r = _mm512_mul_pd(p, r);
  const __m512d lo = _mm512_setr_pd(0x1.0000000000000p+0, 0x1.0b5586cf9890fp+0, 0x1.172b83c7d517bp+0,
                                    0x1.2387a6e756238p+0, 0x1.306fe0a31b715p+0, 0x1.3dea64c123422p+0,
                                    0x1.4bfdad5362a27p+0, 0x1.5ab07dd485429p+0);
  const __m512d hi = _mm512_setr_pd(0x1.6a09e667f3bcdp+0, 0x1.7a11473eb0187p+0, 0x1.8ace5422aa0dbp+0,
                                    0x1.9c49182a3f090p+0, 0x1.ae89f995ad3adp+0, 0x1.c199bdd85529cp+0,
                                    0x1.d5818dcfba487p+0, 0x1.ea4afa2a490dap+0);
  // j = n mod 16, the low four bits, picks 2^{j/16} (permutex2var reads bits 0..3 of each index)
  const __m512d table = _mm512_permutex2var_pd(lo, ni, hi);
  // 2^{⌊n/16⌋}: the low 16 bits plus 1023·16 are (⌊n/16⌋ + 1023)·16 + j ∈ [26, 32710]; shifted to
  // the top and with j's four bits cleared, the biased exponent ⌊n/16⌋ + 1023 ∈ [1, 2044]
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi64(_mm512_add_epi64(ni, _mm512_set1_epi64(16368)), 48),
                                        _mm512_set1_epi64(-4503599627370496LL)  /* −2^52: bits 52..63 */);
  // 2^{j/16}·e^r = 2^{j/16} + 2^{j/16}·(e^r − 1) with one rounding; the power of 2 is exact
  return _mm512_mul_pd(_mm512_fmadd_pd(table, expm1_r, table), _mm512_castsi512_pd(bits));
}

TROLL_PACKET_INLINE __m512d exp_bounded(const __m512d& x) {
  return exp_in_range(_mm512_min_pd(_mm512_max_pd(x, _mm512_set1_pd(-708.0)), _mm512_set1_pd(708.0)));
}
#elif defined(__AVX2__) && defined(__FMA__)
/// exp_bounded's AVX2 kernel without the clamp (exp_in_range below). AVX2 has no two-register
/// permute, so the table is the two entries 2^{j/2}, j = n mod 2, picked by one blend: x =
/// (n/2)·ln 2 + r with |r| ≤ ln 2 / 4, e^x = 2^{⌊n/2⌋}·2^{j/2}·e^r. n comes from the shifter
/// 1.5·2^52 + 2046, whose sum's low bits then hold n + 2046 = 2(⌊n/2⌋ + 1023) + j: one logical
/// shift gives the biased exponent, another j. e^r − 1 = r·P(r) with P of degree 9 fitted to
/// (e^r − 1)/r on |r| ≤ 1.0001·ln 2 / 4 (Chebyshev nodes in 60 digits, then rounded; the fit's own
/// relative error 4e-19), and 2^{⌊n/2⌋}·2^{j/2} — the exponent field, or'ed with the mantissa
/// of √2 where j = 1, exact — times e^r with one rounding: (s·(e^r − 1)) + s in one fused
/// multiply-add. 14 operations on the multiply-add pipes where the degree-13 Taylor kernel (with
/// floor, unfused products and double → int → int64 conversions) took 17: the passes that call
/// it are bound there on AVX2 cores. Within 1.5 ulp, 0.86 measured (tests/test_exp_kernels.cpp;
/// the Taylor kernel measured 0.87).
TROLL_PACKET_INLINE __m256d exp_in_range(const __m256d& x) {
  const __m256d shifter = _mm256_set1_pd(6755399441055744.0 + 2046.0);
  const __m256d shifted = _mm256_fmadd_pd(x, _mm256_set1_pd(2.8853900817779268), shifter);  // 2/ln 2
  const __m256d n = _mm256_sub_pd(shifted, shifter);
  // r = x − n·(ln 2)/2 in two parts: the first has 16 significant bits, so n times it is exact
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0.693145751953125 / 2), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.42860682030941723212e-6 / 2), r);
  __m256d p = _mm256_set1_pd(2.7572998907936827e-07);
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(2.757613568572883e-06));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(2.480158318060961e-05));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.00019841264895805152));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.0013888888889330945));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.008333333333863834));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.0416666666666665));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.1666666666666647));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  // ⌊n/2⌋ + 1023 ∈ [1, 2044] for x ∈ [−708, 708]: bits 1..12 of `shifted`, moved to the
  // exponent field (higher bits fall off); j (bit 0) moved to the sign bit steers the blends
  const __m256i bits = _mm256_castpd_si256(shifted);
  const __m256i power = _mm256_slli_epi64(_mm256_srli_epi64(bits, 1), 52);
  const __m256d odd = _mm256_castsi256_pd(_mm256_slli_epi64(bits, 63));
  const __m256d zero = _mm256_setzero_pd();
  const __m256d root2_mantissa = _mm256_castsi256_pd(_mm256_set1_epi64x(0x0006a09e667f3bcdLL));
  const __m256d scale = _mm256_or_pd(_mm256_castsi256_pd(power), _mm256_blendv_pd(zero, root2_mantissa, odd));
  // √2 rounded to a double is off by a relative −6.8e-17 (0.44 ulp): that correction joins
  // e^r − 1 in the multiply-add that forms r·P(r), so no operation is added for it (1.26 ulp
  // measured without it)
  const __m256d root2_error = _mm256_blendv_pd(zero, _mm256_set1_pd(-6.835808657661922e-17), odd);
  const __m256d expm1_r = _mm256_fmadd_pd(p, r, root2_error);
  return _mm256_fmadd_pd(scale, expm1_r, scale);
}

TROLL_PACKET_INLINE __m256d exp_bounded(const __m256d& x) {
  return exp_in_range(_mm256_min_pd(_mm256_max_pd(x, _mm256_set1_pd(-708.0)), _mm256_set1_pd(708.0)));
}

/// exp_nonpositive on AVX2 + FMA: the kernel above on max(x, −700).
TROLL_PACKET_INLINE __m256d exp_nonpositive(const __m256d& x) { return exp_in_range(_mm256_max_pd(x, _mm256_set1_pd(-700.0))); }
#elif defined(__AVX2__)
TROLL_PACKET_INLINE __m256d exp_bounded(const __m256d& x) {
  return exp_reduced_scaled(_mm256_min_pd(x, _mm256_set1_pd(708.0)), -708.0);
}
#endif

/// exp_bounded without its clamp, for callers whose x is known to lie in [−708, 708] or that
/// discard the result otherwise (a reduction that checks its w afterwards, a pass whose `fine`
/// flag rejects the row): the same bits in range, unspecified values (never a trap with the
/// default floating-point environment) outside it. Two vector operations fewer per packet on
/// AVX-512 (the overload above); exp_bounded itself on other packets.
template <class Packet>
TROLL_PACKET_INLINE Packet exp_in_range(const Packet& x) {
  return exp_bounded(x);
}

/// expm1(x) for |x| ≤ 1/2 on one packet: x·Σ_{k=0}^{16} x^k/(k+1)! in Horner form (the terms of
/// expm1_near_zero, 17 operations instead of 32; within 1.46 ulp of expm1l over 2·10^6 points,
/// as the nested form).
template <class Packet>
inline Packet expm1_near_zero_packet(const Packet& x) {
  using namespace Eigen::internal;
  Packet p = pset1<Packet>(exp_taylor::inverse_factorial[17]);
#if defined(__GNUC__) && !defined(__CUDACC__)  // nvcc's front end does not know the pragma
#pragma GCC unroll 16
#endif
  for (int k = 16; k >= 1; --k) p = pmadd(p, x, pset1<Packet>(exp_taylor::inverse_factorial[k]));
  return pmul(x, p);
}

/// Whether any lane of a comparison mask (every lane all ones or all zeros) is set. Eigen 3.4's
/// predux_any takes a horizontal add on AVX-512 double packets (about eight operations, a third
/// of a packet's work in the per-packet tests below); this is one test into a mask register
/// there, a movemask on AVX, and predux_any elsewhere.
template <class Packet>
inline bool any_lane(const Packet& mask) {
#if defined(__AVX512F__)
  if constexpr (sizeof(Packet) == 64) {
    const __m512i bits = _mm512_castpd_si512(mask);
    return _mm512_test_epi64_mask(bits, bits) != 0;
  }
#endif
#if defined(__AVX__)
  if constexpr (sizeof(Packet) == 32) return _mm256_movemask_pd(mask) != 0;
#endif
  return Eigen::internal::predux_any(mask);
}

/// e^x of one packet: exp_in_range where every lane lies in [−708, 708], else std::exp lane by
/// lane (subnormal results, 0, +inf: what exact_exp gives).
template <class Packet>
inline Packet exp_any(const Packet& x) {
  using namespace Eigen::internal;
  constexpr int lanes = int(sizeof(Packet) / sizeof(double));
  if (!any_lane(por(pcmp_lt(x, pset1<Packet>(-708.0)), pcmp_lt(pset1<Packet>(708.0), x))))
    return exp_in_range(x);
  double v[std::size_t(lanes)];
  pstoreu(v, x);
  for (int j = 0; j < lanes; ++j) v[j] = std::exp(v[j]);
  return ploadu<Packet>(v);
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
