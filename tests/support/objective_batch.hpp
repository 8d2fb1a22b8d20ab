// tests/support/objective_batch.hpp — the token batch the objective tests share: rows of old and
// perturbed new logits, masks with zeros and fractional weights, uneven sequences, advantages of
// both signs, some tokens masked (−inf) on both sides. Host memory only; the CUDA tests mirror it
// in device memory with troll_test::device_batch (cuda_objective_batch.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "troll/batch.hpp"
#include "troll/objective_types.hpp"

namespace troll_test {

/// A host batch of sampled tokens: rows of V logits (old and a perturbed new), masks with zeros
/// and fractional weights, sequences of uneven length, advantages of both signs. Some rows have
/// −inf entries on both sides; the new logits move far enough that most rows get projected.
template <class T>
struct host_batch {
  std::size_t rows = 0, cols = 0;
  std::vector<T> fresh, old, advantages, mask;
  std::vector<std::int64_t> tokens, sequence_ids;

  host_batch(std::size_t n, std::size_t v, unsigned seed) : rows(n), cols(v) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_int_distribution<std::int64_t> pick(0, std::int64_t(v) - 1);
    fresh.resize(n * v), old.resize(n * v), advantages.resize(n), mask.resize(n), tokens.resize(n),
        sequence_ids.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      const double step = 0.3 + 0.4 * double(r % 4);
      for (std::size_t j = 0; j < v; ++j) {
        const double b = 2.0 * normal(gen);
        old[r * v + j] = T(b);
        fresh[r * v + j] = T(b + step * normal(gen));
      }
      if (r % 5 == 2)  // a token masked on both sides
        old[r * v + 1] = fresh[r * v + 1] = T(-std::numeric_limits<double>::infinity());
      std::int64_t a = pick(gen);
      if (r % 5 == 2 && a == 1) a = 0;
      tokens[r] = a;
      advantages[r] = T(normal(gen));
      mask[r] = T(r % 7 == 3 ? 0.0 : (r % 3 == 0 ? 0.5 : 1.0));
      sequence_ids[r] = std::int64_t(r / 4 + (r > 9 ? 1 : 0));
    }
  }

  troll::input_view<T> new_view() const {
    return troll::make_batch<const T>(fresh.data(), rows, cols);
  }
  troll::input_view<T> old_view() const {
    return troll::make_batch<const T>(old.data(), rows, cols);
  }
  troll::token_batch<T> tokens_view(troll::loss_aggregation how) const {
    troll::token_batch<T> in;
    in.tokens = tokens.data();
    in.advantages = advantages.data();
    in.loss_mask = mask.data();
    in.sequence_ids = sequence_ids.data();
    in.aggregation = how;
    return in;
  }
};

}  // namespace troll_test
