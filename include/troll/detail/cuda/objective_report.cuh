// troll/detail/cuda/objective_report.cuh — checked mode for the objectives: a device report of an
// objective row becomes the CPU's problem record (detail/objective_problem.hpp) and is thrown
// through the CPU's message table. Host code; no kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../objective_problem.hpp"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The objective_problem of a device report of a token-level check (bad_sampled, bad_advantage,
/// bad_mask, sequence_order, old_token_masked, regression_inf, objective_overflow); a problem of
/// kind none for every other code.
inline objective_problem as_objective_problem(const cuda_row_report& report) {
  using k = objective_problem::kind;
  static constexpr code_kind<k> kinds[] = {
      {cuda_row_error::bad_sampled, k::token_range},       {cuda_row_error::bad_advantage, k::advantage},
      {cuda_row_error::bad_mask, k::mask},                 {cuda_row_error::sequence_order, k::sequence_order},
      {cuda_row_error::old_token_masked, k::old_token_masked}, {cuda_row_error::regression_inf, k::regression_inf}};
  if (report.error == cuda_row_error::objective_overflow)
    return overflow_problem(report.operand, report.value, static_cast<std::int64_t>(report.token));
  objective_problem p;
  p.value = report.value;
  p.what = kind_of(report.error, kinds, k::none);
  return p;
}

/// Checked mode: a device report of a dense objective row becomes the CPU's exception.
struct throw_objective_report {
  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const operand_names[3]) const {
    const objective_problem p = as_objective_problem(report);
    if (!p) throw_report(function, row, report, operand_names);
    throw_objective_problem(function, row, p);
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
