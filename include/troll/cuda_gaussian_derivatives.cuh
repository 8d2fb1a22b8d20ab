// troll/cuda_gaussian_derivatives.cuh — the CUDA backend of the Gaussian KL and of the diagonal
// projections' derivatives (nvcc only): troll::gaussian::kl, kl_diag, project_joint_diag_backward,
// project_split_diag_backward, project_joint_diag_jvp and project_split_diag_jvp under the
// troll::cuda policy tag, with exactly the CPU overloads' argument lists (troll/gaussian.hpp,
// gaussian_backward.hpp, gaussian_jvp.hpp):
//
//   troll::gaussian::project_joint_diag_backward(troll::cuda.on(stream), mean, std_dev, old_mean,
//       old_std_dev, eps, out_mean, out_std_dev, stats, grad_out_mean, grad_out_std_dev, grads);
//
// Every view, `stats`, `out` and the bound-gradient arrays of `grads` are device memory; work is
// enqueued on policy.stream, nothing allocates and nothing synchronises (no workspace:
// workspace_bytes is 0 for every Gaussian tag). One warp per row: diagonal rows up to d = 2048,
// full rows (kl) up to d = 32 (larger d: shape_error). The host checks shapes and bounds as the
// CPU does. By default the values are checked on the device: a row the CPU would reject (bad
// values, forward stats not solved with t in (0, 1]) gets NaN in every requested output. With
// troll::cuda.on(s).checked() the rows are checked on the host first (gaussian_checked.cuh) and
// the first bad one throws the CPU's exception, naming it, before anything is written.
// The full-covariance backward and JVP run on the CPU only for now.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/gaussian_checked.cuh"
#include "detail/cuda/gaussian_derivative_kernels.cuh"
#include "detail/cuda/gaussian_kernels.cuh"
#include "detail/gaussian_checks.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// shape_error unless d fits one warp per row (full: gaussian_full_max_dim, diagonal: _diag_).
inline void check_gaussian_dim(const gaussian_call& c) {
  const std::size_t max_dim = c.full ? gaussian_full_max_dim : gaussian_diag_max_dim;
  if (c.dim > max_dim)
    throw_shape(c.function, std::string("d = ") + std::to_string(c.dim) + " is above the CUDA backend's " +
                                std::to_string(max_dim) + (c.full ? " for full covariances" : " for diagonal ones") +
                                " (one warp per row); use the CPU backend");
}

template <class T>
void gaussian_kl(cuda_policy policy, const gaussian_call& call, batch_view<const T> mean, batch_view<const T> cov,
                 batch_view<const T> old_mean, batch_view<const T> old_cov, double* out) {
  require_float_type<T>();
  const gaussian_call c = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, mean, cov);
  if (out == nullptr && mean.rows != 0) throw_shape(c.function, "out is a null pointer");
  check_gaussian_dim(c);
  if (mean.rows == 0) return;
  check_gaussian_rows_on_host(policy, c, mean, cov, old_mean, old_cov);
  const gaussian_kl_launch<T> launch{mean, cov, old_mean, old_cov, out};
  const unsigned grid = grid_for(mean.rows);
  if (c.full) {
    const std::size_t shared = (4 * c.dim * c.dim + 4 * c.dim) * sizeof(double);
    gaussian_kl_full_kernel<T><<<grid, gaussian_warp, shared, policy.stream>>>(launch);
  } else {
    gaussian_kl_diag_kernel<T><<<grid, gaussian_warp, 0, policy.stream>>>(launch);
  }
  check_launch(c.function);
}

template <class T>
void project_gaussian_diag_backward(cuda_policy policy, gaussian_call call, batch_view<const T> mean,
                                    batch_view<const T> cov, batch_view<const T> old_mean,
                                    batch_view<const T> old_cov, double eps_mean, double eps_cov,
                                    batch_view<const T> out_mean, batch_view<const T> out_cov,
                                    const gaussian::gaussian_stats* stats, batch_view<const T> grad_out_mean,
                                    batch_view<const T> grad_out_cov, const gaussian::gaussian_grads<T>& grads) {
  require_float_type<T>();
  call = check_derivative_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, grad_out_mean,
                                    grad_out_cov, stats, eps_mean, eps_cov);
  const char* fn = call.function;
  check_optional_view(fn, "grads.mean", grads.mean, mean);
  check_optional_view(fn, "grads.cov", grads.cov, cov);
  check_optional_view(fn, "grads.old_mean", grads.old_mean, old_mean);
  check_optional_view(fn, "grads.old_cov", grads.old_cov, old_cov);
  check_gaussian_dim(call);
  if (mean.rows == 0) return;
  check_gaussian_rows_on_host(policy, call, mean, cov, old_mean, old_cov, stats, "backward");
  const gaussian_vjp_launch<T> launch{mean,          cov,   old_mean, old_cov, out_mean, out_cov, grad_out_mean,
                                      grad_out_cov,  stats, grads,    eps_mean, call.split};
  gaussian_vjp_diag_kernel<T><<<grid_for(mean.rows), gaussian_warp, 0, policy.stream>>>(launch);
  check_launch(fn);
}

template <class T>
void project_gaussian_diag_jvp(cuda_policy policy, gaussian_call call, batch_view<const T> mean,
                               batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                               double eps_mean, double eps_cov, batch_view<const T> out_mean,
                               batch_view<const T> out_cov, const gaussian::gaussian_stats* stats,
                               const gaussian::gaussian_tangents<T>& tangents, batch_view<T> tangent_out_mean,
                               batch_view<T> tangent_out_cov) {
  require_float_type<T>();
  call = check_derivative_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, tangent_out_mean,
                                    tangent_out_cov, stats, eps_mean, eps_cov);
  check_jvp_tangents(call.function, tangents, mean, cov, old_mean, old_cov);
  check_gaussian_dim(call);
  if (mean.rows == 0) return;
  check_gaussian_rows_on_host(policy, call, mean, cov, old_mean, old_cov, stats, "JVP");
  const gaussian_jvp_launch<T> launch{mean,     cov,           old_mean,        old_cov, stats, tangents,
                                      tangent_out_mean, tangent_out_cov, eps_mean, call.split};
  gaussian_jvp_diag_kernel<T><<<grid_for(mean.rows), gaussian_warp, 0, policy.stream>>>(launch);
  check_launch(call.function);
}

}  // namespace cuda
}  // namespace detail

namespace gaussian {

/// kl on the device (troll/gaussian.hpp): full rows up to d = 32; out is device memory.
template <class T>
void kl(cuda_policy policy, batch_view<const T> mean, batch_view<const T> cov_chol, batch_view<const T> old_mean,
        batch_view<const T> old_cov_chol, double* out) {
  detail::cuda::gaussian_kl(policy, detail::gaussian_call{"gaussian::kl", true, false}, mean, cov_chol, old_mean,
                            old_cov_chol, out);
}

/// kl_diag on the device: up to d = 2048.
template <class T>
void kl_diag(cuda_policy policy, batch_view<const T> mean, batch_view<const T> std_dev, batch_view<const T> old_mean,
             batch_view<const T> old_std_dev, double* out) {
  detail::cuda::gaussian_kl(policy, detail::gaussian_call{"gaussian::kl_diag", false, false}, mean, std_dev,
                            old_mean, old_std_dev, out);
}

/// project_joint_diag_backward on the device (troll/gaussian_backward.hpp).
template <class T>
void project_joint_diag_backward(cuda_policy policy, input_view<T> mean, input_view<T> std_dev,
                                 input_view<T> old_mean, input_view<T> old_std_dev, double eps,
                                 input_view<T> out_mean, input_view<T> out_std_dev, const gaussian_stats* stats,
                                 input_view<T> grad_out_mean, input_view<T> grad_out_std_dev,
                                 const gaussian_grads<T>& grads) {
  detail::cuda::project_gaussian_diag_backward(
      policy, detail::gaussian_call{"gaussian::project_joint_diag_backward", false, false}, mean, std_dev, old_mean,
      old_std_dev, eps, eps, out_mean, out_std_dev, stats, grad_out_mean, grad_out_std_dev, grads);
}

/// project_split_diag_backward on the device.
template <class T>
void project_split_diag_backward(cuda_policy policy, input_view<T> mean, input_view<T> std_dev,
                                 input_view<T> old_mean, input_view<T> old_std_dev, double eps_mean, double eps_cov,
                                 input_view<T> out_mean, input_view<T> out_std_dev, const gaussian_stats* stats,
                                 input_view<T> grad_out_mean, input_view<T> grad_out_std_dev,
                                 const gaussian_grads<T>& grads) {
  detail::cuda::project_gaussian_diag_backward(
      policy, detail::gaussian_call{"gaussian::project_split_diag_backward", false, true}, mean, std_dev, old_mean,
      old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev, stats, grad_out_mean, grad_out_std_dev, grads);
}

/// project_joint_diag_jvp on the device (troll/gaussian_jvp.hpp).
template <class T>
void project_joint_diag_jvp(cuda_policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps, input_view<T> out_mean, input_view<T> out_std_dev,
                            const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                            batch_view<T> tangent_out_mean, batch_view<T> tangent_out_std_dev) {
  detail::cuda::project_gaussian_diag_jvp(policy,
                                          detail::gaussian_call{"gaussian::project_joint_diag_jvp", false, false},
                                          mean, std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev,
                                          stats, tangents, tangent_out_mean, tangent_out_std_dev);
}

/// project_split_diag_jvp on the device.
template <class T>
void project_split_diag_jvp(cuda_policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_std_dev, const gaussian_stats* stats,
                            const gaussian_tangents<T>& tangents, batch_view<T> tangent_out_mean,
                            batch_view<T> tangent_out_std_dev) {
  detail::cuda::project_gaussian_diag_jvp(policy,
                                          detail::gaussian_call{"gaussian::project_split_diag_jvp", false, true},
                                          mean, std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean,
                                          out_std_dev, stats, tangents, tangent_out_mean, tangent_out_std_dev);
}

}  // namespace gaussian
TROLL_END_NAMESPACE
