// troll/detail/cuda/objective_launch.cuh — the launches of the ratio baselines (PPO clip, DPPO);
// checked mode translates their reports with throw_objective_report (objective_report.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../../objective_types.hpp"
#include "../workspace.hpp"
#include "error_check.cuh"
#include "launch.cuh"
#include "objective_kernels.cuh"
#include "objective_report.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The forward of a ratio baseline (`spec` built and checked by make_spec).
template <class T>
void ratio_forward(const char* fn, cuda_policy policy, const ratio_objective_spec& spec,
                   input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                   T* token_loss, objective_metrics* metrics) {
  check_objective_shapes(fn, new_logits, old_logits, in);
  if (metrics == nullptr) throw_shape(fn, "metrics is a null pointer");
  check_workspace(fn, policy.workspace, cuda::objective_workspace_bytes(new_logits.rows));
  void* const workspace = policy.workspace.data;
  const cuda_checks& checks = policy.checks;
  objective_row_record* records = static_cast<objective_row_record*>(workspace) + 1;
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  run(fn, policy.stream, new_logits.rows, checks, names,
      block_per_row(policy.stream, ratio_forward_kernel<T>, new_logits, old_logits, in, spec, token_loss, records),
      throw_objective_report{});
  aggregate_kernel<T><<<1, block_threads, 0, policy.stream>>>(in, new_logits.rows, nullptr,
                                                               records, metrics);
  check_launch(fn);
}

/// The backward of a ratio baseline.
template <class T>
void ratio_backward(const char* fn, cuda_policy policy, ratio_objective_spec spec,
                    input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                    batch_view<T> grad_new, double grad_loss) {
  check_ratio_backward_arguments<T>(fn, new_logits, old_logits, in, grad_new, grad_loss);
  check_workspace(fn, policy.workspace, cuda::objective_workspace_bytes(new_logits.rows));
  void* const workspace = policy.workspace.data;
  const cuda_checks& checks = policy.checks;
  if (new_logits.rows == 0) return;
  spec.compute_kl = false;
  objective_row_record* header = static_cast<objective_row_record*>(workspace);
  enqueue_aggregation_weights(fn, policy.stream, in, new_logits.rows, header);
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  run(fn, policy.stream, new_logits.rows, checks, names,
      block_per_row(policy.stream, ratio_backward_kernel<T>, new_logits, old_logits, in, spec, grad_new, grad_loss,
                    header, header + 1),
      throw_objective_report{});
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
