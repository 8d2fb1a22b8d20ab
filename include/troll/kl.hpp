// troll/kl.hpp — categorical log-softmax and KL divergence between rows of logits, with the
// gradient of KL w.r.t. both logit rows (math.md §1). −inf logits mark impossible tokens.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/kl_backward_row.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "errors.hpp"
#include "execution.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {
/// Validates every row pair first (in parallel); throws the problem of the lowest bad row.
/// Disjoint supports are no problem for KL (it is +inf): only value and all-masked errors count.
template <class T>
void validate_pairs(const char* function, unsigned threads, batch_view<const T> a,
                    batch_view<const T> b, const char* name_a, const char* name_b) {
  auto problem = [&](std::size_t r) {
    row_setup setup;
    row_problem p = cpu::scan_pair(a.row(r), b.row(r), a.cols, setup, name_a, name_b);
    if (p.kind == row_error::disjoint) p = row_problem{};
    return p;
  };
  cpu::throw_first_problem(function, threads, a.rows, 2 * a.cols, problem, &throw_row_problem);
}

template <class T>
void validate_rows(const char* function, unsigned threads, batch_view<const T> a, const char* name) {
  // One fused pass per row; logits_row_problem names what is wrong with the first bad row.
  const std::size_t bad =
      cpu::first_bad_row(threads, a.rows, a.cols, [&](std::size_t r) { return !cpu::row_values_fine(a.row(r), a.cols); });
  if (bad != a.rows) throw_row_problem(function, bad, cpu::logits_row_problem(a.row(bad), a.cols, name));
}
}  // namespace detail

/// out[r] = log_softmax(logits[r]). Throws domain_error for NaN / +inf entries or an all −inf row.
template <class T>
void log_softmax(cpu_policy policy, input_view<T> logits, batch_view<T> out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "log_softmax";
  detail::check_view(fn, "logits", logits);
  detail::check_view(fn, "out", out);
  detail::check_same_shape(fn, "logits", logits, "out", out);
  detail::validate_rows(fn, policy.threads, logits, "logits");
  detail::cpu::parallel_for(policy.threads, logits.rows, 3 * logits.cols, [&](std::size_t r) {
    detail::cpu::log_softmax_row(logits.row(r), logits.cols, out.row(r));
  });
}

/// kl_out[r] = KL(softmax(p[r]) ‖ softmax(q[r])) ≥ 0, exactly +inf when p puts mass on a token
/// that q masks. kl_out holds p.rows entries. Accurate to a few ulps of the row's log-probability
/// scale (every reduction in double). A finite KL beyond T's range (float logits of opposite
/// extremes, p = (3e38, 0), q = (−3e38, 3e38): KL ≈ 6.8e38) throws domain_error naming the lowest
/// such row after the pass (kl_out then holds unspecified values), rather than a +inf that would
/// read as a masked token.
template <class T>
void kl(cpu_policy policy, input_view<T> p_logits, input_view<T> q_logits, T* kl_out) {
  detail::require_float_type<T>();
  constexpr const char* fn = "kl";
  detail::check_kl_arguments<T>(fn, p_logits, q_logits, kl_out);
  detail::validate_pairs(fn, policy.threads, p_logits, q_logits, "p_logits", "q_logits");
  std::atomic<std::size_t> overflowed{p_logits.rows};
  detail::cpu::parallel_for(policy.threads, p_logits.rows, 4 * p_logits.cols, [&](std::size_t r) {
    detail::row_setup setup;
    detail::cpu::scan_pair(p_logits.row(r), q_logits.row(r), p_logits.cols, setup, "", "");
    const double value = detail::cpu::kl_row(p_logits.row(r), q_logits.row(r), p_logits.cols, setup);
    if (!setup.new_only && !detail::fits_in<T>(value)) detail::cpu::lower_to(overflowed, r);
    kl_out[r] = T(value);
  });
  const std::size_t bad = overflowed.load();
  if (bad != p_logits.rows)
    throw domain_error(detail::row_prefix(fn, bad) + "the KL does not fit " +
                           (sizeof(T) == sizeof(float) ? "float" : "double") +
                           " (its true value is finite and overflows: logits of opposite extremes, "
                           "such as a token near the type's largest value in p and its lowest in q)",
                       bad);
}

/// Backward of kl: given upstream g[r] = ∂L/∂KL_r, writes
///     ∂L/∂p_j = g · p_j (log p_j − log q_j − KL),      ∂L/∂q_j = g · (q_j − p_j).
/// Either gradient view may be empty (rows == 0) to skip it. Throws domain_error for a row whose
/// KL is +inf (the gradient does not exist) or a non-finite upstream value.
template <class T>
void kl_backward(cpu_policy policy, input_view<T> p_logits, input_view<T> q_logits, const T* grad_kl,
                 batch_view<T> grad_p, batch_view<T> grad_q) {
  detail::require_float_type<T>();
  constexpr const char* fn = "kl_backward";
  detail::check_kl_backward_arguments(fn, p_logits, q_logits, grad_kl, grad_p, grad_q);
  const bool want_p = grad_p.rows != 0, want_q = grad_q.rows != 0;
  const std::size_t size = p_logits.cols;
  // Row by row (its logits, then grad_kl, then the KL's finiteness), one pass: the lowest bad row
  // whatever its problem, as the device's checked mode.
  auto problem = [&](std::size_t r) {
    detail::row_setup setup;
    detail::row_problem pr = detail::cpu::scan_pair(p_logits.row(r), q_logits.row(r), size, setup, "p_logits", "q_logits");
    if (pr.kind == row_error::disjoint) pr = detail::row_problem{};  // KL = +inf: infinite_kl below
    if (pr) return pr;
    if (!(grad_kl[r] - grad_kl[r] == 0)) {
      pr.kind = row_error::nan_value;
      pr.operand = "grad_kl";
      pr.entry = -1;  // one value per row: no token
      pr.value = static_cast<double>(grad_kl[r]);
      return pr;
    }
    if (setup.new_only) pr.kind = row_error::infinite_kl;
    return pr;
  };
  detail::cpu::throw_first_problem(fn, policy.threads, p_logits.rows, 2 * size, problem,
                                   &detail::throw_row_problem);

  detail::cpu::parallel_for(policy.threads, p_logits.rows, 8 * size, [&](std::size_t r) {
    const T* zp = p_logits.row(r);
    const T* zq = q_logits.row(r);
    detail::row_setup setup;
    detail::cpu::scan_pair(zp, zq, size, setup, "", "");
    detail::cpu::kl_backward_row(zp, zq, size, setup, static_cast<double>(grad_kl[r]),
                                 want_p ? grad_p.row(r) : nullptr, want_q ? grad_q.row(r) : nullptr);
  });
}

TROLL_END_NAMESPACE
