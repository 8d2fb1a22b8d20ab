// troll/detail/cpu/finite_rows.hpp — fused SIMD passes (Eigen's packet primitives: AVX-512, AVX2,
// SSE or NEON as compiled, scalar otherwise) for the common row pair: every logit finite and a
// logit spread of at most 700, so no exponent falls below −700 (where Eigen's vectorised exp is
// wrong) and no difference can overflow. The scan that recognises such a pair and the tilted
// reduction (tilt_family.hpp, lse_state.hpp) in two passes per block: x, w and their maximum, then
// the exponentials and the three weighted sums together. Rows of a few dozen entries (the lumped
// sparse rows) pay no per-expression setup.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <limits>
#include <type_traits>

#include "../../config.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../tilt_family.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// e^x for x ∈ [−700, 64] (inputs below are clamped to −700): x = n·ln 2 + r with |r| ≤ ln 2 / 2,
/// e^r by its Taylor polynomial of degree 13 (truncation below 1e-17 relative) in Horner form,
/// and 2^n built in the exponent bits; within about 1 ulp, a rational-free and division-free
/// path several times cheaper than Eigen 3.4's pexp. Packets other than AVX-512's and AVX2's
/// double packets use Eigen's pexp.
template <class Packet>
inline Packet exp_nonpositive(const Packet& x) {
  return Eigen::internal::pexp(x);
}

/// The shared arithmetic of exp_nonpositive: n (as a double) and the polynomial of r.
template <class Packet>
inline Packet exp_reduced_polynomial(const Packet& x, Packet& n) {
  using namespace Eigen::internal;
  const Packet clamped = pmax(x, pset1<Packet>(-700.0));
  n = pfloor(pmadd(clamped, pset1<Packet>(1.4426950408889634), pset1<Packet>(0.5)));
  // r = x − n·ln 2 in two parts (the first exact for |n| < 2^11).
  Packet r = psub(clamped, pmul(n, pset1<Packet>(0.693145751953125)));
  r = psub(r, pmul(n, pset1<Packet>(1.42860682030941723212e-6)));
  static constexpr double inverse_factorial[14] = {1.0,
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
                                                   1.0 / 6227020800.0};
  Packet p = pset1<Packet>(inverse_factorial[13]);
  for (int k = 12; k >= 0; --k) p = pmadd(p, r, pset1<Packet>(inverse_factorial[k]));
  return p;
}

#if defined(__AVX512F__)
inline __m512d exp_nonpositive(const __m512d& x) {
  __m512d n;
  const __m512d p = exp_reduced_polynomial(x, n);
  // 2^n for n ∈ [−1010, 93]: the biased exponent n + 1023 in the exponent field.
  const __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n)),
                                                          _mm512_set1_epi64(1023)),
                                         52);
  return _mm512_mul_pd(p, _mm512_castsi512_pd(bits));
}
#endif
#if defined(__AVX2__)
inline __m256d exp_nonpositive(const __m256d& x) {
  __m256d n;
  const __m256d p = exp_reduced_polynomial(x, n);
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)),
                                                          _mm256_set1_epi64x(1023)),
                                         52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
}
#endif

/// Largest and smallest entries of a pair of double rows.
struct pair_extremes {
  double max_new, max_old, min_new, min_old;
};

/// One packet pass over zn, zo[0..count) in T's own packets (float rows 16 lanes wide with
/// AVX-512): false when some entry is NaN or ±inf (x − x is then NaN, and so is the sum of those
/// differences), else true with the extremes of each row (exact: max and min round nothing).
template <class T>
inline bool finite_extremes(const T* zn, const T* zo, long count, pair_extremes& e) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  const long whole = count - count % lanes;
  packet hi_n = pset1<packet>(-std::numeric_limits<T>::infinity()), hi_o = hi_n;
  packet lo_n = pset1<packet>(std::numeric_limits<T>::infinity()), lo_o = lo_n;
  packet bad = pset1<packet>(T(0));
  for (long k = 0; k < whole; k += lanes) {
    const packet a = ploadu<packet>(zn + k), b = ploadu<packet>(zo + k);
    bad = padd(bad, padd(psub(a, a), psub(b, b)));
    hi_n = pmax(hi_n, a);
    hi_o = pmax(hi_o, b);
    lo_n = pmin(lo_n, a);
    lo_o = pmin(lo_o, b);
  }
  T odd = predux(bad);
  T most_n = predux_max(hi_n), most_o = predux_max(hi_o), least_n = predux_min(lo_n), least_o = predux_min(lo_o);
  for (long k = whole; k < count; ++k) {
    odd += (zn[k] - zn[k]) + (zo[k] - zo[k]);
    most_n = zn[k] > most_n ? zn[k] : most_n;
    most_o = zo[k] > most_o ? zo[k] : most_o;
    least_n = zn[k] < least_n ? zn[k] : least_n;
    least_o = zo[k] < least_o ? zo[k] : least_o;
  }
  e = pair_extremes{double(most_n), double(most_o), double(least_n), double(least_o)};
  return odd == T(0);
}

/// The first k < count with z[k] == value, packet by packet (value must occur in z).
template <class T>
inline long first_index_of(const T* z, long count, T value) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  const long whole = count - count % lanes;
  const packet target = pset1<packet>(value);
  long k = 0;
  while (k < whole && !predux_any(pcmp_eq(ploadu<packet>(z + k), target))) k += lanes;
  while (z[k] != value) ++k;
  return k;
}

/// Lane by lane: where value > most, most ← value and most_at ← at (ties keep the earlier one).
template <class Packet>
inline void keep_first_max(const Packet& value, const Packet& at, Packet& most, Packet& most_at) {
  using namespace Eigen::internal;
  const Packet above = pcmp_lt(most, value);
  most = pselect(above, value, most);
  most_at = pselect(above, at, most_at);
}
inline void keep_first_max(double value, double at, double& most, double& most_at) {
  if (most < value) most = value, most_at = at;
}

/// tilt_reduce_finite in two passes: x, w and their maximum m, then e^{w − m} and the sums.
inline lse_state tilt_reduce_two_pass(const double* zn, const double* zo, long count, const tilt_param& u,
                                      const tilt_ref& ref, double* x, double* w) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  const long whole = count - count % lanes;
  // w = (z° − z°_r) + t·x for t ≤ 1/2, (z̃ − z̃_r) − s·x above: the same two writings as
  // tilt_family.hpp's tilt_weight.
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  // Each lane keeps its largest w and the first token that has it (the token ids as doubles).
  packet most = pset1<packet>(neg_inf()), most_at = pset1<packet>(0.0), token = plset<packet>(0.0);
  const packet step = pset1<packet>(double(lanes));
  for (long k = 0; k < whole; k += lanes) {
    const packet dn = psub(ploadu<packet>(zn + k), rn);
    const packet dold = psub(ploadu<packet>(zo + k), ro);
    const packet xk = psub(dn, dold);
    const packet wk = padd(low ? dold : dn, pmul(ps, xk));
    pstoreu(x + k, xk);
    pstoreu(w + k, wk);
    keep_first_max(wk, token, most, most_at);
    token = padd(token, step);
  }
  double lane_most[lanes], lane_at[lanes];
  pstoreu(lane_most, most);
  pstoreu(lane_at, most_at);
  double m = neg_inf();
  long at = 0;
  for (long j = 0; j < lanes; ++j) {  // the largest w, and the first token of it
    if (lane_most[j] > m || (lane_most[j] == m && long(lane_at[j]) < at)) m = lane_most[j], at = long(lane_at[j]);
  }
  for (long k = whole; k < count; ++k) {
    const double dn = zn[k] - ref.zn, dold = zo[k] - ref.zo;
    x[k] = dn - dold;
    w[k] = (low ? dold : dn) + slope * x[k];
    if (w[k] > m) m = w[k], at = k;
  }
  lse_state st;
  if (count == 0) return st;
  // The last partial packet is padded with w = −inf, x = 0: its weights come out ≤ 1e-304, which
  // leave s0 ≥ 1 unchanged, and multiply x = 0 in s1 and s2.
  const long padded = whole == count ? count : whole + lanes;
  for (long k = count; k < padded; ++k) x[k] = 0.0, w[k] = neg_inf();
  const packet pm = pset1<packet>(m);
  packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0;
  for (long k = 0; k < padded; k += lanes) {
    const packet e = exp_nonpositive(psub(ploadu<packet>(w + k), pm));
    const packet xk = ploadu<packet>(x + k);
    const packet ex = pmul(e, xk);
    s0 = padd(s0, e);
    s1 = padd(s1, ex);
    s2 = padd(s2, pmul(ex, xk));  // (e·x)·x, as tilt_evaluator
  }
  st.m = m;
  st.s0 = predux(s0);
  st.s1 = predux(s1);
  st.s2 = predux(s2);
  st.ref_new = zn[at];
  st.ref_old = zo[at];
  return st;
}

/// The lse_state of the pairs (w_i, x_i), i < count, of the finite logits zn, zo at (u, ref), with
/// the (z̃, z°) of the first token of largest w as its reference. `x` and `w` are scratch of
/// `count` doubles rounded up to a whole packet (block_size holds any block). Precondition: every
/// logit finite and max − min over both rows ≤ 700.
///
/// One pass where it can: w is written relative to the reference, whose own w is 0, so the
/// weights e^{w} need not wait for the maximum m. They are taken as they come (e^w within 1 ulp
/// for w up to 32 as below 0; a weight below e^{−700} becomes e^{−700}, nothing beside the
/// reference's 1 or a block maximum above e^{−64}), the maximum and its first token found in the
/// same pass, and the sums rescaled by e^{−m} once at the end. A block whose maximum falls
/// outside [−64, 32] (the reference far from the mode, or outside the block) takes the two
/// passes of tilt_reduce_two_pass instead. The sums are those of the two-pass reduction up to
/// rounding (as for a different summation order).
inline lse_state tilt_reduce_finite(const double* zn, const double* zo, long count, const tilt_param& u,
                                    const tilt_ref& ref, double* x, double* w) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  if (count == 0) return lse_state{};
  const long whole = count - count % lanes;
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  packet most = pset1<packet>(neg_inf()), most_at = pset1<packet>(0.0), token = plset<packet>(0.0);
  packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0;
  const packet step = pset1<packet>(double(lanes));
  // One packet of pairs: x, w, the running maximum, the weight and the three sums.
  auto add = [&](const packet& a, const packet& b, const packet& valid, auto masked) {
    const packet dn = psub(a, rn), dold = psub(b, ro);
    const packet xk = psub(dn, dold);  // 0 in the padding (the reference's own logits)
    packet wk = padd(low ? dold : dn, pmul(ps, xk));
    if (decltype(masked)::value) wk = pselect(valid, wk, pset1<packet>(neg_inf()));
    keep_first_max(wk, token, most, most_at);
    token = padd(token, step);
    const packet e = exp_nonpositive(wk);  // padding: w = −inf gives e^{−700} ≤ 1e-304, x = 0
    const packet ex = pmul(e, xk);
    s0 = padd(s0, e);
    s1 = padd(s1, ex);
    s2 = padd(s2, pmul(ex, xk));  // (e·x)·x, as tilt_evaluator
  };
  for (long k = 0; k < whole; k += lanes) add(ploadu<packet>(zn + k), ploadu<packet>(zo + k), step, std::false_type{});
  if (whole < count) {  // the last partial packet, padded with the reference's own logits
    double an[lanes], bo[lanes], valid[lanes];
    for (long j = 0; j < lanes; ++j) {
      const bool in = whole + j < count;
      an[j] = in ? zn[whole + j] : ref.zn;
      bo[j] = in ? zo[whole + j] : ref.zo;
      valid[j] = in ? 1.0 : 0.0;
    }
    add(ploadu<packet>(an), ploadu<packet>(bo), pcmp_eq(ploadu<packet>(valid), pset1<packet>(1.0)), std::true_type{});
  }
  double lane_most[lanes], lane_at[lanes];
  pstoreu(lane_most, most);
  pstoreu(lane_at, most_at);
  double m = neg_inf();
  long at = 0;
  for (long j = 0; j < lanes; ++j) {  // the largest w, and the first token of it
    if (lane_most[j] > m || (lane_most[j] == m && long(lane_at[j]) < at)) m = lane_most[j], at = long(lane_at[j]);
  }
  if (!(m >= -64.0 && m <= 32.0)) return tilt_reduce_two_pass(zn, zo, count, u, ref, x, w);
  lse_state st;
  st.m = m;
  st.s0 = predux(s0);
  st.s1 = predux(s1);
  st.s2 = predux(s2);
  if (m != 0.0) {
    const double scale = std::exp(-m);
    st.s0 *= scale;
    st.s1 *= scale;
    st.s2 *= scale;
  }
  st.ref_new = zn[at];
  st.ref_old = zo[at];
  return st;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
