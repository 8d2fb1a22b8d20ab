#include <doctest/doctest.h>

// Relative accuracy of the values sparse rows store where they are close to 0 (found by the
// sparse audit against a long-double oracle written from math.md §4):
//  * a near-deterministic row's top log-probability, −log(1 + Σ_{others} e^{z − max}), which the
//    canonical total once took as log(1 + x) in double: 0 for x < 1e-16, and 1e-8 relative error
//    at x = 2e-9;
//  * the log-remainder of a short support of small mass (δ near 1, a flat row): log r ≈ −1e-5
//    came out of ((m_tail − m) + tail) − total, a difference of two numbers near log V.
// Through sparsify, the two-stage shard finalize, align(new_logits, …) and the sparse
// objective's gather share the same sums (detail::exact_log_sums), checked here on sparsify,
// the shards and align.

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace {

using ld = long double;

struct one_row {
  std::vector<troll::sparse_index> indices;
  std::vector<double> log_probs;
  int count = 0;
  double remainder = 0.0;
};

one_row sparsify_one(const std::vector<double>& z, int k, double delta) {
  const std::size_t km = std::size_t(k) + 1;
  one_row o;
  o.indices.assign(km, -7);
  o.log_probs.assign(km, 7.0);
  troll::sparse_index count = -1;
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), 1, z.size()), nullptr, {k, delta},
                  troll::sparse_batch_view<double>{o.indices.data(), o.log_probs.data(), &count, &o.remainder, 1, km,
                                                   z.size()});
  o.count = count;
  return o;
}

/// Relative error, with a floor of 1e-300 on the scale.
double rel(double got, ld want) {
  return double(std::fabs(ld(got) - want) / std::fmax(double(std::fabs(want)), 1e-300));
}

}  // namespace

TEST_CASE("a near-deterministic row keeps its top log-probability to relative accuracy") {
  for (const double gap : {20.0, 37.0, 50.0, 300.0}) {
    CAPTURE(gap);
    const std::vector<double> z = {-gap, 0.0, -gap - 10.0, -gap - 1.0};
    const one_row o = sparsify_one(z, 1, 0.0);
    REQUIRE(o.count == 1);
    CHECK(o.indices[0] == 1);
    // log p_1 = −log1p(Σ_{others} e^{z}), in long double (the argument is far below 1).
    const ld others = std::exp(ld(-gap)) + std::exp(ld(-gap - 10.0)) + std::exp(ld(-gap - 1.0));
    const ld want = -std::log1p(others);
    CHECK(o.log_probs[0] < 0.0);
    CHECK(rel(o.log_probs[0], want) <= 1e-14);
    // The tail (everything else): log r = log(others) − log1p(others).
    CHECK(rel(o.remainder, std::log(others) - std::log1p(others)) <= 1e-14);
  }
}

TEST_CASE("a short support of small mass stores log r ≈ −Σ_S p to relative accuracy") {
  for (const std::size_t vocab : {std::size_t(1000), std::size_t(100000)}) {
    CAPTURE(vocab);
    std::vector<double> z(vocab);
    for (std::size_t i = 0; i < vocab; ++i) z[i] = 0.25 * std::sin(double(i) * 0.37);  // flat, no ties
    // δ close to 1: the prefix is the top token alone.
    const one_row o = sparsify_one(z, 8, 0.999999);
    REQUIRE(o.count == 1);
    ld total = 0.0L, top = 0.0L;
    for (double x : z) total += std::exp(ld(x));
    top = std::exp(ld(z[std::size_t(o.indices[0])]));
    const ld want = std::log1p(-top / total);
    CHECK(rel(o.remainder, want) <= 1e-13);
    CHECK(rel(o.log_probs[0], std::log(top / total)) <= 1e-14);

    // The shards' two-stage finalize writes the same bits.
    const std::size_t cut = vocab / 3;
    troll::sparsify_state a, b;
    troll::sparsify_shard(troll::cpu, troll::make_batch(static_cast<const double*>(z.data()), 1, cut, vocab), 0, vocab, nullptr, {8, 0.999999}, &a);
    troll::sparsify_shard(troll::cpu, troll::make_batch(static_cast<const double*>(z.data()) + cut, 1, vocab - cut, vocab), cut, vocab, nullptr,
                          {8, 0.999999}, &b);
    troll::sparsify_merge(troll::cpu, &a, &b, 1);
    std::vector<troll::sparse_index> idx(9);
    std::vector<double> lp(9), tail_sums(4);
    troll::sparse_index count = 0;
    double lr = 0.0, tail_max = 0.0;
    const troll::sparse_batch_view<double> out{idx.data(), lp.data(), &count, &lr, 1, 9, vocab};
    troll::sparsify_finalize(troll::cpu, &a, {8, 0.999999}, out, nullptr, &tail_max);
    troll::sparsify_tail_sums<double>(troll::cpu, troll::make_batch(z.data(), 1, cut, vocab), 0, out, &tail_max,
                                      tail_sums.data());
    troll::sparsify_tail_sums<double>(troll::cpu, troll::make_batch(z.data() + cut, 1, vocab - cut, vocab), cut, out,
                                      &tail_max, tail_sums.data() + 2);
    troll::sparsify_finalize(troll::cpu, &a, {8, 0.999999}, out, nullptr, nullptr, tail_sums.data(), 2);
    REQUIRE(count == 1);
    CHECK(idx[0] == o.indices[0]);
    CHECK(lp[0] == o.log_probs[0]);
    CHECK(lr == o.remainder);

    // align(new_logits, support, old): the new side's bucket over V∖U, U = {top, one old token}.
    const troll::sparse_index other = o.indices[0] == 0 ? 1 : 0;
    std::vector<troll::sparse_index> old_idx = {other};
    std::vector<double> old_lp = {-std::log(double(vocab))};
    troll::sparse_index old_count = 1;
    double old_lr = std::log1p(-1.0 / double(vocab));
    const troll::sparse_batch_view<const double> old_rows{old_idx.data(), old_lp.data(), &old_count, &old_lr, 1, 1, vocab};
    const troll::sparse_batch_view<const double> support{o.indices.data(), o.log_probs.data(), &o.count, &o.remainder, 1,
                                                         o.indices.size(), vocab};
    std::vector<troll::sparse_index> ui(4), uc(1);
    std::vector<double> an(4), ao(4), anr(1), aor(1);
    troll::align(troll::cpu, troll::make_batch(z.data(), 1, vocab), support, old_rows,
                 troll::aligned_batch_view<double>{ui.data(), uc.data(), an.data(), ao.data(), anr.data(), aor.data(), 1,
                                                   4, vocab});
    REQUIRE(uc[0] == 2);
    const ld mass_u = top + std::exp(ld(z[std::size_t(other)]));
    CHECK(rel(anr[0], std::log1p(-mass_u / total)) <= 1e-13);
  }
}


TEST_CASE("align shrinks a remainder close to 1 to relative accuracy (log1p of the moved share)") {
  // Two sparse rows over V = 100,000 with four tokens each of mass ~1e-5 (log r ≈ −4e-5), on
  // disjoint supports: align moves four uniform tail tokens of each row into U, so the bucket is
  // log r + log((m − 4) / m). Taken as log of the rounded quotient, that factor carried an ulp of
  // 1 (1.1e-16 absolute): 1e-13 relative on the bucket's log-mass of −9e-5 (seen on sparsified
  // flat rows in the 13th session's audit). Reference in long double.
  const std::size_t V = 100000;
  std::vector<troll::sparse_index> ni = {0, 1, 2, 3}, oi = {10, 11, 12, 13}, ai(8), ac(1), nc = {4}, oc = {4};
  std::vector<double> nv(4), ov(4), nr(1), orr(1), an(8), ao(8), anr(1), aor(1);
  ld new_mass = 0, old_mass = 0;
  for (int j = 0; j < 4; ++j) {
    nv[std::size_t(j)] = std::log(1e-5 * (1.0 + 0.1 * j));
    ov[std::size_t(j)] = std::log(1.3e-5 * (1.0 + 0.07 * j));
    new_mass += std::exp(ld(nv[std::size_t(j)]));
    old_mass += std::exp(ld(ov[std::size_t(j)]));
  }
  nr[0] = double(std::log1p(-new_mass));
  orr[0] = double(std::log1p(-old_mass));
  const troll::sparse_batch_view<double> new_row{ni.data(), nv.data(), nc.data(), nr.data(), 1, 4, V};
  const troll::sparse_batch_view<double> old_row{oi.data(), ov.data(), oc.data(), orr.data(), 1, 4, V};
  troll::aligned_batch_view<double> out{ai.data(), ac.data(), an.data(), ao.data(), anr.data(), aor.data(), 1, 8, V};
  troll::align(troll::cpu, troll::sparse_input<double>(new_row), troll::sparse_input<double>(old_row), out);
  REQUIRE(ac[0] == 8);
  const ld m = ld(V - 4), factor = std::log1p(ld(-4) / m);
  const ld want_new = ld(nr[0]) + factor, want_old = ld(orr[0]) + factor;
  CAPTURE(double(want_new));
  CHECK(std::fabs(ld(anr[0]) - want_new) <= 4 * std::numeric_limits<double>::epsilon() * std::fabs(want_new));
  CHECK(std::fabs(ld(aor[0]) - want_old) <= 4 * std::numeric_limits<double>::epsilon() * std::fabs(want_old));
}

TEST_CASE("align(new_logits, …) keeps the bucket's log-mass exact when the tail holds just under half the mass") {
  // Dense new logits: 256 tokens of logit ≈ c (the new support, U) and V − 256 tokens of logit ≈ 0, c
  // chosen so that r = (V − 256) / (V − 256 + 256·e^c) is just below 1/2, where log r was the
  // difference ((m_tail − m) + log Σ_tail) − log Σ_all of three numbers of size log V: 11 ulps
  // (1.8e-15 relative) off a 70-digit oracle at r = 0.499, V = 20,000. Now −log1p(Σ_U / Σ_tail)
  // wherever the tail's mass is representable. Reference: the sums in long double.
  for (const std::size_t V : {std::size_t(20000), std::size_t(262144)}) {
    for (const double r : {0.3, 0.45, 0.499}) {
      CAPTURE(V);
      CAPTURE(r);
      const int n = 256;
      const double c = std::log(double(V - n) / n * (1.0 - r) / r);
      std::vector<double> z(V);
      for (std::size_t k = 0; k < V; ++k) z[k] = 1e-3 * std::sin(double(k));
      std::vector<troll::sparse_index> ns(std::size_t(n) + 1), nc = {n};
      std::vector<double> nv(std::size_t(n) + 1, 0.0), nr(1, 0.0);
      for (int i = 0; i < n; ++i) {
        ns[std::size_t(i)] = troll::sparse_index(37 * i + 5);
        z[std::size_t(37 * i + 5)] = c + 1e-3 * std::cos(double(i));
      }
      // Old row: four of U's tokens at 0.1 each, the remaining 0.6 in its tail.
      std::vector<troll::sparse_index> oi = {5, 42, 79, 116}, oc = {4};
      std::vector<double> ov(4, std::log(0.1)), orr = {std::log(0.6)};
      std::vector<troll::sparse_index> ai(std::size_t(n) + 4), ac(1);
      std::vector<double> an(ai.size()), ao(ai.size()), anr(1), aor(1);
      const troll::sparse_batch_view<double> support{ns.data(), nv.data(), nc.data(), nr.data(), 1, ns.size(), V};
      const troll::sparse_batch_view<double> old_row{oi.data(), ov.data(), oc.data(), orr.data(), 1, 4, V};
      troll::aligned_batch_view<double> out{ai.data(), ac.data(), an.data(), ao.data(), anr.data(), aor.data(),
                                            1,         ai.size(), V};
      troll::align(troll::cpu, troll::make_batch(static_cast<const double*>(z.data()), 1, V),
                   troll::sparse_input<double>(support), troll::sparse_input<double>(old_row), out);
      REQUIRE(ac[0] == n);
      ld support_mass = 0, all_mass = 0;
      for (int i = 0; i < n; ++i) support_mass += std::exp(ld(z[std::size_t(37 * i + 5)]));
      for (std::size_t k = 0; k < V; ++k) all_mass += std::exp(ld(z[k]));
      const ld want_r = -std::log1p(support_mass / (all_mass - support_mass));
      const ld want_p = ld(z[5]) - std::log(all_mass);
      const double eps = std::numeric_limits<double>::epsilon();
      CHECK(rel(anr[0], want_r) <= 2.5 * eps);  // 2.7 to 5.3 eps before; 1.5 now
      CHECK(rel(an[0], want_p) <= 2.5 * eps);
    }
  }
}
