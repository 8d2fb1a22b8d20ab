// tests/support/oracle.hpp — long-double reference implementations of troll's forward maths
// (math.md §1–2): log-softmax, KL by a direct sum, the tilted family π_t and the projection by
// plain bisection on t. Deliberately naive (no Newton, no moment formulas) and slow: O(V) long
// double work per evaluation. Header-only, no test framework inside.
//
// Conventions: −inf logits are masked tokens; 0·log 0 = 0; KL(p‖q) = +inf when p_i > 0 = q_i.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace troll_test {
namespace oracle {

using real = long double;

inline real infinity() { return std::numeric_limits<real>::infinity(); }
inline bool finite_logit(real z) { return z > -infinity(); }

/// log_softmax of n logits (any shift, −inf allowed, at least one finite) in long double.
template <class T>
std::vector<real> log_softmax(const T* z, std::size_t n) {
  real top = -infinity();
  for (std::size_t i = 0; i < n; ++i) top = std::max(top, static_cast<real>(z[i]));
  real sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (finite_logit(z[i])) sum += std::exp(static_cast<real>(z[i]) - top);
  }
  const real log_norm = top + std::log(sum);
  std::vector<real> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = finite_logit(z[i]) ? static_cast<real>(z[i]) - log_norm : -infinity();
  }
  return out;
}

/// KL(p‖q) = Σ_i p_i (log p_i − log q_i) from log-probabilities, summed term by term:
/// a term with p_i = 0 is 0, a term with p_i > 0 = q_i makes the result +inf.
inline real kl(const std::vector<real>& log_p, const std::vector<real>& log_q) {
  real sum = 0;
  for (std::size_t i = 0; i < log_p.size(); ++i) {
    if (!finite_logit(log_p[i])) continue;
    if (!finite_logit(log_q[i])) return infinity();
    sum += std::exp(log_p[i]) * (log_p[i] - log_q[i]);
  }
  return sum;
}

/// KL(softmax(p) ‖ softmax(q)) from two logit rows.
template <class T>
real kl_logits(const T* p, const T* q, std::size_t n) {
  return kl(log_softmax(p, n), log_softmax(q, n));
}

/// KL(softmax(p)‖softmax(q)) together with the scale a double evaluation of it rounds before its
/// terms cancel: condition = 1 + Σ_i p_i (|log p_i| + |log q_i| + (max p − p_i) + (max q − q_i))
/// over the tokens where both are finite (logits p, q). Use with tolerance.hpp's kl_tolerance.
struct kl_value {
  real value = 0;
  real condition = 1;
};

template <class T>
kl_value kl_with_condition(const T* p, const T* q, std::size_t n) {
  const std::vector<real> log_p = log_softmax(p, n), log_q = log_softmax(q, n);
  real top_p = -infinity(), top_q = -infinity();
  for (std::size_t i = 0; i < n; ++i) {
    top_p = std::max(top_p, static_cast<real>(p[i]));
    top_q = std::max(top_q, static_cast<real>(q[i]));
  }
  kl_value out;
  out.value = kl(log_p, log_q);
  for (std::size_t i = 0; i < n; ++i) {
    if (!finite_logit(log_p[i]) || !finite_logit(log_q[i])) continue;
    out.condition += std::exp(log_p[i]) *
                     (std::fabs(log_p[i]) + std::fabs(log_q[i]) + (top_p - static_cast<real>(p[i])) +
                      (top_q - static_cast<real>(q[i])));
  }
  return out;
}

/// True when the row pair masks some token on both sides and no token on one side only (every
/// −inf of one row is a −inf of the other). troll 0.1 returns NaN on such rows (see the
/// "tokens masked in both rows" tests); the corpus tests check them separately.
template <class T>
bool only_two_sided_masks(const T* p, const T* q, std::size_t n) {
  bool two_sided = false;
  for (std::size_t i = 0; i < n; ++i) {
    const bool fp = finite_logit(p[i]), fq = finite_logit(q[i]);
    if (fp != fq) return false;
    two_sided = two_sided || !fp;
  }
  return two_sided;
}

/// log Σ_i exp(log_p_i) of a row of (possibly unnormalised) log-probabilities of type T:
/// 0 for a normalised row.
template <class T>
real log_total_mass(const T* log_p, std::size_t n) {
  real top = -infinity();
  for (std::size_t i = 0; i < n; ++i) top = std::max(top, static_cast<real>(log_p[i]));
  real sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (finite_logit(log_p[i])) sum += std::exp(static_cast<real>(log_p[i]) - top);
  }
  return top + std::log(sum);
}

/// The solution classes of math.md §2 (mirrors troll::row_status, kept separate on purpose).
enum class status { inactive, projected, restricted, infeasible };

/// One (new, old) row pair prepared for evaluating the tilted family
///     log π_t,i = log q_i + t d_i − A(t)  on J = {i : z̃_i, z°_i finite},  −inf elsewhere,
///     d = z̃ − z°,  A(t) = log Σ_J q_i e^{t d_i},
/// for t ∈ [0, 1]. At t = 1 it is p̃ restricted to supp(q), renormalised; at t → 0, q restricted
/// to J, renormalised.
class tilted_row {
 public:
  template <class T>
  tilted_row(const T* new_logits, const T* old_logits, std::size_t n)
      : log_new_(log_softmax(new_logits, n)), log_old_(log_softmax(old_logits, n)), diff_(n, 0) {
    joint_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const bool in_new = finite_logit(new_logits[i]), in_old = finite_logit(old_logits[i]);
      joint_[i] = in_new && in_old;
      if (joint_[i]) {
        diff_[i] = static_cast<real>(new_logits[i]) - static_cast<real>(old_logits[i]);
      }
      new_only_ = new_only_ || (in_new && !in_old);
      old_only_ = old_only_ || (!in_new && in_old);
      any_joint_ = any_joint_ || joint_[i];
    }
  }

  std::size_t size() const { return diff_.size(); }
  bool new_only() const { return new_only_; }  ///< p̃ has mass where q has none
  bool old_only() const { return old_only_; }  ///< q has mass where p̃ has none
  bool disjoint() const { return !any_joint_; }
  bool joint(std::size_t i) const { return joint_[i] != 0; }
  real diff(std::size_t i) const { return diff_[i]; }
  const std::vector<real>& log_new() const { return log_new_; }  ///< log p̃ over all tokens
  const std::vector<real>& log_old() const { return log_old_; }  ///< log q over all tokens

  /// log π_t over all tokens (−inf outside J).
  std::vector<real> log_pi(real t) const {
    const real a = log_partition(t);
    std::vector<real> out(size(), -infinity());
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) out[i] = log_old_[i] + t * diff_[i] - a;
    }
    return out;
  }

  /// KL(π_t ‖ q) = Σ_J π_t,i (t d_i − A(t)), a direct sum (log π_t,i − log q_i = t d_i − A(t)).
  /// One exponential per token: the weights of the normaliser pass are kept for the sum.
  real kl_to_old(real t) const {
    real top = -infinity();
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) top = std::max(top, log_old_[i] + t * diff_[i]);
    }
    std::vector<real> weight(size(), 0);
    real total = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) total += weight[i] = std::exp(log_old_[i] + t * diff_[i] - top);
    }
    const real a = top + std::log(total);
    real sum = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) sum += weight[i] / total * (t * diff_[i] - a);
    }
    return sum;
  }

  /// Mean and variance of d under π_t (two passes: the mean first, then centred squares).
  void moments(real t, real& mean, real& variance) const {
    const std::vector<real> lp = log_pi(t);
    mean = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) mean += std::exp(lp[i]) * diff_[i];
    }
    variance = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) variance += std::exp(lp[i]) * (diff_[i] - mean) * (diff_[i] - mean);
    }
  }

  /// −log q(J) = lim_{t→0+} KL(π_t‖q): the least KL any distribution with support in J reaches.
  real min_kl() const {
    real top = -infinity();
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) top = std::max(top, log_old_[i]);
    }
    real sum = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) sum += std::exp(log_old_[i] - top);
    }
    return std::max(real(0), -(top + std::log(sum)));
  }

 private:
  /// A(t) = log Σ_J exp(log q_i + t d_i).
  real log_partition(real t) const {
    real top = -infinity();
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) top = std::max(top, log_old_[i] + t * diff_[i]);
    }
    real sum = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      if (joint_[i]) sum += std::exp(log_old_[i] + t * diff_[i] - top);
    }
    return top + std::log(sum);
  }

  std::vector<real> log_new_, log_old_, diff_;
  std::vector<unsigned char> joint_;
  bool new_only_ = false, old_only_ = false, any_joint_ = false;
};

/// The oracle's answer for one row and bound ε.
struct solution {
  oracle::status status = oracle::status::inactive;
  real t = 1;              ///< t* (1 for inactive and restricted rows, 0 for infeasible ones)
  real kl_before = 0;      ///< KL(p̃‖q), +inf when p̃ has mass where q has none
  real kl_restricted = 0;  ///< KL(π_1‖q): p̃ restricted to supp(q), renormalised
  int bisection_steps = 0;
};

/// The class of the row for bound ε, decided from first principles (math.md §2), without solving
/// for t*: t is 1 for inactive and restricted rows, 0 for infeasible ones, unset (−1) for
/// projected ones.
inline solution classify(const tilted_row& row, real eps) {
  solution s;
  s.kl_before = row.new_only() ? infinity() : kl(row.log_new(), row.log_old());
  if (row.disjoint()) {
    s.status = status::infeasible;
    s.t = 0;
    return s;
  }
  s.kl_restricted = row.kl_to_old(1);
  if (s.kl_restricted <= eps) {
    s.status = row.new_only() ? status::restricted : status::inactive;
    return s;
  }
  if (row.min_kl() >= eps) {
    s.status = status::infeasible;
    s.t = 0;
    return s;
  }
  s.status = status::projected;
  s.t = -1;
  return s;
}

/// The projection: classify, then for an active row find t* by plain bisection of the monotone
/// KL(π_t‖q) − ε on (0, 1] until the bracket is `relative_width` of its upper end (2^-48 ≈ 4e-15
/// by default, far below any test tolerance on t).
inline solution project(const tilted_row& row, real eps, real relative_width = std::ldexp(real(1), -48)) {
  solution s = classify(row, eps);
  if (s.status != status::projected) return s;
  real lo = 0, hi = 1;
  while (hi - lo > relative_width * hi && s.bisection_steps < 400) {
    const real mid = (lo + hi) / 2;
    (row.kl_to_old(mid) > eps ? hi : lo) = mid;
    ++s.bisection_steps;
  }
  s.t = (lo + hi) / 2;
  return s;
}

/// Certifies a claimed root without solving: true when KL(π_{t_lo}‖q) < ε < KL(π_{t_hi}‖q), i.e.
/// (KL being increasing in t) t* ∈ (t_lo, t_hi). t_hi is clipped to 1.
inline bool brackets_root(const tilted_row& row, real eps, real t_lo, real t_hi) {
  t_hi = std::min(t_hi, real(1));
  const real lower = t_lo <= 0 ? row.min_kl() : row.kl_to_old(t_lo);
  return lower < eps && row.kl_to_old(t_hi) > eps;
}

}  // namespace oracle
}  // namespace troll_test
