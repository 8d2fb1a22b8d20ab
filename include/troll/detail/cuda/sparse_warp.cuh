// troll/detail/cuda/sparse_warp.cuh — the building blocks of the sparse CUDA kernels: warp
// all-reduce of any trivially copyable summary, a warp bitonic sort of (index, position) slots in
// shared memory, the device check of one sparse row (the rules of cpu::check_sparse_row, as a
// cuda_row_report) and the union of two supports in the CPU's order (detail::union_support).
#pragma once

#include <cstddef>
#include <cstring>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "error_check.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

constexpr int warp_lanes = 32;
constexpr unsigned full_warp = 0xFFFFFFFFu;

/// Token id past every real one: padding of sorted slot arrays.
constexpr sparse_index index_padding = 0x7FFFFFFF;

/// Slots of shared scratch one warp needs to sort a row of at most `k_max` entries (a power of
/// two ≥ min(k_max, sparse_max_entries), at least 32).
TROLL_HOST_DEVICE inline int sort_slots(std::size_t k_max) {
  const std::size_t cap = k_max < std::size_t(sparse_max_entries) ? k_max : std::size_t(sparse_max_entries);
  int p = warp_lanes;
  while (std::size_t(p) < cap) p *= 2;
  return p;
}

#ifdef __CUDACC__

/// Reduces one value per lane with `op` (associative) by an xor butterfly in which the lower
/// lane's value is always the first operand: both lanes of a pair form the same merge, so every
/// lane ends with the same result bit for bit. That order matters: lse_state's merge keeps the
/// first operand's reference (its mode) on tied maxima, and with each lane's own value first the
/// lanes of a row whose categories tie (a uniform old row at t = 0) each kept their own token as
/// the mode, the solver's next member was centred differently in every lane, and the sparse
/// projection ended not converged (found on an H200, 2026-11-28). All 32 lanes must call it.
template <class V, class Op>
__device__ V warp_all_reduce(V value, Op op) {
  static_assert(sizeof(V) % sizeof(int) == 0, "warp_all_reduce: size must be a multiple of 4 bytes");
  constexpr int words = int(sizeof(V) / sizeof(int));
  for (int offset = warp_lanes / 2; offset > 0; offset /= 2) {
    int mine[words], theirs[words];
    std::memcpy(mine, &value, sizeof(V));
#pragma unroll
    for (int w = 0; w < words; ++w) theirs[w] = __shfl_xor_sync(full_warp, mine[w], offset);
    V other;
    std::memcpy(&other, theirs, sizeof(V));
    // (threadIdx.x & offset: the lane's bit at this stage, offset < 32, warps whole in x)
    value = (threadIdx.x & unsigned(offset)) != 0u ? op(other, value) : op(value, other);
  }
  return value;
}

struct merge_log_sum {
  __device__ log_sum_state operator()(const log_sum_state& a, const log_sum_state& b) const {
    return merge(a, b);
  }
};
struct add_double {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct min_size {
  __device__ std::size_t operator()(std::size_t a, std::size_t b) const { return a < b ? a : b; }
};

__device__ inline int lane_id() { return int(threadIdx.x) % warp_lanes; }

/// Sorts slots[0..size) by index, ascending (size a power of two ≥ 32; pad with
/// index_padding). Called by all lanes of one warp; the slots are in shared memory.
__device__ inline void warp_sort_slots(index_slot* slots, int size) {
  const int lane = lane_id();
  for (int k = 2; k <= size; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int pair = lane; pair < size / 2; pair += warp_lanes) {
        const int i = ((pair & ~(j - 1)) << 1) | (pair & (j - 1));
        const int partner = i | j;
        const bool ascending = (i & k) == 0;
        const index_slot a = slots[i], b = slots[partner];
        if ((a.index > b.index) == ascending) slots[i] = b, slots[partner] = a;
      }
      __syncwarp();
    }
  }
}

/// Loads entries [0, count) of a support as slots, pads to `size`, sorts by index.
__device__ inline void warp_sorted_support(const sparse_index* indices, int count, index_slot* slots, int size) {
  __syncwarp();  // every lane's reads of the previous sort (a binary search, a duplicate scan) are done
  for (int i = lane_id(); i < size; i += warp_lanes)
    slots[i] = i < count ? index_slot{indices[i], i} : index_slot{index_padding, i};
  __syncwarp();
  warp_sort_slots(slots, size);
}

/// Slot of `index` in slots[0..n) sorted by index, or −1 (one lane's binary search).
__device__ inline int find_sorted(const index_slot* slots, int n, sparse_index index) {
  return find_slot(slots, n, index);
}

/// The lowest lane of the warp whose `flag` is set, or −1 (all lanes call it).
__device__ inline int first_lane(bool flag) {
  const unsigned mask = __ballot_sync(full_warp, flag);
  return mask == 0u ? -1 : __ffs(int(mask)) - 1;
}

/// The device counterpart of cpu::check_sparse_row, by one warp: count range, then entry by entry
/// (token id in [0, V), not NaN, ≤ 0), then the remainder (not NaN, ≤ 0), no remainder when the
/// support covers V, some mass, distinct token ids, a total mass within sparse_mass_tolerance<T>
/// of 1. `remainder_rules` = false skips the remainder and mass rules (a support whose values are
/// not read); a null `log_probs` skips the entry value rules too (only the indices are read:
/// sparsify_tail_sums). Sorts the support into `slots` (`size` slots)
/// when the entry checks pass. Every lane returns the same report; `operand` is copied into it.
template <class T>
__device__ cuda_row_report warp_check_sparse_row(const sparse_index* indices, const T* log_probs, long long count,
                                                 double log_remainder, std::size_t capacity, std::size_t vocab,
                                                 int operand, bool remainder_rules, index_slot* slots, int size) {
  cuda_row_report report;
  report.operand = operand;
  if (!sparse_count_fits(count, capacity, vocab)) {
    report.error = cuda_row_error::sparse_count;
    report.value = double(count);
    return report;
  }
  const int n = int(count);
  bool any_mass = false;
  for (int base = 0; base < n; base += warp_lanes) {
    const int i = base + lane_id();
    cuda_row_error error = cuda_row_error::none;
    double value = 0.0;
    if (i < n) {
      const long long index = indices[i];
      const double l = log_probs != nullptr ? static_cast<double>(log_probs[i]) : neg_inf();
      if (index < 0 || index >= static_cast<long long>(vocab)) {
        error = cuda_row_error::sparse_index, value = double(index);
      } else if (l != l) {
        error = cuda_row_error::sparse_nan;
      } else if (l > 0.0) {
        error = cuda_row_error::sparse_above_one, value = l;
      }
      any_mass = any_mass || l > neg_inf();
    }
    const int bad = first_lane(error != cuda_row_error::none);
    if (bad >= 0) {
      report.error = static_cast<cuda_row_error>(__shfl_sync(full_warp, int(error), bad));
      report.value = __shfl_sync(full_warp, value, bad);
      report.token = static_cast<unsigned long long>(base + bad);
      return report;
    }
  }
  any_mass = __any_sync(full_warp, any_mass);
  if (remainder_rules) {
    const double r = log_remainder;
    if (r != r || r > 0.0) {
      report.error = r != r ? cuda_row_error::sparse_nan : cuda_row_error::sparse_above_one;
      report.token = ~0ull;
      report.value = r;
      return report;
    }
    if (static_cast<std::size_t>(n) == vocab && r > neg_inf()) {
      report.error = cuda_row_error::sparse_no_tail, report.value = r;
      return report;
    }
    if (!any_mass && !(r > neg_inf())) {
      report.error = cuda_row_error::sparse_no_mass;
      return report;
    }
  }
  warp_sorted_support(indices, n, slots, size);
  // The smallest repeated token id; the entry reported is its second occurrence by position.
  for (int base = 1; base < n; base += warp_lanes) {
    const int i = base + lane_id();
    const bool repeat = i < n && slots[i].index == slots[i - 1].index;
    const int bad = first_lane(repeat);
    if (bad < 0) continue;
    const int at = base + bad;
    const sparse_index index = slots[at].index;
    // Positions of every slot holding `index` (a run starting at or before at − 1).
    int first = 0x7FFFFFFF, second = 0x7FFFFFFF;
    for (int j = lane_id(); j < n; j += warp_lanes) {
      if (slots[j].index != index) continue;
      const int p = slots[j].position;
      if (p < first) second = first, first = p;
      else if (p < second) second = p;
    }
    for (int offset = warp_lanes / 2; offset > 0; offset /= 2) {
      const int of = __shfl_xor_sync(full_warp, first, offset), os = __shfl_xor_sync(full_warp, second, offset);
      const int lo = first < of ? first : of;
      const int hi_a = first < of ? of : first;
      const int next = second < os ? second : os;
      first = lo;
      second = hi_a < next ? hi_a : next;
    }
    report.error = cuda_row_error::sparse_duplicate;
    report.token = static_cast<unsigned long long>(second);
    report.value = double(index);
    return report;
  }
  if (remainder_rules) {  // last, as cpu::check_sparse_row: Σ_S p_i + r within the tolerance of 1
    double mass = 0.0;
    for (int i = lane_id(); i < n; i += warp_lanes) mass += ::exp(static_cast<double>(log_probs[i]));
    mass = warp_all_reduce(mass, add_double{}) + ::exp(log_remainder);
    if (!(mass >= 1.0 - sparse_mass_tolerance<T>() && mass <= 1.0 + sparse_mass_tolerance<T>())) {
      report.error = cuda_row_error::sparse_mass;
      report.token = sizeof(T);
      report.value = mass;
    }
  }
  return report;
}

/// U = S_new ∪ S_old in the order of detail::union_support (the new row's entries in its order,
/// then the old row's entries missing from it, in the old row's order), by one warp. Needs both
/// supports sorted into new_sorted / old_sorted (counts cn, co). Calls emit(u, token, new_position,
/// old_position) once per entry of U (positions in either row, −1 where absent; lanes in
/// parallel) and returns |U| in every lane.
template <class Emit>
__device__ int warp_union(const sparse_index* new_indices, int cn, const sparse_index* old_indices, int co,
                          const index_slot* new_sorted, const index_slot* old_sorted, Emit&& emit) {
  const int lane = lane_id();
  for (int i = lane; i < cn; i += warp_lanes) {
    const int slot = find_slot(old_sorted, co, new_indices[i]);
    emit(i, new_indices[i], i, slot >= 0 ? old_sorted[slot].position : -1);
  }
  int u = cn;
  for (int base = 0; base < co; base += warp_lanes) {
    const int i = base + lane;
    const bool old_only = i < co && find_slot(new_sorted, cn, old_indices[i]) < 0;
    const unsigned mask = __ballot_sync(full_warp, old_only);
    if (old_only) emit(u + __popc(mask & ((1u << lane) - 1u)), old_indices[i], -1, i);
    u += __popc(mask);
  }
  return u;
}

/// Launch shape of a warp-per-row kernel whose warps each sort `arrays` supports of up to k_max
/// entries in shared memory: up to 8 warps a block, at most 32 KiB of scratch a block.
struct warp_launch {
  unsigned grid = 0;
  unsigned threads = 0;
  std::size_t shared_bytes = 0;
  int slots = 0;  // sorted slots per array (sort_slots(k_max))
};

inline warp_launch warp_launch_for(std::size_t rows, std::size_t k_max, int arrays) {
  warp_launch l;
  l.slots = sort_slots(k_max);
  const std::size_t per_warp = std::size_t(arrays) * std::size_t(l.slots) * sizeof(index_slot);
  std::size_t warps = per_warp == 0 ? 8 : (32768 / per_warp);
  warps = warps < 1 ? 1 : (warps > 8 ? 8 : warps);
  l.threads = unsigned(warps) * warp_lanes;
  l.shared_bytes = warps * per_warp;
  const std::size_t blocks = (rows + warps - 1) / warps;
  l.grid = unsigned(blocks < max_grid_rows ? blocks : max_grid_rows);
  return l;
}

/// The launch that run_sparse() calls for a warp-per-row kernel sorting `arrays` supports of up
/// to k_max entries: kernel(args..., slots, range, device) in warp_launch_for's shape on `stream`.
/// The arguments are copied into the launch.
template <class... Params, class... Args>
auto warp_per_row(cudaStream_t stream, std::size_t k_max, int arrays, void (*kernel)(Params...),
                  const Args&... args) {
  return [=](row_range range, device_checks device) {
    const warp_launch l = warp_launch_for(range.count, k_max, arrays);
    kernel<<<l.grid, l.threads, l.shared_bytes, stream>>>(args..., l.slots, range, device);
  };
}

/// This warp's scratch (arrays × slots index_slots) in the block's dynamic shared memory.
__device__ inline index_slot* warp_scratch(int arrays, int slots) {
  extern __shared__ unsigned long long troll_sparse_shared[];
  return reinterpret_cast<index_slot*>(troll_sparse_shared) +
         std::size_t(threadIdx.x / warp_lanes) * std::size_t(arrays) * std::size_t(slots);
}

/// First row of this warp and the stride of the warp-per-row loop.
__device__ inline std::size_t warp_first_row(const row_range& range) {
  return range.begin + std::size_t(blockIdx.x) * (blockDim.x / warp_lanes) + threadIdx.x / warp_lanes;
}
__device__ inline std::size_t warp_row_stride() { return std::size_t(gridDim.x) * (blockDim.x / warp_lanes); }

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
