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
#include "detail/cpu/gaussian_derivative_rows.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The CPU's rows of a Gaussian backward after its argument checks (gaussian_derivative_call.hpp).
template <class T>
void gaussian_vjp_rows(cpu_policy policy, const gaussian_call& call, const gaussian_vjp_launch<T>& k,
                       gaussian::saved_factorisation<const double> saved) {
  cpu::gaussian_derivative_rows(
      policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.eps_mean, k.stats, saved, "backward",
      [&](std::size_t r) { return vjp_row_io(k.out_cov, k.grad_out_mean, k.grad_out_cov, k.grads, r); },
      &cpu::gaussian_backward_full<T>, &cpu::gaussian_backward_diag<T>);
}

}  // namespace detail

namespace gaussian {

/// The VJP of project_joint: given the forward's inputs, outputs and stats and the upstream
/// gradients ∂L/∂μ* and ∂L/∂L* (lower triangle read), writes ∂L/∂ of every input named in
/// `grads` (factor gradients lower-triangular) and ∂L/∂ε per row. Rows must be solved (inactive
/// or projected); a not_converged row throws domain_error naming it, before anything is written.
/// O(d³) per row; `saved` (optional): the factorisation the forward of these inputs saved
/// (gaussian_types.hpp), read instead of recomputed.
template <class T>
void project_joint_backward(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads,
                            saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_joint_backward", true, false},
                                    mean, cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol, stats,
                                    grad_out_mean, grad_out_cov_chol, grads, saved);
}

/// The VJP of project_split (grads.eps: ∂L/∂ε_Σ, grads.eps_mean: ∂L/∂ε_μ).
template <class T>
void project_split_backward(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads,
                            saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_split_backward", true, true},
                                    mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean, out_cov_chol,
                                    stats, grad_out_mean, grad_out_cov_chol, grads, saved);
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
