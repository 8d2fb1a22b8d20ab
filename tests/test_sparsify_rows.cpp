#include <doctest/doctest.h>

// sparsify's row kernel (detail::cpu::sparsify_row): the one-read scan without exponentials
// (sparsify_scan_topk), the δ rule decided on the exact tail sum (keep_with_margin), against
//  * the path of block sums in the scan and finalize's own δ rule (fast = false), bit for bit;
//  * a straightforward reference: every token sorted by (logit desc, index asc), the top K, the
//    δ rule in long double, the tail's sum as its canonical terms (double rows: packet_exp; float
//    rows: tail_term_fixed) added one by one in token order,
//    exact_log_sums — bit for bit where the δ rule is not within 1e-2 of log δ in long double.
// Rows: random, Zipf-like, heavy ties at the K-th value (ties go to the lower index), −inf
// masks (runs, nearly all masked), sampled token inside / outside the top K and masked, K ≥ V,
// V not a multiple of the packet or group width; δ = 0, 1e-5, 0.1, 0.5; float and double.

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "bits.hpp"

namespace {

using troll_test::same_bits;

using namespace troll::detail;

template <class T>
struct row_out {
  std::vector<troll::sparse_index> indices = std::vector<troll::sparse_index>(troll::sparsify_max_k + 1, -7);
  std::vector<T> log_probs = std::vector<T>(troll::sparsify_max_k + 1, T(7));
  int count = -1;
  T remainder = T(7);
  bool ok = false;
};

template <class T>
row_out<T> run_row(const std::vector<T>& z, int k, troll::sparse_index sampled, double log_delta, bool fast) {
  row_out<T> o;
  o.ok = cpu::sparsify_row(z.data(), z.size(), k, sampled, log_delta, o.indices.data(), o.log_probs.data(), o.count,
                           o.remainder, fast);
  return o;
}

template <class T>
void check_same(const row_out<T>& a, const row_out<T>& b) {
  REQUIRE(a.ok == b.ok);
  if (!a.ok) return;
  REQUIRE(a.count == b.count);
  for (int i = 0; i < a.count; ++i) {
    CHECK(a.indices[std::size_t(i)] == b.indices[std::size_t(i)]);
    CHECK(same_bits(a.log_probs[std::size_t(i)], b.log_probs[std::size_t(i)]));
  }
  CHECK(same_bits(a.remainder, b.remainder));
}

/// The reference: returns false (no verdict) where the δ rule is too close to call.
template <class T>
bool reference_row(const std::vector<T>& z, int k, long sampled, double log_delta, row_out<T>& o) {
  const long V = long(z.size());
  std::vector<long> order;
  for (long i = 0; i < V; ++i)
    if (i != sampled) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](long a, long b) { return z[std::size_t(a)] > z[std::size_t(b)] || (z[std::size_t(a)] == z[std::size_t(b)] && a < b); });
  // the heap: the K best finite tokens; then the sampled token inserted in rank order
  std::vector<long> list;
  for (long i : order)
    if (int(list.size()) < k && z[std::size_t(i)] > -std::numeric_limits<T>::infinity()) list.push_back(i);
  int sampled_pos = -1;
  if (sampled >= 0) {
    std::size_t at = 0;
    while (at < list.size() && (z[std::size_t(list[at])] > z[std::size_t(sampled)] ||
                                (z[std::size_t(list[at])] == z[std::size_t(sampled)] && list[at] < sampled)))
      ++at;
    list.insert(list.begin() + long(at), sampled);
    sampled_pos = int(at);
  }
  const int n = int(list.size());
  std::vector<bool> in_list(std::size_t(V), false);
  for (long i : list) in_list[std::size_t(i)] = true;
  long double total = 0.0L, outside = 0.0L;
  for (long i = 0; i < V; ++i) {
    const long double e = std::exp(static_cast<long double>(z[std::size_t(i)]));
    total += e;
    if (!in_list[std::size_t(i)]) outside += e;
  }
  if (!(total > 0.0L)) return false;
  const int limit = std::min(n, k);
  int keep = limit;
  long double rest = outside;
  for (int i = n - 1; i >= limit; --i) rest += std::exp(static_cast<long double>(z[std::size_t(list[std::size_t(i)])]));
  for (int j = limit - 1; j >= 1; --j) {
    rest += std::exp(static_cast<long double>(z[std::size_t(list[std::size_t(j)])]));
    if (rest == 0.0L) {
      keep = j;
      continue;
    }
    const long double d = std::log(rest) - std::log(total);
    if (log_delta == -std::numeric_limits<double>::infinity()) break;
    if (std::fabs(double(d) - log_delta) <= 1e-2) return false;
    if (double(d) > log_delta) break;
    keep = j;
  }
  // the support (kept prefix, then the sampled token when beyond it) and the tail
  std::vector<long> support(list.begin(), list.begin() + keep);
  if (sampled_pos >= keep) support.push_back(sampled);
  std::vector<bool> in_support(std::size_t(V), false);
  for (long i : support) in_support[std::size_t(i)] = true;
  double m_tail = -std::numeric_limits<double>::infinity();
  for (long i = 0; i < V; ++i)
    if (!in_support[std::size_t(i)]) m_tail = std::max(m_tail, double(z[std::size_t(i)]));
  exact_sum tail;
  if (m_tail > -std::numeric_limits<double>::infinity() && sizeof(T) == sizeof(float)) {
    // float rows: the canonical terms tail_term_fixed (integers of 2^−50), one by one
    for (long i = 0; i < V; ++i)
      if (!in_support[std::size_t(i)])
        cpu::add_fixed(tail, std::uint64_t(cpu::tail_term_fixed(float(z[std::size_t(i)]), float(m_tail))));
  } else if (m_tail > -std::numeric_limits<double>::infinity()) {
    std::vector<T> e(static_cast<std::size_t>(V));
    cpu::packet_exp(z.data(), Eigen::Index(V), static_cast<T>(m_tail), e.data());
    for (long i = 0; i < V; ++i)
      if (!in_support[std::size_t(i)]) exact_add(tail, double(e[std::size_t(i)]));
  }
  struct logits_of {
    const std::vector<T>* z;
    const std::vector<long>* s;
    double operator[](int i) const { return double((*z)[std::size_t((*s)[std::size_t(i)])]); }
  };
  const row_log_sums sums = exact_log_sums(logits_of{&z, &support}, int(support.size()), m_tail, tail);
  o.ok = true;
  o.count = int(support.size());
  for (std::size_t i = 0; i < support.size(); ++i) {
    o.indices[i] = troll::sparse_index(support[i]);
    o.log_probs[i] = T(sums.log_prob(double(z[std::size_t(support[i])])));
  }
  o.remainder = T(sums.stored_log_remainder());
  return true;
}

enum class shape { normal, zipf, ties, masked_runs, mostly_masked, peaked };

template <class T>
std::vector<T> make_row(shape s, std::size_t V, std::mt19937_64& gen) {
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<T> z(V);
  const T masked = -std::numeric_limits<T>::infinity();
  for (std::size_t i = 0; i < V; ++i) {
    switch (s) {
      case shape::normal: z[i] = T(3.0 * n01(gen)); break;
      case shape::zipf: z[i] = T(-1.1 * std::log(double(1 + std::uniform_int_distribution<std::size_t>(0, V)(gen))) + 0.3 * n01(gen)); break;
      case shape::ties: z[i] = T(double(pick(gen) % 5) - 2.0); break;  // five values: the K-th ties
      case shape::masked_runs: z[i] = (i / 37) % 3 == 1 ? masked : T(2.0 * n01(gen)); break;
      case shape::mostly_masked: z[i] = pick(gen) < 97 ? masked : T(n01(gen)); break;
      case shape::peaked: z[i] = T(i % 997 == 3 ? 12.0 + n01(gen) : -4.0 + n01(gen)); break;
    }
  }
  return z;
}

template <class T>
void compare_all() {
  std::mt19937_64 gen(20261124);
  const std::size_t sizes[] = {1, 15, 17, 63, 64, 65, 200, 1031, 4099, 20000};
  const int ks[] = {1, 3, 64, 256};
  const double deltas[] = {0.0, 1e-5, 0.1, 0.5};
  const shape shapes[] = {shape::normal, shape::zipf, shape::ties, shape::masked_runs, shape::mostly_masked, shape::peaked};
  int verdicts = 0, rows = 0;
  for (std::size_t V : sizes)
    for (shape s : shapes) {
      const std::vector<T> z = make_row<T>(s, V, gen);
      // sampled: none, the best token, a random token, a masked token where there is one
      std::vector<long> samples = {-1, long(std::max_element(z.begin(), z.end()) - z.begin()),
                                   long(std::uniform_int_distribution<std::size_t>(0, V - 1)(gen))};
      const auto masked = std::find(z.begin(), z.end(), -std::numeric_limits<T>::infinity());
      if (masked != z.end()) samples.push_back(long(masked - z.begin()));
      for (int k : ks)
        for (double delta : deltas)
          for (long sampled : samples) {
            const double log_delta = delta > 0.0 ? std::log(delta) : -std::numeric_limits<double>::infinity();
            INFO("V ", V, " shape ", int(s), " k ", k, " delta ", delta, " sampled ", sampled);
            const row_out<T> fast = run_row(z, k, troll::sparse_index(sampled), log_delta, true);
            const row_out<T> blocks = run_row(z, k, troll::sparse_index(sampled), log_delta, false);
            check_same(fast, blocks);
            row_out<T> ref;
            if (fast.ok && reference_row(z, k, sampled, log_delta, ref)) {
              check_same(fast, ref);
              ++verdicts;
            }
            ++rows;
          }
    }
  CHECK(verdicts > rows / 2);  // the reference decides most rows
}

}  // namespace

TEST_CASE("sparsify_row: the one-read scan gives the block-sum path's bits and the sorted reference's, float") {
  compare_all<float>();
}

TEST_CASE("sparsify_row: the one-read scan gives the block-sum path's bits and the sorted reference's, double") {
  compare_all<double>();
}

TEST_CASE("sparsify_row: bad rows are reported by both paths") {
  for (bool fast : {true, false}) {
    std::vector<float> z(1000, 0.5f);
    z[999] = std::numeric_limits<float>::quiet_NaN();
    CHECK_FALSE(run_row(z, 8, -1, -1.0, fast).ok);
    z[999] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(run_row(z, 8, 3, -1.0, fast).ok);
    z[3] = std::numeric_limits<float>::quiet_NaN();  // the sampled token's own logit
    z[999] = 0.5f;
    CHECK_FALSE(run_row(z, 8, 3, -1.0, fast).ok);
    std::vector<float> masked(77, -std::numeric_limits<float>::infinity());
    CHECK_FALSE(run_row(masked, 8, 5, -1.0, fast).ok);
    CHECK_FALSE(run_row(masked, 8, -1, -1.0, fast).ok);
  }
}

namespace {

/// A NaN, −NaN or +inf at every position of the first groups of a flat row (the threshold stays
/// low) and of a random one (it rises), and a +inf next to a −inf: the row is bad.
template <class T>
void bad_at_every_position() {
  std::mt19937_64 gen(20261125);
  std::normal_distribution<double> n01(0.0, 1.0);
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  for (bool flat : {true, false}) {
    std::vector<T> base(300);
    for (T& v : base) v = flat ? T(0.5) : T(n01(gen));
    for (std::size_t p = 0; p < base.size(); ++p) {
      for (T bad : {nan, -nan, inf}) {
        std::vector<T> z = base;
        z[p] = bad;
        if (bad == inf) z[(p + 5) % z.size()] = -inf;  // the group's sum is NaN, its max +inf
        INFO("flat ", flat, " position ", p, " value ", double(bad));
        CHECK_FALSE(run_row(z, 8, -1, -1.0, true).ok);
        CHECK_FALSE(run_row(z, 8, troll::sparse_index((p + 150) % z.size()), -1.0, true).ok);
      }
    }
  }
}

}  // namespace

TEST_CASE("sparsify_row: a NaN or +inf at any position of the packet groups makes the row bad") {
  // The one-read scan tests groups of four packets at once: float rows with AVX-512 through the
  // group's max against the threshold (+inf beats any) and unordered compares of packet pairs
  // for NaN; other rows with a compare of every packet. Float and double rows.
  bad_at_every_position<float>();
  bad_at_every_position<double>();
}

TEST_CASE("topk_buffer::select keeps the K best in token order, ties to the lower index") {
  // Against a stable sort by value: random buffers of K + 1 … capacity candidates, with normal
  // values, heavy ties, ±0, −inf and magnitudes over 60 binades (the float select of AVX-512
  // builds, and the scalar one it falls back to on ties at the K-th value).
  std::mt19937_64 gen(7);
  using buffer = cpu::topk_buffer<float>;
  constexpr int capacity = troll::sparsify_max_k + buffer::extra + buffer::slack;
  for (int it = 0; it < 4000; ++it) {
    buffer b;
    b.k = 1 + int(gen() % troll::sparsify_max_k);
    b.count = std::min(capacity, b.k + 1 + int(gen() % (buffer::extra + buffer::slack)));
    b.out_max = it % 3 == 0 ? -1.0 : -std::numeric_limits<double>::infinity();
    const int mode = it % 4;
    for (int i = 0; i < b.count; ++i) {
      float v = 0.0f;
      if (mode == 0) v = std::normal_distribution<float>(0.0f, 1.0f)(gen);
      if (mode == 1) v = float(int(gen() % 8)) - 4.0f;
      if (mode == 2) v = (gen() % 2 ? -0.0f : 0.0f) + (gen() % 3 == 0 ? -1e30f : 0.0f);
      if (mode == 3) v = std::ldexp(float(gen() % 1000), int(gen() % 60) - 30) * (gen() % 2 ? 1.0f : -1.0f);
      if (gen() % 50 == 0) v = -std::numeric_limits<float>::infinity();
      b.values[i] = v;
      b.indices[i] = troll::sparse_index(3 * i + 1);
    }
    const buffer before = b;
    b.select();
    std::vector<int> order(std::size_t(before.count));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int x, int y) { return before.values[x] + 0.0f > before.values[y] + 0.0f; });
    std::vector<int> kept(order.begin(), order.begin() + before.k);
    std::sort(kept.begin(), kept.end());
    double out_max = before.out_max;
    for (std::size_t i = std::size_t(before.k); i < order.size(); ++i)
      out_max = std::max(out_max, double(before.values[order[i]]));
    float worst = std::numeric_limits<float>::infinity();
    for (int x : kept) worst = std::min(worst, before.values[x]);
    INFO("iteration ", it, " k ", before.k, " count ", before.count, " mode ", mode);
    REQUIRE(b.count == before.k);
    CHECK(b.out_max == out_max);
    CHECK(b.threshold == worst);
    for (int i = 0; i < before.k; ++i) {
      CHECK(b.indices[i] == before.indices[kept[std::size_t(i)]]);
      CHECK(same_bits(b.values[i], before.values[kept[std::size_t(i)]]));
    }
  }
}

TEST_CASE("keep_with_margin declines a δ decision within the margin") {
  // two tokens of logit 0 and an outside of one token at log δ-ish: rest(1) − log_total ≈ log δ
  sparse_candidate list[2] = {{0.0, 0}, {0.0, 1}};
  exact_sum tail;
  exact_add(tail, 1.0);  // one outside token at m_tail = 0
  const double d = std::log(2.0 / 3.0);  // rest(1) = {list[1], outside} = 2 of a total of 3
  CHECK(cpu::keep_with_margin(list, 2, -1, 2, 0.0, tail, d) == -1);
  CHECK(cpu::keep_with_margin(list, 2, -1, 2, 0.0, tail, d + 0.01) == 1);
  CHECK(cpu::keep_with_margin(list, 2, -1, 2, 0.0, tail, d - 0.01) == 2);
}
