// troll/detail/cuda/gaussian_full_block_kernels.cuh — the forward projection and the KL of
// full-covariance rows above d = 32 (up to 256) on the device: one block of
// gaussian_full_threads per row running gaussian_full_forward.hpp's team steps (parallel-order
// Jacobi, the shared solve, the Cholesky write-back), shared with the host and checked there
// against the CPU backend. Each block's row scratch is its slice of the caller's workspace
// (gaussian_full_blocks blocks; workspace_layout.hpp), the grid striding over the rows.
//
// Rows that fail the CPU's value checks are written as NaN (forward: status rejected).
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../gaussian_types.hpp"
#include "../gaussian_full_forward.hpp"
#include "../workspace_layout.hpp"
#include "gaussian_full_derivative_kernels.cuh"
#include "gaussian_kernels.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

static_assert(gaussian_forward_row_bytes(7) == forward_scratch_doubles(7) * sizeof(double),
              "workspace_layout.hpp's forward row size is gaussian_full_forward.hpp's scratch");
static_assert(gaussian_derivative_row_bytes(7) == full_scratch::doubles(7) * sizeof(double),
              "workspace_layout.hpp's derivative row size is gaussian_full_derivatives.hpp's scratch");

/// A rejected full row by the whole block: NaN outputs and stats, status rejected.
template <class T>
__device__ void reject_full_row_block(const gaussian_launch<T>& k, std::size_t r) {
  fill_nan_block(k.out_mean.row(r), k.out_mean.cols);
  fill_nan_block(k.out_cov.row(r), k.out_cov.cols);
  if (threadIdx.x == 0) k.stats[r] = rejected_gaussian_stats();
}

template <class T>
__global__ void __launch_bounds__(gaussian_full_threads)
    gaussian_full_block_kernel(gaussian_launch<T> k, double* workspace, std::size_t row_doubles) {
  __shared__ double partial[gaussian_full_threads / gaussian_warp];
  const block_team tm{partial};
  const int d = static_cast<int>(k.mean.cols);
  const full_scratch w{workspace + blockIdx.x * row_doubles, d, forward_matrices};
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *l_new = k.cov.row(r), *old_mean = k.old_mean.row(r), *l_old = k.old_cov.row(r);
    const bool bad_new = bad_full_operand(mean, l_new, d, tm);
    const bool bad_old = bad_full_operand(old_mean, l_old, d, tm);
    if (bad_new || bad_old) {
      reject_full_row_block(k, r);
      continue;
    }
    gaussian_full_forward_row(tm, k.split, mean, l_new, old_mean, l_old, k.eps_mean, k.eps_cov, k.options,
                              k.out_mean.row(r), k.out_cov.row(r), k.stats + r,
                              k.saved.data == nullptr ? nullptr : k.saved.row(r), w);
  }
}

template <class T>
__global__ void __launch_bounds__(gaussian_full_threads)
    gaussian_kl_full_block_kernel(gaussian_kl_launch<T> k, double* workspace, std::size_t row_doubles) {
  __shared__ double partial[gaussian_full_threads / gaussian_warp];
  const block_team tm{partial};
  const int d = static_cast<int>(k.mean.cols);
  const full_scratch w{workspace + blockIdx.x * row_doubles, d, forward_matrices};
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *l_new = k.cov.row(r), *old_mean = k.old_mean.row(r), *l_old = k.old_cov.row(r);
    const bool bad_new = bad_full_operand(mean, l_new, d, tm);
    const bool bad_old = bad_full_operand(old_mean, l_old, d, tm);
    if (bad_new || bad_old) {
      if (threadIdx.x == 0) k.out[r] = quiet_nan();
      continue;
    }
    factor_full_team(tm, mean, l_new, old_mean, l_old, w);
    const gaussian_point none;
    const gaussian_point p = gaussian_team_family<block_team>{tm, gaussian_spectrum{w.vec(0), w.vec(1), d, true}}
                                 .evaluate(tilt_near_one(0.0), none, 0.0, 0.0);
    if (threadIdx.x == 0) k.out[r] = p.kl;
    tm.sync();
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
