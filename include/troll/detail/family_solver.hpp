// troll/detail/family_solver.hpp — the safeguarded Newton solve for t* ∈ (0, 1] with
// KL(π_t* ‖ q) = ε, written once for every exponential family troll projects onto (the
// categorical rows, dense and sparse, and the Gaussians), on host and device.
//
// Along the natural-parameter path θ_t = θ° + t(θ̃ − θ°), KL(π_t ‖ q) rises from KL(π_0 ‖ q)
// to KL(p̃ ‖ q) with dKL/dt = t·I(t), where I(t) ≥ 0 is the Fisher information of the family
// along the path (Var_πt[d] for a categorical row). A family is seen only through
//     Point evaluate(const tilt_param& u, const Point& near, double eps, double tol) const
// which returns the member at u (near: the member evaluated last, a hint for where π_u's mass
// sits), with KL(π_u ‖ q) good to well inside tol where it is within tol of ε; and a Point
// holds at least
//     double t, s;     the parameter (s = 1 − t, the exact one of the pair where it is small)
//     double kl;       KL(π_u ‖ q)
//     double sigma2;   I(t): dKL/dt = t·sigma2
#pragma once

#include <cmath>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "numeric.hpp"
#include "tilt_family.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

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

/// The first Newton guess for t* from both ends of the bracket, where KL(0) = KL0 < ε < KL(1).
/// On g(t) = sqrt(KL(t) − KL0), which is close to linear in t (the sqrt transform of the Newton
/// steps below), the four things the ends give are known: g(0) = 0, g'(0) = sqrt(I(0)/2)
/// (KL − KL0 ≈ t² I(0)/2 near 0), g(1) = sqrt(KL1 − KL0) and g'(1) = I(1) / (2 g(1)) (dKL/dt = t
/// I(t)); the guess is where their cubic Hermite interpolant crosses sqrt(ε − KL0), found by
/// Newton steps on the cubic kept inside the bracket (bisection otherwise). Where the t = 0 end
/// gives no slope, or the cubic's root is not found inside (0, 1), the second-order expansion
/// at t = 0 alone (sqrt(2 (ε − KL0) / I(0))), or 1/2.
TROLL_HOST_DEVICE inline double newton_start(double kl0, double sigma2_0, double kl1, double sigma2_1, double eps) {
  const double quadratic = sigma2_0 > 0.0 ? ::sqrt(2.0 * (eps - kl0) / sigma2_0) : 0.5;
  const double fallback = quadratic > 0.0 && quadratic < 1.0 ? quadratic : 0.5;
  const double slope0 = ::sqrt(0.5 * sigma2_0), g1 = ::sqrt(kl1 - kl0), target = ::sqrt(eps - kl0);
  const double slope1 = sigma2_1 / (2.0 * g1);
  // h(t) = slope0 (t³ − 2t² + t) + g1 (3t² − 2t³) + slope1 (t³ − t²) = c1 t + c2 t² + c3 t³.
  const double c1 = slope0, c2 = 3.0 * g1 - 2.0 * slope0 - slope1, c3 = slope0 + slope1 - 2.0 * g1;
  if (!(slope0 > 0.0 && slope0 < inf() && g1 > 0.0 && g1 < inf() && slope1 >= 0.0 && slope1 < inf() &&
        target > 0.0 && target < g1 && eps - kl0 >= 0.01 * (kl1 - kl0)))
    return fallback;
  // Only a cubic that rises over all of [0, 1] (h' = c1 + 2 c2 t + 3 c3 t² > 0): ends that
  // disagree with a smooth rise (a steep late climb) keep the t = 0 expansion.
  const double vertex = c3 > 0.0 ? -c2 / (3.0 * c3) : -1.0;
  if (vertex > 0.0 && vertex < 1.0 && !(c1 + vertex * c2 > 0.0)) return fallback;
  double lo = 0.0, hi = 1.0, t = fallback;
  for (int k = 0; k < 16; ++k) {
    const double value = t * (c1 + t * (c2 + t * c3)) - target;
    const double slope = c1 + t * (2.0 * c2 + t * 3.0 * c3);
    if (value < 0.0) {
      lo = t;
    } else {
      hi = t;
    }
    const double delta = value / slope;
    if (::fabs(delta) <= 1e-6 * t) {  // a guess needs no more digits than this
      t -= delta;
      break;
    }
    const double next = t - delta;
    t = next > lo && next < hi ? next : 0.5 * (lo + hi);
  }
  return t > 0.0 && t < 1.0 ? t : fallback;
}

/// A sharper first guess where both ends also carry the third and fourth cumulants of d (κ₃,
/// κ₄; the reductions form them for two more multiply-adds per token): then g = sqrt(KL − KL0)
/// has its value and first three derivatives known at both ends, and the guess is where their
/// septic Hermite interpolant crosses sqrt(ε − KL0). With K = KL − KL0, K' = tσ², K'' = σ² + tκ₃,
/// K''' = 2κ₃ + tκ₄: at t = 0, g = t·sqrt(σ²/2 + tκ₃/3 + t²κ₄/8 + …); at t = 1, g's derivatives
/// follow from K's by the chain rule. On LLM-like rows at V = 151,936 the cubic guess lies
/// 3e-4 … 1e-2 / L from t* and this one ~1e-8 … 1e-5 / L (L: the range of d), close enough for
/// the member after the first Newton evaluation to be predicted (predict_member). On the
/// ~80-category rows of the sparse path the cubic guess can lie 0.1 from t* and this one a few
/// 1e-3. Only a guess: kept where it lies inside (0, 1) within 0.25 of the cubic's (ends whose
/// interpolant wanders keep the cubic), else the cubic's guess `cubic`. Rows, stopping rule and
/// bracket unchanged.
TROLL_HOST_DEVICE inline double newton_start_septic(double cubic, double kl0, double sigma2_0, double k3_0,
                                                    double k4_0, double kl1, double sigma2_1, double k3_1,
                                                    double k4_1, double eps) {
  const double a = ::sqrt(0.5 * sigma2_0), g = ::sqrt(kl1 - kl0), target = ::sqrt(eps - kl0);
  if (!(a > 0.0 && a < inf() && g > 0.0 && g < inf() && target > 0.0 && target < g)) return cubic;
  // The Taylor part at t = 0: c1 t + c2 t² + c3 t³ (c0 = 0).
  const double b = k3_0 / 3.0, c = k4_0 / 8.0;
  const double c1 = a, c2 = 0.5 * (b / a), c3 = c / (2.0 * a) - b * b / (8.0 * a * a * a);
  // g and its first three derivatives at t = 1.
  const double k1 = sigma2_1, k2 = sigma2_1 + k3_1, k3 = 2.0 * k3_1 + k4_1;
  const double g2 = g * g, g3 = g2 * g;
  const double d1 = k1 / (2.0 * g), d2 = k2 / (2.0 * g) - k1 * k1 / (4.0 * g3),
               d3 = k3 / (2.0 * g) - 3.0 * k1 * k2 / (4.0 * g3) + 3.0 * k1 * k1 * k1 / (8.0 * g3 * g2);
  // t⁴ (c4 + c5 t + c6 t² + c7 t³) takes up what the Taylor part leaves at t = 1.
  const double r0 = g - (c1 + c2 + c3), r1 = d1 - (c1 + 2.0 * c2 + 3.0 * c3), r2 = d2 - (2.0 * c2 + 6.0 * c3),
               r3 = d3 - 6.0 * c3;
  const double c4 = 35.0 * r0 - 15.0 * r1 + 2.5 * r2 - r3 / 6.0, c5 = -84.0 * r0 + 39.0 * r1 - 7.0 * r2 + 0.5 * r3,
               c6 = 70.0 * r0 - 34.0 * r1 + 6.5 * r2 - 0.5 * r3, c7 = -20.0 * r0 + 10.0 * r1 - 2.0 * r2 + r3 / 6.0;
  if (!(::fabs(c2) + ::fabs(c3) + ::fabs(c4) + ::fabs(c5) + ::fabs(c6) + ::fabs(c7) < inf())) return cubic;
  const double start_lo = maximum(0.0, cubic - 0.25), start_hi = minimum(1.0, cubic + 0.25);
  auto value = [&](double x) {
    return x * (c1 + x * (c2 + x * (c3 + x * (c4 + x * (c5 + x * (c6 + x * c7)))))) - target;
  };
  if (!(value(start_lo) < 0.0 && value(start_hi) > 0.0)) return cubic;
  double lo = start_lo, hi = start_hi, t = cubic;
  for (int k = 0; k < 24; ++k) {
    const double v = value(t);
    const double slope =
        c1 + t * (2.0 * c2 + t * (3.0 * c3 + t * (4.0 * c4 + t * (5.0 * c5 + t * (6.0 * c6 + t * 7.0 * c7)))));
    if (v < 0.0) {
      lo = t;
    } else {
      hi = t;
    }
    const double delta = v / slope;
    if (::fabs(delta) <= 1e-12 * t) {
      t -= delta;
      break;
    }
    const double next = t - delta;
    t = next > lo && next < hi ? next : 0.5 * (lo + hi);
  }
  return t > start_lo && t < start_hi && t > 0.0 && t < 1.0 ? t : cubic;
}

/// Whether a Point carries cumulants (tilt_point: κ₃, κ₄, NaN where not formed).
template <class Point, class = void>
struct point_has_cumulants : std::false_type {};
template <class Point>
struct point_has_cumulants<Point, decltype(void(std::declval<const Point&>().kappa3 +
                                                std::declval<const Point&>().kappa4))> : std::true_type {};

/// The first Newton guess from the two ends: the septic start where both carry finite κ₃ and
/// κ₄, else the cubic one.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Point>
TROLL_HOST_DEVICE double first_guess(const Point& at_zero, const Point& at_one, double eps) {
  const double cubic = newton_start(at_zero.kl, at_zero.sigma2, at_one.kl, at_one.sigma2, eps);
  if constexpr (point_has_cumulants<Point>::value) {
    const double sum = at_zero.kappa3 + at_zero.kappa4 + at_one.kappa3 + at_one.kappa4;
    if (sum - sum == 0.0)  // all four finite
      return newton_start_septic(cubic, at_zero.kl, at_zero.sigma2, at_zero.kappa3, at_zero.kappa4, at_one.kl,
                                 at_one.sigma2, at_one.kappa3, at_one.kappa4, eps);
  }
  return cubic;
}

/// d²KL/dt² = Var_πt[d] + t κ₃ of a member that carries κ₃, else NaN (no Halley step).
template <class Point>
TROLL_HOST_DEVICE double second_derivative(const Point& p, double t) {
  if constexpr (point_has_cumulants<Point>::value) {
    return p.sigma2 + t * p.kappa3;
  } else {
    (void)p, (void)t;
    return quiet_nan();
  }
}

/// How a bracketed solve ended: the member to write (the converged one, else the best feasible
/// one, KL < ε) and the number of members evaluated.
template <class Point>
struct bracket_solution {
  Point point;
  int iterations = 0;
  bool converged = false;
};

/// Solves KL(π_t ‖ q) = ε on the bracket (0, 1), given the two ends with
/// at_zero.kl < ε < at_one.kl. Converged once |KL − ε| ≤ atol + rtol·ε; otherwise (after
/// max_iterations, or once t* is resolved to adjacent doubles) the best member below ε.
///
/// Each iteration evaluates one member and keeps a bracket lo < t* < hi. The next member is a
/// Newton step on a transform of KL (below) when that lands inside the bracket and is at most
/// half the step before last (the rtsafe rule), otherwise the bisection point: so the bracket
/// shrinks at least geometrically, and a stall (steps that shrink slowly, a KL that underflows
/// to 0 on the far side of a steep rise) turns into bisection within two iterations.
/// solve_bracketed's iteration, one member at a time (a caller could hold several rows' solves
/// at once and still take exactly solve_bracketed's decisions): start(), then while !done():
/// evaluate the member at u (near() is its hint) and hand it to advance().
template <class Point>
struct bracket_search {
  double eps = 0.0, tol = 0.0, sqrt_eps = 0.0;
  int max_iterations = 0;
  tilt_param lo, hi, u;
  Point best_lo, point, first_near;
  double step_last = 0.0, step_before = 0.0;
  int iterations = 0;
  bool converged = false, finished = false;

  TROLL_HOST_DEVICE void start(const Point& at_zero, const Point& at_one, double eps_, const projection_options& opt) {
    eps = eps_;
    tol = opt.atol + opt.rtol * eps;
    sqrt_eps = ::sqrt(eps);
    max_iterations = opt.max_iterations;
    lo = tilt_at(0.0);
    hi = tilt_at(1.0);
    best_lo = at_zero;
    point = at_one;
    const double t0 = first_guess(at_zero, at_one, eps);
    u = t0 <= 0.5 ? tilt_at(t0) : tilt_near_one(1.0 - t0);
    first_near = t0 <= 0.5 ? at_zero : at_one;
    step_last = inf();
    step_before = inf();
    iterations = 0;
    converged = false;
    finished = max_iterations < 1;
  }
  TROLL_HOST_DEVICE bool done() const { return finished; }
  /// The hint for the member at u: the member evaluated last (the nearer end at first).
  TROLL_HOST_DEVICE const Point& near() const { return iterations == 0 ? first_near : point; }

  /// Takes the member evaluated at u: stops (converged, out of iterations, or the bracket
  /// exhausted at this precision) or moves u to the next member.
  TROLL_HOST_DEVICE void advance(const Point& evaluated) {
    point = evaluated;
    ++iterations;
    const double g = point.kl - eps;
    if (g <= tol && g >= -tol) {
      converged = finished = true;
      return;
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
    // dKL/dt = t I(t). A KL that is 0 (underflow) or a slope that is 0 or not finite gives no
    // step: bisection.
    //
    // Where the member carries κ₃ (the reductions formed it: members near t*, the septic start's
    // ends), the step is Halley's on the same transform, with d²KL/dt² = I(t) + t κ₃(t): cubic
    // rather than quadratic convergence, so that a member a few 1e-3 from t* is followed by one
    // within ~1e-9 and the next is predicted (predict_member) instead of evaluated. Taken only
    // where Halley's factor moves the Newton step by at most a factor of two.
    const double dkl = u.t * point.sigma2;
    const double d2kl = second_derivative(point, u.t);
    tilt_param next = u;
    bool newton = false;
    if (point.kl > 0.0 && dkl > 0.0 && dkl < inf()) {
      const bool far_above = point.kl > 4.0 * eps;
      for (int k = 0; k < 2; ++k) {
        // The sqrt step first unless far above; each taken only when needed (a log is not free).
        const bool take_log = far_above == (k == 0);
        double delta, curvature;  // the Newton step f/f′ and f″/f′ of the transform f
        if (take_log) {
          delta = ::log(point.kl / eps) * point.kl / dkl;
          curvature = d2kl / dkl - dkl / point.kl;  // f′ = KL′/KL, f″ = KL″/KL − f′²
        } else {
          const double root_kl = ::sqrt(point.kl);
          delta = (root_kl - sqrt_eps) * 2.0 * root_kl / dkl;
          curvature = d2kl / dkl - 0.5 * dkl / point.kl;  // f′ = KL′/(2√KL), f″ = KL″/(2√KL) − KL′²/(4 KL^{3/2})
        }
        const double halley = 1.0 - 0.5 * delta * curvature;
        if (halley >= 0.5 && halley <= 2.0) delta /= halley;  // false for a NaN κ₃
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
      if (!(tilt_less(lo, next) && tilt_less(next, hi))) {  // bracket exhausted at this precision
        finished = true;
        return;
      }
    }
    // |Δt| of this step, measured on whichever of t and s is exact.
    const double step = next.t <= 0.5 && u.t <= 0.5 ? ::fabs(next.t - u.t) : ::fabs(next.s - u.s);
    step_before = step_last;
    step_last = step;
    u = next;
    finished = iterations >= max_iterations;
  }

  /// Takes a member at u that the family predicted (without evaluating it) and proved
  /// converged: the search ends with it.
  TROLL_HOST_DEVICE void accept_converged(const Point& predicted) {
    point = predicted;
    ++iterations;
    converged = finished = true;
  }

  /// The member to write: the converged one, else the best feasible one (KL < ε).
  TROLL_HOST_DEVICE bracket_solution<Point> solution() const {
    bracket_solution<Point> r;
    r.point = converged ? point : best_lo;
    r.iterations = iterations;
    r.converged = converged;
    return r;
  }
};

/// Solves KL(π_t ‖ q) = ε on the bracket (0, 1), given the two ends with
/// at_zero.kl < ε < at_one.kl. Converged once |KL − ε| ≤ atol + rtol·ε; otherwise (after
/// max_iterations, or once t* is resolved to adjacent doubles) the best member below ε.
///
/// Each iteration evaluates one member and keeps a bracket lo < t* < hi. The next member is a
/// Newton step on a transform of KL (bracket_search::advance) when that lands inside the bracket
/// and is at most half the step before last (the rtsafe rule), otherwise the bisection point: so
/// the bracket shrinks at least geometrically, and a stall (steps that shrink slowly, a KL that
/// underflows to 0 on the far side of a steep rise) turns into bisection within two iterations.
///
/// A family may also offer
///     bool predict(const Point& last, const tilt_param& u, double eps, double tol, Point& out)
/// which returns true with the member at u, computed from the member evaluated last without
/// another evaluation, only where that member is provably within tol of ε: the solve then ends
/// with it (the last Newton step is typically ~1e-7 relative, where a series in the step is
/// exact; predict_member in tilt_family.hpp).
template <class Family, class Point, class = void>
struct family_predicts : std::false_type {};
template <class Family, class Point>
struct family_predicts<Family, Point,
                       decltype(void(std::declval<const Family&>().predict(
                           std::declval<const Point&>(), std::declval<const tilt_param&>(), 0.0, 0.0,
                           std::declval<Point&>())))> : std::true_type {};

#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Family, class Point>
TROLL_HOST_DEVICE bracket_solution<Point> solve_bracketed(const Family& family, const Point& at_zero,
                                                          const Point& at_one, double eps,
                                                          const projection_options& opt) {
  bracket_search<Point> search;
  search.start(at_zero, at_one, eps, opt);
  while (!search.done()) {
    if constexpr (family_predicts<Family, Point>::value) {
      Point predicted;
      if (search.iterations > 0 && family.predict(search.point, search.u, eps, search.tol, predicted)) {
        search.accept_converged(predicted);
        break;
      }
    }
    search.advance(family.evaluate(search.u, search.near(), eps, search.tol));
  }
  return search.solution();
}

}  // namespace detail
TROLL_END_NAMESPACE
