// troll/detail/cuda/gaussian_full_block_kernels.cuh — the forward projection and the KL of
// full-covariance rows above d = 32 (up to 256) on the device: one block of
// gaussian_full_threads per row running gaussian_full_forward.hpp's team steps (parallel-order
// Jacobi, the shared solve, the Cholesky write-back), shared with the host and checked there
// against the CPU backend. Each block's row scratch is its slice of the caller's workspace
// (gaussian_full_blocks blocks; workspace_layout.hpp), the grid striding over the rows.
//
// Rows that fail the CPU's value checks are written as NaN; the forward also rejects the rows the
// projection refuses (gaussian_row_refused), status rejected. The full rows' whitened step here is
// L°⁻¹ (from its explicit inverse) times μ̃ − μ°, where the CPU's check substitutes forward: for
// old factors so ill-conditioned that one of the two overflows and the other does not, the
// verdicts can differ.
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

/// The forward projection's parts of a full row in gaussian_full_rows_kernel: a rejected row
/// (NaN outputs and stats, status rejected) and a row with good operands.
template <class T>
struct full_forward_op {
  gaussian_launch<T> k;

  __device__ void reject(std::size_t r) const {
    fill_row_nan<gaussian_full_threads>(k.out_mean.row(r), k.out_mean.cols);
    fill_row_nan<gaussian_full_threads>(k.out_cov.row(r), k.out_cov.cols);
    if (threadIdx.x == 0) k.stats[r] = rejected_gaussian_stats();
  }
  __device__ void row(const block_team& tm, std::size_t r, const T* mean, const T* l_new, const T* old_mean,
                      const T* l_old, const full_scratch& w) const {
    const bool written =
        gaussian_full_forward_row(tm, k.split, mean, l_new, old_mean, l_old, k.eps_mean, k.eps_cov, k.options,
                                  k.out_mean.row(r), k.out_cov.row(r), k.stats + r,
                                  k.saved.data == nullptr ? nullptr : k.saved.row(r), w);
    if (!written) reject(r);  // a row the CPU refuses (a ratio or mean step beyond the doubles)
  }
};

/// The KL's parts of a full row in gaussian_full_rows_kernel: NaN for a rejected row, else the
/// KL at t = 1.
template <class T>
struct full_kl_op {
  gaussian_kl_launch<T> k;

  __device__ void reject(std::size_t r) const {
    if (threadIdx.x == 0) k.out[r] = quiet_nan();
  }
  __device__ void row(const block_team& tm, std::size_t r, const T* mean, const T* l_new, const T* old_mean,
                      const T* l_old, const full_scratch& w) const {
    const int d = w.d;
    factor_full_team(tm, mean, l_new, old_mean, l_old, w);
    const double *g = w.vec(0), *b = w.vec(1);
    bool tiny = false;
    for (int i = tm.lane(); i < d; i += tm.size()) tiny |= gaussian_full_kl_from_determinant(g[i]);
    if (tm.sum(tiny ? 1.0 : 0.0) != 0.0) {  // a tiny eigenvalue: log det from the diagonals, as the CPU's
      double part = 0.0;
      for (int i = tm.lane(); i < d; i += tm.size())
        part += gaussian_full_beyond_kl(gaussian_full_lambda(g[i], nullptr, i), b[i],
                                        static_cast<double>(l_new[i * d + i]), static_cast<double>(l_old[i * d + i]));
      const double kl_sum = tm.sum(part);
      if (threadIdx.x == 0) k.out[r] = gaussian_kl_result(kl_sum);
      tm.sync();
      return;
    }
    const gaussian_point none;
    const gaussian_point p =
        gaussian_team_family<block_team>{tm, gaussian_spectrum{g, b, d, true}}.evaluate(tilt_near_one(0.0), none, 0.0, 0.0);
    if (threadIdx.x == 0) k.out[r] = gaussian_kl_result(p.kl);
    tm.sync();
  }
};

/// Full rows one block a row with the row scratch in the caller's workspace (full_forward_op or
/// full_kl_op): a row with a bad operand pair is rejected, the others computed.
template <class T, class Op>
__global__ void __launch_bounds__(gaussian_full_threads)
    gaussian_full_rows_kernel(Op op, double* workspace, std::size_t row_doubles) {
  __shared__ double partial[gaussian_full_threads / gaussian_warp];
  const block_team tm{partial};
  const int d = static_cast<int>(op.k.mean.cols);
  const full_scratch w{workspace + blockIdx.x * row_doubles, d, forward_matrices};
  for (std::size_t r = blockIdx.x; r < op.k.mean.rows; r += gridDim.x) {
    const T *mean = op.k.mean.row(r), *l_new = op.k.cov.row(r), *old_mean = op.k.old_mean.row(r),
            *l_old = op.k.old_cov.row(r);
    const bool bad_new = bad_full_operand(mean, l_new, d, tm);
    const bool bad_old = bad_full_operand(old_mean, l_old, d, tm);
    if (bad_new || bad_old) {
      op.reject(r);
      continue;
    }
    op.row(tm, r, mean, l_new, old_mean, l_old, w);
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
