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

#include "backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The re-centring's tests on the CPU backend (also compiled for troll::cuda by
// tests/cuda/test_cuda_gradients.cu).
#include "bodies/backward_centring.hpp"

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

namespace {

/// The projection's derivatives of one row (VJP with grad_old and ε, JVP along (e_0, ε' = 1),
/// the three Jacobian blocks), in double for comparison.
struct row_derivatives {
  std::vector<double> grad_new, grad_old, jvp, jac_new, jac_old, jac_eps;
  double grad_eps = 0.0;
  troll::row_status status{};
};

template <class T>
row_derivatives derivatives_of(const std::vector<T>& zn, const std::vector<T>& zo, double eps) {
  const std::size_t v = zn.size();
  const auto n = troll::make_batch(zn.data(), 1, v), o = troll::make_batch(zo.data(), 1, v);
  std::vector<T> lp(v), g(v), gn(v), go(v), tangent(v, T(0)), jvp(v), jn(v * v), jo(v * v), je(v);
  for (std::size_t j = 0; j < v; ++j) g[j] = T(0.5 * std::sin(1.7 * double(j + 1)));
  tangent[0] = T(1);
  troll::projection_stats st;
  troll::project(troll::cpu, n, o, eps, troll::make_batch(lp.data(), 1, v), &st);
  const auto lpv = troll::make_batch<const T>(lp.data(), 1, v);
  T ge = 0;
  troll::project_backward(troll::cpu, n, o, lpv, &st, troll::make_batch<const T>(g.data(), 1, v),
                          troll::make_batch(gn.data(), 1, v), troll::make_batch(go.data(), 1, v), &ge);
  troll::project_jvp(troll::cpu, n, o, lpv, &st, troll::make_batch<const T>(tangent.data(), 1, v),
                     troll::make_batch<const T>(tangent.data(), 1, v), 1.0, troll::make_batch(jvp.data(), 1, v));
  troll::project_jacobian(troll::cpu, n, o, lpv, &st, jn.data(), jo.data(), je.data());
  row_derivatives r;
  r.grad_new.assign(gn.begin(), gn.end());
  r.grad_old.assign(go.begin(), go.end());
  r.jvp.assign(jvp.begin(), jvp.end());
  r.jac_new.assign(jn.begin(), jn.end());
  r.jac_old.assign(jo.begin(), jo.end());
  r.jac_eps.assign(je.begin(), je.end());
  r.grad_eps = double(ge);
  r.status = st.status;
  return r;
}

void check_same(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t j = 0; j < got.size(); ++j) {
    INFO("entry " << j << ": got " << got[j] << ", want " << want[j]);
    CHECK(std::abs(got[j] - want[j]) <= tol * (scale + std::abs(want[j])));
  }
}

/// Every derivative of `got` against `want`.
void check_all(const row_derivatives& got, const row_derivatives& want, double tol) {
  check_same(got.grad_new, want.grad_new, tol);
  check_same(got.grad_old, want.grad_old, tol);
  check_same({got.grad_eps}, {want.grad_eps}, tol);
  check_same(got.jvp, want.jvp, tol);
  check_same(got.jac_new, want.jac_new, tol);
  check_same(got.jac_old, want.jac_old, tol);
  check_same(got.jac_eps, want.jac_eps, tol);
}

}  // namespace

TEST_CASE("derivatives of rows shifted far from the origin equal the unshifted row's (softmax invariance)") {
  // softmax(z° + c) = softmax(z°): a row whose old logits carry a constant c has the same π*,
  // statistics (but μ) and derivatives as c = 0, an exact oracle. The kernels formed d_j − μ from
  // d_j = z̃_j − z°_j rounded to ulp(c) on each token (16384 at c = 1e20): ∂/∂ε had the wrong sign
  // at c = 1e16 and was 0 beyond 1e20, in float and double (the forward was right). Such rows are
  // now differentiated against a reference token (detail/cpu/offset_rows.hpp).
  const std::vector<double> base_new = {0.0, 1.0, 2.0, -0.75, 0.5};
  for (double c : {1e8, 1e12, 1e16, 1e20, -1e25, 1e30, 3e38}) {
    for (double eps : {0.05, 1e-6}) {
      INFO("c = " << c << ", eps = " << eps);
      {  // float: the old row a constant c (exactly representable), the new row small
        std::vector<float> zn(base_new.begin(), base_new.end()), zo(zn.size(), 0.0f), zc(zn.size(), float(c));
        const row_derivatives want = derivatives_of(zn, zo, eps), got = derivatives_of(zn, zc, eps);
        REQUIRE(got.status == troll::row_status::projected);
        check_all(got, want, 2e-6);
      }
      if (std::abs(c) <= 1e300) {  // double: the same, and the new row shifted by c instead
        std::vector<double> zn = base_new, zo(zn.size(), 0.0), zc(zn.size(), c);
        const row_derivatives want = derivatives_of(zn, zo, eps), got = derivatives_of(zn, zc, eps);
        check_all(got, want, 1e-9);
        // z̃ + c with z̃ on multiples of ulp(c): exactly the shifted row.
        const double unit = std::abs(c) * 0x1p-52 * 2.0;
        std::vector<double> wide(zn.size()), shifted(zn.size());
        for (std::size_t j = 0; j < zn.size(); ++j) {
          wide[j] = std::max(unit, 1.0) * std::round(zn[j] * 4.0) / 4.0;
          shifted[j] = wide[j] + c;
        }
        if (unit <= 1.0) {  // otherwise `wide` is far from a moderate row: left to the float case
          const row_derivatives w2 = derivatives_of(wide, zo, eps), g2 = derivatives_of(shifted, zo, eps);
          check_same(g2.grad_new, w2.grad_new, 1e-9);
          check_same({g2.grad_eps}, {w2.grad_eps}, 1e-9);
          check_same(g2.jvp, w2.jvp, 1e-9);
        }
      }
    }
  }
}

TEST_CASE("the TROLL objective's gradient on rows shifted far from the origin equals the unshifted row's") {
  // The fused objective backward formed d − μ as the projection's derivatives did (the cross term
  // of the sampled token's ratio): the same invariance oracle, dense old rows shifted by c.
  const std::size_t rows = 2, v = 5;
  auto gradient = [&](const std::vector<double>& zn, const std::vector<double>& zo) {
    const auto n = troll::make_batch(zn.data(), rows, v), o = troll::make_batch(zo.data(), rows, v);
    std::vector<double> lp(rows * v), grad(rows * v), token_loss(rows);
    std::vector<troll::projection_stats> st(rows);
    const std::vector<troll::token_id> tokens = {1, 3};
    const std::vector<double> advantages = {1.0, -0.7};
    troll::token_batch<double> batch;
    batch.tokens = tokens.data();
    batch.advantages = advantages.data();
    troll::trust_region_objective objective;
    objective.eps = 0.05;
    objective.alpha = 0.1;
    troll::objective_metrics metrics;
    troll::objective_forward(troll::cpu, objective, n, o, batch, troll::make_batch(lp.data(), rows, v), st.data(),
                             token_loss.data(), &metrics);
    for (const troll::projection_stats& s : st) REQUIRE(s.status == troll::row_status::projected);
    troll::objective_backward(troll::cpu, objective, n, o, batch, troll::make_batch<const double>(lp.data(), rows, v),
                              st.data(), troll::make_batch(grad.data(), rows, v), 1.0);
    return grad;
  };
  const std::vector<double> zn = {0.0, 1.0, 2.0, -0.75, 0.5, 1.5, -1.0, 0.25, 0.0, 2.5};
  const std::vector<double> zo(rows * v, 0.0);
  const std::vector<double> want = gradient(zn, zo);
  for (double c : {1e16, 1e20, -3e30}) {
    INFO("c = " << c);
    const std::vector<double> shifted(rows * v, c);
    check_same(gradient(zn, shifted), want, 1e-9);
  }
}
