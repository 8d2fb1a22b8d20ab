// troll/gradcheck.hpp — a finite-difference gradient checker for functions over flat double
// vectors. It compares an analytic derivative (full Jacobian, VJP or JVP) with central
// differences, entry by entry or along random directions, and returns a structured result.
//
// Contract. A function reads n = x.size() inputs and writes m outputs:
//   f(const double* x, double* y)                           y: m
// and its analytic derivative comes in one of three forms:
//   jac(const double* x, double* J)                         J: m*n row-major, J[i*n + j] =
//   dy_i/dx_j vjp(const double* x, const double* gy, double* gx)      gx = Jᵀ gy   (gy: m, gx: n)
//   jvp(const double* x, const double* dx, double* dy)      dy = J dx    (dx: n, dy: m)
// Any callable works (lambda, functor, function pointer). Callables overwrite every entry of
// their output: buffers are pre-filled with NaN, so an entry left unwritten (or accumulated into
// with +=) fails the check instead of passing silently. Bad arguments (x empty, m == 0, x not
// finite, step below 4·DBL_EPSILON, negative tolerances, directions < 1 in random mode) throw
// troll::invalid_input.
//
// Numeric derivative. Central differences with a per-input step h_k = step · max(1, |x_k|):
//   D(h) = (f(x + h e_k) − f(x − h e_k)) / 2h,   error ≈ h² |f'''| / 6  +  u |f| / h,
// u = 2⁻⁵³ ≈ 1.1e-16 being the unit round-off. With `richardson` (the default) the checker also
// takes D(h/2) and returns R = D(h/2) + (D(h/2) − D(h)) / 3, whose truncation error is O(h⁴ f⁽⁵⁾)
// and whose round-off is about three times that of D(h). The denominator is the step actually
// taken, (x_k + h) − (x_k − h) in floating point, so the representation of x_k + h costs nothing.
//
// Default tolerances and why. With step = 1e-6 the round-off term is ~1e-10 |f| and the
// truncation term ~1e-13 |f'''|: for values and derivatives of size O(1)..O(100) the numeric
// derivative is good to ~1e-8, two orders below atol = 1e-6 and rtol = 1e-4. A correct
// derivative therefore passes with margin, and a wrong one is flagged once its error exceeds
// about 1e-4 relative (1e-6 absolute near zero). For functions with large values (|f| ≳ 1e4)
// round-off dominates: raise `step` to 1e-4..1e-3 and keep Richardson on.
// The step is relative to |x|: for functions whose curvature does not grow with x (logits with a
// large common offset: a correct KL gradient fails from offsets of 1e6 with the default), take
// step = 1e-6 / max|x| (≥ 4·DBL_EPSILON). For functions computed in float, step = 1e-2 with
// rtol = 1e-3, atol = 1e-4 (docs/api.md, "Gradient checker", has the measurements).
//
// Full-Jacobian modes (check_jacobian, check_vjp, check_jvp) build the numeric Jacobian column by
// column (2n evaluations of f, 4n with Richardson) and compare every entry (i, j):
//   pass  iff  |analytic − numeric| ≤ atol + rtol · |numeric|.
// check_vjp / check_jvp read the analytic Jacobian off unit vectors, so they also call the
// product once with a random unit vector w and require Σ_i w_i J[i, :] (J w) of it, entry by
// entry to atol + rtol · Σ|w_i J_ij|: a product right on the e_i only ("not linear") fails.
// Random-direction mode (check_vjp_random, check_jvp_random; JAX check_grads style) costs
// 2 or 4 evaluations of f per direction whatever n and m are. For each direction it draws
// independent Gaussian u ∈ ℝᵐ and v ∈ ℝⁿ, normalised to unit length, and compares the scalar
// numeric ⟨u, J v⟩ (a central difference of f along v, step h = step · max(1, ‖x‖∞)) with the
// analytic ⟨vjp(u), v'⟩ or ⟨u, jvp(v')⟩, v' the direction the difference actually took (x + h·v
// rounded to the ulps of x, Richardson-combined as the differences are; v' = v where x is small):
//   pass  iff  |a − b| ≤ atol · ‖u‖‖v'‖ + rtol · max(|a|, |b|)      (‖u‖ = 1, ‖v'‖ ≈ 1).
// A direction the step moves x by less than ‖v'‖ = ½ (x + h·v rounding back to x: large |x|, a
// small step, a long v) fails the check instead of comparing 0 with 0.
// An error E in the Jacobian shows up as ⟨u, E v⟩, of typical size ‖E‖_F / √(mn); the random
// mode is a cheap screen for large problems, the full modes are the exact test for small ones.
// The directions come from splitmix64 + Box–Muller seeded by `seed`, so a run is reproducible.
//
// Non-finite outputs. An output that is −inf at x (a masked token's log-probability) is taken as
// constant: it is skipped and counted in `skipped_outputs`, its rows of the analytic Jacobian are
// ignored, and in random mode u is zero there. It must stay −inf at the nearby points. Any other
// non-finite value — NaN or +inf at x, an output finite at x but not at x ± h, a −inf output that
// turns finite, a NaN analytic entry — fails the check and the report says which and where.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "errors.hpp"
#include "gradcheck_types.hpp"
#include "detail/gradcheck_steps.hpp"

TROLL_BEGIN_NAMESPACE


/// Checks a full analytic Jacobian: jac(x, J) fills J (m*n, row-major, J[i*n + j] = ∂y_i/∂x_j),
/// compared entry by entry with central differences of f(x, y). Rows of outputs that are −inf
/// at x are not read. Throws troll::invalid_input for bad arguments (see the header comment).
template <class F, class Jac>
gradcheck_result check_jacobian(F&& f, Jac&& jac, const std::vector<double>& x, std::size_t m,
                                const gradcheck_options& options = {}) {
  auto fill = [&](const double* at, double* jacobian,
                  const std::vector<detail::gradcheck_output>&) { jac(at, jacobian); };
  return detail::gradcheck_full("check_jacobian", f, fill, x, m, options);
}

/// Checks a vector–Jacobian product vjp(x, gy, gx), gx = Jᵀ gy, by calling it with each unit
/// vector gy = e_i (m calls; outputs −inf at x are skipped) and comparing the rows it yields with
/// central differences of f. Throws troll::invalid_input for bad arguments.
template <class F, class Vjp>
gradcheck_result check_vjp(F&& f, Vjp&& vjp, const std::vector<double>& x, std::size_t m,
                           const gradcheck_options& options = {}) {
  const std::size_t n = x.size();
  auto fill = [&](const double* at, double* jacobian,
                  const std::vector<detail::gradcheck_output>& state) {
    detail::for_each_unit(
        m, n, [&](std::size_t i) { return state[i] != detail::gradcheck_output::compared; },
        [&](const double* gy, double* gx) { vjp(at, gy, gx); },
        [&](std::size_t i, const double* gx) { std::copy(gx, gx + n, jacobian + i * n); });
  };
  auto linear = [&](const std::vector<double>& jacobian, const std::vector<detail::gradcheck_output>& state,
                    detail::gradcheck_tally& tally) {
    detail::gradcheck_linearity("vjp", [&](const double* at, const double* gy, double* gx) { vjp(at, gy, gx); },
                                x.data(), jacobian, m, n, true, state, options, tally);
  };
  return detail::gradcheck_full("check_vjp", f, fill, x, m, options, linear);
}

/// Checks a Jacobian–vector product jvp(x, dx, dy), dy = J dx, by calling it with each unit
/// vector dx = e_j (n calls) and comparing the columns it yields with central differences of f.
/// Entries of dy for outputs −inf at x are not read. Throws troll::invalid_input for bad arguments.
template <class F, class Jvp>
gradcheck_result check_jvp(F&& f, Jvp&& jvp, const std::vector<double>& x, std::size_t m,
                           const gradcheck_options& options = {}) {
  const std::size_t n = x.size();
  auto fill = [&](const double* at, double* jacobian,
                  const std::vector<detail::gradcheck_output>&) {
    detail::for_each_unit(
        n, m, [](std::size_t) { return false; }, [&](const double* dx, double* dy) { jvp(at, dx, dy); },
        [&](std::size_t j, const double* dy) {
          for (std::size_t i = 0; i < m; ++i) jacobian[i * n + j] = dy[i];
        });
  };
  auto linear = [&](const std::vector<double>& jacobian, const std::vector<detail::gradcheck_output>& state,
                    detail::gradcheck_tally& tally) {
    detail::gradcheck_linearity("jvp", [&](const double* at, const double* dx, double* dy) { jvp(at, dx, dy); },
                                x.data(), jacobian, m, n, false, state, options, tally);
  };
  return detail::gradcheck_full("check_jvp", f, fill, x, m, options, linear);
}

/// Random-direction check of a VJP: for `options.directions` random unit u (m) and v (n),
/// compares ⟨vjp(x, u), v⟩ with a central difference of ⟨u, f⟩ along v. u is zero on outputs
/// that are −inf at x. Throws troll::invalid_input for bad arguments.
template <class F, class Vjp>
gradcheck_result check_vjp_random(F&& f, Vjp&& vjp, const std::vector<double>& x, std::size_t m,
                                  const gradcheck_options& options = {}) {
  const std::size_t n = x.size();
  std::vector<double> gx(n);
  auto inner = [&](const double* at, const std::vector<double>& u, const std::vector<double>& v,
                   const std::vector<detail::gradcheck_output>&) {
    std::fill(gx.begin(), gx.end(), std::numeric_limits<double>::quiet_NaN());
    vjp(at, u.data(), gx.data());
    double sum = 0;
    for (std::size_t j = 0; j < n; ++j) sum += gx[j] * v[j];
    return sum;
  };
  return detail::gradcheck_random("check_vjp_random", "<vjp(u), v>", f, inner, x, m, options);
}

/// Random-direction check of a JVP: for `options.directions` random unit u (m) and v (n),
/// compares ⟨u, jvp(x, v)⟩ with a central difference of ⟨u, f⟩ along v. Entries of jvp's output
/// for outputs −inf at x are not read. Throws troll::invalid_input for bad arguments.
template <class F, class Jvp>
gradcheck_result check_jvp_random(F&& f, Jvp&& jvp, const std::vector<double>& x, std::size_t m,
                                  const gradcheck_options& options = {}) {
  std::vector<double> dy(m);
  auto inner = [&](const double* at, const std::vector<double>& u, const std::vector<double>& v,
                   const std::vector<detail::gradcheck_output>& state) {
    std::fill(dy.begin(), dy.end(), std::numeric_limits<double>::quiet_NaN());
    jvp(at, v.data(), dy.data());
    double sum = 0;
    for (std::size_t i = 0; i < m; ++i) {
      if (state[i] == detail::gradcheck_output::compared) sum += u[i] * dy[i];
    }
    return sum;
  };
  return detail::gradcheck_random("check_jvp_random", "<u, jvp(v)>", f, inner, x, m, options);
}

/// Checks the gradient of a scalar loss: loss(x) returns a double, grad(x, g) fills g (n).
/// Same comparison as check_jacobian with m = 1. Throws troll::invalid_input for bad arguments.
template <class Loss, class Grad>
gradcheck_result check_gradient(Loss&& loss, Grad&& grad, const std::vector<double>& x,
                                const gradcheck_options& options = {}) {
  auto f = [&](const double* at, double* y) { y[0] = loss(at); };
  auto fill = [&](const double* at, double* gradient,
                  const std::vector<detail::gradcheck_output>&) { grad(at, gradient); };
  return detail::gradcheck_full("check_gradient", f, fill, x, 1, options);
}

inline std::string gradcheck_result::report() const {
  using detail::gradcheck_number;
  const auto index = [](std::size_t i) { return std::to_string(i); };
  std::string text = "troll::" + mode + ": " + (ok ? "PASSED" : "FAILED") + " (" +
                     (random_directions ? "random directions" : "full Jacobian") + ", " +
                     index(outputs) + " output" + (outputs == 1 ? "" : "s") + " x " +
                     index(inputs) + " input" + (inputs == 1 ? "" : "s") + ")\n";
  if (!ok) text += "  reason:    " + reason + "\n";

  const bool has_worst = worst_output != npos || worst_input != npos || worst_direction != npos;
  if (has_worst) {
    std::string where;
    if (worst_direction != npos) {
      where = "direction " + index(worst_direction) +
              (mode == "check_jvp_random" ? " of <u, J v> (analytic <u, jvp(v)>)"
                                          : " of <u, J v> (analytic <vjp(u), v>)");
    }
    if (worst_output != npos)
      where += (where.empty() ? "" : ", ") + ("output " + index(worst_output));
    if (worst_input != npos) where += (where.empty() ? "" : ", ") + ("input " + index(worst_input));
    text += "  worst:     " + where + "\n";
    if (!std::isnan(analytic_at_worst) || !std::isnan(numeric_at_worst)) {
      text += "             analytic " + gradcheck_number(analytic_at_worst, 12) + ", numeric " +
              gradcheck_number(numeric_at_worst, 12) + "\n";
    }
    if (std::isfinite(tolerance_at_worst)) {
      const double error = std::fabs(analytic_at_worst - numeric_at_worst);
      text += "             |analytic - numeric| = " + gradcheck_number(error, 3) +
              (error <= tolerance_at_worst ? " <= " : " > ") + "tolerance " +
              gradcheck_number(tolerance_at_worst, 3) + "\n";
    }
  }

  const char* unit = random_directions ? (checked == 1 ? " direction" : " directions")
                                       : (checked == 1 ? " entry" : " entries");
  text += "  compared:  " + index(checked) + unit + ", " + index(failed) + " beyond tolerance";
  if (nonfinite > 0)
    text += ", " + index(nonfinite) + " non-finite problem" + (nonfinite == 1 ? "" : "s");
  text += "\n";
  if (skipped_outputs > 0) {
    text += "  skipped:   " + index(skipped_outputs) + " output" +
            (skipped_outputs == 1 ? "" : "s") + " -inf at x, treated as constant\n";
  }
  text += "  errors:    max abs " + gradcheck_number(max_abs_error, 3) + ", max rel " +
          gradcheck_number(max_rel_error, 3) + ", max error/tolerance " +
          gradcheck_number(max_error_ratio, 3) + "\n";
  text += "  settings:  pass iff |analytic - numeric| <= atol + rtol * " +
          std::string(random_directions ? "max(|analytic|, |numeric|)" : "|numeric|") + ", atol " +
          gradcheck_number(options.atol) + ", rtol " + gradcheck_number(options.rtol) + "; step " +
          gradcheck_number(options.step) + " (relative), Richardson " +
          (options.richardson ? "on" : "off");
  if (random_directions) {
    char seed[24];
    std::snprintf(seed, sizeof seed, "0x%llx", static_cast<unsigned long long>(options.seed));
    text += "; " + std::to_string(options.directions) + " directions, seed " + seed;
  }
  text += "\n";
  return text;
}

TROLL_END_NAMESPACE
