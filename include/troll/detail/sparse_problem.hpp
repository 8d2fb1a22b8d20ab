// troll/detail/sparse_problem.hpp — what can be wrong with one sparse row and the one message table
// for it: the CPU checks fill a sparse_problem, the CUDA backend's checked mode turns a device report
// into one (detail/cuda/sparse_report.cuh), and both throw through throw_sparse_problem, so the two
// backends' messages cannot drift apart. Host-only, no Eigen.
#pragma once

#include <cstddef>
#include <sstream>
#include <string>

#include "../config.hpp"
#include "../errors.hpp"
#include "../sparsify_state.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// What can be wrong with one sparse row.
enum class sparse_problem_kind {
  none,
  count_range,         // count < 0, > capacity, > V or > sparse_max_entries (value = count)
  index_range,         // indices[entry] outside [0, V) (value = index)
  duplicate,           // indices[entry] repeats an earlier entry (value = index)
  nan_value,           // log_probs[entry] is NaN (entry = −1: the remainder)
  above_one,           // log_probs[entry] > 0 (entry = −1: the remainder)
  remainder_no_tail,   // count = V but the remainder has mass
  no_mass,             // every log-prob and the remainder are −inf
  not_aligned,         // an entry of a sparse row is missing from the aligned support
  mass,                // Σ_S p_i + r is `value`, off 1 by more than sparse_mass_tolerance<T>()
  wrong_token,         // entry holds token id `value` where the aligned rows hold `other`
  masked_mass,         // log π* at entry is `value` > −inf where a side is −inf (backward)
};

struct sparse_problem {
  sparse_problem_kind kind = sparse_problem_kind::none;
  const char* operand = "";
  long long entry = 0;
  double value = 0.0;
  double other = 0.0;  // mass: the tolerance the row missed; wrong_token: the expected id

  explicit operator bool() const { return kind != sparse_problem_kind::none; }
};

/// The exception of a sparse-row problem, naming the row, the operand and the entry.
[[noreturn]] inline void throw_sparse_problem(const char* function, std::size_t row,
                                              const sparse_problem& p) {
  std::ostringstream msg;
  msg.precision(17);
  msg << row_prefix(function, row) << p.operand;
  const auto where = [&]() -> std::string {
    return p.entry < 0 ? std::string(" log_remainder") : " entry " + std::to_string(p.entry);
  };
  switch (p.kind) {
    case sparse_problem_kind::count_range:
      msg << ": count " << p.value << " is negative or exceeds the capacity k_max, the "
          << "vocabulary or " << sparse_max_entries << " entries";
      throw shape_error(msg.str(), row);
    case sparse_problem_kind::index_range:
      msg << ": entry " << p.entry << " has token index " << p.value
          << " outside the vocabulary [0, V)";
      throw shape_error(msg.str(), row);
    case sparse_problem_kind::duplicate:
      msg << ": entry " << p.entry << " repeats token index " << p.value
          << " (support indices must be distinct)";
      throw shape_error(msg.str(), row);
    case sparse_problem_kind::nan_value:
      msg << where() << " is NaN";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::above_one:
      msg << where() << " is " << p.value << " > 0 (a probability above 1)";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::remainder_no_tail:
      msg << ": the support covers the whole vocabulary but log_remainder is " << p.value
          << " (the bucket is empty; it must be -inf)";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::no_mass:
      msg << ": every log-probability and the remainder are -inf (the row has no mass)";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::not_aligned:
      msg << ": entry " << p.entry << " (token " << p.value
          << ") is missing from the aligned support";
      throw shape_error(msg.str(), row);
    case sparse_problem_kind::masked_mass:
      msg << where() << " is " << p.value
          << " where the new or old side is -inf: not the projection's output for these rows";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::wrong_token:
      msg << ": entry " << p.entry << " holds token " << p.value << " where the aligned rows hold token "
          << p.other << " (log_probs must be project()'s output for these rows)";
      throw shape_error(msg.str(), row);
    case sparse_problem_kind::mass:
      msg << ": the probabilities sum to " << p.value << " (support plus remainder), more than "
          << p.other
          << " from 1: not a normalised row";
      throw domain_error(msg.str(), row);
    case sparse_problem_kind::none:
      break;
  }
  throw invalid_input(msg.str() + ": unknown problem", row);
}

/// Which of sparsify_finalize's log-sums of a row ({ref, total, tail_ref, tail}, row_log_sums)
/// keeps sparsify_shard_backward from using them, or −1 when none does: ref and total finite;
/// tail_ref −inf (no tail mass, then tail −inf too) or finite and not above ref; a finite tail
/// with a finite tail_ref; the tail's mass ((tail_ref − ref) + tail) not above the total.
TROLL_HOST_DEVICE inline int log_sums_problem(const double* sums) {
  if (!(sums[0] - sums[0] == 0.0)) return 0;
  if (!(sums[1] - sums[1] == 0.0)) return 1;
  if (sums[2] != sums[2] || sums[2] > sums[0]) return 2;
  if (sums[2] == neg_inf()) return sums[3] == neg_inf() ? -1 : 3;
  if (!(sums[3] - sums[3] == 0.0) || ((sums[2] - sums[0]) + sums[3]) > sums[1]) return 3;
  return -1;
}

/// The exception of a row whose log-sums are not usable (sparsify_shard_backward, both backends):
/// `entry` (0 ref, 1 total, 2 tail) holds `value`.
[[noreturn]] inline void throw_bad_log_sums(const char* function, std::size_t row, int entry, double value) {
  static const char* const names[4] = {"ref", "total", "tail_ref", "tail"};
  const char* name = entry >= 0 && entry < 4 ? names[entry] : "?";
  throw domain_error(row_prefix(function, row) + "log_sums " + name + " (entry " + std::to_string(entry) + ") is " +
                         std::to_string(value) +
                         ": ref and total must be finite, tail_ref -inf or finite and not above ref, the tail "
                         "finite with it and its mass not above the total (sparsify_finalize's log_sums, "
                         "{ref, total, tail_ref, tail} a row)",
                     row);
}

/// The exception of a row whose tail_max (sparsify_finalize's first stage) is NaN or +inf
/// (sparsify_tail_sums, both backends).
[[noreturn]] inline void throw_bad_tail_max(const char* function, std::size_t row) {
  throw domain_error(row_prefix(function, row) + "tail_max is NaN or +inf (sparsify_finalize's tail_max)", row);
}

/// The CPU kernels' names for the same types (detail::cpu::sparse_problem, ...).
namespace cpu {
using detail::sparse_problem;
using detail::sparse_problem_kind;
}  // namespace cpu

}  // namespace detail
TROLL_END_NAMESPACE
