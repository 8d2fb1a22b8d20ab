// troll/detail/cpu/gaussian_jvp_kernels.hpp — the JVP (forward-mode derivative) of one Gaussian
// projection row by the implicit function theorem (docs/gaussian.md, "Gradients"), in double.
//
// With Λ_t = tΛ̃ + (1 − t)Λ°, h_t = t h̃ + (1 − t) h° and F(t, inputs) = KL(π_t ‖ q) − ε = 0:
//   at fixed t the tangents of the inputs give Λ_t' = tΛ̃' + (1 − t)Λ°', h_t' = t h̃' + (1 − t)h°'
//   and the partial dF·v; t' = (ε' − dF·v)/(t I(t)); the output's natural tangent is
//   (Λ_t' + t'(Λ̃ − Λ°), h_t' + t'(h̃ − h°)), turned into (μ', L') of the Cholesky factor.
// The partial of the KL at fixed t is taken on KL = ½[tr(Λ°Σ_t) + δᵀΛ°δ − d − log det Λ° −
// log det Σ_t] (δ = μ_t − μ°), written with the differences Λ° − Λ_t = −t(Λ̃ − Λ°) and
// Σ_t − Σ° = W diag(1/a − 1) Wᵀ from the factorised basis, so no large terms cancel. The split
// projection's covariance part drops the δ terms; its closed-form mean is differentiated directly.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../gaussian_diag_derivatives.hpp"
#include "../gaussian_family.hpp"
#include "../gaussian_row_io.hpp"
#include "gaussian_kernels.hpp"

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

/// The tangent of a Cholesky factor L given the tangent of Σ = LLᵀ: L' = L Φ(L⁻¹ Σ' L⁻ᵀ), Φ the
/// lower triangle with the diagonal halved.
inline gaussian_matrix cholesky_tangent(const gaussian_matrix& l, const gaussian_matrix& sigma_dot) {
  const auto lower = l.triangularView<Eigen::Lower>();
  const gaussian_matrix left = lower.solve(sigma_dot);                          // L⁻¹ Σ'
  gaussian_matrix inner = lower.solve(left.transpose()).transpose();            // L⁻¹ Σ' L⁻ᵀ
  inner = inner.triangularView<Eigen::Lower>();
  inner.diagonal() *= 0.5;
  return l.triangularView<Eigen::Lower>() * inner;
}

/// The JVP of one full-covariance row (validated inputs; a solved row, t = 1 when inactive).
/// Writes μ*' and L*' (lower-triangular).
template <class T>
void gaussian_jvp_full(bool split, std::size_t d, const T* mean, const T* cov, const T* old_mean, const T* old_cov,
                       double eps_mean, double t, const gaussian_jvp_io<T>& io,
                       const double* saved = nullptr) {
  const auto n = static_cast<Eigen::Index>(d);
  const gaussian_vector mu_new = load_vector(mean, d), mu_old = load_vector(old_mean, d);
  const gaussian_vector dmu_new = load_tangent_vector(io.mean, d), dmu_old = load_tangent_vector(io.old_mean, d);
  const gaussian_matrix dl_new = load_tangent_factor(io.cov, d), dl_old = load_tangent_factor(io.old_cov, d);
  gaussian_vector mean_dot = gaussian_vector::Zero(n);
  auto store_factor = [&](const gaussian_matrix& m) {
    for (Eigen::Index i = 0; i < n; ++i)
      for (Eigen::Index j = 0; j < n; ++j) io.out_cov_tangent[i * n + j] = j <= i ? static_cast<T>(m(i, j)) : T(0);
  };
  gaussian_basis basis;
  factor_full_or_saved(mean, cov, old_mean, old_cov, d, saved, basis);
  const gaussian_matrix& lo = basis.old_factor;
  const gaussian_matrix lo_inv = lo.triangularView<Eigen::Lower>().solve(gaussian_matrix::Identity(n, n));
  const gaussian_matrix precision_old = lo_inv.transpose() * lo_inv;
  const gaussian_matrix sigma_old_dot = dl_old * lo.transpose() + lo * dl_old.transpose();
  const gaussian_matrix lam_old_dot = -(precision_old * sigma_old_dot * precision_old);

  if (split) {
    const gaussian_vector diff = mu_new - mu_old, diff_dot = dmu_new - dmu_old;
    const double m = 0.5 * basis.b.squaredNorm();
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      const double m_dot = diff.dot(precision_old * diff_dot) + 0.5 * diff.dot(lam_old_dot * diff);
      const double kappa_dot = 0.5 * kappa * (io.eps_mean / eps_mean - m_dot / m);
      mean_dot = dmu_old + kappa * diff_dot + kappa_dot * diff;
    } else {
      mean_dot = dmu_new;
    }
  }
  if (t >= 1.0) {  // inactive: the output is the input
    if (!split) mean_dot = dmu_new;
    store_vector(mean_dot, io.out_mean);
    store_factor(dl_new);
    return;
  }
  const double s = 1.0 - t;
  const gaussian_matrix l_new = load_factor(cov, d);
  const gaussian_matrix w = lo.triangularView<Eigen::Lower>() * basis.vectors;
  const gaussian_matrix w_inv_t = lo_inv.transpose() * basis.vectors;
  const gaussian_matrix precision_step = w_inv_t * basis.g.asDiagonal() * w_inv_t.transpose();  // Λ̃ − Λ°
  const gaussian_matrix precision_new = precision_old + precision_step;
  const gaussian_member_coords c = member_coords(basis, t);
  const gaussian_array a = c.a.array();
  const gaussian_matrix sigma = w * a.inverse().matrix().asDiagonal() * w.transpose();
  const gaussian_matrix sigma_gap = w * (-t * basis.g.array() / a).matrix().asDiagonal() * w.transpose();  // Σ_t − Σ°
  const gaussian_vector delta = w * c.m;  // μ_t − μ°
  const gaussian_vector mu_t = mu_old + delta;

  const gaussian_matrix sigma_new_dot = dl_new * l_new.transpose() + l_new * dl_new.transpose();
  const gaussian_matrix lam_new_dot = -(precision_new * sigma_new_dot * precision_new);
  gaussian_matrix lam_t_dot = t * lam_new_dot + s * lam_old_dot;
  const gaussian_matrix sigma_t_dot = -(sigma * lam_t_dot * sigma);
  // ∂KL at fixed t: ½[tr(Λ°'(Σ_t − Σ°)) − t tr((Λ̃ − Λ°) Σ_t')] (+ the mean terms when joint).
  double kl_dot = 0.5 * (lam_old_dot.cwiseProduct(sigma_gap).sum() - t * precision_step.cwiseProduct(sigma_t_dot).sum());
  gaussian_vector h_t_dot = gaussian_vector::Zero(n), h_gap = gaussian_vector::Zero(n);
  if (!split) {
    const gaussian_vector h_new_dot = lam_new_dot * mu_new + precision_new * dmu_new;
    const gaussian_vector h_old_dot = lam_old_dot * mu_old + precision_old * dmu_old;
    h_t_dot = t * h_new_dot + s * h_old_dot;
    h_gap = precision_new * (mu_new - mu_old) + precision_step * mu_old;  // h̃ − h°
    const gaussian_vector mu_t_dot = sigma * (h_t_dot - lam_t_dot * mu_t);
    kl_dot += delta.dot(precision_old * (mu_t_dot - dmu_old)) + 0.5 * delta.dot(lam_old_dot * delta);
  }
  const double info = gaussian_member(basis.spectrum(!split), tilt_param{t, s}).sigma2;
  const double t_dot = (io.eps - kl_dot) / (t * info);
  lam_t_dot += t_dot * precision_step;
  const gaussian_matrix sigma_out_dot = -(sigma * lam_t_dot * sigma);
  if (!split) {
    h_t_dot += t_dot * h_gap;
    mean_dot = sigma * (h_t_dot - lam_t_dot * mu_t);
  }
  store_vector(mean_dot, io.out_mean);
  store_factor(cholesky_tangent(load_factor(io.out_cov, d), sigma_out_dot));
}

/// The JVP of one diagonal row: gaussian_diag_derivatives.hpp's two passes over the coordinates.
template <class T>
void gaussian_jvp_diag(bool split, std::size_t d, const T* mean, const T* std_dev, const T* old_mean,
                       const T* old_std, double eps_mean, double t, const gaussian_jvp_io<T>& io) {
  auto entry = [&](std::size_t i) { return diag_entry(mean, std_dev, old_mean, old_std, i); };
  auto at = [](const T* x, std::size_t i) { return x == nullptr ? 0.0 : static_cast<double>(x[i]); };
  auto tangent = [&](std::size_t i) {
    return gaussian_diag_tangent{at(io.mean, i), at(io.cov, i), at(io.old_mean, i), at(io.old_cov, i)};
  };
  gaussian_diag_jvp_sums sums;
  for (std::size_t i = 0; i < d; ++i) gaussian_diag_jvp_accumulate(entry(i), tangent(i), split, t, &sums);
  const gaussian_diag_jvp_scalars sc = gaussian_diag_jvp_finish(sums, split, t, eps_mean, io.eps, io.eps_mean);
  for (std::size_t i = 0; i < d; ++i) {
    const gaussian_diag_jvp_out o = gaussian_diag_jvp_coordinate(entry(i), tangent(i), split, sc);
    io.out_mean[i] = static_cast<T>(o.mean);
    io.out_cov_tangent[i] = static_cast<T>(o.std_dev);
  }
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
