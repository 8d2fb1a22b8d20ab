// troll/gaussian_projections.hpp — the four Gaussian projections, one definition for every policy
// (troll/gaussian.hpp runs them under troll::cpu, troll/cuda_gaussian.cuh under troll::cuda): each
// forwards to detail::gaussian_backend<Policy>, which the backend's header specialises. No Eigen,
// no CUDA here.
#pragma once

#include <type_traits>

#include "batch.hpp"
#include "config.hpp"
#include "detail/gaussian_checks.hpp"
#include "execution.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The backend of the Gaussian projections under policy P: a static
/// `template <class T> project(P, const gaussian_call&, mean, cov, old_mean, old_cov, eps_mean,
/// eps_cov, out_mean, out_cov, stats, options)`. Specialised by gaussian.hpp (cpu_policy) and
/// cuda_gaussian.cuh (cuda_policy).
template <class Policy>
struct gaussian_backend;

template <class Policy>
using if_policy =
    std::enable_if_t<std::is_same<Policy, cpu_policy>::value || std::is_same<Policy, cuda_policy>::value, int>;

}  // namespace detail

namespace gaussian {

/// Projects each new Gaussian N(mean, LLᵀ) onto the ball KL(· ‖ N(old_mean, L°L°ᵀ)) ≤ eps (joint
/// bound) and writes the projected mean and Cholesky factor, and one gaussian_stats per row.
/// Rows already inside the ball are copied bit for bit. Projected rows satisfy
/// |KL(π* ‖ q) − ε| ≤ atol + rtol·ε of the options, KL evaluated in double on the factorised row.
///
/// Shapes: means N × d, factors N × d² (row-major, lower-triangular: the strict upper triangle
/// must be 0 and the diagonal > 0). Throws, before writing anything: shape_error (shapes, null
/// pointers, d = 0), domain_error (a non-finite entry, a factor that is not lower-triangular
/// with a positive diagonal, naming the row and entry; eps ≤ 0 or not finite; bad options).
template <class Policy, class T, detail::if_policy<Policy> = 0>
void project_joint(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                   input_view<T> old_cov_chol, double eps, batch_view<T> out_mean, batch_view<T> out_cov_chol,
                   gaussian_stats* stats, const projection_options& options = {}) {
  detail::gaussian_backend<Policy>::project(
      policy, detail::gaussian_call{"gaussian::project_joint", true, false},
      detail::gaussian_projection_args<T>{mean, cov_chol, old_mean, old_cov_chol, out_mean, out_cov_chol, stats, eps,
                                          eps, options});
}

/// The split projection: the mean against eps_mean (closed form, Σ°'s metric), the covariance
/// against eps_cov (½[tr(Σ°⁻¹Σ) − d + log det Σ° − log det Σ] ≤ ε_Σ, by the solve). Shapes and
/// errors as project_joint.
template <class Policy, class T, detail::if_policy<Policy> = 0>
void project_split(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                   input_view<T> old_cov_chol, double eps_mean, double eps_cov, batch_view<T> out_mean,
                   batch_view<T> out_cov_chol, gaussian_stats* stats, const projection_options& options = {}) {
  detail::gaussian_backend<Policy>::project(
      policy, detail::gaussian_call{"gaussian::project_split", true, true},
      detail::gaussian_projection_args<T>{mean, cov_chol, old_mean, old_cov_chol, out_mean, out_cov_chol, stats,
                                          eps_mean, eps_cov, options});
}

/// project_joint for diagonal covariances given as standard deviations (N × d, all > 0): O(d)
/// per row.
template <class Policy, class T, detail::if_policy<Policy> = 0>
void project_joint_diag(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                        input_view<T> old_std_dev, double eps, batch_view<T> out_mean, batch_view<T> out_std_dev,
                        gaussian_stats* stats, const projection_options& options = {}) {
  detail::gaussian_backend<Policy>::project(
      policy, detail::gaussian_call{"gaussian::project_joint_diag", false, false},
      detail::gaussian_projection_args<T>{mean, std_dev, old_mean, old_std_dev, out_mean, out_std_dev, stats, eps, eps,
                                          options});
}

/// project_split for diagonal covariances given as standard deviations.
template <class Policy, class T, detail::if_policy<Policy> = 0>
void project_split_diag(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                        input_view<T> old_std_dev, double eps_mean, double eps_cov, batch_view<T> out_mean,
                        batch_view<T> out_std_dev, gaussian_stats* stats, const projection_options& options = {}) {
  detail::gaussian_backend<Policy>::project(
      policy, detail::gaussian_call{"gaussian::project_split_diag", false, true},
      detail::gaussian_projection_args<T>{mean, std_dev, old_mean, old_std_dev, out_mean, out_std_dev, stats, eps_mean,
                                          eps_cov, options});
}

}  // namespace gaussian
TROLL_END_NAMESPACE
