// test_kl_gradient.cpp — troll::kl against a long-double reference, troll::kl_backward (both
// gradients) against troll's gradient checker with masked tokens, and composite losses that chain
// kl_backward into project_backward: the body tests/bodies/kl_gradient.hpp compiled for the CPU;
// then CPU-only checks (one gradient at a time, regressions).
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

TEST_CASE("kl of disjoint supports is +inf (math.md §1), not an error") {
  // Regression: p = {0, -inf}, q = {-inf, 0}. p puts all its mass where q has none, so by the
  // definition KL(p‖q) = +inf (troll once raised the projection's infeasible_error here).
  const std::vector<double> zp = {0.0, neg_inf}, zq = {neg_inf, 0.0};
  double k = -1.0;
  CHECK_NOTHROW(troll::kl(troll::cpu, troll::make_batch(zp.data(), 1, 2),
                          troll::make_batch(zq.data(), 1, 2), &k));
  CHECK(k == std::numeric_limits<double>::infinity());
}
