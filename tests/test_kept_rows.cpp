// test_kept_rows.cpp — project() and project_backward() keep what their validation pass found for
// the first 64 rows of a batch (the scan's setup, the VJP's first-pass sums) and redo it for later
// rows. Batches that cross that boundary must give every row exactly what a one-row call gives
// (bit for bit, stats included), on one and two threads, and a bad row on either side of the
// boundary must be reported as the lowest bad row, before anything is written.
#include <doctest/doctest.h>

#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bits.hpp"

namespace {

using troll_test::same_bits;

constexpr std::size_t vocab = 37;

template <class T>
struct batch {
  std::size_t rows;
  std::vector<T> fresh, old, upstream;

  explicit batch(std::size_t n, unsigned seed) : rows(n), fresh(n * vocab), old(n * vocab), upstream(n * vocab) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (std::size_t r = 0; r < n; ++r) {
      // Rows of every kind: inactive (a small change), projected (a large one), with masked tokens
      // on either side, and logits of very different scales.
      const double scale = (r % 5 == 0) ? 30.0 : (r % 3 == 0 ? 0.01 : 2.0);
      for (std::size_t j = 0; j < vocab; ++j) {
        const double base = normal(gen);
        old[r * vocab + j] = T(base);
        fresh[r * vocab + j] = T(base + scale * normal(gen));
        upstream[r * vocab + j] = T(normal(gen));
      }
      if (r % 7 == 1) old[r * vocab + (r % vocab)] = -std::numeric_limits<T>::infinity();
      if (r % 11 == 2) {  // masked on both sides (a new-side mask alone can make the row infeasible)
        fresh[r * vocab + ((r + 3) % vocab)] = -std::numeric_limits<T>::infinity();
        old[r * vocab + ((r + 3) % vocab)] = -std::numeric_limits<T>::infinity();
      }
    }
  }
  troll::batch_view<const T> view(const std::vector<T>& v, std::size_t first, std::size_t n) const {
    return troll::make_batch(v.data() + first * vocab, n, vocab);
  }
};

bool same_solution(const troll::projection_stats& a, const troll::projection_stats& b) {
  return std::memcmp(&a.eta, &b.eta, sizeof(double)) == 0 && std::memcmp(&a.t, &b.t, sizeof(double)) == 0 &&
         std::memcmp(&a.kl_after, &b.kl_after, sizeof(double)) == 0 && a.iterations == b.iterations &&
         a.status == b.status;
}

template <class T>
void check_batch_equals_rows(std::size_t rows, int threads) {
  CAPTURE(rows);
  CAPTURE(threads);
  const double eps = 0.05;
  batch<T> b(rows, 17u + unsigned(rows));
  const auto policy = troll::cpu.with_threads(threads);
  std::vector<T> out(rows * vocab), grad_new(rows * vocab), grad_old(rows * vocab), grad_eps(rows);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(policy, b.view(b.fresh, 0, rows), b.view(b.old, 0, rows), eps, troll::make_batch(out.data(), rows, vocab),
                 stats.data());
  // Without grad_old: the path that keeps the first rows' sums.
  troll::project_backward(policy, b.view(b.fresh, 0, rows), b.view(b.old, 0, rows),
                          troll::make_batch<const T>(out.data(), rows, vocab), stats.data(),
                          b.view(b.upstream, 0, rows), troll::make_batch(grad_new.data(), rows, vocab));
  // With grad_old and grad_eps: the path that keeps nothing.
  std::vector<T> grad_new2(rows * vocab);
  troll::project_backward(policy, b.view(b.fresh, 0, rows), b.view(b.old, 0, rows),
                          troll::make_batch<const T>(out.data(), rows, vocab), stats.data(),
                          b.view(b.upstream, 0, rows), troll::make_batch(grad_new2.data(), rows, vocab),
                          troll::make_batch(grad_old.data(), rows, vocab), grad_eps.data());

  std::vector<T> one_out(vocab), one_grad(vocab), one_grad2(vocab), one_old(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    troll::projection_stats one_stats;
    T one_eps = T(0);
    troll::project(troll::cpu.with_threads(1), b.view(b.fresh, r, 1), b.view(b.old, r, 1), eps,
                   troll::make_batch(one_out.data(), 1, vocab), &one_stats);
    troll::project_backward(troll::cpu.with_threads(1), b.view(b.fresh, r, 1), b.view(b.old, r, 1),
                            troll::make_batch<const T>(one_out.data(), 1, vocab), &one_stats, b.view(b.upstream, r, 1),
                            troll::make_batch(one_grad.data(), 1, vocab));
    troll::project_backward(troll::cpu.with_threads(1), b.view(b.fresh, r, 1), b.view(b.old, r, 1),
                            troll::make_batch<const T>(one_out.data(), 1, vocab), &one_stats, b.view(b.upstream, r, 1),
                            troll::make_batch(one_grad2.data(), 1, vocab), troll::make_batch(one_old.data(), 1, vocab),
                            &one_eps);
    CHECK(same_solution(stats[r], one_stats));
    CHECK(same_bits(out.data() + r * vocab, one_out.data(), vocab));
    CHECK(same_bits(grad_new.data() + r * vocab, one_grad.data(), vocab));
    CHECK(same_bits(grad_new2.data() + r * vocab, one_grad2.data(), vocab));
    CHECK(same_bits(grad_old.data() + r * vocab, one_old.data(), vocab));
    CHECK(same_bits(&grad_eps[r], &one_eps, 1));
  }
}

/// Runs `call` and returns the row its troll exception names (npos when it throws none).
template <class Call>
std::size_t thrown_row(Call&& call) {
  try {
    call();
  } catch (const troll::invalid_input& e) {
    return e.row();
  }
  return troll::invalid_input::npos;
}

template <class T>
void check_lowest_bad_row(std::size_t rows, std::vector<std::size_t> bad, bool in_upstream) {
  CAPTURE(rows);
  CAPTURE(in_upstream);
  const double eps = 0.05;
  batch<T> b(rows, 5u);
  std::vector<T> out(rows * vocab), grad(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(troll::cpu, b.view(b.fresh, 0, rows), b.view(b.old, 0, rows), eps, troll::make_batch(out.data(), rows, vocab),
                 stats.data());
  std::vector<T>& target = in_upstream ? b.upstream : b.fresh;
  std::size_t lowest = rows;
  for (std::size_t r : bad) {
    target[r * vocab + 4] = std::numeric_limits<T>::quiet_NaN();
    lowest = std::min(lowest, r);
  }
  const T sentinel = T(1234.5);
  std::vector<T> out2(rows * vocab, sentinel), grad2(rows * vocab, sentinel);
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    if (!in_upstream) {
      CHECK(thrown_row([&] {
              troll::project(troll::cpu.with_threads(threads), b.view(b.fresh, 0, rows), b.view(b.old, 0, rows), eps,
                             troll::make_batch(out2.data(), rows, vocab), stats.data());
            }) == lowest);
      CHECK(std::all_of(out2.begin(), out2.end(), [&](T v) { return v == sentinel; }));
    }
    CHECK(thrown_row([&] {
            troll::project_backward(troll::cpu.with_threads(threads), b.view(b.fresh, 0, rows), b.view(b.old, 0, rows),
                                    troll::make_batch<const T>(out.data(), rows, vocab), stats.data(),
                                    b.view(b.upstream, 0, rows), troll::make_batch(grad2.data(), rows, vocab));
          }) == lowest);
    CHECK(std::all_of(grad2.begin(), grad2.end(), [&](T v) { return v == sentinel; }));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("batches across the 64 kept rows equal one-row calls bit for bit", T, float, double) {
  for (std::size_t rows : {63u, 64u, 65u, 130u})
    for (int threads : {1, 2}) check_batch_equals_rows<T>(rows, threads);
}

TEST_CASE_TEMPLATE("the lowest bad row is reported on either side of the kept rows", T, float, double) {
  for (bool in_upstream : {false, true}) {
    check_lowest_bad_row<T>(130, {100}, in_upstream);
    check_lowest_bad_row<T>(130, {100, 10}, in_upstream);
    check_lowest_bad_row<T>(130, {64}, in_upstream);
    check_lowest_bad_row<T>(130, {63, 64}, in_upstream);
    check_lowest_bad_row<T>(130, {129, 70}, in_upstream);
  }
}
