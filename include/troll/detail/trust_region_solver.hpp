// troll/detail/trust_region_solver.hpp — the scalar part of the projection, written once for
// host and device: the safeguarded Newton solve for t* ∈ (0, 1] with KL(π_t* ‖ q) = ε
// (math.md §2; docs/math.md "Convergence").
//
// A row is seen only through an evaluator with
//     lse_state operator()(tilt_param u, tilt_ref r)  the reduction over J of the pairs (w_i, x_i)
//                                                      of tilt_family.hpp, by push_pair;
//     double exact_kl(const tilt_point& p)             Σ_i kl_term at an evaluated point;
//     double old_log_sum()                             log Σ_i exp(z°_i − M°) (all old tokens).
// The reference r is a token of J: the arg-max of z° at t = 0, of z̃ at t = 1, and the mode of
// the last evaluation in between, so that every w and x stays the size of the row's logit
// differences around its mode.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "lse_state.hpp"
#include "numeric.hpp"
#include "tilt_family.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// What a row's preliminary scan found (computed without exponentials).
struct row_setup {
  double old_max = neg_inf();  // M° = max_i z°_i
  tilt_ref new_top;            // (z̃, z°) at argmax_J z̃ (lowest token on ties): t = 1's reference
  tilt_ref old_top;            // (z̃, z°) at argmax_J z°: t = 0's reference
  bool new_only = false;       // a token with z̃ finite and z° = −inf (p̃ mass outside supp q)
  bool old_only = false;       // a token with z° finite and z̃ = −inf (q mass outside supp p̃)
  bool any_masked = false;     // some token is −inf in either row: evaluators must mask
  double spread = inf();       // max − min over the logits of both rows (CPU scan; +inf: unknown)
};

struct solve_result {
  tilt_point point;  // the evaluated member the row is written from
  double kl_before = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;
};

/// Evaluates the member at (u, ref) for the solve towards KL = ε within ±tol. The closed-form
/// KL is kept where its rounding bound is well inside the tolerance, or where it is far enough
/// from ε (and from 0) to decide the bracket side and to steer a Newton step; otherwise (tiny ε,
/// near the root, a KL that has underflowed) it is replaced by the cancellation-free sum.
///
/// The reference should be the mode of π_u (then w ≤ 0 with w = 0 at the mode). Where it is
/// far from it (the largest w exceeds 64: the mode moved by orders of magnitude since the last
/// evaluation, as at the steep rise of a token one row masks with a huge finite value), w and
/// the KL would be differences of huge numbers, so the member is evaluated again relative to
/// the mode just found.
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate(const Eval& eval, const tilt_param& u, tilt_ref ref, double old_max,
                                      double old_log_sum, double eps, double tol) {
  lse_state st = eval(u, ref);
  if (st.m > 64.0) {
    ref = tilt_ref{st.ref_new, st.ref_old};
    st = eval(u, ref);
  }
  tilt_point p = make_point(st, u, ref, old_max, old_log_sum);
  const bool fine = p.kl_error <= 2.0 * tol;  // then |KL − ε| ≤ 3 tol: inside the 1e-10 guarantee
  const bool decided = ::fabs(p.kl - eps) > tol + p.kl_error && p.kl > 1e3 * p.kl_error;
  if (!(fine || decided)) {
    p.kl = eval.exact_kl(p);
    p.kl_error = 0.0;
  }
  return p;
}

/// Replaces p.kl by the cancellation-free sum unless the closed form is good to 1e-11 relative.
template <class Eval>
TROLL_HOST_DEVICE void settle_kl(const Eval& eval, tilt_point& p) {
  if (!(p.kl_error <= 1e-11 * p.kl)) {
    p.kl = eval.exact_kl(p);
    p.kl_error = 0.0;
  }
  p.kl = maximum(p.kl, 0.0);
}

/// KL(π_1 ‖ q) = KL(p̃ ‖ q) to 1e-11 relative (the t = 1 member; p̃ restricted to J when the
/// old row masks some of its tokens).
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate_at_one(const Eval& eval, const row_setup& setup, double old_log_sum) {
  tilt_point p = make_point(eval(tilt_at(1.0), setup.new_top), tilt_at(1.0), setup.new_top, setup.old_max,
                            old_log_sum);
  settle_kl(eval, p);
  return p;
}

/// The t = 0 member (π_0 = q restricted to J) from its reduction, with KL(π_0+ ‖ q) = −log q(J),
/// the least KL any admissible π reaches (0 unless the new row masks old mass), to 1e-11
/// relative.
template <class Eval>
TROLL_HOST_DEVICE tilt_point zero_point(const Eval& eval, const row_setup& setup, const lse_state& state,
                                        double old_log_sum) {
  tilt_point p = make_point(state, tilt_at(0.0), setup.old_top, setup.old_max, old_log_sum);
  if (setup.old_only) {
    settle_kl(eval, p);
  } else {
    p.kl = 0.0;
  }
  return p;
}

template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate_at_zero(const Eval& eval, const row_setup& setup, double old_log_sum) {
  return zero_point(eval, setup, eval(tilt_at(0.0), setup.old_top), old_log_sum);
}

/// Orders members by t (ties, which only occur near t = 1, by s).
TROLL_HOST_DEVICE inline bool tilt_less(const tilt_param& a, const tilt_param& b) {
  return a.t < b.t || (a.t == b.t && a.s > b.s);
}

/// u moved to t − δ, keeping exact whichever of t and s ends up the small one.
TROLL_HOST_DEVICE inline tilt_param tilt_step(const tilt_param& u, double delta) {
  if (u.t <= 0.5) {
    const double t = u.t - delta;
    return t <= 0.5 ? tilt_at(t) : tilt_near_one(u.s + delta);
  }
  const double s = u.s + delta;
  return s <= 0.5 ? tilt_near_one(s) : tilt_at(u.t - delta);
}

/// A point strictly between 0 and v > 0, far towards 0: v·min(1/8, v) (squaring, so that a
/// root at 1e-300 is reached in a few steps), then v·2^-64, then the smallest subnormal.
TROLL_HOST_DEVICE inline double towards_zero(double v) {
  double next = v * minimum(0.125, v);
  if (!(next > 0.0)) next = v * 5.421010862427522e-20;
  if (!(next > 0.0)) next = 4.9406564584124654e-324;
  return next;
}

/// sqrt(a·b) without underflow for subnormal a, b.
TROLL_HOST_DEVICE inline double geometric_mean(double a, double b) { return ::sqrt(a) * ::sqrt(b); }

/// The bisection point of the bracket (lo, hi): arithmetic in t (both ends in the lower half)
/// or in s (both in the upper half), geometric where the ends are more than a factor 4 apart,
/// and towards_zero from an end at exactly t = 0 or s = 0, so that a root at t ~ 1e-300 or
/// 1 − 1e-300 is bracketed in a few dozen halvings of the exponent.
TROLL_HOST_DEVICE inline tilt_param tilt_bisect(const tilt_param& lo, const tilt_param& hi) {
  if (hi.t <= 0.5) {
    if (lo.t == 0.0) return tilt_at(towards_zero(hi.t));
    return tilt_at(hi.t > 4.0 * lo.t ? geometric_mean(lo.t, hi.t) : 0.5 * (lo.t + hi.t));
  }
  if (lo.t >= 0.5) {
    if (hi.s == 0.0) return tilt_near_one(towards_zero(lo.s));
    return tilt_near_one(lo.s > 4.0 * hi.s ? geometric_mean(lo.s, hi.s) : 0.5 * (lo.s + hi.s));
  }
  return tilt_at(0.5);
}

/// Solves one row. Never throws: an infeasible row (q's mass on J is at most e^{−ε}) comes back
/// with status infeasible and the t → 0 end as its point; a row not brought within the
/// tolerance |KL − ε| ≤ atol + rtol·ε comes back not_converged with its best feasible member
/// (KL < ε) as the point.
///
/// Each iteration evaluates one member (one pass over the row, two where the closed-form KL is
/// too coarse for the decision at hand) and keeps a bracket lo < t* < hi. The next member is a
/// Newton step on a transform of KL (below) when that lands inside the bracket and is at most
/// half the step before last (the rtsafe rule), otherwise the bisection point: so the bracket
/// shrinks at least geometrically, and a stall (steps that shrink slowly, a KL that underflows
/// to 0 on the far side of a steep rise) turns into bisection within two iterations.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE solve_result solve_row(const Eval& eval, const row_setup& setup, double eps,
                                         const projection_options& opt) {
  solve_result r;
  // t = 0 first: π_0 = q restricted to J. Its normaliser is log q's (relative to M°) whenever J
  // covers supp q, and its variance seeds the first Newton guess.
  const lse_state zero_state = eval(tilt_at(0.0), setup.old_top);
  const double old_log_sum =
      setup.old_only ? eval.old_log_sum() : zero_state.log_sum() + (setup.old_top.zo - setup.old_max);
  const tilt_point at_zero = zero_point(eval, setup, zero_state, old_log_sum);

  const tilt_point at_one = evaluate_at_one(eval, setup, old_log_sum);
  r.kl_before = setup.new_only ? inf() : at_one.kl;
  r.point = at_one;
  if (at_one.kl <= eps) {
    r.status = setup.new_only ? row_status::restricted : row_status::inactive;
    return r;
  }
  if (at_zero.kl >= eps) {
    r.status = row_status::infeasible;
    r.point = at_zero;
    return r;
  }

  const double tol = opt.atol + opt.rtol * eps;
  const double sqrt_eps = ::sqrt(eps);
  tilt_param lo = tilt_at(0.0), hi = tilt_at(1.0);
  tilt_point best_lo = at_zero, point = at_one;
  // Near t = 0, KL ≈ KL0 + t² σ0² / 2.
  double t0 = at_zero.sigma2 > 0.0 ? ::sqrt(2.0 * (eps - at_zero.kl) / at_zero.sigma2) : 0.5;
  if (!(t0 > 0.0 && t0 < 1.0)) t0 = 0.5;
  tilt_param u = t0 <= 0.5 ? tilt_at(t0) : tilt_near_one(1.0 - t0);
  tilt_ref ref = t0 <= 0.5 ? at_zero.mode : at_one.mode;
  double step_last = inf(), step_before = inf();
  bool converged = false;

  for (int it = 1; it <= opt.max_iterations; ++it) {
    // The closed form decides whenever its error is well inside the tolerance or far from it.
    point = evaluate(eval, u, ref, setup.old_max, old_log_sum, eps, tol);
    r.iterations = it;
    const double g = point.kl - eps;
    if (g <= tol && g >= -tol) {
      converged = true;
      break;
    }
    if (g < 0.0) {
      lo = u;
      best_lo = point;
    } else {
      hi = u;
    }
    // Two Newton steps on transforms of KL, each exact for one shape of the curve:
    //   on sqrt(KL) − sqrt(ε), exact where KL ≈ a t² (smooth rows, small t);
    //   on log(KL) − log(ε),   exact where KL ≈ a e^{bt} (a sharp q whose mode is about to be
    //   overtaken: KL stays tiny, then rises by orders of magnitude within a short interval).
    // Near the root the sqrt transform is the flatter one; far above it (KL > 4ε) the log step
    // leads. Whichever leads, the other is the fallback when the first leaves the bracket.
    // dKL/dt = t σ²(t). A KL that is 0 (underflow) or a slope that is 0 or not finite gives no
    // step: bisection.
    const double dkl = u.t * point.sigma2;
    tilt_param next = u;
    bool newton = false;
    if (point.kl > 0.0 && dkl > 0.0 && dkl < inf()) {
      const double root_kl = ::sqrt(point.kl);
      const double sqrt_step = (root_kl - sqrt_eps) * 2.0 * root_kl / dkl;
      const double log_step = ::log(point.kl / eps) * point.kl / dkl;
      const bool far_above = point.kl > 4.0 * eps;
      const double steps[2] = {far_above ? log_step : sqrt_step, far_above ? sqrt_step : log_step};
      for (const double delta : steps) {
        if (!(::fabs(delta) <= 0.5 * step_before)) continue;  // not shrinking fast enough
        const tilt_param candidate = tilt_step(u, delta);
        if (tilt_less(lo, candidate) && tilt_less(candidate, hi)) {
          next = candidate;
          newton = true;
          break;
        }
      }
    }
    if (!newton) {
      next = tilt_bisect(lo, hi);
      if (!(tilt_less(lo, next) && tilt_less(next, hi))) break;  // bracket exhausted at this precision
    }
    // |Δt| of this step, measured on whichever of t and s is exact.
    const double step = next.t <= 0.5 && u.t <= 0.5 ? ::fabs(next.t - u.t) : ::fabs(next.s - u.s);
    step_before = step_last;
    step_last = step;
    ref = point.mode;
    u = next;
  }
  if (converged) {
    r.status = row_status::projected;
    r.point = point;
  } else {
    r.status = row_status::not_converged;
    r.point = best_lo;  // feasible: KL(π‖q) < ε
  }
  return r;
}

/// Fills the public per-row statistics from a solve.
TROLL_HOST_DEVICE inline projection_stats make_stats(const solve_result& r) {
  projection_stats s;
  s.status = r.status;
  s.t = r.point.t;
  s.eta = r.point.t > 0.0 ? r.point.s / r.point.t : inf();
  s.kl_before = r.kl_before;
  s.kl_after = r.status == row_status::inactive ? r.kl_before : maximum(r.point.kl, 0.0);
  s.mu = r.point.mu;
  s.sigma2 = r.point.sigma2;
  s.iterations = r.iterations;
  return s;
}

}  // namespace detail
TROLL_END_NAMESPACE
