// troll/gaussian_types.hpp — the per-row statistics and gradient views of the Gaussian
// trust-region projections (troll/gaussian.hpp). Plain aggregates, identical on host and device.
#pragma once

#include <cstddef>
#include <type_traits>

#include "batch.hpp"
#include "config.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace gaussian {

/// What the projection did to one Gaussian row. Joint bound: every field but omega and the
/// mean_kl pair describes KL(·‖q) of the whole Gaussian. Split bounds: t, kl_before, kl_after
/// describe the covariance part ½[tr(Σ°⁻¹Σ) − d + log det Σ° − log det Σ], and the mean part
/// m = ½(μ − μ°)ᵀΣ°⁻¹(μ − μ°) is in mean_kl_before / mean_kl_after, its step in omega.
struct gaussian_stats {
  double t = 1.0;               ///< interpolation weight of the new natural parameters
  double eta = 0.0;             ///< (1 − t)/t
  double omega = 0.0;           ///< split mean: μ* = (μ̃ + ω μ°)/(1 + ω) (0: mean bound inactive)
  double kl_before = 0.0;       ///< KL at the new Gaussian (joint) or its covariance part (split)
  double kl_after = 0.0;        ///< the same at the projection
  double mean_kl_before = 0.0;  ///< split: m at μ̃; joint: 0
  double mean_kl_after = 0.0;   ///< split: m at μ*; joint: 0
  double fisher = 0.0;          ///< I(t*) = (dKL/dt)/t at t* (0 when inactive)
  int iterations = 0;
  row_status status = row_status::inactive;  ///< inactive, projected or not_converged

  /// Whether the row holds the exact projection (the covariance part for split bounds).
  TROLL_HOST_DEVICE bool solved() const {
    return status == row_status::inactive || status == row_status::projected;
  }
};

/// Where a backward pass writes: the gradient of the loss w.r.t. each input, shaped like it
/// (factors N × d·d, lower triangle written and the upper set to 0; std devs N × d). Any view
/// may be empty (data == nullptr) to skip it; the bound pointers take one double per row.
template <class T>
struct gaussian_grads {
  batch_view<T> mean;
  batch_view<T> cov;
  batch_view<T> old_mean;
  batch_view<T> old_cov;
  double* eps = nullptr;       ///< joint: ∂L/∂ε; split: ∂L/∂ε_Σ
  double* eps_mean = nullptr;  ///< split only: ∂L/∂ε_μ
};

/// The input tangents of a JVP (forward-mode derivative), shaped like the inputs. Any view may be
/// empty (data == nullptr) for a zero tangent; factor tangents are read in their lower triangle.
/// The bound tangents are shared by all rows.
template <class T>
struct gaussian_tangents {
  batch_view<const T> mean;
  batch_view<const T> cov;
  batch_view<const T> old_mean;
  batch_view<const T> old_cov;
  double eps = 0.0;       ///< joint: ε'; split: ε_Σ'
  double eps_mean = 0.0;  ///< split only: ε_μ'
};

/// Caller-owned memory for the factorisation of full-covariance rows (V, d² doubles, then
/// g = γ − 1 and b, d each: saved_doubles(d) a row, `rows` rows back to back). A forward
/// projection given one fills it; the backward or JVP of the same inputs given it reads the
/// factorisation instead of recomputing it (the eigendecomposition, ~40–50 % of a full backward
/// on the CPU). It must come from the forward of exactly these inputs: nothing checks that.
template <class D>
struct saved_factorisation {
  D* data = nullptr;
  std::size_t rows = 0;
  std::size_t dim = 0;
  static constexpr std::size_t saved_doubles(std::size_t d) { return d * d + 2 * d; }
  TROLL_HOST_DEVICE D* row(std::size_t r) const { return data + r * (dim * dim + 2 * dim); }
  /// Implicit conversion to the read-only view the backward and JVP take.
  template <class U = D, class = std::enable_if_t<!std::is_const<U>::value>>
  TROLL_HOST_DEVICE operator saved_factorisation<const U>() const {
    return saved_factorisation<const U>{data, rows, dim};
  }
};

}  // namespace gaussian
TROLL_END_NAMESPACE
