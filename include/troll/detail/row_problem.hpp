// troll/detail/row_problem.hpp — what can be wrong with one input row, found by the scans
// before anything is written, and the typed exception each problem becomes.
#pragma once

#include <cstddef>
#include <sstream>
#include <string>

#include "../config.hpp"
#include "../errors.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

enum class problem_kind {
  none,
  nan_value,     // NaN in `operand` at `token`
  pos_inf,       // +inf in `operand` at `token`
  all_masked,    // every entry of `operand` is −inf
  disjoint,      // no token has both logits finite
  infeasible,    // masked new tokens hold too much old mass: KL(π‖q) ≥ `value` ≥ ε for all π
  bad_stats,     // forward statistics unusable (backward only)
  above_zero,    // a log-probability in `operand` at `token` is `value` > 0 (backward only)
  masked_mass,   // `operand` is `value` > −inf at `token`, where a logit is −inf (backward only)
};

struct row_problem {
  problem_kind kind = problem_kind::none;
  const char* operand = "";
  std::size_t token = 0;
  double value = 0.0;

  explicit operator bool() const { return kind != problem_kind::none; }
};

/// Throws the troll exception describing `p` at `row` of a call to `function`.
[[noreturn]] inline void throw_problem(const char* function, std::size_t row, const row_problem& p) {
  std::ostringstream msg;
  msg.precision(17);
  msg << row_prefix(function, row);
  switch (p.kind) {
    case problem_kind::nan_value:
      msg << p.operand << " is NaN at token " << p.token;
      throw domain_error(msg.str(), row);
    case problem_kind::pos_inf:
      msg << p.operand << " is +inf at token " << p.token
          << " (only -inf, a masked token, is allowed)";
      throw domain_error(msg.str(), row);
    case problem_kind::all_masked:
      msg << "every entry of " << p.operand << " is -inf (the row has no support)";
      throw domain_error(msg.str(), row);
    case problem_kind::disjoint:
      msg << "new and old logits share no finite token: the supports are disjoint, so no "
             "distribution absolutely continuous w.r.t. the new one lies in the KL ball";
      throw infeasible_error(msg.str(), row);
    case problem_kind::infeasible:
      msg << "the new logits mask tokens that carry old probability mass; every admissible "
             "distribution has KL(pi||q) >= "
          << p.value << ", which is not below the bound eps";
      throw infeasible_error(msg.str(), row);
    case problem_kind::bad_stats:
      msg << "forward statistics are unusable: " << p.operand;
      throw domain_error(msg.str(), row);
    case problem_kind::above_zero:
      msg << p.operand << " is " << p.value << " > 0 at token " << p.token << " (a probability above 1)";
      throw domain_error(msg.str(), row);
    case problem_kind::masked_mass:
      msg << p.operand << " is " << p.value << " at token " << p.token
          << ", which the new or old logits mask (-inf): not the projection's output for these logits";
      throw domain_error(msg.str(), row);
    case problem_kind::none:
      break;
  }
  throw invalid_input(msg.str() + "unknown problem", row);
}

}  // namespace detail
TROLL_END_NAMESPACE
