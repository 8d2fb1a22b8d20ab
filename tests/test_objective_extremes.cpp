#include <doctest/doctest.h>

// The objectives' aggregation and metrics at the ends of double's range, where a sum overflows
// although every term and every mean fits:
//  * loss masks whose sum overflows (masks near 1e308) give the masks' ratios as weights, so the
//    loss and the gradients are those of the same masks scaled down by a power of two;
//  * the metric means (ratio, KL before / after, divergence) of values near 1e308 are their
//    means, not +inf;
//  * DPPO's top-K KL takes p·log(p/q) → 0 for an old probability that underflows to 0
//    (log p = −inf from finite logits), not 0·(−inf) = NaN.
// Expectations: the scaled batch bit for bit (scaling masks by a power of two is exact), and
// long double closed forms.

#include <troll/objectives.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using ld = long double;

/// A small batch: `rows` rows of V logits from a fixed pattern, token r % V, advantages ±.
struct batch_case {
  std::size_t rows = 6, V = 5;
  std::vector<double> zn, zo, adv;
  std::vector<std::int64_t> tok, seq;

  batch_case() {
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < V; ++j) {
        zn.push_back(0.3 * std::sin(double(3 * r + j)) + 0.05 * double(j));
        zo.push_back(0.3 * std::sin(double(3 * r + j) + 0.4));
      }
      tok.push_back(std::int64_t(r % V));
      adv.push_back(r % 2 == 0 ? 1.0 : -0.5);
      seq.push_back(std::int64_t(r / 2));
    }
  }
  troll::token_batch<double> batch(const std::vector<double>& mask, troll::loss_aggregation agg) const {
    troll::token_batch<double> b;
    b.tokens = tok.data();
    b.advantages = adv.data();
    b.loss_mask = mask.data();
    b.sequence_ids = seq.data();
    b.aggregation = agg;
    return b;
  }
  troll::input_view<double> news() const { return troll::make_batch<const double>(zn.data(), rows, V); }
  troll::input_view<double> olds() const { return troll::make_batch<const double>(zo.data(), rows, V); }
};

struct outcome {
  double loss = 0.0;
  std::vector<double> token_loss, grad;
};

template <class Objective>
outcome run_ratio(const batch_case& c, const Objective& o, const troll::token_batch<double>& b) {
  outcome out;
  out.token_loss.assign(c.rows, 42.0);
  out.grad.assign(c.rows * c.V, 42.0);
  out.loss = troll::objective_forward(troll::cpu, o, c.news(), c.olds(), b, out.token_loss.data()).loss;
  troll::objective_backward(troll::cpu, o, c.news(), c.olds(), b, troll::make_batch(out.grad.data(), c.rows, c.V), 1.5);
  return out;
}

outcome run_troll(const batch_case& c, const troll::token_batch<double>& b) {
  troll::trust_region_objective o;
  o.eps = 0.01;
  outcome out;
  out.token_loss.assign(c.rows, 42.0);
  out.grad.assign(c.rows * c.V, 42.0);
  std::vector<double> lp(c.rows * c.V);
  std::vector<troll::projection_stats> stats(c.rows);
  out.loss = troll::objective_forward(troll::cpu, o, c.news(), c.olds(), b, troll::make_batch(lp.data(), c.rows, c.V),
                                      stats.data(), out.token_loss.data())
                 .loss;
  troll::objective_backward(troll::cpu, o, c.news(), c.olds(), b, troll::make_batch<const double>(lp.data(), c.rows, c.V),
                            stats.data(), troll::make_batch(out.grad.data(), c.rows, c.V), 1.5);
  return out;
}

void check_same(const outcome& big, const outcome& small) {
  CHECK(std::isfinite(big.loss));
  CHECK(big.loss == small.loss);
  CHECK(big.token_loss == small.token_loss);
  CHECK(big.grad == small.grad);
  bool any_nonzero = false;
  for (double g : big.grad) any_nonzero = any_nonzero || g != 0.0;
  CHECK(any_nonzero);
}

}  // namespace

TEST_CASE("Loss masks whose sum overflows a double weigh by their ratios (token and sequence mean)") {
  const batch_case c;
  // Σ of the large masks is 15·2^1021 > DBL_MAX; every mask is finite.
  const std::vector<double> small = {4.0, 6.0, 2.0, 0.0, 3.0, 0.5};
  std::vector<double> big;
  for (double w : small) big.push_back(std::ldexp(w, 1021));
  for (auto agg : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
    CAPTURE(int(agg));
    check_same(run_troll(c, c.batch(big, agg)), run_troll(c, c.batch(small, agg)));
    check_same(run_ratio(c, troll::ppo_clip_objective{}, c.batch(big, agg)),
               run_ratio(c, troll::ppo_clip_objective{}, c.batch(small, agg)));
    const auto dppo = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);
    check_same(run_ratio(c, dppo, c.batch(big, agg)), run_ratio(c, dppo, c.batch(small, agg)));
  }
  // Subnormal masks weigh as their ratios too (scaled up before the division).
  std::vector<double> tiny;
  for (double w : small) tiny.push_back(std::ldexp(w, -1060));
  for (auto agg : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean})
    check_same(run_troll(c, c.batch(tiny, agg)), run_troll(c, c.batch(small, agg)));
}

TEST_CASE("Metric means of values near DBL_MAX are their means, not +inf") {
  // V = 2, new rows uniform, old rows (h, −h): q_1 = exp(−2h), so KL(p̃‖q) = h − log 2 + ~0 and
  // the ratio at token 0 is 1/2. Four rows at h = 0.75e308 sum their KLs past DBL_MAX.
  const double h = 0.75e308;
  const std::size_t rows = 4, V = 2;
  std::vector<double> zn(rows * V, 0.0), zo, adv(rows, 1.0);
  for (std::size_t r = 0; r < rows; ++r) {
    zo.push_back(h);
    zo.push_back(-h);
  }
  std::vector<std::int64_t> tok(rows, 0);
  troll::token_batch<double> b;
  b.tokens = tok.data();
  b.advantages = adv.data();
  const troll::objective_metrics m = troll::objective_forward(
      troll::cpu, troll::ppo_clip_objective{}, troll::make_batch<const double>(zn.data(), rows, V),
      troll::make_batch<const double>(zo.data(), rows, V), b);
  const ld kl = ld(h) - std::log(ld(2));  // ½·log(½/1) + ½·(log ½ + 2h)
  CHECK(std::isfinite(m.kl_before_mean));
  CHECK(m.kl_before_mean == doctest::Approx(double(kl)).epsilon(1e-14));
  CHECK(m.kl_before_max == doctest::Approx(double(kl)).epsilon(1e-14));
  CHECK(m.ratio_mean == doctest::Approx(0.5).epsilon(1e-15));

  // Ratios near DBL_MAX: the old row puts the sampled token ~709.6 nats below the rest.
  const double gap = std::log(1.5e308) + std::log(2.0);  // p̃_0 = 1/2, q_0 ≈ exp(−gap): ρ ≈ 1.5e308
  std::vector<double> zo2;
  for (std::size_t r = 0; r < rows; ++r) {
    zo2.push_back(0.0);
    zo2.push_back(gap);
  }
  const troll::objective_metrics m2 = troll::objective_forward(
      troll::cpu, troll::ppo_clip_objective{}, troll::make_batch<const double>(zn.data(), rows, V),
      troll::make_batch<const double>(zo2.data(), rows, V), b);
  const ld log_q0 = -std::log1p(std::exp(ld(gap)));
  const ld ratio = std::exp(std::log(ld(0.5)) - log_q0);
  CHECK(std::isfinite(m2.ratio_mean));
  CHECK(m2.ratio_mean == doctest::Approx(double(ratio)).epsilon(1e-12));
}

TEST_CASE("DPPO top-K KL: an old probability that underflows to 0 adds 0, not NaN") {
  // Old row (h, −h) with h = 1e308: log q_1 = −2h is −inf in double though the logits are finite.
  // Top-2 KL over tokens {0, 1}: q_0·log(q_0/p̃_0) + q_1·log(q_1/p̃_1) = log 2 + 0.
  const double h = 1e308;
  const std::size_t rows = 2, V = 2;
  std::vector<double> zn(rows * V, 0.0), zo = {h, -h, h, -h}, adv = {1.0, -1.0};
  std::vector<std::int64_t> tok = {0, 0};
  troll::token_batch<double> b;
  b.tokens = tok.data();
  b.advantages = adv.data();
  for (auto d : {troll::dppo_divergence::topk_kl, troll::dppo_divergence::topk_tv}) {
    auto o = troll::dppo_objective::defaults(d);
    o.top_k = 2;
    o.kl_metrics = false;
    const troll::objective_metrics m = troll::objective_forward(
        troll::cpu, o, troll::make_batch<const double>(zn.data(), rows, V),
        troll::make_batch<const double>(zo.data(), rows, V), b);
    const double expect = d == troll::dppo_divergence::topk_kl ? std::log(2.0) : 0.5;
    CHECK(m.divergence_mean == doctest::Approx(expect).epsilon(1e-15));
    CHECK(std::isfinite(m.loss));
  }
}

TEST_CASE_TEMPLATE("Ratio losses: the sampled token's gradient where p̃_a rounds to 1 and the ratio is huge", T,
                   double, float) {
  // The thirty-sixth session's audit row: p̃_a = 1 − 2.6e-18 and q_a = 1.6e-19, so c = −A·ρ ≈
  // 2.9e18 and the gradient c·(δ_ja − p̃_j) is (+7.47, −7.47): entry a is c·(1 − p̃_a), which was
  // formed as c − c·p̃_a and came out 0 (the row's entries must sum to 0). It is now c times the
  // other tokens' mass (detail::ratio_sampled_entry). Checked for PPO clip (unclipped: A < 0,
  // ρ > 1 + ε) and DPPO (binary TV, a drop bound beyond the divergence keeps the token).
  const std::vector<double> zn_d = {37.93256159712966, -2.569795519014507}, zo_d = {0.295021767249682,
                                                                                   43.572481144786586};
  const double advantage = -0.46599421569978794;
  std::vector<T> zn(zn_d.begin(), zn_d.end()), zo(zo_d.begin(), zo_d.end()), adv = {T(advantage)}, grad(2);
  std::vector<std::int64_t> tok = {0};
  troll::token_batch<T> b;
  b.tokens = tok.data();
  b.advantages = adv.data();
  // The reference in long double from the logits as T holds them: ρ = p̃_0/q_0, g = −A·ρ·(δ − p̃).
  const ld n0 = ld(zn[0]), n1 = ld(zn[1]), o0 = ld(zo[0]), o1 = ld(zo[1]);
  const ld p1 = 1 / (1 + std::exp(n0 - n1)), p0 = 1 / (1 + std::exp(n1 - n0));
  const ld log_q0 = -(o1 - o0) - std::log1p(std::exp(o0 - o1));
  const ld rho = std::exp(std::log(p0) - log_q0);
  const ld want0 = -ld(adv[0]) * rho * p1, want1 = -want0;
  auto check = [&](const std::string& what) {
    CAPTURE(what);
    const double scale = double(std::fabs(want0));
    const double tol = std::is_same<T, double>::value ? 1e-12 : 1e-5;
    CHECK(std::fabs(double(grad[0]) - double(want0)) <= tol * scale);
    CHECK(std::fabs(double(grad[1]) - double(want1)) <= tol * scale);
  };
  troll::objective_backward(troll::cpu, troll::ppo_clip_objective{}, troll::make_batch<const T>(zn.data(), 1, 2),
                            troll::make_batch<const T>(zo.data(), 1, 2), b, troll::make_batch(grad.data(), 1, 2));
  check("ppo_clip");
  auto o = troll::dppo_objective::defaults(troll::dppo_divergence::binary_tv);
  o.delta_low = o.delta_high = 2.0;  // TV ≤ 1: never dropped
  troll::objective_backward(troll::cpu, o, troll::make_batch<const T>(zn.data(), 1, 2),
                            troll::make_batch<const T>(zo.data(), 1, 2), b, troll::make_batch(grad.data(), 1, 2));
  check("dppo binary_tv");
}

namespace {

/// ∂ℓ/∂z̃ of TROLL's objective (token_mean over one row, mask 1) in long double, given the
/// forward's t* (stats.t; 1 on inactive rows): the member π_t, its moments and the formula of
/// docs/objectives.md, with the sampled token's 1 − π_a and every d − μ formed without
/// cancellation (π_t from log-space, 1 − π_a as the others' sum, μ and σ² as weighted sums of
/// differences to the dominant token). Independent of troll's code paths.
std::vector<ld> troll_gradient_given_t(const std::vector<double>& zn, const std::vector<double>& zo, double t_star,
                                       bool projected, std::size_t a, double advantage, double alpha) {
  const std::size_t n = zn.size();
  const ld t = projected ? ld(t_star) : ld(1);
  auto log_softmax = [](const std::vector<ld>& z) {
    const ld top = *std::max_element(z.begin(), z.end());
    ld sum = 0;
    for (ld v : z) sum += std::exp(v - top);
    std::vector<ld> out;
    for (ld v : z) out.push_back((v - top) - std::log(sum));
    return out;
  };
  std::vector<ld> w(n), zq(n), zp(n), d(n);
  for (std::size_t j = 0; j < n; ++j) {
    zp[j] = ld(zn[j]), zq[j] = ld(zo[j]), d[j] = zp[j] - zq[j];
    w[j] = zq[j] + t * d[j];
  }
  const std::vector<ld> lpi = log_softmax(w), lq = log_softmax(zq), lp = log_softmax(zp);
  std::size_t k = 0;
  for (std::size_t j = 1; j < n; ++j)
    if (lpi[j] > lpi[k]) k = j;
  ld mu_k = 0, others = 0;  // μ − d_k = Σ π_j (d_j − d_k); 1 − π_k = Σ_{j≠k} π_j
  for (std::size_t j = 0; j < n; ++j)
    if (j != k) mu_k += std::exp(lpi[j]) * (d[j] - d[k]), others += std::exp(lpi[j]);
  ld var = 0;
  for (std::size_t j = 0; j < n; ++j) {
    const ld c = (d[j] - d[k]) - mu_k;
    var += std::exp(lpi[j]) * c * c;
  }
  const ld rho = std::exp(lpi[a] - lq[a]), coef = -ld(advantage) * rho;
  ld kl_reg = 0;
  for (std::size_t j = 0; j < n; ++j) kl_reg += std::exp(lp[j]) * (lp[j] - lpi[j]);
  const ld c_a = (d[a] - d[k]) - mu_k;
  // p̃'s mode h: log p̃_h − log π_h − KL(p̃‖π) = Σ_{j≠h} p̃_j (r_h − r_j), r = log p̃ − log π (the
  // same number without the cancellation of r_h against KL)
  std::size_t h = 0;
  for (std::size_t j = 1; j < n; ++j)
    if (lp[j] > lp[h]) h = j;
  std::vector<ld> g(n);
  for (std::size_t j = 0; j < n; ++j) {
    const ld pi = std::exp(lpi[j]), c = (d[j] - d[k]) - mu_k;
    const ld delta_minus_pi = j == a ? (a == k ? others : 1 - pi) : -pi;
    g[j] = coef * t * (delta_minus_pi - (projected ? pi * c * c_a / var : ld(0)));
    ld reg_factor = (lp[j] - lpi[j]) - kl_reg;
    if (j == h) {
      reg_factor = 0;
      for (std::size_t i = 0; i < n; ++i)
        if (i != h) reg_factor += std::exp(lp[i]) * ((lp[h] - lpi[h]) - (lp[i] - lpi[i]));
    }
    if (projected && alpha != 0) g[j] += ld(alpha) * std::exp(lp[j]) * reg_factor;
  }
  return g;
}

}  // namespace

TEST_CASE("TROLL objective: the dominant token's gradient entry on near one-hot rows") {
  // The thirty-sixth session's differential audit: an inactive row sampled at its dominant token
  // (p̃_3 = 1 − 3.5e-135) had that entry written as c·(1 − p̃_3) = 0 instead of c times the other
  // tokens' mass, so the gradient did not sum to 0 and was 100% off relative to itself. The entry
  // of the dominant token is now minus the others' sum. Also a projected near one-hot row (a
  // logit gap of 40 against the old row's), held to the long-double gradient given t*.
  struct row_case {
    std::vector<double> zn, zo;
    std::int64_t token;
    double eps, advantage;
  };
  const std::vector<row_case> cases = {
      {{0.85628676220478528, 1.6595079310927789, -0.23469957593696841, 311.91325000725573, -1.228563896856355,
        0.41671610732941278, 0.26311804451127285, -2.3823859683752153},
       {1.1275662150887551, 2.8622119622156199, -1.8050688560718902, 148.42430902085141, -0.66725579786105949,
        0.41713620671365104, -0.46723612477328846, -2.2974142667247093},
       3, 5.3442873218253979e-06, 0.87636609357581741},
      // projected (KL(p̃‖q) ~ 1e-17 against ε = 1e-18), sampled at the dominant token and not
      {{0.3, -0.2, 40.0, 0.1, -1.0}, {0.1, 0.4, 38.5, -0.3, 0.2}, 2, 1e-18, -0.7},
      {{0.3, -0.2, 40.0, 0.1, -1.0}, {0.1, 0.4, 38.5, -0.3, 0.2}, 0, 1e-18, 1.3},
      // projected with a large step (ε = 0.05 against KL(p̃‖q) ~ 1.6)
      {{0.3, -0.2, 12.0, 0.1, -1.0}, {0.1, 0.4, 9.5, -0.3, 0.2}, 2, 0.05, -0.7},
      // π*'s dominant token (0, the old row's mode) is not p̃'s (1): the sparse audit's row, A = 0,
      // so the regression term alone, whose terms cancel at p̃'s dominant token (the rule per part;
      // it was 100% off there)
      {{-40.0, 0.0, -41.0, -42.0},
       {-3.0983564697167347e-09, -20.000000003098357, -21.000000003098357, -22.000000003098357},
       0, 0.05, 0.0},
      // p̃'s dominant token 2, π*'s another: the new row moved its mode far from the old one
      {{0.0, 0.5, 30.0, -0.2}, {25.0, 0.3, 0.0, 0.1}, 1, 0.05, 0.4},
  };
  for (const row_case& c : cases) {
    for (const double alpha : {0.0, 1.0}) {
      CAPTURE(c.token);
      CAPTURE(alpha);
      const std::size_t v = c.zn.size();
      std::vector<double> lp(v), grad(v);
      troll::projection_stats st;
      std::vector<std::int64_t> tok = {c.token};
      std::vector<double> adv = {c.advantage};
      troll::token_batch<double> b;
      b.tokens = tok.data();
      b.advantages = adv.data();
      troll::trust_region_objective o;
      o.eps = c.eps;
      o.alpha = alpha;
      troll::objective_forward(troll::cpu, o, troll::make_batch<const double>(c.zn.data(), 1, v),
                               troll::make_batch<const double>(c.zo.data(), 1, v), b,
                               troll::make_batch(lp.data(), 1, v), &st);
      troll::objective_backward(troll::cpu, o, troll::make_batch<const double>(c.zn.data(), 1, v),
                                troll::make_batch<const double>(c.zo.data(), 1, v), b,
                                troll::make_batch<const double>(lp.data(), 1, v), &st,
                                troll::make_batch(grad.data(), 1, v));
      const std::vector<ld> want = troll_gradient_given_t(c.zn, c.zo, st.t, st.status == troll::row_status::projected,
                                                          std::size_t(c.token), c.advantage, alpha);
      ld scale = 0, worst = 0, sum = 0;
      for (std::size_t j = 0; j < v; ++j) {
        scale = std::max(scale, std::fabs(want[j]));
        worst = std::max(worst, std::fabs(ld(grad[j]) - want[j]));
        sum += ld(grad[j]);
      }
      CAPTURE(int(st.status));
      if (scale == 0) {  // A = 0 and α = 0: nothing to differentiate
        for (std::size_t j = 0; j < v; ++j) CHECK(grad[j] == 0.0);
        continue;
      }
      CHECK(double(worst / scale) <= 1e-9);  // t* to the solver's 1e-11, π_t's sensitivity to it
      CHECK(double(std::fabs(sum) / scale) <= 1e-12);
    }
  }
}

TEST_CASE_TEMPLATE("DPPO binary KL: 1 − π of a sampled token with p̃_a just short of rounding to 1", T, double,
                   float) {
  // The thirty-sixth session's ratio audit: new logits (36.5, 0), so 1 − p̃_0 = 1.4e-16 while
  // log p̃_0 is not yet 0. The refinement −log1p(Σ_{j≠a} e^{z_j − z_a}) ran only where log p̃_a
  // was exactly 0, so 1 − π kept less than a digit: divergence 0.04951 for 0.05030, and the
  // token, beyond δ = 0.05, was kept. Now every p > 1/2 is refined (detail::refines_log_prob).
  const std::vector<T> zn = {T(36.5), T(0)}, zo = {T(6.360101178210273), T(0)};
  std::vector<T> adv = {T(1)};
  std::vector<std::int64_t> tok = {0};
  troll::token_batch<T> b;
  b.tokens = tok.data();
  b.advantages = adv.data();
  // μ log(μ/π) + (1 − μ) log((1 − μ)/(1 − π)) in long double from the logits as T holds them
  const ld g_new = ld(zn[0]) - ld(zn[1]), g_old = ld(zo[0]) - ld(zo[1]);
  const ld one_minus_pi = 1 / (1 + std::exp(g_new)), pi = 1 / (1 + std::exp(-g_new));
  const ld one_minus_mu = 1 / (1 + std::exp(g_old)), mu = 1 / (1 + std::exp(-g_old));
  const ld want = mu * std::log(mu / pi) + one_minus_mu * std::log(one_minus_mu / one_minus_pi);
  REQUIRE(want > 0.05L);  // beyond δ_high: the token (A > 0, π > μ) is masked
  const troll::objective_metrics m = troll::objective_forward(
      troll::cpu, troll::dppo_objective::defaults(troll::dppo_divergence::binary_kl),
      troll::make_batch<const T>(zn.data(), 1, 2), troll::make_batch<const T>(zo.data(), 1, 2), b);
  CHECK(m.divergence_mean == doctest::Approx(double(want)).epsilon(1e-12));
  CHECK(m.limited_fraction == 1.0);
  CHECK(m.loss == 0.0);
}
