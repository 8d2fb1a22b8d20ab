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
