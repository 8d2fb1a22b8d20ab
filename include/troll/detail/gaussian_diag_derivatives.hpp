// troll/detail/gaussian_diag_derivatives.hpp — the VJP and JVP of one diagonal Gaussian
// projection row (docs/gaussian.md, "Gradients"), coordinate by coordinate, written once for the
// CPU loop and the device's warps.
//
// With W = diag(σ°) every matrix of the implicit-function-theorem formulas (see
// cpu/gaussian_backward_kernels.hpp and cpu/gaussian_jvp_kernels.hpp) is diagonal, so a row is
// two passes over its coordinates: the first accumulates a few sums (m = ½Σb², the split mean's
// κ̄ or m', the IFT's t̄ or KL', and I(t)), the scalars of the row follow from them
// (…_finish), and the second pass writes every coordinate from its own inputs and those
// scalars. The host sums in coordinate order, the device in its warp order.
#pragma once

#include <cmath>
#include <cstddef>

#include "../config.hpp"
#include "gaussian_family.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// One coordinate of a diagonal row pair: the new and old mean and standard deviation.
struct gaussian_diag_entry {
  double mean = 0.0, std_dev = 1.0, old_mean = 0.0, old_std = 1.0;
};

/// Coordinate i of a diagonal row pair (the new and old means and standard deviations), in double.
template <class T>
TROLL_HOST_DEVICE gaussian_diag_entry diag_entry(const T* mean, const T* std_dev, const T* old_mean,
                                                 const T* old_std, std::size_t i) {
  return gaussian_diag_entry{static_cast<double>(mean[i]), static_cast<double>(std_dev[i]),
                             static_cast<double>(old_mean[i]), static_cast<double>(old_std[i])};
}

/// What a coordinate of the member at t needs, derived from the entry (t = 1: inactive).
struct gaussian_diag_member {
  double g = 0.0, b = 0.0;    // γ − 1 and (μ̃ − μ°)/σ°
  double gamma = 1.0;         // γ = (σ°/σ̃)², from the ratio itself where g < −½ (1 + g loses its digits)
  double po = 1.0;            // Λ° = 1/σ°²
  double ps = 0.0, pn = 1.0;  // Λ̃ − Λ° and Λ̃
  double a = 1.0;             // 1 + t g, or s + tγ where g < −½ (as the forward's member)
  double sigma = 1.0;         // Σ_t = σ°²/a
  double delta = 0.0;         // μ_t − μ° = σ° t γ b / a
};

// ---- Units ----------------------------------------------------------------------------------
//
// The intermediates of these formulas span powers −4 … 4 of a coordinate's scale (Σ_t², Λ̃²,
// Λ°²: the σ̄ of a row with standard deviations of 1e77 formed 1e308 and overflowed, one of
// 1e-78 underflowed, and the gradients came out inf or NaN while the forward was exact). A
// diagonal projection commutes with scaling each coordinate (KL is invariant under x ↦ Cx with
// C = diag(c)): out(x) = C·out(C⁻¹x), so its Jacobian is C·J(C⁻¹x)·C⁻¹. Every coordinate is
// therefore worked in units of c = 2^⌊log2 σ°⌋ (its old standard deviation in [1, 2)): the VJP
// takes the upstream gradients times c and returns the gradients divided by c, the JVP takes the
// tangents divided by c and returns its outputs times c. c is a power of two, so the scaling is
// exact and, where nothing over- or underflowed before, every result is bit for bit the same.

// ---- Relative means ----------------------------------------------------------------------------
//
// A projection commutes with a common shift of both means (out(μ̃ + a, μ° + a) = out(μ̃, μ°) + a
// on the mean, the standard deviation unchanged), so its derivatives do not depend on a. The
// formulas below carry the natural parameter h = Λμ, whose terms in μ° cancel only in exact
// arithmetic: worked with the means as given, a coordinate kept ~u·|μ°|/σ° of its derivatives'
// digits (2e-4 relative at μ° = 1e12, σ° = 1). Every coordinate is therefore worked with its old
// mean at 0 and its new mean at μ̃ − μ° — the difference the forward forms too (b = (μ̃ − μ°)/σ°,
// the same bits), as the full-covariance derivatives do.

/// The entry with its means relative to the old mean.
TROLL_HOST_DEVICE inline gaussian_diag_entry gaussian_diag_relative(const gaussian_diag_entry& e) {
  return gaussian_diag_entry{e.mean - e.old_mean, e.std_dev, 0.0, e.old_std};
}

/// The power-of-two unit of a coordinate (1 where the scaled entry would not be finite: a mean
/// far outside the standard deviations' range stays in its own units).
TROLL_HOST_DEVICE inline int gaussian_diag_unit(const gaussian_diag_entry& e) {
  if (!(e.old_std > 0.0 && e.old_std < inf())) return 0;
  const int k = ::ilogb(e.old_std);
  const double m = ::ldexp(e.mean, -k), om = ::ldexp(e.old_mean, -k), sd = ::ldexp(e.std_dev, -k);
  if (!(m - m == 0.0 && om - om == 0.0 && sd > 0.0 && sd < inf())) return 0;
  return k;
}

/// The entry in units of 2^k.
TROLL_HOST_DEVICE inline gaussian_diag_entry gaussian_diag_scaled(const gaussian_diag_entry& e, int k) {
  return gaussian_diag_entry{::ldexp(e.mean, -k), ::ldexp(e.std_dev, -k), ::ldexp(e.old_mean, -k),
                             ::ldexp(e.old_std, -k)};
}

/// A coordinate as every derivative works it: relative to its old mean, in units of 2^k.
struct gaussian_diag_units {
  gaussian_diag_entry entry;
  int k = 0;
};
TROLL_HOST_DEVICE inline gaussian_diag_units gaussian_diag_in_units(const gaussian_diag_entry& e) {
  const gaussian_diag_entry r = gaussian_diag_relative(e);
  const int k = gaussian_diag_unit(r);
  return gaussian_diag_units{gaussian_diag_scaled(r, k), k};
}

/// The member at (t, s), s = 1 − t exact (solved_gap): a new variance above twice the old (g <
/// −½) takes γ from the ratio and a = s + tγ, as the forward does (gaussian_precision_ratio), so
/// that a near t = 1 keeps the digits of a small γ (1 + tg kept only ~u/γ of them: the derivatives
/// at σ̃ = 1e6 σ° and 1 − t* = 1e-12 were 1.7e-5 off).
TROLL_HOST_DEVICE inline gaussian_diag_member gaussian_diag_member_at(const gaussian_diag_entry& e, double t,
                                                                      double s) {
  gaussian_diag_member m;
  gaussian_diag_coordinate(e.mean, e.std_dev, e.old_mean, e.old_std, &m.g, &m.b);
  const double inverse_ratio = e.old_std / e.std_dev;
  const bool wide = m.g < -0.5;
  m.gamma = wide ? inverse_ratio * inverse_ratio : 1.0 + m.g;
  m.po = 1.0 / (e.old_std * e.old_std);
  m.ps = m.g * m.po;
  m.pn = m.gamma * m.po;
  m.a = wide ? s + t * m.gamma : 1.0 + t * m.g;
  m.sigma = e.old_std * e.old_std / m.a;
  m.delta = e.old_std * (t * m.gamma * m.b / m.a);
  return m;
}

// ---- The dominant coordinate -------------------------------------------------------------------
//
// dKL/dt = t·I(t) is a sum of one term per coordinate. Where one coordinate holds nearly all of
// it (a new standard deviation far below the old on that axis, r = σ̃/σ° ≲ 1e-4, so that γ = 1/r²
// is huge), the total derivative of that coordinate's outputs with respect to its σ̃ is the
// difference of a direct term and the implicit one through t*, each ~1/r² times the result: the
// textbook form kept only ~u/r² of its digits (3.9e-5 relative at r = 1e-6, the wrong sign at
// 1e-8). For that coordinate the derivative is written instead as
//
//   dF/dγ = (∂F/∂γ · K_rest − T_rest · ∂K/∂γ + ∂(F, K)/∂(γ, t)) / K_t,
//
// F the output functional (ū_μ μ_t + ū_σ σ_t), K its coordinate's KL term, K_rest and T_rest the
// other coordinates' shares of dKL/dt and of ∂(ū·out)/∂t (exclusive sums, summed as such rather
// than as totals less its own term), and the Jacobian determinant in closed form: F and K depend
// on (γ, t) only through p = tγ and a = 1 − t + p, whose map has determinant −t, so
// ∂(F, K)/∂(γ, t) = −t (F_p K_a − F_a K_p) = −t (ū_μ Δ·tg + ū_σ σ_t·p b²) / (2a³). Every term is
// then of the size of the result. The coordinate is the one with the largest I(t) term (ties: the
// lowest index); the other coordinates keep the textbook form, where the two terms do not cancel
// (their ratio is that coordinate's share of dKL/dt, at most ½).

/// The coordinate with the largest term of I(t) and the sums over the others. `term` is the
/// coordinate's term of the tracked sum (VJP: t̄; JVP: KL'), `own` (JVP) that term without its
/// σ̃ tangent; `rest` sums `term` over the other coordinates.
struct gaussian_diag_top {
  int index = -1;
  double info = 0.0, term = 0.0, own = 0.0;
  double rest_info = 0.0, rest = 0.0;

  /// Whether this one's coordinate wins over o's (an empty one never wins; ties: the lower index).
  TROLL_HOST_DEVICE bool beats(const gaussian_diag_top& o) const {
    return index >= 0 && (o.index < 0 || info > o.info || (info == o.info && index < o.index));
  }
  /// Merges another partial (another lane's coordinates) into this one.
  TROLL_HOST_DEVICE void merge(const gaussian_diag_top& o) {
    const bool mine = beats(o);
    const gaussian_diag_top& lost = mine ? o : *this;
    const double lost_info = lost.index >= 0 ? lost.info : 0.0, lost_term = lost.index >= 0 ? lost.term : 0.0;
    rest_info = rest_info + o.rest_info + lost_info;
    rest = rest + o.rest + lost_term;
    if (!mine) {
      index = o.index;
      info = o.info;
      term = o.term;
      own = o.own;
    }
  }
  /// Adds coordinate i.
  TROLL_HOST_DEVICE void add(int i, double info_i, double term_i, double own_i) {
    gaussian_diag_top c;
    c.index = i;
    c.info = info_i;
    c.term = term_i;
    c.own = own_i;
    merge(c);
  }
};

/// d(ū_μ μ_t + ū_σ σ_t)/dσ̃ of the dominant coordinate (see above; split: ū_μ and b do not enter),
/// total, with t moving to keep the KL: rest_info and rest_t_bar are the other coordinates' shares
/// (rest_t_bar 0 in the JVP, which carries them in t'), info = I(t). Not finite where I(t)
/// overflowed: the caller keeps the textbook form then.
TROLL_HOST_DEVICE inline double gaussian_diag_top_std_bar(const gaussian_diag_entry& e, const gaussian_diag_member& m,
                                                          bool split, double t, double s, double up_mean,
                                                          double up_std, double rest_info, double rest_t_bar,
                                                          double info) {
  const double a = m.a, p = t * m.gamma, tg = t * m.g;
  const double b = split ? 0.0 : m.b, um = split ? 0.0 : up_mean;
  const double diff = e.mean - e.old_mean;
  const double sigma_t = ::sqrt(m.sigma);
  const double f_gamma = um * diff * s / (a * a) - 0.5 * up_std * sigma_t / a;  // ∂F/∂γ / t
  const double k_gamma = (0.5 * tg + p * b * b * s / a) / (a * a);              // ∂K/∂γ / t
  const double det = (um * diff * tg + up_std * sigma_t * p * b * b) / (2.0 * a * a * a);  // −∂(F, K)/∂(γ, t) / t
  const double d_gamma = (f_gamma * t * rest_info - rest_t_bar * k_gamma - det) / info;
  return (m.gamma * d_gamma) * (-2.0 / e.std_dev);  // dγ/dσ̃ = −2γ/σ̃
}

// ---- VJP -------------------------------------------------------------------------------------

/// The upstream gradients of one coordinate and the forward's output standard deviation σ*.
struct gaussian_diag_upstream {
  double mean = 0.0, std_dev = 0.0, out_std = 1.0;
};

/// The first pass's sums of a VJP row.
struct gaussian_diag_vjp_sums {
  double b2 = 0.0;         // Σ b²
  double kappa_bar = 0.0;  // split: Σ μ̄* (μ̃ − μ°)
  double t_bar = 0.0;      // ⟨θ̄_t, θ̃ − θ°⟩
  double info = 0.0;       // I(t)
  gaussian_diag_top top;   // the dominant coordinate (term: its t̄ term); merged, not summed

  /// f(field) for each sum, in declaration order (a team's reduction of the lanes' sums).
  template <class F>
  TROLL_HOST_DEVICE void for_each_field(F&& f) {
    f(b2), f(kappa_bar), f(t_bar), f(info);
  }
};

/// The scalars of a VJP row: the split mean's κ and k = κ̄κ/(2m), the IFT's c = t̄/(t I), and
/// the bound gradients.
struct gaussian_diag_vjp_scalars {
  double t = 1.0;
  double s = 0.0;  // 1 − t, exact (solved_gap)
  double kappa = 1.0;
  double k = 0.0;
  double cst = 0.0;
  double eps_bar = 0.0;
  double eps_mean_bar = 0.0;
  int top = -1;  // the dominant coordinate, and the others' shares of I(t) and t̄
  double rest_info = 0.0, rest_t_bar = 0.0, info = 0.0;
};

/// The gradients of one coordinate of the four inputs.
struct gaussian_diag_vjp_out {
  double mean = 0.0, std_dev = 0.0, old_mean = 0.0, old_std = 0.0;
};

/// The natural-parameter gradients at the output: Λ̄ and h̄ (joint) of one coordinate.
TROLL_HOST_DEVICE inline void gaussian_diag_output_bar(const gaussian_diag_entry& e, const gaussian_diag_member& m,
                                                       const gaussian_diag_upstream& up, bool split, double* lambda_bar,
                                                       double* h_bar) {
  *lambda_bar = -(m.sigma * m.sigma) * (up.std_dev / (2.0 * up.out_std));
  *h_bar = 0.0;
  if (!split) {
    *h_bar = m.sigma * up.mean;
    *lambda_bar -= *h_bar * (e.old_mean + m.delta);
  }
}

TROLL_HOST_DEVICE inline void gaussian_diag_vjp_accumulate_units(const gaussian_diag_entry& e,
                                                                 const gaussian_diag_upstream& up, bool split,
                                                                 double t, double s, int i,
                                                                 gaussian_diag_vjp_sums* sums) {
  const gaussian_diag_member m = gaussian_diag_member_at(e, t, s);
  sums->b2 += m.b * m.b;
  if (split) sums->kappa_bar += up.mean * (e.mean - e.old_mean);
  if (t >= 1.0) return;
  double lambda_bar = 0.0, h_bar = 0.0;
  gaussian_diag_output_bar(e, m, up, split, &lambda_bar, &h_bar);
  double t_bar = lambda_bar * m.ps;
  if (!split) t_bar += h_bar * (m.pn * (e.mean - e.old_mean) + m.ps * e.old_mean);
  sums->t_bar += t_bar;
  double kl_sum = 0.0, info = 0.0;
  gaussian_coordinate_at(m.g, m.gamma, m.a, split ? 0.0 : m.b, t, !split, &kl_sum, &info);
  sums->info += info;
  sums->top.add(i, info, t_bar, 0.0);
}

/// The upstream of a coordinate in units of 2^k: the gradients times 2^k, σ* divided by it.
TROLL_HOST_DEVICE inline gaussian_diag_upstream gaussian_diag_scaled(const gaussian_diag_upstream& up, int k) {
  return gaussian_diag_upstream{::ldexp(up.mean, k), ::ldexp(up.std_dev, k), ::ldexp(up.out_std, -k)};
}

/// The first pass of a VJP row, coordinate i (in its units: see "Units" above).
TROLL_HOST_DEVICE inline void gaussian_diag_vjp_accumulate(const gaussian_diag_entry& e,
                                                           const gaussian_diag_upstream& up, bool split, double t,
                                                           double s, std::size_t i, gaussian_diag_vjp_sums* sums) {
  const gaussian_diag_units u = gaussian_diag_in_units(e);
  const int k = u.k;
  gaussian_diag_vjp_accumulate_units(u.entry, gaussian_diag_scaled(up, k), split, t, s,
                                     static_cast<int>(i), sums);
}

TROLL_HOST_DEVICE inline gaussian_diag_vjp_scalars gaussian_diag_vjp_finish(const gaussian_diag_vjp_sums& sums,
                                                                            bool split, double t, double gap,
                                                                            double eps_mean) {
  gaussian_diag_vjp_scalars s;
  s.t = t;
  s.s = gap;
  if (split) {
    const double m = 0.5 * sums.b2;
    s.kappa = split_mean_scale(m, eps_mean);
    if (s.kappa < 1.0) {
      s.k = sums.kappa_bar * s.kappa / (2.0 * m);
      s.eps_mean_bar = sums.kappa_bar * s.kappa / (2.0 * eps_mean);
    }
  }
  if (t < 1.0) {
    s.cst = sums.t_bar / (t * sums.info);
    s.eps_bar = s.cst;
    s.top = sums.top.index;
    s.rest_info = sums.top.rest_info;
    s.rest_t_bar = sums.top.rest;
    s.info = sums.info;
  }
  return s;
}

TROLL_HOST_DEVICE inline gaussian_diag_vjp_out gaussian_diag_vjp_coordinate_units(
    const gaussian_diag_entry& e, const gaussian_diag_upstream& up, bool split, const gaussian_diag_vjp_scalars& sc,
    bool top) {
  const double t = sc.t;
  const gaussian_diag_member m = gaussian_diag_member_at(e, t, sc.s);
  double mean_new = 0.0, mean_old = 0.0, lam_new = 0.0, lam_old = 0.0, h_new = 0.0, h_old = 0.0;
  if (split) {
    if (sc.kappa < 1.0) {
      const double diff = e.mean - e.old_mean;
      const double diff_bar = sc.kappa * up.mean - sc.k * m.po * diff;
      mean_new += diff_bar;
      mean_old += up.mean - diff_bar;
      lam_old -= 0.5 * sc.k * diff * diff;
    } else {
      mean_new += up.mean;
    }
  }
  const bool inactive = t >= 1.0;
  if (inactive) {
    if (!split) mean_new += up.mean;
  } else {
    const double s = sc.s;
    double lambda_bar = 0.0, h_bar = 0.0;
    gaussian_diag_output_bar(e, m, up, split, &lambda_bar, &h_bar);
    const double so2 = e.old_std * e.old_std;
    double eta_lam_dot = 0.5 * so2 * m.g / (m.a * m.a);
    double eta_lam_gap = -0.5 * so2 * t * m.g / m.a;
    double eta_h_dot = 0.0, eta_h_gap = 0.0;
    if (!split) {
      eta_h_dot = e.old_std * m.gamma * m.b / (m.a * m.a);
      eta_lam_dot -= eta_h_dot * (e.old_mean + m.delta);
      eta_lam_gap += e.old_mean * m.delta + 0.5 * m.delta * m.delta;
      eta_h_gap = -m.delta;
    }
    lam_new += t * lambda_bar - sc.cst * t * t * eta_lam_dot;
    lam_old += s * lambda_bar - sc.cst * (eta_lam_gap + t * s * eta_lam_dot);
    h_new += t * h_bar - sc.cst * t * t * eta_h_dot;
    h_old += s * h_bar - sc.cst * (eta_h_gap + t * s * eta_h_dot);
  }
  // h = Λμ, Λ = 1/σ²: μ̄ = μ̄_direct + Λh̄, σ̄ = 2σ·Σ̄, Σ̄ = −Λ²(Λ̄ + h̄μ).
  gaussian_diag_vjp_out out;
  if (inactive) {
    out.mean = mean_new;
    out.std_dev = up.std_dev;
  } else {
    out.mean = mean_new + m.pn * h_new;
    out.std_dev = 2.0 * e.std_dev * (-(m.pn * m.pn) * (lam_new + h_new * e.mean));
    if (top) {  // the dominant coordinate: from the exclusive sums (see "The dominant coordinate")
      const double std_bar = gaussian_diag_top_std_bar(e, m, split, t, sc.s, up.mean, up.std_dev, sc.rest_info,
                                                       sc.rest_t_bar, sc.info);
      if (std_bar - std_bar == 0.0) out.std_dev = std_bar;
    }
  }
  out.old_mean = mean_old + m.po * h_old;
  out.old_std = 2.0 * e.old_std * (-(m.po * m.po) * (lam_old + h_old * e.old_mean));
  return out;
}

/// The gradients of coordinate i of the four inputs (worked in its units: see "Units" above).
TROLL_HOST_DEVICE inline gaussian_diag_vjp_out gaussian_diag_vjp_coordinate(const gaussian_diag_entry& e,
                                                                            const gaussian_diag_upstream& up,
                                                                            bool split,
                                                                            const gaussian_diag_vjp_scalars& sc,
                                                                            std::size_t i) {
  const gaussian_diag_units u = gaussian_diag_in_units(e);
  const int k = u.k;
  const gaussian_diag_vjp_out g = gaussian_diag_vjp_coordinate_units(
      u.entry, gaussian_diag_scaled(up, k), split, sc, static_cast<int>(i) == sc.top);
  return gaussian_diag_vjp_out{::ldexp(g.mean, -k), ::ldexp(g.std_dev, -k), ::ldexp(g.old_mean, -k),
                               ::ldexp(g.old_std, -k)};
}

// ---- JVP -------------------------------------------------------------------------------------

/// The input tangents of one coordinate (0 for an absent tangent).
struct gaussian_diag_tangent {
  double mean = 0.0, std_dev = 0.0, old_mean = 0.0, old_std = 0.0;
};

/// The first pass's sums of a JVP row.
struct gaussian_diag_jvp_sums {
  double b2 = 0.0;      // Σ b²
  double m_dot = 0.0;   // split: m'
  double kl_dot = 0.0;  // ∂KL(π_t ‖ q) at fixed t along the tangents
  double info = 0.0;    // I(t)
  gaussian_diag_top top;  // the dominant coordinate (term: its KL' term, own: without its σ̃ tangent)

  /// f(field) for each sum, in declaration order (a team's reduction of the lanes' sums).
  template <class F>
  TROLL_HOST_DEVICE void for_each_field(F&& f) {
    f(b2), f(m_dot), f(kl_dot), f(info);
  }
};

/// The scalars of a JVP row: the split mean's κ and κ', and t'.
struct gaussian_diag_jvp_scalars {
  double t = 1.0;
  double s = 0.0;  // 1 − t, exact (solved_gap)
  double kappa = 1.0;
  double kappa_dot = 0.0;
  double t_dot = 0.0;
  int top = -1;         // the dominant coordinate, the others' share of I(t), and t' without its σ̃ tangent
  double rest_info = 0.0, info = 0.0, t_dot_top = 0.0;
};

struct gaussian_diag_jvp_out {
  double mean = 0.0, std_dev = 0.0;
};

/// The coordinate's Λ_t' at fixed t, Σ_t and (joint) h_t'.
struct gaussian_diag_fixed_t {
  double lam_old_dot = 0.0, lam_t_dot = 0.0, h_t_dot = 0.0;
};

TROLL_HOST_DEVICE inline gaussian_diag_fixed_t gaussian_diag_fixed_t_tangent(const gaussian_diag_entry& e,
                                                                             const gaussian_diag_member& m,
                                                                             const gaussian_diag_tangent& d, bool split,
                                                                             double t, double s) {
  gaussian_diag_fixed_t f;
  f.lam_old_dot = -2.0 * d.old_std / (e.old_std * e.old_std * e.old_std);
  const double lam_new_dot = -2.0 * d.std_dev * m.pn / e.std_dev;
  f.lam_t_dot = t * lam_new_dot + s * f.lam_old_dot;
  if (!split)
    f.h_t_dot = t * (lam_new_dot * e.mean + m.pn * d.mean) + s * (f.lam_old_dot * e.old_mean + m.po * d.old_mean);
  return f;
}

/// One coordinate's term of ∂KL(π_t ‖ q) at fixed t along the tangents.
TROLL_HOST_DEVICE inline double gaussian_diag_kl_dot(const gaussian_diag_entry& e, const gaussian_diag_member& m,
                                                     const gaussian_diag_tangent& d, bool split, double t, double s) {
  const gaussian_diag_fixed_t f = gaussian_diag_fixed_t_tangent(e, m, d, split, t, s);
  const double so2 = e.old_std * e.old_std;
  const double sigma_gap = -so2 * t * m.g / m.a;  // Σ_t − Σ°
  const double sigma_t_dot = -(m.sigma * m.sigma * f.lam_t_dot);
  double kl_dot = 0.5 * (f.lam_old_dot * sigma_gap - t * m.ps * sigma_t_dot);
  if (!split) {
    const double mu_t_dot = m.sigma * (f.h_t_dot - f.lam_t_dot * (e.old_mean + m.delta));
    kl_dot += m.delta * m.po * (mu_t_dot - d.old_mean) + 0.5 * m.delta * f.lam_old_dot * m.delta;
  }
  return kl_dot;
}

/// The tangents without the new standard deviation's.
TROLL_HOST_DEVICE inline gaussian_diag_tangent gaussian_diag_without_std(gaussian_diag_tangent d) {
  d.std_dev = 0.0;
  return d;
}

TROLL_HOST_DEVICE inline void gaussian_diag_jvp_accumulate_units(const gaussian_diag_entry& e,
                                                                 const gaussian_diag_tangent& d, bool split, double t,
                                                                 double s, int i, gaussian_diag_jvp_sums* sums) {
  const gaussian_diag_member m = gaussian_diag_member_at(e, t, s);
  sums->b2 += m.b * m.b;
  if (split) {
    const double diff = e.mean - e.old_mean, diff_dot = d.mean - d.old_mean;
    const double lam_old_dot = -2.0 * d.old_std / (e.old_std * e.old_std * e.old_std);
    sums->m_dot += diff * m.po * diff_dot + 0.5 * diff * lam_old_dot * diff;
  }
  if (t >= 1.0) return;
  const double kl_dot = gaussian_diag_kl_dot(e, m, d, split, t, s);
  const double own = d.std_dev == 0.0 ? kl_dot : gaussian_diag_kl_dot(e, m, gaussian_diag_without_std(d), split, t, s);
  sums->kl_dot += kl_dot;
  double kl_sum = 0.0, info = 0.0;
  gaussian_coordinate_at(m.g, m.gamma, m.a, split ? 0.0 : m.b, t, !split, &kl_sum, &info);
  sums->info += info;
  sums->top.add(i, info, kl_dot, own);
}

/// The input tangents of a coordinate in units of 2^k.
TROLL_HOST_DEVICE inline gaussian_diag_tangent gaussian_diag_scaled(const gaussian_diag_tangent& d, int k) {
  return gaussian_diag_tangent{::ldexp(d.mean, -k), ::ldexp(d.std_dev, -k), ::ldexp(d.old_mean, -k),
                               ::ldexp(d.old_std, -k)};
}

/// The first pass of a JVP row, coordinate i (in its units: see "Units" above).
TROLL_HOST_DEVICE inline void gaussian_diag_jvp_accumulate(const gaussian_diag_entry& e,
                                                           const gaussian_diag_tangent& d, bool split, double t,
                                                           double s, std::size_t i, gaussian_diag_jvp_sums* sums) {
  const gaussian_diag_units u = gaussian_diag_in_units(e);
  const int k = u.k;
  gaussian_diag_jvp_accumulate_units(u.entry, gaussian_diag_scaled(d, k), split, t, s,
                                     static_cast<int>(i), sums);
}

TROLL_HOST_DEVICE inline gaussian_diag_jvp_scalars gaussian_diag_jvp_finish(const gaussian_diag_jvp_sums& sums,
                                                                            bool split, double t, double gap,
                                                                            double eps_mean, double eps_dot,
                                                                            double eps_mean_dot) {
  gaussian_diag_jvp_scalars s;
  s.t = t;
  s.s = gap;
  if (split) {
    const double m = 0.5 * sums.b2;
    s.kappa = split_mean_scale(m, eps_mean);
    if (s.kappa < 1.0) s.kappa_dot = 0.5 * s.kappa * (eps_mean_dot / eps_mean - sums.m_dot / m);
  }
  if (t < 1.0) {
    s.t_dot = (eps_dot - sums.kl_dot) / (t * sums.info);
    s.top = sums.top.index;
    s.rest_info = sums.top.rest_info;
    s.info = sums.info;
    s.t_dot_top = (eps_dot - (sums.top.rest + sums.top.own)) / (t * sums.info);
  }
  return s;
}

/// The output tangents of a projected coordinate with t' = t_dot (the textbook form).
TROLL_HOST_DEVICE inline gaussian_diag_jvp_out gaussian_diag_jvp_projected(const gaussian_diag_entry& e,
                                                                           const gaussian_diag_member& m,
                                                                           const gaussian_diag_tangent& d, bool split,
                                                                           double t, double s, double t_dot) {
  gaussian_diag_jvp_out out;
  gaussian_diag_fixed_t f = gaussian_diag_fixed_t_tangent(e, m, d, split, t, s);
  f.lam_t_dot += t_dot * m.ps;
  if (!split) {
    const double h_gap = m.pn * (e.mean - e.old_mean) + m.ps * e.old_mean;  // h̃ − h°
    f.h_t_dot += t_dot * h_gap;
    out.mean = m.sigma * (f.h_t_dot - f.lam_t_dot * (e.old_mean + m.delta));
  }
  // σ* = sqrt(Σ*): σ*' = Σ*'/(2σ*), Σ*' = −Σ*² Λ*'.
  out.std_dev = -(m.sigma * m.sigma * f.lam_t_dot) / (2.0 * ::sqrt(m.sigma));
  return out;
}

TROLL_HOST_DEVICE inline gaussian_diag_jvp_out gaussian_diag_jvp_coordinate_units(
    const gaussian_diag_entry& e, const gaussian_diag_tangent& d, bool split, const gaussian_diag_jvp_scalars& sc,
    bool top) {
  const double t = sc.t;
  double split_mean = 0.0;
  if (split)
    split_mean = sc.kappa < 1.0 ? d.old_mean + sc.kappa * (d.mean - d.old_mean) + sc.kappa_dot * (e.mean - e.old_mean)
                                : d.mean;
  if (t >= 1.0) {  // inactive: the output is the input
    gaussian_diag_jvp_out out;
    out.mean = split ? split_mean : d.mean;
    out.std_dev = d.std_dev;
    return out;
  }
  const gaussian_diag_member m = gaussian_diag_member_at(e, t, sc.s);
  gaussian_diag_jvp_out out = gaussian_diag_jvp_projected(e, m, d, split, t, sc.s, sc.t_dot);
  if (top && d.std_dev != 0.0) {
    // The dominant coordinate (see "The dominant coordinate"): the other tangents through t' less
    // this σ̃ tangent's share, plus this σ̃ tangent's total effect from the exclusive sums.
    gaussian_diag_jvp_out o =
        gaussian_diag_jvp_projected(e, m, gaussian_diag_without_std(d), split, t, sc.s, sc.t_dot_top);
    if (!split)
      o.mean += gaussian_diag_top_std_bar(e, m, split, t, sc.s, 1.0, 0.0, sc.rest_info, 0.0, sc.info) * d.std_dev;
    o.std_dev += gaussian_diag_top_std_bar(e, m, split, t, sc.s, 0.0, 1.0, sc.rest_info, 0.0, sc.info) * d.std_dev;
    if (o.mean - o.mean == 0.0 && o.std_dev - o.std_dev == 0.0) out = o;
  }
  if (split) out.mean = split_mean;
  return out;
}

/// The output tangents of coordinate i (worked in its units: see "Units" above).
TROLL_HOST_DEVICE inline gaussian_diag_jvp_out gaussian_diag_jvp_coordinate(const gaussian_diag_entry& e,
                                                                            const gaussian_diag_tangent& d,
                                                                            bool split,
                                                                            const gaussian_diag_jvp_scalars& sc,
                                                                            std::size_t i) {
  const gaussian_diag_units u = gaussian_diag_in_units(e);
  const int k = u.k;
  const gaussian_diag_jvp_out o = gaussian_diag_jvp_coordinate_units(
      u.entry, gaussian_diag_scaled(d, k), split, sc, static_cast<int>(i) == sc.top);
  return gaussian_diag_jvp_out{::ldexp(o.mean, k), ::ldexp(o.std_dev, k)};
}

}  // namespace detail
TROLL_END_NAMESPACE
