// troll/detail/lse_state.hpp — an online, mergeable log-sum-exp with the first two moments of a
// companion value. One state summarises a set of pairs (w_i, x_i) as
//     m = max w_i,   s_k = Σ exp(w_i − m) · x_i^k   (k = 0, 1, 2),
// and, where the reduction that made it keeps them, the third and fourth moments s3, s4 (k = 3, 4;
// NaN where unknown: reductions that do not form them leave them NaN, and merge keeps them NaN).
// States merge associatively (blocks, threads, warps, vocabulary shards all reduce the same way).
// The tilted-family reduction also keeps the (z̃, z°) pair of the element that attains m, the
// reference its next evaluation is written relative to (tilt_family.hpp).
#pragma once

#include <cmath>

#include "../config.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

struct lse_state {
  double m = neg_inf();
  double s0 = 0.0;
  double s1 = 0.0;
  double s2 = 0.0;
  double ref_new = 0.0;  // z̃ of the pair attaining m (push_pair only)
  double ref_old = 0.0;  // z° of that pair
  double s3 = quiet_nan();  // Σ exp(w_i − m) · x_i³, NaN where the reduction did not form it
  double s4 = quiet_nan();  // Σ exp(w_i − m) · x_i⁴, likewise
  // The most roundings any term's share of s0, s1, s2 went through on its way into them (the
  // additions of the reduction's order, the rescalings): each sum lies within depth·u of its
  // exact value, relative to the sum of its terms' magnitudes. A row of many terms summed one
  // after another rounds in step when its terms are alike (a block of equal logits: every
  // addition rounds the same way), so this, not a few ulps, bounds the closed-form KL's error
  // on long rows (make_point).
  double depth = 0.0;

  TROLL_HOST_DEVICE bool empty() const { return m == neg_inf(); }
  /// log Σ exp(w_i); −inf for an empty set.
  TROLL_HOST_DEVICE double log_sum() const { return empty() ? neg_inf() : m + ::log(s0); }
  /// Weighted mean Σ e^{w_i} x_i / Σ e^{w_i}.
  TROLL_HOST_DEVICE double mean() const { return s1 / s0; }
  /// Weighted variance, clamped at zero against round-off; +inf where the second moment s2
  /// overflowed (an x beyond ~1e154: a logit difference the row's others cannot balance), which
  /// had given inf − inf and then the clamp's 0.
  TROLL_HOST_DEVICE double variance() const {
    const double mu = s1 / s0, m2 = s2 / s0;
    if (m2 == -neg_inf()) return m2;
    const double v = m2 - mu * mu;
    return v > 0.0 ? v : 0.0;
  }
  /// Weighted third central moment (the third cumulant of x); NaN where s3 is unknown.
  TROLL_HOST_DEVICE double third_cumulant() const {
    const double mu = s1 / s0;
    return s3 / s0 - mu * (3.0 * (s2 / s0) - 2.0 * mu * mu);
  }
  /// Weighted fourth cumulant of x (E(x−μ)⁴ − 3 Var²); NaN where s3 or s4 is unknown.
  TROLL_HOST_DEVICE double fourth_cumulant() const {
    const double mu = s1 / s0, m2 = s2 / s0, m3 = s3 / s0, m4 = s4 / s0;
    const double central4 = m4 - mu * (4.0 * m3 - mu * (6.0 * m2 - 3.0 * mu * mu));
    const double var = m2 - mu * mu;
    return central4 - 3.0 * var * var;
  }
};

/// Adds one pair (w, x); w = −inf contributes nothing.
TROLL_HOST_DEVICE inline void push(lse_state& st, double w, double x) {
  if (w == neg_inf()) return;
  st.depth += 2.0;  // a rescaling and an addition at most
  if (w > st.m) {
    const double scale = ::exp(st.m - w);  // exp(−inf) = 0 on the first push
    st.s0 = st.s0 * scale + 1.0;
    st.s1 = st.s1 * scale + x;
    st.s2 = st.s2 * scale + x * x;  // weight 1: x² overflows only if x itself is ~1e154+
    st.s3 = (st.m == neg_inf() ? 0.0 : st.s3 * scale) + x * x * x;  // an empty state's s3 is NaN
    st.s4 = (st.m == neg_inf() ? 0.0 : st.s4 * scale) + (x * x) * (x * x);
    st.m = w;
  } else {
    const double e = ::exp(w - st.m);
    const double ex = e * x;  // (e·x)·x: a zero weight never meets an x² that overflowed
    st.s0 += e;
    st.s1 += ex;
    st.s2 += ex * x;
    st.s3 += (ex * x) * x;
    st.s4 += ((ex * x) * x) * x;
  }
}

/// push() of the tilted-family pair of a token with logits (z̃, z°) = (zn, zo), which it records
/// as the reference when w is a new maximum.
TROLL_HOST_DEVICE inline void push_pair(lse_state& st, double w, double x, double zn, double zo) {
  if (w > st.m) st.ref_new = zn, st.ref_old = zo;
  push(st, w, x);
}

/// The state of the union of two disjoint sets. Associative and commutative up to round-off in
/// its sums; on tied maxima it keeps the first operand's reference (ref_new, ref_old), so a
/// parallel reduction whose results must agree across threads fixes the operand order
/// (cuda::warp_all_reduce: the lower lane first).
TROLL_HOST_DEVICE inline lse_state merge(const lse_state& a, const lse_state& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  const bool a_big = a.m >= b.m;
  const lse_state& hi = a_big ? a : b;
  const lse_state& lo = a_big ? b : a;
  const double scale = ::exp(lo.m - hi.m);
  // lo's terms: the scale's rounding, the product's and the sum's; hi's: the sum's
  const double depth = hi.depth + 1.0 > lo.depth + 3.0 ? hi.depth + 1.0 : lo.depth + 3.0;
  return lse_state{hi.m,       hi.s0 + lo.s0 * scale, hi.s1 + lo.s1 * scale, hi.s2 + lo.s2 * scale,
                   hi.ref_new, hi.ref_old,            hi.s3 + lo.s3 * scale, hi.s4 + lo.s4 * scale,
                   depth};
}

}  // namespace detail
TROLL_END_NAMESPACE
