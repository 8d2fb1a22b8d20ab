// troll/detail/cuda/row_report.cuh — how the CUDA backend reports a rejected input row without
// synchronising: a per-row report word in caller memory, the lowest rejected row in one device
// scalar, and (on the host) the translation of a report into the CPU backend's typed exception.
// The public names (troll::cuda_row_error, cuda_row_report, cuda_checks) are reached through
// <troll/cuda.cuh>.
#pragma once

#include <cstddef>
#include <string>

#include "../../config.hpp"
#include "../../errors.hpp"
#include "../numeric.hpp"
#include "../row_problem.hpp"
#include "error_check.cuh"

TROLL_BEGIN_NAMESPACE

/// Why the device rejected one row (0: it did not). Each value maps to the exception the CPU
/// backend throws for the same row: domain_error, except disjoint and infeasible
/// (infeasible_error).
enum class cuda_row_error : int {
  none = 0,
  nan_value = 1,     ///< NaN in `operand` at `token`
  pos_inf = 2,       ///< +inf in `operand` at `token`
  all_masked = 3,    ///< every entry of `operand` is −inf
  disjoint = 4,      ///< new and old logits share no finite token
  infeasible = 5,    ///< the trust region holds no reachable π; `value` is the least KL(π‖q)
  bad_stats = 6,     ///< projection_stats unusable in a backward pass; `operand` says which field
  not_finite = 7,    ///< an upstream gradient is NaN or ±inf in `operand` at `token`
  // Sparse rows (troll/cuda_sparse.cuh): `token` is the entry (~0: the log-remainder).
  sparse_count = 8,      ///< count negative or above k_max, V or 1024 (`value`): shape_error
  sparse_index = 9,      ///< entry `token` holds token id `value` outside [0, V): shape_error
  sparse_duplicate = 10, ///< entry `token` repeats token id `value`: shape_error
  sparse_nan = 11,       ///< entry `token` is NaN (of a gradient: NaN or ±inf): domain_error
  sparse_above_one = 12, ///< entry `token` is `value` > 0: domain_error
  sparse_no_tail = 13,   ///< the support covers V but the remainder is `value` > −inf: domain_error
  sparse_no_mass = 14,   ///< every entry and the remainder are −inf: domain_error
  sparse_not_aligned = 15,  ///< entry `token` (token id `value`) is not in the aligned support: shape_error
  sparse_capacity = 16,  ///< the output holds `token` entries, the row needs `value`: shape_error
  bad_sampled = 17,      ///< the sampled token `value` is outside [0, V): domain_error
  // Objective rows (troll/cuda_objectives.cuh), mirroring detail::objective_problem.
  bad_mask = 18,           ///< the loss mask is `value` (NaN, infinite or negative): domain_error
  bad_advantage = 19,      ///< the advantage is `value` (NaN or infinite): domain_error
  sequence_order = 20,     ///< sequence id `value` is below the previous row's: domain_error
  old_token_masked = 21,   ///< old_logits is −inf at the sampled token `value`: domain_error
  regression_inf = 22,     ///< new logits have mass where old ones mask, α > 0: domain_error
  // Vocabulary-shard states and align_backward (troll/cuda_sparse.cuh).
  state_mismatch = 23,     ///< sparsify_merge: the states differ in k or sampled token: invalid_input
  state_k = 24,            ///< sparsify_finalize: the state's k is `value`, not options.k: invalid_input
  state_capacity = 25,     ///< sparsify_finalize: out holds `token` entries, the row needs `value`: shape_error
  sampled_missing = 26,    ///< sparsify_finalize: no shard held the sampled token `value`: domain_error
  no_support = 27,         ///< sparsify_finalize: every logit of the row is −inf: domain_error
  bad_state = 28,          ///< a state with k or size (`value`) out of range (a rejected shard row): invalid_input
  bad_log_probs = 29,      ///< a derivative's log_probs is `value` at `token`: NaN, +inf, > 0, or finite where
                           ///< a logit is −inf: domain_error
  state_invalid = 30,      ///< sparsify_merge / _finalize: detail::state_problem_kind `operand` % 32 of state
                           ///< `operand` / 32 (0 into / states, 1 from), entry `token`, `value`: throw_state_problem
  sparse_mass = 31,        ///< Σ_S p + r is `value`, beyond sparse_mass_tolerance<T> (`token` = sizeof(T)): domain_error
  sparse_wrong_token = 32, ///< log_probs entry `token` holds token id `value`, the aligned rows `operand`: shape_error
  sparse_masked_mass = 33, ///< backward: log_probs entry `token` is `value` > −inf where the new or old side is −inf: domain_error
  // Dense derivatives (troll/cuda.cuh: kl_backward, project_jvp, project_jacobian).
  infinite_kl = 40,        ///< kl_backward: KL(p‖q) is +inf (p has mass where q is −inf), no gradient: domain_error
  // The sparse objective (troll/cuda_sparse_objectives.cuh), mirroring detail::sparse_objective_problem.
  objective_capacity = 46,    ///< aligned / log_probs hold fewer than min(V, |S_old| + new_k) = `value` entries: shape_error
  not_in_support = 47,        ///< the sampled token `value` is not in the old row's support: domain_error
  not_in_aligned = 48,        ///< backward: the sampled token `value` is not in U: domain_error
  log_probs_mismatch = 49,    ///< backward: log_probs entry `token` (~0: its count) is `value`, aligned has `operand`: shape_error
  objective_overflow = 50,    ///< the ratio / loss / gradient at the sampled token `token` overflows (`value` = log ρ,
                              ///< `operand` = detail::overflow_operand): domain_error
};

/// One row's validation outcome, written by every CUDA entry point that is given a report array.
/// `operand` indexes the entry point's arguments: 0 the first logits argument (logits, p_logits
/// or new_logits), 1 the second (q_logits or old_logits), 2 the upstream gradient. For bad_stats
/// it names the field instead: 0 t, 1 sigma2, 2 mu, 3 status, 4 kl_after.
struct cuda_row_report {
  cuda_row_error error = cuda_row_error::none;
  int operand = 0;
  unsigned long long token = 0;
  double value = 0.0;
};

/// Device-side validation controls, the optional last argument of every CUDA entry point.
///
/// * Default (all null, checked = false): rows are validated inside the kernels at no extra
///   pass; a rejected row gets NaN outputs (and projection_stats with NaN fields and status
///   infeasible) and nothing tells the host. Nothing synchronises.
/// * `reports`: device array of `rows` reports, one written per row (error none when the row is
///   fine). `first_bad_row`: one device word, reset with cudaMemsetAsync and lowered with
///   atomicMin to the lowest rejected row (all ones when none). Both are stream-ordered; the
///   caller reads them whenever it synchronises anyway.
/// * `checked = true`: a validation kernel runs first, the stream is synchronised and the first
///   rejected row is thrown as the CPU backend's typed exception, naming the row, before any
///   output is written. It allocates a few bytes with cudaMallocAsync and synchronises twice:
///   meant for debugging and tests, not for the training hot path.
struct cuda_checks {
  cuda_row_report* reports = nullptr;
  unsigned long long* first_bad_row = nullptr;
  bool checked = false;
};

/// `troll::cuda_checked`: the synchronising, throwing mode.
inline constexpr cuda_checks cuda_checked{nullptr, nullptr, true};

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
#endif

/// The CPU backend's exception for a device report, with the same message.
/// `operand_names` holds the names of operands 0, 1 and 2 of the calling entry point.
[[noreturn]] inline void throw_report(const char* function, std::size_t row, const cuda_row_report& report,
                                      const char* const operand_names[3]) {
  static const char* const stats_fields[5] = {
      "t of a projected row is not in (0, 1]", "sigma2 of a projected row is not finite and > 0",
      "mu of a projected row is not finite", "status is not inactive, projected or restricted",
      "kl_after of a projected row is not finite and >= 0"};
  const int operand = report.operand >= 0 && report.operand < 3 ? report.operand : 0;
  row_problem p;
  p.operand = operand_names[operand];
  p.token = static_cast<std::size_t>(report.token);
  p.value = report.value;
  switch (report.error) {
    case cuda_row_error::nan_value: p.kind = problem_kind::nan_value; break;
    case cuda_row_error::pos_inf: p.kind = problem_kind::pos_inf; break;
    case cuda_row_error::all_masked: p.kind = problem_kind::all_masked; break;
    case cuda_row_error::disjoint: p.kind = problem_kind::disjoint; break;
    case cuda_row_error::infeasible: p.kind = problem_kind::infeasible; break;
    case cuda_row_error::bad_stats:
      p.kind = problem_kind::bad_stats;
      p.operand = stats_fields[report.operand >= 0 && report.operand < 5 ? report.operand : 3];
      break;
    case cuda_row_error::not_finite: p.kind = problem_kind::nan_value; break;  // the CPU's wording
    case cuda_row_error::bad_log_probs:
      p.kind = report.value != report.value ? problem_kind::nan_value
               : report.value == inf()      ? problem_kind::pos_inf
               : report.value > 0.0         ? problem_kind::above_zero
                                            : problem_kind::masked_mass;
      p.operand = "log_probs";
      break;
    case cuda_row_error::none:
    default:
      throw invalid_input(row_prefix(function, row) + "unknown device error code " +
                              std::to_string(static_cast<int>(report.error)),
                          row);
  }
  throw_problem(function, row, p);
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
