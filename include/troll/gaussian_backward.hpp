// troll/gaussian_backward.hpp — the analytic backward (VJP) of the Gaussian projections of
// troll/gaussian.hpp, by the implicit function theorem on KL(π_t* ‖ q) = ε: gradients w.r.t.
// the new and old means and covariance factors (or standard deviations) and the bounds. This
// header is the CPU backend; the entry points, one for every policy, are in gaussian_api.hpp.
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_backward_kernels.hpp"
#include "detail/cpu/gaussian_derivative_rows.hpp"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_api.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The CPU's rows of a Gaussian backward after its argument checks (gaussian_derivative_call.hpp).
template <>
struct gaussian_vjp_backend<cpu_policy> {
  template <class T>
  static void rows(cpu_policy policy, const gaussian_call& call, const gaussian_vjp_launch<T>& k,
                   gaussian::saved_factorisation<const double> saved) {
    cpu::gaussian_derivative_rows(
        policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.eps_mean, k.stats, saved, "backward",
        upstream_operands(call, k.grad_out_mean, k.grad_out_cov),
        [&](std::size_t r) { return vjp_row_io(k.out_cov, k.grad_out_mean, k.grad_out_cov, k.grads, r); },
        &cpu::gaussian_backward_full<T>, &cpu::gaussian_backward_diag<T>);
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
