// test_tiny_eps.cpp — the projection at a tiny ε (1e-14 … 1e-300), dense and sparse, float and
// double, against a long-double oracle independent of troll's solver. Near t = 0 the family's KL
// is the cumulant series of d = z̃ − z° under q, K(t) = κ₂t²/2 + κ₃t³/3 + κ₄t⁴/8 + O(κ₅t⁵), with
// the cumulants from central moments (two passes, no cancellation); t* solves K(t) = ε by Newton.
// At ε ≤ 1e-14 on these rows t·max|d| < 1e-5, so the series' remainder is below 1e-20 relative.
// Before refine_a_c (trust_region_solver.hpp) the solver's cancellation-free KL carried the
// rounding of its log-normaliser squared (~1e-31 absolute): at ε = 1e-24 t* was 3e-8 off, at
// 1e-30 2%, at 1e-100 … 1e-300 25–47%, every row still reported `projected`.
#include <doctest/doctest.h>

#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

namespace tiny_eps_test {

using real = long double;

/// κ₂, κ₃, κ₄ of d = z̃ − z° under q = softmax(z°), over the tokens both rows keep.
struct series {
  real k2 = 0, k3 = 0, k4 = 0;
  real kl(real t) const { return t * t * (k2 / 2 + t * (k3 / 3 + t * k4 / 8)); }
  real slope(real t) const { return t * (k2 + t * (k3 + t * k4 / 2)); }
};

template <class T>
series cumulants(const std::vector<T>& zn, const std::vector<T>& zo) {
  const real minus_inf = -std::numeric_limits<real>::infinity();
  real top = minus_inf;
  for (std::size_t i = 0; i < zo.size(); ++i)
    if (real(zn[i]) > minus_inf) top = std::max(top, real(zo[i]));
  real sum = 0, mean = 0;
  std::vector<real> q(zo.size(), 0), d(zo.size(), 0);
  for (std::size_t i = 0; i < zo.size(); ++i) {
    if (!(real(zn[i]) > minus_inf && real(zo[i]) > minus_inf)) continue;
    q[i] = std::exp(real(zo[i]) - top);
    d[i] = real(zn[i]) - real(zo[i]);
    sum += q[i];
  }
  for (std::size_t i = 0; i < zo.size(); ++i) mean += q[i] / sum * d[i];
  real m2 = 0, m3 = 0, m4 = 0;
  for (std::size_t i = 0; i < zo.size(); ++i) {
    const real w = q[i] / sum, c = d[i] - mean;
    m2 += w * c * c, m3 += w * c * c * c, m4 += w * c * c * c * c;
  }
  return {m2, m3, m4 - 3 * m2 * m2};
}

real solve(const series& s, real eps) {
  real t = std::sqrt(2 * eps / s.k2);
  for (int i = 0; i < 40; ++i) t -= (s.kl(t) - eps) / s.slope(t);
  return t;
}

const double eps_values[] = {1e-14, 1e-18, 1e-22, 1e-26, 1e-30, 1e-50, 1e-100, 1e-200, 1e-300};

/// Row pair `rep`: old logits of scale 2, new ones 0.5 away, V from 8 to 65; with `masks`, the
/// old row masks two tokens (−inf; the new row keeps them: KL(p̃‖q) = +inf, still projected).
template <class T>
void make_rows(int rep, bool masks, std::mt19937_64& rng, std::vector<T>& zn, std::vector<T>& zo) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::size_t n = 8 + std::size_t(rep) * 3;
  zn.resize(n), zo.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    zo[i] = T(2.0 * normal(rng));
    zn[i] = T(double(zo[i]) + 0.5 * normal(rng));
  }
  if (masks) zo[1] = zo[n - 2] = -std::numeric_limits<T>::infinity();
}

/// t* and KL(π_t*‖q) of a projected row against the oracle: KL within 1e-10·ε of ε at the
/// returned t (the documented guarantee), t* within 1e-10 relative (K ∝ t² here).
void check_row(const series& s, double eps, const troll::projection_stats& st) {
  CAPTURE(eps);
  REQUIRE(st.status == troll::row_status::projected);
  const real t = solve(s, real(eps));
  CHECK(double(std::fabs(s.kl(real(st.t)) / real(eps) - 1)) <= 1e-10);
  CHECK(double(std::fabs((real(st.t) - t) / t)) <= 1e-10);
  CHECK(double(std::fabs(real(st.kl_after) / real(eps) - 1)) <= 1e-10);
}

TEST_CASE_TEMPLATE("dense project at a tiny eps: t* and the KL against a cumulant-series oracle", T, double, float) {
  std::mt19937_64 rng(11);
  for (bool masks : {false, true}) {
    for (int rep = 0; rep < 12; ++rep) {
      std::vector<T> zn, zo;
      make_rows(rep, masks, rng, zn, zo);
      const std::size_t n = zn.size();
      const series s = cumulants(zn, zo);
      for (double eps : eps_values) {
        CAPTURE(masks);
        CAPTURE(rep);
        std::vector<T> out(n);
        troll::projection_stats st;
        troll::project(troll::cpu, troll::make_batch<const T>(zn.data(), 1, n), troll::make_batch<const T>(zo.data(), 1, n),
                       eps, troll::make_batch(out.data(), 1, n), &st);
        check_row(s, eps, st);
      }
    }
  }
}

TEST_CASE_TEMPLATE("sparse project at a tiny eps: the lumped rows' t* and KL against the same oracle", T, double, float) {
  std::mt19937_64 rng(12);
  for (int rep = 0; rep < 12; ++rep) {
    std::vector<T> zn, zo;
    make_rows(rep, false, rng, zn, zo);
    const std::size_t n = zn.size(), k = n / 2;
    // Sparse rows: the first k tokens as entries, the rest in the remainder bucket (log-probs in T).
    auto sparse_row = [&](const std::vector<T>& z, std::vector<T>& lp, T& remainder) {
      real top = -std::numeric_limits<real>::infinity(), sum = 0, tail = 0;
      for (T v : z) top = std::max(top, real(v));
      for (T v : z) sum += std::exp(real(v) - top);
      lp.resize(k);
      for (std::size_t i = 0; i < k; ++i) lp[i] = T(real(z[i]) - top - std::log(sum));
      for (std::size_t i = k; i < n; ++i) tail += std::exp(real(z[i]) - top);
      remainder = T(std::log(tail / sum));
    };
    std::vector<T> new_lp, old_lp;
    T new_r, old_r;
    sparse_row(zn, new_lp, new_r);
    sparse_row(zo, old_lp, old_r);
    // The lumped pair the oracle sees: the k entries and the bucket, as written in T.
    std::vector<T> lumped_new(new_lp), lumped_old(old_lp);
    lumped_new.push_back(new_r), lumped_old.push_back(old_r);
    const series s = cumulants(lumped_new, lumped_old);
    std::vector<troll::sparse_index> ids(k), count{troll::sparse_index(k)};
    for (std::size_t i = 0; i < k; ++i) ids[i] = troll::sparse_index(i);
    const troll::aligned_batch_view<const T> aligned{ids.data(), count.data(), new_lp.data(), old_lp.data(),
                                                     &new_r,     &old_r,       1,             k,
                                                     n};
    for (double eps : eps_values) {
      CAPTURE(rep);
      std::vector<troll::sparse_index> out_ids(k), out_count(1);
      std::vector<T> out_lp(k), out_r(1);
      troll::projection_stats st;
      troll::project(troll::cpu, aligned, eps,
                     troll::sparse_batch_view<T>{out_ids.data(), out_lp.data(), out_count.data(), out_r.data(), 1, k, n},
                     &st);
      check_row(s, eps, st);
    }
  }
}

}  // namespace tiny_eps_test

namespace tiny_eps_test {

/// φ(σ) = σe^σ − e^σ + 1 = Σ_{n≥2} (n−1)σⁿ/n!: the series below |σ| = 1e-2 (remainder below
/// 4e-16 relative), else σ·expm1(σ) + σ − expm1(σ).
inline real phi(real x) {
  if (std::fabs(x) < 1e-2L) return x * x * (1 / 2.0L + x * (1 / 3.0L + x * (1 / 8.0L + x * (1 / 30.0L + x * (1 / 144.0L + x / 840.0L)))));
  return x * std::expm1(x) + x - std::expm1(x);
}

/// KL(π_t ‖ q) of a row given by its distinct (z̃, z°) pairs and how many tokens hold each, in
/// long double, as Σ_i n_i q_i φ(log π_i/q_i) (non-negative terms, no cancellation).
struct grouped_row {
  std::vector<real> zn, zo, count;
  real kl(real t) const {
    const std::size_t n = zn.size();
    std::vector<real> w(n);
    real top_w = -std::numeric_limits<real>::infinity(), top_o = top_w;
    for (std::size_t i = 0; i < n; ++i) {
      w[i] = (1 - t) * zo[i] + t * zn[i];
      top_w = std::max(top_w, w[i]), top_o = std::max(top_o, zo[i]);
    }
    real zw = 0, zq = 0;
    for (std::size_t i = 0; i < n; ++i) zw += count[i] * std::exp(w[i] - top_w), zq += count[i] * std::exp(zo[i] - top_o);
    real sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const real log_q = zo[i] - top_o - std::log(zq);
      const real sigma = (w[i] - top_w - std::log(zw)) - log_q;
      sum += count[i] * std::exp(log_q) * phi(sigma);
    }
    return sum;
  }
  real solve(real eps) const {  // KL is increasing in t: bisection
    real lo = 0, hi = 1;
    for (int i = 0; i < 200; ++i) {
      const real mid = (lo + hi) / 2;
      (kl(mid) < eps ? lo : hi) = mid;
    }
    return (lo + hi) / 2;
  }
};

}  // namespace tiny_eps_test

TEST_CASE_TEMPLATE("dense project of long rows whose tail is one logit repeated: KL within 1e-10 eps", T, double, float) {
  // The expanded form of a sparse row: a few distinct tokens and ~V identical tail tokens. Every
  // addition of the tail rounds the same way, so the closed-form KL was off by ~1e-4·ε at ε = 1e-9
  // (the reductions' summation error was not in its bound): the solver then stopped `not_converged`
  // on a member outside the ball. The oracle sees the row as its distinct pairs with their counts.
  using namespace tiny_eps_test;
  std::mt19937_64 rng(21);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t vocab : {std::size_t(151936), std::size_t(262144)}) {
    for (int rep = 0; rep < 3; ++rep) {
      const std::size_t head = 10;
      std::vector<T> zn(vocab), zo(vocab);
      for (std::size_t i = 0; i < head; ++i) {
        zo[i] = T(-3.0 + 1.5 * normal(rng));
        zn[i] = T(double(zo[i]) + 0.5 * normal(rng));
      }
      const T tail_new = T(-14.78 - 0.3 * rep), tail_old = T(-14.81 - 0.2 * rep);
      for (std::size_t i = head; i < vocab; ++i) zn[i] = tail_new, zo[i] = tail_old;
      grouped_row g;
      for (std::size_t i = 0; i < head; ++i) g.zn.push_back(real(zn[i])), g.zo.push_back(real(zo[i])), g.count.push_back(1);
      g.zn.push_back(real(tail_new)), g.zo.push_back(real(tail_old)), g.count.push_back(real(vocab - head));
      for (double eps : {1e-11, 1e-9, 1e-7}) {
        CAPTURE(vocab);
        CAPTURE(rep);
        CAPTURE(eps);
        std::vector<T> out(vocab);
        troll::projection_stats st;
        troll::project(troll::cpu, troll::make_batch<const T>(zn.data(), 1, vocab),
                       troll::make_batch<const T>(zo.data(), 1, vocab), eps, troll::make_batch(out.data(), 1, vocab), &st);
        REQUIRE(st.status == troll::row_status::projected);
        CHECK(double(std::fabs(g.kl(real(st.t)) / real(eps) - 1)) <= 1e-10);
        CHECK(double(std::fabs(real(st.kl_after) / real(eps) - 1)) <= 1e-10);
        const real t = g.solve(real(eps));
        CHECK(double(std::fabs((real(st.t) - t) / t)) <= 1e-9);
      }
    }
  }
}
