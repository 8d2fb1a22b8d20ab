// troll/detail/trust_region_solver.hpp — the scalar part of the projection, written once for
// host and device: the tilted-family moments at a given t and the safeguarded Newton solve for
// t* ∈ (0, 1] with KL(π_t* ‖ q) = ε (math.md §2).
//
// A row is seen only through an evaluator `lse_state eval(double t, double c)` that reduces, over
// the joint support J = {i : z̃_i > −inf and z°_i > −inf}, the pairs
//     w_i = (z°_i − M°) + t · (d_i − c),   x_i = d_i − c,      d_i = z̃_i − z°_i,
// where M° = max z° and c is a free centring shift. KL is invariant under c; choosing c ≈ μ(t)
// keeps t·μ and log Σ from cancelling and keeps the variance formula s2/s0 − μ² accurate.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "lse_state.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// What a row's preliminary scan found (computed without exponentials).
struct row_setup {
  double old_max = neg_inf();  // M° = max_i z°_i
  double shift_new = 0.0;      // d at argmax_J z̃: centres the t = 1 evaluation
  double shift_old = 0.0;      // d at argmax_J z°: centres the t = 0 evaluation
  bool new_only = false;       // a token with z̃ finite and z° = −inf (p̃ mass outside supp q)
  bool old_only = false;       // a token with z° finite and z̃ = −inf (q mass outside supp p̃)
  bool any_masked = false;     // some token is −inf in either row: evaluators must mask
};

/// One member π_t of the tilted family, summarised.
struct tilt_point {
  double t = 0.0;
  double shift = 0.0;     // the c used for this evaluation
  double log_norm = 0.0;  // log Σ_J exp(w_i): log π_i = w_i − log_norm on J
  double mu = 0.0;        // E_πt[d] (absolute)
  double sigma2 = 0.0;    // Var_πt[d]
  double kl = 0.0;        // KL(π_t ‖ q)
};

/// Turns an evaluator's reduction at (t, c) into a tilt_point. `old_log_sum` is
/// log Σ_i exp(z°_i − M°) over all tokens, so log q_i = z°_i − M° − old_log_sum.
TROLL_HOST_DEVICE inline tilt_point make_point(const lse_state& st, double t, double c,
                                               double old_log_sum) {
  tilt_point p;
  p.t = t;
  p.shift = c;
  p.log_norm = st.log_sum();
  const double mu_c = st.mean();
  p.mu = mu_c + c;
  p.sigma2 = st.variance();
  // A_c(t) = log Σ_J q_i exp(t (d_i − c)); KL(π_t‖q) = t·E[d − c] − A_c(t).
  const double a_c = st.m + (::log(st.s0) - old_log_sum);
  p.kl = t * mu_c - a_c;
  return p;
}

struct solve_result {
  tilt_point point;  // the evaluated member the row is written from
  double kl_before = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;
};

/// Solves one row. The evaluator also provides `double old_log_sum() const` (a separate pass,
/// called only when some old token is masked in the new row; otherwise the t = 0 evaluation
/// already sums q over its whole support). Never throws: an infeasible row (q's mass on J is at
/// most e^{−ε}) comes back with status infeasible and the t → 0 end as its point.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE solve_result solve_row(const Eval& eval, const row_setup& setup, double eps,
                                         const projection_options& opt) {
  solve_result r;
  // t = 0 first: π_0 = q restricted to J. Its normaliser is log q's (relative to M°) whenever J
  // covers supp q, and its variance seeds the first Newton guess.
  const lse_state zero_state = eval(0.0, setup.shift_old);
  const double old_log_sum = setup.old_only ? eval.old_log_sum() : zero_state.log_sum();
  tilt_point at_zero = make_point(zero_state, 0.0, setup.shift_old, old_log_sum);
  // KL(π_0+ ‖ q) = −log q(J): zero unless the new row masks old mass.
  at_zero.kl = setup.old_only ? maximum(at_zero.kl, 0.0) : 0.0;

  const tilt_point at_one = make_point(eval(1.0, setup.shift_new), 1.0, setup.shift_new, old_log_sum);
  const double kl_one = maximum(at_one.kl, 0.0);
  r.kl_before = setup.new_only ? inf() : kl_one;
  r.point = at_one;
  if (kl_one <= eps) {
    r.status = setup.new_only ? row_status::restricted : row_status::inactive;
    r.point.kl = kl_one;
    return r;
  }
  if (at_zero.kl >= eps) {
    r.status = row_status::infeasible;
    r.point = at_zero;
    return r;
  }
  r.status = row_status::projected;

  // Bracket [lo, hi] with KL(lo) < ε < KL(hi). Near t = 0, KL ≈ KL0 + t² σ0² / 2.
  double lo = 0.0, hi = 1.0;
  tilt_point best_lo = at_zero, point = at_one;
  double t = at_zero.sigma2 > 0.0 ? ::sqrt(2.0 * (eps - at_zero.kl) / at_zero.sigma2) : 0.5;
  if (!(t > 0.0 && t < 1.0)) t = 0.5;
  // μ(t) grows with t (dμ/dt = σ²); predict it for the centring shift.
  double c = minimum(at_zero.mu + t * at_zero.sigma2, at_one.mu);
  const double tol = opt.atol + opt.rtol * eps;
  const double sqrt_eps = ::sqrt(eps);
  const double ulp = 2.220446049250313e-16;
  bool converged = false;

  for (int it = 1; it <= opt.max_iterations; ++it) {
    point = make_point(eval(t, c), t, c, old_log_sum);
    r.iterations = it;
    const double f = point.kl - eps;
    if (f <= tol && f >= -tol) {
      converged = true;
      break;
    }
    if (f < 0.0) {
      lo = t;
      best_lo = point;
    } else {
      hi = t;
    }
    // Two Newton steps on transforms of KL, each exact for one shape of the curve:
    //   on sqrt(KL) − sqrt(ε), exact where KL ≈ a t² (smooth rows, small t);
    //   on log(KL) − log(ε),   exact where KL ≈ a e^{bt} (a sharp q whose mode is about to be
    //   overtaken: KL stays tiny, then rises by orders of magnitude within a short interval).
    // Near the root the sqrt transform is the flatter one (fewer steps on smooth rows); far above
    // it (KL > 4ε) the sqrt step crawls along exponential stretches, so the log step leads there.
    // Whichever leads, the other is the fallback when the first leaves the bracket, and bisection
    // the last resort. dKL/dt = t σ²(t). (On the test corpus this cut the worst case from 21 to
    // 16 evaluations and left smooth rows unchanged; docs/iterations.md.)
    const double kl_pos = maximum(point.kl, 1e-300);
    const double dkl = t * point.sigma2;
    double next = lo;
    if (dkl > 0.0) {
      const double root_kl = ::sqrt(kl_pos);
      const double sqrt_step = (root_kl - sqrt_eps) * 2.0 * root_kl / dkl;
      const double log_step = ::log(kl_pos / eps) * kl_pos / dkl;
      const bool far_above = point.kl > 4.0 * eps;
      const double first = far_above ? log_step : sqrt_step;
      const double second = far_above ? sqrt_step : log_step;
      next = t - first;
      if (!(next > lo && next < hi)) next = t - second;
    }
    if (!(next > lo && next < hi)) {
      next = lo > 0.0 ? (hi > 4.0 * lo ? ::sqrt(lo * hi) : 0.5 * (lo + hi)) : 0.125 * hi;
    }
    if (hi - lo <= 4.0 * ulp * hi || next == t) break;  // bracket exhausted at this precision
    c = point.mu + (next - t) * point.sigma2;
    t = next;
  }
  if (!converged && point.kl > eps && lo > 0.0) point = best_lo;  // stalled: keep the feasible end
  r.point = point;
  return r;
}

/// Fills the public per-row statistics from a solve.
TROLL_HOST_DEVICE inline projection_stats make_stats(const solve_result& r) {
  projection_stats s;
  s.status = r.status;
  s.t = r.point.t;
  s.eta = r.point.t > 0.0 ? (1.0 - r.point.t) / r.point.t : inf();
  s.kl_before = r.kl_before;
  s.kl_after = r.status == row_status::inactive ? r.kl_before : maximum(r.point.kl, 0.0);
  s.mu = r.point.mu;
  s.sigma2 = r.point.sigma2;
  s.iterations = r.iterations;
  return s;
}

}  // namespace detail
TROLL_END_NAMESPACE
