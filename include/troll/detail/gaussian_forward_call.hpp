// troll/detail/gaussian_forward_call.hpp — the Gaussian projections' and KL's entry shared by the
// CPU and CUDA backends: the float-type check, every argument check that reads no row values
// (gaussian_checks.hpp), the backend's limit on d and the saved factorisation, in that order, then
// the backend's rows: gaussian_backend<Policy>::check_dim / project / kl (gaussian_backend.hpp),
// specialised for cpu_policy in gaussian.hpp and for cuda_policy in cuda_gaussian.cuh.
#pragma once

#include "../batch.hpp"
#include "../config.hpp"
#include "../gaussian_types.hpp"
#include "../projection_types.hpp"
#include "gaussian_backend.hpp"
#include "gaussian_checks.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The operands, bounds and options of a projection after its checks: what the backends' rows
/// read (the CUDA kernels' launch argument as well, cuda::gaussian_launch).
template <class T>
struct gaussian_forward_launch {
  batch_view<const T> mean, cov, old_mean, old_cov;
  batch_view<T> out_mean, out_cov;
  gaussian::gaussian_stats* stats;
  double eps_mean, eps_cov;
  projection_options options;
  bool split;
  gaussian::saved_factorisation<double> saved{};  ///< full rows: V, g, b written when not empty
};

/// The four Gaussian projections under `policy`, diagonal or full rows (call.full).
template <class Policy, class T>
void project_gaussian_forward(Policy policy, const gaussian_call& call, batch_view<const T> mean,
                              batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                              double eps_mean, double eps_cov, batch_view<T> out_mean, batch_view<T> out_cov,
                              gaussian::gaussian_stats* stats, const projection_options& opt,
                              gaussian::saved_factorisation<double> saved = {}) {
  require_float_type<T>();
  const gaussian_call c = check_projection_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, stats,
                                                     eps_mean, eps_cov, opt);
  using base = execution_policy_base_t<Policy>;
  gaussian_backend<base>::check_dim(c);
  check_saved_factorisation(c, mean.rows, saved);
  const gaussian_forward_launch<T> k{mean, cov, old_mean, old_cov, out_mean, out_cov, stats, eps_mean, eps_cov, opt,
                                    c.split, saved};
  gaussian_backend<base>::project(base(policy), c, k);
}

/// gaussian::kl / kl_diag under `policy`.
template <class Policy, class T>
void gaussian_kl_forward(Policy policy, const gaussian_call& call, batch_view<const T> mean, batch_view<const T> cov,
                         batch_view<const T> old_mean, batch_view<const T> old_cov, double* out) {
  require_float_type<T>();
  const gaussian_call c = check_kl_arguments(call, mean, cov, old_mean, old_cov, out);
  using base = execution_policy_base_t<Policy>;
  gaussian_backend<base>::check_dim(c);
  gaussian_backend<base>::kl(base(policy), c, mean, cov, old_mean, old_cov, out);
}

}  // namespace detail
TROLL_END_NAMESPACE
