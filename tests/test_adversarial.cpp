// tests/test_adversarial.cpp — an adversarial audit of the CPU results: vocabularies from 1 to
// 262,144, logits at ±1e4 and at float's ±3e38, −inf masks (all but one token), ties in the
// maximum, near-deterministic rows, p == q, ε from 1e-12 to 50, float and double, strided rows,
// 1 and 2 threads, empty batches. Every expectation comes from the long-double oracle written
// below (bisection on t, KL as a sum of non-negative terms), never from troll's own output. The
// derivatives against central differences are the body tests/bodies/adversarial_derivatives.hpp
// (also compiled for troll::cuda).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "troll/gradcheck.hpp"
#include "troll/projection.hpp"
#include "troll/sparse.hpp"

#include "adversarial_rows.hpp"
#include "backend.hpp"

namespace {

using real = long double;
constexpr double inf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// The oracle: one row pair in long double.
//   log q_i = z°_i − logsumexp(z°) over every finite z°;
//   log π_t,i = w_i − logsumexp(w) on J = {both finite}, w_i = (z°_i − z°_r) + t·x_i, with
//   x_i = (z̃_i − z̃_r) − (z°_i − z°_r) and r the mode of π_t (so the differences that matter are
//   those of nearby logits); near t = 1 the same value as (z̃_i − z̃_r) − s·x_i, s = 1 − t exact.
//   KL(π_t‖q) = Σ_J π (e^δ − 1 − δ) + (1 − q(J)), δ = log q − log π: non-negative terms.
// ---------------------------------------------------------------------------------------------
struct oracle_row {
  std::vector<real> zn, zo;
  std::vector<bool> joint;
  bool new_outside = false;  // p̃ has mass where q has none

  template <class T>
  oracle_row(const T* a, const T* b, std::size_t n) : zn(n), zo(n), joint(n) {
    for (std::size_t i = 0; i < n; ++i) {
      zn[i] = real(a[i]);
      zo[i] = real(b[i]);
      joint[i] = std::isfinite(zn[i]) && std::isfinite(zo[i]);
      if (std::isfinite(zn[i]) && !std::isfinite(zo[i])) new_outside = true;
    }
  }

  /// log π at (t, s) on J (−inf elsewhere) and log q, both as differences from the mode r of
  /// π_t (so that rows shifted by 1e4 or 1e38 lose nothing to the shift).
  struct member {
    std::vector<real> lp, lq;
  };
  std::size_t first_joint() const {
    std::size_t i = 0;
    while (i < joint.size() && !joint[i]) ++i;
    return i;
  }
  member at(real t, real s) const {
    const std::size_t n = zn.size();
    member mb{std::vector<real>(n, -INFINITY), std::vector<real>(n, -INFINITY)};
    std::vector<real>& w = mb.lp;
    std::size_t r = n;
    for (int pass = 0; pass < 4; ++pass) {  // until the reference is the mode it finds
      const std::size_t ref = r == n ? first_joint() : r;
      real best = -INFINITY;
      for (std::size_t i = 0; i < n; ++i) {
        if (!joint[i]) continue;
        const real dn = zn[i] - zn[ref], dold = zo[i] - zo[ref], x = dn - dold;
        w[i] = t <= 0.5L ? dold + t * x : dn - s * x;
        if (w[i] > best) best = w[i], r = i;
      }
      if (r == ref) break;
    }
    const real m = w[r];
    real sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (joint[i]) sum += std::exp(w[i] - m);
    const real norm = m + std::log(sum);
    for (auto& v : w) v -= norm;
    real mq = -INFINITY, sq = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (std::isfinite(zo[i])) mb.lq[i] = zo[i] - zo[r], mq = std::max(mq, mb.lq[i]);
    for (std::size_t i = 0; i < n; ++i)
      if (std::isfinite(zo[i])) sq += std::exp(mb.lq[i] - mq);
    const real qnorm = mq + std::log(sq);
    for (auto& v : mb.lq) v -= qnorm;
    return mb;
  }
  std::vector<real> log_pi(real t, real s) const { return at(t, s).lp; }

  real kl_at(real t, real s) const {
    const member mb = at(t, s);
    real sum = 0, q_outside = 0;  // 1 − q(J) summed directly, never formed as a difference
    for (std::size_t i = 0; i < zn.size(); ++i) {
      if (!joint[i]) {
        q_outside += std::exp(mb.lq[i]);
        continue;
      }
      // π(e^δ − 1 − δ) = q − π(1 + δ): in that form where δ > 1 (no cancellation worth the
      // name, and a π that underflows still leaves q), in the first where δ ≤ 1.
      const real delta = mb.lq[i] - mb.lp[i];
      const real p = std::exp(mb.lp[i]);
      sum += delta > 1 ? std::exp(mb.lq[i]) - p * (1 + delta) : p * (std::expm1(delta) - delta);
    }
    return sum + q_outside;
  }

  /// t* (and s* = 1 − t*) with KL(π_t*‖q) = ε, assuming KL(π_0) < ε < KL(π_1).
  void solve(real eps, real& t, real& s, int iterations = 200) const {
    if (kl_at(0.5L, 0.5L) > eps) {  // t* ∈ (0, 1/2): bisect in t, geometric while far from 0
      real lo = 0, hi = 0.5L;
      for (int k = 0; k < iterations; ++k) {
        const real mid = (lo > 0 && hi > 4 * lo) ? std::sqrt(lo * hi) : (lo == 0 ? hi * std::min(real(1) / 16, hi) : (lo + hi) / 2);
        (kl_at(mid, 1 - mid) > eps ? hi : lo) = mid;
      }
      t = (lo + hi) / 2, s = 1 - t;
    } else {  // s* ∈ (0, 1/2]
      real lo = 0, hi = 0.5L;  // in s: KL decreasing in s
      for (int k = 0; k < iterations; ++k) {
        const real mid = (lo > 0 && hi > 4 * lo) ? std::sqrt(lo * hi) : (lo == 0 ? hi * std::min(real(1) / 16, hi) : (lo + hi) / 2);
        (kl_at(1 - mid, mid) > eps ? lo : hi) = mid;
      }
      s = (lo + hi) / 2, t = 1 - s;
    }
  }
};

template <class T>
constexpr double ulp() {
  return double(std::numeric_limits<T>::epsilon());
}

using troll_test::describe;
using troll_test::row_case;

/// Checks troll::project on one row pair in T against the oracle. Returns the stats.
template <class T>
troll::projection_stats check_projection(const row_case& c, double eps, unsigned threads = 1,
                                          std::size_t stride_pad = 0) {
  const std::size_t n = c.zn.size(), stride = n + stride_pad;
  std::vector<T> zn(stride, T(-123)), zo(stride, T(456)), out(stride, T(7));
  for (std::size_t i = 0; i < n; ++i) zn[i] = T(c.zn[i]), zo[i] = T(c.zo[i]);
  const std::string values = n <= 40 ? describe(c) : std::string("(large)");
  INFO(c.name, " V=", n, " eps=", eps, " rows ", values, " type=", sizeof(T) == 4 ? "float" : "double", " threads=", threads);
  troll::projection_stats st;
  const oracle_row o(zn.data(), zo.data(), n);
  bool infeasible = false;
  try {
    troll::project(troll::cpu.with_threads(threads), troll::make_batch<const T>(zn.data(), 1, n, stride),
                   troll::make_batch<const T>(zo.data(), 1, n, stride), eps, troll::make_batch(out.data(), 1, n, stride),
                   &st);
  } catch (const troll::infeasible_error&) {
    infeasible = true;
  }
  for (std::size_t i = n; i < stride; ++i) REQUIRE(out[i] == T(7));  // the padding untouched
  if (infeasible) {
    // Only when even t → 0 (π on J ∝ q) is outside the ball: −log q(J) ≥ ε.
    if (o.first_joint() < n) CHECK(o.kl_at(0, 1) >= real(eps) * (1 - 1e-9L));  // else disjoint supports
    return st;
  }
  INFO("status ", troll::status_name(st.status), " t ", st.t, " eta ", st.eta, " kl_before ", st.kl_before,
       " kl_after ", st.kl_after, " iterations ", st.iterations);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(!std::isnan(out[i]));
  const real kl1 = o.new_outside ? real(INFINITY) : o.kl_at(1, 0);
  const real eps_r = eps;
  const double guard = std::is_same<T, float>::value ? 1e-6 : 1e-12;
  if (st.status == troll::row_status::inactive) {
    CHECK(double(kl1) <= eps * (1 + guard) + guard * 1e-3);
    std::vector<T> ls(n);
    troll::log_softmax(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n, stride),
                       troll::make_batch(ls.data(), 1, n));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == ls[i]);
    return st;
  }
  CHECK(double(kl1) >= eps * (1 - guard));
  if (st.status == troll::row_status::not_converged) {
    // Only where t* cannot be resolved in a double: a logit difference between the rows beyond
    // ~1e16 (a double lowest() mask in one row; in float, tokens at ±3e38 that change places at
    // t ≈ 1/2, where t has 53 bits and the curve rises from 0 to 1e38 within 1e-38 of t: see
    // the last test case). The row then holds a feasible member and says so.
    double widest = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (o.joint[i]) widest = std::max(widest, double(std::fabs(o.zn[i] - o.zo[i])));
    // Either t* is beyond a double (a difference beyond ~1e16), or the KL moves by more than the
    // tolerance per ulp of t (d log KL/dt grows like the difference) and t is within a few ulps
    // of t*: 64 ulps up, the long-double KL is above ε.
    double above = st.t;
    for (int k = 0; k < 64; ++k) above = std::nextafter(above, 1.0);
    CHECK(widest >= 1e5);
    CHECK((widest >= 1e16 || o.kl_at(real(above), real(1) - real(above)) > eps_r));
    CHECK(st.kl_after < eps);
    return st;
  }
  real t, s;
  if (st.status == troll::row_status::restricted) {
    t = 1, s = 0;
    CHECK(o.kl_at(1, 0) <= eps_r * (1 + 1e-10L));
  } else {
    REQUIRE(st.status == troll::row_status::projected);
    // KL at troll's own (t, s = η·t) within the documented 1e-10·ε.
    const real ts = st.t, ss = real(st.eta) * real(st.t);
    const real kl_troll = o.kl_at(ts, ts <= 0.5L ? 1 - ts : ss);
    CHECK(std::fabs(double(kl_troll - eps_r)) <= 1e-10 * eps + 1e-300);
    CHECK(std::fabs(st.kl_after - eps) <= 1e-10 * eps);
    if (n <= 100000) {  // the huge row: KL at troll's t above is the check (CI time)
      o.solve(eps_r, t, s, n > 1000 ? 100 : 200);
      // t* to 1e-10 relative, or as far as a KL that is flat in t resolves it: |Δt| ≤
      // (tolerance on KL) / (dKL/dt = t σ²).
      const real flat = 2e-10L * eps_r / std::max(real(1e-300), t * real(st.sigma2));
      CHECK(std::fabs(double(real(st.t) - t)) <= double(std::max(real(1e-9) * t, flat)));
      if (t > 0.5L) CHECK(std::fabs(double(ss - s)) <= double(std::max(real(1e-9) * s, flat)));
    }
    // The written output against log π at troll's own point: a few ulps of T times the logit
    // scale of the nearby tokens.
    const std::vector<real> at_troll = o.log_pi(ts, ts <= 0.5L ? 1 - ts : ss);
    // The row's logit scale: the largest logit magnitude among the tokens that carry mass.
    real scale = 1;
    for (std::size_t i = 0; i < n; ++i)
      if (o.joint[i] && at_troll[i] > -700)
        scale = std::max({scale, std::fabs(at_troll[i]), std::fabs(o.zn[i]), std::fabs(o.zo[i])});
    for (std::size_t i = 0; i < n; ++i) {
      INFO("token ", i, " out ", double(out[i]), " oracle ", double(at_troll[i]));
      if (!o.joint[i]) {
        REQUIRE(out[i] == -std::numeric_limits<T>::infinity());
        continue;
      }
      const double err = std::fabs(double(real(out[i]) - at_troll[i]));
      const double ref = std::fabs(double(at_troll[i]));
      const double allowed = 4 * ulp<T>() * ref + 16 * ulp<T>() * double(scale);
      if (!(err <= allowed)) {
        CHECK(err <= allowed);
        break;
      }
    }
  }
  return st;
}

// ---------------------------------------------------------------------------------------------
// Row generators.
// ---------------------------------------------------------------------------------------------
using troll_test::gaussian_row;

std::vector<row_case> adversarial_cases(std::mt19937_64& g, std::size_t n) {
  std::vector<row_case> cases;
  auto add = [&](std::string name, std::vector<double> a, std::vector<double> b) {
    cases.push_back(row_case{name + " V=" + std::to_string(n), std::move(a), std::move(b)});
  };
  add("gaussian", gaussian_row(g, n, 2), gaussian_row(g, n, 2));
  add("shifted 1e4", gaussian_row(g, n, 3, 1e4), gaussian_row(g, n, 3, -1e4));
  add("p == q", gaussian_row(g, n, 2), {});
  cases.back().zo = cases.back().zn;
  {  // ties in the maximum, both rows; the modes differ
    std::vector<double> a(n, -3.0), b(n, -3.0);
    a[0] = 5, b[n - 1] = 5;
    if (n > 2) a[n / 2] = 5, b[n / 2 - 1] = 5;
    add("ties, modes differ", a, b);
  }
  {  // near-deterministic: the new row sure of one token, the old of another
    std::vector<double> a = gaussian_row(g, n, 1), b = gaussian_row(g, n, 1);
    a[0] += 60, b[n - 1] += 60;
    add("near-deterministic, modes differ", a, b);
  }
  {  // the old row near-deterministic on the new row's mode
    std::vector<double> a = gaussian_row(g, n, 1), b = a;
    a[n / 2] += 8, b[n / 2] += 40;
    add("sharp old", a, b);
  }
  {  // all but one masked in the new row
    std::vector<double> a(n, -inf), b = gaussian_row(g, n, 1);
    a[n / 3] = 0.5;
    add("new all but one masked", a, b);
  }
  {  // all but one masked in the old row (p̃ outside supp q: restricted or projected)
    std::vector<double> a = gaussian_row(g, n, 1), b(n, -inf);
    b[n / 3] = 0.5;
    add("old all but one masked", a, b);
  }
  {  // masks in both rows, overlapping
    std::vector<double> a = gaussian_row(g, n, 2), b = gaussian_row(g, n, 2);
    for (std::size_t i = 0; i < n; i += 3) a[i] = -inf;
    for (std::size_t i = 1; i < n; i += 4) b[i] = -inf;
    if (n < 3) a[0] = 0, b[0] = 0;
    add("scattered masks", a, b);
  }
  {  // a wide row: spread beyond 700 (the exact-exp path)
    std::vector<double> a = gaussian_row(g, n, 300), b = gaussian_row(g, n, 300);
    add("spread 1e3", a, b);
  }
  {  // spread just under 700 with the tail at the edge of the fast path
    std::vector<double> a = gaussian_row(g, n, 1), b = gaussian_row(g, n, 1);
    a[n - 1] = -695, b[0] = -695;
    add("spread 699", a, b);
  }
  return cases;
}

const double eps_list[] = {1e-12, 1e-8, 1e-4, 0.05, 1.0, 50.0};

}  // namespace

TEST_CASE("dense projection against the long-double oracle, small and mid vocabularies") {
  std::mt19937_64 g(20240611);
  for (std::size_t n : {1, 2, 3, 17, 4097}) {
    for (const auto& c : adversarial_cases(g, n)) {
      for (double eps : eps_list) {
        if (n > 1000 && eps != 1e-12 && eps != 0.05 && eps != 50.0) continue;  // CI time
        check_projection<double>(c, eps);
        check_projection<float>(c, eps);
      }
    }
  }
}

namespace {

/// A random adversarial row pair of size n: scales from 1e-3 to 1e3, shifts up to 1e4, ties,
/// sharp modes, masks (−inf, or huge finite ones), the two rows sometimes equal or nearly so.
row_case random_case(std::mt19937_64& g, std::size_t n, bool float_range) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto pick = [&](double p) { return u(g) < p; };
  const double scale = std::pow(10.0, -3 + 6 * u(g));
  std::vector<double> a = gaussian_row(g, n, scale), b = gaussian_row(g, n, scale * std::pow(10.0, u(g) - 0.5));
  if (pick(0.2)) b = a;
  if (pick(0.2))
    for (auto& v : b) v += 1e-6 * scale * (u(g) - 0.5);
  if (pick(0.3)) {  // ties: a few values repeated
    for (std::size_t i = 0; i < n; ++i)
      if (pick(0.5)) a[i] = a[0];
    for (std::size_t i = 0; i < n; ++i)
      if (pick(0.5)) b[i] = b[n - 1];
  }
  if (pick(0.3)) a[std::size_t(u(g) * double(n)) % n] += 30 * scale;  // a sharp mode
  if (pick(0.3)) b[std::size_t(u(g) * double(n)) % n] += 30 * scale;
  if (pick(0.3)) {  // shifts
    const double sa = (u(g) - 0.5) * 2e4, sb = (u(g) - 0.5) * 2e4;
    for (auto& v : a) v += sa;
    for (auto& v : b) v += sb;
  }
  const double big = float_range ? 3e38 : 1e300;
  const double masks[] = {-inf, -1e9, -big};
  for (auto* row : {&a, &b}) {
    if (!pick(0.4)) continue;
    const double mask = masks[std::size_t(u(g) * 3) % 3];
    const double rate = u(g);
    for (auto& v : *row)
      if (pick(rate)) v = mask;
  }
  // At least one token finite in both rows keeps most rows solvable; leave some infeasible.
  if (pick(0.9)) {
    const std::size_t k = std::size_t(u(g) * double(n)) % n;
    if (!std::isfinite(a[k]) || a[k] < -1e8) a[k] = 0;
    if (!std::isfinite(b[k]) || b[k] < -1e8) b[k] = 0;
  }
  bool any_a = false, any_b = false;
  for (std::size_t i = 0; i < n; ++i) any_a |= std::isfinite(a[i]), any_b |= std::isfinite(b[i]);
  if (!any_a) a[0] = 0;
  if (!any_b) b[0] = 0;
  return row_case{"random", a, b};
}

int fuzz_rounds() {
  const char* env = std::getenv("TROLL_ADVERSARIAL_ROUNDS");
  return env ? std::atoi(env) : 300;
}

}  // namespace

TEST_CASE("dense projection: random adversarial rows, float and double") {
  std::mt19937_64 g(77);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int rounds = fuzz_rounds();
  for (int k = 0; k < rounds; ++k) {
    const std::size_t sizes[] = {1, 2, 3, 5, 17, 40};
    const std::size_t n = sizes[std::size_t(u(g) * 6) % 6];
    const double eps = std::pow(10.0, -12 + 13.7 * u(g));
    const bool as_float = u(g) < 0.5;
    const row_case c = random_case(g, n, as_float);
    INFO("round ", k);
    if (as_float)
      check_projection<float>(c, eps);
    else
      check_projection<double>(c, eps);
  }
}

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The finite-difference checks of project's derivatives, one body for every backend (also
// compiled for troll::cuda by tests/cuda/test_cuda_backward_gradient.cu).
#include "../bodies/adversarial_derivatives.hpp"

namespace {

/// sparsify of one row of T against a long-double oracle: the support (prefix by logit, ties to
/// the lower index, until the mass reaches 1 − δ, at most k; then the sampled token), its
/// log-probabilities and the log tail mass.
template <class T>
void check_sparsify(const std::vector<double>& z64, int k, double delta, int sampled) {
  const std::size_t n = z64.size();
  std::vector<T> z(z64.begin(), z64.end());
  INFO("sparsify V=", n, " k=", k, " delta=", delta, " sampled=", sampled, " type=", sizeof(T));
  const std::size_t cap = std::size_t(k) + 1;
  std::vector<troll::sparse_index> idx(cap), cnt(1);
  std::vector<T> lp(cap), lr(1);
  troll::sparse_batch_view<T> out{idx.data(), lp.data(), cnt.data(), lr.data(), 1, cap, n};
  troll::sparsify_options opt;
  opt.k = k;
  opt.delta = delta;
  const troll::token_id tok = sampled;
  troll::sparsify(troll::cpu, troll::make_batch<const T>(z.data(), 1, n), sampled >= 0 ? &tok : nullptr, opt, out);
  // The oracle.
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return z[a] > z[b]; });
  real m = -INFINITY;
  for (auto v : z) m = std::max(m, real(v));
  real sum = 0;
  for (auto v : z) sum += std::exp(real(v) - m);
  const real lse = m + std::log(sum);
  std::vector<std::size_t> support;
  real mass = 0;
  bool borderline = false;
  for (std::size_t j = 0; j < n && int(support.size()) < k; ++j) {
    if (mass >= 1 - real(delta)) break;
    if (!std::isfinite(double(z[order[j]]))) break;
    support.push_back(order[j]);
    mass += std::exp(real(z[order[j]]) - lse);
    if (std::fabs(double(mass - (1 - real(delta)))) < 1e-6) borderline = true;
  }
  if (sampled >= 0 && std::find(support.begin(), support.end(), std::size_t(sampled)) == support.end())
    support.push_back(std::size_t(sampled));
  if (borderline) return;  // the prefix length depends on the last rounding of the mass
  REQUIRE(std::size_t(cnt[0]) == support.size());
  real tail = 0;
  std::vector<bool> in(n, false);
  for (auto i : support) in[i] = true;
  real tm = -INFINITY;
  for (std::size_t i = 0; i < n; ++i)
    if (!in[i]) tm = std::max(tm, real(z[i]));
  for (std::size_t i = 0; i < n; ++i)
    if (!in[i] && std::isfinite(double(z[i]))) tail += std::exp(real(z[i]) - tm);
  const real log_tail = tail > 0 ? tm + std::log(tail) - lse : real(-INFINITY);
  const double tol_abs = 8 * ulp<T>() * (1 + std::fabs(double(m))) + 1e-300;
  for (std::size_t j = 0; j < support.size(); ++j) {
    INFO("entry ", j);
    CHECK(std::size_t(idx[j]) == support[j]);
    const real expect = real(z[support[j]]) - lse;
    if (!(expect >= -real(std::numeric_limits<T>::max()))) {  // beyond T's range: −inf is its rounding
      CHECK(lp[j] == -std::numeric_limits<T>::infinity());
    } else {
      CHECK(std::fabs(double(real(lp[j]) - expect)) <= tol_abs + 4 * ulp<T>() * std::fabs(double(expect)));
    }
  }
  if (!(log_tail >= -real(std::numeric_limits<T>::max()))) {
    CHECK(lr[0] == -std::numeric_limits<T>::infinity());
  } else {
    CHECK(std::fabs(double(real(lr[0]) - log_tail)) <= tol_abs + 4 * ulp<T>() * std::fabs(double(log_tail)));
  }
  for (std::size_t j = support.size(); j < cap; ++j) CHECK(idx[j] == -1);
}

}  // namespace

TEST_CASE("sparsify against the long-double oracle on adversarial rows") {
  std::mt19937_64 g(11);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int round = 0; round < 400; ++round) {
    const std::size_t sizes[] = {1, 2, 3, 17, 300};
    const std::size_t n = sizes[round % 5];
    const bool as_float = round % 2 == 0;
    std::vector<double> z = gaussian_row(g, n, std::pow(10.0, -2 + 4 * u(g)), u(g) < 0.3 ? 1e4 : 0.0);
    if (u(g) < 0.3)
      for (auto& v : z) v = std::round(v);  // ties
    if (u(g) < 0.3) z[std::size_t(u(g) * double(n)) % n] += 50;  // near-deterministic
    if (u(g) < 0.3)
      for (auto& v : z)
        if (u(g) < 0.6) v = -inf;
    if (as_float && u(g) < 0.2) {  // float extremes
      z[0] = 3e38;
      if (n > 1) z[n - 1] = -3e38;
    }
    bool any = false;
    for (auto v : z) any |= std::isfinite(v);
    if (!any) z[0] = 0;
    const int ks[] = {1, 3, 64, 256};
    const double deltas[] = {0.0, 1e-5, 0.5};
    const int k = ks[std::size_t(u(g) * 4) % 4];
    const double delta = deltas[std::size_t(u(g) * 3) % 3];
    const int sampled = u(g) < 0.5 ? -1 : int(std::size_t(u(g) * double(n)) % n);
    INFO("round ", round);
    if (as_float)
      check_sparsify<float>(z, k, delta, sampled);
    else
      check_sparsify<double>(z, k, delta, sampled);
  }
}

TEST_CASE("threads, strides, empty batches and a 262,144-token row") {
  std::mt19937_64 g(3);
  // Strided rows and 2 threads: same answers as packed rows on 1 thread (check_projection
  // verifies the padding is untouched).
  const row_case c{"strided", gaussian_row(g, 17, 2), gaussian_row(g, 17, 2)};
  const auto a = check_projection<double>(c, 0.05, 1, 0);
  const auto b = check_projection<double>(c, 0.05, 2, 5);
  CHECK(a.t == b.t);
  check_projection<float>(c, 0.05, 2, 3);
  {  // many rows on 1 and 2 threads: bit-identical
    const std::size_t rows = 37, n = 129;
    std::vector<double> zn, zo;
    for (std::size_t r = 0; r < rows; ++r) {
      auto x = gaussian_row(g, n, double(r % 5) + 0.1), y = gaussian_row(g, n, 1.5);
      zn.insert(zn.end(), x.begin(), x.end());
      zo.insert(zo.end(), y.begin(), y.end());
    }
    std::vector<double> o1(rows * n), o2(rows * n);
    std::vector<troll::projection_stats> s1(rows), s2(rows);
    troll::project(troll::cpu.with_threads(1), troll::make_batch<const double>(zn.data(), rows, n),
                   troll::make_batch<const double>(zo.data(), rows, n), 0.05, troll::make_batch(o1.data(), rows, n), s1.data());
    troll::project(troll::cpu.with_threads(2), troll::make_batch<const double>(zn.data(), rows, n),
                   troll::make_batch<const double>(zo.data(), rows, n), 0.05, troll::make_batch(o2.data(), rows, n), s2.data());
    CHECK(o1 == o2);
  }
  {  // zero rows: every entry point accepts an empty batch and writes nothing
    std::vector<double> none(4, 1.0);
    const auto e = troll::make_batch<const double>(none.data(), 0, 4);
    auto w = troll::make_batch(none.data(), 0, 4);
    troll::project(troll::cpu, e, e, 0.05, w, nullptr);
    troll::log_softmax(troll::cpu, e, w);
    troll::kl(troll::cpu, e, e, none.data());
    troll::project_backward(troll::cpu, e, e, e, nullptr, e, w);
    troll::project_jvp(troll::cpu, e, e, e, nullptr, e, e, 0.0, w);
    CHECK(none == std::vector<double>(4, 1.0));
  }
  {  // V = 262,144, one row: the long-double oracle once (eps 0.05), float and double
    const std::size_t n = 262144;
    row_case big{"V=262144", gaussian_row(g, n, 3), gaussian_row(g, n, 3)};
    big.zn[12345] += 20;
    for (std::size_t i = 0; i < n; i += 7) big.zo[i] = -inf;
    check_projection<double>(big, 0.05, 2);
    check_projection<float>(big, 0.05, 2);
  }
}

TEST_CASE("float logits at ±3e38 and −inf masks: no NaN, the exact projection of the given logits") {
  std::vector<row_case> cases;
  cases.push_back(row_case{"3e38 both", {3e38, -3e38, 0, 1}, {-3e38, 3e38, 1, 0}});
  cases.push_back(row_case{"3e38 new", {3e38, 0, 0, -3e38}, {0, 0, 1, 2}});
  cases.push_back(row_case{"lowest old", {0, 1, 2, 3}, {-3.4028234663852886e38, 0, 0, 0}});
  cases.push_back(row_case{"all but one masked, shared", {-inf, -inf, 2, -inf}, {-inf, -inf, 5, -inf}});
  cases.push_back(row_case{"tie at max, masks", {7, 7, -inf, 7}, {7, -inf, 7, 7}});
  for (const auto& c : cases)
    for (double eps : {1e-12, 0.05, 50.0}) {
      check_projection<float>(c, eps);
      check_projection<double>(c, eps);
    }
}

TEST_CASE("float rows whose ±3e38 tokens change places at t = 1/2: not_converged, typed, feasible") {
  // Known limit (reported, not fixed here): KL(π_t‖q) jumps from 0 to ~1e38 within ~1e-38 of
  // t = 1/2, which no double t resolves; the solve ends not_converged with a member inside the
  // ball rather than a wrong "projected" row, and the backward refuses it.
  const std::vector<float> zn = {3e38f, -3e38f, 0.0f, 1.0f}, zo = {-3e38f, 3e38f, 1.0f, 0.0f};
  std::vector<float> out(4);
  troll::projection_stats st;
  troll::project(troll::cpu, troll::make_batch<const float>(zn.data(), 1, 4), troll::make_batch<const float>(zo.data(), 1, 4),
                 0.05, troll::make_batch(out.data(), 1, 4), &st);
  CHECK(st.status == troll::row_status::not_converged);
  CHECK(st.kl_after < 0.05);
  for (float v : out) CHECK(!std::isnan(v));
  std::vector<float> g(4, 1.0f), gn(4);
  CHECK_THROWS_AS(troll::project_backward(troll::cpu, troll::make_batch<const float>(zn.data(), 1, 4),
                                          troll::make_batch<const float>(zo.data(), 1, 4),
                                          troll::make_batch<const float>(out.data(), 1, 4), &st,
                                          troll::make_batch<const float>(g.data(), 1, 4), troll::make_batch(gn.data(), 1, 4)),
                  troll::domain_error);
}

TEST_CASE("-1e9 masks whose tokens change places near t = 1/2: t* to one ulp, not_converged, feasible") {
  // Found by the random rounds (round 10801 of 15000): double, V = 3, ε = 3.73113e-11. The KL
  // rises by a factor e over ~5e-10 of t around t* ≈ 1/2 − 2.2e-8 (x = z̃ − z° spans 2e9), so
  // it moves by ~1e-7 relative per ulp of t: no double t meets rtol = 1e-11. The solve closes
  // the bracket on adjacent doubles and reports the feasible end (docs/api.md, "Accuracy").
  const std::vector<double> zn = {-1e9, -1e9, 0.039886742385599652}, zo = {0.019529310757074963, -1e9, -1e9};
  const double eps = 3.73113e-11;
  std::vector<double> out(3);
  troll::projection_stats st;
  troll::project(troll::cpu, troll::make_batch<const double>(zn.data(), 1, 3),
                 troll::make_batch<const double>(zo.data(), 1, 3), eps, troll::make_batch(out.data(), 1, 3), &st);
  const oracle_row o(zn.data(), zo.data(), 3);
  CHECK(st.status == troll::row_status::not_converged);
  CHECK(st.kl_after < eps);
  CHECK(st.kl_after > eps * (1 - 1e-6));
  // the long-double oracle at troll's t agrees to the resolution of a double t (troll's w = t·x
  // rounds at ~2e-7 absolute, the KL moves by ~1e-7 relative per ulp), and 64 ulps further up
  // the KL is clearly above ε: t sits at the root to within a few ulps
  const real at_t = o.kl_at(real(st.t), real(1) - real(st.t));
  CHECK(double(at_t) == doctest::Approx(eps).epsilon(1e-6));
  double above = st.t;
  for (int k = 0; k < 64; ++k) above = std::nextafter(above, 1.0);
  CHECK(double(o.kl_at(real(above), real(1) - real(above))) > eps);
  for (double v : out) CHECK(!std::isnan(v));
}
