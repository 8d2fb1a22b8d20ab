// troll/row_error.hpp — why troll rejected one input row: one code set for both backends. The
// CPU backend's checks and the CUDA backend's per-row reports (troll/cuda_report.hpp) name a
// rejected row by the same code, every exception about a row carries it (invalid_input::code()),
// and one message table (detail/row_problem.hpp) turns a code into the exception and its text.
// The numbers are stable: device reports store them.
#pragma once

#include "config.hpp"

TROLL_BEGIN_NAMESPACE

/// Why a row was rejected (0: it was not). `operand`, `entry` and `value` refer to the fields
/// of a CUDA report (cuda_row_report) or of the CPU's record; the exception each code becomes
/// is given after the colon.
enum class row_error : int {
  none = 0,
  // Dense rows (logits, log-probabilities, upstream gradients).
  nan_value = 1,     ///< NaN in `operand` at token `entry` (an upstream gradient or tangent: `value`, NaN or ±inf; `entry` −1 for grad_kl): domain_error
  pos_inf = 2,       ///< +inf in `operand` at token `entry`: domain_error
  all_masked = 3,    ///< every entry of `operand` is −inf: domain_error
  disjoint = 4,      ///< new and old logits share no finite token: infeasible_error
  infeasible = 5,    ///< the trust region holds no reachable π; `value` is the least KL(π‖q): infeasible_error
  bad_stats = 6,     ///< projection_stats unusable in a backward pass (device: `operand` names the field): domain_error
  not_finite = 7,    ///< (device) an upstream gradient is `value` (NaN or ±inf) in `operand` at `entry` (−1: grad_kl): domain_error
  // Sparse rows: `entry` is the entry (device ~0, CPU −1: the log-remainder).
  sparse_count = 8,       ///< count negative or above k_max, V or sparse_max_entries (`value`): shape_error
  sparse_index = 9,       ///< entry `entry` holds token id `value` outside [0, V): shape_error
  sparse_duplicate = 10,  ///< entry `entry` repeats token id `value`: shape_error
  sparse_nan = 11,        ///< entry `entry` is NaN (of a gradient: `value`, NaN or ±inf): domain_error
  sparse_above_one = 12,  ///< entry `entry` is `value` > 0: domain_error
  sparse_no_tail = 13,    ///< the support covers V but the remainder is `value` > −inf: domain_error
  sparse_no_mass = 14,    ///< every entry and the remainder are −inf: domain_error
  sparse_not_aligned = 15,  ///< entry `entry` (token id `value`) is not in the aligned support: shape_error
  sparse_capacity = 16,   ///< the output holds `entry` entries, the row has `value`: shape_error
  bad_sampled = 17,       ///< the sampled token `value` is outside the vocabulary [0, V): domain_error
  // Objective rows.
  bad_mask = 18,          ///< the loss mask is `value` (NaN, infinite or negative): domain_error
  bad_advantage = 19,     ///< the advantage is `value` (NaN or infinite): domain_error
  sequence_order = 20,    ///< sequence id `value` is below the previous row's: domain_error
  old_token_masked = 21,  ///< old_logits is −inf at the sampled token `value`: domain_error
  regression_inf = 22,    ///< new logits have mass where old ones mask, α > 0: domain_error
  // Vocabulary-shard states and align_backward.
  state_mismatch = 23,    ///< (device) sparsify_merge: the states differ in k or sampled token: invalid_input
  state_k = 24,           ///< sparsify_finalize: the state's k is `value`, not options.k: invalid_input
  state_capacity = 25,    ///< sparsify_finalize: out holds `entry` entries, the row needs `value`: shape_error
  sampled_missing = 26,   ///< sparsify_finalize: no shard held the sampled token `value`: domain_error
  no_support = 27,        ///< sparsify_finalize: every logit of the row is −inf: domain_error
  bad_state = 28,         ///< (device) a state with k `value` and size `entry` out of range: invalid_input
  bad_log_probs = 29,     ///< (device) a derivative's log_probs is `value` at `entry`: NaN, +inf, > 0, finite where
                          ///< a logit is −inf, or −inf where both are finite (the CPU names which: nan_value,
                          ///< pos_inf, above_zero, masked_mass, log_prob_underflow)
  state_invalid = 30,     ///< (device) sparsify_merge / _finalize: state problem `operand` % 32 of state `operand` / 32
                          ///< (0 into / states, 1 from), entry `entry`, `value` (the CPU names it: state_bad_k ...)
  sparse_mass = 31,       ///< Σ_S p + r is `value`, beyond sparse_mass_tolerance<T>: domain_error
  sparse_wrong_token = 32,  ///< log_probs entry `entry` holds token id `value` where the aligned rows hold another: shape_error
  sparse_masked_mass = 33,  ///< backward: log_probs entry `entry` is `value` > −inf where a side is −inf: domain_error
  bad_log_sums = 34,      ///< sparsify_shard_backward: log_sums entry `operand` (0 ref, 1 total, 2 tail_ref, 3 tail) unusable: domain_error
  bad_tail_max = 35,      ///< sparsify_tail_sums: tail_max is NaN or +inf: domain_error
  above_zero = 36,        ///< a log-probability in `operand` at token `entry` is `value` > 0: domain_error
  masked_mass = 37,       ///< `operand` is `value` > −inf at token `entry` where a logit is −inf: domain_error
  token_range = 38,       ///< an objective's sampled token `value` is outside [0, V): domain_error
  old_entry_masked = 39,  ///< the sparse old row's log-probability at the sampled token `value` is −inf: domain_error
  infinite_kl = 40,       ///< kl_backward: KL(p‖q) is +inf (p has mass where q is −inf), no gradient: domain_error
  // The sparse objective.
  objective_capacity = 46,  ///< aligned / log_probs hold fewer than min(V, |S_old| + new_k) = `value` entries: shape_error
  not_in_support = 47,      ///< the sampled token `value` is not in the old row's support: domain_error
  not_in_aligned = 48,      ///< backward: the sampled token `value` is not in U: domain_error
  log_probs_mismatch = 49,  ///< backward: log_probs entry `entry` (−1 / ~0: its count) is `value`, U has another: shape_error
  objective_overflow = 50,  ///< the ratio / loss / gradient at the sampled token overflows (`value` = log ρ): domain_error
  // A sparsify_state (sparsify_merge, sparsify_finalize): `entry` and `value` as commented.
  state_bad_k = 51,            ///< k outside [1, sparsify_max_k] (`value` = k): shape_error
  state_bad_size = 52,         ///< heap size `value` outside [0, k] or above the tokens covered: shape_error
  state_bad_vocab = 53,        ///< vocabulary size `value` not positive: shape_error
  state_bad_ranges = 54,       ///< covered range `entry` (−1: the range count `value`) malformed: shape_error
  state_bad_sampled = 55,      ///< the sampled id `value` is outside [−1, V), or held but not covered: shape_error
  state_sampled_logit = 56,    ///< the held sampled token's logit `value` is NaN or +inf: domain_error
  state_sampled_unseen = 57,   ///< the state covers the sampled token `value` but does not hold it: domain_error
  state_heap_logit = 58,       ///< heap entry `entry` has the non-finite logit `value`: domain_error
  state_heap_index = 59,       ///< heap entry `entry` holds token `value`, not covered (or the sampled one): shape_error
  state_heap_duplicate = 60,   ///< heap entry `entry` repeats token `value`: shape_error
  state_heap_order = 61,       ///< heap entry `entry` (token `value`) ranks after its parent: shape_error
  state_bad_outside = 62,      ///< the outside log-sum (max `value`) is unusable: domain_error
  state_k_mismatch = 63,       ///< merge: the states' k differ (`value` = the other k): invalid_input
  state_sampled_mismatch = 64, ///< merge: the states' sampled tokens differ (`value` = the other one): invalid_input
  state_vocab_mismatch = 65,   ///< the state was made for a vocabulary of `value` tokens: shape_error
  state_overlap = 66,          ///< merge: both states cover token `value`: invalid_input
  state_too_many_ranges = 67,  ///< merge: the union needs `value` ranges, more than sparsify_max_ranges: invalid_input
  state_incomplete = 68,       ///< finalize: token `value` is not covered (`entry` = tokens covered): invalid_input
  // Dense derivatives (after the state codes: codes keep their numbers across releases).
  log_prob_underflow = 69,  ///< `operand` is −inf at token `entry` where both logits are finite: its true log-probability is below the type's range: domain_error
  tail_above_max = 70,      ///< sparsify_tail_sums: shard token `entry`, outside the support, has logit `value` above tail_max: domain_error
};

TROLL_END_NAMESPACE
