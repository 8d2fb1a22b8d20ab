// troll/sparsify_state.hpp — the public types of the sparse path's limits and of vocabulary-shard
// sparsify: sparse_index, the capacity constants, and sparsify_state (the mergeable partial state
// sparsify_shard writes and sparsify_merge / sparsify_finalize read, on either backend). Plain,
// trivially copyable structs, identical on host and device.
#pragma once

#include <cmath>
#include <cstdint>

#include "config.hpp"
#include "detail/numeric.hpp"

TROLL_BEGIN_NAMESPACE

/// Index type stored in sparse supports (token ids of a sparse row, compact; V < 2^31).
using sparse_index = std::int32_t;

/// Largest K sparsify accepts (a sparse row from sparsify holds at most K + 1 entries: the
/// sampled token may be added).
inline constexpr int sparsify_max_k = 256;

/// Largest support any sparse row may hold (an aligned union of two sparsified rows fits).
inline constexpr int sparse_max_entries = 1024;

/// Most disjoint token ranges one sparsify_state records. Merging adjacent shards coalesces their
/// ranges, so a row split into n shards needs at most ⌈n / 2⌉ whatever the merge order.
inline constexpr int sparsify_max_ranges = 32;

/// Doubles per row of sparsify_finalize's `log_sums` (taken back by sparsify_shard_backward):
/// {ref, log Σ_j e^{z_j − ref}, tail_ref, log Σ_{j∉S} e^{z_j − tail_ref}}, ref the row's and
/// tail_ref the tail's largest logit (−inf: no tail mass) — each normaliser relative to its own
/// reference, so that logits of any magnitude keep their digits (detail::row_log_sums).
inline constexpr int sparsify_log_sums_width = 4;

/// A half-open range [begin, end) of token ids.
struct sparse_token_range {
  sparse_index begin;
  sparse_index end;
};

namespace detail {

/// log Σ exp(w_i) of a set, as (max, Σ exp(w_i − max)); merges associatively.
struct log_sum_state {
  double m = neg_inf();
  double s = 0.0;

  /// The absolute log-sum m + log s (a double of magnitude |m|: use log_sum_relative where m may
  /// be large).
  TROLL_HOST_DEVICE double value() const { return m == neg_inf() ? neg_inf() : m + ::log(s); }
};

/// One token of a running top-K: its logit (widened to double) and its global index.
struct sparse_candidate {
  double logit;
  sparse_index index;
};

}  // namespace detail

/// The partial state of sparsify over a set of tokens of one row (a whole row, or one vocabulary
/// shard of it). Holds the K best tokens seen (a min-heap: the worst kept token at the root), the
/// log-sum-exp of every other token seen, and the sampled token's logit when it was seen. The
/// sampled token never enters the heap or the outside sum: it is always kept, so keeping it
/// apart makes the tail mass exact without any subtraction.
/// Trivially copyable (about 4 KiB); merging two states of disjoint token sets is associative.
/// The state also says which tokens it has seen: `vocab` (the row's V) and `covered`, the
/// sorted, disjoint, non-adjacent ranges of token ids seen so far. sparsify_merge refuses states
/// whose ranges overlap (a shard merged twice) and sparsify_finalize refuses a state that does not
/// cover exactly [0, V); both validate every field first (detail::check_state), so a corrupted
/// state is a typed error, never an out-of-bounds access.
struct sparsify_state {
  int k = 0;     ///< heap capacity (the K of sparsify)
  int size = 0;  ///< tokens in the heap
  sparse_index sampled = -1;            ///< the row's sampled token (−1: none)
  bool has_sampled = false;             ///< the sampled token was among the tokens seen
  double sampled_logit = 0.0;
  detail::log_sum_state outside;        ///< every token seen that is neither in the heap nor sampled
  sparse_index vocab = 0;               ///< V of the row (0: not a state sparsify_shard made)
  int range_count = 0;                  ///< entries of `covered` in use
  sparse_token_range covered[sparsify_max_ranges];   ///< the token ids seen
  detail::sparse_candidate heap[sparsify_max_k + 1];  ///< one spare slot for finalize
};

TROLL_END_NAMESPACE
