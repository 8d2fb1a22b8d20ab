#include <doctest/doctest.h>

// The solver's last member predicted by the cumulant series (predict_member, tilt_family.hpp)
// instead of evaluated: on ordinary rows the solve takes one reduction fewer, and the predicted
// member agrees with the member the solve would have evaluated at the same t (the same solve
// with an evaluator that forms no κ₄ between the ends, so that nothing is predicted) and with a long double
// evaluation of that member — on LLM-like rows, near-deterministic rows whose modes trade places,
// and rows with t* near 1, at ε from 1e-6 to 0.4, float and double.

#include <troll/detail/cpu/row_kernels.hpp>
#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

#include "support/llm_rows.hpp"

namespace {

using namespace troll::detail;
using real = long double;

/// The CPU evaluator, counting its reductions (it can form the cumulants: the solve predicts).
template <class T>
struct predicting {
  cpu::tilt_evaluator<T> e;
  int* reductions;
  lse_state operator()(const tilt_param& u, const tilt_ref& r, bool cumulants = false) const {
    ++*reductions;
    return e(u, r, cumulants);
  }
  double exact_kl(const tilt_point& p) const { return e.exact_kl(p); }
  double ratio_sum(const tilt_point& p) const { return e.ratio_sum(p); }
  double old_log_sum() const { return e.old_log_sum(); }
};

/// The same with κ₄ dropped between the ends (the same septic first guess, first_guess in
/// family_solver.hpp, and the same κ₃, so the same Halley steps and the same members): nothing
/// is predicted (predict_member needs κ₄), every member is evaluated.
template <class T>
struct evaluating {
  cpu::tilt_evaluator<T> e;
  int* reductions;
  lse_state operator()(const tilt_param& u, const tilt_ref& r, bool cumulants = false) const {
    ++*reductions;
    lse_state st = e(u, r, cumulants);
    if (!(u.t == 0.0 || u.s == 0.0)) st.s4 = std::numeric_limits<double>::quiet_NaN();
    return st;
  }
  double exact_kl(const tilt_point& p) const { return e.exact_kl(p); }
  double ratio_sum(const tilt_point& p) const { return e.ratio_sum(p); }
  double old_log_sum() const { return e.old_log_sum(); }
};

/// The member at p's (t, s) relative to p.ref in long double: log_norm, E[d], Var[d], KL(π‖q).
struct member {
  real log_norm = 0, mu = 0, var = 0, kl = 0;
};
template <class T>
member long_double_member(const T* zn, const T* zo, std::size_t n, const tilt_point& p) {
  const real t = p.t, s = p.s;
  std::vector<real> w(n), d(n);
  real top_o = -std::numeric_limits<real>::infinity();
  for (std::size_t i = 0; i < n; ++i) top_o = std::max(top_o, real(zo[i]));
  real sum_q = 0;
  for (std::size_t i = 0; i < n; ++i) sum_q += std::exp(real(zo[i]) - top_o);
  const real log_sum_q = std::log(sum_q);
  for (std::size_t i = 0; i < n; ++i) {
    const real dn = real(zn[i]) - real(p.ref.zn), dold = real(zo[i]) - real(p.ref.zo);
    d[i] = real(zn[i]) - real(zo[i]);
    w[i] = t <= 0.5L ? dold + t * (dn - dold) : dn - s * (dn - dold);
  }
  real sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += std::exp(w[i]);
  member m;
  m.log_norm = std::log(sum);
  real mu = 0;
  for (std::size_t i = 0; i < n; ++i) mu += std::exp(w[i] - m.log_norm) * d[i];
  real var = 0, kl = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const real log_pi = w[i] - m.log_norm, pi = std::exp(log_pi);
    var += pi * (d[i] - mu) * (d[i] - mu);
    kl += pi * (log_pi - (real(zo[i]) - top_o - log_sum_q));
  }
  m.mu = mu;
  m.var = var;
  m.kl = kl;
  return m;
}

/// An LLM-like pair: Zipf-like old logits with noise, the new row perturbed by δ·g with δ drawn
/// so that KL(p̃ ‖ q) lands between ~2ε and ~50ε.
/// Shape 1: near-deterministic rows (one token 30 above the rest in the old row, another 25
/// above in the new one: t* where the two modes trade places). Shape 2: the same LLM-like row
/// with KL(p̃ ‖ q) within a few per cent of ε (t* near 1).
template <class T>
void make_pair(std::mt19937_64& rng, std::size_t n, double eps, int shape, std::vector<T>& zn,
               std::vector<T>& zo) {
  std::uniform_real_distribution<double> unit;
  const double scale = std::sqrt(2.0 * eps) * (shape == 2 ? 1.05 : 1.5 + 5.0 * unit(rng));
  troll_test::llm_like_pair(rng, n, scale, shape == 1, zn, zo);
}

template <class T>
void check_rows(double rel_tol) {
  std::mt19937_64 rng(20261124);
  const double eps_values[] = {1e-6, 1e-3, 0.05, 0.4};
  const std::size_t sizes[] = {73, 1031, 20000};
  int rows = 0, long_rows = 0, predicted_rows = 0, llm_rows = 0, three_pass_rows = 0, llm_reductions = 0;
  std::vector<T> zn, zo;
  for (const std::size_t n : sizes) {
    for (const double eps : eps_values) {
      for (int k = 0; k < 9; ++k) {
        const int shape = k % 3;
        make_pair(rng, n, eps, shape, zn, zo);
        row_setup setup;
        REQUIRE_FALSE(cpu::scan_pair(zn.data(), zo.data(), n, setup, "new", "old"));
        const cpu::tilt_evaluator<T> eval = cpu::make_evaluator(zn.data(), zo.data(), n, setup);
        const troll::projection_options opt;
        int with = 0, without = 0;
        const solve_result a = solve_row(predicting<T>{eval, &with}, setup, eps, opt);
        const solve_result b = solve_row(evaluating<T>{eval, &without}, setup, eps, opt);
        if (b.status != troll::row_status::projected) continue;  // an inactive row
        ++rows;
        CAPTURE(n);
        CAPTURE(eps);
        CAPTURE(k);
        CAPTURE(shape);
        REQUIRE(a.status == troll::row_status::projected);
        // the same Newton steps: the same members, the last one predicted or evaluated
        CHECK(a.iterations == b.iterations);
        CHECK(a.point.t == b.point.t);
        CHECK(a.point.s == b.point.s);
        CHECK(with <= without);
        // rows that evaluated two Newton members or more: the last one is what gets predicted
        // (counted on the LLM-like shape; the others are checked for accuracy only)
        if (without >= 4 && shape == 0) ++long_rows, predicted_rows += with < without ? 1 : 0;
        // LLM-like rows: the septic first guess (first_guess) puts the first Newton member close
        // enough to t* for the next one to be predicted: three reductions (t = 0, t = 1, one
        // Newton member) where the cubic guess took four
        if (shape == 0) ++llm_rows, three_pass_rows += with == 3 ? 1 : 0, llm_reductions += with;
        // the predicted member against the evaluated one and against long double
        const member m = long_double_member(zn.data(), zo.data(), n, a.point);
        const double ulp = std::numeric_limits<double>::epsilon();
        CHECK(std::fabs(a.point.kl - eps) <= 1e-11 * eps);
        CHECK(std::fabs(double(m.kl) - eps) <= 1e-10 * eps * rel_tol);
        // An evaluation sums its terms in one accumulator a lane over chunks of 512 tokens: its
        // rounding grows as the square root of the terms a lane (8 ulp with AVX-512's eight
        // lanes; 6.5 ulp from long double measured in an SSE2 build's two lanes at n = 20000).
        const double pair_ulps = 8 * std::sqrt(8.0 / Eigen::internal::packet_traits<double>::size);
        if (a.point.ref.zn == b.point.ref.zn && a.point.ref.zo == b.point.ref.zo) {
          CHECK(std::fabs(a.point.log_norm - b.point.log_norm) <= pair_ulps * ulp * (1.0 + std::fabs(b.point.log_norm)));
        } else {
          // Written relative to different reference tokens (the member predicted from the first
          // Newton member keeps that member's reference, the mode of the end it started from):
          // log_norm + s·z°_r + t·z̃_r is the same number for every reference r.
          const real shift_a = real(a.point.s) * a.point.ref.zo + real(a.point.t) * a.point.ref.zn;
          const real shift_b = real(b.point.s) * b.point.ref.zo + real(b.point.t) * b.point.ref.zn;
          CHECK(std::fabs(double((a.point.log_norm + shift_a) - (b.point.log_norm + shift_b))) <=
                pair_ulps * ulp * (1.0 + std::fabs(b.point.log_norm) + double(std::fabs(shift_a) + std::fabs(shift_b))));
        }
        CHECK(std::fabs(a.point.log_norm - double(m.log_norm)) <= 16 * ulp * (1.0 + std::fabs(double(m.log_norm))));
        const double sd = std::sqrt(double(m.var));
        CHECK(std::fabs(a.point.mu - double(m.mu)) <= 1e-12 * (std::fabs(double(m.mu)) + sd));
        CHECK(std::fabs(a.point.sigma2 - double(m.var)) <= 1e-12 * double(m.var));
        CHECK(std::fabs(a.point.sigma2 - b.point.sigma2) <= 1e-12 * b.point.sigma2);
      }
    }
  }
  // the prediction must take on ordinary rows (it saves the pass on nearly all of them)
  CHECK(rows >= 40);
  CHECK(long_rows >= 15);
  // (10 of 24 here: the Halley steps bring the other rows' last evaluated member within tol
  // outright, so there is nothing left to predict; declined: wide rows, L ~ 50, at ε = 0.4)
  CHECK(predicted_rows * 3 >= long_rows);
  MESSAGE(three_pass_rows << " of " << llm_rows << " LLM-like solves took three reductions");
  CHECK(three_pass_rows * 3 >= llm_rows);  // (15 of 36; wide rows at ε ≥ 0.05 take four)
  // The septic start and the Halley steps: 131 reductions for the 36 rows (3.64 a row; 139 with
  // Newton steps and the cubic guess on the rows of 73).
  MESSAGE(llm_reductions << " reductions for " << llm_rows << " LLM-like solves");
  CHECK(llm_reductions * 4 <= llm_rows * 15);  // at most 3.75 a row (other packet widths round apart)
  MESSAGE(predicted_rows << " of " << long_rows << " solves of two Newton members or more predicted the last");
}

/// KL(p̃ ‖ q) of a pair of logit rows (double).
double pair_kl(const std::vector<double>& zn, const std::vector<double>& zo) {
  const double mn = *std::max_element(zn.begin(), zn.end()), mo = *std::max_element(zo.begin(), zo.end());
  double sn = 0, so = 0, weighted = 0;
  for (std::size_t i = 0; i < zn.size(); ++i) {
    const double e = std::exp(zn[i] - mn);
    sn += e;
    so += std::exp(zo[i] - mo);
    weighted += e * ((zn[i] - mn) - (zo[i] - mo));
  }
  return weighted / sn - std::log(sn) + std::log(so);
}

}  // namespace

// The rows of bench_dense (Zipf-like old rows with noise, the new row z° + δ·g with KL(p̃ ‖ q)
// aimed at [2ε, 8ε], ε = 0.05): the septic first guess (first_guess, family_solver.hpp) lands
// the first Newton member within reach of the prediction, so a row takes three reductions
// (t = 0, t = 1, one Newton member) — the cubic guess took four — and the member written is the
// long double one.
TEST_CASE("LLM-like rows take three reductions and keep their accuracy") {
  std::mt19937_64 rng(20261124);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unit;
  const double eps = 0.05;
  const std::size_t n = 32768;
  int rows = 0, three = 0;
  for (int k = 0; k < 16; ++k) {
    std::vector<double> zo(n), g(n), zn(n);
    for (std::size_t i = 0; i < n; ++i) {
      zo[i] = -1.1 * std::log1p(double((i * 7919 + std::size_t(k) * 104729) % n)) + 0.5 * normal(rng);
      g[i] = normal(rng);
    }
    const double target = 2.0 * eps * std::pow(4.0, unit(rng));
    double scale = std::sqrt(2.0 * target);
    for (int step = 0; step < 6; ++step) {
      for (std::size_t i = 0; i < n; ++i) zn[i] = zo[i] + scale * g[i];
      scale *= std::sqrt(target / pair_kl(zn, zo));
    }
    std::vector<float> fn(n), fo(n);
    for (std::size_t i = 0; i < n; ++i) fn[i] = float(zo[i] + scale * g[i]), fo[i] = float(zo[i]);
    row_setup setup;
    REQUIRE_FALSE(cpu::scan_pair(fn.data(), fo.data(), n, setup, "new", "old"));
    const cpu::tilt_evaluator<float> eval = cpu::make_evaluator(fn.data(), fo.data(), n, setup);
    int reductions = 0;
    const solve_result r = solve_row(predicting<float>{eval, &reductions}, setup, eps, troll::projection_options{});
    CAPTURE(k);
    REQUIRE(r.status == troll::row_status::projected);
    ++rows;
    three += reductions == 3 ? 1 : 0;
    CHECK(reductions <= 4);
    const member m = long_double_member(fn.data(), fo.data(), n, r.point);
    const double ulp = std::numeric_limits<double>::epsilon();
    CHECK(std::fabs(double(m.kl) - eps) <= 1e-10 * eps);
    CHECK(std::fabs(r.point.log_norm - double(m.log_norm)) <= 16 * ulp * (1.0 + std::fabs(double(m.log_norm))));
    const double sd = std::sqrt(double(m.var));
    CHECK(std::fabs(r.point.mu - double(m.mu)) <= 1e-12 * (std::fabs(double(m.mu)) + sd));
    CHECK(std::fabs(r.point.sigma2 - double(m.var)) <= 1e-12 * double(m.var));
  }
  MESSAGE(three << " of " << rows << " rows took three reductions");
  CHECK(three * 4 >= rows * 3);
}

TEST_CASE("the last member is predicted on ordinary rows and equals the evaluated one (double)") {
  check_rows<double>(1.0);
}

TEST_CASE("the last member is predicted on ordinary rows and equals the evaluated one (float)") {
  check_rows<float>(1.0);
}

TEST_CASE("predict_member declines what it cannot bound") {
  tilt_point p;
  p.t = 0.3;
  p.s = 0.7;
  p.sigma2 = 0.5;
  p.mean_x = 0.1;
  p.kappa3 = 0.2;
  p.kappa4 = 0.1;
  p.kl = 0.05;
  p.kl_error = 0.0;
  const double tol = 1e-11 * 0.05;
  tilt_point out;
  const tilt_param near_u = tilt_at(0.3 + 1e-13);
  CHECK(predict_member(p, near_u, 10.0, 0.05, tol, out));  // a tiny step, converged
  CHECK(out.t == near_u.t);
  CHECK_FALSE(predict_member(p, near_u, std::numeric_limits<double>::infinity(), 0.05, tol, out));  // L unknown
  CHECK_FALSE(predict_member(p, tilt_at(0.3 + 1e-3), 10.0, 0.05, tol, out));  // the KL moves past tol
  CHECK_FALSE(predict_member(p, tilt_at(0.3 + 0.2), 10.0, 0.05, tol, out));   // |h|·L > 1/2
  CHECK_FALSE(predict_member(p, near_u, 1e4, 0.05, tol, out));  // Var's bound coarser than an evaluation
  tilt_point q = p;
  q.kappa4 = std::numeric_limits<double>::quiet_NaN();  // the reduction formed no cumulants
  CHECK_FALSE(predict_member(q, near_u, 10.0, 0.05, tol, out));
  q = p;
  q.kl = 0.05 * (1 + 1e-9);  // not converged
  CHECK_FALSE(predict_member(q, near_u, 10.0, 0.05, tol, out));
}
