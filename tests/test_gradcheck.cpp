#include <doctest/doctest.h>

// Tests of troll/gradcheck.hpp: correct derivatives pass in every mode, wrong ones fail and the
// result points at the wrong entry (located independently from closed-form Jacobians), non-finite
// outputs are skipped or fail loudly, and bad arguments throw.

#include <troll/gradcheck.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "special_values.hpp"

namespace {

using troll_test::minus_inf;
using troll_test::nan_value;

std::vector<double> softmax(const double* x, std::size_t n, double temperature = 1.0) {
  double largest = minus_inf;
  for (std::size_t k = 0; k < n; ++k) largest = std::max(largest, temperature * x[k]);
  std::vector<double> p(n);
  double sum = 0;
  for (std::size_t k = 0; k < n; ++k) sum += p[k] = std::exp(temperature * x[k] - largest);
  for (double& value : p) value /= sum;
  return p;
}

// y = log_softmax(x) over n = 5 logits; J_ij = δ_ij − p_j, derived by hand.
constexpr std::size_t n5 = 5;
const std::vector<double> x5 = {0.3, -1.2, 2.0, 0.7, -0.4};

void log_softmax(const double* x, double* y) {
  double largest = minus_inf;
  for (std::size_t k = 0; k < n5; ++k) largest = std::max(largest, x[k]);
  double sum = 0;
  for (std::size_t k = 0; k < n5; ++k) sum += std::exp(x[k] - largest);
  const double log_normaliser = largest + std::log(sum);
  for (std::size_t k = 0; k < n5; ++k) y[k] = x[k] - log_normaliser;
}

void log_softmax_jacobian(const double* x, double* jacobian) {
  const std::vector<double> p = softmax(x, n5);
  for (std::size_t i = 0; i < n5; ++i) {
    for (std::size_t j = 0; j < n5; ++j) jacobian[i * n5 + j] = (i == j ? 1.0 : 0.0) - p[j];
  }
}

// gx_j = gy_j − p_j Σ_i gy_i
void log_softmax_vjp(const double* x, const double* gy, double* gx) {
  const std::vector<double> p = softmax(x, n5);
  double total = 0;
  for (std::size_t i = 0; i < n5; ++i) total += gy[i];
  for (std::size_t j = 0; j < n5; ++j) gx[j] = gy[j] - p[j] * total;
}

// dy_i = dx_i − Σ_j p_j dx_j
void log_softmax_jvp(const double* x, const double* dx, double* dy) {
  const std::vector<double> p = softmax(x, n5);
  double mean = 0;
  for (std::size_t j = 0; j < n5; ++j) mean += p[j] * dx[j];
  for (std::size_t i = 0; i < n5; ++i) dy[i] = dx[i] - mean;
}

// A claimed Jacobian M(x) (m×n row-major) turned into the three analytic forms, so one wrong
// matrix can be fed to every mode.
template <class Matrix>
struct claimed {
  Matrix matrix;
  std::size_t m, n;

  void jac(const double* x, double* out) const {
    const std::vector<double> values = matrix(x);
    std::copy(values.begin(), values.end(), out);
  }
  void vjp(const double* x, const double* gy, double* gx) const {
    const std::vector<double> values = matrix(x);
    for (std::size_t j = 0; j < n; ++j) {
      gx[j] = 0;
      for (std::size_t i = 0; i < m; ++i) gx[j] += values[i * n + j] * gy[i];
    }
  }
  void jvp(const double* x, const double* dx, double* dy) const {
    const std::vector<double> values = matrix(x);
    for (std::size_t i = 0; i < m; ++i) {
      dy[i] = 0;
      for (std::size_t j = 0; j < n; ++j) dy[i] += values[i * n + j] * dx[j];
    }
  }
};

template <class Matrix>
claimed<Matrix> make_claimed(Matrix matrix, std::size_t m, std::size_t n) {
  return claimed<Matrix>{std::move(matrix), m, n};
}

struct all_modes {
  troll::gradcheck_result jacobian, vjp, jvp, vjp_random, jvp_random;
  std::vector<const troll::gradcheck_result*> full() const { return {&jacobian, &vjp, &jvp}; }
  std::vector<const troll::gradcheck_result*> random() const { return {&vjp_random, &jvp_random}; }
  std::vector<const troll::gradcheck_result*> every() const {
    return {&jacobian, &vjp, &jvp, &vjp_random, &jvp_random};
  }
};

template <class F, class Matrix>
all_modes run_all_modes(F f, const claimed<Matrix>& c, const std::vector<double>& x,
                        const troll::gradcheck_options& options = {}) {
  auto jac = [&](const double* at, double* out) { c.jac(at, out); };
  auto vjp = [&](const double* at, const double* gy, double* gx) { c.vjp(at, gy, gx); };
  auto jvp = [&](const double* at, const double* dx, double* dy) { c.jvp(at, dx, dy); };
  all_modes r;
  r.jacobian = troll::check_jacobian(f, jac, x, c.m, options);
  r.vjp = troll::check_vjp(f, vjp, x, c.m, options);
  r.jvp = troll::check_jvp(f, jvp, x, c.m, options);
  r.vjp_random = troll::check_vjp_random(f, vjp, x, c.m, options);
  r.jvp_random = troll::check_jvp_random(f, jvp, x, c.m, options);
  return r;
}

// The entry the checker should call worst: argmax over (i, j) of |claimed − true| divided by the
// full-mode tolerance atol + rtol |true|, computed from closed forms alone.
std::pair<std::size_t, std::size_t> expected_worst(const std::vector<double>& wrong,
                                                   const std::vector<double>& truth, std::size_t m,
                                                   std::size_t n,
                                                   const troll::gradcheck_options& options = {}) {
  std::pair<std::size_t, std::size_t> worst{0, 0};
  double worst_ratio = -1;
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      const double t = truth[i * n + j];
      const double ratio =
          std::fabs(wrong[i * n + j] - t) / (options.atol + options.rtol * std::fabs(t));
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = {i, j};
      }
    }
  }
  return worst;
}

std::vector<double> true_log_softmax_jacobian(const double* x) {
  std::vector<double> jacobian(n5 * n5);
  log_softmax_jacobian(x, jacobian.data());
  return jacobian;
}

bool contains(const std::string& text, const std::string& piece) {
  return text.find(piece) != std::string::npos;
}

}  // namespace

TEST_CASE("log-softmax with its hand-derived derivatives passes in every mode") {
  all_modes r;
  r.jacobian = troll::check_jacobian(log_softmax, log_softmax_jacobian, x5, n5);
  r.vjp = troll::check_vjp(log_softmax, log_softmax_vjp, x5, n5);
  r.jvp = troll::check_jvp(log_softmax, log_softmax_jvp, x5, n5);
  r.vjp_random = troll::check_vjp_random(log_softmax, log_softmax_vjp, x5, n5);
  r.jvp_random = troll::check_jvp_random(log_softmax, log_softmax_jvp, x5, n5);
  for (const troll::gradcheck_result* result : r.every()) {
    INFO(result->report());
    CHECK(result->ok);
    CHECK(result->reason.empty());
    CHECK(result->failed == 0);
    CHECK(result->nonfinite == 0);
    CHECK(result->skipped_outputs == 0);
    CHECK(result->max_error_ratio <= 1.0);
    // Central differences with Richardson on smooth O(1) functions are far more accurate than the
    // tolerance: a loose numeric derivative would show here.
    CHECK(result->max_abs_error < 1e-8);
    CHECK(contains(result->report(), "PASSED"));
  }
  for (const troll::gradcheck_result* result : r.full()) {
    CHECK(result->checked == n5 * n5);
    CHECK(result->worst_output < n5);
    CHECK(result->worst_input < n5);
    CHECK(result->worst_direction == troll::gradcheck_result::npos);
  }
  for (const troll::gradcheck_result* result : r.random()) {
    CHECK(result->checked == 16);
    CHECK(result->worst_direction < 16);
    CHECK(result->worst_output == troll::gradcheck_result::npos);
  }
  CHECK(r.jacobian.mode == "check_jacobian");
  CHECK(r.vjp_random.mode == "check_vjp_random");
  CHECK(r.vjp_random.random_directions);
  CHECK_FALSE(r.jvp.random_directions);
}

TEST_CASE("the numeric value at the worst entry matches the closed form") {
  const troll::gradcheck_result r =
      troll::check_jacobian(log_softmax, log_softmax_jacobian, x5, n5);
  const std::vector<double> truth = true_log_softmax_jacobian(x5.data());
  const double expected = truth[r.worst_output * n5 + r.worst_input];
  CHECK(r.numeric_at_worst == doctest::Approx(expected).epsilon(1e-9));
  CHECK(r.analytic_at_worst == doctest::Approx(expected).epsilon(1e-15));
}

TEST_CASE("one Jacobian entry off by 1e-3 fails in every mode and is located") {
  const std::size_t bad_row = 2, bad_column = 3;
  auto perturbed = [=](const double* x) {
    std::vector<double> jacobian = true_log_softmax_jacobian(x);
    jacobian[bad_row * n5 + bad_column] += 1e-3;
    return jacobian;
  };
  const all_modes r = run_all_modes(log_softmax, make_claimed(perturbed, n5, n5), x5);
  for (const troll::gradcheck_result* result : r.every()) {
    INFO(result->report());
    CHECK_FALSE(result->ok);
    CHECK(result->failed >= 1);
    CHECK(result->max_error_ratio > 1.0);
    CHECK(contains(result->report(), "FAILED"));
    CHECK(contains(result->reason, "exceed the tolerance"));
  }
  const double truth = true_log_softmax_jacobian(x5.data())[bad_row * n5 + bad_column];
  for (const troll::gradcheck_result* result : r.full()) {
    INFO(result->report());
    CHECK(result->failed == 1);
    CHECK(result->worst_output == bad_row);
    CHECK(result->worst_input == bad_column);
    CHECK(result->analytic_at_worst == doctest::Approx(truth + 1e-3).epsilon(1e-12));
    CHECK(result->numeric_at_worst == doctest::Approx(truth).epsilon(1e-8));
    CHECK(result->max_abs_error == doctest::Approx(1e-3).epsilon(1e-5));
    CHECK(contains(result->report(), "output 2, input 3"));
  }
  for (const troll::gradcheck_result* result : r.random()) {
    CHECK(result->worst_direction < 16);
  }
}

TEST_CASE("a transposed Jacobian fails in every mode at the most wrong entry") {
  auto transposed = [](const double* x) {
    const std::vector<double> jacobian = true_log_softmax_jacobian(x);
    std::vector<double> result(n5 * n5);
    for (std::size_t i = 0; i < n5; ++i) {
      for (std::size_t j = 0; j < n5; ++j) result[i * n5 + j] = jacobian[j * n5 + i];
    }
    return result;
  };
  const all_modes r = run_all_modes(log_softmax, make_claimed(transposed, n5, n5), x5);
  const std::vector<double> wrong = transposed(x5.data());
  const auto worst = expected_worst(wrong, true_log_softmax_jacobian(x5.data()), n5, n5);
  REQUIRE(worst.first != worst.second);
  for (const troll::gradcheck_result* result : r.every()) {
    INFO(result->report());
    CHECK_FALSE(result->ok);
  }
  for (const troll::gradcheck_result* result : r.full()) {
    INFO(result->report());
    CHECK(result->worst_output == worst.first);
    CHECK(result->worst_input == worst.second);
    CHECK(result->failed == n5 * n5 - n5);  // every off-diagonal entry: p_i ≠ p_j here
  }
}

TEST_CASE("a missing factor (temperature 2 forgotten) fails in every mode") {
  const double temperature = 2.0;
  auto f = [=](const double* x, double* y) {
    double scaled[n5];
    for (std::size_t k = 0; k < n5; ++k) scaled[k] = temperature * x[k];
    log_softmax(scaled, y);
  };
  // True Jacobian: T (δ_ij − p_j) with p = softmax(T x); the claimed one drops T.
  auto truth_of = [=](const double* x) {
    const std::vector<double> p = softmax(x, n5, temperature);
    std::vector<double> jacobian(n5 * n5);
    for (std::size_t i = 0; i < n5; ++i) {
      for (std::size_t j = 0; j < n5; ++j) {
        jacobian[i * n5 + j] = temperature * ((i == j ? 1.0 : 0.0) - p[j]);
      }
    }
    return jacobian;
  };
  auto missing_factor = [=](const double* x) {
    std::vector<double> jacobian = truth_of(x);
    for (double& value : jacobian) value /= temperature;
    return jacobian;
  };
  const std::vector<double> truth = truth_of(x5.data());
  const auto worst = expected_worst(missing_factor(x5.data()), truth, n5, n5);

  const all_modes wrong = run_all_modes(f, make_claimed(missing_factor, n5, n5), x5);
  for (const troll::gradcheck_result* result : wrong.every()) {
    INFO(result->report());
    CHECK_FALSE(result->ok);
  }
  for (const troll::gradcheck_result* result : wrong.full()) {
    INFO(result->report());
    CHECK(result->failed == n5 * n5);
    CHECK(result->worst_output == worst.first);
    CHECK(result->worst_input == worst.second);
    CHECK(result->numeric_at_worst ==
          doctest::Approx(truth[worst.first * n5 + worst.second]).epsilon(1e-8));
  }

  // The same closed form with the factor restored passes: the failure is the factor, not f.
  const all_modes right = run_all_modes(f, make_claimed(truth_of, n5, n5), x5);
  for (const troll::gradcheck_result* result : right.every()) {
    INFO(result->report());
    CHECK(result->ok);
  }
}

TEST_CASE("pass iff |analytic - numeric| <= atol + rtol |numeric|, at the boundary") {
  // f(x) = A x is linear, so the numeric Jacobian is A up to ~1e-10 round-off; the tolerance at
  // entry (1, 2), where A = 1.5, is 1e-6 + 1e-4 * 1.5 = 1.51e-4.
  const std::vector<double> a = {0.5, -2.0, 1.0, 3.0, 0.25, 1.5};
  auto f = [&](const double* x, double* y) {
    for (std::size_t i = 0; i < 2; ++i)
      y[i] = a[i * 3] * x[0] + a[i * 3 + 1] * x[1] + a[i * 3 + 2] * x[2];
  };
  const std::vector<double> x = {0.7, -0.3, 2.5};
  auto with_offset = [&](double offset) {
    return [&a, offset](const double*, double* jacobian) {
      std::copy(a.begin(), a.end(), jacobian);
      jacobian[5] += offset;
    };
  };
  const double tolerance = 1e-6 + 1e-4 * 1.5;
  const troll::gradcheck_result inside =
      troll::check_jacobian(f, with_offset(0.97 * tolerance), x, 2);
  const troll::gradcheck_result outside =
      troll::check_jacobian(f, with_offset(1.03 * tolerance), x, 2);
  CHECK(inside.ok);
  CHECK(inside.max_error_ratio == doctest::Approx(0.97).epsilon(1e-4));
  CHECK_FALSE(outside.ok);
  CHECK(outside.failed == 1);
  CHECK(outside.worst_output == 1);
  CHECK(outside.worst_input == 2);
  CHECK(outside.tolerance_at_worst == doctest::Approx(tolerance).epsilon(1e-6));

  troll::gradcheck_options loose;
  loose.rtol = 1e-3;
  CHECK(troll::check_jacobian(f, with_offset(1.03 * tolerance), x, 2, loose).ok);
}

TEST_CASE("Richardson extrapolation removes the O(h^2) truncation error") {
  // d/dx sin(3x) = 3 cos(3x). With step 1e-2 the plain central difference is off by
  // ~ h² · 27 / 6 ≈ 4.5e-4 (relative 1.5e-4 of the derivative); the extrapolated one by ~1e-8.
  auto f = [](const double* x, double* y) { y[0] = std::sin(3 * x[0]); };
  auto jac = [](const double* x, double* jacobian) { jacobian[0] = 3 * std::cos(3 * x[0]); };
  const std::vector<double> x = {0.4};
  troll::gradcheck_options options;
  options.step = 1e-2;
  options.atol = 0;
  options.rtol = 1e-6;
  options.richardson = false;
  const troll::gradcheck_result plain = troll::check_jacobian(f, jac, x, 1, options);
  options.richardson = true;
  const troll::gradcheck_result extrapolated = troll::check_jacobian(f, jac, x, 1, options);
  INFO(plain.report());
  INFO(extrapolated.report());
  CHECK_FALSE(plain.ok);
  CHECK(plain.max_abs_error == doctest::Approx(1e-4 * 27 / 6 * std::cos(1.2)).epsilon(1e-2));
  CHECK(extrapolated.ok);
  CHECK(extrapolated.max_abs_error < 1e-7);
}

TEST_CASE("an output that is -inf at x is skipped and counted") {
  // Log-softmax over 5 logits with token 1 masked: y_1 = -inf for every x, and x_1 has no effect.
  const std::size_t masked = 1;
  auto masked_log_softmax = [=](const double* x, double* y) {
    double logits[n5];
    std::copy(x, x + n5, logits);
    logits[masked] = minus_inf;
    log_softmax(logits, y);
  };
  auto truth = [=](const double* x) {
    double logits[n5];
    std::copy(x, x + n5, logits);
    logits[masked] = minus_inf;
    const std::vector<double> p = softmax(logits, n5);
    std::vector<double> jacobian(n5 * n5);
    for (std::size_t i = 0; i < n5; ++i) {
      for (std::size_t j = 0; j < n5; ++j) {
        jacobian[i * n5 + j] = (i == masked || j == masked) ? 0.0 : (i == j ? 1.0 : 0.0) - p[j];
      }
    }
    return jacobian;
  };
  const all_modes r = run_all_modes(masked_log_softmax, make_claimed(truth, n5, n5), x5);
  // A masked row of a full Jacobian may hold anything: it is not read.
  auto jac_with_nan_row = [&](const double* x, double* jacobian) {
    make_claimed(truth, n5, n5).jac(x, jacobian);
    std::fill(jacobian + masked * n5, jacobian + (masked + 1) * n5, nan_value);
  };
  CHECK(troll::check_jacobian(masked_log_softmax, jac_with_nan_row, x5, n5).ok);
  for (const troll::gradcheck_result* result : r.every()) {
    INFO(result->report());
    CHECK(result->ok);
    CHECK(result->skipped_outputs == 1);
    CHECK(contains(result->report(), "1 output -inf at x, treated as constant"));
  }
  for (const troll::gradcheck_result* result : r.full()) CHECK(result->checked == (n5 - 1) * n5);

  // The VJP is never asked for a cotangent on the masked output.
  double largest_masked_cotangent = 0;
  auto vjp = [&](const double* x, const double* gy, double* gx) {
    largest_masked_cotangent = std::max(largest_masked_cotangent, std::fabs(gy[masked]));
    make_claimed(truth, n5, n5).vjp(x, gy, gx);
  };
  CHECK(troll::check_vjp(masked_log_softmax, vjp, x5, n5).ok);
  CHECK(troll::check_vjp_random(masked_log_softmax, vjp, x5, n5).ok);
  CHECK(largest_masked_cotangent == 0.0);

  // A wrong entry in an unmasked row is still caught with the mask present.
  auto wrong = [&](const double* x) {
    std::vector<double> jacobian = truth(x);
    jacobian[3 * n5 + 0] += 1e-3;
    return jacobian;
  };
  const all_modes bad = run_all_modes(masked_log_softmax, make_claimed(wrong, n5, n5), x5);
  for (const troll::gradcheck_result* result : bad.every()) CHECK_FALSE(result->ok);
  CHECK(bad.jacobian.worst_output == 3);
  CHECK(bad.jacobian.worst_input == 0);
}

TEST_CASE("a -inf output that turns finite nearby fails") {
  // y = log(max(x, 0)) at x = 0: -inf at x, finite at x + h.
  auto f = [](const double* x, double* y) { y[0] = std::log(std::max(x[0], 0.0)); };
  auto jac = [](const double*, double* jacobian) { jacobian[0] = 0; };
  const troll::gradcheck_result r = troll::check_jacobian(f, jac, {0.0}, 1);
  INFO(r.report());
  CHECK_FALSE(r.ok);
  CHECK(r.skipped_outputs == 1);
  CHECK(r.nonfinite >= 1);
  CHECK(contains(r.reason, "-inf at x but"));
  CHECK(contains(r.reason, "x + h*e_0"));
}

TEST_CASE("every output -inf: nothing compared is not a pass") {
  auto f = [](const double*, double* y) { y[0] = y[1] = minus_inf; };
  auto jac = [](const double*, double* jacobian) { std::fill(jacobian, jacobian + 2, 0.0); };
  auto vjp = [](const double*, const double*, double* gx) { gx[0] = 0; };
  const troll::gradcheck_result full = troll::check_jacobian(f, jac, {1.0}, 2);
  const troll::gradcheck_result random = troll::check_vjp_random(f, vjp, {1.0}, 2);
  for (const troll::gradcheck_result* result : {&full, &random}) {
    INFO(result->report());
    CHECK_FALSE(result->ok);
    CHECK(result->checked == 0);
    CHECK(result->skipped_outputs == 2);
    CHECK(contains(result->reason, "nothing was compared"));
  }
}

TEST_CASE("NaN outputs fail with a reason") {
  SUBCASE("NaN at x") {
    auto f = [](const double* x, double* y) {
      y[0] = x[0];
      y[1] = std::sqrt(x[0]);
    };
    auto jac = [](const double* x, double* jacobian) {
      jacobian[0] = 1;
      jacobian[1] = 0.5 / std::sqrt(x[0]);
    };
    auto vjp = [](const double* x, const double* gy, double* gx) {
      gx[0] = gy[0] + gy[1] * 0.5 / std::sqrt(x[0]);
    };
    const troll::gradcheck_result full = troll::check_jacobian(f, jac, {-1.0}, 2);
    const troll::gradcheck_result random = troll::check_vjp_random(f, vjp, {-1.0}, 2);
    for (const troll::gradcheck_result* result : {&full, &random}) {
      INFO(result->report());
      CHECK_FALSE(result->ok);
      CHECK(result->worst_output == 1);
      CHECK(contains(result->reason, "output 1 is NaN at x"));
      CHECK(contains(result->report(), "FAILED"));
    }
  }
  SUBCASE("finite at x, NaN at x - h") {
    // log(x) at x = 5e-7 with h = 1e-6: x - h < 0.
    auto f = [](const double* x, double* y) { y[0] = std::log(x[0]); };
    auto jac = [](const double* x, double* jacobian) { jacobian[0] = 1 / x[0]; };
    auto jvp = [](const double* x, const double* dx, double* dy) { dy[0] = dx[0] / x[0]; };
    const troll::gradcheck_result full = troll::check_jacobian(f, jac, {5e-7}, 1);
    const troll::gradcheck_result random = troll::check_jvp_random(f, jvp, {5e-7}, 1);
    for (const troll::gradcheck_result* result : {&full, &random}) {
      INFO(result->report());
      CHECK_FALSE(result->ok);
      CHECK(result->worst_output == 0);
      CHECK(contains(result->reason, "is finite at x"));
      CHECK(contains(result->reason, "but NaN at x "));
    }
    CHECK(contains(full.reason, "NaN at x - h*e_0"));
    CHECK(full.worst_input == 0);
    CHECK(random.worst_direction == 0);
  }
  SUBCASE("+inf at x is not treated as constant") {
    auto f = [](const double*, double* y) { y[0] = std::numeric_limits<double>::infinity(); };
    auto jac = [](const double*, double* jacobian) { jacobian[0] = 0; };
    const troll::gradcheck_result r = troll::check_jacobian(f, jac, {1.0}, 1);
    CHECK_FALSE(r.ok);
    CHECK(contains(r.reason, "+inf at x"));
  }
  SUBCASE("a NaN or unwritten analytic entry") {
    auto nan_entry = [](const double* x, double* jacobian) {
      log_softmax_jacobian(x, jacobian);
      jacobian[7] = nan_value;  // (1, 2)
    };
    const troll::gradcheck_result r = troll::check_jacobian(log_softmax, nan_entry, x5, n5);
    INFO(r.report());
    CHECK_FALSE(r.ok);
    CHECK(r.worst_output == 1);
    CHECK(r.worst_input == 2);
    CHECK(contains(r.reason, "analytic entry (output 1, input 2) is NaN"));

    // A VJP that skips gx[4] leaves the NaN pre-fill there.
    auto partial_vjp = [](const double* x, const double* gy, double* gx) {
      double full_gx[n5];
      log_softmax_vjp(x, gy, full_gx);
      std::copy(full_gx, full_gx + 4, gx);
    };
    const troll::gradcheck_result vjp = troll::check_vjp(log_softmax, partial_vjp, x5, n5);
    const troll::gradcheck_result random =
        troll::check_vjp_random(log_softmax, partial_vjp, x5, n5);
    CHECK_FALSE(vjp.ok);
    CHECK(vjp.worst_input == 4);
    CHECK_FALSE(random.ok);
    CHECK(contains(random.reason, "analytic <vjp(u), v> is NaN"));
  }
}

TEST_CASE("finite values whose difference overflows fail instead of skipping the entry") {
  // y0 = 1.7e308·tanh(1e7·x0) at x0 = 0: finite at every point, but y0(h) − y0(−h) overflows. The
  // full mode skipped that entry silently (checked 3 of 4, ok = true, a wrong J(0, 0) unnoticed).
  auto f = [](const double* x, double* y) {
    y[0] = 1.7e308 * std::tanh(1e7 * x[0]);
    y[1] = x[1] * x[1];
  };
  auto jac = [](const double* x, double* jacobian) {
    jacobian[0] = 12345.0;  // wrong (the exact value overflows a double)
    jacobian[1] = 0.0;
    jacobian[2] = 0.0;
    jacobian[3] = 2.0 * x[1];
  };
  auto jvp = [](const double* x, const double* dx, double* dy) {
    dy[0] = 12345.0 * dx[0];
    dy[1] = 2.0 * x[1] * dx[1];
  };
  const troll::gradcheck_result full = troll::check_jacobian(f, jac, {0.0, 1.0}, 2);
  const troll::gradcheck_result random = troll::check_jvp_random(f, jvp, {0.0, 1.0}, 2);
  for (const troll::gradcheck_result* result : {&full, &random}) {
    INFO(result->report());
    CHECK_FALSE(result->ok);
    CHECK(result->nonfinite > 0);
    CHECK(contains(result->reason, "overflows"));
  }
  CHECK(full.worst_output == 0);
  CHECK(full.worst_input == 0);
}

TEST_CASE("bad arguments throw troll::invalid_input") {
  auto jac = [](const double*, double* jacobian) { jacobian[0] = 0; };
  auto vjp = [](const double*, const double*, double* gx) { gx[0] = 0; };
  auto f = [](const double*, double* y) { y[0] = 0; };
  const std::vector<double> x = {1.0};
  CHECK_THROWS_AS(troll::check_jacobian(f, jac, x, 0), troll::invalid_input);
  CHECK_THROWS_AS(troll::check_jacobian(f, jac, std::vector<double>{}, 1), troll::invalid_input);
  CHECK_THROWS_AS(troll::check_vjp_random(f, vjp, std::vector<double>{}, 1), troll::invalid_input);
  CHECK_THROWS_AS(troll::check_jacobian(f, jac, {nan_value}, 1), troll::invalid_input);
  CHECK_THROWS_AS(troll::check_jacobian(f, jac, {minus_inf}, 1), troll::invalid_input);

  const auto throws_with = [&](troll::gradcheck_options options) {
    bool full = false, random = false;
    try {
      troll::check_jacobian(f, jac, x, 1, options);
    } catch (const troll::invalid_input&) {
      full = true;
    }
    try {
      troll::check_vjp_random(f, vjp, x, 1, options);
    } catch (const troll::invalid_input&) {
      random = true;
    }
    return std::make_pair(full, random);
  };
  troll::gradcheck_options options;
  options.step = 0;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options.step = -1e-6;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options.step = nan_value;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options.step = 1e-17;  // below the resolution of double: x + h == x
  CHECK(throws_with(options) == std::make_pair(true, true));
  options = {};
  options.atol = -1e-6;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options = {};
  options.rtol = -1e-4;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options = {};
  options.rtol = nan_value;
  CHECK(throws_with(options) == std::make_pair(true, true));
  options = {};
  options.directions = 0;  // only the random mode uses directions
  CHECK(throws_with(options) == std::make_pair(false, true));

  try {
    troll::check_vjp(f, vjp, x, 0);
    FAIL("expected a throw");
  } catch (const troll::invalid_input& error) {
    CHECK(contains(error.what(), "troll::check_vjp"));
    CHECK(contains(error.what(), "m = 0"));
  }
}

TEST_CASE("random mode with a wrong VJP fails for a fixed seed, reproducibly") {
  // A VJP that forgets the softmax term: gx = gy, i.e. claims J = I.
  auto wrong_vjp = [](const double*, const double* gy, double* gx) { std::copy(gy, gy + n5, gx); };
  troll::gradcheck_options options;
  options.seed = 12345;
  const troll::gradcheck_result first =
      troll::check_vjp_random(log_softmax, wrong_vjp, x5, n5, options);
  const troll::gradcheck_result again =
      troll::check_vjp_random(log_softmax, wrong_vjp, x5, n5, options);
  INFO(first.report());
  CHECK_FALSE(first.ok);
  CHECK(first.checked == 16);
  CHECK(first.failed >= 1);
  CHECK(first.worst_direction < 16);
  CHECK(contains(first.report(), "direction " + std::to_string(first.worst_direction)));

  // Same seed, same directions: bit-identical numbers.
  CHECK(again.worst_direction == first.worst_direction);
  CHECK(again.analytic_at_worst == first.analytic_at_worst);
  CHECK(again.numeric_at_worst == first.numeric_at_worst);

  // Another seed draws other directions (the numbers differ) and still fails.
  options.seed = 99;
  const troll::gradcheck_result other =
      troll::check_vjp_random(log_softmax, wrong_vjp, x5, n5, options);
  CHECK_FALSE(other.ok);
  CHECK(other.numeric_at_worst != first.numeric_at_worst);

  // With fewer directions the count follows the option.
  options.directions = 3;
  CHECK(troll::check_vjp_random(log_softmax, log_softmax_vjp, x5, n5, options).checked == 3);
}

TEST_CASE("random mode on a linear function agrees to round-off") {
  // f(x) = A x: the central difference along v is exactly A v up to round-off (~u |f| / h), so a
  // correct VJP passes a tolerance ten thousand times tighter than the default.
  const std::vector<double> a = {1.0, 2.0, -1.0, 0.5, 0.0, 3.0};  // 2 x 3
  auto f = [&](const double* x, double* y) {
    for (std::size_t i = 0; i < 2; ++i)
      y[i] = a[i * 3] * x[0] + a[i * 3 + 1] * x[1] + a[i * 3 + 2] * x[2];
  };
  auto vjp = [&](const double*, const double* gy, double* gx) {
    for (std::size_t j = 0; j < 3; ++j) gx[j] = a[j] * gy[0] + a[3 + j] * gy[1];
  };
  const std::vector<double> x = {0.2, -0.1, 0.4};
  troll::gradcheck_options tight;
  tight.atol = 1e-12;
  tight.rtol = 1e-8;
  const troll::gradcheck_result r = troll::check_vjp_random(f, vjp, x, 2, tight);
  INFO(r.report());
  CHECK(r.ok);
  CHECK(r.max_abs_error < 1e-9);
  // |<u, J v>| <= ||J||_2 for unit u, v: the numbers are on the scale of J, not of n or m.
  CHECK(std::fabs(r.numeric_at_worst) <= 4.0);
}

TEST_CASE("check_gradient on a softmax cross-entropy loss") {
  // loss(z) = logsumexp(z) − z_label; grad = softmax(z) − e_label.
  const std::size_t label = 2;
  auto loss = [&](const double* z) {
    double y[n5];
    log_softmax(z, y);
    return -y[label];
  };
  auto grad = [&](const double* z, double* g) {
    const std::vector<double> p = softmax(z, n5);
    for (std::size_t k = 0; k < n5; ++k) g[k] = p[k] - (k == label ? 1.0 : 0.0);
  };
  auto wrong_grad = [&](const double* z, double* g) {
    grad(z, g);
    g[label] += 1.0;  // forgot the −e_label
  };
  const troll::gradcheck_result right = troll::check_gradient(loss, grad, x5);
  const troll::gradcheck_result wrong = troll::check_gradient(loss, wrong_grad, x5);
  INFO(right.report());
  INFO(wrong.report());
  CHECK(right.ok);
  CHECK(right.checked == n5);
  CHECK(right.mode == "check_gradient");
  CHECK_FALSE(wrong.ok);
  CHECK(wrong.failed == 1);
  CHECK(wrong.worst_output == 0);
  CHECK(wrong.worst_input == label);
  CHECK(wrong.numeric_at_worst ==
        doctest::Approx(softmax(x5.data(), n5)[label] - 1.0).epsilon(1e-8));
}

TEST_CASE("large inputs use a relative step") {
  // f(x) = x² at x = 1e6: with an absolute step 1e-6 the difference would be lost to round-off
  // (ulp(1e12) ≈ 1.2e-4); the relative step h = 1 gets 2x exactly.
  auto f = [](const double* x, double* y) { y[0] = x[0] * x[0]; };
  auto jac = [](const double* x, double* jacobian) { jacobian[0] = 2 * x[0]; };
  const troll::gradcheck_result r = troll::check_jacobian(f, jac, {1e6}, 1);
  INFO(r.report());
  CHECK(r.ok);
  CHECK(r.max_rel_error < 1e-8);
}

TEST_CASE("the report names the mode, the verdict, the worst entry and the tolerances") {
  auto wrong = [](const double* x, double* jacobian) {
    log_softmax_jacobian(x, jacobian);
    jacobian[1 * n5 + 4] *= 1.01;
  };
  const troll::gradcheck_result r = troll::check_jacobian(log_softmax, wrong, x5, n5);
  const std::string text = r.report();
  INFO(text);
  CHECK(contains(text, "troll::check_jacobian: FAILED"));
  CHECK(contains(text, "full Jacobian, 5 outputs x 5 inputs"));
  CHECK(contains(text, "reason:    1 of 25 compared entries exceed the tolerance"));
  CHECK(contains(text, "worst:     output 1, input 4"));
  CHECK(contains(text, "analytic " + troll::detail::gradcheck_number(r.analytic_at_worst, 12)));
  CHECK(contains(text, "numeric " + troll::detail::gradcheck_number(r.numeric_at_worst, 12)));
  CHECK(contains(text, "atol 1e-06, rtol 0.0001"));
  CHECK(contains(text, "Richardson on"));
  CHECK(std::count(text.begin(), text.end(), '\n') >= 5);
}

TEST_CASE("an output the function forgets to write fails instead of passing on stale data") {
  // f promises m = 2 outputs but writes only y[0].
  auto f = [](const double* x, double* y) { y[0] = 2 * x[0]; };
  auto jac = [](const double*, double* jacobian) {
    jacobian[0] = 2;
    jacobian[1] = 0;
  };
  const troll::gradcheck_result r = troll::check_jacobian(f, jac, {0.5}, 2);
  INFO(r.report());
  CHECK_FALSE(r.ok);
  CHECK(r.worst_output == 1);
  CHECK(contains(r.reason, "output 1 is NaN at x"));
}

TEST_CASE("the difference divides by the step actually taken") {
  // For the identity, (f(x+h) − f(x−h)) / ((x+h) − (x−h)) is exactly 1 whatever rounding x + h
  // suffers; dividing by the nominal 2h instead would be off by ~1e-11 at these x.
  auto f = [](const double* x, double* y) { std::copy(x, x + 3, y); };
  auto jac = [](const double*, double* jacobian) {
    for (std::size_t k = 0; k < 9; ++k) jacobian[k] = (k % 4 == 0) ? 1.0 : 0.0;
  };
  for (bool richardson : {false, true}) {
    troll::gradcheck_options options;
    options.richardson = richardson;
    const troll::gradcheck_result r = troll::check_jacobian(f, jac, {0.1, -0.7, 3.3}, 3, options);
    INFO(r.report());
    CHECK(r.ok);
    CHECK(r.max_abs_error == 0.0);
  }
}

TEST_CASE("the direction generator is splitmix64 + Box-Muller, the same on every platform") {
  // Reference outputs of splitmix64 seeded with 1234567 (Vigna's splitmix64.c).
  troll::detail::gradcheck_normal_generator generator(1234567);
  CHECK(generator.next_bits() == 6457827717110365317ull);
  CHECK(generator.next_bits() == 3203168211198807973ull);
  CHECK(generator.next_bits() == 9817491932198370423ull);
  CHECK(generator.next_bits() == 4593380528125082431ull);
  CHECK(generator.next_bits() == 16408922859458223821ull);

  // Standard normal draws: mean 0 and variance 1 within ~4 standard errors of 20000 samples.
  troll::detail::gradcheck_normal_generator normals(troll::gradcheck_options{}.seed);
  const int samples = 20000;
  double sum = 0, sum_squares = 0;
  for (int k = 0; k < samples; ++k) {
    const double z = normals.next_normal();
    sum += z;
    sum_squares += z * z;
  }
  const double mean = sum / samples;
  CHECK(std::fabs(mean) < 4 / std::sqrt(double(samples)));
  CHECK(std::fabs(sum_squares / samples - mean * mean - 1) < 4 * std::sqrt(2.0 / samples));
}

TEST_CASE("random mode differences along the direction actually taken (large inputs, small step)") {
  // log Σ exp(x_j − c) at x_j ≈ c = 1e8 (logits with a large common offset): its curvature is
  // O(1) whatever c is, so the step must be absolute (step = 1e-14 relative gives h = 1e-6). x + h·v
  // then rounds each coordinate to ulp(1e8) ≈ 1.5e-8, a few per cent of h·v_j: the random mode
  // compared the difference along that rounded direction with ⟨vjp(u), v⟩ along the exact one and
  // failed a correct VJP (error ratio ~950 before). The full mode divides by the step taken and
  // passes; both modes must still fail a VJP 1% off.
  constexpr double offset = 1e8;
  const std::size_t n = 40;
  std::vector<double> x(n);
  for (std::size_t j = 0; j < n; ++j) x[j] = offset + std::sin(1.7 * double(j + 1));
  auto f = [&](const double* z, double* y) {
    double largest = minus_inf, sum = 0;
    for (std::size_t j = 0; j < n; ++j) largest = std::max(largest, z[j] - offset);
    for (std::size_t j = 0; j < n; ++j) sum += std::exp((z[j] - offset) - largest);
    y[0] = largest + std::log(sum);
  };
  auto make_vjp = [&](double error) {
    return [&, error](const double* z, const double* gy, double* gx) {
      std::vector<double> shifted(n);
      for (std::size_t j = 0; j < n; ++j) shifted[j] = z[j] - offset;
      const std::vector<double> p = softmax(shifted.data(), n);
      for (std::size_t j = 0; j < n; ++j) gx[j] = gy[0] * p[j] * (j == 0 ? 1.0 + error : 1.0);
    };
  };
  troll::gradcheck_options options;
  options.step = 1e-14;
  const troll::gradcheck_result random = troll::check_vjp_random(f, make_vjp(0.0), x, 1, options);
  INFO(random.report());
  CHECK(random.ok);
  CHECK(random.max_error_ratio < 0.01);
  CHECK(troll::check_vjp(f, make_vjp(0.0), x, 1, options).ok);
  CHECK_FALSE(troll::check_vjp_random(f, make_vjp(0.5), x, 1, options).ok);
  CHECK_FALSE(troll::check_vjp(f, make_vjp(0.01), x, 1, options).ok);
}

TEST_CASE("full VJP / JVP modes: a product right on unit vectors but not linear fails (one random vector more)") {
  // Found by the thirty-first session's audit: check_vjp calls the VJP with each e_i, so a VJP
  // that forgets the factor Σ gy (exact whenever Σ gy = 1) passed; check_vjp_random caught it.
  auto forgets_sum = [](const double* x, const double* gy, double* gx) {
    const std::vector<double> p = softmax(x, n5);
    for (std::size_t j = 0; j < n5; ++j) gx[j] = gy[j] - p[j];
  };
  auto reads_abs = [](const double* x, const double* gy, double* gx) {
    std::vector<double> a(gy, gy + n5);
    for (double& v : a) v = std::fabs(v);
    log_softmax_vjp(x, a.data(), gx);
  };
  auto quadratic_jvp = [](const double* x, const double* dx, double* dy) {
    std::vector<double> q(dx, dx + n5);
    for (double& v : q) v = v * std::fabs(v);
    log_softmax_jvp(x, q.data(), dy);
  };
  for (const troll::gradcheck_result& r : {troll::check_vjp(log_softmax, forgets_sum, x5, n5),
                                           troll::check_vjp(log_softmax, reads_abs, x5, n5),
                                           troll::check_jvp(log_softmax, quadratic_jvp, x5, n5)}) {
    INFO(r.report());
    CHECK_FALSE(r.ok);
    CHECK(r.failed == 0);  // every unit-vector entry matched the numeric Jacobian
    CHECK(r.reason.find("is not linear") != std::string::npos);
  }
  // The right products pass, and the linearity call adds nothing to the entries compared.
  const troll::gradcheck_result vjp = troll::check_vjp(log_softmax, log_softmax_vjp, x5, n5);
  const troll::gradcheck_result jvp = troll::check_jvp(log_softmax, log_softmax_jvp, x5, n5);
  CHECK(vjp.ok);
  CHECK(jvp.ok);
  CHECK(vjp.checked == n5 * n5);
  CHECK(jvp.checked == n5 * n5);
}

TEST_CASE("random mode: a direction the step cannot move x along fails instead of comparing 0 with 0") {
  // n = 8192 logits at 1e10 with step = 4 DBL_EPSILON: h·v_j ~ 1e-7 is below ulp(1e10) ~ 1.9e-6,
  // so x + h·v rounded back to x and every direction compared 0 with 0: a VJP scaled by -3 passed.
  const std::size_t n = 8192;
  std::vector<double> x(n);
  for (std::size_t j = 0; j < n; ++j) x[j] = 1e10 + std::sin(0.37 * double(j));
  auto f = [&](const double* z, double* y) {
    double largest = minus_inf, sum = 0;
    for (std::size_t j = 0; j < n; ++j) largest = std::max(largest, z[j]);
    for (std::size_t j = 0; j < n; ++j) sum += std::exp(z[j] - largest);
    y[0] = largest + std::log(sum);
  };
  auto vjp = [&](const double* z, const double* gy, double* gx) {
    double largest = minus_inf, sum = 0;
    for (std::size_t j = 0; j < n; ++j) largest = std::max(largest, z[j]);
    for (std::size_t j = 0; j < n; ++j) sum += std::exp(z[j] - largest);
    for (std::size_t j = 0; j < n; ++j) gx[j] = -3.0 * gy[0] * std::exp(z[j] - largest) / sum;
  };
  troll::gradcheck_options options;
  options.step = 4 * std::numeric_limits<double>::epsilon();
  options.directions = 4;
  const troll::gradcheck_result r = troll::check_vjp_random(f, vjp, x, 1, options);
  INFO(r.report());
  CHECK_FALSE(r.ok);
  CHECK(r.reason.find("raise `step`") != std::string::npos);
}

TEST_CASE("an evaluation point beyond the doubles fails instead of dividing by an infinite step") {
  // f(x) = atan(x_0 − 1.79e308) at x_0 = 1.79e308: f' = 1 there. With step = 0.1, x_0 + h overflows
  // to +inf, where f is a finite π/2: the step taken was inf and the difference π / inf = 0, so a
  // gradient of 0 (wrong) passed and a right one failed as a mismatch.
  const std::vector<double> x = {1.79e308, 0.5};
  auto loss = [](const double* z) { return std::atan(z[0] - 1.79e308) + z[1]; };
  auto wrong = [](const double*, double* g) {
    g[0] = 0.0;
    g[1] = 1.0;
  };
  auto right = [](const double* z, double* g) {
    const double d = z[0] - 1.79e308;
    g[0] = 1.0 / (1.0 + d * d);
    g[1] = 1.0;
  };
  troll::gradcheck_options options;
  options.step = 0.1;
  for (const bool correct : {false, true}) {
    const troll::gradcheck_result r =
        correct ? troll::check_gradient(loss, right, x, options) : troll::check_gradient(loss, wrong, x, options);
    INFO(r.report());
    CHECK_FALSE(r.ok);
    CHECK(r.reason.find("overflows the doubles") != std::string::npos);
    CHECK(r.worst_input == 0);
  }
  // Random mode, one input (every direction is ±e_0 and overflows).
  auto f = [](const double* z, double* y) { y[0] = std::atan(z[0] - 1.79e308); };
  auto vjp = [](const double*, const double*, double* gx) { gx[0] = 0.0; };
  options.directions = 3;
  const troll::gradcheck_result r = troll::check_vjp_random(f, vjp, std::vector<double>{1.79e308}, 1, options);
  INFO(r.report());
  CHECK_FALSE(r.ok);
  CHECK(r.reason.find("overflows the doubles") != std::string::npos);
  // A step that fits is checked as before.
  options.step = 1e-6;
  const std::vector<double> small = {0.25, 0.5};
  auto near = [](const double* z) { return std::atan(z[0]) + z[1]; };
  auto near_grad = [](const double* z, double* g) {
    g[0] = 1.0 / (1.0 + z[0] * z[0]);
    g[1] = 1.0;
  };
  CHECK(troll::check_gradient(near, near_grad, small, options).ok);
}
