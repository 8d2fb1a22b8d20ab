// troll/detail/cuda/sparse_objective_report.cuh — the sparse objective's checked-mode translation of a
// device report into the CPU's row_problem, thrown through the one message table
// (detail/row_problem.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../row_problem.hpp"
#include "objective_report.cuh"
#include "row_report.cuh"
#include "sparse_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The CPU's record of a device report of a sparse objective row: the dense new logits' and the
/// lumped rows' codes (operands 0: new_logits, 2 and 3: the lumped rows), the sparse objective's
/// own codes, the token-level checks (objective_report_problem) and the sparse rows'
/// (sparse_report_problem, operands as the entry point names them). `capacity` is
/// min(aligned.k_max, log_probs.k_max) (the forward's capacity message).
inline row_problem sparse_objective_report_problem(const cuda_row_report& report, long long capacity,
                                                   bool backward) {
  static const char* const no_names[3] = {"", "", ""};
  switch (report.error) {
    case row_error::nan_value:
    case row_error::pos_inf:
    case row_error::all_masked:
    case row_error::disjoint:
    case row_error::infeasible: {
      static const char* const names[4] = {"new_logits", "new_logits", "new (lumped)", "old (lumped)"};
      return make_problem(report.error, names[report.operand >= 0 && report.operand < 4 ? report.operand : 0],
                          static_cast<long long>(report.token), report.value);
    }
    case row_error::old_token_masked:  // the dense objective's code, as the device reported it before
    case row_error::old_entry_masked: return make_problem(row_error::old_entry_masked, "", 0, report.value);
    case row_error::objective_capacity:
      return make_problem(row_error::objective_capacity, "", 0, report.value, static_cast<double>(capacity));
    case row_error::not_in_support:
    case row_error::not_in_aligned:
      return make_problem(report.error, "", 0, report.value);
    case row_error::log_probs_mismatch:
      return make_problem(row_error::log_probs_mismatch, "",
                          report.token == ~0ull ? -1 : static_cast<long long>(report.token), report.value,
                          static_cast<double>(report.operand));
    case row_error::bad_sampled:
    case row_error::bad_advantage:
    case row_error::bad_mask:
    case row_error::sequence_order:
    case row_error::regression_inf:
    case row_error::objective_overflow:
      return objective_report_problem(report, no_names);
    case row_error::bad_stats: return dense_problem(report, no_names);
    default: {
      const char* const names[8] = {backward ? "aligned (new side)" : "new_logits",
                                    backward ? "aligned (old side)" : "old",
                                    "new (lumped)",
                                    "old (lumped)",
                                    "log_probs",
                                    nullptr,
                                    nullptr,
                                    nullptr};
      return sparse_report_problem(report, names, 0);
    }
  }
}

/// Checked mode: a device report of a sparse objective row becomes the CPU's exception.
struct throw_sparse_objective_report {
  bool backward = false;
  long long capacity = 0;

  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const* /*operand names*/) const {
    throw_translated(function, row, report, sparse_objective_report_problem(report, capacity, backward));
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
