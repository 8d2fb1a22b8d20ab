// bench/support/llm_rows.hpp — LLM-like (old, new) logit rows for troll's benchmarks.
// Old rows are Zipf-like logits over a vocabulary of V tokens; each new row is the old row plus a
// Gaussian perturbation scaled so that KL(p̃ ‖ q) lands on a chosen side of the bound ε.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace troll_bench {

/// Rows × V logits in row-major order, generated in double (cast with `as<T>` for float runs).
struct logit_pair {
  std::size_t rows = 0;
  std::size_t vocab = 0;
  std::vector<double> old_logits;  // z°
  std::vector<double> new_logits;  // z̃
  std::vector<char> active;        // 1 where KL(p̃ ‖ q) was aimed above ε
};

/// Whether row r is one of the active rows when a fraction `active_fraction` ∈ [0, 1] of the rows
/// is active: floor((r+1)·f) > floor(r·f). Spreads the active rows evenly; for f = 1/4 the rows
/// 3, 7, 11, … are active (so a batch of one row is inactive), and a batch that is a prefix of a
/// larger one keeps the same pattern.
inline bool is_active_row(std::size_t r, double active_fraction) {
  return std::floor(double(r + 1) * active_fraction) > std::floor(double(r) * active_fraction);
}

/// KL(softmax(p) ‖ softmax(q)) of one row of finite logits, in double (an oracle independent of
/// troll, used only to calibrate the generator).
inline double row_kl(const double* p, const double* q, std::size_t size) {
  const double p_max = *std::max_element(p, p + size);
  const double q_max = *std::max_element(q, q + size);
  double p_sum = 0.0, q_sum = 0.0, weighted = 0.0;
  for (std::size_t j = 0; j < size; ++j) {
    const double ep = std::exp(p[j] - p_max);
    p_sum += ep;
    q_sum += std::exp(q[j] - q_max);
    weighted += ep * ((p[j] - p_max) - (q[j] - q_max));
  }
  return std::max(0.0, weighted / p_sum - std::log(p_sum) + std::log(q_sum));
}

/// One old row: z°_j = −α·log(1 + rank_j) + σ·n_j with ranks a random permutation of 0..V−1
/// (token probabilities ∝ rank^−α, roughly what a pretrained LM puts on its vocabulary) and n_j
/// standard normal noise. α = 1.1, σ = 0.5.
inline void zipf_row(std::mt19937_64& rng, std::size_t size, double* out) {
  constexpr double alpha = 1.1, noise = 0.5;
  std::vector<std::size_t> rank(size);
  std::iota(rank.begin(), rank.end(), std::size_t(0));
  std::shuffle(rank.begin(), rank.end(), rng);
  std::normal_distribution<double> normal;
  for (std::size_t j = 0; j < size; ++j)
    out[j] = -alpha * std::log1p(double(rank[j])) + noise * normal(rng);
}

/// Generates `rows` row pairs over `vocab` tokens. Row r uses its own seed, so a batch of k rows
/// is the prefix of any larger batch with the same arguments. An active row aims at
/// KL(p̃ ‖ q) ∈ [2ε, 8ε] (log-uniform), an inactive one at [0.1ε, 0.5ε] (with active_fraction < 0,
/// every row at [1e-7, 1e-5]: nearly equal rows); the perturbation
/// z̃ − z° = δ·g (g standard normal per token) is scaled by a few fixed-point steps
/// δ ← δ·sqrt(target / KL(δ)), which land within a few per cent of the target.
inline logit_pair make_logit_pair(std::size_t rows, std::size_t vocab, double active_fraction,
                                  double eps = 0.05, std::uint64_t seed = 20240601) {
  logit_pair out;
  out.rows = rows;
  out.vocab = vocab;
  out.old_logits.resize(rows * vocab);
  out.new_logits.resize(rows * vocab);
  out.active.resize(rows);
  std::vector<double> direction(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    std::mt19937_64 rng(seed + 0x9E3779B97F4A7C15ull * (r + 1));
    double* zo = out.old_logits.data() + r * vocab;
    double* zn = out.new_logits.data() + r * vocab;
    zipf_row(rng, vocab, zo);
    std::normal_distribution<double> normal;
    for (double& g : direction) g = normal(rng);

    const bool active = is_active_row(r, active_fraction);
    out.active[r] = active ? 1 : 0;
    std::uniform_real_distribution<double> unit;
    // active_fraction < 0: every row nearly equal to its old row (KL from 1e-7 to 1e-5, far below
    // ε: the first steps of every PPO update), else inactive rows at 0.1–0.5 ε
    const bool near = active_fraction < 0.0;
    const double low = active ? 2.0 * eps : near ? 1e-7 : 0.1 * eps;
    const double high = active ? 8.0 * eps : near ? 1e-5 : 0.5 * eps;
    const double target = low * std::pow(high / low, unit(rng));

    auto perturb = [&](double scale) {
      for (std::size_t j = 0; j < vocab; ++j) zn[j] = zo[j] + scale * direction[j];
      return row_kl(zn, zo, vocab);
    };
    double scale = std::sqrt(2.0 * target);  // KL ≈ δ²·Var(g)/2 for small δ
    for (int step = 0; step < 6; ++step) {
      const double kl = perturb(scale);
      if (!(kl > 0.0)) break;
      scale *= std::sqrt(target / kl);
    }
    perturb(scale);
  }
  return out;
}

/// A dense upstream gradient ∂L/∂log π* (rows × V), standard normal entries.
inline std::vector<double> upstream_gradient(std::size_t rows, std::size_t vocab,
                                             std::uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> g(rows * vocab);
  for (double& x : g) x = normal(rng);
  return g;
}

/// Element-wise copy to T.
template <class T>
std::vector<T> as(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

}  // namespace troll_bench
