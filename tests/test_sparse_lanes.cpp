// tests/test_sparse_lanes.cpp — the rows-in-lanes driver (detail/cpu/lane_solver.hpp) against the
// one-row path (lumped_pair, scan_pair, project_row) on random and adversarial batches of lumped
// sparse rows: the same bits in every output and statistic, for any batch size.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <troll/detail/cpu/lane_solver.hpp>
#include <troll/sparse.hpp>

#include <cmath>
#include <cstddef>
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "sparse_oracle.hpp"

namespace {

using sparse_test::aligned_rows;
using sparse_test::sparse_rows;
using ld = long double;
const ld minus_inf = -std::numeric_limits<ld>::infinity();

/// log-softmax over the support logits and one tail logit (the bucket's log-mass).
std::vector<ld> normalised(const std::vector<ld>& z) {
  ld m = minus_inf;
  for (ld v : z) m = v > m ? v : m;
  ld s = 0;
  for (ld v : z) s += v == minus_inf ? 0 : std::exp(v - m);
  std::vector<ld> out(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) out[i] = z[i] - m - std::log(s);
  return out;
}

/// A batch of aligned rows of every kind the lanes meet: |U| from 1 to 130, smooth and peaked
/// rows, inactive rows (old = new), rows far from the bound, tokens masked on either side or on
/// both (those drop out of the lumped row), an empty new tail, and huge finite logits (a spread
/// beyond 700: the one-row path inside the driver).
template <class T>
aligned_rows<T> make_batch(std::size_t rows, std::size_t vocab, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  const std::size_t k_max = 140;
  aligned_rows<T> a(rows, k_max, vocab);
  std::vector<troll::sparse_index> ids(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    const int kind = int(rng() % 8);
    const int count = kind == 7 ? 1 + int(rng() % 4) : 1 + int(rng() % 130);
    std::iota(ids.begin(), ids.end(), 0);
    for (int i = 0; i < count; ++i) std::swap(ids[std::size_t(i)], ids[std::size_t(i) + rng() % (vocab - std::size_t(i))]);
    const double scale = kind == 4 ? 12.0 : 1.0 + 2.0 * u01(rng);
    const double noise = kind == 1 ? 0.0 : kind == 5 ? 3.0 : 0.05 + 0.8 * u01(rng);
    std::vector<ld> zn(std::size_t(count) + 1), zo(std::size_t(count) + 1);
    for (int i = 0; i <= count; ++i) {
      zn[std::size_t(i)] = scale * n01(rng) - (i == count ? 0.0 : 0.5 * i / double(count));
      zo[std::size_t(i)] = zn[std::size_t(i)] + noise * n01(rng);
    }
    if (kind == 2 && count > 2) {
      // new masks the old row's least likely support token (a small q(J) loss: feasible), old
      // masks another (mass of p̃ outside supp q), both mask a third
      int lowest = 0;
      for (int i = 0; i < count; ++i) lowest = zo[std::size_t(i)] < zo[std::size_t(lowest)] ? i : lowest;
      zo[std::size_t(lowest)] -= 12.0;
      zn[std::size_t(lowest)] = minus_inf;
      const int other = (lowest + 1) % count;
      zo[std::size_t(other)] = minus_inf;
      const int third = (lowest + 2) % count;
      if (rng() % 2) zo[std::size_t(third)] = zn[std::size_t(third)] = minus_inf;
    }
    if (kind == 3) zn[std::size_t(count)] = minus_inf;  // nothing of p̃ in the tail
    const std::vector<ld> ln = normalised(zn), lo = normalised(zo);
    for (int i = 0; i < count; ++i) {
      a.indices[r * k_max + std::size_t(i)] = ids[std::size_t(i)];
      a.new_log_probs[r * k_max + std::size_t(i)] = T(ln[std::size_t(i)]);
      a.old_log_probs[r * k_max + std::size_t(i)] = T(lo[std::size_t(i)]);
    }
    for (std::size_t i = std::size_t(count); i < k_max; ++i) {
      a.indices[r * k_max + i] = -1;
      a.new_log_probs[r * k_max + i] = a.old_log_probs[r * k_max + i] = T(minus_inf);
    }
    a.counts[r] = count;
    a.new_log_remainder[r] = T(ln[std::size_t(count)]);
    a.old_log_remainder[r] = T(lo[std::size_t(count)]);
    if (kind == 6 && count > 1) {  // a huge finite negative log-prob on one side: spread > 700
      T& v = (rng() % 2 ? a.new_log_probs : a.old_log_probs)[r * k_max + std::size_t(count - 1)];
      if (v > T(-20)) v = T(-20);  // keep the mass (this token's share below 2e-9)
      v = T(-1e30);
    }
  }
  return a;
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// project_rows_in_lanes against project_row, row by row, bit for bit.
template <class T>
void lanes_match_rows(std::size_t rows, double eps, unsigned seed, std::size_t chunk) {
  CAPTURE(rows);
  CAPTURE(eps);
  CAPTURE(seed);
  CAPTURE(chunk);
  const aligned_rows<T> a = make_batch<T>(rows, 5000, seed);
  aligned_rows<T> mutable_copy = a;
  const troll::aligned_batch_view<const T> in(mutable_copy.view());
  constexpr std::size_t width = troll::sparse_max_entries + 1;
  std::vector<double> lanes_lp(rows * width, -7.0);
  std::vector<int> lanes_n(rows, -1), emitted(rows, 0);
  std::vector<troll::projection_stats> lanes_stats(rows);
  auto load = [&](std::size_t r, double* zn, double* zo, int* slot) { return troll::detail::lumped_pair(in, r, zn, zo, slot); };
  auto emit = [&](std::size_t r, int n, const int*, const double* lp, const troll::projection_stats& s) {
    ++emitted[r];
    lanes_n[r] = n;
    lanes_stats[r] = s;
    std::copy(lp, lp + n, lanes_lp.begin() + std::ptrdiff_t(r * width));
  };
  troll::projection_options opt;
  for (std::size_t begin = 0; begin < rows; begin += chunk)
    troll::detail::cpu::project_rows_in_lanes(begin, std::min(rows, begin + chunk), eps, opt, load, emit);
  std::size_t solved = 0, wide = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    REQUIRE(emitted[r] == 1);
    double zn[width], zo[width], lp[width];
    int slot[width];
    const int n = troll::detail::lumped_pair(in, r, zn, zo, slot);
    troll::detail::row_setup setup;
    troll::detail::cpu::scan_pair(zn, zo, std::size_t(n), setup, "", "");
    wide += troll::detail::cpu::lane_eligible(setup, std::size_t(n)) ? 0 : 1;
    const troll::projection_stats s = troll::detail::cpu::project_row(zn, zo, std::size_t(n), setup, eps, opt, lp);
    const troll::projection_stats& got = lanes_stats[r];
    solved += s.iterations > 0 ? 1 : 0;
    CHECK(s.status == got.status);
    CHECK(s.iterations == got.iterations);
    CHECK(same_bits(s.t, got.t));
    CHECK(same_bits(s.eta, got.eta));
    CHECK(same_bits(s.kl_before, got.kl_before));
    CHECK(same_bits(s.kl_after, got.kl_after));
    CHECK(same_bits(s.mu, got.mu));
    CHECK(same_bits(s.sigma2, got.sigma2));
    REQUIRE(lanes_n[r] == n);
    int differ = 0;
    for (int j = 0; j < n; ++j) differ += same_bits(lp[j], lanes_lp[r * width + std::size_t(j)]) ? 0 : 1;
    CHECK(differ == 0);
  }
  // A large batch holds rows the lanes solve and rows they hand to the one-row path.
  if (rows >= 100) {
    CHECK(solved > rows / 8);
    CHECK(wide > 0);
  }
}

}  // namespace

TEST_CASE("rows in lanes give the one-row path's bits (float and double inputs)") {
  for (unsigned seed : {1u, 2u, 3u}) {
    for (double eps : {1e-7, 0.05, 0.5}) {
      lanes_match_rows<float>(203, eps, seed, 64);  // not a multiple of the lanes or of the chunks
      lanes_match_rows<double>(203, eps, seed + 10, 203);
    }
  }
  lanes_match_rows<float>(5, 0.05, 8, 64);  // fewer rows than lanes
  lanes_match_rows<double>(1, 0.05, 9, 1);
}
