// test_kl_precision.cpp — troll::kl on nearly equal rows (z̃ = z° + δ·noise, KL ~ δ²), where the
// closed form cancels and the cancellation-free sum must not take its x_i from differences to a
// reference token (which carry ulps of the logits, magnified by ~1/sqrt(KL): 3e-8 relative at
// KL ~ 1e-17 before kl_centred), and on equal rows (exactly 0, also with masks).
// Reference (long double): KL = Σ p_i ψ(δ_i), ψ(x) = x + e^{−x} − 1 ≥ 0, δ_i = d_i − c,
// c = log1p(Σ q_i expm1(d_i)); first-order insensitive to c's rounding, no cancellation.
// Also troll::kl at KL ~1e-31 (the sum's log-ratio from log-sums was off by ~1e-16 there, which
// moved the KL by ~δ²/2: 54% wrong), and troll::kl_backward on nearly equal rows and on near
// one-hot rows whose minor tokens barely differ (the textbook p(log p − log q − KL) and q − p
// cancelled: normwise errors of 0.65 at KL ~1e-31 and 1.0 on the one-hot rows, float included).
// Gradient reference: ∂KL/∂z_p,j = p_j (δ_j − KL) = p_j (x_j − E_p[x]) with x = d − d_mode,
// ∂KL/∂z_q,j = −q_j expm1(δ_j).
#include <doctest/doctest.h>

#include <troll/kl.hpp>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <cstddef>
#include <random>
#include <type_traits>
#include <vector>

namespace {

long double psi(long double x) {
  if (std::fabs(x) < 0.01L) {  // x²/2 − x³/6 + x⁴/24 − …
    long double term = x * x / 2, sum = 0;
    for (int n = 2; n < 30; ++n) {
      sum += term;
      term *= -x / (n + 1);
    }
    return sum;
  }
  return x + std::expm1(-x);
}

long double reference_kl(const std::vector<double>& p_logits, const std::vector<double>& q_logits) {
  const std::size_t n = p_logits.size();
  long double q_top = -INFINITY, q_sum = 0;
  for (double z : q_logits) q_top = std::max(q_top, static_cast<long double>(z));
  for (double z : q_logits) q_sum += std::exp(z - q_top);
  long double shift = 0;  // Σ q_i expm1(d_i)
  for (std::size_t i = 0; i < n; ++i) {
    const long double q = std::exp(q_logits[i] - q_top) / q_sum;
    shift += q * std::expm1(static_cast<long double>(p_logits[i]) - q_logits[i]);
  }
  const long double c = std::log1p(shift);
  long double kl = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const long double q = std::exp(q_logits[i] - q_top) / q_sum;
    const long double delta = (static_cast<long double>(p_logits[i]) - q_logits[i]) - c;
    kl += q * std::exp(delta) * psi(delta);
  }
  return kl;
}

/// The reference gradients (math.md §1) of one unmasked row pair, in long double.
void reference_gradients(const std::vector<double>& p_logits, const std::vector<double>& q_logits,
                         std::vector<long double>& grad_p, std::vector<long double>& grad_q) {
  const std::size_t n = p_logits.size();
  long double q_top = -INFINITY, q_sum = 0, shift = 0;
  for (double z : q_logits) q_top = std::max(q_top, static_cast<long double>(z));
  for (double z : q_logits) q_sum += std::exp(z - q_top);
  // differences taken against the mode r of p, so that δ_r = log p_r − log q_r (tiny on near
  // one-hot rows) is not the difference of two numbers of the size of d_r
  const std::size_t r = std::size_t(std::max_element(p_logits.begin(), p_logits.end()) - p_logits.begin());
  const long double d_r = static_cast<long double>(p_logits[r]) - q_logits[r];
  std::vector<long double> q(n), x(n), delta(n);
  for (std::size_t i = 0; i < n; ++i) {
    q[i] = std::exp(q_logits[i] - q_top) / q_sum;
    x[i] = (static_cast<long double>(p_logits[i]) - q_logits[i]) - d_r;
    shift += q[i] * std::expm1(x[i]);
  }
  const long double c = std::log1p(shift);
  for (std::size_t i = 0; i < n; ++i) delta[i] = x[i] - c;
  // δ_j − KL = x_j − E_p[x] (KL = E_p[δ], δ = x − c): on near one-hot rows δ_r and KL agree to
  // many digits, so their difference is taken in this form
  long double mean_x = 0;
  for (std::size_t i = 0; i < n; ++i) mean_x += q[i] * std::exp(delta[i]) * x[i];
  grad_p.resize(n);
  grad_q.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const long double p = q[i] * std::exp(delta[i]);
    grad_p[i] = p * (x[i] - mean_x);
    grad_q[i] = -q[i] * std::expm1(delta[i]);
  }
}

/// max_j |got_j − want_j| / max_j |want_j| (both gradients), the rows given in T.
template <class T>
double normwise_gradient_error(const std::vector<T>& zp, const std::vector<T>& zq) {
  const std::size_t n = zp.size();
  std::vector<T> gp(n), gq(n);
  const T one = 1;
  troll::kl_backward(troll::cpu, troll::make_batch(static_cast<const T*>(zp.data()), 1, n),
                     troll::make_batch(static_cast<const T*>(zq.data()), 1, n), &one,
                     troll::make_batch(gp.data(), 1, n), troll::make_batch(gq.data(), 1, n));
  std::vector<long double> wp, wq;
  reference_gradients(std::vector<double>(zp.begin(), zp.end()), std::vector<double>(zq.begin(), zq.end()), wp,
                      wq);
  double worst = 0;
  for (int side = 0; side < 2; ++side) {
    const std::vector<T>& got = side == 0 ? gp : gq;
    const std::vector<long double>& want = side == 0 ? wp : wq;
    long double scale = 0, error = 0;
    for (std::size_t j = 0; j < n; ++j) {
      scale = std::max(scale, std::fabs(want[j]));
      error = std::max(error, std::fabs(static_cast<long double>(got[j]) - want[j]));
    }
    worst = std::max(worst, double(error / scale));
  }
  return worst;
}

/// kl of p = q + δ·N(0, 1) against the long-double reference, to 1e-12 relative, for q = scale·N(0, 1).
void check_nearly_equal_kl(unsigned seed, double scale, std::initializer_list<std::size_t> sizes,
                           std::initializer_list<double> deltas) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  for (std::size_t size : sizes) {
    for (double delta : deltas) {
      std::vector<double> q(size), p(size);
      for (std::size_t i = 0; i < size; ++i) {
        q[i] = scale * normal(rng);
        p[i] = q[i] + delta * normal(rng);
      }
      double got = -1.0;
      troll::kl(troll::cpu, troll::make_batch(static_cast<const double*>(p.data()), 1, size),
                troll::make_batch(static_cast<const double*>(q.data()), 1, size), &got);
      const long double want = reference_kl(p, q);
      CAPTURE(size);
      CAPTURE(delta);
      CAPTURE(double(want));
      CHECK(std::fabs(double(got - want)) <= 1e-12 * double(want));
    }
  }
}

}  // namespace

TEST_CASE("kl of nearly equal double rows is accurate to 1e-12 relative") {
  check_nearly_equal_kl(11, 3.0, {5u, 50u, 1000u}, {1e-2, 1e-4, 1e-6, 1e-8});
}

TEST_CASE("kl of equal rows is exactly 0, masks included") {
  for (std::size_t size : {1u, 3u, 50u, 1000u}) {
    std::vector<double> z(size);
    std::vector<float> f(size);
    for (std::size_t i = 0; i < size; ++i) {
      z[i] = (i % 3 == 1 && size > 1) ? -INFINITY : 1e4 + 5.0 * std::sin(double(i));
      f[i] = float(z[i]);
    }
    double got = -1.0;
    float got_f = -1.0f;
    auto v = troll::make_batch(static_cast<const double*>(z.data()), 1, size);
    auto vf = troll::make_batch(static_cast<const float*>(f.data()), 1, size);
    troll::kl(troll::cpu, v, v, &got);
    troll::kl(troll::cpu, vf, vf, &got_f);
    CAPTURE(size);
    CHECK(got == 0.0);
    CHECK(got_f == 0.0f);
  }
}

TEST_CASE("kl at KL ~1e-31: nearly equal double rows a few ulps apart") {
  check_nearly_equal_kl(5, 2.0, {3u, 64u, 4097u}, {1e-15, 1e-14});
}

TEST_CASE_TEMPLATE("kl_backward on nearly equal rows and near one-hot rows, against long double", T, double,
                   float) {
  // normwise, relative to the largest entry of each gradient; measured: double ≤ 3e-14 over the
  // audit's rows, float ≤ 7e-8
  const double tol = std::is_same<T, double>::value ? 1e-12 : 1e-6;
  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal;
  for (std::size_t size : {3u, 200u, 4097u}) {
    CAPTURE(size);
    // nearly equal rows (double: δ down to a few ulps; float: a few ulps of each logit)
    for (double delta : {1e-4, 1e-8, 1e-15}) {
      std::vector<T> p(size), q(size);
      for (std::size_t i = 0; i < size; ++i) {
        q[i] = T(2.0 * normal(rng));
        p[i] = std::is_same<T, double>::value ? T(double(q[i]) + delta * normal(rng))
                                              : std::nextafter(q[i], T(normal(rng) > 0 ? 10 : -10));
      }
      CAPTURE(delta);
      CHECK(normwise_gradient_error(p, q) <= tol);
    }
    // near one-hot rows: one token `gap` above the rest, the minor tokens moved by ~1e-3 (same
    // top), or both rows one-hot on token 0 with different minor tokens
    for (double gap : {30.0, 200.0}) {
      if (!std::is_same<T, double>::value && gap > 60) continue;  // float: the minor masses underflow
      std::vector<T> p(size), q(size), r(size);
      for (std::size_t i = 0; i < size; ++i) {
        p[i] = T(normal(rng) + (i == 0 ? gap : 0.0));
        q[i] = i == 0 ? p[i] : T(double(p[i]) + 1e-3 * normal(rng));
        r[i] = T(normal(rng) + (i == 0 ? 0.9 * gap : 0.0));
      }
      CAPTURE(gap);
      CHECK(normwise_gradient_error(p, q) <= tol);
      CHECK(normwise_gradient_error(p, r) <= tol);
    }
  }
}

TEST_CASE_TEMPLATE("kl_backward where q all but masks p's top token with a huge finite logit", T, double, float) {
  // The audit's row (thirty-sixth session): z_q at p's top token is M = −1e3 … −1e300 instead of
  // −inf. troll centres the differences on that token (x_j = d_j − d_r), so every x_j and the
  // log-ratio a are ~M, and σ_j = x_j − a lost log p_j − log q_j: grad_q came out 0 at −1e300
  // (100% off), 1.4e-8 off at −1e9, 2.6e-12 at −1e5. The reference is the textbook form in long
  // double, which has nothing to cancel on these rows (p and q are far apart).
  const double tol = std::is_same<T, double>::value ? 1e-14 : 1e-6;  // measured ~1e-16; float: its output rounding
  for (const double m : {-720.0, -1e3, -1e5, -1e9, -1e15, -1e30, -3e38, -1e300}) {
    if (!std::is_same<T, double>::value && m < -3.4e38) continue;  // −inf in float: a real mask
    const std::vector<T> zp = {T(-0.24399113844610634), T(-1.3363066455702657), T(0.7939515825067062)};
    const std::vector<T> zq = {T(1.1861321424029596), T(-1.5144343046061002), T(m)};
    std::vector<T> gp(3), gq(3);
    const T g = T(1.5);
    troll::kl_backward(troll::cpu, troll::make_batch(zp.data(), 1, 3), troll::make_batch(zq.data(), 1, 3), &g,
                       troll::make_batch(gp.data(), 1, 3), troll::make_batch(gq.data(), 1, 3));
    using ld = long double;
    auto log_probs = [](const std::vector<T>& z) {
      ld top = -INFINITY, sum = 0;
      for (T v : z) top = std::max(top, ld(v));
      for (T v : z) sum += std::exp(ld(v) - top);
      std::vector<ld> out;
      for (T v : z) out.push_back((ld(v) - top) - std::log(sum));
      return out;
    };
    const std::vector<ld> lp = log_probs(zp), lq = log_probs(zq);
    ld kl = 0;
    for (int j = 0; j < 3; ++j) kl += std::exp(lp[j]) * (lp[j] - lq[j]);
    double worst_p = 0, worst_q = 0;
    ld scale_p = 0, scale_q = 0;
    for (int j = 0; j < 3; ++j) {
      const ld want_p = ld(1.5) * std::exp(lp[j]) * (lp[j] - lq[j] - kl);
      const ld want_q = ld(1.5) * (std::exp(lq[j]) - std::exp(lp[j]));
      scale_p = std::max(scale_p, std::fabs(want_p)), scale_q = std::max(scale_q, std::fabs(want_q));
      worst_p = std::max(worst_p, double(std::fabs(ld(gp[j]) - want_p)));
      worst_q = std::max(worst_q, double(std::fabs(ld(gq[j]) - want_q)));
    }
    CAPTURE(m);
    CHECK(worst_q / double(scale_q) <= tol);
    CHECK(worst_p / double(scale_p) <= tol);
  }
}

#if defined(__SIZEOF_FLOAT128__)
namespace {

/// KL(p‖q) and its gradients in long double with x_i = (z̃_i − z°_i) − (z̃_r − z°_r) formed in
/// __float128, where the differences of doubles are exact (long double's 64 bits are not enough
/// on rows shifted by an offset: z̃ − z° ≈ 100 rounds at ~1e-17, against x ~ 1e-12).
struct offset_reference {
  long double kl = 0;
  std::vector<long double> grad_p, grad_q;
};
offset_reference reference_offset(const std::vector<double>& zp, const std::vector<double>& zq) {
  const std::size_t n = zp.size(), r = 0;
  long double q_top = -INFINITY, q_sum = 0, shift = 0;
  for (double z : zq) q_top = std::max(q_top, static_cast<long double>(z));
  for (double z : zq) q_sum += std::exp(z - q_top);
  std::vector<long double> q(n), x(n);
  const __float128 d_r = static_cast<__float128>(zp[r]) - static_cast<__float128>(zq[r]);
  for (std::size_t i = 0; i < n; ++i) {
    q[i] = std::exp(zq[i] - q_top) / q_sum;
    x[i] = static_cast<long double>((static_cast<__float128>(zp[i]) - static_cast<__float128>(zq[i])) - d_r);
    shift += q[i] * std::expm1(x[i]);
  }
  const long double c = std::log1p(shift);
  offset_reference out;
  long double mean_x = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const long double delta = x[i] - c, p = q[i] * std::exp(delta);
    out.kl += p * psi(delta);
    mean_x += p * x[i];
  }
  for (std::size_t i = 0; i < n; ++i) {
    const long double p = q[i] * std::exp(x[i] - c);
    out.grad_p.push_back(p * (x[i] - mean_x));
    out.grad_q.push_back(-q[i] * std::expm1(x[i] - c));
  }
  return out;
}

}  // namespace

TEST_CASE("kl and kl_backward of rows that differ by an offset plus a small change (z̃ = z° + c + δ)") {
  // Before, troll::kl was off by up to 1.5e-4 relative here (c = 100, δ = 1e-12): the row
  // differences z̃ − z° ≈ c round at ulp(c) when z° is much smaller than c. Measured after:
  // ≤ 2.5e-15 on these rows.
  std::mt19937_64 rng(23);
  std::normal_distribution<double> normal;
  for (double offset : {1.0, 100.0, 1e4, 1e6, -3e7})
    for (double delta : {1e-6, 1e-9, 1e-12})
      for (std::size_t size : {5u, 1000u, 4099u}) {
        std::vector<double> zq(size), zp(size);
        for (std::size_t i = 0; i < size; ++i) {
          zq[i] = 3.0 * normal(rng);
          zp[i] = zq[i] + offset + delta * normal(rng);
        }
        CAPTURE(offset);
        CAPTURE(delta);
        CAPTURE(size);
        const offset_reference want = reference_offset(zp, zq);
        double got = -1.0;
        auto vp = troll::make_batch(static_cast<const double*>(zp.data()), 1, size);
        auto vq = troll::make_batch(static_cast<const double*>(zq.data()), 1, size);
        troll::kl(troll::cpu, vp, vq, &got);
        CAPTURE(double(want.kl));
        CHECK(std::fabs(double(got - want.kl)) <= 1e-13 * double(want.kl));
        std::vector<double> gp(size), gq(size);
        const double one = 1.0;
        troll::kl_backward(troll::cpu, vp, vq, &one, troll::make_batch(gp.data(), 1, size),
                           troll::make_batch(gq.data(), 1, size));
        long double scale = 0, error = 0;
        for (std::size_t j = 0; j < size; ++j) {
          scale = std::max({scale, std::fabs(want.grad_p[j]), std::fabs(want.grad_q[j])});
          error = std::max({error, std::fabs(gp[j] - want.grad_p[j]), std::fabs(gq[j] - want.grad_q[j])});
        }
        CHECK(double(error / scale) <= 1e-12);
      }
}
#endif
