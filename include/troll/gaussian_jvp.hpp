// troll/gaussian_jvp.hpp — the analytic JVP (forward-mode derivative) of the Gaussian projections
// of troll/gaussian.hpp, by the implicit function theorem on KL(π_t* ‖ q) = ε: the tangent of
// the projected mean and covariance factor (or standard deviations) along tangents of all inputs
// and the bounds.
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_jvp_kernels.hpp"
#include "detail/cpu/gaussian_derivative_rows.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_backward.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The CPU's rows of a Gaussian JVP after its argument checks (gaussian_derivative_call.hpp);
/// out_cov: the forward's output factor (read).
template <class T>
void gaussian_jvp_rows(cpu_policy policy, const gaussian_call& call, const gaussian_jvp_launch<T>& k,
                       batch_view<const T> out_cov, gaussian::saved_factorisation<const double> saved) {
  cpu::gaussian_derivative_rows(
      policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.eps_mean, k.stats, saved, "JVP",
      [&](std::size_t r) { return jvp_row_io(out_cov, k.tangents, k.out_mean, k.out_cov, r); },
      &cpu::gaussian_jvp_full<T>, &cpu::gaussian_jvp_diag<T>);
}

}  // namespace detail

namespace gaussian {

/// The JVP of project_joint: given the forward's inputs, outputs and stats and the input
/// tangents (tangents.eps: ε'), writes the tangents of μ* and L* (lower-triangular). Rows must
/// be solved; a not_converged row throws domain_error naming it, before anything is written.
/// O(d³) per row.
template <class T>
void project_joint_jvp(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                       input_view<T> old_cov_chol, double eps, input_view<T> out_mean, input_view<T> out_cov_chol,
                       const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                       batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov_chol,
                       saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_joint_jvp", true, false}, mean,
                               cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol, stats, tangents,
                               tangent_out_mean, tangent_out_cov_chol, saved);
}

/// The JVP of project_split (tangents.eps: ε_Σ', tangents.eps_mean: ε_μ').
template <class T>
void project_split_jvp(cpu_policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                       input_view<T> old_cov_chol, double eps_mean, double eps_cov, input_view<T> out_mean,
                       input_view<T> out_cov_chol, const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                       batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov_chol,
                       saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_split_jvp", true, true}, mean,
                               cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean, out_cov_chol, stats,
                               tangents, tangent_out_mean, tangent_out_cov_chol, saved);
}

/// The JVP of project_joint_diag (standard deviations; O(d) per row).
template <class T>
void project_joint_diag_jvp(cpu_policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps, input_view<T> out_mean, input_view<T> out_std_dev,
                            const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                            batch_view<T> tangent_out_mean, batch_view<T> tangent_out_std_dev) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_joint_diag_jvp", false, false},
                               mean, std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev, stats, tangents,
                               tangent_out_mean, tangent_out_std_dev);
}

/// The JVP of project_split_diag.
template <class T>
void project_split_diag_jvp(cpu_policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_std_dev, const gaussian_stats* stats,
                            const gaussian_tangents<T>& tangents, batch_view<T> tangent_out_mean,
                            batch_view<T> tangent_out_std_dev) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_split_diag_jvp", false, true},
                               mean, std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev, stats,
                               tangents, tangent_out_mean, tangent_out_std_dev);
}

}  // namespace gaussian
TROLL_END_NAMESPACE
