// troll/detail/cuda/sparse_sparsify.cuh — sparsify on the device: one 256-thread block per row,
// one streaming pass over the logits (fp32, fp16, bf16 or double), the semantics of
// detail::finalize; and the same stream ending in a sparsify_state (vocabulary shards).
//
// The row is read in tiles (8 tokens per thread for fp32 / fp16 / bf16, 4 for double; 16-byte
// loads when aligned). A token whose logit beats the block's entry threshold θ joins a shared
// candidate buffer (warp-aggregated atomics); every other finite token joins the thread's
// running log-sum-exp of "outside" tokens (double sum). When the buffer may overflow, a block
// radix select on the candidate keys (logit, then lower index first: 64-bit keys for float
// logits, 96 bits for double) keeps the K best, pushes the evicted ones into the outside sums
// and raises θ to the K-th best logit. Tokens arrive tile by tile in increasing index order, so a
// later token with logit = θ ranks after the K-th and cannot enter: the candidates end as exactly
// the CPU heap's K best and the outside sum holds every other token — the tail mass is a sum,
// never a difference. The sampled token is kept aside throughout. These running sums pick the
// support (the δ prefix); the values written come from the canonical sums of
// detail::exact_log_sums — the tail's exact max and a second pass summing e^{z − m_tail} as
// double-double (canonical_tail_sum) — as the CPU's sparsify writes them.
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

/// Element types of dense logits the sparse kernels read on the device (sparsify, shards, align,
/// sparsify_backward).
template <class L>
struct is_sparsify_logit : std::false_type {};
template <>
struct is_sparsify_logit<float> : std::true_type {};
template <>
struct is_sparsify_logit<double> : std::true_type {};
template <>
struct is_sparsify_logit<__half> : std::true_type {};
template <>
struct is_sparsify_logit<__nv_bfloat16> : std::true_type {};

/// The logits of a CUDA entry point that reads them in their own precision (sparsify,
/// sparsify_shard, sparsify_tail_sums, align with dense logits, sparsify_backward,
/// sparsify_shard_backward) as a read-only view; the element type must be a sparsify logit.
template <class L>
batch_view<const std::remove_const_t<L>> sparsify_logits(batch_view<L> logits) {
  static_assert(is_sparsify_logit<std::remove_const_t<L>>::value,
                "troll (CUDA sparsify, sparsify_shard, sparsify_tail_sums, align, sparsify_backward, "
                "sparsify_shard_backward): logits must be float, double, __half or __nv_bfloat16");
  return {logits.data, logits.rows, logits.cols, logits.stride};
}

/// A candidate key of a double logit: `high` the logit's order bits, `low` the index part (32
/// bits); compared as the 96-bit number high·2³² + low. No initialisers: it lives in __shared__.
struct wide_key {
  unsigned long long high;
  unsigned long long low;
};

/// How sparsify ranks and buffers the tokens of logits of type L: fp32, fp16 and bf16 logits are
/// compared as floats with 64-bit keys (logit, index); double logits as doubles with 96-bit keys.
template <class L>
struct sparsify_keys {
  using value_type = float;
  using key_type = unsigned long long;
  static constexpr int items = 8;   // tokens per thread per tile
  static constexpr int digits = 8;  // 8-bit radix digits of a key
};
template <>
struct sparsify_keys<double> {
  using value_type = double;
  using key_type = wide_key;
  static constexpr int items = 4;
  static constexpr int digits = 12;
};

template <class Keys>
struct sparsify_layout {
  static constexpr int tile = block_threads * Keys::items;      // tokens per tile (2048 or 1024)
  static constexpr int capacity = 2 * tile;                     // candidate keys (32 KiB)
  static constexpr int per_thread = capacity / block_threads;  // candidate slots per thread
};
constexpr int sorted_capacity = 2 * block_threads;  // ≥ sparsify_max_k + 1

template <class Keys>
struct sparsify_shared {
  typename Keys::key_type keys[sparsify_layout<Keys>::capacity];
  double suffix_m[sparsify_max_k + 1];
  double suffix_s[sparsify_max_k + 1];
  union {
    typename cub::BlockScan<int, block_threads>::TempStorage scan_int;
    typename cub::BlockScan<log_sum_state, block_threads>::TempStorage scan_state;
  } temp;
  int hist[256];
  int count, kept, digit, above, bin, last_false, has_sampled, sampled_pos;
  unsigned long long min_word;
  typename Keys::value_type threshold, sampled_logit;
};

/// What the block reduces at the end of the stream: the outside sum and the first bad token.
struct stream_summary {
  log_sum_state outside;
  std::size_t first_bad = no_token;
};

#ifdef __CUDACC__

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline double to_double(double x) { return x; }
template <class L>
__device__ double to_double(L x) {
  return static_cast<double>(to_float(x));
}
/// A logit in the precision sparsify compares it in (sparsify_keys<L>::value_type).
template <class L>
__device__ float to_value(L x) {
  return to_float(x);
}
__device__ inline double to_value(double x) { return x; }

struct merge_stream_summary {
  __device__ stream_summary operator()(const stream_summary& a, const stream_summary& b) const {
    return stream_summary{merge(a.outside, b.outside), a.first_bad < b.first_bad ? a.first_bad : b.first_bad};
  }
};

// Keys: larger logit first, then lower index (the order of ranks_before); −0 ties with +0. The
// radix select reads 8-bit digits from the most significant (digit 0) down.

__device__ inline unsigned long long make_key(float logit, long long index) {
  unsigned bits = __float_as_uint(logit == 0.0f ? 0.0f : logit);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(bits) << 32) | (0x7FFFFFFFull - static_cast<unsigned long long>(index));
}
__device__ inline wide_key make_key(double logit, long long index) {
  unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(logit == 0.0 ? 0.0 : logit));
  bits = (bits & 0x8000000000000000ull) ? ~bits : (bits | 0x8000000000000000ull);
  return wide_key{bits, 0x7FFFFFFFull - static_cast<unsigned long long>(index)};
}
__device__ inline float key_logit(unsigned long long key) {
  unsigned bits = static_cast<unsigned>(key >> 32);
  bits = (bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits;
  return __uint_as_float(bits);
}
__device__ inline double key_logit(const wide_key& key) {
  const unsigned long long bits =
      (key.high & 0x8000000000000000ull) ? (key.high & 0x7FFFFFFFFFFFFFFFull) : ~key.high;
  return __longlong_as_double(static_cast<long long>(bits));
}
__device__ inline sparse_index key_index(unsigned long long key) {
  return static_cast<sparse_index>(0x7FFFFFFFu - static_cast<unsigned>(key & 0xFFFFFFFFull));
}
__device__ inline sparse_index key_index(const wide_key& key) {
  return static_cast<sparse_index>(0x7FFFFFFFu - static_cast<unsigned>(key.low & 0xFFFFFFFFull));
}
__device__ inline bool key_less(unsigned long long a, unsigned long long b) { return a < b; }
__device__ inline bool key_less(const wide_key& a, const wide_key& b) {
  return a.high < b.high || (a.high == b.high && a.low < b.low);
}
__device__ inline bool key_equal(unsigned long long a, unsigned long long b) { return a == b; }
__device__ inline bool key_equal(const wide_key& a, const wide_key& b) { return a.high == b.high && a.low == b.low; }
/// The 8-bit digit d (0 = most significant).
__device__ inline int key_digit(unsigned long long key, int d) { return int((key >> (56 - 8 * d)) & 0xFFull); }
__device__ inline int key_digit(const wide_key& key, int d) {
  return d < 8 ? int((key.high >> (56 - 8 * d)) & 0xFFull) : int((key.low >> (88 - 8 * d)) & 0xFFull);
}
/// The key with digits 0..d kept and the others zero (d = −1: zero).
__device__ inline unsigned long long key_head(unsigned long long key, int d) {
  return d < 0 ? 0ull : key & (~0ull << (56 - 8 * d));
}
__device__ inline wide_key key_head(const wide_key& key, int d) {
  if (d < 0) return wide_key{0ull, 0ull};
  if (d < 8) return wide_key{key.high & (~0ull << (56 - 8 * d)), 0ull};
  return wide_key{key.high, key.low & (~0ull << (88 - 8 * d))};
}
/// `key` (zero in digit d) with digit d set.
__device__ inline unsigned long long with_digit(unsigned long long key, int d, int digit) {
  return key | (static_cast<unsigned long long>(digit) << (56 - 8 * d));
}
__device__ inline wide_key with_digit(wide_key key, int d, int digit) {
  if (d < 8) {
    key.high |= static_cast<unsigned long long>(digit) << (56 - 8 * d);
  } else {
    key.low |= static_cast<unsigned long long>(digit) << (88 - 8 * d);
  }
  return key;
}
/// The most significant 64 bits (their minimum over keys gives the smallest logit).
__device__ inline unsigned long long key_word(unsigned long long key) { return key; }
__device__ inline unsigned long long key_word(const wide_key& key) { return key.high; }
template <class K>
__device__ K word_key(unsigned long long word);
template <>
__device__ inline unsigned long long word_key<unsigned long long>(unsigned long long word) {
  return word;
}
template <>
__device__ inline wide_key word_key<wide_key>(unsigned long long word) {
  return wide_key{word, 0ull};
}
/// The zero key ranks below every real key (padding of the sort).
template <class K>
__device__ K zero_key() {
  return word_key<K>(0ull);
}

__device__ inline float exp_of(float x) { return ::expf(x); }
__device__ inline double exp_of(double x) { return ::exp(x); }

/// One token into a thread's outside sum (running max in the logit precision, sum in double).
template <class V>
__device__ void add_outside(V& run_max, double& run_sum, V x) {
  if (x > run_max) {
    run_sum = run_sum * ::exp(static_cast<double>(run_max) - static_cast<double>(x)) + 1.0;
    run_max = x;
  } else if (x > static_cast<V>(neg_inf())) {
    run_sum += ::exp(static_cast<double>(x) - static_cast<double>(run_max));
  }
}

/// Loads N consecutive logits; `aligned`: p is 16-byte aligned and all N exist.
template <class L, class V, int N>
__device__ void load_items(const L* p, bool aligned, std::size_t valid, V (&v)[N]) {
  if (aligned) {
    static_assert(sizeof(L) * N % sizeof(uint4) == 0, "load_items: whole 16-byte vectors");
    constexpr int vectors = int(sizeof(L) * N / sizeof(uint4));
    L e[N];
#pragma unroll
    for (int w = 0; w < vectors; ++w) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[w];
      std::memcpy(reinterpret_cast<char*>(e) + w * sizeof(uint4), &raw, sizeof(uint4));
    }
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_value(e[i]);
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = std::size_t(i) < valid ? to_value(p[i]) : static_cast<V>(neg_inf());
}

/// Keeps the k best of keys[0..n) (n > k) in keys[0..k): a radix select over 8-bit digits from
/// the top, stopping as soon as the selected bin is kept whole. Evicted candidates join the
/// calling threads' outside sums; θ becomes the k-th best logit. All threads call it.
template <class Keys>
__device__ void select_top(sparsify_shared<Keys>& sh, int n, int k, typename Keys::value_type& run_max,
                           double& run_sum) {
  using key_type = typename Keys::key_type;
  constexpr int per_thread = sparsify_layout<Keys>::per_thread;
  const int tid = int(threadIdx.x);
  key_type prefix = zero_key<key_type>();
  int remaining = k, d = 0;
  for (;; ++d) {
    sh.hist[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += block_threads) {
      const key_type key = sh.keys[i];
      if (key_equal(key_head(key, d - 1), prefix)) atomicAdd(&sh.hist[key_digit(key, d)], 1);
    }
    __syncthreads();
    const int bin = 255 - tid, c = sh.hist[bin];
    int above = 0;
    cub::BlockScan<int, block_threads>(sh.temp.scan_int).ExclusiveSum(c, above);
    if (above < remaining && remaining <= above + c) sh.digit = bin, sh.above = above, sh.bin = c;
    __syncthreads();
    prefix = with_digit(prefix, d, sh.digit);
    remaining -= sh.above;
    const bool done = sh.bin == remaining || d == Keys::digits - 1;
    __syncthreads();
    if (done) break;
  }
  key_type held[per_thread];
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    const int i = tid + j * block_threads;
    held[j] = i < n ? sh.keys[i] : zero_key<key_type>();
  }
  if (tid == 0) sh.kept = 0, sh.min_word = ~0ull;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    if (tid + j * block_threads >= n) continue;
    if (!key_less(key_head(held[j], d), prefix)) {
      sh.keys[atomicAdd(&sh.kept, 1)] = held[j];
      atomicMin(&sh.min_word, key_word(held[j]));
    } else {
      add_outside(run_max, run_sum, key_logit(held[j]));
    }
  }
  __syncthreads();
  if (tid == 0) sh.count = sh.kept, sh.threshold = key_logit(word_key<key_type>(sh.min_word));
  __syncthreads();
}

/// Sorts keys[0..sorted_capacity) descending (bitonic, one compare-exchange per thread a stage).
template <class K>
__device__ void block_sort_descending(K* keys) {
  const int tid = int(threadIdx.x);
  for (int k = 2; k <= sorted_capacity; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      const int i = ((tid & ~(j - 1)) << 1) | (tid & (j - 1));
      const int partner = i | j;
      const bool up = (i & k) == 0;
      const K a = keys[i], b = keys[partner];
      if (key_less(a, b) == up) keys[i] = b, keys[partner] = a;
      __syncthreads();
    }
  }
}

__device__ inline log_sum_state single(double x) {
  log_sum_state s;
  push(s, x);
  return s;
}

/// The block's view of one streamed row (or shard): the kept candidates (unsorted) in
/// sh.keys[0..kept), the outside sum and the first bad token, and the sampled token's logit
/// when it was seen.
struct stream_result {
  int kept;
  stream_summary summary;
  bool has_sampled;
  double sampled_logit;  // exact: the logit in its comparison precision, widened
};

/// Streams z[0..size) (global token ids offset + i) through the candidate buffer, keeping the k
/// best tokens other than `sampled_token` (a global id; −1: none). All threads call it.
template <class Keys, class L>
__device__ stream_result stream_row(sparsify_shared<Keys>& sh, reduce_storage<stream_summary>& storage, const L* z,
                                    std::size_t size, std::size_t offset, long long sampled_token, int k) {
  using value_type = typename Keys::value_type;
  constexpr int items = Keys::items;
  constexpr int tile = sparsify_layout<Keys>::tile;
  constexpr int capacity = sparsify_layout<Keys>::capacity;
  const int tid = int(threadIdx.x);
  const value_type minus_inf = static_cast<value_type>(neg_inf());
  const bool vectors = reinterpret_cast<std::uintptr_t>(z) % sizeof(uint4) == 0;
  if (tid == 0) sh.count = 0, sh.threshold = minus_inf, sh.has_sampled = 0, sh.sampled_pos = -1, sh.last_false = 0;
  __syncthreads();

  value_type run_max = minus_inf;
  double run_sum = 0.0;
  std::size_t first_bad = no_token;
  for (std::size_t base = 0; base < size; base += tile) {
    const int count = sh.count;
    __syncthreads();
    if (count > capacity - tile) select_top(sh, count, k, run_max, run_sum);
    const value_type threshold = sh.threshold;
    const std::size_t first = base + std::size_t(tid) * items;
    value_type v[items];
    const bool full = base + tile <= size;
    if (first < size) {
      load_items(z + first, vectors && full, size - first, v);
    } else {
#pragma unroll
      for (int i = 0; i < items; ++i) v[i] = minus_inf;
    }
    bool enter[items];
    value_type candidate[items];
    value_type chunk_max = minus_inf;
#pragma unroll
    for (int i = 0; i < items; ++i) {
      const std::size_t token = first + std::size_t(i);
      const value_type x = v[i];
      candidate[i] = x;
      enter[i] = false;
      if (!(x < -minus_inf)) {  // NaN or +inf (tokens past the row are −inf)
        if (token < first_bad) first_bad = token;
        v[i] = minus_inf;
        continue;
      }
      if (token < size && static_cast<long long>(offset + token) == sampled_token) {  // not a padding token
        sh.sampled_logit = x, sh.has_sampled = 1;
        v[i] = minus_inf;
        continue;
      }
      enter[i] = x > threshold;
      if (enter[i]) v[i] = minus_inf;
      chunk_max = chunk_max < v[i] ? v[i] : chunk_max;
    }
    if (chunk_max > minus_inf) {
      if (chunk_max > run_max) {
        run_sum *= ::exp(static_cast<double>(run_max) - static_cast<double>(chunk_max));
        run_max = chunk_max;
      }
      value_type part = 0;
#pragma unroll
      for (int i = 0; i < items; ++i) part += exp_of(v[i] - run_max);
      run_sum += static_cast<double>(part);
    }
    const int lane = lane_id();
#pragma unroll
    for (int i = 0; i < items; ++i) {
      const unsigned mask = __ballot_sync(full_warp, enter[i]);
      if (mask == 0u) continue;
      const int leader = __ffs(int(mask)) - 1;
      int slot = 0;
      if (lane == leader) slot = atomicAdd(&sh.count, __popc(mask));
      slot = __shfl_sync(full_warp, slot, leader);
      if (enter[i]) {
        slot += __popc(mask & ((1u << lane) - 1u));
        sh.keys[slot] = make_key(candidate[i], static_cast<long long>(offset + first + std::size_t(i)));
      }
    }
    __syncthreads();
  }
  const int candidates = sh.count;
  __syncthreads();
  if (candidates > k) select_top(sh, candidates, k, run_max, run_sum);

  stream_summary mine;
  mine.outside = run_max > minus_inf ? log_sum_state{static_cast<double>(run_max), run_sum} : log_sum_state{};
  mine.first_bad = first_bad;
  stream_result result;
  result.kept = candidates < k ? candidates : k;
  result.summary = block_all_reduce(storage, mine, merge_stream_summary{});  // synchronises: sh is visible
  result.has_sampled = sh.has_sampled != 0;
  result.sampled_logit = result.has_sampled ? static_cast<double>(sh.sampled_logit) : neg_inf();
  __syncthreads();  // every thread has read sh before any moves on to the next row's reset
  return result;
}

/// exact_add of two exact_sums as a CUB reduction operator.
struct add_exact_sum {
  __device__ exact_sum operator()(const exact_sum& a, const exact_sum& b) const { return exact_add(a, b); }
};

/// The logits of a finalised support as exact_log_sums reads them: the first `keep` sorted keys,
/// then the sampled token's key when it ranks beyond them.
template <class Key>
struct support_key_logits {
  const Key* keys;
  int keep;
  int sampled_pos;

  __device__ double operator[](int i) const {
    return static_cast<double>(key_logit(keys[i < keep ? i : sampled_pos]));
  }
};

/// Σ e^{z_j − m_tail} over the tokens j of z[0..size) with mass that `in_support(j, x)` does not
/// claim (x = z_j in the logits' comparison precision; each thread asks for its tokens in
/// increasing j), as the CPU's cpu::tail_exp_sum: each term is one exponential in that precision
/// of z_j − m_tail alone, widened to double, and the terms are added as exact_sums (per thread,
/// then across the block). The double the pair rounds to (value()) is within n²·eps² of the
/// exact sum, so it does not depend on which thread, tile or vocabulary shard a token fell in:
/// the whole-row sparsify and every shard's sparsify_tail_sums add the same terms. Returned in
/// every thread (a block-wide reduction: all threads must call it).
template <class Keys, class L, class InSupport>
__device__ exact_sum tail_exp_sum(reduce_storage<exact_sum>& storage, const L* z, std::size_t size, double m_tail,
                                  InSupport in_support) {
  using value_type = typename Keys::value_type;
  constexpr int items = Keys::items;
  constexpr int tile = sparsify_layout<Keys>::tile;
  exact_sum part;
  if (m_tail > neg_inf()) {
    const value_type shift = static_cast<value_type>(m_tail);  // one of the row's logits: exact
    const value_type minus_inf = static_cast<value_type>(neg_inf());
    const bool vectors = reinterpret_cast<std::uintptr_t>(z) % sizeof(uint4) == 0;
    // The thread's `items` consecutive tokens from `first` (−inf past the row).
    auto load = [&](std::size_t first, bool full, value_type(&v)[items]) {
      if (first < size) {
        load_items(z + first, vectors && full, size - first, v);
      } else {
#pragma unroll
        for (int i = 0; i < items; ++i) v[i] = minus_inf;
      }
    };
    auto add = [&](std::size_t first, const value_type(&v)[items]) {
#pragma unroll
      for (int i = 0; i < items; ++i) {
        const std::size_t j = first + std::size_t(i);
        const value_type x = v[i];
        if (!(x > minus_inf) || j >= size) continue;  // a masked token (or past the row) has no mass
        if (in_support(j, x)) continue;
        exact_add(part, static_cast<double>(exp_of(x - shift)));
      }
    };
    // Two tiles a step, each thread's loads (16 bytes where aligned) issued before any is used:
    // the stream's layout, so that several loads are in flight (the one-token-a-thread loop
    // waited on every 2-byte load; Nsight Compute on an H200: 42% of sparsify's stall samples).
    for (std::size_t base = 0; base < size; base += 2 * std::size_t(tile)) {
      const std::size_t first0 = base + std::size_t(threadIdx.x) * items;
      const std::size_t first1 = first0 + std::size_t(tile);
      value_type v0[items], v1[items];
      load(first0, base + tile <= size, v0);
      load(first1, base + 2 * std::size_t(tile) <= size, v1);
      add(first0, v0);
      add(first1, v1);
    }
  }
  return block_all_reduce(storage, part, add_exact_sum{});
}

/// The whole row's tail sum (tail_exp_sum) outside the support of sparsify_kernel: the `keep`
/// best of the sorted keys and the sampled token.
template <class Keys, class L>
__device__ exact_sum canonical_tail_sum(reduce_storage<exact_sum>& storage, const L* z, std::size_t size,
                                        const typename Keys::key_type* keys, int keep, bool has_sampled,
                                        long long sampled_token, double m_tail) {
  using value_type = typename Keys::value_type;
  // The support's last token: a token is in the support's top-`keep` prefix iff it ranks at or
  // before it (larger logit, or the same logit and an index not above).
  const bool any = keep > 0;
  const value_type last_logit = any ? key_logit(keys[keep - 1]) : value_type(0);
  const long long last_index = any ? static_cast<long long>(key_index(keys[keep - 1])) : -1;
  return tail_exp_sum<Keys>(storage, z, size, m_tail, [&](std::size_t j, value_type x) {
    const long long token = static_cast<long long>(j);
    if (any && (x > last_logit || (x == last_logit && token <= last_index))) return true;
    return has_sampled && token == sampled_token;
  });
}

/// The grid-stride loop of the sparsify row kernels: per row r of `range`, z = logits.row(r)
/// (global token ids offset + i of a row of `vocab`), its sampled token (sampled[r]; −1 where
/// sampled is null), stream_row, and the row's first problem in the CPU's order — a sampled
/// token outside [0, vocab) (bad_sampled), then a NaN / +inf logit — then
/// body(r, z, sampled_token, stream, report) (returning from the body ends that row).
template <class Keys, class L, class Body>
__device__ void for_each_streamed_row(sparsify_shared<Keys>& sh, batch_view<const L> logits, std::size_t offset,
                                      std::size_t vocab, const token_id* sampled, int k, const row_range& range,
                                      Body&& body) {
  __shared__ reduce_storage<stream_summary> storage;
  const std::size_t size = logits.cols, end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const L* z = logits.row(r);
    const long long sampled_token = sampled != nullptr ? static_cast<long long>(sampled[r]) : -1;
    const bool sampled_ok = sampled == nullptr || (sampled_token >= 0 && sampled_token < static_cast<long long>(vocab));
    const stream_result stream = stream_row(sh, storage, z, size, offset, sampled_token, k);
    cuda_row_report report;
    if (!sampled_ok) {
      report.error = cuda_row_error::bad_sampled, report.value = double(sampled_token);
    } else if (stream.summary.first_bad != no_token) {
      report = bad_value_report(0, stream.summary.first_bad, to_double(z[stream.summary.first_bad]));
    }
    body(r, z, sampled_token, stream, report);
  }
}

/// Rows of `range`: the sparse rows of troll::sparsify (see troll/cuda_sparse.cuh). A rejected
/// row (NaN / +inf logits, all −inf, a sampled token outside [0, V)) gets count 0, NaN
/// log-remainder and padding.
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    sparsify_kernel(batch_view<const L> logits, const token_id* sampled, int k, double log_delta,
                    sparse_batch_view<T> out, row_range range, device_checks checks) {
  using Keys = sparsify_keys<L>;
  using key_type = typename Keys::key_type;
  __shared__ sparsify_shared<Keys> sh;
  __shared__ reduce_storage<exact_sum> tail_storage;
  const int tid = int(threadIdx.x);
  const std::size_t size = logits.cols;
  for_each_streamed_row(sh, logits, 0, size, sampled, k, range,
                        [&](std::size_t r, const L* z, long long sampled_token, const stream_result& stream,
                            cuda_row_report& report) {
    const stream_summary& summary = stream.summary;
    const int kept = stream.kept;
    const bool has_sampled = stream.has_sampled;
    const double sampled_logit = stream.sampled_logit;
    if (report.error == cuda_row_error::none && kept == 0 && summary.outside.m == neg_inf() &&
        !(sampled_logit > neg_inf()))
      report.error = cuda_row_error::all_masked;
    if (tid == 0) record_row(checks, range, r, report);
    if (checks.validate_only) return;
    sparse_index* indices = out.row_indices(r);
    T* log_probs = out.row_log_probs(r);
    if (report.error != cuda_row_error::none) {
      for (std::size_t i = std::size_t(tid); i < out.k_max; i += block_threads)
        indices[i] = -1, log_probs[i] = static_cast<T>(neg_inf());
      if (tid == 0) out.counts[r] = 0, out.log_remainder[r] = static_cast<T>(quiet_nan());
      __syncthreads();  // the shared keys are reused by the next row
      return;
    }

    // The candidates and the sampled token, best first.
    const int listed = kept + (has_sampled ? 1 : 0);
    for (int i = kept + tid; i < sorted_capacity; i += block_threads) sh.keys[i] = zero_key<key_type>();
    if (tid == 0 && has_sampled)
      sh.keys[kept] = make_key(static_cast<typename Keys::value_type>(sampled_logit), sampled_token);
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
    // Relative to the row's largest logit, as finalize (never an absolute log Σ e^z).
    const double ref = whole.m, log_total = ::log(whole.s);
    const int limit = listed < k ? listed : k;
    for (int j = tid + 1; j < limit; j += block_threads) {
      const log_sum_state rest = merge(summary.outside, log_sum_state{sh.suffix_m[j], sh.suffix_s[j]});
      if (!(log_sum_relative(rest, ref) - log_total <= log_delta)) atomicMax(&sh.last_false, j);
    }
    __syncthreads();
    const int keep = limit <= 1 ? limit : sh.last_false + 1;
    const int sampled_pos = sh.sampled_pos;

    // The values come from the canonical sums (detail::exact_log_sums), as the CPU's sparsify:
    // the tail's largest logit — exact, from the sorted list and the outside max — and the tail's
    // exact sum Σ e^{z_j − m_tail} from a second pass over the row (canonical_tail_sum).
    const bool append_sampled = sampled_pos >= keep;
    const int first_tail = keep == sampled_pos ? keep + 1 : keep;
    double m_tail = summary.outside.m;
    if (first_tail < listed) {
      const double x = static_cast<double>(key_logit(sh.keys[first_tail]));
      if (x > m_tail) m_tail = x;
    }
    const exact_sum tail = canonical_tail_sum<Keys>(tail_storage, z, size, sh.keys, keep, has_sampled,
                                                    sampled_token, m_tail);
    const support_key_logits<key_type> support{sh.keys, keep, sampled_pos};
    const row_log_sums sums = exact_log_sums(support, keep + (append_sampled ? 1 : 0), m_tail, tail);

    const int count = keep + (append_sampled ? 1 : 0);
    for (int j = tid; j < count; j += block_threads) {
      const key_type key = sh.keys[j < keep ? j : sampled_pos];
      indices[j] = key_index(key);
      log_probs[j] = static_cast<T>(sums.log_prob(static_cast<double>(key_logit(key))));
    }
    for (std::size_t i = std::size_t(count) + std::size_t(tid); i < out.k_max; i += block_threads)
      indices[i] = -1, log_probs[i] = static_cast<T>(neg_inf());
    if (tid == 0) {
      out.counts[r] = count;
      out.log_remainder[r] = static_cast<T>(sums.stored_log_remainder());
    }
    __syncthreads();  // the shared keys are reused by the next row
  });
}

/// Rows of `range`: states[r] = the sparsify_state of shard row r (tokens offset .. offset +
/// cols of a row of `vocab` tokens), as detail::reset + cpu::sparsify_scan make it: the k best
/// tokens (worst first, a valid min-heap), the outside sum, the sampled token if in the shard.
/// A rejected row (NaN / +inf logits, a sampled token outside [0, vocab)) gets an invalid state
/// (k = 0), which sparsify_merge and sparsify_finalize reject.
template <class L>
__global__ void __launch_bounds__(block_threads)
    sparsify_shard_kernel(batch_view<const L> logits, std::size_t offset, std::size_t vocab,
                          const token_id* sampled, int k, sparsify_state* states, row_range range,
                          device_checks checks) {
  using Keys = sparsify_keys<L>;
  using key_type = typename Keys::key_type;
  __shared__ sparsify_shared<Keys> sh;
  const int tid = int(threadIdx.x);
  const std::size_t size = logits.cols;
  for_each_streamed_row(sh, logits, offset, vocab, sampled, k, range,
                        [&](std::size_t r, const L* z, long long sampled_token, const stream_result& stream,
                            cuda_row_report& report) {
    if (tid == 0) record_row(checks, range, r, report);
    if (checks.validate_only) return;
    sparsify_state& st = states[r];
    // Every byte of the state is written (padding and unused slots zero): sparsify_merge and
    // sparsify_finalize copy states as whole words, and compute-sanitizer's initcheck reported
    // those copies reading the bytes this kernel had left unwritten (H200, 2026-11-28).
    auto* words = reinterpret_cast<unsigned long long*>(&st);
    for (std::size_t i = std::size_t(tid); i < sizeof(sparsify_state) / sizeof(unsigned long long); i += block_threads)
      words[i] = 0ull;
    __syncthreads();
    if (report.error != cuda_row_error::none) {
      if (tid == 0) {  // k = 0: a state merge and finalize reject
        reset(st, 0, static_cast<sparse_index>(sampled_token), static_cast<sparse_index>(vocab),
              static_cast<sparse_index>(offset), static_cast<sparse_index>(offset + size));
      }
      __syncthreads();  // the shared keys are reused by the next row
      return;
    }
    const int kept = stream.kept;
    for (int i = kept + tid; i < sorted_capacity; i += block_threads) sh.keys[i] = zero_key<key_type>();
    __syncthreads();
    block_sort_descending(sh.keys);
    for (int j = tid; j < kept; j += block_threads)
      st.heap[kept - 1 - j] = sparse_candidate{static_cast<double>(key_logit(sh.keys[j])), key_index(sh.keys[j])};
    if (tid == 0) {
      reset(st, k, static_cast<sparse_index>(sampled_token), static_cast<sparse_index>(vocab),
            static_cast<sparse_index>(offset), static_cast<sparse_index>(offset + size));
      st.size = kept;
      st.has_sampled = stream.has_sampled;
      st.sampled_logit = stream.has_sampled ? stream.sampled_logit : 0.0;
      st.outside = stream.summary.outside;
    }
    __syncthreads();  // the shared keys are reused by the next row
  });
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
