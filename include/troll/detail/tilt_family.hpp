// troll/detail/tilt_family.hpp — one member π_t of the tilted family, per token and summarised,
// written once for host and device (math.md §2). With d_i = z̃_i − z°_i and a reference token r
// of the joint support J (the mode of the previous evaluation), c = d_r:
//     log π_t,i = w_i − log_norm,   x_i = d_i − c,
//     w_i = (z°_i − z°_r) + t·x_i          for t ≤ 1/2,
//     w_i = (z̃_i − z̃_r) − s·x_i            for t > 1/2,   s = 1 − t,
// two writings of one value, each free of cancellation where it is used: w_r = 0, so the terms
// stay the size of the row's logit differences around its mode, and the pair (t, s) is carried
// with whichever half is small held exactly. So a t within a rounding of 1, or a token that one
// row masks with a huge finite negative (−1e9, lowest()), is still resolved
// (docs/math.md, "Hard rows").
#pragma once

#include <cmath>

#include "../config.hpp"
#include "lse_state.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// A point of the family: the weight t of the new logits and s = 1 − t. Build with tilt_at(t)
/// when t ≤ 1/2 (t is exact) and tilt_near_one(s) when s ≤ 1/2 (s is exact).
struct tilt_param {
  double t = 0.0;
  double s = 1.0;
};
TROLL_HOST_DEVICE inline tilt_param tilt_at(double t) { return tilt_param{t, 1.0 - t}; }
TROLL_HOST_DEVICE inline tilt_param tilt_near_one(double s) { return tilt_param{1.0 - s, s}; }

/// The reference token of an evaluation: its new and old logits (both finite).
struct tilt_ref {
  double zn = 0.0;
  double zo = 0.0;
  TROLL_HOST_DEVICE double d() const { return zn - zo; }
};

/// Differences are clamped to ±DBL_MAX: a pair of finite logits of opposite extremes
/// (|z̃ − z°| > DBL_MAX) must not become ±inf, whose product with a zero weight is NaN. Any
/// finite difference passes unchanged.
TROLL_HOST_DEVICE constexpr double max_difference() { return 1.7976931348623157e308; }
TROLL_HOST_DEVICE inline double clamp_difference(double x) {
  return minimum(maximum(x, -max_difference()), max_difference());
}

/// x_i = d_i − d_r of one token on J, formed as (z̃_i − z̃_r) − (z°_i − z°_r): two differences of
/// logits of one row, which round only at the size of the row's spread (z̃_i − z°_i could be
/// ~1e3 on rows shifted by a constant and round at that size).
TROLL_HOST_DEVICE inline double tilt_centred(double zn, double zo, const tilt_ref& ref) {
  return clamp_difference(clamp_difference(zn - ref.zn) - clamp_difference(zo - ref.zo));
}

/// w_i of one token on J at u, from its x (see the header comment).
TROLL_HOST_DEVICE inline double tilt_weight(double zn, double zo, double x, const tilt_ref& ref,
                                            const tilt_param& u) {
  return u.t <= 0.5 ? clamp_difference(zo - ref.zo) + u.t * x : clamp_difference(zn - ref.zn) - u.s * x;
}

/// One evaluated member, summarised.
struct tilt_point {
  double t = 0.0;
  double s = 1.0;
  tilt_ref ref;           // the reference this evaluation was written relative to
  tilt_ref mode;          // the token of largest w: the reference for an evaluation nearby
  double log_norm = 0.0;  // log Σ_J exp(w_i)
  double a_c = 0.0;       // log Σ_J q_i exp(t x_i) = log_norm + (z°_r − M°) − old_log_sum
  double mu = 0.0;        // E_πt[d] (absolute)
  double sigma2 = 0.0;    // Var_πt[d]
  double mean_x = 0.0;    // E_πt[x] (x relative to ref)
  double kappa3 = 0.0;    // third cumulant of d under π_t (NaN where the reduction did not form it)
  double kappa4 = 0.0;    // fourth cumulant of d under π_t (likewise)
  double kl = 0.0;        // KL(π_t ‖ q)
  double kl_error = 0.0;  // a bound on the rounding error of `kl` as make_point computes it, for
                          // sums that round like a random walk (the statistics' accuracy)
  double sum_error = 0.0;  // what the sums' own rounding can add to that in the worst case (a long
                           // row of equal terms): the solver's decisions read kl_error + sum_error
  double a_error = 0.0;   // a bound on the rounding error of `a_c` (refine_a_c)
  double old_max = 0.0;      // M° = max z° the point was made with
  double old_log_sum = 0.0;  // log Σ_i exp(z°_i − M°), or over J alone where joint_old
  bool joint_old = false;    // q is q_J, the old row restricted to J and renormalised: old-only
                             // tokens carry no mass and `kl` is KL(π_t ‖ q_J) (solve_above_floor)
};

/// Turns a reduction at (u, ref) into a tilt_point. log q_i = z°_i − M° − old_log_sum, and
/// KL(π_t‖q) = Σ π_i (t x_i − a_c) = t·E[x] − a_c.
///
/// That difference cancels when KL is small against the log-sums it is formed from (tiny ε,
/// rows with a large log V), so `kl_error` bounds its rounding error: 16 ulps of every term that
/// enters (the two logarithms carry an ulp of their arguments, which are ≥ 1, hence the 4), and
/// of t·E[x] (its weights' exponents are within a few units of 0 where they carry mass).
/// `sum_error` adds the sums' own worst-case rounding: st.depth ulps of s0 (so of log s0,
/// absolutely), as much of the old log-sum (a sum over the same row by the same kind of
/// reduction) and of E[x] = s1/s0 (|s1| ≤ s0·spread term by term). It matters on long rows whose
/// terms are alike: 150k equal logits round every addition the same way, and the closed form was
/// 4.5e-14 off (KL 2.9e-5 relative at ε = 1e-9, V = 151,936) while kl_error allowed 1.6e-14, so
/// the solver stopped on a wrong KL. Where the bound is too coarse the caller asks the evaluator
/// for the cancellation-free sum (kl_term below), whose terms are non-negative.
TROLL_HOST_DEVICE inline tilt_point make_point(const lse_state& st, const tilt_param& u, const tilt_ref& ref,
                                               double old_max, double old_log_sum, bool joint_old = false) {
  constexpr double ulp = 2.220446049250313e-16;
  tilt_point p;
  p.t = u.t;
  p.s = u.s;
  p.ref = ref;
  p.mode = tilt_ref{st.ref_new, st.ref_old};
  p.old_max = old_max;
  p.old_log_sum = old_log_sum;
  p.joint_old = joint_old;
  const double log_s0 = ::log(st.s0);
  p.log_norm = st.m + log_s0;
  const double mu_c = st.mean();
  // NaN where Σ e^w·x overflowed (|x| near DBL_MAX on several tokens: its mean, though finite,
  // came out ±inf, and then even of the wrong sign once ref.d() is added); σ² is +inf there too.
  p.mu = mu_c - mu_c == 0.0 ? mu_c + ref.d() : quiet_nan();
  p.sigma2 = st.variance();
  p.mean_x = mu_c;
  p.kappa3 = st.third_cumulant();
  p.kappa4 = st.fourth_cumulant();
  const double ref_offset = ref.zo - old_max;
  p.a_c = p.log_norm + ref_offset - old_log_sum;
  p.kl = u.t * mu_c - p.a_c;
  const double spread = st.s2 > 0.0 ? ::sqrt(st.s2 / st.s0) : 0.0;
  const double summed = st.depth * ulp;  // the relative rounding of the reduction's sums
  p.a_error = 16.0 * ulp * (4.0 + ::fabs(st.m) + ::fabs(log_s0) + ::fabs(ref_offset) + ::fabs(old_log_sum)) +
              2.0 * summed;
  p.kl_error = p.a_error - 2.0 * summed + 16.0 * ulp * u.t * spread * (4.0 + ::fabs(st.m));
  p.sum_error = 2.0 * summed * (1.0 + u.t * spread);
  return p;
}

/// The member at u predicted from the evaluated member p by the cumulant series of the family,
/// instead of another pass over the row; true only where the prediction is provably converged.
///
/// Along the path, w_i moves by h·x_i from p to u (h = t_u − t_p, in either writing), so with
/// K(h) = log E_πp[e^{h x}] = h μ + h²σ²/2 + h³κ3/6 + h⁴κ4/24 + R5 (the cumulants of x at p):
///     log_norm_u = log_norm_p + K(h),   E_u[x] = K'(h),   Var_u = K''(h),
///     KL_u − KL_p = t_u (K'(h) − μ) − (K(h) − h μ).
/// Every remainder is bounded through the fifth cumulant along [t_p, t_u]: x lies in an interval
/// of length L (x_range), so the central moments satisfy |m_k| ≤ L^{k−2}σ² and σ² ≤ L²/4, hence
/// |κ5| = |m5 − 10 m3 σ²| ≤ 3.5 L³σ²; the variance at any τ between is at most e^{|h|L} ≤ 2
/// times σ² (|h|L ≤ 1/2): |κ5| ≤ 7L³σ² =: B. Then K within |h|⁵B/120, E_u[x] within h⁴B/24,
/// Var_u within |h|³B/6. κ3 and κ4, formed from raw moments about the reference (|x| ≤ L on J),
/// carry a rounding of at most 1e-14·L³ and 1e-13·L⁴. The prediction is taken only where
/// |KL_u − ε| plus every bound (and p's own kl_error) is within tol, and where log_norm, μ and σ²
/// are as exact as an evaluation makes them (an ulp of log_norm, a few of E[x], E[x²]);
/// otherwise the caller evaluates the member.
TROLL_HOST_DEVICE inline bool predict_member(const tilt_point& p, const tilt_param& u, double x_range, double eps,
                                             double tol, tilt_point& out) {
  constexpr double ulp = 2.220446049250313e-16;
  const double v = p.sigma2, k3 = p.kappa3, k4 = p.kappa4, L = x_range;
  if (!(L < inf() && v > 0.0 && v < inf() && k3 - k3 == 0.0 && k4 - k4 == 0.0)) return false;
  // h = t_u − t_p on whichever of t and s is exact at both (as bracket_search measures steps)
  const double h = u.t <= 0.5 && p.t <= 0.5 ? u.t - p.t : p.s - u.s;
  const double ah = ::fabs(h);
  if (!(ah * L <= 0.5)) return false;
  const double b5 = 7.0 * L * L * L * v, e3 = 1e-14 * L * L * L, e4 = 1e-13 * L * L * L * L;
  const double h2 = h * h, ah3 = ah * h2, h4 = h2 * h2;
  const double mu = p.mean_x;
  // K(h) − hμ and K'(h) − μ to fourth order, with their bounds
  const double dk = h2 * (0.5 * v + h * (k3 / 6.0 + h * (k4 / 24.0)));
  const double dk_error = ah * h4 * b5 / 120.0 + ah3 * e3 / 6.0 + h4 * e4 / 24.0;
  const double dmu = h * (v + h * (0.5 * k3 + h * (k4 / 6.0)));
  const double mu_error = h4 * b5 / 24.0 + 0.5 * h2 * e3 + ah3 * e4 / 6.0;
  const double v_u = v + h * (k3 + 0.5 * h * k4);
  const double v_error = ah3 * b5 / 6.0 + ah * e3 + 0.5 * h2 * e4;
  const double dkl = u.t * dmu - dk;
  const double kl_u = p.kl + dkl;
  const double kl_error =
      u.t * mu_error + dk_error + p.kl_error + p.sum_error + 4.0 * ulp * (::fabs(p.kl) + ::fabs(dkl));
  if (!(::fabs(kl_u - eps) + kl_error <= tol)) return false;
  const double log_norm_u = p.log_norm + (h * mu + dk);
  const double mu_u = mu + dmu;
  // as exact as an evaluation: log_norm to an ulp of its size, E[x] and Var to a few ulps
  if (!(dk_error <= ulp * (1.0 + ::fabs(log_norm_u)) && mu_error <= 4.0 * ulp * (::fabs(mu_u) + ::sqrt(v)) &&
        v_error <= 8.0 * ulp * (v + mu * mu) && v_u > 0.0))
    return false;
  out = p;
  out.t = u.t;
  out.s = u.s;
  out.log_norm = log_norm_u;
  out.a_c = p.a_c + (h * mu + dk);
  out.mean_x = mu_u;
  out.mu = mu_u + p.ref.d();
  out.sigma2 = v_u;
  out.kappa3 = quiet_nan();  // not known to the precision a further prediction would need
  out.kappa4 = quiet_nan();
  out.kl = kl_u;
  out.kl_error = kl_error;
  out.sum_error = 0.0;  // in kl_error
  return true;
}

/// The coefficients of φ(σ)/σ² = Σ_{n≥2} c_n σ^{n−2}, c_n = (n−1)/n! (n = 2..21; the tail is
/// below 1e-18 relative for |σ| < 1), in Horner order: kl_series_coefficient(k) is c_{21−k}, k =
/// 0..kl_series_terms − 1. Shared by kl_term_value and the CPU's packet sum (exact_kl_finite).
constexpr int kl_series_terms = 20;
TROLL_HOST_DEVICE inline double kl_series_coefficient(int k) {
  constexpr double c[kl_series_terms] = {
      3.9145882126782523e-19, 7.809603484293113e-18, 1.4797143443923793e-16,
      2.6552651846596585e-15, 4.498331606952833e-14, 7.169215998581078e-13,
      1.0706029224547743e-11, 1.4911969277048643e-10, 1.9270852604185937e-09,
      2.296443268665491e-08, 2.505210838544172e-07, 2.48015873015873e-06,
      2.2045855379188714e-05, 0.00017361111111111112, 0.0011904761904761906,
      0.006944444444444444, 0.03333333333333333, 0.125,
      0.3333333333333333, 0.5};
  return c[k];
}

/// q·φ(σ) with φ(σ) = σ e^σ − e^σ + 1 = Σ_{n≥2} (n−1) σ^n / n!, the non-negative per-token term
/// of KL(π‖q) = Σ_i q_i φ(log π_i/q_i) (valid because Σπ = Σq = 1). For |σ| < 1 the series
/// (kl_series_coefficient), else π(σ − 1) + q, which cannot cancel by more than a factor of four there;
/// formed from log π where π is near the subnormals (a token the old row masks with a finite
/// value near −DBL_MAX) and σ·π is not.
TROLL_HOST_DEVICE inline double kl_term_value(double sigma, double log_pi, double q) {
  if (::fabs(sigma) < 1.0) {
    const double x = sigma;
    double acc = kl_series_coefficient(0);
    for (int k = 1; k < kl_series_terms; ++k) acc = acc * x + kl_series_coefficient(k);
    return q * (x * x) * acc;
  }
  const double pi = ::exp(log_pi);
  if (sigma > 1.0 && pi < 1e-290) return ::exp(log_pi + ::log(sigma - 1.0)) + q;
  return pi * (sigma - 1.0) + q;
}

/// The rounding error of d = fl(a − b): a − b = d + difference_error(a, b, d) exactly (Knuth's
/// TwoSum of a and −b; additions only, so no contraction into an FMA can change it). For finite
/// a, b whose difference d is finite.
TROLL_HOST_DEVICE inline double difference_error(double a, double b, double d) {
  const double b_part = d - a;  // −b as the sum saw it
  return (a - (d - b_part)) - (b + b_part);
}

/// x_i = (z̃_i − z°_i) − (z̃_r − z°_r) for the KL terms, to an ulp or two of itself. Where the two
/// rows are close (z̃ ≈ z°, KL(p̃‖q) tiny) x is tiny, and any rounding of the differences it is
/// formed from is magnified by ~1/sqrt(KL) in the sum (troll::kl was off by 2e-10 relative at
/// KL ~ 1e-13, by 1e-4 on rows z̃ = z° + 100 + δ with δ ~ 1e-12). So x is formed from two
/// differences that carry their rounding errors (difference_error): the row differences
/// d_i − d_r where they are the smaller, else tilt_centred's differences to the reference
/// (z̃_i − z̃_r) − (z°_i − z°_r). Either way the outer subtraction is exact (Sterbenz) or rounds at
/// an ulp of x, and the errors add the rest. A difference that overflows (logits of opposite
/// extremes) takes tilt_centred's clamped form.
TROLL_HOST_DEVICE inline double kl_centred(double zn, double zo, const tilt_ref& ref) {
  const double d = zn - zo, ref_d = ref.zn - ref.zo, dn = zn - ref.zn, dq = zo - ref.zo;
  const double x = ::fabs(d) + ::fabs(ref_d) < ::fabs(dn) + ::fabs(dq)
                       ? (d - ref_d) + (difference_error(zn, zo, d) - difference_error(ref.zn, ref.zo, ref_d))
                       : (dn - dq) + (difference_error(zn, ref.zn, dn) - difference_error(zo, ref.zo, dq));
  return x - x == 0.0 ? x : tilt_centred(zn, zo, ref);
}

/// Token i's share of KL(π_t‖q) at the evaluated point p; every share is ≥ 0, so the sum cannot
/// cancel:
///   on J:           q_i φ(σ_i), σ_i = log π_i − log q_i = t·x_i − a_c
///                   (a_c's rounding shifts every σ_i alike and moves KL only by that relative
///                   amount, to first order: the sum is exact where the closed form cancels);
///   old-only (z̃ = −inf, z° finite): q_i (π puts nothing there; 0 against q_J);   elsewhere: 0.
TROLL_HOST_DEVICE inline double kl_term(double zn, double zo, const tilt_point& p) {
  if (zo == neg_inf()) return 0.0;
  const double log_q = (zo - p.old_max) - p.old_log_sum;
  const double q = ::exp(log_q);
  if (zn == neg_inf()) return p.joint_old ? 0.0 : q;
  const double x = tilt_centred(zn, zo, p.ref);
  const double sigma = p.t * kl_centred(zn, zo, p.ref) - p.a_c;
  const double log_pi = tilt_weight(zn, zo, x, p.ref, tilt_param{p.t, p.s}) - p.log_norm;
  return kl_term_value(sigma, log_pi, q);
}

/// Token i's share of Σ_J q_i e^{σ_i} − 1 at the evaluated point p (σ_i = t·x_i − a_c as in
/// kl_term): q_i·expm1(σ_i) on J (π_i − q_i from log π where |σ| ≥ 1/2, so nothing overflows),
/// −q_i on an old-only token (0 against q_J), 0 elsewhere. With a_c exact the shares sum to 0
/// (Σ_J π = 1); their sum s says a_c's own rounding: the exact value is a_c + log1p(s) (refine_a_c). Near t = 0
/// every σ_i is tiny, so s is formed to an absolute ~1e-16·t·max|x|, far finer than a_c's
/// rounding from the log-sums it is made of.
TROLL_HOST_DEVICE inline double ratio_term(double zn, double zo, const tilt_point& p) {
  if (zo == neg_inf()) return 0.0;
  const double log_q = (zo - p.old_max) - p.old_log_sum;
  const double q = ::exp(log_q);
  if (zn == neg_inf()) return p.joint_old ? 0.0 : -q;
  const double sigma = p.t * kl_centred(zn, zo, p.ref) - p.a_c;
  if (::fabs(sigma) < 0.5) return q * ::expm1(sigma);
  const double x = tilt_centred(zn, zo, p.ref);
  return ::exp(tilt_weight(zn, zo, x, p.ref, tilt_param{p.t, p.s}) - p.log_norm) - q;
}

}  // namespace detail
TROLL_END_NAMESPACE
