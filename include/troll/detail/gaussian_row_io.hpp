// troll/detail/gaussian_row_io.hpp — where one Gaussian row's VJP or JVP reads and writes: the
// row pointers into the caller's views, picked once for the CPU and CUDA row kernels alike.
#pragma once

#include <cstddef>

#include "../batch.hpp"
#include "../config.hpp"
#include "../gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Row r of an optional view (null when the view is empty).
template <class U>
TROLL_HOST_DEVICE U* row_or_null(batch_view<U> v, std::size_t r) {
  return v.data == nullptr ? nullptr : v.row(r);
}

/// The tilt t of a solved row's stats where its derivatives are taken: 1 for an inactive row
/// (the derivatives test t ≥ 1 for it), else the projected row's t, below 1: a t* within half an
/// ulp of 1 (ε within ~1e-14 of KL(p̃ ‖ q) relative, as at ε ≈ 5e11 against a new standard
/// deviation 1e6 of the old) rounds to t = 1 in the stats, and is taken as the double below 1,
/// whose exact gap is solved_gap (before, such a row got the inactive row's derivatives: ∂σ*/∂ε
/// = 0 where 1e-6 is right).
TROLL_HOST_DEVICE inline double solved_tilt(const gaussian::gaussian_stats& s) {
  if (s.status == row_status::inactive) return 1.0;
  return s.t < 1.0 ? s.t : 0x1.fffffffffffffp-1;
}

/// 1 − t of a solved row's stats, exact: 0 for an inactive row, η·t where t > ½ (η = (1 − t*)/t*
/// is formed from the exact 1 − t*: 1 − t from the stored t would carry half an ulp of t, all of
/// a gap of 1e-12 … 1e-18), else 1 − t (exact there).
TROLL_HOST_DEVICE inline double solved_gap(const gaussian::gaussian_stats& s) {
  if (s.status == row_status::inactive) return 0.0;
  return s.t > 0.5 ? s.eta * s.t : 1.0 - s.t;
}

/// Where one row's VJP reads its upstream gradients and writes (null outputs skipped).
template <class T>
struct gaussian_vjp_io {
  const T* out_cov;        // L* or σ*
  const T* grad_out_mean;  // ∂L/∂μ*
  const T* grad_out_cov;   // ∂L/∂L* (lower triangle read) or ∂L/∂σ*
  T* mean;
  T* cov;
  T* old_mean;
  T* old_cov;
  double* eps;
  double* eps_mean;
};

/// Where one row's JVP reads its tangents (a null input tangent is 0) and writes.
template <class T>
struct gaussian_jvp_io {
  const T* out_cov;    // L* (the forward's output factor, full only)
  const T* mean;       // μ̃'
  const T* cov;        // L̃' (lower triangle read)
  const T* old_mean;   // μ°'
  const T* old_cov;    // L°' (lower triangle read)
  double eps;          // joint: ε'; split: ε_Σ'
  double eps_mean;     // split: ε_μ'
  T* out_mean;         // μ*'
  T* out_cov_tangent;  // L*' (lower-triangular, upper written 0)
};

/// Row r's VJP io: the forward's output `out_cov`, the upstream gradients and `grads`.
template <class T>
TROLL_HOST_DEVICE gaussian_vjp_io<T> vjp_row_io(batch_view<const T> out_cov, batch_view<const T> grad_out_mean,
                                                batch_view<const T> grad_out_cov,
                                                const gaussian::gaussian_grads<T>& grads, std::size_t r) {
  return gaussian_vjp_io<T>{out_cov.row(r),
                            grad_out_mean.row(r),
                            grad_out_cov.row(r),
                            row_or_null(grads.mean, r),
                            row_or_null(grads.cov, r),
                            row_or_null(grads.old_mean, r),
                            row_or_null(grads.old_cov, r),
                            grads.eps == nullptr ? nullptr : grads.eps + r,
                            grads.eps_mean == nullptr ? nullptr : grads.eps_mean + r};
}

/// Row r's JVP io: the forward's output `out_cov`, the input `tangents` and the output tangents.
template <class T>
TROLL_HOST_DEVICE gaussian_jvp_io<T> jvp_row_io(batch_view<const T> out_cov,
                                                const gaussian::gaussian_tangents<T>& tangents,
                                                batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov,
                                                std::size_t r) {
  return gaussian_jvp_io<T>{out_cov.row(r),
                            row_or_null(tangents.mean, r),
                            row_or_null(tangents.cov, r),
                            row_or_null(tangents.old_mean, r),
                            row_or_null(tangents.old_cov, r),
                            tangents.eps,
                            tangents.eps_mean,
                            tangent_out_mean.row(r),
                            tangent_out_cov.row(r)};
}

}  // namespace detail
TROLL_END_NAMESPACE
