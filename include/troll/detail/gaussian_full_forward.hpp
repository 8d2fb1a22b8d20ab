// troll/detail/gaussian_full_forward.hpp — the forward projection of one full-covariance
// Gaussian row as team steps (gaussian_matrix_steps.hpp), written once for host and device: the
// factorisation of cpu/gaussian_kernels.hpp (E = L°⁻¹(L̃ − L°), S − I = E + Eᵀ + EEᵀ = V diag(λ − 1)
// Vᵀ, here by the parallel-order Jacobi of gaussian_jacobi.hpp), the shared solve
// (solve_gaussian_family) with the member's sums split over the team, and the write-back
// L* = L°·chol(V diag(1/a) Vᵀ). The device runs it with a block per row for d > 32
// (cuda/gaussian_full_block_kernels.cuh); tests/test_gaussian_full_steps.cpp runs the host
// instantiation against the CPU backend.
//
// Scratch: a full_scratch with forward_matrices matrices and forward_vectors vectors.
#pragma once

#include <cstddef>

#include "../config.hpp"
#include "../gaussian_types.hpp"
#include "../projection_types.hpp"
#include "gaussian_family.hpp"
#include "gaussian_full_derivatives.hpp"
#include "gaussian_jacobi.hpp"
#include "gaussian_matrix_steps.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

constexpr int forward_matrices = 4;
constexpr int forward_vectors = 8;
/// Doubles of the forward's row scratch.
TROLL_HOST_DEVICE constexpr std::size_t forward_scratch_doubles(std::size_t d) {
  return forward_matrices * d * d + forward_vectors * d;
}

/// The Gaussian family of the shared solve with its sums split over a team.
template <class Team>
struct gaussian_team_family {
  Team tm;
  gaussian_spectrum row;
  TROLL_HOST_DEVICE gaussian_point evaluate(const tilt_param& u, const gaussian_point&, double, double) const {
    double kl_sum = 0.0, info = 0.0;
    for (int i = tm.lane(); i < row.dim; i += tm.size())
      gaussian_coordinate(row.g[i], row.with_mean ? row.b[i] : 0.0, u.t, row.with_mean, &kl_sum, &info);
    return gaussian_point_at(u, tm.sum(kl_sum), tm.sum(info));
  }
};

/// The factorisation of one full row pair into w: L° in mat(0), V in mat(1), g in vec(0), b in
/// vec(1) (mat(2), mat(3), vec(2) to vec(5) are work). Needs w.mats ≥ 4 and 6 vectors.
template <class Team, class T>
TROLL_HOST_DEVICE void factor_full_team(const Team& tm, const T* mean, const T* l_new, const T* old_mean,
                                        const T* l_old, const full_scratch& w) {
  namespace fs = full_steps;
  const int d = w.d, dd = d * d;
  double *lo = w.mat(0), *v = w.mat(1), *m2 = w.mat(2), *m3 = w.mat(3);
  double *delta = w.vec(2), *diff = w.vec(3), *cs = w.vec(4);
  fs::load_lower(tm, d, l_old, lo);
  steps::lower_inverse(tm, d, lo, m2);
  for (int i = tm.lane(); i < d; i += tm.size())
    diff[i] = static_cast<double>(mean[i]) - static_cast<double>(old_mean[i]);
  tm.sync();
  steps::mul_vec(tm, d, m2, false, diff, delta);  // δ = L°⁻¹(μ̃ − μ°)
  fs::load_lower(tm, d, l_new, m3);
  steps::axpby(tm, dd, 1.0, m3, -1.0, lo, m3);
  steps::mul(tm, d, m2, false, m3, false, v);  // E (in V's place until the eigensolver)
  steps::plus_transpose(tm, d, v, m2);
  steps::mul(tm, d, v, false, v, true, m3);
  steps::axpby(tm, dd, 1.0, m3, 1.0, m2, m3);  // S − I
  jacobi_eigen(tm, d, m3, v, cs);
  for (int i = tm.lane(); i < d; i += tm.size()) w.vec(0)[i] = gaussian_gain(m3[i * d + i]);
  tm.sync();
  steps::mul_vec(tm, d, v, true, delta, w.vec(1));  // b = Vᵀδ
}

/// The lower Cholesky factor of the symmetric positive definite `a` in place (upper set to 0),
/// right-looking, one column a step.
template <class Team>
TROLL_HOST_DEVICE void cholesky_in_place(const Team& tm, int d, double* a) {
  for (int c = 0; c < d; ++c) {
    if (tm.lane() == 0) a[c * d + c] = ::sqrt(a[c * d + c]);
    tm.sync();
    for (int i = c + 1 + tm.lane(); i < d; i += tm.size()) a[i * d + c] /= a[c * d + c];
    tm.sync();
    const int rest = d - c - 1;
    for (int e = tm.lane(); e < rest * rest; e += tm.size()) {
      const int i = c + 1 + e / rest, j = c + 1 + e % rest;
      if (j <= i) a[i * d + j] -= a[i * d + c] * a[j * d + c];
    }
    tm.sync();
  }
  for (int e = tm.lane(); e < d * d; e += tm.size())
    if (e % d > e / d) a[e] = 0.0;
  tm.sync();
}

/// The forward projection of one full row whose operands passed their checks (the team's scratch
/// `w`, forward_matrices / forward_vectors). Writes μ*, L* and the stats (lane 0); `saved` (may be
/// null) gets V, g, b. Returns false, having written nothing, for a row the projection refuses
/// (gaussian_row_refused: the CPU throws for it; the device rejects it).
template <class Team, class T>
TROLL_HOST_DEVICE bool gaussian_full_forward_row(const Team& tm, bool split, const T* mean, const T* l_new,
                                                 const T* old_mean, const T* l_old, double eps_mean, double eps_cov,
                                                 const projection_options& opt, T* out_mean, T* out_l,
                                                 gaussian::gaussian_stats* stats, double* saved,
                                                 const full_scratch& w) {
  const int d = w.d, dd = d * d;
  factor_full_team(tm, mean, l_new, old_mean, l_old, w);
  // The CPU's refusals beyond bad operands (w.vec(2) holds δ = L°⁻¹(μ̃ − μ°) until the solve).
  if (gaussian_row_refused(tm, split, l_new, l_old, d + 1, w.vec(2), d)) return false;
  double *lo = w.mat(0), *v = w.mat(1), *inner = w.mat(2), *product = w.mat(3);
  double *g = w.vec(0), *b = w.vec(1), *a = w.vec(2), *m = w.vec(3), *x = w.vec(4), *y = w.vec(5);
  if (saved != nullptr) {
    for (int e = tm.lane(); e < dd; e += tm.size()) saved[e] = v[e];
    for (int i = tm.lane(); i < d; i += tm.size()) {
      saved[dd + i] = g[i];
      saved[dd + d + i] = b[i];
    }
    tm.sync();
  }
  gaussian::gaussian_stats st;
  if (split) {
    const double mk = 0.5 * steps::dot(tm, d, b, b);
    const double kappa = split_mean_scale(mk, eps_mean);
    st.mean_kl_before = mk;
    st.mean_kl_after = kappa < 1.0 ? eps_mean : mk;
    st.omega = kappa < 1.0 ? 1.0 / kappa - 1.0 : 0.0;
    for (int i = tm.lane(); i < d; i += tm.size()) {
      const double mo = static_cast<double>(old_mean[i]);
      out_mean[i] = kappa < 1.0 ? static_cast<T>(mo + kappa * (static_cast<double>(mean[i]) - mo)) : mean[i];
    }
    tm.sync();
  }
  const gaussian_spectrum spectrum{g, b, d, !split};
  const gaussian_solve_result s =
      solve_gaussian_family(gaussian_team_family<Team>{tm, spectrum}, split ? eps_cov : eps_mean, opt);
  st.status = s.status;
  st.kl_before = s.kl_before;
  st.iterations = s.iterations;
  if (s.status == row_status::inactive) {
    st.kl_after = s.kl_before;
    for (int e = tm.lane(); e < dd; e += tm.size()) out_l[e] = l_new[e];
    if (!split)
      for (int i = tm.lane(); i < d; i += tm.size()) out_mean[i] = mean[i];
  } else {
    st.t = s.point.t;
    st.eta = s.point.s / s.point.t;
    st.kl_after = s.point.kl;
    st.fisher = s.point.sigma2;
    const double t = s.point.t;
    for (int i = tm.lane(); i < d; i += tm.size()) {
      a[i] = 1.0 + t * g[i];
      m[i] = (t * (1.0 + g[i]) / a[i]) * b[i];  // tγ/a first: no overflow for a huge γ
      x[i] = 1.0 / a[i];
    }
    tm.sync();
    if (!split) {  // μ* = μ° + L° V m
      steps::mul_vec(tm, d, v, false, m, y);
      steps::mul_vec(tm, d, lo, false, y, m);
      for (int i = tm.lane(); i < d; i += tm.size())
        out_mean[i] = static_cast<T>(static_cast<double>(old_mean[i]) + m[i]);
    }
    steps::mul_diag(tm, d, v, x, inner);
    cholesky_in_place(tm, d, inner);
    steps::mul(tm, d, lo, false, inner, false, product);
    full_steps::store_lower(tm, d, product, 1.0, out_l);
  }
  if (tm.lane() == 0) *stats = st;
  tm.sync();
  return true;
}

}  // namespace detail
TROLL_END_NAMESPACE
