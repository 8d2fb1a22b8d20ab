// troll/detail/gaussian_full_derivatives.hpp — the VJP and JVP of one full-covariance Gaussian
// projection row as a sequence of small matrix steps (gaussian_matrix_steps.hpp) over plain
// arrays, written once for host and device. The maths is the CPU's Eigen version
// (cpu/gaussian_backward_kernels.hpp and cpu/gaussian_jvp_kernels.hpp, whose header comments
// derive it) step for step; tests/test_gaussian_full_steps.cpp checks the host instantiation
// against it, and the device runs the same steps with a warp per row.
//
// The caller factorises the row first (or reads a saved factorisation) into the scratch:
// L° in mat(0), V in mat(1), g = γ − 1 in vec(0), b in vec(1); the rest is the steps' work.
#pragma once

#include <cstddef>

#include "../config.hpp"
#include "gaussian_family.hpp"
#include "gaussian_matrix_steps.hpp"
#include "gaussian_row_io.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The scratch of one row: full_scratch::matrices d×d matrices then full_scratch::vectors
/// d-vectors, doubles(d) doubles in all.
struct full_scratch {
  static constexpr int matrices = 13;
  static constexpr int vectors = 18;
  static constexpr std::size_t doubles(std::size_t d) { return matrices * d * d + vectors * d; }
  double* base;
  int d;
  int mats = matrices;  ///< matrices before the vectors (fewer for the forward's scratch)
  TROLL_HOST_DEVICE double* mat(int k) const { return base + k * d * d; }
  TROLL_HOST_DEVICE double* vec(int k) const { return base + mats * d * d + k * d; }
};

namespace full_steps {

/// x = the d entries of src (0 for a null src).
template <class Team, class T>
TROLL_HOST_DEVICE void load_vec(const Team& tm, int d, const T* src, double* x) {
  for (int i = tm.lane(); i < d; i += tm.size()) x[i] = src == nullptr ? 0.0 : static_cast<double>(src[i]);
  tm.sync();
}

/// x = the lower triangle of the row-major d×d src (upper 0; all 0 for a null src).
template <class Team, class T>
TROLL_HOST_DEVICE void load_lower(const Team& tm, int d, const T* src, double* x) {
  for (int e = tm.lane(); e < d * d; e += tm.size())
    x[e] = src == nullptr || e % d > e / d ? 0.0 : static_cast<double>(src[e]);
  tm.sync();
}

/// out = α × the lower triangle of x (upper written 0).
template <class Team, class T>
TROLL_HOST_DEVICE void store_lower(const Team& tm, int d, const double* x, double alpha, T* out) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) out[e] = e % d > e / d ? T(0) : static_cast<T>(alpha * x[e]);
  tm.sync();
}

template <class Team, class T>
TROLL_HOST_DEVICE void store_vec(const Team& tm, int d, const double* x, T* out) {
  for (int i = tm.lane(); i < d; i += tm.size()) out[i] = static_cast<T>(x[i]);
  tm.sync();
}

/// I(t) of the row's spectrum (gaussian_member's sums, split over the team).
template <class Team>
TROLL_HOST_DEVICE double fisher(const Team& tm, int d, const double* g, const double* b, double t, bool with_mean) {
  double kl_sum = 0.0, info = 0.0;
  for (int i = tm.lane(); i < d; i += tm.size()) gaussian_coordinate(g[i], with_mean ? b[i] : 0.0, t, with_mean, &kl_sum, &info);
  return tm.sum(info);
}

/// Natural-parameter gradients (h̄, Λ̄) and a direct mean gradient m̄ of one Gaussian (μ, L, P = Λ)
/// turned into ∂/∂μ = m̄ + P h̄ and ∂/∂L = lower(2 Σ̄ L), Σ̄ = −P(Λ̄ + sym(h̄ μᵀ))P. Λ̄ is
/// overwritten; t1, t2 and v are scratch.
template <class Team, class T>
TROLL_HOST_DEVICE void natural_to_factor(const Team& tm, int d, const double* mu, const double* l, const double* p,
                                         const double* h_bar, double* lambda_bar, const double* mean_bar,
                                         T* out_mean, T* out_cov, double* t1, double* t2, double* v) {
  if (out_mean != nullptr) {
    steps::mul_vec(tm, d, p, false, h_bar, v);
    steps::axpby(tm, d, 1.0, mean_bar, 1.0, v, v);
    store_vec(tm, d, v, out_mean);
  }
  if (out_cov == nullptr) return;
  steps::add_rank2(tm, d, h_bar, mu, 0.5, lambda_bar);
  steps::mul(tm, d, p, false, lambda_bar, false, t1);
  steps::mul(tm, d, t1, false, p, false, t2);
  steps::mul(tm, d, t2, false, l, false, t1);
  store_lower(tm, d, t1, -2.0, out_cov);
}

/// The factorisation's derived matrices: L°⁻¹ in mat(2), W = L°V in mat(3), W⁻ᵀ = L°⁻ᵀV in
/// mat(4), Λ° in mat(5), Λ̃ − Λ° = W⁻ᵀ diag(g) W⁻¹ in mat(6).
template <class Team>
TROLL_HOST_DEVICE void derived(const Team& tm, const full_scratch& w) {
  const int d = w.d;
  steps::lower_inverse(tm, d, w.mat(0), w.mat(2));
  steps::mul(tm, d, w.mat(2), true, w.mat(2), false, w.mat(5));
  steps::mul(tm, d, w.mat(0), false, w.mat(1), false, w.mat(3));
  steps::mul(tm, d, w.mat(2), true, w.mat(1), false, w.mat(4));
  steps::mul_diag(tm, d, w.mat(4), w.vec(0), w.mat(6));
}

}  // namespace full_steps

/// The VJP of one full-covariance row (validated inputs, a solved row, t = 1 when inactive; `gap`
/// = 1 − t exact, solved_gap), the factorisation already in `w` (header comment).
template <class Team, class T>
TROLL_HOST_DEVICE void gaussian_full_vjp_row(const Team& tm, bool split, const T* mean, const T* cov,
                                             const T* old_mean, double eps_mean, double t, double gap,
                                             const gaussian_vjp_io<T>& io, const full_scratch& w) {
  namespace fs = full_steps;
  const int d = w.d, dd = d * d;
  double *lo = w.mat(0), *w_mat = w.mat(3), *p_old = w.mat(5), *p_step = w.mat(6), *sig = w.mat(7);
  double *t1 = w.mat(8), *t2 = w.mat(9), *t3 = w.mat(10), *lam_new = w.mat(11), *lam_old = w.mat(12);
  double *g = w.vec(0), *b = w.vec(1), *mu_new = w.vec(2), *mu_old = w.vec(3), *gm = w.vec(4);
  double *h_new = w.vec(5), *h_old = w.vec(6), *m_new = w.vec(7), *m_old = w.vec(8), *delta = w.vec(9);
  double *mu_star = w.vec(10), *h_bar = w.vec(11), *eh_dot = w.vec(12), *a = w.vec(13), *v1 = w.vec(14),
         *v2 = w.vec(15), *cm = w.vec(16), *x = w.vec(17);
  fs::derived(tm, w);
  fs::load_vec(tm, d, mean, mu_new);
  fs::load_vec(tm, d, old_mean, mu_old);
  fs::load_vec(tm, d, io.grad_out_mean, gm);
  steps::fill(tm, dd, 0.0, lam_new);
  steps::fill(tm, dd, 0.0, lam_old);
  steps::fill(tm, d, 0.0, h_new);
  steps::fill(tm, d, 0.0, h_old);
  steps::fill(tm, d, 0.0, m_new);
  steps::fill(tm, d, 0.0, m_old);
  double eps_bar = 0.0, eps_mean_bar = 0.0;

  if (split) {
    steps::axpby(tm, d, 1.0, mu_new, -1.0, mu_old, v1);  // μ̃ − μ°
    const double m = 0.5 * steps::dot(tm, d, b, b);
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      const double kappa_bar = steps::dot(tm, d, gm, v1);
      const double k = kappa_bar * kappa / (2.0 * m);
      steps::mul_vec(tm, d, p_old, false, v1, v2);
      steps::axpby(tm, d, kappa, gm, -k, v2, m_new);
      steps::axpby(tm, d, 1.0, gm, -1.0, m_new, m_old);
      steps::add_rank2(tm, d, v1, v1, -0.25 * k, lam_old);
      eps_mean_bar = kappa_bar * kappa / (2.0 * eps_mean);
    } else {
      steps::axpby(tm, d, 1.0, gm, 0.0, gm, m_new);
    }
  }
  const bool inactive = t >= 1.0;
  if (inactive) {
    if (!split) steps::axpby(tm, d, 1.0, m_new, 1.0, gm, m_new);
    if (io.mean != nullptr) fs::store_vec(tm, d, m_new, io.mean);
    if (io.cov != nullptr) {
      fs::load_lower(tm, d, io.grad_out_cov, t1);
      fs::store_lower(tm, d, t1, 1.0, io.cov);
    }
  } else {
    const double s = gap;  // 1 − t, exact (solved_gap)
    for (int i = tm.lane(); i < d; i += tm.size()) {
      a[i] = 1.0 + t * g[i];
      cm[i] = (t * (1.0 + g[i]) / a[i]) * b[i];
      x[i] = 1.0 / a[i];
    }
    tm.sync();
    steps::mul_diag(tm, d, w_mat, x, sig);  // Σ* = W diag(1/a) Wᵀ
    // Σ̄ from L̄ (cholesky_backward): ½ sym(L⁻ᵀ Φ(Lᵀ L̄) L⁻¹), L = L*.
    fs::load_lower(tm, d, io.out_cov, t1);
    fs::load_lower(tm, d, io.grad_out_cov, t2);
    steps::mul(tm, d, t1, true, t2, false, t3);
    steps::lower_half_diagonal(tm, d, t3);
    steps::lower_inverse(tm, d, t1, t2);                 // L*⁻¹
    steps::mul(tm, d, t2, true, t3, false, t1);          // L⁻ᵀ P
    steps::mul(tm, d, t1, false, t2, false, t3);         // L⁻ᵀ P L⁻¹
    steps::symmetrise(tm, d, t3, t1);                    // Σ̄
    steps::mul(tm, d, sig, false, t1, false, t2);
    steps::mul(tm, d, t2, false, sig, false, t3, -1.0);  // Λ̄ = −Σ Σ̄ Σ (in t3)
    steps::mul_vec(tm, d, w_mat, false, cm, delta);      // μ* − μ°
    steps::axpby(tm, d, 1.0, mu_old, 1.0, delta, mu_star);
    if (!split) {
      steps::mul_vec(tm, d, sig, false, gm, h_bar);
      steps::add_rank2(tm, d, h_bar, mu_star, -0.5, t3);
    } else {
      steps::fill(tm, d, 0.0, h_bar);
    }
    double t_bar = steps::dot(tm, dd, t3, p_step);
    if (!split) {
      // h̃ − h° = Λ̃(μ̃ − μ°) + (Λ̃ − Λ°)μ°
      steps::axpby(tm, d, 1.0, mu_new, -1.0, mu_old, v1);
      steps::mul_vec(tm, d, p_old, false, v1, v2);
      steps::mul_vec(tm, d, p_step, false, v1, v2, 1.0, 1.0);
      steps::mul_vec(tm, d, p_step, false, mu_old, v2, 1.0, 1.0);
      t_bar += steps::dot(tm, d, h_bar, v2);
    }
    const double info = fs::fisher(tm, d, g, b, t, !split);
    const double cst = t_bar / (t * info);
    // η̇_Λ = −½ Σ̇ = W diag(g / (2a²)) Wᵀ (t1); η° − η_t: −½ W diag(t g / a) Wᵀ (t2).
    for (int i = tm.lane(); i < d; i += tm.size()) x[i] = 0.5 * g[i] / (a[i] * a[i]);
    tm.sync();
    steps::mul_diag(tm, d, w_mat, x, t1);
    for (int i = tm.lane(); i < d; i += tm.size()) x[i] = -0.5 * t * g[i] / a[i];
    tm.sync();
    steps::mul_diag(tm, d, w_mat, x, t2);
    if (!split) {
      for (int i = tm.lane(); i < d; i += tm.size()) x[i] = ((1.0 + g[i]) / a[i]) * b[i] / a[i];
      tm.sync();
      steps::mul_vec(tm, d, w_mat, false, x, eh_dot);
      steps::add_rank2(tm, d, eh_dot, mu_star, -0.5, t1);
      steps::add_rank2(tm, d, mu_old, delta, 0.5, t2);
      steps::add_rank2(tm, d, delta, delta, 0.25, t2);
    } else {
      steps::fill(tm, d, 0.0, eh_dot);
    }
    // Λ̃̄ = tΛ̄ − c t² η̇; Λ°̄ += sΛ̄ − c(gap + t s η̇); the same for h (η_h gap = −δ).
    steps::axpby(tm, dd, t, t3, -cst * t * t, t1, lam_new);
    steps::axpby(tm, dd, 1.0, lam_old, s, t3, lam_old);
    steps::axpby(tm, dd, 1.0, lam_old, -cst, t2, lam_old);
    steps::axpby(tm, dd, 1.0, lam_old, -cst * t * s, t1, lam_old);
    steps::axpby(tm, d, t, h_bar, -cst * t * t, eh_dot, h_new);
    steps::axpby(tm, d, s, h_bar, split ? 0.0 : cst, delta, h_old);  // η_h gap −δ: joint only
    steps::axpby(tm, d, 1.0, h_old, -cst * t * s, eh_dot, h_old);
    eps_bar = cst;
    steps::axpby(tm, dd, 1.0, p_old, 1.0, p_step, p_step);  // Λ̃
    fs::load_lower(tm, d, cov, sig);                         // L̃ (Σ* no longer needed)
    fs::natural_to_factor(tm, d, mu_new, sig, p_step, h_new, lam_new, m_new, io.mean, io.cov, t1, t2, v1);
  }
  fs::natural_to_factor(tm, d, mu_old, lo, p_old, h_old, lam_old, m_old, io.old_mean, io.old_cov, t1, t2, v1);
  if (tm.lane() == 0) {
    if (io.eps != nullptr) *io.eps = eps_bar;
    if (io.eps_mean != nullptr) *io.eps_mean = eps_mean_bar;
  }
  tm.sync();
}

/// The JVP of one full-covariance row (validated inputs, a solved row), the factorisation
/// already in `w`.
template <class Team, class T>
TROLL_HOST_DEVICE void gaussian_full_jvp_row(const Team& tm, bool split, const T* mean, const T* cov,
                                             const T* old_mean, double eps_mean, double t, double gap,
                                             const gaussian_jvp_io<T>& io, const full_scratch& w) {
  namespace fs = full_steps;
  const int d = w.d, dd = d * d;
  double *lo = w.mat(0), *w_mat = w.mat(3), *p_old = w.mat(5), *p_step = w.mat(6), *sig = w.mat(7);
  double *t1 = w.mat(8), *t2 = w.mat(9), *lam_old_dot = w.mat(10), *lam_t_dot = w.mat(11), *sig_gap = w.mat(12);
  double *p_new = w.mat(2), *l_new = w.mat(4);  // L°⁻¹ and W⁻ᵀ are not needed after derived()
  double *g = w.vec(0), *b = w.vec(1), *mu_new = w.vec(2), *mu_old = w.vec(3), *dmu_new = w.vec(4),
         *dmu_old = w.vec(5), *mean_dot = w.vec(6), *delta = w.vec(7), *mu_t = w.vec(8), *a = w.vec(9),
         *x = w.vec(10), *v1 = w.vec(11), *v2 = w.vec(12), *h_t_dot = w.vec(13), *h_gap = w.vec(14),
         *v3 = w.vec(15);
  fs::derived(tm, w);
  fs::load_vec(tm, d, mean, mu_new);
  fs::load_vec(tm, d, old_mean, mu_old);
  fs::load_vec(tm, d, io.mean, dmu_new);
  fs::load_vec(tm, d, io.old_mean, dmu_old);
  // Λ°' = −Λ° (L°'L°ᵀ + L°L°'ᵀ) Λ°.
  fs::load_lower(tm, d, io.old_cov, t1);
  steps::mul(tm, d, t1, false, lo, true, t2);
  steps::plus_transpose(tm, d, t2, t1);
  steps::mul(tm, d, p_old, false, t1, false, t2);
  steps::mul(tm, d, t2, false, p_old, false, lam_old_dot, -1.0);
  steps::fill(tm, d, 0.0, mean_dot);

  if (split) {
    steps::axpby(tm, d, 1.0, mu_new, -1.0, mu_old, v1);    // diff
    steps::axpby(tm, d, 1.0, dmu_new, -1.0, dmu_old, v2);  // diff'
    const double m = 0.5 * steps::dot(tm, d, b, b);
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      steps::mul_vec(tm, d, p_old, false, v2, v3);
      double m_dot = steps::dot(tm, d, v1, v3);
      steps::mul_vec(tm, d, lam_old_dot, false, v1, v3);
      m_dot += 0.5 * steps::dot(tm, d, v1, v3);
      const double kappa_dot = 0.5 * kappa * (io.eps_mean / eps_mean - m_dot / m);
      steps::axpby(tm, d, 1.0, dmu_old, kappa, v2, mean_dot);
      steps::axpby(tm, d, 1.0, mean_dot, kappa_dot, v1, mean_dot);
    } else {
      steps::axpby(tm, d, 1.0, dmu_new, 0.0, dmu_new, mean_dot);
    }
  }
  if (t >= 1.0) {  // inactive: the output is the input
    if (!split) steps::axpby(tm, d, 1.0, dmu_new, 0.0, dmu_new, mean_dot);
    fs::store_vec(tm, d, mean_dot, io.out_mean);
    fs::load_lower(tm, d, io.cov, t1);
    fs::store_lower(tm, d, t1, 1.0, io.out_cov_tangent);
    return;
  }
  const double s = gap;  // 1 − t, exact (solved_gap)
  steps::axpby(tm, dd, 1.0, p_old, 1.0, p_step, p_new);
  fs::load_lower(tm, d, cov, l_new);
  for (int i = tm.lane(); i < d; i += tm.size()) {
    a[i] = 1.0 + t * g[i];
    x[i] = 1.0 / a[i];
  }
  tm.sync();
  steps::mul_diag(tm, d, w_mat, x, sig);
  for (int i = tm.lane(); i < d; i += tm.size()) x[i] = -t * g[i] / a[i];
  tm.sync();
  steps::mul_diag(tm, d, w_mat, x, sig_gap);  // Σ_t − Σ°
  for (int i = tm.lane(); i < d; i += tm.size()) x[i] = (t * (1.0 + g[i]) / a[i]) * b[i];
  tm.sync();
  steps::mul_vec(tm, d, w_mat, false, x, delta);  // μ_t − μ°
  steps::axpby(tm, d, 1.0, mu_old, 1.0, delta, mu_t);
  // Λ̃' = −Λ̃ (L̃'L̃ᵀ + L̃L̃'ᵀ) Λ̃ (in t1), Λ_t' = tΛ̃' + sΛ°'.
  fs::load_lower(tm, d, io.cov, t2);
  steps::mul(tm, d, t2, false, l_new, true, t1);
  steps::plus_transpose(tm, d, t1, t2);
  steps::mul(tm, d, p_new, false, t2, false, t1);
  steps::mul(tm, d, t1, false, p_new, false, t2, -1.0);  // Λ̃' in t2
  steps::axpby(tm, dd, t, t2, s, lam_old_dot, lam_t_dot);
  // Σ_t' = −Σ Λ_t' Σ (in t1) and ∂KL at fixed t.
  double kl_dot = 0.5 * steps::dot(tm, dd, lam_old_dot, sig_gap);
  {
    double* sigma_t_dot = t1;
    double* tmp = sig_gap;  // Σ_t − Σ° is no longer needed
    steps::mul(tm, d, sig, false, lam_t_dot, false, tmp);
    steps::mul(tm, d, tmp, false, sig, false, sigma_t_dot, -1.0);
    kl_dot -= 0.5 * t * steps::dot(tm, dd, p_step, sigma_t_dot);
  }
  if (!split) {
    steps::mul_vec(tm, d, t2, false, mu_new, v1);             // Λ̃' μ̃
    steps::mul_vec(tm, d, p_new, false, dmu_new, v1, 1.0, 1.0);  // + Λ̃ μ̃'
    steps::mul_vec(tm, d, lam_old_dot, false, mu_old, v2);
    steps::mul_vec(tm, d, p_old, false, dmu_old, v2, 1.0, 1.0);
    steps::axpby(tm, d, t, v1, s, v2, h_t_dot);
    steps::axpby(tm, d, 1.0, mu_new, -1.0, mu_old, v1);
    steps::mul_vec(tm, d, p_new, false, v1, h_gap);
    steps::mul_vec(tm, d, p_step, false, mu_old, h_gap, 1.0, 1.0);
    steps::mul_vec(tm, d, lam_t_dot, false, mu_t, v1);
    steps::axpby(tm, d, 1.0, h_t_dot, -1.0, v1, v1);
    steps::mul_vec(tm, d, sig, false, v1, v2);  // μ_t' at fixed t
    steps::axpby(tm, d, 1.0, v2, -1.0, dmu_old, v2);
    steps::mul_vec(tm, d, p_old, false, v2, v1);
    kl_dot += steps::dot(tm, d, delta, v1);
    steps::mul_vec(tm, d, lam_old_dot, false, delta, v1);
    kl_dot += 0.5 * steps::dot(tm, d, delta, v1);
  }
  const double info = fs::fisher(tm, d, g, b, t, !split);
  const double t_dot = (io.eps - kl_dot) / (t * info);
  steps::axpby(tm, dd, 1.0, lam_t_dot, t_dot, p_step, lam_t_dot);
  steps::mul(tm, d, sig, false, lam_t_dot, false, t1);
  steps::mul(tm, d, t1, false, sig, false, t2, -1.0);  // Σ*' (t2)
  if (!split) {
    steps::axpby(tm, d, 1.0, h_t_dot, t_dot, h_gap, h_t_dot);
    steps::mul_vec(tm, d, lam_t_dot, false, mu_t, v1);
    steps::axpby(tm, d, 1.0, h_t_dot, -1.0, v1, v1);
    steps::mul_vec(tm, d, sig, false, v1, mean_dot);
  }
  fs::store_vec(tm, d, mean_dot, io.out_mean);
  // L*' = L Φ(L⁻¹ Σ*' L⁻ᵀ), L = L* (cholesky_tangent).
  double* l_out = sig;  // Σ* no longer needed
  double* l_inv = lam_t_dot;
  fs::load_lower(tm, d, io.out_cov, l_out);
  steps::lower_inverse(tm, d, l_out, l_inv);
  steps::mul(tm, d, l_inv, false, t2, false, t1);
  steps::mul(tm, d, t1, false, l_inv, true, t2);
  steps::lower_half_diagonal(tm, d, t2);
  steps::mul(tm, d, l_out, false, t2, false, t1);
  fs::store_lower(tm, d, t1, 1.0, io.out_cov_tangent);
}

}  // namespace detail
TROLL_END_NAMESPACE
