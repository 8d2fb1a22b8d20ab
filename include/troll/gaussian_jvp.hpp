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
#include "detail/cpu/parallel.hpp"
#include "detail/gaussian_checks.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_backward.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

template <class T>
void project_gaussian_jvp(cpu_policy policy, gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                          batch_view<const T> old_mean, batch_view<const T> old_cov, double eps_mean, double eps_cov,
                          batch_view<const T> out_mean, batch_view<const T> out_cov,
                          const gaussian::gaussian_stats* stats, const gaussian::gaussian_tangents<T>& tangents,
                          batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov,
                          gaussian::saved_factorisation<const double> saved = {}) {
  require_float_type<T>();
  call = check_jvp_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, tangent_out_mean,
                             tangent_out_cov, stats, eps_mean, eps_cov, tangents, saved);
  const char* fn = call.function;
  validate_gaussian_rows(policy.threads, call, mean, cov, old_mean, old_cov);
  validate_gaussian_stats(fn, stats, mean.rows, "JVP");
  const std::size_t work = call.full ? 200 * call.dim * call.dim * call.dim : 200 * call.dim;
  auto row = [](batch_view<const T> v, std::size_t r) { return v.data == nullptr ? nullptr : v.row(r); };
  cpu::parallel_for(policy.threads, mean.rows, work, [&](std::size_t r) {
    const cpu::gaussian_row_tangents<T> io{out_cov.row(r),
                                           row(tangents.mean, r),
                                           row(tangents.cov, r),
                                           row(tangents.old_mean, r),
                                           row(tangents.old_cov, r),
                                           tangents.eps,
                                           tangents.eps_mean,
                                           tangent_out_mean.row(r),
                                           tangent_out_cov.row(r)};
    const double t = stats[r].status == row_status::inactive ? 1.0 : stats[r].t;
    if (call.full) {
      cpu::gaussian_jvp_full(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r),
                             eps_mean, t, io, saved.data == nullptr ? nullptr : saved.row(r));
    } else {
      cpu::gaussian_jvp_diag(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r),
                             eps_mean, t, io);
    }
  });
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
