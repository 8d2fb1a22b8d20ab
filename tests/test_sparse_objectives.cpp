#include <doctest/doctest.h>

// Tests of troll/sparse_objectives.hpp: TROLL's objective with dense new logits against sparse
// old rows (top-K + remainder bucket). The fused forward / backward is checked against
//  * finite differences (troll's checker, double) of the loss composed from troll's public
//    sparse pieces — sparsify → align(dense logits, support, old row) → project — and lumped
//    log p̃ in long double, the regression term differenced against a frozen π*: the one body
//    tests/bodies/sparse_objective_gradients.hpp, compiled here for troll::cpu (and for
//    troll::cuda by tests/cuda/test_cuda_sparse_objectives.cu);
//  * the dense objective, on rows whose tails outside U are exactly uniform (then the sparse
//    projection is the dense one, math.md §4);
// and bad input is rejected before anything is written, naming the row.

#include "grad_helpers.hpp"  // first: silences GCC 12 false positives in Eigen for this TU
#include "sparse_oracle.hpp"

#include <troll/gradcheck.hpp>
#include <troll/objectives.hpp>
#include <troll/sparse_objectives.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "sparse_objective_cases.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "../bodies/sparse_objective_gradients.hpp"

using namespace troll_test::sparse_objective_cases;
using sparse_test::aligned_rows;
using sparse_test::ld;
using sparse_test::sparse_rows;

TEST_CASE("sparse TROLL values and metrics against the public sparse pieces") {
  sparse_case c = make_sparse_case(12, 48, 5);
  const troll::sparse_trust_region_objective o = objective(0.7);
  const sparse_run<double> run = run_sparse(c, o);
  const std::vector<double> w = weights_of(c);
  std::vector<std::vector<double>> own(c.rows);
  double kl_before = 0, kl_before_max = 0, kl_after_max = 0, ratio = 0, eta = 0, projected = 0,
         counted = 0;
  for (std::size_t r = 0; r < c.rows; ++r) {
    const oracle_row row = oracle_forward(c, r, c.new_logits.data() + r * c.vocab, o);
    own[r] = row.log_pi;
    // aligned and log_probs hold U and π* as the public pieces compute them.
    const int u = run.aligned.counts[r];
    REQUIRE(std::size_t(u) == row.support.size());
    REQUIRE(run.log_probs.counts[r] == u);
    for (int i = 0; i < u; ++i) {
      CHECK(run.aligned.indices[r * run.aligned.k_max + std::size_t(i)] ==
            row.support[std::size_t(i)]);
      CHECK(run.log_probs.indices[r * run.log_probs.k_max + std::size_t(i)] ==
            row.support[std::size_t(i)]);
      CHECK(run.log_probs.log_probs[r * run.log_probs.k_max + std::size_t(i)] ==
            doctest::Approx(row.log_pi[std::size_t(i)]).epsilon(1e-12));
      CHECK(run.aligned.new_log_probs[r * run.aligned.k_max + std::size_t(i)] ==
            doctest::Approx(double(row.log_p[std::size_t(i)])).epsilon(1e-13));
    }
    CHECK(run.log_probs.log_remainder[r] == doctest::Approx(row.log_pi.back()).epsilon(1e-12));
    CHECK(run.aligned.new_log_remainder[r] ==
          doctest::Approx(double(row.log_p.back())).epsilon(1e-12));
    CHECK(run.stats[r].kl_before == doctest::Approx(row.stats.kl_before).epsilon(1e-12));
    CHECK(run.stats[r].kl_after <= o.eps * (1 + 1e-10) + 1e-13);
    if (w[r] == 0.0) {
      CHECK(run.token_loss[r] == 0.0);
      for (std::size_t j = 0; j < c.vocab; ++j) CHECK(run.grad[r * c.vocab + j] == 0.0);
      continue;
    }
    counted += 1;
    kl_before += row.stats.kl_before;
    kl_before_max = std::max(kl_before_max, row.stats.kl_before);
    kl_after_max = std::max(kl_after_max, row.stats.kl_after);
    const std::size_t a = std::size_t(
        std::find(row.support.begin(), row.support.end(), troll::sparse_index(c.tokens[r])) -
        row.support.begin());
    ratio += std::exp(row.log_pi[a] - old_log_prob(c, r, c.tokens[r]));
    if (row.stats.active()) projected += 1, eta += row.stats.eta;
  }
  CHECK(run.metrics.loss ==
        doctest::Approx(loss_frozen(c, c.new_logits.data(), o, own)).epsilon(1e-12));
  double weighted = 0;
  for (std::size_t r = 0; r < c.rows; ++r) weighted += w[r] * run.token_loss[r];
  CHECK(run.metrics.loss == doctest::Approx(weighted).epsilon(1e-13));
  CHECK(run.metrics.tokens == std::size_t(counted));
  CHECK(run.metrics.kl_before_mean == doctest::Approx(kl_before / counted).epsilon(1e-12));
  CHECK(run.metrics.kl_before_max == doctest::Approx(kl_before_max).epsilon(1e-12));
  CHECK(run.metrics.kl_after_max == doctest::Approx(kl_after_max).epsilon(1e-9));
  CHECK(run.metrics.ratio_mean == doctest::Approx(ratio / counted).epsilon(1e-12));
  CHECK(run.metrics.projected_fraction == doctest::Approx(projected / counted));
  CHECK(run.metrics.eta_mean == doctest::Approx(eta / counted).epsilon(1e-9));
  CHECK(projected > 0);
  CHECK(projected < counted);
  // grad_loss scales the gradient.
  const sparse_run<double> scaled =
      run_sparse<double>(c, c.new_logits.data(), c.old, c.batch(), o, -2.0);
  for (std::size_t k = 0; k < scaled.grad.size(); ++k)
    CHECK(scaled.grad[k] == doctest::Approx(-2.0 * run.grad[k]));
}

namespace {

/// Rows whose tails outside U are exactly uniform on both sides: the old row has 6 distinct
/// logits and a constant elsewhere (sparsified with δ = 0 to exactly those 6, the sampled token
/// among them); the new row has its 5 largest logits on tokens partly inside and partly outside
/// the old support (rows r ≡ 0 mod 4: inside, a small step from the old row), distinct values on
/// the rest of the old support, and a constant elsewhere. With new_support = {5, 0}, U is the
/// union of the two sets and V∖U is flat on both sides.
sparse_case uniform_tail_case(std::size_t rows, std::size_t vocab, std::uint64_t seed) {
  grad_helpers::rng g(seed);
  sparse_case c;
  c.rows = rows;
  c.vocab = vocab;
  c.new_logits.assign(rows * vocab, 0.0);
  c.old_logits.assign(rows * vocab, 0.0);
  const double steps[4] = {0.05, 1.2, 2.0, 0.7};
  for (std::size_t r = 0; r < rows; ++r) {
    double* zo = c.old_logits.data() + r * vocab;
    double* zn = c.new_logits.data() + r * vocab;
    const std::size_t base = (7 * r) % (vocab - 9);
    const double old_tail = -1.5 - 0.1 * double(r),
                 new_tail = old_tail + 0.5 * steps[r % 4] * g.normal();
    for (std::size_t j = 0; j < vocab; ++j) zo[j] = old_tail, zn[j] = new_tail;
    // Old support: base .. base+5. New top 5: base+3 .. base+7 (two outside the old support).
    for (std::size_t i = 0; i < 6; ++i) zo[base + i] = 1.0 + 0.6 * double(i) + 0.3 * g.normal();
    for (std::size_t i = 0; i < 6; ++i) zn[base + i] = zo[base + i] + steps[r % 4] * g.normal();
    if (r % 4 != 0) {  // rows r ≡ 0 (mod 4) stay close to the old row (U = S_old, inactive)
      const double top = std::max(new_tail, *std::max_element(zn + base, zn + base + 3));
      for (std::size_t i = 3; i < 8; ++i)
        zn[base + i] = top + 0.5 + 0.4 * double(i) + 0.1 * g.normal();
    }
    c.tokens.push_back(std::int64_t(base + (r % 6)));
    c.advantages.push_back(r % 3 == 0 ? -1.3 : 0.9);
    c.mask.push_back(r % 4 == 3 ? 0.5 : 1.0);
    c.sequence_ids.push_back(std::int64_t(r / 3));
  }
  c.old_k = 7;
  c.sparsify_old({6, 0.0});
  return c;
}

}  // namespace

TEST_CASE("sparse TROLL equals dense TROLL when the tails outside U are exactly uniform") {
  for (auto aggregation :
       {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
    CAPTURE(int(aggregation));
    sparse_case c = uniform_tail_case(9, 64, 3);
    c.aggregation = aggregation;
    const std::size_t N = c.rows, V = c.vocab;
    const troll::sparse_trust_region_objective o = objective(1.0);
    troll::trust_region_objective dense;
    dense.alpha = o.alpha;
    dense.projection = o.projection;
    const sparse_run<double> run = run_sparse(c, o);

    std::vector<double> lp(N * V), token_loss(N), grad(N * V);
    std::vector<troll::projection_stats> stats(N);
    const auto zn = troll::make_batch(c.new_logits.data(), N, V);
    const auto zo = troll::make_batch(c.old_logits.data(), N, V);
    const troll::objective_metrics m =
        troll::objective_forward(cpu, dense, zn, zo, c.batch(), troll::make_batch(lp.data(), N, V),
                                 stats.data(), token_loss.data());
    troll::objective_backward(cpu, dense, zn, zo, c.batch(), troll::make_batch(lp.data(), N, V),
                              stats.data(), troll::make_batch(grad.data(), N, V));

    int projected = 0;
    for (std::size_t r = 0; r < N; ++r) {
      CAPTURE(r);
      REQUIRE(run.aligned.counts[r] == (r % 4 == 0 ? 6 : 8));  // S_old, or S_old and two new tokens
      CHECK(run.stats[r].status == stats[r].status);
      projected += stats[r].active() ? 1 : 0;
      CHECK(run.stats[r].kl_before == doctest::Approx(stats[r].kl_before).epsilon(1e-11));
      CHECK(run.stats[r].kl_after == doctest::Approx(stats[r].kl_after).epsilon(1e-9));
      CHECK(run.stats[r].t == doctest::Approx(stats[r].t).epsilon(1e-9));
      CHECK(run.token_loss[r] == doctest::Approx(token_loss[r]).epsilon(1e-10));
      // π* on U and the bucket = Σ of the dense π* over V∖U.
      std::vector<char> in_u(V, 0);
      for (int i = 0; i < run.log_probs.counts[r]; ++i) {
        const std::size_t k =
            std::size_t(run.log_probs.indices[r * run.log_probs.k_max + std::size_t(i)]);
        in_u[k] = 1;
        CHECK(run.log_probs.log_probs[r * run.log_probs.k_max + std::size_t(i)] ==
              doctest::Approx(lp[r * V + k]).epsilon(1e-10));
      }
      std::vector<ld> tail;
      for (std::size_t k = 0; k < V; ++k)
        if (!in_u[k]) tail.push_back(ld(lp[r * V + k]));
      CHECK(run.log_probs.log_remainder[r] ==
            doctest::Approx(double(sparse_test::log_sum_exp(tail))).epsilon(1e-10));
      double scale = 0;
      for (std::size_t k = 0; k < V; ++k) scale = std::max(scale, std::fabs(grad[r * V + k]));
      for (std::size_t k = 0; k < V; ++k)
        CHECK(std::fabs(run.grad[r * V + k] - grad[r * V + k]) <= 1e-9 * scale + 1e-15);
    }
    CHECK(projected > 0);
    CHECK(projected < int(N));
    CHECK(run.metrics.loss == doctest::Approx(m.loss).epsilon(1e-10));
    CHECK(run.metrics.tokens == m.tokens);
    CHECK(run.metrics.sequences == m.sequences);
    CHECK(run.metrics.ratio_mean == doctest::Approx(m.ratio_mean).epsilon(1e-10));
    CHECK(run.metrics.kl_before_mean == doctest::Approx(m.kl_before_mean).epsilon(1e-10));
    CHECK(run.metrics.kl_after_max == doctest::Approx(m.kl_after_max).epsilon(1e-9));
    CHECK(run.metrics.regression_kl_mean == doctest::Approx(m.regression_kl_mean).epsilon(1e-8));
    CHECK(run.metrics.projected_fraction == m.projected_fraction);
    CHECK(run.metrics.eta_mean == doctest::Approx(m.eta_mean).epsilon(1e-8));
  }
}

TEST_CASE("sparse TROLL in float agrees with double") {
  const sparse_case c = make_sparse_case(8, 256, 17, 16, 1e-4);
  const troll::sparse_trust_region_objective o = objective(1.0, {16, 1e-5});
  const sparse_run<double> ref = run_sparse(c, o);
  const std::vector<float> x(c.new_logits.begin(), c.new_logits.end());
  sparse_rows<float> old(c.rows, c.old.k_max, c.vocab);
  old.indices = c.old.indices;
  old.counts = c.old.counts;
  old.log_probs.assign(c.old.log_probs.begin(), c.old.log_probs.end());
  old.log_remainder.assign(c.old.log_remainder.begin(), c.old.log_remainder.end());
  const std::vector<float> adv(c.advantages.begin(), c.advantages.end()),
      mask(c.mask.begin(), c.mask.end());
  troll::token_batch<float> b;
  b.tokens = c.tokens.data();
  b.advantages = adv.data();
  b.loss_mask = mask.data();
  troll::sparse_trust_region_objective of = o;
  of.projection = troll::projection_options{};
  const sparse_run<float> run = run_sparse<float>(c, x.data(), old, b, of);
  CHECK(run.metrics.loss == doctest::Approx(ref.metrics.loss).epsilon(1e-5));
  double max_grad = 0;
  for (double g : ref.grad) max_grad = std::max(max_grad, std::fabs(g));
  for (std::size_t k = 0; k < ref.grad.size(); ++k)
    CHECK(std::fabs(run.grad[k] - ref.grad[k]) <= 1e-5 * max_grad + 1e-7);
}

namespace {

/// Runs the sparse forward on outputs pre-filled with sentinels; expects `E` naming `row` (npos:
/// no row) with `fragment` in its message, and every output untouched.
template <class E>
void expect_forward_rejected(const sparse_case& c, const troll::sparse_trust_region_objective& o,
                             std::size_t row, const std::string& fragment,
                             std::size_t capacity = 0) {
  const std::size_t N = c.rows, V = c.vocab;
  const std::size_t cap =
      capacity ? capacity : c.old.k_max + std::size_t(std::max(o.new_support.k, 0));
  aligned_rows<double> al(N, cap, V);
  sparse_rows<double> lp(N, cap, V);
  std::vector<troll::projection_stats> stats(N);
  for (auto& s : stats) s.eta = 42.0;
  std::vector<double> token_loss(N, 42.0);
  const aligned_rows<double> al0 = al;
  const sparse_rows<double> lp0 = lp;
  bool thrown = false;
  try {
    troll::objective_forward(cpu, o, troll::make_batch(c.new_logits.data(), N, V), c.old.view(),
                             c.batch(), al.view(), lp.view(), stats.data(), token_loss.data());
  } catch (const E& e) {
    thrown = true;
    CHECK(e.row() == row);
    CHECK_MESSAGE(std::string(e.what()).find(fragment) != std::string::npos, std::string(e.what()));
  }
  CHECK(thrown);
  CHECK(al.indices == al0.indices);
  CHECK(al.counts == al0.counts);
  CHECK(al.new_log_probs == al0.new_log_probs);
  CHECK(al.old_log_probs == al0.old_log_probs);
  CHECK(al.new_log_remainder == al0.new_log_remainder);
  CHECK(al.old_log_remainder == al0.old_log_remainder);
  CHECK(lp.indices == lp0.indices);
  CHECK(lp.counts == lp0.counts);
  CHECK(lp.log_probs == lp0.log_probs);
  CHECK(lp.log_remainder == lp0.log_remainder);
  for (const auto& s : stats) CHECK(s.eta == 42.0);
  for (double v : token_loss) CHECK(v == 42.0);
}

}  // namespace

/// A token of the vocabulary missing from old row r's support.
std::int64_t token_outside_old(const sparse_case& c, std::size_t r) {
  for (std::size_t k = 0; k < c.vocab; ++k) {
    bool found = false;
    for (int i = 0; i < c.old.counts[r]; ++i)
      found = found || c.old.indices[r * c.old.k_max + std::size_t(i)] == int(k);
    if (!found) return std::int64_t(k);
  }
  return -1;
}

/// The entry of old row r holding its sampled token.
std::size_t sampled_entry(const sparse_case& c, std::size_t r) {
  for (int i = 0; i < c.old.counts[r]; ++i)
    if (c.old.indices[r * c.old.k_max + std::size_t(i)] == c.tokens[r])
      return r * c.old.k_max + std::size_t(i);
  return std::size_t(-1);
}

TEST_CASE("sparse TROLL forward rejects bad input before writing, naming the row") {
  const sparse_case good = make_sparse_case(6, 24, 13);
  const troll::sparse_trust_region_objective o = objective(1.0);
  {
    sparse_case c = good;
    c.tokens[3] = token_outside_old(c, 3);
    expect_forward_rejected<troll::domain_error>(c, o, 3, "is not in the old row's support");
  }
  {
    sparse_case c = good;
    // The sampled token's mass moves to the remainder: the row stays normalised.
    double& sampled_log_prob = c.old.log_probs[sampled_entry(c, 2)];
    c.old.log_remainder[2] = std::log(std::exp(c.old.log_remainder[2]) + std::exp(sampled_log_prob));
    sampled_log_prob = minus_inf;
    expect_forward_rejected<troll::domain_error>(c, o, 2, "log-probability at the sampled token");
  }
  {
    sparse_case c = good;
    c.tokens[1] = 24;
    expect_forward_rejected<troll::domain_error>(c, o, 1, "sampled token 24 is outside [0, V)");
    c.tokens[1] = good.tokens[1];
    c.advantages[5] = nan_value;
    expect_forward_rejected<troll::domain_error>(c, o, 5, "advantage is nan");
    c.advantages[5] = 1.0;
    c.aggregation = troll::loss_aggregation::sequence_mean;
    c.sequence_ids[4] = 0;
    expect_forward_rejected<troll::domain_error>(c, o, 4, "non-decreasing");
  }
  {
    sparse_case c = good;
    c.new_logits[2 * c.vocab + 5] = nan_value;
    expect_forward_rejected<troll::domain_error>(c, o, 2, "new_logits is NaN at token 5");
    c.new_logits[2 * c.vocab + 5] = std::numeric_limits<double>::infinity();
    expect_forward_rejected<troll::domain_error>(c, o, 2, "new_logits is +inf at token 5");
    for (std::size_t k = 0; k < c.vocab; ++k) c.new_logits[2 * c.vocab + k] = minus_inf;
    expect_forward_rejected<troll::domain_error>(c, o, 2, "every entry of new_logits is -inf");
  }
  {
    sparse_case c = good;
    c.old.indices[1 * c.old.k_max + 1] = c.old.indices[1 * c.old.k_max];
    expect_forward_rejected<troll::shape_error>(c, o, 1, "repeats token index");
    c = good;
    c.old.indices[4 * c.old.k_max] = 99;
    expect_forward_rejected<troll::shape_error>(c, o, 4, "outside the vocabulary");
    c = good;
    c.old.log_remainder[3] = 0.25;
    expect_forward_rejected<troll::domain_error>(c, o, 3, "a probability above 1");
    c = good;
    c.old.log_probs[0] = nan_value;
    expect_forward_rejected<troll::domain_error>(c, o, 0, "is NaN");
  }
  // Room for U: aligned / log_probs need |S_old| + new_support.k entries.
  expect_forward_rejected<troll::shape_error>(good, o, 0, "capacity", good.old.k_max);
  {
    // The old row claims no tail mass, the new row has some: KL(p̃ ‖ π*) = +inf with α > 0.
    sparse_case c = good;
    const double kept_mass = -std::expm1(c.old.log_remainder[4]);  // the support renormalised
    for (int i = 0; i < c.old.counts[4]; ++i) c.old.log_probs[4 * c.old.k_max + std::size_t(i)] -= std::log(kept_mass);
    c.old.log_remainder[4] = minus_inf;
    c.mask[4] = 1.0;
    expect_forward_rejected<troll::domain_error>(c, o, 4, "KL(p_new || pi*)");
    const sparse_run<double> run = run_sparse(c, objective(0.0));  // fine without the term
    CHECK(std::isfinite(run.metrics.loss));
    // With mask 0 (a padding row) the term adds nothing: accepted, and the batch's loss, metrics
    // and other rows' gradients are those of the batch with the row left as it was.
    c.mask[4] = 0.0;
    sparse_case plain = good;
    plain.mask[4] = 0.0;
    const sparse_run<double> padded = run_sparse(c, o), reference = run_sparse(plain, o);
    CHECK(padded.metrics.loss == reference.metrics.loss);
    CHECK(padded.metrics.kl_after_mean == reference.metrics.kl_after_mean);
    CHECK(padded.metrics.tokens == reference.metrics.tokens);
    CHECK(padded.token_loss[4] == 0.0);
    for (std::size_t k = 0; k < padded.grad.size(); ++k) {
      CAPTURE(k);
      CHECK(padded.grad[k] == (k / c.vocab == 4 ? 0.0 : reference.grad[k]));
    }
  }
  {
    // The new row masks the old row's top tokens: every admissible π is far from q.
    sparse_case c = good;
    for (int i = 0; i < 3; ++i) {
      const std::size_t k = std::size_t(c.old.indices[1 * c.old.k_max + std::size_t(i)]);
      c.new_logits[1 * c.vocab + k] = minus_inf;
    }
    expect_forward_rejected<troll::infeasible_error>(c, o, 1, "KL(pi||q) >=");
  }
  {
    troll::sparse_trust_region_objective bad = o;
    bad.eps = 0.0;
    expect_forward_rejected<troll::domain_error>(good, bad, troll::invalid_input::npos,
                                                 "eps must be finite");
    bad = o;
    bad.alpha = -1.0;
    expect_forward_rejected<troll::domain_error>(good, bad, troll::invalid_input::npos, "alpha");
    bad = o;
    bad.new_support.k = 300;
    expect_forward_rejected<troll::domain_error>(good, bad, troll::invalid_input::npos,
                                                 "sparsify_options.k");
    bad = o;
    bad.new_support = {0, 1.5};
    expect_forward_rejected<troll::domain_error>(good, bad, troll::invalid_input::npos,
                                                 "new_support.delta");
  }
  {
    // Rows with mask 0 are not read beyond their logits: any token, any advantage.
    sparse_case c = good;
    c.tokens[4] = -100;
    c.advantages[4] = nan_value;
    const sparse_run<double> run = run_sparse(c, o);
    CHECK(run.token_loss[4] == 0.0);
    CHECK(std::isfinite(run.metrics.loss));
  }
}

TEST_CASE("sparse TROLL backward rejects bad input before writing, naming the row") {
  const sparse_case c = make_sparse_case(6, 24, 19);
  const troll::sparse_trust_region_objective o = objective(1.0);
  const sparse_run<double> run = run_sparse(c, o);
  const std::size_t N = c.rows, V = c.vocab;
  auto expect_rejected = [&](const sparse_case& in, const aligned_rows<double>& al,
                             const sparse_rows<double>& lp,
                             const std::vector<troll::projection_stats>& stats, double grad_loss,
                             std::size_t row, const std::string& fragment) {
    std::vector<double> grad(N * V, 42.0);
    aligned_rows<double> al_copy = al;
    sparse_rows<double> lp_copy = lp;
    bool thrown = false;
    try {
      troll::objective_backward(cpu, o, troll::make_batch(in.new_logits.data(), N, V),
                                al_copy.view(), in.batch(), lp_copy.view(), stats.data(),
                                troll::make_batch(grad.data(), N, V), grad_loss);
    } catch (const troll::invalid_input& e) {
      thrown = true;
      CHECK(e.row() == row);
      CHECK_MESSAGE(std::string(e.what()).find(fragment) != std::string::npos, std::string(e.what()));
    }
    CHECK(thrown);
    for (double v : grad) CHECK(v == 42.0);
  };
  {
    sparse_rows<double> lp = run.log_probs;
    std::swap(lp.indices[2 * lp.k_max], lp.indices[2 * lp.k_max + 1]);
    expect_rejected(c, run.aligned, lp, run.stats, 1.0, 2, "log_probs entry 0 holds token");
    lp = run.log_probs;
    lp.counts[3] -= 1;
    expect_rejected(c, run.aligned, lp, run.stats, 1.0, 3, "log_probs has");
  }
  {
    std::vector<troll::projection_stats> stats = run.stats;
    std::size_t projected = 0;
    while (!stats[projected].active()) ++projected;
    stats[projected].sigma2 = 0.0;
    expect_rejected(c, run.aligned, run.log_probs, stats, 1.0, projected,
                    "statistics are unusable");
  }
  {
    sparse_case other = c;
    other.tokens[5] = token_outside_old(c, 5);
    bool in_u = false;
    for (int i = 0; i < run.aligned.counts[5]; ++i)
      in_u = in_u || run.aligned.indices[5 * run.aligned.k_max + std::size_t(i)] == other.tokens[5];
    REQUIRE(!in_u);
    expect_rejected(other, run.aligned, run.log_probs, run.stats, 1.0, 5,
                    "not in the aligned support U");
  }
  {
    sparse_case other = c;
    other.new_logits[1 * V + 3] = nan_value;
    expect_rejected(other, run.aligned, run.log_probs, run.stats, 1.0, 1,
                    "new_logits is NaN at token 3");
  }
  {
    aligned_rows<double> al = run.aligned;
    al.old_log_probs[0] = nan_value;
    expect_rejected(c, al, run.log_probs, run.stats, 1.0, 0, "is NaN");
  }
  expect_rejected(c, run.aligned, run.log_probs, run.stats, nan_value, troll::invalid_input::npos,
                  "grad_loss");
}

TEST_CASE("sparse TROLL: a sampled token far in the old row's tail overflows with a typed error") {
  // Row 2's sampled token gets old log-prob −1e6 (its mass moves to the remainder): ρ = π*_a/q_a
  // ≈ e^(1e6·t*) overflows double. The forward names the row before writing a token loss; rows
  // whose ratio fits are unaffected (row 1, with −300, runs).
  sparse_case c = make_sparse_case(4, 40, 77);
  c.mask = {1.0, 1.0, 1.0, 1.0};
  auto push_to_tail = [&](std::size_t r, double log_prob) {
    const std::size_t at = sampled_entry(c, r);
    REQUIRE(at != std::size_t(-1));
    const double moved = std::exp(c.old.log_probs[at]);
    c.old.log_probs[at] = log_prob;
    c.old.log_remainder[r] = std::log(std::exp(c.old.log_remainder[r]) + moved);
  };
  push_to_tail(1, -300.0);
  push_to_tail(2, -1e6);
  const troll::sparse_trust_region_objective o = objective(0.0);
  expect_forward_rejected<troll::domain_error>(c, o, 2, "overflows double");
  c.mask[2] = 0.0;  // a row with mask 0 is never asked for its ratio
  const sparse_run<double> run = run_sparse(c, o);
  CHECK(std::isfinite(run.metrics.loss));
  for (double g : run.grad) CHECK(std::isfinite(g));
}

TEST_CASE("sparse TROLL: rows the solver stops early on keep a feasible member and a finite loss") {
  // One Newton member per row: projected rows end not_converged (docs/api.md: a feasible member,
  // KL < ε). The forward keeps them with their loss (the CUDA backend must too); the backward
  // refuses them, naming the first.
  sparse_case c = make_sparse_case(12, 48, 5);
  troll::sparse_trust_region_objective o = objective(0.7);
  o.projection.max_iterations = 1;
  const std::size_t cap = c.old.k_max + std::size_t(o.new_support.k);
  aligned_rows<double> aligned(c.rows, cap, c.vocab);
  sparse_rows<double> log_probs(c.rows, cap, c.vocab);
  std::vector<troll::projection_stats> stats(c.rows);
  std::vector<double> token_loss(c.rows, -7.0);
  const troll::objective_metrics m =
      troll::objective_forward(cpu, o, troll::make_batch(c.new_logits.data(), c.rows, c.vocab), c.old.view(),
                               c.batch(), aligned.view(), log_probs.view(), stats.data(), token_loss.data());
  CHECK(std::isfinite(m.loss));
  std::size_t stopped = 0, first_stopped = c.rows;
  for (std::size_t r = 0; r < c.rows; ++r) {
    CAPTURE(r);
    if (stats[r].status != troll::row_status::not_converged) continue;
    ++stopped;
    first_stopped = std::min(first_stopped, r);
    CHECK(std::isfinite(token_loss[r]));
    CHECK(stats[r].kl_after < o.eps);
    CHECK(stats[r].t >= 0.0);  // t = 0 (π = q) where the one member was above ε
    CHECK(stats[r].t < 1.0);
    CHECK(aligned.counts[r] > 0);
    CHECK(log_probs.counts[r] == aligned.counts[r]);
  }
  REQUIRE(stopped > 0);
  std::vector<double> grad(c.rows * c.vocab, -7.0);
  try {
    troll::objective_backward(cpu, o, troll::make_batch(c.new_logits.data(), c.rows, c.vocab), aligned.view(),
                              c.batch(), log_probs.view(), stats.data(),
                              troll::make_batch(grad.data(), c.rows, c.vocab), 1.0);
    FAIL("objective_backward accepted a not_converged row");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == first_stopped);
  }
  for (double g : grad) CHECK(g == -7.0);
}
