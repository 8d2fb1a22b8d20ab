// tests/support/llm_rows.hpp — the LLM-like row pair the solver tests draw: Zipf-like old logits
// with noise and the new row perturbed by `scale`·N(0, 1), optionally made near-deterministic.
#pragma once

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace troll_test {

/// zo_i = −1.1·log1p(i·7919 mod n) + 0.5·N(0,1), zn_i = zo_i + scale·N(0,1) (rounded to T from
/// the double). near_deterministic: one old token at 30 and another new one at 25, far above the
/// rest, so that the two modes trade places along the path.
template <class T>
void llm_like_pair(std::mt19937_64& rng, std::size_t n, double scale, bool near_deterministic, std::vector<T>& zn,
                   std::vector<T>& zo) {
  std::normal_distribution<double> normal;
  zn.resize(n);
  zo.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double old = -1.1 * std::log1p(double(i * 7919 % n)) + 0.5 * normal(rng);
    zo[i] = T(old);
    zn[i] = T(old + scale * normal(rng));
  }
  if (near_deterministic) {
    zo[n / 3] = T(30.0);
    zn[n / 2] = T(25.0);
  }
}

}  // namespace troll_test
