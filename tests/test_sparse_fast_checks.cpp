// tests/test_sparse_fast_checks.cpp — the CPU's one-pass yes/no value check of a sparse row
// (detail/cpu/sparse_fast_checks.hpp: sparse_values_fine) against the full check it stands in
// for (check_sparse_row), which decides with a scalar double sum. Rows of every count from 0 to
// 49 (partial last packets, whole packets with the remainder in a packet of its own), masses
// swept across both edges of the tolerance, masked entries, NaN / +inf / positive values at
// every position of a packet, and the remainder masked or not. And the distinct-id check through
// a scratch shared by a run of rows (sparse_indices_fine with distinct_ids_scratch, whose table
// is emptied by a new stamp per row, not cleared) against sorting; with AVX-512, supports of up
// to 128 ids take the packet compares of distinct_ids_lanes instead, tested against sorting with
// a repeat at every pair of positions, and ids just outside [0, V). The value check of both sides
// of an aligned row in one pass (aligned_values_fine) gives the verdicts of two single checks;
// its float exponential (exp_eigen_bounded) gives Eigen's bits on [−87, 0].
#include <doctest/doctest.h>

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

namespace {

using troll::sparse_index;

/// Whether check_sparse_row accepts the row (its indices 0..n−1 are distinct and in range).
template <class T>
bool full_check_accepts(const std::vector<T>& lp, T log_remainder, std::size_t vocab) {
  std::vector<sparse_index> ids(lp.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = sparse_index(i);
  std::vector<troll::detail::index_slot> scratch(troll::sparse_max_entries);
  const auto p = troll::detail::cpu::check_sparse_row(ids.data(), lp.data(), (long long)lp.size(), log_remainder,
                                                      lp.size(), vocab, "x", scratch.data());
  return !p;
}

template <class T>
void agree(const std::vector<T>& lp, T log_remainder, std::size_t vocab) {
  bool finite = true;
  const bool fast = troll::detail::cpu::sparse_values_fine(lp.data(), (long long)lp.size(), log_remainder, vocab, &finite);
  const bool full = full_check_accepts(lp, log_remainder, vocab);
  CHECK(fast == full);
  // "above −inf": the remainder compared, the log-probs not −inf (a NaN is refused anyway)
  bool every_finite = log_remainder > -std::numeric_limits<T>::infinity();
  for (const T l : lp) every_finite = every_finite && l != -std::numeric_limits<T>::infinity();
  CHECK(finite == every_finite);
  // Both sides in one pass (aligned_values_fine, fast_values_pair) beside a good row of the same
  // length, in either order: the verdicts of two sparse_values_fine calls, the same sums and flags.
  namespace cpu = troll::detail::cpu;
  const int n = int(lp.size());
  const std::vector<T> other(lp.size(), T(std::log(1.0 / (n + 1))));
  const T other_r = T(std::log(1.0 / (n + 1)));
  bool other_finite = false;
  const bool other_fine = cpu::sparse_values_fine(other.data(), n, other_r, vocab, &other_finite);
  bool f1 = false, f2 = false;
  CHECK(cpu::aligned_values_fine(lp.data(), log_remainder, other.data(), other_r, n, vocab, &f1, &f2) ==
        (fast && other_fine));
  CHECK(f1 == finite);
  CHECK(f2 == other_finite);
  CHECK(cpu::aligned_values_fine(other.data(), other_r, lp.data(), log_remainder, n, vocab, &f1, &f2) ==
        (fast && other_fine));
  CHECK(f1 == other_finite);
  CHECK(f2 == finite);
  cpu::fast_row_values pa, pb;
  cpu::fast_values_pair(lp.data(), log_remainder, other.data(), other_r, n, pa, pb);
  const cpu::fast_row_values sa = cpu::fast_values(lp.data(), n, log_remainder);
  const cpu::fast_row_values sb = cpu::fast_values(other.data(), n, other_r);
  auto same = [](double x, double y) { return x == y || (x != x && y != y); };  // bit for bit, or both NaN
  CHECK(same(pa.mass, sa.mass));
  CHECK(same(pb.mass, sb.mass));
  CHECK(pa.bad == sa.bad);
  CHECK(pa.masked == sa.masked);
  CHECK(pa.some == sa.some);
}

/// A row of n entries plus remainder whose probabilities sum to `mass` (remainder share 1/8, or
/// none when masked), with the entries at `masked` set to −inf (their share moved elsewhere).
template <class T>
void sweep(std::mt19937_64& rng) {
  const double tol = troll::sparse_mass_tolerance<T>();
  std::uniform_real_distribution<double> u(0.05, 1.0);
  for (int n = 0; n < 50; ++n) {
    CAPTURE(n);
    for (int with_remainder = 0; with_remainder < 2; ++with_remainder) {
      if (n == 0 && !with_remainder) continue;
      std::vector<double> w(std::size_t(n) + 1);
      for (double& x : w) x = u(rng);
      if (!with_remainder) w[std::size_t(n)] = 0.0;
      double total = 0.0;
      for (const double x : w) total += x;
      // Masses at and around both edges, in steps of a tenth of the tolerance, and far off.
      for (const double k : {-30.0, -10.5, -10.1, -10.0, -9.9, -9.5, -5.0, 0.0, 5.0, 9.5, 9.9, 10.0, 10.1, 10.5, 30.0}) {
        const double mass = 1.0 + k * tol / 10.0;
        CAPTURE(mass);
        std::vector<T> lp(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) lp[std::size_t(i)] = T(std::log(w[std::size_t(i)] / total * mass));
        const T r = with_remainder ? T(std::log(w[std::size_t(n)] / total * mass)) : -std::numeric_limits<T>::infinity();
        agree(lp, r, std::size_t(n) + 10);
        agree(lp, r, std::size_t(n));  // count = V: remainder mass is refused
        if (n > 1) {  // one entry masked, its mass in the first entry (the partial packet included)
          std::vector<T> masked = lp;
          const std::size_t at = std::size_t(n - 1 - (n - 1) % 3);
          if (at != 0) {
            masked[0] = T(std::log(std::exp(double(masked[0])) + std::exp(double(masked[at]))));
            masked[at] = -std::numeric_limits<T>::infinity();
            agree(masked, r, std::size_t(n) + 10);
          }
        }
      }
    }
    // Bad values at every position: NaN, +inf, a positive log-prob; and an all-masked row.
    for (int at = 0; at < n; ++at) {
      for (const T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(), T(0.25)}) {
        std::vector<T> lp(std::size_t(n), T(std::log(1.0 / (n + 1))));
        lp[std::size_t(at)] = bad;
        agree(lp, T(std::log(1.0 / (n + 1))), std::size_t(n) + 10);
      }
    }
    std::vector<T> none(std::size_t(n), -std::numeric_limits<T>::infinity());
    agree(none, -std::numeric_limits<T>::infinity(), std::size_t(n) + 10);
    agree(none, T(0), std::size_t(n) + 10);
    agree(none, std::numeric_limits<T>::quiet_NaN(), std::size_t(n) + 10);
  }
}

}  // namespace

TEST_CASE("sparse_values_fine accepts exactly the rows check_sparse_row accepts: float") {
  std::mt19937_64 rng(11);
  sweep<float>(rng);
}

TEST_CASE("sparse_values_fine accepts exactly the rows check_sparse_row accepts: double") {
  std::mt19937_64 rng(12);
  sweep<double>(rng);
}

TEST_CASE("sparse_indices_fine over a run of rows sharing one scratch agrees with sorting") {
  std::mt19937_64 rng(13);
  const std::size_t vocab = 151936;
  troll::detail::cpu::distinct_ids_scratch scratch;
  std::vector<sparse_index> table(troll::detail::cpu::distinct_table_slots);
  for (int row = 0; row < 3000; ++row) {
    CAPTURE(row);
    const int n = row % 7 == 0 ? int(rng() % 3) : int(rng() % 300);
    std::vector<sparse_index> ids(static_cast<std::size_t>(n));
    // Rows drawn from a small range repeat ids often; from the whole vocabulary, rarely.
    const std::uint64_t range = row % 3 == 0 ? 400 : vocab;
    for (sparse_index& v : ids) v = sparse_index(rng() % range);
    if (n > 1 && row % 5 == 0) ids[std::size_t(rng() % std::uint64_t(n))] = ids[0];  // a repeat
    if (n > 0 && row % 11 == 0) ids[std::size_t(rng() % std::uint64_t(n))] = row % 2 ? -1 : sparse_index(vocab);
    std::vector<sparse_index> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    const bool in_range = sorted.empty() || (sorted.front() >= 0 && std::size_t(sorted.back()) < vocab);
    const bool expected = in_range && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    CHECK(troll::detail::cpu::sparse_indices_fine(ids.data(), n, 300, vocab, scratch) == expected);
    CHECK(troll::detail::cpu::sparse_indices_fine(ids.data(), n, 300, vocab, table.data()) == expected);
  }
  // Counts outside [0, min(capacity, V, sparse_max_entries)] are refused.
  std::vector<sparse_index> ids{1, 2, 3};
  CHECK(!troll::detail::cpu::sparse_indices_fine(ids.data(), -1, 300, vocab, scratch));
  CHECK(!troll::detail::cpu::sparse_indices_fine(ids.data(), 3, 2, vocab, scratch));
  CHECK(!troll::detail::cpu::sparse_indices_fine(ids.data(), 3, 300, 2, scratch));
}

namespace {

/// Whether ids are distinct and in [0, vocab), by sorting (the oracle).
bool distinct_in_range(std::vector<sparse_index> ids, std::size_t vocab) {
  std::sort(ids.begin(), ids.end());
  const bool in_range = ids.empty() || (ids.front() >= 0 && std::size_t(ids.back()) < vocab);
  return in_range && std::adjacent_find(ids.begin(), ids.end()) == ids.end();
}

}  // namespace

TEST_CASE("sparse_indices_fine: a repeat at every pair of positions, counts 0 to 130") {
  std::mt19937_64 rng(14);
  const std::size_t vocab = 151936;
  troll::detail::cpu::distinct_ids_scratch scratch;
  for (int n = 0; n <= 130; ++n) {
    CAPTURE(n);
    // Distinct ids (a random sample of the vocabulary), some next to each other.
    std::vector<sparse_index> ids;
    while (int(ids.size()) < n) {
      const sparse_index v = sparse_index(rng() % vocab);
      if (std::find(ids.begin(), ids.end(), v) == ids.end()) ids.push_back(v);
    }
    CHECK(troll::detail::cpu::sparse_indices_fine(ids.data(), n, 200, vocab, scratch));
    // Every pair (i, j), i < j, for the short rows; a spread of pairs for the long ones.
    const int step = n <= 40 ? 1 : 7;
    for (int i = 0; i < n; i += (i % step == 0 ? 1 : step)) {
      for (int j = i + 1; j < n; ++j) {
        std::vector<sparse_index> twice = ids;
        twice[std::size_t(j)] = twice[std::size_t(i)];
        CAPTURE(i);
        CAPTURE(j);
        REQUIRE(!troll::detail::cpu::sparse_indices_fine(twice.data(), n, 200, vocab, scratch));
      }
    }
    // An id just outside [0, V), or −1 (the padding value of the packet compares), at each
    // position; ids 0 and V − 1 are fine.
    for (int i = 0; i < n; ++i) {
      std::vector<sparse_index> bad = ids;
      for (const sparse_index v : {sparse_index(-1), sparse_index(vocab),
                                   std::numeric_limits<sparse_index>::min(),
                                   std::numeric_limits<sparse_index>::max()}) {
        bad[std::size_t(i)] = v;
        CHECK(!troll::detail::cpu::sparse_indices_fine(bad.data(), n, 200, vocab, scratch));
      }
      for (const sparse_index v : {sparse_index(0), sparse_index(vocab - 1)}) {
        bad[std::size_t(i)] = v;
        CHECK(troll::detail::cpu::sparse_indices_fine(bad.data(), n, 200, vocab, scratch) ==
              distinct_in_range(bad, vocab));
      }
    }
  }
}

TEST_CASE("sparse_indices_fine: small and huge vocabularies, rows of 0 to 130 ids, against sorting") {
  std::mt19937_64 rng(15);
  troll::detail::cpu::distinct_ids_scratch scratch;
  // V = 2^31 − 1 (every non-negative int32 but the largest), V above 2^31 (every non-negative id).
  for (const std::size_t vocab : {std::size_t(130), std::size_t(200), std::size_t(2147483647),
                                  std::size_t(1) << 33}) {
    for (int row = 0; row < 2000; ++row) {
      const int n = int(rng() % 131);
      if (std::size_t(n) > vocab) continue;
      CAPTURE(vocab);
      CAPTURE(row);
      std::vector<sparse_index> ids(static_cast<std::size_t>(n));
      const std::uint64_t wide = std::uint64_t(1) << 31, narrow = 2 * std::uint64_t(n) + 1;
      const std::uint64_t range = std::min<std::uint64_t>(vocab, row % 2 ? narrow : wide);
      for (sparse_index& v : ids) v = sparse_index(rng() % range);
      if (row % 5 == 0) std::sort(ids.begin(), ids.end());
      if (row % 13 == 0 && n > 0)
        ids[std::size_t(rng() % std::uint64_t(n))] = std::numeric_limits<sparse_index>::max();
      CHECK(troll::detail::cpu::sparse_indices_fine(ids.data(), n, 200, vocab, scratch) ==
            distinct_in_range(ids, vocab));
    }
  }
}

#if defined(__FMA__) && (defined(__AVX512F__) || defined(__AVX2__))
namespace {

/// Arguments of Eigen's float exponential on [−87, 0]: random points, then the ends, the points
/// where its m changes (x·log2 e + 1/2 crossing an integer) and their neighbours, tiny arguments
/// and signed zeros.
std::vector<float> eigen_exp_points(std::size_t count) {
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<float> u(-87.0f, 0.0f);
  std::vector<float> x(count);
  for (float& v : x) v = u(rng);
  std::vector<float> edges{-87.0f, -86.99999f, -64.0f, -1.0f, -0.5f, -1e-30f, -0.0f, 0.0f};
  for (int m = -125; m <= 0; ++m) {
    const float at = static_cast<float>((m - 0.5) / 1.4426950408889634);
    edges.insert(edges.end(), {at, std::nextafter(at, 0.0f), std::nextafter(at, -100.0f)});
  }
  std::copy(edges.begin(), edges.end(), x.begin());
  return x;
}

}  // namespace

TEST_CASE("exp_eigen_bounded: Eigen's float exp bit for bit on [-87, 0]") {
  using packet = Eigen::internal::packet_traits<float>::type;  // the packet exp_eigen_bounded takes
  constexpr std::size_t lanes = sizeof(packet) / sizeof(float);
  const std::vector<float> x = eigen_exp_points(std::size_t(1) << 18);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < x.size(); i += lanes) {
    const packet p = Eigen::internal::ploadu<packet>(x.data() + i);
    float ours[lanes], eigen[lanes];
    Eigen::internal::pstoreu(ours, packet(troll::detail::cpu::exp_eigen_bounded(p)));
    Eigen::internal::pstoreu(eigen, Eigen::internal::pexp(p));
    for (std::size_t j = 0; j < lanes; ++j) differ += std::memcmp(&ours[j], &eigen[j], sizeof(float)) != 0;
  }
  CHECK(differ == 0);
}
#endif
