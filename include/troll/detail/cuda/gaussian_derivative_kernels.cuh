// troll/detail/cuda/gaussian_derivative_kernels.cuh — the Gaussian KL and the diagonal rows' VJP
// and JVP on the device, one warp per row. The per-coordinate maths is
// gaussian_diag_derivatives.hpp's and gaussian_family.hpp's, shared with the CPU: each lane takes
// every 32nd coordinate through the first pass, the sums meet in warp_sum (one fixed order, the
// same bits in every lane), and the second pass writes each coordinate.
//
// A row the CPU would reject for its values (bad operands, forward stats that are not solved with
// t in (0, 1], a non-finite upstream gradient or input tangent) is written as NaN: every
// requested output of the row, and its bound gradients.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../gaussian_types.hpp"
#include "../../projection_types.hpp"
#include "../gaussian_derivative_call.hpp"
#include "../gaussian_diag_derivatives.hpp"
#include "../gaussian_family.hpp"
#include "../gaussian_row_io.hpp"
#include "../numeric.hpp"
#include "gaussian_kernels.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Whether the forward's stats of a row are usable by a derivative (gaussian_stats_problem).
__device__ inline bool usable_stats(const gaussian::gaussian_stats& s) {
  return s.solved() && s.t > 0.0 && s.t <= 1.0 && !(s.status == row_status::projected && !(s.fisher < inf()));
}

template <class T>
__device__ inline double at_or_zero(const T* row, std::size_t i) {
  return row == nullptr ? 0.0 : static_cast<double>(row[i]);
}

/// NaN in n entries of `out` (none when null) by `Lanes` threads: a warp's row, or a block's
/// (gaussian_full_threads).
template <int Lanes = gaussian_warp, class T>
__device__ inline void fill_row_nan(T* out, std::size_t n) {
  if (out == nullptr) return;
  for (std::size_t i = threadIdx.x; i < n; i += Lanes) out[i] = static_cast<T>(quiet_nan());
}

/// Whether the calling thread, lane `lane` of `lanes`, finds a non-finite entry among those of
/// `row`'s n it reads (none when null); with factor_dim d > 0 the row is a d×d factor of which only
/// the lower triangle is read, and only that is tested (the CPU's finite_operands). The caller
/// reduces the verdict over its team.
template <class T>
__device__ inline bool nonfinite_part(const T* row, std::size_t n, std::size_t factor_dim, int lane, int lanes) {
  bool bad = false;
  if (row == nullptr) return bad;
  for (std::size_t e = static_cast<std::size_t>(lane); e < n; e += static_cast<std::size_t>(lanes))
    bad |= (factor_dim == 0 || e % factor_dim <= e / factor_dim) && !finite_value(static_cast<double>(row[e]));
  return bad;
}

// ---- KL ----------------------------------------------------------------------------------------

template <class T>
struct gaussian_kl_launch {
  batch_view<const T> mean, cov, old_mean, old_cov;
  double* out;
};

/// KL of diagonal rows: Σ ψ(log γ_i)… at t = 1, the member's sums of gaussian_coordinate.
template <class T>
__global__ void __launch_bounds__(gaussian_warp) gaussian_kl_diag_kernel(gaussian_kl_launch<T> k) {
  const std::size_t d = k.mean.cols;
  const tilt_param u = tilt_near_one(0.0);
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *sd = k.cov.row(r), *old_mean = k.old_mean.row(r), *old_sd = k.old_cov.row(r);
    if (bad_operand(mean, sd, d, false) || bad_operand(old_mean, old_sd, d, false)) {
      if (threadIdx.x == 0) k.out[r] = quiet_nan();
      continue;
    }
    double kl_sum = 0.0, info = 0.0;
    for (std::size_t i = threadIdx.x; i < d; i += gaussian_warp) {
      const double m = static_cast<double>(mean[i]), s = static_cast<double>(sd[i]),
                   om = static_cast<double>(old_mean[i]), so = static_cast<double>(old_sd[i]);
      if (gaussian_diag_beyond(s, so)) {  // γ beyond the doubles: the exact term, as the CPU's
        kl_sum += gaussian_diag_beyond_kl(m, s, om, so);
        continue;
      }
      double g = 0.0, b = 0.0;
      gaussian_diag_coordinate(m, s, om, so, &g, &b);
      gaussian_coordinate(g, b, u.t, true, &kl_sum, &info);
    }
    const gaussian_point p = gaussian_point_at(u, warp_sum(kl_sum), warp_sum(info));
    if (threadIdx.x == 0) k.out[r] = gaussian_kl_result(p.kl);
  }
}

/// KL of full rows (d ≤ 32): the forward's factorisation (factor_full_row), then the member at
/// t = 1. Shared memory as gaussian_full_kernel.
template <class T>
__global__ void __launch_bounds__(gaussian_warp) gaussian_kl_full_kernel(gaussian_kl_launch<T> k) {
  extern __shared__ double gaussian_shared[];
  const int d = static_cast<int>(k.mean.cols);
  const int dd = d * d;
  double* lo = gaussian_shared;
  double* work = lo + dd;
  double* a = work + dd;
  double* v = a + dd;
  double* g = v + dd;
  double* b = g + d;
  double* delta = b + d;
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *l_new = k.cov.row(r), *old_mean = k.old_mean.row(r), *l_old = k.old_cov.row(r);
    if (bad_operand(mean, l_new, d, true) || bad_operand(old_mean, l_old, d, true)) {
      if (threadIdx.x == 0) k.out[r] = quiet_nan();
      continue;
    }
    factor_full_row(mean, l_new, old_mean, l_old, d, lo, work, a, v, g, b, delta);
    const int lane = static_cast<int>(threadIdx.x);
    const bool by_determinant = __any_sync(0xffffffffu, lane < d && gaussian_full_kl_from_determinant(g[lane]));
    if (by_determinant) {  // a tiny eigenvalue: the log-determinant from the diagonals, as the CPU's
      double part = 0.0;
      if (lane < d)
        part = gaussian_full_beyond_kl(gaussian_full_lambda(g[lane], nullptr, lane), b[lane],
                                       static_cast<double>(l_new[lane * d + lane]),
                                       static_cast<double>(l_old[lane * d + lane]));
      const double kl_sum = warp_sum(part);
      if (lane == 0) k.out[r] = gaussian_kl_result(kl_sum);
      __syncwarp();
      continue;
    }
    const gaussian_point none;
    const gaussian_point p =
        gaussian_warp_family{gaussian_spectrum{g, b, d, true}}.evaluate(tilt_near_one(0.0), none, 0.0, 0.0);
    if (threadIdx.x == 0) k.out[r] = gaussian_kl_result(p.kl);
    __syncwarp();
  }
}

/// The lanes' dominant coordinates merged (gaussian_diag_top::merge) down the lanes to lane 0 in
/// one fixed order, as warp_sum, then broadcast: every lane gets the same bits.
__device__ inline void warp_merge(gaussian_diag_top& top) {
  const unsigned all = 0xffffffffu;
  for (int offset = gaussian_warp / 2; offset > 0; offset /= 2) {
    gaussian_diag_top o;
    o.index = __shfl_down_sync(all, top.index, offset);
    o.info = __shfl_down_sync(all, top.info, offset);
    o.term = __shfl_down_sync(all, top.term, offset);
    o.own = __shfl_down_sync(all, top.own, offset);
    o.rest_info = __shfl_down_sync(all, top.rest_info, offset);
    o.rest = __shfl_down_sync(all, top.rest, offset);
    top.merge(o);
  }
  top.index = __shfl_sync(all, top.index, 0);
  top.info = __shfl_sync(all, top.info, 0);
  top.term = __shfl_sync(all, top.term, 0);
  top.own = __shfl_sync(all, top.own, 0);
  top.rest_info = __shfl_sync(all, top.rest_info, 0);
  top.rest = __shfl_sync(all, top.rest, 0);
}

// ---- VJP of diagonal rows ------------------------------------------------------------------------

/// The VJP's parts of a diagonal derivative row (gaussian_derivative_diag_kernel): the rejected
/// row (NaN in everything it writes) and the row itself at the solved tilt t.
template <class T>
struct diag_vjp_op {
  gaussian_vjp_launch<T> k;

  __device__ void reject(std::size_t r, std::size_t d) const {
    fill_row_nan(row_or_null(k.grads.mean, r), d);
    fill_row_nan(row_or_null(k.grads.cov, r), d);
    fill_row_nan(row_or_null(k.grads.old_mean, r), d);
    fill_row_nan(row_or_null(k.grads.old_cov, r), d);
    if (threadIdx.x == 0) {
      if (k.grads.eps != nullptr) k.grads.eps[r] = quiet_nan();
      if (k.grads.eps_mean != nullptr) k.grads.eps_mean[r] = quiet_nan();
    }
  }
  /// Whether the row's upstream gradients hold a non-finite entry (the same verdict in every lane).
  __device__ bool bad_upstream(std::size_t r, std::size_t d) const {
    const int lane = static_cast<int>(threadIdx.x);
    const bool bad = nonfinite_part(k.grad_out_mean.row(r), d, 0, lane, gaussian_warp) ||
                     nonfinite_part(k.grad_out_cov.row(r), d, 0, lane, gaussian_warp);
    return __any_sync(0xffffffffu, bad);
  }
  __device__ void row(std::size_t r, std::size_t d, const T* mean, const T* sd, const T* old_mean, const T* old_sd,
                      double t, double s) const {
    const T *out_sd = k.out_cov.row(r), *up_mean = k.grad_out_mean.row(r), *up_sd = k.grad_out_cov.row(r);
    T *g_mean = row_or_null(k.grads.mean, r), *g_sd = row_or_null(k.grads.cov, r);
    T *g_old_mean = row_or_null(k.grads.old_mean, r), *g_old_sd = row_or_null(k.grads.old_cov, r);
    auto entry = [&](std::size_t i) { return diag_entry(mean, sd, old_mean, old_sd, i); };
    auto upstream = [&](std::size_t i) {
      return gaussian_diag_upstream{static_cast<double>(up_mean[i]), static_cast<double>(up_sd[i]),
                                    static_cast<double>(out_sd[i])};
    };
    gaussian_diag_vjp_sums sums;
    for (std::size_t i = threadIdx.x; i < d; i += gaussian_warp)
      gaussian_diag_vjp_accumulate(entry(i), upstream(i), k.split, t, s, i, &sums);
    sums.for_each_field([](double& x) { x = warp_sum(x); });
    warp_merge(sums.top);
    const gaussian_diag_vjp_scalars sc = gaussian_diag_vjp_finish(sums, k.split, t, s, k.eps_mean);
    for (std::size_t i = threadIdx.x; i < d; i += gaussian_warp) {
      const gaussian_diag_vjp_out o = gaussian_diag_vjp_coordinate(entry(i), upstream(i), k.split, sc, i);
      if (g_mean != nullptr) g_mean[i] = static_cast<T>(o.mean);
      if (g_sd != nullptr) g_sd[i] = static_cast<T>(o.std_dev);
      if (g_old_mean != nullptr) g_old_mean[i] = static_cast<T>(o.old_mean);
      if (g_old_sd != nullptr) g_old_sd[i] = static_cast<T>(o.old_std);
    }
    if (threadIdx.x == 0) {
      if (k.grads.eps != nullptr) k.grads.eps[r] = sc.eps_bar;
      if (k.grads.eps_mean != nullptr) k.grads.eps_mean[r] = sc.eps_mean_bar;
    }
  }
};

// ---- JVP of diagonal rows ------------------------------------------------------------------------

/// The JVP's parts of a diagonal derivative row (gaussian_derivative_diag_kernel).
template <class T>
struct diag_jvp_op {
  gaussian_jvp_launch<T> k;

  __device__ void reject(std::size_t r, std::size_t d) const {
    fill_row_nan(k.out_mean.row(r), d);
    fill_row_nan(k.out_cov.row(r), d);
  }
  /// Whether the row's input tangents (those given) hold a non-finite entry (every lane's verdict).
  __device__ bool bad_upstream(std::size_t r, std::size_t d) const {
    const int lane = static_cast<int>(threadIdx.x);
    const bool bad = nonfinite_part(row_or_null(k.tangents.mean, r), d, 0, lane, gaussian_warp) ||
                     nonfinite_part(row_or_null(k.tangents.cov, r), d, 0, lane, gaussian_warp) ||
                     nonfinite_part(row_or_null(k.tangents.old_mean, r), d, 0, lane, gaussian_warp) ||
                     nonfinite_part(row_or_null(k.tangents.old_cov, r), d, 0, lane, gaussian_warp);
    return __any_sync(0xffffffffu, bad);
  }
  __device__ void row(std::size_t r, std::size_t d, const T* mean, const T* sd, const T* old_mean, const T* old_sd,
                      double t, double s) const {
    const T *d_mean = row_or_null(k.tangents.mean, r), *d_sd = row_or_null(k.tangents.cov, r);
    const T *d_old_mean = row_or_null(k.tangents.old_mean, r), *d_old_sd = row_or_null(k.tangents.old_cov, r);
    T *out_mean = k.out_mean.row(r), *out_sd = k.out_cov.row(r);
    auto entry = [&](std::size_t i) { return diag_entry(mean, sd, old_mean, old_sd, i); };
    auto tangent = [&](std::size_t i) {
      return gaussian_diag_tangent{at_or_zero(d_mean, i), at_or_zero(d_sd, i), at_or_zero(d_old_mean, i),
                                   at_or_zero(d_old_sd, i)};
    };
    gaussian_diag_jvp_sums sums;
    for (std::size_t i = threadIdx.x; i < d; i += gaussian_warp)
      gaussian_diag_jvp_accumulate(entry(i), tangent(i), k.split, t, s, i, &sums);
    sums.for_each_field([](double& x) { x = warp_sum(x); });
    warp_merge(sums.top);
    const gaussian_diag_jvp_scalars sc =
        gaussian_diag_jvp_finish(sums, k.split, t, s, k.eps_mean, k.tangents.eps, k.tangents.eps_mean);
    for (std::size_t i = threadIdx.x; i < d; i += gaussian_warp) {
      const gaussian_diag_jvp_out o = gaussian_diag_jvp_coordinate(entry(i), tangent(i), k.split, sc, i);
      out_mean[i] = static_cast<T>(o.mean);
      out_sd[i] = static_cast<T>(o.std_dev);
    }
  }
};

/// Diagonal derivative rows, one warp a row (diag_vjp_op or diag_jvp_op): a row with a bad
/// operand pair, unusable stats or a non-finite upstream gradient (tangent) is rejected, the
/// others differentiated at their solved tilt. Each test's verdict is the warp's, so the
/// short-circuit is the same in every lane.
template <class T, class Op>
__global__ void __launch_bounds__(gaussian_warp) gaussian_derivative_diag_kernel(Op op) {
  const std::size_t d = op.k.mean.cols;
  for (std::size_t r = blockIdx.x; r < op.k.mean.rows; r += gridDim.x) {
    const T *mean = op.k.mean.row(r), *sd = op.k.cov.row(r), *old_mean = op.k.old_mean.row(r),
            *old_sd = op.k.old_cov.row(r);
    const gaussian::gaussian_stats st = op.k.stats[r];
    if (bad_operand(mean, sd, d, false) || bad_operand(old_mean, old_sd, d, false) || !usable_stats(st) ||
        op.bad_upstream(r, d)) {
      op.reject(r, d);
      continue;
    }
    op.row(r, d, mean, sd, old_mean, old_sd, solved_tilt(st), solved_gap(st));
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
