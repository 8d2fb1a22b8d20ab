// troll/detail/cuda/sparse_report.cuh — the translation of a sparse entry point's device report into
// the CPU backend's exception and message, and the launch helper of the sparse entry points.
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
#include "../sparse_problem.hpp"
#include "../sparse_row.hpp"
#include "../../sparse_types.hpp"
#include "launch.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The sparse_problem of a device report of a sparse-row check (codes sparse_count ... sparse_mass,
/// sparse_masked_mass, sparse_wrong_token): `token` is the entry (~0: the log-remainder).
inline sparse_problem as_sparse_problem(const cuda_row_report& report, const char* name) {
  sparse_problem p;
  p.operand = name;
  p.entry = static_cast<long long>(report.token);
  p.value = report.value;
  using k = sparse_problem_kind;
  static constexpr code_kind<k> kinds[] = {
      {cuda_row_error::sparse_count, k::count_range},        {cuda_row_error::sparse_index, k::index_range},
      {cuda_row_error::sparse_duplicate, k::duplicate},      {cuda_row_error::sparse_nan, k::nan_value},
      {cuda_row_error::sparse_above_one, k::above_one},      {cuda_row_error::sparse_no_tail, k::remainder_no_tail},
      {cuda_row_error::sparse_no_mass, k::no_mass},          {cuda_row_error::sparse_not_aligned, k::not_aligned},
      {cuda_row_error::sparse_mass, k::mass},                {cuda_row_error::sparse_masked_mass, k::masked_mass},
      {cuda_row_error::sparse_wrong_token, k::wrong_token}};
  p.kind = kind_of(report.error, kinds, k::none);
  if (p.kind == k::not_aligned && p.entry < 0) p.entry = 0;
  if (p.kind == k::mass)
    p.other = report.token == sizeof(float) ? sparse_mass_tolerance<float>() : sparse_mass_tolerance<double>();
  if (p.kind == k::wrong_token) {
    p.operand = "log_probs";
    p.other = static_cast<double>(report.operand);
  }
  return p;
}

/// Turns a sparse entry point's device report into the CPU backend's exception and message.
/// names[o] is the CPU's name of operand o (see sparse_operand); `vocab` serves bad_sampled.
struct sparse_thrower {
  const char* names[8];
  std::size_t vocab = 0;

  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const* /*dense names*/) const {
    const int o = report.operand >= 0 && report.operand < 8 && report.error != cuda_row_error::sparse_wrong_token
                      ? report.operand
                      : 0;
    const char* name = names[o] != nullptr ? names[o] : "";
    std::ostringstream msg;
    msg.precision(17);
    msg << row_prefix(function, row);
    const long long entry = static_cast<long long>(report.token);
    switch (report.error) {
      // Sparse-row problems: the CPU's record and message table (detail/sparse_problem.hpp).
      case cuda_row_error::sparse_count:
      case cuda_row_error::sparse_index:
      case cuda_row_error::sparse_duplicate:
      case cuda_row_error::sparse_nan:
      case cuda_row_error::sparse_above_one:
      case cuda_row_error::sparse_no_tail:
      case cuda_row_error::sparse_no_mass:
      case cuda_row_error::sparse_not_aligned:
      case cuda_row_error::sparse_mass:
      case cuda_row_error::sparse_masked_mass:
      case cuda_row_error::sparse_wrong_token:
        throw_sparse_problem(function, row, as_sparse_problem(report, name));
      case cuda_row_error::bad_log_sums:
        throw_bad_log_sums(function, row, report.operand, report.value);
      case cuda_row_error::bad_tail_max:
        throw_bad_tail_max(function, row);
      case cuda_row_error::sparse_capacity:
        msg << "out has capacity " << report.token << " but the row has " << report.value << " entries";
        throw shape_error(msg.str(), row);
      case cuda_row_error::bad_sampled:
        msg << "sampled token " << static_cast<long long>(report.value) << " is outside the vocabulary [0, "
            << vocab << ")";
        throw domain_error(msg.str(), row);
      case cuda_row_error::state_mismatch:
        msg << "the two states were made with different k or sampled tokens";
        throw invalid_input(msg.str(), row);
      case cuda_row_error::state_k:
        msg << "the state was made with k = " << static_cast<long long>(report.value) << ", options.k is "
            << report.token;
        throw invalid_input(msg.str(), row);
      case cuda_row_error::state_capacity:
        msg << "out has capacity " << report.token << " but the row needs " << static_cast<long long>(report.value);
        throw shape_error(msg.str(), row);
      case cuda_row_error::sampled_missing:
        msg << "no shard held the sampled token " << static_cast<long long>(report.value);
        throw domain_error(msg.str(), row);
      case cuda_row_error::no_support:
        msg << "every logit is -inf (the row has no support)";
        throw domain_error(msg.str(), row);
      case cuda_row_error::bad_state:
        msg << name << ": the state has k = " << static_cast<long long>(report.value) << " and size = " << entry
            << " (k must be in [1, " << sparsify_max_k << "] and size in [0, k]: a row sparsify_shard rejected, or "
            << "not a sparsify_state)";
        throw invalid_input(msg.str(), row);
      case cuda_row_error::state_invalid: {
        const int which = report.operand / 32 == 1 ? 1 : 0;
        state_problem p;
        p.kind = static_cast<state_problem_kind>(report.operand % 32);
        p.entry = entry;
        p.value = report.value;
        throw_state_problem(function, row, names[which] != nullptr ? names[which] : "", p);
      }
      default:  // bad_stats (every field, kl_after included) and the dense codes
        break;
    }
    const char* dense_names[3] = {name, name, name};
    throw_report(function, row, report, dense_names);
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
