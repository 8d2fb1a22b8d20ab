// troll/detail/sparse_arguments.hpp — the host-side shape and option checks of the sparse entry
// points (views, row and vocabulary agreement, sparsify's options, each entry point's argument
// list), run by the CPU and CUDA backends before any work. Eigen-free. The layout they check is
// troll/sparse_types.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../batch.hpp"
#include "../config.hpp"
#include "../errors.hpp"
#include "../projection_types.hpp"
#include "../sparse_types.hpp"
#include "arguments.hpp"
#include "numeric.hpp"
#include "row_problem.hpp"
#include "sparse_row.hpp"
#include "number_text.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

template <class T>
void check_sparse_view(const char* fn, const char* name, const sparse_batch_view<T>& v) {
  if (v.rows == 0) return;
  if (!v.indices || !v.log_probs || !v.counts || !v.log_remainder)
    throw_shape(fn, std::string(name) + " has a null pointer");
  if (v.vocab == 0) throw_shape(fn, std::string(name) + " has vocabulary size V = 0");
  if (v.vocab > std::size_t(INT32_MAX))
    throw_shape(fn, std::string(name) + " has a vocabulary larger than 2^31 - 1 tokens");
  if (v.k_max == 0) throw_shape(fn, std::string(name) + " has capacity k_max = 0");
  // No real buffer holds 2^59 entries; a view claiming more would wrap the sizes of the scratch
  // troll derives from it (rows · (12 · k_max + 13) bytes for sparsify) and be written past.
  if (v.k_max > (~std::size_t(0) / 32) / v.rows)
    throw_shape(fn, std::string(name) + " has rows * k_max = " + std::to_string(v.rows) + " * " +
                        std::to_string(v.k_max) + " entries, beyond the address space");
}

template <class T>
void check_aligned_view(const char* fn, const char* name, const aligned_batch_view<T>& v) {
  check_sparse_view(fn, name, v.new_side());
  check_sparse_view(fn, name, v.old_side());
}

inline void check_same_rows(const char* fn, const char* name_a, std::size_t rows_a, const char* name_b,
                     std::size_t rows_b) {
  if (rows_a != rows_b)
    throw_shape(fn, std::string(name_a) + " has " + std::to_string(rows_a) + " rows but " + name_b +
                        " has " + std::to_string(rows_b));
}

inline void check_same_vocab(const char* fn, const char* name_a, std::size_t a, const char* name_b,
                             std::size_t b) {
  if (a != b)
    throw_shape(fn, std::string(name_a) + " has vocabulary " + std::to_string(a) + " but " + name_b +
                        " has " + std::to_string(b));
}

template <class T>
void check_grad_view(const char* fn, const char* name, const sparse_grad_view<T>& g, std::size_t rows,
                     std::size_t k_max) {
  if (g.rows != rows || g.k_max < k_max)
    throw_shape(fn, std::string(name) + " is " + std::to_string(g.rows) + " rows x " +
                        std::to_string(g.k_max) + " but needs " + std::to_string(rows) + " x " +
                        std::to_string(k_max));
  if (rows != 0 && (!g.log_probs || !g.log_remainder))
    throw_shape(fn, std::string(name) + " has a null pointer");
}

/// Host checks of sparsify_shard_backward (both backends), in the CPU's order.
template <class L, class T>
void check_sparsify_shard_backward_arguments(const char* fn, const batch_view<const L>& shard_logits,
                                             std::size_t vocab_offset, const sparse_batch_view<const T>& support,
                                             const sparse_grad_view<const T>& grad, const double* log_sums,
                                             const batch_view<T>& grad_shard) {
  check_view(fn, "shard_logits", shard_logits);
  check_view(fn, "grad_shard", grad_shard);
  check_same_shape(fn, "shard_logits", shard_logits, "grad_shard", grad_shard);
  check_sparse_view(fn, "support", support);
  check_same_rows(fn, "shard_logits", shard_logits.rows, "support", support.rows);
  check_grad_view(fn, "grad", grad, shard_logits.rows, support.k_max);
  if (shard_logits.rows != 0 && log_sums == nullptr) throw_shape(fn, "log_sums is a null pointer");
  if (shard_logits.rows != 0 && (vocab_offset > support.vocab || shard_logits.cols > support.vocab - vocab_offset))
    throw_shape(fn, "the shard of " + std::to_string(shard_logits.cols) + " tokens at offset " +
                        std::to_string(vocab_offset) + " does not fit in the vocabulary [0, " +
                        std::to_string(support.vocab) + ")");
}

/// Host checks of sparsify_tail_sums (both backends), in the CPU's order.
template <class L, class T>
void check_sparsify_tail_sums_arguments(const char* fn, const batch_view<const L>& shard_logits,
                                        std::size_t vocab_offset, const sparse_batch_view<const T>& support,
                                        const double* tail_max, const double* sums) {
  check_view(fn, "shard_logits", shard_logits);
  check_sparse_view(fn, "support", support);
  check_same_rows(fn, "shard_logits", shard_logits.rows, "support", support.rows);
  if (shard_logits.rows != 0 && (tail_max == nullptr || sums == nullptr))
    throw_shape(fn, "tail_max or sums is a null pointer");
  if (shard_logits.rows != 0 && (vocab_offset > support.vocab || shard_logits.cols > support.vocab - vocab_offset))
    throw_shape(fn, "the shard of " + std::to_string(shard_logits.cols) + " tokens at offset " +
                        std::to_string(vocab_offset) + " does not fit in the vocabulary [0, " +
                        std::to_string(support.vocab) + ")");
}

inline void check_sparse_eps(const char* fn, double eps, const projection_options& opt) {
  check_eps(fn, eps);
  check_options(fn, opt);
}

inline void check_sparsify_options(const char* fn, const sparsify_options& o) {
  if (o.k < 1 || o.k > sparsify_max_k)
    throw domain_error(std::string("troll::") + fn + ": sparsify_options.k must be in [1, " +
                       std::to_string(sparsify_max_k) + "], got " + std::to_string(o.k));
  if (!(o.delta >= 0.0 && o.delta < 1.0))
    throw domain_error(std::string("troll::") + fn + ": sparsify_options.delta must be in [0, 1), got " +
                       number_text(o.delta));
}

template <class T>
void check_output_view(const char* fn, const char* name, const sparse_batch_view<T>& out,
                       std::size_t rows, std::size_t vocab, std::size_t k_needed) {
  check_sparse_view(fn, name, out);
  check_same_rows(fn, "the input", rows, name, out.rows);
  check_same_vocab(fn, "the input", vocab, name, out.vocab);
  if (rows != 0 && out.k_max < k_needed)
    throw_shape(fn, std::string(name) + " has capacity k_max = " + std::to_string(out.k_max) +
                        " but rows may need " + std::to_string(k_needed) + " entries");
}

/// The host-side checks of align(new_logits, new_support, old_rows, out) that read no values:
/// views, row counts and vocabulary sizes (new_support may be empty). Shared by CPU and CUDA.
template <class L, class T>
void check_align_arguments(const char* fn, const batch_view<const L>& new_logits,
                           const sparse_batch_view<const T>& new_support,
                           const sparse_batch_view<const T>& old_rows, const aligned_batch_view<T>& out) {
  check_view(fn, "new_logits", new_logits);
  check_sparse_view(fn, "old", old_rows);
  check_aligned_view(fn, "out", out);
  if (new_support.rows != 0) {
    check_sparse_view(fn, "new_support", new_support);
    check_same_rows(fn, "new_logits", new_logits.rows, "new_support", new_support.rows);
    check_same_vocab(fn, "new_logits", new_logits.cols, "new_support", new_support.vocab);
  }
  check_same_rows(fn, "new_logits", new_logits.rows, "old", old_rows.rows);
  check_same_rows(fn, "new_logits", new_logits.rows, "out", out.rows);
  check_same_vocab(fn, "new_logits", new_logits.cols, "old", old_rows.vocab);
  check_same_vocab(fn, "new_logits", new_logits.cols, "out", out.vocab);
}

/// The host-side checks of align(new_rows, old_rows, out) that read no values: views, row counts
/// and vocabulary sizes. Shared by CPU and CUDA.
template <class T>
void check_sparse_align_arguments(const char* fn, const sparse_batch_view<const T>& new_rows,
                                  const sparse_batch_view<const T>& old_rows, const aligned_batch_view<T>& out) {
  check_sparse_view(fn, "new", new_rows);
  check_sparse_view(fn, "old", old_rows);
  check_aligned_view(fn, "out", out);
  check_same_rows(fn, "new", new_rows.rows, "old", old_rows.rows);
  check_same_rows(fn, "new", new_rows.rows, "out", out.rows);
  check_same_vocab(fn, "new", new_rows.vocab, "old", old_rows.vocab);
  check_same_vocab(fn, "new", new_rows.vocab, "out", out.vocab);
}

/// The host-side checks of sparsify that read no values: the logits view, the options, and an
/// `out` that holds min(k + 1 for a sampled token, V) entries a row. Shared by CPU and CUDA.
template <class L, class T>
void check_sparsify_arguments(const char* fn, const batch_view<const L>& logits, bool with_sampled,
                              const sparsify_options& options, const sparse_batch_view<T>& out) {
  check_view(fn, "logits", logits);
  check_sparsify_options(fn, options);
  const std::size_t need = std::size_t(options.k) + (with_sampled ? 1 : 0);
  check_output_view(fn, "out", out, logits.rows, logits.cols, need < logits.cols ? need : logits.cols);
}

/// The host-side checks of project(aligned rows) that read no values. Shared by CPU and CUDA.
template <class T>
void check_sparse_project_arguments(const char* fn, const aligned_batch_view<const T>& rows, double eps,
                                    const sparse_batch_view<T>& out, const projection_stats* stats,
                                    const projection_options& options) {
  check_aligned_view(fn, "rows", rows);
  check_output_view(fn, "out", out, rows.rows, rows.vocab, 0);
  if (rows.rows != 0 && stats == nullptr) throw_shape(fn, "stats is a null pointer");
  check_sparse_eps(fn, eps, options);
}

/// The host-side checks of project_backward(aligned rows) that read no values: views, row
/// counts, vocabularies, gradient shapes (grad_old only when not empty), stats. Shared by CPU and
/// CUDA.
template <class T>
void check_sparse_project_backward_arguments(const char* fn, const aligned_batch_view<const T>& rows,
                                             const sparse_batch_view<const T>& log_probs,
                                             const projection_stats* stats, const sparse_grad_view<const T>& grad,
                                             const sparse_grad_view<T>& grad_new, const sparse_grad_view<T>& grad_old) {
  check_aligned_view(fn, "rows", rows);
  check_sparse_view(fn, "log_probs", log_probs);
  check_same_rows(fn, "rows", rows.rows, "log_probs", log_probs.rows);
  check_same_vocab(fn, "rows", rows.vocab, "log_probs", log_probs.vocab);
  check_grad_view(fn, "grad", grad, rows.rows, log_probs.k_max);
  check_grad_view(fn, "grad_new", grad_new, rows.rows, rows.k_max);
  if (!grad_old.empty()) check_grad_view(fn, "grad_old", grad_old, rows.rows, rows.k_max);
  if (rows.rows != 0 && stats == nullptr) throw_shape(fn, "stats is a null pointer");
}

/// The host-side checks of sparsify_backward that read no values. Shared by CPU and CUDA.
template <class L, class T>
void check_sparsify_backward_arguments(const char* fn, const batch_view<const L>& logits,
                                       const sparse_batch_view<const T>& support,
                                       const sparse_grad_view<const T>& grad, const batch_view<T>& grad_logits) {
  check_view(fn, "logits", logits);
  check_view(fn, "grad_logits", grad_logits);
  check_same_shape(fn, "logits", logits, "grad_logits", grad_logits);
  check_sparse_view(fn, "support", support);
  check_same_rows(fn, "logits", logits.rows, "support", support.rows);
  check_same_vocab(fn, "logits", logits.cols, "support", support.vocab);
  check_grad_view(fn, "grad", grad, logits.rows, support.k_max);
}

/// The host-side checks of align_backward(row, aligned, grad_aligned, grad_row) that read no
/// values: views, row counts, vocabulary sizes and gradient shapes. Shared by CPU and CUDA.
template <class T>
void check_align_backward_arguments(const char* fn, const sparse_batch_view<const T>& row,
                                    const aligned_batch_view<const T>& aligned,
                                    const sparse_grad_view<const T>& grad_aligned, const sparse_grad_view<T>& grad_row) {
  check_sparse_view(fn, "row", row);
  check_aligned_view(fn, "aligned", aligned);
  check_same_rows(fn, "row", row.rows, "aligned", aligned.rows);
  check_same_vocab(fn, "row", row.vocab, "aligned", aligned.vocab);
  check_grad_view(fn, "grad_aligned", grad_aligned, aligned.rows, aligned.k_max);
  check_grad_view(fn, "grad_row", grad_row, row.rows, row.k_max);
}

/// The host-side checks of sparsify_shard that read no values: the shard view, the options, the
/// states pointer, and the shard [vocab_offset, vocab_offset + cols) inside a vocabulary of
/// `vocab` < 2^31 tokens. Shared by CPU and CUDA.
template <class L>
void check_sparsify_shard_arguments(const char* fn, const batch_view<const L>& shard_logits, std::size_t vocab_offset,
                                    std::size_t vocab, const sparsify_options& options, const sparsify_state* states) {
  check_view(fn, "shard_logits", shard_logits);
  check_sparsify_options(fn, options);
  if (shard_logits.rows != 0 && states == nullptr) throw_shape(fn, "states is a null pointer");
  // Written so that nothing wraps: vocab_offset + cols may exceed SIZE_MAX.
  if (vocab == 0 || vocab > std::size_t(INT32_MAX))
    throw_shape(fn, "the vocabulary size " + std::to_string(vocab) + " is not in [1, 2^31 - 1]");
  if (vocab_offset > vocab || shard_logits.cols > vocab - vocab_offset)
    throw_shape(fn, "the shard of " + std::to_string(shard_logits.cols) + " tokens at offset " +
                        std::to_string(vocab_offset) + " does not fit in the vocabulary [0, " + std::to_string(vocab) +
                        ")");
}

/// The typed exception for a problem with row `row`'s state (named `name`) in sparsify_merge or
/// sparsify_finalize, through the one message table (row_error::state_bad_k … state_incomplete):
///   shape_error: k, size, vocab, covered ranges, heap ids, vocabulary of another state or of out;
///   domain_error: a NaN / infinite logit or outside sum, the sampled token covered but not held;
///   invalid_input: states that do not belong together (k, sampled token, overlapping coverage,
///   too many ranges) and a state that does not cover the whole vocabulary.
[[noreturn]] inline void throw_state_problem(const char* fn, std::size_t row, const char* name,
                                             const state_problem& p) {
  throw_row_problem(fn, row, make_problem(state_error(static_cast<int>(p.kind)), name, p.entry, p.value));
}

/// The host-side check of sparsify_merge: both state pointers set when rows > 0.
inline void check_sparsify_merge_arguments(const char* fn, const sparsify_state* into, const sparsify_state* from,
                                           std::size_t rows) {
  if (rows != 0 && (!into || !from)) throw_shape(fn, "a state pointer is null");
}

/// The host-side checks of sparsify_finalize that read no values: options, out, the states
/// pointer. Shared by CPU and CUDA.
template <class T>
void check_sparsify_finalize_arguments(const char* fn, const sparsify_state* states, const sparsify_options& options,
                                       const sparse_batch_view<T>& out) {
  check_sparsify_options(fn, options);
  check_sparse_view(fn, "out", out);
  if (out.rows != 0 && !states) throw_shape(fn, "states is a null pointer");
}

}  // namespace detail

TROLL_END_NAMESPACE
