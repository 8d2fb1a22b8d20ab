// tests/test_gaussian_backward.cpp — the VJP of the Gaussian projections (joint and split, full
// and diagonal) against central finite differences of the independent long-double oracle
// (support/gaussian_oracle.hpp: bisection for t*, explicit inverses), in random directions of
// every input and of the bounds; at larger d against differences of troll's own forward.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Cholesky>
#include <cmath>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "support/gaussian_oracle.hpp"
#include "troll/gaussian.hpp"

namespace {

namespace gauss = troll_test::gauss;
using gauss::real;

/// One problem: inputs (means, factors or std devs), bounds, layout.
struct problem {
  std::size_t d = 0;
  bool full = true;
  bool split = false;
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0.1, eps_cov = 0.1;
  std::size_t cov_size() const { return full ? d * d : d; }
};

/// The forward output flattened (mean then factor / std devs) by the long-double oracle.
std::vector<real> oracle_output(const problem& p) {
  const gauss::normal target = p.full ? gauss::normal::from_factor(p.mean.data(), p.cov.data(), p.d)
                                      : gauss::normal::from_std(p.mean.data(), p.cov.data(), p.d);
  const gauss::normal old = p.full ? gauss::normal::from_factor(p.old_mean.data(), p.old_cov.data(), p.d)
                                   : gauss::normal::from_std(p.old_mean.data(), p.old_cov.data(), p.d);
  const real t = gauss::solve_t(target, old, p.split ? p.eps_cov : p.eps, !p.split);
  gauss::normal out = gauss::member(target, old, t, !p.split);
  if (p.split) {
    const gauss::vec diff = target.mean - old.mean;
    const real m = diff.dot(gauss::inverse(old.cov) * diff) / 2;
    const real kappa = m > p.eps ? std::sqrt(static_cast<real>(p.eps) / m) : 1;
    out.mean = old.mean + kappa * diff;
  }
  std::vector<real> flat(out.mean.data(), out.mean.data() + p.d);
  const auto n = static_cast<Eigen::Index>(p.d);
  if (p.full) {
    const gauss::mat l = Eigen::LLT<gauss::mat>(out.cov).matrixL();
    for (Eigen::Index i = 0; i < n; ++i)
      for (Eigen::Index j = 0; j < n; ++j) flat.push_back(j <= i ? l(i, j) : 0);
  } else {
    for (Eigen::Index i = 0; i < n; ++i) flat.push_back(std::sqrt(out.cov(i, i)));
  }
  return flat;
}

struct forward {
  std::vector<double> mean, cov;
  troll::gaussian::gaussian_stats stats;
};

forward troll_forward(const problem& p) {
  forward f;
  f.mean.resize(p.d);
  f.cov.resize(p.cov_size());
  const std::size_t cc = p.cov_size();
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  (void)cc;
  if (p.full && !p.split)
    troll::gaussian::project_joint(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                   out(f.mean), out(f.cov), &f.stats);
  if (p.full && p.split)
    troll::gaussian::project_split(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                   p.eps_cov, out(f.mean), out(f.cov), &f.stats);
  if (!p.full && !p.split)
    troll::gaussian::project_joint_diag(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                        out(f.mean), out(f.cov), &f.stats);
  if (!p.full && p.split)
    troll::gaussian::project_split_diag(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                        p.eps_cov, out(f.mean), out(f.cov), &f.stats);
  return f;
}

std::vector<real> troll_output(const problem& p) {
  const forward f = troll_forward(p);
  std::vector<real> flat(f.mean.begin(), f.mean.end());
  flat.insert(flat.end(), f.cov.begin(), f.cov.end());
  return flat;
}

struct gradients {
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0, eps_mean = 0;
};

gradients troll_backward(const problem& p, const std::vector<double>& upstream) {
  const forward f = troll_forward(p);
  gradients g;
  g.mean.resize(p.d);
  g.old_mean.resize(p.d);
  g.cov.resize(p.cov_size());
  g.old_cov.resize(p.cov_size());
  const std::vector<double> up_mean(upstream.begin(), upstream.begin() + long(p.d));
  const std::vector<double> up_cov(upstream.begin() + long(p.d), upstream.end());
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  double eps_bar = 0, eps_mean_bar = 0;
  troll::gaussian::gaussian_grads<double> grads{out(g.mean), out(g.cov), out(g.old_mean), out(g.old_cov),
                                                &eps_bar, &eps_mean_bar};
  if (p.full && !p.split)
    troll::gaussian::project_joint_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                            in(f.mean), in(f.cov), &f.stats, in(up_mean), in(up_cov), grads);
  if (p.full && p.split)
    troll::gaussian::project_split_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps,
                                            p.eps_cov, in(f.mean), in(f.cov), &f.stats, in(up_mean), in(up_cov),
                                            grads);
  if (!p.full && !p.split)
    troll::gaussian::project_joint_diag_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov),
                                                 p.eps, in(f.mean), in(f.cov), &f.stats, in(up_mean), in(up_cov),
                                                 grads);
  if (!p.full && p.split)
    troll::gaussian::project_split_diag_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov),
                                                 p.eps, p.eps_cov, in(f.mean), in(f.cov), &f.stats, in(up_mean),
                                                 in(up_cov), grads);
  if (p.split) {
    g.eps = eps_mean_bar;  // ε of the problem is ε_μ for split
    g.eps_mean = eps_bar;  // and eps_cov is ε_Σ
  } else {
    g.eps = eps_bar;
  }
  return g;
}

/// Checks ⟨∇, v⟩ against the central difference of ⟨upstream, output⟩ along v, for v a random
/// direction of each input in turn (factor directions lower-triangular) and of each bound.
void check_vjp(const problem& p, const std::function<std::vector<real>(const problem&)>& output, double h,
               double rtol, gauss::generator& gen, const std::string& what) {
  INFO(what, " d=", p.d, " full=", p.full, " split=", p.split, " eps=", p.eps);
  std::vector<double> upstream(p.d + p.cov_size());
  for (std::size_t i = 0; i < upstream.size(); ++i) {
    const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
    upstream[i] = above ? 0.0 : gen.normal01();
  }
  const gradients g = troll_backward(p, upstream);
  auto loss = [&](const problem& q) {
    const std::vector<real> out = output(q);
    real s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<real>(upstream[i]) * out[i];
    return s;
  };
  auto check_direction = [&](const char* name, std::vector<double> problem::*field, const std::vector<double>& grad,
                             bool is_cov) {
    std::vector<double> dir((p.*field).size());
    double analytic = 0;
    for (std::size_t i = 0; i < dir.size(); ++i) {
      const bool above = is_cov && p.full && i % p.d > i / p.d;
      // relative directions for the scales (they stay positive), absolute for the means
      dir[i] = above ? 0.0 : gen.normal01() * (is_cov ? std::fabs((p.*field)[i]) + 0.1 : 1.0);
      analytic += grad[i] * dir[i];
    }
    problem plus = p, minus = p;
    for (std::size_t i = 0; i < dir.size(); ++i) {
      (plus.*field)[i] += h * dir[i];
      (minus.*field)[i] -= h * dir[i];
    }
    const double numeric = double((loss(plus) - loss(minus)) / (2 * static_cast<real>(h)));
    INFO(std::string(name), ": analytic ", analytic, " numeric ", numeric);
    CHECK(std::fabs(analytic - numeric) <= rtol * (1.0 + std::fabs(numeric)));
  };
  check_direction("mean", &problem::mean, g.mean, false);
  check_direction("cov", &problem::cov, g.cov, true);
  check_direction("old_mean", &problem::old_mean, g.old_mean, false);
  check_direction("old_cov", &problem::old_cov, g.old_cov, true);
  auto check_bound = [&](const char* name, double problem::*field, double grad) {
    problem plus = p, minus = p;
    const double step = h * p.*field;
    plus.*field += step;
    minus.*field -= step;
    const double numeric = double((loss(plus) - loss(minus)) / (2 * static_cast<real>(step)));
    INFO(std::string(name), ": analytic ", grad, " numeric ", numeric);
    CHECK(std::fabs(grad - numeric) * p.*field <= rtol * (1.0 + std::fabs(numeric) * p.*field));
  };
  check_bound("eps", &problem::eps, g.eps);
  if (p.split) check_bound("eps_cov", &problem::eps_cov, g.eps_mean);
}

problem random_problem(gauss::generator& gen, std::size_t d, bool full, bool split, double eps) {
  problem p;
  p.d = d;
  p.full = full;
  p.split = split;
  p.mean = gen.mean(d, 1.0);
  p.old_mean = gen.mean(d, 1.0);
  p.cov = full ? gen.factor(d, 0.4) : gen.std_dev(d, 0.4);
  p.old_cov = full ? gen.factor(d, 0.4) : gen.std_dev(d, 0.4);
  p.eps = eps;
  p.eps_cov = eps * 0.7;
  return p;
}

}  // namespace

TEST_CASE("VJP against finite differences of the long-double oracle") {
  gauss::generator gen(41);
  for (const bool full : {true, false}) {
    for (const bool split : {false, true}) {
      for (const std::size_t d : {std::size_t(1), std::size_t(3)}) {
        for (const double eps : {1e-3, 0.1, 1e4}) {  // 1e4: inactive
          const problem p = random_problem(gen, d, full, split, eps);
          check_vjp(p, oracle_output, 1e-6, 1e-6, gen, "oracle");
        }
      }
    }
  }
}

TEST_CASE("VJP against finite differences of troll's forward at larger d") {
  gauss::generator gen(43);
  for (const bool full : {true, false}) {
    for (const bool split : {false, true}) {
      for (const std::size_t d : {std::size_t(12), std::size_t(48)}) {
        const problem p = random_problem(gen, d, full, split, 0.2);
        check_vjp(p, troll_output, 1e-6, 1e-5, gen, "troll forward");
      }
    }
  }
}

TEST_CASE("the backward rejects unsolved rows") {
  gauss::generator gen(1);
  const problem p = random_problem(gen, 2, true, false, 0.1);
  forward f = troll_forward(p);
  f.stats.status = troll::row_status::not_converged;
  std::vector<double> up(p.d + p.cov_size(), 1.0), gm(p.d), gc(p.cov_size());
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  const std::vector<double> up_mean(up.begin(), up.begin() + 2), up_cov(up.begin() + 2, up.end());
  troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.data(), 1, 2), troll::make_batch(gc.data(), 1, 4),
                                                {}, {}, nullptr, nullptr};
  CHECK_THROWS_AS(troll::gaussian::project_joint_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean),
                                                          in(p.old_cov), p.eps, in(f.mean), in(f.cov), &f.stats,
                                                          in(up_mean), in(up_cov), grads),
                  troll::domain_error);
}
