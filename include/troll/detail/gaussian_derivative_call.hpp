// troll/detail/gaussian_derivative_call.hpp — the Gaussian backward (VJP) and JVP entry shared by
// the CPU and CUDA backends: the float-type check and every argument check that reads no row
// values (gaussian_checks.hpp), then the backend's rows: gaussian_vjp_backend<Policy>::rows /
// gaussian_jvp_backend<Policy>::rows (gaussian_backend.hpp), specialised for cpu_policy in
// gaussian_backward.hpp / gaussian_jvp.hpp and for cuda_policy in cuda_gaussian_derivatives.cuh.
#pragma once

#include "../batch.hpp"
#include "../config.hpp"
#include "../gaussian_types.hpp"
#include "gaussian_backend.hpp"
#include "gaussian_checks.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The views of a backward call after its checks (the CUDA kernels' launch argument as well).
template <class T>
struct gaussian_vjp_launch {
  batch_view<const T> mean, cov, old_mean, old_cov, out_mean, out_cov, grad_out_mean, grad_out_cov;
  const gaussian::gaussian_stats* stats;
  gaussian::gaussian_grads<T> grads;
  double eps_mean;
  bool split;
};

/// The views of a JVP call after its checks (the forward's out_cov travels beside it).
template <class T>
struct gaussian_jvp_launch {
  batch_view<const T> mean, cov, old_mean, old_cov;
  const gaussian::gaussian_stats* stats;
  gaussian::gaussian_tangents<T> tangents;
  batch_view<T> out_mean, out_cov;  // the tangents of μ* and of the covariance factor
  double eps_mean;
  bool split;
};

/// The VJP of the four Gaussian projections under `policy`, diagonal or full rows (call.full).
template <class Policy, class T>
void project_gaussian_backward(Policy policy, gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                               batch_view<const T> old_mean, batch_view<const T> old_cov, double eps_mean,
                               double eps_cov, batch_view<const T> out_mean, batch_view<const T> out_cov,
                               const gaussian::gaussian_stats* stats, batch_view<const T> grad_out_mean,
                               batch_view<const T> grad_out_cov, const gaussian::gaussian_grads<T>& grads,
                               gaussian::saved_factorisation<const double> saved = {}) {
  require_float_type<T>();
  call = check_backward_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, grad_out_mean, grad_out_cov,
                                  stats, eps_mean, eps_cov, grads, saved);
  const gaussian_vjp_launch<T> k{mean,          cov,   old_mean, old_cov, out_mean, out_cov, grad_out_mean,
                                 grad_out_cov,  stats, grads,    eps_mean, call.split};
  using base = execution_policy_base_t<Policy>;
  gaussian_vjp_backend<base>::rows(base(policy), call, k, saved);
}

/// The JVP of the four Gaussian projections under `policy`, diagonal or full rows (call.full).
template <class Policy, class T>
void project_gaussian_jvp(Policy policy, gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                          batch_view<const T> old_mean, batch_view<const T> old_cov, double eps_mean, double eps_cov,
                          batch_view<const T> out_mean, batch_view<const T> out_cov,
                          const gaussian::gaussian_stats* stats, const gaussian::gaussian_tangents<T>& tangents,
                          batch_view<T> tangent_out_mean, batch_view<T> tangent_out_cov,
                          gaussian::saved_factorisation<const double> saved = {}) {
  require_float_type<T>();
  call = check_jvp_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, tangent_out_mean,
                             tangent_out_cov, stats, eps_mean, eps_cov, tangents, saved);
  const gaussian_jvp_launch<T> k{mean,     cov,           old_mean,        old_cov, stats, tangents,
                                 tangent_out_mean, tangent_out_cov, eps_mean, call.split};
  using base = execution_policy_base_t<Policy>;
  gaussian_jvp_backend<base>::rows(base(policy), call, k, out_cov, saved);
}

}  // namespace detail
TROLL_END_NAMESPACE
