// troll/detail/cuda/sparse_sparsify.cuh — sparsify on the device: one 256-thread block per row,
// one streaming pass over the logits (fp32, fp16 or bf16), the semantics of detail::finalize.
//
// The row is read in tiles of 2048 tokens (8 per thread, 16-byte loads when aligned). A token
// whose logit beats the block's entry threshold θ joins a shared candidate buffer (warp-
// aggregated atomics); every other finite token joins the thread's running log-sum-exp of
// "outside" tokens (float exp, double sum). When the buffer may overflow, a block radix select
// on 64-bit keys (logit, then lower index first) keeps the K best, pushes the evicted ones into
// the outside sums and raises θ to the K-th best logit. Tokens arrive tile by tile in increasing
// index order, so a later token with logit = θ ranks after the K-th and cannot enter: the
// candidates end as exactly the CPU heap's K best and the outside sum holds every other token —
// the tail mass is a sum, never a difference. The sampled token is kept aside throughout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../sparse_types.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "block_reduce.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "sparse_warp.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Logit element types sparsify reads on the device (keys pack a float logit with the index).
template <class L>
struct is_sparsify_logit : std::false_type {};
template <>
struct is_sparsify_logit<float> : std::true_type {};
template <>
struct is_sparsify_logit<__half> : std::true_type {};
template <>
struct is_sparsify_logit<__nv_bfloat16> : std::true_type {};

/// Element types of dense logits the sparse kernels read (sparsify_backward, align).
template <class L>
struct is_device_logit : std::integral_constant<bool, is_sparsify_logit<L>::value || std::is_same<L, double>::value> {};

#ifdef __CUDACC__
__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline double to_double(double x) { return x; }
template <class L>
__device__ double to_double(L x) {
  return static_cast<double>(to_float(x));
}
#endif

constexpr int sparsify_items = 8;                                 // tokens per thread per tile
constexpr int sparsify_tile = block_threads * sparsify_items;     // 2048 tokens
constexpr int candidate_capacity = 2 * sparsify_tile;             // 4096 keys (32 KiB)
constexpr int candidate_per_thread = candidate_capacity / block_threads;
constexpr int sorted_capacity = 2 * block_threads;                // ≥ sparsify_max_k + 1

struct sparsify_shared {
  unsigned long long keys[candidate_capacity];
  double suffix_m[sparsify_max_k + 1];
  double suffix_s[sparsify_max_k + 1];
  union {
    typename cub::BlockScan<int, block_threads>::TempStorage scan_int;
    typename cub::BlockScan<log_sum_state, block_threads>::TempStorage scan_state;
  } temp;
  int hist[256];
  int count, kept, digit, above, bin, last_false, has_sampled, sampled_pos;
  unsigned long long min_key;
  float threshold, sampled_logit;
};

/// What the block reduces at the end of the stream: the outside sum and the first bad token.
struct stream_summary {
  log_sum_state outside;
  std::size_t first_bad = no_token;
};

#ifdef __CUDACC__

struct merge_stream_summary {
  __device__ stream_summary operator()(const stream_summary& a, const stream_summary& b) const {
    return stream_summary{merge(a.outside, b.outside), a.first_bad < b.first_bad ? a.first_bad : b.first_bad};
  }
};

/// Key of a candidate: larger logit first, then lower index (the order of ranks_before).
__device__ inline unsigned long long candidate_key(float logit, long long index) {
  unsigned bits = __float_as_uint(logit == 0.0f ? 0.0f : logit);  // −0 ties with +0
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(bits) << 32) | (0x7FFFFFFFull - static_cast<unsigned long long>(index));
}
__device__ inline float key_logit(unsigned long long key) {
  unsigned bits = static_cast<unsigned>(key >> 32);
  bits = (bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits;
  return __uint_as_float(bits);
}
__device__ inline sparse_index key_index(unsigned long long key) {
  return static_cast<sparse_index>(0x7FFFFFFFu - static_cast<unsigned>(key & 0xFFFFFFFFull));
}

/// One token into a thread's outside sum (running max in float, sum in double).
__device__ inline void add_outside(float& run_max, double& run_sum, float x) {
  if (x > run_max) {
    run_sum = run_sum * ::exp(static_cast<double>(run_max) - static_cast<double>(x)) + 1.0;
    run_max = x;
  } else if (x > -__int_as_float(0x7f800000)) {
    run_sum += ::exp(static_cast<double>(x) - static_cast<double>(run_max));
  }
}

/// Loads 8 consecutive logits as floats; `aligned`: p is 16-byte aligned and all 8 exist.
template <class L>
__device__ void load_items(const L* p, bool aligned, std::size_t valid, float (&v)[sparsify_items]) {
  if (aligned) {
    constexpr int vectors = int(sizeof(L) * sparsify_items / sizeof(uint4));
    L e[sparsify_items];
#pragma unroll
    for (int w = 0; w < vectors; ++w) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[w];
      std::memcpy(reinterpret_cast<char*>(e) + w * sizeof(uint4), &raw, sizeof(uint4));
    }
#pragma unroll
    for (int i = 0; i < sparsify_items; ++i) v[i] = to_float(e[i]);
    return;
  }
#pragma unroll
  for (int i = 0; i < sparsify_items; ++i) v[i] = std::size_t(i) < valid ? to_float(p[i]) : -__int_as_float(0x7f800000);
}

/// Keeps the k best of keys[0..n) (n > k) in keys[0..k): a radix select over 8-bit digits from
/// the top, stopping as soon as the selected bin is kept whole. Evicted candidates join the
/// calling threads' outside sums; θ becomes the k-th best logit. All threads call it.
__device__ inline void select_top(sparsify_shared& sh, int n, int k, float& run_max, double& run_sum) {
  const int tid = int(threadIdx.x);
  unsigned long long prefix = 0, mask = 0;
  int remaining = k, shift = 56;
  for (;; shift -= 8) {
    sh.hist[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += block_threads) {
      const unsigned long long key = sh.keys[i];
      if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 0xFFull], 1);
    }
    __syncthreads();
    const int bin = 255 - tid, c = sh.hist[bin];
    int above = 0;
    cub::BlockScan<int, block_threads>(sh.temp.scan_int).ExclusiveSum(c, above);
    if (above < remaining && remaining <= above + c) sh.digit = bin, sh.above = above, sh.bin = c;
    __syncthreads();
    prefix |= static_cast<unsigned long long>(sh.digit) << shift;
    mask |= 0xFFull << shift;
    remaining -= sh.above;
    const bool done = sh.bin == remaining || shift == 0;
    __syncthreads();
    if (done) break;
  }
  unsigned long long held[candidate_per_thread];
#pragma unroll
  for (int j = 0; j < candidate_per_thread; ++j) {
    const int i = tid + j * block_threads;
    held[j] = i < n ? sh.keys[i] : 0ull;
  }
  if (tid == 0) sh.kept = 0, sh.min_key = ~0ull;
  __syncthreads();
  const unsigned long long floor = prefix >> shift;
#pragma unroll
  for (int j = 0; j < candidate_per_thread; ++j) {
    if (tid + j * block_threads >= n) continue;
    if ((held[j] >> shift) >= floor) {
      sh.keys[atomicAdd(&sh.kept, 1)] = held[j];
      atomicMin(&sh.min_key, held[j]);
    } else {
      add_outside(run_max, run_sum, key_logit(held[j]));
    }
  }
  __syncthreads();
  if (tid == 0) sh.count = sh.kept, sh.threshold = key_logit(sh.min_key);
  __syncthreads();
}

/// Sorts keys[0..sorted_capacity) descending (bitonic, one compare-exchange per thread a stage).
__device__ inline void block_sort_descending(unsigned long long* keys) {
  const int tid = int(threadIdx.x);
  for (int k = 2; k <= sorted_capacity; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      const int i = ((tid & ~(j - 1)) << 1) | (tid & (j - 1));
      const int partner = i | j;
      const bool up = (i & k) == 0;
      const unsigned long long a = keys[i], b = keys[partner];
      if ((a < b) == up) keys[i] = b, keys[partner] = a;
      __syncthreads();
    }
  }
}

__device__ inline log_sum_state single(double x) {
  log_sum_state s;
  push(s, x);
  return s;
}

/// Rows of `range`: the sparse rows of troll::sparsify (see troll/cuda_sparse.cuh). A rejected
/// row (NaN / +inf logits, all −inf, a sampled token outside [0, V)) gets count 0, NaN
/// log-remainder and padding.
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    sparsify_kernel(batch_view<const L> logits, const sparse_index* sampled, int k, double log_delta,
                    sparse_batch_view<T> out, row_range range, device_checks checks) {
  __shared__ sparsify_shared sh;
  __shared__ reduce_storage<stream_summary> summary_storage;
  __shared__ reduce_storage<log_sum_state> tail_storage;
  const int tid = int(threadIdx.x);
  const std::size_t size = logits.cols, end = range.begin + range.count;
  const float minus_inf = -__int_as_float(0x7f800000);
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const L* z = logits.row(r);
    const long long sampled_token = sampled != nullptr ? static_cast<long long>(sampled[r]) : -1;
    const bool sampled_ok = sampled == nullptr || (sampled_token >= 0 && sampled_token < static_cast<long long>(size));
    const bool vectors = reinterpret_cast<std::uintptr_t>(z) % sizeof(uint4) == 0;
    if (tid == 0) sh.count = 0, sh.threshold = minus_inf, sh.has_sampled = 0, sh.sampled_pos = -1, sh.last_false = 0;
    __syncthreads();

    float run_max = minus_inf;
    double run_sum = 0.0;
    std::size_t first_bad = no_token;
    for (std::size_t base = 0; base < size; base += sparsify_tile) {
      const int count = sh.count;
      __syncthreads();
      if (count > candidate_capacity - sparsify_tile) select_top(sh, count, k, run_max, run_sum);
      const float threshold = sh.threshold;
      const std::size_t first = base + std::size_t(tid) * sparsify_items;
      float v[sparsify_items];
      const bool full = base + sparsify_tile <= size;
      if (first < size) {
        load_items(z + first, vectors && full, size - first, v);
      } else {
#pragma unroll
        for (int i = 0; i < sparsify_items; ++i) v[i] = minus_inf;
      }
      bool enter[sparsify_items];
      float candidate[sparsify_items];
      float chunk_max = minus_inf;
#pragma unroll
      for (int i = 0; i < sparsify_items; ++i) {
        const std::size_t token = first + std::size_t(i);
        const float x = v[i];
        candidate[i] = x;
        enter[i] = false;
        if (!(x < -minus_inf)) {  // NaN or +inf (tokens past the row are −inf)
          if (token < first_bad) first_bad = token;
          v[i] = minus_inf;
          continue;
        }
        if (static_cast<long long>(token) == sampled_token) {
          sh.sampled_logit = x, sh.has_sampled = 1;
          v[i] = minus_inf;
          continue;
        }
        enter[i] = x > threshold;
        if (enter[i]) v[i] = minus_inf;
        chunk_max = fmaxf(chunk_max, v[i]);
      }
      if (chunk_max > minus_inf) {
        if (chunk_max > run_max) {
          run_sum *= ::exp(static_cast<double>(run_max) - static_cast<double>(chunk_max));
          run_max = chunk_max;
        }
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < sparsify_items; ++i) part += ::expf(v[i] - run_max);
        run_sum += static_cast<double>(part);
      }
      const int lane = lane_id();
#pragma unroll
      for (int i = 0; i < sparsify_items; ++i) {
        const unsigned mask = __ballot_sync(full_warp, enter[i]);
        if (mask == 0u) continue;
        const int leader = __ffs(int(mask)) - 1;
        int slot = 0;
        if (lane == leader) slot = atomicAdd(&sh.count, __popc(mask));
        slot = __shfl_sync(full_warp, slot, leader);
        if (enter[i]) {
          slot += __popc(mask & ((1u << lane) - 1u));
          sh.keys[slot] = candidate_key(candidate[i], static_cast<long long>(first + std::size_t(i)));
        }
      }
      __syncthreads();
    }
    const int candidates = sh.count;
    __syncthreads();
    if (candidates > k) select_top(sh, candidates, k, run_max, run_sum);
    const int kept = candidates < k ? candidates : k;

    stream_summary mine;
    mine.outside = run_max > minus_inf ? log_sum_state{static_cast<double>(run_max), run_sum} : log_sum_state{};
    mine.first_bad = first_bad;
    const stream_summary summary = block_all_reduce(summary_storage, mine, merge_stream_summary{});
    const bool has_sampled = sh.has_sampled != 0;
    const double sampled_logit = has_sampled ? static_cast<double>(sh.sampled_logit) : neg_inf();

    cuda_row_report report;
    if (!sampled_ok) {
      report.error = cuda_row_error::bad_sampled, report.value = double(sampled_token);
    } else if (summary.first_bad != no_token) {
      report = bad_value_report(0, summary.first_bad, to_double(z[summary.first_bad]));
    } else if (kept == 0 && summary.outside.m == neg_inf() && !(sampled_logit > neg_inf())) {
      report.error = cuda_row_error::all_masked;
    }
    if (tid == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    sparse_index* indices = out.row_indices(r);
    T* log_probs = out.row_log_probs(r);
    if (report.error != cuda_row_error::none) {
      for (std::size_t i = std::size_t(tid); i < out.k_max; i += block_threads)
        indices[i] = -1, log_probs[i] = static_cast<T>(neg_inf());
      if (tid == 0) out.counts[r] = 0, out.log_remainder[r] = static_cast<T>(quiet_nan());
      continue;
    }

    // The candidates and the sampled token, best first.
    const int listed = kept + (has_sampled ? 1 : 0);
    for (int i = kept + tid; i < sorted_capacity; i += block_threads) sh.keys[i] = 0ull;
    if (tid == 0 && has_sampled) sh.keys[kept] = candidate_key(sh.sampled_logit, sampled_token);
    __syncthreads();
    block_sort_descending(sh.keys);

    // suffix(j) = log-sum-exp of list[j..listed): an inclusive scan over the reversed list.
    log_sum_state items[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = listed - 1 - (2 * tid + e);
      items[e] = j >= 0 ? single(static_cast<double>(key_logit(sh.keys[j]))) : log_sum_state{};
    }
    cub::BlockScan<log_sum_state, block_threads>(sh.temp.scan_state).InclusiveScan(items, items, merge_log_sum{});
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = listed - 1 - (2 * tid + e);
      if (j >= 0) sh.suffix_m[j] = items[e].m, sh.suffix_s[j] = items[e].s;
    }
    for (int j = tid; j < listed; j += block_threads)
      if (static_cast<long long>(key_index(sh.keys[j])) == sampled_token && has_sampled) sh.sampled_pos = j;
    __syncthreads();
    const log_sum_state whole = listed > 0 ? merge(summary.outside, log_sum_state{sh.suffix_m[0], sh.suffix_s[0]})
                                           : summary.outside;
    const double log_total = whole.value();
    const int limit = listed < k ? listed : k;
    for (int j = tid + 1; j < limit; j += block_threads) {
      const log_sum_state rest = merge(summary.outside, log_sum_state{sh.suffix_m[j], sh.suffix_s[j]});
      if (!(rest.value() - log_total <= log_delta)) atomicMax(&sh.last_false, j);
    }
    __syncthreads();
    const int keep = limit <= 1 ? limit : sh.last_false + 1;
    const int sampled_pos = sh.sampled_pos;

    log_sum_state tail_part;
    for (int j = keep + tid; j < listed; j += block_threads)
      if (j != sampled_pos) push(tail_part, static_cast<double>(key_logit(sh.keys[j])));
    const log_sum_state tail = merge(summary.outside, block_all_reduce(tail_storage, tail_part, merge_log_sum{}));

    const bool append_sampled = sampled_pos >= keep;
    const int count = keep + (append_sampled ? 1 : 0);
    for (int j = tid; j < count; j += block_threads) {
      const unsigned long long key = sh.keys[j < keep ? j : sampled_pos];
      indices[j] = key_index(key);
      log_probs[j] = static_cast<T>(static_cast<double>(key_logit(key)) - log_total);
    }
    for (std::size_t i = std::size_t(count) + std::size_t(tid); i < out.k_max; i += block_threads)
      indices[i] = -1, log_probs[i] = static_cast<T>(neg_inf());
    if (tid == 0) {
      out.counts[r] = count;
      const double log_tail = tail.value();
      out.log_remainder[r] = static_cast<T>(log_tail == neg_inf() ? neg_inf() : log_tail - log_total);
    }
    __syncthreads();  // the shared keys are reused by the next row
  }
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
