// troll/gaussian_jvp.hpp — the analytic JVP (forward-mode derivative) of the Gaussian projections
// of troll/gaussian.hpp, by the implicit function theorem on KL(π_t* ‖ q) = ε: the tangent of
// the projected mean and covariance factor (or standard deviations) along tangents of all inputs
// and the bounds. This header is the CPU backend; the entry points, one for every policy, are in
// gaussian_api.hpp.
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_jvp_kernels.hpp"
#include "detail/cpu/gaussian_derivative_rows.hpp"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_api.hpp"
#include "gaussian_backward.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// The CPU's rows of a Gaussian JVP after its argument checks (gaussian_derivative_call.hpp);
/// out_cov: the forward's output factor (read).
template <>
struct gaussian_jvp_backend<cpu_policy> {
  template <class T>
  static void rows(cpu_policy policy, const gaussian_call& call, const gaussian_jvp_launch<T>& k,
                   batch_view<const T> out_cov, gaussian::saved_factorisation<const double> saved) {
    cpu::gaussian_derivative_rows(
        policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.eps_mean, k.stats, saved, "JVP",
        tangent_operands(call, k.tangents),
        [&](std::size_t r) { return jvp_row_io(out_cov, k.tangents, k.out_mean, k.out_cov, r); },
        &cpu::gaussian_jvp_full<T>, &cpu::gaussian_jvp_diag<T>);
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
