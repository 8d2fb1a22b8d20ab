// tests/test_gaussian_backward.cpp — the VJP of the Gaussian projections (joint and split, full
// and diagonal) against central finite differences of the independent long-double oracle
// (support/gaussian_oracle.hpp: bisection for t*, explicit inverses), in random directions of
// every input and of the bounds; at larger d against differences of troll's own forward.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Cholesky>
#include <algorithm>
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

// ---- JVP (forward mode) ----

namespace {

/// A direction in the space of every input: one entry per input value, and the bounds'.
struct direction {
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0, eps_cov = 0;
};

direction random_direction(const problem& p, gauss::generator& gen) {
  direction v;
  auto fill = [&](const std::vector<double>& like, bool is_cov) {
    std::vector<double> out(like.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const bool above = is_cov && p.full && i % p.d > i / p.d;
      out[i] = above ? 0.0 : gen.normal01() * (is_cov ? std::fabs(like[i]) + 0.1 : 1.0);
    }
    return out;
  };
  v.mean = fill(p.mean, false);
  v.cov = fill(p.cov, true);
  v.old_mean = fill(p.old_mean, false);
  v.old_cov = fill(p.old_cov, true);
  v.eps = gen.normal01() * p.eps;
  v.eps_cov = gen.normal01() * p.eps_cov;
  return v;
}

problem moved(const problem& p, const direction& v, double h) {
  problem q = p;
  for (std::size_t i = 0; i < p.d; ++i) {
    q.mean[i] += h * v.mean[i];
    q.old_mean[i] += h * v.old_mean[i];
  }
  for (std::size_t i = 0; i < p.cov_size(); ++i) {
    q.cov[i] += h * v.cov[i];
    q.old_cov[i] += h * v.old_cov[i];
  }
  q.eps += h * v.eps;
  q.eps_cov += h * v.eps_cov;
  return q;
}

/// troll's JVP along v, flattened like the output (mean then factor / std devs).
std::vector<double> troll_jvp(const problem& p, const direction& v) {
  const forward f = troll_forward(p);
  std::vector<double> tm(p.d), tc(p.cov_size());
  auto in = [](const std::vector<double>& x) { return troll::make_batch(x.data(), 1, x.size()); };
  auto out = [](std::vector<double>& x) { return troll::make_batch(x.data(), 1, x.size()); };
  troll::gaussian::gaussian_tangents<double> tan{in(v.mean), in(v.cov), in(v.old_mean), in(v.old_cov), 0.0, 0.0};
  // The problem's eps is the joint bound or ε_μ (split); eps_cov is ε_Σ.
  tan.eps = p.split ? v.eps_cov : v.eps;
  tan.eps_mean = p.split ? v.eps : 0.0;
  namespace g = troll::gaussian;
  if (p.full && !p.split)
    g::project_joint_jvp(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps, in(f.mean),
                         in(f.cov), &f.stats, tan, out(tm), out(tc));
  if (p.full && p.split)
    g::project_split_jvp(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps, p.eps_cov,
                         in(f.mean), in(f.cov), &f.stats, tan, out(tm), out(tc));
  if (!p.full && !p.split)
    g::project_joint_diag_jvp(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps, in(f.mean),
                              in(f.cov), &f.stats, tan, out(tm), out(tc));
  if (!p.full && p.split)
    g::project_split_diag_jvp(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean), in(p.old_cov), p.eps, p.eps_cov,
                              in(f.mean), in(f.cov), &f.stats, tan, out(tm), out(tc));
  tm.insert(tm.end(), tc.begin(), tc.end());
  return tm;
}

/// J v against the central difference of the output along v, entry by entry (atol + rtol·scale,
/// scale the largest entry of the difference).
void check_jvp_fd(const problem& p, const std::function<std::vector<real>(const problem&)>& output, double h,
                  double rtol, gauss::generator& gen, const std::string& what) {
  INFO(what, " d=", p.d, " full=", p.full, " split=", p.split, " eps=", p.eps);
  const direction v = random_direction(p, gen);
  const std::vector<double> jv = troll_jvp(p, v);
  const std::vector<real> plus = output(moved(p, v, h)), minus = output(moved(p, v, -h));
  double scale = 0;
  std::vector<double> numeric(jv.size());
  for (std::size_t i = 0; i < jv.size(); ++i) {
    numeric[i] = double((plus[i] - minus[i]) / (2 * static_cast<real>(h)));
    scale = std::max(scale, std::fabs(numeric[i]));
  }
  for (std::size_t i = 0; i < jv.size(); ++i) {
    INFO("entry ", i, ": jvp ", jv[i], " numeric ", numeric[i]);
    CHECK(std::fabs(jv[i] - numeric[i]) <= rtol * (1.0 + scale));
  }
}

}  // namespace

TEST_CASE("JVP against finite differences of the long-double oracle") {
  gauss::generator gen(47);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(1), std::size_t(3)})
        for (const double eps : {1e-3, 0.1, 1e4}) check_jvp_fd(random_problem(gen, d, full, split, eps), oracle_output,
                                                              1e-6, 1e-6, gen, "oracle");
}

TEST_CASE("JVP against finite differences of troll's forward at larger d") {
  gauss::generator gen(53);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(12), std::size_t(48)})
        check_jvp_fd(random_problem(gen, d, full, split, 0.2), troll_output, 1e-6, 1e-5, gen, "troll forward");
}

TEST_CASE("JVP and VJP are adjoint: <u, J v> = <J^T u, v>") {
  gauss::generator gen(59);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(1), std::size_t(5), std::size_t(32)})
        for (const double eps : {1e-3, 0.3, 1e4}) {
          const problem p = random_problem(gen, d, full, split, eps);
          INFO("d=", d, " full=", full, " split=", split, " eps=", eps);
          const direction v = random_direction(p, gen);
          std::vector<double> u(p.d + p.cov_size());
          for (std::size_t i = 0; i < u.size(); ++i) {
            const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
            u[i] = above ? 0.0 : gen.normal01();
          }
          const std::vector<double> jv = troll_jvp(p, v);
          const gradients g = troll_backward(p, u);
          double left = 0, right = 0, magnitude = 0;
          for (std::size_t i = 0; i < u.size(); ++i) {
            left += u[i] * jv[i];
            magnitude += std::fabs(u[i] * jv[i]);
          }
          auto dot = [&](const std::vector<double>& a, const std::vector<double>& b) {
            for (std::size_t i = 0; i < a.size(); ++i) {
              right += a[i] * b[i];
              magnitude += std::fabs(a[i] * b[i]);
            }
          };
          dot(g.mean, v.mean);
          dot(g.cov, v.cov);
          dot(g.old_mean, v.old_mean);
          dot(g.old_cov, v.old_cov);
          right += g.eps * v.eps + (p.split ? g.eps_mean * v.eps_cov : 0.0);
          INFO("<u, Jv> = ", left, ", <J^T u, v> = ", right);
          CHECK(std::fabs(left - right) <= 1e-10 * (1.0 + magnitude));
        }
}

// ---- larger d, float, and the singular-covariance clamp ----

TEST_CASE("VJP and JVP at d = 256") {
  gauss::generator gen(61);
  for (const bool full : {true, false})
    for (const bool split : {false, true}) {
      const problem p = random_problem(gen, 256, full, split, 0.5);
      check_vjp(p, troll_output, 1e-6, 1e-5, gen, "troll forward, d = 256");
      check_jvp_fd(p, troll_output, 1e-6, 1e-5, gen, "troll forward, d = 256");
    }
}

namespace {

/// The forward and backward of project_joint / project_joint_diag in T for one problem, the
/// gradients returned in double (mean, cov, old_mean, old_cov, eps).
template <class T>
std::vector<double> joint_gradients(const problem& p, const std::vector<double>& upstream) {
  auto cast = [](const std::vector<double>& v) { return std::vector<T>(v.begin(), v.end()); };
  const std::vector<T> mean = cast(p.mean), cov = cast(p.cov), old_mean = cast(p.old_mean), old_cov = cast(p.old_cov);
  const std::vector<T> up_mean(upstream.begin(), upstream.begin() + long(p.d));
  const std::vector<T> up_cov(upstream.begin() + long(p.d), upstream.end());
  std::vector<T> om(p.d), oc(p.cov_size()), gm(p.d), gc(p.cov_size()), gom(p.d), goc(p.cov_size());
  troll::gaussian::gaussian_stats stats;
  double ge = 0;
  auto in = [](const std::vector<T>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<T>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  const troll::gaussian::gaussian_grads<T> grads{out(gm), out(gc), out(gom), out(goc), &ge, nullptr};
  if (p.full) {
    troll::gaussian::project_joint(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, out(om), out(oc),
                                   &stats);
    troll::gaussian::project_joint_backward(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, in(om),
                                            in(oc), &stats, in(up_mean), in(up_cov), grads);
  } else {
    troll::gaussian::project_joint_diag(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, out(om),
                                        out(oc), &stats);
    troll::gaussian::project_joint_diag_backward(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps,
                                                 in(om), in(oc), &stats, in(up_mean), in(up_cov), grads);
  }
  std::vector<double> all;
  for (const std::vector<T>* v : {&gm, &gc, &gom, &goc}) all.insert(all.end(), v->begin(), v->end());
  all.push_back(ge);
  return all;
}

}  // namespace

TEST_CASE("the backward in float agrees with double") {
  gauss::generator gen(67);
  for (const bool full : {true, false})
    for (const std::size_t d : {std::size_t(2), std::size_t(8), std::size_t(32)}) {
      problem p = random_problem(gen, d, full, false, 0.2);
      // Inputs representable in float, so both types see the same problem.
      for (std::vector<double>* v : {&p.mean, &p.cov, &p.old_mean, &p.old_cov})
        for (double& x : *v) x = double(float(x));
      std::vector<double> upstream(p.d + p.cov_size());
      for (std::size_t i = 0; i < upstream.size(); ++i) {
        const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
        upstream[i] = above ? 0.0 : double(float(gen.normal01()));
      }
      const std::vector<double> g32 = joint_gradients<float>(p, upstream), g64 = joint_gradients<double>(p, upstream);
      double scale = 0;
      for (const double x : g64) scale = std::max(scale, std::fabs(x));
      INFO("d=", d, " full=", full, " scale=", scale);
      for (std::size_t i = 0; i < g64.size(); ++i) {
        INFO("entry ", i, ": float ", g32[i], " double ", g64[i]);
        CHECK(std::isfinite(g32[i]));
        CHECK(std::fabs(g32[i] - g64[i]) <= 1e-5 + 2e-3 * scale);
      }
    }
}

TEST_CASE("a new covariance singular to working precision against the old one (the clamped gain)") {
  // σ̃/σ° = 1e-12 along one axis: λ − 1 = r² − 1 rounds to −1, the gain is clamped to
  // 1/DBL_MIN instead of 1e24. The answer does not depend on the gain: with equal means the
  // projection moves only along that axis, to a* > 1 with ψ(log a*) = 1/a* − 1 + log a* = 2ε,
  // σ* = σ°/sqrt(a*), and (t* ~ 1e-307 instead of ~1e-24) leaves the other axis at σ°.
  const double eps = 0.05;
  long double lo = 1, hi = 1e6;
  for (int i = 0; i < 200; ++i) {
    const long double mid = (lo + hi) / 2;
    (1 / mid - 1 + std::log(mid) < 2 * eps ? lo : hi) = mid;
  }
  const double a_star = double((lo + hi) / 2);
  const std::vector<double> mean = {0.3, -0.2}, old_std = {1.5, 0.7}, std_dev = {1.5e-12, 0.9};
  std::vector<double> om(2), os(2);
  troll::gaussian::gaussian_stats stats;
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  troll::gaussian::project_joint_diag(troll::cpu, in(mean), in(std_dev), in(mean), in(old_std), eps, out(om), out(os),
                                      &stats);
  CHECK(stats.status == troll::row_status::projected);
  CHECK(stats.t > 0.0);
  CHECK(stats.t < 1e-300);
  CHECK(os[0] == doctest::Approx(old_std[0] / std::sqrt(a_star)).epsilon(1e-10));
  CHECK(os[1] == doctest::Approx(old_std[1]).epsilon(1e-12));
  CHECK(om[0] == doctest::Approx(mean[0]).epsilon(1e-15));
  CHECK(om[1] == doctest::Approx(mean[1]).epsilon(1e-15));
  // The same with full factors (old factor the identity scaled; new factor diagonal).
  const std::vector<double> l_new = {1.5e-12, 0.0, 0.0, 0.9}, l_old = {1.5, 0.0, 0.0, 0.7};
  std::vector<double> ol(4);
  troll::gaussian::project_joint(troll::cpu, in(mean), in(l_new), in(mean), in(l_old), eps, out(om), out(ol), &stats);
  CHECK(stats.status == troll::row_status::projected);
  CHECK(ol[0] == doctest::Approx(old_std[0] / std::sqrt(a_star)).epsilon(1e-10));
  CHECK(ol[3] == doctest::Approx(old_std[1]).epsilon(1e-12));
  CHECK(ol[2] == doctest::Approx(0.0));
}

TEST_CASE("a saved factorisation gives the backward and the JVP bit for bit the same results") {
  namespace g = troll::gaussian;
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(6), std::size_t(40)}) {
      CAPTURE(split);
      CAPTURE(d);
      const std::size_t n = 5, dd = d * d;
      gauss::generator gen(static_cast<unsigned>(31 * d + split));
      std::vector<double> m, l, om, ol;
      for (std::size_t r = 0; r < n; ++r) {
        const double scale = r == 3 ? 1e-4 : 1.0;  // row 3 inactive
        const std::vector<double> a = gen.mean(d, 1.0), b = gen.mean(d, 1.0), c = gen.factor(d, 0.3),
                                  e = gen.factor(d, 0.3);
        for (std::size_t i = 0; i < d; ++i) om.push_back(b[i]), m.push_back(b[i] + scale * (a[i] - b[i]));
        for (std::size_t i = 0; i < dd; ++i) ol.push_back(e[i]), l.push_back(e[i] + scale * (c[i] - e[i]));
      }
      auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
      std::vector<double> ym(n * d), yl(n * dd), ym2(n * d), yl2(n * dd);
      std::vector<double> saved(n * g::saved_factorisation<double>::saved_doubles(d), -7.0);
      const g::saved_factorisation<double> save{saved.data(), n, d};
      std::vector<g::gaussian_stats> st(n), st2(n);
      const double eps = 0.05, eps_cov = 0.03;
      if (split) {
        g::project_split(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov,
                         troll::make_batch(ym.data(), n, d), troll::make_batch(yl.data(), n, dd), st.data(), {}, save);
        g::project_split(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov,
                         troll::make_batch(ym2.data(), n, d), troll::make_batch(yl2.data(), n, dd), st2.data());
      } else {
        g::project_joint(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                         troll::make_batch(ym.data(), n, d), troll::make_batch(yl.data(), n, dd), st.data(), {}, save);
        g::project_joint(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                         troll::make_batch(ym2.data(), n, d), troll::make_batch(yl2.data(), n, dd), st2.data());
      }
      CHECK(ym == ym2);  // saving changes nothing in the forward
      CHECK(yl == yl2);
      CHECK(std::none_of(saved.begin(), saved.end(), [](double x) { return x == -7.0; }));
      // VJP with and without the saved factorisation.
      std::vector<double> up_m(n * d), up_l(n * dd);
      for (double& x : up_m) x = gen.normal01();
      for (double& x : up_l) x = gen.normal01();
      struct grads_out {
        std::vector<double> m, l, om, ol, e, em;
      };
      auto vjp = [&](bool use_saved) {
        grads_out o{std::vector<double>(n * d), std::vector<double>(n * dd), std::vector<double>(n * d),
                    std::vector<double>(n * dd), std::vector<double>(n), std::vector<double>(n)};
        const g::gaussian_grads<double> gr{troll::make_batch(o.m.data(), n, d), troll::make_batch(o.l.data(), n, dd),
                                           troll::make_batch(o.om.data(), n, d),
                                           troll::make_batch(o.ol.data(), n, dd), o.e.data(),
                                           split ? o.em.data() : nullptr};
        const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
        if (split) {
          g::project_split_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov, in(ym, d),
                                    in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr, s);
        } else {
          g::project_joint_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, in(ym, d),
                                    in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr, s);
        }
        return o;
      };
      const grads_out a = vjp(true), b = vjp(false);
      CHECK(a.m == b.m);
      CHECK(a.l == b.l);
      CHECK(a.om == b.om);
      CHECK(a.ol == b.ol);
      CHECK(a.e == b.e);
      CHECK(a.em == b.em);
      // JVP with and without.
      auto jvp = [&](bool use_saved) {
        std::vector<double> tm(n * d), tl(n * dd);
        const g::gaussian_tangents<double> tan{in(up_m, d), in(up_l, dd), in(up_m, d), {}, 0.01, 0.02};
        const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
        if (split) {
          g::project_split_jvp(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov, in(ym, d),
                               in(yl, dd), st.data(), tan, troll::make_batch(tm.data(), n, d),
                               troll::make_batch(tl.data(), n, dd), s);
        } else {
          g::project_joint_jvp(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, in(ym, d), in(yl, dd),
                               st.data(), tan, troll::make_batch(tm.data(), n, d), troll::make_batch(tl.data(), n, dd),
                               s);
        }
        tm.insert(tm.end(), tl.begin(), tl.end());
        return tm;
      };
      CHECK(jvp(true) == jvp(false));
      // A saved factorisation of another shape: shape_error before anything is written.
      const g::saved_factorisation<const double> wrong{saved.data(), n - 1, d};
      std::vector<double> gm(n * d, 3.0);
      const g::gaussian_grads<double> gr{troll::make_batch(gm.data(), n, d), {}, {}, {}, nullptr, nullptr};
      CHECK_THROWS_AS(g::project_joint_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                                                in(ym, d), in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr,
                                                wrong),
                      troll::shape_error);
      CHECK(std::all_of(gm.begin(), gm.end(), [](double x) { return x == 3.0; }));
    }
  }
}
