// troll/sparse_types.hpp — the sparse batch layout (math.md §4) shared by every backend: views
// of sparse rows, aligned row pairs and their gradients over caller memory, and sparsify's
// options. The host-side shape and option checks the CPU and CUDA entry points run before any
// work are in detail/sparse_arguments.hpp. Eigen-free, so the CUDA backend
// (troll/cuda_sparse.cuh) includes it without the CPU kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "batch.hpp"
#include "config.hpp"
#include "sparsify_state.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {
template <class T, class I>
using copy_const_t = std::conditional_t<std::is_const<T>::value, const I, I>;
}  // namespace detail

/// A batch of sparse rows in a padded layout over caller memory (maps 1:1 onto device memory):
///   indices    rows × k_max   token ids of the support (entries past counts[r] are ignored)
///   log_probs  rows × k_max   log p_i, normalised over the whole vocabulary
///   counts     rows           |S_r| ≤ k_max
///   log_remainder rows        log r = log Σ_{j∉S} p_j (−inf: no tail mass)
/// with vocabulary size `vocab` = V; row r's tail count is m = V − counts[r] and its tail is taken
/// as uniform (each tail token r/m). Outputs written by troll pad entries past the count with
/// index −1 and log-prob −inf.
template <class T>
struct sparse_batch_view {
  using index_type = detail::copy_const_t<T, sparse_index>;
  index_type* indices = nullptr;
  T* log_probs = nullptr;
  index_type* counts = nullptr;
  T* log_remainder = nullptr;
  std::size_t rows = 0;
  std::size_t k_max = 0;
  std::size_t vocab = 0;

  TROLL_HOST_DEVICE index_type* row_indices(std::size_t r) const { return indices + r * k_max; }
  TROLL_HOST_DEVICE T* row_log_probs(std::size_t r) const { return log_probs + r * k_max; }
  TROLL_HOST_DEVICE long long count(std::size_t r) const { return counts[r]; }
  TROLL_HOST_DEVICE long long tail_count(std::size_t r) const {
    return static_cast<long long>(vocab) - counts[r];
  }

  template <class U = T, class = std::enable_if_t<!std::is_const<U>::value>>
  TROLL_HOST_DEVICE operator sparse_batch_view<const U>() const {
    return sparse_batch_view<const U>{indices, log_probs, counts, log_remainder, rows, k_max, vocab};
  }
};

/// A new and an old row aligned on one support U (math.md §4): shared indices and counts, each
/// side's log-probabilities on U and each side's bucket over V∖U. Same padded layout as
/// sparse_batch_view; new_side() / old_side() view one side as a sparse batch.
template <class T>
struct aligned_batch_view {
  using index_type = detail::copy_const_t<T, sparse_index>;
  index_type* indices = nullptr;
  index_type* counts = nullptr;
  T* new_log_probs = nullptr;
  T* old_log_probs = nullptr;
  T* new_log_remainder = nullptr;
  T* old_log_remainder = nullptr;
  std::size_t rows = 0;
  std::size_t k_max = 0;
  std::size_t vocab = 0;

  TROLL_HOST_DEVICE sparse_batch_view<T> new_side() const {
    return sparse_batch_view<T>{indices, new_log_probs, counts, new_log_remainder, rows, k_max, vocab};
  }
  TROLL_HOST_DEVICE sparse_batch_view<T> old_side() const {
    return sparse_batch_view<T>{indices, old_log_probs, counts, old_log_remainder, rows, k_max, vocab};
  }

  template <class U = T, class = std::enable_if_t<!std::is_const<U>::value>>
  TROLL_HOST_DEVICE operator aligned_batch_view<const U>() const {
    return aligned_batch_view<const U>{indices,           counts,           new_log_probs,
                                       old_log_probs,     new_log_remainder, old_log_remainder,
                                       rows,              k_max,            vocab};
  }
};

/// Gradients w.r.t. (or upstream of) a sparse batch: rows × k_max values on the support entries
/// (∂L/∂log p_i, same positions as the primal's log_probs) and one per row for the bucket
/// (∂L/∂log r). Entries past a row's count are ignored on input and written 0 on output.
template <class T>
struct sparse_grad_view {
  T* log_probs = nullptr;
  T* log_remainder = nullptr;
  std::size_t rows = 0;
  std::size_t k_max = 0;

  TROLL_HOST_DEVICE T* row(std::size_t r) const { return log_probs + r * k_max; }
  TROLL_HOST_DEVICE bool empty() const { return rows == 0; }

  template <class U = T, class = std::enable_if_t<!std::is_const<U>::value>>
  TROLL_HOST_DEVICE operator sparse_grad_view<const U>() const {
    return sparse_grad_view<const U>{log_probs, log_remainder, rows, k_max};
  }
};

/// Read-only inputs whose element type is deduced from an output argument.
template <class T>
using sparse_input = sparse_batch_view<const typename detail::identity<T>::type>;
template <class T>
using aligned_input = aligned_batch_view<const typename detail::identity<T>::type>;
template <class T>
using sparse_grad_input = sparse_grad_view<const typename detail::identity<T>::type>;

/// Controls of sparsify: keep the shortest prefix (by logit, ties to the lower index) whose mass
/// reaches 1 − delta, at most k tokens (1 ≤ k ≤ 256), then the sampled token if missing.
struct sparsify_options {
  int k = 64;
  double delta = 1e-5;
};

TROLL_END_NAMESPACE
