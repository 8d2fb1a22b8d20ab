// tests/support/precise_oracle.hpp — a long-double reference for the hard rows of the projection
// (huge finite masks, steep rows, tiny ε), independent of troll's solver: π_s ∝ exp(z̃ − s·d)
// parametrised by s = 1 − t (so t within 1e-300 of 1 is still a distinct point), KL as the sum of
// non-negative terms Σ q_i φ(log π_i − log q_i), and plain bisection on log s or s.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace troll_test {
namespace precise {

using real = long double;

inline real inf() { return std::numeric_limits<real>::infinity(); }

/// φ(σ) = σ e^σ − e^σ + 1 ≥ 0, by its series for small |σ| (no cancellation).
inline real phi(real sigma) {
  if (std::fabs(sigma) < 0.5L) {
    real term = sigma * sigma / 2, sum = 0;  // (n−1) σ^n / n!, n = 2, 3, ...
    real power = sigma * sigma, factorial = 2;
    for (int n = 2; n < 40; ++n) {
      term = real(n - 1) * power / factorial;
      sum += term;
      power *= sigma;
      factorial *= real(n + 1);
    }
    return sum;
  }
  return std::exp(sigma) * (sigma - 1) + 1;
}

/// One row pair in long double with its log q; the family member at s.
struct row {
  std::vector<real> zn, zo, log_q;
  std::size_t size = 0;

  template <class T>
  row(const T* new_logits, const T* old_logits, std::size_t n) : size(n) {
    zn.assign(new_logits, new_logits + n);
    zo.assign(old_logits, old_logits + n);
    real top = -inf();
    for (real z : zo) top = std::max(top, z);
    real sum = 0;
    for (real z : zo)
      if (z > -inf()) sum += std::exp(z - top);
    log_q.resize(n);
    for (std::size_t i = 0; i < n; ++i) log_q[i] = zo[i] > -inf() ? zo[i] - top - std::log(sum) : -inf();
  }

  bool joint(std::size_t i) const { return zn[i] > -inf() && zo[i] > -inf(); }

  /// log π_s over the joint support (−inf elsewhere): weights z̃ − s·d for s ≤ 1/2, z° + t·d above.
  std::vector<real> log_pi(real t, real s) const {
    std::vector<real> w(size, -inf());
    real top = -inf();
    for (std::size_t i = 0; i < size; ++i) {
      if (!joint(i)) continue;
      const real d = zn[i] - zo[i];
      w[i] = s <= 0.5L ? zn[i] - s * d : zo[i] + t * d;
      top = std::max(top, w[i]);
    }
    real sum = 0;
    for (real x : w)
      if (x > -inf()) sum += std::exp(x - top);
    const real norm = top + std::log(sum);
    for (real& x : w)
      if (x > -inf()) x -= norm;
    return w;
  }

  /// KL(π‖q) as Σ q_i φ(log π_i − log q_i) + the old mass π cannot reach; +inf where π has
  /// mass that q lacks.
  real kl(const std::vector<real>& lp) const {
    real sum = 0;
    for (std::size_t i = 0; i < size; ++i) {
      if (!(log_q[i] > -inf())) {
        if (lp[i] > -inf()) return inf();
        continue;
      }
      if (!(lp[i] > -inf())) {
        sum += std::exp(log_q[i]);
        continue;
      }
      const real sigma = lp[i] - log_q[i];
      sum += std::fabs(sigma) < 0.5L ? std::exp(log_q[i]) * phi(sigma)
                                     : std::exp(lp[i]) * (sigma - 1) + std::exp(log_q[i]);
    }
    return sum;
  }

  real kl_at(real t, real s) const { return kl(log_pi(t, s)); }
};

/// The root of KL(π_t‖q) = ε by bisection (t* in (0, 1)), for a row whose KL at t = 1 exceeds ε
/// and at t → 0 is below it. Bisects on t in (0, 1/2] and on s in (0, 1/2], geometrically where
/// the bracket spans orders of magnitude. Returns {t, s}.
struct root {
  real t = 0, s = 1;
};
inline root solve(const row& r, real eps) {
  // Which half holds the root?
  const bool upper = r.kl_at(0.5L, 0.5L) < eps;
  real lo = upper ? std::ldexp(real(1), -16000) : std::ldexp(real(1), -16000);
  real hi = 0.5L;
  // In the lower half KL rises with t; in the upper half KL falls with s.
  auto above = [&](real v) { return upper ? r.kl_at(1 - v, v) < eps : r.kl_at(v, 1 - v) > eps; };
  // `above(v)` true means v is on the hi side of the root in its own variable.
  for (int it = 0; it < 400; ++it) {
    const real mid = hi > 4 * lo ? std::sqrt(lo * hi) : (lo + hi) / 2;
    if (!(mid > lo && mid < hi)) break;
    (above(mid) ? hi : lo) = mid;
  }
  const real v = (lo + hi) / 2;
  return upper ? root{1 - v, v} : root{v, 1 - v};
}

}  // namespace precise
}  // namespace troll_test
