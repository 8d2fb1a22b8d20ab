// troll/detail/tilt_derivatives.hpp — ∂t*/∂z°_j, the one derivative of the projection that needs
// care in floating point, as one host/device function: the CPU Jacobian, the CUDA backward, JVP,
// Jacobian and sparse backward all call it, and cpu::dt_dold_block is its block form.
//
//   ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²),   d = z̃ − z°, at t = t*.
//
// At small ε the bracket nearly cancels: π_j − q_j ≈ t π_j (d_j − μ), and the bracket is O(t²)
// of π_j while its two terms are O(t). Where π ≈ q (|log π_j/q_j| < 1/2) the bracket is therefore
// formed from the log-ratio x = log(π_j/q_j) = t c_j + KL(π‖q) (c_j = d_j − μ), known in double
// from the statistics — never from a π read back from a (float) log π*, whose relative error of
// ~6e-8 would become ~6e-8/t of the derivative — and with its O(t) parts cancelled by hand: with
// y = (1 − t) t c_j, π_j = q_j e^x and e^x = 1 + x + φ(x), φ(x) = expm1(x) − x,
//
//   bracket / q_j = y e^x − expm1(x) = −(t·t c_j + KL) + y (x + φ(x)) − φ(x),
//
// every term O(t²). (Forming q_j e^x and q_j expm1(x) and subtracting, as before the thirty-fourth
// session, left ~ulp·t c_j of noise in an O(t² c_j) result: relative error ~1e-16/t, which a
// large Σ g (d − μ) — a row whose far tokens carry little mass but large d − μ — turned into
// O(1) errors of grad_old at ε ≤ 1e-100.)
#pragma once

#include <cmath>
#include <cstddef>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// 1 − t* of a row's statistics: η·t where t > 1/2 and η agrees with t (the forward forms η from
/// the exact 1 − t*, so this stays accurate where t* is within a rounding of 1 and s.t itself is
/// 1; an old row that all but masks a token with a huge finite logit), else 1 − t (no
/// cancellation below 1/2; statistics made by hand without η).
TROLL_HOST_DEVICE inline double one_minus_t(const projection_stats& s) {
  const double rest = 1.0 - s.t;
  if (!(s.t > 0.5)) return rest;
  const double from_eta = s.eta * s.t;
  return ::fabs(from_eta - rest) <= 0x1p-52 ? from_eta : rest;
}

/// The dominant token of a projected row (π ≥ 1/2: the largest log π*, the lowest index on ties)
/// and the sum of the row's other old-side derivative entries. That token's own ∂t/∂z° is a
/// difference of O(1) quantities of the row (d_k − μ and log(π_k/q_k) both vanish with the other
/// tokens' mass) whose rounding, ~1e-16, can exceed its true size where the other tokens carry
/// tiny masses, while the entries of ∂L/∂z° (and of each row of ∂log π*/∂z°) sum to exactly 0: a
/// shift of every old logit leaves π* alone. So its entry is taken as minus the others' sum
/// (top_entry()), which never adds the dominant token's own value.
struct old_side_sums {
  double others = 0.0;  // the sum of every entry but the dominant token's
  double top_log_pi = -0.6931471805599453;  // log(1/2): no token below it is dominant
  std::size_t top = ~std::size_t(0);
  double top_value = 0.0;

  /// Token i with log π* = log_pi and old-side entry `value`.
  TROLL_HOST_DEVICE void add(std::size_t i, double log_pi, double value) {
    if (log_pi > top_log_pi || (log_pi == top_log_pi && i < top)) {
      if (found()) others += top_value;
      top_log_pi = log_pi, top = i, top_value = value;
    } else {
      others += value;
    }
  }
  /// The sums of two disjoint parts of the row.
  TROLL_HOST_DEVICE friend old_side_sums operator+(old_side_sums a, const old_side_sums& b) {
    const bool take_b = b.top_log_pi > a.top_log_pi || (b.top_log_pi == a.top_log_pi && b.top < a.top);
    a.others += b.others;
    if (take_b) {
      if (a.found()) a.others += a.top_value;
      a.top_log_pi = b.top_log_pi, a.top = b.top, a.top_value = b.top_value;
    } else if (b.found()) {
      a.others += b.top_value;
    }
    return a;
  }
  TROLL_HOST_DEVICE bool found() const { return top != ~std::size_t(0); }
  /// The dominant token's entry: minus the sum of the others'.
  TROLL_HOST_DEVICE double top_entry() const { return 0.0 - others; }  // +0, not −0, when the others are
};

/// ∂t/∂z°_j of a projected row. `pi` = π_j as read from log π* and `centred` = d_j − μ, both 0
/// off the support J of π; `q` = q_j (0 where z°_j = −inf).
TROLL_HOST_DEVICE inline double dt_dold(bool on_support, double pi, double centred, double q,
                                        const projection_stats& s) {
  const double t = s.t, rest = one_minus_t(s);
  if (!on_support) return -q / (t * s.sigma2);  // π_j = 0: the bracket is q_j
  const double tc = t * centred;
  const double log_ratio = tc + s.kl_after;  // x = log(π_j / q_j)
  if (::fabs(log_ratio) < 0.5) {
    const double phi = expm1_minus_x(log_ratio);
    const double bracket = q * ((rest * tc * (log_ratio + phi) - phi) - (t * tc + s.kl_after));
    return -bracket / (t * s.sigma2);
  }
  return -(rest * t * pi * centred - (pi - q)) / (t * s.sigma2);
}

/// The unit of the last place at 1 (machine epsilon) of the type a row's log π* is stored in:
/// what the centring's noise estimate scales with. float and double only.
template <class T>
TROLL_HOST_DEVICE constexpr double storage_epsilon() {
  return sizeof(T) == sizeof(float) ? 0x1p-23 : 0x1p-52;
}

/// The re-centring of d − μ shared by every derivative of the projection, CPU and CUDA (the
/// "Centring" note at the top of detail/cpu/backward_kernels.hpp): μ arrives in absolute units,
/// so c_j = d_j − μ as rounded can lose the dominant token's true value on nearly one-hot rows
/// with large logits. m = Σ_J π_j c_j (0 in exact arithmetic) is subtracted from every c_j where
/// it exceeds twice its own noise, ulp_T · Σ_J |π_j c_j| (1 − log π_j) (π read back from log π*
/// stored in T). Sums linear in c are corrected afterwards: Σ g (c − m) = Σ g c − m Σ g.
struct centring_sums {
  double m = 0.0;       ///< Σ_J π c
  double spread = 0.0;  ///< Σ_J |π c| (1 − log π)

  /// One token of J: π_j, c_j = d_j − μ, log π_j.
  TROLL_HOST_DEVICE void add(double pi, double centred, double log_pi) {
    const double pc = pi * centred;
    m += pc;
    spread += ::fabs(pc) * (1.0 - log_pi);
  }
  /// The sums of two disjoint parts of J (the reductions' merge).
  TROLL_HOST_DEVICE friend centring_sums operator+(centring_sums a, const centring_sums& b) {
    a.m += b.m;
    a.spread += b.spread;
    return a;
  }
  /// m where it exceeds twice its noise (log π* stored in T), else 0.
  template <class T>
  TROLL_HOST_DEVICE double step() const {
    const double noise = storage_epsilon<T>() * spread;
    return ::fabs(m) > 2.0 * noise ? m : 0.0;
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
