#include <doctest/doctest.h>

// Vocabulary shards made exact: rows split into 1..8 slices of any widths, states merged in any
// order and finalised in two stages (supports and tail maxima; then every shard's exact tail sum)
// give sparsify's rows of the whole vocabulary bit for bit, in float and double; the shards'
// backward gives sparsify_backward's columns bit for bit; states survive the byte packing the
// Python package exchanges between processes (the fields before the heap, then k heap entries);
// and the canonical sums are as accurate as a long-double oracle allows.

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "bits.hpp"
#include "sparse_oracle.hpp"

using namespace sparse_test;

namespace {

using troll_test::same_bits;

static_assert(std::is_trivially_copyable<troll::sparsify_state>::value,
              "states are exchanged between processes as bytes");

/// The bytes the Python package sends for one state of heap capacity k: every field before the
/// heap, then the k heap entries a state can hold (the last slot is finalize's scratch).
std::size_t packed_bytes(int k) {
  return offsetof(troll::sparsify_state, heap) + sizeof(troll::detail::sparse_candidate) * std::size_t(k);
}

template <class T>
std::vector<T> test_logits(std::size_t rows, std::size_t vocab, std::mt19937_64& rng) {
  std::vector<T> z;
  std::normal_distribution<double> normal(0.0, 3.0);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<T> row = r % 2 ? zipf_logits<T>(vocab, 1.1, 0.5, rng) : std::vector<T>(vocab);
    if (r % 2 == 0)
      for (auto& x : row) x = T(normal(rng));
    for (std::size_t i = 0; i < vocab; i += 97) row[i] = row[(i * 31) % vocab];  // ties across shards
    if (r == 2)
      for (std::size_t i = 0; i < vocab; i += 5) row[i] = -std::numeric_limits<T>::infinity();  // masked
    z.insert(z.end(), row.begin(), row.end());
  }
  return z;
}

std::vector<std::size_t> random_cuts(int shards, std::size_t vocab, std::mt19937_64& rng) {
  std::vector<std::size_t> cuts{0, vocab};
  std::uniform_int_distribution<std::size_t> cut(1, vocab - 1);
  while (cuts.size() < std::size_t(shards) + 1) {
    const std::size_t c = cut(rng);
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

template <class T>
void check_exact_shards() {
  std::mt19937_64 rng(sizeof(T) * 101);
  const std::size_t vocab = 4099, rows = 4, k_max = 33;
  const std::vector<T> z = test_logits<T>(rows, vocab, rng);
  const std::vector<troll::token_id> sampled{17, 4000, 7, 4098};
  const troll::sparsify_options opt{32, 1e-4};
  sparse_rows<T> whole(rows, k_max, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled.data(), opt, whole.view());

  // The whole row's gradient, its normalisers taken by sparsify_backward itself.
  sparse_grads<T> g(rows, k_max);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t r = 0; r < rows; ++r) {
    for (int i = 0; i < whole.counts[r]; ++i) g.log_probs[r * k_max + std::size_t(i)] = T(normal(rng));
    g.log_remainder[r] = T(normal(rng));
  }
  std::vector<T> grad_whole(rows * vocab);
  troll::sparsify_backward(troll::cpu, troll::make_batch(z.data(), rows, vocab), whole.view(),
                           troll::sparse_grad_view<const T>{g.log_probs.data(), g.log_remainder.data(), rows, k_max},
                           troll::make_batch(grad_whole.data(), rows, vocab));

  for (int shards = 1; shards <= 8; ++shards) {
    CAPTURE(shards);
    const std::vector<std::size_t> cuts = random_cuts(shards, vocab, rng);
    auto shard_view = [&](int s) {
      const std::size_t begin = cuts[std::size_t(s)];
      return troll::batch_view<const T>{z.data() + begin, rows, cuts[std::size_t(s) + 1] - begin, vocab};
    };
    std::vector<std::vector<troll::sparsify_state>> states(static_cast<std::size_t>(shards),
                                                           std::vector<troll::sparsify_state>(rows));
    for (int s = 0; s < shards; ++s)
      troll::sparsify_shard(troll::cpu, shard_view(s), cuts[std::size_t(s)], vocab, sampled.data(), opt,
                            states[std::size_t(s)].data());
    // Pack and unpack as the Python package does; the unsent heap slots hold garbage.
    for (auto& shard : states)
      for (auto& st : shard) {
        std::vector<std::uint8_t> bytes(packed_bytes(opt.k));
        std::memcpy(bytes.data(), &st, bytes.size());
        std::memset(static_cast<void*>(&st), 0xA5, sizeof st);
        std::memcpy(static_cast<void*>(&st), bytes.data(), bytes.size());
      }
    // Merge in a random order.
    std::vector<int> order(static_cast<std::size_t>(shards));
    for (int s = 0; s < shards; ++s) order[std::size_t(s)] = s;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<troll::sparsify_state> merged = states[std::size_t(order[0])];
    for (std::size_t i = 1; i < order.size(); ++i)
      troll::sparsify_merge(troll::cpu, merged.data(), states[std::size_t(order[i])].data(), rows);

    // Stage 1: supports and tail maxima. Stage 2: every shard's exact tail sum, stacked in
    // another order, then the values.
    sparse_rows<T> first(rows, k_max, vocab);
    std::vector<double> tail_max(rows), log_sums(troll::sparsify_log_sums_width * rows);
    troll::sparsify_finalize(troll::cpu, merged.data(), opt, first.view(), nullptr, tail_max.data());
    CHECK(first.indices == whole.indices);
    CHECK(first.counts == whole.counts);
    std::vector<double> tail_sums(std::size_t(shards) * rows * 2);
    for (int s = 0; s < shards; ++s)
      troll::sparsify_tail_sums<T>(troll::cpu, shard_view(s), cuts[std::size_t(s)], first.view(), tail_max.data(),
                                tail_sums.data() + 2 * rows * std::size_t(shards - 1 - s));
    sparse_rows<T> exact(rows, k_max, vocab);
    troll::sparsify_finalize(troll::cpu, merged.data(), opt, exact.view(), log_sums.data(), nullptr, tail_sums.data(),
                             std::size_t(shards));
    CHECK(exact.indices == whole.indices);
    CHECK(exact.counts == whole.counts);
    CHECK(same_bits(exact.log_probs, whole.log_probs));
    CHECK(same_bits(exact.log_remainder, whole.log_remainder));

    // Each shard's backward: sparsify_backward's columns, bit for bit.
    std::vector<T> grad_shards(rows * vocab);
    for (int s = 0; s < shards; ++s) {
      const std::size_t begin = cuts[std::size_t(s)];
      troll::sparsify_shard_backward(
          troll::cpu, shard_view(s), begin, exact.view(),
          troll::sparse_grad_view<const T>{g.log_probs.data(), g.log_remainder.data(), rows, k_max}, log_sums.data(),
          troll::batch_view<T>{grad_shards.data() + begin, rows, cuts[std::size_t(s) + 1] - begin, vocab});
    }
    CHECK(same_bits(grad_shards, grad_whole));
  }
}

}  // namespace

TEST_CASE("two-stage finalize of merged shards gives sparsify's rows and gradients bit for bit (float)") {
  check_exact_shards<float>();
}

TEST_CASE("two-stage finalize of merged shards gives sparsify's rows and gradients bit for bit (double)") {
  check_exact_shards<double>();
}

TEST_CASE("the packed state: the fields before the heap, then k entries, whatever lies beyond") {
  CHECK(packed_bytes(64) == offsetof(troll::sparsify_state, heap) + 64 * sizeof(troll::detail::sparse_candidate));
  CHECK(offsetof(troll::sparsify_state, heap) < sizeof(troll::sparsify_state));
  // A state packed with fewer than its size's entries is caught by the checks (its heap is read
  // up to size), never read out of bounds: cut the bytes at k − 1 entries and fill the rest.
  std::mt19937_64 rng(3);
  const std::size_t vocab = 500;
  const std::vector<double> z = test_logits<double>(1, vocab, rng);
  const troll::sparsify_options opt{8, 0.0};
  troll::sparsify_state st;
  troll::sparsify_shard(troll::cpu, troll::make_batch(z.data(), 1, vocab), 0, vocab, nullptr, opt, &st);
  troll::sparsify_state torn;
  std::memset(static_cast<void*>(&torn), 0xFF, sizeof torn);
  std::memcpy(static_cast<void*>(&torn), &st, packed_bytes(opt.k - 1));
  sparse_rows<double> out(1, 8, vocab);
  CHECK_THROWS_AS(troll::sparsify_finalize(troll::cpu, &torn, opt, out.view()), troll::invalid_input);
}

TEST_CASE("canonical sums: sparsify's double values against a long-double oracle") {
  std::mt19937_64 rng(29);
  const std::size_t vocab = 20011, rows = 4;
  const std::vector<double> z = test_logits<double>(rows, vocab, rng);
  const troll::sparsify_options opt{16, 1e-3};
  sparse_rows<double> out(rows, 16, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), nullptr, opt, out.view());
  const double eps = std::numeric_limits<double>::epsilon();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    const oracle_sparse_row o = oracle_sparsify(z.data() + r * vocab, vocab, opt.k, opt.delta, -1);
    REQUIRE(std::size_t(out.counts[r]) == o.indices.size());
    // log p = z − log Z and log r = log Z_tail − log Z: a few ulps of the log-sums' size.
    const double log_total = double(ld(z[r * vocab + std::size_t(o.indices[0])]) - o.log_probs[0]);
    const double tol = 4 * eps * std::max(1.0, std::fabs(log_total));
    for (std::size_t i = 0; i < o.indices.size(); ++i) {
      const double want = double(o.log_probs[i]), got = out.log_probs[r * 16 + i];
      CHECK(std::fabs(got - want) <= std::max(tol, 4 * eps * std::fabs(want)));
    }
    const double want = double(o.log_remainder);
    CHECK(std::fabs(out.log_remainder[r] - want) <= std::max(tol, 4 * eps * std::fabs(want)));
  }
}

TEST_CASE("sparsify_tail_sums rejects what it cannot sum, naming the row") {
  const std::size_t vocab = 64, rows = 2;
  std::vector<double> z(rows * vocab, 0.5);
  const troll::sparsify_options opt{4, 0.0};
  sparse_rows<double> rows_out(rows, 4, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), nullptr, opt, rows_out.view());
  std::vector<double> tail_max{0.5, std::numeric_limits<double>::quiet_NaN()}, sums(2 * rows);
  const troll::batch_view<const double> shard{z.data(), rows, 32, vocab};
  try {
    troll::sparsify_tail_sums<double>(troll::cpu, shard, 0, rows_out.view(), tail_max.data(), sums.data());
    FAIL("a NaN tail_max was accepted");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 1);
  }
  tail_max[1] = 0.5;
  CHECK_THROWS_AS(troll::sparsify_tail_sums<double>(troll::cpu, shard, 40, rows_out.view(), tail_max.data(), sums.data()),
                  troll::shape_error);
  z[vocab + 3] = std::numeric_limits<double>::infinity();
  try {
    troll::sparsify_tail_sums<double>(troll::cpu, shard, 0, rows_out.view(), tail_max.data(), sums.data());
    FAIL("a +inf logit was accepted");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 1);
  }
}

TEST_CASE("the shard functions deduce T from plain views, as docs/sparse.md writes the calls") {
  // sparsify_tail_sums names T only in non-deduced positions, and sparsify_shard takes const
  // logits: a call without <T>, on the non-const view make_batch(float*) gives, must compile and
  // give the explicit call's bits.
  const std::size_t vocab = 40, cut = 17;
  std::vector<float> z(vocab);
  for (std::size_t i = 0; i < vocab; ++i) z[i] = float(std::sin(0.7 * double(i)));
  troll::sparsify_state a, b;
  troll::sparsify_shard(troll::cpu, troll::make_batch(z.data(), 1, cut, vocab), 0, vocab, nullptr, {4, 0.0}, &a);
  troll::sparsify_shard(troll::cpu, troll::make_batch(z.data() + cut, 1, vocab - cut, vocab), cut, vocab, nullptr,
                        {4, 0.0}, &b);
  troll::sparsify_merge(troll::cpu, &a, &b, 1);
  std::vector<troll::sparse_index> idx(4);
  std::vector<float> lp(4);
  troll::sparse_index count = 0;
  float lr = 0.0f;
  double tail_max = 0.0;
  const troll::sparse_batch_view<float> out{idx.data(), lp.data(), &count, &lr, 1, 4, vocab};
  troll::sparsify_finalize(troll::cpu, &a, {4, 0.0}, out, nullptr, &tail_max);
  double deduced[2] = {0, 0}, deduced_const[2] = {0, 0}, explicit_t[2] = {0, 0};
  troll::sparsify_tail_sums(troll::cpu, troll::make_batch(z.data(), 1, cut, vocab), 0, out, &tail_max, deduced);
  const troll::batch_view<const float> shard = troll::make_batch(static_cast<const float*>(z.data()), 1, cut, vocab);
  troll::sparsify_tail_sums(troll::cpu, shard, 0, troll::sparse_batch_view<const float>(out), &tail_max, deduced_const);
  troll::sparsify_tail_sums<float>(troll::cpu, shard, 0, out, &tail_max, explicit_t);
  CHECK(deduced[0] == explicit_t[0]);
  CHECK(deduced[1] == explicit_t[1]);
  CHECK(deduced_const[0] == explicit_t[0]);
  CHECK(deduced_const[1] == explicit_t[1]);
  CHECK(explicit_t[0] >= 1.0);
}

namespace {

/// sparsify of one row against the one-stage finalize (no tail sums) of its two merged shards.
template <class T>
void check_one_stage(std::vector<T> z, int k, double delta, double rtol) {
  const std::size_t V = z.size(), half = V / 2;
  const troll::sparsify_options opt{k, delta};
  std::vector<troll::sparse_index> idx(std::size_t(k) + 1), cnt(1), idx2(std::size_t(k) + 1), cnt2(1);
  std::vector<T> lp(std::size_t(k) + 1), lr(1), lp2(std::size_t(k) + 1), lr2(1);
  troll::sparse_batch_view<T> whole{idx.data(), lp.data(), cnt.data(), lr.data(), 1, std::size_t(k), V};
  troll::sparse_batch_view<T> shards{idx2.data(), lp2.data(), cnt2.data(), lr2.data(), 1, std::size_t(k), V};
  troll::sparsify(troll::cpu, troll::make_batch(static_cast<const T*>(z.data()), 1, V), nullptr, opt, whole);
  troll::sparsify_state a, b;
  troll::sparsify_shard(troll::cpu, troll::make_batch(static_cast<const T*>(z.data()), 1, half, V), 0, V, nullptr,
                        opt, &a);
  troll::sparsify_shard(troll::cpu, troll::make_batch(static_cast<const T*>(z.data()) + half, 1, V - half, V), half,
                        V, nullptr, opt, &b);
  troll::sparsify_merge(troll::cpu, &a, &b, 1);
  troll::sparsify_finalize(troll::cpu, &a, opt, shards);
  REQUIRE(cnt2[0] == cnt[0]);
  for (std::size_t i = 0; i < std::size_t(cnt[0]); ++i) {
    CHECK(idx2[i] == idx[i]);
    CHECK(std::fabs(double(lp2[i]) - double(lp[i])) <= rtol * std::fabs(double(lp[i])));
  }
  CHECK(std::fabs(double(lr2[0]) - double(lr[0])) <= rtol * std::fabs(double(lr[0])));
}

}  // namespace

TEST_CASE("one-stage finalize keeps the relative digits of values near 0 (near-deterministic and flat rows)") {
  // Before, the one-stage values came from log(s) and a difference of log-sums: a top
  // log-probability of −9.36e-9 was 2.7e-9 relative off (V = 1e5, z₀ = 30 above the rest), a
  // log r of −1e-5 1.8e-11 off (flat row), float's −1.11e-12 8.9e-5 off. The running tail sum is
  // a plain accumulation, so agreement with sparsify (exact sums) is to ~1e-13, not to the bit.
  std::vector<double> peaked(100000, 0.0), flat(100000, 0.0);
  peaked[0] = 30.0;
  check_one_stage<double>(peaked, 1, 0.0, 1e-12);
  check_one_stage<double>(flat, 1, 0.0, 1e-12);
  std::vector<float> peaked_f(262144, 0.0f);
  peaked_f[0] = 40.0f;
  check_one_stage<float>(peaked_f, 1, 0.0, 4e-7);
  std::vector<double> two(151936, -3.0);
  two[7] = 25.0;
  two[100000] = 24.0;
  check_one_stage<double>(two, 4, 0.0, 1e-12);
}
