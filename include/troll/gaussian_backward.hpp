// troll/gaussian_backward.hpp — the analytic backward (VJP) of the Gaussian projections of
// troll/gaussian.hpp, by the implicit function theorem on KL(π_t* ‖ q) = ε: gradients w.r.t.
// the new and old means and covariance factors (or standard deviations) and the bounds.
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_backward_kernels.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/gaussian_checks.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

template <class T>
void check_gradient_view(const char* function, const char* name, batch_view<T> view, batch_view<const T> like) {
  if (view.data == nullptr) return;
  check_view(function, name, view);
  check_same_shape(function, name, view, "its input", like);
}

/// The checks every Gaussian derivative (backward, JVP) runs after its shapes: stats given, the
/// bounds, and (after `before_rows`, which may throw) every row's values and forward statistics,
/// which must be solved (inactive or projected). `what` names the derivative in the message.
template <class T, class BeforeRows>
void check_gaussian_derivative(unsigned threads, const gaussian_call& call, batch_view<const T> mean,
                               batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                               double eps_mean, double eps_cov, const gaussian::gaussian_stats* stats,
                               const char* what, BeforeRows before_rows) {
  const char* fn = call.function;
  if (stats == nullptr && mean.rows != 0) throw_shape(fn, "stats is a null pointer");
  check_eps(fn, eps_mean);
  if (call.split) check_eps(fn, eps_cov);
  before_rows();
  validate_gaussian_rows(threads, call, mean, cov, old_mean, old_cov);
  for (std::size_t r = 0; r < mean.rows; ++r) {
    if (!stats[r].solved() || !(stats[r].t > 0.0 && stats[r].t <= 1.0))
      throw domain_error(row_prefix(fn, r) + "forward statistics are unusable: status " +
                             status_name(stats[r].status) + ", t = " + std::to_string(stats[r].t) + " (" + what +
                             " needs a solved row: inactive or projected)",
                         r);
  }
}

/// The shape checks of a Gaussian derivative: the forward's inputs and outputs, the derivative's
/// two dense views (upstream gradients or output tangents), and the four optional per-input views
/// of `extra` (gaussian_grads or gaussian_tangents; empty ones skipped) under `names`.
template <class T, class U, class Extra>
gaussian_call check_derivative_shapes(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                      batch_view<const T> old_mean, batch_view<const T> old_cov,
                                      batch_view<const T> out_mean, batch_view<const T> out_cov,
                                      batch_view<U> dense_mean, batch_view<U> dense_cov, const Extra& extra,
                                      const char* const names[4]) {
  call = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov);
  check_gaussian_arguments(call, mean, cov, old_mean, old_cov, dense_mean, dense_cov);
  check_gradient_view<const T>(call.function, names[0], extra.mean, mean);
  check_gradient_view<const T>(call.function, names[1], extra.cov, cov);
  check_gradient_view<const T>(call.function, names[2], extra.old_mean, old_mean);
  check_gradient_view<const T>(call.function, names[3], extra.old_cov, old_cov);
  return call;
}

/// Row r of a view, or null for an empty (skipped) view.
template <class T>
T* row_or_null(batch_view<T> v, std::size_t r) {
  return v.data == nullptr ? nullptr : v.row(r);
}

/// Runs a Gaussian derivative's row kernel over every row in parallel: full(…) or diag(…) with
/// (split, d, the four input rows, eps_mean, t, io_of(r)), t the forward's t* (1 on inactive rows).
template <class T, class IoOf, class Full, class Diag>
void for_each_solved_row(unsigned threads, const gaussian_call& call, batch_view<const T> mean,
                         batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                         double eps_mean, const gaussian::gaussian_stats* stats, IoOf io_of, Full full, Diag diag) {
  const std::size_t work = call.full ? 200 * call.dim * call.dim * call.dim : 200 * call.dim;
  cpu::parallel_for(threads, mean.rows, work, [&](std::size_t r) {
    const double t = stats[r].status == row_status::inactive ? 1.0 : stats[r].t;
    if (call.full) {
      full(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), eps_mean, t, io_of(r));
    } else {
      diag(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), eps_mean, t, io_of(r));
    }
  });
}

template <class T>
void project_gaussian_backward(cpu_policy policy, gaussian_call call, batch_view<const T> mean,
                               batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                               double eps_mean, double eps_cov, batch_view<const T> out_mean,
                               batch_view<const T> out_cov, const gaussian::gaussian_stats* stats,
                               batch_view<const T> grad_out_mean, batch_view<const T> grad_out_cov,
                               const gaussian::gaussian_grads<T>& grads) {
  require_float_type<T>();
  static const char* const names[4] = {"grads.mean", "grads.cov", "grads.old_mean", "grads.old_cov"};
  call = check_derivative_shapes(call, mean, cov, old_mean, old_cov, out_mean, out_cov, grad_out_mean, grad_out_cov,
                                 grads, names);
  check_gaussian_derivative(policy.threads, call, mean, cov, old_mean, old_cov, eps_mean, eps_cov, stats,
                            "the backward", [] {});
  for_each_solved_row(
      policy.threads, call, mean, cov, old_mean, old_cov, eps_mean, stats,
      [&](std::size_t r) {
        return cpu::gaussian_row_grads<T>{out_mean.row(r),
                                          out_cov.row(r),
                                          grad_out_mean.row(r),
                                          grad_out_cov.row(r),
                                          row_or_null(grads.mean, r),
                                          row_or_null(grads.cov, r),
                                          row_or_null(grads.old_mean, r),
                                          row_or_null(grads.old_cov, r),
                                          grads.eps == nullptr ? nullptr : grads.eps + r,
                                          grads.eps_mean == nullptr ? nullptr : grads.eps_mean + r};
      },
      [](auto&&... a) { cpu::gaussian_backward_full(a...); }, [](auto&&... a) { cpu::gaussian_backward_diag(a...); });
}

}  // namespace detail

namespace gaussian {

/// The VJP of project_joint: given the forward's inputs, outputs and stats and the upstream
/// gradients ∂L/∂μ* and ∂L/∂L* (lower triangle read), writes ∂L/∂ of every input named in
/// `grads` (factor gradients lower-triangular) and ∂L/∂ε per row. Rows must be solved (inactive
/// or projected); a not_converged row throws domain_error naming it, before anything is written.
/// O(d³) per row.
template <class T>
void project_joint_backward(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_joint_backward", true, false},
                                    mean, cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol, stats,
                                    grad_out_mean, grad_out_cov_chol, grads);
}

/// The VJP of project_split (grads.eps: ∂L/∂ε_Σ, grads.eps_mean: ∂L/∂ε_μ).
template <class T>
void project_split_backward(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_split_backward", true, true},
                                    mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean, out_cov_chol,
                                    stats, grad_out_mean, grad_out_cov_chol, grads);
}

/// The VJP of project_joint_diag (standard deviations; O(d) per row).
template <class T>
void project_joint_diag_backward(cpu_policy policy, input_view<T> mean, input_view<T> std_dev,
                                 input_view<T> old_mean, input_view<T> old_std_dev, double eps,
                                 input_view<T> out_mean, input_view<T> out_std_dev, const gaussian_stats* stats,
                                 input_view<T> grad_out_mean, input_view<T> grad_out_std_dev,
                                 const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy,
                                    detail::gaussian_call{"gaussian::project_joint_diag_backward", false, false},
                                    mean, std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev, stats,
                                    grad_out_mean, grad_out_std_dev, grads);
}

/// The VJP of project_split_diag.
template <class T>
void project_split_diag_backward(cpu_policy policy, input_view<T> mean, input_view<T> std_dev,
                                 input_view<T> old_mean, input_view<T> old_std_dev, double eps_mean, double eps_cov,
                                 input_view<T> out_mean, input_view<T> out_std_dev, const gaussian_stats* stats,
                                 input_view<T> grad_out_mean, input_view<T> grad_out_std_dev,
                                 const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy,
                                    detail::gaussian_call{"gaussian::project_split_diag_backward", false, true},
                                    mean, std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev,
                                    stats, grad_out_mean, grad_out_std_dev, grads);
}

}  // namespace gaussian
TROLL_END_NAMESPACE
