// troll/sparse.hpp — sparse top-K rows with a remainder bucket (math.md §4) on the CPU: the batch
// layout, sparsify from dense logits (whole rows or vocabulary shards), alignment of a new and
// an old row on the union of their supports, and the KL, projection and backward passes, which
// run the dense row maths on the |U| + 1 lumped categories (the bucket is one category).
//
//   sparsify → align → project → (loss) → project_backward → align_backward / sparsify_backward
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "backward.hpp"
#include "batch.hpp"
#include "config.hpp"
#include "detail/cpu/backward_kernels.hpp"
#include "detail/cpu/offset_rows.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_fingerprint.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "detail/cpu/sparse_backward_rows.hpp"
#include "detail/cpu/sparse_fast_checks.hpp"
#include "detail/cpu/sparse_kernels.hpp"
#include "detail/cpu/sparse_lumped_rows.hpp"
#include "detail/row_problem.hpp"
#include "detail/sparse_arguments.hpp"
#include "detail/sparse_row.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "detail/workspace.hpp"
#include "workspace.hpp"
#include "kl.hpp"
#include "projection_types.hpp"
#include "sparse_types.hpp"
#include "detail/cpu/sparse_checks.hpp"

TROLL_BEGIN_NAMESPACE

// ---------------------------------------------------------------------------------------------
// Argument checks (host only; all run before anything is written).

// ---------------------------------------------------------------------------------------------
// Sparsify.

/// Sparsifies each row of dense `logits` (rows × V) into `out` (rows, k_max ≥ k + 1 when
/// `sampled` is given, else ≥ k; out.vocab = V): the shortest prefix of tokens by logit (ties to
/// the lower index) whose mass reaches 1 − delta, at most k, then sampled[r] if it is missing
/// (sampled may be null: no sampled token). Entries are written in that order; log_remainder is
/// the exact log tail mass (a log-sum-exp over the tail, never log(1 − Σ)). One read of each row
/// from memory picks the support (no exponentials); a second pass while the row is in cache takes
/// the tail's exact sum (docs/sparse.md, "Sparsify"). −inf logits are legal (masked tokens; they never enter the support unless
/// sampled). Throws before writing: shape_error (shapes, capacity), domain_error (k outside
/// [1, 256], delta outside [0, 1), NaN / +inf logits, an all −inf row, a sampled token outside
/// [0, V)), each naming the row where there is one.
template <class T>
void sparsify(cpu_policy policy, input_view<T> logits, const token_id* sampled,
              const sparsify_options& options, sparse_batch_view<T> out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify";
  detail::check_sparsify_arguments(fn, logits, sampled != nullptr, options, out);
  const double log_delta = options.delta > 0.0 ? std::log(options.delta) : detail::neg_inf();
  // One read of each row: the scan validates what it reads (NaN / +inf, an all −inf row) and the
  // row is finished — support, canonical tail sum, log-probs — while it is still in cache, into
  // scratch of k_max entries per row. Only when every row has passed are the rows copied to
  // `out`; a bad row makes validate_rows name the first one and throw, with `out` untouched.
  // The scratch (troll::workspace_bytes(policy, op::sparsify{}, rows, V, k_max)): the policy's
  // workspace, else the calling thread's arena. Doubles first (log-probs, remainders: room for T ≤ double),
  // then the 4-byte indices and counts, then one flag per row.
  const std::size_t k_max = out.k_max, rows = logits.rows;
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::sparsify{}, rows, logits.cols, k_max));
  unsigned char* base = scratch.data();
  T* scratch_log_probs = reinterpret_cast<T*>(base);
  T* scratch_remainder = reinterpret_cast<T*>(base + rows * k_max * 8);
  sparse_index* scratch_indices = reinterpret_cast<sparse_index*>(base + rows * k_max * 8 + rows * 8);
  int* scratch_counts = reinterpret_cast<int*>(base + rows * k_max * 12 + rows * 8);
  unsigned char* row_bad = base + rows * k_max * 12 + rows * 12;
  static_assert(sizeof(T) <= 8 && sizeof(sparse_index) == 4 && sizeof(int) == 4, "the scratch layout");
  detail::cpu::parallel_for(policy.threads, logits.rows, 2 * logits.cols, [&](std::size_t r) {
    if (detail::sampled_problem(sampled, r, logits.cols)) {  // not read: reported below
      row_bad[r] = 1;
      scratch_counts[r] = 0;
      return;
    }
    const sparse_index sampled_r = sampled ? static_cast<sparse_index>(sampled[r]) : -1;
    int count = 0;
    row_bad[r] = !detail::cpu::sparsify_row(logits.row(r), logits.cols, options.k, sampled_r, log_delta,
                                            scratch_indices + r * k_max, scratch_log_probs + r * k_max, count,
                                            scratch_remainder[r], true,
                                            r + 1 < rows ? logits.row(r + 1) : nullptr);
    scratch_counts[r] = row_bad[r] ? 0 : count;
  });
  // The lowest bad row, row by row as the device reports it: its sampled token, then its logits.
  for (std::size_t r = 0; r < rows; ++r) {
    if (!row_bad[r]) continue;
    detail::row_problem p = detail::sampled_problem(sampled, r, logits.cols);
    if (!p) p = detail::cpu::logits_row_problem(logits.row(r), logits.cols, "logits");
    detail::throw_row_problem(fn, r, p);
  }
  for (std::size_t r = 0; r < rows; ++r) {
    const int count = scratch_counts[r];
    std::copy(scratch_indices + r * k_max, scratch_indices + r * k_max + count, out.row_indices(r));
    std::copy(scratch_log_probs + r * k_max, scratch_log_probs + r * k_max + count, out.row_log_probs(r));
    out.log_remainder[r] = scratch_remainder[r];
    out.counts[r] = count;
    detail::pad_row(out.row_indices(r), out.row_log_probs(r), std::size_t(count), out.k_max);
  }
}

/// Vocabulary shards: fills states[r] (rows entries) with the partial sparsify state of the
/// tokens [vocab_offset, vocab_offset + shard_logits.cols) of a row of `vocab` tokens. States of
/// disjoint shards merge with sparsify_merge (associative, any order); sparsify_finalize turns a
/// state covering the whole row into the same sparse row sparsify writes. `sampled` (global
/// indices, may be null) and options must be the same for every shard of a row. Each state
/// records V and the range it covers, so merge and finalize can check what they are given.
/// Throws before writing: shape_error (the shard does not fit in [0, V) — computed without
/// wrap-around — or V is not in [1, 2^31)), domain_error (options, NaN / +inf logits, a sampled
/// token outside [0, V)).
template <class T>
void sparsify_shard(cpu_policy policy, batch_view<const T> shard_logits, std::size_t vocab_offset,
                    std::size_t vocab, const token_id* sampled, const sparsify_options& options,
                    sparsify_state* states) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_shard";
  detail::check_sparsify_shard_arguments(fn, shard_logits, vocab_offset, vocab, options, states);
  detail::validate_shard_values(fn, policy.threads, shard_logits, sampled, vocab);
  detail::cpu::parallel_for(policy.threads, shard_logits.rows, 2 * shard_logits.cols, [&](std::size_t r) {
    const auto begin = static_cast<sparse_index>(vocab_offset);
    detail::reset(states[r], options.k, sampled ? static_cast<sparse_index>(sampled[r]) : -1, static_cast<sparse_index>(vocab), begin,
                  static_cast<sparse_index>(vocab_offset + shard_logits.cols));
    detail::cpu::sparsify_scan(shard_logits.row(r), shard_logits.cols, vocab_offset, states[r]);
  });
}

/// sparsify_shard with logits given as a non-const view (batch_view<float> from make_batch(float*)):
/// the same call, T deduced.
template <class T, class = std::enable_if_t<!std::is_const<T>::value>>
void sparsify_shard(cpu_policy policy, batch_view<T> shard_logits, std::size_t vocab_offset, std::size_t vocab,
                    const token_id* sampled, const sparsify_options& options, sparsify_state* states) {
  sparsify_shard<T>(policy, batch_view<const T>(shard_logits), vocab_offset, vocab, sampled, options, states);
}

/// into[r] ← merge(into[r], from[r]) for rows rows: the state of the union of two disjoint token
/// sets of the same row. Every state is validated first (detail::check_state: k, size, V, covered
/// ranges, heap entries, sums), then each pair (same k, sampled token and V; coverages that do
/// not overlap and whose union fits in sparsify_max_ranges ranges). Throws before writing
/// (detail::throw_state_problem lists the exception per problem; merging the same shard twice is
/// invalid_input naming the first token both cover).
inline void sparsify_merge(cpu_policy policy, sparsify_state* into, const sparsify_state* from,
                           std::size_t rows) {
  constexpr const char* fn = "sparsify_merge";
  detail::check_sparsify_merge_arguments(fn, into, from, rows);
  auto problem = [&](std::size_t r, const char*& name) {
    detail::index_slot scratch[sparsify_max_k];
    name = "into";
    detail::state_problem p = detail::check_state(into[r], scratch);
    if (p) return p;
    name = "from";
    p = detail::check_state(from[r], scratch);
    if (p) return p;
    name = "from";
    return detail::check_merge(into[r], from[r]);
  };
  const std::size_t bad = detail::cpu::first_bad_row(policy.threads, rows, 4 * sparsify_max_k, [&](std::size_t r) {
    const char* name = "";
    return bool(problem(r, name));
  });
  if (bad != rows) {
    const char* name = "";
    const detail::state_problem p = problem(bad, name);
    detail::throw_state_problem(fn, bad, name, p);
  }
  detail::cpu::parallel_for(policy.threads, rows, 4 * sparsify_max_k,
                            [&](std::size_t r) { detail::merge_into(into[r], from[r]); });
}

/// Writes the sparse rows of states that cover whole rows of `out.vocab` tokens (see
/// sparsify_shard). Two stages make them equal, bit for bit, to sparsify's rows of the whole
/// vocabulary: a first call picks each row's support and writes `tail_max` (rows doubles, may be
/// null: the largest logit outside the support); every shard then adds up its tail with
/// sparsify_tail_sums, and a second call given those sums (`tail_sums`: tail_shards blocks of
/// rows × 2 doubles, any order) writes the canonical values (detail::exact_log_sums). Without
/// `tail_sums` the values come from the merged states' running sums (within a few ulps). Throws before writing: the state problems of detail::throw_state_problem (a
/// malformed state, k other than options.k, a state made for another V, a state that does not
/// cover all of [0, V) — a shard never merged), shape_error for a too small out.k_max, and
/// domain_error for a row whose logits were all −inf. `log_sums` (rows × sparsify_log_sums_width
/// = 4 doubles, may be null) receives each row's {ref, log Σ_j e^{z_j − ref}, tail_ref,
/// log Σ_{j∉S} e^{z_j − tail_ref}}, ref the row's and tail_ref the tail's largest logit (−inf: no
/// tail mass; detail::row_log_sums), which sparsify_shard_backward takes.
template <class T>
void sparsify_finalize(cpu_policy policy, const sparsify_state* states, const sparsify_options& options,
                       sparse_batch_view<T> out, double* log_sums = nullptr, double* tail_max = nullptr,
                       const double* tail_sums = nullptr, std::size_t tail_shards = 0) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_finalize";
  detail::check_sparsify_finalize_arguments(fn, states, options, out);
  const std::size_t bad = detail::cpu::first_bad_row(policy.threads, out.rows, 4 * sparsify_max_k, [&](std::size_t r) {
    detail::index_slot scratch[sparsify_max_k];
    return bool(detail::check_state(states[r], scratch)) ||
           bool(detail::check_whole_row(states[r], options.k, static_cast<long long>(out.vocab)));
  });
  for (std::size_t r = 0; r < out.rows; ++r) {
    if (r == bad) {
      detail::index_slot scratch[sparsify_max_k];
      detail::state_problem p = detail::check_state(states[r], scratch);
      if (!p) p = detail::check_whole_row(states[r], options.k, static_cast<long long>(out.vocab));
      detail::throw_state_problem(fn, r, "states", p);
    }
    const std::size_t need = std::size_t(states[r].size) + (states[r].sampled >= 0 ? 1 : 0);
    if (out.k_max < need)
      detail::throw_row_problem(fn, r, detail::make_problem(row_error::state_capacity, "", static_cast<long long>(out.k_max), double(need)));
    if (detail::state_has_no_support(states[r]))
      detail::throw_row_problem(fn, r, detail::make_problem(row_error::no_support, ""));
  }
  const double log_delta = options.delta > 0.0 ? std::log(options.delta) : detail::neg_inf();
  detail::cpu::parallel_for(policy.threads, out.rows, 4 * sparsify_max_k, [&](std::size_t r) {
    sparsify_state st = states[r];
    int count = 0;
    detail::exact_sum tail;
    for (std::size_t s = 0; s < tail_shards; ++s) {
      const double* part = tail_sums + 2 * (s * out.rows + r);
      tail = detail::exact_add(tail, detail::exact_sum{part[0], part[1]});
    }
    const detail::finalize_problem p =
        detail::finalize(st, log_delta, out.row_indices(r), out.row_log_probs(r), count, out.log_remainder[r],
                         log_sums ? log_sums + sparsify_log_sums_width * r : nullptr, tail_max ? tail_max + r : nullptr,
                         tail_sums ? &tail : nullptr);
    (void)p;  // ruled out by the checks above
    out.counts[r] = count;
    detail::pad_row(out.row_indices(r), out.row_log_probs(r), std::size_t(count), out.k_max);
  });
}

/// One vocabulary shard's share of the exact tail sums of rows finalised from merged states
/// (sparsify_finalize's first stage): sums[2r], sums[2r + 1] = Σ e^{z_j − tail_max[r]} over the
/// shard's tokens j (the tokens [vocab_offset, vocab_offset + cols) of rows of support.vocab
/// tokens) outside row r's support, as an unevaluated pair hi + lo (detail::exact_sum: the same
/// whatever the split of the row). Only the support's indices and counts are read. O(cols) a row.
/// Throws before writing: shape_error (shapes, a shard that does not fit in [0, V), bad support
/// indices), domain_error (NaN / +inf logits, a NaN or +inf tail_max, a logit outside the support
/// above tail_max: code tail_above_max, naming the shard token).
template <class T>
void sparsify_tail_sums(cpu_policy policy, input_view<T> shard_logits, std::size_t vocab_offset,
                        sparse_input<T> support, const double* tail_max, double* sums) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_tail_sums";
  detail::check_sparsify_tail_sums_arguments(fn, shard_logits, vocab_offset, support, tail_max, sums);
  // Row by row: the shard's logits, tail_max, the support's indices, then every tail logit at or
  // below tail_max (a tail_max from other rows or another support would make the terms exceed 1:
  // NaN sums, or 0 for a −inf tail_max).
  detail::first_sorted_row_problem(fn, policy.threads, shard_logits.rows, [&](std::size_t r, detail::index_slot* scratch) {
    const T* z = shard_logits.row(r);
    detail::row_problem p = detail::cpu::find_bad_value(z, shard_logits.cols, "shard_logits");
    if (p) return p;
    if (!(tail_max[r] < detail::inf())) return detail::make_problem(row_error::bad_tail_max, "");
    p = detail::check_support_row(support, r, "support", scratch, true);
    if (p) return p;
    const long long above = detail::cpu::first_tail_above(z, shard_logits.cols, vocab_offset, support.row_indices(r),
                                                          support.count(r), tail_max[r]);
    if (above >= 0)
      return detail::make_problem(row_error::tail_above_max, "", above, double(z[std::size_t(above)]));
    return p;
  }, 0, shard_logits.cols + 4 * std::size_t(sparse_max_entries));
  const std::size_t end = vocab_offset + shard_logits.cols;
  detail::cpu::parallel_for(policy.threads, shard_logits.rows, 2 * shard_logits.cols, [&](std::size_t r) {
    detail::index_slot slots[sparse_max_entries];
    int n = 0;
    for (long long i = 0; i < support.count(r); ++i) {
      const sparse_index token = support.row_indices(r)[i];
      if (std::size_t(token) >= vocab_offset && std::size_t(token) < end)
        slots[n++] = detail::index_slot{token, int(i)};
    }
    detail::sort_by_index(slots, n);
    const detail::exact_sum s =
        detail::cpu::tail_exp_sum(shard_logits.row(r), shard_logits.cols, vocab_offset, slots, n, tail_max[r]);
    sums[2 * r] = s.hi;
    sums[2 * r + 1] = s.lo;
  });
}

/// sparsify_tail_sums with T deduced from the views (the overload above names T only in
/// non-deduced positions, so a call without <T> lands here): logits and support of one element
/// type, each const or not.
template <class L, class S,
          class = std::enable_if_t<std::is_same<std::remove_const_t<L>, std::remove_const_t<S>>::value>>
void sparsify_tail_sums(cpu_policy policy, batch_view<L> shard_logits, std::size_t vocab_offset,
                        sparse_batch_view<S> support, const double* tail_max, double* sums) {
  using T = std::remove_const_t<L>;
  sparsify_tail_sums<T>(policy, batch_view<const T>(shard_logits), vocab_offset, sparse_batch_view<const T>(support),
                        tail_max, sums);
}

/// Backward of sparsify (and of the new side of align(logits, ...)): scatters an upstream
/// gradient on a sparse row gathered from `logits` — g on the support of `support` (its indices
/// and counts are read, and of its values only which are −inf) and g_R on its bucket — to dense
/// logits (math.md §4):
///     ∂L/∂z_k = [k∈S] g_k + [k∉S] g_R p_k / r − p_k (Σ_S g_i + g_R),   O(V) per row.
/// Masked outputs have their upstream gradients ignored (docs/api.md): g_i where support's value
/// is −inf (a masked token: sparsify's masked sampled token, align's new side on a token the
/// new logits mask), g_R where the bucket holds no mass; a support token whose logit is −inf
/// gets 0.
/// Throws before writing: shape_error, domain_error (bad logits, bad support, NaN / inf grads).
template <class T>
void sparsify_backward(cpu_policy policy, input_view<T> logits, sparse_input<T> support,
                       sparse_grad_input<T> grad, batch_view<T> grad_logits) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_backward";
  detail::check_sparsify_backward_arguments(fn, logits, support, grad, grad_logits);
  // Row by row: the logits, the support, the upstream gradient.
  detail::first_sorted_row_problem(fn, policy.threads, logits.rows, [&](std::size_t r, detail::index_slot* scratch) {
    detail::row_problem p = detail::cpu::logits_row_problem(logits.row(r), logits.cols, "logits");
    if (!p) p = detail::check_support_row(support, r, "support", scratch);
    return p ? p : detail::check_grad_row(grad, r, support.count(r), "grad");
  }, 0, logits.cols + 4 * std::size_t(sparse_max_entries));
  std::atomic<std::size_t> overflowed{logits.rows};  // the lowest row with an entry beyond T
  detail::cpu::parallel_for(policy.threads, logits.rows, 3 * logits.cols, [&](std::size_t r) {
    detail::index_slot slots[sparse_max_entries];
    const int n = static_cast<int>(support.count(r));
    for (int i = 0; i < n; ++i) slots[i] = detail::index_slot{support.row_indices(r)[i], i};
    detail::sort_by_index(slots, n);
    if (!detail::cpu::sparsify_backward_row(logits.row(r), logits.cols, slots, n, grad.row(r),
                                            support.row_log_probs(r), double(grad.log_remainder[r]),
                                            grad_logits.row(r)))
      detail::cpu::lower_to(overflowed, r);
  });
  detail::throw_scatter_overflowed<T>(fn, overflowed.load(), logits.rows);
}

/// Backward of sparsify over vocabulary shards: the rows of `support` were finalised from the
/// merged states of every shard (sparsify_finalize, which also wrote `log_sums`); this writes the
/// gradient w.r.t. one shard's logits (the tokens [vocab_offset, vocab_offset + cols) of rows of
/// support.vocab tokens), the columns of what sparsify_backward writes for the whole row:
///     ∂L/∂z_k = [k∈S] g_k + [k∉S] g_R p_k / r − p_k (Σ_S g_i + g_R),
///     p_k = e^{(z_k − ref) − total},  p_k / r = e^{(z_k − tail_ref) − tail},
/// with {ref, total, tail_ref, tail} = log_sums[4r .. 4r + 4) (sparsify_log_sums_width a row).
/// Needs no communication: every rank holds the whole sparse row, its upstream gradient and the
/// row's log-sums. O(cols) per row. Throws before writing: shape_error (shapes, a shard that
/// does not fit in [0, V), bad support indices), domain_error (NaN / +inf logits, NaN / infinite
/// gradients, log-sums that detail::log_sums_problem rejects: ref or total not finite, a NaN or
/// +inf tail_ref or one above ref, a tail not finite with a finite tail_ref, or a tail mass above
/// the total).
template <class T>
void sparsify_shard_backward(cpu_policy policy, input_view<T> shard_logits, std::size_t vocab_offset,
                             sparse_input<T> support, sparse_grad_input<T> grad, const double* log_sums,
                             batch_view<T> grad_shard) {
  detail::require_float_type<T>();
  constexpr const char* fn = "sparsify_shard_backward";
  detail::check_sparsify_shard_backward_arguments(fn, shard_logits, vocab_offset, support, grad, log_sums,
                                                  grad_shard);
  // Row by row: the shard's logits, the log-sums, the support, the upstream gradient.
  detail::first_sorted_row_problem(fn, policy.threads, shard_logits.rows, [&](std::size_t r, detail::index_slot* scratch) {
    detail::row_problem p = detail::cpu::find_bad_value(shard_logits.row(r), shard_logits.cols, "shard_logits");
    if (p) return p;
    const double* row_sums = log_sums + sparsify_log_sums_width * r;
    const int entry = detail::log_sums_problem(row_sums);
    if (entry >= 0) return detail::make_problem(row_error::bad_log_sums, "", entry, row_sums[entry]);
    p = detail::check_support_row(support, r, "support", scratch);
    return p ? p : detail::check_grad_row(grad, r, support.count(r), "grad");
  }, 0, shard_logits.cols + 4 * std::size_t(sparse_max_entries));
  const std::size_t end = vocab_offset + shard_logits.cols;
  std::atomic<std::size_t> overflowed{shard_logits.rows};  // the lowest row with an entry beyond T
  detail::cpu::parallel_for(policy.threads, shard_logits.rows, 3 * shard_logits.cols, [&](std::size_t r) {
    detail::index_slot slots[sparse_max_entries], all[sparse_max_entries];
    const int count = static_cast<int>(support.count(r));
    int n = 0;
    for (int i = 0; i < count; ++i) {
      const sparse_index token = support.row_indices(r)[i];
      all[i] = detail::index_slot{token, i};
      if (std::size_t(token) >= vocab_offset && std::size_t(token) < end) slots[n++] = detail::index_slot{token, i};
    }
    detail::sort_by_index(slots, n);
    detail::sort_by_index(all, count);  // the whole row's order: its counted sum bit for bit
    const detail::row_log_sums sums{log_sums[sparsify_log_sums_width * r], log_sums[sparsify_log_sums_width * r + 1],
                                    log_sums[sparsify_log_sums_width * r + 2],
                                    log_sums[sparsify_log_sums_width * r + 3]};
    const T* values = support.row_log_probs(r);
    const detail::counted_grad counted = detail::count_grad(
        grad.row(r), values, all, count, double(grad.log_remainder[r]), sums.tail_ref > detail::neg_inf());
    if (!detail::cpu::sparse_scatter_row(shard_logits.row(r), shard_logits.cols, vocab_offset, slots, n,
                                         grad.row(r), values, counted, sums, grad_shard.row(r)))
      detail::cpu::lower_to(overflowed, r);
  });
  detail::throw_scatter_overflowed<T>(fn, overflowed.load(), shard_logits.rows);
}

// ---------------------------------------------------------------------------------------------
// Alignment.

/// Aligns sparse new and old rows on U = S_new ∪ S_old (math.md §4) into `out` (capacity ≥ |U|
/// of every row; out.vocab = V): U lists the new row's entries in its order, then the old row's
/// entries missing from it. A token of U missing from a row gets that row's uniform tail value
/// log(r/m); each row's bucket shrinks to log(r·(V − |U|)/m). Exact: the aligned pair expands to
/// the same V-vectors as the inputs. Throws before writing (shape_error / domain_error naming
/// the row: bad sparse rows, a union larger than out.k_max).
template <class T>
void align(cpu_policy policy, sparse_input<T> new_rows, sparse_input<T> old_rows,
           aligned_batch_view<T> out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "align";
  detail::check_sparse_align_arguments(fn, new_rows, old_rows, out);
  // Row by row: the new row, the old row, the union's size.
  detail::check_union_capacity(fn, policy.threads, new_rows, old_rows, out.k_max,
                               [&](std::size_t r, detail::index_slot* scratch) {
                                 const detail::row_problem p = detail::sparse_row_problem(new_rows, r, "new", scratch);
                                 return p ? p : detail::sparse_row_problem(old_rows, r, "old", scratch);
                               });
  detail::cpu::parallel_for(policy.threads, out.rows, 8 * std::size_t(sparse_max_entries), [&](std::size_t r) {
    const int cn = int(new_rows.count(r));
    detail::align_row(out, r, new_rows.row_indices(r), cn, old_rows,
                      [&](int u, const sparse_index*, const int* new_pos, detail::index_slot*, T* ln) {
                        const long long m_new = static_cast<long long>(out.vocab) - cn,
                                        m_u = static_cast<long long>(out.vocab) - u;
                        const double lr_new = double(new_rows.log_remainder[r]);
                        const double tail_new = detail::tail_log_value(lr_new, m_new);
                        for (int i = 0; i < u; ++i)
                          ln[i] = new_pos[i] >= 0 ? new_rows.row_log_probs(r)[new_pos[i]] : T(tail_new);
                        out.new_log_remainder[r] = T(detail::shrink_log_remainder(lr_new, m_new, m_u));
                      });
  });
}

/// Aligns dense new logits (rows × V) with sparse old rows: U = S ∪ S_old where S is the support
/// of `new_support` (indices and counts read, values not; pass an empty view, rows = 0, for
/// U = S_old). The new side gathers exact log-probs z_i − logsumexp(z) on U and its bucket is the
/// exact log tail mass over V∖U (differentiable w.r.t. every logit: see sparsify_backward, with
/// support = out.new_side()); the old side is aligned as in align(new, old).
template <class T>
void align(cpu_policy policy, input_view<T> new_logits, sparse_input<T> new_support,
           sparse_input<T> old_rows, aligned_batch_view<T> out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "align";
  detail::check_align_arguments(fn, new_logits, new_support, old_rows, out);
  const bool with_support = new_support.rows != 0;
  // Row by row: the new logits, the old row, the support, the union's size.
  detail::check_union_capacity(fn, policy.threads, new_support, old_rows, out.k_max,
                               [&](std::size_t r, detail::index_slot* scratch) {
                                 detail::row_problem p =
                                     detail::cpu::logits_row_problem(new_logits.row(r), new_logits.cols, "new_logits");
                                 if (!p) p = detail::sparse_row_problem(old_rows, r, "old", scratch);
                                 if (!p && with_support) p = detail::check_support_row(new_support, r, "new_support", scratch, true);
                                 return p;
                               }, new_logits.cols);
  detail::cpu::parallel_for(policy.threads, out.rows, 2 * new_logits.cols, [&](std::size_t r) {
    const int cn = with_support ? int(new_support.count(r)) : 0;
    detail::align_row(out, r, with_support ? new_support.row_indices(r) : nullptr, cn, old_rows,
                      [&](int u, const sparse_index* indices, const int*, detail::index_slot* scratch, T* ln) {
                        for (int i = 0; i < u; ++i) scratch[i] = detail::index_slot{indices[i], i};
                        detail::sort_by_index(scratch, u);
                        const T* z = new_logits.row(r);
                        const detail::row_log_sums sums =
                            detail::cpu::log_sums_outside(z, new_logits.cols, scratch, u);
                        for (int i = 0; i < u; ++i) ln[i] = T(sums.log_prob(double(z[indices[i]])));
                        out.new_log_remainder[r] = T(sums.stored_log_remainder());
                      });
  });
}

/// Backward of align(new, old) for one side: given the gradient on that side of the aligned rows
/// (∂L/∂ aligned log-probs and ∂L/∂ aligned log-remainder), writes the gradient w.r.t. the
/// original sparse row `row` (the new or the old input of align): entries of S pass through;
/// each token of U∖S had value log r − log m and the bucket log r + log(m_U/m), so
///     ∂L/∂log r = g_R' + Σ_{u ∈ U∖S} g_u,
/// each term only where its output is not −inf (its upstream gradient is ignored), and entries
/// of the row that are −inf get 0.
/// Throws shape_error when an entry of `row` is missing from the aligned support.
template <class T>
void align_backward(cpu_policy policy, sparse_input<T> row, aligned_input<T> aligned,
                    sparse_grad_input<T> grad_aligned, sparse_grad_view<T> grad_row) {
  detail::require_float_type<T>();
  constexpr const char* fn = "align_backward";
  detail::check_align_backward_arguments(fn, row, aligned, grad_aligned, grad_row);
  // Row by row: the sparse row, the aligned side, every entry of the row in U, the gradient.
  detail::first_sorted_row_problem(fn, policy.threads, row.rows, [&](std::size_t r, detail::index_slot* scratch) {
    detail::row_problem p = detail::sparse_row_problem(row, r, "row", scratch);
    if (!p) p = detail::check_sparse_row_of(aligned.new_side(), r, "aligned", scratch);
    if (p) return p;
    const int u = int(aligned.counts[r]);
    for (int i = 0; i < u; ++i)
      scratch[i] = detail::index_slot{aligned.indices[r * aligned.k_max + std::size_t(i)], i};
    detail::sort_by_index(scratch, u);
    for (long long i = 0; i < row.count(r); ++i) {
      if (detail::find_slot(scratch, u, row.row_indices(r)[i]) < 0) {
        p.kind = row_error::sparse_not_aligned;
        p.operand = "row";
        p.entry = i;
        p.value = row.row_indices(r)[i];
        return p;
      }
    }
    return detail::check_grad_row(grad_aligned, r, u, "grad_aligned");
  });
  detail::cpu::parallel_for(policy.threads, row.rows, 8 * std::size_t(sparse_max_entries), [&](std::size_t r) {
    detail::index_slot slots[sparse_max_entries];
    const int c = int(row.count(r)), u = int(aligned.counts[r]);
    for (int i = 0; i < c; ++i) slots[i] = detail::index_slot{row.row_indices(r)[i], i};
    detail::sort_by_index(slots, c);
    const T* g = grad_aligned.row(r);
    T* out = grad_row.row(r);
    // Upstream gradients at −inf outputs are ignored (docs/api.md): a token of U∖S where the
    // row's tail is massless (its value log r − log m is −inf), the bucket where it is too or U
    // covers the vocabulary, an entry of S whose own value is −inf (a masked input: gradient 0).
    const double lr = double(row.log_remainder[r]);
    const long long vocab = static_cast<long long>(row.vocab), m = vocab - c, m_u = vocab - u;
    const bool tail_counted = !detail::masked_value<T>(detail::tail_log_value(lr, m));
    double g_remainder = detail::masked_value<T>(detail::shrink_log_remainder(lr, m, m_u))
                             ? 0.0 : double(grad_aligned.log_remainder[r]);
    const T* values = row.row_log_probs(r);
    for (int i = 0; i < c; ++i) out[i] = T(0);
    for (int i = 0; i < u; ++i) {
      const int slot = detail::find_slot(slots, c, aligned.indices[r * aligned.k_max + std::size_t(i)]);
      if (slot >= 0) {
        const int at = slots[slot].position;
        out[at] = detail::masked_value<T>(double(values[at])) ? T(0) : g[i];
      } else if (tail_counted) {
        g_remainder += double(g[i]);
      }
    }
    for (std::size_t i = std::size_t(c); i < grad_row.k_max; ++i) out[i] = T(0);
    grad_row.log_remainder[r] = T(g_remainder);
  });
}

// ---------------------------------------------------------------------------------------------
// KL, projection and its backward on aligned rows.

/// kl_out[r] = KL(new ‖ old) of aligned rows: the KL of the lumped (|U|+1)-category rows, equal to
/// the KL of the expanded V-vectors under uniform tails. +inf where new has mass that old lacks,
/// disjoint supports included (as the dense kl).
template <class T>
void kl(cpu_policy policy, aligned_input<T> rows, T* kl_out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "kl";
  detail::check_aligned_view(fn, "rows", rows);
  if (rows.rows != 0 && kl_out == nullptr) detail::throw_shape(fn, "kl_out is a null pointer");
  detail::lumped_checks checks;
  checks.disjoint_ok = true;  // disjoint rows are +inf, not an error
  detail::validate_aligned(fn, policy.threads, rows, checks);
  detail::cpu::parallel_for(policy.threads, rows.rows, 8 * std::size_t(sparse_max_entries), [&](std::size_t r) {
    double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1];
    int slot[sparse_max_entries + 1];
    detail::row_setup setup;
    const int n = detail::lumped_pair_setup(rows, r, zn, zo, slot, setup);
    kl_out[r] = T(detail::cpu::kl_row(zn, zo, std::size_t(n), setup));
  });
}

/// The trust-region projection of aligned rows (math.md §2, §4): the dense projection of the
/// lumped (|U|+1)-category rows (bucket = one category of log-mass log r), which under uniform
/// tails is exactly the projection of the expanded V-vectors. Writes `out` (indices and counts of
/// U, log π* on U, the bucket's log π*) and stats (rows entries; μ and σ² over the lumped
/// categories). Inactive rows (KL ≤ ε) are the log-softmax of the lumped new row (the new row
/// itself when normalised); only violating rows are solved. Guarantees and throws as the dense
/// project(), plus the sparse-row checks (shape_error / domain_error naming the row).
template <class T>
void project(cpu_policy policy, aligned_input<T> rows, double eps, sparse_batch_view<T> out,
             projection_stats* stats, const projection_options& options = {}) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project";
  detail::check_sparse_project_arguments(fn, rows, eps, out, stats, options);
  detail::lumped_checks checks;
  checks.eps = eps;
  checks.capacity = out.k_max;  // after the lumped scan, before infeasibility (the device's order)
  detail::validate_aligned(fn, policy.threads, rows, checks);
  detail::cpu::parallel_for(policy.threads, rows.rows, 16 * std::size_t(sparse_max_entries), [&](std::size_t r) {
    double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1], lp[sparse_max_entries + 1];
    int slot[sparse_max_entries + 1];
    detail::row_setup setup;
    const int n = detail::lumped_pair_setup(rows, r, zn, zo, slot, setup);
    stats[r] = detail::cpu::project_row(zn, zo, std::size_t(n), setup, eps, options, lp);
    stats[r].row_fingerprint = detail::cpu::aligned_row_fingerprint(rows, r);
    detail::write_lumped_row(rows, r, slot, n, lp, out);
  });
}

/// VJP of project(aligned): given upstream g on the output (∂L/∂log π* on U and on the bucket),
/// writes grad_new = ∂L/∂(new aligned log-probs, new log-remainder), grad_old likewise for the old
/// side (skipped when empty) and grad_eps[r] = ∂L/∂ε (skipped when null) — the dense VJP
/// (math.md §3) on the lumped categories. Upstream entries at −inf outputs are ignored.
template <class T>
void project_backward(cpu_policy policy, aligned_input<T> rows, sparse_input<T> log_probs,
                      const projection_stats* stats, sparse_grad_input<T> grad,
                      sparse_grad_view<T> grad_new, sparse_grad_view<T> grad_old = {},
                      typename detail::identity<T>::type* grad_eps = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_backward";
  detail::check_sparse_project_backward_arguments(fn, rows, log_probs, stats, grad, grad_new, grad_old);
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::project_backward{}, rows.rows));
  const bool want_old = !grad_old.empty();
  // Row by row (the lowest row with any problem): the aligned row (validate_aligned), then
  // log_probs, the upstream gradient and the stats (below). One fast yes/no pass over the aligned
  // rows and, while each row is in cache, the output, upstream gradient and stats of the same row;
  // only a batch with a refused row runs the full checks, which name it.
  auto own_problem = [&](std::size_t r) {
    detail::row_problem p;
    p.operand = "log_probs";
    // Its own capacity first: the entries below are read up to count.
    if (log_probs.counts[r] < 0 || std::size_t(log_probs.counts[r]) > log_probs.k_max) {
      p.kind = row_error::sparse_count;
      p.value = double(log_probs.counts[r]);
      return p;
    }
    if (log_probs.counts[r] != rows.counts[r]) {
      p.kind = row_error::sparse_not_aligned;
      p.value = double(log_probs.counts[r]);
      return p;
    }
    for (long long i = -1; i < log_probs.count(r); ++i) {
      const double g = i < 0 ? double(grad.log_remainder[r]) : double(grad.row(r)[i]);
      const double l = i < 0 ? double(log_probs.log_remainder[r]) : double(log_probs.row_log_probs(r)[i]);
      // project() writes the aligned support in its order: any other id (permuted, negative, out
      // of range) is not its output.
      if (i >= 0 && log_probs.row_indices(r)[i] != rows.indices[r * rows.k_max + std::size_t(i)]) {
        p.kind = row_error::sparse_wrong_token;
        p.entry = i;
        p.value = double(log_probs.row_indices(r)[i]);
        p.other = double(rows.indices[r * rows.k_max + std::size_t(i)]);
        return p;
      }
      if (l != l) {
        p.kind = row_error::sparse_nan;
        p.entry = i;
        return p;
      }
      if (l > 0.0) {  // +inf included
        p.kind = row_error::sparse_above_one;
        p.entry = i;
        p.value = l;
        return p;
      }
      const bool tail = rows.vocab > std::size_t(rows.counts[r]);
      const std::size_t at = r * rows.k_max + std::size_t(i < 0 ? 0 : i);
      const double new_side = i < 0 ? (tail ? double(rows.new_log_remainder[r]) : detail::neg_inf())
                                    : double(rows.new_log_probs[at]);
      const double old_side = i < 0 ? (tail ? double(rows.old_log_remainder[r]) : detail::neg_inf())
                                    : double(rows.old_log_probs[at]);
      // π* ≪ p̃ and π* ≪ q for every status.
      if (l > detail::neg_inf() && (new_side == detail::neg_inf() || old_side == detail::neg_inf())) {
        p.kind = row_error::sparse_masked_mass;
        p.entry = i;
        p.value = l;
        return p;
      }
      if (l > detail::neg_inf() && !(g - g == 0.0)) {
        p.kind = row_error::sparse_nan;
        p.operand = "grad";
        p.entry = i;
        p.value = g;
        return p;
      }
    }
    return detail::check_stats_for(stats[r], [&] { return detail::cpu::aligned_row_fingerprint(rows, r); });
  };
  detail::validate_aligned(fn, policy.threads, rows, detail::lumped_checks{}, [&](std::size_t r, bool finite) {
        const sparse_index c = log_probs.counts[r];
        if (c < 0 || std::size_t(c) > log_probs.k_max || c != rows.counts[r]) return true;
        const bool tail = rows.vocab > std::size_t(c);
        const T masked = T(detail::neg_inf());
        const std::size_t at = r * rows.k_max;
        return !detail::cpu::backward_row_fine(
                   log_probs.row_indices(r), rows.indices + at, log_probs.row_log_probs(r), rows.new_log_probs + at,
                   rows.old_log_probs + at, grad.row(r), int(c), log_probs.log_remainder[r],
                   tail ? rows.new_log_remainder[r] : masked, tail ? rows.old_log_remainder[r] : masked,
                   grad.log_remainder[r], finite) ||
               bool(detail::check_stats_for(stats[r], [&] { return detail::cpu::aligned_row_fingerprint(rows, r); }));
      }, [&](std::size_t r, long long c) {  // the same row's output and upstream gradient
        detail::cpu::prefetch_entries(log_probs.row_indices(r), c);
        detail::cpu::prefetch_entries(log_probs.row_log_probs(r), c);
        detail::cpu::prefetch_entries(grad.row(r), c);
      }, own_problem);
  unsigned char* overflowed = scratch.data();
  // Whether a written gradient row (count entries and its bucket) is finite: its values were formed
  // and checked in double, so only a narrower T can overflow here.
  auto lumped_row_fits = [](const T* row, int count, T bucket) {
    if constexpr (std::is_same<T, double>::value) {
      return true;
    } else {
      bool fine = bucket - bucket == T(0);
      for (int j = 0; j < count; ++j) fine &= row[j] - row[j] == T(0);
      return fine;
    }
  };
  // Whether row r's written outputs (grad_new, grad_old when asked, and ∂L/∂ε) fit T.
  auto outputs_fit = [&](std::size_t r, int count, double row_grad_eps, bool with_old) {
    return detail::fits_in<T>(row_grad_eps) && lumped_row_fits(grad_new.row(r), count, grad_new.log_remainder[r]) &&
           (!with_old || lumped_row_fits(grad_old.row(r), count, grad_old.log_remainder[r]));
  };
  detail::cpu::parallel_for(policy.threads, rows.rows, 16 * std::size_t(sparse_max_entries), [&](std::size_t r) {
    const int count = static_cast<int>(rows.counts[r]);
    if (r + detail::cpu::prefetch_rows_ahead < rows.rows) {
      const std::size_t ahead = r + detail::cpu::prefetch_rows_ahead, at = ahead * rows.k_max;
      const long long c = rows.counts[ahead];
      detail::cpu::prefetch_entries(rows.new_log_probs + at, c);
      detail::cpu::prefetch_entries(rows.old_log_probs + at, c);
      detail::cpu::prefetch_entries(log_probs.row_log_probs(ahead), c);
      detail::cpu::prefetch_entries(grad.row(ahead), c);
    }
    if (!want_old) {  // the common row, read in place (the bits of the lumped path below)
      const bool tail = rows.vocab > std::size_t(count);
      const std::size_t at = r * rows.k_max;
      const T masked = T(detail::neg_inf());
      const detail::cpu::sparse_vjp_row_view<T> v{rows.new_log_probs + at,
                                                  rows.old_log_probs + at,
                                                  log_probs.row_log_probs(r),
                                                  grad.row(r),
                                                  count,
                                                  tail ? rows.new_log_remainder[r] : masked,
                                                  tail ? rows.old_log_remainder[r] : masked,
                                                  log_probs.log_remainder[r],
                                                  grad.log_remainder[r]};
      double row_grad_eps = 0.0;
      const int done = detail::cpu::sparse_vjp_row_short(v, stats[r], grad_new.row(r), grad_new.k_max,
                                                         grad_new.log_remainder + r, &row_grad_eps);
      if (done >= 0) {
        overflowed[r] = done == 0;  // 0 also where a written output does not fit T
        if (grad_eps) grad_eps[r] = T(row_grad_eps);
        return;
      }
    }
    double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1], lp[sparse_max_entries + 1],
        g[sparse_max_entries + 1], gn[sparse_max_entries + 1], go[sparse_max_entries + 1];
    int slot[sparse_max_entries + 1];
    const int n = detail::lumped_pair(rows, r, zn, zo, slot);
    // n = count + 1: every category kept, slot[j] = j (the common case; loops the compiler
    // vectorises). Otherwise through slot.
    const bool identity = n == count + 1;
    const T* row_lp = log_probs.row_log_probs(r);
    const T* row_g = grad.row(r);
    if (identity) {
      for (int j = 0; j < count; ++j) lp[j] = double(row_lp[j]);
      for (int j = 0; j < count; ++j) g[j] = double(row_g[j]);
      lp[count] = double(log_probs.log_remainder[r]);
      g[count] = double(grad.log_remainder[r]);
    } else {
      for (int j = 0; j < n; ++j) {
        const bool bucket = slot[j] == count;
        lp[j] = double(bucket ? log_probs.log_remainder[r] : row_lp[slot[j]]);
        g[j] = double(bucket ? grad.log_remainder[r] : row_g[slot[j]]);
      }
    }
    double row_grad_eps = 0.0;
    overflowed[r] = detail::offset_row(stats[r])  // |μ| ≫ σ: against a reference (offset_rows.hpp)
                        ? !detail::cpu::vjp_offset_row(zn, zo, lp, g, std::size_t(n), stats[r], gn,
                                                       want_old ? go : nullptr, &row_grad_eps,
                                                       detail::two_point_pi_ulps<T>())
                        : !detail::cpu::vjp_row(zn, zo, lp, g, std::size_t(n), stats[r], gn,
                                                want_old ? go : nullptr, &row_grad_eps, nullptr,
                                                detail::two_point_pi_ulps<T>());
    auto scatter = [&](const double* lumped, sparse_grad_view<T> to) {
      T* row = to.row(r);
      if (identity) {
        for (int j = 0; j < count; ++j) row[j] = T(lumped[j]);
        for (std::size_t i = std::size_t(count); i < to.k_max; ++i) row[i] = T(0);
        to.log_remainder[r] = T(lumped[count]);
        return;
      }
      for (std::size_t i = 0; i < to.k_max; ++i) row[i] = T(0);
      to.log_remainder[r] = T(0);
      for (int j = 0; j < n; ++j) (slot[j] == count ? to.log_remainder[r] : row[slot[j]]) = T(lumped[j]);
    };
    scatter(gn, grad_new);
    if (want_old) scatter(go, grad_old);
    if (grad_eps) grad_eps[r] = T(row_grad_eps);
    // vjp_row checked the lumped values in double; the outputs must fit T too.
    if (!outputs_fit(r, count, row_grad_eps, want_old)) overflowed[r] = 1;
  });
  detail::throw_overflowed<T>(fn, overflowed, rows.rows);
}

TROLL_END_NAMESPACE
