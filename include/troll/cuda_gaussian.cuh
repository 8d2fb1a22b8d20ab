// troll/cuda_gaussian.cuh — the CUDA backend of the Gaussian projections (nvcc only):
// troll::gaussian::project_joint, project_split, project_joint_diag and project_split_diag
// (gaussian_api.hpp, one entry point for both policies) under the troll::cuda policy tag:
//
//   troll::gaussian::project_joint(troll::cuda.on(stream), mean, cov_chol, old_mean, old_cov_chol,
//                                  eps, out_mean, out_cov_chol, stats);
//
// Every view and `stats` is device memory; work is enqueued on policy.stream, nothing allocates
// and nothing synchronises. One warp per row: full covariances for d ≤ 32, diagonal ones for
// d ≤ 2048; full covariances for 32 < d ≤ 256 one block per row, the row's work (a few d×d
// matrices) in the caller's workspace: policy.with_workspace(p, bytes) with
// bytes = troll::workspace_bytes(troll::cuda, troll::op::gaussian_project_joint{}, rows, d)
// (0 up to d = 32; an undersized, null or misaligned workspace: shape_error before anything is
// written). Larger d: shape_error. The host checks shapes, bounds and options and throws as the
// CPU does; the values are checked on the device, where a row the CPU would reject (non-finite
// entries, a standard deviation or factor diagonal ≤ 0, a non-zero above a factor's diagonal, a
// mean step beyond the doubles, a ratio σ̃/σ° or factor diagonal ratio below ~7.5e-155, and under
// a split bound ½|step|² beyond the doubles) is written as NaN with stats.status =
// row_status::rejected; with troll::cuda.on(s).checked() the rows are checked on the host first,
// row by row, and the lowest bad one throws the CPU's exception, naming it,
// before anything is written (detail/cuda/gaussian_checked.cuh). The KL and the diagonal rows'
// VJP and JVP are in cuda_gaussian_derivatives.cuh (included here). Compiled in CI.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "cuda_gaussian_derivatives.cuh"  // the device rows of kl, the backward and the JVP
#include "detail/arguments.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/gaussian_checked.cuh"
#include "detail/cuda/gaussian_full_block_kernels.cuh"
#include "detail/cuda/gaussian_kernels.cuh"
#include "detail/cuda/gaussian_launch.cuh"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_forward_call.hpp"
#include "detail/workspace.hpp"
#include "detail/workspace_layout.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_api.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The device's rows of a projection after its argument checks (gaussian_forward_call.hpp).
template <class T>
void project_gaussian(cuda_policy policy, const gaussian_call& c, const gaussian_launch<T>& launch) {
  const std::size_t rows = launch.mean.rows, row_bytes = gaussian_forward_row_bytes(c.dim);
  double* workspace = full_workspace(policy, c, rows, row_bytes);  // one block per row above d = 32
  if (rows == 0) return;
  check_gaussian_rows_on_host(policy, c, launch.mean, launch.cov, launch.old_mean, launch.old_cov);
  launch_gaussian_rows<T>(policy, c, rows, workspace, row_bytes, full_forward_op<T>{launch},
                          gaussian_full_kernel<T>, gaussian_diag_kernel<T>, 2 * c.dim * sizeof(double), launch);
}

}  // namespace cuda

/// The CUDA backend of the Gaussian entry points of gaussian_api.hpp (the KL: cuda_gaussian_derivatives.cuh).
template <>
struct gaussian_backend<cuda_policy> {
  static void check_dim(const gaussian_call& c) { cuda::check_gaussian_dim(c); }
  template <class... Args>
  static void project(const Args&... args) {
    cuda::project_gaussian(args...);
  }
  template <class... Args>
  static void kl(const Args&... args) {
    cuda::gaussian_kl(args...);
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
