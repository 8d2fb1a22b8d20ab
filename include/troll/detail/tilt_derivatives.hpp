// troll/detail/tilt_derivatives.hpp — ∂t*/∂z°_j, the one derivative of the projection that needs
// care in floating point, as one host/device function: the CPU Jacobian, the CUDA backward, JVP,
// Jacobian and sparse backward all call it, and cpu::dt_dold_block is its block form.
//
//   ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²),   d = z̃ − z°, at t = t*.
//
// At small ε the bracket nearly cancels: π_j − q_j ≈ t π_j (d_j − μ), and the bracket is O(t²)
// of π_j. Where π ≈ q (|log π_j/q_j| < 1/2) both π_j − q_j and π_j are therefore formed from the
// log-ratio log(π_j/q_j) = t(d_j − μ) + KL(π‖q), known in double from the statistics, as
// q_j·expm1(·) and q_j + that — never from a π read back from a (float) log π*, whose relative
// error of ~6e-8 would become ~6e-8/t of the derivative.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "../projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// ∂t/∂z°_j of a projected row. `pi` = π_j as read from log π* and `centred` = d_j − μ, both 0
/// off the support J of π; `q` = q_j (0 where z°_j = −inf).
TROLL_HOST_DEVICE inline double dt_dold(bool on_support, double pi, double centred, double q,
                                        const projection_stats& s) {
  const double t = s.t;
  if (!on_support) return -q / (t * s.sigma2);  // π_j = 0: the bracket is q_j
  const double log_ratio = t * centred + s.kl_after;  // log(π_j / q_j)
  double pi_minus_q = pi - q;
  if (::fabs(log_ratio) < 0.5) {
    pi_minus_q = q * ::expm1(log_ratio);
    pi = q + pi_minus_q;
  }
  return -((1.0 - t) * t * pi * centred - pi_minus_q) / (t * s.sigma2);
}

}  // namespace detail
TROLL_END_NAMESPACE
