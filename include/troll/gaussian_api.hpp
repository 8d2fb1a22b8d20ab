// troll/gaussian_api.hpp — the public Gaussian entry points, written once for both backends:
// the projections and KL (math.md §6, docs/gaussian.md), their backward (VJP) and JVP. Each is a
// template over the execution policy (troll::cpu, troll::cuda.on(stream), ...: any type with
// is_execution_policy) that checks nothing itself and forwards to the policy's backend
// (detail/gaussian_backend.hpp): the CPU's in gaussian.hpp / gaussian_backward.hpp /
// gaussian_jvp.hpp, the device's in cuda_gaussian.cuh (nvcc). Include those, not this header: a
// policy whose backend header is missing stops the build with a static_assert naming it. Under
// troll::cuda every view, `stats`, `out`, `saved` and the bound-gradient arrays are device memory
// (limits on d and the workspace: cuda_gaussian.cuh).
#pragma once

#include "batch.hpp"
#include "config.hpp"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "detail/gaussian_forward_call.hpp"
#include "execution.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace gaussian {

/// Projects each new Gaussian N(mean, LLᵀ) onto the ball KL(· ‖ N(old_mean, L°L°ᵀ)) ≤ eps (joint
/// bound) and writes the projected mean and Cholesky factor, and one gaussian_stats per row.
/// Rows already inside the ball are copied bit for bit. `saved` (optional, caller-owned: see
/// gaussian_types.hpp) receives each row's factorisation for project_joint_backward / _jvp. Projected rows satisfy
/// |KL(π* ‖ q) − ε| ≤ atol + rtol·ε of the options, KL evaluated in double on the factorised row.
///
/// Shapes: means N × d, factors N × d² (row-major, lower-triangular: the strict upper triangle
/// must be 0 and the diagonal > 0). Throws, before writing anything: shape_error (shapes, null
/// pointers, d = 0), domain_error (a non-finite entry, a factor that is not lower-triangular
/// with a positive diagonal, naming the row and entry; eps ≤ 0 or not finite; bad options).
/// Under troll::cuda a rejected row is written as NaN with status rejected (and leaves `saved`
/// untouched) unless the policy is .checked().
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                   input_view<T> old_cov_chol, double eps, batch_view<T> out_mean, batch_view<T> out_cov_chol,
                   gaussian_stats* stats, const projection_options& options = {},
                   saved_factorisation<double> saved = {}) {
  detail::project_gaussian_forward(policy, detail::gaussian_call{"gaussian::project_joint", true, false},
                                   mean, cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol,
                                   stats, options, saved);
}

/// The split projection: the mean against eps_mean (closed form, Σ°'s metric), the covariance
/// against eps_cov (½[tr(Σ°⁻¹Σ) − d + log det Σ° − log det Σ] ≤ ε_Σ, by the solve). Shapes and
/// errors as project_joint.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                   input_view<T> old_cov_chol, double eps_mean, double eps_cov, batch_view<T> out_mean,
                   batch_view<T> out_cov_chol, gaussian_stats* stats, const projection_options& options = {},
                   saved_factorisation<double> saved = {}) {
  detail::project_gaussian_forward(policy, detail::gaussian_call{"gaussian::project_split", true, true},
                                   mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean,
                                   out_cov_chol, stats, options, saved);
}

/// project_joint for diagonal covariances given as standard deviations (N × d, all > 0): O(d)
/// per row.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint_diag(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                        input_view<T> old_std_dev, double eps, batch_view<T> out_mean, batch_view<T> out_std_dev,
                        gaussian_stats* stats, const projection_options& options = {}) {
  detail::project_gaussian_forward(policy,
                                   detail::gaussian_call{"gaussian::project_joint_diag", false, false}, mean,
                                   std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev, stats,
                                   options, saved_factorisation<double>{});
}

/// project_split for diagonal covariances given as standard deviations.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split_diag(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                        input_view<T> old_std_dev, double eps_mean, double eps_cov, batch_view<T> out_mean,
                        batch_view<T> out_std_dev, gaussian_stats* stats, const projection_options& options = {}) {
  detail::project_gaussian_forward(policy,
                                   detail::gaussian_call{"gaussian::project_split_diag", false, true}, mean,
                                   std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev,
                                   stats, options, saved_factorisation<double>{});
}

/// KL(N(mean, LLᵀ) ‖ N(old_mean, L°L°ᵀ)) per row, into out[r] (double), from the same
/// factorisation as the projection (O(d³) per row).
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void kl(Policy policy, batch_view<const T> mean, batch_view<const T> cov_chol, batch_view<const T> old_mean,
        batch_view<const T> old_cov_chol, double* out) {
  detail::gaussian_kl_forward(policy, detail::gaussian_call{"gaussian::kl", true, false, 0, true}, mean, cov_chol,
                              old_mean, old_cov_chol, out);
}

/// kl for diagonal covariances given as standard deviations.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void kl_diag(Policy policy, batch_view<const T> mean, batch_view<const T> std_dev, batch_view<const T> old_mean,
             batch_view<const T> old_std_dev, double* out) {
  detail::gaussian_kl_forward(policy, detail::gaussian_call{"gaussian::kl_diag", false, false, 0, true}, mean,
                              std_dev, old_mean, old_std_dev, out);
}

/// kl with views of non-const (or mixed) elements, as make_batch gives them for a std::vector's
/// data(): the output is double, so nothing else names T (the projections deduce it from their
/// outputs).
template <class A, class B, class C, class D, class Policy, detail::if_execution_policy<Policy> = 0,
          detail::if_same_elements<A, B, C, D> = 0>
void kl(Policy policy, batch_view<A> mean, batch_view<B> cov_chol, batch_view<C> old_mean, batch_view<D> old_cov_chol,
        double* out) {
  using T = std::remove_const_t<A>;
  kl<T>(policy, input_view<T>(mean), input_view<T>(cov_chol), input_view<T>(old_mean), input_view<T>(old_cov_chol),
        out);
}

/// kl_diag with views of non-const (or mixed) elements (see kl).
template <class A, class B, class C, class D, class Policy, detail::if_execution_policy<Policy> = 0,
          detail::if_same_elements<A, B, C, D> = 0>
void kl_diag(Policy policy, batch_view<A> mean, batch_view<B> std_dev, batch_view<C> old_mean,
             batch_view<D> old_std_dev, double* out) {
  using T = std::remove_const_t<A>;
  kl_diag<T>(policy, input_view<T>(mean), input_view<T>(std_dev), input_view<T>(old_mean), input_view<T>(old_std_dev),
             out);
}

/// The VJP of project_joint: given the forward's inputs, outputs and stats and the upstream
/// gradients ∂L/∂μ* and ∂L/∂L* (lower triangle read), writes ∂L/∂ of every input named in
/// `grads` (factor gradients lower-triangular) and ∂L/∂ε per row. Rows must be solved (inactive
/// or projected); a not_converged row throws domain_error naming it, before anything is written.
/// O(d³) per row; `saved` (optional): the factorisation the forward of these inputs saved
/// (gaussian_types.hpp), read instead of recomputed.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint_backward(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads,
                            saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_joint_backward", true, false},
                                    mean, cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol, stats,
                                    grad_out_mean, grad_out_cov_chol, grads, saved);
}

/// The VJP of project_split (grads.eps: ∂L/∂ε_Σ, grads.eps_mean: ∂L/∂ε_μ).
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split_backward(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                            input_view<T> old_cov_chol, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_cov_chol, const gaussian_stats* stats, input_view<T> grad_out_mean,
                            input_view<T> grad_out_cov_chol, const gaussian_grads<T>& grads,
                            saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_backward(policy, detail::gaussian_call{"gaussian::project_split_backward", true, true},
                                    mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean, out_cov_chol,
                                    stats, grad_out_mean, grad_out_cov_chol, grads, saved);
}

/// The VJP of project_joint_diag (standard deviations; O(d) per row).
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint_diag_backward(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                                 input_view<T> old_std_dev, double eps, input_view<T> out_mean,
                                 input_view<T> out_std_dev, const gaussian_stats* stats, input_view<T> grad_out_mean,
                                 input_view<T> grad_out_std_dev, const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy,
                                    detail::gaussian_call{"gaussian::project_joint_diag_backward", false, false},
                                    mean, std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev, stats,
                                    grad_out_mean, grad_out_std_dev, grads);
}

/// The VJP of project_split_diag.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split_diag_backward(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                                 input_view<T> old_std_dev, double eps_mean, double eps_cov, input_view<T> out_mean,
                                 input_view<T> out_std_dev, const gaussian_stats* stats, input_view<T> grad_out_mean,
                                 input_view<T> grad_out_std_dev, const gaussian_grads<T>& grads) {
  detail::project_gaussian_backward(policy,
                                    detail::gaussian_call{"gaussian::project_split_diag_backward", false, true},
                                    mean, std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev,
                                    stats, grad_out_mean, grad_out_std_dev, grads);
}

/// The JVP of project_joint: given the forward's inputs, outputs and stats and the input
/// tangents (tangents.eps: ε'), writes the tangents of μ* and L* (lower-triangular). Rows must
/// be solved; a not_converged row throws domain_error naming it, before anything is written.
/// O(d³) per row.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint_jvp(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                       input_view<T> old_cov_chol, double eps, input_view<T> out_mean, input_view<T> out_cov_chol,
                       const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                       batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov_chol,
                       saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_joint_jvp", true, false}, mean,
                               cov_chol, old_mean, old_cov_chol, eps, eps, out_mean, out_cov_chol, stats, tangents,
                               tangent_out_mean, tangent_out_cov_chol, saved);
}

/// The JVP of project_split (tangents.eps: ε_Σ', tangents.eps_mean: ε_μ').
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split_jvp(Policy policy, input_view<T> mean, input_view<T> cov_chol, input_view<T> old_mean,
                       input_view<T> old_cov_chol, double eps_mean, double eps_cov, input_view<T> out_mean,
                       input_view<T> out_cov_chol, const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                       batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov_chol,
                       saved_factorisation<const double> saved = {}) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_split_jvp", true, true}, mean,
                               cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, out_mean, out_cov_chol, stats,
                               tangents, tangent_out_mean, tangent_out_cov_chol, saved);
}

/// The JVP of project_joint_diag (standard deviations; O(d) per row).
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_joint_diag_jvp(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps, input_view<T> out_mean, input_view<T> out_std_dev,
                            const gaussian_stats* stats, const gaussian_tangents<T>& tangents,
                            batch_view<T> tangent_out_mean, batch_view<T> tangent_out_std_dev) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_joint_diag_jvp", false, false},
                               mean, std_dev, old_mean, old_std_dev, eps, eps, out_mean, out_std_dev, stats, tangents,
                               tangent_out_mean, tangent_out_std_dev);
}

/// The JVP of project_split_diag.
template <class T, class Policy, detail::if_execution_policy<Policy> = 0>
void project_split_diag_jvp(Policy policy, input_view<T> mean, input_view<T> std_dev, input_view<T> old_mean,
                            input_view<T> old_std_dev, double eps_mean, double eps_cov, input_view<T> out_mean,
                            input_view<T> out_std_dev, const gaussian_stats* stats,
                            const gaussian_tangents<T>& tangents, batch_view<T> tangent_out_mean,
                            batch_view<T> tangent_out_std_dev) {
  detail::project_gaussian_jvp(policy, detail::gaussian_call{"gaussian::project_split_diag_jvp", false, true},
                               mean, std_dev, old_mean, old_std_dev, eps_mean, eps_cov, out_mean, out_std_dev, stats,
                               tangents, tangent_out_mean, tangent_out_std_dev);
}

}  // namespace gaussian
TROLL_END_NAMESPACE
