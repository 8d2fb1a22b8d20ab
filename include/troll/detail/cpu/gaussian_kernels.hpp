// troll/detail/cpu/gaussian_kernels.hpp — the CPU backend's Gaussian rows: the one
// factorisation per row that puts a (new, old) pair in the basis of gaussian_family.hpp, and
// the write-back of the projected member. Full covariances as row-major d×d lower-triangular
// Cholesky factors, diagonal ones as standard deviations; arithmetic in double.
#pragma once

#include "eigen.hpp"  // first: Eigen/Core with GCC 12's AVX-512 headers warning-free
#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <Eigen/SVD>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "../../config.hpp"
#include "../gaussian_family.hpp"
#include "../numeric.hpp"
#include "one_sided_jacobi.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

using gaussian_matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using gaussian_vector = Eigen::VectorXd;
using gaussian_array = Eigen::ArrayXd;

/// A row pair in the whitened eigenbasis: x = μ° + W y with W = L°V (full) or diag(σ°) (diag).
struct gaussian_basis {
  bool full = true;
  gaussian_matrix old_factor;  // L° (full)
  gaussian_matrix vectors;     // V, orthonormal (full)
  gaussian_vector old_scale;   // σ° (diag)
  gaussian_vector g;           // γ_i − 1
  gaussian_vector b;           // W⁻¹(μ̃ − μ°)
  gaussian_vector gamma;       // γ_i, accurate relative to themselves (the forward's; may be empty)
  gaussian_spectrum spectrum(bool with_mean) const {
    return gaussian_spectrum{g.data(), b.data(), static_cast<int>(g.size()), with_mean};
  }
  /// The forward's spectrum: with γ where factorised (a = s + tγ for g < −½; gaussian_spectrum).
  /// The derivatives keep spectrum(), so that a saved factorisation (V, g, b) reproduces them.
  gaussian_spectrum forward_spectrum(bool with_mean) const {
    gaussian_spectrum r = spectrum(with_mean);
    if (gamma.size() == g.size()) r.gamma = gamma.data();
    return r;
  }
};

template <class T>
inline gaussian_vector load_vector(const T* x, std::size_t d) {
  gaussian_vector v(static_cast<Eigen::Index>(d));
  for (std::size_t i = 0; i < d; ++i) v[static_cast<Eigen::Index>(i)] = static_cast<double>(x[i]);
  return v;
}

template <class T>
inline gaussian_matrix load_factor(const T* x, std::size_t d) {
  const auto n = static_cast<Eigen::Index>(d);
  gaussian_matrix m(n, n);
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) m(i, j) = j <= i ? static_cast<double>(x[i * n + j]) : 0.0;
  return m;
}

/// γ − 1 from λ − 1 (gaussian_gain, shared with the device).
inline double gain_from_excess(double excess) { return gaussian_gain(excess); }

/// Full covariances: with E = L°⁻¹(L̃ − L°), the whitened new covariance is
/// S = (I + E)(I + E)ᵀ = I + D, D = E + Eᵀ + EEᵀ, and D = V diag(λ − 1) Vᵀ. Forming D from the
/// difference of the factors keeps λ − 1 accurate relative to itself when the covariances are
/// nearly equal. One triangular solve and one symmetric eigendecomposition: O(d³).
template <class T>
inline void factor_full(const T* mean, const T* chol, const T* old_mean, const T* old_chol, std::size_t d,
                        gaussian_basis& out) {
  out.full = true;
  out.old_factor = load_factor(old_chol, d);
  const auto lower = out.old_factor.triangularView<Eigen::Lower>();
  const gaussian_matrix e = lower.solve(load_factor(chol, d) - out.old_factor);
  gaussian_matrix excess = e + e.transpose();
  excess.noalias() += e * e.transpose();
  Eigen::SelfAdjointEigenSolver<gaussian_matrix> eig(excess);
  out.vectors = eig.eigenvectors();
  out.g.resize(eig.eigenvalues().size());
  out.gamma.resize(out.g.size());
  for (Eigen::Index i = 0; i < out.g.size(); ++i) {
    out.g[i] = gain_from_excess(eig.eigenvalues()[i]);
    const double lambda = 1.0 + eig.eigenvalues()[i];
    out.gamma[i] = lambda > 0.0 ? 1.0 / lambda : 0.0;  // read only where g < −½ (λ > 2: exact)
  }
  // The eigenvalues of S − I carry an absolute error ~d·u·max|λ − 1|: where that would cost the
  // smallest λ more than ~1e-12 of itself (λ_min below ~2e-4·d·max|λ − 1|: a new covariance
  // narrower than ~1/70 of the old along some direction, or an old or new covariance with
  // condition number 1e12 against a well-conditioned other one), the small λ — and so the large
  // gains γ − 1 — lose their digits (or round to λ ≤ 0). There
  // the whitened factor M = L°⁻¹L̃ (S = MMᵀ) is decomposed instead by a two-stage one-sided
  // Jacobi SVD (one_sided_jacobi.hpp: M's columns, then the rows of VᵀM), whose singular values
  // σ = sqrt(λ) keep their relative accuracy on such graded factors and whose V diagonalises S to
  // working precision relative to each λ: V = U, g = 1/σ² − 1 = −((σ − 1)/σ)((σ + 1)/σ).
  const double spread = eig.eigenvalues().cwiseAbs().maxCoeff();
  const double smallest = 1.0 + eig.eigenvalues()[0];
  if (!(smallest > 1e12 * static_cast<double>(d) * 2.220446049250313e-16 * spread)) {
    const gaussian_matrix m = lower.solve(load_factor(chol, d));
    gaussian_vector singular;
    // The column stage alone (the route above d = 16 until the second stage was added) left V
    // diagonalising S only to ~1e-9 of sqrt(λ_iλ_j) when L° is ill-conditioned (M's rows
    // graded): enough for the forward, not for the derivatives (covariance gradient off by up to
    // 1.4e-7 at d = 24 against mpmath, 9e-4 with both covariances at 1e12). Eigen's
    // QR-preconditioned two-sided Jacobi, used up to d = 16 before, was accurate for one graded
    // covariance but not for both (6.6e-5 at d = 8) and costs ~60× the eigensolver at d = 256; it
    // stays as the fallback should the one-sided sweeps not converge or a column vanish.
    // (Eigen's divide-and-conquer SVD, used here earlier, took minutes to compile in every
    // translation unit.)
    bool done = false;
    {
      const left_singular_pairs svd = one_sided_jacobi_svd(m);
      if (svd.converged) {
        out.vectors = svd.u;
        singular = svd.sigma;
        done = true;
      }
    }
    if (!done) {
      const Eigen::JacobiSVD<gaussian_matrix, Eigen::ColPivHouseholderQRPreconditioner> svd(m, Eigen::ComputeFullU);
      out.vectors = svd.matrixU();
      singular = svd.singularValues();
    }
    for (Eigen::Index i = 0; i < out.g.size(); ++i) {
      const double sv = singular[i];
      out.g[i] = sv > 0.0 ? minimum(-((sv - 1.0) / sv) * ((sv + 1.0) / sv), largest_finite<double>())
                          : largest_finite<double>();
      out.gamma[i] = sv > 0.0 ? (1.0 / sv) * (1.0 / sv) : 0.0;  // read only where g < −½
    }
  }
  const gaussian_vector delta = lower.solve(load_vector(mean, d) - load_vector(old_mean, d));
  out.b = out.vectors.transpose() * delta;
}

/// Writes a full row's factorisation (V, g, b: d² + 2d doubles) to `saved`.
inline void save_basis(const gaussian_basis& basis, double* saved) {
  const Eigen::Index n = basis.g.size();
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) saved[i * n + j] = basis.vectors(i, j);
  for (Eigen::Index i = 0; i < n; ++i) saved[n * n + i] = basis.g[i];
  for (Eigen::Index i = 0; i < n; ++i) saved[n * n + n + i] = basis.b[i];
}

/// factor_full, or (when `saved` is not null) the factorisation save_basis wrote for the same
/// inputs, with L° loaded again.
template <class T>
inline void factor_full_or_saved(const T* mean, const T* chol, const T* old_mean, const T* old_chol, std::size_t d,
                                 const double* saved, gaussian_basis& out) {
  if (saved == nullptr) {
    factor_full(mean, chol, old_mean, old_chol, d, out);
    return;
  }
  const auto n = static_cast<Eigen::Index>(d);
  out.full = true;
  out.old_factor = load_factor(old_chol, d);
  out.vectors.resize(n, n);
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) out.vectors(i, j) = saved[i * n + j];
  out.g.resize(n);
  out.b.resize(n);
  for (Eigen::Index i = 0; i < n; ++i) out.g[i] = saved[n * n + i];
  for (Eigen::Index i = 0; i < n; ++i) out.b[i] = saved[n * n + n + i];
}

/// Diagonal covariances: λ_i = r_i² with r = σ̃/σ°, λ − 1 = (r − 1)(r + 1), r − 1 = (σ̃ − σ°)/σ°.
template <class T>
inline void factor_diag(const T* mean, const T* std_dev, const T* old_mean, const T* old_std, std::size_t d,
                        gaussian_basis& out) {
  out.full = false;
  const auto n = static_cast<Eigen::Index>(d);
  out.old_scale.resize(n);
  out.g.resize(n);
  out.b.resize(n);
  out.gamma.resize(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    const double so = static_cast<double>(old_std[i]);
    out.old_scale[i] = so;
    gaussian_diag_coordinate(static_cast<double>(mean[i]), static_cast<double>(std_dev[i]),
                             static_cast<double>(old_mean[i]), so, &out.g[i], &out.b[i]);
    const double inverse_ratio = so / static_cast<double>(std_dev[i]);
    out.gamma[i] = inverse_ratio * inverse_ratio;
  }
}

/// The member at t in the eigenbasis: a_i = 1 + t g_i and, with the mean, m_i = t γ_i b_i / a_i.
struct gaussian_member_coords {
  gaussian_vector a;
  gaussian_vector m;
};
/// The forward's member at (t, s): a and γ as forward_spectrum's (gaussian_precision_ratio).
inline gaussian_member_coords forward_member_coords(const gaussian_basis& basis, double t, double s) {
  const Eigen::Index n = basis.g.size();
  const double* gamma = basis.gamma.size() == n ? basis.gamma.data() : nullptr;
  gaussian_member_coords c;
  c.a.resize(n);
  c.m.resize(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    const double g = basis.g[i];
    c.a[i] = gaussian_precision_ratio(g, gamma, static_cast<int>(i), t, s);
    const double gi = gamma != nullptr && g < -0.5 ? gamma[i] : 1.0 + g;
    c.m[i] = (t * gi / c.a[i]) * basis.b[i];
  }
  return c;
}
inline gaussian_member_coords member_coords(const gaussian_basis& basis, double t) {
  gaussian_member_coords c;
  c.a = (1.0 + t * basis.g.array()).matrix();
  c.m = ((t * (1.0 + basis.g.array()) / c.a.array()) * basis.b.array()).matrix();  // tγ/a first
  return c;
}

/// W y for a vector y of eigenbasis coordinates.
inline gaussian_vector to_original(const gaussian_basis& basis, const gaussian_vector& y) {
  if (!basis.full) return (basis.old_scale.array() * y.array()).matrix();
  return basis.old_factor.triangularView<Eigen::Lower>() * (basis.vectors * y);
}

template <class T>
inline void store_vector(const gaussian_vector& v, T* out) {
  for (Eigen::Index i = 0; i < v.size(); ++i) out[i] = static_cast<T>(v[i]);
}

/// Writes μ° + W m(t) (joint: the member's mean).
template <class T>
inline void write_member_mean(const gaussian_basis& basis, const gaussian_member_coords& c, const T* old_mean,
                              T* out) {
  const gaussian_vector shift = to_original(basis, c.m);
  for (Eigen::Index i = 0; i < shift.size(); ++i) out[i] = static_cast<T>(static_cast<double>(old_mean[i]) + shift[i]);
}

/// The Cholesky factor of V diag(1/a) Vᵀ (V orthonormal, a > 0) from the Householder QR of
/// Bᵀ = diag(a^{-1/2}) Vᵀ (B Bᵀ = RᵀR), its rows ordered by decreasing scale a^{-1/2}. Reordering
/// the rows of Bᵀ leaves RᵀR alone, and a Householder QR of rows graded in decreasing order keeps
/// each row's relative accuracy: small 1/a lose nothing to large ones, where the explicit product
/// V diag(1/a) Vᵀ and its Cholesky lose ~u·max(a)/min(a) relative in the directions of large a.
/// No positive pivots needed either (1/a spanning more than the doubles resolve).
inline gaussian_matrix graded_inner_factor(const gaussian_matrix& vectors, const gaussian_vector& a) {
  const Eigen::Index n = a.size();
  std::vector<Eigen::Index> order(static_cast<std::size_t>(n));
  for (Eigen::Index i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](Eigen::Index x, Eigen::Index y) { return a[x] < a[y]; });
  gaussian_matrix bt(n, n);
  for (Eigen::Index k = 0; k < n; ++k) {
    const Eigen::Index i = order[static_cast<std::size_t>(k)];
    bt.row(k) = vectors.col(i).transpose() * (1.0 / ::sqrt(a[i]));
  }
  const Eigen::HouseholderQR<gaussian_matrix> qr(bt);
  gaussian_matrix factor = qr.matrixQR().triangularView<Eigen::Upper>().toDenseMatrix().transpose();
  for (Eigen::Index j = 0; j < n; ++j)
    if (factor(j, j) < 0.0) factor.col(j) = -factor.col(j);
  return factor;
}

/// Writes the member's covariance factor: σ°/sqrt(a) (diag), or L°·chol(V diag(1/a) Vᵀ) (full;
/// a product of lower-triangular factors with positive diagonals, so the Cholesky factor). The
/// inner factor: the Cholesky of the product where a spans at most graded_spread, else (and
/// where that Cholesky fails) graded_inner_factor. The product's Cholesky loses ~u·max(a)/min(a)
/// relative in the directions of the largest a — a new covariance much wider than the old one
/// along some axis and ε large (t* near 1, where a = s + tγ spans ~max(γ)/s), or one
/// ill-conditioned against the other: max |L*_ref⁻¹ L* − I| was 6.1e-8 at 1 − t* ≈ 5e-4 with the
/// new covariance at condition 1e12, growing as 1/(1 − t*), before this route (2.1e-12 with it;
/// tests/test_gaussian_extreme_ratios.cpp).
constexpr double graded_spread = 1e3;

template <class T>
inline void write_member_cov(const gaussian_basis& basis, const gaussian_member_coords& c, T* out) {
  const Eigen::Index n = c.a.size();
  if (!basis.full) {
    for (Eigen::Index i = 0; i < n; ++i) out[i] = static_cast<T>(basis.old_scale[i] / ::sqrt(c.a[i]));
    return;
  }
  gaussian_matrix inner_factor;
  bool done = false;
  if (c.a.maxCoeff() <= graded_spread * c.a.minCoeff()) {
    const gaussian_matrix inner = basis.vectors * c.a.cwiseInverse().asDiagonal() * basis.vectors.transpose();
    const Eigen::LLT<gaussian_matrix> llt(inner);
    inner_factor = llt.matrixL();
    done = llt.info() == Eigen::Success && (inner_factor.diagonal().array() > 0.0).all() && inner_factor.allFinite();
  }
  if (!done) inner_factor = graded_inner_factor(basis.vectors, c.a);
  const gaussian_matrix factor = basis.old_factor.triangularView<Eigen::Lower>() * inner_factor;
  for (Eigen::Index i = 0; i < n; ++i)
    for (Eigen::Index j = 0; j < n; ++j) out[i * n + j] = j <= i ? static_cast<T>(factor(i, j)) : T(0);
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
