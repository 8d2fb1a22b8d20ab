// troll/detail/gradcheck_steps.hpp — the gradient checker's steps (argument checks, evaluation,
// the numeric Jacobian in full and random-direction modes, the direction generator), kept out of
// the public <troll/gradcheck.hpp>.
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

#include "../config.hpp"
#include "../errors.hpp"
#include "../gradcheck_types.hpp"

TROLL_BEGIN_NAMESPACE

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

  /// A finite defect that is not a comparison of analytic with numeric: a direction the step
  /// could not move x along, a derivative that is not linear in its vector. It fails the check
  /// with its own reason (the first one; `failed` counts only comparisons).
  void defect(const std::string& reason, std::size_t output, std::size_t input, std::size_t direction,
              double analytic, double expected, double tolerance) {
    if (defects_++ > 0) return;
    defect_ = reason;
    if (result_.nonfinite == 0 && result_.failed == 0)
      set_worst(output, input, direction, analytic, expected, tolerance);
  }

  void finish() {
    gradcheck_result& r = result_;
    const char* unit = r.random_directions ? "directions" : "entries";
    if (r.nonfinite > 0) {
      if (r.nonfinite > 1) {
        r.reason += " (and " + std::to_string(r.nonfinite - 1) + " more non-finite problem" +
                    (r.nonfinite > 2 ? "s)" : ")");
      }
    } else if (r.failed > 0 || defects_ > 0) {
      if (r.failed > 0)
        r.reason = std::to_string(r.failed) + " of " + std::to_string(r.checked) + " compared " + unit +
                   " exceed the tolerance";
      if (defects_ > 0) {
        r.reason += (r.reason.empty() ? "" : "; ") + defect_;
        if (defects_ > 1)
          r.reason += " (and " + std::to_string(defects_ - 1) + " more like it)";
      }
    } else if (r.checked == 0) {
      r.reason = "nothing was compared: every output is -inf at x";
    }
    r.ok = r.nonfinite == 0 && r.failed == 0 && defects_ == 0 && r.checked > 0;
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
  std::size_t defects_ = 0;
  std::string defect_;
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

/// Whether x + offset and x − offset are finite doubles (the largest offset of a central
/// difference; the Richardson half steps then fit too).
inline bool gradcheck_shift_fits(double x, double offset) {
  return std::isfinite(x + offset) && std::isfinite(x - offset);
}

/// The report of an evaluation point beyond the doubles.
inline std::string gradcheck_overflow_text(const std::string& along) {
  return "x + h*" + along + " overflows the doubles (|x| near DBL_MAX against the step): f is not evaluated "
         "there; lower `step` or check a smaller x";
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

/// No check beyond the entries: gradcheck_full's default for `linear`.
struct gradcheck_no_linearity {
  template <class... Args>
  void operator()(Args&&...) const {}
};

/// Full-Jacobian driver: numeric Jacobian column by column, analytic Jacobian from `fill`
/// (called as fill(x, J, state) on a NaN-filled m*n row-major J), then entry-wise comparison,
/// then linear(J, state, tally): the VJP / JVP modes' check that the product they built J from
/// with unit vectors is linear (gradcheck_linearity).
template <class F, class Fill, class Linear = gradcheck_no_linearity>
gradcheck_result gradcheck_full(const char* mode, F& f, Fill&& fill, const std::vector<double>& x,
                                std::size_t m, const gradcheck_options& options, Linear&& linear = Linear{}) {
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
    const std::string along = "e_" + std::to_string(j) + ", h = " + gradcheck_number(h);
    // x_j + h overflows where |x_j| is near DBL_MAX: the offset taken is then inf and every
    // difference divided by it 0, which would compare 0 with the analytic entry (or pass 0 = 0).
    if (!gradcheck_shift_fits(x[j], h)) {
      tally.problem(gradcheck_overflow_text(along), gradcheck_result::npos, j, gradcheck_result::npos, nan, nan);
      continue;
    }
    for (int p = 0; p < points; ++p) {
      shifted[j] = x[j] + wanted[p];
      offsets[p] = shifted[j] - x[j];
      gradcheck_evaluate(f, shifted.data(), values[static_cast<std::size_t>(p)].data(), m);
    }
    shifted[j] = x[j];
    for (std::size_t i = 0; i < m; ++i) {
      if (gradcheck_usable(values, points, i, state[i], y[i], along, j, gradcheck_result::npos,
                           tally)) {
        const double d = gradcheck_difference(values, points, i, offsets);
        // Finite values whose difference overflows (or Richardson's inf − inf): nothing reported
        // them, and skipping the entry would pass an unchecked one.
        if (!std::isfinite(d))
          tally.problem("numeric entry (output " + std::to_string(i) + ", input " + std::to_string(j) + ") is " +
                            gradcheck_describe(d) + ": the finite difference of finite values overflows along " +
                            along + " (a smaller step?)",
                        i, j, gradcheck_result::npos, nan, d);
        numeric[i * n + j] = d;
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
      if (!std::isfinite(d)) continue;  // reported above (here or by gradcheck_usable)
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
  linear(analytic, state, tally);
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
/// The linearity check of the full VJP / JVP modes, which build J from unit vectors only (a
/// product wrong for every other vector — a VJP that forgets the factor Σ gy, or reads |gy| —
/// would pass them): one more call with a random unit vector w (over the compared outputs for a
/// VJP), product(x, w, out), whose result must be J's combination of w: Σ_i w_i J[i, :] (VJP,
/// `rows` = true) or J w (JVP), entry by entry to atol + rtol·max(|out|, Σ |w J|), the scale
/// of the terms summed (rounding in the combination cannot fail it).
template <class Product>
void gradcheck_linearity(const char* name, Product&& product, const double* x, const std::vector<double>& jacobian,
                         std::size_t m, std::size_t n, bool rows, const std::vector<gradcheck_output>& state,
                         const gradcheck_options& options, gradcheck_tally& tally) {
  const std::size_t in = rows ? m : n, out_size = rows ? n : m;
  gradcheck_normal_generator generator(options.seed ^ 0x6c696e656172ull);  // "linear"
  std::vector<double> w(in), out(out_size, std::numeric_limits<double>::quiet_NaN());
  if (!gradcheck_unit_vector(generator, w, rows ? &state : nullptr)) return;
  product(x, w.data(), out.data());
  for (std::size_t o = 0; o < out_size; ++o) {
    if (!rows && state[o] != gradcheck_output::compared) continue;  // a JVP's skipped outputs are not read
    double expected = 0, scale = 0;
    for (std::size_t k = 0; k < in; ++k) {
      const double entry = rows ? jacobian[k * n + o] : jacobian[o * n + k];
      if (w[k] == 0.0) continue;  // a skipped output's NaN row
      expected += w[k] * entry;
      scale += std::fabs(w[k] * entry);
    }
    if (!std::isfinite(expected)) return;  // a non-finite J entry: reported by the comparison
    const double got = out[o];
    const double tolerance = options.atol + options.rtol * std::max(std::fabs(got), scale);
    if (std::isfinite(got) && std::fabs(got - expected) <= tolerance) continue;
    const std::string where = rows ? "input " + std::to_string(o) : "output " + std::to_string(o);
    tally.defect(std::string(name) + " is not linear: for a random unit " + (rows ? "gy" : "dx") + " it gives " +
                     gradcheck_number(got, 12) + " at " + where + ", the same combination of its unit-vector " +
                     (rows ? "rows " : "columns ") + gradcheck_number(expected, 12),
                 rows ? gradcheck_result::npos : o, rows ? o : gradcheck_result::npos, gradcheck_result::npos, got,
                 expected, tolerance);
    return;
  }
}

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
  std::vector<double> u(m), v(n), shifted(n), taken(n);
  std::vector<std::vector<double>> values(4, std::vector<double>(m)), moved(4, std::vector<double>(n));
  for (int k = 0; k < options.directions; ++k) {
    const std::size_t direction = static_cast<std::size_t>(k);
    gradcheck_unit_vector(generator, v, nullptr);
    if (!gradcheck_unit_vector(generator, u, &state)) break;  // no compared output
    const std::string along =
        "v (direction " + std::to_string(k) + ", h = " + gradcheck_number(h) + ")";
    bool fits = true;
    for (std::size_t j = 0; j < n && fits; ++j) fits = gradcheck_shift_fits(x[j], h * v[j]);
    if (!fits) {  // x + h·v overflows (|x| near DBL_MAX): f is not evaluated there
      tally.problem(gradcheck_overflow_text(along), gradcheck_result::npos, gradcheck_result::npos, direction,
                    std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN());
      continue;
    }

    for (int p = 0; p < points; ++p) {
      std::vector<double>& offset = moved[static_cast<std::size_t>(p)];
      for (std::size_t j = 0; j < n; ++j) {
        shifted[j] = x[j] + offsets[p] * v[j];
        offset[j] = shifted[j] - x[j];  // the offset actually applied (exact where it is small)
      }
      gradcheck_evaluate(f, shifted.data(), values[static_cast<std::size_t>(p)].data(), m);
    }
    // The direction the numeric difference measures: x_j + h·v_j rounds to x_j's ulps, which
    // where h·v_j is not far above them (|x| ≳ 1e6 with a step lowered to suit it) changes the
    // direction by up to a few per cent; the analytic side is taken along that same direction,
    // Richardson-combined as the differences are (the full modes divide by the step taken).
    for (std::size_t j = 0; j < n; ++j) {
      const double coarse = (moved[0][j] - moved[1][j]) / (offsets[0] - offsets[1]);
      if (points == 2) {
        taken[j] = coarse;
      } else {
        const double fine = (moved[2][j] - moved[3][j]) / (offsets[2] - offsets[3]);
        taken[j] = fine + (fine - coarse) / 3.0;
      }
    }
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
    if (!std::isfinite(numeric)) {  // finite values whose difference overflows
      tally.problem("numeric derivative in direction " + std::to_string(k) + " is " + gradcheck_describe(numeric) +
                        ": the finite difference of finite values overflows along " + along + " (a smaller step?)",
                    gradcheck_result::npos, gradcheck_result::npos, direction, std::numeric_limits<double>::quiet_NaN(),
                    numeric);
      continue;
    }

    // A direction the step could not move x along (x + h·v rounds back to x: h·v below the
    // spacing of large |x|, most entries of a long v) compares 0 with 0 and proves nothing.
    double taken_norm2 = 0;
    for (double t : taken) taken_norm2 += t * t;
    const double taken_norm = std::sqrt(taken_norm2);
    if (!(taken_norm >= 0.5)) {
      tally.defect("direction " + std::to_string(k) + " moved x by only " + gradcheck_number(taken_norm, 3) +
                       " of the unit step along " + along +
                       ": x + h v rounds to x's doubles (|x| large against h): raise `step`",
                   gradcheck_result::npos, gradcheck_result::npos, direction, std::numeric_limits<double>::quiet_NaN(),
                   numeric, std::numeric_limits<double>::quiet_NaN());
      continue;
    }
    const double analytic = inner(x.data(), u, taken, state);
    if (!std::isfinite(analytic)) {
      tally.problem(std::string("analytic ") + analytic_name + " is " +
                        gradcheck_describe(analytic) + " in direction " + std::to_string(k) +
                        " (does the callable write every entry?)",
                    gradcheck_result::npos, gradcheck_result::npos, direction, analytic, numeric);
      continue;
    }
    const double scale = std::max(std::fabs(analytic), std::fabs(numeric));
    tally.compare(analytic, numeric, options.atol * taken_norm + options.rtol * scale, gradcheck_result::npos,
                  gradcheck_result::npos, direction);
  }
  tally.finish();
  return result;
}

}  // namespace detail

TROLL_END_NAMESPACE
