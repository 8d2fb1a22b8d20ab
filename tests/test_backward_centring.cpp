// test_backward_centring.cpp — the derivatives of troll::project on rows whose π* is nearly
// one-hot on large logits (|d| ~ 1e4, minor masses ~1e-13): the dominant token's d − μ is then
// ~π_minor·Δd, far below the rounding of μ (held in absolute units in projection_stats), and the
// VJP / JVP / Jacobian multiply it by Σ g (d − μ)/σ², which is large. Before the backward
// re-centred d − μ (detail/cpu/backward_kernels.hpp, "Centring") the double VJP of the first row
// here was off by 1.6e-3 relative. Reference: math.md §3 in long double at the forward's t, with
// d − μ formed as Σ_i π_i (d_j − d_i) (no absolute mean).
#include <doctest/doctest.h>

#include <troll/objectives.hpp>
#include <troll/projection.hpp>
#include <troll/detail/cpu/backward_kernels.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace {

struct reference {
  std::vector<long double> pi, centred;
  long double sigma2 = 0;
};

// π_t = softmax(z° + t d) and the centred d, in long double.
template <class T>
reference at_t(const std::vector<T>& zn, const std::vector<T>& zo, double t) {
  const std::size_t n = zn.size();
  reference r;
  std::vector<long double> u(n), d(n);
  long double top = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    d[i] = static_cast<long double>(zn[i]) - static_cast<long double>(zo[i]);
    u[i] = static_cast<long double>(zo[i]) + static_cast<long double>(t) * d[i];
    top = std::max(top, u[i]);
  }
  long double sum = 0;
  r.pi.resize(n);
  for (std::size_t i = 0; i < n; ++i) sum += (r.pi[i] = std::exp(u[i] - top));
  for (auto& p : r.pi) p /= sum;
  r.centred.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    long double c = 0;
    for (std::size_t i = 0; i < n; ++i) c += r.pi[i] * (d[j] - d[i]);
    r.centred[j] = c;
  }
  for (std::size_t i = 0; i < n; ++i) r.sigma2 += r.pi[i] * r.centred[i] * r.centred[i];
  return r;
}

template <class T>
void check_row(std::vector<T> zn, std::vector<T> zo, double eps, double tolerance) {
  const std::size_t n = zn.size();
  std::vector<T> log_probs(n), g(n), grad_new(n), grad_new_general(n), grad_old(n), jvp(n), jac(n * n);
  for (std::size_t i = 0; i < n; ++i) g[i] = T(std::cos(0.7 * double(i)) + 0.25);
  troll::projection_stats stats;
  auto nv = troll::make_batch(static_cast<const T*>(zn.data()), 1, n);
  auto ov = troll::make_batch(static_cast<const T*>(zo.data()), 1, n);
  troll::project(troll::cpu, nv, ov, eps, troll::make_batch(log_probs.data(), 1, n), &stats);
  REQUIRE(stats.status == troll::row_status::projected);
  const reference r = at_t(zn, zo, stats.t);
  const long double t = stats.t;

  // VJP w.r.t. z̃: t [g_j − π_j Σg − π_j c_j Σ g c / σ²]
  long double sg = 0, sgc = 0;
  for (std::size_t i = 0; i < n; ++i) sg += g[i], sgc += g[i] * r.centred[i];
  std::vector<long double> want(n);
  long double scale = 0;
  for (std::size_t j = 0; j < n; ++j) {
    want[j] = t * (g[j] - r.pi[j] * sg - r.pi[j] * r.centred[j] * sgc / r.sigma2);
    scale = std::max(scale, std::fabs(want[j]));
  }
  auto lp = troll::make_batch(static_cast<const T*>(log_probs.data()), 1, n);
  auto gv = troll::make_batch(static_cast<const T*>(g.data()), 1, n);
  troll::project_backward(troll::cpu, nv, ov, lp, &stats, gv, troll::make_batch(grad_new.data(), 1, n));
  troll::project_backward(troll::cpu, nv, ov, lp, &stats, gv, troll::make_batch(grad_new_general.data(), 1, n),
                          troll::make_batch(grad_old.data(), 1, n));
  for (std::size_t j = 0; j < n; ++j) {
    CAPTURE(j);
    CHECK(std::fabs(double(grad_new[j] - T(want[j]))) <= tolerance * double(scale));
    CHECK(std::fabs(double(grad_new_general[j] - T(want[j]))) <= tolerance * double(scale));
  }

  // JVP along u = g (z̃ only): t (u_i − Σ π u − c_i Σ π c u / σ²); and the Jacobian's rows.
  long double spu = 0, spcu = 0;
  for (std::size_t j = 0; j < n; ++j) spu += r.pi[j] * g[j], spcu += r.pi[j] * r.centred[j] * g[j];
  troll::project_jvp(troll::cpu, nv, ov, lp, &stats, gv, troll::input_view<T>{}, 0.0,
                     troll::make_batch(jvp.data(), 1, n));
  if (n <= 64) troll::project_jacobian(troll::cpu, nv, ov, lp, &stats, jac.data());
  for (std::size_t i = 0; i < n; ++i) {
    const long double want_jvp = t * (g[i] - spu - r.centred[i] * spcu / r.sigma2);
    CAPTURE(i);
    CHECK(std::fabs(double(jvp[i] - T(want_jvp))) <= tolerance * (std::fabs(double(want_jvp)) + 1.0));
    if (n > 64) continue;
    long double jv = 0;
    for (std::size_t j = 0; j < n; ++j) jv += static_cast<long double>(jac[i * n + j]) * g[j];
    CHECK(std::fabs(double(jv - want_jvp)) <= tolerance * (std::fabs(double(want_jvp)) + 1.0));
  }
}

}  // namespace

TEST_CASE("derivatives of near-one-hot rows with large logits: d − mu is re-centred") {
  // double: the short VJP path (V = 3), the general one (grad_old), the JVP and the Jacobian
  check_row<double>({1e4, -1e4, 0.0}, {-1e4, 1e4, 5.0}, 1e-9, 1e-10);
  check_row<double>({12000.0, -17000.0, 25.0}, {-17000.0, 12000.0, 0.0}, 1e-9, 1e-10);
  check_row<double>({3e4, 0.0, 1.0}, {0.0, 2e4, 1.0}, 1e-6, 1e-10);
  check_row<float>({1e4f, -1e4f, 0.0f}, {-1e4f, 1e4f, 5.0f}, 1e-9, 1e-5);
  // a long row (the packet VJP path): the same three tokens among 997 far-below ones
  std::vector<double> zn(1000, -3e4), zo(1000, -3e4);
  zn[0] = 1e4, zn[500] = -1e4, zn[999] = 0.0;
  zo[0] = -1e4, zo[500] = 1e4, zo[999] = 5.0;
  check_row<double>(zn, zo, 1e-9, 1e-10);
  std::vector<float> fn(zn.begin(), zn.end()), fo(zo.begin(), zo.end());
  check_row<float>(fn, fo, 1e-9, 1e-5);
}

TEST_CASE("TROLL objective backward on a near-one-hot row with large logits: d - mu is re-centred") {
  // α = 0, one row, token_mean: ℓ = −ρ A, ∂ℓ/∂z̃_j = −A ρ t (δ_aj − π_j − c_a c_j π_j / σ²), with
  // the sampled token a the dominant one (its c_a = d_a − μ is the small, hard one).
  for (int long_row = 0; long_row < 2; ++long_row) {
    std::vector<double> zn{1e4, -1e4, 0.0}, zo{-1e4, 1e4, 5.0};
    if (long_row) {
      zn.assign(700, -3e4), zo.assign(700, -3e4);
      zn[0] = 1e4, zn[1] = -1e4, zn[2] = 0.0, zo[0] = -1e4, zo[1] = 1e4, zo[2] = 5.0;
    }
    const std::size_t n = zn.size();
    const troll::token_id token = 1;
    const double advantage = 0.75;
    troll::token_batch<double> batch;
    batch.tokens = &token;
    batch.advantages = &advantage;
    troll::trust_region_objective objective;
    objective.eps = 1e-9;
    objective.alpha = 0.0;
    std::vector<double> log_probs(n), grad(n);
    troll::projection_stats stats;
    double loss = 0;
    troll::objective_metrics metrics;
    auto nv = troll::make_batch(static_cast<const double*>(zn.data()), 1, n);
    auto ov = troll::make_batch(static_cast<const double*>(zo.data()), 1, n);
    troll::objective_forward(troll::cpu, objective, nv, ov, batch, troll::make_batch(log_probs.data(), 1, n),
                             &stats, &loss, &metrics);
    REQUIRE(stats.status == troll::row_status::projected);
    troll::objective_backward(troll::cpu, objective, nv, ov, batch,
                              troll::make_batch(static_cast<const double*>(log_probs.data()), 1, n), &stats,
                              troll::make_batch(grad.data(), 1, n));
    const reference r = at_t(zn, zo, stats.t);
    long double old_top = -INFINITY, old_sum = 0;
    for (double z : zo) old_top = std::max(old_top, static_cast<long double>(z));
    for (double z : zo) old_sum += std::exp(static_cast<long double>(z) - old_top);
    const long double log_q_a = zo[token] - old_top - std::log(old_sum);
    const long double rho = std::exp(std::log(r.pi[token]) - log_q_a);
    for (std::size_t j = 0; j < n; ++j) {
      // per entry: the three terms cancel at the dominant token, so each entry is held to 1e-10 of
      // its own terms' size (the minor tokens' third term is where a lost c_a shows)
      const long double delta = j == std::size_t(token) ? 1 : 0;
      const long double third = r.centred[token] * r.centred[j] * r.pi[j] / r.sigma2;
      const long double factor = -advantage * rho * stats.t;
      const long double want = factor * (delta - r.pi[j] - third);
      const long double size = std::fabs(factor) * (delta + r.pi[j] + std::fabs(third));
      CAPTURE(long_row);
      CAPTURE(j);
      CHECK(std::fabs(double(grad[j] - want)) <= 1e-10 * double(size) + 1e-300);
    }
  }
}

TEST_CASE("float VJP: the centring sums are skipped only where they could not be applied") {
  // centring_negligible lets the float VJP's first pass skip the exponential of the centring sums
  // on projected rows. Over ordinary, offset, nearly one-hot and two-mode float rows, and rows
  // whose d carries a large constant (μ ~ 1e4 … 6e4), all with every log π* in [−700, 0] (the
  // packet path): wherever it says "negligible", the sums formed anyway must give no correction
  // (|m| within the noise estimate, so step() = 0); and the family must hold rows of both kinds,
  // the nearly one-hot ones with a correction that is applied (the guard matters).
  namespace cpu = troll::detail::cpu;
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int negligible = 0, needed = 0, applied = 0, rows = 0;
  for (std::size_t v : {16u, 1000u, 6000u}) {
    for (int kind = 0; kind < 5; ++kind) {
      for (int rep = 0; rep < 12; ++rep) {
        std::vector<float> zn(v), zo(v), g(v), log_probs(v);
        const double scale = rep % 3 == 0 ? 1.0 : rep % 3 == 1 ? 3.0 : 10.0;
        const double offset = kind == 1 ? (rep % 2 ? 1e4 : -3e5) : 0.0;
        for (std::size_t j = 0; j < v; ++j) {
          double o = scale * normal(rng), n = o + 0.5 * normal(rng);
          if (kind == 2) {  // nearly one-hot: the old row on token 0, the new on token 1, a tiny ε
            o = j == 0 ? 0.0 : j == 1 ? -40.0 : -300.0 - 300.0 * uniform(rng);
            n = (j == 1 ? 0.0 : j == 0 ? -40.0 : -300.0 - 300.0 * uniform(rng)) + 7.0 * double(rep % 3);
          }
          if (kind == 3) {  // two modes far apart, the others below
            o = j < 2 ? 40.0 * double(j) : -50.0 * uniform(rng);
            n = j < 2 ? 40.0 * double(1 - j) : -50.0 * uniform(rng);
          }
          zo[j] = float(o + offset);
          zn[j] = float(n + offset + (kind == 4 ? (rep % 2 ? 1e4 : 6e4) : 0.0));  // kind 4: μ ~ 1e4, 6e4
          g[j] = float(normal(rng));
        }
        const double eps = kind == 2 ? 1e-12 : rep % 2 ? 1e-3 : 0.05;
        troll::projection_stats s;
        troll::project(troll::cpu, troll::make_batch(static_cast<const float*>(zn.data()), 1, v),
                       troll::make_batch(static_cast<const float*>(zo.data()), 1, v), eps,
                       troll::make_batch(log_probs.data(), 1, v), &s);
        if (s.status != troll::row_status::projected) continue;
        const cpu::vjp_sums with =
            cpu::vjp_first_pass_of<true>(zn.data(), zo.data(), log_probs.data(), g.data(), long(v), s.mu);
        if (!with.fine) continue;  // log π* outside [−700, 0]: the general path
        ++rows;
        const bool skip = cpu::centring_negligible<float>(s.mu, s.sigma2, with.widest, long(v));
        const double noise = double(std::numeric_limits<float>::epsilon()) * with.centring.spread;
        CAPTURE(v);
        CAPTURE(kind);
        CAPTURE(rep);
        if (skip) {
          ++negligible;
          CHECK(std::fabs(with.centring.m) <= noise);
          CHECK(with.centring.step<float>() == 0.0);
        } else {
          ++needed;
          applied += with.centring.step<float>() != 0.0;
        }
        // the pass that skips them agrees on everything else
        const cpu::vjp_sums chosen = cpu::vjp_first_pass(zn.data(), zo.data(), log_probs.data(), g.data(), long(v), s);
        CHECK(chosen.sum_g == with.sum_g);
        CHECK(chosen.sum_gc == with.sum_gc);
        CHECK(chosen.centring.step<float>() == with.centring.step<float>());
      }
    }
  }
  MESSAGE("projected float rows on the packet path: " << rows << ", negligible " << negligible << ", needed "
                                                      << needed << " (correction applied on " << applied << ")");
  CHECK(negligible > rows / 2);
  CHECK(applied > 0);
  CHECK(cpu::centring_negligible<double>(0.0, 1.0, 1.0, 100) == false);
}
