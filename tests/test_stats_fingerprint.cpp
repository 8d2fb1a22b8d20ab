// tests/test_stats_fingerprint.cpp — projection_stats::row_fingerprint: the CPU project() (dense
// and sparse) records which row pair its statistics belong to, and the derivatives refuse
// statistics of another row or call (domain_error, bad_stats, before anything is written) instead
// of returning the gradient of a different projection. Statistics without a fingerprint (0: the
// device's, the Python package's, hand-made ones) are taken as before; a row and its copy (another
// buffer, another stride, float rows promoted to double) keep their fingerprint.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "troll/projection.hpp"

namespace {

constexpr std::size_t rows = 4, vocab = 37;

/// Dense logits: rows × vocab normal draws (scale 3), the old rows the new ones plus noise.
struct dense_rows {
  std::vector<double> z_new, z_old;
};

dense_rows make_dense(unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  dense_rows d;
  for (std::size_t i = 0; i < rows * vocab; ++i) {
    d.z_new.push_back(3.0 * normal(rng));
    d.z_old.push_back(d.z_new.back() + 0.8 * normal(rng));
  }
  return d;
}

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

/// project() then project_backward() on the given rows and statistics: the gradient written, or
/// the exception's row and message.
template <class T>
struct dense_call {
  std::vector<T> z_new, z_old, log_probs, grad;
  std::vector<troll::projection_stats> stats;

  explicit dense_call(const dense_rows& d) : z_new(as<T>(d.z_new)), z_old(as<T>(d.z_old)), log_probs(rows * vocab) {
    stats.resize(rows);
    troll::project(troll::cpu, in(z_new), in(z_old), 0.05, troll::make_batch(log_probs.data(), rows, vocab),
                   stats.data());
    for (std::size_t i = 0; i < rows * vocab; ++i) grad.push_back(T(std::sin(double(i))));
  }
  static troll::batch_view<const T> in(const std::vector<T>& v) { return troll::make_batch(v.data(), rows, vocab); }

  std::vector<T> backward(const std::vector<troll::projection_stats>& s) const {
    std::vector<T> out(rows * vocab, T(7));
    troll::project_backward(troll::cpu, in(z_new), in(z_old), in(log_probs), s.data(), in(grad),
                            troll::make_batch(out.data(), rows, vocab));
    return out;
  }
};

/// Aligned sparse rows (3 entries of V = 12 and a bucket), the old side the new one moved.
struct sparse_rows {
  std::vector<troll::sparse_index> ids, counts;
  std::vector<double> new_lp, old_lp, new_r, old_r;
  std::size_t k_max = 3;
};

sparse_rows make_sparse(unsigned seed, std::size_t k_max = 3) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.1, 1.0);
  sparse_rows s;
  s.k_max = k_max;
  for (std::size_t r = 0; r < rows; ++r) {
    const troll::sparse_index row_ids[3] = {troll::sparse_index(r), troll::sparse_index(4 + r), 11};
    for (const bool old_side : {false, true}) {
      double p[4], total = 0.0;
      for (double& x : p) total += x = unit(rng);
      for (std::size_t i = 0; i < 3; ++i) (old_side ? s.old_lp : s.new_lp).push_back(std::log(p[i] / total));
      for (std::size_t i = 3; i < k_max; ++i) (old_side ? s.old_lp : s.new_lp).push_back(-1.0);  // padding
      (old_side ? s.old_r : s.new_r).push_back(std::log(p[3] / total));
    }
    for (std::size_t i = 0; i < k_max; ++i) s.ids.push_back(i < 3 ? row_ids[i] : troll::sparse_index(-1));
    s.counts.push_back(3);
  }
  return s;
}

template <class T>
struct sparse_call {
  std::vector<troll::sparse_index> ids, counts, out_ids, out_counts;
  std::vector<T> new_lp, old_lp, new_r, old_r, out_lp, out_r, grad, grad_r;
  std::size_t k_max;
  std::vector<troll::projection_stats> stats;

  explicit sparse_call(const sparse_rows& s)
      : ids(s.ids), counts(s.counts), out_ids(rows * s.k_max), out_counts(rows), new_lp(as<T>(s.new_lp)),
        old_lp(as<T>(s.old_lp)), new_r(as<T>(s.new_r)), old_r(as<T>(s.old_r)), out_lp(rows * s.k_max),
        out_r(rows), k_max(s.k_max) {
    stats.resize(rows);
    troll::project(troll::cpu, view(), 0.02, out(), stats.data());
    for (std::size_t r = 0; r < rows; ++r)  // the same upstream entries whatever the stride
      for (std::size_t i = 0; i < k_max; ++i) grad.push_back(T(i < 3 ? std::cos(double(r * 3 + i)) : 0.0));
    for (std::size_t r = 0; r < rows; ++r) grad_r.push_back(T(0.5 - double(r)));
  }
  troll::aligned_batch_view<const T> view() const {
    return {ids.data(), counts.data(), new_lp.data(), old_lp.data(), new_r.data(), old_r.data(), rows, k_max, 12};
  }
  troll::sparse_batch_view<T> out() { return {out_ids.data(), out_lp.data(), out_counts.data(), out_r.data(), rows, k_max, 12}; }

  std::vector<T> backward(const std::vector<troll::projection_stats>& s) const {
    std::vector<T> g(rows * k_max, T(7)), g_r(rows, T(7));
    const troll::sparse_batch_view<const T> lp{out_ids.data(), out_lp.data(), out_counts.data(), out_r.data(),
                                               rows, k_max, 12};
    troll::project_backward(troll::cpu, view(), lp, s.data(),
                            troll::sparse_grad_view<const T>{grad.data(), grad_r.data(), rows, k_max},
                            troll::sparse_grad_view<T>{g.data(), g_r.data(), rows, k_max});
    for (std::size_t r = 0; r < rows; ++r) g.push_back(g_r[r]);
    return g;
  }
};

/// Statistics with rows a and b swapped.
std::vector<troll::projection_stats> swapped(std::vector<troll::projection_stats> s, std::size_t a, std::size_t b) {
  std::swap(s[a], s[b]);
  return s;
}

/// Statistics without fingerprints (as the device and the Python package hand them over).
std::vector<troll::projection_stats> unknown(std::vector<troll::projection_stats> s) {
  for (troll::projection_stats& x : s) x.row_fingerprint = 0;
  return s;
}

template <class Call>
void expect_other_rows(Call&& call, std::size_t row) {
  troll_test::expect_rejected<troll::domain_error>(call, row, "row_fingerprint differs");
  try {
    call();
  } catch (const troll::invalid_input& e) {
    CHECK(e.code() == troll::row_error::bad_stats);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("dense: statistics of another row or call are refused, unknown ones taken", T, float, double) {
  const dense_call<T> a(make_dense(1)), b(make_dense(2));
  for (const troll::projection_stats& s : a.stats) CHECK(s.row_fingerprint != 0);
  const std::vector<T> want = a.backward(a.stats);
  CHECK(a.backward(unknown(a.stats)) == want);  // no fingerprint: accepted, the same bits
  // Rows 1 and 2 swapped: row 1 is named, nothing is written.
  std::vector<T> out(rows * vocab, T(7));
  const std::vector<troll::projection_stats> mixed = swapped(a.stats, 1, 2);
  expect_other_rows([&] {
    troll::project_backward(troll::cpu, a.in(a.z_new), a.in(a.z_old), a.in(a.log_probs), mixed.data(), a.in(a.grad),
                            troll::make_batch(out.data(), rows, vocab));
  }, 1);
  for (T x : out) CHECK(x == T(7));
  // Another call's statistics (other logits, same shapes): row 0.
  expect_other_rows([&] { a.backward(b.stats); }, 0);
  // The JVP and the Jacobian share the check.
  std::vector<T> tangent(rows * vocab, T(0.25)), jvp(rows * vocab);
  expect_other_rows([&] {
    troll::project_jvp(troll::cpu, a.in(a.z_new), a.in(a.z_old), a.in(a.log_probs), mixed.data(), a.in(tangent),
                       troll::input_view<T>{}, 0.0, troll::make_batch(jvp.data(), rows, vocab));
  }, 1);
  // A copy of the rows in another buffer with another stride keeps the fingerprint.
  const std::size_t stride = vocab + 5;
  std::vector<T> zn(rows * stride, T(-1)), zo(rows * stride, T(-1));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < vocab; ++j) {
      zn[r * stride + j] = a.z_new[r * vocab + j];
      zo[r * stride + j] = a.z_old[r * vocab + j];
    }
  std::vector<T> copied(rows * vocab, T(7));
  troll::project_backward(troll::cpu, troll::batch_view<const T>{zn.data(), rows, vocab, stride},
                          troll::batch_view<const T>{zo.data(), rows, vocab, stride}, a.in(a.log_probs),
                          a.stats.data(), a.in(a.grad), troll::make_batch(copied.data(), rows, vocab));
  CHECK(copied == want);
}

TEST_CASE("dense: float statistics go with the same rows promoted to double") {
  const dense_call<float> f(make_dense(3));
  const dense_call<double> d(make_dense(3));
  for (std::size_t r = 0; r < rows; ++r) CHECK(f.stats[r].row_fingerprint == d.stats[r].row_fingerprint);
  // Promoted exactly: the float run's statistics are taken by the double backward of its rows.
  dense_call<double> promoted = d;
  promoted.z_new.assign(f.z_new.begin(), f.z_new.end());
  promoted.z_old.assign(f.z_old.begin(), f.z_old.end());
  promoted.log_probs.assign(f.log_probs.begin(), f.log_probs.end());
  CHECK_NOTHROW(promoted.backward(f.stats));
}

TEST_CASE_TEMPLATE("sparse: statistics of another row or call are refused, unknown ones taken", T, float, double) {
  const sparse_call<T> a(make_sparse(4)), b(make_sparse(5));
  for (const troll::projection_stats& s : a.stats) CHECK(s.row_fingerprint != 0);
  const std::vector<T> want = a.backward(a.stats);
  CHECK(a.backward(unknown(a.stats)) == want);
  expect_other_rows([&] { a.backward(swapped(a.stats, 2, 3)); }, 2);
  expect_other_rows([&] { a.backward(b.stats); }, 0);
  // The rows copied with another k_max (another stride): the same fingerprints, the same gradient.
  const sparse_call<T> wide(make_sparse(4, 6));
  for (std::size_t r = 0; r < rows; ++r) CHECK(wide.stats[r].row_fingerprint == a.stats[r].row_fingerprint);
  const std::vector<T> got = wide.backward(a.stats);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t i = 0; i < 3; ++i) CHECK(got[r * 6 + i] == want[r * 3 + i]);
    CHECK(got[rows * 6 + r] == want[rows * 3 + r]);
  }
  // One row edited after the forward (its last entry's old log-probability moved, its mass still
  // within the tolerance): its statistics no longer describe it.
  sparse_call<T> edited = a;
  edited.old_lp[1 * 3 + 2] = T(double(edited.old_lp[1 * 3 + 2]) + 1e-6);
  expect_other_rows([&] { edited.backward(a.stats); }, 1);
}

TEST_CASE_TEMPLATE("TROLL's objective: its backward refuses the statistics of other rows", T, float, double) {
  const dense_rows d = make_dense(6);
  const std::vector<T> z_new = as<T>(d.z_new), z_old = as<T>(d.z_old);
  const std::vector<troll::token_id> tokens = {3, 17, 0, 36};
  const std::vector<T> advantages = {T(1), T(-0.5), T(2), T(0.25)};
  troll::token_batch<T> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  const troll::trust_region_objective objective{0.05, 1.0, {}};
  auto view = [](const std::vector<T>& v) { return troll::make_batch(v.data(), rows, vocab); };
  std::vector<T> log_probs(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::objective_forward(troll::cpu, objective, view(z_new), view(z_old), in,
                           troll::make_batch(log_probs.data(), rows, vocab), stats.data());
  for (const troll::projection_stats& s : stats) CHECK(s.row_fingerprint != 0);
  auto backward = [&](const std::vector<troll::projection_stats>& s) {
    std::vector<T> grad(rows * vocab, T(7));
    troll::objective_backward(troll::cpu, objective, view(z_new), view(z_old), in, view(log_probs), s.data(),
                              troll::make_batch(grad.data(), rows, vocab));
    return grad;
  };
  const std::vector<T> want = backward(stats);
  CHECK(backward(unknown(stats)) == want);
  expect_other_rows([&] { backward(swapped(stats, 0, 3)); }, 0);
}

TEST_CASE("the sparse TROLL objective: its backward refuses the statistics of other rows") {
  using T = float;
  const dense_rows d = make_dense(7);
  const std::vector<T> z_new = as<T>(d.z_new), z_old = as<T>(d.z_old);
  const std::vector<troll::token_id> tokens = {3, 17, 0, 36};
  const std::vector<T> advantages = {T(1), T(-0.5), T(2), T(0.25)};
  // The old rows as the trainer keeps them: top-8 plus the sampled token and a bucket.
  const std::size_t k_old = 10, k_aligned = 16;
  std::vector<troll::sparse_index> old_ids(rows * k_old), old_counts(rows);
  std::vector<T> old_lp(rows * k_old), old_r(rows);
  const troll::sparse_batch_view<T> old_rows{old_ids.data(), old_lp.data(), old_counts.data(), old_r.data(),
                                             rows, k_old, vocab};
  troll::sparsify(troll::cpu, troll::make_batch(z_old.data(), rows, vocab), tokens.data(), {8, 1e-5}, old_rows);
  troll::token_batch<T> in;
  in.tokens = tokens.data();
  in.advantages = advantages.data();
  troll::sparse_trust_region_objective objective;
  objective.new_support.k = 4;
  std::vector<troll::sparse_index> a_ids(rows * k_aligned), a_counts(rows), lp_ids(rows * k_aligned), lp_counts(rows);
  std::vector<T> a_new(rows * k_aligned), a_old(rows * k_aligned), a_new_r(rows), a_old_r(rows);
  std::vector<T> lp(rows * k_aligned), lp_r(rows);
  const troll::aligned_batch_view<T> aligned{a_ids.data(), a_counts.data(), a_new.data(), a_old.data(),
                                             a_new_r.data(), a_old_r.data(), rows, k_aligned, vocab};
  const troll::sparse_batch_view<T> log_probs{lp_ids.data(), lp.data(), lp_counts.data(), lp_r.data(),
                                              rows, k_aligned, vocab};
  std::vector<troll::projection_stats> stats(rows);
  troll::objective_forward(troll::cpu, objective, troll::make_batch(z_new.data(), rows, vocab),
                           troll::sparse_input<T>(old_rows), in, aligned, log_probs, stats.data());
  for (const troll::projection_stats& s : stats) CHECK(s.row_fingerprint != 0);
  auto backward = [&](const std::vector<troll::projection_stats>& s) {
    std::vector<T> grad(rows * vocab, T(7));
    troll::objective_backward(troll::cpu, objective, troll::make_batch(z_new.data(), rows, vocab),
                              troll::aligned_input<T>(aligned), in, troll::sparse_input<T>(log_probs), s.data(),
                              troll::make_batch(grad.data(), rows, vocab));
    return grad;
  };
  const std::vector<T> want = backward(stats);
  CHECK(backward(unknown(stats)) == want);
  expect_other_rows([&] { backward(swapped(stats, 1, 2)); }, 1);
}
