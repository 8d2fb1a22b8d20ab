// troll/detail/cuda/offset_reference.cuh — the reference token and μ' of an offset row
// (detail/centring_reference.hpp) by the whole block: the token with the largest log π* (the
// lowest such token on ties, as the CPU's reference_of), then μ' = Σ_J π_j d'_j / Σ_J π_j with
// d' relative to it. Two reductions, only on offset rows (|μ| > 2^20 σ); every other row gets the
// plain reference (0, 0, μ) without a barrier. block_reference: by a whole block (the dense
// kernels), warp_reference: by one warp (the sparse rows); every thread of it must call it with
// the same stats.
#pragma once

#include <cstddef>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../centring_reference.hpp"
#include "../numeric.hpp"
#include "block_reduce.cuh"
#include "row_scan.cuh"
#include "sparse_warp.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// One token as block_reference reads it: its two logits and log π*.
struct reference_entry {
  double new_logit;
  double old_logit;
  double log_pi;
};

/// The token with the largest log π* so far (no_token: none above −inf).
struct reference_pick {
  double log_pi = neg_inf();
  std::size_t token = no_token;
};

/// The larger log π*, the lower token on ties (NaN never enters: `>` skips it).
struct pick_larger {
  __device__ reference_pick operator()(const reference_pick& a, const reference_pick& b) const {
    if (a.log_pi > b.log_pi) return a;
    if (b.log_pi > a.log_pi) return b;
    return a.token < b.token ? a : b;
  }
};

/// Shared memory of block_reference.
struct reference_storage {
  reduce_storage<reference_pick> pick;
  reduce_storage<double_pair> sums;
};

/// The two reductions by a whole block.
struct block_reducer {
  reference_storage& storage;
  __device__ reference_pick operator()(const reference_pick& v) const {
    return block_all_reduce(storage.pick, v, pick_larger{});
  }
  __device__ double_pair operator()(const double_pair& v) const { return block_all_reduce(storage.sums, v, add_pair{}); }
};

/// The two reductions by one warp.
struct warp_reducer {
  __device__ reference_pick operator()(const reference_pick& v) const { return warp_all_reduce(v, pick_larger{}); }
  __device__ double_pair operator()(const double_pair& v) const { return warp_all_reduce(v, add_pair{}); }
};

/// The reference of a row of `size` tokens whose token i is `entry(i)` (a reference_entry), each
/// thread taking tokens first, first + stride, …, and `reduce` combining the threads.
template <class Entry, class Reduce>
__device__ centring_reference strided_reference(std::size_t size, const projection_stats& s, const Entry& entry,
                                                std::size_t first, std::size_t stride, const Reduce& reduce) {
  centring_reference r = plain_reference(s);
  if (!offset_row(s)) return r;  // uniform across the threads that reduce
  reference_pick local;
  for (std::size_t i = first; i < size; i += stride) {
    const double v = entry(i).log_pi;
    if (v > local.log_pi) local = reference_pick{v, i};  // i grows: the lowest on ties
  }
  const reference_pick pick = reduce(local);
  if (pick.token == no_token) return r;  // no mass: a row the checks reject
  const reference_entry k = entry(pick.token);
  r.offset = true;
  r.new_ref = k.new_logit;
  r.old_ref = k.old_logit;
  double_pair sums;  // Σ π d', Σ π
  for (std::size_t i = first; i < size; i += stride) {
    const reference_entry e = entry(i);
    if (!(e.log_pi > neg_inf())) continue;
    const double p = ::exp(e.log_pi);
    sums.first += p * r.difference(e.new_logit, e.old_logit);
    sums.second += p;
  }
  const double_pair total = reduce(sums);
  r.mu = total.first / total.second;
  return r;
}

/// The reference of a lumped row of `size` entries (the sparse kernels' U and bucket), by one warp.
template <class Entry>
__device__ centring_reference warp_reference(std::size_t size, const projection_stats& s, const Entry& entry) {
  return strided_reference(size, s, entry, std::size_t(lane_id()), std::size_t(warp_lanes), warp_reducer{});
}

/// The reference of a dense row, by the whole block.
template <class T>
__device__ centring_reference block_reference(const T* zn, const T* zo, const T* log_pi, std::size_t size,
                                              const projection_stats& s, reference_storage& storage) {
  const auto entry = [=](std::size_t i) {
    return reference_entry{static_cast<double>(zn[i]), static_cast<double>(zo[i]), static_cast<double>(log_pi[i])};
  };
  return strided_reference(size, s, entry, std::size_t(threadIdx.x), std::size_t(block_threads),
                           block_reducer{storage});
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
