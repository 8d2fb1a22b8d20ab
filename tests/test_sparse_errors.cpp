#include <doctest/doctest.h>

// Bad input to the sparse path: each listed problem throws its typed troll exception naming the
// row, before anything is written; then a randomised fuzz over malformed sparse rows (no crash,
// no NaN in outputs, no write outside the outputs — run it under ASan).

#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "sparse_oracle.hpp"

using troll_test::expect_row_error;

using namespace sparse_test;

namespace {

using troll_test::nan_value;

struct valid_pair {
  static constexpr std::size_t vocab = 200, rows = 4, k = 9;
  sparse_rows<double> sn{rows, k, vocab}, so{rows, k, vocab};
  valid_pair() {
    std::mt19937_64 rng(1);
    for (std::size_t r = 0; r < rows; ++r) {
      auto a = zipf_logits<double>(vocab, 1.5, 0.1, rng);
      auto b = zipf_logits<double>(vocab, 1.5, 0.1, rng);
      troll::sparse_batch_view<double> vn = sn.view(), vo = so.view();
      vn.rows = vo.rows = 1;
      vn.indices += r * k; vn.log_probs += r * k; vn.counts += r; vn.log_remainder += r;
      vo.indices += r * k; vo.log_probs += r * k; vo.counts += r; vo.log_remainder += r;
      troll::sparsify(troll::cpu, troll::make_batch(a.data(), 1, vocab), nullptr, {8, 1e-4}, vn);
      troll::sparsify(troll::cpu, troll::make_batch(b.data(), 1, vocab), nullptr, {8, 1e-4}, vo);
    }
  }
};

/// Calls every sparse entry point that reads (new, old) sparse rows; each must throw E naming row.
template <class E>
void every_entry_point_rejects(valid_pair& p, std::size_t row) {
  aligned_rows<double> al(p.rows, 20, p.vocab);
  const aligned_rows<double> untouched = al;
  expect_row_error<E>([&] { troll::align(troll::cpu, p.sn.view(), p.so.view(), al.view()); }, row);
  CHECK(al.indices == untouched.indices);
  CHECK(al.counts == untouched.counts);
  // Aligned views built directly on the malformed rows (identical supports are not needed for the
  // checks to fire first).
  troll::aligned_batch_view<const double> direct{p.sn.indices.data(),       p.sn.counts.data(),
                                                 p.sn.log_probs.data(),     p.sn.log_probs.data(),
                                                 p.sn.log_remainder.data(), p.sn.log_remainder.data(),
                                                 p.rows,                    p.k,
                                                 p.vocab};
  std::vector<double> kl_out(p.rows, -7.0);
  expect_row_error<E>([&] { troll::kl(troll::cpu, direct, kl_out.data()); }, row);
  CHECK(kl_out == std::vector<double>(p.rows, -7.0));
  sparse_rows<double> out(p.rows, 20, p.vocab);
  const sparse_rows<double> out_before = out;
  std::vector<troll::projection_stats> st(p.rows);
  expect_row_error<E>([&] { troll::project(troll::cpu, direct, 0.05, out.view(), st.data()); }, row);
  CHECK(out.log_probs == out_before.log_probs);
  CHECK(out.indices == out_before.indices);
}

}  // namespace

TEST_CASE("malformed sparse rows: typed errors naming the row, nothing written") {
  SUBCASE("duplicate index") {
    valid_pair p;
    p.sn.indices[2 * p.k + 3] = p.sn.indices[2 * p.k + 1];
    every_entry_point_rejects<troll::shape_error>(p, 2);
  }
  SUBCASE("index out of range") {
    valid_pair p;
    p.sn.indices[1 * p.k + 0] = troll::sparse_index(p.vocab);
    every_entry_point_rejects<troll::shape_error>(p, 1);
  }
  SUBCASE("negative index") {
    valid_pair p;
    p.sn.indices[3 * p.k + 2] = -1;
    every_entry_point_rejects<troll::shape_error>(p, 3);
  }
  SUBCASE("count above k_max") {
    valid_pair p;
    p.sn.counts[1] = troll::sparse_index(p.k + 1);
    every_entry_point_rejects<troll::shape_error>(p, 1);
  }
  SUBCASE("NaN log-prob") {
    valid_pair p;
    p.sn.log_probs[2 * p.k] = nan_value;
    every_entry_point_rejects<troll::domain_error>(p, 2);
  }
  SUBCASE("NaN remainder") {
    valid_pair p;
    p.sn.log_remainder[0] = nan_value;
    every_entry_point_rejects<troll::domain_error>(p, 0);
  }
  SUBCASE("remainder above 1") {
    valid_pair p;
    p.sn.log_remainder[3] = 0.01;
    every_entry_point_rejects<troll::domain_error>(p, 3);
  }
  SUBCASE("log-prob above 0") {
    valid_pair p;
    p.sn.log_probs[1 * p.k + 1] = 1e-3;
    every_entry_point_rejects<troll::domain_error>(p, 1);
  }
}

TEST_CASE("sparsify: bad options, sampled tokens and logits") {
  const std::size_t vocab = 50, rows = 3;
  std::vector<double> z(rows * vocab, 0.0);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::sin(double(i));
  sparse_rows<double> out(rows, 10, vocab);
  const sparse_rows<double> before = out;
  auto call = [&](troll::sparsify_options o, const troll::token_id* sampled) {
    troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled, o, out.view());
  };
  CHECK_THROWS_AS(call({0, 1e-5}, nullptr), troll::domain_error);
  CHECK_THROWS_AS(call({257, 1e-5}, nullptr), troll::domain_error);
  CHECK_THROWS_AS(call({4, -1e-9}, nullptr), troll::domain_error);
  CHECK_THROWS_AS(call({4, 1.0}, nullptr), troll::domain_error);
  CHECK_THROWS_AS(call({4, nan_value}, nullptr), troll::domain_error);
  std::vector<troll::token_id> sampled{1, 50, 2};
  sampled[1] = 5;
  CHECK_THROWS_AS(call({10, 1e-5}, sampled.data()), troll::shape_error);  // needs k_max >= 11
  sampled[1] = 50;
  expect_row_error<troll::domain_error>([&] { call({4, 1e-5}, sampled.data()); }, 1);
  sampled[1] = -3;
  expect_row_error<troll::domain_error>([&] { call({4, 1e-5}, sampled.data()); }, 1);
  z[2 * vocab + 7] = nan_value;
  expect_row_error<troll::domain_error>([&] { call({4, 1e-5}, nullptr); }, 2);
  z[2 * vocab + 7] = 0.0;
  for (std::size_t i = 0; i < vocab; ++i) z[vocab + i] = -std::numeric_limits<double>::infinity();
  expect_row_error<troll::domain_error>([&] { call({4, 1e-5}, nullptr); }, 1);
  CHECK(out.indices == before.indices);
  CHECK(out.log_probs == before.log_probs);
  CHECK(out.counts == before.counts);
}

TEST_CASE("sparsify and sparsify_shard: a bad sampled id and bad logits in different rows name the lower row") {
  // The sampled ids were all checked before any logit: a NaN in row 0 lost to a bad id in row 2
  // (an audit). Rows are now checked one by one (its id, then its logits), as the device reports.
  const std::size_t vocab = 40, rows = 4;
  std::vector<double> z(rows * vocab);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::cos(0.3 * double(i));
  sparse_rows<double> out(rows, 6, vocab);
  std::vector<troll::sparsify_state> states(rows);
  auto whole = [&](const std::vector<troll::token_id>& sampled) {
    troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled.data(), {4, 1e-5}, out.view());
  };
  auto shard = [&](const std::vector<troll::token_id>& sampled) {
    troll::sparsify_shard(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab), 0, vocab,
                          sampled.data(), {4, 1e-5}, states.data());
  };
  z[0 * vocab + 5] = nan_value;
  expect_row_error<troll::domain_error>([&] { whole({1, 2, 40, 3}); }, 0);
  expect_row_error<troll::domain_error>([&] { shard({1, 2, 40, 3}); }, 0);
  z[0 * vocab + 5] = 0.5;
  z[3 * vocab + 5] = nan_value;
  expect_row_error<troll::domain_error>([&] { whole({1, -1, 2, 3}); }, 1);
  expect_row_error<troll::domain_error>([&] { shard({1, -1, 2, 3}); }, 1);
  // One row with both: its id is named.
  try {
    whole({1, 2, 3, 40});
    FAIL("no exception");
  } catch (const troll::domain_error& e) {
    CHECK(e.row() == 3);
    CHECK(e.code() == troll::row_error::bad_sampled);
  }
}

TEST_CASE("sparsify: a NaN or +inf late in a long row (the scan's own check) throws before any row is written") {
  // Rows of several scan blocks; sparsify validates inside its one pass over each row, so the
  // rows before the bad one are already scanned when it is found: nothing may reach `out`.
  const std::size_t vocab = 5000, rows = 4;
  for (const unsigned threads : {1u, 2u}) {
    for (const std::size_t where : {std::size_t(0), std::size_t(777), vocab - 1}) {
      for (const double bad : {nan_value, std::numeric_limits<double>::infinity()}) {
        std::vector<float> z(rows * vocab);
        for (std::size_t i = 0; i < z.size(); ++i) z[i] = float(3.0 * std::sin(0.37 * double(i)));
        sparse_rows<float> out(rows, 9, vocab);
        std::fill(out.log_probs.begin(), out.log_probs.end(), 7.0f);
        std::fill(out.indices.begin(), out.indices.end(), troll::sparse_index(-9));
        const sparse_rows<float> before = out;
        z[3 * vocab + where] = float(bad);  // the last row
        if (where == 777) z[2 * vocab + vocab - 1] = float(bad);  // and the one before: row 2 is named
        const troll::token_id sampled[rows] = {1, 2, 3, 4};
        expect_row_error<troll::domain_error>(
            [&] {
              troll::sparsify(troll::cpu.with_threads(threads), troll::make_batch(z.data(), rows, vocab), sampled,
                              {8, 1e-4}, out.view());
            },
            where == 777 ? 2 : 3);
        CHECK(out.indices == before.indices);
        CHECK(out.log_probs == before.log_probs);
        CHECK(out.counts == before.counts);
        CHECK(out.log_remainder == before.log_remainder);
      }
    }
  }
}

TEST_CASE("sparsify: a caller's workspace gives the same rows; a short or misaligned one throws before writing") {
  const std::size_t vocab = 3000, rows = 3, k_max = 9;
  std::vector<float> z(rows * vocab);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = float(2.0 * std::cos(0.11 * double(i)));
  const troll::token_id sampled[rows] = {5, 2999, 0};
  sparse_rows<float> own(rows, k_max, vocab), given(rows, k_max, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled, {8, 1e-4}, own.view());
  const std::size_t bytes = troll::workspace_bytes(troll::cpu, troll::op::sparsify{}, rows, vocab, k_max);
  std::vector<double> memory(bytes / 8 + 2);
  troll::sparsify(troll::cpu.with_workspace(memory.data(), bytes), troll::make_batch(z.data(), rows, vocab), sampled,
                  {8, 1e-4}, given.view());
  CHECK(given.indices == own.indices);
  CHECK(given.log_probs == own.log_probs);
  CHECK(given.counts == own.counts);
  CHECK(given.log_remainder == own.log_remainder);
  sparse_rows<float> out(rows, k_max, vocab);
  const sparse_rows<float> before = out;
  CHECK_THROWS_AS(troll::sparsify(troll::cpu.with_workspace(memory.data(), bytes - 1),
                                  troll::make_batch(z.data(), rows, vocab), sampled, {8, 1e-4}, out.view()),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::sparsify(troll::cpu.with_workspace(reinterpret_cast<unsigned char*>(memory.data()) + 4, bytes),
                                  troll::make_batch(z.data(), rows, vocab), sampled, {8, 1e-4}, out.view()),
                  troll::shape_error);
  CHECK(out.indices == before.indices);
  CHECK(out.log_probs == before.log_probs);
  CHECK(out.counts == before.counts);
}

TEST_CASE("fuzz: random malformed sparse rows never crash, leak NaN or write outside the outputs") {
  std::mt19937_64 rng(2024);
  const std::size_t vocab = 64, rows = 5, k = 8, guard = 16;
  std::uniform_int_distribution<int> pick(0, 11);
  std::uniform_int_distribution<std::size_t> any_row(0, rows - 1), any_entry(0, k - 1);
  const double sentinel = 12345.0;
  int thrown = 0, accepted = 0;
  for (int trial = 0; trial < 400; ++trial) {
    sparse_rows<double> rows_new(rows, k, vocab), rows_old(rows, k, vocab);
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    for (auto* s : {&rows_new, &rows_old}) {
      for (std::size_t r = 0; r < rows; ++r) {
        const int count = 1 + int(rng() % k);
        std::vector<int> ids(vocab);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        double mass = 0.0;
        for (int i = 0; i < count; ++i) {
          const double p = 0.9 * u01(rng) / count;
          mass += p;
          s->indices[r * k + std::size_t(i)] = ids[std::size_t(i)];
          s->log_probs[r * k + std::size_t(i)] = std::log(p);
        }
        s->counts[r] = count;
        s->log_remainder[r] = std::log(1.0 - mass);
      }
    }
    // Corrupt a few entries of random rows (or none).
    const int corruptions = int(rng() % 3);
    for (int c = 0; c < corruptions; ++c) {
      sparse_rows<double>& s = rng() % 2 ? rows_new : rows_old;
      const std::size_t r = any_row(rng), e = any_entry(rng);
      switch (pick(rng)) {
        case 0: s.indices[r * k + e] = s.indices[r * k + (e + 1) % k]; break;
        case 1: s.indices[r * k + e] = troll::sparse_index(vocab + rng() % 5); break;
        case 2: s.indices[r * k + e] = -1 - troll::sparse_index(rng() % 3); break;
        case 3: s.counts[r] = troll::sparse_index(k + 1 + rng() % 4); break;
        case 4: s.counts[r] = -1; break;
        case 5: s.log_probs[r * k + e] = nan_value; break;
        case 6: s.log_probs[r * k + e] = 0.5; break;
        case 7: s.log_remainder[r] = nan_value; break;
        case 8: s.log_remainder[r] = 0.2; break;
        case 9: s.log_remainder[r] = std::numeric_limits<double>::infinity(); break;
        case 10: s.log_probs[r * k + e] = -std::numeric_limits<double>::infinity(); break;
        default: s.counts[r] = 0; break;
      }
    }
    // Outputs inside guarded buffers.
    const std::size_t cap = 2 * k;
    std::vector<troll::sparse_index> idx(rows * cap + guard, -9), cnt(rows + guard, -9);
    std::vector<double> ln(rows * cap + guard, sentinel), lo(rows * cap + guard, sentinel),
        rn(rows + guard, sentinel), ro(rows + guard, sentinel);
    troll::aligned_batch_view<double> al{idx.data(), cnt.data(), ln.data(), lo.data(), rn.data(), ro.data(),
                                         rows,       cap,        vocab};
    try {
      troll::align(troll::cpu, rows_new.view(), rows_old.view(), al);
    } catch (const troll::invalid_input& e) {
      ++thrown;
      CHECK(e.row() < rows);
      CHECK(idx == std::vector<troll::sparse_index>(rows * cap + guard, -9));
      CHECK(ln == std::vector<double>(rows * cap + guard, sentinel));
      continue;
    }
    ++accepted;
    for (std::size_t i = rows * cap; i < idx.size(); ++i) CHECK(idx[i] == -9);
    for (std::size_t i = rows * cap; i < ln.size(); ++i) CHECK(ln[i] == sentinel);
    for (std::size_t i = rows; i < rn.size(); ++i) CHECK(rn[i] == sentinel);
    std::vector<troll::sparse_index> oidx(rows * cap + guard, -9), ocnt(rows + guard, -9);
    std::vector<double> olp(rows * cap + guard, sentinel), orem(rows + guard, sentinel);
    troll::sparse_batch_view<double> out{oidx.data(), olp.data(), ocnt.data(), orem.data(), rows, cap, vocab};
    std::vector<troll::projection_stats> st(rows);
    try {
      troll::project(troll::cpu, al, 0.05, out, st.data());
    } catch (const troll::invalid_input& e) {
      CHECK(e.row() < rows);  // e.g. infeasible after a -inf corruption
      continue;
    }
    for (std::size_t r = 0; r < rows; ++r) {
      for (int i = 0; i < ocnt[r]; ++i) CHECK(!std::isnan(olp[r * cap + std::size_t(i)]));
      CHECK(!std::isnan(orem[r]));
    }
    for (std::size_t i = rows * cap; i < olp.size(); ++i) CHECK(olp[i] == sentinel);
    for (std::size_t i = rows; i < orem.size(); ++i) CHECK(orem[i] == sentinel);
  }
  CHECK(thrown > 50);
  CHECK(accepted > 50);
}

TEST_CASE("sparse upstream gradients: a NaN or an infinity is named as it is, with its entry") {
  const std::size_t vocab = 40, rows = 3, k = 6;
  std::vector<double> z(rows * vocab);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::cos(0.7 * double(i));
  sparse_rows<double> support(rows, k, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), nullptr, {4, 1e-5}, support.view());
  for (double bad : {nan_value, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    for (long long entry : {-1LL, 2LL}) {
      const std::string word = bad != bad ? "NaN" : bad > 0 ? "+inf" : "-inf";
      CAPTURE(word);
      CAPTURE(entry);
      std::vector<double> g(rows * k, 0.25), g_r(rows, -0.5), out(rows * vocab, 7.0);
      (entry < 0 ? g_r[1] : g[1 * k + std::size_t(entry)]) = bad;
      const troll::sparse_grad_view<const double> grad{g.data(), g_r.data(), rows, k};
      try {
        troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab),
                                 troll::sparse_batch_view<const double>(support.view()), grad,
                                 troll::make_batch(out.data(), rows, vocab));
        FAIL("no exception");
      } catch (const troll::domain_error& error) {
        const std::string where = entry < 0 ? "log_remainder" : "entry 2";
        CHECK(std::string(error.what()) == "troll::sparsify_backward: row 1: grad " + where + " is " + word);
      }
      CHECK(out == std::vector<double>(rows * vocab, 7.0));
    }
  }
}

namespace {

/// Runs `call`; expects a troll::invalid_input naming `row` with code `code`.
template <class Call>
void expect_row_code(Call&& call, std::size_t row, troll::row_error code) {
  bool thrown = false;
  try {
    call();
  } catch (const troll::invalid_input& e) {
    thrown = true;
    CHECK_MESSAGE(e.row() == row, std::string(e.what()));
    CHECK_MESSAGE(e.code() == code, std::string(e.what()));
  }
  CHECK(thrown);
}

/// Four hand-made aligned rows over V = 50: row r holds counts[r] entries (ids 0, 1, …) of
/// probability 0.1 on both sides, the rest in the bucket.
aligned_rows<double> small_aligned(const std::vector<int>& counts, std::size_t k_max) {
  aligned_rows<double> a(counts.size(), k_max, 50);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const int c = counts[r];
    a.counts[r] = c;
    for (std::size_t i = 0; i < k_max; ++i) {
      const bool used = int(i) < c;
      a.indices[r * k_max + i] = used ? troll::sparse_index(i) : -1;
      a.new_log_probs[r * k_max + i] = a.old_log_probs[r * k_max + i] =
          used ? std::log(0.1) : -std::numeric_limits<double>::infinity();
    }
    a.new_log_remainder[r] = a.old_log_remainder[r] = std::log(1.0 - 0.1 * c);
  }
  return a;
}

}  // namespace

TEST_CASE("every sparse entry point: the lowest bad row, whatever its problem (as the device)") {
  // Each batch has a problem of an early check (new side, logits, the row itself) in row 3 and
  // one of a later check (old side, capacity, stats, tail_max, log-sums, gradient) in row 1. The
  // checks ran in stages over all rows before and named row 3; they now run row by row.
  using troll::row_error;
  const std::size_t rows = 4, vocab = 40, k = 8;
  const double nan = nan_value;
  std::vector<double> z(rows * vocab), z2(rows * vocab);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::cos(0.3 * double(i)), z2[i] = std::sin(0.7 * double(i));
  sparse_rows<double> sn(rows, k, vocab), so(rows, k, vocab);
  troll::sparsify(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab), nullptr, {4, 1e-5}, sn.view());
  troll::sparsify(troll::cpu, troll::make_batch<const double>(z2.data(), rows, vocab), nullptr, {4, 1e-5}, so.view());
  aligned_rows<double> al(rows, 2 * k, vocab);
  troll::align(troll::cpu, sn.view(), so.view(), al.view());
  sparse_grads<double> grad(rows, k), grad_out(rows, k), grad_al(rows, 2 * k);
  std::vector<double> grad_logits(rows * vocab);
  for (unsigned threads : {1u, 3u}) {
    const troll::cpu_policy cpu = troll::cpu.with_threads(threads);
    {  // align(sparse, sparse): the new rows, the old rows
      auto n = sn, o = so;
      n.log_probs[3 * k] = nan;
      o.log_probs[1 * k] = nan;
      aligned_rows<double> out(rows, 2 * k, vocab);
      expect_row_code([&] { troll::align(cpu, n.view(), o.view(), out.view()); }, 1, row_error::sparse_nan);
    }
    {  // align(logits, support, old): the new logits, the old rows
      auto zz = z;
      auto o = so;
      zz[3 * vocab + 2] = nan;
      o.log_probs[1 * k] = nan;
      aligned_rows<double> out(rows, 2 * k, vocab);
      expect_row_code([&] {
        troll::align(cpu, troll::make_batch<const double>(zz.data(), rows, vocab),
                     troll::sparse_batch_view<const double>(sn.view()), o.view(), out.view());
      }, 1, row_error::sparse_nan);
    }
    {  // align_backward: the row, then the aligned side
      auto n = sn;
      auto a = al;
      n.log_probs[3 * k] = nan;
      a.new_log_probs[1 * a.k_max] = nan;
      expect_row_code([&] {
        troll::align_backward(cpu, troll::sparse_batch_view<const double>(n.view()), a.const_view(),
                              troll::sparse_grad_view<const double>(grad_al.view()), grad_out.view());
      }, 1, row_error::sparse_nan);
    }
    {  // kl: the new side (validated over every row first before), the old side
      auto a = al;
      a.new_log_probs[3 * a.k_max] = nan;
      a.old_log_probs[1 * a.k_max] = nan;
      std::vector<double> kl_out(rows);
      expect_row_code([&] { troll::kl(cpu, a.const_view(), kl_out.data()); }, 1, row_error::sparse_nan);
    }
    {  // project: the aligned rows, then the output's capacity; and in one row, capacity before
       // infeasibility (the device's order)
      auto a = small_aligned({3, 5, 3, 3}, 6);
      a.new_log_probs[3 * 6] = nan;
      sparse_rows<double> out(rows, 4, 50);
      std::vector<troll::projection_stats> st(rows);
      expect_row_code([&] { troll::project(cpu, a.const_view(), 0.05, out.view(), st.data()); }, 1,
                      row_error::sparse_capacity);
      a.new_log_probs[3 * 6] = std::log(0.1);
      a.new_log_probs[1 * 6] = -std::numeric_limits<double>::infinity();  // row 1 masks its first token…
      a.new_log_remainder[1] = std::log(0.6);
      a.old_log_probs[1 * 6] = std::log(0.9);  // …where the old row has 0.9: −log q(J) = 2.3 ≥ ε
      for (int i = 1; i < 5; ++i) a.old_log_probs[1 * 6 + std::size_t(i)] = std::log(0.01);
      a.old_log_remainder[1] = std::log(0.06);
      expect_row_code([&] { troll::project(cpu, a.const_view(), 0.05, out.view(), st.data()); }, 1,
                      row_error::sparse_capacity);
      sparse_rows<double> wide(rows, 6, 50);
      expect_row_code([&] { troll::project(cpu, a.const_view(), 0.05, wide.view(), st.data()); }, 1,
                      row_error::infeasible);
    }
    {  // project_backward: the aligned rows, then the stats
      auto a = small_aligned({3, 5, 3, 3}, 6);
      sparse_rows<double> out(rows, 6, 50);
      std::vector<troll::projection_stats> st(rows);
      troll::project(cpu, a.const_view(), 0.05, out.view(), st.data());
      sparse_grads<double> g(rows, 6), gn(rows, 6);
      a.old_log_probs[3 * 6] = nan;
      st[1].status = troll::row_status::not_converged;  // stats the backward refuses
      expect_row_code([&] {
        troll::project_backward(cpu, a.const_view(), troll::sparse_batch_view<const double>(out.view()), st.data(),
                                troll::sparse_grad_view<const double>(g.view()), gn.view());
      }, 1, row_error::bad_stats);
    }
    {  // sparsify_backward: the logits, then the gradient
      auto zz = z;
      auto g = grad;
      zz[3 * vocab + 2] = nan;
      g.log_probs[1 * k] = nan;
      expect_row_code([&] {
        troll::sparsify_backward(cpu, troll::make_batch<const double>(zz.data(), rows, vocab),
                                 troll::sparse_batch_view<const double>(sn.view()),
                                 troll::sparse_grad_view<const double>(g.view()),
                                 troll::make_batch(grad_logits.data(), rows, vocab));
      }, 1, row_error::sparse_nan);
    }
    {  // sparsify_tail_sums: the shard's logits, then tail_max
      auto zz = z;
      zz[3 * vocab + 2] = nan;
      std::vector<double> tail_max(rows, 100.0), sums(2 * rows);  // above every logit
      tail_max[1] = nan;
      expect_row_code([&] {
        troll::sparsify_tail_sums(cpu, troll::make_batch<const double>(zz.data(), rows, vocab), 0,
                                  troll::sparse_batch_view<const double>(sn.view()), tail_max.data(), sums.data());
      }, 1, row_error::bad_tail_max);
    }
    {  // sparsify_shard_backward: the shard's logits, then the log-sums
      auto zz = z;
      zz[3 * vocab + 2] = nan;
      std::vector<double> log_sums(rows * troll::sparsify_log_sums_width);
      for (std::size_t r = 0; r < rows; ++r) {
        double* s = log_sums.data() + r * troll::sparsify_log_sums_width;
        s[0] = 0.0, s[1] = 3.0, s[2] = -1.0, s[3] = 2.0;
      }
      log_sums[1 * troll::sparsify_log_sums_width] = nan;
      expect_row_code([&] {
        troll::sparsify_shard_backward(cpu, troll::make_batch<const double>(zz.data(), rows, vocab), 0,
                                       troll::sparse_batch_view<const double>(sn.view()),
                                       troll::sparse_grad_view<const double>(grad.view()), log_sums.data(),
                                       troll::make_batch(grad_logits.data(), rows, vocab));
      }, 1, row_error::bad_log_sums);
    }
  }
}

TEST_CASE("supports whose values are not read: every id checked (a full support's duplicates; ids after a NaN value)") {
  // A support covering the whole vocabulary (count = V) was checked for its tail rule first,
  // whose refusal was then dropped with the duplicate check behind it: ids {0, 1, 1, 2} at V = 4
  // passed into sparsify_backward and align(logits, ...). sparsify_tail_sums, which reads only
  // the ids, stopped at a NaN value and never saw a bad id behind it. Both now follow the
  // device's rules (warp_check_sparse_row with remainder_rules = false).
  using troll::row_error;
  const std::size_t rows = 2, vocab = 4;
  std::vector<double> z{0.1, -0.3, 0.7, 0.2, 0.5, 0.5, -1.0, 0.0};
  sparse_rows<double> support(rows, vocab, vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    support.counts[r] = 4;
    support.log_remainder[r] = -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < vocab; ++i) {
      support.indices[r * vocab + i] = troll::sparse_index(i);
      support.log_probs[r * vocab + i] = std::log(0.25);
    }
  }
  support.indices[1 * vocab + 2] = 1;  // row 1: ids {0, 1, 1, 3}
  sparse_grads<double> grad(rows, vocab);
  std::vector<double> grad_logits(rows * vocab, 42.0);
  expect_row_code([&] {
    troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab),
                             troll::sparse_batch_view<const double>(support.view()),
                             troll::sparse_grad_view<const double>(grad.view()),
                             troll::make_batch(grad_logits.data(), rows, vocab));
  }, 1, row_error::sparse_duplicate);
  CHECK(grad_logits == std::vector<double>(rows * vocab, 42.0));
  sparse_rows<double> old = support;
  old.indices[1 * vocab + 2] = 2;
  aligned_rows<double> out(rows, vocab, vocab);
  expect_row_code([&] {
    troll::align(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab),
                 troll::sparse_batch_view<const double>(support.view()), old.view(), out.view());
  }, 1, row_error::sparse_duplicate);

  // sparsify_tail_sums reads the ids only: a NaN value is no problem, a bad id behind it is.
  sparse_rows<double> ids = old;
  ids.counts[0] = 2;
  ids.log_probs[0] = nan_value;
  ids.indices[1] = -5;
  std::vector<double> tail_max(rows, 100.0), sums(2 * rows, 42.0);  // above every logit
  expect_row_code([&] {
    troll::sparsify_tail_sums(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab), 0,
                              troll::sparse_batch_view<const double>(ids.view()), tail_max.data(), sums.data());
  }, 0, row_error::sparse_index);
  ids.indices[1] = 3;
  CHECK_NOTHROW(troll::sparsify_tail_sums(troll::cpu, troll::make_batch<const double>(z.data(), rows, vocab), 0,
                                          troll::sparse_batch_view<const double>(ids.view()), tail_max.data(),
                                          sums.data()));
}

// ---- Found by an adversarial audit (thirtieth session) ----

TEST_CASE("sparse project_backward in float: a derivative beyond float throws, as the dense one does") {
  // Finite upstream entries near FLT_MAX: the lumped VJP is formed and checked in double, where it
  // fits; grad_eps (~3.3e39) and the old side's entries do not fit float. Before, they were
  // written as ±inf without an error.
  const std::size_t V = 3;
  const float big = std::numeric_limits<float>::max();
  std::vector<troll::sparse_index> ids{0, 1}, counts{1 + 1};
  std::vector<float> new_lp{std::log(0.6f), std::log(0.3f)}, old_lp{std::log(0.2f), std::log(0.3f)};
  std::vector<float> new_r{std::log(0.1f)}, old_r{std::log(0.5f)};
  const troll::aligned_batch_view<const float> rows{ids.data(),   counts.data(), new_lp.data(), old_lp.data(),
                                                    new_r.data(), old_r.data(),  1,             2,
                                                    V};
  std::vector<troll::sparse_index> out_ids(2), out_counts(1);
  std::vector<float> out_lp(2), out_r(1);
  const troll::sparse_batch_view<float> out{out_ids.data(), out_lp.data(), out_counts.data(), out_r.data(), 1, 2, V};
  troll::projection_stats stats;
  troll::project(troll::cpu, rows, 0.01, out, &stats);
  REQUIRE(stats.status == troll::row_status::projected);
  for (const std::vector<float>& up : {std::vector<float>{big, 0.f, 0.f}, std::vector<float>{-big, 0.f, big}}) {
    std::vector<float> g{up[0], up[1]}, g_r{up[2]}, gn(2, 7.f), gn_r(1, 7.f), go(2, 7.f), go_r(1, 7.f), ge(1, 7.f);
    const troll::sparse_grad_view<const float> grad{g.data(), g_r.data(), 1, 2};
    // With every output requested, and with grad_eps alone beside grad_new (the short path).
    CHECK_THROWS_AS(troll::project_backward(troll::cpu, rows, troll::sparse_input<float>(out), &stats, grad,
                                            troll::sparse_grad_view<float>{gn.data(), gn_r.data(), 1, 2},
                                            troll::sparse_grad_view<float>{go.data(), go_r.data(), 1, 2}, ge.data()),
                    troll::domain_error);
    CHECK_THROWS_WITH_AS(troll::project_backward(troll::cpu, rows, troll::sparse_input<float>(out), &stats, grad,
                                                 troll::sparse_grad_view<float>{gn.data(), gn_r.data(), 1, 2}, {},
                                                 ge.data()),
                         doctest::Contains("row 0: a derivative does not fit float"), troll::domain_error);
  }
  // The same rows in double fit: no error, every output finite.
  std::vector<double> dn(new_lp.begin(), new_lp.end()), dd(old_lp.begin(), old_lp.end());
  std::vector<double> dnr(new_r.begin(), new_r.end()), dor(old_r.begin(), old_r.end());
  const troll::aligned_batch_view<const double> drows{ids.data(), counts.data(), dn.data(), dd.data(),
                                                      dnr.data(), dor.data(),    1,         2,
                                                      V};
  std::vector<double> dlp(2), dr(1);
  const troll::sparse_batch_view<double> dout{out_ids.data(), dlp.data(), out_counts.data(), dr.data(), 1, 2, V};
  troll::projection_stats dstats;
  troll::project(troll::cpu, drows, 0.01, dout, &dstats);
  std::vector<double> g{double(big), 0.0}, g_r{0.0}, gn(2), gn_r(1), go(2), go_r(1), ge(1);
  troll::project_backward(troll::cpu, drows, troll::sparse_input<double>(dout), &dstats,
                          troll::sparse_grad_view<const double>{g.data(), g_r.data(), 1, 2},
                          troll::sparse_grad_view<double>{gn.data(), gn_r.data(), 1, 2},
                          troll::sparse_grad_view<double>{go.data(), go_r.data(), 1, 2}, ge.data());
  CHECK(std::fabs(ge[0]) > double(big));
  for (double v : {gn[0], gn[1], gn_r[0], go[0], go[1], go_r[0], ge[0]}) CHECK(std::isfinite(v));
}

TEST_CASE("sparse project_backward in float: one gradient entry beyond float throws where dL/deps fits") {
  // The short path writes its entries in T and checks them only where its bound on |grad| passes
  // T's largest value. Rows inside the ball (dL/deps = 0, t = 1) and a projected row, with
  // upstream g = (−F, F, F) for F = FLT_MAX: the first entry is −F − π_0·Σg ≈ −1.6·F in double.
  const std::size_t V = 3;
  const float big = std::numeric_limits<float>::max();
  std::vector<troll::sparse_index> ids{0, 1}, counts{2};
  std::vector<float> new_lp{std::log(0.6f), std::log(0.3f)}, old_lp{std::log(0.2f), std::log(0.3f)};
  std::vector<float> new_r{std::log(0.1f)}, old_r{std::log(0.5f)};
  const troll::aligned_batch_view<const float> rows{ids.data(),   counts.data(), new_lp.data(), old_lp.data(),
                                                    new_r.data(), old_r.data(),  1,             2,
                                                    V};
  for (double eps : {10.0, 0.3}) {  // KL(new‖old) ≈ 0.498: inside the ball, then projected
    CAPTURE(eps);
    std::vector<troll::sparse_index> out_ids(2), out_counts(1);
    std::vector<float> out_lp(2), out_r(1);
    const troll::sparse_batch_view<float> out{out_ids.data(), out_lp.data(), out_counts.data(), out_r.data(),
                                              1, 2, V};
    troll::projection_stats stats;
    troll::project(troll::cpu, rows, eps, out, &stats);
    CHECK((stats.status == troll::row_status::projected) == (eps < 1.0));
    std::vector<float> g{-big, big}, g_r{big}, gn(2, 7.f), gn_r(1, 7.f), ge(1, 7.f);
    const troll::sparse_grad_view<const float> grad{g.data(), g_r.data(), 1, 2};
    CHECK_THROWS_WITH_AS(troll::project_backward(troll::cpu, rows, troll::sparse_input<float>(out), &stats, grad,
                                                 troll::sparse_grad_view<float>{gn.data(), gn_r.data(), 1, 2}, {},
                                                 ge.data()),
                         doctest::Contains("row 0"), troll::domain_error);
    // A smaller upstream (1e30) fits: every output finite, no error.
    std::vector<float> h{-1e30f, 1e30f}, h_r{1e30f};
    troll::project_backward(troll::cpu, rows, troll::sparse_input<float>(out), &stats,
                            troll::sparse_grad_view<const float>{h.data(), h_r.data(), 1, 2},
                            troll::sparse_grad_view<float>{gn.data(), gn_r.data(), 1, 2}, {}, ge.data());
    for (float v : {gn[0], gn[1], gn_r[0], ge[0]}) CHECK(std::isfinite(v));
  }
}

TEST_CASE("project at a subnormal eps: every log-probability written is at most 0, and its backward accepts it") {
  // A member with t ~ 3e-145: the dominant old token's log π* rounded to +6e-179 (a probability
  // above 1), which project_backward then refused as not the forward's output.
  std::vector<troll::sparse_index> ids{0, 5}, counts{2};
  std::vector<double> new_lp{-6.951843382763392e-29, -66.627720306717265};
  std::vector<double> old_lp{-89.101789664873976, -1.2070789355679935e-38};
  std::vector<double> new_r{-65.018282394283162}, old_r{-87.492351752439873};
  const std::size_t V = 7;
  const troll::aligned_batch_view<const double> rows{ids.data(),   counts.data(), new_lp.data(), old_lp.data(),
                                                     new_r.data(), old_r.data(),  1,             2,
                                                     V};
  for (double eps : {std::numeric_limits<double>::min(), 1e-300}) {  // subnormal bounds are refused
    CAPTURE(eps);
    std::vector<troll::sparse_index> out_ids(2), out_counts(1);
    std::vector<double> out_lp(2), out_r(1);
    const troll::sparse_batch_view<double> out{out_ids.data(), out_lp.data(), out_counts.data(), out_r.data(), 1, 2, V};
    troll::projection_stats stats;
    troll::project(troll::cpu, rows, eps, out, &stats);
    for (double lp : {out_lp[0], out_lp[1], out_r[0]}) CHECK(lp <= 0.0);
    std::vector<double> g{1.0, 1.0}, g_r{1.0}, gn(2), gn_r(1);
    CHECK_NOTHROW(troll::project_backward(troll::cpu, rows, troll::sparse_input<double>(out), &stats,
                                          troll::sparse_grad_view<const double>{g.data(), g_r.data(), 1, 2},
                                          troll::sparse_grad_view<double>{gn.data(), gn_r.data(), 1, 2}));
    // The same lumped row dense (three categories: the two tokens and the bucket's mass on one).
    const std::vector<double> zn{new_lp[0], new_lp[1], new_r[0]}, zo{old_lp[0], old_lp[1], old_r[0]};
    std::vector<double> dense(3);
    troll::projection_stats dense_stats;
    troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 3), troll::make_batch(zo.data(), 1, 3), eps,
                   troll::make_batch(dense.data(), 1, 3), &dense_stats);
    for (double lp : dense) CHECK(lp <= 0.0);
  }
}

TEST_CASE("sparsify_tail_sums: a tail logit above tail_max is refused, naming the row and the shard token") {
  // A tail_max from other rows (or another support) is below some tail logit: the terms
  // e^{z - tail_max} exceed 1 and the exact sum came out NaN (a -inf tail_max: silently 0).
  const std::size_t rows = 3, offset = 4, shard = 5;  // tokens 4 .. 8 of a 9-token row
  std::vector<double> z(rows * shard);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = 0.25 * double(i % 7) - 1.0;
  // Support: token 6 (shard token 2) in every row, one entry.
  std::vector<troll::sparse_index> ids(rows, 6), counts(rows, 1);
  std::vector<double> lp(rows, -0.5), rem(rows, -1.0);
  const troll::sparse_batch_view<const double> support{ids.data(), lp.data(), counts.data(), rem.data(), rows, 1,
                                                       offset + shard};
  std::vector<double> tail_max(rows), sums(2 * rows, 42.0);
  for (std::size_t r = 0; r < rows; ++r) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t j = 0; j < shard; ++j)
      if (j != 2) m = std::max(m, z[r * shard + j]);
    tail_max[r] = m;
  }
  auto call = [&](troll::cpu_policy p) {
    troll::sparsify_tail_sums(p, troll::make_batch<const double>(z.data(), rows, shard), offset, support,
                              tail_max.data(), sums.data());
  };
  CHECK_NOTHROW(call(troll::cpu));
  for (double s : sums) CHECK(std::isfinite(s));
  std::fill(sums.begin(), sums.end(), 42.0);
  // The support's own token may lie above tail_max; a tail token may not.
  z[1 * shard + 2] = tail_max[1] + 5.0;
  CHECK_NOTHROW(call(troll::cpu));
  std::fill(sums.begin(), sums.end(), 42.0);
  z[2 * shard + 4] = tail_max[2] + 1.0;  // row 2, shard token 4
  z[1 * shard + 3] = tail_max[1] + 0.5;  // row 1, shard token 3: the lowest bad row
  for (unsigned threads : {1u, 3u}) {
    CAPTURE(threads);
    expect_row_code([&] { call(troll::cpu.with_threads(threads)); }, 1, troll::row_error::tail_above_max);
    CHECK_THROWS_WITH_AS(call(troll::cpu.with_threads(threads)), doctest::Contains("row 1: shard token 3"),
                         troll::domain_error);
    CHECK(sums == std::vector<double>(2 * rows, 42.0));
  }
  // A -inf tail_max with a finite tail logit: refused too (it had summed to 0).
  z[1 * shard + 3] = 0.0;
  tail_max[1] = std::max(tail_max[1], 0.0);
  tail_max[2] = -std::numeric_limits<double>::infinity();
  expect_row_code([&] { call(troll::cpu); }, 2, troll::row_error::tail_above_max);
  // A tail_max above the tail (from a larger row) is valid: the same shares in a shifted unit.
  tail_max[2] = 1e3;
  CHECK_NOTHROW(call(troll::cpu));
}

TEST_CASE("sparsify_backward near the largest double: g_R / r overflowing alone is no reason for inf; a true overflow throws") {
  // V = 4 equal logits, support {0}: p = 1/4 everywhere, r = 3/4. With g = 0 on the support and
  // g_R = 1.5e308 the tail entries are g_R (p/r - p) = 1.25e307 and the support entry -p g_R =
  // -3.75e307, all finite, although g_R / r = 2e308 is not (it had been formed first: +inf).
  const double big = 1.5e308;
  std::vector<double> z(4, 0.0), out(4, 7.0), shard_out(4, 7.0);
  std::vector<troll::sparse_index> ids{0}, counts{1};
  std::vector<double> lp{std::log(0.25)}, rem{std::log(0.75)}, g{0.0}, g_r{big};
  const troll::sparse_batch_view<const double> support{ids.data(), lp.data(), counts.data(), rem.data(), 1, 1, 4};
  const troll::sparse_grad_view<const double> grad{g.data(), g_r.data(), 1, 1};
  troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(z.data(), 1, 4), support, grad,
                           troll::make_batch(out.data(), 1, 4));
  CHECK(out[0] == doctest::Approx(-0.25 * big).epsilon(1e-14));
  for (std::size_t k = 1; k < 4; ++k) CHECK(out[k] == doctest::Approx(big / 12.0).epsilon(1e-14));
  // The same row as one shard, its log-sums {ref, total, tail_ref, tail} = {0, log 4, 0, log 3}.
  const double log_sums[4] = {0.0, std::log(4.0), 0.0, std::log(3.0)};
  troll::sparsify_shard_backward(troll::cpu, troll::make_batch<const double>(z.data(), 1, 4), 0, support, grad,
                                 log_sums, troll::make_batch(shard_out.data(), 1, 4));
  for (std::size_t k = 0; k < 4; ++k) CHECK(shard_out[k] == doctest::Approx(out[k]).epsilon(1e-14));

  // A true overflow: rows 1 and 2 of three over V = 3, z = (0, -40, 0), support {0, 1}: g_0 =
  // 1.7e308, g_1 = g_R = -1.7e308, so G = -1.7e308 and the entry of token 0 is g_0 (1 - p_0) -
  // p_0 (G - g_0) ~ 2.55e308. Row 0 has ordinary gradients. The lowest such row is named.
  const std::size_t rows = 3;
  std::vector<double> z3{0.0, -40.0, 0.0, 0.0, -40.0, 0.0, 0.0, -40.0, 0.0};
  std::vector<troll::sparse_index> ids3{0, 1, 0, 1, 0, 1}, counts3{2, 2, 2};
  const double p0 = 1.0 / (2.0 + std::exp(-40.0)), p1 = std::exp(-40.0) * p0;
  std::vector<double> lp3, rem3(rows, std::log(p0)), g3{0.5, -0.25, 1.7e308, -1.7e308, 1.7e308, -1.7e308},
      gr3{0.125, -1.7e308, -1.7e308}, out3(rows * 3, 7.0);
  for (std::size_t r = 0; r < rows; ++r) lp3.insert(lp3.end(), {std::log(p0), std::log(p1)});
  const troll::sparse_batch_view<const double> support3{ids3.data(), lp3.data(), counts3.data(), rem3.data(),
                                                        rows, 2, 3};
  const troll::sparse_grad_view<const double> grad3{g3.data(), gr3.data(), rows, 2};
  for (unsigned threads : {1u, 3u}) {
    CAPTURE(threads);
    CHECK_THROWS_WITH_AS(troll::sparsify_backward(troll::cpu.with_threads(threads),
                                                  troll::make_batch<const double>(z3.data(), rows, 3), support3,
                                                  grad3, troll::make_batch(out3.data(), rows, 3)),
                         doctest::Contains("row 1: a gradient entry does not fit double"), troll::domain_error);
  }
}
