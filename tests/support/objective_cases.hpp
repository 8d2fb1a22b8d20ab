// tests/support/objective_cases.hpp — the token batches the objective tests build on the host
// (token_case: a pair_batch of logits with tokens, advantages, masks and sequences), the
// aggregation weights computed from their definition, and TROLL with tight projection options.
// Shared by tests/test_objectives.cpp and the objective-gradient body
// tests/bodies/objective_gradients.hpp.
#pragma once

#include <troll/objective_types.hpp>
#include <troll/objectives.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "grad_helpers.hpp"
#include "token_fields.hpp"

namespace troll_test {
namespace objective_cases {

using grad_helpers::pair_batch;

/// A batch of token rows with everything an objective reads.
struct token_case : token_fields {
  pair_batch logits;
  std::size_t rows() const { return logits.rows; }
  std::size_t cols() const { return logits.cols; }
};

/// N rows over V tokens: old logits ~ 2·N(0,1); new = old + step_r·N(0,1) with steps cycling
/// through small (inactive under ε = 0.05) and large (projected) values. Three sequences.
inline token_case make_case(std::size_t rows, std::size_t cols, std::uint64_t seed) {
  grad_helpers::rng g(seed);
  token_case c;
  c.logits = pair_batch(rows, cols);
  const double steps[4] = {0.03, 0.9, 1.6, 0.5};
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t j = 0; j < cols; ++j) {
      c.logits.old_row(r)[j] = 2.0 * g.normal();
      c.logits.new_row(r)[j] = c.logits.old_row(r)[j] + steps[r % 4] * g.normal();
    }
    c.tokens.push_back(std::int64_t((r * 5 + 3) % cols));
    c.advantages.push_back(r % 3 == 0 ? -0.8 : 1.1 + 0.1 * double(r));
    c.mask.push_back(r % 5 == 4 ? 0.0 : (r % 2 ? 1.0 : 0.5));
    c.sequence_ids.push_back(std::int64_t(r * 3 / rows));
  }
  return c;
}

/// The aggregation weights c_r, computed here from the definition (not by troll).
inline std::vector<double> weights_of(const token_case& c) {
  const std::size_t n = c.rows();
  std::vector<double> w(n, 0.0);
  auto m = [&](std::size_t r) { return c.mask.empty() ? 1.0 : c.mask[r]; };
  if (c.aggregation == troll::loss_aggregation::token_mean) {
    double total = 0;
    for (std::size_t r = 0; r < n; ++r) total += m(r);
    for (std::size_t r = 0; r < n; ++r) w[r] = total > 0 ? m(r) / total : 0.0;
    return w;
  }
  std::vector<std::int64_t> ids;
  for (std::int64_t id : c.sequence_ids)
    if (ids.empty() || ids.back() != id) ids.push_back(id);
  double counted = 0;
  for (std::int64_t id : ids) {
    double total = 0;
    for (std::size_t r = 0; r < n; ++r)
      if (c.sequence_ids[r] == id) total += m(r);
    if (total > 0) counted += 1;
  }
  for (std::int64_t id : ids) {
    double total = 0;
    for (std::size_t r = 0; r < n; ++r)
      if (c.sequence_ids[r] == id) total += m(r);
    for (std::size_t r = 0; r < n; ++r)
      if (c.sequence_ids[r] == id && total > 0) w[r] = m(r) / total / counted;
  }
  return w;
}

inline troll::trust_region_objective tight_troll(double alpha = 1.0) {
  troll::trust_region_objective o;
  o.alpha = alpha;
  o.projection = grad_helpers::tight_options();
  return o;
}

}  // namespace objective_cases
}  // namespace troll_test
