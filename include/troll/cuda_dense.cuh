// troll/cuda_dense.cuh — the CUDA backend of the dense API (nvcc only): log_softmax, kl, kl_backward,
// project, project_backward, project_jvp and project_jacobian under the troll::cuda policy tag,
// with the CPU overloads' argument lists (project_jacobian's workspace travels in the policy).
//
//   troll::project(troll::cuda.on(stream), new_logits, old_logits, eps, out_log_probs, stats);
//
// Every pointer (views, stats, kl_out, grad_eps, reports) is device memory. Work is enqueued on
// policy.stream; by default nothing allocates and nothing synchronises. Bad input rows are
// reported on the device (policy.checks, see troll::cuda_checks) instead of thrown, unless the
// caller asks for the checked mode (troll::cuda.checked()), which throws the CPU's typed exceptions.
// Tested on an NVIDIA H100 (2026-11-24): see docs/cuda.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cuda/backward_kernels.cuh"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/forward_kernels.cuh"
#include "detail/cuda/gradient_kernels.cuh"
#include "detail/cuda/launch.cuh"
#include "detail/cuda/row_report.cuh"
#include "errors.hpp"
#include "execution.hpp"
#include "detail/workspace.hpp"
#include "workspace.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE


/// out[r] = log_softmax(logits[r]) on the device. Rejected rows (NaN / +inf entries, all −inf)
/// are reported through `checks` and written as NaN; with checks.checked they throw
/// domain_error as on the CPU, before anything is written.
template <class T>
void log_softmax(cuda_policy policy, input_view<T> logits, batch_view<T> out) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "log_softmax";
  detail::check_view(fn, "logits", logits);
  detail::check_view(fn, "out", out);
  detail::check_same_shape(fn, "logits", logits, "out", out);
  static const char* const names[3] = {"logits", "logits", ""};
  detail::cuda::run(fn, policy.stream, logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::log_softmax_kernel<T>, logits, out));
}

/// kl_out[r] = KL(softmax(p[r]) ‖ softmax(q[r])) on the device (kl_out: p.rows device entries),
/// +inf where p has mass q lacks (disjoint supports included, as on the CPU). Rejected rows as
/// in the CPU kl (NaN / +inf, all −inf) give NaN and a report, or throw in checked mode.
template <class T>
void kl(cuda_policy policy, input_view<T> p_logits, input_view<T> q_logits, T* kl_out) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "kl";
  detail::check_kl_arguments<T>(fn, p_logits, q_logits, kl_out);
  static const char* const names[3] = {"p_logits", "q_logits", ""};
  detail::cuda::run(fn, policy.stream, p_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::kl_kernel<T>, p_logits, q_logits, kl_out));
}

/// Backward of kl on the device, as troll::kl_backward(cpu_policy, ...): given the upstream
/// g[r] = ∂L/∂KL_r (grad_kl: p.rows device entries), writes
///     ∂L/∂p_j = g · p_j (log p_j − log q_j − KL),      ∂L/∂q_j = g · (q_j − p_j).
/// Either gradient view may be empty (rows == 0) to skip it. Rows with bad logits (NaN / +inf,
/// all −inf), a non-finite g (report not_finite, operand 2) or an infinite KL (p has mass where q
/// is −inf, disjoint supports included: report infinite_kl) get NaN gradients, or throw
/// domain_error in checked mode — the lowest bad row, its logits checked first, as on the CPU.
template <class T>
void kl_backward(cuda_policy policy, input_view<T> p_logits, input_view<T> q_logits, const T* grad_kl,
                 batch_view<T> grad_p, batch_view<T> grad_q) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "kl_backward";
  detail::check_kl_backward_arguments(fn, p_logits, q_logits, grad_kl, grad_p, grad_q);
  static const char* const names[3] = {"p_logits", "q_logits", "grad_kl"};
  const auto launch = detail::cuda::block_per_row(policy.stream, detail::cuda::kl_backward_kernel<T>, p_logits,
                                                  q_logits, grad_kl, grad_p, grad_q);
  const detail::cuda::throw_derivative_report thrower;
  // Checked: the lowest row with any problem (its logits, then g, then the KL), as the CPU.
  detail::cuda::run(fn, policy.stream, p_logits.rows, checks, names, launch, thrower);
}

/// The trust-region projection of troll::project(cpu_policy, ...) on the device: log π* to
/// out_log_probs, one projection_stats per row to `stats` (device memory, rows entries).
/// Shape, eps and option errors throw on the host before anything is enqueued. Row problems
/// (NaN / +inf, all −inf, disjoint supports, infeasible) are reported through `checks`; such a
/// row gets NaN log-probabilities and stats with NaN fields and status infeasible. With
/// checks.checked the CPU's exceptions are thrown, naming the row, before anything is written.
template <class T>
void project(cuda_policy policy, input_view<T> new_logits, input_view<T> old_logits, double eps,
             batch_view<T> out_log_probs, projection_stats* stats, const projection_options& options = {}) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project";
  detail::check_projection_arguments(fn, new_logits, old_logits, out_log_probs, stats, eps, options);
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  detail::cuda::run(fn, policy.stream, new_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::project_kernel<T>, new_logits,
                                                old_logits, eps, options, out_log_probs, stats));
}

/// Vector–Jacobian product of project() on the device, as troll::project_backward(cpu_policy,
/// ...): grad_new = ∂L/∂z̃, grad_old = ∂L/∂z° (skipped when grad_old is empty), grad_eps[r] =
/// ∂L/∂ε (skipped when null). `stats` is the forward's device array. Rows with bad logits,
/// unusable stats (including rows the forward rejected) or non-finite upstream entries get NaN
/// gradients and a report, or throw domain_error / infeasible_error in checked mode.
template <class T>
void project_backward(cuda_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                      input_view<T> log_probs, const projection_stats* stats, input_view<T> grad_log_probs,
                      batch_view<T> grad_new, batch_view<T> grad_old = {},
                      typename detail::identity<T>::type* grad_eps = nullptr) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project_backward";
  // The CPU overload's checks, in its order.
  detail::check_output(fn, "grad_new", new_logits, grad_new);
  if (grad_old.rows != 0) detail::check_output(fn, "grad_old", new_logits, grad_old);
  detail::check_backward_views(fn, new_logits, old_logits, log_probs, stats, grad_log_probs, "grad_log_probs",
                               input_view<T>{});
  static const char* const names[3] = {"new_logits", "old_logits", "grad_log_probs"};
  detail::cuda::run(fn, policy.stream, new_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::project_backward_kernel<T>,
                                                new_logits, old_logits, log_probs, stats, grad_log_probs,
                                                grad_new, grad_old, grad_eps));
}

/// Jacobian–vector product of project() on the device, as troll::project_jvp(cpu_policy, ...):
/// the directional derivative of log π* along tangent_new (for z̃), tangent_old (for z°; may be
/// empty) and tangent_eps (for ε, shared by all rows), to tangent_out. Masked outputs get 0.
/// `stats` is the forward's device array. A non-finite tangent_eps throws domain_error on the
/// host. Rows with bad logits, unusable stats or non-finite tangent entries (report not_finite:
/// operand 2 tangent_new, operand 3 tangent_old) get NaN, or throw the CPU's domain_error /
/// infeasible_error in checked mode.
template <class T>
void project_jvp(cuda_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                 input_view<T> log_probs, const projection_stats* stats, input_view<T> tangent_new,
                 input_view<T> tangent_old, double tangent_eps, batch_view<T> tangent_out) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project_jvp";
  detail::check_output(fn, "tangent_out", new_logits, tangent_out);
  if (!(tangent_eps - tangent_eps == 0.0))
    throw domain_error("troll::project_jvp: tangent_eps is not finite");
  detail::check_backward_views(fn, new_logits, old_logits, log_probs, stats, tangent_new, "tangent_new",
                               tangent_old);
  static const char* const names[3] = {"new_logits", "old_logits", "tangent_new"};
  detail::cuda::run(fn, policy.stream, new_logits.rows, checks, names,
                    detail::cuda::block_per_row(policy.stream, detail::cuda::project_jvp_kernel<T>, new_logits,
                                                old_logits, log_probs, stats, tangent_new, tangent_old,
                                                tangent_eps, tangent_out),
                    detail::cuda::throw_derivative_report{});
}

/// Full Jacobians of project() on the device, as troll::project_jacobian(cpu_policy, ...): per row a
/// row-major V×V block of jac_new (∂log π*_i/∂z̃_j), of jac_old (∂log π*_i/∂z°_j; null to skip) and V
/// entries of jac_eps (∂log π*_i/∂ε; null to skip). Memory is rows·V² elements: meant for V in the
/// hundreds. `workspace` (device memory, 8-byte aligned, workspace_bytes(policy, op::project_jacobian{},
/// rows, V)) holds per-row terms; the entries are written by one thrust::for_each_n on policy.stream
/// (par_nosync: nothing allocates, nothing synchronises). Rows with bad logits or unusable stats get NaN
/// blocks, or throw the CPU's exception in checked mode.
template <class T>
void project_jacobian(cuda_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                      input_view<T> log_probs, const projection_stats* stats, T* jac_new,
                      typename detail::identity<T>::type* jac_old = nullptr,
                      typename detail::identity<T>::type* jac_eps = nullptr) {
  const cuda_checks& checks = policy.checks;
  detail::require_float_type<T>();
  constexpr const char* fn = "project_jacobian";
  if (new_logits.rows != 0 && jac_new == nullptr) detail::throw_shape(fn, "jac_new is a null pointer");
  detail::check_jacobian_size(fn, new_logits.rows, new_logits.cols, sizeof(T));
  detail::check_backward_views(fn, new_logits, old_logits, log_probs, stats, input_view<T>{}, "",
                               input_view<T>{});
  using terms = detail::cuda::jacobian_row_terms;
  static_assert(alignof(terms) <= detail::workspace_alignment, "check_workspace checks double alignment");
  detail::check_workspace(fn, policy.workspace,
                          workspace_bytes(policy, op::project_jacobian{}, new_logits.rows, new_logits.cols));
  terms* row_terms = static_cast<terms*>(policy.workspace.data);
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  detail::cuda::run(
      fn, policy.stream, new_logits.rows, checks, names,
      [&](detail::cuda::row_range range, detail::cuda::device_checks device) {
        detail::cuda::jacobian_rows_kernel<T>
            <<<detail::cuda::grid_for(range.count), detail::cuda::block_threads, 0, policy.stream>>>(
                new_logits, old_logits, log_probs, stats, row_terms, range, device);
        if (device.validate_only) return;
        detail::cuda::check_launch(fn);
        detail::cuda::write_jacobian_entries(
            fn, policy.stream, range,
            detail::cuda::jacobian_entry<T>{new_logits, old_logits, log_probs, stats, row_terms, jac_new, jac_old,
                                            jac_eps});
      },
      detail::cuda::throw_derivative_report{});
}

TROLL_END_NAMESPACE
