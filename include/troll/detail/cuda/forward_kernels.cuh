// troll/detail/cuda/forward_kernels.cuh — the forward kernels (log_softmax, KL, projection), one
// block per row. The projection runs the shared host/device solve_row in every thread of the
// block at once; its evaluator is a block-wide reduction of lse_state, broadcast to all threads,
// so every thread sees the same numbers and takes the same Newton path.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../trust_region_solver.hpp"
#include "block_reduce.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Adds token (a = z̃_i, b = z°_i) to a tilted-family reduction at u when both are finite.
TROLL_HOST_DEVICE inline void push_tilt_token(lse_state& local, double a, double b, const tilt_ref& ref,
                                              const tilt_param& u) {
  if (a > neg_inf() && b > neg_inf()) {
    const double x = tilt_centred(a, b, ref);
    push_pair(local, tilt_weight(a, b, x, ref, u), x, a, b);
  }
}

/// The tilted family's sums over one row by a team of device threads (a block or a warp), for
/// an evaluator with e.for_each_pair(f) (f(z̃_i, z°_i) for this thread's share of the row) and
/// e.team_reduce(state) (the team's lse_state reduction). Host-and-device only so that
/// solve_row's host instantiation type-checks; only ever called from device code.
template <class Eval>
TROLL_HOST_DEVICE lse_state team_tilt_sums(const Eval& e, const tilt_param& u, const tilt_ref& ref) {
#ifdef __CUDA_ARCH__
  lse_state local;
  e.for_each_pair([&](double a, double b) { push_tilt_token(local, a, b, ref, u); });
  return e.team_reduce(local);
#else
  (void)e, (void)u, (void)ref;
  return lse_state{};
#endif
}

/// Σ_i term(z̃_i, z°_i, p) over the row as a team sum; the sum travels through the lse_state
/// reduction as s0 of states with m = 0.
template <class Eval, class Term>
TROLL_HOST_DEVICE double team_point_sum(const Eval& e, const tilt_point& p, Term term) {
#ifdef __CUDA_ARCH__
  double sum = 0.0;
  e.for_each_pair([&](double a, double b) { sum += term(a, b, p); });
  lse_state part;
  part.m = 0.0, part.s0 = sum;
  return e.team_reduce(part).s0;
#else
  (void)e, (void)p, (void)term;
  return 0.0;
#endif
}

/// KL(π‖q) at an evaluated point as a team sum of non-negative kl_terms (tilt_family.hpp).
template <class Eval>
TROLL_HOST_DEVICE double team_exact_kl(const Eval& e, const tilt_point& p) {
  return team_point_sum(e, p, [](double a, double b, const tilt_point& at) { return kl_term(a, b, at); });
}

/// Σ ratio_term at an evaluated point, as a team sum (the solver's refine_a_c).
template <class Eval>
TROLL_HOST_DEVICE double team_ratio_sum(const Eval& e, const tilt_point& p) {
  return team_point_sum(e, p, [](double a, double b, const tilt_point& at) { return ratio_term(a, b, at); });
}

/// The tilted-family reduction of trust_region_solver.hpp over one row, by the whole block:
/// pairs w_i = (z°_i − M°) + t·x_i, x_i = d_i − c over the joint support (see that header).
template <class T>
struct block_tilt_evaluator {
  const T* new_logits;
  const T* old_logits;
  std::size_t size;
  double old_max;
  double log_sum_old;  // log Σ_i exp(z°_i − M°), from the row scan
  reduce_storage<lse_state>* storage;

  /// The solver's `old_log_sum()`: already known from the scan, no extra pass.
  TROLL_HOST_DEVICE double old_log_sum() const { return log_sum_old; }

  /// f(z̃_i, z°_i) for this thread's tokens i of the row.
  template <class F>
  __device__ void for_each_pair(F&& f) const {
    for (std::size_t i = threadIdx.x; i < size; i += block_threads)
      f(static_cast<double>(new_logits[i]), static_cast<double>(old_logits[i]));
  }
  __device__ lse_state team_reduce(const lse_state& s) const { return block_all_reduce(*storage, s, merge_lse{}); }

  TROLL_HOST_DEVICE lse_state operator()(const tilt_param& u, const tilt_ref& ref) const {
    return team_tilt_sums(*this, u, ref);
  }
  TROLL_HOST_DEVICE double exact_kl(const tilt_point& p) const { return team_exact_kl(*this, p); }
  TROLL_HOST_DEVICE double ratio_sum(const tilt_point& p) const { return team_ratio_sum(*this, p); }

  /// out_i = log π_t,i = w_i − log_norm at the evaluated point `p`; −inf off the joint support.
  __device__ void write(const tilt_point& p, T* out) const {
    const tilt_param u{p.t, p.s};
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double a = static_cast<double>(new_logits[i]);
      const double b = static_cast<double>(old_logits[i]);
      double value = neg_inf();
      if (a > neg_inf() && b > neg_inf())  // a log-probability: at most 0, as on the CPU
        value = minimum(tilt_weight(a, b, tilt_centred(a, b, p.ref), p.ref, u) - p.log_norm, 0.0);
      out[i] = static_cast<T>(value);
    }
  }
};

/// The statistics of a row that was not solved: every number NaN; status infeasible when the
/// trust region holds no reachable π (disjoint supports, new-side masks), rejected for bad input.
__device__ inline projection_stats rejected_stats(cuda_row_error error) {
  projection_stats s;
  s.eta = s.t = s.kl_before = s.kl_after = s.mu = s.sigma2 = quiet_nan();
  s.iterations = 0;
  const bool no_solution = error == cuda_row_error::disjoint || error == cuda_row_error::infeasible;
  s.status = no_solution ? row_status::infeasible : row_status::rejected;
  return s;
}

/// out = (z − M) − log Σ e^{z−M} from a finished scan of z.
template <class T>
__device__ void write_log_softmax(const T* z, const lse_state& lse, std::size_t size, T* out) {
  const double log_sum = ::log(lse.s0);
  for (std::size_t i = threadIdx.x; i < size; i += block_threads)
    out[i] = static_cast<T>((static_cast<double>(z[i]) - lse.m) - log_sum);
}

/// Rows of `range`: out = log_softmax(logits).
template <class T>
__global__ void __launch_bounds__(block_threads)
    log_softmax_kernel(batch_view<const T> logits, batch_view<T> out, row_range range,
                       device_checks checks) {
  __shared__ reduce_storage<row_scan> scan_storage;
  const std::size_t size = logits.cols, end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const T* z = logits.row(r);
    const row_scan scan = scan_row(z, size, scan_storage);
    const cuda_row_report report = single_problem(scan, z);
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    if (report.error != cuda_row_error::none) {
      fill_nan(out.row(r), size);
    } else {
      write_log_softmax(z, scan.lse, size, out.row(r));
    }
  }
}

/// A KL row's value (kl_kernel, sparse_kl_kernel): NaN for a rejected row, +inf where the new
/// side has mass the old lacks, else the KL at t = 1 by the team evaluator make_eval() gives.
template <class MakeEval>
__device__ double kl_row_value(const pair_scan& scan, const cuda_row_report& report, MakeEval&& make_eval) {
  double value = quiet_nan();
  if (report.error == cuda_row_error::none) {
    if (scan.new_only) {
      value = inf();
    } else {
      value = evaluate_at_one(make_eval(), make_setup(scan), old_log_sum(scan)).kl;
    }
  }
  return value;
}

/// Rows of `range`: kl_out[r] = KL(softmax(p) ‖ softmax(q)), +inf where p has mass q lacks.
template <class T>
__global__ void __launch_bounds__(block_threads)
    kl_kernel(batch_view<const T> p_logits, batch_view<const T> q_logits, T* kl_out, row_range range,
              device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  const std::size_t size = p_logits.cols;
  for_each_pair_row(p_logits, q_logits, range,
                    [&](std::size_t r, const T* zp, const T* zq, const pair_scan& scan) {
    const cuda_row_report report = kl_pair_problem(scan, zp, zq);
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) return;
    const double value = kl_row_value(scan, report, [&] {
      return block_tilt_evaluator<T>{zp, zq, size, scan.old.lse.m, old_log_sum(scan), &lse_storage};
    });
    if (threadIdx.x == 0) kl_out[r] = static_cast<T>(value);
  });
}

/// The solve of a row whose report is still none (others are skipped): an infeasible result
/// becomes the row's report (the value: the KL reached).
template <class Eval>
__device__ solve_result solve_checked_row(const Eval& eval, const row_setup& setup, double eps,
                                          const projection_options& options, cuda_row_report& report) {
  solve_result result;
  if (report.error == cuda_row_error::none) {
    result = solve_row(eval, setup, eps, options);
    if (result.status == row_status::infeasible)
      report.error = cuda_row_error::infeasible, report.value = result.point.kl;
  }
  return result;
}

/// The computing pass of a row after its checks: solve_checked_row, the row's record, then
/// either NaN and the rejected stats (the report is not none; the caller returns) or log π*
/// (the solved row's stats are the caller's to write, from the result).
template <class T>
__device__ solve_result solve_and_write_row(const block_tilt_evaluator<T>& eval, const row_setup& setup,
                                            const pair_scan& scan, double eps, const projection_options& options,
                                            cuda_row_report& report, device_checks checks, row_range range,
                                            std::size_t r, T* out, projection_stats* stats) {
  const solve_result result = solve_checked_row(eval, setup, eps, options, report);
  if (threadIdx.x == 0) record_row(checks, range, r, report);
  if (report.error != cuda_row_error::none) {
    fill_nan(out, eval.size);
    if (threadIdx.x == 0) stats[r] = rejected_stats(report.error);
    return result;
  }
  if (result.status == row_status::inactive) {
    write_log_softmax(eval.new_logits, scan.fresh.lse, eval.size, out);
  } else {
    eval.write(result.point, out);
  }
  return result;
}

/// The validation pass's infeasibility check of a row the old logits partly mask: the floor
/// −log q(J) = KL at t → 0 must be below ε (else report infeasible with the floor).
template <class Eval>
__device__ void check_feasible(const Eval& eval, const row_setup& setup, double log_sum_old, double eps,
                               cuda_row_report& report) {
  if (report.error == cuda_row_error::none && setup.old_only) {
    const double floor = evaluate_at_zero(eval, setup, log_sum_old).kl;
    if (floor >= eps) report.error = cuda_row_error::infeasible, report.value = floor;
  }
}

/// Rows of `range`: the trust-region projection (see troll::project). With
/// checks.validate_only, only the CPU's pre-write validation runs (including the
/// infeasibility floor −log q(J) ≥ ε) and nothing is written but the reports.
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    project_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits, double eps,
                   projection_options options, batch_view<T> out_log_probs, projection_stats* stats,
                   row_range range, device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    T* out = out_log_probs.row(r);
    cuda_row_report report = pair_problem(scan, zn, zo);
    const row_setup setup = make_setup(scan);
    const double log_sum_old = old_log_sum(scan);
    const block_tilt_evaluator<T> eval{zn, zo, size, setup.old_max, log_sum_old, &lse_storage};

    if (checks.validate_only) {
      check_feasible(eval, setup, log_sum_old, eps, report);
      if (threadIdx.x == 0) record_row(checks, range, r, report);
      return;
    }

    const solve_result result =
        solve_and_write_row(eval, setup, scan, eps, options, report, checks, range, r, out, stats);
    if (report.error != cuda_row_error::none) return;
    if (threadIdx.x == 0) stats[r] = make_stats(result);
  });
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
