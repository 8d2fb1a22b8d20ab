// Regression tests for issue 10, items 5 and 6: derivatives reject NaN / +inf log-probs and
// log-probs that are not the forward's output for the aligned rows; vocabulary-shard states
// validate themselves (corrupted fields, a state made for another vocabulary, a shard merged
// twice, shards missing, offsets that would wrap); sparse rows must hold mass 1 within the
// documented tolerance. Every rejection is a typed error naming the row, with outputs untouched.
#include <doctest/doctest.h>

#include <troll/objectives.hpp>
#include <troll/projection.hpp>
#include <troll/sparse.hpp>
#include <troll/sparse_objectives.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "sparse_oracle.hpp"

using troll_test::expect_rejected;

namespace {

using sparse_test::aligned_rows;
using sparse_test::sparse_grads;
using sparse_test::sparse_rows;

using troll_test::minus_inf;
using troll_test::nan_value;
using troll_test::plus_inf;

std::vector<double> random_logits(std::size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> z(n);
  for (double& x : z) x = normal(rng);
  return z;
}

}  // namespace

// ---- Item 5: derivatives validate log_probs ----

TEST_CASE("dense project_backward, project_jvp and project_jacobian reject NaN, +inf and positive log_probs") {
  std::mt19937_64 rng(3);
  const std::size_t rows = 4, vocab = 9;
  const std::vector<double> zn = random_logits(rows * vocab, 2.0, rng), zo = random_logits(rows * vocab, 2.0, rng);
  std::vector<double> log_probs(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::make_batch(zo.data(), rows, vocab),
                 0.05, troll::make_batch(log_probs.data(), rows, vocab), stats.data());
  const std::vector<double> upstream = random_logits(rows * vocab, 1.0, rng);

  for (const double bad : {nan_value, plus_inf, 0.5}) {  // 0.5: a probability of e^0.5 > 1
    CAPTURE(bad);
    std::vector<double> lp = log_probs;
    lp[2 * vocab + 5] = bad;
    const std::string what = bad != bad          ? "log_probs is NaN at token 5"
                             : bad == plus_inf ? "log_probs is +inf at token 5"
                                               : "log_probs is 0.5 > 0 at token 5";
    std::vector<double> grad_new(rows * vocab, 42.0), grad_old(rows * vocab, 42.0), grad_eps(rows, 42.0);
    expect_rejected<troll::domain_error>(
        [&] {
          troll::project_backward(troll::cpu, troll::make_batch(zn.data(), rows, vocab),
                                  troll::make_batch(zo.data(), rows, vocab), troll::make_batch(lp.data(), rows, vocab),
                                  stats.data(), troll::make_batch(upstream.data(), rows, vocab),
                                  troll::make_batch(grad_new.data(), rows, vocab),
                                  troll::make_batch(grad_old.data(), rows, vocab), grad_eps.data());
        },
        2, what);
    for (double v : grad_new) CHECK(v == 42.0);
    for (double v : grad_old) CHECK(v == 42.0);
    for (double v : grad_eps) CHECK(v == 42.0);

    std::vector<double> tangent_out(rows * vocab, 42.0);
    expect_rejected<troll::domain_error>(
        [&] {
          troll::project_jvp(troll::cpu, troll::make_batch(zn.data(), rows, vocab),
                             troll::make_batch(zo.data(), rows, vocab), troll::make_batch(lp.data(), rows, vocab),
                             stats.data(), troll::make_batch(upstream.data(), rows, vocab),
                             troll::make_batch(upstream.data(), rows, vocab), 0.5,
                             troll::make_batch(tangent_out.data(), rows, vocab));
        },
        2, what);
    for (double v : tangent_out) CHECK(v == 42.0);

    std::vector<double> jac(rows * vocab * vocab, 42.0);
    expect_rejected<troll::domain_error>(
        [&] {
          troll::project_jacobian(troll::cpu, troll::make_batch(zn.data(), rows, vocab),
                                  troll::make_batch(zo.data(), rows, vocab), troll::make_batch(lp.data(), rows, vocab),
                                  stats.data(), jac.data());
        },
        2, what);
    for (double v : jac) CHECK(v == 42.0);
  }
  // A finite log π* where the new logits mask the token: not the projection of these logits.
  {
    std::vector<double> masked_new = zn, lp = log_probs;
    masked_new[1 * vocab + 4] = minus_inf;
    lp[1 * vocab + 4] = -3.0;
    std::vector<double> grad_new(rows * vocab, 42.0);
    expect_rejected<troll::domain_error>(
        [&] {
          troll::project_backward(troll::cpu, troll::make_batch(masked_new.data(), rows, vocab),
                                  troll::make_batch(zo.data(), rows, vocab), troll::make_batch(lp.data(), rows, vocab),
                                  stats.data(), troll::make_batch(upstream.data(), rows, vocab),
                                  troll::make_batch(grad_new.data(), rows, vocab));
        },
        1, "log_probs is -3 at token 4, which the new or old logits mask");
    for (double v : grad_new) CHECK(v == 42.0);
  }
  // −inf is a masked output, not an error (the row's own masked tokens are −inf already).
  std::vector<double> grad_new(rows * vocab, 42.0);
  troll::project_backward(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::make_batch(zo.data(), rows, vocab),
                          troll::make_batch(log_probs.data(), rows, vocab), stats.data(),
                          troll::make_batch(upstream.data(), rows, vocab), troll::make_batch(grad_new.data(), rows, vocab));
  for (double v : grad_new) CHECK(std::isfinite(v));
}

TEST_CASE("objective_backward (TROLL) rejects NaN, +inf and positive log_probs before writing") {
  std::mt19937_64 rng(4);
  const std::size_t rows = 5, vocab = 11;
  const std::vector<double> zn = random_logits(rows * vocab, 2.0, rng), zo = random_logits(rows * vocab, 2.0, rng);
  std::vector<std::int64_t> tokens{0, 3, 5, 7, 10};
  std::vector<double> advantages{1.0, -1.0, 0.5, 2.0, -0.25};
  troll::token_batch<double> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  const troll::trust_region_objective objective{};
  std::vector<double> log_probs(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::objective_forward(troll::cpu, objective, troll::make_batch(zn.data(), rows, vocab),
                           troll::make_batch(zo.data(), rows, vocab), in,
                           troll::make_batch(log_probs.data(), rows, vocab), stats.data());
  for (const double bad : {nan_value, plus_inf, 1e-3}) {
    CAPTURE(bad);
    std::vector<double> lp = log_probs;
    lp[3 * vocab + 1] = bad;
    std::vector<double> grad(rows * vocab, 42.0);
    expect_rejected<troll::domain_error>(
        [&] {
          troll::objective_backward(troll::cpu, objective, troll::make_batch(zn.data(), rows, vocab),
                                    troll::make_batch(zo.data(), rows, vocab), in,
                                    troll::make_batch(lp.data(), rows, vocab), stats.data(),
                                    troll::make_batch(grad.data(), rows, vocab));
        },
        3, "log_probs is");
    for (double v : grad) CHECK(v == 42.0);
  }
}

// Float logits of both signs near FLT_MAX in one row: a token's true log π* (≈ −6e38) is below
// float's range, and the forward rounds it to −inf (correctly: π* is 0 in any type). Its logits are
// finite, so it is not masked: a derivative that took −inf for a mask would drop the token's
// upstream gradient and give a wrong result without a word (found by an adversarial audit:
// grad_new [0, 0, 0] against the exact [−1, 1, 0] for row 1 below; grad_eps 4.7 against −11.3 for
// row 2). Every dense derivative now refuses the row, naming it, before writing anything; the same
// rows in double have finite log-probabilities and differentiate.
TEST_CASE("dense derivatives refuse a float row whose log-probability is below float's range") {
  const std::size_t rows = 3, vocab = 4;
  const float big = 3e38f;
  // Row 0 ordinary; row 1 inactive (new = old), token 1 at −6e38; row 2 projected, token 1 at ≈ −6e38.
  const std::vector<float> zn{0.5f, -1.0f, 2.0f, 0.0f, big, -big, 0.0f, 1.0f, big, big, 0.0f, 1.0f};
  const std::vector<float> zo{0.0f, 0.5f, 1.0f, -1.0f, big, -big, 0.0f, 1.0f, big, -big, big, 2.0f};
  std::vector<float> lp(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  auto batch = [&](const std::vector<float>& v) { return troll::make_batch(v.data(), rows, vocab); };
  troll::project(troll::cpu, batch(zn), batch(zo), 0.05, troll::make_batch(lp.data(), rows, vocab), stats.data());
  REQUIRE(stats[1].status == troll::row_status::inactive);
  REQUIRE(stats[2].status == troll::row_status::projected);
  CHECK(lp[1 * vocab + 1] == -std::numeric_limits<float>::infinity());  // −6e38 rounded: the forward is right
  CHECK(lp[2 * vocab + 1] == -std::numeric_limits<float>::infinity());
  const std::vector<float> g{0.5f, -1.0f, 0.25f, 2.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.5f, -1.0f, 0.25f, 2.0f};
  const std::string what = "log_probs is -inf at token 1, whose new and old logits are finite";

  std::vector<float> grad_new(rows * vocab, 42.0f), grad_old(rows * vocab, 42.0f), grad_eps(rows, 42.0f);
  expect_rejected<troll::domain_error>(
      [&] {
        troll::project_backward(troll::cpu, batch(zn), batch(zo), batch(lp), stats.data(), batch(g),
                                troll::make_batch(grad_new.data(), rows, vocab),
                                troll::make_batch(grad_old.data(), rows, vocab), grad_eps.data());
      },
      1, what);
  for (float v : grad_new) CHECK(v == 42.0f);
  for (float v : grad_old) CHECK(v == 42.0f);
  for (float v : grad_eps) CHECK(v == 42.0f);
  try {
    troll::project_backward(troll::cpu, batch(zn), batch(zo), batch(lp), stats.data(), batch(g),
                            troll::make_batch(grad_new.data(), rows, vocab));
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 1);
    CHECK(e.code() == troll::row_error::log_prob_underflow);
  }

  std::vector<float> tangent_out(rows * vocab, 42.0f);
  expect_rejected<troll::domain_error>(
      [&] {
        troll::project_jvp(troll::cpu, batch(zn), batch(zo), batch(lp), stats.data(), batch(g), batch(g), 0.5,
                           troll::make_batch(tangent_out.data(), rows, vocab));
      },
      1, what);
  for (float v : tangent_out) CHECK(v == 42.0f);

  std::vector<float> jac(rows * vocab * vocab, 42.0f);
  expect_rejected<troll::domain_error>(
      [&] { troll::project_jacobian(troll::cpu, batch(zn), batch(zo), batch(lp), stats.data(), jac.data()); }, 1,
      what);
  for (float v : jac) CHECK(v == 42.0f);

  // Only rows 2 on: the projected row is refused too.
  std::vector<float> one(vocab, 42.0f);
  expect_rejected<troll::domain_error>(
      [&] {
        troll::project_backward(troll::cpu, troll::make_batch(zn.data() + 2 * vocab, 1, vocab),
                                troll::make_batch(zo.data() + 2 * vocab, 1, vocab),
                                troll::make_batch(lp.data() + 2 * vocab, 1, vocab), stats.data() + 2,
                                troll::make_batch(g.data() + 2 * vocab, 1, vocab), troll::make_batch(one.data(), 1, vocab));
      },
      0, what);

  // The TROLL objective's backward reads the same log π* (rows 0 and 1: row 2's loss at any token
  // overflows float already in the forward, a documented objective_overflow).
  const std::size_t orows = 2;
  std::vector<std::int64_t> tokens{0, 0};
  std::vector<float> advantages{1.0f, -1.0f};
  troll::token_batch<float> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  const troll::trust_region_objective objective{};
  std::vector<float> olp(orows * vocab);
  std::vector<troll::projection_stats> ostats(orows);
  auto obatch = [&](const std::vector<float>& v) { return troll::make_batch(v.data(), orows, vocab); };
  troll::objective_forward(troll::cpu, objective, obatch(zn), obatch(zo), in,
                           troll::make_batch(olp.data(), orows, vocab), ostats.data());
  std::vector<float> ograd(orows * vocab, 42.0f);
  expect_rejected<troll::domain_error>(
      [&] {
        troll::objective_backward(troll::cpu, objective, obatch(zn), obatch(zo), in, obatch(olp), ostats.data(),
                                  troll::make_batch(ograd.data(), orows, vocab));
      },
      1, what);
  for (float v : ograd) CHECK(v == 42.0f);

  // In double the same rows fit: the inactive row's gradient is the exact g − π Σg = [−1, 1, 0, 0].
  std::vector<double> dn(zn.begin(), zn.end()), dz(zo.begin(), zo.end()), dlp(rows * vocab), dg(g.begin(), g.end());
  std::vector<troll::projection_stats> dstats(rows);
  std::vector<double> dgrad(rows * vocab);
  auto dbatch = [&](std::vector<double>& v) { return troll::make_batch<const double>(v.data(), rows, vocab); };
  troll::project(troll::cpu, dbatch(dn), dbatch(dz), 0.05, troll::make_batch(dlp.data(), rows, vocab), dstats.data());
  for (double v : dlp) CHECK(std::isfinite(v));
  troll::project_backward(troll::cpu, dbatch(dn), dbatch(dz), dbatch(dlp), dstats.data(), dbatch(dg),
                          troll::make_batch(dgrad.data(), rows, vocab));
  CHECK(dgrad[1 * vocab + 0] == doctest::Approx(-1.0));
  CHECK(dgrad[1 * vocab + 1] == doctest::Approx(1.0));
  CHECK(dgrad[1 * vocab + 2] == doctest::Approx(0.0));
  CHECK(dgrad[1 * vocab + 3] == doctest::Approx(0.0));
}

namespace {

/// Two sparse rows per batch (V = 12), aligned and projected: the inputs of the sparse backward.
struct sparse_backward_case {
  static constexpr std::size_t rows = 2, k = 6, vocab = 12;
  sparse_rows<double> new_rows{rows, k, vocab}, old_rows{rows, k, vocab};
  aligned_rows<double> aligned{rows, 2 * k, vocab};
  sparse_rows<double> log_probs{rows, 2 * k, vocab};
  std::vector<troll::projection_stats> stats = std::vector<troll::projection_stats>(rows);

  sparse_backward_case() {
    // Row r: support {0, 1, 2} (+ r) with probabilities 0.5, 0.2, 0.1 and the rest in the tail.
    const double p_new[3] = {0.5, 0.2, 0.1}, p_old[3] = {0.1, 0.3, 0.4};
    for (std::size_t r = 0; r < rows; ++r) {
      new_rows.counts[r] = old_rows.counts[r] = 3;
      for (std::size_t i = 0; i < 3; ++i) {
        new_rows.indices[r * k + i] = troll::sparse_index(i + r);
        old_rows.indices[r * k + i] = troll::sparse_index(2 * i + r);
        new_rows.log_probs[r * k + i] = std::log(p_new[i]);
        old_rows.log_probs[r * k + i] = std::log(p_old[i]);
      }
      new_rows.log_remainder[r] = std::log(0.2);
      old_rows.log_remainder[r] = std::log(0.2);
    }
    troll::align(troll::cpu, new_rows.view(), old_rows.view(), aligned.view());
    troll::project(troll::cpu, troll::aligned_batch_view<const double>(aligned.view()), 0.01, log_probs.view(),
                   stats.data());
  }
};

}  // namespace

TEST_CASE("sparse project_backward rejects +inf / NaN log_probs and ids that are not the aligned ones") {
  const sparse_backward_case c;
  const std::size_t rows = c.rows, cap = 2 * c.k;
  sparse_grads<double> grad(rows, cap);
  for (double& g : grad.log_probs) g = 0.25;
  auto run = [&](const sparse_rows<double>& lp) {
    sparse_grads<double> grad_new(rows, cap), grad_old(rows, cap);
    for (double& g : grad_new.log_probs) g = 42.0;
    for (double& g : grad_old.log_probs) g = 42.0;
    std::vector<double> grad_eps(rows, 42.0);
    aligned_rows<double> al = c.aligned;
    bool thrown = false;
    try {
      troll::project_backward(troll::cpu, troll::aligned_batch_view<const double>(al.view()), lp.view(), c.stats.data(),
                              troll::sparse_grad_view<const double>(grad.view()), grad_new.view(), grad_old.view(),
                              grad_eps.data());
    } catch (...) {
      thrown = true;
      for (double g : grad_new.log_probs) CHECK(g == 42.0);
      for (double g : grad_old.log_probs) CHECK(g == 42.0);
      for (double g : grad_eps) CHECK(g == 42.0);
      throw;
    }
    CHECK(!thrown);
  };
  run(c.log_probs);  // the forward's own output is accepted

  sparse_rows<double> lp = c.log_probs;
  lp.log_probs[1 * cap + 2] = plus_inf;
  expect_rejected<troll::domain_error>([&] { run(lp); }, 1, "entry 2 is inf > 0");
  lp = c.log_probs;
  lp.log_remainder[1] = plus_inf;
  expect_rejected<troll::domain_error>([&] { run(lp); }, 1, "log_remainder is inf > 0");
  lp = c.log_probs;
  lp.log_probs[0 * cap + 1] = nan_value;
  expect_rejected<troll::domain_error>([&] { run(lp); }, 0, "is NaN");

  // A permuted order: the same ids and values, another order (values follow their ids).
  lp = c.log_probs;
  std::swap(lp.indices[1 * cap + 0], lp.indices[1 * cap + 3]);
  std::swap(lp.log_probs[1 * cap + 0], lp.log_probs[1 * cap + 3]);
  expect_rejected<troll::shape_error>([&] { run(lp); }, 1, "entry 0 holds token");
  lp = c.log_probs;
  lp.indices[0 * cap + 1] = -7;
  expect_rejected<troll::shape_error>([&] { run(lp); }, 0, "entry 1 holds token -7");
  lp = c.log_probs;
  lp.indices[1 * cap + 2] = troll::sparse_index(c.vocab + 3);
  expect_rejected<troll::shape_error>([&] { run(lp); }, 1, "entry 2 holds token 15");
}

// ---- Item 6: vocabulary-shard states ----

namespace {

/// A row pair of V = 300 logits and its two shards [0, 170), [170, 300), made with k = 8.
struct shard_case {
  static constexpr std::size_t rows = 2, vocab = 300, cut = 170;
  const troll::sparsify_options options{8, 1e-4};
  std::vector<double> z;
  std::vector<troll::token_id> sampled{5, 250};
  std::vector<troll::sparsify_state> left = std::vector<troll::sparsify_state>(rows);
  std::vector<troll::sparsify_state> right = std::vector<troll::sparsify_state>(rows);

  shard_case() {
    std::mt19937_64 rng(8);
    z = random_logits(rows * vocab, 3.0, rng);
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), rows, cut, vocab}, 0, vocab,
                          sampled.data(), options, left.data());
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data() + cut, rows, vocab - cut, vocab}, cut,
                          vocab, sampled.data(), options, right.data());
  }
  std::vector<troll::sparsify_state> merged() const {
    std::vector<troll::sparsify_state> into = left;
    troll::sparsify_merge(troll::cpu, into.data(), right.data(), rows);
    return into;
  }
};

/// sparsify_finalize into sentinel-filled rows; expects E at `row` with `fragment`, out untouched.
template <class E>
void expect_finalize_rejected(const std::vector<troll::sparsify_state>& states, const troll::sparsify_options& options,
                              std::size_t vocab, std::size_t row, const std::string& fragment) {
  sparse_rows<double> out(states.size(), 9, vocab);
  const sparse_rows<double> before = out;
  expect_rejected<E>([&] { troll::sparsify_finalize(troll::cpu, states.data(), options, out.view()); }, row, fragment);
  CHECK(out.indices == before.indices);
  CHECK(out.counts == before.counts);
  CHECK(out.log_probs == before.log_probs);
  CHECK(out.log_remainder == before.log_remainder);
}

template <class E>
void expect_merge_rejected(const std::vector<troll::sparsify_state>& into, const std::vector<troll::sparsify_state>& from,
                           std::size_t row, const std::string& fragment) {
  std::vector<troll::sparsify_state> target = into;
  expect_rejected<E>([&] { troll::sparsify_merge(troll::cpu, target.data(), from.data(), into.size()); }, row, fragment);
  CHECK(std::memcmp(target.data(), into.data(), into.size() * sizeof(troll::sparsify_state)) == 0);
}

}  // namespace

TEST_CASE("a whole-row state finalises to sparsify's row; the state records V and its coverage") {
  const shard_case c;
  const std::vector<troll::sparsify_state> whole = c.merged();
  for (const troll::sparsify_state& s : whole) {
    CHECK(s.vocab == 300);
    REQUIRE(s.range_count == 1);
    CHECK(s.covered[0].begin == 0);
    CHECK(s.covered[0].end == 300);
  }
  CHECK(c.left[1].range_count == 1);
  CHECK(c.left[1].covered[0].end == 170);
  // The finalised row is the top of a full sort of the logits (sampled token added) — the
  // independent reference — and matches sparsify's own row.
  sparse_rows<double> out(c.rows, 9, c.vocab), direct(c.rows, 9, c.vocab);
  troll::sparsify_finalize(troll::cpu, whole.data(), c.options, out.view());
  troll::sparsify(troll::cpu, troll::make_batch(c.z.data(), c.rows, c.vocab), c.sampled.data(), c.options,
                  direct.view());
  CHECK(out.indices == direct.indices);
  CHECK(out.counts == direct.counts);
  for (std::size_t r = 0; r < c.rows; ++r) {
    std::vector<std::size_t> order(c.vocab);
    for (std::size_t i = 0; i < c.vocab; ++i) order[i] = i;
    const double* row = c.z.data() + r * c.vocab;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return row[a] > row[b]; });
    CHECK(out.indices[r * 9] == troll::sparse_index(order[0]));
  }
}

TEST_CASE("sparsify_finalize rejects corrupted states, naming the row, before writing") {
  const shard_case c;
  const std::vector<troll::sparsify_state> good = c.merged();
  std::vector<troll::sparsify_state> s = good;

  s[1].size = 300;  // beyond the heap's 257 slots
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "heap size 300");
  s = good;
  s[1].size = -3;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "heap size -3");
  s = good;
  s[0].heap[3].logit = nan_value;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 0, "heap entry 3 has logit nan");
  s = good;
  s[0].heap[2].logit = plus_inf;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 0, "heap entry 2 has logit inf");
  s = good;
  s[1].heap[4].index = 300;  // ≥ V
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "heap entry 4 has token id 300");
  s = good;
  s[1].heap[4].index = -2;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "heap entry 4 has token id -2");
  s = good;
  s[0].heap[5].index = s[0].heap[6].index;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "repeats token id");
  s = good;
  s[0].heap[1].index = c.sampled[0];
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "heap entry 1 has token id 5");
  s = good;
  std::swap(s[1].heap[0], s[1].heap[1]);  // the best of the two at the root: order broken
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "heap order is broken");
  s = good;
  s[0].outside.m = nan_value;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 0, "outside log-sum");
  s = good;
  s[0].outside.m = s[0].heap[0].logit + 1.0;  // outside tokens ranked above the heap's worst
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 0, "outside log-sum");
  s = good;
  s[1].outside.s = -1.0;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 1, "outside log-sum");
  s = good;
  s[1].sampled_logit = nan_value;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 1, "sampled token's logit is nan");
  s = good;
  s[1].has_sampled = false;
  expect_finalize_rejected<troll::domain_error>(s, c.options, c.vocab, 1, "covers the sampled token 250");
  s = good;
  s[0].sampled = 300;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "sampled token 300");
  s = good;
  s[0].k = 0;  // what sparsify_shard's CUDA overload leaves in a rejected row
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "k = 0");
  s = good;
  s[0].k = 1 << 20;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "k = 1048576");
  s = good;
  s[1].range_count = 1000;  // would index far past covered[]
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "range count 1000");
  s = good;
  s[1].range_count = -1;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "range count -1");
  s = good;
  s[0].covered[0].end = 301;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "covered range 0");
  s = good;
  s[0].vocab = 0;
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 0, "vocabulary size 0");
  // A state that is not a sparsify_state at all: every byte 0xFF.
  s = good;
  std::memset(static_cast<void*>(&s[1]), 0xFF, sizeof(troll::sparsify_state));
  s[1].has_sampled = true;  // a valid bool (a byte of 0xFF is not one)
  expect_finalize_rejected<troll::shape_error>(s, c.options, c.vocab, 1, "k = -1");
}

TEST_CASE("sparsify_finalize rejects a state of another vocabulary, another k, or missing shards") {
  const shard_case c;
  const std::vector<troll::sparsify_state> whole = c.merged();
  // A state built for V = 300 finalised into V = 100.
  expect_finalize_rejected<troll::shape_error>(whole, c.options, 100, 0, "vocabulary of 300 tokens");
  expect_finalize_rejected<troll::invalid_input>(whole, troll::sparsify_options{7, 1e-4}, c.vocab, 0,
                                                 "different k");
  // Only one of the two shards: the first missing token is named.
  expect_finalize_rejected<troll::invalid_input>(c.left, c.options, c.vocab, 0, "covers 170 tokens");
  expect_finalize_rejected<troll::invalid_input>(c.left, c.options, c.vocab, 0, "token 170 is missing");
  expect_finalize_rejected<troll::invalid_input>(c.right, c.options, c.vocab, 0, "token 0 is missing");
}

TEST_CASE("sparsify_merge rejects the same shard twice, other vocabularies and corrupted states") {
  const shard_case c;
  expect_merge_rejected<troll::invalid_input>(c.left, c.left, 0, "both states cover token 0");
  const std::vector<troll::sparsify_state> whole = c.merged();
  expect_merge_rejected<troll::invalid_input>(whole, c.right, 0, "both states cover token 170");
  // Three shards where the middle one overlaps the others by one token.
  std::vector<troll::sparsify_state> middle(c.rows);
  troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{c.z.data() + 169, c.rows, 2, c.vocab}, 169, c.vocab,
                        c.sampled.data(), c.options, middle.data());
  expect_merge_rejected<troll::invalid_input>(c.left, middle, 0, "both states cover token 169");

  std::vector<troll::sparsify_state> other = c.right;
  other[1].vocab = 400;
  expect_merge_rejected<troll::shape_error>(c.left, other, 1, "vocabulary of 400");
  other = c.right;
  other[0].sampled = 7;  // row 0's sampled token (5) lies in the left shard: the right one does not hold it
  expect_merge_rejected<troll::invalid_input>(c.left, other, 0, "different sampled tokens");
  other = c.right;
  other[0].size = 300;
  expect_merge_rejected<troll::shape_error>(c.left, other, 0, "from: the state's heap size 300");
  other = c.left;
  other[1].heap[0].logit = nan_value;
  expect_merge_rejected<troll::domain_error>(other, c.right, 1, "into: heap entry 0 has logit nan");
}

// Issue 16: on an H100 the CUDA test of mixed shards threw "row 0: from: both states cover token
// 6" for V = 9 cut at {0, 1, 6, 9}. The shared merge itself folds those shards in any order; the
// message is exactly what the shared check gives when the last shard ([6, 9)) is merged a second
// time into a fold that already holds it between two ranges — what a merge that read the next
// upload of its reused `from` buffer leaves (a test-harness race, fixed in device_array::upload).
TEST_CASE("sparsify_merge folds shards in any order; a shard merged twice between ranges names its first token") {
  constexpr std::size_t rows = 2, vocab = 9;
  const troll::sparsify_options options{4, 1e-5};
  std::mt19937_64 rng(16);
  const std::vector<double> z = random_logits(rows * vocab, 3.0, rng);
  const std::vector<troll::token_id> sampled{7, 0};
  const std::size_t cuts[] = {0, 1, 6, 9};
  std::vector<std::vector<troll::sparsify_state>> shard(3, std::vector<troll::sparsify_state>(rows));
  for (std::size_t j = 0; j < 3; ++j)
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data() + cuts[j], rows, cuts[j + 1] - cuts[j], vocab},
                          cuts[j], vocab, sampled.data(), options, shard[j].data());
  sparse_rows<double> want(rows, 5, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled.data(), options, want.view());

  const auto fold = [&](std::initializer_list<std::size_t> order) {
    auto it = order.begin();
    std::vector<troll::sparsify_state> into = shard[*it++];
    for (; it != order.end(); ++it) troll::sparsify_merge(troll::cpu, into.data(), shard[*it].data(), rows);
    return into;
  };
  // Left to right, right to left, and the outer shards first (a fold covering [0, 1) ∪ [6, 9)).
  for (const auto& states : {fold({0, 1, 2}), fold({2, 1, 0}), fold({0, 2, 1}), fold({1, 2, 0})}) {
    for (const troll::sparsify_state& s : states) {
      REQUIRE(s.range_count == 1);
      CHECK(s.covered[0].begin == 0);
      CHECK(s.covered[0].end == 9);
    }
    sparse_rows<double> got(rows, 5, vocab);
    std::vector<troll::sparsify_state> copy = states;
    troll::sparsify_finalize(troll::cpu, copy.data(), options, got.view());
    CHECK(got.indices == want.indices);
    CHECK(got.counts == want.counts);
    for (std::size_t i = 0; i < want.log_probs.size(); ++i)
      CHECK((got.log_probs[i] == want.log_probs[i] ||  // the −inf padding
             std::abs(got.log_probs[i] - want.log_probs[i]) <= 1e-12 + 1e-12 * std::abs(want.log_probs[i])));
    for (std::size_t r = 0; r < rows; ++r)
      CHECK(std::abs(got.log_remainder[r] - want.log_remainder[r]) <= 1e-12 + 1e-12 * std::abs(want.log_remainder[r]));
  }

  const std::vector<troll::sparsify_state> outer = fold({0, 2});
  REQUIRE(outer[0].range_count == 2);
  CHECK(outer[0].covered[0].end == 1);
  CHECK(outer[0].covered[1].begin == 6);
  expect_merge_rejected<troll::invalid_input>(outer, shard[2], 0, "from: both states cover token 6");
  std::vector<troll::sparsify_state> target = outer;
  try {
    troll::sparsify_merge(troll::cpu, target.data(), shard[2].data(), rows);
    FAIL("merging [6, 9) twice was accepted");
  } catch (const troll::invalid_input& e) {
    CHECK(std::string(e.what()) ==
          "troll::sparsify_merge: row 0: from: both states cover token 6 (the same shard merged twice, or "
          "overlapping shards)");
  }
  // And a shard overlapping the gap's right edge from inside the gap.
  expect_merge_rejected<troll::invalid_input>(outer, fold({1, 2}), 0, "from: both states cover token 6");
}

TEST_CASE("merging many scattered shards: any order works up to sparsify_max_ranges pieces, then a typed error") {
  const std::size_t vocab = 200, rows = 1;
  std::mt19937_64 rng(12);
  const std::vector<double> z = random_logits(vocab, 2.0, rng);
  const troll::sparsify_options options{16, 0.0};
  std::vector<troll::sparsify_state> shard(vocab / 2);  // 100 shards of two tokens
  for (std::size_t i = 0; i < shard.size(); ++i)
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data() + 2 * i, rows, 2, vocab}, 2 * i, vocab,
                          nullptr, options, &shard[i]);
  // Even shards first: each adds a disjoint range, until the 33rd.
  troll::sparsify_state acc = shard[0];
  for (std::size_t i = 2; i < 2 * std::size_t(troll::sparsify_max_ranges); i += 2)
    troll::sparsify_merge(troll::cpu, &acc, &shard[i], 1);
  CHECK(acc.range_count == troll::sparsify_max_ranges);
  troll::sparsify_state copy = acc;
  expect_rejected<troll::invalid_input>(
      [&] { troll::sparsify_merge(troll::cpu, &copy, &shard[2 * troll::sparsify_max_ranges], 1); }, 0,
      "33 disjoint token ranges");
  // The odd shards in between coalesce the ranges; then the rest, in reverse.
  for (std::size_t i = 1; i < 2 * std::size_t(troll::sparsify_max_ranges); i += 2)
    troll::sparsify_merge(troll::cpu, &acc, &shard[i], 1);
  CHECK(acc.range_count == 1);
  for (std::size_t i = shard.size(); i-- > 2 * std::size_t(troll::sparsify_max_ranges);)
    troll::sparsify_merge(troll::cpu, &acc, &shard[i], 1);
  sparse_rows<double> out(1, 16, vocab), direct(1, 16, vocab);
  troll::sparsify_finalize(troll::cpu, &acc, options, out.view());
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), 1, vocab), nullptr, options, direct.view());
  CHECK(out.indices == direct.indices);
  for (std::size_t i = 0; i < 16; ++i) CHECK(out.log_probs[i] == doctest::Approx(direct.log_probs[i]).epsilon(1e-12));
}

TEST_CASE("sparsify_shard: offsets that would wrap around are shape errors, nothing written") {
  const std::vector<double> z(8, 0.0);
  troll::sparsify_state sentinel;
  sentinel.k = 42;
  std::vector<troll::sparsify_state> states(1, sentinel);
  const troll::sparsify_options options{4, 0.0};
  const std::size_t most = std::numeric_limits<std::size_t>::max();
  for (const std::size_t offset : {most, most - 3, most - 7, std::size_t(93), std::size_t(101)}) {
    CAPTURE(offset);
    CHECK_THROWS_AS(troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), 1, 8, 8}, offset, 100,
                                          nullptr, options, states.data()),
                    troll::shape_error);
    CHECK(states[0].k == 42);
  }
  CHECK_THROWS_AS(troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), 1, 8, 8}, 0,
                                        std::size_t(1) << 31, nullptr, options, states.data()),
                  troll::shape_error);
  // The last token of the largest vocabulary fits.
  troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), 1, 8, 8}, 92, 100, nullptr, options,
                        states.data());
  CHECK(states[0].covered[0].begin == 92);
  CHECK(states[0].covered[0].end == 100);
}

// ---- Item 6: sparse rows hold mass 1 within the documented tolerance ----

TEST_CASE("sparse rows whose mass is far from 1 are rejected; rounding-level errors are accepted") {
  // Row 0 is normalised; row 1's mass is set to `mass` by scaling its probabilities.
  auto make = [](double mass) {
    sparse_rows<double> rows(2, 3, 10);
    const double p[3] = {0.5, 0.25, 0.125};
    for (std::size_t r = 0; r < 2; ++r) {
      const double scale = r == 1 ? mass : 1.0;
      rows.counts[r] = 3;
      for (std::size_t i = 0; i < 3; ++i) {
        rows.indices[r * 3 + i] = troll::sparse_index(3 * i + r);
        rows.log_probs[r * 3 + i] = std::log(scale * p[i]);
      }
      rows.log_remainder[r] = std::log(scale * 0.125);
    }
    return rows;
  };
  auto run_align = [](const sparse_rows<double>& rows) {
    aligned_rows<double> out(2, 6, 10);
    troll::align(troll::cpu, rows.view(), rows.view(), out.view());
  };
  for (const double mass : {2.0, 0.5, 1.01, 1.0 + 3 * troll::sparse_mass_tolerance<double>(),
                            1.0 - 3 * troll::sparse_mass_tolerance<double>()}) {
    CAPTURE(mass);
    expect_rejected<troll::domain_error>([&] { run_align(make(mass)); }, 1, "the probabilities sum to");
  }
  for (const double mass : {1.0, 1.0 + 0.3 * troll::sparse_mass_tolerance<double>(),
                            1.0 - 0.3 * troll::sparse_mass_tolerance<double>()}) {
    CAPTURE(mass);
    CHECK_NOTHROW(run_align(make(mass)));
  }
  // The same rule in kl / project (aligned rows) and in float, with float's tolerance.
  aligned_rows<double> al(2, 6, 10);
  troll::align(troll::cpu, make(1.0).view(), make(1.0).view(), al.view());
  al.old_log_probs[0] = std::log(std::exp(al.old_log_probs[0]) + 0.5);  // mass 1.5 on the old side
  std::vector<double> kl(2, 42.0);
  expect_rejected<troll::domain_error>(
      [&] { troll::kl(troll::cpu, troll::aligned_batch_view<const double>(al.view()), kl.data()); }, 0,
      "old: the probabilities sum to 1.5");
  CHECK(kl[0] == 42.0);

  sparse_rows<float> f(1, 2, 4);
  f.counts[0] = 2;
  f.indices[0] = 0, f.indices[1] = 1;
  const float tol = float(troll::sparse_mass_tolerance<float>());
  f.log_probs[0] = std::log(0.5f), f.log_probs[1] = std::log(0.25f + 0.3f * tol);
  f.log_remainder[0] = std::log(0.25f);
  aligned_rows<float> fa(1, 4, 4);
  CHECK_NOTHROW(troll::align(troll::cpu, f.view(), f.view(), fa.view()));
  f.log_probs[1] = std::log(0.25f + 3.0f * tol);
  expect_rejected<troll::domain_error>([&] { troll::align(troll::cpu, f.view(), f.view(), fa.view()); }, 0,
                                       "sum to");
}

// ---------------------------------------------------------------------------------------------
// One code set (troll::row_error) and one message table for every row check.

namespace {

enum class error_class { invalid, shape, domain, infeasible };

/// The exception class troll/row_error.hpp documents for each code the table serves.
struct documented_code {
  troll::row_error code;
  error_class cls;
};

error_class class_of(const troll::invalid_input& e) {
  if (dynamic_cast<const troll::infeasible_error*>(&e)) return error_class::infeasible;
  if (dynamic_cast<const troll::domain_error*>(&e)) return error_class::domain;
  if (dynamic_cast<const troll::shape_error*>(&e)) return error_class::shape;
  return error_class::invalid;
}

/// The code, row and message of what `f` throws (code none and an empty message: nothing thrown).
template <class F>
std::pair<troll::row_error, std::string> code_of(F&& f, std::size_t* row = nullptr) {
  try {
    f();
  } catch (const troll::invalid_input& e) {
    if (row) *row = e.row();
    return {e.code(), e.what()};
  }
  return {troll::row_error::none, ""};
}

}  // namespace

TEST_CASE("the message table: every row code throws its documented class, names the row and carries the code") {
  using e = troll::row_error;
  using c = error_class;
  const documented_code codes[] = {
      {e::nan_value, c::domain},           {e::pos_inf, c::domain},
      {e::all_masked, c::domain},          {e::disjoint, c::infeasible},
      {e::infeasible, c::infeasible},      {e::bad_stats, c::domain},
      {e::not_finite, c::domain},          {e::sparse_count, c::shape},
      {e::sparse_index, c::shape},         {e::sparse_duplicate, c::shape},
      {e::sparse_nan, c::domain},          {e::sparse_above_one, c::domain},
      {e::sparse_no_tail, c::domain},      {e::sparse_no_mass, c::domain},
      {e::sparse_not_aligned, c::shape},   {e::sparse_capacity, c::shape},
      {e::bad_sampled, c::domain},         {e::bad_mask, c::domain},
      {e::bad_advantage, c::domain},       {e::sequence_order, c::domain},
      {e::old_token_masked, c::domain},    {e::regression_inf, c::domain},
      {e::state_mismatch, c::invalid},     {e::state_k, c::invalid},
      {e::state_capacity, c::shape},       {e::sampled_missing, c::domain},
      {e::no_support, c::domain},          {e::bad_state, c::invalid},
      {e::sparse_mass, c::domain},         {e::sparse_wrong_token, c::shape},
      {e::sparse_masked_mass, c::domain},  {e::bad_log_sums, c::domain},
      {e::bad_tail_max, c::domain},        {e::above_zero, c::domain},
      {e::masked_mass, c::domain},         {e::token_range, c::domain},
      {e::old_entry_masked, c::domain},    {e::infinite_kl, c::domain},
      {e::objective_capacity, c::shape},   {e::not_in_support, c::domain},
      {e::not_in_aligned, c::domain},      {e::log_probs_mismatch, c::shape},
      {e::objective_overflow, c::domain},  {e::state_bad_k, c::shape},
      {e::state_bad_size, c::shape},       {e::state_bad_vocab, c::shape},
      {e::state_bad_ranges, c::shape},     {e::state_bad_sampled, c::shape},
      {e::state_sampled_logit, c::domain}, {e::state_sampled_unseen, c::domain},
      {e::state_heap_logit, c::domain},    {e::state_heap_index, c::shape},
      {e::state_heap_duplicate, c::shape}, {e::state_heap_order, c::shape},
      {e::state_bad_outside, c::domain},   {e::state_k_mismatch, c::invalid},
      {e::state_sampled_mismatch, c::invalid}, {e::state_vocab_mismatch, c::shape},
      {e::state_overlap, c::invalid},      {e::state_too_many_ranges, c::invalid},
      {e::state_incomplete, c::invalid},   {e::log_prob_underflow, c::domain},
      {e::tail_above_max, c::domain},
  };
  for (const documented_code& d : codes) {
    CAPTURE(static_cast<int>(d.code));
    troll::detail::row_problem p = troll::detail::make_problem(d.code, "operand", 2, 5.0, 7.0);
    p.quantity = "loss";
    p.type_name = "float";
    bool thrown = false;
    try {
      troll::detail::throw_row_problem("f", 7, p);
    } catch (const troll::invalid_input& error) {
      thrown = true;
      CHECK(error.row() == 7);
      CHECK(error.code() == d.code);
      CHECK(class_of(error) == d.cls);
      const std::string what = error.what();
      CHECK(what.rfind("troll::f: row 7: ", 0) == 0);
      CHECK(what.find("unknown") == std::string::npos);
      CHECK(what.size() > std::string("troll::f: row 7: ").size() + 8);
    }
    CHECK(thrown);
  }
  // The device-only codes whose translation names the CPU's code, and none, are not the table's.
  for (troll::row_error code : {e::none, e::bad_log_probs, e::state_invalid}) {
    const auto got = code_of([&] { troll::detail::throw_row_problem("f", 1, troll::detail::make_problem(code, "x")); });
    CHECK(got.second.find("unknown problem") != std::string::npos);
  }
}

TEST_CASE("row codes of real calls: dense, sparse, objective, shard states; shape errors carry none") {
  using e = troll::row_error;
  const std::size_t rows = 3, vocab = 6;
  std::vector<double> zn(rows * vocab, 0.0), zo(rows * vocab, 0.0), lp(rows * vocab);
  for (std::size_t i = 0; i < zn.size(); ++i) zn[i] = std::sin(double(i)), zo[i] = std::cos(double(i));
  std::vector<troll::projection_stats> st(rows);
  auto project = [&] {
    troll::project(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::make_batch(zo.data(), rows, vocab),
                   0.05, troll::make_batch(lp.data(), rows, vocab), st.data());
  };
  std::size_t row = 0;
  zn[vocab + 2] = nan_value;
  CHECK(code_of(project, &row).first == e::nan_value);
  CHECK(row == 1);
  zn[vocab + 2] = std::numeric_limits<double>::infinity();
  CHECK(code_of(project).first == e::pos_inf);
  zn[vocab + 2] = 0.0;
  for (std::size_t i = 0; i < vocab; ++i) (i < 3 ? zn : zo)[2 * vocab + i] = -std::numeric_limits<double>::infinity();
  CHECK(code_of(project, &row).first == e::disjoint);
  CHECK(row == 2);
  for (std::size_t i = 0; i < vocab; ++i) zn[2 * vocab + i] = zo[2 * vocab + i] = 0.5;
  CHECK(code_of(project).first == e::none);  // nothing thrown
  // A shape problem is no row's.
  const auto shape = code_of([&] {
    troll::project(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::make_batch(zo.data(), rows - 1, vocab),
                   0.05, troll::make_batch(lp.data(), rows, vocab), st.data());
  });
  CHECK(shape.first == e::none);
  CHECK(!shape.second.empty());
  // Sparse: a sampled token outside the vocabulary.
  sparse_rows<double> out(rows, 8, vocab);
  std::vector<troll::token_id> sampled{0, 1, 9};
  CHECK(code_of([&] {
          troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), sampled.data(), {4, 1e-5}, out.view());
        }, &row).first == e::bad_sampled);
  CHECK(row == 2);
  // Objective: a NaN advantage at row 1.
  std::vector<std::int64_t> tokens{0, 1, 2};
  std::vector<double> advantages{1.0, nan_value, -1.0};
  troll::token_batch<double> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  CHECK(code_of([&] {
          troll::objective_forward(troll::cpu, troll::trust_region_objective{}, troll::make_batch(zn.data(), rows, vocab),
                                   troll::make_batch(zo.data(), rows, vocab), in, troll::make_batch(lp.data(), rows, vocab),
                                   st.data());
        }, &row).first == e::bad_advantage);
  CHECK(row == 1);
  // Shard states: the same shard merged twice.
  std::vector<troll::sparsify_state> a(rows), b(rows);
  troll::sparsify_shard(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), 0, vocab, nullptr, {4, 1e-5}, a.data());
  troll::sparsify_shard(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), 0, vocab, nullptr, {4, 1e-5}, b.data());
  CHECK(code_of([&] { troll::sparsify_merge(troll::cpu, a.data(), b.data(), rows); }, &row).first == e::state_overlap);
  CHECK(row == 0);
}

TEST_CASE("argument messages print numbers as the shortest text that reads back, not std::to_string's six decimals") {
  CHECK(troll::detail::number_text(1e-300) == "1e-300");
  CHECK(troll::detail::number_text(-0.1) == "-0.1");
  CHECK(troll::detail::number_text(0.99999999999) == "0.99999999999");
  CHECK(troll::detail::number_text(1.0 / 3.0) == "0.3333333333333333");
  CHECK(troll::detail::number_text(std::numeric_limits<double>::infinity()) == "inf");
  const std::size_t rows = 2, vocab = 5;
  std::vector<double> z(rows * vocab, 0.25), lp(rows * vocab);
  std::vector<troll::projection_stats> st(rows);
  const auto eps_message = code_of([&] {
    troll::project(troll::cpu, troll::make_batch(z.data(), rows, vocab), troll::make_batch(z.data(), rows, vocab),
                   -1e-300, troll::make_batch(lp.data(), rows, vocab), st.data());
  }).second;
  CHECK(eps_message.find("-1e-300") != std::string::npos);
  CHECK(eps_message.find("0.000000") == std::string::npos);
  sparse_rows<double> out(rows, 8, vocab);
  const auto delta_message = code_of([&] {
    troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), nullptr, {4, 1.25}, out.view());
  }).second;
  CHECK(delta_message.find("1.25") != std::string::npos);
}

TEST_CASE("an aggregation value outside the enum is a domain_error before anything is written") {
  // A loss_aggregation cast from an out-of-range integer took the sequence path without its ids:
  // a null read (segfault) without sequence_ids, and a silent sequence mean with them (an audit).
  const std::size_t rows = 2, v = 4;
  std::vector<double> zn{0.1, 0.5, -0.3, 0.2, 1.0, -1.0, 0.0, 0.3}, zo{0.0, 0.4, -0.2, 0.1, 0.8, -0.9, 0.1, 0.2};
  std::vector<std::int64_t> tokens{1, 2}, ids{0, 0};
  std::vector<double> adv{1.0, -0.5}, lp(rows * v, 7.0), grad(rows * v, 7.0), token_loss(rows, 7.0);
  std::vector<troll::projection_stats> stats(rows);
  stats[0].t = stats[1].t = 0.25;
  for (const std::int64_t* seq : {static_cast<const std::int64_t*>(nullptr), static_cast<const std::int64_t*>(ids.data())}) {
    troll::token_batch<double> in;
    in.tokens = tokens.data();
    in.advantages = adv.data();
    in.sequence_ids = seq;
    in.aggregation = static_cast<troll::loss_aggregation>(7);
    const auto nv = troll::make_batch<const double>(zn.data(), rows, v), ov = troll::make_batch<const double>(zo.data(), rows, v);
    auto unknown = [](auto&& call) {
      CHECK_THROWS_WITH_AS(call(), doctest::Contains("unknown loss aggregation 7"), troll::domain_error);
    };
    unknown([&] {
      troll::objective_forward(troll::cpu, troll::trust_region_objective{}, nv, ov, in,
                               troll::make_batch(lp.data(), rows, v), stats.data(), token_loss.data());
    });
    unknown([&] {
      troll::objective_backward(troll::cpu, troll::trust_region_objective{}, nv, ov, in,
                                troll::make_batch<const double>(lp.data(), rows, v), stats.data(),
                                troll::make_batch(grad.data(), rows, v));
    });
    unknown([&] { troll::objective_forward(troll::cpu, troll::ppo_clip_objective{}, nv, ov, in, token_loss.data()); });
    unknown([&] {
      troll::objective_backward(troll::cpu, troll::dppo_objective{}, nv, ov, in, troll::make_batch(grad.data(), rows, v));
    });
    sparse_rows<double> old_rows(rows, v, v);
    aligned_rows<double> aligned(rows, v, v);
    sparse_rows<double> out(rows, v, v);
    troll::sparsify(troll::cpu, ov, nullptr, {int(v), 0.0}, old_rows.view());
    unknown([&] {
      troll::objective_forward(troll::cpu, troll::sparse_trust_region_objective{}, nv, old_rows.view(), in,
                               aligned.view(), out.view(), stats.data(), token_loss.data());
    });
    for (double x : lp) CHECK(x == 7.0);
    for (double x : grad) CHECK(x == 7.0);
    for (double x : token_loss) CHECK(x == 7.0);
    CHECK(stats[0].t == 0.25);
  }
}

TEST_CASE("sequence_ids_from_lengths checks every length before it writes") {
  const std::int64_t lengths[3] = {2, 3, -1};
  std::vector<std::int64_t> ids(5, -7);
  CHECK_THROWS_WITH_AS(troll::sequence_ids_from_lengths(lengths, 3, ids.data()),
                       doctest::Contains("sequence 2 has negative length -1"), troll::domain_error);
  for (std::int64_t x : ids) CHECK(x == -7);
}
