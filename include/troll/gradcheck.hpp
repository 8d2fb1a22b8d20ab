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
// finite, step ≤ 0, negative tolerances, directions < 1 in random mode) throw troll::invalid_input.
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
//
// Full-Jacobian modes (check_jacobian, check_vjp, check_jvp) build the numeric Jacobian column by
// column (2n evaluations of f, 4n with Richardson) and compare every entry (i, j):
//   pass  iff  |analytic − numeric| ≤ atol + rtol · |numeric|.
// Random-direction mode (check_vjp_random, check_jvp_random; JAX check_grads style) costs
// 2 or 4 evaluations of f per direction whatever n and m are. For each direction it draws
// independent Gaussian u ∈ ℝᵐ and v ∈ ℝⁿ, normalised to unit length, and compares the scalar
// numeric ⟨u, J v⟩ (a central difference of f along v, step h = step · max(1, ‖x‖∞)) with the
// analytic ⟨vjp(u), v⟩ or ⟨u, jvp(v)⟩:
//   pass  iff  |a − b| ≤ atol · ‖u‖‖v‖ + rtol · max(|a|, |b|)      (‖u‖ = ‖v‖ = 1).
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

TROLL_BEGIN_NAMESPACE

/// Settings of a gradient check. The defaults suit functions of O(1) size checked in double; see
/// the header comment for the reasoning.
struct gradcheck_options {
  double step = 1e-6;           ///< relative central-difference step: h_k = step · max(1, |x_k|)
  double atol = 1e-6;           ///< absolute tolerance
  double rtol = 1e-4;           ///< relative tolerance (against |numeric| in full mode)
  int directions = 16;          ///< random-direction mode: how many (u, v) pairs to draw
  std::uint64_t seed = 0x7201;  ///< random-direction mode: generator seed
  bool richardson = true;       ///< Richardson extrapolation over h and h/2 (O(h⁴) differences)
};

/// Outcome of a gradient check. In full-Jacobian mode the "entries" are the (output, input)
/// pairs; in random mode they are the directions.
struct gradcheck_result {
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  bool ok = false;                  ///< every compared entry within tolerance, nothing non-finite
  std::string mode;                 ///< the entry point, e.g. "check_vjp_random"
  bool random_directions = false;   ///< true for the random-direction modes
  std::string reason;               ///< empty when ok; otherwise why the check failed
  std::size_t outputs = 0;          ///< m
  std::size_t inputs = 0;           ///< n
  std::size_t checked = 0;          ///< entries (full mode) or directions (random mode) compared
  std::size_t failed = 0;           ///< compared entries or directions beyond tolerance
  std::size_t nonfinite = 0;        ///< non-finite problems found (each one fails the check)
  std::size_t skipped_outputs = 0;  ///< outputs that are −inf at x, treated as constant

  double max_abs_error = 0;  ///< max |analytic − numeric| over compared entries
  double max_rel_error = 0;  ///< max |analytic − numeric| / max(|analytic|, |numeric|), 0 if both 0
  double max_error_ratio = 0;  ///< max |analytic − numeric| / tolerance; ≤ 1 means within tolerance

  /// The worst entry: the first non-finite problem if there is one, else the compared entry with
  /// the largest error ratio. worst_output and worst_input index it in full mode; in random mode
  /// worst_direction is the direction, and worst_output names an output only for a non-finite one.
  std::size_t worst_output = npos;
  std::size_t worst_input = npos;
  std::size_t worst_direction = npos;
  double analytic_at_worst = 0;
  double numeric_at_worst = 0;
  double tolerance_at_worst = 0;

  gradcheck_options options;  ///< the settings the check ran with

  /// Multi-line readable summary: mode, pass/fail and reason, the worst entry with both values,
  /// counts, and the tolerances.
  std::string report() const;
};

namespace detail {

/// splitmix64 (Steele, Lea, Flood 2014) feeding Box–Muller: a tiny generator whose stream is
/// the same on every platform (up to the last ulp of std::log/std::cos).
class gradcheck_normal_generator {
 public:
  explicit gradcheck_normal_generator(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_bits() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  /// Uniform in the open interval (0, 1): 53 random bits, offset by half a step.
  double next_uniform() {
    return (static_cast<double>(next_bits() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  }

  double next_normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double two_pi = 6.283185307179586476925286766559;
    const double radius = std::sqrt(-2.0 * std::log(next_uniform()));
    const double angle = two_pi * next_uniform();
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  std::uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

/// What the checker does with output i, decided from its value at x.
enum class gradcheck_output : unsigned char {
  compared,  ///< finite at x
  constant,  ///< −inf at x: skipped
  broken,    ///< NaN or +inf at x: reported, not compared
};

inline std::string gradcheck_number(double value, int digits = 6) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+inf" : "-inf";
  char buffer[48];
  std::snprintf(buffer, sizeof buffer, "%.*g", digits, value);
  return buffer;
}

inline bool gradcheck_is_minus_inf(double value) { return std::isinf(value) && value < 0; }

inline std::string gradcheck_describe(double value) { return gradcheck_number(value, 17); }

inline void gradcheck_validate(const char* function, const std::vector<double>& x, std::size_t m,
                               const gradcheck_options& options, bool random_directions) {
  const std::string prefix = std::string("troll::") + function + ": ";
  if (x.empty()) throw shape_error(prefix + "x is empty (n = 0)");
  if (m == 0) throw shape_error(prefix + "m = 0: the function has no outputs");
  for (std::size_t k = 0; k < x.size(); ++k) {
    if (!std::isfinite(x[k])) {
      throw domain_error(prefix + "x[" + std::to_string(k) + "] = " + gradcheck_describe(x[k]) +
                         " is not finite");
    }
  }
  const double min_step = 4 * std::numeric_limits<double>::epsilon();
  if (!std::isfinite(options.step) || !(options.step >= min_step)) {
    throw domain_error(prefix + "step = " + gradcheck_describe(options.step) +
                       " must be finite and at least 4 * DBL_EPSILON");
  }
  if (!std::isfinite(options.atol) || options.atol < 0) {
    throw domain_error(prefix + "atol = " + gradcheck_describe(options.atol) +
                       " must be finite and >= 0");
  }
  if (!std::isfinite(options.rtol) || options.rtol < 0) {
    throw domain_error(prefix + "rtol = " + gradcheck_describe(options.rtol) +
                       " must be finite and >= 0");
  }
  if (random_directions && options.directions < 1) {
    throw domain_error(prefix + "directions = " + std::to_string(options.directions) +
                       " must be at least 1");
  }
}

/// Calls f(x, y) on a NaN-filled y, so an output the callable forgets to write reads as NaN.
template <class F>
void gradcheck_evaluate(F& f, const double* x, double* y, std::size_t m) {
  std::fill(y, y + m, std::numeric_limits<double>::quiet_NaN());
  f(x, y);
}

/// Accumulates comparisons and problems into a result, then decides ok and the reason.
class gradcheck_tally {
 public:
  explicit gradcheck_tally(gradcheck_result& result) : result_(result) {}

  /// A non-finite problem. The first one becomes the reason and the worst entry.
  void problem(const std::string& reason, std::size_t output, std::size_t input,
               std::size_t direction, double analytic, double numeric) {
    if (result_.nonfinite++ > 0) return;
    result_.reason = reason;
    set_worst(output, input, direction, analytic, numeric,
              std::numeric_limits<double>::quiet_NaN());
  }

  /// One finite comparison against `tolerance`.
  void compare(double analytic, double numeric, double tolerance, std::size_t output,
               std::size_t input, std::size_t direction) {
    const double error = std::fabs(analytic - numeric);
    const double scale = std::max(std::fabs(analytic), std::fabs(numeric));
    const double relative = scale > 0 ? error / scale : 0.0;
    const double ratio = tolerance > 0 ? error / tolerance
                         : error > 0   ? std::numeric_limits<double>::infinity()
                                       : 0.0;
    if (!(error <= tolerance)) ++result_.failed;
    result_.max_abs_error = std::max(result_.max_abs_error, error);
    result_.max_rel_error = std::max(result_.max_rel_error, relative);
    const bool first = result_.checked++ == 0;
    if (first || ratio > result_.max_error_ratio) {
      result_.max_error_ratio = ratio;
      if (result_.nonfinite == 0) {
        set_worst(output, input, direction, analytic, numeric, tolerance);
      }
    }
  }

  void finish() {
    gradcheck_result& r = result_;
    const char* unit = r.random_directions ? "directions" : "entries";
    if (r.nonfinite > 0) {
      if (r.nonfinite > 1) {
        r.reason += " (and " + std::to_string(r.nonfinite - 1) + " more non-finite problem" +
                    (r.nonfinite > 2 ? "s)" : ")");
      }
    } else if (r.failed > 0) {
      r.reason = std::to_string(r.failed) + " of " + std::to_string(r.checked) + " compared " +
                 unit + " exceed the tolerance";
    } else if (r.checked == 0) {
      r.reason = "nothing was compared: every output is -inf at x";
    }
    r.ok = r.nonfinite == 0 && r.failed == 0 && r.checked > 0;
  }

 private:
  void set_worst(std::size_t output, std::size_t input, std::size_t direction, double analytic,
                 double numeric, double tolerance) {
    result_.worst_output = output;
    result_.worst_input = input;
    result_.worst_direction = direction;
    result_.analytic_at_worst = analytic;
    result_.numeric_at_worst = numeric;
    result_.tolerance_at_worst = tolerance;
  }

  gradcheck_result& result_;
};

inline gradcheck_result gradcheck_start(const char* mode, bool random_directions, std::size_t m,
                                        std::size_t n, const gradcheck_options& options) {
  gradcheck_result result;
  result.mode = mode;
  result.random_directions = random_directions;
  result.outputs = m;
  result.inputs = n;
  result.options = options;
  return result;
}

/// Classifies each output from its value y at x; NaN or +inf outputs are reported.
inline std::vector<gradcheck_output> gradcheck_classify_outputs(const std::vector<double>& y,
                                                                gradcheck_tally& tally,
                                                                gradcheck_result& result) {
  std::vector<gradcheck_output> state(y.size(), gradcheck_output::compared);
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (gradcheck_is_minus_inf(y[i])) {
      state[i] = gradcheck_output::constant;
      ++result.skipped_outputs;
    } else if (!std::isfinite(y[i])) {
      state[i] = gradcheck_output::broken;
      tally.problem("output " + std::to_string(i) + " is " + gradcheck_describe(y[i]) + " at x" +
                        (std::isnan(y[i]) ? "" : " (only -inf outputs are treated as constant)"),
                    i, gradcheck_result::npos, gradcheck_result::npos,
                    std::numeric_limits<double>::quiet_NaN(),
                    std::numeric_limits<double>::quiet_NaN());
    }
  }
  return state;
}

/// The evaluation points of one central difference: offsets +h, −h and, with Richardson,
/// +h/2, −h/2, named for the report.
inline const char* gradcheck_point_name(int point) {
  static const char* const names[4] = {"x + h*", "x - h*", "x + (h/2)*", "x - (h/2)*"};
  return names[point];
}

/// Checks the values of output i at the evaluation points. Returns true when they can be
/// differenced (a compared output, finite everywhere); reports what is wrong otherwise.
inline bool gradcheck_usable(const std::vector<std::vector<double>>& values, int points,
                             std::size_t i, gradcheck_output state, double value_at_x,
                             const std::string& along, std::size_t input, std::size_t direction,
                             gradcheck_tally& tally) {
  if (state == gradcheck_output::broken) return false;
  for (int p = 0; p < points; ++p) {
    const double value = values[static_cast<std::size_t>(p)][i];
    const std::string where = std::string(gradcheck_point_name(p)) + along;
    if (state == gradcheck_output::constant) {
      if (!gradcheck_is_minus_inf(value)) {
        tally.problem("output " + std::to_string(i) + " is -inf at x but " +
                          gradcheck_describe(value) + " at " + where +
                          ": a -inf output must stay -inf nearby to be treated as constant",
                      i, input, direction, std::numeric_limits<double>::quiet_NaN(),
                      std::numeric_limits<double>::quiet_NaN());
        return false;
      }
    } else if (!std::isfinite(value)) {
      tally.problem("output " + std::to_string(i) + " is finite at x (" +
                        gradcheck_describe(value_at_x) + ") but " + gradcheck_describe(value) +
                        " at " + where,
                    i, input, direction, std::numeric_limits<double>::quiet_NaN(),
                    std::numeric_limits<double>::quiet_NaN());
      return false;
    }
  }
  return state == gradcheck_output::compared;
}

/// Central difference (Richardson-extrapolated when four points were taken) from the values at
/// x + s0, x + s1 (and x + s2, x + s3), s being the offsets actually applied.
inline double gradcheck_difference(const std::vector<std::vector<double>>& values, int points,
                                   std::size_t i, const double (&offsets)[4]) {
  const double coarse = (values[0][i] - values[1][i]) / (offsets[0] - offsets[1]);
  if (points == 2) return coarse;
  const double fine = (values[2][i] - values[3][i]) / (offsets[2] - offsets[3]);
  return fine + (fine - coarse) / 3.0;
}

/// Calls product(e_k, out) for each unit vector e_k of size `count` that skip(k) does not pass
/// over, out (size `width`) NaN-filled before each call, then store(k, out): the Jacobian's rows
/// from a VJP, its columns from a JVP.
template <class Skip, class Product, class Store>
void for_each_unit(std::size_t count, std::size_t width, Skip&& skip, Product&& product, Store&& store) {
  std::vector<double> unit(count, 0.0), out(width);
  for (std::size_t k = 0; k < count; ++k) {
    if (skip(k)) continue;
    unit[k] = 1.0;
    std::fill(out.begin(), out.end(), std::numeric_limits<double>::quiet_NaN());
    product(unit.data(), out.data());
    store(k, out.data());
    unit[k] = 0.0;
  }
}

/// Full-Jacobian driver: numeric Jacobian column by column, analytic Jacobian from `fill`
/// (called as fill(x, J, state) on a NaN-filled m*n row-major J), then entry-wise comparison.
template <class F, class Fill>
gradcheck_result gradcheck_full(const char* mode, F& f, Fill&& fill, const std::vector<double>& x,
                                std::size_t m, const gradcheck_options& options) {
  gradcheck_validate(mode, x, m, options, false);
  const std::size_t n = x.size();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  gradcheck_result result = gradcheck_start(mode, false, m, n, options);
  gradcheck_tally tally(result);

  std::vector<double> y(m);
  gradcheck_evaluate(f, x.data(), y.data(), m);
  const std::vector<gradcheck_output> state = gradcheck_classify_outputs(y, tally, result);

  const int points = options.richardson ? 4 : 2;
  std::vector<double> numeric(m * n, nan);
  std::vector<std::vector<double>> values(4, std::vector<double>(m));
  std::vector<double> shifted(x);
  for (std::size_t j = 0; j < n; ++j) {
    const double h = options.step * std::max(1.0, std::fabs(x[j]));
    const double wanted[4] = {h, -h, h / 2, -h / 2};
    double offsets[4] = {0, 0, 0, 0};
    for (int p = 0; p < points; ++p) {
      shifted[j] = x[j] + wanted[p];
      offsets[p] = shifted[j] - x[j];
      gradcheck_evaluate(f, shifted.data(), values[static_cast<std::size_t>(p)].data(), m);
    }
    shifted[j] = x[j];
    const std::string along = "e_" + std::to_string(j) + ", h = " + gradcheck_number(h);
    for (std::size_t i = 0; i < m; ++i) {
      if (gradcheck_usable(values, points, i, state[i], y[i], along, j, gradcheck_result::npos,
                           tally)) {
        numeric[i * n + j] = gradcheck_difference(values, points, i, offsets);
      }
    }
  }

  std::vector<double> analytic(m * n, nan);
  fill(x.data(), analytic.data(), state);

  for (std::size_t i = 0; i < m; ++i) {
    if (state[i] != gradcheck_output::compared) continue;
    for (std::size_t j = 0; j < n; ++j) {
      const double a = analytic[i * n + j];
      const double d = numeric[i * n + j];
      if (!std::isfinite(d)) continue;  // already reported
      if (!std::isfinite(a)) {
        tally.problem("analytic entry (output " + std::to_string(i) + ", input " +
                          std::to_string(j) + ") is " + gradcheck_describe(a) +
                          " (does the callable write every entry?)",
                      i, j, gradcheck_result::npos, a, d);
        continue;
      }
      tally.compare(a, d, options.atol + options.rtol * std::fabs(d), i, j, gradcheck_result::npos);
    }
  }
  tally.finish();
  return result;
}

/// Fills `out` with a unit-norm Gaussian vector; entries where `keep` is false are zero.
/// Every entry consumes one draw whatever `keep` says, so the stream does not depend on it.
/// Returns false when nothing is kept.
inline bool gradcheck_unit_vector(gradcheck_normal_generator& generator, std::vector<double>& out,
                                  const std::vector<gradcheck_output>* keep) {
  double norm2 = 0;
  for (std::size_t k = 0; k < out.size(); ++k) {
    const double draw = generator.next_normal();
    const bool kept = keep == nullptr || (*keep)[k] == gradcheck_output::compared;
    out[k] = kept ? draw : 0.0;
    norm2 += out[k] * out[k];
  }
  if (!(norm2 > 0)) return false;
  const double scale = 1.0 / std::sqrt(norm2);
  for (double& value : out) value *= scale;
  return true;
}

/// Random-direction driver: for each direction compares the numeric ⟨u, J v⟩ with
/// inner(x, u, v, state), the analytic one.
template <class F, class Inner>
gradcheck_result gradcheck_random(const char* mode, const char* analytic_name, F& f, Inner&& inner,
                                  const std::vector<double>& x, std::size_t m,
                                  const gradcheck_options& options) {
  gradcheck_validate(mode, x, m, options, true);
  const std::size_t n = x.size();
  gradcheck_result result = gradcheck_start(mode, true, m, n, options);
  gradcheck_tally tally(result);

  std::vector<double> y(m);
  gradcheck_evaluate(f, x.data(), y.data(), m);
  const std::vector<gradcheck_output> state = gradcheck_classify_outputs(y, tally, result);

  double largest = 0;
  for (double value : x) largest = std::max(largest, std::fabs(value));
  const double h = options.step * std::max(1.0, largest);
  const double offsets[4] = {h, -h, h / 2, -h / 2};
  const int points = options.richardson ? 4 : 2;

  gradcheck_normal_generator generator(options.seed);
  std::vector<double> u(m), v(n), shifted(n);
  std::vector<std::vector<double>> values(4, std::vector<double>(m));
  for (int k = 0; k < options.directions; ++k) {
    const std::size_t direction = static_cast<std::size_t>(k);
    gradcheck_unit_vector(generator, v, nullptr);
    if (!gradcheck_unit_vector(generator, u, &state)) break;  // no compared output

    for (int p = 0; p < points; ++p) {
      for (std::size_t j = 0; j < n; ++j) shifted[j] = x[j] + offsets[p] * v[j];
      gradcheck_evaluate(f, shifted.data(), values[static_cast<std::size_t>(p)].data(), m);
    }
    const std::string along =
        "v (direction " + std::to_string(k) + ", h = " + gradcheck_number(h) + ")";
    bool usable = true;
    double numeric = 0;
    for (std::size_t i = 0; i < m; ++i) {
      if (gradcheck_usable(values, points, i, state[i], y[i], along, gradcheck_result::npos,
                           direction, tally)) {
        numeric += u[i] * gradcheck_difference(values, points, i, offsets);
      } else if (state[i] == gradcheck_output::compared) {
        usable = false;
      }
    }
    if (!usable) continue;

    const double analytic = inner(x.data(), u, v, state);
    if (!std::isfinite(analytic)) {
      tally.problem(std::string("analytic ") + analytic_name + " is " +
                        gradcheck_describe(analytic) + " in direction " + std::to_string(k) +
                        " (does the callable write every entry?)",
                    gradcheck_result::npos, gradcheck_result::npos, direction, analytic, numeric);
      continue;
    }
    const double scale = std::max(std::fabs(analytic), std::fabs(numeric));
    tally.compare(analytic, numeric, options.atol + options.rtol * scale, gradcheck_result::npos,
                  gradcheck_result::npos, direction);
  }
  tally.finish();
  return result;
}

}  // namespace detail

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
  return detail::gradcheck_full("check_vjp", f, fill, x, m, options);
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
  return detail::gradcheck_full("check_jvp", f, fill, x, m, options);
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
