// troll/detail/cuda/gaussian_kernels.cuh — the Gaussian projections on the device, one warp
// (one 32-thread block) per row. The per-row maths is gaussian_family.hpp's, shared with the CPU:
// the same coordinates (gaussian_diag_coordinate, gaussian_gain), the same solve
// (solve_gaussian_family) with a warp-parallel member whose sums reach every lane in one fixed
// order, so all lanes take the same Newton path. Full covariances factorise in shared memory:
// E = L°⁻¹(L̃ − L°), S − I = E + Eᵀ + EEᵀ, its eigendecomposition by cyclic Jacobi rotations
// (d ≤ 32: one lane per column), then L* = L°·chol(V diag(1/a) Vᵀ) as on the CPU.
//
// Rows that fail the CPU's value checks (non-finite entries, standard deviations or factor
// diagonals ≤ 0, non-zeros above a factor's diagonal) or that the projection refuses
// (gaussian_row_refused: a ratio or a whitened mean step beyond the doubles) are written as NaN
// with status rejected.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../gaussian_types.hpp"
#include "../../projection_types.hpp"
#include "../gaussian_family.hpp"
#include "../gaussian_forward_call.hpp"
#include "../gaussian_jacobi.hpp"
#include "../numeric.hpp"
#include "../workspace_layout.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

constexpr int gaussian_warp = 32;
/// Largest d of a full-covariance row on one warp (one lane per column, 4d² + 4d doubles of
/// shared memory: 33 KB at d = 32); above, up to gaussian_full_block_dim, one block per row with
/// the row in the caller's workspace (gaussian_full_block_kernels.cuh).
constexpr std::size_t gaussian_full_max_dim = gaussian_full_warp_dim;
/// Largest d of a diagonal row on the device (2d doubles of shared memory: 32 KB).
constexpr std::size_t gaussian_diag_max_dim = 2048;
/// Largest d the device takes: full rows up to gaussian_full_block_dim, diagonal ones up to
/// gaussian_diag_max_dim.
constexpr std::size_t gaussian_max_dim(bool full) { return full ? gaussian_full_block_dim : gaussian_diag_max_dim; }

/// A sum over the lanes of one warp, in one fixed order (down the lanes to lane 0, then
/// broadcast): every lane gets the same bits.
__device__ inline double warp_sum(double x) {
  for (int offset = gaussian_warp / 2; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  return __shfl_sync(0xffffffffu, x, 0);
}

/// The Gaussian family of the shared solve with its sums split over the lanes of a warp.
struct gaussian_warp_family {
  gaussian_spectrum row;
  // Host-and-device so that the solve's host instantiation type-checks; only called on the device.
  TROLL_HOST_DEVICE gaussian_point evaluate(const tilt_param& u, const gaussian_point&, double, double) const {
#ifdef __CUDA_ARCH__
    double kl_sum = 0.0, info = 0.0;
    for (int i = static_cast<int>(threadIdx.x); i < row.dim; i += gaussian_warp)
      gaussian_coordinate(row.g[i], row.with_mean ? row.b[i] : 0.0, u.t, row.with_mean, &kl_sum, &info);
    return gaussian_point_at(u, warp_sum(kl_sum), warp_sum(info));
#else
    return gaussian_member(row, u);
#endif
  }
};

/// The device's view of one launch: the operands, the bounds and the options.
template <class T>
using gaussian_launch = gaussian_forward_launch<T>;

__device__ inline bool finite_value(double x) { return x - x == 0.0; }

/// Whether any lane found a bad value in one row operand (the CPU's gaussian_operand_problem).
template <class T>
__device__ bool bad_operand(const T* mean, const T* cov, std::size_t d, bool full) {
  bool bad = false;
  const int lane = static_cast<int>(threadIdx.x);
  for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp) bad |= !finite_value(static_cast<double>(mean[i]));
  if (!full) {
    for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp) {
      const double x = static_cast<double>(cov[i]);
      bad |= !(x > 0.0 && x < inf());
    }
  } else {
    for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp) {
      for (std::size_t j = 0; j < d; ++j) {
        const double x = static_cast<double>(cov[i * d + j]);
        bad |= j > i ? x != 0.0 : !finite_value(x);
        if (j == i) bad |= !(x > 0.0);
      }
    }
  }
  return __any_sync(0xffffffffu, bad);
}

/// The calling thread's index in its block, as a team's lane (0 in the host instantiations, which
/// only type-check the shared steps: the teams run on the device).
TROLL_HOST_DEVICE inline int team_lane() {
#ifdef __CUDA_ARCH__
  return static_cast<int>(threadIdx.x);
#else
  return 0;
#endif
}

/// One warp as a team of gaussian_row_refused (the kernels below run one warp per row).
struct warp_team {
  TROLL_HOST_DEVICE int lane() const { return team_lane(); }
  TROLL_HOST_DEVICE int size() const { return gaussian_warp; }
  TROLL_HOST_DEVICE double sum(double x) const {
#ifdef __CUDA_ARCH__
    return warp_sum(x);
#else
    return x;
#endif
  }
};

/// The stats of a rejected row: every number NaN, status rejected.
__device__ inline gaussian::gaussian_stats rejected_gaussian_stats() {
  gaussian::gaussian_stats s;
  s.t = s.eta = s.omega = s.kl_before = s.kl_after = s.mean_kl_before = s.mean_kl_after = s.fisher = quiet_nan();
  s.status = row_status::rejected;
  return s;
}

/// A rejected row: NaN outputs and stats, status rejected.
template <class T>
__device__ void reject_row(const gaussian_launch<T>& k, std::size_t r, std::size_t cov_size) {
  const T nan_t = static_cast<T>(quiet_nan());
  for (std::size_t i = threadIdx.x; i < k.out_mean.cols; i += gaussian_warp) k.out_mean.row(r)[i] = nan_t;
  for (std::size_t i = threadIdx.x; i < cov_size; i += gaussian_warp) k.out_cov.row(r)[i] = nan_t;
  if (threadIdx.x == 0) k.stats[r] = rejected_gaussian_stats();
}

/// The split mean step and the solve of one factorised row (spectrum in shared memory), by the
/// whole warp. Writes the mean when split (and the stats); returns the solve.
template <class T>
__device__ gaussian_solve_result solve_row(const gaussian_launch<T>& k, std::size_t r, const double* g,
                                           const double* b, int d, gaussian::gaussian_stats* stats) {
  const int lane = static_cast<int>(threadIdx.x);
  if (k.split) {
    double partial = 0.0;
    for (int i = lane; i < d; i += gaussian_warp) partial += b[i] * b[i];
    const double m = 0.5 * warp_sum(partial);
    const double kappa = split_mean_scale(m, k.eps_mean);
    stats->mean_kl_before = m;
    stats->mean_kl_after = kappa < 1.0 ? k.eps_mean : m;
    stats->omega = kappa < 1.0 ? 1.0 / kappa - 1.0 : 0.0;
    const T* mean = k.mean.row(r);
    const T* old_mean = k.old_mean.row(r);
    T* out = k.out_mean.row(r);
    for (int i = lane; i < d; i += gaussian_warp) {
      const double mo = static_cast<double>(old_mean[i]);
      out[i] = kappa < 1.0 ? static_cast<T>(mo + kappa * (static_cast<double>(mean[i]) - mo)) : mean[i];
    }
  }
  const gaussian_spectrum spectrum{g, b, d, !k.split};
  const gaussian_solve_result s =
      solve_gaussian_family(gaussian_warp_family{spectrum}, k.split ? k.eps_cov : k.eps_mean, k.options);
  stats->status = s.status;
  stats->kl_before = s.kl_before;
  stats->iterations = s.iterations;
  if (s.status == row_status::inactive) {
    stats->kl_after = s.kl_before;
  } else {
    stats->t = s.point.t;
    stats->eta = s.point.s / s.point.t;
    stats->kl_after = s.point.kl;
    stats->fisher = s.point.sigma2;
  }
  return s;
}

/// Diagonal rows: one warp per row, g and b in dynamic shared memory (2d doubles).
template <class T>
__global__ void __launch_bounds__(gaussian_warp) gaussian_diag_kernel(gaussian_launch<T> k) {
  extern __shared__ double gaussian_shared[];
  const std::size_t d = k.mean.cols;
  double* g = gaussian_shared;
  double* b = gaussian_shared + d;
  const int lane = static_cast<int>(threadIdx.x);
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *sd = k.cov.row(r), *old_mean = k.old_mean.row(r), *old_sd = k.old_cov.row(r);
    if (bad_operand(mean, sd, d, false) || bad_operand(old_mean, old_sd, d, false)) {
      reject_row(k, r, d);
      continue;
    }
    for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp)
      gaussian_diag_coordinate(static_cast<double>(mean[i]), static_cast<double>(sd[i]),
                               static_cast<double>(old_mean[i]), static_cast<double>(old_sd[i]), &g[i], &b[i]);
    __syncwarp();
    if (gaussian_row_refused(warp_team{}, k.split, sd, old_sd, 1, b, static_cast<int>(d))) {  // b: (μ̃ − μ°)/σ°
      reject_row(k, r, d);
      continue;
    }
    gaussian::gaussian_stats stats;
    const gaussian_solve_result s = solve_row(k, r, g, b, static_cast<int>(d), &stats);
    T* out_mean = k.out_mean.row(r);
    T* out_sd = k.out_cov.row(r);
    if (s.status == row_status::inactive) {
      for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp) {
        out_sd[i] = sd[i];
        if (!k.split) out_mean[i] = mean[i];
      }
    } else {
      const double t = s.point.t;
      for (std::size_t i = static_cast<std::size_t>(lane); i < d; i += gaussian_warp) {
        const double so = static_cast<double>(old_sd[i]);
        const double a = 1.0 + t * g[i];
        out_sd[i] = static_cast<T>(so / ::sqrt(a));
        if (!k.split) out_mean[i] = static_cast<T>(static_cast<double>(old_mean[i]) + so * ((t * (1.0 + g[i]) / a) * b[i]));
      }
    }
    if (lane == 0) k.stats[r] = stats;
    __syncwarp();
  }
}

/// One cyclic-Jacobi sweep's rotation of the symmetric d×d matrix `a` (row-major, shared) in the
/// plane (p, q), accumulated into the eigenvectors `v`; lane k updates row / column k.
__device__ inline void jacobi_rotate(double* a, double* v, int d, int p, int q) {
  const int k = static_cast<int>(threadIdx.x);
  const double apq = a[p * d + q];
  if (apq == 0.0) return;  // the same value in every lane: all lanes return together
  double c = 1.0, s = 0.0;
  jacobi_rotation(a[p * d + p], a[q * d + q], apq, &c, &s);
  __syncwarp();
  if (k < d) rotate_pair(&a[k * d + p], &a[k * d + q], c, s);  // A ← A J (columns p, q of row k)
  __syncwarp();
  if (k < d) {  // A ← Jᵀ A (rows p, q of column k)
    rotate_pair(&a[p * d + k], &a[q * d + k], c, s);
    rotate_pair(&v[k * d + p], &v[k * d + q], c, s);
  }
  __syncwarp();
}

/// The factorisation of one full row pair by the whole warp (d ≤ 32), into shared memory: L° in
/// `lo`, E = L°⁻¹(L̃ − L°) in `work`, S − I diagonalised in `a` with eigenvectors `v`, g = γ − 1,
/// δ = L°⁻¹(μ̃ − μ°) and b = Vᵀδ (each of d² or d doubles). Ends synchronised.
template <class T>
__device__ void factor_full_row(const T* mean, const T* l_new, const T* old_mean, const T* l_old, int d, double* lo,
                                double* work, double* a, double* v, double* g, double* b, double* delta) {
  const int dd = d * d;
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < dd; i += gaussian_warp) lo[i] = static_cast<double>(l_old[i]);
  __syncwarp();
  // E = L°⁻¹(L̃ − L°), column `lane` by forward substitution (E is lower-triangular).
  if (lane < d) {
    for (int i = 0; i < d; ++i) {
      double x = i >= lane ? static_cast<double>(l_new[i * d + lane]) - lo[i * d + lane] : 0.0;
      for (int m = lane; m < i; ++m) x -= lo[i * d + m] * work[m * d + lane];
      work[i * d + lane] = i >= lane ? x / lo[i * d + i] : 0.0;
    }
  }
  __syncwarp();
  // S − I = E + Eᵀ + EEᵀ; V = I.
  if (lane < d) {
    for (int i = 0; i < d; ++i) {
      double x = work[i * d + lane] + work[lane * d + i];
      for (int m = 0; m < d; ++m) x += work[i * d + m] * work[lane * d + m];
      a[i * d + lane] = x;
      v[i * d + lane] = i == lane ? 1.0 : 0.0;
    }
  }
  __syncwarp();
  // Cyclic Jacobi until the off-diagonal mass is below (1e-18 ‖A‖)² (or 40 sweeps).
  for (int sweep = 0; sweep < 40; ++sweep) {
    double off = 0.0, total = 0.0;
    if (lane < d) {
      for (int i = 0; i < d; ++i) {
        const double x = a[i * d + lane];
        total += x * x;
        if (i != lane) off += x * x;
      }
    }
    off = warp_sum(off);
    total = warp_sum(total);
    if (!(off > 1e-36 * total)) break;
    for (int p = 0; p < d - 1; ++p)
      for (int q = p + 1; q < d; ++q) jacobi_rotate(a, v, d, p, q);
  }
  // g from the eigenvalues λ − 1; δ = L°⁻¹(μ̃ − μ°) (lane 0); b = Vᵀδ.
  if (lane < d) g[lane] = gaussian_gain(a[lane * d + lane]);
  if (lane == 0) {
    for (int i = 0; i < d; ++i) {
      double x = static_cast<double>(mean[i]) - static_cast<double>(old_mean[i]);
      for (int m = 0; m < i; ++m) x -= lo[i * d + m] * delta[m];
      delta[i] = x / lo[i * d + i];
    }
  }
  __syncwarp();
  if (lane < d) {
    double x = 0.0;
    for (int m = 0; m < d; ++m) x += v[m * d + lane] * delta[m];
    b[lane] = x;
  }
  __syncwarp();
}

/// Full rows (d ≤ 32): one warp per row; shared memory holds L°, a work matrix, the matrix being
/// diagonalised / its eigenvectors, and g, b, δ (4d² + 4d doubles).
template <class T>
__global__ void __launch_bounds__(gaussian_warp) gaussian_full_kernel(gaussian_launch<T> k) {
  extern __shared__ double gaussian_shared[];
  const int d = static_cast<int>(k.mean.cols);
  const int dd = d * d;
  double* lo = gaussian_shared;     // L°, row-major, upper 0
  double* work = lo + dd;           // E, then the inner matrix and its Cholesky factor
  double* a = work + dd;            // S − I, diagonalised in place
  double* v = a + dd;               // eigenvectors (columns)
  double* g = v + dd;
  double* b = g + d;
  double* delta = b + d;
  double* y = delta + d;
  const int lane = static_cast<int>(threadIdx.x);
  for (std::size_t r = blockIdx.x; r < k.mean.rows; r += gridDim.x) {
    const T *mean = k.mean.row(r), *l_new = k.cov.row(r), *old_mean = k.old_mean.row(r), *l_old = k.old_cov.row(r);
    if (bad_operand(mean, l_new, d, true) || bad_operand(old_mean, l_old, d, true)) {
      reject_row(k, r, static_cast<std::size_t>(dd));
      continue;
    }
    factor_full_row(mean, l_new, old_mean, l_old, d, lo, work, a, v, g, b, delta);
    if (gaussian_row_refused(warp_team{}, k.split, l_new, l_old, d + 1, delta, d)) {  // delta: L°⁻¹(μ̃ − μ°)
      reject_row(k, r, static_cast<std::size_t>(dd));
      continue;
    }
    if (k.saved.data != nullptr) {  // the layout of cpu::save_basis: V row-major, then g, b
      double* out = k.saved.row(r);
      for (int i = lane; i < dd; i += gaussian_warp) out[i] = v[i];
      for (int i = lane; i < d; i += gaussian_warp) {
        out[dd + i] = g[i];
        out[dd + d + i] = b[i];
      }
    }
    gaussian::gaussian_stats stats;
    const gaussian_solve_result s = solve_row(k, r, g, b, d, &stats);
    T* out_mean = k.out_mean.row(r);
    T* out_l = k.out_cov.row(r);
    if (s.status == row_status::inactive) {
      for (int i = lane; i < dd; i += gaussian_warp) out_l[i] = l_new[i];
      if (!k.split)
        for (int i = lane; i < d; i += gaussian_warp) out_mean[i] = mean[i];
    } else {
      const double t = s.point.t;
      // The member in the basis: a_i = 1 + t g_i (kept in delta), m_i = t γ_i b_i / a_i (in y).
      __syncwarp();
      if (lane < d) {
        const double ai = 1.0 + t * g[lane];
        delta[lane] = ai;
        y[lane] = t * (1.0 + g[lane]) * b[lane] / ai;
      }
      __syncwarp();
      if (!k.split && lane < d) {  // μ* = μ° + L° V m, V m first (kept in b: no longer needed)
        double x = 0.0;
        for (int m = 0; m < d; ++m) x += v[lane * d + m] * y[m];
        b[lane] = x;
      }
      __syncwarp();
      if (!k.split && lane < d) {
        double x = static_cast<double>(old_mean[lane]);
        for (int m = 0; m <= lane; ++m) x += lo[lane * d + m] * b[m];
        out_mean[lane] = static_cast<T>(x);
      }
      // inner = V diag(1/a) Vᵀ, column `lane`.
      if (lane < d) {
        for (int i = 0; i < d; ++i) {
          double x = 0.0;
          for (int m = 0; m < d; ++m) x += v[i * d + m] * v[lane * d + m] / delta[m];
          work[i * d + lane] = x;
        }
      }
      __syncwarp();
      // Its Cholesky factor in place (lower triangle), column by column.
      for (int c = 0; c < d; ++c) {
        if (lane == 0) work[c * d + c] = ::sqrt(work[c * d + c]);
        __syncwarp();
        if (lane > c && lane < d) work[lane * d + c] /= work[c * d + c];
        __syncwarp();
        if (lane > c && lane < d)
          for (int i = lane; i < d; ++i) work[i * d + lane] -= work[i * d + c] * work[lane * d + c];
        __syncwarp();
      }
      // L* = L° C, column `lane`.
      if (lane < d) {
        for (int i = 0; i < d; ++i) {
          double x = 0.0;
          for (int m = lane; m <= i; ++m) x += lo[i * d + m] * work[m * d + lane];
          out_l[i * d + lane] = i >= lane ? static_cast<T>(x) : T(0);
        }
      }
    }
    if (lane == 0) k.stats[r] = stats;
    __syncwarp();
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
