// tests/support/cuda_sparse_batch.cuh — what the CUDA sparse tests share: a sparse batch on the
// host with its device copy (sparse_pair), a tolerance compare with equal infinities (close), and
// LLM-like logit rows rounded through a device element type (llm_rows). Include after
// cuda_support.cuh.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

#include "cuda_support.cuh"
#include "troll/sparse_types.hpp"

namespace troll_test {

/// A sparse batch on the host and its device copy (upload / download by hand).
template <class T>
struct sparse_pair {
  std::size_t rows, k_max, vocab;
  std::vector<troll::sparse_index> indices, counts;
  std::vector<T> log_probs, log_remainder;
  device_array<troll::sparse_index> d_indices, d_counts;
  device_array<T> d_log_probs, d_log_remainder;

  sparse_pair(std::size_t n, std::size_t k, std::size_t v)
      : rows(n), k_max(k), vocab(v), indices(n * k, -7), counts(n, -7), log_probs(n * k, T(-7)),
        log_remainder(n, T(-7)), d_indices(n * k), d_counts(n), d_log_probs(n * k), d_log_remainder(n) {}
  troll::sparse_batch_view<T> host() {
    return {indices.data(), log_probs.data(), counts.data(), log_remainder.data(), rows, k_max, vocab};
  }
  troll::sparse_batch_view<T> device() {
    return {d_indices.get(), d_log_probs.get(), d_counts.get(), d_log_remainder.get(), rows, k_max, vocab};
  }
  void upload() {
    d_indices.upload(indices);
    d_counts.upload(counts);
    d_log_probs.upload(log_probs);
    d_log_remainder.upload(log_remainder);
  }
  /// Replaces the host copy with the device contents (synchronising).
  void download() {
    indices = d_indices.download();
    counts = d_counts.download();
    log_probs = d_log_probs.download();
    log_remainder = d_log_remainder.download();
  }
};

/// |got − want| ≤ atol + rtol·|want|, with equal infinities.
inline bool close(double got, double want, double atol, double rtol) {
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

/// LLM-like rows: a Zipf-shaped head over a random permutation, Gaussian noise, a few masked
/// tokens; values already rounded through the device element type L (so the CPU sees the same).
template <class L>
std::vector<float> llm_rows(std::size_t rows, std::size_t vocab, unsigned seed, std::vector<L>& device_values) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> host(rows * vocab);
  device_values.resize(rows * vocab);
  std::vector<std::size_t> perm(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t i = 0; i < vocab; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), gen);
    const float sharp = 1.0f + 0.5f * float(r % 4);
    for (std::size_t i = 0; i < vocab; ++i) {
      float z = -sharp * 2.0f * std::log(1.0f + float(perm[i])) + 0.3f * noise(gen);
      if (r % 3 == 1 && i % 97 == 5) z = -std::numeric_limits<float>::infinity();
      const L stored = L(z);
      device_values[r * vocab + i] = stored;
      host[r * vocab + i] = float(stored);
    }
  }
  return host;
}

}  // namespace troll_test
