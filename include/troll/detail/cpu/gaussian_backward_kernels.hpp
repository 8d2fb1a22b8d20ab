// troll/detail/cpu/gaussian_backward_kernels.hpp — the VJP of one Gaussian projection row by the
// implicit function theorem (docs/gaussian.md, "Gradients"), full and diagonal, in double.
//
// In natural parameters θ = (h, Λ), η = ∇A(θ) = (μ, −½(Σ + μμᵀ)), the output is θ_t with
// θ_t = θ° + t(θ̃ − θ°) and F(t, θ̃, θ°) = KL(π_t ‖ q) − ε = 0, where
//     ∂F/∂t = t I(t),   ∂F/∂θ̃ = t² η̇_t,   ∂F/∂θ° = η° − η_t + t(1 − t) η̇_t   (η̇_t = dη_t/dt).
// So with t̄ = ⟨θ̄_t, θ̃ − θ°⟩ and c = t̄/(t I): θ̃̄ = t θ̄_t − c t² η̇_t,
// θ°̄ = (1 − t) θ̄_t − c(η° − η_t + t(1 − t) η̇_t), ε̄ = c. Full rows run this in the forward's
// whitened eigenbasis (gaussian_whitened.hpp), where every θ and η above is diagonal up to the
// mean's rank-one terms: no precision matrix is formed, free of cancellation however
// ill-conditioned a covariance is. The covariance part of the split
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
#include "gaussian_whitened.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The VJP of one full-covariance row (validated inputs; a solved row: inactive or projected),
/// in the whitened eigenbasis (gaussian_whitened.hpp). There, with Σ̄_y and μ̄_y the upstream
/// gradients of the output's covariance and mean, Λ̄ = −diag(1/a) Σ̄_y diag(1/a), h̄ = μ̄_y/a,
/// Λ̄ −= sym(h̄ mᵀ); t̄ = ⟨Λ̄, diag(g)⟩ + ⟨h̄, γb⟩, c = t̄/(tI); η̇_Λ = diag(g/2a²) − sym(ṁ mᵀ),
/// ṁ = γb/a²; η° − η_t = (−½ diag(tg/a) + ½ mmᵀ, −m). The inputs' natural gradients become mean
/// and covariance gradients in y (new: μ̄ = γ h̄, Σ̄ = −Γ(Λ̄ + sym(h̄ bᵀ))Γ; old: μ̄ = h̄, Σ̄ = −Λ̄),
/// then factor gradients in x: L̃̄ = 2 lower(L°⁻ᵀ V Σ̄ Vᵀ L°⁻¹L̃), L°̄ = 2 lower(L°⁻ᵀ V Σ̄ Vᵀ).
template <class T>
void gaussian_backward_full(bool split, std::size_t d, const T* mean, const T* cov, const T* old_mean,
                            const T* old_cov, double eps_mean, double t, double s, const gaussian_vjp_io<T>& io,
                            const double* saved = nullptr) {
  const auto n = static_cast<Eigen::Index>(d);
  gaussian_basis basis;
  factor_full_or_saved(mean, cov, old_mean, old_cov, d, saved, basis);
  const gaussian_vector g_mean = load_vector(io.grad_out_mean, d);
  const gaussian_array b = basis.b.array();

  // Gradients of the inputs' means in x (direct) and in y, of their covariances in y.
  gaussian_vector mean_new = gaussian_vector::Zero(n), mean_old = gaussian_vector::Zero(n);
  gaussian_vector y_mean_new = gaussian_vector::Zero(n), y_mean_old = gaussian_vector::Zero(n);
  gaussian_matrix y_cov_new = gaussian_matrix::Zero(n, n), y_cov_old = gaussian_matrix::Zero(n, n);
  double eps_bar = 0.0, eps_mean_bar = 0.0;

  if (split) {
    const gaussian_vector diff = load_vector(mean, d) - load_vector(old_mean, d);
    const double m = 0.5 * basis.b.squaredNorm();
    const double kappa = split_mean_scale(m, eps_mean);
    if (kappa < 1.0) {
      const double kappa_bar = g_mean.dot(diff);
      const double k = kappa_bar * kappa / (2.0 * m);
      const gaussian_vector diff_bar = kappa * g_mean - k * from_whitened_gradient(basis, basis.b);  // Λ°(μ̃ − μ°)
      mean_new += diff_bar;
      mean_old += g_mean - diff_bar;
      y_cov_old += 0.5 * k * basis.b * basis.b.transpose();  // −Λ̄° of m = ½ bᵀb
      eps_mean_bar = kappa_bar * kappa / (2.0 * eps_mean);
    } else {
      mean_new += g_mean;
    }
  }
  const bool inactive = t >= 1.0;
  gaussian_matrix y_new;  // Vᵀ L°⁻¹ L̃
  if (!inactive && (io.cov != nullptr || needs_whitened_new_factor(basis))) y_new = whitened_new_factor(basis, cov, d);
  if (inactive) {
    if (!split) mean_new += g_mean;
  } else {
    const whitened_member w = make_whitened_member(basis, t, s, y_new);
    const gaussian_array g = basis.g.array(), a = w.a, gamma = w.gamma;
    // Σ̄_y = ½ diag(√a) sym(Qᵀ P Q) diag(√a), P = Φ(L*ᵀ L̄*); so Λ̄ = −½ diag(1/√a) sym(QᵀPQ) diag(1/√a).
    const gaussian_matrix out_factor = load_factor(io.out_cov, d);
    gaussian_matrix p = (out_factor.transpose() * load_factor(io.grad_out_cov, d)).template triangularView<Eigen::Lower>();
    p.diagonal() *= 0.5;
    const gaussian_matrix cq = w.q.transpose() * p * w.q;
    const gaussian_array inv_root = w.root.inverse();
    gaussian_matrix lambda_bar = -0.5 * inv_root.matrix().asDiagonal() * (cq + cq.transpose()) *
                                 inv_root.matrix().asDiagonal();
    gaussian_vector h_bar = gaussian_vector::Zero(n);
    const gaussian_vector m = w.m.matrix();
    if (!split) {
      h_bar = ((basis.vectors.transpose() * (basis.old_factor.transpose() * g_mean)).array() / a).matrix();
      lambda_bar -= 0.5 * (h_bar * m.transpose() + m * h_bar.transpose());
    }
    double t_bar = (lambda_bar.diagonal().array() * g).sum();
    if (!split) t_bar += (h_bar.array() * gamma * b).sum();
    const double info = gaussian_member(w.spectrum(basis, !split), tilt_param{t, s}).sigma2;
    const double cst = t_bar / (t * info);
    gaussian_matrix eta_lam_dot = (g / (2.0 * a * a)).matrix().asDiagonal();
    gaussian_matrix eta_lam_gap = (-0.5 * t * g / a).matrix().asDiagonal();
    gaussian_vector eta_h_dot = gaussian_vector::Zero(n), eta_h_gap = gaussian_vector::Zero(n);
    if (!split) {
      eta_h_dot = (gamma * b / (a * a)).matrix();
      eta_lam_dot -= 0.5 * (eta_h_dot * m.transpose() + m * eta_h_dot.transpose());
      eta_lam_gap += 0.5 * m * m.transpose();
      eta_h_gap = -m;
    }
    const gaussian_matrix lam_new = t * lambda_bar - cst * t * t * eta_lam_dot;
    const gaussian_matrix lam_old = s * lambda_bar - cst * (eta_lam_gap + t * s * eta_lam_dot);
    const gaussian_vector h_new = t * h_bar - cst * t * t * eta_h_dot;
    const gaussian_vector h_old = s * h_bar - cst * (eta_h_gap + t * s * eta_h_dot);
    y_mean_new += (gamma * h_new.array()).matrix();
    y_mean_old += h_old;
    const gaussian_matrix total = lam_new + 0.5 * (h_new * basis.b.transpose() + basis.b * h_new.transpose());
    y_cov_new -= gamma.matrix().asDiagonal() * total * gamma.matrix().asDiagonal();
    y_cov_old -= lam_old;
    eps_bar = cst;
  }
  // Back to x: μ̄ = L°⁻ᵀ V μ̄_y; Σ̄ = L°⁻ᵀ V Σ̄_y Vᵀ L°⁻¹ and L̄ = 2 lower(Σ̄ L).
  if (io.mean != nullptr) store_vector(gaussian_vector(mean_new + from_whitened_gradient(basis, y_mean_new)), io.mean);
  if (io.cov != nullptr) {
    if (inactive) {
      store_lower_factor(load_factor(io.grad_out_cov, d), io.cov);
    } else {
      const gaussian_matrix inner = basis.vectors * y_cov_new * y_new;
      store_lower_factor(gaussian_matrix(2.0 * basis.old_factor.transpose().template triangularView<Eigen::Upper>().solve(inner)), io.cov);
    }
  }
  if (io.old_mean != nullptr)
    store_vector(gaussian_vector(mean_old + from_whitened_gradient(basis, y_mean_old)), io.old_mean);
  if (io.old_cov != nullptr) {
    const gaussian_matrix inner = basis.vectors * y_cov_old * basis.vectors.transpose();
    store_lower_factor(gaussian_matrix(2.0 * basis.old_factor.transpose().template triangularView<Eigen::Upper>().solve(inner)), io.old_cov);
  }
  if (io.eps != nullptr) *io.eps = eps_bar;
  if (io.eps_mean != nullptr) *io.eps_mean = eps_mean_bar;
}

/// The VJP of one diagonal row: gaussian_diag_derivatives.hpp's two passes over the coordinates.
template <class T>
void gaussian_backward_diag(bool split, std::size_t d, const T* mean, const T* std_dev, const T* old_mean,
                            const T* old_std, double eps_mean, double t, double s, const gaussian_vjp_io<T>& io) {
  auto entry = [&](std::size_t i) { return diag_entry(mean, std_dev, old_mean, old_std, i); };
  auto upstream = [&](std::size_t i) {
    return gaussian_diag_upstream{static_cast<double>(io.grad_out_mean[i]), static_cast<double>(io.grad_out_cov[i]),
                                  static_cast<double>(io.out_cov[i])};
  };
  gaussian_diag_vjp_sums sums;
  for (std::size_t i = 0; i < d; ++i) gaussian_diag_vjp_accumulate(entry(i), upstream(i), split, t, s, i, &sums);
  const gaussian_diag_vjp_scalars sc = gaussian_diag_vjp_finish(sums, split, t, s, eps_mean);
  for (std::size_t i = 0; i < d; ++i) {
    const gaussian_diag_vjp_out g = gaussian_diag_vjp_coordinate(entry(i), upstream(i), split, sc, i);
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
