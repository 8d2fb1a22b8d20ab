// troll/detail/cuda/row_report.cuh — how the CUDA backend reports a rejected input row without
// synchronising: a per-row report word in caller memory, the lowest rejected row in one device
// scalar, and (on the host) the translation of a report into the CPU backend's typed exception.
// The public types (troll::cuda_row_error, cuda_row_report, cuda_checks) live in
// <troll/cuda_report.hpp>.
#pragma once

#include <cstddef>
#include <string>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../../errors.hpp"
#include "../../projection_types.hpp"
#include "../numeric.hpp"
#include "../row_problem.hpp"
#include "error_check.cuh"

TROLL_BEGIN_NAMESPACE

namespace detail {
namespace cuda {

/// What the kernels receive: where to record, and whether to stop after validation.
struct device_checks {
  cuda_row_report* reports = nullptr;  // indexed by (row − first row of the launch)
  unsigned long long* first_bad_row = nullptr;
  bool validate_only = false;
};

/// Rows [begin, begin + count) of a batch: one launch covers one range.
struct row_range {
  std::size_t begin = 0;
  std::size_t count = 0;
};

constexpr unsigned long long no_bad_row = ~0ull;

#ifdef __CUDACC__
/// Records one row's outcome (called by thread 0 of the row's block).
__device__ inline void record_row(const device_checks& checks, const row_range& range, std::size_t row,
                                  const cuda_row_report& report) {
  if (checks.reports != nullptr) checks.reports[row - range.begin] = report;
  if (report.error != cuda_row_error::none && checks.first_bad_row != nullptr)
    atomicMin(checks.first_bad_row, static_cast<unsigned long long>(row));
}

/// The report of a counted token whose importance ratio, loss or gradient overflows
/// (detail::forward_overflow / backward_overflow give `operand`).
__device__ inline cuda_row_report overflow_report(int operand, double log_ratio, std::int64_t token) {
  cuda_row_report report;
  report.error = cuda_row_error::objective_overflow;
  report.operand = operand;
  report.value = log_ratio;
  report.token = static_cast<std::size_t>(token);
  return report;
}

/// A rejected row's output: NaN everywhere (called by the whole block; `out` may be null).
template <class T>
__device__ void fill_nan(T* out, std::size_t size) {
  if (out == nullptr) return;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) out[i] = static_cast<T>(quiet_nan());
}

/// The end of a row's checks in a kernel with one dense output: records the report (thread 0),
/// then true (the caller ends the row) in a validation-only launch, or for a rejected row once
/// row r of `out` (`size` entries) is NaN; false: the row goes on.
template <class T>
__device__ bool record_or_reject(const device_checks& checks, const row_range& range, std::size_t r,
                                 const cuda_row_report& report, batch_view<T> out, std::size_t size) {
  if (threadIdx.x == 0) record_row(checks, range, r, report);
  if (checks.validate_only) return true;
  if (report.error != cuda_row_error::none) {
    fill_nan(out.row(r), size);
    return true;
  }
  return false;
}
#endif

/// The CPU's record of a dense entry point's device report (one code set: mostly the same
/// code): operand_names[o] names operand o; bad_stats names the field, not_finite reads as the
/// CPU's nan_value, bad_log_probs becomes the CPU's own code for the value. Kind none for a code
/// that is not a dense row's.
inline row_problem dense_problem(const cuda_row_report& report, const char* const operand_names[3]) {
  static const char* const stats_fields[5] = {
      "t of a projected row is not in (0, 1]", "sigma2 of a projected row is not finite and > 0",
      "mu of a projected row is not finite", "status is not inactive, projected or restricted",
      "kl_after of a projected row is not finite and >= 0"};
  const int operand = report.operand >= 0 && report.operand < 3 ? report.operand : 0;
  row_problem p = make_problem(report.error, operand_names[operand], static_cast<long long>(report.token), report.value);
  switch (report.error) {
    case row_error::nan_value:
    case row_error::pos_inf:
    case row_error::all_masked:
    case row_error::disjoint:
    case row_error::infeasible:
    case row_error::infinite_kl:
      break;
    case row_error::bad_stats:
      p.operand = stats_fields[report.operand >= 0 && report.operand < 5 ? report.operand : 3];
      if (report.operand == 3 && report.value == double(static_cast<int>(row_status::not_converged)))
        p.operand = not_converged_stats;  // the status rides in `value` (report_unusable_stats)
      p.value = 0.0;
      break;
    case row_error::not_finite: p.kind = row_error::nan_value; break;
    case row_error::bad_log_probs:
      p.kind = report.value != report.value ? row_error::nan_value
               : report.value == inf()      ? row_error::pos_inf
               : report.value > 0.0         ? row_error::above_zero
               : report.value == neg_inf()  ? row_error::log_prob_underflow  // at a token both logits keep
                                            : row_error::masked_mass;
      p.operand = "log_probs";
      break;
    default: p.kind = row_error::none;
  }
  return p;
}

/// Throws the CPU's exception for `p`, or invalid_input naming an unknown device code.
[[noreturn]] inline void throw_translated(const char* function, std::size_t row, const cuda_row_report& report,
                                         const row_problem& p) {
  if (!p)
    throw invalid_input(row_prefix(function, row) + "unknown device error code " +
                            std::to_string(static_cast<int>(report.error)),
                        row);
  throw_row_problem(function, row, p);
}

/// The CPU backend's exception for a device report of a dense entry point, with the same message.
/// `operand_names` holds the names of operands 0, 1 and 2 of the calling entry point.
[[noreturn]] inline void throw_report(const char* function, std::size_t row, const cuda_row_report& report,
                                      const char* const operand_names[3]) {
  throw_translated(function, row, report, dense_problem(report, operand_names));
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
