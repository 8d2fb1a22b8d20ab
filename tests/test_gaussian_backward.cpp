// tests/test_gaussian_backward.cpp — the VJP and JVP of the Gaussian projections (joint and split,
// full and diagonal) against central finite differences of the independent long-double oracle
// (support/gaussian_oracle.hpp: bisection for t*, explicit inverses), in random directions of
// every input and of the bounds; at larger d against differences of troll's own forward: the body
// tests/bodies/gaussian_backward_fd.hpp compiled for the CPU (also compiled for troll::cuda). Then
// CPU-only checks: unsolved rows rejected, float against double, a gain of 1e24, saved
// factorisations.
#include <doctest/doctest.h>

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Cholesky>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "support/gaussian_oracle.hpp"
#include "troll/gaussian.hpp"
#include "troll/workspace.hpp"

#include "backend.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The finite-difference and adjoint checks, one body for every backend (also compiled for
// troll::cuda by tests/cuda/test_cuda_gaussian_full_derivatives.cu).
#include "bodies/gaussian_backward_fd.hpp"

using namespace gaussian_fd;

TEST_CASE("the backward rejects unsolved rows") {
  gauss::generator gen(1);
  const problem p = random_problem(gen, 2, true, false, 0.1);
  forward f = troll_forward(p);
  f.stats.status = troll::row_status::not_converged;
  std::vector<double> up(p.d + p.cov_size(), 1.0), gm(p.d), gc(p.cov_size());
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  const std::vector<double> up_mean(up.begin(), up.begin() + 2), up_cov(up.begin() + 2, up.end());
  troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.data(), 1, 2), troll::make_batch(gc.data(), 1, 4),
                                                {}, {}, nullptr, nullptr};
  CHECK_THROWS_AS(troll::gaussian::project_joint_backward(troll::cpu, in(p.mean), in(p.cov), in(p.old_mean),
                                                          in(p.old_cov), p.eps, in(f.mean), in(f.cov), &f.stats,
                                                          in(up_mean), in(up_cov), grads),
                  troll::domain_error);
}

namespace {

/// Three diagonal rows (d = 2) and their joint projection at ε = 0.05 on the CPU: the forward of
/// the derivatives' input checks below.
struct three_diag_rows {
  static constexpr std::size_t rows = 3, d = 2;
  std::vector<double> mean{0.1, -0.2, 0.3, 0.0, -0.5, 0.4}, sd{1.5, 0.7, 1.0, 1.2, 0.8, 0.9};
  std::vector<double> old_mean{0.0, 0.0, 0.1, 0.2, 0.0, 0.0}, old_sd{1.0, 1.0, 1.1, 1.0, 1.0, 1.3};
  std::vector<double> out_mean = std::vector<double>(rows * d), out_sd = std::vector<double>(rows * d);
  std::vector<troll::gaussian::gaussian_stats> stats = std::vector<troll::gaussian::gaussian_stats>(rows);
  three_diag_rows() {
    troll::gaussian::project_joint_diag(troll::cpu, in(mean), in(sd), in(old_mean), in(old_sd), 0.05,
                                        troll::make_batch(out_mean.data(), rows, d),
                                        troll::make_batch(out_sd.data(), rows, d), stats.data());
  }
  static troll::batch_view<const double> in(const std::vector<double>& v) {
    return troll::make_batch(v.data(), rows, d);
  }
};

}  // namespace

// Found by an adversarial audit: a NaN upstream gradient gave a NaN gradient and an infinite
// tangent a NaN JVP, without a word, where docs/api.md promises domain_error for "a non-finite
// upstream gradient or tangent". Both now name the row, the operand and the entry, before writing.
TEST_CASE("the backward and the JVP refuse non-finite upstream gradients and tangents, naming the row") {
  const three_diag_rows f;
  const std::size_t rows = f.rows, d = f.d;
  const std::vector<double>&mean = f.mean, &sd = f.sd, &old_mean = f.old_mean, &old_sd = f.old_sd;
  const std::vector<double>&out_mean = f.out_mean, &out_sd = f.out_sd;
  const std::vector<troll::gaussian::gaussian_stats>& stats = f.stats;
  auto in = [](const std::vector<double>& v) { return three_diag_rows::in(v); };
  std::vector<double> up_mean(rows * d, 1.0), up_sd(rows * d, -0.5);
  up_sd[1 * d + 1] = std::nan("");
  std::vector<double> gm(rows * d, 42.0), gs(rows * d, 42.0), gom(rows * d, 42.0), gos(rows * d, 42.0), ge(rows, 42.0);
  const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.data(), rows, d),
                                                      troll::make_batch(gs.data(), rows, d),
                                                      troll::make_batch(gom.data(), rows, d),
                                                      troll::make_batch(gos.data(), rows, d), ge.data(), nullptr};
  try {
    troll::gaussian::project_joint_diag_backward(troll::cpu, in(mean), in(sd), in(old_mean), in(old_sd), 0.05,
                                                 in(out_mean), in(out_sd), stats.data(), in(up_mean), in(up_sd), grads);
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 1);
    CHECK(std::string(e.what()).find("grad_out_std_dev is nan at entry 1") != std::string::npos);
  }
  for (const std::vector<double>* v : {&gm, &gs, &gom, &gos, &ge})
    for (double x : *v) CHECK(x == 42.0);

  std::vector<double> t_old(rows * d, 0.25), t_out_mean(rows * d, 42.0), t_out_sd(rows * d, 42.0);
  t_old[2 * d] = std::numeric_limits<double>::infinity();
  troll::gaussian::gaussian_tangents<double> tangents;
  tangents.old_mean = in(t_old);
  tangents.eps = 1.0;
  try {
    troll::gaussian::project_joint_diag_jvp(troll::cpu, in(mean), in(sd), in(old_mean), in(old_sd), 0.05, in(out_mean),
                                            in(out_sd), stats.data(), tangents, troll::make_batch(t_out_mean.data(), rows, d),
                                            troll::make_batch(t_out_sd.data(), rows, d));
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 2);
    CHECK(std::string(e.what()).find("tangents.old_mean is inf at entry 0") != std::string::npos);
  }
  for (const std::vector<double>* v : {&t_out_mean, &t_out_sd})
    for (double x : *v) CHECK(x == 42.0);
  // Finite operands pass (and an empty tangent stays a zero tangent).
  t_old[2 * d] = 0.5;
  troll::gaussian::project_joint_diag_jvp(troll::cpu, in(mean), in(sd), in(old_mean), in(old_sd), 0.05, in(out_mean),
                                          in(out_sd), stats.data(), tangents, troll::make_batch(t_out_mean.data(), rows, d),
                                          troll::make_batch(t_out_sd.data(), rows, d));
  for (double x : t_out_mean) CHECK(std::isfinite(x));
}

TEST_CASE("the derivatives' checks run row by row: the lowest bad row, whatever its problem") {
  // Row 1's upstream gradient is NaN, row 2's statistics are unusable and row 0 is fine: row 1 is
  // named (the stats were checked over every row first and named row 2); a NaN mean in row 2
  // with unusable stats in row 1 names row 1 too (every row's values came first).
  const three_diag_rows f;
  const std::size_t rows = f.rows, d = f.d;
  std::vector<double> mean = f.mean;
  const std::vector<double>&sd = f.sd, &old_mean = f.old_mean, &old_sd = f.old_sd;
  const std::vector<double>&out_mean = f.out_mean, &out_sd = f.out_sd;
  const std::vector<troll::gaussian::gaussian_stats>& stats = f.stats;
  auto in = [](const std::vector<double>& v) { return three_diag_rows::in(v); };
  std::vector<double> gm(rows * d), gs(rows * d);
  const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.data(), rows, d),
                                                      troll::make_batch(gs.data(), rows, d), {}, {}, nullptr, nullptr};
  auto named_row = [&](const std::vector<double>& m, const std::vector<troll::gaussian::gaussian_stats>& st,
                       const std::vector<double>& up) -> std::size_t {
    try {
      troll::gaussian::project_joint_diag_backward(troll::cpu.with_threads(2), in(m), in(sd), in(old_mean), in(old_sd),
                                                   0.05, in(out_mean), in(out_sd), st.data(), in(up), in(up), grads);
    } catch (const troll::domain_error& e) {
      return e.row();
    }
    return rows;
  };
  std::vector<double> up(rows * d, 0.5);
  std::vector<troll::gaussian::gaussian_stats> bad_stats = stats;
  up[1 * d] = std::nan("");
  bad_stats[2].status = troll::row_status::not_converged;
  CHECK(named_row(mean, bad_stats, up) == 1);
  up[1 * d] = 0.5;
  bad_stats = stats;
  bad_stats[1].status = troll::row_status::not_converged;
  mean[2 * d] = std::nan("");
  CHECK(named_row(mean, bad_stats, up) == 1);
}

// Found by an audit: the full rows' factor-shaped upstream gradient and tangents are read in their
// lower triangle only (docs), but a NaN in the strict upper triangle was refused. It is ignored now
// (the results bit-equal to a 0 there); a NaN in the lower triangle is named by (row, column).
TEST_CASE("full rows: only the lower triangle of factor-shaped upstream gradients and tangents is checked") {
  const std::size_t d = 2;
  const std::vector<double> mean{0.3, -0.2}, chol{1.4, 0.0, 0.3, 0.6}, old_mean{0.0, 0.1}, old_chol{1.0, 0.0, -0.2, 1.1};
  std::vector<double> out_mean(d), out_chol(d * d);
  troll::gaussian::gaussian_stats st;
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  troll::gaussian::project_joint(troll::cpu, in(mean), in(chol), in(old_mean), in(old_chol), 0.05,
                                 troll::make_batch(out_mean.data(), 1, d), troll::make_batch(out_chol.data(), 1, d * d),
                                 &st);
  REQUIRE(st.status == troll::row_status::projected);
  const std::vector<double> up_mean{0.7, -0.4};
  std::vector<double> up_chol{0.5, 0.0, -0.3, 0.9}, gm(d), gc(d * d), gm0(d), gc0(d * d);
  auto backward = [&](std::vector<double>& m_out, std::vector<double>& c_out) {
    const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(m_out.data(), 1, d),
                                                        troll::make_batch(c_out.data(), 1, d * d), {}, {}, nullptr,
                                                        nullptr};
    troll::gaussian::project_joint_backward(troll::cpu, in(mean), in(chol), in(old_mean), in(old_chol), 0.05,
                                            in(out_mean), in(out_chol), &st, in(up_mean), in(up_chol), grads);
  };
  backward(gm0, gc0);
  up_chol[1] = std::nan("");  // (0, 1): above the diagonal
  backward(gm, gc);
  CHECK(gm == gm0);
  CHECK(gc == gc0);
  up_chol[2] = std::numeric_limits<double>::infinity();  // (1, 0)
  try {
    backward(gm, gc);
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK_MESSAGE(std::string(e.what()).find("grad_out_cov_chol is inf at entry (1, 0)") != std::string::npos, e.what());
  }
  // The JVP's factor tangents likewise.
  std::vector<double> t_chol{0.1, std::nan(""), 0.2, -0.3}, t_old_chol{0.0, std::nan(""), 0.4, 0.1};
  std::vector<double> t_chol0{0.1, 0.0, 0.2, -0.3}, t_old_chol0{0.0, 0.0, 0.4, 0.1};
  auto jvp = [&](const std::vector<double>& tc, const std::vector<double>& toc) {
    troll::gaussian::gaussian_tangents<double> tangents;
    tangents.cov = in(tc);
    tangents.old_cov = in(toc);
    std::vector<double> om(d), oc(d * d);
    troll::gaussian::project_joint_jvp(troll::cpu, in(mean), in(chol), in(old_mean), in(old_chol), 0.05, in(out_mean),
                                       in(out_chol), &st, tangents, troll::make_batch(om.data(), 1, d),
                                       troll::make_batch(oc.data(), 1, d * d));
    om.insert(om.end(), oc.begin(), oc.end());
    return om;
  };
  CHECK(jvp(t_chol, t_old_chol) == jvp(t_chol0, t_old_chol0));
  t_old_chol[3] = std::nan("");  // (1, 1)
  try {
    jvp(t_chol, t_old_chol);
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK_MESSAGE(std::string(e.what()).find("tangents.old_cov is nan at entry (1, 1)") != std::string::npos, e.what());
  }
}

// Found by an adversarial audit: the diagonal VJP and JVP formed Σ_t², Λ̃², Λ°², which overflow
// for standard deviations above ~1e77 and underflow below ~1e-77 (gradients inf or NaN, or 0.0205
// for 0.0664 at 1e-100) while the forward was exact. A diagonal projection commutes with scaling
// each coordinate, and the derivatives now work each coordinate in units of its old standard
// deviation (a power of two), so scaling coordinate i by c_i = 2^k_i must scale the JVP's outputs
// by c_i and, with the upstream gradients divided by c_i, the VJP's gradients by 1/c_i — exactly.
TEST_CASE("diagonal derivatives at standard deviations from 2^-900 to 2^900 are the scaled ones, bit for bit") {
  const std::size_t d = 3;
  const std::vector<double> mean{0.4, -1.0, 0.2}, sd{1.5, 0.3, 2.0}, old_mean{0.0, 0.5, -0.1}, old_sd{1.0, 0.9, 1.4};
  const std::vector<double> up_mean{1.0, -0.5, 0.25}, up_sd{0.75, 1.0, -2.0}, tangent{0.3, -0.2, 0.1};
  struct result {
    std::vector<double> gm, gs, gom, gos, jm, js;
    double ge = 0.0;
  };
  auto run = [&](const std::vector<int>& k, bool split) {
    auto scaled = [&](const std::vector<double>& v, int sign) {
      std::vector<double> out(d);
      for (std::size_t i = 0; i < d; ++i) out[i] = std::ldexp(v[i], sign * k[i]);
      return out;
    };
    const std::vector<double> m = scaled(mean, 1), s = scaled(sd, 1), om = scaled(old_mean, 1), os = scaled(old_sd, 1);
    const std::vector<double> um = scaled(up_mean, -1), us = scaled(up_sd, -1), tv = scaled(tangent, 1);
    auto in = [&](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, d); };
    std::vector<double> out_m(d), out_s(d);
    troll::gaussian::gaussian_stats st;
    result r{std::vector<double>(d), std::vector<double>(d), std::vector<double>(d), std::vector<double>(d),
             std::vector<double>(d), std::vector<double>(d)};
    auto out = [&](std::vector<double>& v) { return troll::make_batch(v.data(), 1, d); };
    const troll::gaussian::gaussian_grads<double> grads{out(r.gm), out(r.gs), out(r.gom), out(r.gos), &r.ge, nullptr};
    troll::gaussian::gaussian_tangents<double> tangents;
    tangents.mean = in(tv), tangents.cov = in(tv), tangents.old_mean = in(tv), tangents.old_cov = in(tv);
    tangents.eps = 0.5;
    if (split) {
      troll::gaussian::project_split_diag(troll::cpu, in(m), in(s), in(om), in(os), 0.02, 0.05, out(out_m), out(out_s),
                                          &st);
      troll::gaussian::project_split_diag_backward(troll::cpu, in(m), in(s), in(om), in(os), 0.02, 0.05, in(out_m),
                                                   in(out_s), &st, in(um), in(us), grads);
      troll::gaussian::project_split_diag_jvp(troll::cpu, in(m), in(s), in(om), in(os), 0.02, 0.05, in(out_m),
                                              in(out_s), &st, tangents, out(r.jm), out(r.js));
    } else {
      troll::gaussian::project_joint_diag(troll::cpu, in(m), in(s), in(om), in(os), 0.05, out(out_m), out(out_s), &st);
      troll::gaussian::project_joint_diag_backward(troll::cpu, in(m), in(s), in(om), in(os), 0.05, in(out_m),
                                                   in(out_s), &st, in(um), in(us), grads);
      troll::gaussian::project_joint_diag_jvp(troll::cpu, in(m), in(s), in(om), in(os), 0.05, in(out_m), in(out_s),
                                              &st, tangents, out(r.jm), out(r.js));
    }
    REQUIRE(st.status == troll::row_status::projected);
    for (std::size_t i = 0; i < d; ++i) {  // back to the units of the unscaled row
      r.gm[i] = std::ldexp(r.gm[i], k[i]), r.gs[i] = std::ldexp(r.gs[i], k[i]);
      r.gom[i] = std::ldexp(r.gom[i], k[i]), r.gos[i] = std::ldexp(r.gos[i], k[i]);
      r.jm[i] = std::ldexp(r.jm[i], -k[i]), r.js[i] = std::ldexp(r.js[i], -k[i]);
    }
    return r;
  };
  for (bool split : {false, true}) {
    const result base = run({0, 0, 0}, split);
    for (const std::vector<int>& k : std::vector<std::vector<int>>{
             {260, 260, 260}, {-260, -260, -260}, {900, 900, 900}, {-900, -900, -900}, {300, -300, 0}, {-600, 5, 700}}) {
      CAPTURE(split);
      CAPTURE(k[0]);
      CAPTURE(k[1]);
      const result r = run(k, split);
      for (std::size_t i = 0; i < d; ++i) {
        CHECK(r.gm[i] == base.gm[i]);
        CHECK(r.gs[i] == base.gs[i]);
        CHECK(r.gom[i] == base.gom[i]);
        CHECK(r.gos[i] == base.gos[i]);
        CHECK(r.jm[i] == base.jm[i]);
        CHECK(r.js[i] == base.js[i]);
        CHECK(std::isfinite(base.gs[i]));
      }
      CHECK(r.ge == base.ge);
    }
  }
}

// ---- float, and a near-singular new covariance (CPU only) ----

namespace {

/// The forward and backward of project_joint / project_joint_diag in T for one problem, the
/// gradients returned in double (mean, cov, old_mean, old_cov, eps).
template <class T>
std::vector<double> joint_gradients(const problem& p, const std::vector<double>& upstream) {
  auto cast = [](const std::vector<double>& v) { return std::vector<T>(v.begin(), v.end()); };
  const std::vector<T> mean = cast(p.mean), cov = cast(p.cov), old_mean = cast(p.old_mean), old_cov = cast(p.old_cov);
  const std::vector<T> up_mean(upstream.begin(), upstream.begin() + long(p.d));
  const std::vector<T> up_cov(upstream.begin() + long(p.d), upstream.end());
  std::vector<T> om(p.d), oc(p.cov_size()), gm(p.d), gc(p.cov_size()), gom(p.d), goc(p.cov_size());
  troll::gaussian::gaussian_stats stats;
  double ge = 0;
  auto in = [](const std::vector<T>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<T>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  const troll::gaussian::gaussian_grads<T> grads{out(gm), out(gc), out(gom), out(goc), &ge, nullptr};
  if (p.full) {
    troll::gaussian::project_joint(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, out(om), out(oc),
                                   &stats);
    troll::gaussian::project_joint_backward(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, in(om),
                                            in(oc), &stats, in(up_mean), in(up_cov), grads);
  } else {
    troll::gaussian::project_joint_diag(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps, out(om),
                                        out(oc), &stats);
    troll::gaussian::project_joint_diag_backward(troll::cpu, in(mean), in(cov), in(old_mean), in(old_cov), p.eps,
                                                 in(om), in(oc), &stats, in(up_mean), in(up_cov), grads);
  }
  std::vector<double> all;
  for (const std::vector<T>* v : {&gm, &gc, &gom, &goc}) all.insert(all.end(), v->begin(), v->end());
  all.push_back(ge);
  return all;
}

}  // namespace

TEST_CASE("the backward in float agrees with double") {
  gauss::generator gen(67);
  for (const bool full : {true, false})
    for (const std::size_t d : {std::size_t(2), std::size_t(8), std::size_t(32)}) {
      problem p = random_problem(gen, d, full, false, 0.2);
      // Inputs representable in float, so both types see the same problem.
      for (std::vector<double>* v : {&p.mean, &p.cov, &p.old_mean, &p.old_cov})
        for (double& x : *v) x = double(float(x));
      std::vector<double> upstream(p.d + p.cov_size());
      for (std::size_t i = 0; i < upstream.size(); ++i) {
        const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
        upstream[i] = above ? 0.0 : double(float(gen.normal01()));
      }
      const std::vector<double> g32 = joint_gradients<float>(p, upstream), g64 = joint_gradients<double>(p, upstream);
      double scale = 0;
      for (const double x : g64) scale = std::max(scale, std::fabs(x));
      INFO("d=", d, " full=", full, " scale=", scale);
      for (std::size_t i = 0; i < g64.size(); ++i) {
        INFO("entry ", i, ": float ", g32[i], " double ", g64[i]);
        CHECK(std::isfinite(g32[i]));
        CHECK(std::fabs(g32[i] - g64[i]) <= 1e-5 + 2e-3 * scale);
      }
    }
}

TEST_CASE("a new covariance 1e-12 of the old along one axis (the gain 1e24, exact)") {
  // σ̃/σ° = 1e-12 along one axis: λ − 1 = r² − 1 would round to −1, so the gain is formed from r
  // (diagonal: 1/r² − 1; full: the Jacobi SVD of L°⁻¹L̃) and is exact, 1e24. With equal means the
  // projection moves essentially along that axis only, to a* > 1 with ψ(log a*) = 1/a* − 1 +
  // log a* = 2ε, σ* = σ°/sqrt(a*), t* = (a* − 1)/(1e24 − 1), and leaves the other axis at σ°.
  const double eps = 0.05;
  long double lo = 1, hi = 1e6;
  for (int i = 0; i < 200; ++i) {
    const long double mid = (lo + hi) / 2;
    (1 / mid - 1 + std::log(mid) < 2 * eps ? lo : hi) = mid;
  }
  const double a_star = double((lo + hi) / 2);
  const std::vector<double> mean = {0.3, -0.2}, old_std = {1.5, 0.7}, std_dev = {1.5e-12, 0.9};
  std::vector<double> om(2), os(2);
  troll::gaussian::gaussian_stats stats;
  auto in = [](const std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  auto out = [](std::vector<double>& v) { return troll::make_batch(v.data(), 1, v.size()); };
  troll::gaussian::project_joint_diag(troll::cpu, in(mean), in(std_dev), in(mean), in(old_std), eps, out(om), out(os),
                                      &stats);
  CHECK(stats.status == troll::row_status::projected);
  CHECK(stats.t == doctest::Approx((a_star - 1.0) / 1e24).epsilon(1e-9));
  CHECK(os[0] == doctest::Approx(old_std[0] / std::sqrt(a_star)).epsilon(1e-10));
  CHECK(os[1] == doctest::Approx(old_std[1]).epsilon(1e-12));
  CHECK(om[0] == doctest::Approx(mean[0]).epsilon(1e-15));
  CHECK(om[1] == doctest::Approx(mean[1]).epsilon(1e-15));
  // The same with full factors (old factor the identity scaled; new factor diagonal).
  const std::vector<double> l_new = {1.5e-12, 0.0, 0.0, 0.9}, l_old = {1.5, 0.0, 0.0, 0.7};
  std::vector<double> ol(4);
  troll::gaussian::project_joint(troll::cpu, in(mean), in(l_new), in(mean), in(l_old), eps, out(om), out(ol), &stats);
  CHECK(stats.status == troll::row_status::projected);
  CHECK(stats.t == doctest::Approx((a_star - 1.0) / 1e24).epsilon(1e-9));
  CHECK(ol[0] == doctest::Approx(old_std[0] / std::sqrt(a_star)).epsilon(1e-10));
  CHECK(ol[3] == doctest::Approx(old_std[1]).epsilon(1e-12));
  CHECK(ol[2] == doctest::Approx(0.0));
}

TEST_CASE("a saved factorisation gives the backward and the JVP bit for bit the same results") {
  namespace g = troll::gaussian;
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(6), std::size_t(40)}) {
      CAPTURE(split);
      CAPTURE(d);
      const std::size_t n = 5, dd = d * d;
      gauss::generator gen(static_cast<unsigned>(31 * d + split));
      std::vector<double> m, l, om, ol;
      for (std::size_t r = 0; r < n; ++r) {
        const double scale = r == 3 ? 1e-4 : 1.0;  // row 3 inactive
        const std::vector<double> a = gen.mean(d, 1.0), b = gen.mean(d, 1.0), c = gen.factor(d, 0.3),
                                  e = gen.factor(d, 0.3);
        for (std::size_t i = 0; i < d; ++i) om.push_back(b[i]), m.push_back(b[i] + scale * (a[i] - b[i]));
        for (std::size_t i = 0; i < dd; ++i) ol.push_back(e[i]), l.push_back(e[i] + scale * (c[i] - e[i]));
      }
      auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
      std::vector<double> ym(n * d), yl(n * dd), ym2(n * d), yl2(n * dd);
      std::vector<double> saved(n * g::saved_factorisation<double>::saved_doubles(d), -7.0);
      const g::saved_factorisation<double> save{saved.data(), n, d};
      std::vector<g::gaussian_stats> st(n), st2(n);
      const double eps = 0.05, eps_cov = 0.03;
      if (split) {
        g::project_split(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov,
                         troll::make_batch(ym.data(), n, d), troll::make_batch(yl.data(), n, dd), st.data(), {}, save);
        g::project_split(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov,
                         troll::make_batch(ym2.data(), n, d), troll::make_batch(yl2.data(), n, dd), st2.data());
      } else {
        g::project_joint(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                         troll::make_batch(ym.data(), n, d), troll::make_batch(yl.data(), n, dd), st.data(), {}, save);
        g::project_joint(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                         troll::make_batch(ym2.data(), n, d), troll::make_batch(yl2.data(), n, dd), st2.data());
      }
      CHECK(ym == ym2);  // saving changes nothing in the forward
      CHECK(yl == yl2);
      CHECK(std::none_of(saved.begin(), saved.end(), [](double x) { return x == -7.0; }));
      // VJP with and without the saved factorisation.
      std::vector<double> up_m(n * d), up_l(n * dd);
      for (double& x : up_m) x = gen.normal01();
      for (double& x : up_l) x = gen.normal01();
      struct grads_out {
        std::vector<double> m, l, om, ol, e, em;
      };
      auto vjp = [&](bool use_saved) {
        grads_out o{std::vector<double>(n * d), std::vector<double>(n * dd), std::vector<double>(n * d),
                    std::vector<double>(n * dd), std::vector<double>(n), std::vector<double>(n)};
        const g::gaussian_grads<double> gr{troll::make_batch(o.m.data(), n, d), troll::make_batch(o.l.data(), n, dd),
                                           troll::make_batch(o.om.data(), n, d),
                                           troll::make_batch(o.ol.data(), n, dd), o.e.data(),
                                           split ? o.em.data() : nullptr};
        const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
        if (split) {
          g::project_split_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov, in(ym, d),
                                    in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr, s);
        } else {
          g::project_joint_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, in(ym, d),
                                    in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr, s);
        }
        return o;
      };
      const grads_out a = vjp(true), b = vjp(false);
      CHECK(a.m == b.m);
      CHECK(a.l == b.l);
      CHECK(a.om == b.om);
      CHECK(a.ol == b.ol);
      CHECK(a.e == b.e);
      CHECK(a.em == b.em);
      // JVP with and without.
      auto jvp = [&](bool use_saved) {
        std::vector<double> tm(n * d), tl(n * dd);
        const g::gaussian_tangents<double> tan{in(up_m, d), in(up_l, dd), in(up_m, d), {}, 0.01, 0.02};
        const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
        if (split) {
          g::project_split_jvp(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, eps_cov, in(ym, d),
                               in(yl, dd), st.data(), tan, troll::make_batch(tm.data(), n, d),
                               troll::make_batch(tl.data(), n, dd), s);
        } else {
          g::project_joint_jvp(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps, in(ym, d), in(yl, dd),
                               st.data(), tan, troll::make_batch(tm.data(), n, d), troll::make_batch(tl.data(), n, dd),
                               s);
        }
        tm.insert(tm.end(), tl.begin(), tl.end());
        return tm;
      };
      CHECK(jvp(true) == jvp(false));
      // A saved factorisation of another shape: shape_error before anything is written.
      const g::saved_factorisation<const double> wrong{saved.data(), n - 1, d};
      std::vector<double> gm(n * d, 3.0);
      const g::gaussian_grads<double> gr{troll::make_batch(gm.data(), n, d), {}, {}, {}, nullptr, nullptr};
      CHECK_THROWS_AS(g::project_joint_backward(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), eps,
                                                in(ym, d), in(yl, dd), st.data(), in(up_m, d), in(up_l, dd), gr,
                                                wrong),
                      troll::shape_error);
      CHECK(std::all_of(gm.begin(), gm.end(), [](double x) { return x == 3.0; }));
    }
  }
}
