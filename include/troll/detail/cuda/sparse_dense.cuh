// troll/detail/cuda/sparse_dense.cuh — the sparse kernels that read dense logits, one 256-thread
// block per row: align(new_logits, new_support, old) (the new side gathered exactly, its bucket
// the exact tail mass over V∖U) and sparsify_backward (the scatter of a sparse gradient to dense
// logits, math.md §4). Warp 0 checks and sorts the supports; then the block walks the row with
// a per-thread cursor into the sorted support, so the tail log-sum is summed over the tail
// (never total minus support).
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../sparse_types.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "block_reduce.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "sparse_projection.cuh"
#include "sparse_sparsify.cuh"
#include "sparse_warp.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// One pass over a dense row split by a sorted support: first NaN / +inf, and the log-sum-exp
/// of the tokens outside and inside the support.
struct split_scan {
  std::size_t first_bad = no_token;
  log_sum_state tail;
  log_sum_state support;
};

struct split_scan_storage {
  index_slot sorted[sparse_max_entries];
  index_slot other[sparse_max_entries];
  cub::Uninitialized<cuda_row_report> report;
  double sum_g;
  double sum_lo;    // the counted Σ g as an exact_sum (sum_g, sum_lo): block_count_grad
  double g_bucket;  // the counted g_R
  int count;
};

#ifdef __CUDACC__

struct merge_split_scan {
  __device__ split_scan operator()(const split_scan& a, const split_scan& b) const {
    return split_scan{a.first_bad < b.first_bad ? a.first_bad : b.first_bad, merge(a.tail, b.tail),
                      merge(a.support, b.support)};
  }
};

/// Scans row z (V = size) with the whole block; support membership from sorted[0..n).
template <class L>
__device__ split_scan scan_split(const L* z, std::size_t size, const index_slot* sorted, int n,
                                 reduce_storage<split_scan>& storage) {
  split_scan local;
  int cursor = 0;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
    const double x = to_double(z[i]);
    if (!(x < inf())) {
      if (i < local.first_bad) local.first_bad = i;
      continue;
    }
    while (cursor < n && std::size_t(sorted[cursor].index) < i) ++cursor;
    push(cursor < n && std::size_t(sorted[cursor].index) == i ? local.support : local.tail, x);
  }
  return block_all_reduce(storage, local, merge_split_scan{});
}

/// The report of a dense logits row from its split scan (NaN / +inf, all −inf), or none.
template <class L>
__device__ cuda_row_report logits_problem(const split_scan& s, const L* z) {
  cuda_row_report report;
  if (s.first_bad != no_token) return bad_value_report(0, s.first_bad, to_double(z[s.first_bad]));
  if (s.tail.m == neg_inf() && s.support.m == neg_inf()) report.error = cuda_row_error::all_masked;
  return report;
}

/// Run by the first warp of a block: row r of `support` checked as a support (values not read)
/// and sorted into sh.sorted, then the upstream gradient g (bucket g_r first, then the entries)
/// checked for NaN / inf and summed. Leaves the report, Σ g and the count (0 on a bad row) in sh.
template <class T>
__device__ void warp_support_and_grad(const sparse_batch_view<const T>& support, std::size_t r, const T* g,
                                      double g_r, int slots, split_scan_storage& sh) {
  cuda_row_report report =
      warp_check_sparse_row(support.row_indices(r), support.row_log_probs(r), support.counts[r], 0.0, support.k_max,
                            support.vocab, operand_support, false, sh.sorted, slots);
  const int n = report.error == cuda_row_error::none ? static_cast<int>(support.counts[r]) : 0;
  double sum_g = 0.0;
  if (report.error == cuda_row_error::none) {
    for (int base = -1; base < n; base += warp_lanes) {
      const int i = base + lane_id();
      const double gi = i < 0 ? g_r : (i < n ? static_cast<double>(g[i]) : 0.0);
      const int bad = first_lane(!(gi - gi == 0.0));
      if (bad >= 0) {
        report.error = cuda_row_error::sparse_nan, report.operand = operand_grad;
        report.token = static_cast<unsigned long long>(static_cast<long long>(base + bad));
        report.value = __shfl_sync(full_warp, gi, bad);  // bad is the warp's: every lane is here
        break;
      }
      sum_g += gi;
    }
    sum_g = warp_all_reduce(sum_g, add_double{});
  }
  if (lane_id() == 0) sh.report.Alias() = report, sh.sum_g = sum_g, sh.count = report.error == cuda_row_error::none ? n : 0;
}

/// The upstream gradient as the backward counts it (count_grad, sparse_row.hpp, as on the CPU):
/// Σ g over the support (sh.sorted, in index order; 0 for entries whose gathered value is −inf)
/// and g_R where the tail holds mass, as an exact_sum into sh.sum_g / sh.sum_lo, and the counted
/// g_R into sh.g_bucket. Formed by thread 0 (n ≤ sparse_max_entries terms); every thread must
/// reach it (it ends with a barrier).
template <class T>
__device__ void block_count_grad(split_scan_storage& sh, int n, const T* g, const T* values, double g_r,
                                 bool tail_has_mass) {
  if (threadIdx.x == 0) {
    const counted_grad c = count_grad(g, values, sh.sorted, n, g_r, tail_has_mass);
    sh.sum_g = c.sum.hi, sh.sum_lo = c.sum.lo, sh.g_bucket = c.bucket;
  }
  __syncthreads();
}

/// One entry of a sparse row's scatter on the support (the CPU's sparse_scatter_row): 0 where its
/// logit is −inf (log p = −inf), else g_k (1 − p_k) − p_k (G − g_k) with G − g_k from the exact sum.
__device__ inline double support_scatter_value(double gk, double log_p, double p, const split_scan_storage& sh) {
  if (!(log_p > neg_inf())) return 0.0;
  return gk * -::expm1(log_p) - p * ((sh.sum_g - gk) + sh.sum_lo);
}

/// The grid-stride loop of the sparse gradient kernels and their shared scratch: per row r of
/// `range`, its logits z, its gradient g and g_R, after a barrier (the previous row is done with
/// the shared scratch), then body(r, z, g, g_r, sh, scan_storage) (returning from the body ends
/// that row).
template <class L, class T, class Body>
__device__ void for_each_grad_row(batch_view<const L> logits, sparse_grad_view<const T> grad, const row_range& range,
                                  Body&& body) {
  __shared__ split_scan_storage sh;
  __shared__ reduce_storage<split_scan> scan_storage;
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const L* z = logits.row(r);
    const T* g = grad.row(r);
    const double g_r = static_cast<double>(grad.log_remainder[r]);
    __syncthreads();  // the previous row is done with the shared scratch
    body(r, z, g, g_r, sh, scan_storage);
  }
}

/// Rows of `range`: grad_logits = ∂L/∂z from g on the support of `support` and g_R on its bucket:
///     ∂L/∂z_k = [k∈S] g_k + [k∉S] g_R p_k / r − p_k (Σ_S g_i + g_R).
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    sparsify_backward_kernel(batch_view<const L> logits, sparse_batch_view<const T> support,
                             sparse_grad_view<const T> grad, batch_view<T> grad_logits, int slots, row_range range,
                             device_checks checks) {
  const std::size_t size = logits.cols;
  for_each_grad_row(logits, grad, range,
                    [&](std::size_t r, const L* z, const T* g, double g_r, split_scan_storage& sh,
                        reduce_storage<split_scan>& scan_storage) {
    if (threadIdx.x < warp_lanes) warp_support_and_grad(support, r, g, g_r, slots, sh);
    __syncthreads();
    const int n = sh.count;
    const split_scan scan = scan_split(z, size, sh.sorted, n, scan_storage);
    cuda_row_report report = logits_problem(scan, z);
    if (report.error == cuda_row_error::none) report = sh.report.Alias();
    if (record_or_reject(checks, range, r, report, grad_logits, size)) return;
    T* out = grad_logits.row(r);
    // Relative to the row's largest logit (row_log_sums): p_k = e^{(z_k − ref) − total}, with
    // the canonical sums (detail::exact_log_sums, as the CPU's log_sums_outside and
    // align_dense_kernel): log1p of the exact total, so that a support entry's 1 − p_k =
    // −expm1(log p_k) keeps its digits on a near-deterministic row.
    struct support_logits {
      const L* z;
      const index_slot* sorted;
      __device__ double operator[](int i) const { return to_double(z[sorted[i].index]); }
    };
    const exact_sum tail_sum{scan.tail.m > neg_inf() ? scan.tail.s : 0.0, 0.0};
    const row_log_sums sums = exact_log_sums(support_logits{z, sh.sorted}, n, scan.tail.m, tail_sum);
    const double log_total = sums.total;
    const T* values = support.row_log_probs(r);
    block_count_grad<T>(sh, n, g, values, g_r, sums.tail_ref > neg_inf());
    const double g_bucket = sh.g_bucket;
    const bool tail_mass = sums.tail_ref > neg_inf() && g_bucket != 0.0;
    const double sum_g = sh.sum_g + sh.sum_lo;
    int cursor = 0;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double zi = to_double(z[i]), x = zi - sums.ref;
      const double p = ::exp(x - log_total);
      while (cursor < n && std::size_t(sh.sorted[cursor].index) < i) ++cursor;
      double value;
      if (cursor < n && std::size_t(sh.sorted[cursor].index) == i) {
        value = support_scatter_value(counted_entry(g, values, sh.sorted[cursor].position), x - log_total, p, sh);
      } else {
        value = -sum_g * p + (tail_mass ? g_bucket * ::exp((zi - sums.tail_ref) - sums.tail) : 0.0);
      }
      out[i] = static_cast<T>(value);
    }
  });
}

/// Rows of `range`: grad_shard = the columns [offset, offset + cols) of sparsify_backward's
/// gradient, from the row's log-sums {ref, log Σ_V e^{z − ref}, tail_ref, log Σ_{V∖S} e^{z −
/// tail_ref}} (sparsify_finalize's log_sums, row_log_sums):
///     ∂L/∂z_k = [k∈S] g_k + [k∉S] g_R p_k / r − p_k (Σ_S g_i + g_R),
///     p_k = e^{(z_k − ref) − total},  p_k / r = e^{(z_k − tail_ref) − tail}.
/// Row checks in the CPU's order: the shard logits (NaN / +inf), the log-sums, the support, the
/// gradient. A rejected row gets NaN gradients.
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    sparsify_shard_backward_kernel(batch_view<const L> shard_logits, std::size_t offset,
                                   sparse_batch_view<const T> support, sparse_grad_view<const T> grad,
                                   const double* log_sums, batch_view<T> grad_shard, int slots, row_range range,
                                   device_checks checks) {
  const std::size_t size = shard_logits.cols;
  for_each_grad_row(shard_logits, grad, range,
                    [&](std::size_t r, const L* z, const T* g, double g_r, split_scan_storage& sh,
                        reduce_storage<split_scan>& scan_storage) {
    if (threadIdx.x < warp_lanes) warp_support_and_grad(support, r, g, g_r, slots, sh);
    __syncthreads();
    const int n = sh.count;
    const split_scan scan = scan_split(z, size, sh.sorted, 0, scan_storage);
    cuda_row_report report;
    if (scan.first_bad != no_token) report = bad_value_report(0, scan.first_bad, to_double(z[scan.first_bad]));
    const double* row_sums = log_sums + sparsify_log_sums_width * r;
    const int bad_entry = log_sums_problem(row_sums);
    if (report.error == cuda_row_error::none && bad_entry >= 0) {
      report.error = cuda_row_error::bad_log_sums;
      report.operand = bad_entry;
      report.value = row_sums[bad_entry];
    }
    if (report.error == cuda_row_error::none) report = sh.report.Alias();
    if (record_or_reject(checks, range, r, report, grad_shard, size)) return;
    T* out = grad_shard.row(r);
    // Relative to the row's and the tail's references (row_log_sums):
    // p_k = e^{(z_k − ref) − total},  p_k / r = e^{(z_k − tail_ref) − tail}.
    const row_log_sums sums{row_sums[0], row_sums[1], row_sums[2], row_sums[3]};
    const T* values = support.row_log_probs(r);
    block_count_grad<T>(sh, n, g, values, g_r, sums.tail_ref > neg_inf());
    const double sum_g = sh.sum_g + sh.sum_lo, g_bucket = sh.g_bucket;
    const double ref = sums.ref, total = sums.total;
    const bool tail_term = sums.tail_ref > neg_inf() && g_bucket != 0.0;
    // g_R / r once per row unless the bucket is light (light_bucket_log, sparse_row.hpp) or it
    // overflows (g_R within 1/r of the largest double): then g_R · p_k / r with p_k / r ≤ 1 from
    // the tail's own sums (the CPU's choice).
    const double log_inv_r = -sums.log_remainder();
    const double g_over_r = log_inv_r < light_bucket_log ? g_bucket * ::exp(log_inv_r) : 0.0;
    const bool scale_tail = log_inv_r < light_bucket_log && fits_in<double>(g_over_r);
    // g_R / r − G as g_R (1/r − 1) − (G − g_R), as the CPU's sparse_scatter_row: exact where the
    // bucket holds nearly all the mass (e^{−log r} − 1 gave 0 for 4.2e-18 at a logit gap of 40).
    const double tail_factor = g_bucket * ::expm1(log_inv_r) - ((sh.sum_g - g_bucket) + sh.sum_lo);
    int cursor = 0;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double zi = to_double(z[i]), x = zi - ref;
      const double p = x == neg_inf() ? 0.0 : ::exp(x - total);
      const std::size_t token = offset + i;
      while (cursor < n && std::size_t(sh.sorted[cursor].index) < token) ++cursor;
      double value = -sum_g * p;
      if (tail_term)
        value = scale_tail ? tail_factor * p
                           : value + (x == neg_inf() ? 0.0 : g_bucket * ::exp((zi - sums.tail_ref) - sums.tail));
      if (cursor < n && std::size_t(sh.sorted[cursor].index) == token)
        value = support_scatter_value(counted_entry(g, values, sh.sorted[cursor].position), x - total, p, sh);
      out[i] = static_cast<T>(value);
    }
  });
}

/// Shared memory of sparsify_tail_sums_kernel.
struct tail_sums_storage {
  index_slot sorted[sparse_max_entries];
  cub::Uninitialized<cuda_row_report> report;
  int count;
};

/// Rows of `range`: one shard's share of the canonical tail sums (troll::sparsify_tail_sums):
/// sums[2r], sums[2r + 1] = Σ e^{z_j − tail_max[r]} over the shard's tokens (global ids offset +
/// j) outside row r's support, the terms tail_exp_sum adds in the whole-row sparsify_kernel, so
/// the exact_add of every shard's pair rounds to the whole row's tail sum. Only the support's
/// indices and counts are read. Row checks in the CPU's order: the shard logits (NaN / +inf),
/// tail_max, the support's indices, every tail logit at or below tail_max. A rejected row gets
/// NaN sums.
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    sparsify_tail_sums_kernel(batch_view<const L> shard_logits, std::size_t offset,
                              sparse_batch_view<const T> support, const double* tail_max, double* sums, int slots,
                              row_range range, device_checks checks) {
  using Keys = sparsify_keys<L>;
  using value_type = typename Keys::value_type;
  __shared__ tail_sums_storage sh;
  __shared__ reduce_storage<std::size_t> bad_storage;
  __shared__ reduce_storage<exact_sum> tail_storage;
  const std::size_t size = shard_logits.cols, end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const L* z = shard_logits.row(r);
    __syncthreads();  // the previous row is done with the shared scratch
    if (threadIdx.x < warp_lanes) {
      const cuda_row_report report =
          warp_check_sparse_row(support.row_indices(r), static_cast<const T*>(nullptr), support.counts[r], 0.0,
                                support.k_max, support.vocab, operand_support, false, sh.sorted, slots);
      __syncwarp();  // the sorted slots are visible to lane 0
      if (lane_id() == 0) {
        // The support's tokens inside the shard, still sorted by index, at the front.
        int n = 0;
        if (report.error == cuda_row_error::none) {
          const int count = static_cast<int>(support.counts[r]);
          for (int i = 0; i < count; ++i) {
            const std::size_t token = std::size_t(sh.sorted[i].index);
            if (token >= offset && token - offset < size) sh.sorted[n++] = sh.sorted[i];
          }
        }
        sh.report.Alias() = report, sh.count = n;
      }
    }
    std::size_t bad = no_token;
    for (std::size_t i = threadIdx.x; i < size && bad == no_token; i += block_threads)
      if (!(to_double(z[i]) < inf())) bad = i;
    bad = block_all_reduce(bad_storage, bad, min_token{});  // synchronises: sh is visible
    cuda_row_report report;
    const double m_tail = tail_max[r];
    if (bad != no_token) {
      report = bad_value_report(0, bad, to_double(z[bad]));
    } else if (!(m_tail < inf())) {
      report.error = cuda_row_error::bad_tail_max, report.value = m_tail;
    } else {
      report = sh.report.Alias();
    }
    if (report.error == cuda_row_error::none) {  // the same verdict in every thread
      // Then every tail logit at or below tail_max: the lowest shard token above it that the
      // support does not hold (sh.sorted[0, count): its shard tokens, sorted by index).
      const int n = sh.count;
      std::size_t above = no_token;
      for (std::size_t i = threadIdx.x; i < size && above == no_token; i += block_threads) {
        if (!(to_double(z[i]) > m_tail)) continue;
        int lo = 0, hi = n;
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (std::size_t(sh.sorted[mid].index) < offset + i) lo = mid + 1; else hi = mid;
        }
        if (!(lo < n && std::size_t(sh.sorted[lo].index) == offset + i)) above = i;
      }
      above = block_all_reduce(bad_storage, above, min_token{});
      if (above != no_token)
        report.error = cuda_row_error::tail_above_max, report.token = above, report.value = to_double(z[above]);
    }
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    if (report.error != cuda_row_error::none) {
      if (threadIdx.x == 0) sums[2 * r] = sums[2 * r + 1] = quiet_nan();
      continue;
    }
    const int n = sh.count;
    int cursor = 0;
    const exact_sum tail = tail_exp_sum<Keys>(tail_storage, z, size, m_tail, [&](std::size_t j, value_type) {
      const std::size_t token = offset + j;
      while (cursor < n && std::size_t(sh.sorted[cursor].index) < token) ++cursor;
      return cursor < n && std::size_t(sh.sorted[cursor].index) == token;
    });
    if (threadIdx.x == 0) sums[2 * r] = tail.hi, sums[2 * r + 1] = tail.lo;
  }
}

/// Rows of `range`: out = align(new_logits, new_support, old_rows) (see troll::align). With no
/// support (new_support.rows == 0) U = S_old.
template <class L, class T>
__global__ void __launch_bounds__(block_threads)
    align_dense_kernel(batch_view<const L> new_logits, sparse_batch_view<const T> new_support,
                       sparse_batch_view<const T> old_rows, aligned_batch_view<T> out, int slots, row_range range,
                       device_checks checks) {
  __shared__ split_scan_storage sh;
  __shared__ index_slot union_sorted[sparse_max_entries];
  __shared__ reduce_storage<split_scan> scan_storage;
  const std::size_t size = new_logits.cols, end = range.begin + range.count;
  const bool with_support = new_support.rows != 0;
  const std::size_t cap = out.k_max < std::size_t(sparse_max_entries) ? out.k_max : std::size_t(sparse_max_entries);
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const L* z = new_logits.row(r);
    const sparse_index* oi = old_rows.row_indices(r);
    const double lr_old = static_cast<double>(old_rows.log_remainder[r]);
    const int co = static_cast<int>(old_rows.counts[r]);
    sparse_index* indices = out.indices + r * out.k_max;
    T* ln = out.new_log_probs + r * out.k_max;
    T* lo = out.old_log_probs + r * out.k_max;
    const double tail_old = tail_log_value(lr_old, static_cast<long long>(out.vocab) - co);
    __syncthreads();
    if (threadIdx.x < warp_lanes) {
      cuda_row_report report = warp_check_sparse_row(oi, old_rows.row_log_probs(r), co, lr_old, old_rows.k_max,
                                                     old_rows.vocab, operand_old, true, sh.other, slots);
      const sparse_index* ni = with_support ? new_support.row_indices(r) : nullptr;
      const int cn = with_support && report.error == cuda_row_error::none ? static_cast<int>(new_support.counts[r]) : 0;
      if (report.error == cuda_row_error::none && with_support)
        // indices and counts only: the support's values are never read (troll::align)
        report = warp_check_sparse_row(ni, static_cast<const T*>(nullptr), new_support.counts[r], 0.0,
                                       new_support.k_max, new_support.vocab, operand_support, false, sh.sorted, slots);
      int u = 0;
      if (report.error == cuda_row_error::none) {
        u = warp_union(ni, cn, oi, co, sh.sorted, sh.other, [](int, sparse_index, int, int) {});
        if (std::size_t(u) > cap)
          report.error = cuda_row_error::sparse_count, report.operand = operand_out, report.value = double(u);
      }
      if (report.error == cuda_row_error::none && !checks.validate_only) {
        const T* old_lp = old_rows.row_log_probs(r);
        warp_union(ni, cn, oi, co, sh.sorted, sh.other, [&](int at, sparse_index token, int, int old_pos) {
          indices[at] = token;
          lo[at] = old_pos >= 0 ? old_lp[old_pos] : static_cast<T>(tail_old);
        });
        __syncwarp();
        const int size_u = sort_slots(std::size_t(u));
        warp_sorted_support(indices, u, union_sorted, size_u);
      }
      if (lane_id() == 0) sh.report.Alias() = report, sh.count = report.error == cuda_row_error::none ? u : 0;
    }
    __syncthreads();
    const int u = checks.validate_only ? 0 : sh.count;
    const split_scan scan = scan_split(z, size, union_sorted, u, scan_storage);
    cuda_row_report report = logits_problem(scan, z);
    if (report.error == cuda_row_error::none) report = sh.report.Alias();
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    if (report.error != cuda_row_error::none) {
      for (std::size_t i = threadIdx.x; i < out.k_max; i += block_threads) {
        indices[i] = -1;
        ln[i] = lo[i] = static_cast<T>(neg_inf());
      }
      if (threadIdx.x == 0)
        out.counts[r] = 0, out.new_log_remainder[r] = out.old_log_remainder[r] = static_cast<T>(quiet_nan());
      continue;
    }
    // As the CPU's log_sums_outside (detail::exact_log_sums): the union's terms summed exactly,
    // log1p of the total, the direct log r; the tail from the scan's running sum. A new
    // log-probability near 0 (a near-deterministic row) and a log r near 0 keep their relative
    // digits, which log(s) and the difference of log-sums lose. Every thread forms the same sums
    // from the u ≤ k_max union logits (indices were written before the barrier above).
    struct union_logits {
      const L* z;
      const sparse_index* indices;
      __device__ double operator[](int i) const { return to_double(z[indices[i]]); }
    };
    const exact_sum tail_sum{scan.tail.m > neg_inf() ? scan.tail.s : 0.0, 0.0};
    const row_log_sums sums = exact_log_sums(union_logits{z, indices}, u, scan.tail.m, tail_sum);
    for (int i = int(threadIdx.x); i < u; i += block_threads)
      ln[i] = static_cast<T>(sums.log_prob(to_double(z[indices[i]])));
    for (std::size_t i = std::size_t(u) + threadIdx.x; i < out.k_max; i += block_threads) {
      indices[i] = -1;
      ln[i] = lo[i] = static_cast<T>(neg_inf());
    }
    if (threadIdx.x == 0) {
      const long long vocab = static_cast<long long>(out.vocab);
      out.counts[r] = u;
      out.new_log_remainder[r] = static_cast<T>(sums.stored_log_remainder());
      out.old_log_remainder[r] = static_cast<T>(shrink_log_remainder(lr_old, vocab - co, vocab - u));
    }
  }
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
