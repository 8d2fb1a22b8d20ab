// troll/detail/cuda/sparse_shards.cuh — the vocabulary-shard states on the device: merging two
// sparsify_states of disjoint token sets and finalising a whole-row state into a sparse row. One
// warp per row; the warp copies the state into shared memory and one lane runs the shared
// host/device code (detail::merge_into, detail::finalize) on it. States are the same struct on
// the host and the device, so CPU and GPU shard states mix freely.
#pragma once

#include <cstddef>

#include <cub/util_type.cuh>

#include "../../config.hpp"
#include "../../sparse_types.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "row_report.cuh"
#include "sparse_warp.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Rows (warps) per block of the state kernels: 4 states of ~4 KiB in shared memory.
constexpr int state_warps = 4;

/// Launch shape of a state kernel over `rows` rows.
inline warp_launch state_launch_for(std::size_t rows) {
  warp_launch l;
  l.threads = unsigned(state_warps * warp_lanes);
  const std::size_t blocks = (rows + state_warps - 1) / state_warps;
  l.grid = unsigned(blocks < max_grid_rows ? blocks : max_grid_rows);
  return l;
}

#ifdef __CUDACC__

/// Copies a state by the lanes of one warp (8-byte words), then syncs the warp.
__device__ inline void warp_copy_state(sparsify_state& to, const sparsify_state& from) {
  static_assert(sizeof(sparsify_state) % sizeof(unsigned long long) == 0, "sparsify_state: whole 8-byte words");
  constexpr int words = int(sizeof(sparsify_state) / sizeof(unsigned long long));
  auto* dst = reinterpret_cast<unsigned long long*>(&to);
  const auto* src = reinterpret_cast<const unsigned long long*>(&from);
  for (int i = lane_id(); i < words; i += warp_lanes) dst[i] = src[i];
  __syncwarp();
}

/// A state problem (detail::check_state, check_merge, check_whole_row) as a row report; `which`
/// names the state (0: into / states, 1: from). See cuda_row_error::state_invalid.
__device__ inline cuda_row_report state_report(const state_problem& p, int which) {
  cuda_row_report report;
  if (!p) return report;
  report.error = cuda_row_error::state_invalid;
  report.operand = static_cast<int>(p.kind) + 32 * which;
  report.token = static_cast<unsigned long long>(p.entry);
  report.value = p.value;
  return report;
}

/// Lane 0's report, in every lane of the warp.
__device__ inline cuda_row_report broadcast_report(cuda_row_report report) {
  report.error = static_cast<cuda_row_error>(__shfl_sync(full_warp, static_cast<int>(report.error), 0));
  report.operand = __shfl_sync(full_warp, report.operand, 0);
  report.token = __shfl_sync(full_warp, report.token, 0);
  report.value = __shfl_sync(full_warp, report.value, 0);
  return report;
}

/// Rows of `range`: into[r] ← merge(into[r], from[r]) (detail::merge_into). Lane 0 validates both
/// states and the pair as the CPU does (check_state, check_merge); a rejected row leaves into[r]
/// invalid (k = 0). A template (State = sparsify_state) only so that the header-only kernel may
/// be defined in every translation unit.
template <class State>
__global__ void __launch_bounds__(state_warps * warp_lanes)
    sparsify_merge_kernel(State* into, const State* from, row_range range, device_checks checks) {
  __shared__ cub::Uninitialized<State> scratch[state_warps];
  State& st = scratch[threadIdx.x / warp_lanes].Alias();
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    const State& a = into[r];
    const State& b = from[r];
    cuda_row_report report;
    if (lane_id() == 0) {
      index_slot slots[sparsify_max_k];
      state_problem p = check_state(a, slots);
      int which = 0;
      if (!p) p = check_state(b, slots), which = 1;
      if (!p) p = check_merge(a, b), which = 1;
      report = state_report(p, which);
    }
    report = broadcast_report(report);
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    if (report.error != cuda_row_error::none) {
      __syncwarp();  // every lane has read into[r] before lane 0 marks it
      if (lane_id() == 0) into[r].k = 0, into[r].size = 0;
      continue;
    }
    warp_copy_state(st, a);
    if (lane_id() == 0) merge_into(st, b);
    __syncwarp();
    warp_copy_state(into[r], st);
  }
}

/// Rows of `range`: the sparse row of whole-row state states[r] (detail::finalize), padded to
/// out.k_max; `tail_max` (may be null) receives the row's largest logit outside the support, and
/// with `tail_sums` (tail_shards blocks of rows × 2 doubles: sparsify_tail_sums' pairs, added as
/// exact_sums in block order, as the CPU) the values are the canonical ones. Row checks in the
/// CPU's order (the state and its coverage of out.vocab with k, capacity, support); a rejected
/// row gets count 0, padding and a NaN log-remainder (and NaN log_sums and tail_max).
template <class T>
__global__ void __launch_bounds__(state_warps * warp_lanes)
    sparsify_finalize_kernel(const sparsify_state* states, int k, double log_delta, sparse_batch_view<T> out,
                             double* log_sums, double* tail_max, const double* tail_sums,
                             std::size_t tail_shards, row_range range, device_checks checks) {
  __shared__ cub::Uninitialized<sparsify_state> scratch[state_warps];
  sparsify_state& st = scratch[threadIdx.x / warp_lanes].Alias();
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    const sparsify_state& s = states[r];
    cuda_row_report report;
    if (lane_id() == 0) {
      index_slot slots[sparsify_max_k];
      state_problem p = check_state(s, slots);
      if (!p) p = check_whole_row(s, k, static_cast<long long>(out.vocab));
      report = state_report(p, 0);
      if (report.error == cuda_row_error::none) {
        const std::size_t need = std::size_t(s.size) + (s.sampled >= 0 ? 1 : 0);
        if (out.k_max < need) {
          report.error = cuda_row_error::state_capacity, report.token = out.k_max, report.value = double(need);
        } else if (state_has_no_support(s)) {
          report.error = cuda_row_error::no_support;
        }
      }
    }
    report = broadcast_report(report);
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    sparse_index* indices = out.row_indices(r);
    T* log_probs = out.row_log_probs(r);
    int count = 0;
    if (report.error == cuda_row_error::none) {
      warp_copy_state(st, s);
      if (lane_id() == 0) {
        exact_sum tail;
        for (std::size_t b = 0; b < tail_shards; ++b) {
          const double* part = tail_sums + 2 * (b * out.rows + r);
          tail = exact_add(tail, exact_sum{part[0], part[1]});
        }
        finalize(st, log_delta, indices, log_probs, count, out.log_remainder[r],
                 log_sums != nullptr ? log_sums + sparsify_log_sums_width * r : nullptr, tail_max != nullptr ? tail_max + r : nullptr,
                 tail_sums != nullptr ? &tail : nullptr);
      }
      count = __shfl_sync(full_warp, count, 0);
    } else if (lane_id() == 0) {
      out.log_remainder[r] = static_cast<T>(quiet_nan());
      if (log_sums != nullptr)
        for (int j = 0; j < sparsify_log_sums_width; ++j) log_sums[sparsify_log_sums_width * r + j] = quiet_nan();
      if (tail_max != nullptr) tail_max[r] = quiet_nan();
    }
    for (std::size_t i = std::size_t(count) + std::size_t(lane_id()); i < out.k_max; i += warp_lanes) {
      indices[i] = -1;
      log_probs[i] = static_cast<T>(neg_inf());
    }
    if (lane_id() == 0) out.counts[r] = count;
    __syncwarp();  // the shared state is reused by the next row
  }
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
