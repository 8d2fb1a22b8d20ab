// troll/detail/cuda/objective_kernels.cuh — TROLL's objective on the device (math.md §5), one
// block per row as the projection kernels: the row kernel projects, then forms the ratio at the
// sampled token and the regression KL; a one-block kernel aggregates the rows into the metrics
// (forward) or the aggregation weights (backward), in a fixed order, so results are reproducible.
// Per-token maths from detail/objective_row.hpp, shared with the CPU backend.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../objective_types.hpp"
#include "../../projection_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../objective_row.hpp"
#include "../trust_region_solver.hpp"
#include "../workspace_layout.hpp"
#include "backward_kernels.cuh"
#include "block_reduce.cuh"
#include "offset_reference.cuh"
#include "forward_kernels.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "two_point_block.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The device counterpart of check_token_row (same order of checks). `old_row` null: sparse old
/// rows, which check the old entry at the sampled token themselves.
template <class T>
__device__ cuda_row_report token_problem(const token_batch<T>& in, std::size_t r, std::size_t size,
                                         const T* old_row) {
  cuda_row_report p;
  if (in.aggregation == loss_aggregation::sequence_mean && r > 0 &&
      in.sequence_ids[r] < in.sequence_ids[r - 1]) {
    p.error = cuda_row_error::sequence_order, p.value = double(in.sequence_ids[r]);
    return p;
  }
  const double w = mask_of(in, r);
  if (!(w >= 0.0 && w < inf())) {
    p.error = cuda_row_error::bad_mask, p.value = w;
    return p;
  }
  if (w == 0.0) return p;
  const std::int64_t a = in.tokens[r];
  if (a < 0 || std::uint64_t(a) >= size) {
    p.error = cuda_row_error::bad_sampled, p.value = double(a);
    return p;
  }
  const double adv = static_cast<double>(in.advantages[r]);
  if (!(adv - adv == 0.0)) {
    p.error = cuda_row_error::bad_advantage, p.value = adv;
    return p;
  }
  if (old_row != nullptr && is_masked(static_cast<double>(old_row[a])))
    p.error = cuda_row_error::old_token_masked, p.value = double(a);
  return p;
}

/// The checks of validate_objective (pair_scan mode) on a scanned row: token data, logits,
/// regression support, and (when `with_floor`) the infeasibility floor −log q(J) ≥ ε.
template <class T>
__device__ cuda_row_report objective_row_problem(const token_batch<T>& in, std::size_t r,
                                                 std::size_t size, const T* zn, const T* zo,
                                                 const pair_scan& scan,
                                                 const block_tilt_evaluator<T>& eval, double eps,
                                                 double alpha, bool with_floor) {
  cuda_row_report report = token_problem(in, r, size, zo);
  if (report.error == cuda_row_error::none) report = pair_problem(scan, zn, zo);
  const row_setup setup = make_setup(scan);
  // Uniform across the block: every thread holds the same report and scan.
  if (with_floor) check_feasible(eval, setup, eval.old_log_sum(), eps, report);
  // A row with mask 0 adds nothing: an infinite KL(p̃‖π*) there is no problem (padding).
  if (report.error == cuda_row_error::none && alpha > 0.0 && mask_of(in, r) != 0.0 && setup.new_only)
    report.error = cuda_row_error::regression_inf;
  return report;
}

/// KL(p̃ ‖ π) = Σ_j p̃_j (log p̃_j − log π_j) by the whole block, +inf where p̃ has mass π lacks
/// (cpu::kl_logits_to_log_probs).
template <class T>
__device__ double block_kl_to_log_probs(const T* zn, double log_norm_new, const T* log_pi,
                                        std::size_t size, reduce_storage<double_pair>& storage) {
  double_pair local;  // first: the finite sum, second: entries where π_j = 0 < p̃_j
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
    const double lp_new = static_cast<double>(zn[i]) - log_norm_new;
    if (!(lp_new > neg_inf())) continue;
    const double lp = static_cast<double>(log_pi[i]);
    if (!(lp > neg_inf())) {
      local.second += 1.0;
      continue;
    }
    local.first += ::exp(lp_new) * (lp_new - lp);
  }
  const double_pair total = block_all_reduce(storage, local, add_pair{});
  return total.second > 0.0 ? inf() : maximum(total.first, 0.0);
}

/// Rows of `range`: TROLL's forward (troll::objective_forward). Writes log π*, stats, the row's
/// record and token_loss[r] (when not null). With checks.validate_only only the reports.
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    troll_forward_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                         token_batch<T> in, double eps, double alpha, projection_options options,
                         batch_view<T> log_probs, projection_stats* stats, T* token_loss,
                         objective_row_record* records, row_range range, device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  __shared__ reduce_storage<double_pair> kl_storage;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    T* out = log_probs.row(r);
    const row_setup setup = make_setup(scan);
    const block_tilt_evaluator<T> eval{zn,          zo, size, setup.old_max, old_log_sum(scan),
                                       &lse_storage};
    cuda_row_report report =
        objective_row_problem(in, r, size, zn, zo, scan, eval, eps, alpha, checks.validate_only);
    if (checks.validate_only) {
      if (threadIdx.x == 0) record_row(checks, range, r, report);
      return;
    }
    const solve_result result =
        solve_and_write_row(eval, setup, scan, eps, options, report, checks, range, r, out, stats);
    if (report.error != cuda_row_error::none) {
      if (threadIdx.x == 0) {
        records[r] = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, 0.0};
        if (token_loss != nullptr) token_loss[r] = static_cast<T>(quiet_nan());
      }
      return;
    }
    const projection_stats s = make_stats(result);
    const double w = mask_of(in, r);
    objective_row_record record;
    if (w != 0.0) {
      __syncthreads();  // out[a] is written by some other thread of the block
      const std::int64_t a = in.tokens[r];
      const double log_q_a = (static_cast<double>(zo[a]) - scan.old.lse.m) - old_log_sum(scan);
      record.ratio = ratio_from_logs(static_cast<double>(out[a]), log_q_a);
      // An inactive row is log_softmax(z̃): KL(p̃‖π*) = 0 exactly, as on the CPU.
      if (s.status != row_status::inactive)
        record.kl_reg = block_kl_to_log_probs(zn, scan.fresh.lse.log_sum(), out, size, kl_storage);
      record.loss = troll_token_loss(record.ratio, static_cast<double>(in.advantages[r]), alpha,
                                     alpha != 0.0 ? record.kl_reg : 0.0);
      const int overflow = forward_overflow<T>(record.ratio, record.loss);
      if (overflow >= 0) {  // uniform across the block; log π* and the stats stand
        if (threadIdx.x == 0)
          record_row(checks, range, r, overflow_report(overflow, static_cast<double>(out[a]) - log_q_a, a));
        record = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, 0.0};
      }
    }
    if (threadIdx.x == 0) {
      stats[r] = s;
      records[r] = record;
      if (token_loss != nullptr) token_loss[r] = static_cast<T>(record.loss);
    }
  });
}

/// The per-thread sums of the aggregation kernels, merged in a fixed order.
struct objective_sums {
  double loss = 0.0;        // Σ w ℓ (token mean) or Σ_s (Σ w ℓ / Σ w) (sequence mean)
  double normaliser = 0.0;  // Σ w (token mean) or S (sequence mean)
  double tokens = 0.0, projected = 0.0, limited = 0.0;
  metric_sum ratio, kl_before, kl_after, reg, eta, divergence;  // means that must not overflow
  double kl_before_max = 0.0, kl_after_max = 0.0;
};
struct merge_objective_sums {
  __device__ objective_sums operator()(const objective_sums& a, const objective_sums& b) const {
    objective_sums s;
    s.loss = a.loss + b.loss;
    s.normaliser = a.normaliser + b.normaliser;
    s.tokens = a.tokens + b.tokens;
    (s.ratio = a.ratio) += b.ratio;
    (s.kl_before = a.kl_before) += b.kl_before;
    (s.kl_after = a.kl_after) += b.kl_after;
    (s.reg = a.reg) += b.reg;
    (s.eta = a.eta) += b.eta;
    s.projected = a.projected + b.projected;
    s.limited = a.limited + b.limited;
    (s.divergence = a.divergence) += b.divergence;
    s.kl_before_max = maximum(a.kl_before_max, b.kl_before_max);
    s.kl_after_max = maximum(a.kl_after_max, b.kl_after_max);
    return s;
  }
};

/// True when row r opens a sequence.
template <class T>
__device__ inline bool opens_sequence(const token_batch<T>& in, std::size_t r) {
  return r == 0 || in.sequence_ids[r] != in.sequence_ids[r - 1];
}

/// The sums of the normaliser over the rows a thread owns: every row for the token mean, the
/// sequences it opens for the sequence mean (each walked to its end, so each thread's work is
/// its sequences' length). `per_row(r, w)` sees every counted row (mask ≠ 0, a bad mask
/// included) with w its mask times `scale`, the token mean's mask_scale (block_mask_scale);
/// `per_sequence(begin, end, total, s)` every counted sequence, with s its own mask_scale and
/// total = Σ s·w. The normalisers take a bad mask (NaN, negative, +inf: a rejected row) as 0
/// (counted_weight), as the weights do.
template <class T, class PerRow, class PerSequence>
__device__ void for_owned_rows(const token_batch<T>& in, std::size_t rows, double scale, objective_sums& sums,
                               const PerRow& per_row, const PerSequence& per_sequence) {
  for (std::size_t r = threadIdx.x; r < rows; r += block_threads) {
    const double w = mask_of(in, r);
    if (w != 0.0) per_row(r, scale * w);
    if (in.aggregation == loss_aggregation::token_mean) {
      sums.normaliser += scale * counted_weight(w);
      continue;
    }
    if (!opens_sequence(in, r)) continue;
    std::size_t stop = r;
    double largest = 0.0;
    while (stop < rows && in.sequence_ids[stop] == in.sequence_ids[r])
      largest = maximum(largest, counted_weight(mask_of(in, stop++)));
    const double s = mask_scale(largest);
    double total = 0.0;
    for (std::size_t i = r; i < stop; ++i) total += s * counted_weight(mask_of(in, i));
    if (!(total > 0.0)) continue;
    sums.normaliser += 1.0;
    per_sequence(r, stop, total, s);
  }
}

/// The token mean's mask_scale: of the largest counted mask of the batch (1 for the sequence
/// mean, whose sequences take their own). Every thread of the block gets it.
template <class T>
__device__ double block_mask_scale(const token_batch<T>& in, std::size_t rows, reduce_storage<double>& storage) {
  if (in.aggregation != loss_aggregation::token_mean || in.loss_mask == nullptr) return 1.0;
  double largest = 0.0;
  for (std::size_t r = threadIdx.x; r < rows; r += block_threads)
    largest = maximum(largest, counted_weight(mask_of(in, r)));
  return mask_scale(block_all_reduce(storage, largest, larger_of{}));
}

/// One block: the forward's loss and metrics from the row records and stats (objective_metrics,
/// token_batch::aggregation). `stats` null: a ratio objective (KL before = after = record.kl_reg).
template <class T>
__global__ void __launch_bounds__(block_threads)
    aggregate_kernel(token_batch<T> in, std::size_t rows, const projection_stats* stats,
                     const objective_row_record* records, objective_metrics* metrics) {
  __shared__ reduce_storage<objective_sums> storage;
  __shared__ reduce_storage<double> scale_storage;
  objective_sums local;
  const bool token_mean = in.aggregation == loss_aggregation::token_mean;
  for_owned_rows(
      in, rows, block_mask_scale(in, rows, scale_storage), local,
      [&](std::size_t r, double w) {
        const objective_row_record& x = records[r];
        local.tokens += 1.0;
        local.ratio.add(x.ratio);
        local.limited += x.limited;
        local.divergence.add(x.divergence);
        // A rejected row's record is NaN: it makes the loss NaN in both aggregations.
        if (token_mean || x.loss != x.loss) local.loss += w * x.loss;
        if (stats == nullptr) {
          local.kl_before.add(x.kl_reg);
          local.kl_after.add(x.kl_reg);
          local.kl_before_max = maximum(local.kl_before_max, x.kl_reg);
          local.kl_after_max = maximum(local.kl_after_max, x.kl_reg);
          return;
        }
        const projection_stats& s = stats[r];
        local.kl_before.add(s.kl_before);
        local.kl_after.add(s.kl_after);
        local.kl_before_max = maximum(local.kl_before_max, s.kl_before);
        local.kl_after_max = maximum(local.kl_after_max, s.kl_after);
        local.reg.add(x.kl_reg);
        const bool active = s.active();
        local.eta.add(active ? s.eta : 0.0);
        local.projected += active ? 1.0 : 0.0;
      },
      [&](std::size_t begin, std::size_t stop, double total, double scale) {
        double sum = 0.0;
        for (std::size_t r = begin; r < stop; ++r) {
          const double w = mask_of(in, r);
          if (w != 0.0) sum += scale * w * records[r].loss;
        }
        local.loss += sum / total;
      });
  const objective_sums total = block_all_reduce(storage, local, merge_objective_sums{});
  if (threadIdx.x != 0) return;
  objective_metrics m;
  // 0 for an empty batch; NaN when a counted row was rejected (total.loss is then NaN, also
  // where a bad mask left the normaliser 0).
  m.loss = total.normaliser == 0.0 ? total.loss : total.loss / total.normaliser;
  m.tokens = static_cast<std::size_t>(total.tokens);
  m.sequences = token_mean ? 0 : static_cast<std::size_t>(total.normaliser);
  if (m.tokens != 0) {
    const double n = total.tokens;
    m.ratio_mean = total.ratio.mean(n);
    m.kl_before_mean = total.kl_before.mean(n);
    m.kl_after_mean = total.kl_after.mean(n);
    m.regression_kl_mean = total.reg.mean(n);
    m.eta_mean = total.eta.mean(n);
    m.projected_fraction = total.projected / n;
    m.limited_fraction = total.limited / n;
    m.divergence_mean = total.divergence.mean(n);
  }
  m.kl_before_max = total.kl_before_max;
  m.kl_after_max = total.kl_after_max;
  *metrics = m;
}

/// One block: the backward's weights, records[r].weight = w_r (token mean) or w_r / Σ_{seq} w
/// (sequence mean, 0 in sequences of mask sum 0), and the normaliser (Σ w or S) in `header`; a
/// bad mask counts as 0 everywhere (counted_weight; its row's gradient is NaN by its report), so
/// the other rows' gradients are the CPU's for the batch with that row's mask 0.
template <class T>
__global__ void __launch_bounds__(block_threads)
    aggregation_weights_kernel(token_batch<T> in, std::size_t rows, objective_row_record* header,
                               objective_row_record* records) {
  __shared__ reduce_storage<objective_sums> storage;
  __shared__ reduce_storage<double> scale_storage;
  objective_sums local;
  const bool token_mean = in.aggregation == loss_aggregation::token_mean;
  const double scale = block_mask_scale(in, rows, scale_storage);
  for (std::size_t r = threadIdx.x; r < rows; r += block_threads)
    records[r].weight = token_mean ? scale * counted_weight(mask_of(in, r)) : 0.0;
  // A thread that opens a sequence writes the weights of rows other threads zeroed above.
  __syncthreads();
  for_owned_rows(
      in, rows, scale, local, [](std::size_t, double) {},
      [&](std::size_t begin, std::size_t stop, double total, double s) {
        for (std::size_t r = begin; r < stop; ++r)
          records[r].weight = s * counted_weight(mask_of(in, r)) / total;
      });
  const objective_sums total = block_all_reduce(storage, local, merge_objective_sums{});
  if (threadIdx.x == 0) header->weight = total.normaliser;
}

/// Enqueues aggregation_weights_kernel (one block) for `rows` rows: the weights to header + 1…,
/// the normaliser to header->weight. Every backward of a token objective starts with it.
template <class T>
void enqueue_aggregation_weights(const char* fn, cudaStream_t stream, const token_batch<T>& in, std::size_t rows,
                                 objective_row_record* header) {
  aggregation_weights_kernel<T><<<1, block_threads, 0, stream>>>(in, rows, header, header + 1);
  check_launch(fn);
}

/// troll_dominant_sums as a reduction operator (block and warp).
struct merge_troll_dominant {
  __device__ troll_dominant_sums operator()(const troll_dominant_sums& a, const troll_dominant_sums& b) const {
    return a + b;
  }
};

/// Rows of `range`: TROLL's fused backward (troll::objective_backward), c_r = grad_loss ·
/// weight_r / normaliser from aggregation_weights_kernel. Rejected rows get NaN gradients.
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    troll_backward_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                          token_batch<T> in, double eps, double alpha,
                          batch_view<const T> log_probs, const projection_stats* stats,
                          batch_view<T> grad_new, double grad_loss,
                          const objective_row_record* header, const objective_row_record* records,
                          row_range range, device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  __shared__ reduce_storage<double_pair> kl_storage;
  __shared__ reduce_storage<std::size_t> token_storage;
  __shared__ reduce_storage<centring_sums> centring_storage;
  __shared__ reduce_storage<troll_dominant_sums> dominant_storage;
  __shared__ reduce_storage<double> largest_storage;
  __shared__ two_point_storage pair_storage;
  __shared__ reference_storage ref_storage;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    const T* log_pi = log_probs.row(r);
    T* grad = grad_new.row(r);
    const block_tilt_evaluator<T> eval{zn,          zo, size, scan.old.lse.m, old_log_sum(scan),
                                       &lse_storage};
    // The floor in every mode (one evaluation, on rows whose new logits mask old mass only): an
    // infeasible row is reported `infeasible`, as the CPU throws it, not as its forward's stats.
    cuda_row_report report = objective_row_problem(in, r, size, zn, zo, scan, eval, eps, alpha, true);
    // Row by row, the CPU's order: the token data and logits, then log_probs, then the stats.
    const projection_stats s = stats[r];
    if (report.error == cuda_row_error::none) {  // block-uniform
      const std::size_t bad = block_first_bad_log_prob(log_pi, zn, zo, size, token_storage);
      if (bad != no_token) {
        report.error = cuda_row_error::bad_log_probs, report.token = bad;
        report.value = static_cast<double>(log_pi[bad]);
      }
    }
    if (report.error == cuda_row_error::none) report_unusable_stats(s, report);
    if (record_or_reject(checks, range, r, report, grad_new, size)) return;
    const double weight = backward_row_weight(grad_loss, *header, records[r]);
    if (weight == 0.0) {
      for (std::size_t i = threadIdx.x; i < size; i += block_threads) grad[i] = T(0);
      return;
    }
    const std::int64_t a = in.tokens[r];
    const double log_norm_new = scan.fresh.lse.log_sum();
    const double log_q_a = (static_cast<double>(zo[a]) - scan.old.lse.m) - old_log_sum(scan);
    const double ratio = ratio_from_logs(static_cast<double>(log_pi[a]), log_q_a);
    const bool with_reg = alpha != 0.0 && s.status != row_status::inactive;
    const double kl_reg =
        with_reg ? block_kl_to_log_probs(zn, log_norm_new, log_pi, size, kl_storage) : 0.0;
    const bool projected = s.status == row_status::projected;  // block-uniform
    // d − μ against a reference token on offset rows (centring_reference.hpp), else as given; the
    // re-centring on the other projected rows, as the CPU's troll_backward_prepare.
    const centring_reference ref = block_reference(zn, zo, log_pi, size, s, ref_storage);
    const double d_a = ref.difference(static_cast<double>(zn[a]), static_cast<double>(zo[a]));
    const double m =
        projected && !ref.offset ? block_centring(zn, zo, log_pi, size, ref, centring_storage) : 0.0;
    projection_stats shifted = s;
    shifted.mu = ref.mu;
    const troll_row_coefficients k =
        troll_coefficients(weight, static_cast<double>(in.advantages[r]), ratio,
                           with_reg ? alpha : 0.0, kl_reg, d_a, shifted, m);
    const int overflow = backward_overflow<T>(ratio, k.ratio_coef * k.t);
    if (overflow >= 0) {  // uniform across the block
      if (threadIdx.x == 0)
        record_row(checks, range, r, overflow_report(overflow, static_cast<double>(log_pi[a]) - log_q_a, a));
      fill_nan(grad, size);
      return;
    }
    // Each part's entry at its dominant token (π*'s for the ratio part, p̃'s for the regression
    // part) is minus the part's other entries, as on the CPU (troll_backward_write,
    // troll_dominant_sums): the parts sum to 0 and cancel there.
    troll_dominant_sums dominant;
    double largest = 0.0;  // the largest |entry|: an entry beyond the sampled token's may overflow T
    double largest_ratio = 0.0;  // the ratio part's (two_point_suspect)
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double lp = static_cast<double>(log_pi[i]);
      const double zn_i = static_cast<double>(zn[i]);
      const bool on_support = lp > neg_inf();
      const double centred = on_support && projected ? ref.centred(zn_i, static_cast<double>(zo[i])) - m : 0.0;
      const double lp_new = zn_i - log_norm_new;
      const troll_gradient_parts g =
          troll_gradient_split(k, std::int64_t(i) == a, on_support, lp_new > neg_inf(), lp, lp_new, centred);
      grad[i] = static_cast<T>(g.ratio + g.reg);
      largest = larger_of{}(largest, ::fabs(g.ratio + g.reg));
      largest_ratio = larger_of{}(largest_ratio, ::fabs(g.ratio));
      dominant.add(i, lp, with_reg ? lp_new : neg_inf(), g);
    }
    // every thread reaches this (no early return after the overflow check above); its barriers
    // also order the writes above before thread 0's overwrites below
    const troll_dominant_sums total = block_all_reduce(dominant_storage, dominant, merge_troll_dominant{});
    largest = block_all_reduce(largest_storage, largest, larger_of{});
    // The ratio part is the projection's VJP of ratio_coef·t·e_a: on a nearly two-point π* its
    // entries at the two heaviest tokens from the others' (troll/detail/two_point.hpp), as the CPU.
    two_point_values tp;
    heavy_pair h;
    if (projected && k.inv_sigma2 != 0.0) {  // block-uniform
      const two_point_frame f{k.ratio_coef * k.t, 1.0, k.centred_a * k.inv_sigma2, two_point_pi_ulps<T>()};
      tp = group_two_point(
          two_point_block{pair_storage}, size, f, largest_ratio, 1.0,
          [&](std::size_t j) { return static_cast<double>(log_pi[j]); },
          [&](std::size_t j, double& x, double& y) { x = static_cast<double>(zn[j]), y = static_cast<double>(zo[j]); },
          [&](std::size_t j) { return std::int64_t(j) == a ? 1.0 : 0.0; },
          [&](std::size_t j) { return ref.centred(static_cast<double>(zn[j]), static_cast<double>(zo[j])) - m; }, h);
    }
    if (threadIdx.x == 0) {
      if (total.ratio.found()) {
        const double value = total.at_ratio_top();
        largest = larger_of{}(largest, ::fabs(value));
        grad[total.ratio.top] = static_cast<T>(value);
      }
      if (total.reg.found()) {
        const double value = total.at_reg_top();
        largest = larger_of{}(largest, ::fabs(value));
        grad[total.reg.top] = static_cast<T>(value);
      }
      if (tp.take) {  // the regression part added as written (its rule's value at p̃'s dominant token)
        const auto reg_at = [&](std::size_t j) {
          return troll_regression_written(k, total, j, std::int64_t(j) == a, static_cast<double>(log_pi[j]),
                                          static_cast<double>(zn[j]) - log_norm_new);
        };
        const double v1 = tp.v1 + reg_at(h.first), v2 = tp.v2 + reg_at(h.second);
        largest = larger_of{}(largest, larger_of{}(::fabs(v1), ::fabs(v2)));
        grad[h.first] = static_cast<T>(v1), grad[h.second] = static_cast<T>(v2);
      }
      // The CPU's last guard (objective_backward): the row is reported after its pass, and its
      // gradient then holds unspecified values.
      if (!fits_in<T>(largest))
        record_row(checks, range, r,
                   overflow_report(overflow_operand<T>(overflow_quantity::gradient),
                                   static_cast<double>(log_pi[a]) - log_q_a, a));
    }
  });
}

// ---- The ratio baselines: PPO clip and DPPO, ℓ from r = p̃_a / q_a (no projection) ----

/// An order-preserving unsigned key of a double that is not NaN (−0 and +0 share one key, as
/// they compare equal on the CPU).
__device__ inline unsigned long long order_key(double x) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(x == 0.0 ? 0.0 : x));
  return (bits >> 63) != 0 ? ~bits : bits | (1ull << 63);
}

/// Shared memory of block_topk_sums.
struct topk_storage {
  unsigned int histogram[256];
  unsigned int warp_counts[block_threads / 32];
  unsigned long long threshold;  // the key of the K-th largest entry (or a lower bound of it)
  unsigned int wanted;           // entries still to take among those whose key starts as threshold
  int state;                     // a topk_selection
  unsigned long long tie_cut;    // with_ties: the largest index taken among key == threshold
  reduce_storage<topk_sums> sums;
};

/// How block_topk_sums chose the top-K set of a row.
enum topk_selection : int {
  topk_selecting = 0,
  topk_all = 1,        // at most K finite entries: all of them
  topk_at_least = 2,   // exactly the entries with key ≥ threshold
  topk_with_ties = 3,  // key > threshold, and the `wanted` lowest indices with key == threshold
};

struct add_topk_sums {
  __device__ topk_sums operator()(const topk_sums& a, const topk_sums& b) const {
    topk_sums s;
    s.abs_diff = a.abs_diff + b.abs_diff;
    s.plog = a.plog + b.plog;
    s.rest_p = a.rest_p + b.rest_p;
    s.rest_q = a.rest_q + b.rest_q;
    return s;
  }
};

/// DPPO's top-K sums (cpu::gather_topk_sums) by the whole block: the K largest old logits (ties
/// to the lower index, −inf never taken) are found by a radix select on order_key, 8 bits per
/// pass from the top, stopping as soon as the K-th entry's bin is taken whole (usually after two
/// or three passes over the row); exact ties at the K-th value are broken by index in one more
/// pass. log p_j = (z°_j − m_old) − ls_old, log q_j = (z̃_j − m_new) − ls_new; the entries not
/// taken feed the rests. Every thread returns the sums. Reached by all threads of the block.
template <class T>
__device__ topk_sums block_topk_sums(const T* zn, const T* zo, std::size_t size, double m_new,
                                     double ls_new, double m_old, double ls_old, int k,
                                     topk_storage& st) {
  if (threadIdx.x == 0) {
    st.threshold = 0;
    st.wanted = static_cast<unsigned int>(k);
    st.state = topk_selecting;
    st.tie_cut = 0;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += block_threads) st.histogram[b] = 0;
    __syncthreads();
    const unsigned long long high = shift == 56 ? 0ull : ~0ull << (shift + 8);
    const unsigned long long prefix = st.threshold;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double x = static_cast<double>(zo[i]);
      if (!(x > neg_inf())) continue;
      const unsigned long long key = order_key(x);
      if ((key & high) == prefix) atomicAdd(&st.histogram[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (shift == 56) {
        unsigned int finite = 0;
        for (int b = 0; b < 256; ++b) finite += st.histogram[b];
        if (finite <= st.wanted) st.state = topk_all;
      }
      if (st.state == topk_selecting) {
        // The bins above b hold fewer than `wanted` entries, bin b completes them.
        unsigned int above = 0;
        int b = 255;
        while (above + st.histogram[b] < st.wanted) above += st.histogram[b--];
        st.threshold = prefix | (static_cast<unsigned long long>(b) << shift);
        st.wanted -= above;
        if (st.histogram[b] == st.wanted) {
          st.state = topk_at_least;
        } else if (shift == 0) {
          st.state = topk_with_ties;
        }
      }
    }
    __syncthreads();
    if (st.state != topk_selecting) break;
  }
  const int state = st.state;
  const unsigned long long threshold = st.threshold;
  if (state == topk_with_ties) {  // the `wanted` lowest indices among key == threshold
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int wanted = st.wanted;
    unsigned int taken = 0;
    for (std::size_t base = 0; base < size; base += block_threads) {
      const std::size_t i = base + threadIdx.x;
      const double x = i < size ? static_cast<double>(zo[i]) : neg_inf();
      const bool tie = x > neg_inf() && order_key(x) == threshold;
      const unsigned int ballot = __ballot_sync(0xffffffffu, tie);
      if (lane == 0) st.warp_counts[warp] = static_cast<unsigned int>(__popc(ballot));
      __syncthreads();
      unsigned int before = static_cast<unsigned int>(__popc(ballot & ((1u << lane) - 1u)));
      unsigned int chunk = 0;
      for (unsigned int w = 0; w < block_threads / 32; ++w) {
        chunk += st.warp_counts[w];
        if (w < warp) before += st.warp_counts[w];
      }
      if (tie && taken + before + 1 == wanted) st.tie_cut = i;
      taken += chunk;
      __syncthreads();
      if (taken >= wanted) break;
    }
  }
  const unsigned long long tie_cut = st.tie_cut;
  topk_sums local;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
    const double x = static_cast<double>(zo[i]);
    const double log_p = (x - m_old) - ls_old, log_q = (static_cast<double>(zn[i]) - m_new) - ls_new;
    bool chosen = x > neg_inf() && state == topk_all;
    if (x > neg_inf() && !chosen) {
      const unsigned long long key = order_key(x);
      chosen = key > threshold ||
               (key == threshold && (state == topk_at_least || i <= tie_cut));
    }
    if (chosen) {
      local.add(log_p, log_q);
    } else {  // the rests, −inf entries of the old row included (topk_sums)
      local.add_rest(log_p, log_q);
    }
  }
  return block_all_reduce(st.sums, local, add_topk_sums{});
}

/// The checks of validate_objective without pair_scan: token data, then each side's values and
/// support (new side first, as the CPU).
template <class T>
__device__ cuda_row_report ratio_row_problem(const token_batch<T>& in, std::size_t r,
                                             std::size_t size, const T* zn, const T* zo,
                                             const pair_scan& scan) {
  cuda_row_report report = token_problem(in, r, size, zo);
  if (report.error != cuda_row_error::none) return report;
  const row_scan* sides[2] = {&scan.fresh, &scan.old};
  const T* rows[2] = {zn, zo};
  for (int side = 0; side < 2; ++side) {
    if (sides[side]->first_bad != no_token)
      return bad_value_report(side, sides[side]->first_bad,
                              static_cast<double>(rows[side][sides[side]->first_bad]));
    if (sides[side]->lse.empty()) {
      report.error = cuda_row_error::all_masked, report.operand = side;
      return report;
    }
  }
  return report;
}

/// cpu::refined_log_prob over the block: the log-probability of a token with p > 1/2
/// (refines_log_prob) recomputed as −log1p(Σ_{j≠a} e^{z_j − z_a}), so that DPPO's binary KL
/// reads 1 − π with its digits. `log_prob` is the same in every thread, so either the whole block
/// reduces or none of it. Reached by the whole block.
template <class T>
__device__ double block_refined_log_prob(const T* z, std::size_t size, std::int64_t a, double log_prob,
                                         reduce_storage<topk_sums>& storage) {
  if (!refines_log_prob(log_prob)) return log_prob;
  const double za = static_cast<double>(z[a]);
  topk_sums local{};
  for (std::size_t j = threadIdx.x; j < size; j += block_threads) {
    const double x = static_cast<double>(z[j]);
    if (static_cast<std::int64_t>(j) != a && x > neg_inf()) local.rest_p += ::exp(x - za);
  }
  return -::log1p(block_all_reduce(storage, local, add_topk_sums{}).rest_p);
}

/// The ratio r = p̃_a / q_a, the surrogate at the sampled token of a scanned row and DPPO's
/// divergence (cpu::ratio_forward_row). Reached by the whole block (top-K divergences reduce).
template <class T>
__device__ surrogate_token ratio_row_token(const T* zn, const T* zo, std::size_t size,
                                           const pair_scan& scan, std::int64_t a, double advantage,
                                           const ratio_objective_spec& spec, topk_storage& topk,
                                           double& ratio, double& divergence) {
  const double ls_new = ::log(scan.fresh.lse.s0), ls_old = old_log_sum(scan);
  const double log_p_a = (static_cast<double>(zn[a]) - scan.fresh.lse.m) - ls_new;
  const double log_q_a = (static_cast<double>(zo[a]) - scan.old.lse.m) - ls_old;
  ratio = ratio_from_logs(log_p_a, log_q_a);
  const topk_sums sums = spec.needs_top_k()
                             ? block_topk_sums(zn, zo, size, scan.fresh.lse.m, ls_new,
                                               scan.old.lse.m, ls_old, spec.top_k, topk)
                             : topk_sums{};
  if (spec.which == ratio_objective_spec::kind::dppo_binary_kl) {  // uniform across the block
    const double refined_p = block_refined_log_prob(zn, size, a, log_p_a, topk.sums);
    const double refined_q = block_refined_log_prob(zo, size, a, log_q_a, topk.sums);
    return ratio_token(spec, ratio, advantage, refined_p, refined_q, sums, divergence);
  }
  return ratio_token(spec, ratio, advantage, log_p_a, log_q_a, sums, divergence);
}

/// Rows of `range`: the forward of PPO clip or DPPO (`spec`) — the row's record and
/// token_loss[r] (when not null).
template <class T>
__global__ void __launch_bounds__(block_threads)
    ratio_forward_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                         token_batch<T> in, ratio_objective_spec spec, T* token_loss,
                         objective_row_record* records, row_range range, device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  __shared__ topk_storage topk;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    const cuda_row_report report = ratio_row_problem(in, r, size, zn, zo, scan);
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) return;
    objective_row_record record;
    const double w = mask_of(in, r);
    if (report.error != cuda_row_error::none) {
      record = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, quiet_nan()};
    } else if (w != 0.0) {
      const surrogate_token token =
          ratio_row_token(zn, zo, size, scan, in.tokens[r], static_cast<double>(in.advantages[r]),
                          spec, topk, record.ratio, record.divergence);
      record.loss = token.loss;
      record.limited = token.limited ? 1.0 : 0.0;
      const int overflow = forward_overflow<T>(record.ratio, record.loss);
      if (overflow >= 0) {  // uniform across the block
        if (threadIdx.x == 0) record_row(checks, range, r, overflow_report(overflow, ::log(record.ratio), in.tokens[r]));
        record = objective_row_record{quiet_nan(), quiet_nan(), quiet_nan(), 0.0, 0.0, quiet_nan()};
      }
      if (spec.compute_kl) {  // KL(p̃ ‖ q) as kl_kernel: +inf where p̃ has mass q lacks
        if (scan.new_only) {
          record.kl_reg = inf();
        } else {
          const block_tilt_evaluator<T> eval{
              zn, zo, size, scan.old.lse.m, old_log_sum(scan), &lse_storage};
          record.kl_reg = evaluate_at_one(eval, make_setup(scan), old_log_sum(scan)).kl;
        }
      }
    }
    if (threadIdx.x == 0) {
      records[r] = record;
      if (token_loss != nullptr) token_loss[r] = static_cast<T>(record.loss);
    }
  });
}

/// Rows of `range`: the backward of PPO clip or DPPO, ∂(cℓ)/∂z̃_j = c·(∂ℓ/∂r)·r·(δ_ja − p̃_j)
/// with c from aggregation_weights_kernel (DPPO's mask held constant). Rejected rows get NaN
/// gradients.
template <class T>
__global__ void __launch_bounds__(block_threads)
    ratio_backward_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                          token_batch<T> in, ratio_objective_spec spec, batch_view<T> grad_new,
                          double grad_loss, const objective_row_record* header,
                          const objective_row_record* records, row_range range,
                          device_checks checks) {
  __shared__ topk_storage topk;
  __shared__ reduce_storage<double_pair> others_storage;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    T* grad = grad_new.row(r);
    const cuda_row_report report = ratio_row_problem(in, r, size, zn, zo, scan);
    if (record_or_reject(checks, range, r, report, grad_new, size)) return;
    const double weight = backward_row_weight(grad_loss, *header, records[r]);
    double coef = 0.0, ratio = 0.0;
    std::int64_t a = -1;
    if (weight != 0.0) {  // uniform across the block
      a = in.tokens[r];
      double divergence = 0.0;
      const surrogate_token token =
          ratio_row_token(zn, zo, size, scan, a, static_cast<double>(in.advantages[r]), spec, topk,
                          ratio, divergence);
      coef = weight * token.dloss_dr * ratio;
      const int overflow = backward_overflow<T>(ratio, coef);
      if (overflow >= 0) {
        if (threadIdx.x == 0) record_row(checks, range, r, overflow_report(overflow, ::log(ratio), a));
        fill_nan(grad, size);
        return;
      }
    }
    const double log_norm_new = scan.fresh.lse.log_sum();
    // p̃_a and Σ_{j≠a} p̃_j for the sampled token's entry (ratio_sampled_entry); coef is uniform
    // across the block, so every thread reaches the reduction or none does.
    double_pair sampled;  // (Σ_{j≠a} p̃_j, p̃_a)
    if (coef != 0.0) {
      double_pair local;
      for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
        const double p = ::exp(static_cast<double>(zn[i]) - log_norm_new);
        (std::int64_t(i) == a ? local.second : local.first) += p;
      }
      sampled = block_all_reduce(others_storage, local, add_pair{});
    }
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double p = coef != 0.0 ? ::exp(static_cast<double>(zn[i]) - log_norm_new) : 0.0;
      grad[i] = static_cast<T>(coef == 0.0                ? 0.0
                               : std::int64_t(i) == a ? ratio_sampled_entry(coef, sampled.second, sampled.first)
                                                      : -coef * p);
    }
  });
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
