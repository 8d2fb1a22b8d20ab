// troll/detail/cuda/sparse_objective_kernels.cuh — the kernels TROLL's sparse objective adds to
// the sparse path's (troll/cuda_sparse_objectives.cuh): the per-row checks that come before the
// alignment (token data, the dense new row, the old sparse row, capacity, the sampled token's old
// entry), the per-row ratio / regression KL on the projected lumped categories, and the backward's
// upstream gradient on the lumped categories. sparsify, align, project and sparsify_backward are
// the sparse path's own kernels; the aggregation is the dense objective's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../objective_types.hpp"
#include "../../projection_types.hpp"
#include "../../sparse_types.hpp"
#include "../numeric.hpp"
#include "../objective_row.hpp"
#include "../sparse_row.hpp"
#include "../trust_region_solver.hpp"
#include "../workspace_layout.hpp"
#include "backward_kernels.cuh"
#include "block_reduce.cuh"
#include "offset_reference.cuh"
#include "forward_kernels.cuh"
#include "objective_kernels.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "sparse_dense.cuh"
#include "sparse_projection.cuh"
#include "sparse_warp.cuh"
#include "two_point_block.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The pieces of a caller's workspace (see sparse_objective_bytes).
struct sparse_objective_workspace {
  objective_row_record* header = nullptr;
  objective_row_record* records = nullptr;
  cuda_row_report* outcome = nullptr;
  unsigned char* scratch = nullptr;
};

inline sparse_objective_workspace split_workspace(void* workspace, std::size_t rows) {
  sparse_objective_workspace w;
  w.header = static_cast<objective_row_record*>(workspace);
  w.records = w.header + 1;
  w.outcome = reinterpret_cast<cuda_row_report*>(w.records + rows);
  w.scratch = reinterpret_cast<unsigned char*>(w.outcome + rows);
  return w;
}

/// The new rows' sparsify prefix (rows × new_k) in the scratch piece.
template <class T>
sparse_batch_view<T> support_in(const sparse_objective_workspace& w, std::size_t rows, std::size_t new_k,
                                std::size_t vocab) {
  T* values = reinterpret_cast<T*>(w.scratch);
  T* remainders = reinterpret_cast<T*>(w.scratch + rows * new_k * sizeof(double));
  sparse_index* indices = reinterpret_cast<sparse_index*>(w.scratch + rows * (new_k + 1) * sizeof(double));
  sparse_index* counts = indices + rows * new_k;
  return sparse_batch_view<T>{indices, values, counts, remainders, rows, new_k, vocab};
}

/// The upstream gradient on the aligned rows (rows × k_max) in the scratch piece.
template <class T>
sparse_grad_view<T> upstream_in(const sparse_objective_workspace& w, std::size_t rows, std::size_t k_max) {
  T* values = reinterpret_cast<T*>(w.scratch);
  T* remainders = reinterpret_cast<T*>(w.scratch + rows * k_max * sizeof(double));
  return sparse_grad_view<T>{values, remainders, rows, k_max};
}

/// Bytes of an aligned batch of rows × k_max (both sides' values, remainders, indices, counts).
template <class T>
constexpr std::size_t aligned_batch_bytes(std::size_t rows, std::size_t k_max) {
  return rows * (k_max + 1) * (2 * sizeof(T) + sizeof(sparse_index));
}

/// An aligned batch laid out in `memory` (aligned_batch_bytes<T>(rows, k_max) bytes, aligned for
/// T): the checked forward's validation pass builds the lumped rows here, not in the caller's
/// output, so that a throw leaves every output untouched.
template <class T>
aligned_batch_view<T> aligned_batch_in(void* memory, std::size_t rows, std::size_t k_max, std::size_t vocab) {
  T* values = static_cast<T*>(memory);
  aligned_batch_view<T> v;
  v.new_log_probs = values;
  v.old_log_probs = values + rows * k_max;
  v.new_log_remainder = values + 2 * rows * k_max;
  v.old_log_remainder = values + 2 * rows * k_max + rows;
  v.indices = reinterpret_cast<sparse_index*>(values + 2 * rows * (k_max + 1));
  v.counts = v.indices + rows * k_max;
  v.rows = rows;
  v.k_max = k_max;
  v.vocab = vocab;
  return v;
}

#ifdef __CUDACC__

/// Shared memory of the block-per-row check kernels.
struct sparse_objective_shared {
  index_slot sorted[sparse_max_entries];
  cub::Uninitialized<cuda_row_report> report;
};

/// The grid-stride loop of the sparse objective's block-per-row check kernels: per row r of
/// `range`, its dense new row z and its first checks in the CPU's order — the token data, then z
/// (NaN / +inf, all −inf), whose block-wide scan is `scan` — then body(r, z, scan, report)
/// (returning from the body ends that row).
template <class T, class Body>
__device__ void for_each_objective_row(batch_view<const T> new_logits, const token_batch<T>& in, index_slot* sorted,
                                       const row_range& range, Body&& body) {
  __shared__ reduce_storage<split_scan> storage;
  const std::size_t size = new_logits.cols, end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const T* z = new_logits.row(r);
    cuda_row_report report = token_problem<T>(in, r, size, nullptr);
    const split_scan scan = scan_split(z, size, sorted, 0, storage);
    if (report.error == cuda_row_error::none) report = logits_problem(scan, z);
    body(r, z, scan, report);
  }
}

/// Rows of `range`: the forward's checks before the alignment, in the CPU's order — token data,
/// the dense new row (NaN / +inf, all −inf), the old sparse row, the capacity min(V, |S_old| +
/// new_k) ≤ `capacity`, and on counted rows the sampled token in S_old with a finite old entry.
/// Records the outcome through `checks` and in outcome[r].
template <class T>
__global__ void __launch_bounds__(block_threads)
    sparse_objective_check_kernel(batch_view<const T> new_logits, sparse_batch_view<const T> old_rows,
                                  token_batch<T> in, int new_k, std::size_t capacity, int slots,
                                  cuda_row_report* outcome, row_range range, device_checks checks) {
  __shared__ sparse_objective_shared sh;
  const std::size_t size = new_logits.cols;
  for_each_objective_row(new_logits, in, sh.sorted, range,
                         [&](std::size_t r, const T* z, const split_scan& scan, cuda_row_report& report) {
    if (threadIdx.x < warp_lanes) {  // uniform: every thread holds the same report
      if (report.error == cuda_row_error::none) {
        const long long count = old_rows.counts[r];
        const T* old_lp = old_rows.row_log_probs(r);
        report = warp_check_sparse_row(old_rows.row_indices(r), old_lp, count,
                                       static_cast<double>(old_rows.log_remainder[r]), old_rows.k_max,
                                       old_rows.vocab, operand_old, true, sh.sorted, slots);
        if (report.error == cuda_row_error::none) {
          const long long vocab = static_cast<long long>(size);
          const long long need = count + new_k < vocab ? count + new_k : vocab;
          if (need > static_cast<long long>(capacity)) {
            report.error = cuda_row_error::objective_capacity, report.value = double(need);
          } else if (mask_of(in, r) != 0.0) {
            const std::int64_t a = in.tokens[r];
            const int slot = find_sorted(sh.sorted, int(count), sparse_index(a));
            if (slot < 0) {
              report.error = cuda_row_error::not_in_support, report.value = double(a);
            } else if (is_masked(static_cast<double>(old_lp[sh.sorted[slot].position]))) {
              report.error = cuda_row_error::old_entry_masked, report.value = double(a);
            }
          }
        }
      }
      if (lane_id() == 0) sh.report.Alias() = report;
    }
    __syncthreads();
    report = sh.report.Alias();
    if (threadIdx.x == 0) {
      record_row(checks, range, r, report);
      if (outcome != nullptr) outcome[r] = report;
    }
    __syncthreads();  // the next row rewrites the shared report and slots
  });
}

/// The checks of the lumped categories of aligned row r (cpu check_lumped): the sparse rules and
/// the lumped scan (all −inf sides, disjoint supports), with eps > 0 the infeasibility floor,
/// with `regression` new mass where the old row has none. One warp; every lane returns the same.
template <class T>
__device__ cuda_row_report lumped_problem(const aligned_batch_view<const T>& a, std::size_t r, double eps,
                                          bool regression, index_slot* slots, int size, pair_scan& scan) {
  cuda_row_report report = check_aligned_row(a, r, slots, size, scan);
  if (report.error != cuda_row_error::none) return report;
  const row_setup setup = make_setup(scan);
  if (eps > 0.0 && setup.old_only) {
    const double log_sum_old = old_log_sum(scan);
    const warp_lumped_evaluator<T> eval{lumped_row(a, r), setup.old_max, log_sum_old};
    const double floor = evaluate_at_zero(eval, setup, log_sum_old).kl;
    if (floor >= eps) {
      report.error = cuda_row_error::infeasible, report.value = floor;
      return report;
    }
  }
  if (regression && setup.new_only) report.error = cuda_row_error::regression_inf;
  return report;
}

/// Position of token `a` among entries [0, count) of `indices`, or −1 (one warp, every lane).
__device__ inline int warp_find_entry(const sparse_index* indices, int count, std::int64_t a) {
  int found = -1;
  for (int base = 0; base < count && found < 0; base += warp_lanes) {
    const int i = base + lane_id();
    const int lane = first_lane(i < count && std::int64_t(indices[i]) == a);
    if (lane >= 0) found = base + lane;
  }
  return found;
}

/// KL(p̃ ‖ π*) over the lumped categories (cpu::kl_logits_to_log_probs on the lumped rows): the
/// new side normalised by `log_norm_new`, π* from log_probs; +inf where p̃ > 0 = π*. One warp.
template <class T>
__device__ double warp_lumped_kl(const lumped_rows<T>& row, const T* lp_row, double lp_bucket, double log_norm_new) {
  double_pair local;  // first: the finite sum, second: categories where π* = 0 < p̃
  for (int i = lane_id(); i <= row.count; i += warp_lanes) {
    double x, y;
    row.at(i, x, y);
    const double lp_new = x - log_norm_new;
    if (!(lp_new > neg_inf())) continue;
    const double lp = i < row.count ? static_cast<double>(lp_row[i]) : lp_bucket;
    if (!(lp > neg_inf())) {
      local.second += 1.0;
      continue;
    }
    local.first += ::exp(lp_new) * (lp_new - lp);
  }
  const double_pair total = warp_all_reduce(local, add_pair{});
  return total.second > 0.0 ? inf() : maximum(total.first, 0.0);
}

/// Rows of `range`, after align and project: rows whose pre-alignment check (outcome[r]) passed
/// get the lumped checks (recorded through `checks`); then, unless validate_only, each row's
/// record and token loss: ρ = π*_a / q_a and α·KL(p̃ ‖ π*) on the lumped categories. A rejected
/// row (either check, or a projection that failed) gets count 0 and NaN remainders in aligned
/// and log_probs, stats with NaN fields, a NaN record and token loss.
template <class T>
__global__ void sparse_objective_rows_kernel(aligned_batch_view<T> aligned, token_batch<T> in, double eps,
                                             double alpha, sparse_batch_view<T> log_probs, projection_stats* stats,
                                             T* token_loss, objective_row_record* records,
                                             const cuda_row_report* outcome, int slots_per_array, row_range range,
                                             device_checks checks) {
  index_slot* slots = warp_scratch(1, slots_per_array);
  const aligned_batch_view<const T> rows = aligned;
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    cuda_row_report report = outcome[r];
    pair_scan scan;
    if (report.error == cuda_row_error::none) {
      report = lumped_problem(rows, r, eps, alpha > 0.0 && mask_of(in, r) != 0.0, slots, slots_per_array, scan);
      if (!checks.validate_only && report.error == cuda_row_error::none) {
        // The projection refused the row. A not_converged row holds a feasible member and is kept
        // with its loss, as on the CPU; its backward refuses it.
        const row_status status = stats[r].status;
        if (status == row_status::infeasible || status == row_status::rejected)
          report.error = cuda_row_error::infeasible, report.value = quiet_nan();
      }
      if (lane_id() == 0) record_row(checks, range, r, report);
    }
    if (checks.validate_only) continue;
    if (report.error != cuda_row_error::none) {
      sparse_index* indices = aligned.indices + r * aligned.k_max;
      for (std::size_t i = std::size_t(lane_id()); i < aligned.k_max; i += warp_lanes) {
        indices[i] = -1;
        aligned.new_log_probs[r * aligned.k_max + i] = aligned.old_log_probs[r * aligned.k_max + i] =
            static_cast<T>(neg_inf());
      }
      reject_sparse_row(log_probs.row_indices(r), log_probs.row_log_probs(r), log_probs.k_max);
      if (lane_id() == 0) {
        aligned.counts[r] = 0;
        aligned.new_log_remainder[r] = aligned.old_log_remainder[r] = static_cast<T>(quiet_nan());
        log_probs.counts[r] = 0, log_probs.log_remainder[r] = static_cast<T>(quiet_nan());
        stats[r] = rejected_stats(report.error);
        records[r] = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, 0.0};
        if (token_loss != nullptr) token_loss[r] = static_cast<T>(quiet_nan());
      }
      continue;
    }
    objective_row_record record;
    if (mask_of(in, r) != 0.0) {  // uniform across the warp
      const lumped_rows<T> row = lumped_row(rows, r);
      const T* lp_row = log_probs.row_log_probs(r);
      const int at = warp_find_entry(rows.indices + r * rows.k_max, row.count, in.tokens[r]);
      const double log_q_a = (static_cast<double>(row.old[at]) - scan.old.lse.m) - old_log_sum(scan);
      record.ratio = ratio_from_logs(static_cast<double>(lp_row[at]), log_q_a);
      // An inactive row is the log-softmax of the lumped new row: KL(p̃‖π*) = 0, as on the CPU.
      if (stats[r].status != row_status::inactive)
        record.kl_reg = warp_lumped_kl(row, lp_row, static_cast<double>(log_probs.log_remainder[r]),
                                       scan.fresh.lse.log_sum());
      record.loss = troll_token_loss(record.ratio, static_cast<double>(in.advantages[r]), alpha,
                                     alpha != 0.0 ? record.kl_reg : 0.0);
      const int overflow = forward_overflow<T>(record.ratio, record.loss);
      if (overflow >= 0) {  // uniform across the warp; the rows, log π* and stats stand
        if (lane_id() == 0)
          record_row(checks, range, r,
                     overflow_report(overflow, static_cast<double>(lp_row[at]) - log_q_a, in.tokens[r]));
        record = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, 0.0};
      }
    }
    if (lane_id() == 0) {
      records[r] = record;
      if (token_loss != nullptr) token_loss[r] = static_cast<T>(record.loss);
    }
  }
}

/// Rows of `range`: the backward's checks in the CPU's order — token data, the dense new row,
/// the aligned sides and log_probs (sparse rules), log_probs on the aligned support, on counted
/// rows the sampled token in U with a finite old entry, the lumped categories (regression with
/// α > 0), the stats — then, unless validate_only, ∂(c·ℓ)/∂(lumped new log-probs) into
/// `upstream` (the dense objective's per-token formula, objective_row.hpp): g on U, g_R on the
/// bucket, 0 on categories −inf on both sides and on rows with c = 0; NaN on rejected rows, so
/// that sparsify_backward writes their gradients as NaN.
template <class T>
__global__ void __launch_bounds__(block_threads)
    sparse_objective_upstream_kernel(batch_view<const T> new_logits, aligned_batch_view<const T> aligned,
                                     token_batch<T> in, double alpha, sparse_batch_view<const T> log_probs,
                                     const projection_stats* stats, double grad_loss,
                                     const objective_row_record* header, const objective_row_record* records,
                                     sparse_grad_view<T> upstream, int slots, row_range range, device_checks checks) {
  __shared__ sparse_objective_shared sh;
  const std::size_t size = new_logits.cols;
  for_each_objective_row(new_logits, in, sh.sorted, range,
                         [&](std::size_t r, const T* z, const split_scan& dense, cuda_row_report& report) {
    if (threadIdx.x < warp_lanes) {  // uniform: every thread holds the same report
      const sparse_index* indices = aligned.indices + r * aligned.k_max;
      const long long count = aligned.counts[r];
      if (report.error == cuda_row_error::none)
        report = warp_check_sparse_row(indices, aligned.new_log_probs + r * aligned.k_max, count,
                                       static_cast<double>(aligned.new_log_remainder[r]), aligned.k_max,
                                       aligned.vocab, operand_new, true, sh.sorted, slots);
      if (report.error == cuda_row_error::none)
        report = warp_check_sparse_row(indices, aligned.old_log_probs + r * aligned.k_max, count,
                                       static_cast<double>(aligned.old_log_remainder[r]), aligned.k_max,
                                       aligned.vocab, operand_old, true, sh.sorted, slots);
      // log_probs' mass (the last of its checks) is held back until after the support match, as
      // the CPU: log_probs of another forward (other ids, another count) is named as such.
      cuda_row_report log_probs_mass;
      if (report.error == cuda_row_error::none) {
        report = warp_check_sparse_row(log_probs.row_indices(r), log_probs.row_log_probs(r), log_probs.counts[r],
                                       static_cast<double>(log_probs.log_remainder[r]), log_probs.k_max,
                                       log_probs.vocab, operand_log_probs, true, sh.sorted, slots);
        if (report.error == cuda_row_error::sparse_mass) log_probs_mass = report, report = cuda_row_report{};
      }
      if (report.error == cuda_row_error::none && log_probs.counts[r] != count) {
        report.error = cuda_row_error::log_probs_mismatch, report.token = ~0ull;
        report.value = double(log_probs.counts[r]), report.operand = int(count);
      }
      if (report.error == cuda_row_error::none) {
        const sparse_index* lp_indices = log_probs.row_indices(r);
        for (int base = 0; base < int(count); base += warp_lanes) {
          const int i = base + lane_id();
          const int lane = first_lane(i < int(count) && lp_indices[i] != indices[i]);
          if (lane < 0) continue;
          const int at = base + lane;
          report.error = cuda_row_error::log_probs_mismatch, report.token = static_cast<unsigned long long>(at);
          report.value = double(lp_indices[at]), report.operand = int(indices[at]);
          break;
        }
      }
      if (report.error == cuda_row_error::none) report = log_probs_mass;
      if (report.error == cuda_row_error::none && mask_of(in, r) != 0.0) {
        const std::int64_t a = in.tokens[r];
        const int at = warp_find_entry(indices, int(count), a);
        if (at < 0) {
          report.error = cuda_row_error::not_in_aligned, report.value = double(a);
        } else if (is_masked(static_cast<double>(aligned.old_log_probs[r * aligned.k_max + std::size_t(at)]))) {
          report.error = cuda_row_error::old_entry_masked, report.value = double(a);
        }
      }
      pair_scan scan;
      if (report.error == cuda_row_error::none)
        report = lumped_problem(aligned, r, 0.0, alpha > 0.0 && mask_of(in, r) != 0.0, sh.sorted, slots, scan);
      const projection_stats s = stats[r];
      if (report.error == cuda_row_error::none) report_unusable_stats(s, report);
      if (lane_id() == 0) record_row(checks, range, r, report);
      if (!checks.validate_only) {
        T* g = upstream.row(r);
        const double weight = backward_row_weight(grad_loss, *header, records[r]);
        if (report.error != cuda_row_error::none) {
          // The whole slot row (the count may be the bad part): the scatter reads no unwritten g.
          for (std::size_t i = lane_id(); i < upstream.k_max; i += warp_lanes) g[i] = static_cast<T>(quiet_nan());
          if (lane_id() == 0) upstream.log_remainder[r] = static_cast<T>(quiet_nan());
        } else if (weight == 0.0) {
          for (int i = lane_id(); i < int(count); i += warp_lanes) g[i] = T(0);
          if (lane_id() == 0) upstream.log_remainder[r] = T(0);
        } else {
          const lumped_rows<T> row = lumped_row(aligned, r);
          const T* lp_row = log_probs.row_log_probs(r);
          const double lp_bucket = static_cast<double>(log_probs.log_remainder[r]);
          const int at = warp_find_entry(indices, row.count, in.tokens[r]);
          const double log_q_a = (static_cast<double>(row.old[at]) - scan.old.lse.m) - old_log_sum(scan);
          const double ratio = ratio_from_logs(static_cast<double>(lp_row[at]), log_q_a);
          const double log_norm_new = scan.fresh.lse.log_sum();
          const bool with_reg = alpha != 0.0 && s.status != row_status::inactive;
          const double kl_reg = with_reg ? warp_lumped_kl(row, lp_row, lp_bucket, log_norm_new) : 0.0;
          const bool projected = s.status == row_status::projected;
          // d − μ against a reference category on offset rows (centring_reference.hpp), else as
          // given; the re-centring (detail::centring_sums) over the other projected lumped rows, as
          // the CPU's troll_backward_prepare on its double lumped rows.
          const auto entry = [&](std::size_t i) {
            double x, y;
            row.at(static_cast<int>(i), x, y);
            return reference_entry{x, y, static_cast<int>(i) < row.count ? static_cast<double>(lp_row[i]) : lp_bucket};
          };
          const centring_reference ref = warp_reference(static_cast<std::size_t>(row.count) + 1, s, entry);
          const double d_a = ref.difference(static_cast<double>(row.fresh[at]), static_cast<double>(row.old[at]));
          double m = 0.0;
          if (projected && !ref.offset) {
            centring_sums centring;
            for (int i = lane_id(); i <= row.count; i += warp_lanes) {
              double x, y;
              row.at(i, x, y);
              const double lp = i < row.count ? static_cast<double>(lp_row[i]) : lp_bucket;
              if (lp > neg_inf() && !(x == neg_inf() && y == neg_inf())) centring.add(::exp(lp), ref.centred(x, y), lp);
            }
            m = warp_all_reduce(centring, merge_centring{}).step<double>();
          }
          projection_stats shifted = s;
          shifted.mu = ref.mu;
          const troll_row_coefficients k = troll_coefficients(weight, static_cast<double>(in.advantages[r]), ratio,
                                                              with_reg ? alpha : 0.0, kl_reg, d_a, shifted, m);
          const int overflow = backward_overflow<T>(ratio, k.ratio_coef * k.t);
          if (overflow >= 0 && lane_id() == 0)  // uniform across the warp: NaN upstream below
            record_row(checks, range, r,
                       overflow_report(overflow, static_cast<double>(lp_row[at]) - log_q_a, in.tokens[r]));
          // Each part's entry at its dominant category (π*'s for the ratio part, p̃'s for the
          // regression part) is minus the part's other entries, as on the CPU
          // (troll_backward_write on the lumped rows, troll_dominant_sums).
          troll_dominant_sums dominant;
          double largest = 0.0;        // the largest |entry|
          double largest_ratio = 0.0;  // the ratio part's (two_point_suspect)
          for (int i = lane_id(); i <= row.count; i += warp_lanes) {
            double x, y;
            row.at(i, x, y);
            troll_gradient_parts parts;
            double lp = neg_inf(), lp_new = neg_inf();
            if (!(x == neg_inf() && y == neg_inf())) {
              lp = i < row.count ? static_cast<double>(lp_row[i]) : lp_bucket;
              const bool on_support = lp > neg_inf();
              const double centred = on_support && projected ? ref.centred(x, y) - m : 0.0;
              lp_new = x - log_norm_new;
              parts = troll_gradient_split(k, i == at, on_support, lp_new > neg_inf(), lp, lp_new, centred);
            }
            dominant.add(static_cast<std::size_t>(i), lp, with_reg ? lp_new : neg_inf(), parts);
            const double value = overflow >= 0 ? quiet_nan() : parts.ratio + parts.reg;
            if (overflow < 0) largest = larger_of{}(largest, ::fabs(value));
            largest_ratio = larger_of{}(largest_ratio, ::fabs(parts.ratio));
            (i < row.count ? g[i] : upstream.log_remainder[r]) = static_cast<T>(value);
          }
          // every lane reaches the reduction (the branch above is uniform across the warp), and
          // __syncwarp orders the lanes' writes before lane 0's overwrites (shuffles are no fence)
          const troll_dominant_sums total = warp_all_reduce(dominant, merge_troll_dominant{});
          largest = warp_all_reduce(largest, larger_of{});
          // The ratio part on a nearly two-point π*: its entries at the two heaviest categories from
          // the others' (troll/detail/two_point.hpp), as the CPU's troll_backward_write.
          two_point_values tp;
          heavy_pair h;
          if (projected && overflow < 0 && k.inv_sigma2 != 0.0) {  // warp-uniform
            const two_point_frame f{k.ratio_coef * k.t, 1.0, k.centred_a * k.inv_sigma2, two_point_pi_ulps<T>()};
            tp = warp_lumped_two_point(row, lp_row, lp_bucket, ref, m, f, largest_ratio, 1.0,
                                       [&](std::size_t i) { return static_cast<int>(i) == at ? 1.0 : 0.0; }, h);
          }
          __syncwarp();
          if (overflow < 0 && lane_id() == 0) {
            const auto put = [&](std::size_t top, double value) {
              largest = larger_of{}(largest, ::fabs(value));
              (int(top) < row.count ? g[top] : upstream.log_remainder[r]) = static_cast<T>(value);
            };
            if (total.ratio.found()) put(total.ratio.top, total.at_ratio_top());
            if (total.reg.found()) put(total.reg.top, total.at_reg_top());
            if (tp.take) {  // the regression part added as written (its rule's value at p̃'s dominant)
              const auto reg_at = [&](std::size_t i) {
                double x, y;
                row.at(static_cast<int>(i), x, y);
                const double lp = static_cast<int>(i) < row.count ? static_cast<double>(lp_row[i]) : lp_bucket;
                return troll_regression_written(k, total, i, static_cast<int>(i) == at, lp, x - log_norm_new);
              };
              put(h.first, tp.v1 + reg_at(h.first));
              put(h.second, tp.v2 + reg_at(h.second));
            }
            // The CPU's last guard: an entry beyond the sampled token's that overflows T (a huge
            // regression or cross term) is reported after the pass.
            if (!fits_in<T>(largest))
              record_row(checks, range, r,
                         overflow_report(overflow_operand<T>(overflow_quantity::gradient), quiet_nan(),
                                         in.tokens[r]));  // the CPU's report (no ratio)
          }
        }
      }
    }
    __syncthreads();  // the next row rewrites the shared slots
  });
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
