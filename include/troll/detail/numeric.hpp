// troll/detail/numeric.hpp — scalar helpers shared by host and device code: infinities, NaN
// tests that survive -ffast-math-free builds, and the accumulation type of each input type.
#pragma once

#include <cmath>

#include "../config.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

TROLL_HOST_DEVICE constexpr double inf() { return __builtin_huge_val(); }
TROLL_HOST_DEVICE constexpr double neg_inf() { return -__builtin_huge_val(); }
TROLL_HOST_DEVICE inline double quiet_nan() { return __builtin_nan(""); }

/// NaN or +inf: the values a logit may never take (−inf is legal: a masked token).
TROLL_HOST_DEVICE constexpr bool is_bad_logit(double x) { return !(x < inf()); }
TROLL_HOST_DEVICE constexpr bool is_masked(double x) { return x == neg_inf(); }

TROLL_HOST_DEVICE inline double maximum(double a, double b) { return a < b ? b : a; }
TROLL_HOST_DEVICE inline double minimum(double a, double b) { return b < a ? b : a; }
/// The larger of a and b, NaN where either is NaN (`maximum` keeps a NaN only as its first
/// operand): for a running bound on the |entries| written, which an overflow check then reads, so
/// that a NaN entry never reads as small.
TROLL_HOST_DEVICE inline double bound_max(double a, double b) { return (a < b || b != b) ? b : a; }

/// e^δ − 1 − δ (≥ 0) without cancellation: its series δ²/2! + δ³/3! + … where |δ| < ½, else
/// expm1(δ) − δ.
TROLL_HOST_DEVICE inline double expm1_minus_x(double d) {
  if (!(::fabs(d) < 0.5)) return ::expm1(d) - d;
  double term = 0.0;
  for (int k = 18; k >= 2; --k) term = (1.0 + term) * d / double(k);  // d/2·(1 + d/3·(1 + …))
  return term * d;
}

/// The largest finite value of an output element type (float or double), as a double.
template <class T>
TROLL_HOST_DEVICE constexpr double largest_finite() {
  return sizeof(T) == sizeof(float) ? 3.4028234663852886e38 : 1.7976931348623157e308;
}

/// Whether v is a finite value that rounds to a finite T (|v| ≤ T's largest; false for NaN).
template <class T>
TROLL_HOST_DEVICE constexpr bool fits_in(double v) {
  return v <= largest_finite<T>() && v >= -largest_finite<T>();
}

/// Whether lp can be the forward's log π* at a token whose new and old logits are both above −inf
/// (`open`: π* > 0 there for every status) or not (π* = 0): not NaN, ≤ 0, and above −inf exactly
/// on the open tokens. −inf on an open token is a log-probability below the element type's
/// range (float logits near ±3e38 in one row: log π ≈ −6e38), which the forward rounds to −inf
/// and no derivative can take for a masked token's (detail::row_error::log_prob_underflow).
TROLL_HOST_DEVICE constexpr bool log_prob_fits(double lp, bool open) {
  return lp <= 0.0 && (open ? lp > neg_inf() : lp == neg_inf());
}

/// Every row-level reduction runs in double, whatever the element type: float inputs are widened
/// on load and results rounded once on store. (float sums over 10^5 entries lose ~1e-5.)
template <class T>
struct accumulate {
  using type = double;
};
template <class T>
using accumulate_t = typename accumulate<T>::type;

}  // namespace detail
TROLL_END_NAMESPACE
