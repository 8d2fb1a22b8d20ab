// troll/cuda_sparse.cuh — the CUDA backend of the sparse path (math.md §4, troll/sparse.hpp):
// sparsify (fp32, fp16, bf16 or double logits; whole rows or vocabulary shards with
// sparsify_shard / sparsify_merge / sparsify_finalize / sparsify_tail_sums), align (two sparse
// rows, or dense new logits with sparse old rows) and align_backward, kl, project and project_backward of aligned
// rows, and sparsify_backward, under the troll::cuda policy tag with the CPU overloads' argument
// lists.
//
//   troll::sparsify(troll::cuda.on(stream).reporting(reports), bf16_logits, sampled, options, sparse_out);
//
// Every pointer is device memory; work is enqueued on policy.stream; nothing allocates and
// nothing synchronises unless policy.checks.checked (as in troll/cuda_dense.cuh). Rejected rows are
// reported through policy.checks and written as documented per entry point (NaN values, count 0).
// Reached through troll/cuda.cuh; tested on an NVIDIA H100 (2026-11-24): see docs/cuda.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>

#include "batch.hpp"
#include "config.hpp"
#include "detail/cuda/launch.cuh"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/row_report.cuh"
#include "detail/cuda/sparse_dense.cuh"
#include "detail/cuda/sparse_projection.cuh"
#include "detail/cuda/sparse_report.cuh"
#include "detail/cuda/sparse_shards.cuh"
#include "detail/cuda/sparse_sparsify.cuh"
#include "detail/cuda/sparse_warp.cuh"
#include "detail/row_problem.hpp"
#include "detail/sparse_arguments.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "projection_types.hpp"
#include "sparse_types.hpp"

TROLL_BEGIN_NAMESPACE


/// Sparsifies each row of dense device `logits` (rows × V; float, double, __half or
/// __nv_bfloat16) into `out` (float or double), with the semantics of troll::sparsify(cpu_policy,
/// ...): tokens ranked in the logits' precision (float for fp16 / bf16), the shortest
/// prefix by logit (ties to the lower index) reaching 1 − delta, at most k ≤ 256 tokens, then
/// sampled[r] (device array, may be null) if missing; log_remainder the exact log tail mass.
/// One streaming pass per row. Host checks as on the CPU (shape_error, domain_error for the
/// options); row problems (NaN / +inf logits, all −inf, a sampled token outside [0, V)) are
/// reported through `checks` and give count 0 and a NaN log_remainder, or throw in checked mode.
template <class L, class T>
void sparsify(cuda_policy policy, batch_view<const L> logits, const token_id* sampled, const sparsify_options& options,
              sparse_batch_view<T> out) {
  const cuda_checks& checks = policy.checks;
  using logit_type = std::remove_const_t<L>;
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(logits);
  detail::check_sparsify_arguments(fn, in, sampled != nullptr, options, out);
  const double log_delta = options.delta > 0.0 ? std::log(options.delta) : detail::neg_inf();
  const detail::cuda::sparse_thrower thrower{{"logits"}, in.cols};
  detail::cuda::run_sparse(fn, policy.stream, in.rows, checks, thrower,
                           detail::cuda::block_per_row(policy.stream, detail::cuda::sparsify_kernel<logit_type, T>, in,
                                                       sampled, options.k, log_delta, out));
}

/// The same for a mutable view of the logits (forwards to the const one above, so that
/// `f<T>(policy, batch_view<const T>, ...)` names the element type as on the CPU).
template <class L, class T, std::enable_if_t<!std::is_const<L>::value, int> = 0>
void sparsify(cuda_policy policy, batch_view<L> logits, const token_id* sampled, const sparsify_options& options,
              sparse_batch_view<T> out) {
  sparsify<L, T>(policy, batch_view<const L>(logits), sampled, options, out);
}

/// Vocabulary shards on the device, as troll::sparsify_shard(cpu_policy, ...): fills states[r]
/// (device memory, rows entries) with the partial sparsify state of the tokens [vocab_offset,
/// vocab_offset + shard_logits.cols) of a row of `vocab` tokens (logits float, double, __half or
/// __nv_bfloat16; `sampled` a device array of global ids, may be null). The states are the CPU's
/// struct: copied to the host they merge with CPU shard states, and back. Row problems (NaN /
/// +inf logits, a sampled token outside [0, vocab)) are reported through `checks` and leave an
/// invalid state (k = 0) that sparsify_merge and sparsify_finalize reject; an all −inf shard is
/// fine (another shard may hold the mass).
template <class L>
void sparsify_shard(cuda_policy policy, batch_view<const L> shard_logits, std::size_t vocab_offset, std::size_t vocab,
                    const token_id* sampled, const sparsify_options& options, sparsify_state* states) {
  const cuda_checks& checks = policy.checks;
  using logit_type = std::remove_const_t<L>;
  constexpr const char* fn = "sparsify_shard";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(shard_logits);
  detail::check_sparsify_shard_arguments(fn, in, vocab_offset, vocab, options, states);
  const detail::cuda::sparse_thrower thrower{{"shard_logits"}, vocab};
  detail::cuda::run_sparse(fn, policy.stream, in.rows, checks, thrower,
                           detail::cuda::block_per_row(policy.stream, detail::cuda::sparsify_shard_kernel<logit_type>,
                                                       in, vocab_offset, vocab, sampled, options.k, states));
}

/// The same for a mutable view of the logits (forwards to the const one above, so that
/// `f<T>(policy, batch_view<const T>, ...)` names the element type as on the CPU).
template <class L, std::enable_if_t<!std::is_const<L>::value, int> = 0>
void sparsify_shard(cuda_policy policy, batch_view<L> shard_logits, std::size_t vocab_offset, std::size_t vocab,
                    const token_id* sampled, const sparsify_options& options, sparsify_state* states) {
  sparsify_shard<L>(policy, batch_view<const L>(shard_logits), vocab_offset, vocab, sampled, options, states);
}

/// into[r] ← merge(into[r], from[r]) for `rows` device states, as troll::sparsify_merge(cpu_policy,
/// ...) (associative and commutative; the shared detail::merge_into). A row whose states differ
/// in k or sampled token (invalid_input in checked mode, as on the CPU), or where either state is
/// invalid (k outside [1, 256], size outside [0, k]), is reported and leaves into[r] invalid.
inline void sparsify_merge(cuda_policy policy, sparsify_state* into, const sparsify_state* from, std::size_t rows) {
  const cuda_checks& checks = policy.checks;
  constexpr const char* fn = "sparsify_merge";
  detail::check_sparsify_merge_arguments(fn, into, from, rows);
  const detail::cuda::sparse_thrower thrower{{"into", "from"}, 0};
  detail::cuda::run_sparse(fn, policy.stream, rows, checks, thrower,
                           [&](detail::cuda::row_range range, detail::cuda::device_checks device) {
                             const detail::cuda::warp_launch l = detail::cuda::state_launch_for(range.count);
                             detail::cuda::sparsify_merge_kernel<sparsify_state><<<l.grid, l.threads, 0, policy.stream>>>(
                                 into, from, range, device);
                           });
}

/// Writes the sparse rows of whole-row device states into `out`, as
/// troll::sparsify_finalize(cpu_policy, ...) (the shared detail::finalize), in the same two
/// stages: a first call writes `tail_max` (device, rows doubles, may be null), every shard adds up
/// its tail with sparsify_tail_sums, and a second call given those pairs (`tail_sums`: device,
/// tail_shards blocks of rows × 2 doubles, any order) writes the canonical values — bit for bit
/// the rows of troll::sparsify(cuda, ...) on the whole logits, whatever the split. Without
/// `tail_sums` the values come from the merged states' running sums (within a few ulps). Row
/// checks as on the CPU, in its order: the state's k is options.k (invalid_input), out.k_max holds
/// the row (shape_error), some shard held the sampled token, some logit is finite (domain_error);
/// a rejected row gets count 0, padding and a NaN log_remainder (NaN log_sums and tail_max).
/// `log_sums` (device, rows × sparsify_log_sums_width doubles {ref, total, tail_ref, tail}, may be null)
/// receives what the CPU overload writes there.
template <class T>
void sparsify_finalize(cuda_policy policy, const sparsify_state* states, const sparsify_options& options,
                       sparse_batch_view<T> out, double* log_sums = nullptr, double* tail_max = nullptr,
                       const double* tail_sums = nullptr, std::size_t tail_shards = 0) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_finalize";
  detail::check_sparsify_finalize_arguments(fn, states, options, out);
  const double log_delta = options.delta > 0.0 ? std::log(options.delta) : detail::neg_inf();
  const detail::cuda::sparse_thrower thrower{{"states"}, 0};
  detail::cuda::run_sparse(fn, policy.stream, out.rows, checks, thrower,
                           [&](detail::cuda::row_range range, detail::cuda::device_checks device) {
                             const detail::cuda::warp_launch l = detail::cuda::state_launch_for(range.count);
                             detail::cuda::sparsify_finalize_kernel<T><<<l.grid, l.threads, 0, policy.stream>>>(
                                 states, options.k, log_delta, out, log_sums, tail_max, tail_sums, tail_shards,
                                 range, device);
                           });
}

/// One vocabulary shard's share of the canonical tail sums on the device, as
/// troll::sparsify_tail_sums(cpu_policy, ...) (sparsify_finalize's first stage): sums[2r],
/// sums[2r + 1] = Σ e^{z_j − tail_max[r]} over the shard's tokens (global ids [vocab_offset,
/// vocab_offset + cols) of rows of support.vocab tokens) outside row r's support, as an exact_sum
/// pair, the same terms the whole-row CUDA sparsify adds (each in the logits' comparison
/// precision). `shard_logits` float, double, __half or __nv_bfloat16; every pointer device
/// memory. Only the support's indices and counts are read. Host checks as on the CPU; rejected
/// rows (NaN / +inf shard logits, a NaN or +inf tail_max, bad support indices) get NaN sums, or
/// throw the CPU's exception in checked mode (one validation pass; the lowest bad row, checked in
/// the CPU's order: logits, tail_max, support). T (the support's element type) is named as for the CPU overload:
/// troll::sparsify_tail_sums<float>(troll::cuda.on(s), bf16_shard, offset, support, tail_max, sums).
template <class T, class L>
void sparsify_tail_sums(cuda_policy policy, batch_view<L> shard_logits, std::size_t vocab_offset,
                        sparse_input<T> support, const double* tail_max, double* sums) {
  using logit_type = std::remove_const_t<L>;
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_tail_sums";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(shard_logits);
  detail::check_sparsify_tail_sums_arguments(fn, in, vocab_offset, support, tail_max, sums);
  const detail::cuda::sparse_thrower thrower{
      {"shard_logits", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, "support"}, 0};
  const int slots = detail::cuda::sort_slots(support.k_max);
  detail::cuda::run_sparse(fn, policy.stream, in.rows, policy.checks, thrower,
                           detail::cuda::block_per_row(policy.stream,
                                                       detail::cuda::sparsify_tail_sums_kernel<logit_type, T>, in,
                                                       vocab_offset, support, tail_max, sums, slots));
}

/// sparsify_tail_sums with T deduced from the support view (as the CPU overload): the call
/// troll::sparsify_tail_sums(policy, shard, offset, support, tail_max, sums) compiles under both
/// policies. An explicit <T> still lands above (the shard then cannot be a view of T here).
template <class L, class S>
void sparsify_tail_sums(cuda_policy policy, batch_view<L> shard_logits, std::size_t vocab_offset,
                        sparse_batch_view<S> support, const double* tail_max, double* sums) {
  using T = std::remove_const_t<S>;
  sparsify_tail_sums<T>(policy, batch_view<const std::remove_const_t<L>>(shard_logits), vocab_offset,
                        sparse_input<T>(support), tail_max, sums);
}

/// Aligns sparse new and old device rows on U = S_new ∪ S_old into `out`, as
/// troll::align(cpu_policy, new, old, out). Rejected rows (bad sparse rows, a union beyond
/// out.k_max) get count 0 and NaN remainders.
template <class T>
void align(cuda_policy policy, sparse_input<T> new_rows, sparse_input<T> old_rows, aligned_batch_view<T> out) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "align";
  detail::check_sparse_align_arguments(fn, new_rows, old_rows, out);
  const detail::cuda::sparse_thrower thrower{
      {"new", "old", nullptr, nullptr, nullptr, nullptr, "out (the union of the supports)", nullptr}, 0};
  detail::cuda::run_sparse(fn, policy.stream, new_rows.rows, checks, thrower,
                           detail::cuda::warp_per_row(policy.stream, detail::cuda::larger(new_rows.k_max, old_rows.k_max),
                                                      2, detail::cuda::align_kernel<T>, new_rows, old_rows, out));
}

/// Aligns dense new device logits (float, double, __half or __nv_bfloat16) with sparse old rows,
/// as troll::align(cpu_policy, new_logits, new_support, old, out): U = S ∪ S_old (S the support
/// of new_support, or empty when new_support.rows == 0), the new side gathered exactly and its
/// bucket the exact tail mass over V∖U.
template <class L, class T>
void align(cuda_policy policy, batch_view<const L> new_logits, sparse_input<T> new_support, sparse_input<T> old_rows,
           aligned_batch_view<T> out) {
  const cuda_checks& checks = policy.checks;
  using logit_type = std::remove_const_t<L>;
  detail::require_float_type<T>();
  constexpr const char* fn = "align";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(new_logits);
  detail::check_align_arguments(fn, in, new_support, old_rows, out);
  const bool with_support = new_support.rows != 0;
  const detail::cuda::sparse_thrower thrower{
      {"new_logits", "old", nullptr, nullptr, nullptr, nullptr, "out (the union of the supports)", "new_support"}, 0};
  const int slots = detail::cuda::sort_slots(
      detail::cuda::larger(old_rows.k_max, with_support ? new_support.k_max : std::size_t(1)));
  detail::cuda::run_sparse(fn, policy.stream, in.rows, checks, thrower,
                           detail::cuda::block_per_row(policy.stream, detail::cuda::align_dense_kernel<logit_type, T>,
                                                       in, new_support, old_rows, out, slots));
}

/// The same for a mutable view of the logits (forwards to the const one above, so that
/// `f<T>(policy, batch_view<const T>, ...)` names the element type as on the CPU).
template <class L, class T, std::enable_if_t<!std::is_const<L>::value, int> = 0>
void align(cuda_policy policy, batch_view<L> new_logits, sparse_input<T> new_support, sparse_input<T> old_rows,
           aligned_batch_view<T> out) {
  align<L, T>(policy, batch_view<const L>(new_logits), new_support, old_rows, out);
}

/// Backward of align(new, old) for one side on the device, as troll::align_backward(cpu_policy,
/// row, aligned, grad_aligned, grad_row): entries of `row` pass their aligned gradient through,
/// and ∂L/∂log r = g_R + Σ_{u ∈ U∖S} g_u. Rejected rows (a bad `row` or aligned new side, an entry
/// of `row` missing from U, a NaN / infinite gradient) get NaN gradients.
template <class T>
void align_backward(cuda_policy policy, sparse_input<T> row, aligned_input<T> aligned,
                    sparse_grad_input<T> grad_aligned, sparse_grad_view<T> grad_row) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "align_backward";
  detail::check_align_backward_arguments(fn, row, aligned, grad_aligned, grad_row);
  const detail::cuda::sparse_thrower thrower{
      {"row", "aligned", nullptr, nullptr, nullptr, "grad_aligned", nullptr, nullptr}, 0};
  detail::cuda::run_sparse(fn, policy.stream, row.rows, checks, thrower,
                           detail::cuda::warp_per_row(policy.stream, detail::cuda::larger(row.k_max, aligned.k_max), 2,
                                                      detail::cuda::align_backward_kernel<T>, row, aligned,
                                                      grad_aligned, grad_row));
}

/// kl_out[r] = KL(new ‖ old) of aligned device rows (the lumped rows), +inf where new has mass old
/// lacks, as troll::kl(cpu_policy, rows, kl_out). Rejected rows give NaN.
template <class T>
void kl(cuda_policy policy, aligned_input<T> rows, T* kl_out) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "kl";
  detail::check_aligned_view(fn, "rows", rows);
  if (rows.rows != 0 && kl_out == nullptr) detail::throw_shape(fn, "kl_out is a null pointer");
  const detail::cuda::sparse_thrower thrower{{"new", "old", "new (lumped)", "old (lumped)"}, 0};
  detail::cuda::run_sparse(fn, policy.stream, rows.rows, checks, thrower,
                           detail::cuda::warp_per_row(policy.stream, rows.k_max, 1, detail::cuda::sparse_kl_kernel<T>,
                                                      rows, kl_out));
}

/// The trust-region projection of aligned device rows, as troll::project(cpu_policy, rows, eps,
/// out, stats, options): the dense projection of the lumped (|U| + 1)-category rows. Rejected rows
/// (bad sparse rows, disjoint, infeasible, a row beyond out.k_max) get count 0, a NaN remainder
/// and stats with NaN fields and status infeasible / rejected.
template <class T>
void project(cuda_policy policy, aligned_input<T> rows, double eps, sparse_batch_view<T> out, projection_stats* stats,
             const projection_options& options = {}) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project";
  detail::check_sparse_project_arguments(fn, rows, eps, out, stats, options);
  const detail::cuda::sparse_thrower thrower{{"new", "old", "new (lumped)", "old (lumped)", nullptr, nullptr, "out"}, 0};
  detail::cuda::run_sparse(fn, policy.stream, rows.rows, checks, thrower,
                           detail::cuda::warp_per_row(policy.stream, rows.k_max, 1, detail::cuda::sparse_project_kernel<T>,
                                                      rows, eps, options, out, stats));
}

/// VJP of the sparse project() on the device, as troll::project_backward(cpu_policy, rows,
/// log_probs, stats, grad, grad_new, grad_old, grad_eps). Rejected rows get NaN gradients.
template <class T>
void project_backward(cuda_policy policy, aligned_input<T> rows, sparse_input<T> log_probs,
                      const projection_stats* stats, sparse_grad_input<T> grad, sparse_grad_view<T> grad_new,
                      sparse_grad_view<T> grad_old = {},
                      typename detail::identity<T>::type* grad_eps = nullptr) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project_backward";
  detail::check_sparse_project_backward_arguments(fn, rows, log_probs, stats, grad, grad_new, grad_old);
  const detail::cuda::sparse_thrower thrower{
      {"new", "old", "new (lumped)", "old (lumped)", "log_probs", "grad"}, 0};
  detail::cuda::run_sparse(fn, policy.stream, rows.rows, checks, thrower,
                           detail::cuda::warp_per_row(policy.stream, rows.k_max, 1,
                                                      detail::cuda::sparse_project_backward_kernel<T>, rows, log_probs,
                                                      stats, grad, grad_new, grad_old, grad_eps));
}

/// Backward of sparsify (and of align's new side) on the device, as
/// troll::sparsify_backward(cpu_policy, logits, support, grad, grad_logits): scatters g on the
/// support of `support` and g_R on its bucket to dense logit gradients (float or double; logits
/// float, double, __half or __nv_bfloat16). O(V) per row, two passes. Rejected rows get NaN.
template <class L, class T>
void sparsify_backward(cuda_policy policy, batch_view<const L> logits, sparse_input<T> support, sparse_grad_input<T> grad,
                       batch_view<T> grad_logits) {
  const cuda_checks& checks = policy.checks;
  using logit_type = std::remove_const_t<L>;
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_backward";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(logits);
  detail::check_sparsify_backward_arguments(fn, in, support, grad, grad_logits);
  const detail::cuda::sparse_thrower thrower{
      {"logits", nullptr, nullptr, nullptr, nullptr, "grad", nullptr, "support"}, 0};
  const int slots = detail::cuda::sort_slots(support.k_max);
  detail::cuda::run_sparse(fn, policy.stream, in.rows, checks, thrower,
                           detail::cuda::block_per_row(policy.stream,
                                                       detail::cuda::sparsify_backward_kernel<logit_type, T>, in,
                                                       support, grad, grad_logits, slots));
}

/// The same for a mutable view of the logits (forwards to the const one above, so that
/// `f<T>(policy, batch_view<const T>, ...)` names the element type as on the CPU).
template <class L, class T, std::enable_if_t<!std::is_const<L>::value, int> = 0>
void sparsify_backward(cuda_policy policy, batch_view<L> logits, sparse_input<T> support, sparse_grad_input<T> grad,
                       batch_view<T> grad_logits) {
  sparsify_backward<L, T>(policy, batch_view<const L>(logits), support, grad, grad_logits);
}

/// Backward of sparsify over vocabulary shards on the device, as
/// troll::sparsify_shard_backward(cpu_policy, ...): grad_shard = the columns [vocab_offset,
/// vocab_offset + cols) of sparsify_backward's gradient, from `log_sums` (device, rows × sparsify_log_sums_width, what
/// sparsify_finalize wrote). One pass per row, no communication. Host checks as on the CPU; rejected
/// rows (NaN / +inf shard logits, unusable log_sums, a bad support row, a NaN / infinite gradient)
/// get NaN, or throw the CPU's exception in checked mode (one validation pass; the lowest bad row,
/// checked in the CPU's order: logits, log_sums, support, gradient).
template <class L, class T>
void sparsify_shard_backward(cuda_policy policy, batch_view<const L> shard_logits, std::size_t vocab_offset,
                             sparse_input<T> support, sparse_grad_input<T> grad, const double* log_sums,
                             batch_view<T> grad_shard) {
  using logit_type = std::remove_const_t<L>;
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_shard_backward";
  const batch_view<const logit_type> in = detail::cuda::sparsify_logits(shard_logits);
  detail::check_sparsify_shard_backward_arguments(fn, in, vocab_offset, support, grad, log_sums, grad_shard);
  const detail::cuda::sparse_thrower thrower{
      {"shard_logits", nullptr, nullptr, nullptr, nullptr, "grad", nullptr, "support"}, 0};
  const int slots = detail::cuda::sort_slots(support.k_max);
  detail::cuda::run_sparse(fn, policy.stream, in.rows, policy.checks, thrower,
                           detail::cuda::block_per_row(policy.stream,
                                                       detail::cuda::sparsify_shard_backward_kernel<logit_type, T>,
                                                       in, vocab_offset, support, grad, log_sums, grad_shard, slots));
}

/// The same for a mutable view of the logits (forwards to the const one above, so that
/// `f<T>(policy, batch_view<const T>, ...)` names the element type as on the CPU).
template <class L, class T, std::enable_if_t<!std::is_const<L>::value, int> = 0>
void sparsify_shard_backward(cuda_policy policy, batch_view<L> shard_logits, std::size_t vocab_offset,
                             sparse_input<T> support, sparse_grad_input<T> grad, const double* log_sums,
                             batch_view<T> grad_shard) {
  sparsify_shard_backward<L, T>(policy, batch_view<const L>(shard_logits), vocab_offset, support, grad, log_sums,
                                grad_shard);
}

TROLL_END_NAMESPACE
