// troll/detail/cuda/gaussian_full_derivative_kernels.cuh — the VJP and JVP of full-covariance
// Gaussian rows on the device, one block of gaussian_full_threads per row. The maths is
// gaussian_full_derivatives.hpp's sequence of matrix steps, shared with the host (and checked
// there against the CPU's Eigen version), run by a block team; the row's factorisation comes
// from the forward's saved one or is recomputed by the forward's (factor_full_row, one warp).
// The row scratch (full_scratch::doubles(d) doubles) is in dynamic shared memory up to d = 32,
// above (to d = 256) in the block's slice of the caller's workspace (workspace_layout.hpp).
//
// A row the CPU would reject for its values (bad operands, forward stats that are not solved with
// t in (0, 1], a non-finite upstream gradient or input tangent) is written as NaN: every
// requested output of the row, and its bound gradients.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../gaussian_types.hpp"
#include "../gaussian_full_derivatives.hpp"
#include "../gaussian_full_forward.hpp"
#include "gaussian_derivative_kernels.cuh"
#include "gaussian_kernels.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Threads of one full-covariance derivative row (whole warps).
constexpr int gaussian_full_threads = 128;

/// The threads of one block as a team of gaussian_matrix_steps.hpp: __syncthreads between steps,
/// sums by warp_sum then the warps' partials in one fixed order (every thread gets the same bits).
/// `partial` is gaussian_full_threads / 32 doubles of shared memory.
struct block_team {
  double* partial;
  TROLL_HOST_DEVICE int lane() const { return team_lane(); }
  TROLL_HOST_DEVICE int size() const { return gaussian_full_threads; }
  TROLL_HOST_DEVICE void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
  TROLL_HOST_DEVICE double sum(double x) const {
#ifdef __CUDA_ARCH__
    x = warp_sum(x);
    if (threadIdx.x % gaussian_warp == 0) partial[threadIdx.x / gaussian_warp] = x;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < gaussian_full_threads / gaussian_warp; ++w) s += partial[w];
    __syncthreads();
    return s;
#else
    return x;
#endif
  }
};

/// Whether any thread of the block found a bad value in one full row operand (the CPU's
/// gaussian_operand_problem: non-finite entries, a factor diagonal <= 0, a non-zero above it).
template <class T>
__device__ bool bad_full_operand(const T* mean, const T* l, int d, const block_team& tm) {
  bool bad = false;
  for (int i = tm.lane(); i < d; i += tm.size()) bad |= !finite_value(static_cast<double>(mean[i]));
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    const double x = static_cast<double>(l[e]);
    bad |= j > i ? x != 0.0 : !finite_value(x);
    if (j == i) bad |= !(x > 0.0);
  }
  return tm.sum(bad ? 1.0 : 0.0) != 0.0;
}

/// The row's factorisation into w (L° in mat(0), V in mat(1), g in vec(0), b in vec(1)): read from
/// `saved` when it is given, else computed as the forward of that d does (warp 0 up to d = 32,
/// the block's team steps above), so the two see the same basis bit for bit.
template <class T>
__device__ void load_or_factor(const T* mean, const T* l_new, const T* old_mean, const T* l_old,
                               const double* saved, const full_scratch& w, const block_team& tm) {
  const int d = w.d, dd = d * d;
  if (saved != nullptr) {
    for (int e = tm.lane(); e < dd; e += tm.size()) {
      w.mat(0)[e] = static_cast<double>(l_old[e]);
      w.mat(1)[e] = saved[e];
    }
    for (int i = tm.lane(); i < d; i += tm.size()) {
      w.vec(0)[i] = saved[dd + i];
      w.vec(1)[i] = saved[dd + d + i];
    }
  } else if (d > static_cast<int>(gaussian_full_max_dim)) {  // as the block forward does
    factor_full_team(tm, mean, l_new, old_mean, l_old, w);
  } else if (threadIdx.x < gaussian_warp) {  // as the warp forward does
    factor_full_row(mean, l_new, old_mean, l_old, d, w.mat(0), w.mat(2), w.mat(3), w.mat(1), w.vec(0), w.vec(1),
                    w.vec(2));
  }
  tm.sync();
}

/// The VJP's parts of a full-covariance derivative row (gaussian_derivative_full_kernel): the
/// row's io, its rejection (NaN in everything it writes) and the row itself.
template <class T>
struct full_vjp_op {
  gaussian_vjp_launch<T> k;

  __device__ gaussian_vjp_io<T> io(std::size_t r) const {
    return vjp_row_io(k.out_cov, k.grad_out_mean, k.grad_out_cov, k.grads, r);
  }
  __device__ static void reject(const gaussian_vjp_io<T>& io, int d, std::size_t dd) {
    fill_row_nan<gaussian_full_threads>(io.mean, d);
    fill_row_nan<gaussian_full_threads>(io.cov, dd);
    fill_row_nan<gaussian_full_threads>(io.old_mean, d);
    fill_row_nan<gaussian_full_threads>(io.old_cov, dd);
    if (threadIdx.x == 0) {
      if (io.eps != nullptr) *io.eps = quiet_nan();
      if (io.eps_mean != nullptr) *io.eps_mean = quiet_nan();
    }
  }
  /// Whether the row's upstream gradients hold a non-finite entry (∂L/∂L*: its lower triangle);
  /// reached by every thread, the same verdict in each.
  __device__ static bool bad_upstream(const gaussian_vjp_io<T>& io, int d, std::size_t dd, const block_team& tm) {
    const bool bad = nonfinite_part(io.grad_out_mean, std::size_t(d), 0, tm.lane(), tm.size()) ||
                     nonfinite_part(io.grad_out_cov, dd, std::size_t(d), tm.lane(), tm.size());
    return tm.sum(bad ? 1.0 : 0.0) != 0.0;
  }
  __device__ void row(const block_team& tm, const T* mean, const T* l_new, const T* old_mean, double t, double s,
                      const gaussian_vjp_io<T>& io, const full_scratch& w) const {
    gaussian_full_vjp_row(tm, k.split, mean, l_new, old_mean, k.eps_mean, t, s, io, w);
  }
};

/// The JVP's parts of a full-covariance derivative row; out_cov: the forward's L* (read).
template <class T>
struct full_jvp_op {
  gaussian_jvp_launch<T> k;
  batch_view<const T> out_cov;

  __device__ gaussian_jvp_io<T> io(std::size_t r) const {
    return jvp_row_io(out_cov, k.tangents, k.out_mean, k.out_cov, r);
  }
  __device__ static void reject(const gaussian_jvp_io<T>& io, int d, std::size_t dd) {
    fill_row_nan<gaussian_full_threads>(io.out_mean, d);
    fill_row_nan<gaussian_full_threads>(io.out_cov_tangent, dd);
  }
  /// Whether the row's input tangents (those given; factors: their lower triangles) hold a
  /// non-finite entry; reached by every thread, the same verdict in each.
  __device__ static bool bad_upstream(const gaussian_jvp_io<T>& io, int d, std::size_t dd, const block_team& tm) {
    const std::size_t n = std::size_t(d);
    const bool bad = nonfinite_part(io.mean, n, 0, tm.lane(), tm.size()) ||
                     nonfinite_part(io.cov, dd, n, tm.lane(), tm.size()) ||
                     nonfinite_part(io.old_mean, n, 0, tm.lane(), tm.size()) ||
                     nonfinite_part(io.old_cov, dd, n, tm.lane(), tm.size());
    return tm.sum(bad ? 1.0 : 0.0) != 0.0;
  }
  __device__ void row(const block_team& tm, const T* mean, const T* l_new, const T* old_mean, double t, double s,
                      const gaussian_jvp_io<T>& io, const full_scratch& w) const {
    gaussian_full_jvp_row(tm, k.split, mean, l_new, old_mean, k.eps_mean, t, s, io, w);
  }
};

/// Full-covariance derivative rows, one block a row (full_vjp_op or full_jvp_op): a row with a
/// bad operand pair, unusable stats or a non-finite upstream gradient (tangent) is rejected (the same verdict in every thread), the others
/// factorised (or loaded from `saved`) and differentiated.
template <class T, class Op>
__global__ void __launch_bounds__(gaussian_full_threads)
    gaussian_derivative_full_kernel(Op op, gaussian::saved_factorisation<const double> saved, double* workspace,
                                    std::size_t row_doubles) {
  extern __shared__ double gaussian_shared[];
  __shared__ double partial[gaussian_full_threads / gaussian_warp];
  const block_team tm{partial};
  const int d = static_cast<int>(op.k.mean.cols);
  const std::size_t dd = static_cast<std::size_t>(d) * d;
  const full_scratch w{workspace == nullptr ? gaussian_shared : workspace + blockIdx.x * row_doubles, d};
  for (std::size_t r = blockIdx.x; r < op.k.mean.rows; r += gridDim.x) {
    const T *mean = op.k.mean.row(r), *l_new = op.k.cov.row(r), *old_mean = op.k.old_mean.row(r),
            *l_old = op.k.old_cov.row(r);
    const gaussian::gaussian_stats st = op.k.stats[r];
    const auto io = op.io(r);
    const bool bad_new = bad_full_operand(mean, l_new, d, tm);  // both reached by every thread
    const bool bad_old = bad_full_operand(old_mean, l_old, d, tm);
    const bool bad_up = Op::bad_upstream(io, d, dd, tm);
    const bool bad = bad_new || bad_old || !usable_stats(st) || bad_up;
    if (bad) {  // the same verdict in every thread
      op.reject(io, d, dd);
      continue;
    }
    const double t = solved_tilt(st), s = solved_gap(st);
    load_or_factor(mean, l_new, old_mean, l_old, saved.data == nullptr ? nullptr : saved.row(r), w, tm);
    op.row(tm, mean, l_new, old_mean, t, s, io, w);
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
