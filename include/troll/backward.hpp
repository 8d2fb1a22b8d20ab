// troll/backward.hpp — derivatives of the projection (math.md §3): the VJP a trainer's backward
// calls (O(V) per row, no V×V matrix), the JVP, and full Jacobians for small vocabularies.
// All take the forward's inputs, its output log π* and its per-row statistics.
#pragma once

#include <cstddef>
#include <vector>
#include <limits>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/backward_kernels.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "detail/workspace.hpp"
#include "workspace.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// First non-finite entry (NaN or ±inf) of a row that must be finite everywhere (one vectorised
/// scan; a bad row is then walked).
template <class T>
row_problem find_nonfinite(const T* z, std::size_t size, const char* operand) {
  row_problem p;
  if (cpu::all_finite(z, size)) return p;
  for (std::size_t k = 0; k < size; ++k) {
    const double x = static_cast<double>(z[k]);
    if (!(x - x == 0.0)) {
      p.kind = row_error::nan_value;
      p.operand = operand;
      p.entry = static_cast<long long>(k);
      p.value = x;
      return p;
    }
  }
  return p;
}

/// First entry of a row of log-probabilities (the forward's log π*) that cannot be one: NaN,
/// +inf, a finite value above 0 (a probability above 1), or a value above −inf where the new or
/// the old logits are −inf (π* ≪ p̃ and π* ≪ q for every status). −inf (a masked output) is fine.
/// One vectorised scan; a bad row is then walked.
template <class T>
row_problem find_bad_log_prob(const T* log_probs, const T* new_logits, const T* old_logits, std::size_t size,
                              const char* operand) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  row_problem p;
  unsigned char all_fine = 1;
  for (std::size_t k = 0; k < size; ++k)
    all_fine &= static_cast<unsigned char>(log_probs[k] <= T(0) && ((new_logits[k] > minus_inf && old_logits[k] > minus_inf) ||
                                                                    log_probs[k] == minus_inf));
  if (all_fine) return p;
  for (std::size_t k = 0; k < size; ++k) {
    const double x = static_cast<double>(log_probs[k]);
    const bool masked = !(static_cast<double>(new_logits[k]) > neg_inf() && static_cast<double>(old_logits[k]) > neg_inf());
    if (x <= 0.0 && !(masked && x > neg_inf())) continue;
    p.kind = x != x ? row_error::nan_value
             : x == inf() ? row_error::pos_inf
             : x > 0.0    ? row_error::above_zero
                          : row_error::masked_mass;
    p.operand = operand;
    p.entry = static_cast<long long>(k);
    p.value = x;
    return p;
  }
  return p;
}

inline row_problem check_stats(const projection_stats& s) {
  row_problem p;
  p.kind = row_error::bad_stats;
  switch (s.status) {
    case row_status::inactive:
    case row_status::restricted:
      return row_problem{};
    case row_status::projected:
      if (!(s.t > 0.0 && s.t <= 1.0)) {
        p.operand = "t of a projected row is not in (0, 1]";
      } else if (!(s.sigma2 > 0.0 && s.sigma2 < inf())) {
        p.operand = "sigma2 of a projected row is not finite and > 0";
      } else if (!(s.mu - s.mu == 0.0)) {
        p.operand = "mu of a projected row is not finite";
      } else if (!(s.kl_after >= 0.0 && s.kl_after < inf())) {
        p.operand = "kl_after of a projected row is not finite and >= 0";
      } else {
        return row_problem{};
      }
      return p;
    case row_status::not_converged:
      p.operand = "status is not_converged (the forward solve stopped before the tolerance; see "
                  "projection_options)";
      return p;
    default:
      p.operand = "status is not inactive, projected or restricted";
      return p;
  }
}

/// The last guard of a derivative pass: the lowest row whose outputs do not fit T (the true
/// derivative overflows, as with a sizeable upstream gradient on a token the row all but masks)
/// throws domain_error. The outputs are then unspecified; every other problem is found before
/// anything is written.
template <class T>
void throw_overflowed(const char* fn, const unsigned char* overflowed, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r)
    if (overflowed[r])
      throw domain_error(row_prefix(fn, r) + "a derivative does not fit " +
                             (sizeof(T) == sizeof(float) ? "float" : "double") +
                             " (its true value overflows: an upstream gradient on a token of "
                             "near-zero probability, with a tiny variance sigma2)",
                         r);
}

/// Shared argument checks of the backward entry points; throws before anything is written.
template <class T>
void validate_backward(const char* fn, unsigned threads, batch_view<const T> new_logits,
                       batch_view<const T> old_logits, batch_view<const T> log_probs,
                       const projection_stats* stats, batch_view<const T> upstream,
                       const char* upstream_name, batch_view<const T> upstream_old,
                       cpu::vjp_sums* kept = nullptr, std::size_t kept_rows = 0) {
  check_backward_views(fn, new_logits, old_logits, log_probs, stats, upstream, upstream_name, upstream_old);
  const std::size_t size = new_logits.cols;
  const bool four = upstream.data != nullptr && upstream_old.rows == 0;
  auto problem = [&](std::size_t r) {
    // The common row, every logit and upstream entry finite and every log π* ≤ 0, passes in one
    // vectorised read of the four rows; any other row is walked by the checks below, which name
    // its first problem.
    if (four && r < kept_rows && !check_stats(stats[r])) {  // the VJP's first pass is the check; sums kept
      kept[r] = cpu::vjp_first_pass(new_logits.row(r), old_logits.row(r), log_probs.row(r), upstream.row(r),
                                    static_cast<long>(size), stats[r].mu);
      if (kept[r].fine) return row_problem{};
    } else if (four && cpu::backward_row_fine(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                              upstream.row(r), size)) {
      return check_stats(stats[r]);
    }
    row_setup setup;
    row_problem p = cpu::scan_pair(new_logits.row(r), old_logits.row(r), size, setup,
                                   "new_logits", "old_logits");
    if (!p) p = find_bad_log_prob(log_probs.row(r), new_logits.row(r), old_logits.row(r), size, "log_probs");
    if (!p) p = check_stats(stats[r]);
    if (!p && upstream.data != nullptr) p = find_nonfinite(upstream.row(r), size, upstream_name);
    if (!p && upstream_old.rows != 0) p = find_nonfinite(upstream_old.row(r), size, "tangent_old");
    return p;
  };
  cpu::throw_first_problem(fn, threads, new_logits.rows, 3 * size, problem, &throw_row_problem);
}

}  // namespace detail

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
                      batch_view<T> grad_old = {}, T* grad_eps = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_backward";
  detail::check_output(fn, "grad_new", new_logits, grad_new);
  if (grad_old.rows != 0) detail::check_output(fn, "grad_old", new_logits, grad_old);
  const bool want_old = grad_old.rows != 0;
  // The validation of the first rows is the VJP's first pass: their sums are kept (on the stack).
  constexpr std::size_t kept_rows = 64;
  detail::cpu::vjp_sums kept[kept_rows];
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            grad_log_probs, "grad_log_probs", input_view<T>{}, kept,
                            want_old ? std::size_t(0) : kept_rows);
  const std::size_t size = new_logits.cols;
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::project_backward{}, new_logits.rows));
  unsigned char* overflowed = scratch.data();
  detail::cpu::parallel_for(policy.threads, new_logits.rows, 6 * size, [&](std::size_t r) {
    double row_grad_eps = 0.0;
    overflowed[r] = !detail::cpu::vjp_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                          grad_log_probs.row(r), size, stats[r], grad_new.row(r),
                                          want_old ? grad_old.row(r) : static_cast<T*>(nullptr), &row_grad_eps,
                                          !want_old && r < kept_rows && kept[r].fine ? &kept[r] : nullptr);
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
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            tangent_new, "tangent_new", tangent_old);
  const std::size_t size = new_logits.cols;
  const bool with_old = tangent_old.rows != 0;
  const detail::host_scratch scratch(fn, policy.workspace, workspace_bytes(policy, op::project_jvp{}, new_logits.rows));
  unsigned char* overflowed = scratch.data();
  detail::cpu::parallel_for(policy.threads, new_logits.rows, 6 * size, [&](std::size_t r) {
    overflowed[r] = !detail::cpu::jvp_row(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                         tangent_new.row(r), with_old ? tangent_old.row(r) : static_cast<const T*>(nullptr),
                         tangent_eps, size, stats[r], tangent_out.row(r));
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
                      T* jac_old = nullptr, T* jac_eps = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project_jacobian";
  if (new_logits.rows != 0 && jac_new == nullptr) detail::throw_shape(fn, "jac_new is a null pointer");
  detail::check_jacobian_size(fn, new_logits.rows, new_logits.cols, sizeof(T));
  detail::validate_backward(fn, policy.threads, new_logits, old_logits, log_probs, stats,
                            input_view<T>{}, "", input_view<T>{});
  const std::size_t size = new_logits.cols;
  detail::cpu::parallel_for(policy.threads, new_logits.rows, size * size, [&](std::size_t r) {
    const std::size_t block = size * size;
    detail::cpu::jacobian_row(new_logits.row(r), old_logits.row(r), log_probs.row(r), size, stats[r],
                              jac_new + r * block, jac_old ? jac_old + r * block : nullptr,
                              jac_eps ? jac_eps + r * size : nullptr);
  });
}

TROLL_END_NAMESPACE
