// tests/support/tolerance.hpp — the tolerances troll's tests compare with: every bound has an
// absolute and a relative part, and both depend on the element type (float or double).
// Header-only, no test framework inside; used by every test that checks numbers.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

namespace troll_test {

/// |value − reference| ≤ atol + rtol·|reference|. Two infinities of the same sign agree; a NaN
/// never agrees with anything.
struct tolerance {
  double atol = 0.0;
  double rtol = 0.0;

  /// The allowed deviation around `reference`.
  double bound(double reference) const { return atol + rtol * std::fabs(reference); }

  template <class A, class B>
  bool accepts(A value, B reference) const {
    const long double v = static_cast<long double>(value);
    const long double r = static_cast<long double>(reference);
    if (std::isnan(v) || std::isnan(r)) return false;
    if (std::isinf(v) || std::isinf(r)) return v == r;
    return std::fabs(v - r) <= static_cast<long double>(bound(static_cast<double>(r)));
  }

  /// Both parts multiplied by `factor` (a condition number, a safety margin).
  tolerance scaled(double factor) const { return tolerance{atol * factor, rtol * factor}; }
};

/// Unit round-off of T (half an ulp of 1): 2^-24 for float, 2^-53 for double.
template <class T>
constexpr double unit_roundoff() {
  static_assert(std::is_floating_point<T>::value, "unit_roundoff: floating-point types only");
  return static_cast<double>(std::numeric_limits<T>::epsilon()) / 2.0;
}

/// troll's documented accuracy of a projected row, |KL(π*‖q) − ε| ≤ atol + rtol·ε with ε as the
/// reference: rtol 1e-10, atol 1e-13 for double; rtol 1e-4, atol 1e-6 for float (whose output
/// log-probabilities are rounded to 24 bits, although the solve runs in double).
template <class T>
constexpr tolerance projection_guarantee() {
  return std::is_same<T, float>::value ? tolerance{1e-6, 1e-4} : tolerance{1e-13, 1e-10};
}

/// Tolerance of a KL value computed from logits of type T, against an exact reference.
/// `condition` is Σ_i p_i (|l_p,i| + |l_q,i| + |z_p,i − max z_p| + |z_q,i − max z_q|) + 1: the
/// magnitudes that are rounded before the terms of the sum cancel (see oracle::kl_condition).
/// Every reduction in troll runs in double, so the absolute part is a few double ulps of that
/// scale; a float result is additionally rounded once on store (relative part).
template <class T>
tolerance kl_tolerance(double condition) {
  const double store = std::is_same<T, float>::value ? 2.0 * unit_roundoff<float>() : 0.0;
  return tolerance{32.0 * unit_roundoff<double>() * condition, 1e-12 + store};
}

/// Tolerance of one output log-probability of type T whose computation rounds quantities of
/// magnitude up to `scale` (|log π_i|, the logits, their maximum): a few double ulps of the scale
/// plus the final rounding to T.
template <class T>
double log_prob_tolerance(double value, double scale) {
  return 16.0 * unit_roundoff<double>() * (1.0 + scale) +
         2.0 * unit_roundoff<T>() * std::fabs(value);
}

/// Relative tolerance on t* implied by an error `kl_error` in KL(π_t‖q) at the root: since
/// dKL/dt = t σ²(t), a KL deviation δ moves the root by δ / (t σ²). `floor` absorbs the
/// round-off of t itself.
inline double t_tolerance(double t, double sigma2, double kl_error, double floor = 1e-13) {
  const double slope = t * sigma2;
  if (!(slope > 0.0)) return std::numeric_limits<double>::infinity();
  return kl_error / slope + floor * t;
}

}  // namespace troll_test
