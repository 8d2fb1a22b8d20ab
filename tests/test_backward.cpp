// test_backward.cpp — every derivative of troll::project in double, against troll's gradient
// checker (central differences with Richardson extrapolation): the VJP w.r.t. new logits, old
// logits and ε (full-Jacobian mode for small V, random directions up to V = 4096), the JVP, the
// full Jacobians, and their mutual consistency. Rows sit well inside their regime (inactive,
// projected, restricted) so no finite-difference step flips the status.
#include <doctest/doctest.h>

#include "grad_helpers.hpp"  // first: it silences a GCC false positive in troll's headers

#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"

using namespace grad_helpers;

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The finite-difference and JVP/VJP consistency tests, one body for every backend (also compiled
// for troll::cuda by tests/cuda/test_cuda_backward_gradient.cu).
#include "../bodies/backward_gradient.hpp"

namespace {

/// Asserts the case has the expected status and that the status is robust: the KL at t = 1
/// (over the joint support) is at least 2x from ε.
void require_regime(const row_case& c) {
  const forward_result f = forward(c.batch, c.eps);
  INFO(c.name);
  REQUIRE(f.stats[0].status == c.status);
  // KL over the joint support, by an independent long-double sum.
  std::vector<double> zn(c.batch.new_logits), zo(c.batch.old_logits);
  for (std::size_t j = 0; j < zn.size(); ++j)
    if (zo[j] == neg_inf) zn[j] = neg_inf;
  const double kl_joint = reference_kl(zn.data(), zo.data(), zn.size());
  if (c.status == troll::row_status::projected) {
    CHECK(kl_joint > 2.0 * c.eps);
  } else {
    CHECK(kl_joint < 0.5 * c.eps);
  }
}

/// Projection Jacobians by VJP with unit upstream vectors (row i of each Jacobian).
struct vjp_jacobians {
  std::vector<double> new_jac, old_jac, eps_jac;
};
vjp_jacobians jacobians_by_vjp(const pair_batch& b, const forward_result& f) {
  const std::size_t v = b.cols;
  vjp_jacobians j{std::vector<double>(v * v), std::vector<double>(v * v), std::vector<double>(v)};
  std::vector<double> g(v), gn(v), go(v);
  double ge = 0;
  for (std::size_t i = 0; i < v; ++i) {
    std::fill(g.begin(), g.end(), 0.0);
    g[i] = 1.0;
    troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), 1, v),
                            troll::make_batch(b.old_logits.data(), 1, v),
                            troll::make_batch(f.log_probs.data(), 1, v), f.stats.data(),
                            troll::make_batch(g.data(), 1, v), troll::make_batch(gn.data(), 1, v),
                            troll::make_batch(go.data(), 1, v), &ge);
    std::copy(gn.begin(), gn.end(), j.new_jac.begin() + long(i * v));
    std::copy(go.begin(), go.end(), j.old_jac.begin() + long(i * v));
    j.eps_jac[i] = ge;
  }
  return j;
}

}  // namespace

TEST_CASE("every case sits inside its regime") {
  for (const row_case& c : small_cases()) require_regime(c);
}


TEST_CASE("project_jacobian agrees with project_backward on unit vectors") {
  for (const row_case& c : small_cases()) {
    const pair_batch& b = c.batch;
    const std::size_t v = b.cols;
    const forward_result f = forward(b, c.eps);
    std::vector<double> jn(v * v, -7.0), jo(v * v, -7.0), je(v, -7.0);
    troll::project_jacobian(troll::cpu, troll::make_batch(b.new_logits.data(), 1, v),
                            troll::make_batch(b.old_logits.data(), 1, v),
                            troll::make_batch(f.log_probs.data(), 1, v), f.stats.data(), jn.data(),
                            jo.data(), je.data());
    const vjp_jacobians by_vjp = jacobians_by_vjp(b, f);
    INFO(c.name);
    double scale = 1.0;
    for (double x : jn) scale = std::max(scale, std::fabs(x));
    for (double x : jo) scale = std::max(scale, std::fabs(x));
    for (double x : je) scale = std::max(scale, std::fabs(x));
    const double tol = 1e-12 * scale;
    for (std::size_t i = 0; i < v; ++i) {
      const bool masked_output = f.log_probs[i] == neg_inf;
      for (std::size_t j = 0; j < v; ++j) {
        INFO("output " << i << " input " << j);
        CHECK(std::fabs(jn[i * v + j] - by_vjp.new_jac[i * v + j]) <= tol);
        CHECK(std::fabs(jo[i * v + j] - by_vjp.old_jac[i * v + j]) <= tol);
        if (masked_output) CHECK(jn[i * v + j] == 0.0);
        if (masked_output) CHECK(jo[i * v + j] == 0.0);
        // masked inputs get no gradient (exact zeros are asserted in a test of their own)
        if (b.new_logits[j] == neg_inf) CHECK(jn[i * v + j] == 0.0);
        if (b.old_logits[j] == neg_inf) CHECK(jo[i * v + j] == 0.0);
      }
      CHECK(std::fabs(je[i] - by_vjp.eps_jac[i]) <= tol);
      if (masked_output) CHECK(je[i] == 0.0);
    }
  }
}


TEST_CASE("project_backward matches the closed-form VJP of math.md §3 (long double oracle)") {
  // ∂L/∂z̃_j = t [g_j − π_j Σg − π_j (d_j − μ) Σ g_i (d_i − μ) / σ²], with μ, σ² recomputed
  // from π* independently, and ∂L/∂ε = Σ g_i (d_i − μ) / (t σ²).
  rng g(5);
  for (std::size_t v : {std::size_t(16), std::size_t(4096)}) {
    pair_batch b = gaussian_row(g, v, 1.2);
    const double eps = 0.03;
    const forward_result f = forward(b, eps);
    REQUIRE(f.stats[0].status == troll::row_status::projected);
    const double t = f.stats[0].t;
    std::vector<double> up = g.normals(v, 1.0), gn(v), ge(1);
    troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), 1, v),
                            troll::make_batch(b.old_logits.data(), 1, v),
                            troll::make_batch(f.log_probs.data(), 1, v), f.stats.data(),
                            troll::make_batch(up.data(), 1, v), troll::make_batch(gn.data(), 1, v),
                            troll::batch_view<double>{}, ge.data());
    long double mu = 0, var = 0, sum_g = 0, sum_gc = 0;
    std::vector<long double> pi(v), d(v);
    for (std::size_t j = 0; j < v; ++j) {
      pi[j] = std::exp((long double)f.log_probs[j]);
      d[j] = (long double)b.new_logits[j] - b.old_logits[j];
      mu += pi[j] * d[j];
    }
    for (std::size_t j = 0; j < v; ++j) var += pi[j] * (d[j] - mu) * (d[j] - mu);
    for (std::size_t j = 0; j < v; ++j) sum_g += up[j], sum_gc += up[j] * (d[j] - mu);
    CHECK(std::fabs(double(mu) - f.stats[0].mu) <= 1e-10 * (1 + std::fabs(double(mu))));
    CHECK(std::fabs(double(var) - f.stats[0].sigma2) <= 1e-9 * double(var));
    double worst = 0;
    for (std::size_t j = 0; j < v; ++j) {
      const long double want = t * (up[j] - pi[j] * sum_g - pi[j] * (d[j] - mu) * sum_gc / var);
      worst = std::max(worst, std::fabs(double(want) - gn[j]) / (1e-12 + std::fabs(double(want))));
    }
    INFO("V = " << v);
    CHECK(worst < 1e-7);
    const double want_eps = double(sum_gc / (t * var));
    CHECK(std::fabs(ge[0] - want_eps) <= 1e-8 * std::fabs(want_eps));
  }
}

/// Long-double oracle of one projected row at the reported t: π_t and q from the logits, μ, σ².
struct tilt_oracle {
  std::vector<long double> pi, q, d;
  long double t = 0, mu = 0, var = 0;
  tilt_oracle(const std::vector<double>& zn, const std::vector<double>& zo, long double t_) : t(t_) {
    const std::size_t v = zn.size();
    pi.resize(v), q.resize(v), d.resize(v);
    long double zmax = -INFINITY, omax = -INFINITY, zs = 0, os = 0;
    for (std::size_t j = 0; j < v; ++j) {
      d[j] = (long double)zn[j] - zo[j];
      zmax = std::max(zmax, (long double)zo[j] + t * d[j]);
      omax = std::max(omax, (long double)zo[j]);
    }
    for (std::size_t j = 0; j < v; ++j) {
      pi[j] = std::exp((long double)zo[j] + t * d[j] - zmax), zs += pi[j];
      q[j] = std::exp((long double)zo[j] - omax), os += q[j];
    }
    for (std::size_t j = 0; j < v; ++j) pi[j] /= zs, q[j] /= os, mu += pi[j] * d[j];
    for (std::size_t j = 0; j < v; ++j) var += pi[j] * (d[j] - mu) * (d[j] - mu);
  }
  /// ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²)
  long double dt_dold(std::size_t j) const {
    return -((1 - t) * t * pi[j] * (d[j] - mu) - (pi[j] - q[j])) / (t * var);
  }
};

/// One row projected at eps in type T, and ∂t/∂z° from the internal block the VJP, JVP and
/// Jacobian all use (`got`; `blk` holds π and c = d − μ as the block saw them).
template <class T>
struct projected_dt_dold {
  std::vector<T> n, o, lp;
  troll::projection_stats st;
  troll::detail::cpu::backward_block blk;
  troll::detail::cpu::block_array got;
  projected_dt_dold(const std::vector<double>& zn, const std::vector<double>& zo, double eps)
      : n(zn.begin(), zn.end()), o(zo.begin(), zo.end()), lp(zn.size()) {
    const std::size_t v = zn.size();
    troll::project(troll::cpu, troll::make_batch(n.data(), 1, v), troll::make_batch(o.data(), 1, v), eps,
                   troll::make_batch(lp.data(), 1, v), &st);
    REQUIRE(st.status == troll::row_status::projected);
    namespace dc = troll::detail::cpu;
    const dc::old_normaliser on = dc::normalise_old(o.data(), v);
    dc::load_backward_block(n.data(), o.data(), lp.data(), st.mu, 0, Eigen::Index(v), blk);
    got = dc::dt_dold_block(o.data(), blk, st, on, 0, Eigen::Index(v));
  }
};

/// max_j |∂t/∂z°_j − oracle| / max_j |oracle| for one row projected at eps in type T: the
/// internal block against tilt_oracle.
template <class T>
double dt_dold_error(const std::vector<double>& zn, const std::vector<double>& zo, double eps) {
  const std::size_t v = zn.size();
  const projected_dt_dold<T> p(zn, zo, eps);
  const tilt_oracle oracle(std::vector<double>(p.n.begin(), p.n.end()), std::vector<double>(p.o.begin(), p.o.end()),
                           p.st.t);
  const auto& got = p.got;
  double worst = 0, scale = 0;
  for (std::size_t j = 0; j < v; ++j) scale = std::max(scale, double(std::fabs(oracle.dt_dold(j))));
  for (std::size_t j = 0; j < v; ++j)
    worst = std::max(worst, std::fabs(double(oracle.dt_dold(j)) - got[Eigen::Index(j)]) / scale);
  return worst;
}

TEST_CASE("grad_old and dt/dz-old at small eps against a long-double oracle") {
  // ∂L/∂z°_j = (1 − t)(g_j − π_j Σg) + Σ_i g_i (d_i − μ) · ∂t/∂z°_j. At small ε the bracket of
  // ∂t/∂z°_j nearly cancels (π_j − q_j ≈ t π_j (d_j − μ), the bracket is O(t²)), so π_j − q_j
  // has to be formed from log(π_j/q_j) = t(d_j − μ) + KL in double: a π read back from a float
  // log π* carries 6e-8 of itself, which would be ~6e-8 / t² of ∂t/∂z° (~3% at ε = 1e-6).
  rng g(17);
  const std::size_t v = 64;
  for (const double eps : {1e-10, 1e-6, 0.05}) {
    CAPTURE(eps);
    pair_batch b = gaussian_row(g, v, 0.8);
    const forward_result f = forward(b, eps);
    REQUIRE(f.stats[0].status == troll::row_status::projected);
    const tilt_oracle o(b.new_logits, b.old_logits, f.stats[0].t);
    std::vector<double> up = g.normals(v, 1.0), gn(v), go(v), ge(1);
    troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), 1, v),
                            troll::make_batch(b.old_logits.data(), 1, v),
                            troll::make_batch(f.log_probs.data(), 1, v), f.stats.data(),
                            troll::make_batch(up.data(), 1, v), troll::make_batch(gn.data(), 1, v),
                            troll::make_batch(go.data(), 1, v), ge.data());
    long double sum_g = 0, sum_gc = 0;
    for (std::size_t j = 0; j < v; ++j) sum_g += up[j], sum_gc += up[j] * (o.d[j] - o.mu);
    double worst = 0, scale = 0;
    std::vector<long double> want(v);
    for (std::size_t j = 0; j < v; ++j) {
      want[j] = (1 - o.t) * (up[j] - o.pi[j] * sum_g) + sum_gc * o.dt_dold(j);
      scale = std::max(scale, double(std::fabs(want[j])));
    }
    for (std::size_t j = 0; j < v; ++j) worst = std::max(worst, std::fabs(double(want[j]) - go[j]) / scale);
    CHECK(worst < 1e-10);
    // ∂t/∂z° itself, relative to its own size: the bracket's O(t) parts cancel by hand
    // (tilt_derivatives.hpp), so it keeps double's digits at every ε (it was 2e-6 off at ε = 1e-10
    // before the thirty-fourth session). The long-double oracle subtracts π − q itself, so it is
    // good only to ~1e-19/t² (~5e-10 at ε = 1e-10); tinier ε: the next test case.
    CHECK(dt_dold_error<double>(b.new_logits, b.old_logits, eps) < (eps < 1e-8 ? 1e-8 : 1e-12));
  }
  // Float rows: the case the log-ratio form exists for (π_j from the float log π* in the first
  // term of the bracket left 4e-5 of ∂t/∂z° at ε = 1e-6 before π_j was formed as q_j + (π_j − q_j)).
  for (const double eps : {1e-6, 1e-4, 0.05}) {
    CAPTURE(eps);
    pair_batch b = gaussian_row(g, v, 0.8);
    CHECK(dt_dold_error<float>(b.new_logits, b.old_logits, eps) < 2e-6);  // was 4e-5 at ε = 1e-6
  }
}

/// max_j |∂t/∂z°_j − its small-t limit| / max_j |limit| at a tiny ε: for t → 0 the bracket is
/// t² q_j (c_j²/2 − c_j − σ²/2) + O(t³), so ∂t/∂z°_j = −t q_j (c_j²/2 − c_j − σ²/2)/σ² to a
/// relative O(t), with q, c = d − E_q[d] and σ² = Var_q[d] of the old row in long double (an
/// oracle independent of the bracket's cancellation, exact to ~t for t ≤ 1e-20).
template <class T>
double dt_dold_small_t_error(const std::vector<double>& zn, const std::vector<double>& zo, double eps) {
  const std::size_t v = zn.size();
  const projected_dt_dold<T> p(zn, zo, eps);
  const std::vector<T>& n = p.n;
  const std::vector<T>& o = p.o;
  const troll::projection_stats& st = p.st;
  REQUIRE(st.t < 1e-20);
  std::vector<long double> q(v), d(v);
  long double omax = -INFINITY, sum = 0, mu = 0, var = 0;
  for (std::size_t j = 0; j < v; ++j) omax = std::max(omax, (long double)o[j]);
  for (std::size_t j = 0; j < v; ++j) q[j] = std::exp((long double)o[j] - omax), sum += q[j];
  for (std::size_t j = 0; j < v; ++j) q[j] /= sum, d[j] = (long double)n[j] - (long double)o[j], mu += q[j] * d[j];
  for (std::size_t j = 0; j < v; ++j) var += q[j] * (d[j] - mu) * (d[j] - mu);
  const auto& got = p.got;
  const auto& blk = p.blk;
  double worst = 0, scale = 0;
  std::vector<long double> want(v);
  for (std::size_t j = 0; j < v; ++j) {
    const long double c = d[j] - mu;
    want[j] = -(long double)st.t * q[j] * (c * c / 2 - c - var / 2) / var;
    scale = std::max(scale, double(std::fabs(want[j])));
  }
  for (std::size_t j = 0; j < v; ++j) {
    worst = std::max(worst, std::fabs(double(want[j]) - got[Eigen::Index(j)]) / scale);
    // The scalar form every CUDA kernel calls, on the same inputs.
    const double scalar = troll::detail::dt_dold(true, blk.pi[Eigen::Index(j)], blk.centred[Eigen::Index(j)],
                                                 double(q[j]), st);
    worst = std::max(worst, std::fabs(double(want[j]) - scalar) / scale);
  }
  return worst;
}

TEST_CASE("dt/dz-old at tiny eps against its small-t limit") {
  // Before the thirty-fourth session the bracket [(1 − t) t π c − (π − q)] was formed as the
  // difference of its two O(t) terms, leaving ~1e-16 t c of noise in an O(t² c) result: ∂t/∂z°
  // was 1e-7 off at ε = 1e-20 and wrong by 13 or more orders of magnitude at ε = 1e-60.
  rng g(23);
  const std::size_t v = 48;
  for (const double eps : {1e-50, 1e-60, 1e-200, 1e-300, std::numeric_limits<double>::min()}) {
    CAPTURE(eps);
    pair_batch b = gaussian_row(g, v, 0.8);
    CHECK(dt_dold_small_t_error<double>(b.new_logits, b.old_logits, eps) < 1e-13);
    CHECK(dt_dold_small_t_error<float>(b.new_logits, b.old_logits, eps) < 1e-13);
  }
}

TEST_CASE("grad_old at tiny eps on a row whose far tokens carry a large d - mu") {
  // The old row carries +3e5 on every even token, so the odd tokens have π ≈ q ≈ e^{−3e5} but
  // d − μ ≈ 3e5, and H = Σ g (d − μ) is ~1e6 where ∂t/∂z° on the even tokens is ~1e-30: any
  // noise of ∂t/∂z° is multiplied by 1e6. The old-side VJP must still be (1 − t)(g − π Σg) to
  // double precision (the H ∂t/∂z° term is below 1e-20 here), and Σ_j ∂L/∂z°_j = 0 (a shift of
  // the old logits leaves π* unchanged). Before the thirty-fourth session: 9e-2 off.
  for (const std::size_t v : {std::size_t(16), std::size_t(64), std::size_t(1024)}) {
    for (const double eps : {1e-100, 1e-300, std::numeric_limits<double>::min()}) {
      CAPTURE(v);
      CAPTURE(eps);
      rng g(7);
      std::vector<double> zn(v), zo(v), lp(v), up = g.normals(v, 1.0), gn(v), go(v), ge(1);
      for (std::size_t j = 0; j < v; ++j) {
        zn[j] = 3.0 * g.normal();
        zo[j] = zn[j] + 1e-9 * g.normal() + (j % 2 == 0 ? 3e5 : 0.0);
      }
      troll::projection_stats st;
      troll::project(troll::cpu, troll::make_batch(zn.data(), 1, v), troll::make_batch(zo.data(), 1, v), eps,
                     troll::make_batch(lp.data(), 1, v), &st);
      REQUIRE(st.status == troll::row_status::projected);
      REQUIRE(st.t < 1e-40);
      troll::project_backward(troll::cpu, troll::make_batch(zn.data(), 1, v), troll::make_batch(zo.data(), 1, v),
                              troll::make_batch(lp.data(), 1, v), &st, troll::make_batch(up.data(), 1, v),
                              troll::make_batch(gn.data(), 1, v), troll::make_batch(go.data(), 1, v), ge.data());
      long double sum_g = 0, sum_go = 0;
      for (std::size_t j = 0; j < v; ++j) sum_g += up[j];
      double worst = 0, scale = 0;
      for (std::size_t j = 0; j < v; ++j) {
        const long double want = (1 - (long double)st.t) * (up[j] - std::exp((long double)lp[j]) * sum_g);
        scale = std::max(scale, std::fabs(go[j]));
        worst = std::max(worst, double(std::fabs(want - go[j])));
        sum_go += go[j];
      }
      CHECK(worst <= 1e-14 * scale);
      CHECK(std::fabs(double(sum_go)) <= 1e-14 * scale);
    }
  }
}

TEST_CASE("nearly equal double rows: mu, sigma2 and the VJP keep their digits") {
  // d = z̃ − z° of size 1e-7 … 1e-12 beside logits of size ~3: the solver's x = (z̃ − z̃_r) −
  // (z° − z°_r) carries ~ulp(3) of absolute error, and before the thirty-fourth session μ and σ²
  // (hence every derivative) kept only ~ulp/|d| of their digits (σ² 2e-6 off at KL(p̃‖q) = 1e-20).
  // refine_moments (row_kernels.hpp) forms them again from compensated differences. Oracle: long
  // double, d exact, π_t ∝ q e^{t d} at the reported t.
  for (const double kl : {1e-14, 1e-20, 1e-24}) {
    CAPTURE(kl);
    rng g(41);
    const std::size_t v = 24;
    std::vector<double> zo = g.normals(v, 3.0), zn(v), lp(v), up = g.normals(v, 1.0), gn(v), ge(1);
    for (std::size_t j = 0; j < v; ++j) zn[j] = zo[j] + std::sqrt(2.0 * kl) * g.normal();
    long double omax = -INFINITY, sq = 0, m0 = 0, var0 = 0;
    std::vector<long double> q(v), d(v), pi(v);
    for (std::size_t j = 0; j < v; ++j) omax = std::max(omax, (long double)zo[j]);
    for (std::size_t j = 0; j < v; ++j) q[j] = std::exp((long double)zo[j] - omax), sq += q[j];
    for (std::size_t j = 0; j < v; ++j) q[j] /= sq, d[j] = (long double)zn[j] - (long double)zo[j], m0 += q[j] * d[j];
    for (std::size_t j = 0; j < v; ++j) var0 += q[j] * (d[j] - m0) * (d[j] - m0);
    const double eps = double(var0 / 4);  // KL(p̃‖q) ≈ var0/2: t* ≈ 1/√2
    troll::projection_stats st;
    troll::project(troll::cpu, troll::make_batch(zn.data(), 1, v), troll::make_batch(zo.data(), 1, v), eps,
                   troll::make_batch(lp.data(), 1, v), &st);
    REQUIRE(st.status == troll::row_status::projected);
    const long double t = st.t;
    long double sp = 0, mu = 0, var = 0, sum_g = 0, sum_gc = 0;
    for (std::size_t j = 0; j < v; ++j) pi[j] = q[j] * std::exp(t * (d[j] - m0)), sp += pi[j];
    for (std::size_t j = 0; j < v; ++j) pi[j] /= sp, mu += pi[j] * d[j];
    for (std::size_t j = 0; j < v; ++j) var += pi[j] * (d[j] - mu) * (d[j] - mu);
    for (std::size_t j = 0; j < v; ++j) sum_g += up[j], sum_gc += up[j] * (d[j] - mu);
    CHECK(std::fabs(double((long double)st.sigma2 / var - 1)) < 1e-12);
    CHECK(std::fabs(double((long double)st.mu - mu)) < 1e-12 * double(std::sqrt(var)));
    troll::project_backward(troll::cpu, troll::make_batch(zn.data(), 1, v), troll::make_batch(zo.data(), 1, v),
                            troll::make_batch(lp.data(), 1, v), &st, troll::make_batch(up.data(), 1, v),
                            troll::make_batch(gn.data(), 1, v), troll::batch_view<double>{}, ge.data());
    double worst = 0, scale = 0;
    for (std::size_t j = 0; j < v; ++j) {
      const long double want = t * (up[j] - pi[j] * sum_g - pi[j] * (d[j] - mu) * sum_gc / var);
      scale = std::max(scale, double(std::fabs(want)));
      worst = std::max(worst, double(std::fabs(want - gn[j])));
    }
    CHECK(worst <= 1e-12 * scale);
    const long double want_eps = sum_gc / (t * var);
    CHECK(std::fabs(double(ge[0] - want_eps)) <= 1e-12 * std::fabs(double(want_eps)));
  }
}

TEST_CASE("inactive and restricted rows: plain log-softmax backward, no old or eps gradient") {
  rng g(31);
  const std::size_t v = 11;
  pair_batch b(2, v);
  {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += 0.03 * g.normal();
    zn[4] = zo[4] = neg_inf;           // masked in both
    zn[8] = neg_inf, zo[8] = -6.0;     // old-only token with little old mass
    b.set_row(0, zn, zo);
  }
  {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += 0.03 * g.normal();
    zo[2] = neg_inf, zn[2] = -22.0;  // new-only token with 1e-10 mass: restricted
    b.set_row(1, zn, zo);
  }
  const double eps = 0.2;
  const forward_result f = forward(b, eps);
  REQUIRE(f.stats[0].status == troll::row_status::inactive);
  REQUIRE(f.stats[1].status == troll::row_status::restricted);
  std::vector<double> up = g.normals(2 * v, 1.0);
  up[4] = 1e6;  // upstream at masked outputs is ignored
  up[8] = 2e6;
  up[v + 2] = -3e5;
  std::vector<double> gn(2 * v, 9.0), go(2 * v, 9.0), ge(2, 9.0);
  troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), 2, v),
                          troll::make_batch(b.old_logits.data(), 2, v),
                          troll::make_batch(f.log_probs.data(), 2, v), f.stats.data(),
                          troll::make_batch(up.data(), 2, v), troll::make_batch(gn.data(), 2, v),
                          troll::make_batch(go.data(), 2, v), ge.data());
  for (std::size_t r = 0; r < 2; ++r) {
    // independent reference: softmax of z̃ over the joint support, g_j − p_j Σ_J g
    auto masked = [&](std::size_t j) {
      return b.new_row(r)[j] == neg_inf || b.old_row(r)[j] == neg_inf;
    };
    long double m = -INFINITY, s = 0, sum_g = 0;
    for (std::size_t j = 0; j < v; ++j)
      if (!masked(j)) m = std::max(m, (long double)b.new_row(r)[j]);
    for (std::size_t j = 0; j < v; ++j)
      if (!masked(j)) s += std::exp((long double)b.new_row(r)[j] - m), sum_g += up[r * v + j];
    for (std::size_t j = 0; j < v; ++j) {
      INFO("row " << r << " token " << j);
      const std::size_t k = r * v + j;
      if (masked(j)) {
        CHECK(f.log_probs[k] == neg_inf);
        CHECK(std::fabs(gn[k]) <= 1e-300);
      } else {
        const long double p = std::exp((long double)b.new_row(r)[j] - m) / s;
        CHECK(f.log_probs[k] == doctest::Approx(double(std::log(p))).epsilon(1e-13));
        CHECK(gn[k] == doctest::Approx(double(up[k] - p * sum_g)).epsilon(1e-12).scale(1.0));
      }
      CHECK(std::fabs(go[k]) <= 1e-300);
    }
    CHECK(ge[r] == 0.0);
  }
  // The inactive row is bit-identical to troll::log_softmax.
  std::vector<double> ls(v);
  troll::log_softmax(troll::cpu, troll::make_batch(b.new_logits.data(), 1, v),
                     troll::make_batch(ls.data(), 1, v));
  for (std::size_t j = 0; j < v; ++j) CHECK(std::memcmp(&ls[j], &f.log_probs[j], sizeof(double)) == 0);
}

TEST_CASE("multithreaded backward equals the serial one bit for bit") {
  rng g(8);
  const std::size_t v = 300, rows = 64;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += (r % 3 == 0 ? 0.01 : 1.0) * g.normal();
    b.set_row(r, zn, zo);
  }
  const forward_result f = forward(b, 0.05);
  std::vector<double> up = g.normals(rows * v, 1.0);
  std::vector<double> gn1(rows * v), go1(rows * v), ge1(rows), gn4(rows * v), go4(rows * v), ge4(rows);
  auto run = [&](troll::cpu_policy p, std::vector<double>& gn, std::vector<double>& go,
                 std::vector<double>& ge) {
    troll::project_backward(p, troll::make_batch(b.new_logits.data(), rows, v),
                            troll::make_batch(b.old_logits.data(), rows, v),
                            troll::make_batch(f.log_probs.data(), rows, v), f.stats.data(),
                            troll::make_batch(up.data(), rows, v), troll::make_batch(gn.data(), rows, v),
                            troll::make_batch(go.data(), rows, v), ge.data());
  };
  run(troll::cpu.with_threads(1), gn1, go1, ge1);
  run(troll::cpu.with_threads(4), gn4, go4, ge4);
  CHECK(std::memcmp(gn1.data(), gn4.data(), gn1.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(go1.data(), go4.data(), go1.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(ge1.data(), ge4.data(), ge1.size() * sizeof(double)) == 0);
}

TEST_CASE("strided views: backward reads and writes only inside each row") {
  rng g(12);
  const std::size_t v = 9, rows = 3, stride = 13;
  pair_batch packed(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += 1.5 * g.normal();
    packed.set_row(r, zn, zo);
  }
  const double eps = 0.05;
  const forward_result f = forward(packed, eps);
  std::vector<double> up = g.normals(rows * v, 1.0), gn(rows * v), go(rows * v), ge(rows);
  troll::project_backward(troll::cpu, troll::make_batch(packed.new_logits.data(), rows, v),
                          troll::make_batch(packed.old_logits.data(), rows, v),
                          troll::make_batch(f.log_probs.data(), rows, v), f.stats.data(),
                          troll::make_batch(up.data(), rows, v), troll::make_batch(gn.data(), rows, v),
                          troll::make_batch(go.data(), rows, v), ge.data());
  // The same batch with stride 13; the padding holds NaN (never read) and sentinels (never written).
  const double nan = std::nan("");
  std::vector<double> zn_s(rows * stride, nan), zo_s(rows * stride, nan), lp_s(rows * stride, nan),
      up_s(rows * stride, nan), gn_s(rows * stride, 123.0), go_s(rows * stride, 123.0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < v; ++j) {
      zn_s[r * stride + j] = packed.new_logits[r * v + j];
      zo_s[r * stride + j] = packed.old_logits[r * v + j];
      lp_s[r * stride + j] = f.log_probs[r * v + j];
      up_s[r * stride + j] = up[r * v + j];
    }
  std::vector<double> ge_s(rows);
  troll::project_backward(troll::cpu, troll::make_batch(zn_s.data(), rows, v, stride),
                          troll::make_batch(zo_s.data(), rows, v, stride),
                          troll::make_batch(lp_s.data(), rows, v, stride), f.stats.data(),
                          troll::make_batch(up_s.data(), rows, v, stride),
                          troll::make_batch(gn_s.data(), rows, v, stride),
                          troll::make_batch(go_s.data(), rows, v, stride), ge_s.data());
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t j = 0; j < stride; ++j) {
      if (j < v) {
        CHECK(gn_s[r * stride + j] == gn[r * v + j]);
        CHECK(go_s[r * stride + j] == go[r * v + j]);
      } else {
        CHECK(gn_s[r * stride + j] == 123.0);
        CHECK(go_s[r * stride + j] == 123.0);
      }
    }
    CHECK(ge_s[r] == ge[r]);
  }
}

// ---- Regressions of library bugs these tests found (fixed in e8c331b) ----

TEST_CASE("a token masked in both rows, and no one-sided mask, behaves like a shorter row") {
  // (Its derivatives' check is in bodies/backward_gradient.hpp, run on every backend.)
  // z̃ = {0, 1, -inf, 0.5}, z° = {0, 0, -inf, 0.2} must match the V = 3 row without token 2, with
  // log π*_2 = -inf. (Was: status projected, kl_before NaN, output NaN — the -inf - -inf of the
  // both-masked token entered the unmasked fast path.)
  const std::vector<double> zn = {0.0, 1.0, neg_inf, 0.5}, zo = {0.0, 0.0, neg_inf, 0.2};
  const std::vector<double> zn3 = {0.0, 1.0, 0.5}, zo3 = {0.0, 0.0, 0.2};
  for (double eps : {0.5, 0.01}) {
    INFO("eps = " << eps);
    const forward_result full = forward(one_row(zn, zo), eps);
    const forward_result short_row = forward(one_row(zn3, zo3), eps);
    CHECK(full.stats[0].status == short_row.stats[0].status);
    CHECK(full.stats[0].kl_before == doctest::Approx(short_row.stats[0].kl_before).epsilon(1e-12));
    CHECK(full.log_probs[2] == neg_inf);
    CHECK(full.log_probs[0] == doctest::Approx(short_row.log_probs[0]).epsilon(1e-12));
    CHECK(full.log_probs[1] == doctest::Approx(short_row.log_probs[1]).epsilon(1e-12));
    CHECK(full.log_probs[3] == doctest::Approx(short_row.log_probs[2]).epsilon(1e-12));
  }
}

TEST_CASE("masked inputs get exactly zero gradient (docs/api.md)") {
  // A projected row with a masked token on each side. (Was: ~1e-308 at the masked inputs without
  // AVX-512 — Eigen's vectorised exp(-inf) returned the smallest normal, not 0.)
  const std::vector<double> zn = {0.3, -0.2, 2.0, neg_inf, 0.9, -1.0},
                            zo = {0.1, 0.4, -0.5, -2.0, neg_inf, 0.0};
  const pair_batch b = one_row(zn, zo);
  const forward_result f = forward(b, 0.05);
  REQUIRE(f.stats[0].status == troll::row_status::projected);
  std::vector<double> up = {0.7, -1.1, 0.4, 0.0, 0.0, 2.0}, gn(6, 5.0), go(6, 5.0);
  double ge = 0;
  troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), 1, 6),
                          troll::make_batch(b.old_logits.data(), 1, 6),
                          troll::make_batch(f.log_probs.data(), 1, 6), f.stats.data(),
                          troll::make_batch(up.data(), 1, 6), troll::make_batch(gn.data(), 1, 6),
                          troll::make_batch(go.data(), 1, 6), &ge);
  CHECK(gn[3] == 0.0);  // masked new logit
  CHECK(go[4] == 0.0);  // masked old logit
  CHECK(gn[4] == 0.0);  // new logit of a token the old row masks: π* has no mass there
}

TEST_CASE("the checks can fail: slightly wrong derivatives are caught at these tolerances") {
  const row_case c = small_cases().front();  // projected, ε = 0.05
  const packing pack(c.batch, true, true, c.eps);
  const std::size_t n_new = c.batch.cols, n = pack.size();
  for (int mutation = 0; mutation < 3; ++mutation) {
    auto wrong_vjp = [&](const double* x, const double* gy, double* gx) {
      projection_vjp{&pack}(x, gy, gx);
      if (mutation == 0) gx[n - 1] *= 1.0 + 1e-3;                          // ∂/∂log ε off by 0.1%
      if (mutation == 1) gx[n_new + 2] += 1e-3 * gx[2];                    // old leaks into new
      if (mutation == 2) for (std::size_t k = 0; k < n_new; ++k) gx[k] *= 1.0 - 1e-4;  // t off
    };
    const troll::gradcheck_result r = troll::check_vjp(projection_function{&pack}, wrong_vjp,
                                                       pack.x0(), pack.outputs(), opts());
    INFO("mutation " << mutation << "\n" << r.report());
    CHECK_FALSE(r.ok);
  }
}

TEST_CASE("float rows on the packet VJP: inactive rows against long double, projected against double") {
  // Rows of V = 3,000 float logits, no grad_old: the two-pass packet VJP (vjp_row_packets),
  // which for rows that are not projected skips the centring sums and both logit rows in its
  // second pass. Inactive rows: g_j − p_j Σg with p = softmax(z̃), in long double from the same
  // float inputs. The projected row: the double backward of the same float inputs, widened.
  rng g(47);
  const std::size_t v = 3000, rows = 3;
  std::vector<float> zn(rows * v), zo(rows * v), up(rows * v);
  for (std::size_t r = 0; r < rows; ++r) {
    const double shift = r == 2 ? 0.6 : 0.004;  // rows 0 and 1 inactive at ε = 0.05, row 2 projected
    for (std::size_t j = 0; j < v; ++j) {
      const double o = 3.0 * g.normal();
      zo[r * v + j] = float(o);
      zn[r * v + j] = float(o + shift * g.normal());
      up[r * v + j] = float(g.normal());
    }
  }
  up[v + 7] = 40.0f;  // a large upstream entry on one inactive row
  const double eps = 0.05;
  std::vector<float> lp(rows * v), gn(rows * v, 9.0f), ge(rows, 9.0f);
  std::vector<troll::projection_stats> st(rows);
  troll::project(troll::cpu, troll::make_batch(zn.data(), rows, v), troll::make_batch(zo.data(), rows, v), eps,
                 troll::make_batch(lp.data(), rows, v), st.data());
  REQUIRE(st[0].status == troll::row_status::inactive);
  REQUIRE(st[1].status == troll::row_status::inactive);
  REQUIRE(st[2].status == troll::row_status::projected);
  troll::project_backward(troll::cpu, troll::make_batch(zn.data(), rows, v), troll::make_batch(zo.data(), rows, v),
                          troll::make_batch(lp.data(), rows, v), st.data(), troll::make_batch(up.data(), rows, v),
                          troll::make_batch(gn.data(), rows, v), troll::batch_view<float>{}, ge.data());
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(ge[r] == 0.0f);
    long double m = -INFINITY, s = 0, sum_g = 0;
    for (std::size_t j = 0; j < v; ++j) m = std::max(m, (long double)zn[r * v + j]);
    for (std::size_t j = 0; j < v; ++j) s += std::exp((long double)zn[r * v + j] - m), sum_g += up[r * v + j];
    double worst = 0.0;
    for (std::size_t j = 0; j < v; ++j) {
      const long double p = std::exp((long double)zn[r * v + j] - m) / s;
      const long double ref = (long double)up[r * v + j] - p * sum_g;
      // float output rounding and π read back from the float log π* (|log π| ≤ ~30 here)
      const long double scale = std::fabs((long double)up[r * v + j]) + p * std::fabs(sum_g);
      worst = std::max(worst, double(std::fabs((long double)gn[r * v + j] - ref) / scale));
    }
    INFO("row " << r);
    CHECK(worst < 4e-6);
  }
  // The projected row: against the double backward of the widened inputs (its own forward).
  std::vector<double> dn(zn.begin() + long(2 * v), zn.end()), dold(zo.begin() + long(2 * v), zo.end()),
      dup(up.begin() + long(2 * v), up.end()), dlp(v), dgn(v);
  troll::projection_stats ds;
  double dge = 0.0;
  troll::project(troll::cpu, troll::make_batch(dn.data(), 1, v), troll::make_batch(dold.data(), 1, v), eps,
                 troll::make_batch(dlp.data(), 1, v), &ds);
  troll::project_backward(troll::cpu, troll::make_batch(dn.data(), 1, v), troll::make_batch(dold.data(), 1, v),
                          troll::make_batch(dlp.data(), 1, v), &ds, troll::make_batch(dup.data(), 1, v),
                          troll::make_batch(dgn.data(), 1, v), troll::batch_view<double>{}, &dge);
  double largest = 0.0, worst = 0.0;
  for (std::size_t j = 0; j < v; ++j) largest = std::max(largest, std::fabs(dgn[j]));
  for (std::size_t j = 0; j < v; ++j) worst = std::max(worst, std::fabs(double(gn[2 * v + j]) - dgn[j]));
  CHECK(worst <= 1e-4 * largest);
  CHECK(double(ge[2]) == doctest::Approx(dge).epsilon(1e-4));
}

namespace {

/// ∂L/∂z° of a two-token row whose old row all but masks token 1 (z°_1 ≈ −1e30): the projected
/// row's t* lies within a rounding of 1, so every term is formed from s = 1 − t*, found here by
/// bisection in long double, and from the forms that do not cancel on such a row (π₀ − q₀ = −π₁,
/// c₀ = π₁(d₀ − d₁), c₁ = π₀(d₁ − d₀), σ² = π₀π₁(d₁ − d₀)²; q₁ underflows to 0).
std::vector<long double> near_one_grad_old(const std::vector<double>& zn, const std::vector<double>& zo, double eps,
                                           const std::vector<double>& g) {
  using ld = long double;
  const ld d0 = ld(zn[0]) - ld(zo[0]), d1 = ld(zn[1]) - ld(zo[1]);
  const ld old_lse = ld(zo[0]) + std::log1p(std::exp(ld(zo[1]) - ld(zo[0])));
  struct member {
    ld s, pi0, pi1, kl;
  };
  auto at = [&](ld s) {
    const ld w0 = ld(zn[0]) - s * d0, w1 = ld(zn[1]) - s * d1;
    const ld top = std::max(w0, w1), lse = top + std::log(std::exp(w0 - top) + std::exp(w1 - top));
    member m{s, std::exp(w0 - lse), std::exp(w1 - lse), 0};
    // log π_i − log q_i = (1 − s) d_i − lse + old_lse
    m.kl = m.pi0 * ((1 - s) * d0 - lse + old_lse) + m.pi1 * ((1 - s) * d1 - lse + old_lse);
    return m;
  };
  ld lo = std::log(ld(1e-60)), hi = std::log(ld(1e-12));  // log s; KL falls as s grows
  for (int k = 0; k < 200; ++k) {
    const ld mid = 0.5L * (lo + hi);
    (at(std::exp(mid)).kl > ld(eps) ? lo : hi) = mid;
  }
  const member m = at(std::exp(0.5L * (lo + hi)));
  const ld t = 1 - m.s, c0 = m.pi1 * (d0 - d1), c1 = m.pi0 * (d1 - d0);
  const ld sigma2 = m.pi0 * m.pi1 * (d1 - d0) * (d1 - d0);
  const ld sum_gc = ld(g[0]) * c0 + ld(g[1]) * c1;
  const ld dt0 = -(m.s * t * m.pi0 * c0 - (-m.pi1)) / (t * sigma2);
  const ld dt1 = -(m.s * t * m.pi1 * c1 - m.pi1) / (t * sigma2);
  // g_j − π_j Σg without 1 − π₀ (which rounds to 0): g₀π₁ − π₀g₁ and g₁π₀ − π₁g₀
  const ld explicit0 = ld(g[0]) * m.pi1 - m.pi0 * ld(g[1]), explicit1 = ld(g[1]) * m.pi0 - m.pi1 * ld(g[0]);
  return {m.s * explicit0 + sum_gc * dt0, m.s * explicit1 + sum_gc * dt1};
}

}  // namespace

TEST_CASE("grad_old where t* is within a rounding of 1: 1 − t* from the statistics' eta") {
  // z° = (0.034, −1e30): the old row gives token 1 a mass of e^{-1e30}, so at ε = 10 the member
  // sits at 1 − t* ≈ 7e-29 and s.t is exactly 1. Before the thirty-fifth session the (1 − t)
  // factors of ∂L/∂z° came from 1 − s.t = 0, and token 0's ∂t/∂z° (π₀ ≈ 1) from quantities of
  // size 10 whose rounding is ~1e-15 against a true 1e-29: grad_old's entries did not sum to 0
  // and token 0's was off by 100% … 1e16 of the largest. Now 1 − t* comes from η and the
  // dominant token's entry from the others' (Σ_j ∂L/∂z°_j = 0).
  const std::vector<double> zn = {-0.7145797210329641, 0.4695680987474934};
  for (const double shift : {0.03392818243710029, 2.5}) {
    const std::vector<double> zo = {shift, -1e30};
    for (const std::vector<double>& g : {std::vector<double>{0.7, -1.3}, std::vector<double>{1.0, 0.0}}) {
      CAPTURE(shift);
      const std::vector<long double> want = near_one_grad_old(zn, zo, 10.0, g);
      const double scale = double(std::max(std::fabs(want[0]), std::fabs(want[1])));
      REQUIRE(scale > 0.0);
      auto run = [&](auto zero) {
        using T = decltype(zero);
        std::vector<T> n(zn.begin(), zn.end()), o(zo.begin(), zo.end()), lp(2), up(g.begin(), g.end()), gn(2),
            go(2);
        troll::projection_stats st;
        troll::project(troll::cpu, troll::make_batch(n.data(), 1, 2), troll::make_batch(o.data(), 1, 2), 10.0,
                       troll::make_batch(lp.data(), 1, 2), &st);
        REQUIRE(st.status == troll::row_status::projected);
        CHECK(st.t == 1.0);  // the case: 1 − t* is below half an ulp of 1
        CHECK(st.eta > 0.0);
        troll::project_backward(troll::cpu, troll::make_batch(n.data(), 1, 2), troll::make_batch(o.data(), 1, 2),
                                troll::make_batch(lp.data(), 1, 2), &st, troll::make_batch(up.data(), 1, 2),
                                troll::make_batch(gn.data(), 1, 2), troll::make_batch(go.data(), 1, 2));
        // relative to the larger entry, with T's smallest normal as the floor (1e-59 is 0 in float)
        double worst = 0;
        const double floor = double(std::numeric_limits<T>::min());
        for (int j = 0; j < 2; ++j)
          worst = std::max(worst, std::max(0.0, std::fabs(double(go[j]) - double(want[j])) - floor) / scale);
        return worst;
      };
      CHECK(run(0.0) < 1e-12);  // measured 1.5e-14 … 5.2e-14
      // The JVP with tangent_old = e_j and the Jacobian's column j agree with the VJP: gᵀ J° e_j.
      std::vector<double> n(zn), o(zo), lp(2), jn(4), jo(4), tn(2, 0.0), out(2);
      troll::projection_stats st;
      troll::project(troll::cpu, troll::make_batch(n.data(), 1, 2), troll::make_batch(o.data(), 1, 2), 10.0,
                     troll::make_batch(lp.data(), 1, 2), &st);
      troll::project_jacobian(troll::cpu, troll::make_batch(n.data(), 1, 2), troll::make_batch(o.data(), 1, 2),
                              troll::make_batch(lp.data(), 1, 2), &st, jn.data(), jo.data());
      for (std::size_t j = 0; j < 2; ++j) {
        CAPTURE(j);
        std::vector<double> to(2, 0.0);
        to[j] = 1.0;
        troll::project_jvp(troll::cpu, troll::make_batch(n.data(), 1, 2), troll::make_batch(o.data(), 1, 2),
                           troll::make_batch(lp.data(), 1, 2), &st, troll::make_batch(tn.data(), 1, 2),
                           troll::make_batch(to.data(), 1, 2), 0.0, troll::make_batch(out.data(), 1, 2));
        const double by_jacobian = g[0] * jo[0 * 2 + j] + g[1] * jo[1 * 2 + j];
        const double by_jvp = g[0] * out[0] + g[1] * out[1];
        CHECK(std::fabs(by_jacobian - double(want[j])) <= 1e-12 * scale);
        CHECK(std::fabs(by_jvp - double(want[j])) <= 1e-12 * scale);
      }
      // π₁ = e^{-66.8} read back from float log π* carries ~ulp(66.8) = 8e-6 of itself, and the
      // two terms of ∂L/∂z° cancel by ~70 here (docs/api.md: the float limit of π read back)
      CHECK(run(0.0f) < 2e-3);
    }
  }
}

TEST_CASE_TEMPLATE("grad_new at the dominant token of a near one-hot row, upstream on that token", T, double, float) {
  // The thirty-sixth session's sparse-derivative audit: upstream g = e_0 on a row whose token 0
  // holds 1 − 4e-18 of the mass. ∂L/∂z̃_0 = t(1 − π_0) − … was formed as g_0 − π_0 Σg: 0 for
  // 5.8e-18 (100% off relative to the gradient itself). Every VJP path (the short and packet
  // paths, the general one with grad_old or masked tokens) now writes the entry at a token of
  // π > 1/2 as minus the others' sum (new_side_dominant). Inactive rows: the reference is
  // δ_j0 − p_j in long double.
  for (const std::size_t v : {3u, 9u, 5000u}) {
    for (const bool masked : {false, true}) {
      for (const bool with_old : {false, true}) {
        CAPTURE(v);
        CAPTURE(masked);
        CAPTURE(with_old);
        std::vector<T> zn(v), lp(v), g(v, T(0)), gn(v), go(v);
        for (std::size_t j = 0; j < v; ++j) zn[j] = j == 0 ? T(0) : T(-40.0 - double(j % 7));
        if (masked) zn[1] = -std::numeric_limits<T>::infinity();
        g[0] = T(1);
        const std::vector<T> zo = zn;  // KL 0: inactive, π* = p̃
        troll::projection_stats st;
        troll::project(troll::cpu, troll::make_batch<const T>(zn.data(), 1, v), troll::make_batch<const T>(zo.data(), 1, v),
                       0.05, troll::make_batch(lp.data(), 1, v), &st);
        REQUIRE(st.status == troll::row_status::inactive);
        troll::project_backward(troll::cpu, troll::make_batch<const T>(zn.data(), 1, v),
                                troll::make_batch<const T>(zo.data(), 1, v), troll::make_batch<const T>(lp.data(), 1, v),
                                &st, troll::make_batch<const T>(g.data(), 1, v), troll::make_batch(gn.data(), 1, v),
                                with_old ? troll::make_batch(go.data(), 1, v) : troll::batch_view<T>{});
        long double total = 0;
        std::vector<long double> p(v);
        for (std::size_t j = 0; j < v; ++j) p[j] = std::exp((long double)zn[j]), total += p[j];
        long double rest = 0, worst = 0, scale = 0;
        for (std::size_t j = 1; j < v; ++j) rest += p[j] / total;
        for (std::size_t j = 0; j < v; ++j) {
          const long double want = j == 0 ? rest : -p[j] / total;
          scale = std::max(scale, std::fabs(want));
          worst = std::max(worst, std::fabs((long double)gn[j] - want));
        }
        REQUIRE(scale > 0);
        CHECK(double(worst / scale) <= (std::is_same<T, double>::value ? 1e-13 : 1e-6));
      }
    }
  }
}

TEST_CASE("bound_max: the running bound the overflow checks read keeps a NaN from either operand") {
  // The VJP, JVP and objective kernels bound |entry| over what they wrote and then test the bound
  // with fits_in; with `maximum` (a < b ? b : a) a NaN entry as the second operand was dropped, so
  // a row whose only bad entry was NaN would have passed the check.
  using troll::detail::bound_max;
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  CHECK(std::isnan(bound_max(1.0, nan)));
  CHECK(std::isnan(bound_max(nan, 1.0)));
  CHECK(std::isnan(bound_max(nan, nan)));
  CHECK(std::isnan(bound_max(inf, nan)));
  CHECK(bound_max(1.0, 2.0) == 2.0);
  CHECK(bound_max(2.0, 1.0) == 2.0);
  CHECK(bound_max(0.0, inf) == inf);
  CHECK_FALSE(troll::detail::fits_in<float>(bound_max(0.5, nan)));
  CHECK(std::isnan(troll::detail::maximum(nan, 1.0)));  // `maximum` keeps a NaN only first
  CHECK(troll::detail::maximum(1.0, nan) == 1.0);
}
