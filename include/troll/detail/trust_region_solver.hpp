// troll/detail/trust_region_solver.hpp — the scalar part of the categorical projection, written
// once for host and device: a row as a family of the safeguarded Newton solve for t* ∈ (0, 1]
// with KL(π_t* ‖ q) = ε (family_solver.hpp; math.md §2; docs/math.md "Convergence").
//
// A row is seen only through an evaluator with
//     lse_state operator()(tilt_param u, tilt_ref r)  the reduction over J of the pairs (w_i, x_i)
//                                                      of tilt_family.hpp, by push_pair;
//     double exact_kl(const tilt_point& p)             Σ_i kl_term at an evaluated point;
//     double ratio_sum(const tilt_point& p)            Σ_i ratio_term at an evaluated point;
//     double old_log_sum()                             log Σ_i exp(z°_i − M°) (all old tokens).
// The reference r is a token of J: the arg-max of z° at t = 0, of z̃ at t = 1, and the mode of
// the last evaluation in between, so that every w and x stays the size of the row's logit
// differences around its mode.
#pragma once

#include <cmath>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "family_solver.hpp"
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
  double x_range = inf();      // ≥ max − min of z̃ − z° over J (CPU scan of an all-finite pair; +inf: unknown)
};

struct solve_result {
  tilt_point point;  // the evaluated member the row is written from
  double kl_before = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;
};

/// eval(u, ref, true) where the evaluator can also form the third and fourth moments (s3, s4),
/// else eval(u, ref).
template <class Eval, class = void>
struct forms_cumulants : std::false_type {};
template <class Eval>
struct forms_cumulants<Eval, decltype(void(std::declval<const Eval&>()(tilt_param{}, tilt_ref{}, true)))>
    : std::true_type {};
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE lse_state reduce(const Eval& eval, const tilt_param& u, const tilt_ref& ref, bool cumulants) {
  if constexpr (forms_cumulants<Eval>::value) {
    return eval(u, ref, cumulants);
  } else {
    (void)cumulants;
    return eval(u, ref);
  }
}

/// Whether the evaluator reduces both ends at once: eval.ends(zero_ref, one_ref, cumulants, zero,
/// one) returns true with the states eval(tilt_at(0), zero_ref) and eval(tilt_at(1), one_ref)
/// would give (bit for bit), or false where it cannot (the CPU's one-pass kernel for the common
/// pair; the CUDA evaluators reduce each end on its own).
template <class Eval, class = void>
struct reduces_ends : std::false_type {};
template <class Eval>
struct reduces_ends<Eval, decltype(void(std::declval<const Eval&>().ends(
                              tilt_ref{}, tilt_ref{}, true, std::declval<lse_state&>(), std::declval<lse_state&>())))>
    : std::true_type {};

/// The reductions of the two ends, t = 0 relative to setup.old_top and t = 1 relative to
/// setup.new_top (with κ₃, κ₄ where `cumulants`): in one pass where the evaluator offers it.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE void reduce_ends(const Eval& eval, const row_setup& setup, bool cumulants, lse_state& zero,
                                   lse_state& one) {
  if constexpr (reduces_ends<Eval>::value) {
    if (eval.ends(setup.old_top, setup.new_top, cumulants, zero, one)) return;
  }
  zero = reduce(eval, tilt_at(0.0), setup.old_top, cumulants);
  one = reduce(eval, tilt_at(1.0), setup.new_top, cumulants);
}

/// Corrects p.a_c by log1p(Σ ratio_term) (tilt_family.hpp) where its rounding could matter to the
/// cancellation-free KL: an error δ in a_c moves Σ q φ(σ) by δ·KL + φ(δ) ≈ δ·KL + δ²/2, and with
/// a_c formed from log-sums (δ up to a_error, ~1e-15) the δ²/2 alone is ~1e-31, which at a tiny ε
/// (below ~1e-20) is larger than the KL's tolerance: the solver then converged on a wrong KL
/// (t* 25% off at ε = 1e-200, reported `projected`). Runs only where a_error²/2 exceeds `slack`:
/// never on rows with ε ≥ 1e-12 at the default tolerance (a_error is ~1e-13 on rows of 151,936
/// logits: a_error²/2 ≈ 7e-27 against a thousandth of 1e-11·ε).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE void refine_a_c(const Eval& eval, tilt_point& p, double slack) {
  if (!(0.5 * p.a_error * p.a_error > slack)) return;
  const double s = eval.ratio_sum(p);
  if (s > -0.5 && s < 0.5) {
    p.a_c += ::log1p(s);
    p.a_error = 0.0;
  }
}

/// Replaces p.kl by the cancellation-free sum (a_c refined first where `slack` asks for it).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE void make_exact(const Eval& eval, tilt_point& p, double slack) {
  refine_a_c(eval, p, slack);
  p.kl = eval.exact_kl(p);
  p.kl_error = 0.0;
  p.sum_error = 0.0;
}

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
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate_from(const Eval& eval, lse_state st, const tilt_param& u, tilt_ref ref,
                                           double old_max, double old_log_sum, double eps, double tol,
                                           bool cumulants = false, bool joint_old = false) {
  if (st.m > 64.0) {
    ref = tilt_ref{st.ref_new, st.ref_old};
    st = reduce(eval, u, ref, cumulants);
  }
  tilt_point p = make_point(st, u, ref, old_max, old_log_sum, joint_old);
  const double error = p.kl_error + p.sum_error;  // every rounding the closed form can carry
  const bool fine = error <= 2.0 * tol;  // then |KL − ε| ≤ 3 tol: inside the 1e-10 guarantee
  const bool decided = ::fabs(p.kl - eps) > tol + error && p.kl > 1e3 * error;
  if (!(fine || decided)) make_exact(eval, p, 1e-3 * tol);
  return p;
}

/// evaluate_from of the reduction eval(u, ref).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate(const Eval& eval, const tilt_param& u, tilt_ref ref, double old_max,
                                      double old_log_sum, double eps, double tol, bool cumulants = false,
                                      bool joint_old = false) {
  return evaluate_from(eval, reduce(eval, u, ref, cumulants), u, ref, old_max, old_log_sum, eps, tol, cumulants,
                       joint_old);
}

/// Replaces p.kl by the cancellation-free sum unless the closed form is good to 1e-11 relative
/// (kl_error: sums that round like a random walk; the statistics kl_before and kl_after). A
/// decision against ε reads the worst case too (decide_against).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE void settle_kl(const Eval& eval, tilt_point& p) {
  if (!(p.kl_error <= 1e-11 * p.kl)) make_exact(eval, p, 1e-13 * maximum(p.kl, 0.0));
  p.kl = maximum(p.kl, 0.0);
}

/// Makes p.kl exact where the closed form's worst case (kl_error + sum_error) leaves its side of
/// ε open: which end of the bracket holds ε, whether a row is inactive or infeasible.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE void decide_against(const Eval& eval, tilt_point& p, double eps) {
  if (p.kl_error + p.sum_error == 0.0 || ::fabs(p.kl - eps) > p.kl_error + p.sum_error) return;
  make_exact(eval, p, 1e-13 * maximum(p.kl, 0.0));
  p.kl = maximum(p.kl, 0.0);
}

/// KL(π_1 ‖ q) = KL(p̃ ‖ q) to 1e-11 relative (the t = 1 member; p̃ restricted to J when the
/// old row masks some of its tokens).
/// The t = 1 member from its reduction state = eval(tilt_at(1), setup.new_top).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE tilt_point one_point(const Eval& eval, const row_setup& setup, const lse_state& state,
                                       double old_log_sum) {
  tilt_point p = make_point(state, tilt_at(1.0), setup.new_top, setup.old_max, old_log_sum);
  settle_kl(eval, p);
  return p;
}

#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate_at_one(const Eval& eval, const row_setup& setup, double old_log_sum) {
  return one_point(eval, setup, eval(tilt_at(1.0), setup.new_top), old_log_sum);
}

/// The t = 0 member (π_0 = q restricted to J) from its reduction, with KL(π_0+ ‖ q) = −log q(J),
/// the least KL any admissible π reaches (0 unless the new row masks old mass), to 1e-11
/// relative.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
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

#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE tilt_point evaluate_at_zero(const Eval& eval, const row_setup& setup, double old_log_sum) {
  return zero_point(eval, setup, eval(tilt_at(0.0), setup.old_top), old_log_sum);
}

/// A categorical row as a family of solve_bracketed: each member relative to the mode of the
/// member evaluated before it, dKL/dt = t·Var_πt[d].
template <class Eval>
struct categorical_family {
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
  const Eval& eval;
  double old_max;
  double old_log_sum;
  double x_range;  // row_setup::x_range (+inf: unknown, nothing is predicted)
  bool joint_old = false;  // members against q_J, old_log_sum over J (solve_above_floor)
  /// The member at u. Where it lies within |Δt|·L ≤ 0.1 of the member evaluated before it (a
  /// Newton step that has nearly converged: the next one is likely small enough to predict), the
  /// reduction also forms the third and fourth cumulants that predict() needs.
  TROLL_HOST_DEVICE tilt_point evaluate(const tilt_param& u, const tilt_point& near, double eps, double tol) const {
    const double step = u.t <= 0.5 && near.t <= 0.5 ? u.t - near.t : near.s - u.s;
    // The first member from ends that formed κ₃, κ₄ (the septic start, first_guess) is
    // typically within ~1e-6 / L of t*: its cumulants let the next member be predicted.
    const bool from_end = (near.t == 0.0 || near.s == 0.0) && near.kappa3 - near.kappa3 == 0.0;
    const bool cumulants = ::fabs(step) * x_range <= 0.1 || from_end;
    return detail::evaluate(eval, u, near.mode, old_max, old_log_sum, eps, tol, cumulants, joint_old);
  }
  /// The converged member at u from the last evaluated one without a pass (predict_member).
  TROLL_HOST_DEVICE bool predict(const tilt_point& last, const tilt_param& u, double eps, double tol,
                                 tilt_point& out) const {
    return predict_member(last, u, x_range, eps, tol, out);
  }
};

/// log Σ_i exp(z°_i − M°) over every old token, from the t = 0 reduction: π_0 = q restricted
/// to J, whose normaliser is log q's (relative to M°) whenever J covers supp q.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE double ends_old_log_sum(const Eval& eval, const row_setup& setup, const lse_state& zero_state) {
  return setup.old_only ? eval.old_log_sum() : zero_state.log_sum() + (setup.old_top.zo - setup.old_max);
}

/// Decides a row from its two ends: false with r final (inactive or restricted: KL(p̃‖q) ≤ ε;
/// infeasible: KL(π_0+‖q) ≥ ε), true with r.kl_before set when the bracketed solve must run.
TROLL_HOST_DEVICE inline bool needs_solve(const row_setup& setup, const tilt_point& at_zero,
                                          const tilt_point& at_one, double eps, solve_result& r) {
  r.kl_before = setup.new_only ? inf() : at_one.kl;
  r.point = at_one;
  if (at_one.kl <= eps) {
    r.status = setup.new_only ? row_status::restricted : row_status::inactive;
    return false;
  }
  if (at_zero.kl >= eps) {
    r.status = row_status::infeasible;
    r.point = at_zero;
    return false;
  }
  return true;
}

/// The result of a row whose bracketed solve ended.
template <class Point>
TROLL_HOST_DEVICE void take_solution(const bracket_solution<Point>& solved, solve_result& r) {
  r.point = solved.point;
  r.iterations = solved.iterations;
  r.status = solved.converged ? row_status::projected : row_status::not_converged;
}

/// The bracketed solve of a row whose new logits mask old mass (setup.old_only), on the distance
/// from its floor. There K(t) = KL(π_t ‖ q) = −log q(J) + KL(π_t ‖ q_J), q_J the old row
/// restricted to J and renormalised (Σ_J π_t = 1), so the solve runs on the second term against
/// ε_J = ε + log q(J), with every member formed relative to q_J (old_log_sum over J, no old-only
/// terms in the cancellation-free sums). Its tolerance atol + rtol·ε_J is then relative to the
/// distance from the floor: a tolerance on K itself spans most of K − floor where ε is close to
/// the floor, and t* (and every derivative) was loose by as much (6.6e-2 at ε/floor − 1 = 1e-13,
/// an audit of the twenty-fifth session). The floor's rounding adds to the solve's: it is taken
/// to half the new tolerance and to atol + rtol·floor, so that |K − ε| stays within atol + rtol·ε
/// (the cancellation-free sum where the closed form's bound is coarser: one more pass over the
/// row, on rows near their floor; with a tenth instead, every such row paid it, 2.5× the time of
/// a V = 151,936 row with new-side masks), and the solution is handed back against q: a_c and the
/// KL shift by the floor. False, with r untouched, where the bracket
/// 0 < ε_J < KL(π_1 ‖ q_J) does not hold in floating point (ε a rounding away from the floor or
/// from KL(π_1 ‖ q)); the caller then solves against q.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE bool solve_above_floor(const Eval& eval, const row_setup& setup, const lse_state& zero_state,
                                         const lse_state& one_state, tilt_point floor_point, double old_log_sum,
                                         double eps, const projection_options& opt, solve_result& r) {
  const double slack = minimum(0.5 * (opt.atol + opt.rtol * (eps - floor_point.kl)),
                               opt.atol + opt.rtol * floor_point.kl);
  if (!(floor_point.kl_error + floor_point.sum_error <= slack)) {
    refine_a_c(eval, floor_point, slack);
    floor_point.kl = eval.exact_kl(floor_point);
  }
  const double floor = floor_point.kl, eps_joint = eps - floor;
  const double joint_log_sum = zero_state.log_sum() + (setup.old_top.zo - setup.old_max);
  tilt_point zero = make_point(zero_state, tilt_at(0.0), setup.old_top, setup.old_max, joint_log_sum, true);
  zero.kl = 0.0;
  zero.kl_error = 0.0;
  tilt_point one = make_point(one_state, tilt_at(1.0), setup.new_top, setup.old_max, joint_log_sum, true);
  settle_kl(eval, one);
  decide_against(eval, one, eps_joint);
  if (!(eps_joint > 0.0 && one.kl > eps_joint && floor > 0.0)) return false;
  bracket_solution<tilt_point> solved = solve_bracketed(
      categorical_family<Eval>{eval, setup.old_max, joint_log_sum, setup.x_range, true}, zero, one, eps_joint, opt);
  tilt_point& p = solved.point;
  p.joint_old = false;
  p.old_log_sum = old_log_sum;
  p.a_c = p.log_norm + (p.ref.zo - setup.old_max) - old_log_sum;
  p.kl += floor;
  take_solution(solved, r);
  return true;
}

/// Solves one row. Never throws: an infeasible row (q's mass on J is at most e^{−ε}) comes back
/// with status infeasible and the t → 0 end as its point; a row not brought within the
/// tolerance |KL − ε| ≤ atol + rtol·ε comes back not_converged with its best feasible member
/// (KL < ε) as the point. The ends t = 0 and t = 1 are evaluated here; the bracketed Newton
/// solve between them is family_solver.hpp's, each member one pass over the row (two where the
/// closed-form KL is too coarse for the decision at hand).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Eval>
TROLL_HOST_DEVICE solve_result solve_row(const Eval& eval, const row_setup& setup, double eps,
                                         const projection_options& opt) {
  solve_result r;
  // The ends, in one pass where the evaluator can: t = 0's normaliser gives log q's, both
  // variances seed the first Newton guess.
  // Where the step to t* can be predicted (L known: the CPU's finite rows, dense and sparse
  // alike), the ends also form κ₃ and κ₄ for the septic first guess (first_guess,
  // family_solver.hpp); evaluators that cannot form them (CUDA's) ignore the request.
  const bool cumulants = setup.x_range < inf();
  lse_state zero_state, one_state;
  reduce_ends(eval, setup, cumulants, zero_state, one_state);
  const double old_log_sum = ends_old_log_sum(eval, setup, zero_state);
  tilt_point at_zero = zero_point(eval, setup, zero_state, old_log_sum);
  tilt_point at_one = one_point(eval, setup, one_state, old_log_sum);
  // inactive (KL(p̃‖q) ≤ ε) and infeasible (the floor ≥ ε) against the closed forms' worst case
  decide_against(eval, at_one, eps);
  if (setup.old_only) decide_against(eval, at_zero, eps);
  if (!needs_solve(setup, at_zero, at_one, eps, r)) return r;
  if (setup.old_only && solve_above_floor(eval, setup, zero_state, one_state, at_zero, old_log_sum, eps, opt, r))
    return r;
  take_solution(
      solve_bracketed(categorical_family<Eval>{eval, setup.old_max, old_log_sum, setup.x_range}, at_zero, at_one,
                      eps, opt),
      r);
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
