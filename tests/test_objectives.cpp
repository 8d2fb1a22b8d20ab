#include <doctest/doctest.h>

// Tests of troll/objectives.hpp: TROLL's objective and the PPO-clip / DPPO baselines. Gradients
// are checked with troll's finite-difference checker in double, through the projection; the
// regression term KL(p̃ ‖ stopgrad(π*)) is differenced with π* frozen at the base point: those
// checks are the one body tests/bodies/objective_gradients.hpp, compiled here for troll::cpu (and
// for troll::cuda by tests/cuda/test_cuda_objectives.cu). Values are checked against
// hand-computed numbers and long-double oracles; masks, aggregation and bad input are covered.

#include <troll/gradcheck.hpp>
#include <troll/objectives.hpp>
#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "grad_helpers.hpp"
#include "objective_batch.hpp"
#include "objective_cases.hpp"
#include "oracle.hpp"
#include "special_values.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "../bodies/objective_gradients.hpp"

namespace {

using grad_helpers::neg_inf;
using grad_helpers::pair_batch;
namespace oracle = troll_test::oracle;
using namespace troll_test::objective_cases;

using troll_test::nan_value;

struct troll_run {
  std::vector<double> log_probs, token_loss, grad;
  std::vector<troll::projection_stats> stats;
  troll::objective_metrics metrics;
};

troll_run run_troll(const token_case& c, const troll::trust_region_objective& o) {
  const std::size_t N = c.rows(), V = c.cols();
  troll_run out;
  out.log_probs.assign(N * V, 0.0);
  out.token_loss.assign(N, 0.0);
  out.grad.assign(N * V, 0.0);
  out.stats.assign(N, {});
  const auto zn = troll::make_batch(c.logits.new_logits.data(), N, V);
  const auto zo = troll::make_batch(c.logits.old_logits.data(), N, V);
  out.metrics = troll::objective_forward(troll::cpu, o, zn, zo, c.batch(),
                                         troll::make_batch(out.log_probs.data(), N, V),
                                         out.stats.data(), out.token_loss.data());
  troll::objective_backward(troll::cpu, o, zn, zo, c.batch(), troll::make_batch(out.log_probs.data(), N, V),
                            out.stats.data(), troll::make_batch(out.grad.data(), N, V));
  return out;
}

/// A one-row case over three tokens with q = (0.5, 0.3, 0.2), p̃ = (p0, p1, p2), token 0 sampled.
token_case three_token_row(double p0, double p1, double p2, double advantage) {
  token_case c;
  c.logits = pair_batch(1, 3);
  c.logits.set_row(0, {std::log(p0), std::log(p1), std::log(p2)},
                   {std::log(0.5), std::log(0.3), std::log(0.2)});
  c.tokens = {0};
  c.advantages = {advantage};
  return c;
}

}  // namespace

TEST_CASE("TROLL values: loss, projection and metrics against independent evaluation") {
  token_case c = make_case(12, 16, 5);
  const troll::trust_region_objective o = tight_troll(0.7);
  const troll_run run = run_troll(c, o);
  const std::vector<double> w = weights_of(c);
  const std::size_t V = c.cols();

  // The loss is Σ c_r ℓ_r with ℓ_r evaluated independently (frozen π* = the forward's own π*
  // makes no difference to the value).
  CHECK(run.metrics.loss == doctest::Approx(troll_loss_frozen(c, c.logits, o, run.log_probs)).epsilon(1e-12));
  double projected = 0, counted = 0, kl_after_max = 0, eta = 0;
  for (std::size_t r = 0; r < c.rows(); ++r) {
    if (w[r] == 0.0) {
      CHECK(run.token_loss[r] == 0.0);
      continue;
    }
    counted += 1;
    const troll::projection_stats& s = run.stats[r];
    const double kl_before = oracle::kl_logits(c.logits.new_row(r), c.logits.old_row(r), V);
    CHECK(s.kl_before == doctest::Approx(kl_before).epsilon(1e-10));
    if (s.active()) {
      projected += 1;
      eta += s.eta;
      CHECK(kl_before > o.eps);
    } else {
      // Inactive: π* = p̃, the loss is −r·A exactly and the regression KL is zero.
      const auto lp = oracle::log_softmax(c.logits.new_row(r), V);
      const auto lq = oracle::log_softmax(c.logits.old_row(r), V);
      const std::size_t a = std::size_t(c.tokens[r]);
      CHECK(run.token_loss[r] == doctest::Approx(double(-std::exp(lp[a] - lq[a]) * c.advantages[r])).epsilon(1e-12));
    }
    // KL(π*‖q) measured independently from the written log π*.
    std::vector<oracle::real> lpi(run.log_probs.begin() + long(r * V), run.log_probs.begin() + long((r + 1) * V));
    const double kl_after = double(oracle::kl(lpi, oracle::log_softmax(c.logits.old_row(r), V)));
    CHECK(kl_after <= o.eps * (1 + 1e-10) + 1e-13);
    kl_after_max = std::max(kl_after_max, kl_after);
  }
  CHECK(projected > 0);
  CHECK(projected < counted);
  CHECK(run.metrics.tokens == std::size_t(counted));
  CHECK(run.metrics.projected_fraction == doctest::Approx(projected / counted));
  CHECK(run.metrics.eta_mean == doctest::Approx(eta / counted));
  CHECK(run.metrics.kl_after_max == doctest::Approx(kl_after_max).epsilon(1e-9));
  CHECK(run.metrics.kl_after_max <= o.eps * (1 + 1e-10) + 1e-13);
  CHECK(run.metrics.kl_before_max > o.eps);
}

TEST_CASE("TROLL backward agrees with the scalar host/device reference of objective_row.hpp") {
  token_case c = make_case(8, 20, 41);
  c.mask.clear();
  const troll::trust_region_objective o = tight_troll(1.3);
  const troll_run run = run_troll(c, o);
  const std::vector<double> w = weights_of(c);
  const std::size_t V = c.cols();
  for (std::size_t r = 0; r < c.rows(); ++r) {
    const auto lp = oracle::log_softmax(c.logits.new_row(r), V);
    const auto lq = oracle::log_softmax(c.logits.old_row(r), V);
    const double* lpi = run.log_probs.data() + r * V;
    const std::size_t a = std::size_t(c.tokens[r]);
    const double ratio = std::exp(lpi[a] - double(lq[a]));
    double kl_reg = 0;
    for (std::size_t j = 0; j < V; ++j) kl_reg += double(std::exp(lp[j]) * (lp[j] - lpi[j]));
    const troll::projection_stats& s = run.stats[r];
    const double reg_alpha = s.active() ? o.alpha : 0.0;
    const auto k = troll::detail::troll_coefficients(w[r], c.advantages[r], ratio, reg_alpha, kl_reg,
                                                     c.logits.new_row(r)[a] - c.logits.old_row(r)[a], s);
    for (std::size_t j = 0; j < V; ++j) {
      const double centred = c.logits.new_row(r)[j] - c.logits.old_row(r)[j] - s.mu;
      const double g = troll::detail::troll_gradient_entry(k, j == a, true, true, lpi[j], double(lp[j]), centred);
      CHECK(run.grad[r * V + j] == doctest::Approx(g).epsilon(1e-9).scale(1e-12));
    }
  }
}

TEST_CASE("TROLL in float agrees with double") {
  token_case c = make_case(6, 64, 3);
  const std::size_t N = c.rows(), V = c.cols();
  const troll_run ref = run_troll(c, troll::trust_region_objective{});
  std::vector<float> zn(c.logits.new_logits.begin(), c.logits.new_logits.end());
  std::vector<float> zo(c.logits.old_logits.begin(), c.logits.old_logits.end());
  std::vector<float> adv(c.advantages.begin(), c.advantages.end()), mask(c.mask.begin(), c.mask.end());
  std::vector<float> lp(N * V), grad(N * V);
  std::vector<troll::projection_stats> stats(N);
  troll::token_batch<float> b;
  b.tokens = c.tokens.data();
  b.advantages = adv.data();
  b.loss_mask = mask.data();
  const auto m = troll::objective_forward(troll::cpu, troll::trust_region_objective{},
                                          troll::make_batch(zn.data(), N, V), troll::make_batch(zo.data(), N, V), b,
                                          troll::make_batch(lp.data(), N, V), stats.data());
  troll::objective_backward(troll::cpu, troll::trust_region_objective{}, troll::make_batch(zn.data(), N, V),
                            troll::make_batch(zo.data(), N, V), b, troll::make_batch(lp.data(), N, V),
                            stats.data(), troll::make_batch(grad.data(), N, V));
  // Inputs rounded to float move the loss by ~1e-7 relative; the outputs are float.
  CHECK(m.loss == doctest::Approx(ref.metrics.loss).epsilon(1e-5));
  double max_grad = 0;
  for (double g : ref.grad) max_grad = std::max(max_grad, std::fabs(g));
  for (std::size_t k = 0; k < N * V; ++k) CHECK(std::fabs(grad[k] - ref.grad[k]) <= 1e-5 * max_grad + 1e-7);
}

TEST_CASE("PPO clip: hand-computed values and gradients") {
  // q = (0.5, 0.3, 0.2), token 0 sampled. ℓ = −min(rA, clip(r)A); ∂ℓ/∂z̃_j = −A r (δ_j0 − p̃_j)
  // on unclipped tokens, 0 on clipped ones.
  struct expect {
    double p0, p1, p2, advantage, dual, loss;
    bool clipped;
  };
  const expect cases[] = {
      {0.7, 0.2, 0.1, +1.0, 0.0, -1.2, true},   // r = 1.4 > 1.2, A > 0: clipped at 1 + ε
      {0.7, 0.2, 0.1, -1.0, 0.0, 1.4, false},   // A < 0: min picks r·A = −1.4, gradient flows
      {0.25, 0.5, 0.25, +1.0, 0.0, -0.5, false},  // r = 0.5, A > 0: unclipped
      {0.25, 0.5, 0.25, -1.0, 0.0, 0.8, true},    // r = 0.5, A < 0: clipped at 1 − ε
      {0.95, 0.03, 0.02, -2.0, 1.5, 3.0, true},   // r = 1.9: r·A = −3.8 < 1.5·A = −3: dual clip
      {0.55, 0.25, 0.2, -2.0, 3.0, 2.2, false},   // r = 1.1: inside, dual clip inactive
  };
  for (const expect& e : cases) {
    CAPTURE(e.p0);
    CAPTURE(e.advantage);
    token_case c = three_token_row(e.p0, e.p1, e.p2, e.advantage);
    troll::ppo_clip_objective o;
    o.dual_clip = e.dual;
    std::vector<double> g(3), token_loss(1);
    const auto m = troll::objective_forward(troll::cpu, o, troll::make_batch(c.logits.new_logits.data(), 1, 3),
                                            troll::make_batch(c.logits.old_logits.data(), 1, 3), c.batch(),
                                            token_loss.data());
    troll::objective_backward(troll::cpu, o, troll::make_batch(c.logits.new_logits.data(), 1, 3),
                              troll::make_batch(c.logits.old_logits.data(), 1, 3), c.batch(),
                              troll::make_batch(g.data(), 1, 3));
    CHECK(m.loss == doctest::Approx(e.loss).epsilon(1e-12));
    CHECK(token_loss[0] == doctest::Approx(e.loss).epsilon(1e-12));
    CHECK(m.limited_fraction == (e.clipped ? 1.0 : 0.0));
    CHECK(m.ratio_mean == doctest::Approx(e.p0 / 0.5).epsilon(1e-12));
    const double r = e.p0 / 0.5, p[3] = {e.p0, e.p1, e.p2};
    for (int j = 0; j < 3; ++j) {
      const double want = e.clipped ? 0.0 : -e.advantage * r * ((j == 0 ? 1.0 : 0.0) - p[j]);
      CHECK(g[std::size_t(j)] == doctest::Approx(want).epsilon(1e-12).scale(1e-15));
    }
  }
}

TEST_CASE("DPPO's binary KL of tiny probabilities against mpmath (50 digits)") {
  // The tail (1−μ) log((1−μ)/(1−π)) was the log of the rounded quotient, ~1e-16 off: with μ and π
  // near 1e-13 (KL ~1e-12) that moved the divergence by 2.7e-6 relative (an audit, float DPPO); and
  // at μ ≈ π the textbook difference of two ~|π − μ| terms kept ~KL/|π − μ| of its digits.
  struct row {
    double log_mu, log_pi, kl, rtol;
  };
  const row rows[] = {
      {-28.696392070816856, -43.881505954932614, 4.8881903320663503839e-12, 1e-13},
      {-1e-14, -3e-14, 9.0138771133188569542e-15, 1e-13},
      {-30.0, -31.0, 3.4424771084701514031e-14, 1e-13},
      {-0.7, -0.7000001, 4.9321688351755990078e-15, 1e-13},  // the textbook form: 4.7e-3
      {-0.6931471805599453, -1e-17, 18.878826109889442523, 1e-14},   // 1 − π far below 1 − μ
      {-1e-3, -2.0, 1.9902425376815011519, 1e-14},
      {-5.0, -1e-9, 20.543228639719025473, 1e-14},
      {-1e-300, -2.0, 2.0, 1e-14},  // 1 − μ = 1e-300
  };
  for (const row& r : rows) {
    CAPTURE(r.log_mu);
    const double got = troll::detail::binary_kl(r.log_mu, r.log_pi);
    CHECK(std::fabs(got - r.kl) <= r.rtol * r.kl);
  }
  CHECK(troll::detail::binary_kl(-1.0, 0.0) == std::numeric_limits<double>::infinity());  // π = 1 > μ
  CHECK(troll::detail::binary_kl(0.0, -1.0) == doctest::Approx(1.0));                       // μ = 1
}

TEST_CASE("DPPO: divergences and the directional mask by hand") {
  // q = (0.5, 0.3, 0.2), p̃ = (0.7, 0.2, 0.1), token 0: μ = 0.5, π = 0.7, r = 1.4.
  const double binary_kl = 0.5 * std::log(0.5 / 0.7) + 0.5 * std::log(0.5 / 0.3);
  const double top2_kl = 0.5 * std::log(0.5 / 0.7) + 0.3 * std::log(0.3 / 0.2) + 0.2 * std::log(0.2 / 0.1);
  struct expect {
    troll::dppo_divergence divergence;
    int k;
    double delta, divergence_value;
  };
  const expect cases[] = {
      {troll::dppo_divergence::binary_tv, 0, 0.15, 0.2},
      {troll::dppo_divergence::binary_kl, 0, 0.05, binary_kl},
      {troll::dppo_divergence::topk_tv, 1, 0.15, 0.5 * (0.2 + 0.2)},
      {troll::dppo_divergence::topk_tv, 2, 0.15, 0.5 * (0.2 + 0.1 + 0.1)},
      {troll::dppo_divergence::topk_kl, 1, 0.05, binary_kl},
      {troll::dppo_divergence::topk_kl, 2, 0.05, top2_kl},
  };
  for (const expect& e : cases) {
    CAPTURE(int(e.divergence));
    CAPTURE(e.k);
    for (double advantage : {+1.0, -1.0}) {
      CAPTURE(advantage);
      token_case c = three_token_row(0.7, 0.2, 0.1, advantage);
      troll::dppo_objective o = troll::dppo_objective::defaults(e.divergence);
      CHECK(o.delta_high == e.delta);
      if (e.k) o.top_k = e.k;
      std::vector<double> g(3);
      const auto m = troll::objective_forward(troll::cpu, o, troll::make_batch(c.logits.new_logits.data(), 1, 3),
                                              troll::make_batch(c.logits.old_logits.data(), 1, 3), c.batch());
      troll::objective_backward(troll::cpu, o, troll::make_batch(c.logits.new_logits.data(), 1, 3),
                                troll::make_batch(c.logits.old_logits.data(), 1, 3), c.batch(),
                                troll::make_batch(g.data(), 1, 3));
      CHECK(m.divergence_mean == doctest::Approx(e.divergence_value).epsilon(1e-12));
      // π > μ: A > 0 pushes further along the divergent direction → masked; A < 0 pulls back → kept.
      const bool masked = advantage > 0 && e.divergence_value > e.delta;
      CHECK(masked == (advantage > 0));
      CHECK(m.limited_fraction == (masked ? 1.0 : 0.0));
      CHECK(m.loss == doctest::Approx(masked ? 0.0 : -1.4 * advantage).epsilon(1e-12));
      const double p[3] = {0.7, 0.2, 0.1};
      for (int j = 0; j < 3; ++j) {
        const double want = masked ? 0.0 : -advantage * 1.4 * ((j == 0 ? 1.0 : 0.0) - p[j]);
        CHECK(g[std::size_t(j)] == doctest::Approx(want).epsilon(1e-12).scale(1e-15));
      }
    }
  }
  // Below the bound nothing is masked: binary TV 0.05 < 0.15.
  token_case c = three_token_row(0.55, 0.27, 0.18, +1.0);
  const auto m = troll::objective_forward(troll::cpu, troll::dppo_objective{},
                                          troll::make_batch(c.logits.new_logits.data(), 1, 3),
                                          troll::make_batch(c.logits.old_logits.data(), 1, 3), c.batch());
  CHECK(m.limited_fraction == 0.0);
  CHECK(m.divergence_mean == doctest::Approx(0.05).epsilon(1e-12));
}

namespace {

/// KL(P‖Q) and TV(P, Q) over a whole row in long double (P = softmax(old), Q = softmax(new); −inf
/// entries of old carry no mass): the lumped top-K divergences when K covers every finite entry.
template <class T>
void full_row_divergences(const T* zn, const T* zo, std::size_t n, long double& kl, long double& tv) {
  long double mo = -INFINITY, mn = -INFINITY, so = 0, sn = 0;
  for (std::size_t j = 0; j < n; ++j) mo = std::max(mo, (long double)zo[j]), mn = std::max(mn, (long double)zn[j]);
  for (std::size_t j = 0; j < n; ++j) so += std::exp((long double)zo[j] - mo), sn += std::exp((long double)zn[j] - mn);
  kl = tv = 0;
  for (std::size_t j = 0; j < n; ++j) {
    const long double p = std::exp((long double)zo[j] - mo) / so, q = std::exp((long double)zn[j] - mn) / sn;
    if (p > 0) kl += p * std::log(p / q);
    tv += std::fabs(p - q) / 2;
  }
}

}  // namespace

TEST_CASE_TEMPLATE("DPPO top-K with K at or above the finite entries: the whole row's divergence, "
                   "any summation order (rests summed, not 1 - sum over K)", T, float, double) {
  // The batch and K of the device comparison that failed on an H100 (tests/cuda/
  // test_cuda_dppo.cu, "K above the finite entries"): with every finite entry in K,
  // 1 − Σ_K p and 1 − Σ_K q were ±1e-16 rounding noise, and a positive rest_p against a rest_q
  // clamped to 0 made the KL +inf (CPU rows 2, 6 and 11; row 0 under the device's order).
  troll_test::host_batch<T> h(12, 16, 41u);
  const double u = std::numeric_limits<T>::epsilon() / 2;
  for (std::size_t r = 0; r < h.rows; ++r) {
    CAPTURE(r);
    const T* zn = h.fresh.data() + r * h.cols;
    const T* zo = h.old.data() + r * h.cols;
    long double kl = 0, tv = 0;
    full_row_divergences(zn, zo, h.cols, kl, tv);
    for (const int k : {16, 20, 256}) {
      CAPTURE(k);
      for (const auto d : {troll::dppo_divergence::topk_kl, troll::dppo_divergence::topk_tv}) {
        troll::dppo_objective o = troll::dppo_objective::defaults(d);
        o.top_k = k;
        troll::token_batch<T> in;
        in.tokens = h.tokens.data() + r;
        in.advantages = h.advantages.data() + r;
        const auto m = troll::objective_forward(troll::cpu, o, troll::make_batch(zn, 1, h.cols),
                                                troll::make_batch(zo, 1, h.cols), in);
        const long double want = d == troll::dppo_divergence::topk_kl ? kl : tv;
        CHECK(std::isfinite(m.divergence_mean));
        CHECK(std::fabs(m.divergence_mean - want) <= 1e-12 + 64 * u * want);
      }
    }
    // The shared sums (troll/detail/objective_row.hpp) as the CUDA block adds them: log-probs
    // as (x − m) − log s, accumulated pairwise (a reduction tree) and sequentially; both agree
    // with the whole row, K = 20 taking all.
    double mo = -INFINITY, mn = -INFINITY, so = 0, sn = 0;
    for (std::size_t j = 0; j < h.cols; ++j) mo = std::max(mo, double(zo[j])), mn = std::max(mn, double(zn[j]));
    for (std::size_t j = 0; j < h.cols; ++j) so += std::exp(double(zo[j]) - mo), sn += std::exp(double(zn[j]) - mn);
    std::vector<troll::detail::topk_sums> leaves(h.cols);
    troll::detail::topk_sums sequential;
    for (std::size_t j = 0; j < h.cols; ++j) {
      const double lp = (double(zo[j]) - mo) - std::log(so), lq = (double(zn[j]) - mn) - std::log(sn);
      if (double(zo[j]) > -INFINITY) {
        leaves[j].add(lp, lq);
        sequential.add(lp, lq);
      } else {
        leaves[j].add_rest(lp, lq);
        sequential.add_rest(lp, lq);
      }
    }
    for (std::size_t half = h.cols / 2; half > 0; half /= 2)
      for (std::size_t j = 0; j < half; ++j) {
        leaves[j].abs_diff += leaves[j + half].abs_diff, leaves[j].plog += leaves[j + half].plog;
        leaves[j].rest_p += leaves[j + half].rest_p, leaves[j].rest_q += leaves[j + half].rest_q;
      }
    for (const troll::detail::topk_sums& s : {leaves[0], sequential}) {
      CHECK(s.rest_p == 0.0);
      CHECK(std::fabs(s.kl() - kl) <= 1e-12 + 64 * u * kl);
      CHECK(std::fabs(s.tv() - tv) <= 1e-12 + 64 * u * tv);
    }
  }
}

TEST_CASE("Aggregation weights: a bad mask counts as 0 in every other row's weight") {
  // The rule the CUDA backend's aggregation kernels share (detail::counted_weight): a NaN,
  // negative or +inf mask rejects its own row (the CPU throws before aggregating, the device
  // writes that row NaN) and leaves the other rows' weights those of the batch with that mask 0.
  // On an H100 a NaN mask made the token-mean normaliser NaN, so every row's gradient was NaN.
  troll_test::host_batch<double> h(8, 4, 5u);
  for (const double bad : {std::nan(""), -1.0, double(INFINITY)}) {
    CAPTURE(bad);
    for (const auto how : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
      CAPTURE(int(how));
      std::vector<double> mask = h.mask, zeroed = h.mask;
      mask[5] = bad;
      zeroed[5] = 0.0;
      troll::token_batch<double> in = h.tokens_view(how), clean = in;
      in.loss_mask = mask.data();
      clean.loss_mask = zeroed.data();
      std::vector<double> got(8), want(8);
      std::size_t got_sequences = 0, want_sequences = 0;
      troll::detail::aggregation_weights(in, 8, 1.5, &got_sequences, got.data());
      troll::detail::aggregation_weights(clean, 8, 1.5, &want_sequences, want.data());
      CHECK(got_sequences == want_sequences);
      for (std::size_t r = 0; r < 8; ++r) {
        CAPTURE(r);
        CHECK(std::isfinite(got[r]));
        if (r != 5) CHECK(got[r] == want[r]);
      }
    }
  }
  CHECK(troll::detail::counted_weight(0.5) == 0.5);
  CHECK(troll::detail::counted_weight(0.0) == 0.0);
  CHECK(troll::detail::counted_weight(-0.0) == 0.0);
  CHECK(troll::detail::counted_weight(std::nan("")) == 0.0);
  CHECK(troll::detail::counted_weight(-INFINITY) == 0.0);
}

TEST_CASE("Masks and aggregation: token mean, sequence mean, zero-mask rows") {
  token_case c = make_case(9, 10, 8);
  c.tokens[4] = -100;  // mask 0 on row 4 (r % 5 == 4): an ignore index is allowed there
  c.advantages[4] = nan_value;
  for (auto aggregation : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
    c.aggregation = aggregation;
    const std::vector<double> w = weights_of(c);
    const troll_run run = run_troll(c, troll::trust_region_objective{});
    double expected = 0;
    for (std::size_t r = 0; r < c.rows(); ++r) expected += w[r] * run.token_loss[r];
    CHECK(run.metrics.loss == doctest::Approx(expected).epsilon(1e-13));
    for (std::size_t j = 0; j < c.cols(); ++j) CHECK(run.grad[4 * c.cols() + j] == 0.0);
    CHECK(run.token_loss[4] == 0.0);
    CHECK(run.metrics.tokens == 8);  // row 4 is the only masked row of 0..8
    if (aggregation == troll::loss_aggregation::sequence_mean) CHECK(run.metrics.sequences == 3);

    std::vector<double> token_loss(c.rows());
    const auto m = troll::objective_forward(troll::cpu, troll::ppo_clip_objective{},
                                            troll::make_batch(c.logits.new_logits.data(), c.rows(), c.cols()),
                                            troll::make_batch(c.logits.old_logits.data(), c.rows(), c.cols()),
                                            c.batch(), token_loss.data());
    expected = 0;
    for (std::size_t r = 0; r < c.rows(); ++r) expected += w[r] * token_loss[r];
    CHECK(m.loss == doctest::Approx(expected).epsilon(1e-13));
  }
  // A sequence whose mask is all zero does not count in the sequence mean.
  c.aggregation = troll::loss_aggregation::sequence_mean;
  for (std::size_t r = 0; r < c.rows(); ++r)
    if (c.sequence_ids[r] == 1) c.mask[r] = 0.0;
  const troll_run run = run_troll(c, troll::trust_region_objective{});
  CHECK(run.metrics.sequences == 2);
  const std::vector<double> w = weights_of(c);
  double expected = 0;
  for (std::size_t r = 0; r < c.rows(); ++r) expected += w[r] * run.token_loss[r];
  CHECK(run.metrics.loss == doctest::Approx(expected).epsilon(1e-13));
  // A padding row (mask 0) whose new logits put mass on a token its old logits mask: with α > 0
  // its KL(p̃‖π*) is +inf, which adds nothing there — accepted (it failed the batch before), the
  // loss, metrics and other rows' gradients those of the batch with that row left as it was.
  {
    token_case padded = c, counted = c;
    padded.logits.old_logits[4 * c.cols() + 3] = neg_inf;
    counted.logits.old_logits[4 * c.cols() + 3] = neg_inf;
    counted.mask[4] = 1.0;
    counted.tokens[4] = 0;
    counted.advantages[4] = 1.0;
    const troll_run with = run_troll(padded, troll::trust_region_objective{}), without = run_troll(c, troll::trust_region_objective{});
    CHECK(with.metrics.loss == without.metrics.loss);
    CHECK(with.metrics.tokens == without.metrics.tokens);
    CHECK(with.token_loss[4] == 0.0);
    for (std::size_t k = 0; k < with.grad.size(); ++k) {
      CAPTURE(k);
      CHECK(with.grad[k] == (k / c.cols() == 4 ? 0.0 : without.grad[k]));
    }
    const std::size_t N = c.rows(), V = c.cols();
    std::vector<double> lp(N * V), tl(N);
    std::vector<troll::projection_stats> st(N);
    CHECK_THROWS_AS(troll::objective_forward(troll::cpu, troll::trust_region_objective{},
                                             troll::make_batch(counted.logits.new_logits.data(), N, V),
                                             troll::make_batch(counted.logits.old_logits.data(), N, V),
                                             counted.batch(), troll::make_batch(lp.data(), N, V), st.data(), tl.data()),
                    troll::domain_error);
  }
  // All masked: loss 0, gradient 0.
  for (double& m : c.mask) m = 0.0;
  const troll_run none = run_troll(c, troll::trust_region_objective{});
  CHECK(none.metrics.loss == 0.0);
  CHECK(none.metrics.tokens == 0);
  for (double g : none.grad) CHECK(g == 0.0);
  // grad_loss scales the gradient.
  token_case d = make_case(5, 8, 9);
  const troll_run one = run_troll(d, troll::trust_region_objective{});
  std::vector<double> scaled(one.grad.size());
  troll::objective_backward(troll::cpu, troll::trust_region_objective{},
                            troll::make_batch(d.logits.new_logits.data(), 5, 8),
                            troll::make_batch(d.logits.old_logits.data(), 5, 8), d.batch(),
                            troll::make_batch(one.log_probs.data(), 5, 8), one.stats.data(),
                            troll::make_batch(scaled.data(), 5, 8), -2.0);
  for (std::size_t k = 0; k < scaled.size(); ++k) CHECK(scaled[k] == doctest::Approx(-2.0 * one.grad[k]));
}

TEST_CASE("sequence_ids_from_lengths") {
  const std::int64_t lengths[] = {2, 0, 3, 1};
  std::int64_t ids[6];
  troll::sequence_ids_from_lengths(lengths, 4, ids);
  const std::int64_t want[] = {0, 0, 2, 2, 2, 3};
  for (int k = 0; k < 6; ++k) CHECK(ids[k] == want[k]);
  const std::int64_t bad[] = {1, -1};
  CHECK_THROWS_AS(troll::sequence_ids_from_lengths(bad, 2, ids), troll::domain_error);
}

namespace {

/// Runs TROLL's forward with outputs pre-filled by a sentinel; expects `E` naming `row` (npos
/// for no row) and the outputs untouched.
template <class E>
void expect_objective_rejected(const token_case& c, const troll::trust_region_objective& o, std::size_t row,
                     const std::string& fragment, bool baselines_too = true) {
  const std::size_t N = c.rows(), V = c.cols();
  std::vector<double> lp(N * V, 42.0), token_loss(N, 42.0), grad(N * V, 42.0);
  std::vector<troll::projection_stats> stats(N);
  for (auto& s : stats) s.eta = 42.0;
  const auto zn = troll::make_batch(c.logits.new_logits.data(), N, V);
  const auto zo = troll::make_batch(c.logits.old_logits.data(), N, V);
  bool thrown = false;
  try {
    troll::objective_forward(troll::cpu, o, zn, zo, c.batch(), troll::make_batch(lp.data(), N, V), stats.data(),
                             token_loss.data());
  } catch (const E& e) {
    thrown = true;
    CHECK(e.row() == row);
    CHECK_MESSAGE(std::string(e.what()).find(fragment) != std::string::npos, e.what());
  }
  CHECK(thrown);
  for (double v : lp) CHECK(v == 42.0);
  for (double v : token_loss) CHECK(v == 42.0);
  for (const auto& s : stats) CHECK(s.eta == 42.0);
  // The baselines and the backward reject the same inputs (when not specific to the projection).
  thrown = false;
  try {
    troll::objective_backward(troll::cpu, troll::ppo_clip_objective{}, zn, zo, c.batch(),
                              troll::make_batch(grad.data(), N, V));
  } catch (const troll::invalid_input&) {
    thrown = true;
  }
  CHECK(thrown == baselines_too);
  if (baselines_too)
    for (double v : grad) CHECK(v == 42.0);
}

}  // namespace

TEST_CASE("Bad input is rejected before anything is written, naming the row") {
  const token_case good = make_case(6, 8, 13);
  {
    token_case c = good;
    c.tokens[2] = 8;
    expect_objective_rejected<troll::domain_error>(c, {}, 2, "sampled token 8 is outside [0, V)");
    c.tokens[2] = -1;
    expect_objective_rejected<troll::domain_error>(c, {}, 2, "outside [0, V)");
  }
  {
    token_case c = good;
    c.advantages[3] = nan_value;
    expect_objective_rejected<troll::domain_error>(c, {}, 3, "advantage is nan");
  }
  {
    token_case c = good;
    c.mask[1] = -0.5;
    expect_objective_rejected<troll::domain_error>(c, {}, 1, "loss mask");
  }
  {
    token_case c = good;
    c.aggregation = troll::loss_aggregation::sequence_mean;
    c.sequence_ids[5] = 0;
    expect_objective_rejected<troll::domain_error>(c, {}, 5, "non-decreasing");
  }
  {
    token_case c = good;
    c.logits.old_row(0)[std::size_t(c.tokens[0])] = neg_inf;
    expect_objective_rejected<troll::domain_error>(c, {}, 0, "q_a = 0");
  }
  {
    token_case c = good;
    c.logits.new_row(3)[1] = nan_value;
    expect_objective_rejected<troll::domain_error>(c, {}, 3, "new_logits is NaN at token 1");
  }
  {
    token_case c = good;  // new mass where the old row masks: KL(p̃‖π*) = +inf with α > 0
    c.logits.old_row(1)[(std::size_t(c.tokens[1]) + 1) % 8] = neg_inf;
    expect_objective_rejected<troll::domain_error>(c, {}, 1, "KL(p_new || pi*)", false);
    troll::trust_region_objective no_regression;
    no_regression.alpha = 0.0;
    const troll_run run = run_troll(c, no_regression);  // fine without the regression term
    CHECK(std::isfinite(run.metrics.loss));
  }
  {
    token_case c = good;
    troll::token_batch<double> b = c.batch();
    b.tokens = nullptr;
    std::vector<double> lp(6 * 8);
    std::vector<troll::projection_stats> stats(6);
    CHECK_THROWS_AS(troll::objective_forward(troll::cpu, troll::trust_region_objective{},
                                             troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                             troll::make_batch(good.logits.old_logits.data(), 6, 8), b,
                                             troll::make_batch(lp.data(), 6, 8), stats.data()),
                    troll::shape_error);
    b = good.batch();
    b.aggregation = troll::loss_aggregation::sequence_mean;
    b.sequence_ids = nullptr;
    CHECK_THROWS_AS(troll::objective_forward(troll::cpu, troll::ppo_clip_objective{},
                                             troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                             troll::make_batch(good.logits.old_logits.data(), 6, 8), b),
                    troll::shape_error);
  }
  {
    troll::trust_region_objective o;
    o.eps = 0.0;
    expect_objective_rejected<troll::domain_error>(good, o, troll::invalid_input::npos, "eps must be finite", false);
    o.eps = 0.05;
    o.alpha = nan_value;
    expect_objective_rejected<troll::domain_error>(good, o, troll::invalid_input::npos, "alpha", false);
  }
  {
    troll::ppo_clip_objective o;
    o.dual_clip = 0.5;
    CHECK_THROWS_AS(troll::objective_forward(troll::cpu, o, troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                             troll::make_batch(good.logits.old_logits.data(), 6, 8), good.batch()),
                    troll::domain_error);
    troll::dppo_objective d = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);
    d.top_k = 0;
    CHECK_THROWS_AS(troll::objective_forward(troll::cpu, d, troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                             troll::make_batch(good.logits.old_logits.data(), 6, 8), good.batch()),
                    troll::domain_error);
  }
  {
    // Unusable stats in the backward.
    const troll_run run = run_troll(good, troll::trust_region_objective{});
    std::vector<troll::projection_stats> stats = run.stats;
    std::size_t projected_row = 0;
    while (!stats[projected_row].active()) ++projected_row;
    stats[projected_row].sigma2 = 0.0;
    std::vector<double> grad(6 * 8, 42.0);
    CHECK_THROWS_AS(troll::objective_backward(troll::cpu, troll::trust_region_objective{},
                                              troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                              troll::make_batch(good.logits.old_logits.data(), 6, 8), good.batch(),
                                              troll::make_batch(run.log_probs.data(), 6, 8), stats.data(),
                                              troll::make_batch(grad.data(), 6, 8)),
                    troll::domain_error);
    for (double v : grad) CHECK(v == 42.0);
  }
  {
    // Row by row: a bad log-prob in row 4 and unusable stats in row 2 name row 2 (log_probs were
    // checked over every row before any row's stats, and named row 4); in one row, log_probs
    // before stats. The device's checked mode reports the same.
    const troll_run run = run_troll(good, troll::trust_region_objective{});
    for (int both_in_row : {0, 1}) {
      std::vector<troll::projection_stats> stats = run.stats;
      std::vector<double> lp = run.log_probs;
      const std::size_t stats_row = 2, lp_row = both_in_row ? 2 : 4;
      stats[stats_row].status = troll::row_status::not_converged;
      lp[lp_row * 8 + 3] = nan_value;
      std::vector<double> grad(6 * 8, 42.0);
      bool thrown = false;
      try {
        troll::objective_backward(troll::cpu.with_threads(both_in_row ? 1u : 3u), troll::trust_region_objective{},
                                  troll::make_batch(good.logits.new_logits.data(), 6, 8),
                                  troll::make_batch(good.logits.old_logits.data(), 6, 8), good.batch(),
                                  troll::make_batch(lp.data(), 6, 8), stats.data(), troll::make_batch(grad.data(), 6, 8));
      } catch (const troll::domain_error& e) {
        thrown = true;
        CHECK(e.row() == 2);
        CHECK(e.code() == (both_in_row ? troll::row_error::nan_value : troll::row_error::bad_stats));
      }
      CHECK(thrown);
      for (double v : grad) CHECK(v == 42.0);
    }
  }
}

namespace {

/// Every objective's loss and gradient on one row pair, in double.
struct shifted_run {
  double loss = 0.0;
  std::vector<double> grad;
};

template <class Objective>
shifted_run run_shifted(const Objective& o, const std::vector<double>& zn, const std::vector<double>& zo,
                        std::int64_t token, double advantage) {
  const std::size_t V = zn.size();
  shifted_run out;
  out.grad.assign(V, 0.0);
  troll::token_batch<double> in;
  in.tokens = &token;
  in.advantages = &advantage;
  const auto n = troll::make_batch(zn.data(), 1, V), q = troll::make_batch(zo.data(), 1, V);
  if constexpr (std::is_same<Objective, troll::trust_region_objective>::value) {
    std::vector<double> log_probs(V);
    troll::projection_stats stats;
    out.loss = troll::objective_forward(troll::cpu, o, n, q, in, troll::make_batch(log_probs.data(), 1, V), &stats).loss;
    troll::objective_backward(troll::cpu, o, n, q, in, troll::make_batch(log_probs.data(), 1, V), &stats,
                              troll::make_batch(out.grad.data(), 1, V));
  } else {
    out.loss = troll::objective_forward(troll::cpu, o, n, q, in).loss;
    troll::objective_backward(troll::cpu, o, n, q, in, troll::make_batch(out.grad.data(), 1, V));
  }
  return out;
}

}  // namespace

TEST_CASE("Logits with a huge common offset: every objective as accurate as on the unshifted row") {
  // The rows below are exact multiples of 1/64, so z + 1e4 and z ± 1e8 are the same distributions
  // bit for bit. A log-probability formed as z_a − (max + log Σ) rounds to the ulp of the offset
  // (7.5e-9 at 1e8): before the fix the ratio, the loss and the gradient of every objective were
  // off by up to 7e-9 relative at 1e8 (4e-11 at 1e6) against a 50-digit oracle; now 4e-16
  // (TROLL: 1.1e-12, its root solve's tolerance).
  const std::vector<double> base_new = {0.75, -0.5, 0.25, 1.5, -1.25, 0.125};
  const std::vector<double> base_old = {0.5, 0.0, 0.25, -0.25, 0.375, -1.0};
  troll::ppo_clip_objective ppo;
  ppo.clip_high = 10.0;  // the ratio here is ≈ 4.4: unclipped, so the gradient is not 0
  const auto dppo_kl = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);
  troll::trust_region_objective troll_loss;  // ε = 0.05: this row is projected
  for (const double advantage : {1.0, -1.0}) {
    for (const double shift : {1e4, 1e8, -1e8}) {
      CAPTURE(advantage);
      CAPTURE(shift);
      std::vector<double> zn = base_new, zo = base_old;
      for (double& z : zn) z += shift;
      for (double& z : zo) z -= shift / 2;
      auto same = [&](const shifted_run& shifted, const shifted_run& plain) {
        CHECK(std::abs(shifted.loss - plain.loss) <= 1e-14 + 1e-13 * std::abs(plain.loss));
        double largest = 0.0;
        for (double g : plain.grad) largest = std::max(largest, std::abs(g));
        for (std::size_t j = 0; j < zn.size(); ++j)
          CHECK(std::abs(shifted.grad[j] - plain.grad[j]) <= 1e-14 + 1e-13 * largest);
      };
      same(run_shifted(ppo, zn, zo, 3, advantage), run_shifted(ppo, base_new, base_old, 3, advantage));
      same(run_shifted(dppo_kl, zn, zo, 3, advantage), run_shifted(dppo_kl, base_new, base_old, 3, advantage));
      same(run_shifted(troll_loss, zn, zo, 3, advantage),
           run_shifted(troll_loss, base_new, base_old, 3, advantage));
      // PPO's loss against long double: −r·A, r = p̃_3 / q_3 from the unshifted rows.
      long double sn = 0, so = 0;
      for (std::size_t j = 0; j < zn.size(); ++j) {
        sn += std::exp(static_cast<long double>(base_new[j]));
        so += std::exp(static_cast<long double>(base_old[j]));
      }
      const long double r = std::exp(static_cast<long double>(base_new[3] - base_old[3])) * so / sn;
      CHECK(std::abs(run_shifted(ppo, zn, zo, 3, advantage).loss + double(r) * advantage) <= 1e-13 * double(r));
    }
  }
}

TEST_CASE_TEMPLATE("DPPO binary KL of a token whose probability only rounds to 1 is finite (CPU)", T, double, float) {
  // log p̃_a = (z_a − max) − log Σ is exactly 0 once 1 − p̃_a < 1.1e-16 (a top-logit gap of ~37);
  // binary_kl took that for π = 1 and returned +inf: the token was dropped (A > 0, π > μ) and
  // divergence_mean was +inf. Oracle in long double with 1 − p summed over the other tokens.
  const std::vector<T> zo = {T(0), T(-35), T(-35)}, zn = {T(0), T(-40), T(-40)};
  const std::vector<troll::token_id> tokens = {0};
  const std::vector<T> advantages = {T(1)};
  troll::token_batch<T> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  std::vector<T> token_loss(1), grad(3);
  const auto objective = troll::dppo_objective::defaults(troll::dppo_divergence::binary_kl);
  const troll::objective_metrics m = troll::objective_forward(
      troll::cpu, objective, troll::make_batch<const T>(zn.data(), 1, 3), troll::make_batch<const T>(zo.data(), 1, 3),
      in, token_loss.data());
  const long double rest_mu = 2 * std::exp(-35.0L) / (1 + 2 * std::exp(-35.0L));
  const long double rest_pi = 2 * std::exp(-40.0L) / (1 + 2 * std::exp(-40.0L));
  const long double mu = 1 - rest_mu, pi = 1 - rest_pi;
  const long double kl = mu * std::log(mu / pi) + rest_mu * std::log(rest_mu / rest_pi);
  INFO("divergence_mean " << m.divergence_mean << ", oracle " << double(kl));
  CHECK(std::isfinite(m.divergence_mean));
  // 1 − μ = 1.3e-15 comes from log Σ = log(1 + 2.5e-15) in double (~4% off): the divergence is
  // right to that, absolutely ~1e-16 — far below any δ, which is what the mask compares.
  CHECK(std::abs(m.divergence_mean - double(kl)) <= 0.1 * double(kl));
  CHECK(m.limited_fraction == 0.0);  // 5e-15 is far below δ = 0.05: kept
  CHECK(std::abs(m.loss - double(-pi / mu)) <= 1e-6);
  troll::objective_backward(troll::cpu, objective, troll::make_batch<const T>(zn.data(), 1, 3),
                            troll::make_batch<const T>(zo.data(), 1, 3), in, troll::make_batch(grad.data(), 1, 3));
  // Kept, so the gradient is the surrogate's −A r (δ_ja − p̃_j): A r p̃_j > 0 at j = 1, 2 (it was 0).
  CHECK(grad[1] > T(0));
  CHECK(grad[2] > T(0));
}
