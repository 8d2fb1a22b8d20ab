#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

// Gradients of the sparse path, checked with troll's gradient checker in double: each backward
// (sparsify, align, project) on its own with full Jacobians, then whole compositions
//   dense logits → sparsify → align → project → scalar loss
// with the support held fixed (logits well separated, δ away from the prefix boundary), and the
// float backward against the double one.

#include <troll/gradcheck.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparse_oracle.hpp"

using namespace sparse_test;

namespace {

constexpr std::size_t vocab = 40;

/// Logits with gaps ≥ 0.05 between any two tokens, so a 1e-6 step never reorders them.
std::vector<double> separated_logits(std::mt19937_64& rng, double scale) {
  std::vector<double> z(vocab);
  std::vector<std::size_t> perm(vocab);
  std::iota(perm.begin(), perm.end(), std::size_t(0));
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<double> jitter(0.0, 0.02);
  for (std::size_t j = 0; j < vocab; ++j) z[perm[j]] = -scale * 0.1 * double(j) + jitter(rng);
  return z;
}

struct fixture {
  std::vector<double> x0, zo;
  sparse_rows<double> so;
  std::vector<double> weight;  // loss weight per token id
  double weight_bucket = 0.7;
  double eps = 0.02;
  troll::token_id sampled = 0;

  explicit fixture(unsigned seed) : so(1, 7, vocab), weight(vocab) {
    std::mt19937_64 rng(seed);
    x0 = separated_logits(rng, 2.0);
    zo = separated_logits(rng, 1.5);
    troll::sparsify(troll::cpu, troll::make_batch(zo.data(), 1, vocab), nullptr, {6, 1e-3}, so.view());
    std::normal_distribution<double> n01;
    for (double& w : weight) w = n01(rng);
    // A sampled token ranked low in the new row, so it is added, not selected.
    std::vector<std::size_t> order(vocab);
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return x0[a] > x0[b]; });
    sampled = troll::token_id(order[vocab - 5]);
  }

  double loss_of(const sparse_rows<double>& out) const {
    double sum = weight_bucket * out.log_remainder[0];
    for (int i = 0; i < out.counts[0]; ++i) sum += weight[std::size_t(out.indices[std::size_t(i)])] * out.log_probs[std::size_t(i)];
    return sum;
  }
  void seed_grad(const sparse_rows<double>& out, sparse_grads<double>& g) const {
    for (int i = 0; i < out.counts[0]; ++i) g.log_probs[std::size_t(i)] = weight[std::size_t(out.indices[std::size_t(i)])];
    g.log_remainder[0] = weight_bucket;
  }
};

}  // namespace

TEST_CASE("composition: dense logits -> sparsify -> align(logits, support, old) -> project -> loss") {
  for (unsigned seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    fixture fx(seed);
    std::vector<troll::sparse_index> base_support;
    auto forward = [&](const double* x, sparse_rows<double>& sn, aligned_rows<double>& al,
                       sparse_rows<double>& out, troll::projection_stats& st) {
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, {5, 0.0}, sn.view());
      troll::align(troll::cpu, troll::make_batch(x, 1, vocab), troll::sparse_batch_view<const double>(sn.view()),
                   fx.so.view(), al.view());
      troll::project(troll::cpu, al.view(), fx.eps, out.view(), &st);
    };
    auto loss = [&](const double* x) {
      sparse_rows<double> sn(1, 6, vocab), out(1, 16, vocab);
      aligned_rows<double> al(1, 16, vocab);
      troll::projection_stats st;
      forward(x, sn, al, out, st);
      REQUIRE(std::vector<troll::sparse_index>(sn.indices.begin(), sn.indices.begin() + sn.counts[0]) == base_support);
      return fx.loss_of(out);
    };
    auto grad = [&](const double* x, double* gx) {
      sparse_rows<double> sn(1, 6, vocab), out(1, 16, vocab);
      aligned_rows<double> al(1, 16, vocab);
      troll::projection_stats st;
      forward(x, sn, al, out, st);
      CHECK(st.status == troll::row_status::projected);
      sparse_grads<double> g(1, 16), gnew(1, 16);
      fx.seed_grad(out, g);
      troll::project_backward(troll::cpu, al.view(), out.view(), &st, g.view(), gnew.view());
      troll::sparsify_backward(troll::cpu, troll::make_batch(x, 1, vocab),
                               troll::aligned_batch_view<const double>(al.view()).new_side(), gnew.view(),
                               troll::make_batch(gx, 1, vocab));
    };
    {
      sparse_rows<double> sn(1, 6, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, {5, 0.0}, sn.view());
      base_support.assign(sn.indices.begin(), sn.indices.begin() + sn.counts[0]);
      REQUIRE(sn.counts[0] == 6);
    }
    const troll::gradcheck_result res = troll::check_gradient(loss, grad, fx.x0);
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("composition: dense logits -> sparsify -> align(sparse, sparse) -> project -> loss") {
  for (unsigned seed : {4u, 5u, 6u}) {
    CAPTURE(seed);
    fixture fx(seed);
    const troll::sparsify_options opt{8, 2e-2};
    std::vector<troll::sparse_index> base_support;
    auto forward = [&](const double* x, sparse_rows<double>& sn, aligned_rows<double>& al,
                       sparse_rows<double>& out, troll::projection_stats& st) {
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, opt, sn.view());
      troll::align(troll::cpu, troll::sparse_batch_view<const double>(sn.view()), fx.so.view(), al.view());
      troll::project(troll::cpu, al.view(), fx.eps, out.view(), &st);
    };
    auto loss = [&](const double* x) {
      sparse_rows<double> sn(1, 9, vocab), out(1, 20, vocab);
      aligned_rows<double> al(1, 20, vocab);
      troll::projection_stats st;
      forward(x, sn, al, out, st);
      REQUIRE(std::vector<troll::sparse_index>(sn.indices.begin(), sn.indices.begin() + sn.counts[0]) == base_support);
      return fx.loss_of(out);
    };
    auto grad = [&](const double* x, double* gx) {
      sparse_rows<double> sn(1, 9, vocab), out(1, 20, vocab);
      aligned_rows<double> al(1, 20, vocab);
      troll::projection_stats st;
      forward(x, sn, al, out, st);
      CHECK(st.status == troll::row_status::projected);
      sparse_grads<double> g(1, 20), gal(1, 20), gsn(1, 9);
      fx.seed_grad(out, g);
      troll::project_backward(troll::cpu, al.view(), out.view(), &st, g.view(), gal.view());
      troll::align_backward(troll::cpu, sn.view(), al.view(), gal.view(), gsn.view());
      troll::sparsify_backward(troll::cpu, troll::make_batch(x, 1, vocab), sn.view(), gsn.view(),
                               troll::make_batch(gx, 1, vocab));
    };
    {
      sparse_rows<double> sn(1, 9, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, opt, sn.view());
      base_support.assign(sn.indices.begin(), sn.indices.begin() + sn.counts[0]);
      // δ is not near the prefix boundary: the kept prefix's rest mass is well below δ and the
      // one before it well above.
      INFO("support size " << sn.counts[0]);
      REQUIRE(sn.counts[0] >= 2);
    }
    const troll::gradcheck_result res = troll::check_gradient(loss, grad, fx.x0);
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("project_backward on aligned rows: full Jacobian in new, old and eps") {
  fixture fx(7);
  sparse_rows<double> sn(1, 7, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), nullptr, {6, 1e-3}, sn.view());
  aligned_rows<double> al0(1, 14, vocab);
  troll::align(troll::cpu, sn.view(), fx.so.view(), al0.view());
  const int u = al0.counts[0];
  const std::size_t m = std::size_t(u) + 1;
  // x = [new entries, new bucket, old entries, old bucket, eps]
  std::vector<double> x0;
  for (int i = 0; i < u; ++i) x0.push_back(al0.new_log_probs[std::size_t(i)]);
  x0.push_back(al0.new_log_remainder[0]);
  for (int i = 0; i < u; ++i) x0.push_back(al0.old_log_probs[std::size_t(i)]);
  x0.push_back(al0.old_log_remainder[0]);
  x0.push_back(fx.eps);
  auto unpack = [&](const double* x, aligned_rows<double>& al) {
    al = al0;
    for (int i = 0; i < u; ++i) {
      al.new_log_probs[std::size_t(i)] = x[i];
      al.old_log_probs[std::size_t(i)] = x[std::size_t(u) + 1 + std::size_t(i)];
    }
    al.new_log_remainder[0] = x[u];
    al.old_log_remainder[0] = x[2 * std::size_t(u) + 1];
  };
  auto f = [&](const double* x, double* y) {
    aligned_rows<double> al;
    unpack(x, al);
    sparse_rows<double> out(1, 14, vocab);
    troll::projection_stats st;
    troll::project(troll::cpu, al.view(), x[2 * m], out.view(), &st);
    for (int i = 0; i < u; ++i) y[i] = out.log_probs[std::size_t(i)];
    y[u] = out.log_remainder[0];
  };
  auto vjp = [&](const double* x, const double* gy, double* gx) {
    aligned_rows<double> al;
    unpack(x, al);
    sparse_rows<double> out(1, 14, vocab);
    troll::projection_stats st;
    troll::project(troll::cpu, al.view(), x[2 * m], out.view(), &st);
    REQUIRE(st.status == troll::row_status::projected);
    sparse_grads<double> g(1, 14), gn(1, 14), go(1, 14);
    std::copy(gy, gy + u, g.log_probs.begin());
    g.log_remainder[0] = gy[u];
    double ge = 0.0;
    troll::project_backward(troll::cpu, al.view(), out.view(), &st, g.view(), gn.view(), go.view(), &ge);
    for (int i = 0; i < u; ++i) {
      gx[i] = gn.log_probs[std::size_t(i)];
      gx[m + std::size_t(i)] = go.log_probs[std::size_t(i)];
    }
    gx[u] = gn.log_remainder[0];
    gx[m + std::size_t(u)] = go.log_remainder[0];
    gx[2 * m] = ge;
  };
  const troll::gradcheck_result res = troll::check_vjp(f, vjp, x0, m);
  INFO(res.report());
  CHECK(res.ok);
}

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

TEST_CASE("align_backward and sparsify_backward: full Jacobians") {
  fixture fx(8);
  sparse_rows<double> sn0(1, 9, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, {8, 1e-3}, sn0.view());
  const int c = sn0.counts[0];
  SUBCASE("align_backward, both sides") {
    for (int side = 0; side < 2; ++side) {
      CAPTURE(side);
      std::vector<double> x0(sn0.log_probs.begin(), sn0.log_probs.begin() + c);
      x0.push_back(sn0.log_remainder[0]);
      aligned_rows<double> probe(1, 20, vocab);
      troll::align(troll::cpu, sn0.view(), fx.so.view(), probe.view());
      const std::size_t m = std::size_t(probe.counts[0]) + 1;
      auto run = [&](const double* x, aligned_rows<double>& al, sparse_rows<double>& sn) {
        sn = sn0;
        std::copy(x, x + c, sn.log_probs.begin());
        sn.log_remainder[0] = x[c];
        if (side == 0) troll::align(troll::cpu, troll::sparse_batch_view<const double>(sn.view()), fx.so.view(), al.view());
        else troll::align(troll::cpu, fx.so.view(), troll::sparse_batch_view<const double>(sn.view()), al.view());
      };
      auto f = [&](const double* x, double* y) {
        aligned_rows<double> al(1, 20, vocab);
        sparse_rows<double> sn;
        run(x, al, sn);
        const auto& lp = side == 0 ? al.new_log_probs : al.old_log_probs;
        for (std::size_t i = 0; i + 1 < m; ++i) y[i] = lp[i];
        y[m - 1] = side == 0 ? al.new_log_remainder[0] : al.old_log_remainder[0];
      };
      auto vjp = [&](const double* x, const double* gy, double* gx) {
        aligned_rows<double> al(1, 20, vocab);
        sparse_rows<double> sn;
        run(x, al, sn);
        sparse_grads<double> g(1, 20), gs(1, 9);
        std::copy(gy, gy + m - 1, g.log_probs.begin());
        g.log_remainder[0] = gy[m - 1];
        troll::align_backward(troll::cpu, sn.view(), al.view(), g.view(), gs.view());
        std::copy(gs.log_probs.begin(), gs.log_probs.begin() + c, gx);
        gx[c] = gs.log_remainder[0];
      };
      const troll::gradcheck_result res = troll::check_vjp(f, vjp, x0, m);
      INFO(res.report());
      CHECK(res.ok);
    }
  }
  SUBCASE("sparsify_backward") {
    const std::size_t m = std::size_t(c) + 1;
    auto f = [&](const double* x, double* y) {
      sparse_rows<double> sn(1, 9, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, {8, 1e-3}, sn.view());
      REQUIRE(sn.indices == sn0.indices);
      std::copy(sn.log_probs.begin(), sn.log_probs.begin() + c, y);
      y[c] = sn.log_remainder[0];
    };
    auto vjp = [&](const double* x, const double* gy, double* gx) {
      sparse_grads<double> g(1, 9);
      std::copy(gy, gy + c, g.log_probs.begin());
      g.log_remainder[0] = gy[c];
      troll::sparsify_backward(troll::cpu, troll::make_batch(x, 1, vocab), sn0.view(), g.view(),
                               troll::make_batch(gx, 1, vocab));
    };
    const troll::gradcheck_result res = troll::check_vjp(f, vjp, fx.x0, m);
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("float backward agrees with double") {
  std::mt19937_64 rng(12);
  const std::size_t big = 20000, rows = 3;
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    auto a = zipf_logits<double>(big, 1.2, 0.3, rng);
    auto b = zipf_logits<double>(big, 1.2, 0.3, rng);
    zn.insert(zn.end(), a.begin(), a.end());
    zo.insert(zo.end(), b.begin(), b.end());
  }
  std::vector<float> znf(zn.begin(), zn.end()), zof(zo.begin(), zo.end());
  std::vector<double> zn_round(znf.begin(), znf.end()), zo_round(zof.begin(), zof.end());
  auto run = [&](auto tag, const auto& z_new, const auto& z_old, std::vector<double>& grad_out) {
    using T = decltype(tag);
    sparse_rows<T> sn(rows, 65, big), so(rows, 65, big), out(rows, 130, big);
    aligned_rows<T> al(rows, 130, big);
    troll::sparsify(troll::cpu, troll::make_batch(z_new.data(), rows, big), nullptr, {64, 1e-5}, sn.view());
    troll::sparsify(troll::cpu, troll::make_batch(z_old.data(), rows, big), nullptr, {64, 1e-5}, so.view());
    troll::align(troll::cpu, troll::make_batch(z_new.data(), rows, big), troll::sparse_batch_view<const T>(sn.view()),
                 so.view(), al.view());
    std::vector<troll::projection_stats> st(rows);
    troll::project(troll::cpu, al.view(), 0.05, out.view(), st.data());
    sparse_grads<T> g(rows, 130), gn(rows, 130);
    for (std::size_t r = 0; r < rows; ++r)
      for (int i = 0; i < out.counts[r]; ++i) g.log_probs[r * 130 + std::size_t(i)] = T(std::sin(double(out.indices[r * 130 + std::size_t(i)])));
    troll::project_backward(troll::cpu, al.view(), out.view(), st.data(), g.view(), gn.view());
    std::vector<T> gz(rows * big);
    troll::sparsify_backward(troll::cpu, troll::make_batch(z_new.data(), rows, big),
                             troll::aligned_batch_view<const T>(al.view()).new_side(), gn.view(),
                             troll::make_batch(gz.data(), rows, big));
    grad_out.assign(gz.begin(), gz.end());
  };
  std::vector<double> gd, gf;
  run(double{}, zn_round, zo_round, gd);
  run(float{}, znf, zof, gf);
  double scale = 0.0, worst = 0.0;
  for (std::size_t i = 0; i < gd.size(); ++i) {
    scale = std::max(scale, std::fabs(gd[i]));
    worst = std::max(worst, std::fabs(gd[i] - gf[i]));
  }
  CHECK(worst <= 1e-4 * scale);
}

namespace {

/// Shard s of n of a row of `vocab` tokens: [cut(s), cut(s + 1)), uneven widths.
std::size_t shard_cut(std::size_t s, std::size_t n, std::size_t vocab) { return vocab * s * s / (n * n); }

template <class T>
void shard_backward_matches_whole_row(std::size_t big, std::size_t shards, double rel) {
  std::mt19937_64 rng(21 + big);
  const std::size_t rows = 4;
  const troll::sparsify_options opt{16, 1e-4};
  std::vector<T> z;
  for (std::size_t r = 0; r < rows; ++r) {
    auto row = zipf_logits<T>(big, 1.1, 0.4, rng);
    if (r == 2)
      for (std::size_t j = 0; j < big; j += 3) row[j] = -std::numeric_limits<T>::infinity();  // masked tokens
    z.insert(z.end(), row.begin(), row.end());
  }
  const std::vector<troll::token_id> sampled{3, troll::token_id(big - 1), 1, troll::token_id(big / 2)};
  std::vector<std::vector<troll::sparsify_state>> states(shards, std::vector<troll::sparsify_state>(rows));
  for (std::size_t s = 0; s < shards; ++s) {
    const std::size_t begin = shard_cut(s, shards, big), end = shard_cut(s + 1, shards, big);
    troll::sparsify_shard(troll::cpu, troll::batch_view<const T>{z.data() + begin, rows, end - begin, big}, begin,
                          big, sampled.data(), opt, states[s].data());
  }
  for (std::size_t s = 1; s < shards; ++s) troll::sparsify_merge(troll::cpu, states[0].data(), states[s].data(), rows);
  sparse_rows<T> support(rows, 17, big);
  std::vector<double> log_sums(troll::sparsify_log_sums_width * rows);
  troll::sparsify_finalize(troll::cpu, states[0].data(), opt, support.view(), log_sums.data());
  sparse_grads<T> g(rows, 17);
  for (std::size_t i = 0; i < g.log_probs.size(); ++i) g.log_probs[i] = T(std::sin(0.7 * double(i)));
  for (std::size_t r = 0; r < rows; ++r) g.log_remainder[r] = T(0.3 - 0.2 * double(r));
  std::vector<T> whole(rows * big), sharded(rows * big, T(-99));
  troll::sparsify_backward(troll::cpu, troll::make_batch(z.data(), rows, big), support.view(), g.view(),
                           troll::make_batch(whole.data(), rows, big));
  for (std::size_t s = 0; s < shards; ++s) {
    const std::size_t begin = shard_cut(s, shards, big), end = shard_cut(s + 1, shards, big);
    troll::sparsify_shard_backward(troll::cpu, troll::batch_view<const T>{z.data() + begin, rows, end - begin, big},
                                   begin, support.view(), g.view(), log_sums.data(),
                                   troll::batch_view<T>{sharded.data() + begin, rows, end - begin, big});
  }
  double scale = 0.0;
  for (T v : whole) scale = std::max(scale, std::fabs(double(v)));
  for (std::size_t i = 0; i < whole.size(); ++i) {
    CAPTURE(i);
    CHECK(std::fabs(double(whole[i]) - double(sharded[i])) <= rel * std::fabs(double(whole[i])) + rel * 1e-3 * scale);
  }
}

}  // namespace

TEST_CASE("sparsify_shard_backward: each shard's columns of sparsify_backward, from the finalised log-sums") {
  // sparsify_backward is checked against full Jacobians above; the shard path must agree with it.
  for (std::size_t shards : {1u, 2u, 3u, 5u}) {
    CAPTURE(shards);
    shard_backward_matches_whole_row<double>(4099, shards, 1e-13);
    shard_backward_matches_whole_row<float>(4099, shards, 2e-7);
  }
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
