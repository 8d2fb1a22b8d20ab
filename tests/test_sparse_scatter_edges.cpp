#include <doctest/doctest.h>

// The sparse path's scatters at their edges, found by a gradient audit (long-double oracle from
// math.md §4):
//  * sparsify_backward / sparsify_shard_backward on near-deterministic rows: a support entry
//    g_k − p_k G cancelled where p_k rounds to 1 (3.5e-5 relative at a gap of 30, 0 for 3.8e-17
//    at 40); now g_k (1 − p_k) − p_k (G − g_k) with 1 − p_k = −expm1(log p_k);
//  * the bucket's upstream gradient is ignored where it is a masked output (a massless tail, or
//    a support covering the vocabulary) — before, it moved every entry's gradient — and a masked
//    support token (logit −inf) gets 0;
//  * align_backward: the same for the aligned side's −inf values (U∖S of a massless tail, the
//    bucket when U covers the vocabulary) and −inf entries of the row.

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace scatter_edges {

using ld = long double;
const double NEG_INF = -std::numeric_limits<double>::infinity();

/// A one-row sparse support (values: log-softmax of z at the ids; log r of the rest) over z.
template <class T>
struct one_row {
  std::vector<T> z;
  std::vector<troll::sparse_index> ids, count;
  std::vector<T> values, remainder;
  one_row(std::vector<T> logits, std::vector<troll::sparse_index> support)
      : z(std::move(logits)), ids(std::move(support)), count(1, troll::sparse_index(ids.size())) {
    ld m = -INFINITY, s = 0;
    for (T x : z) m = std::max(m, ld(x));
    for (T x : z) s += std::exp(ld(x) - m);
    ld tail = 0;
    for (std::size_t j = 0; j < z.size(); ++j) {
      bool in = false;
      for (auto i : ids) in = in || std::size_t(i) == j;
      if (!in) tail += std::exp(ld(z[j]) - m) / s;
    }
    for (auto i : ids) values.push_back(T(ld(z[std::size_t(i)]) - m - std::log(s)));
    remainder.push_back(T(std::log(tail)));
  }
  troll::sparse_batch_view<const T> support() const {
    return troll::sparse_batch_view<const T>{ids.data(), values.data(), count.data(), remainder.data(), 1, ids.size(),
                                             z.size()};
  }
  std::vector<T> backward(std::vector<T> g, T g_r) const {
    std::vector<T> out(z.size(), T(42));
    troll::sparsify_backward(troll::cpu, troll::make_batch<const T>(z.data(), 1, z.size()), support(),
                             troll::sparse_grad_view<const T>{g.data(), &g_r, 1, ids.size()},
                             troll::make_batch(out.data(), 1, z.size()));
    return out;
  }
};

}  // namespace scatter_edges

namespace se = scatter_edges;

TEST_CASE_TEMPLATE("sparsify_backward on near-deterministic rows keeps 1 - p of the top token", T, double, float) {
  for (double gap : {10.0, 20.0, 30.0, 40.0, 60.0}) {
    if (sizeof(T) == 4 && gap > 40) continue;
    CAPTURE(gap);
    std::vector<T> z(10, T(0));
    z[0] = T(gap);
    const se::one_row<T> row(z, {0});
    const std::vector<T> got = row.backward({T(1)}, T(0));
    // ∂L/∂z_0 = 1 − p_0 = Σ_{j≠0} p_j, ∂L/∂z_j = −p_j.
    const se::ld e = std::exp(-se::ld(gap)), p_other = e / (1 + 9 * e);
    const double tol = sizeof(T) == 4 ? 2e-7 : 1e-14;
    CHECK(std::fabs(double(got[0]) - double(9 * p_other)) <= tol * double(9 * p_other));
    for (std::size_t j = 1; j < 10; ++j) CHECK(std::fabs(double(got[j]) + double(p_other)) <= tol * double(p_other));
  }
}

TEST_CASE("sparsify_backward: a light bucket's term keeps its digits") {
  // One token 100 … 650 above the others, the rest in the bucket (log r ≈ −gap), g_R = 1000: the
  // bucket term g_R·p_k/r was formed as g_R·e^{−log r}·p_k while log r > −600, carrying log r's
  // rounding times |log r| (140 … 280·2⁻⁵³ of max |∂L/∂z| here before the thirty-fourth session;
  // docs/sparse.md promised 253). Now e^{(z_k − tail_ref) − tail} below log r = −32
  // (light_bucket_log). Oracle: long double, p_k/r from the tail's own log-sum.
  std::uint64_t state = 88172645463325252ull;
  auto uniform = [&state] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return double(state >> 11) * 0x1p-53;
  };
  for (const double gap : {100.0, 300.0, 450.0, 590.0, 650.0}) {
    for (int rep = 0; rep < 20; ++rep) {
      CAPTURE(gap);
      CAPTURE(rep);
      std::vector<double> z(12);
      for (double& x : z) x = 4.0 * uniform() - 2.0;
      z[0] += gap;
      const se::one_row<double> row(z, {0});
      const double g0 = 2e-3 * uniform() - 1e-3, g_r = 1000.0;
      const std::vector<double> got = row.backward({g0}, g_r);
      se::ld m = -INFINITY, all = 0, tail = 0;
      for (double x : z) m = std::max(m, se::ld(x));
      for (std::size_t j = 0; j < z.size(); ++j) {
        all += std::exp(se::ld(z[j]) - m);
        if (j != 0) tail += std::exp(se::ld(z[j]) - m);
      }
      const se::ld log_all = m + std::log(all), log_tail = m + std::log(tail), sum_g = se::ld(g0) + g_r;
      double worst = 0, scale = 0;
      for (std::size_t j = 0; j < z.size(); ++j) {
        const se::ld p = std::exp(se::ld(z[j]) - log_all);
        const se::ld want = j == 0 ? g0 * -std::expm1(se::ld(z[0]) - log_all) - p * g_r
                                   : g_r * std::exp(se::ld(z[j]) - log_tail) - p * sum_g;
        scale = std::max(scale, double(std::fabs(want)));
        worst = std::max(worst, double(std::fabs(want - got[j])));
      }
      CHECK(worst <= 4 * 0x1p-53 * scale);
    }
  }
}

TEST_CASE("sparsify_backward: a massless bucket's gradient is ignored, masked inputs get 0") {
  // A masked token in the support (logit −inf, value −inf): a masked input, its gradient is 0
  // (it was its upstream g), and a masked output, whose upstream g is ignored: it does not enter
  // Σ g either (the other entries' −p_j Σ g moved by p_j·g before: −0.09 and −0.24 here). The
  // rule reads the support's values, which every vocabulary shard holds whole.
  {
    const se::one_row<double> row({0.0, 1.0, se::NEG_INF, 2.0}, {3, 1, 2});
    for (double v : row.backward({0.0, 0.0, 1.0}, 0.0)) CHECK(v == 0.0);
    const std::vector<double> with = row.backward({0.25, -0.5, 1.0}, 0.5),
                              without = row.backward({0.25, -0.5, 0.0}, 0.5);
    CHECK(with == without);
  }
  // The support covers the vocabulary: the bucket is −inf and g_R does not count.
  {
    const se::one_row<double> row({0.0, 1.0, 2.0, 3.0}, {0, 1, 2, 3});
    for (double v : row.backward({0.0, 0.0, 0.0, 0.0}, 1.0)) CHECK(v == 0.0);
  }
  // A tail of −inf logits only: log r = −inf, g_R does not count.
  {
    const se::one_row<double> row({0.0, 1.0, se::NEG_INF, se::NEG_INF}, {0, 1});
    for (double v : row.backward({0.0, 0.0}, 1.0)) CHECK(v == 0.0);
    // ... while the counted gradients are those of the row without the bucket.
    const std::vector<double> with = row.backward({0.5, -1.0}, 7.0), without = row.backward({0.5, -1.0}, 0.0);
    CHECK(with == without);
  }
}

TEST_CASE_TEMPLATE("a masked sampled token's upstream gradient is ignored: sparsify and align(new_logits) backward",
                   T, double, float) {
  // sparsify keeps the sampled token even where its logit is −inf (value −inf): z = {0, 0, −inf},
  // K = 1, δ = 0, sampled 2 → S = {0, 2}. An upstream g on that −inf entry moved the others'
  // gradients by −p_j·g (−0.5, −0.5 for g = 1); it is a masked output and is ignored now.
  const T ninf = -std::numeric_limits<T>::infinity();
  const std::vector<T> z = {T(0), T(0), ninf};
  const troll::token_id sampled = 2;
  std::vector<troll::sparse_index> ids(2), count(1);
  std::vector<T> values(2), remainder(1);
  troll::sparse_batch_view<T> rows{ids.data(), values.data(), count.data(), remainder.data(), 1, 2, 3};
  troll::sparsify(troll::cpu, troll::make_batch<const T>(z.data(), 1, 3), &sampled, troll::sparsify_options{1, 0.0},
                  rows);
  REQUIRE(count[0] == 2);
  REQUIRE(values[1] == ninf);
  const troll::sparse_batch_view<const T> support{ids.data(), values.data(), count.data(), remainder.data(), 1, 2, 3};
  const std::vector<T> g = {T(0), T(1)};
  const T g_r = T(0);
  std::vector<T> out(3, T(42));
  troll::sparsify_backward(troll::cpu, troll::make_batch<const T>(z.data(), 1, 3), support,
                           troll::sparse_grad_view<const T>{g.data(), &g_r, 1, 2}, troll::make_batch(out.data(), 1, 3));
  for (T v : out) CHECK(v == T(0));
  // The same gather as align's new side: the dense new logits against this support.
  std::vector<troll::sparse_index> u(2), ucount(1);
  std::vector<T> new_lp(2), old_lp(2), new_r(1), old_r(1);
  troll::aligned_batch_view<T> aligned{u.data(), ucount.data(), new_lp.data(), old_lp.data(), new_r.data(),
                                       old_r.data(), 1, 2, 3};
  troll::align(troll::cpu, troll::make_batch<const T>(z.data(), 1, 3), troll::sparse_batch_view<const T>{}, support,
               aligned);
  std::fill(out.begin(), out.end(), T(42));
  const std::vector<T> g_aligned = {u[0] == 2 ? T(1) : T(0), u[1] == 2 ? T(1) : T(0)};
  troll::sparsify_backward(troll::cpu, troll::make_batch<const T>(z.data(), 1, 3), aligned.new_side(),
                           troll::sparse_grad_view<const T>{g_aligned.data(), &g_r, 1, 2},
                           troll::make_batch(out.data(), 1, 3));
  for (T v : out) CHECK(v == T(0));
}

TEST_CASE("sparsify_shard_backward equals sparsify_backward on the edge rows, bit for bit") {
  struct edge {
    std::vector<double> z;
    std::vector<troll::sparse_index> ids;
    std::vector<double> g;
    double g_r;
  };
  std::vector<double> peaked(10, 0.0);
  peaked[0] = 40.0;
  const std::vector<edge> edges = {{peaked, {0}, {1.0}, 0.0},
                                   {{0.0, 1.0, se::NEG_INF, 2.0}, {3, 1, 2}, {0.25, -0.5, 1.0}, 0.5},
                                   {{0.0, 1.0, 2.0, 3.0}, {0, 1, 2, 3}, {0.1, 0.2, 0.3, -0.6}, 1.0},
                                   {{0.0, 1.0, se::NEG_INF, se::NEG_INF}, {0, 1}, {0.5, -1.0}, 7.0}};
  for (const edge& e : edges) {
    const se::one_row<double> row(e.z, e.ids);
    const std::vector<double> whole = row.backward(e.g, e.g_r);
    // The row's log-sums {ref, total, tail_ref, tail} from sparsify_finalize's definition.
    double ref = se::NEG_INF;
    for (double x : e.z) ref = std::max(ref, x);
    double total = 0.0, tail_ref = se::NEG_INF;  // total − 1: every term but the first maximum's
    bool top_seen = false;
    for (std::size_t j = 0; j < e.z.size(); ++j) {
      if (e.z[j] == ref && !top_seen) {
        top_seen = true;
      } else {
        total += std::exp(e.z[j] - ref);
      }
      bool in = false;
      for (auto i : e.ids) in = in || std::size_t(i) == j;
      if (!in) tail_ref = std::max(tail_ref, e.z[j]);
    }
    double tail = 0.0;
    for (std::size_t j = 0; j < e.z.size(); ++j) {
      bool in = false;
      for (auto i : e.ids) in = in || std::size_t(i) == j;
      if (!in && tail_ref > se::NEG_INF) tail += std::exp(e.z[j] - tail_ref);
    }
    const double sums[4] = {ref, std::log1p(total), tail_ref, tail_ref > se::NEG_INF ? std::log(tail) : se::NEG_INF};
    const std::size_t V = e.z.size(), half = V / 2;
    std::vector<double> g = e.g, g_r(1, e.g_r), left(half, 42.0), right(V - half, 42.0);
    const troll::sparse_grad_view<const double> grad{g.data(), g_r.data(), 1, e.ids.size()};
    troll::sparsify_shard_backward(troll::cpu, troll::make_batch<const double>(e.z.data(), 1, half, V), 0,
                                   row.support(), grad, sums, troll::make_batch(left.data(), 1, half));
    troll::sparsify_shard_backward(troll::cpu, troll::make_batch<const double>(e.z.data() + half, 1, V - half, V),
                                   half, row.support(), grad, sums, troll::make_batch(right.data(), 1, V - half));
    for (std::size_t j = 0; j < V; ++j) {
      CAPTURE(j);
      const double shard = j < half ? left[j] : right[j - half];
      // The same formulas from the same log-sums up to their last bits (these sums are not
      // sparsify's canonical ones): agreement to a few ulps of the largest entry.
      double scale = 0.0;
      for (double w : whole) scale = std::max(scale, std::fabs(w));
      CHECK(std::fabs(shard - whole[j]) <= 1e-15 * std::max(scale, 1e-300));
    }
  }
}

TEST_CASE("align_backward ignores upstream gradients at the aligned side's -inf values") {
  // V = 4; new row from z̃ = [0, 1, 2, 3] on S = {0, 1}, old row from z° = [0, 1.5, 2, 3] on {2, 3}:
  // U = {0, 1, 2, 3} covers V, so both aligned buckets are −inf.
  const se::one_row<double> fresh({0.0, 1.0, 2.0, 3.0}, {0, 1}), old({0.0, 1.5, 2.0, 3.0}, {2, 3});
  std::vector<troll::sparse_index> ids(4), counts(1);
  std::vector<double> ln(4), lo(4), lrn(1), lro(1);
  const troll::aligned_batch_view<double> aligned{ids.data(), counts.data(), ln.data(), lo.data(),
                                                  lrn.data(), lro.data(), 1, 4, 4};
  troll::align(troll::cpu, fresh.support(), old.support(), aligned);
  REQUIRE(counts[0] == 4);
  CHECK(lrn[0] == se::NEG_INF);
  CHECK(lro[0] == se::NEG_INF);
  std::vector<double> g = {0.1, -0.2, 0.3, 0.4}, g_r = {1.0};
  const troll::sparse_grad_view<const double> grad{g.data(), g_r.data(), 1, 4};
  for (const bool new_side : {true, false}) {
    CAPTURE(new_side);
    const se::one_row<double>& row = new_side ? fresh : old;
    std::vector<double> out(2, 42.0), out_r(1, 42.0);
    troll::align_backward(troll::cpu, row.support(), troll::aligned_batch_view<const double>(aligned), grad,
                          troll::sparse_grad_view<double>{out.data(), out_r.data(), 1, 2});
    // ∂L/∂log r = Σ_{u∈U∖S} g_u (the bucket's g_R' ignored); entries of S pass through.
    double want_r = 0.0;
    for (std::size_t i = 0; i < 4; ++i) {
      bool in = false;
      for (auto s : row.ids) in = in || s == ids[i];
      if (in) {
        for (std::size_t k = 0; k < 2; ++k)
          if (row.ids[k] == ids[i]) CHECK(out[k] == g[i]);
      } else {
        want_r += g[i];
      }
    }
    CHECK(out_r[0] == doctest::Approx(want_r).epsilon(1e-15));
  }
  // An old row with a massless tail (log r = −inf): its U∖S values log r − log m are −inf, so
  // their gradients and the bucket's are ignored: ∂L/∂log r = 0.
  se::one_row<double> massless({se::NEG_INF, se::NEG_INF, 2.0, 3.0}, {2, 3});
  REQUIRE(massless.remainder[0] == se::NEG_INF);
  troll::align(troll::cpu, fresh.support(), massless.support(), aligned);
  std::vector<double> out(2, 42.0), out_r(1, 42.0);
  troll::align_backward(troll::cpu, massless.support(), troll::aligned_batch_view<const double>(aligned), grad,
                        troll::sparse_grad_view<double>{out.data(), out_r.data(), 1, 2});
  CHECK(out_r[0] == 0.0);
}
