// troll/detail/row_problem.hpp — the one record of what is wrong with one input row and the one
// message table for it. Every row check of the categorical family fills a row_problem (the CPU
// checks directly; the CUDA backend's checked mode from a device report, detail/cuda/*report*),
// and throw_row_problem turns it into the typed exception, its message and its row_error code,
// so that the two backends cannot drift apart. Host-only, no Eigen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "../config.hpp"
#include "../errors.hpp"
#include "../row_error.hpp"
#include "../sparsify_state.hpp"
#include "numeric.hpp"
#include "number_text.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// What is wrong with one row (troll/row_error.hpp says what each field holds per code).
struct row_problem {
  row_error kind = row_error::none;
  const char* operand = "";  ///< the operand's name; bad_stats / infinite_kl: what is unusable
  long long entry = 0;       ///< the token or entry (−1: a sparse row's log-remainder)
  double value = 0.0;
  double other = 0.0;        ///< the second number of a message (a tolerance, an expected id, V)
  const char* quantity = "";   ///< objective_overflow: what overflows ("importance ratio", ...)
  const char* type_name = "";  ///< objective_overflow: the element type it overflows

  explicit operator bool() const { return kind != row_error::none; }
};

/// What bad_stats says of a row whose forward solve stopped short (status not_converged), on
/// both backends.
inline constexpr const char* not_converged_stats =
    "status is not_converged (the forward solve stopped before the tolerance; see projection_options)";

/// A problem of kind `kind` naming `operand`, entry `entry`, with `value` and `other`.
inline row_problem make_problem(row_error kind, const char* operand, long long entry = 0, double value = 0.0,
                                double other = 0.0) {
  row_problem p;
  p.kind = kind;
  p.operand = operand;
  p.entry = entry;
  p.value = value;
  p.other = other;
  return p;
}

/// The overflow problem of a counted token from its operand code (objective_row.hpp: quantity,
/// + 4 for float), log ρ (NaN: unknown) and the sampled token.
inline row_problem overflow_problem(int operand, double log_ratio, std::int64_t token) {
  static const char* const names[4] = {"importance ratio", "loss", "weighted loss", "gradient"};
  row_problem p = make_problem(row_error::objective_overflow, "", static_cast<long long>(token), log_ratio);
  p.quantity = names[operand % 4];
  p.type_name = operand >= 4 ? "float" : "double";
  return p;
}

/// The row_error of a sparsify_state problem (detail::state_problem_kind k, 1 … 18).
inline row_error state_error(int k) { return static_cast<row_error>(50 + k); }

namespace problem_text {

/// The exception classes of the table.
enum class type { invalid, shape, domain, infeasible };

/// A state message's number: an integer when it is one, else std::to_string's.
inline std::string num(double x) {
  if (x != x) return "nan";
  if (x == inf() || x == -inf()) return x > 0 ? "inf" : "-inf";
  if (x > -9e15 && x < 9e15 && x == double(static_cast<long long>(x))) return std::to_string(static_cast<long long>(x));
  return number_text(x);
}

/// The word for a value a check refused as not finite: "+inf" or "-inf" for an infinity, else
/// "NaN" (also where the check recorded no value: those checks refuse only NaN).
inline const char* nonfinite(double x) { return x == inf() ? "+inf" : x == -inf() ? "-inf" : "NaN"; }

/// Writes p's message (after the row prefix) to `msg`; returns the exception class.
inline type write(std::ostringstream& msg, const row_problem& p) {
  using e = row_error;
  const auto ll = [](double x) { return static_cast<long long>(x); };
  const auto where = [&]() -> std::string {
    return p.entry < 0 ? std::string(" log_remainder") : " entry " + std::to_string(p.entry);
  };
  const std::string state = std::string(p.operand) + ": ", entry = std::to_string(p.entry);
  switch (p.kind) {
    // ---- dense rows ----
    case e::nan_value:
    case e::not_finite:
      msg << p.operand << " is " << nonfinite(p.value);
      if (p.entry >= 0) msg << " at token " << p.entry;
      return type::domain;
    case e::pos_inf:
      msg << p.operand << " is +inf at token " << p.entry << " (only -inf, a masked token, is allowed)";
      return type::domain;
    case e::all_masked:
      msg << "every entry of " << p.operand << " is -inf (the row has no support)";
      return type::domain;
    case e::disjoint:
      msg << "new and old logits share no finite token: the supports are disjoint, so no "
             "distribution absolutely continuous w.r.t. the new one lies in the KL ball";
      return type::infeasible;
    case e::infeasible:
      msg << "the new logits mask tokens that carry old probability mass; every admissible "
             "distribution has KL(pi||q) >= "
          << p.value << ", which is not below the bound eps";
      return type::infeasible;
    case e::bad_stats:
      msg << "forward statistics are unusable: " << p.operand;
      return type::domain;
    case e::infinite_kl:
      msg << "KL(p||q) is +inf (p has mass where q is -inf): no gradient";
      return type::domain;
    case e::above_zero:
      msg << p.operand << " is " << p.value << " > 0 at token " << p.entry << " (a probability above 1)";
      return type::domain;
    case e::masked_mass:
      msg << p.operand << " is " << p.value << " at token " << p.entry
          << ", which the new or old logits mask (-inf): not the projection's output for these logits";
      return type::domain;
    case e::log_prob_underflow:
      msg << p.operand << " is -inf at token " << p.entry
          << ", whose new and old logits are finite: its log-probability is below the element type's range "
             "(logits of both signs near the type's largest value in one row), so no derivative of the row "
             "fits the type (use double)";
      return type::domain;
    // ---- sparse rows ----
    case e::sparse_count:
      msg << p.operand << ": count " << p.value << " is negative or exceeds the capacity k_max, the "
          << "vocabulary or " << sparse_max_entries << " entries";
      return type::shape;
    case e::sparse_index:
      msg << p.operand << ": entry " << p.entry << " has token index " << p.value << " outside the vocabulary [0, V)";
      return type::shape;
    case e::sparse_duplicate:
      msg << p.operand << ": entry " << p.entry << " repeats token index " << p.value
          << " (support indices must be distinct)";
      return type::shape;
    case e::sparse_nan:
      msg << p.operand << where() << " is " << nonfinite(p.value);
      return type::domain;
    case e::sparse_above_one:
      msg << p.operand << where() << " is " << p.value << " > 0 (a probability above 1)";
      return type::domain;
    case e::sparse_no_tail:
      msg << p.operand << ": the support covers the whole vocabulary but log_remainder is " << p.value
          << " (the bucket is empty; it must be -inf)";
      return type::domain;
    case e::sparse_no_mass:
      msg << p.operand << ": every log-probability and the remainder are -inf (the row has no mass)";
      return type::domain;
    case e::sparse_not_aligned:
      msg << p.operand << ": entry " << p.entry << " (token " << p.value << ") is missing from the aligned support";
      return type::shape;
    case e::sparse_masked_mass:
      msg << p.operand << where() << " is " << p.value
          << " where the new or old side is -inf: not the projection's output for these rows";
      return type::domain;
    case e::sparse_wrong_token:
      msg << p.operand << ": entry " << p.entry << " holds token " << p.value << " where the aligned rows hold token "
          << p.other << " (log_probs must be project()'s output for these rows)";
      return type::shape;
    case e::sparse_mass:
      msg << p.operand << ": the probabilities sum to " << p.value << " (support plus remainder), more than " << p.other
          << " from 1: not a normalised row";
      return type::domain;
    case e::sparse_capacity:
      msg << "out has capacity " << p.entry << " but the row has " << p.value << " entries";
      return type::shape;
    case e::bad_sampled:
      msg << "sampled token " << ll(p.value) << " is outside the vocabulary [0, " << ll(p.other) << ")";
      return type::domain;
    // ---- sparsify_merge / sparsify_finalize / the shard functions ----
    case e::state_mismatch:
      msg << "the two states were made with different k or sampled tokens";
      return type::invalid;
    case e::state_k:
      msg << "the state was made with k = " << ll(p.value) << ", options.k is " << p.entry;
      return type::invalid;
    case e::state_capacity:
      msg << "out has capacity " << p.entry << " but the row needs " << ll(p.value);
      return type::shape;
    case e::sampled_missing:
      msg << "no shard held the sampled token " << ll(p.value);
      return type::domain;
    case e::no_support:
      msg << "every logit is -inf (the row has no support)";
      return type::domain;
    case e::bad_state:
      msg << p.operand << ": the state has k = " << ll(p.value) << " and size = " << p.entry << " (k must be in [1, "
          << sparsify_max_k << "] and size in [0, k]: a row sparsify_shard rejected, or not a sparsify_state)";
      return type::invalid;
    case e::bad_log_sums: {
      static const char* const names[4] = {"ref", "total", "tail_ref", "tail"};
      msg << "log_sums " << (p.entry >= 0 && p.entry < 4 ? names[p.entry] : "?") << " (entry " << p.entry << ") is "
          << number_text(p.value)
          << ": ref and total must be finite, tail_ref -inf or finite and not above ref, the tail "
             "finite with it and its mass not above the total (sparsify_finalize's log_sums, "
             "{ref, total, tail_ref, tail} a row)";
      return type::domain;
    }
    case e::bad_tail_max:
      msg << "tail_max is NaN or +inf (sparsify_finalize's tail_max)";
      return type::domain;
    case e::tail_above_max:
      msg << "shard token " << p.entry << " (outside the support) has logit " << p.value
          << ", above tail_max: tail_max must be at least every tail logit of the row (sparsify_finalize's "
             "tail_max for these rows and this support)";
      return type::domain;
    case e::state_bad_k:
      msg << state << "the state has k = " << num(p.value) << " outside [1, " << sparsify_max_k
          << "] (a row sparsify_shard rejected, or not a sparsify_state)";
      return type::shape;
    case e::state_bad_size:
      msg << state << "the state's heap size " << num(p.value) << " is negative or exceeds k or the tokens it covers";
      return type::shape;
    case e::state_bad_vocab:
      msg << state << "the state's vocabulary size " << num(p.value) << " is not positive";
      return type::shape;
    case e::state_bad_ranges:
      if (p.entry < 0)
        msg << state << "the state's range count " << num(p.value) << " is not in [1, " << sparsify_max_ranges << "]";
      else
        msg << state << "covered range " << entry << " (begin " << num(p.value)
            << ") is empty, outside [0, V), or not sorted apart from the previous one";
      return type::shape;
    case e::state_bad_sampled:
      msg << state << "the state's sampled token " << num(p.value) << " is outside [-1, V) or held without being covered";
      return type::shape;
    case e::state_sampled_logit:
      msg << state << "the sampled token's logit is " << num(p.value) << " (NaN or +inf)";
      return type::domain;
    case e::state_sampled_unseen:
      msg << state << "the state covers the sampled token " << num(p.value) << " but does not hold it";
      return type::domain;
    case e::state_heap_logit:
      msg << state << "heap entry " << entry << " has logit " << num(p.value) << " (not finite)";
      return type::domain;
    case e::state_heap_index:
      msg << state << "heap entry " << entry << " has token id " << num(p.value)
          << ", which the state does not cover (or the sampled token)";
      return type::shape;
    case e::state_heap_duplicate:
      msg << state << "heap entry " << entry << " repeats token id " << num(p.value);
      return type::shape;
    case e::state_heap_order:
      msg << state << "heap entry " << entry << " (token " << num(p.value)
          << ") ranks after its parent: the heap order is broken";
      return type::shape;
    case e::state_bad_outside:
      msg << state << "the outside log-sum (max " << num(p.value)
          << ") is NaN, infinite, badly scaled, or ranks above the heap";
      return type::domain;
    case e::state_k_mismatch:
      msg << state << "the states were made with different k (other: " << num(p.value) << ")";
      return type::invalid;
    case e::state_sampled_mismatch:
      msg << state << "the states were made with different sampled tokens (other: " << num(p.value) << ")";
      return type::invalid;
    case e::state_vocab_mismatch:
      msg << state << "the state was made for a vocabulary of " << num(p.value)
          << " tokens, not the one it is combined with";
      return type::shape;
    case e::state_overlap:
      msg << state << "both states cover token " << num(p.value) << " (the same shard merged twice, or overlapping shards)";
      return type::invalid;
    case e::state_too_many_ranges:
      msg << state << "the merged state would cover " << num(p.value) << " disjoint token ranges, more than "
          << sparsify_max_ranges << " (merge adjacent shards first)";
      return type::invalid;
    case e::state_incomplete:
      msg << state << "the state covers " << entry << " tokens of the vocabulary, not all of them (token "
          << num(p.value) << " is missing: not every shard was merged)";
      return type::invalid;
    // ---- objectives ----
    case e::token_range:
      msg << "sampled token " << ll(p.value) << " is outside [0, V)";
      return type::domain;
    case e::bad_advantage:
      msg << "advantage is " << p.value << " (must be finite)";
      return type::domain;
    case e::bad_mask:
      msg << "loss mask is " << p.value << " (must be finite and >= 0)";
      return type::domain;
    case e::sequence_order:
      msg << "sequence id " << ll(p.value) << " is smaller than the previous row's (ids must be non-decreasing)";
      return type::domain;
    case e::old_token_masked:
      msg << "old_logits is -inf at the sampled token " << ll(p.value)
          << ": q_a = 0 and the importance ratio is undefined";
      return type::domain;
    case e::objective_overflow:
      msg << "the " << p.quantity << " at sampled token " << p.entry << " overflows " << p.type_name;
      if (p.value == p.value) {
        msg << ": its importance ratio is exp(" << p.value << ") (log pi_new - log q_old)";
        // Half the type's log range: a ratio above it is itself the problem; below it, the other
        // factors (the advantage, the loss weight, the upstream grad_loss) must be near the top
        // of the range for the product to overflow.
        const double half_range = p.type_name[0] == 'f' ? 44.0 : 354.0;
        if (p.value > half_range)
          msg << "; a token this unlikely under the old policy was not sampled from it (check the tokens "
                 "and the old logits)";
        else
          msg << ", which fits; the overflow comes from the size of the advantage, the loss weight (mask) or "
                 "the upstream gradient grad_loss it is multiplied by";
      }
      return type::domain;
    case e::regression_inf:
      msg << "new_logits put mass on tokens the old logits mask (-inf), so KL(p_new || pi*) is "
             "+inf; use alpha = 0 or mask those tokens in the new logits too";
      return type::domain;
    case e::objective_capacity:
      msg << "aligned and log_probs have capacity k_max = " << ll(p.other)
          << " but the row needs up to min(V, |S_old| + new_support.k) = " << ll(p.value) << " entries (at most "
          << sparse_max_entries << ")";
      return type::shape;
    case e::not_in_support:
      msg << "sampled token " << ll(p.value)
          << " is not in the old row's support: the ratio needs its exact old log-probability (sparsify the old "
             "row with the sampled token; sparsify always keeps it)";
      return type::domain;
    case e::not_in_aligned:
      msg << "sampled token " << ll(p.value)
          << " is not in the aligned support U (pass the aligned rows that objective_forward wrote)";
      return type::domain;
    case e::old_entry_masked:
      msg << "the old row's log-probability at the sampled token " << ll(p.value)
          << " is -inf: q_a = 0 and the importance ratio is undefined";
      return type::domain;
    case e::log_probs_mismatch:
      if (p.entry < 0)
        msg << "log_probs has " << ll(p.value) << " entries but the aligned row has " << ll(p.other);
      else
        msg << "log_probs entry " << p.entry << " holds token " << ll(p.value) << " but the aligned row holds token "
            << ll(p.other);
      msg << " (pass the log_probs and aligned rows objective_forward wrote)";
      return type::shape;
    case e::none:
    case e::bad_log_probs:  // the device's; its translation names the CPU's code
    case e::state_invalid:
    default:
      break;
  }
  msg << "unknown problem (row_error " << static_cast<int>(p.kind) << ")";
  return type::invalid;
}

}  // namespace problem_text

/// Throws the troll exception describing `p` at `row` of a call to `function`: the one message
/// table of both backends.
[[noreturn]] inline void throw_row_problem(const char* function, std::size_t row, const row_problem& p) {
  std::ostringstream msg;
  msg.precision(17);
  msg << row_prefix(function, row);
  const problem_text::type t = problem_text::write(msg, p);
  switch (t) {
    case problem_text::type::shape: throw shape_error(msg.str(), row, p.kind);
    case problem_text::type::domain: throw domain_error(msg.str(), row, p.kind);
    case problem_text::type::infeasible: throw infeasible_error(msg.str(), row, p.kind);
    case problem_text::type::invalid: break;
  }
  throw invalid_input(msg.str(), row, p.kind);
}

}  // namespace detail
TROLL_END_NAMESPACE
