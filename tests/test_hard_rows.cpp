// tests/test_hard_rows.cpp — the projection on the inputs that used to go silently wrong
// (issue 10): steep rows where Newton stalled, huge finite "mask" logits (−1e9, −1e200,
// lowest()), tiny ε, bad solver options. Every expectation comes from the long-double oracle of
// support/precise_oracle.hpp (bisection in s = 1 − t, KL as a sum of non-negative terms), never
// from troll's own output.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/precise_oracle.hpp"
#include "troll/projection.hpp"

namespace {

namespace precise = troll_test::precise;
using real = precise::real;

struct projected_row {
  troll::projection_stats stats;
  std::vector<double> log_probs;  // the output, widened
  bool threw = false;
};

template <class T>
projected_row run(const std::vector<T>& zn, const std::vector<T>& zo, double eps,
                  const troll::projection_options& options = {}) {
  projected_row r;
  const std::size_t n = zn.size();
  std::vector<T> out(n, T(7));
  try {
    troll::project(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n),
                   troll::make_batch<const T>(zo.data(), 1, n), eps, troll::make_batch(out.data(), 1, n), &r.stats,
                   options);
  } catch (const troll::infeasible_error&) {
    r.threw = true;
  }
  r.log_probs.assign(out.begin(), out.end());
  return r;
}

/// The relative accuracy troll promises for t and for KL(π*‖q) at the solved t (docs/api.md).
constexpr double solve_rtol = 1e-10;

/// Checks one row against the oracle: status, and for projected rows KL at troll's (t, s) and t
/// itself; the written output against log π at troll's point.
template <class T>
void check_row(const std::vector<T>& zn, const std::vector<T>& zo, double eps, const std::string& what) {
  INFO(what, " eps=", eps);
  const precise::row oracle(zn.data(), zo.data(), zn.size());
  const projected_row r = run(zn, zo, eps);
  const real kl_before = oracle.kl_at(1, 0);
  if (r.threw) {
    // Only when every admissible π is outside the ball: −log q(J) ≥ ε.
    CHECK(oracle.kl(oracle.log_pi(std::ldexp(real(1), -16000), 1)) >= real(eps) * (1 - 1e-12L));
    return;
  }
  std::string values;
  for (std::size_t i = 0; i < zn.size(); ++i) {
    char pair[96];
    std::snprintf(pair, sizeof pair, "(%.17g, %.17g) ", double(zn[i]), double(zo[i]));
    values += pair;
  }
  INFO("rows ", values, " status ", troll::status_name(r.stats.status), " kl_before ", r.stats.kl_before,
       " oracle kl_before ", double(kl_before));
  if (r.stats.status == troll::row_status::not_converged) {
    FAIL_CHECK("not_converged");
    return;
  }
  // kl_before above is KL of p̃ restricted to J; p̃ itself has KL = +inf when it puts mass where
  // q has none (then the answer is that restriction, status restricted, if it is in the ball).
  bool new_only = false;
  for (std::size_t i = 0; i < zn.size(); ++i)
    new_only = new_only || (oracle.zn[i] > -precise::inf() && !(oracle.zo[i] > -precise::inf()));
  if (kl_before <= real(eps) * (1 - 1e-12L)) {
    CHECK(r.stats.status == (new_only ? troll::row_status::restricted : troll::row_status::inactive));
    return;
  }
  if (kl_before < real(eps) * (1 + 1e-12L)) return;  // too close to call either way
  REQUIRE(r.stats.status == troll::row_status::projected);
  const real kl_at_t = oracle.kl_at(r.stats.t, r.stats.t > 0.5 ? r.stats.eta * r.stats.t : 1 - real(r.stats.t));
  INFO("t=", r.stats.t, " eta=", r.stats.eta, " kl_after=", r.stats.kl_after, " oracle kl(t)=", double(kl_at_t));
  CHECK(std::fabs(double(kl_at_t) - eps) <= 2 * solve_rtol * eps);
  // t to the KL tolerance over the condition d ln KL / d ln t (2 where KL ~ t², small where
  // KL(p̃‖q) is barely above ε and t* is near 1), from the oracle's root.
  const precise::root root = precise::solve(oracle, eps);
  const real h = 1e-6L * (root.t <= 0.5L ? root.t : root.s);
  const real slope = root.t * (oracle.kl_at(root.t + h, root.s - h) - oracle.kl_at(root.t - h, root.s + h)) / (2 * h * real(eps));
  INFO("oracle t=", double(root.t), " s=", double(root.s), " d ln KL / d ln t=", double(slope));
  CHECK(std::fabs(double(root.t) - r.stats.t) <= (solve_rtol / std::min(1.0, double(slope))) * double(root.t));
  // The output is log π at troll's point, to the element type's rounding.
  const std::vector<real> expected = oracle.log_pi(r.stats.t, r.stats.t > 0.5 ? r.stats.eta * r.stats.t : 1 - real(r.stats.t));
  const double u = std::numeric_limits<T>::epsilon();
  double scale = 1.0;  // the largest finite logit on the joint support: the output's rounding grows with it
  for (std::size_t i = 0; i < zn.size(); ++i)
    if (std::isfinite(double(expected[i]))) scale = std::max({scale, std::fabs(double(zn[i])), std::fabs(double(zo[i]))});
  for (std::size_t i = 0; i < zn.size(); ++i) {
    const double want = double(expected[i]);
    if (!(want > -std::numeric_limits<double>::infinity())) {
      CHECK(r.log_probs[i] == -std::numeric_limits<double>::infinity());
      continue;
    }
    if (want < std::numeric_limits<T>::lowest()) continue;  // below the type's range: anything that low
    INFO("token ", i, " got ", r.log_probs[i], " want ", want);
    CHECK(std::fabs(r.log_probs[i] - want) <= 64 * u * (scale + std::fabs(want)));
  }
}

}  // namespace

TEST_CASE("a steep row where Newton used to stall is solved to the relative tolerance") {
  const std::vector<double> zn = {8240, -6475, -8110}, zo = {-5217, 8039, 7976};
  const projected_row r = run(zn, zo, 1e-4);
  CHECK(r.stats.status == troll::row_status::projected);
  CHECK(r.stats.t == doctest::Approx(0.47325).epsilon(1e-4));
  CHECK(r.log_probs[0] == doctest::Approx(-18.70).epsilon(1e-3));
  CHECK(r.log_probs[2] == doctest::Approx(-806.95).epsilon(1e-4));
  check_row(zn, zo, 1e-4, "issue example");
  // Its backward is finite and refuses nothing.
  std::vector<double> g = {1.0, -0.5, 0.25}, grad(3), grad_old(3);
  double grad_eps = 0.0;
  std::vector<double> lp = r.log_probs;
  troll::project_backward(troll::cpu, troll::make_batch<const double>(zn.data(), 1, 3),
                          troll::make_batch<const double>(zo.data(), 1, 3), troll::make_batch<const double>(lp.data(), 1, 3),
                          &r.stats, troll::make_batch<const double>(g.data(), 1, 3), troll::make_batch(grad.data(), 1, 3),
                          troll::make_batch(grad_old.data(), 1, 3), &grad_eps);
  for (double v : grad) CHECK(std::isfinite(v));
  CHECK(std::isfinite(grad_eps));
}

TEST_CASE_TEMPLATE("random steep, sharp and masked rows: every feasible row converges to the oracle", T, double, float) {
  std::mt19937_64 rng(20261123);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal;
  const int rows = std::is_same<T, double>::value ? 60000 : 40000;
  // Every finite mask down to lowest() for float; for double down to −1e290 (below that, t* or
  // 1 − t* can fall among the subnormals, where no double holds it to the relative tolerance:
  // the test "double lowest()" below checks that such rows say so).
  const T most_negative = std::is_same<T, float>::value ? std::numeric_limits<T>::lowest() : T(-1e290);
  const T masks[] = {-std::numeric_limits<T>::infinity(), T(-1e9), most_negative};
  int projected = 0;
  for (int k = 0; k < rows; ++k) {
    const std::size_t n = std::size_t(2 + rng() % 14);
    const double scale = std::pow(10.0, -3.0 + 7.0 * unit(rng));  // 1e-3 .. 1e4
    const double eps = std::pow(10.0, -12.0 + 13.0 * unit(rng));  // 1e-12 .. 10
    std::vector<T> zn(n), zo(n);
    for (std::size_t i = 0; i < n; ++i) {
      zn[i] = T(scale * normal(rng));
      zo[i] = T(scale * normal(rng));
    }
    if (k % 4 == 1) {  // a masked token: both sides, the old side only, or the new side only
      const std::size_t i = rng() % n;
      const T mask = masks[rng() % 3];
      const int side = int(rng() % 3);
      if (side != 1) zo[i] = mask;
      if (side != 0) zn[i] = mask;
    }
    if (k % 4 == 2) {  // nearly identical rows: KL tiny against ε or just above it
      for (std::size_t i = 0; i < n; ++i) zn[i] = T(double(zo[i]) + 1e-4 * scale * normal(rng));
    }
    const projected_row r = run(zn, zo, eps);
    projected += r.stats.status == troll::row_status::projected;
    if (k % 50 == 0 || r.stats.status != troll::row_status::inactive)
      check_row(zn, zo, eps, "row " + std::to_string(k) + " V=" + std::to_string(n) + " scale=" + std::to_string(scale));
  }
  MESSAGE(projected << " projected rows of " << rows);
  CHECK(projected > rows / 4);
}

TEST_CASE_TEMPLATE("finite mask idioms give the exact answer in every entry point", T, double, float) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal;
  std::vector<T> masks = {T(-1e9), std::numeric_limits<T>::lowest(), T(-1e30)};
  if (std::is_same<T, double>::value) masks.push_back(T(-1e200));
  for (const T mask : masks) {
    for (int trial = 0; trial < 40; ++trial) {
      const std::size_t n = 16;
      std::vector<T> zn(n), zo(n);
      for (std::size_t i = 0; i < n; ++i) {
        zo[i] = T(normal(rng));
        zn[i] = T(double(zo[i]) + 0.8 * normal(rng));
      }
      // Mask the same tokens in both rows, then one more in the old row only.
      for (std::size_t i = 0; i < 3; ++i) zn[i] = zo[i] = mask;
      if (trial % 2 == 1) zo[3] = mask;
      for (const double eps : {1e-6, 0.05, 0.5}) check_row(zn, zo, eps, "mask " + std::to_string(double(mask)));

      // kl() against the oracle, both directions.
      T kl_pq = 0, kl_qp = 0;
      troll::kl(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n), troll::make_batch<const T>(zo.data(), 1, n), &kl_pq);
      troll::kl(troll::cpu, troll::make_batch<const T>(zo.data(), 1, n), troll::make_batch<const T>(zn.data(), 1, n), &kl_qp);
      const precise::row pq(zn.data(), zo.data(), n), qp(zo.data(), zn.data(), n);
      const double want_pq = double(pq.kl_at(1, 0)), want_qp = double(qp.kl_at(1, 0));
      const double u = std::numeric_limits<T>::epsilon();
      CHECK(std::fabs(double(kl_pq) - want_pq) <= 64 * u * want_pq);
      CHECK(std::fabs(double(kl_qp) - want_qp) <= 64 * u * want_qp);
    }
  }
  // The kl() example: p keeps one token of 16, q is uniform: KL = log 16.
  std::vector<T> p(16, std::numeric_limits<T>::lowest()), q(16, T(0));
  p[5] = T(0);
  T value = 0;
  troll::kl(troll::cpu, troll::make_batch<const T>(p.data(), 1, 16), troll::make_batch<const T>(q.data(), 1, 16), &value);
  CHECK(double(value) == doctest::Approx(std::log(16.0)).epsilon(4 * std::numeric_limits<T>::epsilon()));
}

TEST_CASE("tiny eps: KL(pi*||q) and t to 1e-10 relative down to eps = 1e-12") {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal;
  for (const std::size_t n : {8u, 256u, 4096u}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<double> zn(n), zo(n);
      for (std::size_t i = 0; i < n; ++i) {
        zo[i] = 2.0 * normal(rng);
        zn[i] = zo[i] + normal(rng);
      }
      for (const double eps : {1e-12, 1e-10, 1e-8, 1e-6}) check_row(zn, zo, eps, "V=" + std::to_string(n));
    }
  }
}

TEST_CASE("solver options are validated, and an unfinished solve says so") {
  const std::vector<double> zn = {2.0, -1.0, 0.5, 3.0}, zo = {0.0, 0.3, -0.2, -1.0};
  std::vector<double> out(4);
  troll::projection_stats stats;
  auto call = [&](const troll::projection_options& o) {
    troll::project(troll::cpu, troll::make_batch<const double>(zn.data(), 1, 4),
                   troll::make_batch<const double>(zo.data(), 1, 4), 0.05, troll::make_batch(out.data(), 1, 4), &stats, o);
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(call({inf, 0.0, 50}), troll::domain_error);
  CHECK_THROWS_AS(call({1e-11, inf, 50}), troll::domain_error);
  CHECK_THROWS_AS(call({nan, 0.0, 50}), troll::domain_error);
  CHECK_THROWS_AS(call({1e-11, 0.0, 0}), troll::domain_error);
  CHECK_THROWS_AS(call({0.0, 0.0, 50}), troll::domain_error);

  call({1e-11, 0.0, 1});
  CHECK(stats.status == troll::row_status::not_converged);
  CHECK(stats.kl_after < 0.05);  // the best feasible member: the trust region still holds
  const precise::row oracle(zn.data(), zo.data(), 4);
  std::vector<real> lp(out.begin(), out.end());
  CHECK(double(oracle.kl(lp)) < 0.05 * (1 + 1e-12));
  std::vector<double> g(4, 1.0), grad(4);
  CHECK_THROWS_WITH_AS(troll::project_backward(troll::cpu, troll::make_batch<const double>(zn.data(), 1, 4),
                                               troll::make_batch<const double>(zo.data(), 1, 4),
                                               troll::make_batch<const double>(out.data(), 1, 4), &stats,
                                               troll::make_batch<const double>(g.data(), 1, 4),
                                               troll::make_batch(grad.data(), 1, 4)),
                       doctest::Contains("not_converged"), troll::domain_error);
}

TEST_CASE("double lowest() masks: solved to the tolerance, or reported not_converged and feasible") {
  // With |z̃ − z°| near DBL_MAX, t* or 1 − t* can fall among the subnormals, where no double holds
  // it to 1e-10 relative. Such a row must say so; every other row must be solved.
  std::mt19937_64 rng(99);
  std::normal_distribution<double> normal;
  int solved = 0, unsolved = 0;
  for (int k = 0; k < 3000; ++k) {
    const std::size_t n = std::size_t(2 + rng() % 10);
    const double eps = std::pow(10.0, -12.0 + 13.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    std::vector<double> zn(n), zo(n);
    for (std::size_t i = 0; i < n; ++i) zn[i] = 3 * normal(rng), zo[i] = 3 * normal(rng);
    ((rng() % 2) ? zn : zo)[rng() % n] = std::numeric_limits<double>::lowest();
    const projected_row r = run(zn, zo, eps);
    if (r.threw) continue;
    if (r.stats.status == troll::row_status::not_converged) {
      ++unsolved;
      const precise::row oracle(zn.data(), zo.data(), n);
      std::vector<real> lp(r.log_probs.begin(), r.log_probs.end());
      CHECK(double(oracle.kl(lp)) <= eps * (1 + 1e-9));
      CHECK(r.stats.kl_after < eps);
      for (double v : r.log_probs) CHECK(!std::isnan(v));
    } else {
      ++solved;
      check_row(zn, zo, eps, "lowest row " + std::to_string(k));
    }
  }
  MESSAGE(solved << " solved, " << unsolved << " not_converged");
}

TEST_CASE("logit differences near DBL_MAX: the statistics are right or say they cannot be (never a wrong sign)") {
  // Rows whose differences d = z̃ − z° reach ~1e160 .. DBL_MAX on some tokens: t* ~ 1e-309, η =
  // 1/t − 1 beyond double, σ² = Var_π[d] beyond double. The statistics had reported σ² = 0 (inf −
  // inf, clamped) and, where Σ e^w·x overflowed, μ = −inf for a true μ of +7e307. Now: η is
  // right or +inf where its true value overflows, σ² is right or +inf where it overflows, μ is
  // right or NaN (the reduction could not hold it).
  const double big_values[] = {-std::numeric_limits<double>::max(), -1e308, -1e160,
                               1e160, 1e308, std::numeric_limits<double>::max()};
  int mu_nan = 0, sigma_inf = 0;
  for (double big : big_values) {
    for (int count = 1; count <= 3; ++count) {
      for (double old_last : {0.0, 2.0}) {
        std::vector<double> zn{0.0, 0.5, -0.25, 0.0}, zo{0.0, 0.0, 0.0, old_last};
        for (int i = 0; i < count; ++i) zn[std::size_t(3 - i)] = big;
        INFO("big=", big, " count=", count, " old_last=", old_last);
        const projected_row r = run(zn, zo, 0.05);
        REQUIRE(!r.threw);
        REQUIRE(r.stats.status == troll::row_status::projected);
        const precise::row oracle(zn.data(), zo.data(), zn.size());
        const std::vector<real> lp = oracle.log_pi(r.stats.t, 1 - real(r.stats.t));
        real mu = 0, m2 = 0;
        for (std::size_t i = 0; i < zn.size(); ++i) mu += std::exp(lp[i]) * (oracle.zn[i] - oracle.zo[i]);
        for (std::size_t i = 0; i < zn.size(); ++i) {
          const real c = oracle.zn[i] - oracle.zo[i] - mu;
          m2 += std::exp(lp[i]) * c * c;
        }
        const real eta = 1 / real(r.stats.t) - 1;
        INFO("t=", r.stats.t, " eta=", r.stats.eta, " mu=", r.stats.mu, " sigma2=", r.stats.sigma2,
             " true mu=", double(mu), " true sigma2=", double(m2));
        if (eta > real(std::numeric_limits<double>::max())) {
          CHECK(r.stats.eta == std::numeric_limits<double>::infinity());
        } else {
          CHECK(std::fabs(real(r.stats.eta) - eta) <= 1e-9L * eta);
        }
        if (m2 > real(std::numeric_limits<double>::max())) {
          CHECK(r.stats.sigma2 == std::numeric_limits<double>::infinity());
          ++sigma_inf;
        } else {
          CHECK(std::fabs(real(r.stats.sigma2) - m2) <= 1e-6L * m2);
        }
        if (std::isnan(r.stats.mu)) {
          ++mu_nan;
        } else {
          CHECK(std::fabs(real(r.stats.mu) - mu) <= 1e-6L * std::fabs(mu));
        }
      }
    }
  }
  CHECK(sigma_inf > 0);
  MESSAGE(sigma_inf << " rows with sigma2 = +inf, " << mu_nan << " with mu = NaN");
}

TEST_CASE("TROLL objective: a sampled token masked in the new logits has a zero ratio gradient, never NaN") {
  // π*_a ≡ 0 when z̃_a = −inf: the ratio term is 0 and stays 0 under any finite perturbation, so
  // with α = 0 the whole gradient is 0; with α = 1 it is the regression term's alone, which does
  // not depend on the advantage.
  const std::size_t V = 6;
  std::vector<double> zn = {1.5, -0.5, 2.0, -std::numeric_limits<double>::infinity(), 0.3, -1.0};
  std::vector<double> zo = {0.0, 0.4, -0.8, -6.0, 1.1, -0.2};  // q_3 small: feasible
  const std::vector<std::int64_t> tokens = {3};
  for (const double alpha : {0.0, 1.0}) {
    std::vector<double> grads[2];
    for (int k = 0; k < 2; ++k) {
      const std::vector<double> advantages = {k == 0 ? 1.0 : -3.0};
      troll::token_batch<double> in;
      in.tokens = tokens.data();
      in.advantages = advantages.data();
      troll::trust_region_objective o;
      o.eps = 0.05;
      o.alpha = alpha;
      std::vector<double> log_probs(V), grad(V);
      troll::projection_stats stats;
      const troll::objective_metrics m =
          troll::objective_forward(troll::cpu, o, troll::make_batch<const double>(zn.data(), 1, V),
                                   troll::make_batch<const double>(zo.data(), 1, V), in,
                                   troll::make_batch(log_probs.data(), 1, V), &stats);
      CHECK(std::isfinite(m.loss));
      troll::objective_backward(troll::cpu, o, troll::make_batch<const double>(zn.data(), 1, V),
                                troll::make_batch<const double>(zo.data(), 1, V), in,
                                troll::make_batch<const double>(log_probs.data(), 1, V), &stats,
                                troll::make_batch(grad.data(), 1, V));
      for (double g : grad) CHECK(!std::isnan(g));
      if (alpha == 0.0)
        for (double g : grad) CHECK(g == 0.0);
      grads[k] = grad;
    }
    for (std::size_t j = 0; j < V; ++j) CHECK(grads[0][j] == doctest::Approx(grads[1][j]).epsilon(1e-14));
  }
}

TEST_CASE_TEMPLATE("finite mask idioms: the backward of every solved row is finite", T, double, float) {
  // The VJP with respect to both logits and ε, on rows masked with huge finite values: the
  // masked tokens' d − μ is astronomic, but every gradient entry is a finite number. (Eigen's
  // vectorised exp never underflows to 0, so a 5.6e-309 weight times d ~ 1e290 used to give
  // σ² ~ 1e271 and gradients ~ 1e13 here.)
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  const T huge = std::is_same<T, float>::value ? std::numeric_limits<T>::lowest() : T(-1e290);
  int checked = 0;
  for (int k = 0; k < 4000; ++k) {
    const std::size_t n = std::size_t(2 + rng() % 12);
    const double eps = std::pow(10.0, -8.0 + 8.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    std::vector<T> zn(n), zo(n);
    for (std::size_t i = 0; i < n; ++i) zn[i] = T(2 * normal(rng)), zo[i] = T(2 * normal(rng));
    const int side = int(rng() % 3);
    const std::size_t at = rng() % n;
    if (side != 1) zo[at] = T(huge);
    if (side != 0) zn[at] = T(huge);
    std::vector<T> out(n), g(n), grad(n), grad_old(n);
    troll::projection_stats stats;
    try {
      troll::project(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n), troll::make_batch<const T>(zo.data(), 1, n),
                     eps, troll::make_batch(out.data(), 1, n), &stats);
    } catch (const troll::infeasible_error&) {
      continue;
    }
    if (!stats.solved()) continue;
    // No upstream gradient on the masked token itself: its log-probability has an astronomic
    // (exact) sensitivity, ~|z°| per unit of t, that may overflow the type. Every other token's
    // gradient is an ordinary number.
    for (std::size_t i = 0; i < n; ++i) g[i] = i == at ? T(0) : T(normal(rng));
    T grad_eps = 0;
    try {
      troll::project_backward(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n),
                              troll::make_batch<const T>(zo.data(), 1, n), troll::make_batch<const T>(out.data(), 1, n),
                              &stats, troll::make_batch<const T>(g.data(), 1, n), troll::make_batch(grad.data(), 1, n),
                              troll::make_batch(grad_old.data(), 1, n), &grad_eps);
    } catch (const troll::domain_error& e) {
      // Only a variance beyond the type's range (the masked token partly switched on) may refuse.
      CHECK(std::string(e.what()).find("sigma2") != std::string::npos);
      continue;
    }
    ++checked;
    INFO("row ", k, " side ", side, " status ", troll::status_name(stats.status), " t ", stats.t, " sigma2 ", stats.sigma2);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(std::isfinite(double(grad[i])));
      CHECK(std::isfinite(double(grad_old[i])));
    }
    CHECK(std::isfinite(double(grad_eps)));
  }
  MESSAGE(checked << " rows checked");
}

TEST_CASE_TEMPLATE("finite mask idioms with upstream gradient on the masked token: finite or a typed error", T,
                   double, float) {
  // As above, but with an upstream gradient on the (all but) masked token as well: its
  // log-probability's sensitivity is ~|z°| per unit of t, so the true derivative may overflow the
  // type. Every output is then a finite number or the row is refused with domain_error — never
  // ±inf or NaN. The JVP likewise.
  std::mt19937_64 rng(9);
  std::normal_distribution<double> normal;
  const T huge = std::is_same<T, float>::value ? std::numeric_limits<T>::lowest() : T(-1e300);
  int finite = 0, refused = 0;
  for (int k = 0; k < 3000; ++k) {
    const std::size_t n = std::size_t(2 + rng() % 12);
    const double eps = std::pow(10.0, -8.0 + 8.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    std::vector<T> zn(n), zo(n);
    for (std::size_t i = 0; i < n; ++i) zn[i] = T(2 * normal(rng)), zo[i] = T(2 * normal(rng));
    const int side = int(rng() % 3);
    const std::size_t at = rng() % n;
    if (side != 1) zo[at] = T(huge);
    if (side != 0) zn[at] = T(huge);
    std::vector<T> out(n), g(n), grad(n), grad_old(n), tangent(n);
    troll::projection_stats stats;
    const auto zn_view = troll::make_batch<const T>(zn.data(), 1, n);
    const auto zo_view = troll::make_batch<const T>(zo.data(), 1, n);
    try {
      troll::project(troll::cpu, zn_view, zo_view, eps, troll::make_batch(out.data(), 1, n), &stats);
    } catch (const troll::infeasible_error&) {
      continue;
    }
    if (!stats.solved()) continue;
    for (std::size_t i = 0; i < n; ++i) g[i] = T(normal(rng));
    T grad_eps = 0;
    const auto out_view = troll::make_batch<const T>(out.data(), 1, n);
    try {
      troll::project_backward(troll::cpu, zn_view, zo_view, out_view, &stats,
                              troll::make_batch<const T>(g.data(), 1, n), troll::make_batch(grad.data(), 1, n),
                              troll::make_batch(grad_old.data(), 1, n), &grad_eps);
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(std::isfinite(double(grad[i])));
        CHECK(std::isfinite(double(grad_old[i])));
      }
      CHECK(std::isfinite(double(grad_eps)));
      ++finite;
    } catch (const troll::domain_error& e) {
      CHECK(e.row() == 0);
      ++refused;
    }
    try {
      troll::project_jvp(troll::cpu, zn_view, zo_view, out_view, &stats, troll::make_batch<const T>(g.data(), 1, n),
                         troll::make_batch<const T>(g.data(), 1, n), 0.5, troll::make_batch(tangent.data(), 1, n));
      for (std::size_t i = 0; i < n; ++i) CHECK(std::isfinite(double(tangent[i])));
    } catch (const troll::domain_error& e) {
      CHECK(e.row() == 0);
    }
  }
  MESSAGE(finite << " rows finite, " << refused << " refused");
  CHECK(finite > 0);
}
