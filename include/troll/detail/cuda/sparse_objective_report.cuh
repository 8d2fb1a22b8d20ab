// troll/detail/cuda/sparse_objective_report.cuh — the sparse objective's checked-mode translation of a device
// report into the CPU's problem record and message table (detail/objective_problem.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../../errors.hpp"
#include "../objective_problem.hpp"
#include "../row_problem.hpp"
#include "objective_report.cuh"
#include "row_report.cuh"
#include "sparse_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The sparse_objective_problem of a device report of a sparse objective row: the token-level
/// checks (as_objective_problem), the sparse objective's own codes and the dense new logits' /
/// lumped rows' codes. Kind none for bad_stats and the sparse-row codes (sparse_thrower's).
/// `capacity` is min(aligned.k_max, log_probs.k_max) (the forward's capacity message).
inline sparse_objective_problem as_sparse_objective_problem(const cuda_row_report& report, long long capacity) {
  using k = sparse_objective_problem::kind;
  sparse_objective_problem p;
  p.value = static_cast<long long>(report.value);
  const problem_kind logits = logits_problem_kind(report.error);
  if (logits != problem_kind::none) {
    // Operand 0: the dense new logits; 2 and 3: the lumped rows (sparse_operand).
    static const char* const names[4] = {"new_logits", "new_logits", "new (lumped)", "old (lumped)"};
    p.what = k::token;
    p.token.what = objective_problem::kind::logits;
    row_problem& q = p.token.logits;
    q.kind = logits;
    q.operand = names[report.operand >= 0 && report.operand < 4 ? report.operand : 0];
    q.token = static_cast<std::size_t>(report.token);
    q.value = report.value;
    return p;
  }
  switch (report.error) {
    case cuda_row_error::old_token_masked: p.what = k::old_token_masked; return p;
    case cuda_row_error::objective_capacity:
      p.what = k::capacity;
      p.other = capacity;
      return p;
    case cuda_row_error::not_in_support: p.what = k::not_in_support; return p;
    case cuda_row_error::not_in_aligned: p.what = k::not_in_aligned; return p;
    case cuda_row_error::log_probs_mismatch:
      p.what = k::log_probs_mismatch;
      p.entry = report.token == ~0ull ? -1 : static_cast<long long>(report.token);
      p.other = report.operand;
      return p;
    default:
      p.token = as_objective_problem(report);
      p.what = p.token ? k::token : k::none;
      return p;
  }
}

/// Checked mode: a device report of a sparse objective row becomes the CPU's exception, through
/// the CPU's record and message table (throw_sparse_objective_problem); the sparse-row codes go to
/// the sparse entry points' translation (sparse_thrower, the same table as the CPU's sparse rows).
template <class Sparse = sparse_thrower>
struct throw_sparse_objective_report {
  bool backward = false;
  long long capacity = 0;

  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const* /*operand names*/) const {
    const sparse_objective_problem p = as_sparse_objective_problem(report, capacity);
    if (p) throw_sparse_objective_problem(function, row, p);
    if (report.error == cuda_row_error::bad_stats) {
      static const char* const names[3] = {"", "", ""};
      throw_report(function, row, report, names);
    }
    const Sparse sparse{{backward ? "aligned (new side)" : "new_logits", backward ? "aligned (old side)" : "old",
                         "new (lumped)", "old (lumped)", "log_probs", nullptr, nullptr, nullptr},
                        0};
    sparse(function, row, report, nullptr);
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
