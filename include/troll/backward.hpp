// troll/backward.hpp — derivatives of the projection (math.md §3): the VJP a trainer's backward
// calls (O(V) per row, no V×V matrix), the JVP, and full Jacobians for small vocabularies.
// All take the forward's inputs, its output log π* and its per-row statistics.
#pragma once

#include <atomic>
#include <cstddef>
#include <vector>
#include <limits>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/backward_kernels.hpp"
#include "detail/cpu/offset_rows.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "detail/workspace.hpp"
#include "workspace.hpp"
#include "projection_types.hpp"
#include "detail/cpu/backward_checks.hpp"

TROLL_BEGIN_NAMESPACE

/// Vector–Jacobian product of project(): given g = ∂L/∂log π* (rows × V), writes
///   grad_new = ∂L/∂z̃,  grad_old = ∂L/∂z° (skipped when grad_old is empty),
///   grad_eps[r] = ∂L/∂ε for row r (skipped when null).
/// Upstream entries at masked outputs (log π* = −inf) are ignored; masked inputs get 0.
/// Throws shape_error / domain_error (non-finite g, log_probs NaN, +inf, above 0 or finite where
/// a logit is −inf, unusable stats, bad logits) before writing.
template <class T>
void project_backward(cpu_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                      input_view<T> log_probs, const projection_stats* stats,
                      input_view<T> grad_log_probs, batch_view<T> grad_new,
                      batch_view<T> grad_old = {},
                      typename detail::identity<T>::type* grad_eps = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_backward";
  detail::check_output(fn, "grad_new", new_logits, grad_new);
  if (grad_old.rows != 0) detail::check_output(fn, "grad_old", new_logits, grad_old);
  const bool want_old = grad_old.rows != 0;
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::project_backward{}, new_logits.rows));
  // The validation of the first rows is the VJP's first pass: their sums are kept (on the stack).
  constexpr std::size_t kept_rows = 64;
  detail::cpu::vjp_sums kept[kept_rows];
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            grad_log_probs, "grad_log_probs", input_view<T>{}, kept,
                            want_old ? std::size_t(0) : kept_rows);
  const std::size_t size = new_logits.cols;
  unsigned char* overflowed = scratch.data();
  detail::cpu::parallel_for(policy.threads, new_logits.rows, 6 * size, [&](std::size_t r) {
    double row_grad_eps = 0.0;
    T* const row_grad_old = want_old ? grad_old.row(r) : static_cast<T*>(nullptr);
    if (detail::offset_row(stats[r])) {  // |μ| ≫ σ: against a reference token (offset_rows.hpp)
      overflowed[r] = !detail::cpu::vjp_offset_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                                   grad_log_probs.row(r), size, stats[r], grad_new.row(r),
                                                   row_grad_old, &row_grad_eps);
    } else {
      overflowed[r] = !detail::cpu::vjp_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                            grad_log_probs.row(r), size, stats[r], grad_new.row(r), row_grad_old,
                                            &row_grad_eps,
                                            !want_old && r < kept_rows && kept[r].fine ? &kept[r] : nullptr);
    }
    if (grad_eps) grad_eps[r] = T(row_grad_eps);
  });
  detail::throw_overflowed<T>(fn, overflowed, new_logits.rows);
}

/// Jacobian–vector product of project(): the directional derivative of log π* along tangents
/// (tangent_new for z̃, tangent_old for z° — may be empty — and tangent_eps for ε, shared by all
/// rows). Masked outputs get 0.
template <class T>
void project_jvp(cpu_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                 input_view<T> log_probs, const projection_stats* stats, input_view<T> tangent_new,
                 input_view<T> tangent_old, double tangent_eps, batch_view<T> tangent_out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_jvp";
  detail::check_output(fn, "tangent_out", new_logits, tangent_out);
  if (!(tangent_eps - tangent_eps == 0.0))
    throw domain_error("troll::project_jvp: tangent_eps is not finite");
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::project_jvp{}, new_logits.rows));
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            tangent_new, "tangent_new", tangent_old);
  const std::size_t size = new_logits.cols;
  const bool with_old = tangent_old.rows != 0;
  unsigned char* overflowed = scratch.data();
  detail::cpu::parallel_for(policy.threads, new_logits.rows, 6 * size, [&](std::size_t r) {
    const T* const row_old = with_old ? tangent_old.row(r) : static_cast<const T*>(nullptr);
    overflowed[r] = detail::offset_row(stats[r])
                        ? !detail::cpu::jvp_offset_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                                       tangent_new.row(r), row_old, tangent_eps, size, stats[r],
                                                       tangent_out.row(r))
                        : !detail::cpu::jvp_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                                tangent_new.row(r), row_old, tangent_eps, size, stats[r],
                                                tangent_out.row(r));
  });
  detail::throw_overflowed<T>(fn, overflowed, new_logits.rows);
}

/// Full Jacobians of project() for small vocabularies: per row a row-major V×V block of
/// jac_new (∂log π*_i/∂z̃_j), of jac_old (∂log π*_i/∂z°_j; null to skip) and V entries of
/// jac_eps (∂log π*_i/∂ε; null to skip). Memory is rows·V² elements: meant for V in the
/// hundreds (tests, analysis), not for LLM vocabularies.
template <class T>
void project_jacobian(cpu_policy policy, input_view<T> new_logits, input_view<T> old_logits,
                      input_view<T> log_probs, const projection_stats* stats, T* jac_new,
                      typename detail::identity<T>::type* jac_old = nullptr,
                      typename detail::identity<T>::type* jac_eps = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_jacobian";
  if (new_logits.rows != 0 && jac_new == nullptr) detail::throw_shape(fn, "jac_new is a null pointer");
  detail::check_jacobian_size(fn, new_logits.rows, new_logits.cols, sizeof(T));
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            input_view<T>{}, "", input_view<T>{});
  const std::size_t size = new_logits.cols;
  std::atomic<std::size_t> first_overflow{new_logits.rows};
  detail::cpu::parallel_for(policy.threads, new_logits.rows, size * size, [&](std::size_t r) {
    const std::size_t block = size * size;
    T* const row_old = jac_old ? jac_old + r * block : nullptr;
    T* const row_eps = jac_eps ? jac_eps + r * size : nullptr;
    const bool fits = detail::offset_row(stats[r])
                          ? detail::cpu::jacobian_offset_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                                             size, stats[r], jac_new + r * block, row_old, row_eps)
                          : detail::cpu::jacobian_row(new_logits.row(r), old_logits.row(r), log_probs.row(r), size,
                                                      stats[r], jac_new + r * block, row_old, row_eps);
    if (!fits) detail::cpu::lower_to(first_overflow, r);
  });
  // As project_backward and project_jvp: a row whose true Jacobian overflows T is reported after
  // the pass (the buffers then hold unspecified values), not left as ±inf.
  detail::throw_jacobian_overflowed<T>(fn, first_overflow.load(), new_logits.rows);
}

TROLL_END_NAMESPACE
