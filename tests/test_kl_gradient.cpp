// test_kl_gradient.cpp — troll::kl against a long-double reference and troll::kl_backward (both
// gradients) against troll's gradient checker, with masked tokens; then composite losses that
// chain kl_backward into project_backward.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "grad_helpers.hpp"  // first: it silences a GCC false positive in troll's headers

#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend.hpp"

using namespace grad_helpers;

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The oracle and finite-difference tests, one body for every backend (also compiled for
// troll::cuda by tests/cuda/test_cuda_kl_gradient.cu).
#include "../bodies/kl_gradient.hpp"

TEST_CASE("kl_backward: one gradient at a time; the skipped one is not needed") {
  rng g(11);
  const pair_batch b = kl_rows(g, 8);
  const std::size_t rows = b.rows, v = b.cols;
  std::vector<double> up = g.normals(rows, 1.0);
  std::vector<double> gp_both(rows * v), gq_both(rows * v), gp(rows * v, 4.0), gq(rows * v, 4.0);
  troll::kl_backward(troll::cpu, troll::make_batch(b.new_logits.data(), rows, v),
                     troll::make_batch(b.old_logits.data(), rows, v), up.data(),
                     troll::make_batch(gp_both.data(), rows, v), troll::make_batch(gq_both.data(), rows, v));
  troll::kl_backward(troll::cpu, troll::make_batch(b.new_logits.data(), rows, v),
                     troll::make_batch(b.old_logits.data(), rows, v), up.data(),
                     troll::make_batch(gp.data(), rows, v), troll::batch_view<double>{});
  troll::kl_backward(troll::cpu, troll::make_batch(b.new_logits.data(), rows, v),
                     troll::make_batch(b.old_logits.data(), rows, v), up.data(),
                     troll::batch_view<double>{}, troll::make_batch(gq.data(), rows, v));
  CHECK(std::memcmp(gp.data(), gp_both.data(), gp.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(gq.data(), gq_both.data(), gq.size() * sizeof(double)) == 0);
  // Gradients sum to zero over each row (shift invariance), masked p entries get exactly 0.
  for (std::size_t r = 0; r < rows; ++r) {
    double sp = 0, sq = 0, mag = 0;
    for (std::size_t j = 0; j < v; ++j) {
      sp += gp[r * v + j], sq += gq[r * v + j], mag += std::fabs(gp[r * v + j]) + std::fabs(gq[r * v + j]);
      if (b.new_row(r)[j] == neg_inf) CHECK(gp[r * v + j] == 0.0);
    }
    CHECK(std::fabs(sp) <= 1e-13 * (1 + mag));
    CHECK(std::fabs(sq) <= 1e-13 * (1 + mag));
  }
}

TEST_CASE("kl_backward: random directions at V = 4096") {
  rng g(12);
  const pair_batch b = kl_rows(g, 4096);
  const packing pack(b, true, false, 0.0);
  troll::gradcheck_options o = opts(1e-8, 1e-5);
  o.directions = 12;
  const troll::gradcheck_result r =
      troll::check_vjp_random(kl_function{&pack}, kl_vjp{&pack}, pack.x0(), b.rows, o);
  INFO(r.report());
  CHECK(r.ok);
  CHECK(r.checked == 12);
}

namespace {

/// L = Σ_r KL(p̃_r ‖ π*_r) + Σ w log π* through kl_backward and project_backward, checked with
/// check_gradient over (z̃, z°, log ε). KL's gradient w.r.t. the logits of its second argument,
/// fed log π* as logits, is the upstream ∂L/∂log π* of the projection (log π* is normalised, so
/// log_softmax is the identity there). With `new_row_mask`, row 1's new logits mask a token.
void check_composite_kl_loss(bool new_row_mask) {
  rng g(21);
  const std::size_t v = 9, rows = 3;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += (r == 2 ? 0.02 : 1.4) * g.normal();
    if (r == 1 && new_row_mask) zn[3] = neg_inf, zo[3] = -4.0;  // π* masks it too
    b.set_row(r, zn, zo);
  }
  const double eps = 0.06;
  const std::vector<double> w = g.normals(rows * v, 1.0);
  const packing pack(b, true, true, eps);

  auto loss = [&](const double* x) {
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    std::vector<double> k(rows);
    troll::kl(troll::cpu, troll::make_batch(bb.new_logits.data(), rows, v),
              troll::make_batch(f.log_probs.data(), rows, v), k.data());
    double total = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      total += k[r];
      for (std::size_t j = 0; j < v; ++j)
        if (f.log_probs[r * v + j] != neg_inf) total += w[r * v + j] * f.log_probs[r * v + j];
    }
    return total;
  };
  auto grad = [&](const double* x, double* gx) {
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    std::vector<double> ones(rows, 1.0), gp(rows * v), gq(rows * v);
    troll::kl_backward(troll::cpu, troll::make_batch(bb.new_logits.data(), rows, v),
                       troll::make_batch(f.log_probs.data(), rows, v), ones.data(),
                       troll::make_batch(gp.data(), rows, v), troll::make_batch(gq.data(), rows, v));
    std::vector<double> up(rows * v), gn(rows * v), go(rows * v), ge(rows);
    for (std::size_t k = 0; k < up.size(); ++k) up[k] = gq[k] + w[k];
    troll::project_backward(troll::cpu, troll::make_batch(bb.new_logits.data(), rows, v),
                            troll::make_batch(bb.old_logits.data(), rows, v),
                            troll::make_batch(f.log_probs.data(), rows, v), f.stats.data(),
                            troll::make_batch(up.data(), rows, v), troll::make_batch(gn.data(), rows, v),
                            troll::make_batch(go.data(), rows, v), ge.data());
    for (std::size_t k = 0; k < gn.size(); ++k) gn[k] += gp[k];  // the direct p̃ path of KL
    pack.pack_gradient(gn, go, ge, e, gx);
  };
  const forward_result f0 = forward(b, eps);
  CHECK(f0.stats[0].status == troll::row_status::projected);
  CHECK(f0.stats[1].status == troll::row_status::projected);
  CHECK(f0.stats[2].status == troll::row_status::inactive);
  const troll::gradcheck_result r = troll::check_gradient(loss, grad, pack.x0(), opts());
  INFO(r.report());
  CHECK(r.ok);
}

}  // namespace

TEST_CASE("composite: L = KL(p̃ ‖ π*) + Σ w log π*, kl_backward chained into project_backward") {
  check_composite_kl_loss(false);
}

// ---- Regressions of library bugs these tests found (fixed in e8c331b), and an open one ----

TEST_CASE("kl: a token masked in both rows, and no other mask, is simply absent") {
  // p = {0, 1, -inf}, q = {0, 0, -inf}: KL must equal KL({0,1} ‖ {0,0}). (Was: NaN.)
  const std::vector<double> zp = {0.0, 1.0, neg_inf}, zq = {0.0, 0.0, neg_inf};
  double k = -1.0;
  troll::kl(troll::cpu, troll::make_batch(zp.data(), 1, 3), troll::make_batch(zq.data(), 1, 3), &k);
  CHECK(k == doctest::Approx(reference_kl(zp.data(), zq.data(), 2)).epsilon(1e-13));
  std::vector<double> gp(3, 7.0), gq(3, 7.0);
  const double one = 1.0;
  troll::kl_backward(troll::cpu, troll::make_batch(zp.data(), 1, 3), troll::make_batch(zq.data(), 1, 3),
                     &one, troll::make_batch(gp.data(), 1, 3), troll::make_batch(gq.data(), 1, 3));
  for (std::size_t j = 0; j < 3; ++j) {
    CHECK(std::isfinite(gp[j]));
    CHECK(std::isfinite(gq[j]));
  }
  CHECK(gp[2] == 0.0);
  CHECK(gq[2] == 0.0);
}

TEST_CASE("composite KL(p̃ ‖ π*) loss when the new row masks a token") {
  // The TROLL regulariser KL(p̃ ‖ π*) on a row whose new logits mask a token: p̃ and π* are then
  // both −inf there and nothing else is masked (was NaN, through the bug above).
  check_composite_kl_loss(true);
}

TEST_CASE("kl of disjoint supports is +inf (math.md §1), not an error") {
  // Regression: p = {0, -inf}, q = {-inf, 0}. p puts all its mass where q has none, so by the
  // definition KL(p‖q) = +inf (troll once raised the projection's infeasible_error here).
  const std::vector<double> zp = {0.0, neg_inf}, zq = {neg_inf, 0.0};
  double k = -1.0;
  CHECK_NOTHROW(troll::kl(troll::cpu, troll::make_batch(zp.data(), 1, 2),
                          troll::make_batch(zq.data(), 1, 2), &k));
  CHECK(k == std::numeric_limits<double>::infinity());
}
