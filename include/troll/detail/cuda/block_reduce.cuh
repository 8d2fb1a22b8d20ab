// troll/detail/cuda/block_reduce.cuh — block-wide all-reduce: CUB BlockReduce with a custom
// merge, result broadcast to every thread of the block through shared memory. The Newton loop
// needs every thread to see the same reduced lse_state so that all threads take the same path.
#pragma once

#include <cstddef>

#include <cub/block/block_reduce.cuh>
#include <cub/util_type.cuh>

#include "../../config.hpp"
#include "../lse_state.hpp"
#include "error_check.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Shared memory of one all-reduce of values of type V (trivially constructible, as __shared__
/// variables must be).
template <class V>
struct reduce_storage {
  typename cub::BlockReduce<V, block_threads>::TempStorage temp;
  cub::Uninitialized<V> result;
};

/// Reduces one value per thread with `op` (associative) and returns the result in every thread.
/// Must be reached by all threads of the block (it contains barriers).
template <class V, class Op>
__device__ inline V block_all_reduce(reduce_storage<V>& storage, const V& value, Op op) {
  const V total = cub::BlockReduce<V, block_threads>(storage.temp).Reduce(value, op);
  if (threadIdx.x == 0) storage.result.Alias() = total;
  __syncthreads();
  const V shared = storage.result.Alias();
  __syncthreads();  // the storage may be reused by the next call
  return shared;
}

/// merge() of lse_state as a CUB reduction operator.
struct merge_lse {
  __device__ lse_state operator()(const lse_state& a, const lse_state& b) const { return merge(a, b); }
};

/// The smaller of two token positions (a row's first bad token) as a CUB reduction operator.
struct min_token {
  __device__ std::size_t operator()(std::size_t a, std::size_t b) const { return a < b ? a : b; }
};

/// The larger of two doubles as a CUB reduction operator, NaN where either is NaN (bound_max: a
/// block's bound on the |entries| it wrote, read by an overflow check, never drops a NaN entry
/// whatever the order of the reduction).
struct larger_of {
  __device__ double operator()(double a, double b) const { return bound_max(a, b); }
};

/// Sum of two doubles (the backward's Σ g and Σ g·(d − μ)).
struct double_pair {
  double first = 0.0;
  double second = 0.0;
};
struct add_pair {
  __device__ double_pair operator()(const double_pair& a, const double_pair& b) const {
    return double_pair{a.first + b.first, a.second + b.second};
  }
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
