// tests/support/gaussian_oracle.hpp — an independent long-double reference for the Gaussian
// projections: explicit covariances and precisions (Cholesky inverses), KL by the textbook
// formula, t* by plain bisection. Shares no code with troll's factorised solve.
#pragma once

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Cholesky>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace troll_test {
namespace gauss {

using real = long double;
using mat = Eigen::Matrix<real, Eigen::Dynamic, Eigen::Dynamic>;
using vec = Eigen::Matrix<real, Eigen::Dynamic, 1>;

/// A Gaussian in long double, from a mean and a row-major lower factor (or std devs).
struct normal {
  vec mean;
  mat cov;
  template <class T>
  static normal from_factor(const T* m, const T* l, std::size_t d) {
    normal n;
    const auto k = static_cast<Eigen::Index>(d);
    n.mean.resize(k);
    mat f = mat::Zero(k, k);
    for (Eigen::Index i = 0; i < k; ++i) {
      n.mean[i] = static_cast<real>(m[i]);
      for (Eigen::Index j = 0; j <= i; ++j) f(i, j) = static_cast<real>(l[i * k + j]);
    }
    n.cov = f * f.transpose();
    return n;
  }
  template <class T>
  static normal from_std(const T* m, const T* s, std::size_t d) {
    normal n;
    const auto k = static_cast<Eigen::Index>(d);
    n.mean.resize(k);
    n.cov = mat::Zero(k, k);
    for (Eigen::Index i = 0; i < k; ++i) {
      n.mean[i] = static_cast<real>(m[i]);
      n.cov(i, i) = static_cast<real>(s[i]) * static_cast<real>(s[i]);
    }
    return n;
  }
};

inline mat inverse(const mat& a) { return Eigen::LLT<mat>(a).solve(mat::Identity(a.rows(), a.cols())); }

inline real log_det(const mat& a) {
  const mat l = Eigen::LLT<mat>(a).matrixL();
  real s = 0;
  for (Eigen::Index i = 0; i < a.rows(); ++i) s += 2 * std::log(l(i, i));
  return s;
}

/// KL(N(m1, S1) ‖ N(m0, S0)); with_mean false drops the mean term (the covariance part).
inline real kl(const normal& p, const normal& q, bool with_mean = true) {
  const mat q_precision = inverse(q.cov);
  const vec diff = p.mean - q.mean;
  real v = (q_precision * p.cov).trace() - static_cast<real>(p.mean.size()) + log_det(q.cov) - log_det(p.cov);
  if (with_mean) v += diff.dot(q_precision * diff);
  return v / 2;
}

/// The member θ_t = θ° + t(θ̃ − θ°) of natural parameters (the covariance only, mean μ̃, when
/// !with_mean).
inline normal member(const normal& target, const normal& old, real t, bool with_mean = true) {
  const mat pn = inverse(target.cov), po = inverse(old.cov);
  const mat precision = t * pn + (1 - t) * po;
  normal n;
  n.cov = inverse(precision);
  n.mean = with_mean ? vec(n.cov * (t * (pn * target.mean) + (1 - t) * (po * old.mean))) : target.mean;
  return n;
}

/// t* of the joint (with_mean) or covariance (!with_mean) bound by bisection; 1 when inactive.
inline real solve_t(const normal& target, const normal& old, real eps, bool with_mean = true) {
  auto f = [&](real t) {
    normal m = member(target, old, t, with_mean);
    if (!with_mean) m.mean = old.mean;
    return kl(m, old, with_mean) - eps;
  };
  if (f(1) <= 0) return 1;
  real lo = 0, hi = 1;
  for (int i = 0; i < 90; ++i) {
    const real mid = (lo + hi) / 2;
    (f(mid) < 0 ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

/// Random test data: factors with diagonal e^{N(0, spread)} and off-diagonal N(0, 0.3)/sqrt(d).
struct generator {
  std::mt19937_64 rng;
  explicit generator(unsigned seed) : rng(seed) {}
  double normal01() { return std::normal_distribution<double>(0.0, 1.0)(rng); }
  std::vector<double> mean(std::size_t d, double scale) {
    std::vector<double> m(d);
    for (auto& x : m) x = scale * normal01();
    return m;
  }
  std::vector<double> factor(std::size_t d, double spread) {
    std::vector<double> l(d * d, 0.0);
    for (std::size_t i = 0; i < d; ++i) {
      for (std::size_t j = 0; j < i; ++j) l[i * d + j] = 0.3 * normal01() / std::sqrt(double(d));
      l[i * d + i] = std::exp(spread * normal01());
    }
    return l;
  }
  std::vector<double> std_dev(std::size_t d, double spread) {
    std::vector<double> s(d);
    for (auto& x : s) x = std::exp(spread * normal01());
    return s;
  }
};

/// Diagonal rows as full ones: n rows of d standard deviations → n row-major d × d Cholesky
/// factors with those diagonals.
inline std::vector<double> diagonal_factors(const std::vector<double>& sd, std::size_t n, std::size_t d) {
  std::vector<double> chol(n * d * d, 0.0);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t i = 0; i < d; ++i) chol[r * d * d + i * d + i] = sd[r * d + i];
  return chol;
}

}  // namespace gauss
}  // namespace troll_test
