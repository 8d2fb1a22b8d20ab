// tests/support/token_fields.hpp — the per-token data every objective test batch carries (sampled
// tokens, sequence ids, advantages, loss mask, aggregation) and the troll::token_batch view of
// it. The dense cases (objective_cases.hpp) and the sparse ones (sparse_objective_cases.hpp)
// derive from it.
#pragma once

#include <troll/objective_types.hpp>

#include <cstdint>
#include <vector>

namespace troll_test {

struct token_fields {
  std::vector<std::int64_t> tokens, sequence_ids;
  std::vector<double> advantages, mask;
  troll::loss_aggregation aggregation = troll::loss_aggregation::token_mean;

  /// The batch view; an empty mask or sequence-id vector is passed as null (not given).
  troll::token_batch<double> batch() const {
    troll::token_batch<double> b;
    b.tokens = tokens.data();
    b.advantages = advantages.data();
    b.loss_mask = mask.empty() ? nullptr : mask.data();
    b.sequence_ids = sequence_ids.empty() ? nullptr : sequence_ids.data();
    b.aggregation = aggregation;
    return b;
  }
};

}  // namespace troll_test
