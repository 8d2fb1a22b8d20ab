// troll/detail/cpu/one_sided_jacobi.hpp — singular values and left singular vectors of a square
// matrix by one-sided (Hestenes) Jacobi: plane rotations of column pairs, A ← A·J, until every
// pair of columns is orthogonal to working precision. Then A·V = U·Σ with σ_i = ‖a_i‖ and
// u_i = a_i / σ_i; V is never formed. A second stage rotates the rows of UᵀA (and U with them)
// until they too are orthogonal, for matrices graded by rows (one_sided_jacobi_svd below).
// The method is backward stable (σ to ~u·σ_max absolute at
// least, and to high relative accuracy where A = B·D with B well conditioned: 2.4e-15 against
// mpmath on columns graded over 12 decades), needs no bidiagonalisation, and compiles to a few
// loops over contiguous columns — a fraction of what Eigen's divide-and-conquer SVD costs to
// compile at -O3 in every translation unit that reaches it (minutes on the 2-core VM). Run time:
// like BDCSVD's up to d = 64, ~3× it at d = 256 (docs/gaussian.md).
#pragma once

#include "eigen.hpp"  // first: Eigen/Core with GCC 12's AVX-512 headers warning-free
#include <cmath>

#include "../../config.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The rotation J = [c s; −s c] that makes (a_p c − a_q s) ⟂ (a_p s + a_q c), from α = ‖a_p‖²,
/// β = ‖a_q‖², γ = a_p·a_q ≠ 0: t = tan θ is the smaller root of t² + 2ζt − 1 = 0,
/// ζ = (β − α) / (2γ).
struct jacobi_rotation {
  double c = 1.0, s = 0.0;
  static jacobi_rotation of(double alpha, double beta, double gamma) {
    const double zeta = (beta - alpha) / (2.0 * gamma);
    const double az = std::fabs(zeta);
    // 1 / (|ζ| + sqrt(1 + ζ²)) without overflowing ζ² (|ζ| > 1e150: t ≈ 1 / (2|ζ|)).
    const double t_abs = az > 1e150 ? 0.5 / az : 1.0 / (az + std::sqrt(1.0 + az * az));
    const double t = zeta < 0.0 ? -t_abs : t_abs;
    jacobi_rotation r;
    r.c = 1.0 / std::sqrt(1.0 + t * t);
    r.s = r.c * t;
    return r;
  }
};

/// The result of one_sided_jacobi_svd: `sigma` (unsorted) and `u` (column i belongs to sigma[i]).
/// `converged` is false when a column came out zero or not finite (no left vector for it) or the
/// sweeps ran out; the caller then uses another method.
struct left_singular_pairs {
  Eigen::MatrixXd u;
  Eigen::VectorXd sigma;
  bool converged = false;
};

/// Cyclic sweeps of plane rotations over the column pairs of `a` (A ← A·J), applying each J to
/// `follow`'s columns too where given, until every pair is orthogonal to working precision: a
/// pair is rotated when |a_p·a_q| > tol·‖a_p‖‖a_q‖, tol = n·u; at most `max_sweeps`. Returns
/// whether the last sweep rotated nothing. `a`'s squared column norms must not overflow.
inline bool jacobi_column_sweeps(Eigen::MatrixXd& a, Eigen::MatrixXd* follow, int max_sweeps) {
  const Eigen::Index n = a.cols();
  const double tol = static_cast<double>(n) * 2.220446049250313e-16;
  // The squared column norms: exact at the start of each sweep, then carried through each
  // rotation as α − tγ and β + tγ (exact in exact arithmetic), and recomputed where that
  // difference cancelled (the column shrank below 1/16 of itself).
  Eigen::VectorXd norm2(n);
  bool rotated = true;
  for (int sweep = 0; sweep < max_sweeps && rotated; ++sweep) {
    rotated = false;
    for (Eigen::Index i = 0; i < n; ++i) norm2[i] = a.col(i).squaredNorm();
    for (Eigen::Index p = 0; p + 1 < n; ++p) {
      for (Eigen::Index q = p + 1; q < n; ++q) {
        const double alpha = norm2[p], beta = norm2[q];
        const double gamma = a.col(p).dot(a.col(q));
        if (gamma == 0.0 || !(std::fabs(gamma) > tol * std::sqrt(alpha) * std::sqrt(beta))) continue;
        rotated = true;
        const jacobi_rotation r = jacobi_rotation::of(alpha, beta, gamma);
        auto rotate = [&r](double* cp, double* cq, Eigen::Index rows) {
          for (Eigen::Index i = 0; i < rows; ++i) {
            const double x = cp[i], y = cq[i];
            cp[i] = r.c * x - r.s * y;
            cq[i] = r.s * x + r.c * y;
          }
        };
        rotate(a.col(p).data(), a.col(q).data(), a.rows());
        if (follow != nullptr) rotate(follow->col(p).data(), follow->col(q).data(), follow->rows());
        const double t_gamma = (r.s / r.c) * gamma;
        norm2[p] = alpha - t_gamma;
        norm2[q] = beta + t_gamma;
        if (!(norm2[p] > 0.0625 * alpha)) norm2[p] = a.col(p).squaredNorm();
        if (!(norm2[q] > 0.0625 * beta)) norm2[q] = a.col(q).squaredNorm();
      }
    }
  }
  return !rotated;
}

/// A = U Σ Vᵀ for a square A, in two stages. (1) Sweeps over A's columns (A·J = U·Σ): σ_i and
/// u_i = a_i/σ_i to high relative accuracy where the columns are graded (A = B·D, B well
/// conditioned), but where the *rows* are (A = D·B: the whitened factor L°⁻¹L̃ of an
/// ill-conditioned old covariance), each u_i only to ~u·σ_max absolute: UᵀA's rows, which should
/// be orthogonal, are so only to ~1e-9 of their norms at σ_max/σ_min = 1e6 — enough for the
/// forward, not for the derivatives, which read the basis through Vᵀ L°⁻¹ L̃ (a 1.4e-7 relative
/// error in the covariance gradient at d = 24, docs/gaussian.md). (2) Sweeps over the rows of
/// Y = UᵀA (the columns of Yᵀ = AᵀU), rotating U alongside: one-sided Jacobi on the row-graded
/// side, started from (1)'s nearly diagonalising U, so one to three sweeps; σ_i = ‖y_i‖. Both
/// stages are backward stable in the norms of the rows or columns they rotate.
/// A is scaled by a power of two first (exact) so that no squared norm overflows.
template <class Matrix>
inline left_singular_pairs one_sided_jacobi_svd(const Matrix& a_in) {
  left_singular_pairs out;
  Eigen::MatrixXd a = a_in;  // column-major: the rotations run over contiguous columns
  const Eigen::Index n = a.cols();
  out.sigma.setZero(n);
  const double largest = n > 0 ? a.cwiseAbs().maxCoeff() : 0.0;
  if (!(largest > 0.0) || !std::isfinite(largest)) return out;
  int exponent = 0;
  std::frexp(largest, &exponent);
  a *= std::ldexp(1.0, -exponent);  // entries now in [0.5, 1) at most: ‖a_i‖² ≤ rows
  const Eigen::MatrixXd scaled = a;
  if (!jacobi_column_sweeps(a, nullptr, 64)) return out;
  out.u.resize(a.rows(), n);
  // ‖x‖ scaled by its largest entry: a small σ (a graded column) does not underflow in ‖x‖².
  auto safe_norm = [](const Eigen::VectorXd& x) {
    const double top = x.cwiseAbs().maxCoeff();
    return top > 0.0 ? top * (x / top).norm() : 0.0;
  };
  for (Eigen::Index i = 0; i < n; ++i) {
    const double norm = safe_norm(a.col(i));
    if (!(norm > 0.0) || !std::isfinite(norm)) return out;
    out.u.col(i) = a.col(i) / norm;
  }
  Eigen::MatrixXd rows = scaled.transpose() * out.u;  // Yᵀ: column i is row i of UᵀA
  if (!jacobi_column_sweeps(rows, &out.u, 16)) return out;
  const double unscale = std::ldexp(1.0, exponent);
  for (Eigen::Index i = 0; i < n; ++i) {
    const double norm = safe_norm(rows.col(i));
    if (!(norm > 0.0) || !std::isfinite(norm)) return out;
    out.sigma[i] = norm * unscale;
  }
  out.converged = true;
  return out;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
