// troll/cuda_gaussian.cuh — the CUDA backend of the Gaussian projections (nvcc only):
// troll::gaussian::project_joint, project_split, project_joint_diag and project_split_diag under
// the troll::cuda policy tag, with exactly the CPU overloads' argument lists (troll/gaussian.hpp):
//
//   troll::gaussian::project_joint(troll::cuda.on(stream), mean, cov_chol, old_mean, old_cov_chol,
//                                  eps, out_mean, out_cov_chol, stats);
//
// Every view and `stats` is device memory; work is enqueued on policy.stream, nothing allocates
// and nothing synchronises. One warp per row: full covariances for d ≤ 32, diagonal ones for
// d ≤ 2048 (larger d: shape_error). The host checks shapes, bounds and options and throws as the
// CPU does; the values are checked on the device, where a row the CPU would reject (non-finite
// entries, a standard deviation or factor diagonal ≤ 0, a non-zero above a factor's diagonal) is
// written as NaN with stats.status = row_status::rejected. Compiled in CI; never run on a GPU yet.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/gaussian_kernels.cuh"
#include "detail/gaussian_checks.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_projections.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

template <class T>
void project_gaussian(cuda_policy policy, const gaussian_call& call, const gaussian_projection_args<T>& args) {
  require_float_type<T>();
  const gaussian_call c = check_projection_arguments(call, args);
  const std::size_t max_dim = c.full ? gaussian_full_max_dim : gaussian_diag_max_dim;
  if (c.dim > max_dim)
    throw_shape(c.function, std::string("d = ") + std::to_string(c.dim) + " is above the CUDA backend's " +
                                std::to_string(max_dim) + (c.full ? " for full covariances" : " for diagonal ones") +
                                " (one warp per row); use the CPU backend");
  if (args.mean.rows == 0) return;
  const gaussian_launch<T> launch{args, c.split};
  const unsigned grid = grid_for(args.mean.rows);
  if (c.full) {
    const std::size_t shared = (4 * c.dim * c.dim + 4 * c.dim) * sizeof(double);
    gaussian_full_kernel<T><<<grid, gaussian_warp, shared, policy.stream>>>(launch);
  } else {
    const std::size_t shared = 2 * c.dim * sizeof(double);
    gaussian_diag_kernel<T><<<grid, gaussian_warp, shared, policy.stream>>>(launch);
  }
  check_launch(c.function);
}

}  // namespace cuda

/// The CUDA backend of the four Gaussian projections (troll/gaussian_projections.hpp;
/// rejected rows: NaN and status rejected).
template <>
struct gaussian_backend<cuda_policy> {
  template <class T>
  static void project(cuda_policy policy, const gaussian_call& call, const gaussian_projection_args<T>& args) {
    cuda::project_gaussian(policy, call, args);
  }
};

}  // namespace detail

TROLL_END_NAMESPACE
