// troll/detail/cpu/gaussian_whitened.hpp — what the full-covariance VJP and JVP share: the row in
// the forward's whitened eigenbasis y = W⁻¹(x − μ°), W = L°V (docs/gaussian.md, "Gradients").
//
// The projection commutes with a fixed affine change of variables, so its derivative at a row is
// the derivative of the same projection in y, where the old Gaussian is N(0, I), the new one
// N(b, diag(1/γ)) and the output N(m, diag(1/a)): every natural/mean-parameter step there is
// diagonal scaling, with no precision matrix formed. Only the change of variables touches the
// inputs' factors — a tangent Σ' becomes W⁻¹Σ'W⁻ᵀ = Vᵀ L°⁻¹Σ'L°⁻ᵀ V and a gradient Σ̄ in y
// becomes L°⁻ᵀ V Σ̄ Vᵀ L°⁻¹ in x, by triangular solves with L° — and the output's Cholesky
// factor L* = L°K, K = chol(V diag(1/a) Vᵀ), enters through K⁻¹V = Q diag(√a), Q orthogonal
// from a Householder QR of diag(a^{-½})Vᵀ (no inverse of an ill-conditioned K).
#pragma once

#include "eigen.hpp"
#include <Eigen/QR>
#include <cstddef>

#include "../../config.hpp"
#include "gaussian_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The member at t in the eigenbasis, with what both derivatives read.
struct whitened_member {
  gaussian_array a;      // 1 + t g, or s + t γ where g < −½ (as the forward's members)
  gaussian_array gamma;  // 1 + g, or γ itself where g < −½
  gaussian_array m;      // t γ b / a
  gaussian_array root;   // √a
  gaussian_matrix q;     // Q = K⁻¹ V diag(a^{-½}), orthogonal
  /// The basis' spectrum with these γ (so that I(t) takes the same a).
  gaussian_spectrum spectrum(const gaussian_basis& basis, bool with_mean) const {
    gaussian_spectrum r = basis.spectrum(with_mean);
    r.gamma = gamma.data();
    return r;
  }
};

/// Vᵀ L°⁻¹ L̃ (= diag(σ) Rᵀ for the SVD M = L°⁻¹L̃ = V diag(σ) Rᵀ).
template <class T>
inline gaussian_matrix whitened_new_factor(const gaussian_basis& basis, const T* cov, std::size_t d) {
  return basis.vectors.transpose() * basis.old_factor.triangularView<Eigen::Lower>().solve(load_factor(cov, d));
}

/// `y_new` = whitened_new_factor (read only where some g < −½). γ = 1 + g, except where g < −½
/// (a new covariance wider than the old along v_i: λ_i = 1/γ_i > 2), where 1 + g would keep only
/// ~u/γ of γ's digits: there γ = 1/λ with λ the Rayleigh quotient ‖v_iᵀM‖² (both the fresh and a
/// saved factorisation give the same V and g, so the two stay bit for bit equal). There a = s + tγ
/// (s = 1 − t, exact near t = 1), as the forward's members (gaussian_precision_ratio): 1 + tg
/// would keep only ~u/a of a's digits where t is near 1.
inline whitened_member make_whitened_member(const gaussian_basis& basis, double t, double s,
                                            const gaussian_matrix& y_new) {
  const Eigen::Index n = basis.g.size();
  whitened_member w;
  const gaussian_array g = basis.g.array();
  w.a = 1.0 + t * g;
  w.gamma = 1.0 + g;
  for (Eigen::Index i = 0; i < n; ++i) {
    if (!(g[i] < -0.5)) continue;
    w.gamma[i] = 1.0 / y_new.row(i).squaredNorm();
    w.a[i] = s + t * w.gamma[i];
  }
  w.m = (t * w.gamma / w.a) * basis.b.array();
  w.root = w.a.sqrt();
  // diag(a^{-½}) Vᵀ = Q_h R  ⇒  V diag(a^{-½}) = (Rᵀ S)(S Q_hᵀ), S = sign(diag R): K = Rᵀ S, Q = S Q_hᵀ.
  const gaussian_matrix bt = w.root.inverse().matrix().asDiagonal() * basis.vectors.transpose();
  const Eigen::HouseholderQR<gaussian_matrix> qr(bt);
  const gaussian_matrix qh = qr.householderQ();
  w.q = qh.transpose();
  for (Eigen::Index j = 0; j < n; ++j)
    if (qr.matrixQR()(j, j) < 0.0) w.q.row(j) = -w.q.row(j);
  return w;
}

/// Whether some g < −½ (make_whitened_member then reads the whitened new factor).
inline bool needs_whitened_new_factor(const gaussian_basis& basis) { return (basis.g.array() < -0.5).any(); }

/// Vᵀ L°⁻¹ x: a vector of x's coordinates in y (without the shift).
inline gaussian_vector to_whitened(const gaussian_basis& basis, const gaussian_vector& x) {
  return basis.vectors.transpose() * basis.old_factor.triangularView<Eigen::Lower>().solve(x);
}

/// L°⁻ᵀ V y: a gradient with respect to y as one with respect to x.
inline gaussian_vector from_whitened_gradient(const gaussian_basis& basis, const gaussian_vector& y) {
  return basis.old_factor.triangularView<Eigen::Lower>().transpose().solve(basis.vectors * y);
}

/// Stores the lower triangle of a d×d matrix, row-major.
template <class T>
inline void store_lower_factor(const gaussian_matrix& m, T* out) {
  const Eigen::Index n = m.rows();
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) out[i * n + j] = j <= i ? static_cast<T>(m(i, j)) : T(0);
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
