// troll/detail/cpu/gaussian_jvp_kernels.hpp — the JVP (forward-mode derivative) of one Gaussian
// projection row by the implicit function theorem (docs/gaussian.md, "Gradients"), in double.
//
// With Λ_t = tΛ̃ + (1 − t)Λ°, h_t = t h̃ + (1 − t) h° and F(t, inputs) = KL(π_t ‖ q) − ε = 0:
//   at fixed t the tangents of the inputs give Λ_t' = tΛ̃' + (1 − t)Λ°', h_t' = t h̃' + (1 − t)h°'
//   and the partial dF·v; t' = (ε' − dF·v)/(t I(t)); the output's natural tangent is
//   (Λ_t' + t'(Λ̃ − Λ°), h_t' + t'(h̃ − h°)), turned into (μ', L') of the Cholesky factor.
// The partial of the KL at fixed t is taken on KL = ½[tr(Λ°Σ_t) + δᵀΛ°δ − d − log det Λ° −
// log det Σ_t] (δ = μ_t − μ°). Full rows run all of it in the forward's whitened eigenbasis
// (gaussian_whitened.hpp), where Λ° = I, Λ̃ − Λ° = diag(g) and Σ_t − Σ° = diag(1/a − 1), so no
// precision matrix is formed and nothing large cancels however ill-conditioned a covariance is.
// The split projection's covariance part drops the δ terms; its closed-form mean is
// differentiated directly.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../gaussian_diag_derivatives.hpp"
#include "../gaussian_family.hpp"
#include "../gaussian_row_io.hpp"
#include "gaussian_kernels.hpp"
#include "gaussian_whitened.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The lower-triangular part of a row-major d×d tangent (0 where the pointer is null).
template <class T>
gaussian_matrix load_tangent_factor(const T* x, std::size_t d) {
  const auto n = static_cast<Eigen::Index>(d);
  if (x == nullptr) return gaussian_matrix::Zero(n, n);
  return load_factor(x, d);
}

template <class T>
gaussian_vector load_tangent_vector(const T* x, std::size_t d) {
  if (x == nullptr) return gaussian_vector::Zero(static_cast<Eigen::Index>(d));
  return load_vector(x, d);
}

/// The JVP of one full-covariance row (validated inputs; a solved row, t = 1 when inactive), in
/// the whitened eigenbasis (gaussian_whitened.hpp). The input tangents in y: μ' → Vᵀ L°⁻¹ μ';
/// Σ°_y' = Vᵀ(A + Aᵀ)V, A = L°⁻¹L°'; Σ̃_y' = X Yᵀ + Y Xᵀ, X = Vᵀ L°⁻¹ L̃', Y = Vᵀ L°⁻¹ L̃; then
/// Λ°' = −Σ°_y', h°' = μ°_y', Λ̃' = −Γ Σ̃_y' Γ, h̃' = Λ̃' b + Γ μ̃_y'. At fixed t, Λ_t' = tΛ̃' + sΛ°',
/// h_t' = t h̃' + s h°', μ_t' = (h_t' − Λ_t' m)/a and ∂KL = ½ Σ_i [−Λ°'_ii t g_i/a_i +
/// t g_i Λ_t'_ii/a_i²] (+ mᵀ(μ_t' − μ°') + ½ mᵀΛ°'m joint); t' = (ε' − ∂KL)/(tI), Λ*' = Λ_t' +
/// t' diag(g), h*' = h_t' + t' γb. Out: μ*' = μ°' + L°V(μ*_y' − μ°_y') and
/// L*' = L* Φ(Q diag(√a) Σ*_y' diag(√a) Qᵀ) = L* Φ(−Q diag(a^{-½}) Λ*' diag(a^{-½}) Qᵀ).
template <class T>
void gaussian_jvp_full(bool split, std::size_t d, const T* mean, const T* cov, const T* old_mean, const T* old_cov,
                       double eps_mean, double t, double s, const gaussian_jvp_io<T>& io,
                       const double* saved = nullptr) {
  const auto n = static_cast<Eigen::Index>(d);
  const gaussian_vector dmu_new = load_tangent_vector(io.mean, d), dmu_old = load_tangent_vector(io.old_mean, d);
  gaussian_vector mean_dot = gaussian_vector::Zero(n);
  gaussian_basis basis;
  factor_full_or_saved(mean, cov, old_mean, old_cov, d, saved, basis);
  const auto lower = basis.old_factor.triangularView<Eigen::Lower>();
  const gaussian_matrix& v = basis.vectors;
  const gaussian_vector& b = basis.b;
  const gaussian_vector y_dmu_new = to_whitened(basis, dmu_new), y_dmu_old = to_whitened(basis, dmu_old);
  // Λ°' in y: −Vᵀ(A + Aᵀ)V.
  gaussian_matrix lam_old_dot = gaussian_matrix::Zero(n, n);
  if (io.old_cov != nullptr) {
    const gaussian_matrix va = v.transpose() * lower.solve(load_factor(io.old_cov, d)) * v;
    lam_old_dot = -(va + va.transpose());
  }

  if (split) {
    const gaussian_vector diff = load_vector(mean, d) - load_vector(old_mean, d), diff_dot = dmu_new - dmu_old;
    const double m = 0.5 * b.squaredNorm();
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      const double m_dot = b.dot(y_dmu_new - y_dmu_old) + 0.5 * b.dot(lam_old_dot * b);
      const double kappa_dot = 0.5 * kappa * (io.eps_mean / eps_mean - m_dot / m);
      mean_dot = dmu_old + kappa * diff_dot + kappa_dot * diff;
    } else {
      mean_dot = dmu_new;
    }
  }
  if (t >= 1.0) {  // inactive: the output is the input
    if (!split) mean_dot = dmu_new;
    store_vector(mean_dot, io.out_mean);
    store_lower_factor(load_tangent_factor(io.cov, d), io.out_cov_tangent);
    return;
  }
  gaussian_matrix y_new;  // Vᵀ L°⁻¹ L̃
  if (io.cov != nullptr || needs_whitened_new_factor(basis)) y_new = whitened_new_factor(basis, cov, d);
  const whitened_member w = make_whitened_member(basis, t, s, y_new);
  const gaussian_array g = basis.g.array(), a = w.a, gamma = w.gamma;
  const gaussian_vector m = w.m.matrix();
  gaussian_matrix lam_new_dot = gaussian_matrix::Zero(n, n);
  if (io.cov != nullptr) {
    const gaussian_matrix x = v.transpose() * lower.solve(load_factor(io.cov, d));
    const gaussian_matrix xy = x * y_new.transpose();
    lam_new_dot = -(gamma.matrix().asDiagonal() * (xy + xy.transpose()) * gamma.matrix().asDiagonal());
  }
  gaussian_matrix lam_t_dot = t * lam_new_dot + s * lam_old_dot;
  double kl_dot = 0.5 * t * (-(lam_old_dot.diagonal().array() * g / a) + g * lam_t_dot.diagonal().array() / (a * a)).sum();
  gaussian_vector h_t_dot = gaussian_vector::Zero(n);
  if (!split) {
    const gaussian_vector h_new_dot = lam_new_dot * b + (gamma * y_dmu_new.array()).matrix();
    h_t_dot = t * h_new_dot + s * y_dmu_old;
    const gaussian_vector mu_t_dot = ((h_t_dot - lam_t_dot * m).array() / a).matrix();
    kl_dot += m.dot(mu_t_dot - y_dmu_old) + 0.5 * m.dot(lam_old_dot * m);
  }
  const double info = gaussian_member(w.spectrum(basis, !split), tilt_param{t, s}).sigma2;
  const double t_dot = (io.eps - kl_dot) / (t * info);
  lam_t_dot.diagonal() += (t_dot * g).matrix();
  if (!split) {
    h_t_dot += (t_dot * gamma * b.array()).matrix();
    const gaussian_vector y_mean_dot = ((h_t_dot - lam_t_dot * m).array() / a).matrix();
    mean_dot = dmu_old + basis.old_factor.triangularView<Eigen::Lower>() * (v * (y_mean_dot - y_dmu_old));
  }
  store_vector(mean_dot, io.out_mean);
  const gaussian_array inv_root = w.root.inverse();
  const gaussian_matrix scaled = -(inv_root.matrix().asDiagonal() * lam_t_dot * inv_root.matrix().asDiagonal());
  gaussian_matrix inner = (w.q * scaled * w.q.transpose()).triangularView<Eigen::Lower>();
  inner.diagonal() *= 0.5;
  store_lower_factor(gaussian_matrix(load_factor(io.out_cov, d).template triangularView<Eigen::Lower>() * inner),
                     io.out_cov_tangent);
}

/// The JVP of one diagonal row: gaussian_diag_derivatives.hpp's two passes over the coordinates.
template <class T>
void gaussian_jvp_diag(bool split, std::size_t d, const T* mean, const T* std_dev, const T* old_mean,
                       const T* old_std, double eps_mean, double t, double s, const gaussian_jvp_io<T>& io) {
  auto entry = [&](std::size_t i) { return diag_entry(mean, std_dev, old_mean, old_std, i); };
  auto at = [](const T* x, std::size_t i) { return x == nullptr ? 0.0 : static_cast<double>(x[i]); };
  auto tangent = [&](std::size_t i) {
    return gaussian_diag_tangent{at(io.mean, i), at(io.cov, i), at(io.old_mean, i), at(io.old_cov, i)};
  };
  gaussian_diag_jvp_sums sums;
  for (std::size_t i = 0; i < d; ++i) gaussian_diag_jvp_accumulate(entry(i), tangent(i), split, t, s, i, &sums);
  const gaussian_diag_jvp_scalars sc =
      gaussian_diag_jvp_finish(sums, split, t, s, eps_mean, io.eps, io.eps_mean);
  for (std::size_t i = 0; i < d; ++i) {
    const gaussian_diag_jvp_out o = gaussian_diag_jvp_coordinate(entry(i), tangent(i), split, sc, i);
    io.out_mean[i] = static_cast<T>(o.mean);
    io.out_cov_tangent[i] = static_cast<T>(o.std_dev);
  }
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
