#include <doctest/doctest.h>

// Forward semantics of the sparse path (math.md §4): sparsify against a sort-everything long
// double oracle, shards against the whole row, alignment against the expanded V-vectors, sparse
// KL / projection against the dense path under uniform tails and against a bisection oracle.

#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "sparse_oracle.hpp"

using namespace sparse_test;

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The sparse projection against its long-double bisection oracle, one body for every backend
// (also compiled for troll::cuda by tests/cuda/test_cuda_sparse_projection_oracle.cu).
#include "../bodies/sparse_projection_oracle.hpp"

namespace {

/// a == b within a relative tolerance; equal infinities match.
bool close(double a, double b, double rel) {
  if (a == b) return true;
  return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b));
}

template <class T>
double value_tol() {
  return std::is_same<T, float>::value ? 2e-6 : 1e-13;
}

/// The V-vector of log-probs a sparse row stands for (uniform tail).
template <class T>
std::vector<ld> expand(const troll::sparse_batch_view<const T>& v, std::size_t r) {
  const long long m = v.tail_count(r);
  const ld tail = m > 0 ? ld(v.log_remainder[r]) - std::log(ld(m)) : ld(minus_inf);
  std::vector<ld> out(v.vocab, tail);
  for (long long i = 0; i < v.count(r); ++i) out[std::size_t(v.row_indices(r)[i])] = ld(v.row_log_probs(r)[i]);
  return out;
}

template <class T>
void sparsify_matches_oracle(std::size_t vocab, int k, double delta, bool with_sampled, unsigned seed) {
  std::mt19937_64 rng(seed);
  const std::size_t rows = 6;
  std::vector<T> z;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::vector<T> row = zipf_logits<T>(vocab, 1.0 + 0.4 * double(r), 0.3, rng);
    z.insert(z.end(), row.begin(), row.end());
  }
  std::vector<troll::token_id> sampled(rows);
  for (std::size_t r = 0; r < rows; ++r) sampled[r] = troll::token_id((r * 7919 + seed) % vocab);
  sparse_rows<T> out(rows, std::size_t(k) + 1, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab),
                  with_sampled ? sampled.data() : nullptr, {k, delta}, out.view());
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    const oracle_sparse_row o =
        oracle_sparsify(z.data() + r * vocab, vocab, k, delta, with_sampled ? sampled[r] : -1);
    REQUIRE(out.counts[r] == troll::sparse_index(o.indices.size()));
    for (std::size_t i = 0; i < o.indices.size(); ++i) {
      CHECK(out.indices[r * out.k_max + i] == o.indices[i]);
      CHECK(double(out.log_probs[r * out.k_max + i]) ==
            doctest::Approx(double(o.log_probs[i])).epsilon(value_tol<T>()));
    }
    CHECK(close(double(out.log_remainder[r]), double(o.log_remainder), value_tol<T>()));
    for (std::size_t i = o.indices.size(); i < out.k_max; ++i) CHECK(out.indices[r * out.k_max + i] == -1);
  }
}

}  // namespace

TEST_CASE("sparsify matches the long-double sort-everything oracle") {
  sparsify_matches_oracle<double>(3000, 64, 1e-5, true, 1);
  sparsify_matches_oracle<double>(3000, 64, 1e-5, false, 2);
  sparsify_matches_oracle<double>(2000, 8, 1e-3, true, 3);
  sparsify_matches_oracle<double>(5000, 256, 0.0, true, 4);
  sparsify_matches_oracle<double>(40, 64, 1e-5, true, 5);  // K > V
  sparsify_matches_oracle<float>(3000, 64, 1e-5, true, 6);
  sparsify_matches_oracle<float>(4000, 16, 0.2, true, 7);
}

TEST_CASE("threshold_below: the largest float not above a double, so that y > x iff y > bound") {
  using troll::detail::cpu::threshold_below;
  const float below_one = std::nextafter(1.0f, 0.0f);
  const float fmax = std::numeric_limits<float>::max();
  CHECK(threshold_below<float>(1.0) == 1.0f);
  CHECK(threshold_below<float>(1.0 + 1e-12) == 1.0f);                        // rounds down, not to nearest
  CHECK(threshold_below<float>(std::nextafter(1.0, 0.0)) == below_one);     // not up to 1.0f
  CHECK(threshold_below<float>(-1.0 - 1e-12) == std::nextafter(-1.0f, -2.0f));
  CHECK(threshold_below<float>(minus_inf) == -std::numeric_limits<float>::infinity());
  CHECK(threshold_below<float>(-minus_inf) == std::numeric_limits<float>::infinity());
  CHECK(threshold_below<float>(1e300) == fmax);
  CHECK(threshold_below<float>(-1e300) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(threshold_below<float>(std::nan(""))));
  CHECK(threshold_below<double>(0.1) == 0.1);
  // The defining property on a sweep of doubles between and on float values.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  for (int i = 0; i < 2000; ++i) {
    const double x = i % 2 == 0 ? u(rng) : double(float(u(rng)));
    const float bound = threshold_below<float>(x);
    CHECK(double(bound) <= x);
    for (const float y : {bound, std::nextafter(bound, 8.0f), std::nextafter(std::nextafter(bound, 8.0f), 8.0f)})
      CHECK((double(y) > x) == (y > bound));
  }
}

TEST_CASE("float sparsify selects what double sparsify selects on the same values, to an ulp") {
  // The float scan compares, maximises and exponentiates in float against a threshold rounded
  // down from the heap's double logit. On float-representable values it must pick exactly the
  // double path's tokens — ties across 64-token chunks and 512-token blocks, masked tokens, the
  // sampled token anywhere, logits one ulp apart — and write log-probs within an ulp or two of
  // the float value. (Its adjacent floats catch a bound that is one ulp too high.)
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (const std::size_t vocab : {std::size_t(63), std::size_t(513), std::size_t(1000), std::size_t(4099)}) {
    for (int kind = 0; kind < 5; ++kind) {
      CAPTURE(vocab);
      CAPTURE(kind);
      const std::size_t rows = 4;
      std::vector<float> zf(rows * vocab);
      for (std::size_t i = 0; i < zf.size(); ++i) {
        const double g = normal(rng);
        double x = kind == 0 ? std::round(4.0 * g) / 4.0                       // many exact ties
                   : kind == 1 ? 3.0 * g                                      // flat
                   : kind == 2 ? -30.0 * std::fabs(g) + (i % vocab == 7 ? 60.0 : 0.0)  // sharp
                               : -1.1 * std::log1p(double(i % vocab)) + 0.5 * g;   // Zipf-like
        if (unit(rng) < 0.05) x = minus_inf;  // masked tokens
        zf[i] = float(x);
        if (kind == 4) {  // adjacent floats: a threshold off by one ulp picks different tokens
          float y = 1.0f;
          for (int step = int(8.0 * unit(rng)); step > 0; --step) y = std::nextafter(y, 2.0f);
          zf[i] = y;
        }
      }
      for (std::size_t r = 0; r < rows; ++r) zf[r * vocab + (r * 131) % vocab] = 0.5f;  // never all masked
      const std::vector<double> zd(zf.begin(), zf.end());
      std::vector<troll::token_id> sampled(rows);
      for (std::size_t r = 0; r < rows; ++r) sampled[r] = troll::token_id((r * 977 + 5) % vocab);
      for (const int k : {1, 7, 64, 256}) {
        CAPTURE(k);
        const std::size_t k_max = std::size_t(k) + 1;
        sparse_rows<float> f(rows, k_max, vocab);
        sparse_rows<double> d(rows, k_max, vocab);
        troll::sparsify(troll::cpu, troll::make_batch(zf.data(), rows, vocab), sampled.data(), {k, 1e-6}, f.view());
        troll::sparsify(troll::cpu, troll::make_batch(zd.data(), rows, vocab), sampled.data(), {k, 1e-6}, d.view());
        CHECK(f.indices == d.indices);
        CHECK(f.counts == d.counts);
        auto within_ulps = [](float got, double want) {
          if (double(got) == want) return true;
          const float w = float(want);
          const double ulp = double(std::nextafter(std::fabs(w), std::numeric_limits<float>::infinity())) - std::fabs(w);
          return std::fabs(double(got) - want) <= 2.0 * ulp;
        };
        for (std::size_t i = 0; i < f.log_probs.size(); ++i) {
          CAPTURE(i);
          CHECK(within_ulps(f.log_probs[i], d.log_probs[i]));
        }
        for (std::size_t r = 0; r < rows; ++r) {
          CAPTURE(r);
          CHECK(within_ulps(f.log_remainder[r], d.log_remainder[r]));
        }
      }
    }
  }
}

TEST_CASE("sparsify: ties go to the lower index; masked tokens never enter; the sampled token is kept") {
  std::vector<double> z(100, 0.0);
  z[50] = -std::numeric_limits<double>::infinity();
  sparse_rows<double> out(1, 5, 100);
  const troll::token_id sampled = 50;
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), 1, 100), &sampled, {4, 0.0}, out.view());
  REQUIRE(out.counts[0] == 5);
  CHECK(out.indices[0] == 0);
  CHECK(out.indices[3] == 3);
  CHECK(out.indices[4] == 50);
  CHECK(out.log_probs[4] == minus_inf);
  CHECK(out.log_probs[0] == doctest::Approx(-std::log(99.0)).epsilon(1e-15));
  CHECK(out.log_remainder[0] == doctest::Approx(std::log(95.0 / 99.0)).epsilon(1e-14));
}

TEST_CASE("sparsify: the remainder is the exact tail mass, not 1 - sum") {
  // One dominant token; the tail mass (~1e-16 relative) is invisible to 1 − Σ in double.
  const std::size_t vocab = 1000;
  std::vector<double> z(vocab);
  for (std::size_t i = 0; i < vocab; ++i) z[i] = i == 3 ? 0.0 : -45.0 - 1e-3 * double(i);
  sparse_rows<double> out(1, 2, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), 1, vocab), nullptr, {2, 1e-5}, out.view());
  REQUIRE(out.counts[0] == 1);
  const oracle_sparse_row o = oracle_sparsify(z.data(), vocab, 2, 1e-5, -1);
  CHECK(out.log_remainder[0] == doctest::Approx(double(o.log_remainder)).epsilon(1e-13));
  CHECK(out.log_remainder[0] < -35.0);
}

TEST_CASE("vocabulary shards: 1..8 shards, any merge order, give the whole-row result") {
  std::mt19937_64 rng(11);
  const std::size_t vocab = 5003, rows = 3;
  std::vector<float> z;
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<float> row = zipf_logits<float>(vocab, 1.1, 0.5, rng);
    for (std::size_t i = 0; i < vocab; i += 97) row[i] = row[(i * 31) % vocab];  // ties across shards
    z.insert(z.end(), row.begin(), row.end());
  }
  const std::vector<troll::token_id> sampled{17, 4000, 5002};
  const troll::sparsify_options opt{32, 1e-4};
  sparse_rows<float> whole(rows, 33, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled.data(), opt, whole.view());

  for (int shards = 1; shards <= 8; ++shards) {
    CAPTURE(shards);
    std::vector<std::size_t> cuts{0, vocab};
    std::uniform_int_distribution<std::size_t> cut(1, vocab - 1);
    while (cuts.size() < std::size_t(shards) + 1) {
      const std::size_t c = cut(rng);
      if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::vector<troll::sparsify_state>> states(static_cast<std::size_t>(shards));
    for (auto& s : states) s.resize(rows);
    for (int s = 0; s < shards; ++s) {
      const std::size_t begin = cuts[std::size_t(s)], width = cuts[std::size_t(s) + 1] - begin;
      troll::sparsify_shard(troll::cpu,
                            troll::batch_view<const float>{z.data() + begin, rows, width, vocab}, begin,
                            vocab, sampled.data(), opt, states[std::size_t(s)].data());
    }
    // Left fold in reverse order, and a pairwise tree: both must give the whole-row answer.
    std::vector<troll::sparsify_state> fold = states.back();
    for (int s = shards - 2; s >= 0; --s) troll::sparsify_merge(troll::cpu, fold.data(), states[std::size_t(s)].data(), rows);
    std::vector<std::vector<troll::sparsify_state>> level = states;
    while (level.size() > 1) {
      std::vector<std::vector<troll::sparsify_state>> next;
      for (std::size_t i = 0; i + 1 < level.size(); i += 2) {
        troll::sparsify_merge(troll::cpu, level[i].data(), level[i + 1].data(), rows);
        next.push_back(level[i]);
      }
      if (level.size() % 2) next.push_back(level.back());
      level = next;
    }
    for (const auto* merged : {&fold, &level[0]}) {
      sparse_rows<float> out(rows, 33, vocab);
      troll::sparsify_finalize(troll::cpu, merged->data(), opt, out.view());
      CHECK(out.counts == whole.counts);
      CHECK(out.indices == whole.indices);
      for (std::size_t i = 0; i < out.log_probs.size(); ++i)
        CHECK(out.log_probs[i] == doctest::Approx(whole.log_probs[i]).epsilon(1e-6));
      for (std::size_t r = 0; r < rows; ++r)
        CHECK(out.log_remainder[r] == doctest::Approx(whole.log_remainder[r]).epsilon(1e-6));
    }
  }
}

TEST_CASE("shards of a row with no finite logit are rejected as the whole row is, sampled token or not") {
  const std::size_t vocab = 64, rows = 2;
  const double m = -std::numeric_limits<double>::infinity();
  std::vector<double> z(rows * vocab, m);
  for (std::size_t j = 0; j < vocab; ++j) z[j] = -0.1 * double(j);  // row 0 is fine; row 1 all −inf
  const troll::sparsify_options opt{4, 0.0};
  for (const troll::sparse_index token : {troll::sparse_index(-1), troll::sparse_index(9)}) {
    CAPTURE(token);
    const std::vector<troll::token_id> sampled{3, token};
    const troll::token_id* s = token < 0 ? nullptr : sampled.data();
    sparse_rows<double> whole(rows, 5, vocab);
    CHECK_THROWS_AS(troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), s, opt, whole.view()),
                    troll::domain_error);
    std::vector<troll::sparsify_state> left(rows), right(rows);
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data(), rows, 40, vocab}, 0, vocab, s, opt,
                          left.data());
    troll::sparsify_shard(troll::cpu, troll::batch_view<const double>{z.data() + 40, rows, vocab - 40, vocab}, 40,
                          vocab, s, opt, right.data());
    troll::sparsify_merge(troll::cpu, left.data(), right.data(), rows);
    sparse_rows<double> out(rows, 5, vocab);
    try {
      troll::sparsify_finalize(troll::cpu, left.data(), opt, out.view());
      FAIL("sparsify_finalize accepted a row with no finite logit");
    } catch (const troll::domain_error& e) {
      CHECK(e.row() == 1);
      CHECK(std::string(e.what()).find("no support") != std::string::npos);
    }
  }
}

TEST_CASE("align(sparse, sparse) keeps both expanded V-vectors") {
  std::mt19937_64 rng(5);
  const std::size_t vocab = 700, rows = 4;
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    auto a = zipf_logits<double>(vocab, 1.2, 0.2, rng);
    auto b = zipf_logits<double>(vocab, 1.0, 0.2, rng);
    if (r == 1) b = a;  // identical supports
    zn.insert(zn.end(), a.begin(), a.end());
    zo.insert(zo.end(), b.begin(), b.end());
  }
  sparse_rows<double> sn(rows, 17, vocab), so(rows, 17, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), nullptr, {16, 1e-6}, sn.view());
  troll::sparsify(troll::cpu, troll::make_batch(zo.data(), rows, vocab), nullptr, {16, 1e-6}, so.view());
  aligned_rows<double> al(rows, 40, vocab);
  troll::align(troll::cpu, sn.view(), so.view(), al.view());
  const auto alc = troll::aligned_batch_view<const double>(al.view());
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    const auto en = expand(troll::sparse_batch_view<const double>(sn.view()), r);
    const auto eo = expand(troll::sparse_batch_view<const double>(so.view()), r);
    const auto an = expand(alc.new_side(), r), ao = expand(alc.old_side(), r);
    for (std::size_t i = 0; i < vocab; ++i) {
      CHECK(double(an[i]) == doctest::Approx(double(en[i])).epsilon(1e-14));
      CHECK(double(ao[i]) == doctest::Approx(double(eo[i])).epsilon(1e-14));
    }
    // U = S_new in order, then old-only entries.
    for (int i = 0; i < sn.counts[r]; ++i) CHECK(al.indices[r * 40 + std::size_t(i)] == sn.indices[r * 17 + std::size_t(i)]);
  }
  CHECK(al.counts[1] == sn.counts[1]);
}

TEST_CASE("align(dense logits, sparse old) gathers exact values and the exact tail") {
  std::mt19937_64 rng(9);
  const std::size_t vocab = 900, rows = 3;
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    auto a = zipf_logits<double>(vocab, 1.5, 0.2, rng);
    auto b = zipf_logits<double>(vocab, 1.5, 0.2, rng);
    zn.insert(zn.end(), a.begin(), a.end());
    zo.insert(zo.end(), b.begin(), b.end());
  }
  sparse_rows<double> sn(rows, 9, vocab), so(rows, 9, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), nullptr, {8, 1e-6}, sn.view());
  troll::sparsify(troll::cpu, troll::make_batch(zo.data(), rows, vocab), nullptr, {8, 1e-6}, so.view());
  for (bool with_support : {true, false}) {
    aligned_rows<double> al(rows, 20, vocab);
    troll::align(troll::cpu, troll::make_batch(zn.data(), rows, vocab),
                 with_support ? troll::sparse_batch_view<const double>(sn.view())
                              : troll::sparse_batch_view<const double>{},
                 so.view(), al.view());
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<ld> all(zn.begin() + long(r * vocab), zn.begin() + long((r + 1) * vocab));
      const ld total = log_sum_exp(all);
      std::vector<char> in_u(vocab, 0);
      for (int i = 0; i < al.counts[r]; ++i) {
        const auto k = std::size_t(al.indices[r * 20 + std::size_t(i)]);
        in_u[k] = 1;
        CHECK(al.new_log_probs[r * 20 + std::size_t(i)] == doctest::Approx(double(all[k] - total)).epsilon(1e-14));
      }
      CHECK(al.counts[r] == (with_support ? sn.counts[r] : 0) + so.counts[r] -
                               (with_support ? int(std::count_if(sn.indices.begin() + long(r * 9),
                                                                 sn.indices.begin() + long(r * 9) + sn.counts[r],
                                                                 [&](int k) {
                                                                   return std::find(so.indices.begin() + long(r * 9),
                                                                                    so.indices.begin() + long(r * 9) + so.counts[r],
                                                                                    k) != so.indices.begin() + long(r * 9) + so.counts[r];
                                                                 }))
                                             : 0));
      std::vector<ld> tail;
      for (std::size_t k = 0; k < vocab; ++k)
        if (!in_u[k]) tail.push_back(all[k]);
      CHECK(al.new_log_remainder[r] == doctest::Approx(double(log_sum_exp(tail) - total)).epsilon(1e-13));
    }
  }
}

namespace {

/// Dense rows whose tails are exactly uniform: the tokens outside `support` share one logit.
struct uniform_tail_case {
  std::size_t vocab, rows;
  std::vector<double> zn, zo;                   // dense logits
  sparse_rows<double> sn, so;                   // the same rows, sparse (exact in long double)
};

uniform_tail_case make_uniform_tail_case(std::size_t vocab, std::size_t rows, std::size_t support,
                                         double spread, std::mt19937_64& rng) {
  uniform_tail_case c{vocab, rows, {}, {}, sparse_rows<double>(rows, support, vocab),
                      sparse_rows<double>(rows, support, vocab)};
  std::normal_distribution<double> n01(0.0, 1.0);
  for (std::size_t r = 0; r < rows; ++r) {
    for (int side = 0; side < 2; ++side) {
      std::vector<std::size_t> perm(vocab);
      std::iota(perm.begin(), perm.end(), std::size_t(0));
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<double> z(vocab, -4.0 + n01(rng));
      for (std::size_t i = 0; i < support; ++i) z[perm[i]] = spread * n01(rng);
      std::vector<ld> all(z.begin(), z.end());
      const ld total = log_sum_exp(all);
      sparse_rows<double>& s = side == 0 ? c.sn : c.so;
      s.counts[r] = troll::sparse_index(support);
      for (std::size_t i = 0; i < support; ++i) {
        s.indices[r * support + i] = troll::sparse_index(perm[i]);
        s.log_probs[r * support + i] = double(ld(z[perm[i]]) - total);
      }
      std::vector<ld> tail;
      for (std::size_t i = support; i < vocab; ++i) tail.push_back(ld(z[perm[i]]));
      s.log_remainder[r] = double(log_sum_exp(tail) - total);
      (side == 0 ? c.zn : c.zo).insert((side == 0 ? c.zn : c.zo).end(), z.begin(), z.end());
    }
  }
  return c;
}

}  // namespace

TEST_CASE("uniform tails: sparse KL and projection equal the dense ones to round-off") {
  std::mt19937_64 rng(21);
  const std::size_t vocab = 3000, rows = 8;
  uniform_tail_case c = make_uniform_tail_case(vocab, rows, 24, 2.0, rng);
  aligned_rows<double> al(rows, 48, vocab);
  troll::align(troll::cpu, c.sn.view(), c.so.view(), al.view());

  std::vector<double> kl_sparse(rows), kl_dense(rows);
  troll::kl(troll::cpu, al.view(), kl_sparse.data());
  troll::kl(troll::cpu, troll::make_batch(c.zn.data(), rows, vocab), troll::make_batch(c.zo.data(), rows, vocab),
            kl_dense.data());
  for (std::size_t r = 0; r < rows; ++r) CHECK(kl_sparse[r] == doctest::Approx(kl_dense[r]).epsilon(1e-12));

  for (double eps : {0.01, 0.05, 0.3, 100.0}) {
    CAPTURE(eps);
    sparse_rows<double> out(rows, 48, vocab);
    std::vector<troll::projection_stats> ss(rows), ds(rows);
    troll::project(troll::cpu, al.view(), eps, out.view(), ss.data());
    std::vector<double> dense(rows * vocab);
    troll::project(troll::cpu, troll::make_batch(c.zn.data(), rows, vocab),
                   troll::make_batch(c.zo.data(), rows, vocab), eps, troll::make_batch(dense.data(), rows, vocab),
                   ds.data());
    const auto outc = troll::sparse_batch_view<const double>(out.view());
    for (std::size_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      CHECK(ss[r].status == ds[r].status);
      CHECK(ss[r].t == doctest::Approx(ds[r].t).epsilon(1e-9));
      CHECK(ss[r].kl_after == doctest::Approx(ds[r].kl_after).epsilon(1e-10));
      const auto e = expand(outc, r);
      double worst = 0.0;
      for (std::size_t i = 0; i < vocab; ++i) worst = std::max(worst, std::fabs(double(e[i]) - dense[r * vocab + i]));
      CHECK(worst < 1e-11);
    }
  }
}

TEST_CASE("inactive rows pass through; only violating rows are projected") {
  std::mt19937_64 rng(3);
  uniform_tail_case c = make_uniform_tail_case(500, 6, 10, 1.0, rng);
  // Rows 0, 2, 4: old = new (KL 0).
  for (std::size_t r = 0; r < 6; r += 2) {
    std::copy_n(c.sn.indices.begin() + long(r * 10), 10, c.so.indices.begin() + long(r * 10));
    std::copy_n(c.sn.log_probs.begin() + long(r * 10), 10, c.so.log_probs.begin() + long(r * 10));
    c.so.log_remainder[r] = c.sn.log_remainder[r];
  }
  aligned_rows<double> al(6, 20, 500);
  troll::align(troll::cpu, c.sn.view(), c.so.view(), al.view());
  sparse_rows<double> out(6, 20, 500);
  std::vector<troll::projection_stats> st(6);
  troll::project(troll::cpu, al.view(), 0.01, out.view(), st.data());
  for (std::size_t r = 0; r < 6; ++r) {
    CAPTURE(r);
    CHECK(st[r].active() == (r % 2 == 1));
    if (r % 2 == 1) continue;
    CHECK(st[r].iterations == 0);
    CHECK(out.counts[r] == 10);
    for (int i = 0; i < 10; ++i)
      CHECK(out.log_probs[r * 20 + std::size_t(i)] ==
            doctest::Approx(c.sn.log_probs[r * 10 + std::size_t(i)]).epsilon(1e-15));
    CHECK(out.log_remainder[r] == doctest::Approx(c.sn.log_remainder[r]).epsilon(1e-14));
  }
}

TEST_CASE("empty tail: a support covering the vocabulary has a -inf bucket") {
  const std::size_t vocab = 6;
  std::vector<double> zn{0.1, 0.5, -1.0, 2.0, 0.0, -0.2}, zo{0.3, -0.5, 1.0, 0.0, 0.2, 0.0};
  sparse_rows<double> sn(1, 6, vocab), so(1, 6, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(zn.data(), 1, vocab), nullptr, {6, 0.0}, sn.view());
  troll::sparsify(troll::cpu, troll::make_batch(zo.data(), 1, vocab), nullptr, {6, 0.0}, so.view());
  CHECK(sn.counts[0] == 6);
  CHECK(sn.log_remainder[0] == minus_inf);
  aligned_rows<double> al(1, 6, vocab);
  troll::align(troll::cpu, sn.view(), so.view(), al.view());
  sparse_rows<double> out(1, 6, vocab);
  troll::projection_stats st;
  troll::project(troll::cpu, al.view(), 0.05, out.view(), &st);
  std::vector<double> dense(vocab);
  troll::projection_stats ds;
  troll::project(troll::cpu, troll::make_batch(zn.data(), 1, vocab), troll::make_batch(zo.data(), 1, vocab), 0.05,
                 troll::make_batch(dense.data(), 1, vocab), &ds);
  CHECK(out.log_remainder[0] == minus_inf);
  for (int i = 0; i < 6; ++i) CHECK(out.log_probs[std::size_t(i)] == doctest::Approx(dense[std::size_t(out.indices[std::size_t(i)])]).epsilon(1e-12));
}
