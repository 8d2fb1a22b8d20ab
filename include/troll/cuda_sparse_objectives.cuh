// troll/cuda_sparse_objectives.cuh — TROLL's objective on sparse old rows under the troll::cuda
// policy (nvcc only; reached through <troll/cuda.cuh>): objective_forward and objective_backward
// with the CPU overloads' arguments (troll/sparse_objectives.hpp). Tested on an NVIDIA H100
// (2026-11-24): see docs/cuda.md.
//
//   std::size_t bytes = troll::workspace_bytes(troll::cuda, troll::op::objective_forward{}, obj, rows, V,
//                                              aligned.k_max);
//   auto p = troll::cuda.on(s).with_workspace(workspace, bytes);
//   troll::objective_forward(p, obj, new_logits, old_rows, batch, aligned, log_probs, stats, token_loss, metrics);
//   troll::objective_backward(p, obj, new_logits, aligned, batch, log_probs, stats, grad_new);
//
// A composition of the sparse path's kernels (sparsify for S_new, align from the dense new
// logits, project, sparsify_backward for the scatter to the dense logits) with the dense
// objective's aggregation and per-token maths, plus three small kernels: the checks before the
// alignment, the ratio / regression KL per row, and the upstream gradient on the lumped categories.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/workspace.hpp"
#include "workspace.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/objective_kernels.cuh"
#include "detail/cuda/row_report.cuh"
#include "detail/cuda/sparse_dense.cuh"
#include "detail/cuda/launch.cuh"
#include "detail/cuda/sparse_objective_kernels.cuh"
#include "detail/cuda/sparse_objective_report.cuh"
#include "detail/cuda/sparse_projection.cuh"
#include "detail/cuda/sparse_sparsify.cuh"
#include "detail/cuda/sparse_warp.cuh"
#include "detail/row_problem.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "objective_types.hpp"
#include "projection_types.hpp"
#include "sparse_objective_types.hpp"
#include "sparse_types.hpp"

TROLL_BEGIN_NAMESPACE


/// The sparse TROLL forward on the device (troll::objective_forward(cpu_policy,
/// sparse_trust_region_objective, ...)): U = S_new ∪ S_old and the aligned rows to `aligned`,
/// log π* on U and its bucket to `log_probs`, one projection_stats per row to `stats`, ℓ_r to
/// `token_loss` (optional, 0 on rows with mask 0), the aggregated loss and the batch metrics to
/// `*metrics` (one device objective_metrics). Every pointer, token_batch's included, is device
/// memory; `workspace` holds workspace_bytes(policy, op::objective_forward{}, objective, rows, cols,
/// aligned.k_max). Nothing allocates or synchronises by default. Shape and parameter errors throw on the host
/// before anything is enqueued. Bad rows are reported through `checks` (the CPU's order of
/// checks) and get count 0 with NaN remainders in `aligned` and `log_probs`, stats with NaN
/// fields, a NaN token loss (so a counted bad row makes the loss NaN). With checks.checked the
/// CPU's exceptions are thrown, naming the row, before any output is written: the validation
/// pass builds the lumped rows in a stream-ordered allocation of its own (cudaMallocAsync of
/// aligned's size; its cudaFreeAsync is enqueued on the stream before the call returns or
/// throws). Checked mode is the only mode that allocates (this and the few bytes every checked
/// entry point takes for its row report).
template <class T>
void objective_forward(cuda_policy policy, const sparse_trust_region_objective& objective,
                       input_view<T> new_logits, sparse_input<T> old_rows, const token_batch<T>& in,
                       aligned_batch_view<T> aligned, sparse_batch_view<T> log_probs, projection_stats* stats,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::check_sparse_forward_arguments<T>(fn, objective, new_logits, old_rows, in, aligned, log_probs, stats);
  if (metrics == nullptr) detail::throw_shape(fn, "metrics is a null pointer");
  detail::check_workspace(fn, policy.workspace,
                          workspace_bytes(policy, op::objective_forward{}, objective, new_logits.rows, new_logits.cols, aligned.k_max));
  void* const workspace = policy.workspace.data;
  namespace dc = detail::cuda;
  const std::size_t rows = new_logits.rows, vocab = new_logits.cols;
  const int new_k = objective.new_support.k;
  const double log_delta =
      objective.new_support.delta > 0.0 ? std::log(objective.new_support.delta) : detail::neg_inf();
  const std::size_t capacity_k = aligned.k_max < log_probs.k_max ? aligned.k_max : log_probs.k_max;
  const std::size_t capacity = capacity_k < std::size_t(sparse_max_entries) ? capacity_k : sparse_max_entries;
  const dc::sparse_objective_workspace ws = dc::split_workspace(workspace, rows);
  const sparse_batch_view<T> support =
      new_k > 0 ? dc::support_in<T>(ws, rows, std::size_t(new_k), vocab) : sparse_batch_view<T>{};
  const sparse_batch_view<const T> support_in = support;
  const aligned_batch_view<const T> aligned_in = aligned;
  const int old_slots = dc::sort_slots(old_rows.k_max);
  const std::size_t new_cap = new_k > 0 ? std::size_t(new_k) : 1;
  const int align_slots = dc::sort_slots(old_rows.k_max < new_cap ? new_cap : old_rows.k_max);
  const double eps = objective.eps, alpha = objective.alpha;
  const projection_options options = objective.projection;
  cudaStream_t stream = policy.stream;
  const dc::device_checks quiet{nullptr, nullptr, false};
  const dc::throw_sparse_objective_report thrower{false, static_cast<long long>(capacity_k)};
  // Checked mode validates on lumped rows built in its own allocation (freed on return), so a
  // throw leaves `aligned` as the caller passed it.
  std::unique_ptr<dc::stream_allocation> check_memory;
  aligned_batch_view<T> check_aligned;
  if (checks.checked && rows > 0) {
    check_memory.reset(new dc::stream_allocation(fn, dc::aligned_batch_bytes<T>(rows, aligned.k_max), stream));
    check_aligned = dc::aligned_batch_in<T>(check_memory->get(), rows, aligned.k_max, vocab);
  }
  static const char* const names[3] = {"new_logits", "old", ""};
  dc::run(
      fn, stream, rows, checks, names,
      [&](dc::row_range range, dc::device_checks device) {
        const aligned_batch_view<T> lumped = device.validate_only ? check_aligned : aligned;
        const unsigned grid = dc::grid_for(range.count);
        dc::sparse_objective_check_kernel<T><<<grid, dc::block_threads, 0, stream>>>(
            new_logits, old_rows, in, new_k, capacity, old_slots, ws.outcome, range, device);
        if (new_k > 0)
          dc::sparsify_kernel<T, T><<<grid, dc::block_threads, 0, stream>>>(new_logits, nullptr, new_k, log_delta,
                                                                            support, range, quiet);
        dc::align_dense_kernel<T, T><<<grid, dc::block_threads, 0, stream>>>(new_logits, support_in, old_rows,
                                                                             lumped, align_slots, range, quiet);
        const dc::warp_launch l = dc::warp_launch_for(range.count, aligned.k_max, 1);
        if (!device.validate_only)
          dc::sparse_project_kernel<T><<<l.grid, l.threads, l.shared_bytes, stream>>>(
              aligned_in, eps, options, log_probs, stats, l.slots, range, quiet);
        dc::sparse_objective_rows_kernel<T><<<l.grid, l.threads, l.shared_bytes, stream>>>(
            lumped, in, eps, alpha, log_probs, stats, token_loss, ws.records, ws.outcome, l.slots, range, device);
      },
      thrower);
  dc::aggregate_kernel<T><<<1, dc::block_threads, 0, stream>>>(in, rows, stats, ws.records, metrics);
  dc::check_launch(fn);
}

/// The sparse TROLL fused backward on the device (troll::objective_backward(cpu_policy,
/// sparse_trust_region_objective, ...)): grad_new (rows × V) = grad_loss · ∂L/∂z̃ from the forward's
/// `aligned`, `log_probs` and `stats` (device memory): the upstream gradient on the lumped categories
/// (the dense objective's per-token formula), then the scatter of math.md §4 to every dense logit
/// (sparsify_backward's kernel). `workspace` (workspace_bytes(policy, op::objective_backward{},
/// objective, rows, cols, aligned.k_max)) is scratch: it need not hold the forward's. Rows with mask 0
/// get zeros; bad rows (the CPU's row checks) get NaN and a report, or throw in checked mode before
/// grad_new is written. grad_loss must be finite (host).
template <class T>
void objective_backward(cuda_policy policy, const sparse_trust_region_objective& objective,
                        input_view<T> new_logits, aligned_input<T> aligned, const token_batch<T>& in,
                        sparse_input<T> log_probs, const projection_stats* stats, batch_view<T> grad_new,
                        double grad_loss = 1.0) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::check_sparse_backward_arguments<T>(fn, objective, new_logits, aligned, in, log_probs, stats, grad_new,
                                             grad_loss);
  detail::check_workspace(fn, policy.workspace,
                          workspace_bytes(policy, op::objective_backward{}, objective, new_logits.rows, new_logits.cols, aligned.k_max));
  void* const workspace = policy.workspace.data;
  namespace dc = detail::cuda;
  const std::size_t rows = new_logits.rows;
  if (rows == 0) return;
  const dc::sparse_objective_workspace ws = dc::split_workspace(workspace, rows);
  const sparse_grad_view<T> upstream = dc::upstream_in<T>(ws, rows, aligned.k_max);
  const sparse_grad_view<const T> upstream_in = upstream;
  const int check_slots = dc::sort_slots(aligned.k_max < log_probs.k_max ? log_probs.k_max : aligned.k_max);
  const int scatter_slots = dc::sort_slots(aligned.k_max);
  const double alpha = objective.alpha;
  cudaStream_t stream = policy.stream;
  const dc::device_checks quiet{nullptr, nullptr, false};
  // The weights come first: the checked mode's validation launches do not read them.
  dc::enqueue_aggregation_weights(fn, stream, in, rows, ws.header);
  static const char* const names[3] = {"new_logits", "", ""};
  dc::run(
      fn, stream, rows, checks, names,
      [&](dc::row_range range, dc::device_checks device) {
        const unsigned grid = dc::grid_for(range.count);
        dc::sparse_objective_upstream_kernel<T><<<grid, dc::block_threads, 0, stream>>>(
            new_logits, aligned, in, alpha, log_probs, stats, grad_loss, ws.header, ws.records, upstream,
            check_slots, range, device);
        if (device.validate_only) return;
        dc::sparsify_backward_kernel<T, T><<<grid, dc::block_threads, 0, stream>>>(
            new_logits, aligned.new_side(), upstream_in, grad_new, scatter_slots, range, quiet);
      },
      dc::throw_sparse_objective_report{true, 0});
}

TROLL_END_NAMESPACE
