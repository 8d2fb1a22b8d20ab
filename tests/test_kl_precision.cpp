// test_kl_precision.cpp — troll::kl on nearly equal rows (z̃ = z° + δ·noise, KL ~ δ²), where the
// closed form cancels and the cancellation-free sum must not take its x_i from differences to a
// reference token (which carry ulps of the logits, magnified by ~1/sqrt(KL): 3e-8 relative at
// KL ~ 1e-17 before kl_centred), and on equal rows (exactly 0, also with masks).
// Reference (long double): KL = Σ p_i ψ(δ_i), ψ(x) = x + e^{−x} − 1 ≥ 0, δ_i = d_i − c,
// c = log1p(Σ q_i expm1(d_i)); first-order insensitive to c's rounding, no cancellation.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <troll/kl.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace {

long double psi(long double x) {
  if (std::fabs(x) < 0.01L) {  // x²/2 − x³/6 + x⁴/24 − …
    long double term = x * x / 2, sum = 0;
    for (int n = 2; n < 30; ++n) {
      sum += term;
      term *= -x / (n + 1);
    }
    return sum;
  }
  return x + std::expm1(-x);
}

long double reference_kl(const std::vector<double>& p_logits, const std::vector<double>& q_logits) {
  const std::size_t n = p_logits.size();
  long double q_top = -INFINITY, q_sum = 0;
  for (double z : q_logits) q_top = std::max(q_top, static_cast<long double>(z));
  for (double z : q_logits) q_sum += std::exp(z - q_top);
  long double shift = 0;  // Σ q_i expm1(d_i)
  for (std::size_t i = 0; i < n; ++i) {
    const long double q = std::exp(q_logits[i] - q_top) / q_sum;
    shift += q * std::expm1(static_cast<long double>(p_logits[i]) - q_logits[i]);
  }
  const long double c = std::log1p(shift);
  long double kl = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const long double q = std::exp(q_logits[i] - q_top) / q_sum;
    const long double delta = (static_cast<long double>(p_logits[i]) - q_logits[i]) - c;
    kl += q * std::exp(delta) * psi(delta);
  }
  return kl;
}

}  // namespace

TEST_CASE("kl of nearly equal double rows is accurate to 1e-12 relative") {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal;
  for (std::size_t size : {5u, 50u, 1000u}) {
    for (double delta : {1e-2, 1e-4, 1e-6, 1e-8}) {
      std::vector<double> q(size), p(size);
      for (std::size_t i = 0; i < size; ++i) {
        q[i] = 3.0 * normal(rng);
        p[i] = q[i] + delta * normal(rng);
      }
      double got = -1.0;
      troll::kl(troll::cpu, troll::make_batch(static_cast<const double*>(p.data()), 1, size),
                troll::make_batch(static_cast<const double*>(q.data()), 1, size), &got);
      const long double want = reference_kl(p, q);
      CAPTURE(size);
      CAPTURE(delta);
      CAPTURE(double(want));
      CHECK(std::fabs(double(got - want)) <= 1e-12 * double(want));
    }
  }
}

TEST_CASE("kl of equal rows is exactly 0, masks included") {
  for (std::size_t size : {1u, 3u, 50u, 1000u}) {
    std::vector<double> z(size);
    std::vector<float> f(size);
    for (std::size_t i = 0; i < size; ++i) {
      z[i] = (i % 3 == 1 && size > 1) ? -INFINITY : 1e4 + 5.0 * std::sin(double(i));
      f[i] = float(z[i]);
    }
    double got = -1.0;
    float got_f = -1.0f;
    auto v = troll::make_batch(static_cast<const double*>(z.data()), 1, size);
    auto vf = troll::make_batch(static_cast<const float*>(f.data()), 1, size);
    troll::kl(troll::cpu, v, v, &got);
    troll::kl(troll::cpu, vf, vf, &got_f);
    CAPTURE(size);
    CHECK(got == 0.0);
    CHECK(got_f == 0.0f);
  }
}
