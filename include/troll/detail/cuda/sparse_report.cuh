// troll/detail/cuda/sparse_report.cuh — the translation of a sparse entry point's device report into
// the CPU's row_problem (thrown through the one message table), and the launch helper of the sparse
// entry points.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../../errors.hpp"
#include "../row_problem.hpp"
#include "../sparse_row.hpp"
#include "../sparse_arguments.hpp"
#include "../../sparse_types.hpp"
#include "launch.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The CPU's record of a sparse entry point's device report: names[o] is the CPU's name of
/// operand o (see sparse_operand; null: none), `vocab` serves bad_sampled. Sparse-row codes keep
/// their code (`token` is the entry, ~0 the log-remainder), the state and shard codes add their
/// second number, state_invalid becomes the state's own code, and the rest are a dense row's.
inline row_problem sparse_report_problem(const cuda_row_report& report, const char* const names[8],
                                         std::size_t vocab) {
  const int o = report.operand >= 0 && report.operand < 8 && report.error != cuda_row_error::sparse_wrong_token
                    ? report.operand
                    : 0;
  const char* name = names[o] != nullptr ? names[o] : "";
  row_problem p = make_problem(report.error, name, static_cast<long long>(report.token), report.value);
  switch (report.error) {
    case row_error::sparse_count:
    case row_error::sparse_index:
    case row_error::sparse_duplicate:
    case row_error::sparse_nan:
    case row_error::sparse_above_one:
    case row_error::sparse_no_tail:
    case row_error::sparse_no_mass:
    case row_error::sparse_masked_mass:
    case row_error::sparse_capacity:
    case row_error::state_mismatch:
    case row_error::state_k:
    case row_error::state_capacity:
    case row_error::sampled_missing:
    case row_error::no_support:
    case row_error::bad_state:
    case row_error::bad_tail_max:
    case row_error::tail_above_max:
      return p;
    case row_error::sparse_not_aligned:
      if (p.entry < 0) p.entry = 0;
      return p;
    case row_error::sparse_mass:
      p.other = report.token == sizeof(float) ? sparse_mass_tolerance<float>() : sparse_mass_tolerance<double>();
      return p;
    case row_error::sparse_wrong_token:
      p.operand = "log_probs";
      p.other = static_cast<double>(report.operand);
      return p;
    case row_error::bad_log_sums:
      p.entry = report.operand;
      return p;
    case row_error::bad_sampled:
      p.other = static_cast<double>(vocab);
      return p;
    case row_error::state_invalid: {
      const int which = report.operand / 32 == 1 ? 1 : 0;
      p.kind = state_error(report.operand % 32);
      p.operand = names[which] != nullptr ? names[which] : "";
      return p;
    }
    default: {  // bad_stats (every field, kl_after included) and the dense codes
      const char* const dense_names[3] = {name, name, name};
      return dense_problem(report, dense_names);
    }
  }
}

/// Checked mode of the sparse entry points: a device report becomes the CPU's exception.
struct sparse_thrower {
  const char* names[8];
  std::size_t vocab = 0;

  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const* /*dense names*/) const {
    throw_translated(function, row, report, sparse_report_problem(report, names, vocab));
  }
};

/// Launches a warp-per-row kernel: `launch(shape, rows, device_checks)`.
template <class Launch>
void run_sparse(const char* function, cudaStream_t stream, std::size_t rows, const cuda_checks& checks,
                const sparse_thrower& thrower, const Launch& launch) {
  static const char* const unused[3] = {"", "", ""};
  run(function, stream, rows, checks, unused, launch, thrower);
}

inline std::size_t larger(std::size_t a, std::size_t b) { return a < b ? b : a; }

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
