// troll/detail/gaussian_family.hpp — a Gaussian row as a family of the shared solve
// (family_solver.hpp), written once for host and device (math.md §6; docs/gaussian.md).
//
// In the basis y = W⁻¹(x − μ°) with W = L°V, which whitens Σ° and diagonalises Σ̃, the old
// Gaussian is N(0, I) and the new one N(b, diag(1/γ)); γ_i are the generalised eigenvalues of
// Λ̃ against Λ°, kept as g_i = γ_i − 1 so that nearly equal covariances lose no digits. Along
// θ_t = θ° + t(θ̃ − θ°) the member is N(m(t), diag(1/a)) with
//     a_i = 1 + t g_i,   m_i(t) = t γ_i b_i / a_i,
//     KL(π_t ‖ q) = ½ Σ_i [ψ(log a_i) + m_i²],   ψ(σ) = e^{−σ} − 1 + σ ≥ 0,
//     dKL/dt = t · I(t),   I(t) = Σ_i [½ g_i²/a_i² + γ_i² b_i²/a_i³],
// every evaluation O(d). Without the mean terms (the split projection's covariance part) the
// same sums with b = 0.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "family_solver.hpp"
#include "numeric.hpp"
#include "tilt_family.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// ψ(σ) = e^{−σ} − 1 + σ = Σ_{n≥2} (−σ)^n / n!, without cancellation: for |σ| < 1 the series
/// ½x² Σ_{k<20} c_k x^k (x = −σ, c_k = 2/(k + 2)!, correctly rounded; the tail is below 1e-19
/// relative), evaluated by Estrin's scheme (five levels of independent multiply-adds instead of a
/// 19-deep Horner chain: this is the inner loop of every solve); the closed form (no
/// cancellation beyond a factor of e) elsewhere.
TROLL_HOST_DEVICE inline double gaussian_psi(double sigma) {
  if (::fabs(sigma) < 1.0) {
    const double x = -sigma;
    constexpr double c[20] = {1.0,
                              0.3333333333333333,
                              0.08333333333333333,
                              0.016666666666666666,
                              0.002777777777777778,
                              0.0003968253968253968,
                              4.96031746031746e-05,
                              5.5114638447971785e-06,
                              5.511463844797178e-07,
                              5.010421677088344e-08,
                              4.17535139757362e-09,
                              3.2118087673643227e-10,
                              2.294149119545945e-11,
                              1.5294327463639633e-12,
                              9.55895466477477e-14,
                              5.622914508691041e-15,
                              3.123841393717245e-16,
                              1.644127049324866e-17,
                              8.22063524662433e-19,
                              3.9145882126782525e-20};
    const double x2 = x * x, x4 = x2 * x2, x8 = x4 * x4, x16 = x8 * x8;
    double q[10];
    for (int j = 0; j < 10; ++j) q[j] = c[2 * j] + c[2 * j + 1] * x;
    const double r0 = q[0] + q[1] * x2, r1 = q[2] + q[3] * x2, r2 = q[4] + q[5] * x2, r3 = q[6] + q[7] * x2,
                 r4 = q[8] + q[9] * x2;
    const double s0 = r0 + r1 * x4, s1 = r2 + r3 * x4;
    const double u0 = s0 + s1 * x8;
    return 0.5 * x2 * (u0 + r4 * x16);
  }
  // σ = −∞ (a member with a zero precision, a = 0): ψ = +∞, not ∞ − ∞.
  return sigma == neg_inf() ? inf() : ::expm1(-sigma) + sigma;
}

/// One row in the basis of the header comment: `dim` coordinates g_i = γ_i − 1 and b_i (b is
/// read only when with_mean).
struct gaussian_spectrum {
  const double* g = nullptr;
  const double* b = nullptr;
  int dim = 0;
  bool with_mean = true;
  /// Optional γ_i themselves, accurate relative to themselves (the CPU forward's): where g < −½
  /// (a new variance above twice the old) the member uses a = s + tγ (s = 1 − t exact near t = 1)
  /// instead of 1 + tg, whose cancellation near t = 1 costs the digits of a small γ (ε ≫ 1 with a
  /// much wider new covariance). Null: a = 1 + tg throughout.
  const double* gamma = nullptr;
};

/// One evaluated member: the point type of solve_bracketed (sigma2 = I(t)).
struct gaussian_point {
  double t = 0.0;
  double s = 1.0;
  double kl = 0.0;
  double sigma2 = 0.0;
};

/// One coordinate's terms of the member at t: adds ½ψ(log a) (+ ½m² with the mean) to *kl_sum
/// (the KL) and ½ g²/a² (+ γ²b²/a³) to *info. Each KL term is halved before it is added (½m² as
/// (½m)·m): the same bits as halving the sum, except that a KL between DBL_MAX/2 and DBL_MAX
/// stays finite where twice it would not. Shared by the host loop below and the device's
/// warp-parallel sums.
TROLL_HOST_DEVICE inline void gaussian_coordinate_at(double g, double gamma, double a, double b, double t,
                                                     bool with_mean, double* kl_sum, double* info) {
  if (!(a > 0.0)) {  // γ rounded to 0 (g = −1: a new variance above ~1e16 of the old) at t = 1
    *kl_sum += inf();
    *info += inf();
    return;
  }
  const double ratio = g / a;
  *kl_sum += 0.5 * gaussian_psi(a < 0.5 ? ::log(a) : ::log1p(t * g));
  *info += 0.5 * ratio * ratio;
  if (with_mean) {
    // m = (tγ/a) b and γb/a, ordered so that a huge γ (a near-singular new covariance) with t = 0
    // gives m = 0 and a large b no overflow in γb: tγ/a ≤ max(1, t).
    const double m = (t * gamma / a) * b;
    const double gamma_b_a = (gamma / a) * b;
    *kl_sum += (0.5 * m) * m;
    *info += gamma_b_a * gamma_b_a / a;
  }
}

/// gaussian_coordinate_at with γ = 1 + g and a = 1 + tg.
TROLL_HOST_DEVICE inline void gaussian_coordinate(double g, double b, double t, bool with_mean, double* kl_sum,
                                                  double* info) {
  gaussian_coordinate_at(g, 1.0 + g, 1.0 + t * g, b, t, with_mean, kl_sum, info);
}

/// a = 1 + tg, or s + tγ where γ is given and below ½ (gaussian_spectrum::gamma).
TROLL_HOST_DEVICE inline double gaussian_precision_ratio(double g, const double* gamma, int i, double t, double s) {
  return gamma != nullptr && g < -0.5 ? s + t * gamma[i] : 1.0 + t * g;
}

/// The point of the sums of gaussian_coordinate at u.
TROLL_HOST_DEVICE inline gaussian_point gaussian_point_at(const tilt_param& u, double kl_sum, double info) {
  gaussian_point p;
  p.t = u.t;
  p.s = u.s;
  p.kl = kl_sum;
  p.sigma2 = info;
  return p;
}

/// The member at u: KL(π_u ‖ q) and I(t), one pass over the coordinates.
TROLL_HOST_DEVICE inline gaussian_point gaussian_member(const gaussian_spectrum& r, const tilt_param& u) {
  double kl_sum = 0.0, info = 0.0;
  if (r.gamma == nullptr) {
    for (int i = 0; i < r.dim; ++i) gaussian_coordinate(r.g[i], r.with_mean ? r.b[i] : 0.0, u.t, r.with_mean, &kl_sum, &info);
  } else {
    for (int i = 0; i < r.dim; ++i) {
      const double gamma = r.g[i] < -0.5 ? r.gamma[i] : 1.0 + r.g[i];
      gaussian_coordinate_at(r.g[i], gamma, gaussian_precision_ratio(r.g[i], r.gamma, i, u.t, u.s),
                             r.with_mean ? r.b[i] : 0.0, u.t, r.with_mean, &kl_sum, &info);
    }
  }
  return gaussian_point_at(u, kl_sum, info);
}

/// A Gaussian row as a family of solve_bracketed (every member exact to a few ulps: no
/// cancellation to guard against, so `near`, ε and tol are not needed).
struct gaussian_family {
  gaussian_spectrum row;
  TROLL_HOST_DEVICE gaussian_point evaluate(const tilt_param& u, const gaussian_point&, double, double) const {
    return gaussian_member(row, u);
  }
};

struct gaussian_solve_result {
  gaussian_point point;  // the member to write (t = 1 for an inactive row)
  double kl_before = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;
};

/// Solves one row for KL(π_t ‖ q) = ε with any Gaussian family (its evaluate gives the member
/// at u): inactive (t = 1) when KL(p̃ ‖ q) ≤ ε, else projected, or not_converged with the best
/// member below ε. Never infeasible: KL(π_0 ‖ q) = 0 < ε.
template <class Family>
TROLL_HOST_DEVICE gaussian_solve_result solve_gaussian_family(const Family& family, double eps,
                                                              const projection_options& opt) {
  gaussian_solve_result r;
  const gaussian_point none;
  const gaussian_point at_one = family.evaluate(tilt_near_one(0.0), none, eps, 0.0);
  r.kl_before = at_one.kl;
  r.point = at_one;
  if (at_one.kl <= eps) return r;
  const gaussian_point at_zero = family.evaluate(tilt_at(0.0), none, eps, 0.0);
  const bracket_solution<gaussian_point> solved = solve_bracketed(family, at_zero, at_one, eps, opt);
  r.point = solved.point;
  r.iterations = solved.iterations;
  r.status = solved.converged ? row_status::projected : row_status::not_converged;
  return r;
}

/// solve_gaussian_family on one row's spectrum (the host path).
TROLL_HOST_DEVICE inline gaussian_solve_result solve_gaussian(const gaussian_spectrum& row, double eps,
                                                              const projection_options& opt) {
  return solve_gaussian_family(gaussian_family{row}, eps, opt);
}

/// γ − 1 from λ − 1, λ = 1/γ an eigenvalue of the whitened new covariance: g = −(λ − 1)/λ.
/// A λ that rounding put at or below 0 (a new covariance singular to working precision against
/// the old one) is taken as the smallest normal double, and the gain kept finite (an excess
/// that rounding put below −1 would otherwise give +∞, and 0·∞ = NaN at t = 0; docs/gaussian.md,
/// Accuracy).
TROLL_HOST_DEVICE inline double gaussian_gain(double excess) {
  const double lambda = maximum(1.0 + excess, 2.2250738585072014e-308);
  return minimum(-excess / lambda, largest_finite<double>());
}

/// A diagonal coordinate's g = γ − 1 = 1/r² − 1 (r = σ̃/σ°, r − 1 = (σ̃ − σ°)/σ°: no digits lost
/// for nearly equal scales) as −((r − 1)/r)((r + 1)/r): exact to a few ulps for every ratio (two
/// quotients: r² never underflows), +∞ where it passes the doubles (r below ~7.5e-155), −1 above
/// r = 1e150 (from ~1e8 on 1/r² is below half an ulp of 1 anyway).
TROLL_HOST_DEVICE inline double gaussian_diag_gain(double std_dev, double old_std) {
  const double r = std_dev / old_std;
  if (r > 1e150) return -1.0;
  if (!(r > 1e-300)) return inf();  // r underflowed (or nearly)
  const double r_minus_one = (std_dev - old_std) / old_std;
  return -(r_minus_one / r) * ((r + 1.0) / r);
}

/// Whether a diagonal coordinate's g = γ − 1 is beyond the doubles (gaussian_diag_gain: a new
/// standard deviation below ~7.5e-155 of the old). gaussian_diag_coordinate takes the largest
/// finite double there, which only kl corrects (gaussian_diag_beyond_kl); the projections and
/// their derivatives refuse such rows (gaussian_checks.hpp).
TROLL_HOST_DEVICE inline bool gaussian_diag_beyond(double std_dev, double old_std) {
  return !(gaussian_diag_gain(std_dev, old_std) < largest_finite<double>());
}

/// Whether a projection refuses a row pair whose operands are fine: the CPU's
/// gaussian_ratio_problem and gaussian_mean_step_problem (gaussian_checks.hpp) as one yes/no, by a
/// team (host_team, a warp, a block; every lane gets the answer), for the device's default mode,
/// which rejects the rows the CPU throws for. Coordinate i is refused for its ratio
/// std_dev[i·stride] / old_std[i·stride] (σ̃/σ°; a factor's diagonal entries with stride d + 1)
/// beyond the doubles (gaussian_diag_beyond) or its whitened mean step `step[i]` ((μ̃ − μ°)/σ°;
/// L°⁻¹(μ̃ − μ°) on full rows) not finite; a split bound also refuses ½|step|² beyond the doubles.
template <class Team, class T>
TROLL_HOST_DEVICE bool gaussian_row_refused(const Team& tm, bool split, const T* std_dev, const T* old_std,
                                            int stride, const double* step, int d) {
  double refused = 0.0, squares = 0.0;
  for (int i = tm.lane(); i < d; i += tm.size()) {
    const double y = step[i];
    if (gaussian_diag_beyond(static_cast<double>(std_dev[i * stride]), static_cast<double>(old_std[i * stride])) ||
        !(y - y == 0.0))
      refused = 1.0;
    squares += y * y;
  }
  const bool any = tm.sum(refused) != 0.0;  // every lane takes part in both sums
  const double total = tm.sum(squares);
  return any || (split && !(total < inf()));
}

/// One coordinate of a diagonal row pair in the basis: g = γ − 1 (gaussian_diag_gain; the largest
/// finite double where it passes the doubles, gaussian_diag_beyond) and b = (μ̃ − μ°)/σ°. Shared
/// by the CPU and device factorisations.
TROLL_HOST_DEVICE inline void gaussian_diag_coordinate(double mean, double std_dev, double old_mean, double old_std,
                                                       double* g, double* b) {
  *g = minimum(gaussian_diag_gain(std_dev, old_std), largest_finite<double>());
  *b = (mean - old_mean) / old_std;
}

/// The KL(p̃ ‖ q) term of a diagonal coordinate beyond the doubles (gaussian_diag_beyond):
/// ½(ψ(log γ) + b²) = ½(r² − 1) + ½ log γ + ½b² with ½ log γ = log σ° − log σ̃, which is finite
/// (at most ~745 from the logarithms) where γ itself overflows, and exact: r < 7.5e-155, so the
/// two logarithms do not cancel. Halved term by term (½b² as (½b)·b), as gaussian_coordinate_at.
/// gaussian::kl_diag adds it in place of the clamped coordinate's term.
TROLL_HOST_DEVICE inline double gaussian_diag_beyond_kl(double mean, double std_dev, double old_mean,
                                                        double old_std) {
  const double r = std_dev / old_std;
  const double b = (mean - old_mean) / old_std;
  return ((r * r - 1.0) * 0.5 + (::log(old_std) - ::log(std_dev))) + (0.5 * b) * b;
}

/// Whether `kl` of a full row takes its log-determinant from the factors' diagonals
/// (gaussian_full_beyond_kl) because of this coordinate's gain g = γ − 1: g ≥ 1e8, an eigenvalue
/// λ = 1/γ of Σ°⁻¹Σ̃ below ~1e-8. The factorisation knows such a λ only to an absolute error
/// (~u·λ_max on a factor that is not graded, a floor near 1e-68 measured on a d = 3 row, the
/// gain's clamp below ~1e-308), so Σ log γ_i can be far off (KL 77.4 for 230.6 at a diagonal
/// ratio of 1e-100), while the diagonals give log det exactly. The row's KL is then ≥ ~8.7, so
/// the cancellation the eigenvalue form avoids costs at most ~u·(7 + 0.75 d) relative.
TROLL_HOST_DEVICE inline bool gaussian_full_kl_from_determinant(double g) { return g >= 1e8; }

/// One coordinate's part of KL(p̃ ‖ q) for a full row taken by its determinant
/// (gaussian_full_kl_from_determinant): ½(λ_i − 1) + ½b_i² with λ = 1/γ the eigenvalue of
/// Σ°⁻¹Σ̃ (halved term by term, as gaussian_coordinate_at), plus log L°_ii − log L̃_ii from the
/// factors' diagonals (`new_diag` = L̃_ii, `old_diag` = L°_ii), whose sum is −½ log det(Σ°⁻¹Σ̃),
/// exact, in place of ½ Σ log γ_i; the trace
/// sees a small λ's absolute error only as that error. A large λ (a much wider new covariance)
/// must come accurate relative to itself: 1/(1 + g) loses ~u/(1 + g) of it to the cancellation in
/// 1 + g (λ = 1e10 beside a tiny one: the KL 1e-6 relative off), so the CPU passes 1/γ from the
/// factorisation where g < −½ (gaussian_full_lambda).
TROLL_HOST_DEVICE inline double gaussian_full_beyond_kl(double lambda, double b, double new_diag, double old_diag) {
  return ((lambda - 1.0) * 0.5 + (0.5 * b) * b) + (::log(old_diag) - ::log(new_diag));
}

/// λ = 1/γ of a coordinate with gain g, from γ itself where g < −½ and it is given (accurate
/// relative to itself: the CPU factorisation's), else 1/(1 + g).
TROLL_HOST_DEVICE inline double gaussian_full_lambda(double g, const double* gamma, int i) {
  return gamma != nullptr && g < -0.5 ? 1.0 / gamma[i] : 1.0 / (1.0 + g);
}

/// kl's result for a row whose operands are valid. A NaN there can only come from an
/// intermediate that overflowed (∞ − ∞ or 0·∞ in the whitened mean step or covariance: means 1e300
/// apart against an old standard deviation of 1e-300), and every such intermediate bounds
/// KL(p̃ ‖ q) from below by half its square: the KL is past the doubles, +∞.
TROLL_HOST_DEVICE inline double gaussian_kl_result(double kl) { return kl == kl ? kl : inf(); }

/// The split projection's mean step: with m = ½ (μ̃ − μ°)ᵀ Σ°⁻¹ (μ̃ − μ°) (= ½ Σ b_i²), the mean
/// moves to μ° + κ(μ̃ − μ°), κ = min(1, sqrt(ε_μ / m)) = 1/(1 + ω). Where ε_μ / m falls below
/// the normal doubles (a step of 1e154 at ε_μ = 1e-15) the quotient has lost digits before the
/// root (κ was 3.3% off and the mean bound broken): the two roots are then taken separately.
TROLL_HOST_DEVICE inline double split_mean_scale(double m, double eps_mean) {
  if (!(m > eps_mean)) return 1.0;
  const double ratio = eps_mean / m;
  return ratio >= 0x1p-1022 ? ::sqrt(ratio) : ::sqrt(eps_mean) / ::sqrt(m);
}

}  // namespace detail
TROLL_END_NAMESPACE
