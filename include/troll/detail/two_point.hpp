// troll/detail/two_point.hpp — the new-side derivative entries of a projected row whose π* is
// nearly two-point, taken from the row's two exact invariances (host/device maths; the CPU row
// driver is detail/cpu/two_point_rows.hpp).
//
// For a projected row the VJP w.r.t. the new logits is
//
//   v_j = t·[(g_j − π_j G) − π_j c_j h],   G = Σ g,  h = Σ g c / σ²,  c = d − μ,  d = z̃ − z°,
//
// (TROLL's ratio part is the same with g = coef·e_a). Where two tokens 1 and 2 hold nearly all of
// π*, v_1 and v_2 are differences of terms of size |g| whose true value is of the size of the
// other tokens' mass S_o (on an exactly two-point π* the bracket is 0 for every g): the rounding
// of those terms (and, in float, of the π read back from log π*) is then all of them. An audit
// measured 58× the row's largest entry in double and 1e9× in float at S_o = 1e-15. The rule of a
// single dominant token (minus the others' sum) does not help: the others include the second
// heavy token.
//
// π* does not move when every new logit moves alike (Σ_j v_j = 0), nor when z̃ moves along
// d = z̃ − z° (z° + t(1 + s)d is the same family; t* rescales), so Σ_j v_j d_j = 0. The two heavy
// entries therefore follow from the others' (o ∉ {1, 2}), which carry no such cancellation:
//
//   v_1 = Σ_o v_o (d_2 − d_o) / (d_1 − d_2),    v_2 = Σ_o v_o (d_1 − d_o) / (d_2 − d_1).
//
// The rule is taken where its rounding bound is below the direct formula's: the direct bound is
// the size of the terms at the two tokens, |t|·(|g| + π|G| + π|c h|), its π terms weighted by
// the error of π read back from log π* (~ulp_T·|log π|); the rule's is
// Σ_o [size of v_o's terms·|d_k − d_o| + |v_o|·(|z̃_k − z̃_o| + |z°_k − z°_o|)] / |d_1 − d_2| (v_o's
// own error, and the rounding of d_k − d_o) plus the rounding of d_1 − d_2 itself. Differences of logits are formed within each row first, so that
// an offset between the rows (z̃ = z° + 1e4 + δ) does not reach them.
#pragma once

#include <cmath>
#include <cstddef>

#include "../config.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The scalars of a projected row's new-side VJP: v_j = t·[(g_j − π_j G) − π_j c_j h].
struct two_point_frame {
  double t = 1.0;  ///< t* (times a coefficient for TROLL's ratio part; may be negative)
  double G = 0.0;  ///< Σ g
  double h = 0.0;  ///< Σ g c / σ²
  /// ulp of the log π* type over ulp of double (1, or 2^29 for float): π read back from log π*
  /// carries a relative error of ~that many double ulps times |log π|.
  double pi_ulps = 1.0;

  TROLL_HOST_DEVICE double entry(double g, double pi, double centred) const {
    return t * ((g - pi * G) - pi * centred * h);
  }
  /// A bound of entry()'s rounding, in ulps of double (up to a small constant): the size of its
  /// terms, the π terms weighted by π's own error.
  TROLL_HOST_DEVICE double terms(double g, double pi, double centred, double log_pi) const {
    return ::fabs(t) * (::fabs(g) + pi * (::fabs(G) + ::fabs(centred * h)) * (1.0 + pi_ulps * ::fabs(log_pi)));
  }
};

/// two_point_frame::pi_ulps for log π* stored in T.
template <class T>
TROLL_HOST_DEVICE constexpr double two_point_pi_ulps() {
  return sizeof(T) < sizeof(double) ? 536870912.0 : 1.0;  // 2^-24 / 2^-53
}

/// Whether a row's new-side entries may hide a two-point cancellation: their largest magnitude
/// is well below the size |t|·max|g| of their terms (a token's own upstream). Cheap to decide
/// from sums the passes keep; rows that pass it are then scanned for their two heaviest tokens.
TROLL_HOST_DEVICE inline bool two_point_suspect(double largest_entry, double t, double widest_g) {
  return 8.0 * largest_entry < ::fabs(t) * widest_g;
}

/// Whether the two heaviest tokens (log π_1 ≥ log π_2) leave the others less mass than π_2
/// holds: only there can their entries cancel by more than the others' share.
TROLL_HOST_DEVICE inline bool two_point_candidate(double log_pi_1, double log_pi_2) {
  if (!(log_pi_2 > neg_inf())) return false;
  const double p1 = ::exp(log_pi_1), p2 = ::exp(log_pi_2);
  return (1.0 - p1) - p2 <= p2;
}

/// The two tokens of largest log π* (the lower index first on ties): fed token by token (add)
/// or merged (operator+, the CUDA reductions). `second` is unset (found_two() false) where the
/// row has one token on its support.
struct heavy_pair {
  static constexpr std::size_t none = ~std::size_t(0);
  std::size_t first = none, second = none;
  double log_1 = neg_inf(), log_2 = neg_inf();

  /// Whether (x, i) ranks above (y, j): the larger log π*, the lower index on ties.
  TROLL_HOST_DEVICE static bool above(double x, std::size_t i, double y, std::size_t j) {
    return x > y || (x == y && i < j);
  }
  TROLL_HOST_DEVICE void add(std::size_t j, double log_pi) {
    if (!(log_pi > neg_inf())) return;
    if (above(log_pi, j, log_1, first)) {
      second = first, log_2 = log_1;
      first = j, log_1 = log_pi;
    } else if (above(log_pi, j, log_2, second)) {
      second = j, log_2 = log_pi;
    }
  }
  TROLL_HOST_DEVICE friend heavy_pair operator+(heavy_pair a, const heavy_pair& b) {
    if (b.first != none) a.add(b.first, b.log_1);
    if (b.second != none) a.add(b.second, b.log_2);
    return a;
  }
  TROLL_HOST_DEVICE bool found_two() const { return second != none; }
};

/// The sums over the other tokens o of a candidate row (fed token by token, or merged).
struct two_point_sums {
  double toward_1 = 0.0;  ///< Σ_o v_o (d_2 − d_o): v_1·(d_1 − d_2)
  double toward_2 = 0.0;  ///< Σ_o v_o (d_1 − d_o): −v_2·(d_1 − d_2)
  double bound_1 = 0.0;   ///< Σ_o terms_o·|d_2 − d_o| + |v_o|·(|z̃_2 − z̃_o| + |z°_2 − z°_o|)
  double bound_2 = 0.0;   ///< the same against token 1

  /// Token o with entry v, the size of its terms, and its logits' differences from tokens 1 and 2
  /// (z̃_k − z̃_o and z°_k − z°_o, each within its row).
  TROLL_HOST_DEVICE void add(double v, double terms, double dn1, double do1, double dn2, double do2) {
    const double x1 = dn1 - do1, x2 = dn2 - do2;  // d_1 − d_o, d_2 − d_o
    toward_1 += v * x2;
    toward_2 += v * x1;
    // v's own error (~terms) times |d_k − d_o|; the rounding of d_k − d_o (~|Δz̃| + |Δz°|) times |v|
    bound_1 += terms * ::fabs(x2) + ::fabs(v) * (::fabs(dn2) + ::fabs(do2));
    bound_2 += terms * ::fabs(x1) + ::fabs(v) * (::fabs(dn1) + ::fabs(do1));
  }
  TROLL_HOST_DEVICE friend two_point_sums operator+(two_point_sums a, const two_point_sums& b) {
    a.toward_1 += b.toward_1, a.toward_2 += b.toward_2;
    a.bound_1 += b.bound_1, a.bound_2 += b.bound_2;
    return a;
  }
};

/// The entries of tokens 1 and 2 by the rule, and whether to take them (their rounding bound
/// below `direct_terms`, the size of the direct formula's terms at the two tokens). `dn12` =
/// z̃_1 − z̃_2, `do12` = z°_1 − z°_2.
struct two_point_values {
  bool take = false;
  double v1 = 0.0, v2 = 0.0;
};
TROLL_HOST_DEVICE inline two_point_values two_point_resolve(const two_point_sums& s, double dn12, double do12,
                                                            double direct_terms) {
  two_point_values r;
  const double gap = dn12 - do12;  // d_1 − d_2
  if (!(::fabs(gap) > 0.0) || !(::fabs(gap) < inf())) return r;
  r.v1 = s.toward_1 / gap;
  r.v2 = 0.0 - s.toward_2 / gap;
  const double larger = ::fabs(r.v1) < ::fabs(r.v2) ? ::fabs(r.v2) : ::fabs(r.v1);
  const double bound = ((s.bound_1 < s.bound_2 ? s.bound_2 : s.bound_1) +
                        larger * (::fabs(dn12) + ::fabs(do12))) / ::fabs(gap);
  r.take = bound < direct_terms && fits_in<double>(r.v1) && fits_in<double>(r.v2);
  return r;
}

}  // namespace detail
TROLL_END_NAMESPACE
