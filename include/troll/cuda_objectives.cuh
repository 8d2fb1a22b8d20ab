// troll/cuda_objectives.cuh — TROLL's training objective under the troll::cuda policy (nvcc only;
// reached through <troll/cuda.cuh>): objective_forward and objective_backward for TROLL, PPO
// clip and DPPO, with the CPU overloads' arguments (metrics to a device objective_metrics*).
// Tested on an NVIDIA H100 (2026-11-24): see docs/cuda.md.
//
//   std::size_t bytes = troll::workspace_bytes(troll::cuda, troll::op::objective_forward{}, obj, rows, V);
//   auto p = troll::cuda.on(s).with_workspace(workspace, bytes);   // caller allocates once
//   troll::objective_forward(p, obj, new_logits, old_logits, batch, log_probs, stats, token_loss, metrics);
//   troll::objective_backward(p, obj, new_logits, old_logits, batch, log_probs, stats, grad_new);
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/workspace.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/launch.cuh"
#include "detail/cuda/objective_kernels.cuh"
#include "detail/cuda/objective_launch.cuh"
#include "detail/cuda/row_report.cuh"
#include "detail/objective_arguments.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "objective_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE


/// TROLL's forward on the device (troll::objective_forward(cpu_policy, ...)): log π* to
/// `log_probs`, one projection_stats per row to `stats`, ℓ_r to `token_loss` (optional, rows
/// entries, 0 on rows with mask 0), and the aggregated loss with the batch metrics to `*metrics`
/// (one device objective_metrics, written by a one-block kernel after the rows). Every pointer,
/// token_batch's included, is device memory; `workspace` holds
/// workspace_bytes(policy, op::objective_forward{}, objective, rows, cols). Nothing allocates or
/// synchronises by default. Shape and parameter errors throw on the host before anything is
/// enqueued. Bad rows are reported through `checks` and get NaN outputs (so a
/// counted bad row makes the loss NaN); with checks.checked the CPU's exceptions are thrown, naming
/// the row, before anything is written.
template <class T>
void objective_forward(cuda_policy policy, const trust_region_objective& objective,
                       input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                       batch_view<T> log_probs, projection_stats* stats,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::check_troll_forward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats);
  if (metrics == nullptr) detail::throw_shape(fn, "metrics is a null pointer");
  detail::check_workspace(fn, policy.workspace, detail::cuda::objective_workspace_bytes(new_logits.rows));
  void* const workspace = policy.workspace.data;
  using detail::cuda::objective_row_record;
  objective_row_record* records = static_cast<objective_row_record*>(workspace) + 1;
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  detail::cuda::run(fn, policy.stream, new_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::troll_forward_kernel<T>, new_logits,
                                                old_logits, in, objective.eps, objective.alpha, objective.projection,
                                                log_probs, stats, token_loss, records),
                    detail::cuda::throw_objective_report{});
  detail::cuda::aggregate_kernel<T><<<1, detail::cuda::block_threads, 0, policy.stream>>>(
      in, new_logits.rows, stats, records, metrics);
  detail::cuda::check_launch(fn);
}

/// TROLL's fused backward on the device (troll::objective_backward(cpu_policy, ...)): grad_new =
/// grad_loss · ∂L/∂z̃ from the forward's `log_probs` and `stats` (device memory). `workspace`
/// (workspace_bytes(policy, op::objective_backward{}, objective, rows, cols)) is scratch for the
/// aggregation weights: it need not hold the forward's records. Rows with mask 0 get zeros; bad rows (bad
/// logits or token data, unusable stats) get NaN and a report, or throw in checked mode. grad_loss must
/// be finite (host check).
template <class T>
void objective_backward(cuda_policy policy, const trust_region_objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits,
                        const token_batch<T>& in, input_view<T> log_probs,
                        const projection_stats* stats, batch_view<T> grad_new,
                        double grad_loss = 1.0) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::check_troll_backward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats,
                                            grad_new, grad_loss);
  detail::check_workspace(fn, policy.workspace, detail::cuda::objective_workspace_bytes(new_logits.rows));
  void* const workspace = policy.workspace.data;
  if (new_logits.rows == 0) return;
  using detail::cuda::objective_row_record;
  objective_row_record* header = static_cast<objective_row_record*>(workspace);
  objective_row_record* records = header + 1;
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  // The weights come first: the checked mode's validation launches do not read them.
  detail::cuda::enqueue_aggregation_weights(fn, policy.stream, in, new_logits.rows, header);
  // Checked mode validates every row in one pass (token data, logits, log_probs, stats: the
  // CPU's order within a row) and throws the lowest bad row's problem, as the CPU does.
  detail::cuda::run(fn, policy.stream, new_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::troll_backward_kernel<T>, new_logits,
                                                old_logits, in, objective.eps, objective.alpha, log_probs, stats,
                                                grad_new, grad_loss, header, records),
                    detail::cuda::throw_objective_report{});
}

// ---- The baselines, PPO clip and DPPO (no projection; the ratio is p̃_a / q_a) ----


/// A ratio baseline's forward on the device (troll::objective_forward(cpu_policy, ppo_clip_objective
/// / dppo_objective, ...)): ℓ_r to `token_loss` (optional), the aggregated loss and metrics
/// (limited_fraction = clipped or masked tokens, divergence_mean = DPPO's mean divergence
/// estimate) to `*metrics`. Memory, workspace and validation as TROLL's overload (the CPU's
/// checks without the projection's: disjoint supports are accepted). DPPO's top-K divergences
/// select the old row's K largest logits with a radix select (a few extra passes over the row).
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_forward(cuda_policy policy, const Objective& objective,
                       input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::cuda::ratio_forward<T>(fn, policy, detail::make_spec(fn, objective), new_logits, old_logits,
                                 in, token_loss, metrics);
}

/// A ratio baseline's backward on the device: grad_new = grad_loss · ∂L/∂z̃,
/// ∂ℓ/∂z̃_j = (∂ℓ/∂r)·r·(δ_ja − p̃_j) (DPPO's mask recomputed per row, as on the CPU). `workspace`
/// as TROLL's backward.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_backward(cuda_policy policy, const Objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits,
                        const token_batch<T>& in, batch_view<T> grad_new,
                        double grad_loss = 1.0) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::cuda::ratio_backward<T>(fn, policy, detail::make_spec(fn, objective), new_logits,
                                  old_logits, in, grad_new, grad_loss);
}

TROLL_END_NAMESPACE
