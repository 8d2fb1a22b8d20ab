// troll/detail/cuda/sparse_objective_report.cuh — the sparse objective's checked-mode translation of a device
// report into the CPU's exception and message.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../../errors.hpp"
#include "../../objective_types.hpp"
#include "../../sparse_objective_types.hpp"
#include "../row_problem.hpp"
#include "row_report.cuh"
#include "sparse_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Checked mode: a device report of a sparse objective row becomes the CPU's exception.
/// `capacity` is min(aligned.k_max, log_probs.k_max) (the forward's capacity message).
template <class Sparse = sparse_thrower>
struct throw_sparse_objective_report {
  bool backward = false;
  long long capacity = 0;

  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const* /*operand names*/) const {
    using k = objective_problem::kind;
    const long long value = static_cast<long long>(report.value);
    objective_problem p;
    p.value = report.value;
    switch (report.error) {
      case cuda_row_error::bad_sampled: p.what = k::token_range; break;
      case cuda_row_error::bad_advantage: p.what = k::advantage; break;
      case cuda_row_error::bad_mask: p.what = k::mask; break;
      case cuda_row_error::sequence_order: p.what = k::sequence_order; break;
      case cuda_row_error::regression_inf: p.what = k::regression_inf; break;
      case cuda_row_error::objective_overflow:
        throw_objective_problem(function, row,
                                overflow_problem(report.operand, report.value, static_cast<std::int64_t>(report.token)));
      case cuda_row_error::old_token_masked: throw_old_entry_masked(function, row, value);
      case cuda_row_error::objective_capacity: throw_objective_capacity(function, row, value, capacity);
      case cuda_row_error::not_in_support: throw_not_in_support(function, row, value);
      case cuda_row_error::not_in_aligned: throw_not_in_aligned(function, row, value);
      case cuda_row_error::log_probs_mismatch:
        throw_log_probs_mismatch(function, row, report.token == ~0ull ? -1 : static_cast<long long>(report.token),
                                 value, report.operand);
      case cuda_row_error::nan_value:
      case cuda_row_error::pos_inf:
      case cuda_row_error::all_masked:
      case cuda_row_error::disjoint:
      case cuda_row_error::infeasible: {
        // Operand 0: the dense new logits; 2 and 3: the lumped rows (sparse_operand).
        static const char* const names[4] = {"new_logits", "new_logits", "new (lumped)", "old (lumped)"};
        row_problem q;
        q.kind = report.error == cuda_row_error::nan_value  ? problem_kind::nan_value
                 : report.error == cuda_row_error::pos_inf  ? problem_kind::pos_inf
                 : report.error == cuda_row_error::disjoint ? problem_kind::disjoint
                 : report.error == cuda_row_error::infeasible ? problem_kind::infeasible
                                                              : problem_kind::all_masked;
        q.operand = names[report.operand >= 0 && report.operand < 4 ? report.operand : 0];
        q.token = static_cast<std::size_t>(report.token);
        q.value = report.value;
        throw_problem(function, row, q);
      }
      case cuda_row_error::bad_stats: {
        static const char* const names[3] = {"", "", ""};
        throw_report(function, row, report, names);
      }
      default: {
        const Sparse sparse{{backward ? "aligned (new side)" : "new_logits",
                                     backward ? "aligned (old side)" : "old", "new (lumped)", "old (lumped)",
                                     "log_probs", nullptr, nullptr, nullptr},
                                    0};
        sparse(function, row, report, nullptr);
      }
    }
    throw_objective_problem(function, row, p);
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
