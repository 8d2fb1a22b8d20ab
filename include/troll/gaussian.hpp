// troll/gaussian.hpp — the trust-region projection for Gaussians (math.md §6, docs/gaussian.md),
// the second family of troll's one solver: for a batch of N pairs (new N(μ̃, Σ̃), old N(μ°, Σ°))
// of dimension d,
//   joint:  π* = argmin KL(π ‖ p̃) s.t. KL(π ‖ q) ≤ ε, the natural-parameter interpolation
//           Λ* = tΛ̃ + (1 − t)Λ°, h* = t h̃ + (1 − t) h°, t the root of KL(π_t ‖ q) = ε;
//   split:  the mean μ* = (μ̃ + ω μ°)/(1 + ω) against ε_μ in closed form, the covariance
//           Λ* = tΛ̃ + (1 − t)Λ° against ε_Σ (the trust-region layers of Otto et al., 2021).
// Covariances come as row-major d×d lower-triangular Cholesky factors (N × d² views) or, in the
// _diag variants, as standard deviations (N × d). Policy first, like troll::project:
//   troll::gaussian::project_joint(troll::cpu, mean, chol, old_mean, old_chol, eps, out_mean,
//                                  out_chol, stats);
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_kernels.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/gaussian_checks.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_projections.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The projection of one validated Gaussian row pair: factorise, solve, write, return the stats.
template <class T>
gaussian::gaussian_stats project_gaussian_row(const gaussian_call& call, const T* mean, const T* cov,
                                              const T* old_mean, const T* old_cov, double eps_mean,
                                              double eps_cov, const projection_options& opt, T* out_mean,
                                              T* out_cov) {
  const std::size_t d = call.dim;
  cpu::gaussian_basis basis;
  if (call.full) {
    cpu::factor_full(mean, cov, old_mean, old_cov, d, basis);
  } else {
    cpu::factor_diag(mean, cov, old_mean, old_cov, d, basis);
  }
  gaussian::gaussian_stats stats;
  if (call.split) {
    const double m = 0.5 * basis.b.squaredNorm();
    const double kappa = split_mean_scale(m, eps_mean);
    stats.mean_kl_before = m;
    stats.mean_kl_after = kappa < 1.0 ? eps_mean : m;
    stats.omega = kappa < 1.0 ? 1.0 / kappa - 1.0 : 0.0;
    for (std::size_t i = 0; i < d; ++i) {
      const double mo = static_cast<double>(old_mean[i]);
      out_mean[i] = kappa < 1.0 ? static_cast<T>(mo + kappa * (static_cast<double>(mean[i]) - mo)) : mean[i];
    }
  }
  const gaussian_solve_result r = solve_gaussian(basis.spectrum(!call.split), call.split ? eps_cov : eps_mean, opt);
  stats.status = r.status;
  stats.kl_before = r.kl_before;
  stats.iterations = r.iterations;
  if (r.status == row_status::inactive) {
    stats.kl_after = r.kl_before;
    const std::size_t cov_size = call.full ? d * d : d;
    for (std::size_t i = 0; i < cov_size; ++i) out_cov[i] = cov[i];
    if (!call.split)
      for (std::size_t i = 0; i < d; ++i) out_mean[i] = mean[i];
    return stats;
  }
  stats.t = r.point.t;
  stats.eta = r.point.s / r.point.t;
  stats.kl_after = r.point.kl;
  stats.fisher = r.point.sigma2;
  const cpu::gaussian_member_coords coords = cpu::member_coords(basis, r.point.t);
  cpu::write_member_cov(basis, coords, out_cov);
  if (!call.split) cpu::write_member_mean(basis, coords, old_mean, out_mean);
  return stats;
}

template <class T>
void project_gaussian(cpu_policy policy, const gaussian_call& call, const gaussian_projection_args<T>& a) {
  require_float_type<T>();
  const gaussian_call c = check_projection_arguments(call, a);
  validate_gaussian_rows(policy.threads, c, a.mean, a.cov, a.old_mean, a.old_cov);
  const std::size_t work = c.full ? 40 * c.dim * c.dim * c.dim : 40 * c.dim;
  cpu::parallel_for(policy.threads, a.mean.rows, work, [&](std::size_t r) {
    a.stats[r] = project_gaussian_row(c, a.mean.row(r), a.cov.row(r), a.old_mean.row(r), a.old_cov.row(r), a.eps_mean,
                                      a.eps_cov, a.options, a.out_mean.row(r), a.out_cov.row(r));
  });
}

template <class T>
void gaussian_kl(cpu_policy policy, const gaussian_call& call, batch_view<const T> mean, batch_view<const T> cov,
                 batch_view<const T> old_mean, batch_view<const T> old_cov, double* out) {
  require_float_type<T>();
  const gaussian_call c = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, mean, cov);
  if (out == nullptr && mean.rows != 0) throw_shape(c.function, "out is a null pointer");
  validate_gaussian_rows(policy.threads, c, mean, cov, old_mean, old_cov);
  const std::size_t work = c.full ? 40 * c.dim * c.dim * c.dim : 40 * c.dim;
  cpu::parallel_for(policy.threads, mean.rows, work, [&](std::size_t r) {
    cpu::gaussian_basis basis;
    if (c.full) {
      cpu::factor_full(mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), c.dim, basis);
    } else {
      cpu::factor_diag(mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), c.dim, basis);
    }
    out[r] = gaussian_member(basis.spectrum(true), tilt_near_one(0.0)).kl;
  });
}

/// The CPU backend of the four Gaussian projections (troll/gaussian_projections.hpp).
template <>
struct gaussian_backend<cpu_policy> {
  template <class T>
  static void project(cpu_policy policy, const gaussian_call& call, const gaussian_projection_args<T>& args) {
    project_gaussian(policy, call, args);
  }
};

}  // namespace detail

namespace gaussian {

/// KL(N(mean, LLᵀ) ‖ N(old_mean, L°L°ᵀ)) per row, into out[r] (double), from the same
/// factorisation as the projection (O(d³) per row).
template <class T>
void kl(cpu_policy policy, batch_view<const T> mean, batch_view<const T> cov_chol, batch_view<const T> old_mean,
        batch_view<const T> old_cov_chol, double* out) {
  detail::gaussian_kl(policy, detail::gaussian_call{"gaussian::kl", true, false}, mean, cov_chol, old_mean,
                      old_cov_chol, out);
}

/// kl for diagonal covariances given as standard deviations.
template <class T>
void kl_diag(cpu_policy policy, batch_view<const T> mean, batch_view<const T> std_dev,
             batch_view<const T> old_mean, batch_view<const T> old_std_dev, double* out) {
  detail::gaussian_kl(policy, detail::gaussian_call{"gaussian::kl_diag", false, false}, mean, std_dev, old_mean,
                      old_std_dev, out);
}

}  // namespace gaussian
TROLL_END_NAMESPACE

#include "gaussian_backward.hpp"
#include "gaussian_jvp.hpp"
