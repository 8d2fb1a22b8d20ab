// troll/detail/cuda/objective_report.cuh — checked mode for the objectives: a device report of an
// objective row becomes the CPU's row_problem and is thrown through the one message table
// (detail/row_problem.hpp). Host code; no kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../row_problem.hpp"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The CPU's record of a device report of a token-level check (an out-of-range sampled token is
/// the objective's token_range; the overflow names its quantity); a dense row's for every other
/// code (dense_problem, `operand_names` as there).
inline row_problem objective_report_problem(const cuda_row_report& report, const char* const operand_names[3]) {
  switch (report.error) {
    case row_error::bad_sampled: return make_problem(row_error::token_range, "", 0, report.value);
    case row_error::bad_advantage:
    case row_error::bad_mask:
    case row_error::sequence_order:
    case row_error::old_token_masked:
    case row_error::regression_inf:
      return make_problem(report.error, "", 0, report.value);
    case row_error::objective_overflow:
      return overflow_problem(report.operand, report.value, static_cast<std::int64_t>(report.token));
    default:
      return dense_problem(report, operand_names);
  }
}

/// Checked mode: a device report of a dense objective row becomes the CPU's exception.
struct throw_objective_report {
  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const operand_names[3]) const {
    throw_translated(function, row, report, objective_report_problem(report, operand_names));
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
