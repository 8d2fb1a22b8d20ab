// tests/test_sparse_fast_paths.cpp — the sparse projection's fast paths against the paths they
// stand in for. (1) The VJP of a row read in place (detail/cpu/sparse_backward_rows.hpp)
// gives the bits of the lumped path (lumped_pair, vjp_row, the scatter), reproduced here, on rows
// of every count from 0 to 130, float and double, with masked entries on one side or both, empty
// tails and inactive rows (which take the lumped path or the fast one as they qualify).
// (2) backward_row_fine (packets; also told that the sides are finite) accepts exactly the rows
// backward_row_fine_scalar accepts, with a bad value or id at every position. (3) A bad row at each position of a batch throws the same
// typed error naming that row, and nothing is written. (4) The forward's lumped pair and setup of
// a finite row (lumped_pair_finite) equal lumped_pair + scan_pair bit for bit, and it refuses
// exactly the rows with a masked category or an empty tail.
#include <doctest/doctest.h>

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bits.hpp"
#include "sparse_oracle.hpp"

namespace {

using troll_test::same_bits;

using troll::sparse_index;
using namespace sparse_test;

/// A batch of aligned rows (counts from 0 to k_max, capped by V) with normalised sides: entries
/// masked on one side (`one_side`), on both (`both`), and rows whose support is the whole
/// vocabulary (bucket −inf).
template <class T>
aligned_rows<T> make_rows(std::size_t rows, std::size_t k_max, std::size_t vocab, std::mt19937_64& rng) {
  aligned_rows<T> a(rows, k_max, vocab);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<sparse_index> perm(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t count = std::min<std::size_t>(r % (k_max + 1), vocab);
    std::iota(perm.begin(), perm.end(), sparse_index(0));
    std::shuffle(perm.begin(), perm.end(), rng);
    const bool tail = count < vocab;
    const int kind = int(r % 5);  // 0–2 plain, 3 masked on one side, 4 masked on both
    for (int side = 0; side < 2; ++side) {
      std::vector<double> w(count + 1);
      for (std::size_t i = 0; i < count; ++i) w[i] = std::exp(4.0 * u(rng) - 2.0);
      w[count] = tail ? 0.2 + u(rng) : 0.0;
      if (count > 2 && kind == 3 && side == 1) w[(r / 5) % count] = 0.0;  // masked on the old side only
      if (count > 2 && kind == 4) w[(r / 5) % count] = 0.0;
      double total = 0.0;
      for (double x : w) total += x;
      if (total == 0.0) w[0] = total = 1.0;  // count 0 with no tail cannot happen (V ≥ 1)
      T* lp = (side == 0 ? a.new_log_probs : a.old_log_probs).data() + r * k_max;
      for (std::size_t i = 0; i < count; ++i) lp[i] = T(std::log(w[i] / total));
      (side == 0 ? a.new_log_remainder : a.old_log_remainder)[r] = T(tail ? std::log(w[count] / total) : -INFINITY);
    }
    for (std::size_t i = 0; i < count; ++i) a.indices[r * k_max + i] = perm[i];
    a.counts[r] = sparse_index(count);
  }
  return a;
}

/// The lumped path the fast VJP replaces (project_backward's general branch, without grad_old).
template <class T>
int lumped_vjp(const troll::aligned_batch_view<const T>& rows, const troll::sparse_batch_view<const T>& lp_out,
               const troll::projection_stats& s, const troll::sparse_grad_view<const T>& grad, std::size_t r,
               std::vector<T>& out, T& out_bucket, T& out_eps) {
  const int m = troll::sparse_max_entries + 1;
  std::vector<double> zn(m), zo(m), lp(m), g(m), gn(m);
  std::vector<int> slot(m);
  const int n = troll::detail::lumped_pair(rows, r, zn.data(), zo.data(), slot.data());
  const int count = int(rows.counts[r]);
  for (int j = 0; j < n; ++j) {
    const bool bucket = slot[j] == count;
    lp[j] = double(bucket ? lp_out.log_remainder[r] : lp_out.row_log_probs(r)[slot[j]]);
    g[j] = double(bucket ? grad.log_remainder[r] : grad.row(r)[slot[j]]);
  }
  double eps = 0.0;
  const bool fine = troll::detail::cpu::vjp_row(zn.data(), zo.data(), lp.data(), g.data(), std::size_t(n), s, gn.data(),
                                                static_cast<double*>(nullptr), &eps);
  out.assign(grad.k_max, T(0));
  out_bucket = T(0);
  for (int j = 0; j < n; ++j) (slot[j] == count ? out_bucket : out[std::size_t(slot[j])]) = T(gn[j]);
  out_eps = T(eps);
  return fine ? 1 : 0;
}

template <class T>
void vjp_agrees(std::size_t vocab, std::size_t k_max, double eps, unsigned seed) {
  std::mt19937_64 rng(seed);
  const std::size_t rows = 3 * (k_max + 1);
  const aligned_rows<T> a = make_rows<T>(rows, k_max, vocab, rng);
  const troll::aligned_batch_view<const T> view = a.const_view();
  sparse_rows<T> out(rows, k_max, vocab);
  std::vector<troll::projection_stats> st(rows);
  troll::project(troll::cpu, view, eps, out.view(), st.data());
  sparse_grads<T> g(rows, k_max), gn(rows, k_max);
  std::normal_distribution<double> n01(0.0, 1.0);
  for (T& x : g.log_probs) x = T(n01(rng));
  for (T& x : g.log_remainder) x = T(n01(rng));
  std::vector<T> grad_eps(rows);
  const troll::sparse_batch_view<const T> lp_out = out.view();
  const troll::sparse_grad_view<const T> gv{g.log_probs.data(), g.log_remainder.data(), rows, k_max};
  troll::project_backward(troll::cpu, view, lp_out, st.data(), gv, gn.view(), {}, grad_eps.data());
  std::size_t projected = 0;
  std::vector<T> ref;
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    CAPTURE(a.counts[r]);
    projected += st[r].status == troll::row_status::projected ? 1 : 0;
    T bucket = T(0), e = T(0);
    REQUIRE(lumped_vjp(view, lp_out, st[r], gv, r, ref, bucket, e) == 1);
    bool same = same_bits(bucket, gn.log_remainder[r]) && same_bits(e, grad_eps[r]);
    for (std::size_t i = 0; i < k_max; ++i) same = same && same_bits(ref[i], gn.log_probs[r * k_max + i]);
    CHECK(same);
  }
  if (eps < 0.3) CHECK(projected > rows / 2);
}

/// One entry of a backward row made bad in one of eight ways.
template <class T>
void spoil(int how, int at, int count, std::vector<sparse_index>& ids, std::vector<T>& lp, std::vector<T>& zn,
           std::vector<T>& zo, std::vector<T>& g) {
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  const std::size_t i = std::size_t(at);  // at = count: the bucket (index count of each vector)
  switch (how) {
    case 0: if (at < count) ids[i] += 1; break;
    case 1: lp[i] = nan; break;
    case 2: lp[i] = T(0.25); break;
    case 3: lp[i] = inf; break;
    case 4: zn[i] = -inf; break;
    case 5: zo[i] = -inf; break;
    case 6: g[i] = nan; break;
    case 7: g[i] = -inf; lp[i] = -inf; break;  // not live: fine
    default: break;
  }
}

template <class T>
void fine_agrees() {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-30.0, 0.0);
  for (int count = 0; count <= 40; ++count) {
    for (int at = 0; at <= count; ++at) {
      for (int how = 0; how < 8; ++how) {
        std::vector<sparse_index> ids(std::size_t(count) + 1), aligned(std::size_t(count) + 1);
        std::vector<T> lp(std::size_t(count) + 1), zn(lp.size()), zo(lp.size()), g(lp.size());
        for (std::size_t i = 0; i < lp.size(); ++i) {
          ids[i] = aligned[i] = sparse_index(3 * i + 1);
          lp[i] = T(u(rng)), zn[i] = T(u(rng)), zo[i] = T(u(rng)), g[i] = T(u(rng));
        }
        spoil(how, at, count, ids, lp, zn, zo, g);
        const std::size_t c = std::size_t(count);
        const bool fast = troll::detail::cpu::backward_row_fine(ids.data(), aligned.data(), lp.data(), zn.data(),
                                                                zo.data(), g.data(), count, lp[c], zn[c], zo[c], g[c]);
        const bool scalar = troll::detail::cpu::backward_row_fine_scalar(
            ids.data(), aligned.data(), lp.data(), zn.data(), zo.data(), g.data(), count, lp[c], zn[c], zo[c], g[c]);
        CAPTURE(count);
        CAPTURE(at);
        CAPTURE(how);
        CHECK(fast == scalar);
        CHECK(scalar == (how == 7 || (how == 0 && at == count)));
        // Told the sides hold no −inf entry (true unless an entry's side was masked above): the
        // sides are not read, and the verdict is the same.
        if (!((how == 4 || how == 5) && at < count)) {
          const bool told = troll::detail::cpu::backward_row_fine(ids.data(), aligned.data(), lp.data(), zn.data(),
                                                                  zo.data(), g.data(), count, lp[c], zn[c], zo[c],
                                                                  g[c], true);
          CHECK(told == scalar);
        }
      }
    }
  }
}


template <class T>
bool same_setup(const troll::detail::row_setup& a, const troll::detail::row_setup& b) {
  return same_bits(a.old_max, b.old_max) && same_bits(a.new_top.zn, b.new_top.zn) &&
         same_bits(a.new_top.zo, b.new_top.zo) && same_bits(a.old_top.zn, b.old_top.zn) &&
         same_bits(a.old_top.zo, b.old_top.zo) && a.new_only == b.new_only && a.old_only == b.old_only &&
         a.any_masked == b.any_masked && same_bits(a.spread, b.spread) && same_bits(a.x_range, b.x_range);
}

template <class T>
void setup_agrees(std::size_t vocab, std::size_t k_max, unsigned seed) {
  std::mt19937_64 rng(seed);
  const std::size_t rows = 4 * (k_max + 1);
  aligned_rows<T> a = make_rows<T>(rows, k_max, vocab, rng);
  // Ties of the maximum: some rows repeat their largest entry, or put it in the bucket.
  for (std::size_t r = 0; r < rows; r += 3) {
    const std::size_t count = std::size_t(a.counts[r]);
    if (count < 3) continue;
    T* ln = a.new_log_probs.data() + r * k_max;
    T* lo = a.old_log_probs.data() + r * k_max;
    const T top_n = *std::max_element(ln, ln + count), top_o = *std::max_element(lo, lo + count);
    ln[count - 1] = top_n;
    if (r % 2 == 0 && count < vocab) a.new_log_remainder[r] = top_n, a.old_log_remainder[r] = top_o;
  }
  const troll::aligned_batch_view<const T> view = a.const_view();
  const int m = troll::sparse_max_entries + 1;
  std::size_t fast_rows = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    std::vector<double> zn(m), zo(m), fn(m), fo(m);
    std::vector<int> slot(m);
    const int n = troll::detail::lumped_pair(view, r, zn.data(), zo.data(), slot.data());
    troll::detail::row_setup ref;
    troll::detail::cpu::scan_pair(zn.data(), zo.data(), std::size_t(n), ref, "", "");
    const int count = int(a.counts[r]);
    const bool tail = std::size_t(count) < vocab;
    bool every_finite = tail;
    for (int i = 0; i < count; ++i)
      every_finite = every_finite && std::isfinite(double(view.new_log_probs[r * k_max + std::size_t(i)])) &&
                     std::isfinite(double(view.old_log_probs[r * k_max + std::size_t(i)]));
    troll::detail::row_setup got;
    const T masked = T(-INFINITY);
    const bool fast = troll::detail::cpu::lumped_pair_finite(
        view.new_log_probs + r * k_max, view.old_log_probs + r * k_max, count,
        tail ? view.new_log_remainder[r] : masked, tail ? view.old_log_remainder[r] : masked, fn.data(), fo.data(), got);
    CHECK(fast == every_finite);
    if (!fast) continue;
    ++fast_rows;
    REQUIRE(n == count + 1);
    bool same = same_setup<T>(got, ref);
    for (int j = 0; j < n; ++j) same = same && same_bits(fn[std::size_t(j)], zn[std::size_t(j)]) &&
                                       same_bits(fo[std::size_t(j)], zo[std::size_t(j)]) && slot[std::size_t(j)] == j;
    CHECK(same);
  }
  CHECK(fast_rows > rows / 2);
}

}  // namespace

TEST_CASE("sparse VJP read in place: the bits of the lumped path (float and double)") {
  for (double eps : {1e-6, 0.02, 0.5}) {
    CAPTURE(eps);
    vjp_agrees<float>(1000, 130, eps, 1);
    vjp_agrees<double>(1000, 130, eps, 2);
    vjp_agrees<float>(40, 40, eps, 3);  // rows whose support is the whole vocabulary
    vjp_agrees<double>(40, 40, eps, 4);
  }
}

TEST_CASE("backward_row_fine in packets accepts exactly the rows of the scalar check") {
  fine_agrees<float>();
  fine_agrees<double>();
}

TEST_CASE("a bad row at each position of a batch: the same typed error naming it, nothing written") {
  std::mt19937_64 rng(5);
  const std::size_t rows = 40, k_max = 24, vocab = 300;
  aligned_rows<float> a = make_rows<float>(rows, k_max, vocab, rng);
  const troll::aligned_batch_view<const float> view = a.const_view();
  sparse_rows<float> out(rows, k_max, vocab);
  std::vector<troll::projection_stats> st(rows);
  troll::project(troll::cpu, view, 0.05, out.view(), st.data());
  sparse_grads<float> g(rows, k_max);
  for (float& x : g.log_probs) x = 0.5f;
  // Each way of spoiling row `bad`: the expected exception type as a tag and a word of its message.
  for (int how = 0; how < 5; ++how) {
    std::string first_kind;
    for (std::size_t bad = 0; bad < rows; ++bad) {
      // rows with a masked entry (kinds 3, 4 of make_rows) ignore the upstream gradient there
      if (a.counts[bad] < 2 || std::size_t(a.counts[bad]) == vocab || bad % 5 >= 3) continue;
      sparse_rows<float> lp = out;
      sparse_grads<float> gg = g;
      aligned_rows<float> al = a;
      std::vector<troll::projection_stats> s = st;
      const std::size_t at = bad * k_max + 1;
      switch (how) {
        case 0: gg.log_probs[at] = std::numeric_limits<float>::quiet_NaN(); break;
        case 1: lp.indices[at] = lp.indices[at - 1]; break;  // not the aligned id
        case 2: lp.log_probs[at] = 0.5f; break;
        case 3: gg.log_remainder[bad] = std::numeric_limits<float>::infinity(); break;
        case 4: al.indices[at] = al.indices[at - 1]; break;  // a duplicate in the aligned rows
        default: break;
      }
      troll::aligned_batch_view<const float> v = view;
      v.indices = al.indices.data();
      sparse_grads<float> gn(rows, k_max);
      for (float& x : gn.log_probs) x = 7.0f;
      CAPTURE(how);
      CAPTURE(bad);
      std::string kind;
      std::size_t named = rows;
      try {
        troll::project_backward(troll::cpu, v, lp.view(), s.data(), gg.view(), gn.view());
      } catch (const troll::shape_error& e) {
        kind = "shape_error", named = e.row();
      } catch (const troll::domain_error& e) {
        kind = "domain_error", named = e.row();
      } catch (const troll::invalid_input& e) {
        kind = "invalid_input", named = e.row();
      }
      CHECK(named == bad);
      if (first_kind.empty()) first_kind = kind;
      CHECK(kind == first_kind);
      CHECK(!kind.empty());
      CHECK(std::all_of(gn.log_probs.begin(), gn.log_probs.end(), [](float x) { return x == 7.0f; }));
    }
  }
}

TEST_CASE("the forward's lumped pair and setup of a finite row: the bits of lumped_pair + scan_pair") {
  setup_agrees<float>(1000, 130, 7);
  setup_agrees<double>(1000, 130, 8);
  setup_agrees<float>(40, 40, 9);
  setup_agrees<double>(40, 40, 10);
}
