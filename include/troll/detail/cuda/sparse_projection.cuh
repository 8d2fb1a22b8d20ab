// troll/detail/cuda/sparse_projection.cuh — the sparse row kernels that never touch dense
// logits, one warp per row: align two sparse rows on the union of their supports, and the KL,
// the projection and its VJP of aligned rows. The last three run the shared host/device solver
// (trust_region_solver.hpp) on the |U| + 1 lumped categories (the bucket is one category, log
// mass log r when the tail is not empty), exactly as the CPU's lumped_pair + row kernels do;
// the evaluator is a warp all-reduce of lse_state, identical in every lane.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../../sparse_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "../tilt_derivatives.hpp"
#include "../trust_region_solver.hpp"
#include "backward_kernels.cuh"
#include "block_reduce.cuh"
#include "offset_reference.cuh"
#include "forward_kernels.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "sparse_warp.cuh"
#include "two_point_block.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Operand numbers of the sparse entry points' reports (cuda_row_report::operand).
enum sparse_operand : int {
  operand_new = 0,          // the new rows (or the new side of aligned rows, or sparsify's logits)
  operand_old = 1,          // the old rows (or side)
  operand_new_lumped = 2,   // the lumped (|U| + 1)-category new row
  operand_old_lumped = 3,   // the lumped old row
  operand_log_probs = 4,    // project_backward's forward output
  operand_grad = 5,         // an upstream gradient
  operand_out = 6,          // an output (capacity)
  operand_support = 7,      // the support of sparsify_backward / align(new_logits, ...)
};

/// One aligned row as the lumped categories 0..count (count: the bucket, −inf on both sides when
/// the tail is empty), read straight from the batch.
template <class T>
struct lumped_rows {
  const T* fresh;
  const T* old;
  double bucket_new;
  double bucket_old;
  int count;

  __device__ void at(int i, double& a, double& b) const {
    if (i < count) {
      a = static_cast<double>(fresh[i]), b = static_cast<double>(old[i]);
    } else {
      a = bucket_new, b = bucket_old;
    }
  }
};

template <class T>
__device__ lumped_rows<T> lumped_row(const aligned_batch_view<const T>& a, std::size_t r) {
  const int count = static_cast<int>(a.counts[r]);
  const bool tail = static_cast<long long>(a.vocab) > count;
  return lumped_rows<T>{a.new_log_probs + r * a.k_max, a.old_log_probs + r * a.k_max,
                        tail ? static_cast<double>(a.new_log_remainder[r]) : neg_inf(),
                        tail ? static_cast<double>(a.old_log_remainder[r]) : neg_inf(), count};
}

/// The tilted-family reduction of trust_region_solver.hpp over one lumped row, by one warp.
template <class T>
struct warp_lumped_evaluator {
  lumped_rows<T> row;
  double old_max;
  double log_sum_old;

  TROLL_HOST_DEVICE double old_log_sum() const { return log_sum_old; }

  /// f(a_i, b_i) for this lane's entries i of the lumped row.
  template <class F>
  __device__ void for_each_pair(F&& f) const {
    for (int i = lane_id(); i <= row.count; i += warp_lanes) {
      double a, b;
      row.at(i, a, b);
      f(a, b);
    }
  }
  __device__ lse_state team_reduce(const lse_state& s) const { return warp_all_reduce(s, merge_lse{}); }

  TROLL_HOST_DEVICE lse_state operator()(const tilt_param& u, const tilt_ref& ref) const {
    return team_tilt_sums(*this, u, ref);
  }
  /// KL(π‖q) at an evaluated point as a warp sum (team_exact_kl).
  TROLL_HOST_DEVICE double exact_kl(const tilt_point& p) const { return team_exact_kl(*this, p); }
  /// Σ ratio_term as a warp sum (team_ratio_sum).
  TROLL_HOST_DEVICE double ratio_sum(const tilt_point& p) const { return team_ratio_sum(*this, p); }
};

struct merge_pair_scan_op {
  __device__ pair_scan operator()(const pair_scan& a, const pair_scan& b) const { return merge(a, b); }
};

/// Checks both sides of aligned row r (the sparse rules; the sides share indices and counts) and
/// scans its lumped rows: all-masked sides and disjoint supports, as validate_aligned does.
/// `slots` holds `size` index_slots. Every lane returns the same report and scan.
template <class T>
__device__ cuda_row_report check_aligned_row(const aligned_batch_view<const T>& a, std::size_t r, index_slot* slots,
                                             int size, pair_scan& scan) {
  cuda_row_report report =
      warp_check_sparse_row(a.indices + r * a.k_max, a.new_log_probs + r * a.k_max, a.counts[r],
                            static_cast<double>(a.new_log_remainder[r]), a.k_max, a.vocab, operand_new, true, slots, size);
  if (report.error != cuda_row_error::none) return report;
  report = warp_check_sparse_row(a.indices + r * a.k_max, a.old_log_probs + r * a.k_max, a.counts[r],
                                 static_cast<double>(a.old_log_remainder[r]), a.k_max, a.vocab, operand_old, true,
                                 slots, size);
  if (report.error != cuda_row_error::none) return report;
  const lumped_rows<T> row = lumped_row(a, r);
  pair_scan local;
  for (int i = lane_id(); i <= row.count; i += warp_lanes) {
    double x, y;
    row.at(i, x, y);
    if (x == neg_inf() && y == neg_inf()) continue;  // no mass on either side: left out, as on the CPU
    add(local, std::size_t(i), x, y);
  }
  scan = warp_all_reduce(local, merge_pair_scan_op{});
  if (scan.fresh.lse.empty()) {
    report.error = cuda_row_error::all_masked, report.operand = operand_new_lumped;
  } else if (scan.old.lse.empty()) {
    report.error = cuda_row_error::all_masked, report.operand = operand_old_lumped;
  } else if (scan.at_new == no_token) {
    report.error = cuda_row_error::disjoint;
  }
  return report;
}

/// Writes a rejected sparse output row: count 0, padding, NaN remainder (lane-parallel).
template <class T>
__device__ void reject_sparse_row(sparse_index* indices, T* log_probs, std::size_t k_max) {
  for (std::size_t i = std::size_t(lane_id()); i < k_max; i += warp_lanes) {
    indices[i] = -1;
    log_probs[i] = static_cast<T>(neg_inf());
  }
}

/// Rows of `range`: out = align(new_rows, old_rows) (see troll::align).
template <class T>
__global__ void align_kernel(sparse_batch_view<const T> new_rows, sparse_batch_view<const T> old_rows,
                             aligned_batch_view<T> out, int slots_per_array, row_range range, device_checks checks) {
  index_slot* new_sorted = warp_scratch(2, slots_per_array);
  index_slot* old_sorted = new_sorted + slots_per_array;
  const std::size_t end = range.begin + range.count;
  const std::size_t cap = out.k_max < std::size_t(sparse_max_entries) ? out.k_max : std::size_t(sparse_max_entries);
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    const sparse_index* ni = new_rows.row_indices(r);
    const sparse_index* oi = old_rows.row_indices(r);
    const double lr_new = static_cast<double>(new_rows.log_remainder[r]);
    const double lr_old = static_cast<double>(old_rows.log_remainder[r]);
    cuda_row_report report = warp_check_sparse_row(ni, new_rows.row_log_probs(r), new_rows.counts[r], lr_new,
                                                   new_rows.k_max, new_rows.vocab, operand_new, true, new_sorted,
                                                   slots_per_array);
    if (report.error == cuda_row_error::none)
      report = warp_check_sparse_row(oi, old_rows.row_log_probs(r), old_rows.counts[r], lr_old, old_rows.k_max,
                                     old_rows.vocab, operand_old, true, old_sorted, slots_per_array);
    const int cn = static_cast<int>(new_rows.counts[r]), co = static_cast<int>(old_rows.counts[r]);
    if (report.error == cuda_row_error::none) {
      const int u = warp_union(ni, cn, oi, co, new_sorted, old_sorted, [](int, sparse_index, int, int) {});
      if (std::size_t(u) > cap)
        report.error = cuda_row_error::sparse_count, report.operand = operand_out, report.value = double(u);
    }
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    sparse_index* indices = out.indices + r * out.k_max;
    T* ln = out.new_log_probs + r * out.k_max;
    T* lo = out.old_log_probs + r * out.k_max;
    if (report.error != cuda_row_error::none) {
      reject_sparse_row(indices, ln, out.k_max);
      reject_sparse_row(indices, lo, out.k_max);
      if (lane_id() == 0)
        out.counts[r] = 0, out.new_log_remainder[r] = out.old_log_remainder[r] = static_cast<T>(quiet_nan());
      continue;
    }
    const long long vocab = static_cast<long long>(out.vocab);
    const long long m_new = vocab - cn, m_old = vocab - co;
    const double tail_new = tail_log_value(lr_new, m_new), tail_old = tail_log_value(lr_old, m_old);
    const T* new_lp = new_rows.row_log_probs(r);
    const T* old_lp = old_rows.row_log_probs(r);
    const int u = warp_union(ni, cn, oi, co, new_sorted, old_sorted,
                             [&](int at, sparse_index token, int new_pos, int old_pos) {
                               indices[at] = token;
                               ln[at] = new_pos >= 0 ? new_lp[new_pos] : static_cast<T>(tail_new);
                               lo[at] = old_pos >= 0 ? old_lp[old_pos] : static_cast<T>(tail_old);
                             });
    for (std::size_t i = std::size_t(u) + std::size_t(lane_id()); i < out.k_max; i += warp_lanes) {
      indices[i] = -1;
      ln[i] = lo[i] = static_cast<T>(neg_inf());
    }
    if (lane_id() == 0) {
      const long long m_u = vocab - u;
      out.counts[r] = u;
      out.new_log_remainder[r] = static_cast<T>(shrink_log_remainder(lr_new, m_new, m_u));
      out.old_log_remainder[r] = static_cast<T>(shrink_log_remainder(lr_old, m_old, m_u));
    }
  }
}

/// Rows of `range`: grad_row = the gradient on sparse row `row` of align(new, old) given the
/// gradient on one side of the aligned rows (see troll::align_backward): entries of S pass
/// through, ∂L/∂log r = g_R + Σ_{u ∈ U∖S} g_u. Row checks in the CPU's order: `row` (operand 0),
/// the aligned new side (operand 1), every entry of `row` in U, finite gradients (operand 5).
/// A rejected row gets NaN gradients.
template <class T>
__global__ void align_backward_kernel(sparse_batch_view<const T> row, aligned_batch_view<const T> aligned,
                                      sparse_grad_view<const T> grad_aligned, sparse_grad_view<T> grad_row,
                                      int slots_per_array, row_range range, device_checks checks) {
  index_slot* row_sorted = warp_scratch(2, slots_per_array);
  index_slot* aligned_sorted = row_sorted + slots_per_array;
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    const sparse_index* ri = row.row_indices(r);
    const sparse_index* ai = aligned.indices + r * aligned.k_max;
    const T* g = grad_aligned.row(r);
    const double g_r = static_cast<double>(grad_aligned.log_remainder[r]);
    cuda_row_report report =
        warp_check_sparse_row(ri, row.row_log_probs(r), row.counts[r], static_cast<double>(row.log_remainder[r]),
                              row.k_max, row.vocab, operand_new, true, row_sorted, slots_per_array);
    if (report.error == cuda_row_error::none)
      report = warp_check_sparse_row(ai, aligned.new_log_probs + r * aligned.k_max, aligned.counts[r],
                                     static_cast<double>(aligned.new_log_remainder[r]), aligned.k_max, aligned.vocab,
                                     operand_old, true, aligned_sorted, slots_per_array);
    const int c = report.error == cuda_row_error::none ? static_cast<int>(row.counts[r]) : 0;
    const int u = report.error == cuda_row_error::none ? static_cast<int>(aligned.counts[r]) : 0;
    for (int base = 0; report.error == cuda_row_error::none && base < c; base += warp_lanes) {
      const int i = base + lane_id();
      const int bad = first_lane(i < c && find_slot(aligned_sorted, u, ri[i]) < 0);
      if (bad < 0) continue;
      report.error = cuda_row_error::sparse_not_aligned, report.operand = operand_new;
      report.token = static_cast<unsigned long long>(base + bad);
      report.value = double(ri[base + bad]);
    }
    for (int base = -1; report.error == cuda_row_error::none && base < u; base += warp_lanes) {
      const int i = base + lane_id();
      const double gi = i < 0 ? g_r : (i < u ? static_cast<double>(g[i]) : 0.0);
      const int bad = first_lane(!(gi - gi == 0.0));
      if (bad < 0) continue;
      report.error = cuda_row_error::sparse_nan, report.operand = operand_grad;
      report.token = static_cast<unsigned long long>(static_cast<long long>(base + bad));
      report.value = __shfl_sync(full_warp, gi, bad);  // bad is the warp's: every lane is here
    }
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    T* out = grad_row.row(r);
    if (report.error != cuda_row_error::none) {
      for (std::size_t i = std::size_t(lane_id()); i < grad_row.k_max; i += warp_lanes)
        out[i] = static_cast<T>(quiet_nan());
      if (lane_id() == 0) grad_row.log_remainder[r] = static_cast<T>(quiet_nan());
      continue;
    }
    // Every entry of `row` is in U (checked), so the scatter writes out[0..c) exactly once.
    // Upstream gradients at −inf outputs are ignored, as troll::align_backward(cpu_policy, ...):
    // U∖S where the row's tail is massless, the bucket where it is too or U covers V, and −inf
    // entries of the row get 0.
    const double lr = static_cast<double>(row.log_remainder[r]);
    const long long vocab = static_cast<long long>(row.vocab), m = vocab - c, m_u = vocab - u;
    const bool tail_counted = !masked_value<T>(tail_log_value(lr, m));
    const double g_bucket = masked_value<T>(shrink_log_remainder(lr, m, m_u)) ? 0.0 : g_r;
    const T* values = row.row_log_probs(r);
    double outside = 0.0;
    for (int i = lane_id(); i < u; i += warp_lanes) {
      const int slot = find_slot(row_sorted, c, ai[i]);
      if (slot >= 0) {
        const int at = row_sorted[slot].position;
        out[at] = masked_value<T>(static_cast<double>(values[at])) ? T(0) : g[i];
      } else if (tail_counted) {
        outside += static_cast<double>(g[i]);
      }
    }
    outside = warp_all_reduce(outside, add_double{});
    for (std::size_t i = std::size_t(c) + std::size_t(lane_id()); i < grad_row.k_max; i += warp_lanes)
      out[i] = T(0);
    if (lane_id() == 0) grad_row.log_remainder[r] = static_cast<T>(g_bucket + outside);
  }
}

/// Rows of `range`: kl_out[r] = KL(new ‖ old) of aligned rows (lumped), +inf where new has mass
/// old lacks; NaN for a rejected row.
template <class T>
__global__ void sparse_kl_kernel(aligned_batch_view<const T> rows, T* kl_out, int slots_per_array, row_range range,
                                 device_checks checks) {
  index_slot* slots = warp_scratch(1, slots_per_array);
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    pair_scan scan;
    cuda_row_report report = check_aligned_row(rows, r, slots, slots_per_array, scan);
    if (report.error == cuda_row_error::disjoint) report = cuda_row_report{};  // a KL of +inf (kl_pair_problem)
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    const double value = kl_row_value(scan, report, [&] {
      return warp_lumped_evaluator<T>{lumped_row(rows, r), scan.old.lse.m, old_log_sum(scan)};
    });
    if (lane_id() == 0) kl_out[r] = static_cast<T>(value);
  }
}

/// Rows of `range`: the projection of aligned rows (see troll::project). With
/// checks.validate_only only the CPU's pre-write validation runs (infeasibility and out's
/// capacity included).
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    sparse_project_kernel(aligned_batch_view<const T> rows, double eps, projection_options options,
                                      sparse_batch_view<T> out, projection_stats* stats, int slots_per_array,
                                      row_range range, device_checks checks) {
  index_slot* slots = warp_scratch(1, slots_per_array);
  const std::size_t end = range.begin + range.count;
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    pair_scan scan;
    cuda_row_report report = check_aligned_row(rows, r, slots, slots_per_array, scan);
    const lumped_rows<T> row = lumped_row(rows, r);
    const row_setup setup = make_setup(scan);
    const double log_sum_old = old_log_sum(scan);
    const warp_lumped_evaluator<T> eval{row, setup.old_max, log_sum_old};
    if (report.error == cuda_row_error::none && std::size_t(row.count) > out.k_max) {
      report.error = cuda_row_error::sparse_capacity, report.operand = operand_out;
      report.token = out.k_max, report.value = double(row.count);
    }
    if (checks.validate_only) {
      check_feasible(eval, setup, log_sum_old, eps, report);
      if (lane_id() == 0) record_row(checks, range, r, report);
      continue;
    }
    const solve_result result = solve_checked_row(eval, setup, eps, options, report);
    if (lane_id() == 0) record_row(checks, range, r, report);
    sparse_index* indices = out.row_indices(r);
    T* lp = out.row_log_probs(r);
    if (report.error != cuda_row_error::none) {
      reject_sparse_row(indices, lp, out.k_max);
      if (lane_id() == 0) {
        out.counts[r] = 0, out.log_remainder[r] = static_cast<T>(quiet_nan());
        stats[r] = rejected_stats(report.error);
      }
      continue;
    }
    const bool inactive = result.status == row_status::inactive;
    const double new_max = scan.fresh.lse.m, new_log_sum = ::log(scan.fresh.lse.s0);
    const tilt_point& p = result.point;
    for (int i = lane_id(); i <= row.count; i += warp_lanes) {
      double a, b;
      row.at(i, a, b);
      double value = neg_inf();
      if (inactive) {
        if (a > neg_inf()) value = (a - new_max) - new_log_sum;
      } else if (a > neg_inf() && b > neg_inf()) {
        value = minimum(tilt_weight(a, b, tilt_centred(a, b, p.ref), p.ref, tilt_param{p.t, p.s}) - p.log_norm, 0.0);
      }
      if (i < row.count) {
        indices[i] = rows.indices[r * rows.k_max + std::size_t(i)];
        lp[i] = static_cast<T>(value);
      } else {
        out.log_remainder[r] = static_cast<T>(value);
      }
    }
    for (std::size_t i = std::size_t(row.count) + std::size_t(lane_id()); i < out.k_max; i += warp_lanes) {
      indices[i] = -1;
      lp[i] = static_cast<T>(neg_inf());
    }
    if (lane_id() == 0) {
      out.counts[r] = row.count;
      stats[r] = make_stats(result);
    }
  }
}

/// Rows of `range`: the VJP of the sparse projection (see troll::project_backward) on the lumped
/// categories, with the formulas of cpu::vjp_row (the π − q of ∂t/∂z° from log(π/q) where π ≈ q).
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    sparse_project_backward_kernel(aligned_batch_view<const T> rows, sparse_batch_view<const T> log_probs,
                                               const projection_stats* stats, sparse_grad_view<const T> grad,
                                               sparse_grad_view<T> grad_new, sparse_grad_view<T> grad_old,
                                               T* grad_eps, int slots_per_array, row_range range,
                                               device_checks checks) {
  index_slot* slots = warp_scratch(1, slots_per_array);
  const std::size_t end = range.begin + range.count;
  const bool want_old = !grad_old.empty();
  for (std::size_t r = warp_first_row(range); r < end; r += warp_row_stride()) {
    pair_scan scan;
    cuda_row_report report = check_aligned_row(rows, r, slots, slots_per_array, scan);
    const lumped_rows<T> row = lumped_row(rows, r);
    const T* lp_row = log_probs.row_log_probs(r);
    const T* g_row = grad.row(r);
    const double lr = static_cast<double>(log_probs.log_remainder[r]);
    const double g_r = static_cast<double>(grad.log_remainder[r]);
    const long long lp_count = log_probs.counts[r];
    if (report.error == cuda_row_error::none && (lp_count < 0 || std::size_t(lp_count) > log_probs.k_max)) {
      // Its own capacity first: lp_row is read up to the count (the CPU's order).
      report.error = cuda_row_error::sparse_count, report.operand = operand_log_probs;
      report.value = double(lp_count);
    } else if (report.error == cuda_row_error::none && lp_count != rows.counts[r]) {
      report.error = cuda_row_error::sparse_not_aligned, report.operand = operand_log_probs;
      report.value = double(lp_count);
    }
    if (report.error == cuda_row_error::none) {
      // Entry −1 (the remainder) first, then the entries in order, as the CPU: a token id other
      // than the aligned one, a NaN log-prob, a log-prob above 0 (+inf included), then a
      // non-finite upstream value where the log-prob has mass.
      const sparse_index* lp_indices = log_probs.row_indices(r);
      const sparse_index* aligned_indices = rows.indices + r * rows.k_max;
      for (int base = -1; base < row.count; base += warp_lanes) {
        const int i = base + lane_id();
        int problem = 0;
        double l = 0.0, g = 0.0;
        if (i < row.count) {
          l = i < 0 ? lr : static_cast<double>(lp_row[i]);
          g = i < 0 ? g_r : static_cast<double>(g_row[i]);
          double side_new, side_old;  // the lumped category's (new, old) log-probs
          row.at(i < 0 ? row.count : i, side_new, side_old);
          if (i >= 0 && lp_indices[i] != aligned_indices[i]) problem = 3;
          else if (l != l) problem = 1;
          else if (l > 0.0) problem = 4;
          else if (l > neg_inf() && (side_new == neg_inf() || side_old == neg_inf())) problem = 5;
          else if (l > neg_inf() && !(g - g == 0.0)) problem = 2;
        }
        const int bad = first_lane(problem != 0);
        if (bad < 0) continue;
        const int kind = __shfl_sync(full_warp, problem, bad);
        const int at = base + bad;
        report.token = static_cast<unsigned long long>(static_cast<long long>(at));
        if (kind == 3) {
          report.error = cuda_row_error::sparse_wrong_token;
          report.value = double(lp_indices[at]);
          report.operand = int(aligned_indices[at]);
        } else if (kind == 4) {
          report.error = cuda_row_error::sparse_above_one, report.operand = operand_log_probs;
          report.value = __shfl_sync(full_warp, l, bad);
        } else if (kind == 5) {
          report.error = cuda_row_error::sparse_masked_mass, report.operand = operand_log_probs;
          report.value = __shfl_sync(full_warp, l, bad);
        } else {
          report.error = cuda_row_error::sparse_nan;
          report.operand = kind == 1 ? operand_log_probs : operand_grad;
          report.value = __shfl_sync(full_warp, kind == 1 ? l : g, bad);
        }
        break;
      }
    }
    const projection_stats s = stats[r];
    if (report.error == cuda_row_error::none) report_unusable_stats(s, report);  // kl_after included, as check_stats
    if (lane_id() == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;
    T* out_new = grad_new.row(r);
    T* out_old = want_old ? grad_old.row(r) : nullptr;
    if (report.error != cuda_row_error::none) {
      for (std::size_t i = std::size_t(lane_id()); i < grad_new.k_max; i += warp_lanes)
        out_new[i] = static_cast<T>(quiet_nan());
      for (std::size_t i = std::size_t(lane_id()); want_old && i < grad_old.k_max; i += warp_lanes)
        out_old[i] = static_cast<T>(quiet_nan());
      if (lane_id() == 0) {
        grad_new.log_remainder[r] = static_cast<T>(quiet_nan());
        if (want_old) grad_old.log_remainder[r] = static_cast<T>(quiet_nan());
        if (grad_eps != nullptr) grad_eps[r] = static_cast<T>(quiet_nan());
      }
      continue;
    }
    const bool projected = s.status == row_status::projected;
    // d − μ against a reference category on offset rows (centring_reference.hpp), else as given.
    const auto entry = [&](std::size_t i) {
      double a, b;
      row.at(static_cast<int>(i), a, b);
      return reference_entry{a, b, static_cast<int>(i) < row.count ? static_cast<double>(lp_row[i]) : lr};
    };
    const centring_reference ref = warp_reference(static_cast<std::size_t>(row.count) + 1, s, entry);
    double_pair sums;
    centring_sums centring;  // the re-centring of d − μ (detail::centring_sums), as the CPU's lumped VJP
    for (int i = lane_id(); i <= row.count; i += warp_lanes) {
      double a, b;
      row.at(i, a, b);
      const double l = i < row.count ? static_cast<double>(lp_row[i]) : lr;
      if (!(l > neg_inf()) || (a == neg_inf() && b == neg_inf())) continue;
      const double g = i < row.count ? static_cast<double>(g_row[i]) : g_r;
      const double c = ref.centred(a, b);
      sums.first += g;
      sums.second += g * c;
      if (projected) centring.add(::exp(l), c, l);
    }
    sums = warp_all_reduce(sums, add_pair{});
    // The lumped rows are double on the CPU: its noise estimate is double's.
    const double m = projected ? warp_all_reduce(centring, merge_centring{}).step<double>() : 0.0;
    sums.second -= m * sums.first;
    const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
    const double h_over_var = projected ? sums.second / s.sigma2 : 0.0;
    const double old_max = scan.old.lse.m, log_sum_old = old_log_sum(scan);
    old_side_sums old_sums, new_sums;
    double largest = 0.0, widest_g = 0.0;  // this lane's max |gn| and |g| (two_point_suspect)
    for (int i = lane_id(); i <= row.count; i += warp_lanes) {
      double a, b;
      row.at(i, a, b);
      double gn = 0.0, go = 0.0;
      if (!(a == neg_inf() && b == neg_inf())) {
        const double l = i < row.count ? static_cast<double>(lp_row[i]) : lr;
        const bool on_support = l > neg_inf();
        const double pi = on_support ? ::exp(l) : 0.0;
        const double centred = on_support ? ref.centred(a, b) - m : 0.0;
        const double gb = on_support ? (i < row.count ? static_cast<double>(g_row[i]) : g_r) : 0.0;
        const double explicit_part = gb - pi * sums.first;
        gn = t * (explicit_part - pi * centred * h_over_var);
        new_sums.add(std::size_t(i), l, gn);
        largest = larger_of{}(largest, ::fabs(gn));
        widest_g = larger_of{}(widest_g, ::fabs(gb));
        if (projected) {
          const double q = b > neg_inf() ? ::exp((b - old_max) - log_sum_old) : 0.0;
          go = rest * explicit_part + sums.second * dt_dold(on_support, pi, centred, q, s);
          old_sums.add(std::size_t(i), l, go);
        }
      }
      if (i < row.count) {
        out_new[i] = static_cast<T>(gn);
        if (want_old) out_old[i] = static_cast<T>(go);
      } else {
        grad_new.log_remainder[r] = static_cast<T>(gn);
        if (want_old) grad_old.log_remainder[r] = static_cast<T>(go);
      }
    }
    // Each side's entries sum to 0: the dominant category's entry from the others' (old_side_sums,
    // the CPU's new_side_dominant on the new side). Every lane reaches the reduction (the old
    // side's condition is warp-uniform); __syncwarp orders the lanes' writes above before lane 0's
    // overwrite (shuffles are no fence).
    const auto put_dominant = [&](const old_side_sums& sums, T* out, T* bucket) {
      const old_side_sums total = warp_all_reduce(sums, merge_old_side{});
      __syncwarp();
      if (lane_id() == 0 && total.found())
        (total.top < std::size_t(row.count) ? out[total.top] : *bucket) = static_cast<T>(total.top_entry());
    };
    put_dominant(new_sums, out_new, grad_new.log_remainder + r);
    if (want_old && projected) put_dominant(old_sums, out_old, grad_old.log_remainder + r);
    if (projected) {  // warp-uniform: the two-point rule (troll/detail/two_point.hpp), as the CPU
      const auto upstream = [&](std::size_t i) {
        return static_cast<int>(i) < row.count ? static_cast<double>(g_row[i]) : g_r;
      };
      const two_point_frame f{t, sums.first, h_over_var, two_point_pi_ulps<T>()};
      heavy_pair h;
      const two_point_values tp = warp_lumped_two_point(row, lp_row, lr, ref, m, f, largest, widest_g, upstream, h);
      __syncwarp();  // the lanes' writes above before lane 0's overwrites
      if (lane_id() == 0 && tp.take) {
        T* bucket = grad_new.log_remainder + r;
        (h.first < std::size_t(row.count) ? out_new[h.first] : *bucket) = static_cast<T>(tp.v1);
        (h.second < std::size_t(row.count) ? out_new[h.second] : *bucket) = static_cast<T>(tp.v2);
      }
    }
    for (std::size_t i = std::size_t(row.count) + std::size_t(lane_id()); i < grad_new.k_max; i += warp_lanes)
      out_new[i] = T(0);
    for (std::size_t i = std::size_t(row.count) + std::size_t(lane_id()); want_old && i < grad_old.k_max;
         i += warp_lanes)
      out_old[i] = T(0);
    if (lane_id() == 0 && grad_eps != nullptr)
      grad_eps[r] = static_cast<T>(projected ? sums.second / (s.t * s.sigma2) : 0.0);
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
