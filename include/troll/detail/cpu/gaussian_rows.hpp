// troll/detail/cpu/gaussian_rows.hpp — the Gaussian projections' row loop on the CPU (factorise,
// solve, write one validated row pair), kept out of the public <troll/gaussian.hpp>. Host-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../arguments.hpp"
#include "gaussian_kernels.hpp"
#include "parallel.hpp"
#include "../gaussian_backend.hpp"
#include "../gaussian_checks.hpp"
#include "../gaussian_forward_call.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../../gaussian_api.hpp"
#include "../../gaussian_types.hpp"
#include "../../projection_types.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// The projection of one validated Gaussian row pair: factorise, solve, write, return the stats.
template <class T>
gaussian::gaussian_stats project_gaussian_row(const gaussian_call& call, const T* mean, const T* cov,
                                              const T* old_mean, const T* old_cov, double eps_mean,
                                              double eps_cov, const projection_options& opt, T* out_mean,
                                              T* out_cov, double* saved = nullptr) {
  const std::size_t d = call.dim;
  cpu::gaussian_basis basis;
  if (call.full) {
    cpu::factor_full(mean, cov, old_mean, old_cov, d, basis);
    if (saved != nullptr) cpu::save_basis(basis, saved);
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
  const gaussian_solve_result r = solve_gaussian(basis.forward_spectrum(!call.split), call.split ? eps_cov : eps_mean, opt);
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
  const cpu::gaussian_member_coords coords = cpu::forward_member_coords(basis, r.point.t, r.point.s);
  cpu::write_member_cov(basis, coords, out_cov);
  if (!call.split) cpu::write_member_mean(basis, coords, old_mean, out_mean);
  return stats;
}

/// The rows of a projection after its argument checks (gaussian_forward_call.hpp).
template <class T>
void project_gaussian(cpu_policy policy, const gaussian_call& c, const gaussian_forward_launch<T>& k) {
  validate_gaussian_rows(policy.threads, c, k.mean, k.cov, k.old_mean, k.old_cov);
  const std::size_t work = c.full ? 40 * c.dim * c.dim * c.dim : 40 * c.dim;
  cpu::parallel_for(policy.threads, k.mean.rows, work, [&](std::size_t r) {
    k.stats[r] = project_gaussian_row(c, k.mean.row(r), k.cov.row(r), k.old_mean.row(r), k.old_cov.row(r),
                                      k.eps_mean, k.eps_cov, k.options, k.out_mean.row(r), k.out_cov.row(r),
                                      k.saved.data == nullptr ? nullptr : k.saved.row(r));
  });
}

/// KL(p̃ ‖ q) of a full row pair that cpu::factor_full cannot form (gaussian_full_factor_reach:
/// a subnormal old diagonal, or Σ°⁻¹Σ̃ beyond the doubles), by the closed form
///     ½ [‖M‖²_F − d − 2 Σ log M_ii + ‖L°⁻¹(μ̃ − μ°)‖²],   M = L°⁻¹L̃,
/// in long double (no overflow before the result, which rounds to +inf only where it is beyond
/// the doubles); NaN for a row the factorisation can form (the caller's usual route, accurate
/// also where this sum cancels: M near I).
template <class T>
double gaussian_full_kl_direct(const T* mean, const T* chol, const T* old_mean, const T* old_chol, std::size_t d) {
  if (gaussian_full_factor_reach(chol, old_chol, d).fine()) return quiet_nan();  // no allocation up to d = 64
  std::vector<double> m(d * d);
  gaussian_full_factor_reach(chol, old_chol, d, m.data());
  long double sum = -static_cast<long double>(d);
  for (std::size_t i = 0; i < d; ++i) {
    for (std::size_t j = 0; j <= i; ++j) sum += static_cast<long double>(m[i * d + j]) * m[i * d + j];
    // log M_ii = log L̃_ii − log L°_ii: no overflow of the ratio
    sum -= 2.0L * (std::log(static_cast<long double>(chol[i * d + i])) -
                   std::log(static_cast<long double>(old_chol[i * d + i])));
  }
  std::vector<long double> y(d);
  for (std::size_t i = 0; i < d; ++i) {
    long double v = static_cast<long double>(mean[i]) - static_cast<long double>(old_mean[i]);
    for (std::size_t k = 0; k < i; ++k) v -= static_cast<long double>(old_chol[i * d + k]) * y[k];
    y[i] = v / static_cast<long double>(old_chol[i * d + i]);
    sum += y[i] * y[i];
  }
  const long double kl = 0.5L * sum;
  return kl > static_cast<long double>(largest_finite<double>()) ? inf() : static_cast<double>(kl < 0.0L ? 0.0L : kl);
}

/// The rows of gaussian::kl / kl_diag after their argument checks.
template <class T>
void gaussian_kl(cpu_policy policy, const gaussian_call& c, batch_view<const T> mean, batch_view<const T> cov,
                 batch_view<const T> old_mean, batch_view<const T> old_cov, double* out) {
  validate_gaussian_rows(policy.threads, c, mean, cov, old_mean, old_cov);
  const std::size_t work = c.full ? 40 * c.dim * c.dim * c.dim : 40 * c.dim;
  cpu::parallel_for(policy.threads, mean.rows, work, [&](std::size_t r) {
    cpu::gaussian_basis basis;
    double beyond_kl = 0.0;  // coordinates beyond the doubles, exactly (gaussian_diag_beyond_kl)
    if (c.full) {
      const double direct = gaussian_full_kl_direct(mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), c.dim);
      if (direct == direct) {  // a row the factorisation cannot form: its closed form
        out[r] = direct;
        return;
      }
      cpu::factor_full(mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), c.dim, basis);
      if (std::any_of(basis.g.data(), basis.g.data() + basis.g.size(), gaussian_full_kl_from_determinant)) {
        // A tiny eigenvalue: the log-determinant from the diagonals (exact).
        const T *l = cov.row(r), *lo = old_cov.row(r);
        const double* gamma = basis.gamma.size() == basis.g.size() ? basis.gamma.data() : nullptr;
        double kl_sum = 0.0;
        for (std::size_t i = 0; i < c.dim; ++i) {
          const auto k = static_cast<Eigen::Index>(i);
          kl_sum += gaussian_full_beyond_kl(gaussian_full_lambda(basis.g[k], gamma, static_cast<int>(i)), basis.b[k],
                                            static_cast<double>(l[i * c.dim + i]),
                                            static_cast<double>(lo[i * c.dim + i]));
        }
        out[r] = gaussian_kl_result(kl_sum);
        return;
      }
    } else {
      const T *m = mean.row(r), *sd = cov.row(r), *om = old_mean.row(r), *osd = old_cov.row(r);
      cpu::factor_diag(m, sd, om, osd, c.dim, basis);
      for (std::size_t i = 0; i < c.dim; ++i) {
        const double s = static_cast<double>(sd[i]), so = static_cast<double>(osd[i]);
        if (!gaussian_diag_beyond(s, so)) continue;
        beyond_kl += gaussian_diag_beyond_kl(static_cast<double>(m[i]), s, static_cast<double>(om[i]), so);
        basis.g[static_cast<Eigen::Index>(i)] = basis.b[static_cast<Eigen::Index>(i)] = 0.0;  // adds 0 below
      }
    }
    const double kl = gaussian_member(basis.forward_spectrum(true), tilt_near_one(0.0)).kl;
    out[r] = gaussian_kl_result(beyond_kl == 0.0 ? kl : kl + beyond_kl);
  });
}

/// The CPU backend of the Gaussian entry points of gaussian_api.hpp (no limit on d).
template <>
struct gaussian_backend<cpu_policy> {
  static void check_dim(const gaussian_call&) {}
  template <class... Args>
  static void project(const Args&... args) {
    project_gaussian(args...);
  }
  template <class... Args>
  static void kl(const Args&... args) {
    gaussian_kl(args...);
  }
};

}  // namespace detail

TROLL_END_NAMESPACE
