// test_tilt_kernels.cpp — the CPU kernels under the solve, against independent oracles: the packet
// exponential (exp_nonpositive) against expl, the one-pass tilted reduction (tilt_reduce_finite)
// against the same sums taken in long double and against the two-pass reduction it falls back to,
// and the solver's first Newton guess (newton_start) on curves where the exact answer is known.
#include <doctest/doctest.h>

#include <troll/detail/cpu/finite_rows.hpp>
#include <troll/detail/cpu/row_kernels.hpp>
#include <troll/detail/family_solver.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "bits.hpp"

namespace {

using troll_test::ulps;
using troll::detail::lse_state;
using troll::detail::tilt_at;
using troll::detail::tilt_near_one;
using troll::detail::tilt_param;
using troll::detail::tilt_ref;
using packet = Eigen::internal::packet_traits<double>::type;
constexpr int double_lanes = int(sizeof(packet) / sizeof(double));

/// What tilt_reduce_finite must return: w and x from the same differences as the kernel (in
/// double, so a test tolerance covers the kernel's roundings, fused or not), the largest w, and
/// the sums e^{w − m}·x^k in long double.
struct oracle {
  std::vector<double> w;
  double m = -std::numeric_limits<double>::infinity();
  long at = 0;
  long double s0 = 0, s1 = 0, s2 = 0, abs1 = 0;
  double tol = 0;  // the absolute rounding allowance of w, m and log Σ e^w
};

oracle reduce_oracle(const std::vector<double>& zn, const std::vector<double>& zo, const tilt_param& u,
                     const tilt_ref& ref) {
  const std::size_t n = zn.size();
  std::vector<double> x(n);
  oracle o;
  o.w.resize(n);
  double scale = 1.0;
  for (std::size_t k = 0; k < n; ++k) {
    const long double dn = (long double)zn[k] - ref.zn, dold = (long double)zo[k] - ref.zo;
    x[k] = double(dn - dold);
    o.w[k] = double(u.t <= 0.5 ? dold + (long double)u.t * (dn - dold) : dn - (long double)u.s * (dn - dold));
    if (o.w[k] > o.m) o.m = o.w[k], o.at = long(k);
    scale = std::fmax(scale, std::fmax(std::fabs(zn[k]), std::fabs(zo[k])));
  }
  o.tol = 16.0 * 2.220446049250313e-16 * (4.0 * scale + double(n));
  for (std::size_t k = 0; k < n; ++k) {
    const long double e = std::exp((long double)o.w[k] - (long double)o.m);
    o.s0 += e;
    o.s1 += e * x[k];
    o.s2 += e * x[k] * x[k];
    o.abs1 += e * std::fabs((long double)x[k]);
  }
  return o;
}

/// The state against the oracle: the maximum, a reference token that attains it (to rounding),
/// and the quantities the solver reads — log Σ e^w, the mean and the second moment of x — within
/// the rounding allowance (the mean measured against E|x|, as it can cancel).
void check_state(const lse_state& st, const oracle& o, const std::vector<double>& zn,
                 const std::vector<double>& zo) {
  CHECK(std::fabs(st.m - o.m) <= o.tol);
  bool found = false;
  for (std::size_t k = 0; k < zn.size() && !found; ++k)
    found = zn[k] == st.ref_new && zo[k] == st.ref_old && o.w[k] >= o.m - o.tol;
  CHECK(found);
  const long double log_sum = (long double)st.m + std::log((long double)st.s0);
  const long double log_sum_o = (long double)o.m + std::log(o.s0);
  CHECK(std::fabs(log_sum - log_sum_o) <= o.tol);
  const long double mean = st.s1 / (long double)st.s0, mean_o = o.s1 / o.s0, abs_o = o.abs1 / o.s0;
  CHECK(std::fabs(mean - mean_o) <= o.tol * (1.0L + 4.0L * abs_o));
  const long double second = st.s2 / (long double)st.s0, second_o = o.s2 / o.s0;
  CHECK(std::fabs(second - second_o) <= o.tol * (1.0L + 4.0L * second_o + 4.0L * abs_o));
}

}  // namespace

TEST_CASE("exp_nonpositive: within one ulp of expl on [−700, 64], e^{−700} below") {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> wide(-700.0, 64.0), near_zero(-1.0, 1.0);
  double worst = 0.0;
  double in[double_lanes], out[double_lanes];
  for (int i = 0; i < 40000; ++i) {
    for (int j = 0; j < double_lanes; ++j) in[j] = (i % 2 == 0) ? wide(rng) : near_zero(rng);
    if (i == 0) in[0] = 0.0, in[1] = -700.0, in[double_lanes - 1] = 64.0;
    Eigen::internal::pstoreu(out, troll::detail::cpu::exp_nonpositive(Eigen::internal::ploadu<packet>(in)));
    for (int j = 0; j < double_lanes; ++j) {
      const double e = ulps(out[j], std::exp((long double)in[j]));
      worst = e > worst ? e : worst;
      if (e > 1.0) {
        INFO("x = " << in[j]);
        CHECK(e <= 1.0);
      }
    }
  }
  MESSAGE("worst error: " << worst << " ulp");
  for (int j = 0; j < double_lanes; ++j) in[j] = j % 2 ? -std::numeric_limits<double>::infinity() : -1e300;
  Eigen::internal::pstoreu(out, troll::detail::cpu::exp_nonpositive(Eigen::internal::ploadu<packet>(in)));
  for (int j = 0; j < double_lanes; ++j) CHECK(out[j] == doctest::Approx(std::exp(-700.0)).epsilon(1e-15));
}

TEST_CASE("tilt_reduce_finite: one pass and two passes against long double sums") {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const long sizes[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 77, 78, 130, 257, 511, 512};
  const tilt_param params[] = {tilt_at(0.0),          tilt_at(1e-300),      tilt_at(1e-9), tilt_at(0.3),
                               tilt_at(0.5),          tilt_near_one(0.49),  tilt_near_one(0.2),
                               tilt_near_one(1e-12), tilt_near_one(0.0)};
  std::vector<double> x(512 + double_lanes), w(512 + double_lanes);
  int one_pass = 0, fallback = 0;
  for (int shape = 0; shape < 6; ++shape) {
    for (const long n : sizes) {
      // Rows: LLM-like (scale 3), flat (scale 0.01), a near-deterministic pair (one token far
      // above the rest), a wide spread close to 700, a tiny difference between the rows, and
      // rows whose difference is large (the mode moves far between t = 0 and t = 1).
      std::vector<double> zn(static_cast<std::size_t>(n)), zo(static_cast<std::size_t>(n));
      for (std::size_t k = 0; k < zn.size(); ++k) {
        const double base = 3.0 * n01(rng);
        switch (shape) {
          case 0: zn[k] = base + 0.5 * n01(rng), zo[k] = base; break;
          case 1: zn[k] = 0.01 * n01(rng), zo[k] = 0.01 * n01(rng); break;
          case 2: zn[k] = long(k) == n / 2 ? 40.0 : base - 300.0, zo[k] = long(k) == n / 3 ? 35.0 : base - 280.0; break;
          case 3: zn[k] = -690.0 * unit(rng), zo[k] = -690.0 * unit(rng); break;
          case 4: zn[k] = base, zo[k] = base + 1e-13 * n01(rng); break;
          default: zn[k] = 60.0 * n01(rng), zo[k] = 60.0 * n01(rng); break;
        }
      }
      for (const tilt_param& u : params) {
        // References: the true mode of π_u (the common case: max w = 0), the first token, the
        // last one, and a token far from the mode (max w > 32: the two-pass fallback).
        std::vector<long> refs = {0, n - 1, long(unit(rng) * double(n)) % n};
        {
          const oracle o0 = reduce_oracle(zn, zo, u, tilt_ref{zn[0], zo[0]});
          refs.push_back(o0.at);
        }
        for (const long r : refs) {
          const tilt_ref ref{zn[std::size_t(r)], zo[std::size_t(r)]};
          const oracle o = reduce_oracle(zn, zo, u, ref);
          INFO("shape " << shape << ", n = " << n << ", t = " << u.t << ", s = " << u.s << ", ref " << r
                        << ", max w = " << o.m);
          const lse_state st = troll::detail::cpu::tilt_reduce_finite(zn.data(), zo.data(), n, u, ref, x.data(),
                                                                     w.data());
          check_state(st, o, zn, zo);
          const lse_state two = troll::detail::cpu::tilt_reduce_two_pass(zn.data(), zo.data(), n, u, ref, x.data(),
                                                                        w.data());
          check_state(two, o, zn, zo);
          (o.m >= -64.0 && o.m <= 32.0 ? one_pass : fallback)++;
        }
      }
    }
  }
  MESSAGE(one_pass << " reductions in one pass, " << fallback << " through the two-pass fallback");
  CHECK(one_pass > 100);
  CHECK(fallback > 100);
}

TEST_CASE("newton_start: exact on curves the interpolant reproduces, inside (0, 1) always") {
  using troll::detail::newton_start;
  // KL = a t² (sqrt(KL) linear): the start is the root sqrt(ε / a).
  for (const double a : {1e-6, 0.3, 2.0, 50.0}) {
    for (const double frac : {0.02, 0.2, 0.5, 0.9}) {
      const double eps = frac * a;
      const double t = newton_start(0.0, 2.0 * a, a, 2.0 * a, eps);
      CHECK(t == doctest::Approx(std::sqrt(frac)).epsilon(1e-6));
    }
  }
  // KL − KL0 = g(t)² with g a cubic through g(0) = 0: the ends give g exactly, so the start is
  // the root of g(t) = sqrt(ε − KL0) (found here by bisection).
  const double c1 = 0.7, c2 = 0.4, c3 = -0.2, kl0 = 0.01;
  auto g = [&](double t) { return t * (c1 + t * (c2 + t * c3)); };
  const double g1 = g(1.0), dg1 = c1 + 2.0 * c2 + 3.0 * c3;
  const double kl1 = kl0 + g1 * g1, sigma2_1 = 2.0 * g1 * dg1;  // dKL/dt(1) = 1·I(1) = 2 g g'
  for (const double target : {0.3, 0.5, 0.8}) {
    const double eps = kl0 + target * target;
    double lo = 0.0, hi = 1.0;
    for (int i = 0; i < 200; ++i) (g(0.5 * (lo + hi)) < target ? lo : hi) = 0.5 * (lo + hi);
    CHECK(newton_start(kl0, 2.0 * c1 * c1, kl1, sigma2_1, eps) == doctest::Approx(lo).epsilon(1e-5));
  }
  // No slope at t = 0: 1/2. ε a tiny fraction of KL(1) or a cubic that falls somewhere: the
  // expansion at t = 0 alone.
  CHECK(newton_start(0.0, 0.0, 1.0, 1.0, 0.5) == 0.5);
  CHECK(newton_start(0.0, 2.0, 1.0, 2.0, 1e-6) == doctest::Approx(std::sqrt(1e-6)));
  CHECK(newton_start(0.0, 2.0, 0.05, 20.0, 0.04) == doctest::Approx(std::sqrt(0.04)));
  // Random ends with KL0 < ε < KL1: the start lies strictly inside the bracket.
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> lg(-12.0, 4.0), unit(0.0, 1.0);
  for (int i = 0; i < 20000; ++i) {
    const double kl0 = unit(rng) < 0.3 ? 0.0 : std::pow(10.0, lg(rng) - 4.0);
    const double kl1 = kl0 + std::pow(10.0, lg(rng));
    const double eps = kl0 + (kl1 - kl0) * unit(rng);
    const double s0 = unit(rng) < 0.05 ? 0.0 : std::pow(10.0, lg(rng));
    const double s1 = unit(rng) < 0.05 ? 0.0 : std::pow(10.0, lg(rng));
    if (!(eps > kl0 && eps < kl1)) continue;
    const double t = newton_start(kl0, s0, kl1, s1, eps);
    INFO(kl0 << ' ' << s0 << ' ' << kl1 << ' ' << s1 << ' ' << eps);
    REQUIRE(t > 0.0);
    REQUIRE(t < 1.0);
  }
}

// exact_kl_finite (the packet sum of kl_term the solver asks for where the closed-form KL is too
// coarse) against kl_term summed token by token in long double: rows nearly equal to the old one
// (KL down to ~1e-20), ordinary rows, members at t from 1 down to 0.01 (|σ| ≥ 1 on some tokens:
// the π(σ − 1) + q branch), float and double rows, lengths that leave a partial packet, and
// tokens 699 below the old row's maximum whose log q falls below −708 (those packets are taken
// by kl_term itself).
TEST_CASE("exact_kl_finite: the cancellation-free KL in packets, against kl_term in long double") {
  namespace td = troll::detail;
  std::mt19937_64 rng(17);
  std::normal_distribution<double> n01(0.0, 1.0);
  double worst = 0.0;
  int cases = 0, deep = 0;
  auto run = [&](auto zero, std::size_t size, double noise, bool deep_tail) {
    using T = decltype(zero);
    std::vector<T> zn(size), zo(size);
    // deep_tail: most old logits near 0 (log Σ e^{z°} ≈ log V) and every seventh 699.8 below,
    // so that log q ≈ −699.8 − log V < −708 while the spread stays under 700
    const double scale = deep_tail ? 0.01 : 3.0;
    for (std::size_t j = 0; j < size; ++j) {
      zo[j] = T(scale * n01(rng));
      zn[j] = T(double(zo[j]) + noise * n01(rng));
    }
    if (deep_tail) {
      for (std::size_t j = 0; j < size; j += 7) {
        zo[j] = T(-699.8 + 0.001 * double(j % 100));
        zn[j] = T(double(zo[j]) + 0.5);
      }
    }
    td::row_setup setup;
    REQUIRE_FALSE(td::cpu::scan_pair(zn.data(), zo.data(), size, setup, "new", "old"));
    REQUIRE(setup.spread <= 700.0);
    const td::cpu::tilt_evaluator<T> eval = td::cpu::make_evaluator(zn.data(), zo.data(), size, setup);
    const double old_log_sum = eval.old_log_sum();
    for (double t : {1.0, 0.7, 0.3, 0.01}) {
      const td::tilt_point p = td::make_point(eval(tilt_at(t), setup.new_top), tilt_at(t), setup.new_top,
                                              setup.old_max, old_log_sum);
      long double exact = 0.0L;
      bool below = false;
      for (std::size_t j = 0; j < size; ++j) {
        exact += (long double)td::kl_term(double(zn[j]), double(zo[j]), p);
        below = below || (double(zo[j]) - p.old_max) - p.old_log_sum < -708.0;
      }
      deep += below ? 1 : 0;
      const double got = td::cpu::exact_kl_finite(zn.data(), zo.data(), long(size), p);
      CHECK(eval.exact_kl(p) == got);  // the evaluator's sum on such rows
      const long double diff = std::fabs((long double)got - exact);
      if (exact > 0.0L) worst = std::max(worst, double(diff / exact));
      ++cases;
      INFO("size ", size, " noise ", noise, " t ", t, " got ", got, " exact ", double(exact));
      CHECK(double(diff) <= 1e-13 * double(exact));  // a single token: KL = 0 exactly
    }
  };
  for (std::size_t size : {1, 7, 8, 9, 63, 1000, 4099, 20000})
    for (double noise : {1e-9, 1e-5, 1e-2, 1.0}) {
      run(0.0, size, noise, false);
      run(0.0f, size, noise, false);
    }
  for (std::size_t size : {64, 5000}) {
    run(0.0, size, 1e-3, true);
    run(0.0f, size, 1e-3, true);
  }
  MESSAGE("exact_kl_finite: worst ", worst, " relative over ", cases, " sums (", deep, " with log q < -708)");
  CHECK(deep > 0);
}
