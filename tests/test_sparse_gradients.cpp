#include <doctest/doctest.h>

// Gradients of the sparse path. The properties checked with troll's gradient checker (each
// backward on its own with full Jacobians, the compositions
//   dense logits → sparsify → align → project → scalar loss,
// the float backward against the double one, the shard backward against the whole row) are the
// one body tests/bodies/sparse_gradients.hpp, compiled here for troll::cpu (and for troll::cuda by
// tests/cuda/test_cuda_sparse_projection_oracle.cu); below it, the CPU's argument checks of the
// backward entry points.

#include <troll/gradcheck.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "sparse_oracle.hpp"
#include "sparse_staging.hpp"
#include "tolerance.hpp"

using namespace sparse_test;

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "../bodies/sparse_gradients.hpp"

TEST_CASE("project_backward rejects log_probs whose count exceeds their own capacity, reading nothing past it") {
  fixture fx(11);
  sparse_rows<double> sn(1, 7, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), nullptr, {6, 1e-3}, sn.view());
  aligned_rows<double> al(1, 14, vocab);
  troll::align(troll::cpu, sn.view(), fx.so.view(), al.view());
  const int u = al.counts[0];
  REQUIRE(u >= 2);
  sparse_rows<double> out(1, 14, vocab);
  troll::projection_stats st;
  troll::project(troll::cpu, al.view(), fx.eps, out.view(), &st);
  // The same row through a view one entry narrower than its count (as if k_max were wrong).
  const troll::sparse_batch_view<const double> narrow{out.indices.data(), out.log_probs.data(), out.counts.data(),
                                                      out.log_remainder.data(), 1, std::size_t(u) - 1, vocab};
  sparse_grads<double> g(1, 14), gn(1, 14);
  std::fill(gn.log_probs.begin(), gn.log_probs.end(), 7.0);
  try {
    troll::project_backward(troll::cpu, al.view(), narrow, &st, g.view(), gn.view());
    FAIL("project_backward read log_probs past their capacity");
  } catch (const troll::shape_error& e) {
    CHECK(e.row() == 0);
    CHECK(std::string(e.what()).find("log_probs: count") != std::string::npos);
  }
  CHECK(std::all_of(gn.log_probs.begin(), gn.log_probs.end(), [](double v) { return v == 7.0; }));
}

TEST_CASE("sparsify_shard_backward rejects bad log-sums, shards outside the vocabulary and NaN gradients") {
  const std::size_t rows = 2, v = 10;
  std::vector<double> z(rows * v);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::cos(double(i));
  sparse_rows<double> support(rows, 3, v);
  std::vector<double> log_sums(troll::sparsify_log_sums_width * rows);
  std::vector<troll::sparsify_state> st(rows);
  troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), rows, v, v}, 0, v, nullptr, {3, 0.0}, st.data());
  troll::sparsify_finalize(troll::cpu, st.data(), {3, 0.0}, support.view(), log_sums.data());
  sparse_grads<double> g(rows, 3);
  std::vector<double> out(rows * 4, -7.0);
  const auto shard = troll::batch_view<const double>{z.data() + 6, rows, 4, v};
  const auto grad_shard = troll::batch_view<double>{out.data(), rows, 4, 4};
  troll::sparsify_shard_backward(troll::cpu, shard, 6, support.view(), g.view(), log_sums.data(), grad_shard);
  CHECK(out[0] == 0.0);  // zero upstream, zero gradient
  std::vector<double> bad = log_sums;
  bad[2] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(troll::sparsify_shard_backward(troll::cpu, shard, 6, support.view(), g.view(), bad.data(), grad_shard),
                  troll::domain_error);
  bad = log_sums;
  bad[3] = bad[1] + (bad[0] - bad[2]) + 1.0;  // a tail mass above the total ({ref, total, tail_ref, tail})
  CHECK_THROWS_AS(troll::sparsify_shard_backward(troll::cpu, shard, 6, support.view(), g.view(), bad.data(), grad_shard),
                  troll::domain_error);
  for (int entry : {0, 1}) {  // a reference or a total that is not finite
    for (double x : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      bad = log_sums;
      bad[troll::sparsify_log_sums_width + std::size_t(entry)] = x;  // row 1
      out.assign(out.size(), -7.0);
      CHECK_THROWS_WITH_AS(
          troll::sparsify_shard_backward(troll::cpu, shard, 6, support.view(), g.view(), bad.data(), grad_shard),
          doctest::Contains(entry == 0 ? "row 1: log_sums ref" : "row 1: log_sums total"), troll::domain_error);
      CHECK(out[0] == -7.0);
    }
  }
  CHECK_THROWS_AS(troll::sparsify_shard_backward(troll::cpu, shard, 7, support.view(), g.view(), log_sums.data(), grad_shard),
                  troll::shape_error);
  g.log_remainder[1] = std::numeric_limits<double>::infinity();
  out.assign(out.size(), -7.0);
  CHECK_THROWS_AS(troll::sparsify_shard_backward(troll::cpu, shard, 6, support.view(), g.view(), log_sums.data(), grad_shard),
                  troll::domain_error);
  CHECK(out[0] == -7.0);  // nothing written
}
