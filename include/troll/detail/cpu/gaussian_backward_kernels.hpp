// troll/detail/cpu/gaussian_backward_kernels.hpp — the VJP of one Gaussian projection row by the
// implicit function theorem (docs/gaussian.md, "Gradients"), full and diagonal, in double.
//
// In natural parameters θ = (h, Λ), η = ∇A(θ) = (μ, −½(Σ + μμᵀ)), the output is θ_t with
// θ_t = θ° + t(θ̃ − θ°) and F(t, θ̃, θ°) = KL(π_t ‖ q) − ε = 0, where
//     ∂F/∂t = t I(t),   ∂F/∂θ̃ = t² η̇_t,   ∂F/∂θ° = η° − η_t + t(1 − t) η̇_t   (η̇_t = dη_t/dt).
// So with t̄ = ⟨θ̄_t, θ̃ − θ°⟩ and c = t̄/(t I): θ̃̄ = t θ̄_t − c t² η̇_t,
// θ°̄ = (1 − t) θ̄_t − c(η° − η_t + t(1 − t) η̇_t), ε̄ = c. Every difference (θ̃ − θ°, η° − η_t)
// is formed in the factorised basis, free of cancellation. The covariance part of the split
// projection is the same with the mean terms dropped; its mean step is differentiated directly.
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

/// Σ̄ (symmetric) from L̄ for L = chol(Σ): Σ̄ = ½(M + Mᵀ), M = L⁻ᵀ Φ(Lᵀ L̄) L⁻¹, Φ the lower
/// triangle with the diagonal halved.
inline gaussian_matrix cholesky_backward(const gaussian_matrix& l, const gaussian_matrix& l_bar) {
  gaussian_matrix p = (l.transpose() * l_bar).triangularView<Eigen::Lower>();
  p.diagonal() *= 0.5;
  const auto upper = l.triangularView<Eigen::Lower>().transpose();
  const gaussian_matrix left = upper.solve(p);                             // L⁻ᵀ P
  const gaussian_matrix m = upper.solve(left.transpose()).transpose();     // L⁻ᵀ P L⁻¹
  return 0.5 * (m + m.transpose());
}

/// Natural-parameter gradients (h̄, Λ̄ symmetric) and direct mean gradients of one Gaussian,
/// turned into gradients of its mean and covariance factor (h = Λμ, Λ = Σ⁻¹, Σ = LLᵀ).
template <class T>
void natural_to_factor(const gaussian_vector& mean, const gaussian_matrix& factor, const gaussian_matrix& precision,
                       const gaussian_vector& h_bar, const gaussian_matrix& lambda_bar, const gaussian_vector& mean_bar,
                       T* out_mean, T* out_cov) {
  const Eigen::Index n = mean.size();
  if (out_mean != nullptr) store_vector(gaussian_vector(mean_bar + precision * h_bar), out_mean);
  if (out_cov == nullptr) return;
  const gaussian_matrix total = lambda_bar + 0.5 * (h_bar * mean.transpose() + mean * h_bar.transpose());
  const gaussian_matrix sigma_bar = -(precision * total * precision);
  const gaussian_matrix l_bar = 2.0 * sigma_bar * factor.triangularView<Eigen::Lower>();
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) out_cov[i * n + j] = j <= i ? static_cast<T>(l_bar(i, j)) : T(0);
}

/// The VJP of one full-covariance row (validated inputs; a solved row: inactive or projected).
template <class T>
void gaussian_backward_full(bool split, std::size_t d, const T* mean, const T* cov, const T* old_mean,
                            const T* old_cov, double eps_mean, double t, const gaussian_vjp_io<T>& io,
                            const double* saved = nullptr) {
  const auto n = static_cast<Eigen::Index>(d);
  gaussian_basis basis;
  factor_full_or_saved(mean, cov, old_mean, old_cov, d, saved, basis);
  const gaussian_vector mu_new = load_vector(mean, d), mu_old = load_vector(old_mean, d);
  const gaussian_vector g_mean = load_vector(io.grad_out_mean, d);
  const gaussian_matrix g_factor = gaussian_matrix(load_factor(io.grad_out_cov, d));
  const gaussian_matrix& lo = basis.old_factor;
  const gaussian_matrix lo_inv = lo.triangularView<Eigen::Lower>().solve(gaussian_matrix::Identity(n, n));
  const gaussian_matrix precision_old = lo_inv.transpose() * lo_inv;
  const gaussian_matrix w = lo.triangularView<Eigen::Lower>() * basis.vectors;  // x = μ° + W y
  const gaussian_matrix w_inv_t = lo_inv.transpose() * basis.vectors;           // W⁻ᵀ
  const gaussian_matrix precision_step = w_inv_t * basis.g.asDiagonal() * w_inv_t.transpose();  // Λ̃ − Λ°
  const gaussian_matrix precision_new = precision_old + precision_step;

  gaussian_vector h_new = gaussian_vector::Zero(n), h_old = gaussian_vector::Zero(n);
  gaussian_vector mean_new = gaussian_vector::Zero(n), mean_old = gaussian_vector::Zero(n);
  gaussian_matrix lam_new = gaussian_matrix::Zero(n, n), lam_old = gaussian_matrix::Zero(n, n);
  double eps_bar = 0.0, eps_mean_bar = 0.0;

  if (split) {
    const gaussian_vector diff = mu_new - mu_old;
    const double m = 0.5 * basis.b.squaredNorm();
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      const double kappa_bar = g_mean.dot(diff);
      const double k = kappa_bar * kappa / (2.0 * m);
      const gaussian_vector diff_bar = kappa * g_mean - k * (precision_old * diff);
      mean_new += diff_bar;
      mean_old += g_mean - diff_bar;
      lam_old -= 0.5 * k * diff * diff.transpose();
      eps_mean_bar = kappa_bar * kappa / (2.0 * eps_mean);
    } else {
      mean_new += g_mean;
    }
  }
  const bool inactive = t >= 1.0;
  if (inactive) {
    if (!split) mean_new += g_mean;
  } else {
    const double s = 1.0 - t;
    const gaussian_member_coords c = member_coords(basis, t);
    const gaussian_array inv_a = c.a.array().inverse();
    const gaussian_matrix sigma = w * inv_a.matrix().asDiagonal() * w.transpose();
    const gaussian_matrix out_factor = load_factor(io.out_cov, d);
    const gaussian_matrix lambda_bar_from_sigma = -(sigma * cholesky_backward(out_factor, g_factor) * sigma);
    gaussian_matrix lambda_bar = lambda_bar_from_sigma;
    gaussian_vector h_bar = gaussian_vector::Zero(n);
    const gaussian_vector delta = w * c.m;  // μ* − μ°
    const gaussian_vector mu_star = mu_old + delta;
    const gaussian_array g = basis.g.array();
    if (!split) {
      h_bar = sigma * g_mean;
      lambda_bar -= 0.5 * (h_bar * mu_star.transpose() + mu_star * h_bar.transpose());
    }
    double t_bar = lambda_bar.cwiseProduct(precision_step).sum();
    if (!split) t_bar += h_bar.dot(precision_new * (mu_new - mu_old) + precision_step * mu_old);
    const double info = gaussian_member(basis.spectrum(!split), tilt_param{t, s}).sigma2;
    const double cst = t_bar / (t * info);
    const gaussian_matrix sigma_dot = w * (-g / (c.a.array() * c.a.array())).matrix().asDiagonal() * w.transpose();
    gaussian_matrix eta_lam_dot = -0.5 * sigma_dot;
    gaussian_matrix eta_lam_gap = -0.5 * (w * (t * g * inv_a).matrix().asDiagonal() * w.transpose());  // η° − η_t
    gaussian_vector eta_h_dot = gaussian_vector::Zero(n), eta_h_gap = gaussian_vector::Zero(n);
    if (!split) {
      eta_h_dot = w * ((1.0 + g) * basis.b.array() / (c.a.array() * c.a.array())).matrix();
      eta_lam_dot -= 0.5 * (eta_h_dot * mu_star.transpose() + mu_star * eta_h_dot.transpose());
      eta_lam_gap += 0.5 * (mu_old * delta.transpose() + delta * mu_old.transpose() + delta * delta.transpose());
      eta_h_gap = -delta;
    }
    lam_new += t * lambda_bar - cst * t * t * eta_lam_dot;
    lam_old += s * lambda_bar - cst * (eta_lam_gap + t * s * eta_lam_dot);
    h_new += t * h_bar - cst * t * t * eta_h_dot;
    h_old += s * h_bar - cst * (eta_h_gap + t * s * eta_h_dot);
    eps_bar = cst;
  }
  if (inactive) {
    if (io.mean != nullptr) store_vector(mean_new, io.mean);
    if (io.cov != nullptr)
      for (Eigen::Index i = 0; i < n; ++i)
        for (Eigen::Index j = 0; j < n; ++j) io.cov[i * n + j] = j <= i ? static_cast<T>(g_factor(i, j)) : T(0);
  } else {
    natural_to_factor(mu_new, load_factor(cov, d), precision_new, h_new, lam_new, mean_new, io.mean, io.cov);
  }
  natural_to_factor(mu_old, lo, precision_old, h_old, lam_old, mean_old, io.old_mean, io.old_cov);
  if (io.eps != nullptr) *io.eps = eps_bar;
  if (io.eps_mean != nullptr) *io.eps_mean = eps_mean_bar;
}

/// The VJP of one diagonal row: gaussian_diag_derivatives.hpp's two passes over the coordinates.
template <class T>
void gaussian_backward_diag(bool split, std::size_t d, const T* mean, const T* std_dev, const T* old_mean,
                            const T* old_std, double eps_mean, double t, const gaussian_vjp_io<T>& io) {
  auto entry = [&](std::size_t i) { return diag_entry(mean, std_dev, old_mean, old_std, i); };
  auto upstream = [&](std::size_t i) {
    return gaussian_diag_upstream{static_cast<double>(io.grad_out_mean[i]), static_cast<double>(io.grad_out_cov[i]),
                                  static_cast<double>(io.out_cov[i])};
  };
  gaussian_diag_vjp_sums sums;
  for (std::size_t i = 0; i < d; ++i) gaussian_diag_vjp_accumulate(entry(i), upstream(i), split, t, &sums);
  const gaussian_diag_vjp_scalars sc = gaussian_diag_vjp_finish(sums, split, t, eps_mean);
  for (std::size_t i = 0; i < d; ++i) {
    const gaussian_diag_vjp_out g = gaussian_diag_vjp_coordinate(entry(i), upstream(i), split, sc);
    if (io.mean != nullptr) io.mean[i] = static_cast<T>(g.mean);
    if (io.cov != nullptr) io.cov[i] = static_cast<T>(g.std_dev);
    if (io.old_mean != nullptr) io.old_mean[i] = static_cast<T>(g.old_mean);
    if (io.old_cov != nullptr) io.old_cov[i] = static_cast<T>(g.old_std);
  }
  if (io.eps != nullptr) *io.eps = sc.eps_bar;
  if (io.eps_mean != nullptr) *io.eps_mean = sc.eps_mean_bar;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
