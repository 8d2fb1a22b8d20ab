// troll/cuda_report.hpp — how the CUDA backend tells the caller about a rejected input row: the
// per-row report word (cuda_row_error, cuda_row_report) and the validation controls a cuda_policy
// carries (cuda_checks). Host-only declarations: no CUDA headers are needed to name them.
#pragma once

#include "config.hpp"

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
  bad_log_sums = 34,       ///< sparsify_shard_backward: log_sums entry `operand` (0 ref, 1 total, 2 tail) = `value` unusable: domain_error
  bad_tail_max = 35,       ///< sparsify_tail_sums: tail_max is `value` (NaN or +inf): domain_error
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

/// Device-side validation controls, carried by the policy (troll::cuda.on(s).checked(),
/// .reporting(reports, first_bad_row) or .with_checks(checks)).
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

TROLL_END_NAMESPACE
