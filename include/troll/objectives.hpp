// troll/objectives.hpp — training objectives over a batch of sampled tokens (math.md §5): TROLL's
// trust-region objective with its fused backward, and the baselines it replaces, PPO clip and
// DPPO. Every objective is returned as a loss (−objective, to be minimised), aggregated over the
// batch by token mean or sequence mean, with per-batch metrics.
//
//   TROLL      ℓ = −(π*_a / q_a)·A + α·KL(p̃ ‖ stopgrad(π*)),   π* = project(p̃, q, ε)
//   PPO clip   ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)  [dual clip: −max(·, c·A), A < 0]
//   DPPO       ℓ = −M·r·A,  M = 0 when the divergence of the update exceeds δ in the direction
//              the advantage pushes it (binary TV / binary KL / top-K TV / top-K KL)
//
// with r = p̃_a / q_a, p̃ = softmax(new logits), q = softmax(old logits), a the sampled token.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "backward.hpp"
#include "batch.hpp"
#include "config.hpp"
#include "detail/cpu/objective_kernels.hpp"
#include "detail/cpu/objective_scratch.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_fingerprint.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "detail/objective_arguments.hpp"
#include "detail/objective_row.hpp"
#include "detail/row_problem.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "objective_types.hpp"
#include "projection_types.hpp"
#include "detail/cpu/objective_checks.hpp"

TROLL_BEGIN_NAMESPACE

// ---- TROLL ----

/// Forward of TROLL's objective. Projects every row (log π* to `log_probs`, statistics to
/// `stats`, N entries — both kept for objective_backward), evaluates the per-token losses
///   ℓ_r = −(π*_{r,a} / q_{r,a}) A_r + α KL(p̃_r ‖ π*_r),
/// aggregates them (token_batch::aggregation) and returns the loss with the batch metrics.
/// `token_loss` (optional, N entries) receives ℓ_r (0 on rows with mask 0).
/// Throws before writing anything: shape_error, domain_error (NaN / +inf logits, a token outside
/// [0, V), a non-finite advantage, a negative or non-finite mask, decreasing sequence ids, a
/// sampled token the old logits mask, a row whose new logits have mass where the old ones mask
/// while α > 0, bad ε / α / options) and infeasible_error, each naming the row.
template <class T>
objective_metrics objective_forward(cpu_policy policy, const trust_region_objective& objective,
                                    input_view<T> new_logits, input_view<T> old_logits,
                                    const token_batch<T>& in, batch_view<T> log_probs,
                                    projection_stats* stats,
                                    typename detail::identity<T>::type* token_loss = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::check_troll_forward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::troll_forward_scratch<T>> scratch(fn, policy.workspace, rows,
                                                                                    size);
  detail::validate_objective(fn, policy.threads, new_logits, old_logits, in, true, objective.eps,
                             objective.alpha > 0.0);
  const detail::cpu::troll_forward_scratch<T>& ws = scratch.parts;
  // A counted token far in the old row's tail (−log q_a ≤ max z° − z°_a + log V), or whose
  // regression term α·KL(p̃‖π*) might not fit T (a huge α or huge logits), is projected once into
  // the scratch row first (one such row at a time, in row order), so that a ratio or loss that
  // overflows is reported before anything is written.
  detail::cpu::parallel_for(policy.threads, rows, 2 * size, [&](std::size_t r) {
    ws.flags[r] = 0;
    if (detail::mask_of(in, r) == 0.0) return;
    const T* zo = old_logits.row(r);
    detail::cpu::pair_extent e;
    if (objective.alpha > 0.0)
      e = detail::cpu::pair_extents(new_logits.row(r), zo, size);
    else
      e.old_max = detail::cpu::row_max(zo, size);
    const double bound = e.old_max - static_cast<double>(zo[in.tokens[r]]) + std::log(double(size));
    ws.flags[r] = detail::ratio_may_overflow<T>(bound, static_cast<double>(in.advantages[r])) ||
                  detail::regression_may_overflow<T>(objective.alpha, e.difference_range);
  });
  for (std::size_t r = 0; r < rows; ++r) {
    if (!ws.flags[r]) continue;
    const std::int64_t a = in.tokens[r];
    const detail::cpu::troll_row_result x = detail::cpu::troll_forward_row(
        new_logits.row(r), old_logits.row(r), size, objective.eps, objective.projection, true, a,
        static_cast<double>(in.advantages[r]), objective.alpha, ws.extra);
    const detail::row_problem p = detail::check_token_result<T>(x.ratio, x.log_ratio, x.loss, 1.0, a);
    if (p) detail::throw_row_problem(fn, r, p);
  }

  detail::metrics_sum sum;
  detail::aggregation_weights(in, rows, 1.0, &sum.m.sequences, ws.weights);
  detail::cpu::parallel_for(policy.threads, rows, 12 * size, [&](std::size_t r) {
    const double w = detail::mask_of(in, r);
    const bool counted = w != 0.0;
    ws.records[r] = detail::cpu::troll_forward_row(
        new_logits.row(r), old_logits.row(r), size, objective.eps, objective.projection, counted,
        counted ? in.tokens[r] : 0, counted ? static_cast<double>(in.advantages[r]) : 0.0,
        objective.alpha, log_probs.row(r));
    stats[r] = ws.records[r].stats;
    stats[r].row_fingerprint = detail::cpu::dense_row_fingerprint(new_logits.row(r), old_logits.row(r), size);
  });
  return detail::finish_troll_forward(in, rows, ws.weights, ws.records, token_loss, sum,
                                      [&](std::size_t r, const detail::row_problem& p) {
                                        detail::throw_row_problem(fn, r, p);
                                      });
}

/// The same forward with the result written to `*metrics` (host memory): the argument list of the
/// CUDA overload, so one call serves both policies. Throws shape_error for a null `metrics`.
template <class T>
void objective_forward(cpu_policy policy, const trust_region_objective& objective, input_view<T> new_logits,
                       input_view<T> old_logits, const token_batch<T>& in, batch_view<T> log_probs,
                       projection_stats* stats, typename detail::identity<T>::type* token_loss,
                       objective_metrics* metrics) {
  if (metrics == nullptr) detail::throw_shape("objective_forward", "metrics is a null pointer");
  *metrics = objective_forward(policy, objective, new_logits, old_logits, in, log_probs, stats, token_loss);
}

/// Fused backward of TROLL's objective: grad_new = grad_loss · ∂L/∂z̃ for the loss L of
/// objective_forward, through the projection's VJP (ratio term) and the regression term's
/// gradient w.r.t. p̃ only (π* held constant), in one pass per row:
///   ∂ℓ/∂z̃_j = −ρA·t [δ_ja − π*_j − π*_j (d_j − μ)(d_a − μ)/σ²] + α p̃_j (log p̃_j − log π*_j − KL(p̃‖π*)).
/// `log_probs` and `stats` are objective_forward's outputs for the same inputs. Rows with mask 0
/// get zero gradients. Throws as objective_forward does, and domain_error for log_probs NaN, +inf,
/// above 0 or finite where a logit is −inf, unusable stats or a non-finite grad_loss, before
/// writing.
template <class T>
void objective_backward(cpu_policy policy, const trust_region_objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                        input_view<T> log_probs, const projection_stats* stats,
                        batch_view<T> grad_new, double grad_loss = 1.0) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::check_troll_backward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats,
                                            grad_new, grad_loss);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::troll_backward_scratch> scratch(fn, policy.workspace, rows, rows);
  // Row by row: the token data and logits (as the forward), then log_probs, then the stats.
  detail::validate_objective(fn, policy.threads, new_logits, old_logits, in, true, objective.eps,
                             objective.alpha > 0.0, [&](std::size_t r) {
                               const detail::row_problem p = detail::find_bad_log_prob(
                                   log_probs.row(r), new_logits.row(r), old_logits.row(r), log_probs.cols, "log_probs");
                               return p ? p : detail::check_stats_for(stats[r], [&] {
                                 return detail::cpu::dense_row_fingerprint(new_logits.row(r), old_logits.row(r), size);
                               });
                             });
  const double* c = scratch.parts.weights;
  detail::cpu::troll_backward_plan* plans = scratch.parts.records;
  detail::row_problem* problems = scratch.parts.extra;
  unsigned char* overflowed = scratch.parts.flags;
  detail::aggregation_weights(in, rows, grad_loss, nullptr, scratch.parts.weights);
  // Every row's coefficients first, so that a ratio term that overflows T (the sampled token's
  // entry is about c·A·ρ·t) is reported before anything is written.
  detail::cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    if (c[r] == 0.0) return;
    const std::int64_t token = in.tokens[r];
    plans[r] = detail::cpu::troll_backward_prepare(
        new_logits.row(r), old_logits.row(r), log_probs.row(r), size, stats[r], c[r], token,
        static_cast<double>(in.advantages[r]), objective.alpha);
    problems[r] = detail::check_token_gradient<T>(plans[r].ratio, plans[r].log_ratio, plans[r].ratio_scale(), token);
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (problems[r]) detail::throw_row_problem(fn, r, problems[r]);
  // A last guard: an entry beyond the sampled token's that overflows (a huge regression term or
  // cross term) is reported after the pass; grad_new then holds unspecified values.
  detail::cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    const bool counted = c[r] != 0.0;
    overflowed[r] = !detail::cpu::troll_backward_write(new_logits.row(r), old_logits.row(r),
                                                       log_probs.row(r), size,
                                                       counted ? &plans[r] : nullptr,
                                                       counted ? in.tokens[r] : 0, grad_new.row(r));
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (overflowed[r])
      detail::throw_row_problem(
          fn, r, detail::overflow_problem(detail::overflow_operand<T>(detail::overflow_quantity::gradient),
                                   plans[r].log_ratio, in.tokens[r]));
}

// ---- Baselines: PPO clip and DPPO (no projection; the ratio is p̃_a / q_a) ----

/// Forward of a ratio baseline, PPO clip or DPPO (see ppo_clip_objective, dppo_objective; no
/// projection, the ratio is p̃_a / q_a): returns the aggregated loss and the metrics
/// (limited_fraction = clipped (PPO) or masked (DPPO) tokens; divergence_mean = DPPO's mean
/// divergence estimate). `token_loss` (optional, N entries) receives ℓ_r. Throws as
/// objective_forward does (no projection checks), before writing.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
objective_metrics objective_forward(cpu_policy policy, const Objective& objective,
                                    input_view<T> new_logits, input_view<T> old_logits,
                                    const token_batch<T>& in,
                                    typename detail::identity<T>::type* token_loss = nullptr) {
  detail::require_float_type<T>();
  const auto spec = detail::make_spec("objective_forward", objective);
  return detail::ratio_forward("objective_forward", policy, spec, new_logits, old_logits, in, token_loss);
}

/// The same forward with the result written to `*metrics` (host memory), as the CUDA overload.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_forward(cpu_policy policy, const Objective& objective, input_view<T> new_logits,
                       input_view<T> old_logits, const token_batch<T>& in,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  if (metrics == nullptr) detail::throw_shape("objective_forward", "metrics is a null pointer");
  *metrics = objective_forward(policy, objective, new_logits, old_logits, in, token_loss);
}

/// Backward of a ratio baseline: grad_new = grad_loss · ∂L/∂z̃ with
/// ∂ℓ/∂z̃_j = (∂ℓ/∂r)·r·(δ_ja − p̃_j): PPO clip's ∂ℓ/∂r = −A on unclipped tokens and 0 on clipped
/// ones; DPPO's −M·A, the mask M held constant.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_backward(cpu_policy policy, const Objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                        batch_view<T> grad_new, double grad_loss = 1.0) {
  detail::require_float_type<T>();
  const auto spec = detail::make_spec("objective_backward", objective);
  detail::ratio_backward("objective_backward", policy, spec, new_logits, old_logits, in, grad_new,
                         grad_loss);
}

TROLL_END_NAMESPACE
