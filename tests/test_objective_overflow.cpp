#include <doctest/doctest.h>

// Tokens far in the old policy's tail (issue 10, item 4): the importance ratio ρ = π_a / q_a of
// a sampled token with old log-probability ≈ −709 (double) or ≈ −88 (float) overflows. Every
// objective returns ρ, the loss and the gradient exactly where they fit (double ρ, T loss and
// gradient), and otherwise throws domain_error naming the row and the quantity — never ±inf or
// NaN. The expectations come from long double: ρ, PPO's and DPPO's losses in closed form.

#include <troll/objectives.hpp>
#include <troll/sparse.hpp>
#include <troll/sparse_objectives.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "expect_error.hpp"

namespace {

using ld = long double;

/// One row family: V = 6 tokens, the sampled token 5 sits `gap` below the rest in the old row.
template <class T>
struct tail_case {
  std::size_t rows = 0, V = 6;
  std::vector<T> zn, zo, adv;
  std::vector<std::int64_t> tok;

  tail_case(const std::vector<double>& gaps, double advantage) : rows(gaps.size()) {
    const double base_new[6] = {1.0, 0.5, 0.2, -0.3, 0.1, 0.0};
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < V; ++j) {
        zn.push_back(T(base_new[j]));
        zo.push_back(j == 5 ? T(-gaps[r]) : T(0.1 * double(j)));
      }
      tok.push_back(5);
      adv.push_back(T(advantage));
    }
  }
  troll::token_batch<T> batch() const {
    troll::token_batch<T> b;
    b.tokens = tok.data();
    b.advantages = adv.data();
    return b;
  }
  troll::input_view<T> news() const { return troll::make_batch<const T>(zn.data(), rows, V); }
  troll::input_view<T> olds() const { return troll::make_batch<const T>(zo.data(), rows, V); }

  /// log softmax of row r at the sampled token, in long double.
  static ld log_prob(const std::vector<T>& z, std::size_t r, std::size_t V) {
    ld m = -INFINITY, s = 0;
    for (std::size_t j = 0; j < V; ++j) m = std::max(m, ld(z[r * V + j]));
    for (std::size_t j = 0; j < V; ++j) s += std::exp(ld(z[r * V + j]) - m);
    return ld(z[r * V + 5]) - m - std::log(s);
  }
  ld log_ratio(std::size_t r) const { return log_prob(zn, r, V) - log_prob(zo, r, V); }
};

template <class T>
constexpr ld largest() {
  return ld(std::numeric_limits<T>::max());
}

bool all_finite_of(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}
bool all_finite_of(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

/// PPO clip (ε = 0.2 both sides) at one row, in long double: the loss, and whether the
/// gradient's coefficient ∂ℓ/∂r·r is non-zero.
struct ppo_expect {
  ld loss = 0, coef = 0;
};
ppo_expect ppo_of(ld log_ratio, ld A) {
  const ld r = std::exp(log_ratio);
  const ld clipped = std::min(std::max(r, ld(0.8)), ld(1.2));
  ppo_expect e;
  if (r * A <= clipped * A) {
    e.loss = -r * A;
    e.coef = -A * r;
  } else {
    e.loss = -clipped * A;
  }
  return e;
}

const std::vector<double> gaps = {0.0, 60.0, 85.0, 95.0, 300.0, 700.0, 712.0, 760.0, 1e9, 3e38};

template <class T>
void check_ppo(double advantage) {
  for (double gap : gaps) {
    const tail_case<T> c({gap}, advantage);
    const ld lr = c.log_ratio(0);
    const ppo_expect e = ppo_of(lr, ld(advantage));
    const bool ratio_fits = std::exp(lr) <= largest<double>();
    const bool fits = ratio_fits && std::fabs(e.loss) <= largest<T>() && std::fabs(e.coef) <= largest<T>();
    CAPTURE(gap);
    CAPTURE(advantage);
    std::vector<T> token_loss(1, T(42)), grad(c.V, T(42));
    const troll::ppo_clip_objective o;
    if (!fits) {
      // Forward or backward reports it (the loss may fit while the gradient does not).
      bool thrown = false;
      try {
        troll::objective_forward(troll::cpu, o, c.news(), c.olds(), c.batch(), token_loss.data());
        CHECK(std::isfinite(double(token_loss[0])));
        troll::objective_backward(troll::cpu, o, c.news(), c.olds(), c.batch(),
                                  troll::make_batch(grad.data(), 1, c.V));
      } catch (const troll::domain_error& err) {
        thrown = true;
        CHECK(err.row() == 0);
        CHECK_MESSAGE(std::string(err.what()).find("overflows") != std::string::npos, err.what());
      }
      CHECK(thrown);
      for (T g : grad) CHECK(g == T(42));  // the backward's checks come before its writes
      continue;
    }
    const troll::objective_metrics m =
        troll::objective_forward(troll::cpu, o, c.news(), c.olds(), c.batch(), token_loss.data());
    troll::objective_backward(troll::cpu, o, c.news(), c.olds(), c.batch(), troll::make_batch(grad.data(), 1, c.V));
    const double rtol = sizeof(T) == 4 ? 1e-5 : 1e-11;
    CHECK(double(token_loss[0]) == doctest::Approx(double(e.loss)).epsilon(rtol));
    CHECK(m.ratio_mean == doctest::Approx(double(std::exp(lr))).epsilon(1e-11 * (1.0 + std::fabs(double(lr)))));
    CHECK(all_finite_of(grad));
    // The sampled token's entry: coef·(1 − p̃_a).
    const ld pa = std::exp(tail_case<T>::log_prob(c.zn, 0, c.V));
    CHECK(double(grad[5]) == doctest::Approx(double(e.coef * (1 - pa))).epsilon(rtol));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("PPO clip: huge importance ratios are exact where they fit, rejected where not", T, float,
                   double) {
  check_ppo<T>(1.0);
  check_ppo<T>(-1.0);
  check_ppo<T>(0.0);
  check_ppo<T>(1e-30);
}

TEST_CASE_TEMPLATE("DPPO and TROLL: no ±inf or NaN from huge ratios, a typed error instead", T, float, double) {
  for (double advantage : {1.0, -1.0, 0.0}) {
    for (double gap : gaps) {
      const tail_case<T> c({gap}, advantage);
      const ld lr = c.log_ratio(0);
      CAPTURE(gap);
      CAPTURE(advantage);
      std::vector<T> token_loss(1, T(42)), grad(c.V, T(42)), log_probs(c.V, T(42));
      std::vector<troll::projection_stats> stats(1);
      auto check_error = [&](const troll::domain_error& err) {
        CHECK(err.row() == 0);
        CHECK_MESSAGE(std::string(err.what()).find("overflows") != std::string::npos, err.what());
      };
      // DPPO (binary TV): ρ and the loss −ρA when kept.
      try {
        const troll::dppo_objective o;
        const troll::objective_metrics m =
            troll::objective_forward(troll::cpu, o, c.news(), c.olds(), c.batch(), token_loss.data());
        CHECK(std::exp(lr) <= largest<double>());
        CHECK(std::isfinite(m.loss));
        CHECK(std::isfinite(double(token_loss[0])));
        troll::objective_backward(troll::cpu, o, c.news(), c.olds(), c.batch(),
                                  troll::make_batch(grad.data(), 1, c.V));
        CHECK(all_finite_of(grad));
      } catch (const troll::domain_error& err) {
        check_error(err);
        CHECK((std::exp(lr) > largest<T>() / 4 || gap > 80));
      }
      // TROLL: ρ = π*_a / q_a after the projection.
      try {
        const troll::trust_region_objective o;
        const troll::objective_metrics m = troll::objective_forward(
            troll::cpu, o, c.news(), c.olds(), c.batch(), troll::make_batch(log_probs.data(), 1, c.V),
            stats.data(), token_loss.data());
        CHECK(std::isfinite(m.loss));
        CHECK(std::isfinite(double(token_loss[0])));
        const ld expect_ratio = std::exp(ld(log_probs[5]) - tail_case<T>::log_prob(c.zo, 0, c.V));
        CHECK(m.ratio_mean == doctest::Approx(double(expect_ratio)).epsilon(1e-9));
        troll::objective_backward(troll::cpu, o, c.news(), c.olds(), c.batch(),
                                  troll::make_batch<const T>(log_probs.data(), 1, c.V), stats.data(),
                                  troll::make_batch(grad.data(), 1, c.V));
        CHECK(all_finite_of(grad));
      } catch (const troll::domain_error& err) {
        check_error(err);
        CHECK(token_loss[0] == T(42));  // thrown before anything is written
        if (stats[0].iterations == 0)       // the forward threw (not the backward)
          for (T v : log_probs) CHECK(v == T(42));
      }
    }
  }
}

TEST_CASE("The lowest overflowing row is named, and nothing of the losses is written") {
  const tail_case<double> c({0.0, 1.0, 800.0, 2.0, 900.0}, -1.0);
  std::vector<double> token_loss(c.rows, 42.0);
  troll_test::expect_rejected<troll::domain_error>(
      [&] { troll::objective_forward(troll::cpu, troll::ppo_clip_objective{}, c.news(), c.olds(), c.batch(), token_loss.data()); },
      2, "importance ratio at sampled token 5 overflows double");
  for (double v : token_loss) CHECK(v == 42.0);
  std::vector<double> grad(c.rows * c.V, 42.0);
  troll_test::expect_rejected<troll::domain_error>(
      [&] {
        troll::objective_backward(troll::cpu, troll::ppo_clip_objective{}, c.news(), c.olds(), c.batch(),
                                  troll::make_batch(grad.data(), c.rows, c.V));
      },
      2, "row 2");
  for (double v : grad) CHECK(v == 42.0);
  // Rows with loss mask 0 are not checked (their ρ is never formed).
  std::vector<double> mask = {1, 1, 0, 1, 0};
  troll::token_batch<double> b = c.batch();
  b.loss_mask = mask.data();
  const troll::objective_metrics m =
      troll::objective_forward(troll::cpu, troll::ppo_clip_objective{}, c.news(), c.olds(), b, token_loss.data());
  CHECK(std::isfinite(m.loss));
  CHECK(token_loss[2] == 0.0);
}

TEST_CASE("An overflow from a huge grad_loss blames grad_loss, not the token") {
  // gap 0: the sampled token is ordinary (ρ near 1); the float gradient overflows only because
  // grad_loss is near float's largest value. The message must not call the token implausible.
  const tail_case<float> c({0.0}, 1.0);
  std::vector<float> grad(c.V, 42.0f);
  bool thrown = false;
  try {
    troll::objective_backward(troll::cpu, troll::ppo_clip_objective{}, c.news(), c.olds(), c.batch(),
                              troll::make_batch(grad.data(), 1, c.V), 1e300);
  } catch (const troll::domain_error& err) {
    thrown = true;
    const std::string what = err.what();
    CHECK(err.row() == 0);
    CHECK_MESSAGE(what.find("grad_loss") != std::string::npos, what);
    CHECK_MESSAGE(what.find("not sampled from") == std::string::npos, what);
  }
  CHECK(thrown);
  for (float g : grad) CHECK(g == 42.0f);
  // A ratio beyond half of double's log range still points at the token.
  const tail_case<double> far({760.0}, 1.0);
  troll_test::expect_rejected<troll::domain_error>(
      [&] {
        std::vector<double> token_loss(1);
        troll::objective_forward(troll::cpu, troll::ppo_clip_objective{}, far.news(), far.olds(), far.batch(),
                                 token_loss.data());
      },
      0, "not sampled from");
}

TEST_CASE_TEMPLATE("A regression term alpha*KL that overflows is reported before anything is written", T, float,
                   double) {
  // α passes its own check (finite, ≥ 0), but α·KL(p̃‖π*) does not fit T: the forward used to
  // find it only after log_probs and stats were written (an audit: float α = 1e39). Two rows far
  // from each other (KL(p̃‖π*) of tens at ε = 1e-3), advantage 0 (the ratio term is 0).
  const std::size_t rows = 2, V = 6;
  std::vector<T> zn(rows * V), zo(rows * V), adv(rows, T(0));
  for (std::size_t i = 0; i < rows * V; ++i) zn[i] = T(10.0 * std::cos(double(i))), zo[i] = T(-10.0 * std::cos(double(i)));
  std::vector<std::int64_t> tok{1, 2};
  troll::token_batch<T> b;
  b.tokens = tok.data();
  b.advantages = adv.data();
  const auto nv = troll::make_batch<const T>(zn.data(), rows, V), ov = troll::make_batch<const T>(zo.data(), rows, V);
  troll::trust_region_objective o;
  o.eps = 1e-3;
  o.alpha = std::is_same<T, float>::value ? 1e300 : std::numeric_limits<double>::max() / 2;
  std::vector<T> token_loss(rows, T(42)), log_probs(rows * V, T(42));
  std::vector<troll::projection_stats> stats(rows);
  stats[0].t = stats[1].t = 0.125;
  troll_test::expect_rejected<troll::domain_error>(
      [&] {
        troll::objective_forward(troll::cpu, o, nv, ov, b, troll::make_batch(log_probs.data(), rows, V), stats.data(),
                                 token_loss.data());
      },
      0, "overflows");
  for (T v : log_probs) CHECK(v == T(42));
  for (T v : token_loss) CHECK(v == T(42));
  CHECK(stats[0].t == 0.125);
  CHECK(stats[1].t == 0.125);
  // The sparse objective on the same rows (every token kept).
  troll::sparse_trust_region_objective so;
  so.eps = o.eps;
  so.alpha = o.alpha;
  const std::size_t k = V;
  std::vector<troll::sparse_index> idx(rows * k), cnt(rows), aidx(rows * k, -7), acnt(rows, -7), lidx(rows * k, -7),
      lcnt(rows, -7);
  std::vector<T> olp(rows * k), orem(rows), anew(rows * k, T(42)), aold(rows * k, T(42)), anrem(rows, T(42)),
      aorem(rows, T(42)), llp(rows * k, T(42)), lrem(rows, T(42));
  troll::sparsify(troll::cpu, ov, nullptr, {int(k), 0.0},
                  troll::sparse_batch_view<T>{idx.data(), olp.data(), cnt.data(), orem.data(), rows, k, V});
  troll_test::expect_rejected<troll::domain_error>(
      [&] {
        troll::objective_forward(
            troll::cpu, so, nv, troll::sparse_batch_view<const T>{idx.data(), olp.data(), cnt.data(), orem.data(), rows, k, V},
            b,
            troll::aligned_batch_view<T>{aidx.data(), acnt.data(), anew.data(), aold.data(), anrem.data(), aorem.data(),
                                         rows, k, V},
            troll::sparse_batch_view<T>{lidx.data(), llp.data(), lcnt.data(), lrem.data(), rows, k, V}, stats.data(),
            token_loss.data());
      },
      0, "overflows");
  for (T v : anew) CHECK(v == T(42));
  for (T v : llp) CHECK(v == T(42));
  for (T v : token_loss) CHECK(v == T(42));
  CHECK(stats[0].t == 0.125);
  // An ordinary α on the same rows is accepted.
  o.alpha = 1.0;
  troll::objective_forward(troll::cpu, o, nv, ov, b, troll::make_batch(log_probs.data(), rows, V), stats.data(),
                           token_loss.data());
  CHECK(std::isfinite(double(token_loss[0])));
  CHECK(double(token_loss[0]) > 1.0);  // KL(p̃‖π*) of these rows
}

TEST_CASE("TROLL's forward ignores rows with mask 0 whatever a caller's workspace held before") {
  // The forward's per-row flags live in the workspace; a row with mask 0 (token −100: an ignore
  // index) must not be taken for a flagged row because of the bytes left there.
  const tail_case<double> c({0.0, 1.0}, 1.0);
  std::vector<std::int64_t> tokens{-100, 5};
  std::vector<double> mask{0.0, 1.0};
  troll::token_batch<double> b = c.batch();
  b.tokens = tokens.data();
  b.loss_mask = mask.data();
  const troll::trust_region_objective o;
  const std::size_t bytes = troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, o, c.rows, c.V);
  std::vector<unsigned char> workspace(bytes + 64, 0xFF);
  std::vector<double> token_loss(c.rows), log_probs(c.rows * c.V);
  std::vector<troll::projection_stats> stats(c.rows);
  const troll::objective_metrics m = troll::objective_forward(
      troll::cpu.with_workspace(workspace.data(), bytes), o, c.news(), c.olds(), b,
      troll::make_batch(log_probs.data(), c.rows, c.V), stats.data(), token_loss.data());
  CHECK(std::isfinite(m.loss));
  CHECK(token_loss[0] == 0.0);
}
