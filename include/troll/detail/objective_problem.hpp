// troll/detail/objective_problem.hpp — what can be wrong with one row of an objective call and
// the one message table for it: the CPU objectives fill an objective_problem (dense rows) or a
// sparse_objective_problem (sparse old rows), the CUDA backend's checked mode turns a device report
// into the same records (detail/cuda/objective_report.cuh, sparse_objective_report.cuh), and both
// throw through throw_objective_problem / throw_sparse_objective_problem, so the two backends'
// messages cannot drift apart. Host-only, no Eigen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "../config.hpp"
#include "../errors.hpp"
#include "../sparsify_state.hpp"
#include "row_problem.hpp"
#include "sparse_problem.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// What can be wrong with one row of an objective's inputs.
struct objective_problem {
  enum class kind {
    none,
    logits,            // see `logits`
    token_range,       // sampled token outside [0, V)
    advantage,         // NaN or infinite advantage
    mask,              // NaN, infinite or negative loss mask
    sequence_order,    // sequence id smaller than the previous row's
    old_token_masked,  // q_a = 0: the ratio is undefined
    regression_inf,    // KL(p̃ ‖ π*) = +inf with α > 0
    overflow,          // the ratio (double), the token's loss or its gradient overflows
  };
  kind what = kind::none;
  row_problem logits;
  double value = 0.0;           ///< token_range, advantage, mask, ...; overflow: log ρ
  double token = 0.0;           ///< overflow: the sampled token
  const char* quantity = "";    ///< overflow: what overflowed ("importance ratio", "loss", ...)
  const char* type_name = "";   ///< overflow: the element type it overflows
  explicit operator bool() const { return what != kind::none; }
};

[[noreturn]] inline void throw_objective_problem(const char* fn, std::size_t row,
                                                 const objective_problem& p) {
  using k = objective_problem::kind;
  if (p.what == k::logits) throw_problem(fn, row, p.logits);
  std::ostringstream msg;
  msg.precision(17);
  msg << row_prefix(fn, row);
  switch (p.what) {
    case k::token_range:
      msg << "sampled token " << static_cast<long long>(p.value) << " is outside [0, V)";
      throw domain_error(msg.str(), row);
    case k::advantage:
      msg << "advantage is " << p.value << " (must be finite)";
      throw domain_error(msg.str(), row);
    case k::mask:
      msg << "loss mask is " << p.value << " (must be finite and >= 0)";
      throw domain_error(msg.str(), row);
    case k::sequence_order:
      msg << "sequence id " << static_cast<long long>(p.value)
          << " is smaller than the previous row's (ids must be non-decreasing)";
      throw domain_error(msg.str(), row);
    case k::old_token_masked:
      msg << "old_logits is -inf at the sampled token " << static_cast<long long>(p.value)
          << ": q_a = 0 and the importance ratio is undefined";
      throw domain_error(msg.str(), row);
    case k::overflow:
      msg << "the " << p.quantity << " at sampled token " << static_cast<long long>(p.token)
          << " overflows " << p.type_name;
      if (p.value == p.value)
        msg << ": its importance ratio is exp(" << p.value
            << ") (log pi_new - log q_old); a token this unlikely under the old policy was not "
               "sampled from it (check the tokens and the old logits)";
      throw domain_error(msg.str(), row);
    case k::regression_inf:
      msg << "new_logits put mass on tokens the old logits mask (-inf), so KL(p_new || pi*) is "
             "+inf; use alpha = 0 or mask those tokens in the new logits too";
      throw domain_error(msg.str(), row);
    default:
      break;
  }
  throw invalid_input(msg.str() + "unknown problem", row);
}

/// The overflow problem of a counted token from its operand code (objective_row.hpp), log ρ
/// (NaN: unknown) and the sampled token.
inline objective_problem overflow_problem(int operand, double log_ratio, std::int64_t token) {
  static const char* const names[4] = {"importance ratio", "loss", "weighted loss", "gradient"};
  objective_problem p;
  p.what = objective_problem::kind::overflow;
  p.quantity = names[operand % 4];
  p.type_name = operand >= 4 ? "float" : "double";
  p.value = log_ratio;
  p.token = static_cast<double>(token);
  return p;
}

// ---- The row problems particular to sparse old rows (the others are the dense objective's,
// ---- the sparse rows' or the projection's) ----

[[noreturn]] inline void throw_objective_capacity(const char* fn, std::size_t row, long long need,
                                                  long long k_max) {
  throw shape_error(row_prefix(fn, row) + "aligned and log_probs have capacity k_max = " +
                        std::to_string(k_max) +
                        " but the row needs up to min(V, |S_old| + "
                        "new_support.k) = " +
                        std::to_string(need) + " entries (at most " +
                        std::to_string(sparse_max_entries) + ")",
                    row);
}

[[noreturn]] inline void throw_not_in_support(const char* fn, std::size_t row, long long token) {
  throw domain_error(row_prefix(fn, row) + "sampled token " + std::to_string(token) +
                         " is not in the old row's support: the ratio needs its exact old "
                         "log-probability (sparsify the old row with the sampled token; "
                         "sparsify always keeps it)",
                     row);
}

[[noreturn]] inline void throw_not_in_aligned(const char* fn, std::size_t row, long long token) {
  throw domain_error(row_prefix(fn, row) + "sampled token " + std::to_string(token) +
                         " is not in the aligned support U (pass the aligned rows that "
                         "objective_forward wrote)",
                     row);
}

[[noreturn]] inline void throw_old_entry_masked(const char* fn, std::size_t row, long long token) {
  throw domain_error(row_prefix(fn, row) + "the old row's log-probability at the sampled token " +
                         std::to_string(token) +
                         " is -inf: q_a = 0 and the importance ratio is undefined",
                     row);
}

/// `entry` < 0: the counts differ (`value` log_probs', `other` the aligned row's); else entry
/// `entry` holds token `value` in log_probs and `other` in the aligned row.
[[noreturn]] inline void throw_log_probs_mismatch(const char* fn, std::size_t row, long long entry,
                                                  long long value, long long other) {
  throw shape_error(
      row_prefix(fn, row) +
          (entry < 0 ? "log_probs has " + std::to_string(value) +
                           " entries but the aligned row has " + std::to_string(other)
                     : "log_probs entry " + std::to_string(entry) + " holds token " +
                           std::to_string(value) + " but the aligned row holds token " +
                           std::to_string(other)) +
          " (pass the log_probs and aligned rows objective_forward wrote)",
      row);
}

/// What can be wrong with one row of a sparse objective call.
struct sparse_objective_problem {
  enum class kind {
    none,
    token,               // `token`: mask, token, advantage, order, new logits, lumped rows, stats
    sparse,              // `sparse`: a bad sparse row (old, aligned or log_probs)
    capacity,            // aligned / log_probs cannot hold U (value = entries needed)
    not_in_support,      // the sampled token is not in the old row's support (value = token)
    not_in_aligned,      // backward: the sampled token is not in U (value = token)
    old_token_masked,    // the old log-prob of the sampled token is −inf (value = token)
    log_probs_mismatch,  // backward: log_probs entry `entry` (−1: its count) differs from U
  };
  kind what = kind::none;
  objective_problem token;
  sparse_problem sparse;
  long long value = 0;
  long long other = 0;  ///< capacity: the smaller k_max; log_probs_mismatch: U's count or token
  long long entry = -1;
  explicit operator bool() const { return what != kind::none; }
};

[[noreturn]] inline void throw_sparse_objective_problem(const char* fn, std::size_t row,
                                                        const sparse_objective_problem& p) {
  using k = sparse_objective_problem::kind;
  const std::string prefix = row_prefix(fn, row);
  switch (p.what) {
    case k::token:
      throw_objective_problem(fn, row, p.token);
    case k::sparse:
      throw_sparse_problem(fn, row, p.sparse);
    case k::capacity:
      throw_objective_capacity(fn, row, p.value, p.other);
    case k::not_in_support:
      throw_not_in_support(fn, row, p.value);
    case k::not_in_aligned:
      throw_not_in_aligned(fn, row, p.value);
    case k::old_token_masked:
      throw_old_entry_masked(fn, row, p.value);
    case k::log_probs_mismatch:
      throw_log_probs_mismatch(fn, row, p.entry, p.value, p.other);
    case k::none:
      break;
  }
  throw invalid_input(prefix + "unknown problem", row);
}

}  // namespace detail
TROLL_END_NAMESPACE
