// troll/detail/cuda/gaussian_launch.cuh — the host side shared by the CUDA Gaussian entry points
// (cuda_gaussian.cuh, cuda_gaussian_derivatives.cuh): the device's limit on d, the caller's
// workspace of full rows above d = 32, the grid of a full-row block kernel and the launch of the
// forward-type entries (projection, KL).
#pragma once

#include <cstddef>
#include <string>

#include "../../config.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../gaussian_checks.hpp"
#include "../workspace.hpp"
#include "../workspace_layout.hpp"
#include "error_check.cuh"
#include "gaussian_full_block_kernels.cuh"
#include "gaussian_kernels.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// shape_error unless the device takes d (gaussian_max_dim: full 256, diagonal 2048).
inline void check_gaussian_dim(const gaussian_call& c) {
  const std::size_t max_dim = gaussian_max_dim(c.full);
  if (c.dim > max_dim)
    throw_shape(c.function, std::string("d = ") + std::to_string(c.dim) + " is above the CUDA backend's " +
                                std::to_string(max_dim) + (c.full ? " for full covariances" : " for diagonal ones") +
                                "; use the CPU backend");
}

/// Full rows above d = 32 keep their scratch in the caller's workspace: shape_error unless it
/// holds gaussian_full_workspace_bytes; returns it (null up to d = 32 and for diagonal rows).
inline double* full_workspace(const cuda_policy& policy, const gaussian_call& c, std::size_t rows,
                              std::size_t row_bytes) {
  if (!c.full || c.dim <= gaussian_full_max_dim) return nullptr;
  check_workspace(c.function, policy.workspace, gaussian_full_workspace_bytes(rows, c.dim, row_bytes));
  return static_cast<double*>(policy.workspace.data);
}

/// Grid of a full-row block kernel: gaussian_full_blocks with the workspace, grid_for without.
inline unsigned full_grid(std::size_t rows, const double* workspace, std::size_t row_bytes) {
  return workspace == nullptr ? grid_for(rows) : static_cast<unsigned>(gaussian_full_blocks(rows, row_bytes));
}

/// The launch of a forward-type entry (the projection, the KL) over its rows: full rows above
/// d = 32 one block a row with their scratch in `workspace` (block_op in
/// gaussian_full_rows_kernel), full rows up to d = 32 one warp a row (full_kernel, 4d² + 4d
/// doubles of shared memory), diagonal rows one warp a row (diag_kernel, diag_shared bytes).
template <class T, class BlockOp, class Launch>
void launch_gaussian_rows(const cuda_policy& policy, const gaussian_call& c, std::size_t rows, double* workspace,
                          std::size_t row_bytes, const BlockOp& block_op, void (*full_kernel)(Launch),
                          void (*diag_kernel)(Launch), std::size_t diag_shared, const Launch& launch) {
  const unsigned grid = grid_for(rows);
  if (workspace != nullptr) {
    gaussian_full_rows_kernel<T><<<full_grid(rows, workspace, row_bytes), gaussian_full_threads, 0, policy.stream>>>(
        block_op, workspace, row_bytes / sizeof(double));
  } else if (c.full) {
    const std::size_t shared = (4 * c.dim * c.dim + 4 * c.dim) * sizeof(double);
    full_kernel<<<grid, gaussian_warp, shared, policy.stream>>>(launch);
  } else {
    diag_kernel<<<grid, gaussian_warp, diag_shared, policy.stream>>>(launch);
  }
  check_launch(c.function);
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
