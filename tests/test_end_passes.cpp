#include <doctest/doctest.h>

// The dense rows' end passes (detail/cpu/finite_rows.hpp): both ends reduced in one pass
// (tilt_reduce_ends) against the two one-pass reductions it replaces, bit for bit, and against
// long double sums; the solve with the fused ends against the solve with separate end passes,
// bit for bit, and its member against a long double evaluation; log_softmax's packet path
// against long double; and every inactive row's output against troll::log_softmax, bit for bit,
// on the rows that take the new paths and on those that do not (masked tokens, spread > 700).

#include <troll/detail/cpu/finite_rows.hpp>
#include <troll/detail/cpu/row_kernels.hpp>
#include <troll/kl.hpp>
#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "support/llm_rows.hpp"

namespace {

using namespace troll::detail;
using real = long double;

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

bool same_state(const lse_state& a, const lse_state& b, bool cumulants) {
  bool same = same_bits(a.m, b.m) && same_bits(a.s0, b.s0) && same_bits(a.s1, b.s1) && same_bits(a.s2, b.s2) &&
              same_bits(a.ref_new, b.ref_new) && same_bits(a.ref_old, b.ref_old);
  if (cumulants) same = same && same_bits(a.s3, b.s3) && same_bits(a.s4, b.s4);
  return same;
}

/// Row shapes: 0 LLM-like (Zipf-like old row with noise, the new one perturbed), 1 near-
/// deterministic (one token 30 above the rest in the old row, another 25 above in the new one),
/// 2 a spread just under 700 (a token near −699 below the top in both rows), 3 ties for both
/// maxima (the first of them is the reference), 4 a token the new row masks, 5 a spread above
/// 700 (the last two take the separate passes).
template <class T>
void make_rows(std::mt19937_64& rng, std::size_t n, int shape, double scale, std::vector<T>& zn,
               std::vector<T>& zo) {
  troll_test::llm_like_pair(rng, n, scale, shape == 1, zn, zo);
  if (shape == 2 && n > 2) {
    zo[n - 1] = T(-690.0);
    zn[n - 2] = T(-690.0);
  } else if (shape == 3 && n > 2) {
    zo[0] = zo[n - 1] = T(8.0);
    zn[1] = zn[n - 1] = T(9.0);
  } else if (shape == 4) {
    zn[n / 2] = -std::numeric_limits<T>::infinity();
  } else if (shape == 5) {
    zn[n / 2] = T(-800.0);
  }
}

/// Σ e^{w}·x^k (k = 0…4) at an end in long double, w and x relative to `ref` (exact: the rows'
/// entries widen exactly).
struct exact_end {
  real s[5] = {0, 0, 0, 0, 0};
};
template <class T>
exact_end end_sums(const std::vector<T>& zn, const std::vector<T>& zo, bool at_one, const tilt_ref& ref) {
  exact_end e;
  for (std::size_t i = 0; i < zn.size(); ++i) {
    const real dn = real(zn[i]) - real(ref.zn), dold = real(zo[i]) - real(ref.zo), x = dn - dold;
    const real w = std::exp(at_one ? dn : dold);
    real p = w;
    for (int k = 0; k < 5; ++k) e.s[k] += p, p *= x;
  }
  return e;
}

template <class T>
void check_ends(std::size_t n, int shape, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> zn, zo;
  make_rows(rng, n, shape, 0.4, zn, zo);
  row_setup setup;
  REQUIRE_FALSE(cpu::scan_pair(zn.data(), zo.data(), n, setup, "new", "old"));
  REQUIRE(setup.spread <= 700.0);
  const long count = long(n);
  for (bool cumulants : {false, true}) {
    lse_state zero, one, zero_ref, one_ref;
    if (cumulants) {
      cpu::tilt_reduce_ends<true>(zn.data(), zo.data(), count, setup.old_top, setup.new_top, zero, one);
      REQUIRE(cpu::tilt_reduce_one_pass<true>(zn.data(), zo.data(), count, tilt_at(0.0), setup.old_top, zero_ref));
      REQUIRE(cpu::tilt_reduce_one_pass<true>(zn.data(), zo.data(), count, tilt_at(1.0), setup.new_top, one_ref));
    } else {
      cpu::tilt_reduce_ends<false>(zn.data(), zo.data(), count, setup.old_top, setup.new_top, zero, one);
      REQUIRE(cpu::tilt_reduce_one_pass<false>(zn.data(), zo.data(), count, tilt_at(0.0), setup.old_top, zero_ref));
      REQUIRE(cpu::tilt_reduce_one_pass<false>(zn.data(), zo.data(), count, tilt_at(1.0), setup.new_top, one_ref));
    }
    CAPTURE(n);
    CAPTURE(shape);
    CAPTURE(cumulants);
    CHECK(same_state(zero, zero_ref, cumulants));
    CHECK(same_state(one, one_ref, cumulants));
    if (!cumulants) {
      CHECK(std::isnan(zero.s3));
      CHECK(std::isnan(one.s4));
    }
    // against long double: s0 and s2 to 1e-13 relative, s1 (and s3) against √(s0·s2) (√(s2·s4))
    const exact_end e0 = end_sums(zn, zo, false, setup.old_top), e1 = end_sums(zn, zo, true, setup.new_top);
    for (const auto& pair : {std::make_pair(zero, e0), std::make_pair(one, e1)}) {
      const lse_state& st = pair.first;
      const real* s = pair.second.s;
      CHECK(st.m == 0.0);
      CHECK(std::fabs(st.s0 - s[0]) <= 1e-13L * s[0]);
      CHECK(std::fabs(st.s1 - s[1]) <= 1e-13L * std::sqrt(s[0] * s[2]) + 1e-300L);
      CHECK(std::fabs(st.s2 - s[2]) <= 1e-13L * s[2] + 1e-300L);
      if (cumulants) {
        CHECK(std::fabs(st.s3 - s[3]) <= 1e-13L * std::sqrt(s[2] * s[4]) + 1e-300L);
        CHECK(std::fabs(st.s4 - s[4]) <= 1e-13L * s[4] + 1e-300L);
      }
    }
  }
}

}  // namespace

TEST_CASE("tilt_reduce_ends gives both ends' one-pass reductions bit for bit, and their long double sums") {
  for (std::size_t n : {1u, 2u, 3u, 7u, 8u, 9u, 16u, 17u, 77u, 511u, 512u, 513u, 1000u, 4099u, 151936u}) {
    for (int shape : {0, 1, 2, 3}) {
      if (n < 4 && shape != 0) continue;
      check_ends<double>(n, shape, 31u * unsigned(n) + unsigned(shape));
      check_ends<float>(n, shape, 37u * unsigned(n) + unsigned(shape));
    }
  }
}

namespace {

/// The CPU evaluator without its `ends`: the solve then reduces each end on its own.
template <class T>
struct separate_ends {
  cpu::tilt_evaluator<T> e;
  lse_state operator()(const tilt_param& u, const tilt_ref& r, bool cumulants = false) const {
    return e(u, r, cumulants);
  }
  double exact_kl(const tilt_point& p) const { return e.exact_kl(p); }
  double ratio_sum(const tilt_point& p) const { return e.ratio_sum(p); }
  double old_log_sum() const { return e.old_log_sum(); }
};

bool same_point(const tilt_point& a, const tilt_point& b) {
  return same_bits(a.t, b.t) && same_bits(a.s, b.s) && same_bits(a.log_norm, b.log_norm) && same_bits(a.kl, b.kl) &&
         same_bits(a.mu, b.mu) && same_bits(a.sigma2, b.sigma2) && same_bits(a.ref.zn, b.ref.zn) &&
         same_bits(a.ref.zo, b.ref.zo);
}

/// KL(π_t ‖ q) and log Σ e^{w} of the member at p's (t, s) relative to p.ref, in long double (J:
/// the tokens finite in both rows; q over every finite old token).
template <class T>
void long_double_member(const std::vector<T>& zn, const std::vector<T>& zo, const tilt_point& p, real& kl,
                        real& log_norm) {
  const std::size_t n = zn.size();
  real top = -std::numeric_limits<real>::infinity(), sum_q = 0;
  for (std::size_t i = 0; i < n; ++i) top = std::max(top, real(zo[i]));
  for (std::size_t i = 0; i < n; ++i) sum_q += std::exp(real(zo[i]) - top);
  const real log_sum_q = std::log(sum_q);
  std::vector<real> w(n, -std::numeric_limits<real>::infinity());
  real sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!(std::isfinite(double(zn[i])) && std::isfinite(double(zo[i])))) continue;
    const real dn = real(zn[i]) - real(p.ref.zn), dold = real(zo[i]) - real(p.ref.zo);
    w[i] = p.t <= 0.5 ? dold + real(p.t) * (dn - dold) : dn - real(p.s) * (dn - dold);
    sum += std::exp(w[i]);
  }
  log_norm = std::log(sum);
  kl = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (w[i] == -std::numeric_limits<real>::infinity()) continue;
    const real log_pi = w[i] - log_norm;
    kl += std::exp(log_pi) * (log_pi - (real(zo[i]) - top - log_sum_q));
  }
}

/// The solve of one row with the fused ends and with separate ones: the same result, bit for
/// bit; a projected row's member within the tolerance of ε in long double.
template <class T>
void check_solve(const std::vector<T>& zn, const std::vector<T>& zo, double eps, int& projected, int& inactive) {
  const std::size_t n = zn.size();
  row_setup setup;
  REQUIRE_FALSE(cpu::scan_pair(zn.data(), zo.data(), n, setup, "new", "old"));
  const cpu::tilt_evaluator<T> eval = cpu::make_evaluator(zn.data(), zo.data(), n, setup);
  const troll::projection_options opt{};
  const solve_result fused = solve_row(eval, setup, eps, opt);
  const solve_result apart = solve_row(separate_ends<T>{eval}, setup, eps, opt);
  CHECK(fused.status == apart.status);
  CHECK(fused.iterations == apart.iterations);
  CHECK(same_bits(fused.kl_before, apart.kl_before));
  CHECK(same_point(fused.point, apart.point));
  if (fused.status == troll::row_status::inactive) ++inactive;
  if (fused.status != troll::row_status::projected) return;
  ++projected;
  real kl = 0, log_norm = 0;
  long_double_member(zn, zo, fused.point, kl, log_norm);
  CHECK(std::fabs(double(kl) - eps) <= opt.atol + opt.rtol * eps);
  CHECK(std::fabs(fused.point.log_norm - double(log_norm)) <= 1e-14 * (1.0 + std::fabs(double(log_norm))));
}

/// KL(p̃ ‖ q) of a row pair in long double.
template <class T>
double pair_kl(const std::vector<T>& zn, const std::vector<T>& zo) {
  tilt_point one;
  one.t = 1.0, one.s = 0.0;
  one.ref = tilt_ref{double(*std::max_element(zn.begin(), zn.end())), 0.0};
  real kl = 0, log_norm = 0;
  long_double_member(zn, zo, one, kl, log_norm);
  return double(kl);
}

template <class T>
void check_solves() {
  std::mt19937_64 rng(20261124);
  std::vector<T> zn, zo;
  int projected = 0, inactive = 0;
  for (std::size_t n : {9u, 1031u, 20000u}) {
    for (int shape : {0, 1, 2, 3, 4, 5}) {
      for (double scale : {0.02, 0.1, 0.5}) {
        make_rows(rng, n, shape, scale, zn, zo);
        const double kl1 = pair_kl(zn, zo);
        CAPTURE(n);
        CAPTURE(shape);
        CAPTURE(scale);
        for (double eps : {1e-6, 1e-3, 0.05, 0.4}) check_solve(zn, zo, eps, projected, inactive);
        // t* near 1: ε a hair below KL(p̃ ‖ q)
        if (kl1 > 1e-9) check_solve(zn, zo, kl1 * (1.0 - 1e-7), projected, inactive);
      }
    }
  }
  MESSAGE(projected << " rows projected, " << inactive << " inactive");
  CHECK(projected >= 100);
  CHECK(inactive >= 20);
}

}  // namespace

TEST_CASE("the solve with both ends in one pass equals the one with separate end passes (double)") {
  check_solves<double>();
}

TEST_CASE("the solve with both ends in one pass equals the one with separate end passes (float)") {
  check_solves<float>();
}

namespace {

/// log_softmax of a row in long double (masked entries −inf).
template <class T>
std::vector<real> exact_log_softmax(const std::vector<T>& z) {
  real top = -std::numeric_limits<real>::infinity(), sum = 0;
  for (T v : z) top = std::max(top, real(v));
  for (T v : z) sum += std::exp(real(v) - top);
  std::vector<real> out(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) out[i] = (real(z[i]) - top) - std::log(sum);
  return out;
}

template <class T>
void check_log_softmax(std::size_t n, int shape, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> zn, zo;
  make_rows(rng, n, shape, 0.4, zn, zo);
  std::vector<T> out(n);
  troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch<const T>(zn.data(), 1, n),
                     troll::make_batch(out.data(), 1, n));
  const std::vector<real> exact = exact_log_softmax(zn);
  CAPTURE(n);
  CAPTURE(shape);
  // each output within an ulp of T of the exact value, plus the rounding of the double sum
  const double unit = sizeof(T) == 4 ? 0x1p-24 : 0.0;
  double worst = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isinf(double(exact[i]))) {
      CHECK(std::isinf(double(out[i])));
      continue;
    }
    const double err = double(std::fabs(real(out[i]) - exact[i])) / (1.0 + std::fabs(double(exact[i])));
    worst = std::max(worst, err);
  }
  CHECK(worst <= 2.0 * unit + 1e-14);
}

/// An inactive row (ε above KL(p̃ ‖ q)) is written as troll::log_softmax(z̃), bit for bit.
template <class T>
void check_inactive(std::size_t n, int shape, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> zn, zo;
  make_rows(rng, n, shape, 0.05, zn, zo);
  const double eps = 2.0 * pair_kl(zn, zo) + 1e-12;
  std::vector<T> out(n), ls(n);
  troll::projection_stats st;
  troll::project(troll::cpu.with_threads(1), troll::make_batch<const T>(zn.data(), 1, n),
                 troll::make_batch<const T>(zo.data(), 1, n), eps, troll::make_batch(out.data(), 1, n), &st);
  troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch<const T>(zn.data(), 1, n),
                     troll::make_batch(ls.data(), 1, n));
  CAPTURE(n);
  CAPTURE(shape);
  REQUIRE(st.status == troll::row_status::inactive);
  CHECK(std::memcmp(out.data(), ls.data(), n * sizeof(T)) == 0);
}

}  // namespace

TEST_CASE("log_softmax's packet path against long double, and inactive rows are its bits on every path") {
  for (std::size_t n : {1u, 2u, 3u, 7u, 8u, 9u, 17u, 513u, 4099u, 151936u}) {
    for (int shape : {0, 1, 2, 3, 4, 5}) {
      if (n < 4 && shape != 0) continue;
      check_log_softmax<double>(n, shape, 41u * unsigned(n) + unsigned(shape));
      check_log_softmax<float>(n, shape, 43u * unsigned(n) + unsigned(shape));
      check_inactive<double>(n, shape, 47u * unsigned(n) + unsigned(shape));
      check_inactive<float>(n, shape, 53u * unsigned(n) + unsigned(shape));
    }
  }
}
