// tests/support/cuda_objective_batch.cuh — troll_test::host_batch (objective_batch.hpp) copied to
// device memory, with the same views: what the CUDA objective tests hand to the device overloads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda_support.cuh"
#include "objective_batch.hpp"
#include "tolerance.hpp"
#include "troll/batch.hpp"
#include "troll/objective_types.hpp"

namespace troll_test {

/// Tolerance between the two backends' objective outputs: both reduce in double, the outputs are T.
template <class T>
tolerance objective_between_backends() {
  return tolerance{1e-9 + 64.0 * unit_roundoff<T>(), 1e-9 + 64.0 * unit_roundoff<T>()};
}

/// The same batch in device memory.
template <class T>
struct device_batch {
  device_array<T> fresh, old, advantages, mask;
  device_array<std::int64_t> tokens, sequence_ids;
  std::size_t rows, cols;

  explicit device_batch(const host_batch<T>& h)
      : fresh(h.fresh),
        old(h.old),
        advantages(h.advantages),
        mask(h.mask),
        tokens(h.tokens),
        sequence_ids(h.sequence_ids),
        rows(h.rows),
        cols(h.cols) {}

  troll::input_view<T> new_view() const {
    return troll::make_batch<const T>(fresh.get(), rows, cols);
  }
  troll::input_view<T> old_view() const {
    return troll::make_batch<const T>(old.get(), rows, cols);
  }
  troll::token_batch<T> tokens_view(troll::loss_aggregation how) const {
    troll::token_batch<T> in;
    in.tokens = tokens.get();
    in.advantages = advantages.get();
    in.loss_mask = mask.get();
    in.sequence_ids = sequence_ids.get();
    in.aggregation = how;
    return in;
  }
};

}  // namespace troll_test
