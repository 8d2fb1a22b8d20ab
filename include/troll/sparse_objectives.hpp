// troll/sparse_objectives.hpp — TROLL's objective on the sparse path that trainers run (math.md
// §4, §5): dense new logits (N × V) against sparse old rows (top-K + remainder bucket, as stored
// from the rollout policy). Per row, in one fused pass each way:
//
//   forward   U = top-K(z̃) ∪ S_old → gather exact log p̃ on U and the exact tail mass over V∖U
//             → project the |U|+1 lumped categories → ℓ = −(π*_a / q_a)·A + α·KL(p̃ ‖ stopgrad(π*))
//   backward  ∂ℓ/∂(lumped log p̃) (objective_row.hpp, as on dense rows) → the §4 scatter to every
//             dense logit: ∂ℓ/∂z̃_k = [k∈U] g_k + [k∉U] g_R p̃_k/r̃ − p̃_k (Σ_U g_i + g_R)
//
// Same batch inputs (token_batch), aggregation and metrics as the dense objective (objectives.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "batch.hpp"
#include "config.hpp"
#include "detail/cpu/objective_kernels.hpp"
#include "detail/cpu/objective_scratch.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_fingerprint.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "detail/cpu/sparse_kernels.hpp"
#include "detail/objective_arguments.hpp"
#include "detail/objective_row.hpp"
#include "detail/row_problem.hpp"
#include "detail/sparse_row.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "objectives.hpp"
#include "projection_types.hpp"
#include "sparse.hpp"
#include "sparse_objective_types.hpp"
#include "detail/cpu/sparse_objective_checks.hpp"

#include "detail/cpu/eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE

/// Forward of TROLL's objective on sparse old rows. For each row r (V = new_logits.cols):
///   aligned row r  ← U = S_new ∪ S_old with log p̃ gathered exactly from new_logits and the old
///                    row aligned on U (see sparse_trust_region_objective, align)
///   log_probs row r ← log π* on U (same order) and its bucket: the projection of the |U|+1
///                    lumped categories (as sparse project), stats[r] its statistics
///   ℓ_r = −(π*_a / q_a)·A_r + α·KL(p̃ ‖ π*)  over the lumped categories, q_a the old row's
///                    probability of the sampled token a, which must be in S_old
/// aggregated as token_batch::aggregation says; returns the loss and the metrics of the dense
/// objective (KL before/after, projected fraction, mean η, ...; all on the lumped categories).
/// aligned, log_probs and stats are kept for objective_backward. `token_loss` (optional, N
/// entries) receives ℓ_r (0 on rows with mask 0). Capacity: aligned.k_max and log_probs.k_max ≥
/// min(V, |S_old,r| + new_support.k) for every row, at most 1024. Cost: three passes over each
/// new row (a check, the sparsify scan, the log-sums) and O(|U|) for the rest.
/// Throws before writing anything, naming the row: shape_error (shapes, null pointers, capacity,
/// bad sparse old rows), domain_error (as the dense objective for the token batch and the new
/// logits; a sampled token missing from S_old or with old log-prob −inf; new mass where the old
/// row has none while α > 0, on a row whose mask is not 0; bad ε / α / options), infeasible_error
/// (as project).
template <class T>
objective_metrics objective_forward(cpu_policy policy,
                                    const sparse_trust_region_objective& objective,
                                    input_view<T> new_logits, sparse_input<T> old_rows,
                                    const token_batch<T>& in, aligned_batch_view<T> aligned,
                                    sparse_batch_view<T> log_probs, projection_stats* stats,
                                    typename detail::identity<T>::type* token_loss = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::check_sparse_forward_arguments<T>(fn, objective, new_logits, old_rows, in, aligned,
                                            log_probs, stats);
  const std::size_t rows = new_logits.rows, vocab = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::sparse_forward_scratch> scratch(fn, policy.workspace, rows, 0);
  const int new_k = objective.new_support.k;
  const double log_delta =
      objective.new_support.delta > 0.0 ? std::log(objective.new_support.delta) : detail::neg_inf();
  const std::size_t capacity =
      std::min({aligned.k_max, log_probs.k_max, std::size_t(sparse_max_entries)});
  const bool regression = objective.alpha > 0.0;

  auto problem = [&](std::size_t r) -> detail::row_problem {
    detail::logit_scan scan;
    detail::row_problem p = detail::check_token_and_logits(in, r, new_logits, scan);
    if (p) return p;
    detail::index_slot slots[sparse_max_entries];
    p = detail::check_sparse_row_of(old_rows, r, "old", slots);
    if (p) return p;
    const long long count = old_rows.count(r);
    const long long need = std::min<long long>(static_cast<long long>(vocab), count + new_k);
    if (need > static_cast<long long>(capacity))
      return detail::make_problem(row_error::objective_capacity, "", 0, double(need),
                                  double(std::min(aligned.k_max, log_probs.k_max)));
    const T* old_lp = old_rows.row_log_probs(r);
    bool may_overflow = false;
    // A row with mask 0 adds nothing: an infinite KL(p̃‖π*) there is no problem (padding).
    const bool counted = detail::mask_of(in, r) != 0.0;
    if (counted) {
      const std::int64_t a = in.tokens[r];
      long long at = -1;
      for (long long i = 0; i < count; ++i)
        if (old_rows.row_indices(r)[i] == a) at = i;
      if (at < 0) return detail::make_problem(row_error::not_in_support, "", 0, double(a));
      if (detail::is_masked(static_cast<double>(old_lp[at])))
        return detail::make_problem(row_error::old_entry_masked, "", 0, double(a));
      // A token far in the old row's tail: its ratio and loss, from a projection into scratch
      // memory (below), must fit before anything is written.
      may_overflow = detail::ratio_may_overflow<T>(-static_cast<double>(old_lp[at]),
                                                   static_cast<double>(in.advantages[r]));
      if (regression && !may_overflow) {
        // KL(p̃‖π*) ≤ the range of d over the lumped categories (cpu::pair_extents): the new
        // side's log-probs span at most the finite logits' range + log V (the bucket's sum), the
        // old side's its own finite entries.
        double old_high = detail::neg_inf(), old_low = detail::inf();
        for (long long i = 0; i <= count; ++i) {
          const double x = static_cast<double>(i < count ? old_lp[i] : old_rows.log_remainder[r]);
          if (x > detail::neg_inf()) old_high = detail::maximum(old_high, x), old_low = detail::minimum(old_low, x);
        }
        const double bound = (scan.highest - scan.lowest) + std::log(double(vocab)) + (old_high - old_low);
        may_overflow = detail::regression_may_overflow<T>(objective.alpha, bound);
      }
    }
    // Every lumped category is finite on both sides unless something is −inf: then the rows the
    // projection will see are built (without writing) and checked as project checks them.
    bool old_masked = detail::is_masked(static_cast<double>(old_rows.log_remainder[r])) &&
                      count < static_cast<long long>(vocab);
    for (long long i = 0; i < count && !old_masked; ++i)
      old_masked = detail::is_masked(static_cast<double>(old_lp[i]));
    if (scan.any_masked || old_masked || may_overflow) {
      detail::aligned_row_buffer<T> buffer;
      const aligned_batch_view<const T> one = buffer.view(vocab);
      detail::gather_aligned_row(new_logits.row(r), vocab, old_rows, r, new_k, log_delta, buffer.view(vocab), 0);
      const detail::row_problem lumped = detail::check_lumped(one, 0, detail::lumped_checks{objective.eps, false, regression && counted});
      if (lumped) return lumped;
      if (may_overflow) {
        double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1], lp[sparse_max_entries + 1];
        int slot[sparse_max_entries + 1];
        const int n = detail::lumped_pair(one, 0, zn, zo, slot);
        const detail::cpu::troll_row_result x = detail::cpu::troll_forward_row(
            zn, zo, std::size_t(n), objective.eps, objective.projection, true,
            detail::lumped_category_of(one, 0, slot, n, in.tokens[r]), static_cast<double>(in.advantages[r]),
            objective.alpha, lp);
        const detail::row_problem overflow =
            detail::check_token_result<T>(x.ratio, x.log_ratio, x.loss, 1.0, in.tokens[r]);
        if (overflow) return overflow;
      }
    }
    return detail::row_problem{};
  };
  detail::cpu::throw_first_problem(fn, policy.threads, rows, 2 * vocab, problem, &detail::throw_row_problem);

  detail::cpu::troll_row_result* results = scratch.parts.records;
  detail::metrics_sum sum;
  detail::aggregation_weights(in, rows, 1.0, &sum.m.sequences, scratch.parts.weights);
  const aligned_batch_view<const T> aligned_in = aligned;
  detail::cpu::parallel_for(policy.threads, rows, 6 * vocab, [&](std::size_t r) {
    const bool counted = detail::mask_of(in, r) != 0.0;
    detail::gather_aligned_row(new_logits.row(r), vocab, old_rows, r, new_k, log_delta, aligned, r);
    double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1], lp[sparse_max_entries + 1];
    int slot[sparse_max_entries + 1];
    const int n = detail::lumped_pair(aligned_in, r, zn, zo, slot);
    const int token =
        counted ? detail::lumped_category_of(aligned_in, r, slot, n, in.tokens[r]) : 0;
    results[r] = detail::cpu::troll_forward_row(
        zn, zo, std::size_t(n), objective.eps, objective.projection, counted, token,
        counted ? static_cast<double>(in.advantages[r]) : 0.0, objective.alpha, lp);
    stats[r] = results[r].stats;
    stats[r].row_fingerprint = detail::cpu::aligned_row_fingerprint(aligned_in, r);
    detail::write_lumped_row(aligned_in, r, slot, n, lp, log_probs);
  });
  return detail::finish_troll_forward(in, rows, scratch.parts.weights, results, token_loss, sum,
                                      [&](std::size_t r, const detail::row_problem& p) {
                                        detail::throw_row_problem(fn, r, p);
                                      });
}

/// The same forward with the result written to `*metrics` (host memory): the argument list of the
/// CUDA overload, so one call serves both policies. Throws shape_error for a null `metrics`.
template <class T>
void objective_forward(cpu_policy policy, const sparse_trust_region_objective& objective,
                       input_view<T> new_logits, sparse_input<T> old_rows, const token_batch<T>& in,
                       aligned_batch_view<T> aligned, sparse_batch_view<T> log_probs, projection_stats* stats,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  if (metrics == nullptr) detail::throw_shape("objective_forward", "metrics is a null pointer");
  *metrics = objective_forward(policy, objective, new_logits, old_rows, in, aligned, log_probs, stats, token_loss);
}

/// Fused backward of the sparse TROLL objective: grad_new (N × V) = grad_loss · ∂L/∂z̃ for the
/// loss L of objective_forward, from its outputs `aligned`, `log_probs` and `stats` (same inputs
/// otherwise; the old rows live on in `aligned`). Per row: the dense objective's gradient w.r.t.
/// the lumped new log-probs (ratio term through the projection's VJP, regression term w.r.t. p̃
/// with π* held constant), then the scatter of math.md §4 to every dense logit, O(V). Rows with
/// mask 0 get zero gradients. Throws before writing, naming the row: as objective_forward, plus
/// shape_error for log_probs rows that do not match the aligned support, domain_error for a
/// sampled token missing from U, unusable stats or a non-finite grad_loss.
template <class T>
void objective_backward(cpu_policy policy, const sparse_trust_region_objective& objective,
                        input_view<T> new_logits, aligned_input<T> aligned,
                        const token_batch<T>& in, sparse_input<T> log_probs,
                        const projection_stats* stats, batch_view<T> grad_new,
                        double grad_loss = 1.0) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::check_sparse_backward_arguments<T>(fn, objective, new_logits, aligned, in, log_probs,
                                             stats, grad_new, grad_loss);
  const std::size_t rows = new_logits.rows, vocab = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::sparse_backward_scratch> scratch(fn, policy.workspace, rows, 0);
  const bool regression = objective.alpha > 0.0;

  auto problem = [&](std::size_t r) -> detail::row_problem {
    detail::index_slot slots[sparse_max_entries];
    detail::row_problem p = detail::check_token_and_logits(in, r, new_logits);
    if (p) return p;
    p = detail::check_sparse_row_of(aligned.new_side(), r, "aligned (new side)", slots);
    if (!p) p = detail::check_sparse_row_of(aligned.old_side(), r, "aligned (old side)", slots);
    if (p) return p;
    // log_probs' own checks, its mass (the last of them) held back until after the support match:
    // log_probs of another forward (other ids, another count) is named as such (the device's order).
    p = detail::check_sparse_row_of(log_probs, r, "log_probs", slots);
    if (p && p.kind != row_error::sparse_mass) return p;
    const detail::row_problem log_probs_mass = p;
    const long long count = aligned.counts[r];
    if (log_probs.count(r) != count)
      return detail::make_problem(row_error::log_probs_mismatch, "", -1, double(log_probs.count(r)), double(count));
    for (long long i = 0; i < count; ++i) {
      const sparse_index index = log_probs.row_indices(r)[i];
      const sparse_index want = aligned.indices[r * aligned.k_max + std::size_t(i)];
      if (index != want) return detail::make_problem(row_error::log_probs_mismatch, "", i, double(index), double(want));
    }
    if (log_probs_mass) return log_probs_mass;
    if (detail::mask_of(in, r) != 0.0) {
      const std::int64_t a = in.tokens[r];
      long long at = -1;
      for (long long i = 0; i < count; ++i)
        if (aligned.indices[r * aligned.k_max + std::size_t(i)] == a) at = i;
      if (at < 0) return detail::make_problem(row_error::not_in_aligned, "", 0, double(a));
      if (detail::is_masked(static_cast<double>(aligned.old_log_probs[r * aligned.k_max + std::size_t(at)])))
        return detail::make_problem(row_error::old_entry_masked, "", 0, double(a));
    }
    // A row with mask 0 adds nothing: an infinite KL(p̃‖π*) there is no problem (padding).
    const bool counted = detail::mask_of(in, r) != 0.0;
    const detail::row_problem lumped = detail::check_lumped(aligned, r, detail::lumped_checks{0.0, false, regression && counted});
    if (lumped) return lumped;
    return detail::check_stats_for(stats[r], [&] { return detail::cpu::aligned_row_fingerprint(aligned, r); });
  };
  detail::cpu::throw_first_problem(fn, policy.threads, rows, vocab, problem, &detail::throw_row_problem);

  const double* c = scratch.parts.weights;
  detail::row_problem* problems = scratch.parts.records;
  unsigned char* overflowed = scratch.parts.flags;
  detail::aggregation_weights(in, rows, grad_loss, nullptr, scratch.parts.weights);
  // One row's lumped pair (new, old and π* over the categories of U and the remainder).
  struct lumped_row {
    double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1], lpi[sparse_max_entries + 1];
    int slot[sparse_max_entries + 1];
    int n = 0, count = 0, token = 0;
  };
  auto lump = [&](std::size_t r, lumped_row& row) {
    row.n = detail::lumped_pair(aligned, r, row.zn, row.zo, row.slot);
    row.count = static_cast<int>(aligned.counts[r]);
    for (int j = 0; j < row.n; ++j)
      row.lpi[j] = double(row.slot[j] == row.count ? log_probs.log_remainder[r]
                                                   : log_probs.row_log_probs(r)[row.slot[j]]);
    row.token = detail::lumped_category_of(aligned, r, row.slot, row.n, in.tokens[r]);
  };
  // Every row's ratio term first (O(|U|) each), so that a gradient that overflows T is
  // reported before anything is written.
  detail::cpu::parallel_for(policy.threads, rows, 64, [&](std::size_t r) {
    if (c[r] == 0.0) return;
    lumped_row row;
    lump(r, row);
    const detail::cpu::troll_backward_plan plan = detail::cpu::troll_backward_prepare(
        row.zn, row.zo, row.lpi, std::size_t(row.n), stats[r], c[r], row.token,
        static_cast<double>(in.advantages[r]), objective.alpha);
    problems[r] = detail::check_token_gradient<T>(plan.ratio, plan.log_ratio, plan.ratio_scale(), in.tokens[r]);
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (problems[r]) detail::throw_row_problem(fn, r, problems[r]);
  detail::cpu::parallel_for(policy.threads, rows, 4 * vocab, [&](std::size_t r) {
    T* out = grad_new.row(r);
    if (c[r] == 0.0) {
      for (std::size_t k = 0; k < vocab; ++k) out[k] = T(0);
      return;
    }
    lumped_row row;
    lump(r, row);
    double g[sparse_max_entries + 1];
    const int n = row.n, count = row.count;
    const int* slot = row.slot;
    bool fits = detail::cpu::troll_backward_row(row.zn, row.zo, row.lpi, std::size_t(n), stats[r], c[r],
                                                row.token, static_cast<double>(in.advantages[r]),
                                                objective.alpha, g, detail::two_point_pi_ulps<T>());
    for (int j = 0; j < n; ++j) fits = fits && detail::fits_in<T>(g[j]);
    overflowed[r] = !fits;
    // Upstream of the gather: g on U (0 on categories dropped as −inf on both sides) and g_R.
    T g_support[sparse_max_entries];
    double g_remainder = 0.0;
    for (int i = 0; i < count; ++i) g_support[i] = T(0);
    for (int j = 0; j < n; ++j) {
      if (slot[j] == count) {
        g_remainder = g[j];
      } else {
        g_support[slot[j]] = T(g[j]);
      }
    }
    detail::index_slot sorted[sparse_max_entries];
    for (int i = 0; i < count; ++i)
      sorted[i] = detail::index_slot{aligned.indices[r * aligned.k_max + std::size_t(i)], i};
    detail::sort_by_index(sorted, count);
    if (!detail::cpu::sparsify_backward_row(new_logits.row(r), vocab, sorted, count, g_support,
                                            aligned.new_log_probs + r * aligned.k_max, g_remainder, out))
      overflowed[r] = 1;
  });
  // A last guard (an entry beyond the sampled token's overflows): grad_new is then unspecified.
  for (std::size_t r = 0; r < rows; ++r)
    if (overflowed[r])
      detail::throw_row_problem(fn, r,
                                detail::overflow_problem(detail::overflow_operand<T>(detail::overflow_quantity::gradient),
                                                         detail::quiet_nan(), in.tokens[r]));
}

TROLL_END_NAMESPACE

#include "detail/cpu/eigen_warnings_pop.inc"
