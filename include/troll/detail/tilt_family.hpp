// troll/detail/tilt_family.hpp — one member π_t of the tilted family, per token and summarised,
// written once for host and device (math.md §2):
//     log π_t,i = w_i − log_norm,   w_i = (z°_i − M°) + t·x_i,   x_i = d_i − c,  d_i = z̃_i − z°_i,
// over the joint support J, where M° = max z° and c is a free centring shift. The pair
// (t, s = 1 − t) is carried with both halves exact where they are small, and for t > 1/2 the
// same w is formed as (z̃_i − M° − c) − s·x_i: so a t within a rounding of 1 is still resolved,
// and a token the old row masks with a huge finite negative (−1e9, lowest()) never makes
// (z° − M°) cancel against t·x (docs/math.md, "Huge finite logits").
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

/// Centred differences are clamped to ±this: a pair of finite logits of opposite extremes
/// (|z̃ − z°| > DBL_MAX) must not become ±inf, whose product with a zero weight is NaN.
TROLL_HOST_DEVICE constexpr double max_centred() { return 1e300; }
TROLL_HOST_DEVICE inline double clamp_centred(double x) {
  return minimum(maximum(x, -max_centred()), max_centred());
}

/// w_i of one token on J at (u, c), from its centred difference x = clamp_centred(d − c): the
/// t-form (z° − M°) + t·x for t ≤ 1/2, the s-form (z̃ − M° − c) − s·x above.
TROLL_HOST_DEVICE inline double tilt_weight(double zn, double zo, double x, double old_max, double c,
                                            const tilt_param& u) {
  return u.t <= 0.5 ? (zo - old_max) + u.t * x : ((zn - old_max) - c) - u.s * x;
}

/// One evaluated member, summarised.
struct tilt_point {
  double t = 0.0;
  double s = 1.0;
  double shift = 0.0;     // the centring c of this evaluation
  double log_norm = 0.0;  // log Σ_J exp(w_i)
  double a_c = 0.0;       // log Σ_J q_i exp(t (d_i − c)) = log_norm − old_log_sum
  double mu = 0.0;        // E_πt[d] (absolute)
  double sigma2 = 0.0;    // Var_πt[d]
  double kl = 0.0;        // KL(π_t ‖ q)
  double kl_error = 0.0;  // a bound on the rounding error of `kl` as make_point computes it
  double old_log_sum = 0.0;  // log Σ_i exp(z°_i − M°) the point was made with
};

/// Turns a reduction at (u, c) into a tilt_point. `old_log_sum` = log Σ_i exp(z°_i − M°) over
/// all tokens, so log q_i = z°_i − M° − old_log_sum. KL(π_t‖q) = t·E[d − c] − a_c.
///
/// That difference cancels when KL is small against the log-sums it is formed from (tiny ε,
/// rows with a large log V), so `kl_error` bounds its rounding error: 16 ulps of every term that
/// enters (the two logarithms carry an ulp of their arguments, which are ≥ 1, hence the 4), the
/// moments' terms weighted by the size of the exponents. Where that is too coarse the caller
/// asks the evaluator for the cancellation-free sum (kl_term below).
TROLL_HOST_DEVICE inline tilt_point make_point(const lse_state& st, const tilt_param& u, double c,
                                               double old_log_sum) {
  constexpr double ulp = 2.220446049250313e-16;
  tilt_point p;
  p.t = u.t;
  p.s = u.s;
  p.shift = c;
  p.old_log_sum = old_log_sum;
  const double log_s0 = ::log(st.s0);
  p.log_norm = st.m + log_s0;
  const double mu_c = st.mean();
  p.mu = mu_c + c;
  p.sigma2 = st.variance();
  p.a_c = p.log_norm - old_log_sum;
  p.kl = u.t * mu_c - p.a_c;
  const double spread = st.s2 > 0.0 ? ::sqrt(st.s2 / st.s0) : 0.0;
  p.kl_error = 16.0 * ulp *
               (4.0 + ::fabs(st.m) + ::fabs(log_s0) + ::fabs(old_log_sum) +
                u.t * spread * (64.0 + ::fabs(st.m)));
  return p;
}

/// q·φ(σ) with φ(σ) = σ e^σ − e^σ + 1 = Σ_{n≥2} (n−1) σ^n / n!, the non-negative per-token term
/// of KL(π‖q) = Σ_i q_i φ(log π_i/q_i) (valid because Σπ = Σq = 1). For |σ| < 1 the series
/// (20 terms, Horner; the tail is below 1e-18 relative), else π(σ − 1) + q, which cannot cancel
/// by more than a factor of four there.
TROLL_HOST_DEVICE inline double kl_term_value(double sigma, double pi, double q) {
  if (::fabs(sigma) < 1.0) {
    // φ(σ) = σ² Σ_{n≥2} c_n σ^{n−2}, c_n = (n−1)/n! (n = 2..21).
    const double x = sigma;
    double acc = 3.9145882126782523e-19;
    acc = acc * x + 7.809603484293113e-18;
    acc = acc * x + 1.4797143443923793e-16;
    acc = acc * x + 2.6552651846596585e-15;
    acc = acc * x + 4.498331606952833e-14;
    acc = acc * x + 7.169215998581078e-13;
    acc = acc * x + 1.0706029224547743e-11;
    acc = acc * x + 1.4911969277048643e-10;
    acc = acc * x + 1.9270852604185937e-09;
    acc = acc * x + 2.296443268665491e-08;
    acc = acc * x + 2.505210838544172e-07;
    acc = acc * x + 2.48015873015873e-06;
    acc = acc * x + 2.2045855379188714e-05;
    acc = acc * x + 0.00017361111111111112;
    acc = acc * x + 0.0011904761904761906;
    acc = acc * x + 0.006944444444444444;
    acc = acc * x + 0.03333333333333333;
    acc = acc * x + 0.125;
    acc = acc * x + 0.3333333333333333;
    acc = acc * x + 0.5;
    return q * (x * x) * acc;
  }
  return pi * (sigma - 1.0) + q;
}

/// What kl_term needs of an evaluated point, besides the logits.
struct kl_frame {
  tilt_param u;
  double c = 0.0;
  double old_max = 0.0;
  double log_norm = 0.0;
  double a_c = 0.0;
  double old_log_sum = 0.0;
};

TROLL_HOST_DEVICE inline kl_frame make_frame(const tilt_point& p, double old_max) {
  return kl_frame{tilt_param{p.t, p.s}, p.shift, old_max, p.log_norm, p.a_c, p.old_log_sum};
}

/// Token i's share of KL(π_t‖q), every share ≥ 0 so the sum cannot cancel:
///   on J:           q_i φ(σ_i), σ_i = log π_i − log q_i = t·(d_i − c) − a_c
///                   (a_c's rounding shifts every σ_i alike and moves KL only by that relative
///                   amount, to first order: the sum is exact where the naive one cancels);
///   old-only (z̃ = −inf, z° finite): q_i (π puts nothing there);   elsewhere: 0.
TROLL_HOST_DEVICE inline double kl_term(double zn, double zo, const kl_frame& f) {
  if (zo == neg_inf()) return 0.0;
  const double log_q = (zo - f.old_max) - f.old_log_sum;
  const double q = ::exp(log_q);
  if (zn == neg_inf()) return q;
  const double x = clamp_centred((zn - zo) - f.c);
  const double sigma = f.u.t * x - f.a_c;
  const double pi = ::exp(tilt_weight(zn, zo, x, f.old_max, f.c, f.u) - f.log_norm);
  return kl_term_value(sigma, pi, q);
}

}  // namespace detail
TROLL_END_NAMESPACE
