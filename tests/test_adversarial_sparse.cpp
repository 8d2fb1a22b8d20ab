// tests/test_adversarial_sparse.cpp — an adversarial audit of the CPU sparse path and the
// objectives, the entry points tests/test_adversarial.cpp leaves out: align (sparse and dense
// new side), the sparse kl / project / project_backward, the vocabulary shards (sharded equals
// whole-row bit for bit), sparsify_backward, the TROLL / PPO clip / DPPO objectives (dense and
// sparse old rows), and the bad-input contract of each (typed exception naming the lowest bad
// row, every output untouched). Inputs: V = 1, 2, 3, 4097, 262,144; K = 1 and K > V; logits at
// ±1e4 and float's ±3e38; −inf masks (the sampled token too, all but one token); ties;
// near-deterministic rows; remainder mass 0 and ~1; ε from 1e-12 to 50; float and double;
// strided rows; 1 and 2 threads; 0 rows; advantages 0 and huge; masks all zero. Expectations come
// from long-double oracles written here from math.md, never from troll's own output (except
// where the contract itself is "equal to another entry point", as for the shards).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "troll/gradcheck.hpp"
#include "troll/objectives.hpp"
#include "troll/projection.hpp"
#include "troll/sparse.hpp"
#include "troll/sparse_objectives.hpp"

#include "adversarial_sparse_rows.hpp"
#include "backend.hpp"
#include "expect_error.hpp"
#include "sparse_oracle.hpp"
#include "sparse_staging.hpp"

namespace {

using ld = long double;
using sparse_test::aligned_rows;
using sparse_test::sparse_grads;
using sparse_test::sparse_rows;
using adversarial_sparse::dense_row;
using adversarial_sparse::gather;
using adversarial_sparse::make_aligned;
using adversarial_sparse::oracle_row;
using adversarial_sparse::put_row;
using adversarial_sparse::top_support;
constexpr double inf = std::numeric_limits<double>::infinity();
const ld ld_inf = std::numeric_limits<ld>::infinity();

template <class T>
constexpr double ulp() {
  return double(std::numeric_limits<T>::epsilon());
}
template <class T>
const char* type_name() {
  return sizeof(T) == 4 ? "float" : "double";
}

ld lse(const std::vector<ld>& v) {
  ld m = -ld_inf;
  for (ld x : v) m = std::max(m, x);
  if (m == -ld_inf) return m;
  ld s = 0;
  for (ld x : v) s += std::exp(x - m);
  return m + std::log(s);
}

/// The V-vector a sparse row stands for (uniform tail).
std::vector<ld> expand(const std::vector<int>& support, const std::vector<ld>& lp, ld log_r, std::size_t vocab) {
  const std::size_t m = vocab - support.size();
  std::vector<ld> e(vocab, m ? log_r - std::log(ld(m)) : -ld_inf);
  for (std::size_t i = 0; i < support.size(); ++i) e[std::size_t(support[i])] = lp[i];
  return e;
}

/// |a − b| within a few ulps of T at the value's scale (both −inf counts as equal).
template <class T>
bool close(ld a, ld b, double scale = 1, double ulps = 8) {
  // A log-probability below −max(T) rounds to −inf in T (its probability is 0 in any type).
  if (b < -ld(std::numeric_limits<T>::max())) b = -ld_inf;
  if (a == -ld_inf || b == -ld_inf) return a == b;
  const double err = double(std::fabs(a - b));
  return err <= ulps * ulp<T>() * (double(std::fabs(b)) + scale);
}

// ---------------------------------------------------------------------------------------------
// The lumped projection oracle (long double): π_t ∝ exp(zo + t(zn − zo)) on J = {both finite};
// KL(π_t‖q) = Σ_J π(e^δ − 1 − δ) + q(outside J), δ = log q − log π, non-negative terms.
// ---------------------------------------------------------------------------------------------
struct lumped_oracle {
  std::vector<ld> zn, zo;
  bool new_outside = false;
  lumped_oracle(std::vector<ld> a, std::vector<ld> b) : zn(std::move(a)), zo(std::move(b)) {
    for (std::size_t i = 0; i < zn.size(); ++i)
      if (zn[i] > -ld_inf && zo[i] == -ld_inf) new_outside = true;
  }
  bool joint(std::size_t i) const { return zn[i] > -ld_inf && zo[i] > -ld_inf; }
  // log π at (t, s = 1 − t): near t = 1 formed as zn − s·(zn − zo) so that s keeps its digits.
  std::vector<ld> log_pi(ld t, ld s) const {
    std::vector<ld> w(zn.size(), -ld_inf);
    for (std::size_t i = 0; i < zn.size(); ++i)
      if (joint(i)) w[i] = t <= 0.5L ? zo[i] + t * (zn[i] - zo[i]) : zn[i] - s * (zn[i] - zo[i]);
    const ld n = lse(w);
    for (auto& x : w) x -= n;
    return w;
  }
  std::vector<ld> log_q() const {
    std::vector<ld> q = zo;
    const ld n = lse(q);
    for (auto& x : q) x -= n;
    return q;
  }
  ld kl_at(ld t, ld s) const {
    const std::vector<ld> lp = log_pi(t, s), lq = log_q();
    ld sum = 0;
    for (std::size_t i = 0; i < zn.size(); ++i) {
      if (lq[i] == -ld_inf) continue;
      if (!joint(i)) {
        sum += std::exp(lq[i]);
        continue;
      }
      const ld d = lq[i] - lp[i], p = std::exp(lp[i]);
      sum += d > 1 ? std::exp(lq[i]) - p * (1 + d) : p * (std::expm1(d) - d);
    }
    return sum;
  }
  ld kl_new() const {  // KL(p̃‖q) on the lumped rows
    if (new_outside) return ld_inf;
    std::vector<ld> p = zn;
    const ld n = lse(p);
    const std::vector<ld> lq = log_q();
    ld sum = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (p[i] == -ld_inf) {  // q's mass where p̃ has none
        if (lq[i] > -ld_inf) sum += std::exp(lq[i]);
        continue;
      }
      const ld l = p[i] - n, d = lq[i] - l, pp = std::exp(l);
      sum += d > 1 ? std::exp(lq[i]) - pp * (1 + d) : pp * (std::expm1(d) - d);
    }
    return sum;
  }
};

/// Checks the sparse project of aligned rows (row r of `a`) against the lumped oracle.
template <class T>
void check_sparse_projection(const aligned_rows<T>& a, std::size_t r, double eps, const sparse_rows<T>& out,
                             const troll::projection_stats& st) {
  const std::size_t c = std::size_t(a.counts[r]);
  const bool tail = a.vocab > c;
  std::vector<ld> zn, zo;
  for (std::size_t i = 0; i < c; ++i) {
    zn.push_back(ld(a.new_log_probs[r * a.k_max + i]));
    zo.push_back(ld(a.old_log_probs[r * a.k_max + i]));
  }
  zn.push_back(tail ? ld(a.new_log_remainder[r]) : -ld_inf);
  zo.push_back(tail ? ld(a.old_log_remainder[r]) : -ld_inf);
  const lumped_oracle o(zn, zo);
  INFO("row ", r, " status ", troll::status_name(st.status), " t ", st.t, " eta ", st.eta, " kl_before ",
       st.kl_before, " kl_after ", st.kl_after, " eps ", eps, " type ", type_name<T>());
  REQUIRE(out.counts[r] == a.counts[r]);
  std::vector<ld> got(c + 1);
  for (std::size_t i = 0; i < c; ++i) {
    REQUIRE(out.indices[r * out.k_max + i] == a.indices[r * a.k_max + i]);
    got[i] = ld(out.log_probs[r * out.k_max + i]);
  }
  got[c] = ld(out.log_remainder[r]);
  for (std::size_t i = c; i < out.k_max; ++i) {
    CHECK(out.indices[r * out.k_max + i] == -1);
    CHECK(out.log_probs[r * out.k_max + i] == -std::numeric_limits<T>::infinity());
  }
  for (ld v : got) REQUIRE(!std::isnan(v));
  const ld kl1 = o.kl_new();
  const double g = std::is_same<T, float>::value ? 1e-5 : 1e-11;
  if (st.status == troll::row_status::inactive) {
    CHECK(double(kl1) <= eps * (1 + g) + g * 1e-3);
    // The lumped new row's log-softmax.
    std::vector<ld> p = zn;
    const ld n = lse(p);
    for (std::size_t i = 0; i <= c; ++i) CHECK(close<T>(got[i], p[i] - n, 1, 4));
    return;
  }
  CHECK(double(kl1) >= eps * (1 - g));
  if (st.status == troll::row_status::restricted) {
    CHECK(o.kl_at(1, 0) <= ld(eps) * (1 + 1e-10L));
    const std::vector<ld> lp = o.log_pi(1, 0);
    for (std::size_t i = 0; i <= c; ++i) CHECK(close<T>(got[i], lp[i], 1, 8));
    return;
  }
  REQUIRE(st.status == troll::row_status::projected);
  const ld ts = st.t, ss = ld(st.eta) * ld(st.t);
  const ld kl_troll = o.kl_at(ts, ts <= 0.5L ? 1 - ts : ss);
  CHECK(std::fabs(double(kl_troll) - eps) <= 1e-10 * eps + 1e-300);
  CHECK(std::fabs(st.kl_after - eps) <= 1e-10 * eps);
  const std::vector<ld> lp = o.log_pi(ts, ts <= 0.5L ? 1 - ts : ss);
  double scale = 1;
  for (std::size_t i = 0; i <= c; ++i)
    if (o.joint(i)) scale = std::max({scale, double(std::fabs(zn[i])), double(std::fabs(zo[i]))});
  for (std::size_t i = 0; i <= c; ++i) {
    INFO("entry ", i, " got ", double(got[i]), " oracle ", double(lp[i]));
    CHECK(close<T>(got[i], lp[i], 4 * scale, 8));
  }
}

const std::size_t vocab_list[] = {1, 2, 3, 17, 4097};

}  // namespace

TEST_CASE_TEMPLATE("align(sparse, sparse): the aligned pair expands to the input V-vectors", T, float, double) {
  std::mt19937_64 g(11);
  for (std::size_t vocab : vocab_list) {
    for (int kind = 0; kind < 8; ++kind) {
      for (int trial = 0; trial < 3; ++trial) {
        CAPTURE(vocab);
        CAPTURE(kind);
        CAPTURE(trial);
        const std::vector<T> zn = dense_row<T>(g, vocab, kind), zo = dense_row<T>(g, vocab, kind + trial);
        std::uniform_int_distribution<std::size_t> pick_k(0, std::min<std::size_t>(vocab, 12));
        std::uniform_int_distribution<int> pick_tok(0, int(vocab) - 1);
        // Supports from empty (all mass in the bucket) to the whole vocabulary (no bucket).
        const std::size_t kn = trial == 2 ? vocab : pick_k(g), ko = trial == 1 ? 0 : pick_k(g);
        if (std::min(kn, ko) > 40 || kn > 40 || ko > 40) continue;
        std::vector<T> zn_used = zn, zo_used = zo;
        const oracle_row on = gather(zn_used, top_support(zn_used, kn, kn < vocab ? pick_tok(g) : -1));
        const oracle_row oo = gather(zo_used, top_support(zo_used, ko));
        // Rows with no finite value at all are not rows; the generator never makes them.
        const std::size_t k_max = on.support.size() + oo.support.size() + 2;
        sparse_rows<T> a(1, k_max, vocab), b(1, k_max, vocab);
        put_row(a, 0, on);
        put_row(b, 0, oo);
        aligned_rows<T> out(1, k_max, vocab);
        try {
          troll::align(troll::cpu, a.view(), b.view(), out.view());
        } catch (const troll::invalid_input& e) {
          // Only a row whose total mass rounds outside the tolerance may be refused.
          FAIL_CHECK("align threw: " << std::string(e.what()));
          continue;
        }
        const std::size_t u = std::size_t(out.counts[0]);
        std::vector<int> U(out.indices.begin(), out.indices.begin() + std::ptrdiff_t(u));
        std::vector<ld> an(u), ao(u);
        for (std::size_t i = 0; i < u; ++i) an[i] = ld(out.new_log_probs[i]), ao[i] = ld(out.old_log_probs[i]);
        // U = S_new in order, then the old-only ids in their order.
        std::vector<int> expect_u = on.support;
        for (int i : oo.support)
          if (std::find(expect_u.begin(), expect_u.end(), i) == expect_u.end()) expect_u.push_back(i);
        CHECK(U == expect_u);
        for (std::size_t i = u; i < k_max; ++i) {
          CHECK(out.indices[i] == -1);
          CHECK(out.new_log_probs[i] == -std::numeric_limits<T>::infinity());
          CHECK(out.old_log_probs[i] == -std::numeric_limits<T>::infinity());
        }
        const std::vector<ld> want_n = expand(on.support, std::vector<ld>(a.log_probs.begin(), a.log_probs.begin() + std::ptrdiff_t(on.support.size())), ld(a.log_remainder[0]), vocab);
        const std::vector<ld> want_o = expand(oo.support, std::vector<ld>(b.log_probs.begin(), b.log_probs.begin() + std::ptrdiff_t(oo.support.size())), ld(b.log_remainder[0]), vocab);
        const std::vector<ld> got_n = expand(U, an, ld(out.new_log_remainder[0]), vocab);
        const std::vector<ld> got_o = expand(U, ao, ld(out.old_log_remainder[0]), vocab);
        for (std::size_t i = 0; i < vocab; ++i) {
          INFO("token ", i, " new ", double(got_n[i]), " vs ", double(want_n[i]), " old ", double(got_o[i]), " vs ", double(want_o[i]));
          CHECK(close<T>(got_n[i], want_n[i], 1, 4));
          CHECK(close<T>(got_o[i], want_o[i], 1, 4));
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("align(dense logits, support, old): exact gathered values and tail against long double", T, float, double) {
  std::mt19937_64 g(12);
  for (std::size_t vocab : {std::size_t(1), std::size_t(2), std::size_t(3), std::size_t(17), std::size_t(4097), std::size_t(262144)}) {
    for (int kind = 0; kind < 8; ++kind) {
      if (vocab == 262144 && kind % 3 != 0) continue;  // CI time
      CAPTURE(vocab);
      CAPTURE(kind);
      const std::size_t stride = vocab + 3;
      std::vector<T> zn(stride, T(777)), zo = dense_row<T>(g, vocab, kind + 1);
      const std::vector<T> row = dense_row<T>(g, vocab, kind);
      std::copy(row.begin(), row.end(), zn.begin());
      std::uniform_int_distribution<std::size_t> pick_k(0, std::min<std::size_t>(vocab, 9));
      const oracle_row oo = gather(zo, top_support(zo, pick_k(g)));
      const std::vector<int> sn = top_support(row, pick_k(g));
      const std::size_t k_max = 24;
      sparse_rows<T> old(1, k_max, vocab), support(1, k_max, vocab);
      put_row(old, 0, oo);
      support.counts[0] = troll::sparse_index(sn.size());
      for (std::size_t i = 0; i < sn.size(); ++i) support.indices[i] = sn[i];
      for (bool with_support : {true, false}) {
        aligned_rows<T> out(1, k_max, vocab);
        const troll::sparse_batch_view<const T> sv =
            with_support ? support.view() : troll::sparse_batch_view<const T>{};
        troll::align(troll::cpu.with_threads(2), troll::make_batch<const T>(zn.data(), 1, vocab, stride), sv,
                     old.view(), out.view());
        const std::size_t u = std::size_t(out.counts[0]);
        const std::vector<int> U(out.indices.begin(), out.indices.begin() + std::ptrdiff_t(u));
        const oracle_row exact = gather(row, U);
        // The documented scale: a few ulps of T times the row's logit scale.
        double scale = 1;
        for (T x : row)
          if (std::isfinite(double(x))) scale = std::max(scale, std::fabs(double(x)));
        scale += std::log(double(vocab));  // log Σ e^z itself is that large
        for (std::size_t i = 0; i < u; ++i) {
          INFO("entry ", i, " token ", U[i], " got ", double(out.new_log_probs[i]), " oracle ", double(exact.lp[i]));
          CHECK(close<T>(ld(out.new_log_probs[i]), exact.lp[i], scale, 2));
        }
        INFO("remainder got ", double(out.new_log_remainder[0]), " oracle ", double(exact.log_r));
        // The tail sum in double with float exponentials: a few float ulps of the tail mass.
        CHECK(close<T>(ld(out.new_log_remainder[0]), exact.log_r, scale, 4));
        // The old side as align(sparse, sparse) would give it.
        const std::vector<ld> want_o = expand(oo.support, std::vector<ld>(old.log_probs.begin(), old.log_probs.begin() + std::ptrdiff_t(oo.support.size())), ld(old.log_remainder[0]), vocab);
        std::vector<ld> ao(u);
        for (std::size_t i = 0; i < u; ++i) ao[i] = ld(out.old_log_probs[i]);
        const std::vector<ld> got_o = expand(U, ao, ld(out.old_log_remainder[0]), vocab);
        for (std::size_t i = 0; i < vocab; ++i)
          if (!close<T>(got_o[i], want_o[i], 1, 4)) {
            CHECK(close<T>(got_o[i], want_o[i], 1, 4));
            break;
          }
      }
    }
  }
}


TEST_CASE_TEMPLATE("sparse kl and project against the lumped long-double oracle", T, float, double) {
  std::mt19937_64 g(21);
  for (std::size_t vocab : vocab_list) {
    for (int kind = 0; kind < 8; ++kind) {
      CAPTURE(vocab);
      CAPTURE(kind);
      const std::size_t rows = 3;
      aligned_rows<T> a = make_aligned<T>(g, vocab, rows, kind);
      // KL of the lumped rows.
      std::vector<T> kl(rows + 1, T(-5));
      troll::kl(troll::cpu.with_threads(2), troll::aligned_input<T>(a.view()), kl.data());
      CHECK(kl[rows] == T(-5));
      for (std::size_t r = 0; r < rows; ++r) {
        const std::size_t c = std::size_t(a.counts[r]);
        std::vector<ld> zn, zo;
        double scale = 1;
        for (std::size_t i = 0; i < c; ++i) {
          zn.push_back(ld(a.new_log_probs[r * a.k_max + i]));
          zo.push_back(ld(a.old_log_probs[r * a.k_max + i]));
        }
        zn.push_back(vocab > c ? ld(a.new_log_remainder[r]) : -ld_inf);
        zo.push_back(vocab > c ? ld(a.old_log_remainder[r]) : -ld_inf);
        for (std::size_t i = 0; i <= c; ++i)
          if (std::isfinite(double(zn[i])) && std::isfinite(double(zo[i])))
            scale = std::max({scale, double(std::fabs(zn[i])), double(std::fabs(zo[i]))});
        const ld want = lumped_oracle(zn, zo).kl_new();
        INFO("row ", r, " kl ", double(kl[r]), " oracle ", double(want));
        if (want == ld_inf) {
          CHECK(kl[r] == std::numeric_limits<T>::infinity());
        } else {
          CHECK(std::fabs(double(ld(kl[r]) - want)) <= 8 * ulp<T>() * double(want) + 64 * ulp<double>() * scale);
        }
      }
      for (double eps : {1e-12, 1e-8, 1e-4, 0.05, 1.0, 50.0}) {
        CAPTURE(eps);
        sparse_rows<T> out(rows, a.k_max + 2, vocab);
        std::vector<troll::projection_stats> st(rows);
        try {
          troll::project(troll::cpu.with_threads(2), troll::aligned_input<T>(a.view()), eps, out.view(), st.data());
        } catch (const troll::infeasible_error& e) {
          // Only when π restricted to the joint support ∝ q there is already outside the ball.
          const std::size_t r = e.row();
          const std::size_t c = std::size_t(a.counts[r]);
          std::vector<ld> zn, zo;
          for (std::size_t i = 0; i < c; ++i)
            zn.push_back(ld(a.new_log_probs[r * a.k_max + i])), zo.push_back(ld(a.old_log_probs[r * a.k_max + i]));
          zn.push_back(vocab > c ? ld(a.new_log_remainder[r]) : -ld_inf);
          zo.push_back(vocab > c ? ld(a.old_log_remainder[r]) : -ld_inf);
          CHECK(lumped_oracle(zn, zo).kl_at(0, 1) >= ld(eps) * (1 - 1e-9L));
          continue;
        }
        for (std::size_t r = 0; r < rows; ++r) check_sparse_projection(a, r, eps, out, st[r]);
      }
    }
  }
}

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The sparse VJP against central differences, one body for every backend (also compiled for
// troll::cuda by tests/cuda/test_cuda_sparse_projection_oracle.cu).
#include "../bodies/adversarial_sparse_backward.hpp"

namespace {

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Shards of one batch (cuts from 0 to V), merged in a random order, finalised in two stages:
/// equal to sparsify bit for bit; each shard's backward equal to sparsify_backward's columns.
template <class T>
void check_shards(const std::vector<T>& z, std::size_t rows, std::size_t vocab, const std::vector<std::size_t>& cuts,
                  const troll::token_id* sampled, troll::sparsify_options opt, std::mt19937_64& g) {
  const std::size_t k_max = std::size_t(opt.k) + 1;
  sparse_rows<T> whole(rows, k_max, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled, opt, whole.view());
  const std::size_t shards = cuts.size() - 1;
  auto shard_view = [&](std::size_t s) {
    return troll::batch_view<const T>{z.data() + cuts[s], rows, cuts[s + 1] - cuts[s], vocab};
  };
  std::vector<std::vector<troll::sparsify_state>> states(shards, std::vector<troll::sparsify_state>(rows));
  for (std::size_t s = 0; s < shards; ++s)
    troll::sparsify_shard(troll::cpu.with_threads(2), shard_view(s), cuts[s], vocab, sampled, opt, states[s].data());
  std::vector<std::size_t> order(shards);
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::shuffle(order.begin(), order.end(), g);
  // Merge neighbours only (any order of adjacent pieces), as a distributed gather would.
  std::vector<troll::sparsify_state> merged = states[0];
  for (std::size_t s = 1; s < shards; ++s) troll::sparsify_merge(troll::cpu, merged.data(), states[s].data(), rows);
  sparse_rows<T> first(rows, k_max, vocab);
  std::vector<double> tail_max(rows), log_sums(troll::sparsify_log_sums_width * rows), tail_sums(2 * rows * shards);
  troll::sparsify_finalize(troll::cpu, merged.data(), opt, first.view(), nullptr, tail_max.data());
  CHECK(first.indices == whole.indices);
  CHECK(first.counts == whole.counts);
  for (std::size_t i = 0; i < shards; ++i) {
    const std::size_t s = order[i];
    troll::sparsify_tail_sums<T>(troll::cpu, shard_view(s), cuts[s], first.view(), tail_max.data(),
                                 tail_sums.data() + 2 * rows * i);
  }
  sparse_rows<T> exact(rows, k_max, vocab);
  troll::sparsify_finalize(troll::cpu, merged.data(), opt, exact.view(), log_sums.data(), nullptr, tail_sums.data(),
                           shards);
  CHECK(exact.indices == whole.indices);
  CHECK(exact.counts == whole.counts);
  CHECK(same_bits(exact.log_probs, whole.log_probs));
  CHECK(same_bits(exact.log_remainder, whole.log_remainder));
  sparse_grads<T> up(rows, k_max);
  std::normal_distribution<double> n01(0.0, 1.0);
  for (auto& x : up.log_probs) x = T(n01(g));
  for (auto& x : up.log_remainder) x = T(n01(g));
  std::vector<T> gw(rows * vocab, T(9)), gs(rows * vocab, T(9));
  troll::sparsify_backward(troll::cpu, troll::make_batch(z.data(), rows, vocab), whole.view(),
                           troll::sparse_grad_input<T>(up.view()), troll::make_batch(gw.data(), rows, vocab));
  for (std::size_t s = 0; s < shards; ++s)
    troll::sparsify_shard_backward(troll::cpu, shard_view(s), cuts[s], exact.view(),
                                   troll::sparse_grad_input<T>(up.view()), log_sums.data(),
                                   troll::batch_view<T>{gs.data() + cuts[s], rows, cuts[s + 1] - cuts[s], vocab});
  CHECK(same_bits(gs, gw));
  for (T x : gw) REQUIRE(std::isfinite(double(x)));
}

}  // namespace

TEST_CASE_TEMPLATE("vocabulary shards: adversarial rows, K = 1 and K > V, single-token and all-masked shards", T, float, double) {
  std::mt19937_64 g(41);
  for (std::size_t vocab : {std::size_t(1), std::size_t(2), std::size_t(3), std::size_t(17), std::size_t(4097)}) {
    for (int kind = 0; kind < 8; ++kind) {
      for (int k : {1, 3, 300 > 256 ? 256 : 300}) {
        CAPTURE(vocab);
        CAPTURE(kind);
        CAPTURE(k);
        const std::size_t rows = 3;
        std::vector<T> z;
        std::vector<troll::token_id> sampled(rows);
        for (std::size_t r = 0; r < rows; ++r) {
          std::vector<T> row = dense_row<T>(g, vocab, kind + int(r));
          // The sampled token: a masked one where there is one (r = 0), else the last token.
          sampled[r] = troll::token_id(vocab - 1);
          if (r == 0)
            for (std::size_t i = 0; i < vocab; ++i)
              if (!std::isfinite(double(row[i])) && std::isfinite(double(row[(i + 1) % vocab]))) sampled[r] = troll::token_id(i);
          z.insert(z.end(), row.begin(), row.end());
        }
        // Cuts: every token its own shard for small V; else random, including a shard of masks.
        std::vector<std::size_t> cuts{0};
        if (vocab <= 17) {
          for (std::size_t i = 1; i <= vocab; ++i) cuts.push_back(i);
        } else {
          std::uniform_int_distribution<std::size_t> c(1, vocab - 1);
          std::vector<std::size_t> inner{c(g), c(g), c(g), 1, vocab - 1};
          std::sort(inner.begin(), inner.end());
          inner.erase(std::unique(inner.begin(), inner.end()), inner.end());
          for (std::size_t x : inner) cuts.push_back(x);
          cuts.push_back(vocab);
        }
        for (double delta : {0.0, 1e-5, 0.5}) {
          check_shards<T>(z, rows, vocab, cuts, sampled.data(), troll::sparsify_options{k, delta}, g);
          check_shards<T>(z, rows, vocab, cuts, nullptr, troll::sparsify_options{k, delta}, g);
        }
      }
    }
  }
}

/// Rows whose largest logits are huge (float's ±3e38 tied at the top, rows mixing 3e38 and
/// −3e38, −FLT_MAX masks, 1e30; in double 1e12 with O(1) gaps, ±1e300): every sparse entry point
/// against the dense definition in long double (log-softmax relative to the row's max).
template <class T>
std::vector<std::vector<T>> huge_rows() {
  std::vector<std::vector<T>> rows;
  if constexpr (sizeof(T) == sizeof(float)) {
    const float big = 3e38f, top = std::numeric_limits<float>::max(), low = std::numeric_limits<float>::lowest();
    rows.push_back({big, big, -big, 1.5e38f, big, 0.0f, -1.0f});
    rows.push_back({top, low, top, low, low, top, low});              // ties at FLT_MAX, −FLT_MAX masks
    rows.push_back({-big, -big, -big, -big, -big, -big, -big});      // all tied at −3e38
    rows.push_back({1e30f, std::nextafter(1e30f, 0.0f), 1e30f, -1e30f, 0.0f, low, 1e29f});
    rows.push_back({low, low, 7.0f, low, 6.5f, low, 5.0f});            // −FLT_MAX masks, ordinary top
    rows.push_back({-big, 3.0f, 1.0f, big, -1e30f, 2.0f, big});
  } else {
    rows.push_back({1e12, 1e12 + 0.5, 1e12 - 1.0, 1e12 + 2.0, 1e12 - 3.5, 1e12 + 0.25, 1e12 - 40.0});
    rows.push_back({-1e12, -1e12 + 1.5, -1e12 - 0.75, -1e12 + 3.0, -1e12, -1e12 - 2.0, -1e12 + 0.125});
    rows.push_back({1e300, 1e300, -1e300, 0.0, 1e300, -1.0, 5e299});
    rows.push_back({3e38, 3e38, -3e38, 1.5e38, 3e38, 0.0, -1.0});
    rows.push_back({1e30, 1e30 + 2 * 1.40737488355328e14, 1e30, -1e30, 0.0, -1e30, 1e30});
    rows.push_back({-std::numeric_limits<double>::max() / 4, 7.0, -std::numeric_limits<double>::max() / 4, 6.5, 5.0,
                    -1e300, 4.0});
  }
  return rows;
}

/// log-softmax of z in long double, relative to the row's max (the dense definition).
template <class T>
std::vector<ld> log_softmax_ld(const std::vector<T>& z) {
  ld m = -ld_inf;
  for (T x : z) m = std::max(m, ld(x));
  std::vector<ld> d(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) d[i] = ld(z[i]) - m;
  const ld total = lse(d);
  for (ld& x : d) x -= total;
  return d;
}

/// The tolerance of one log-probability in T: a few ulps of the log-probability scale.
template <class T>
bool close_lp(T got, ld want) {
  return close<T>(ld(got), want, 1.0, 8);
}

TEST_CASE_TEMPLATE("huge logits: every sparse entry point is exact to a few ulps of the log-probability (±3e38 ties, 1e30, 1e12, −FLT_MAX masks)", T, float, double) {
  // Formerly a documented limit (the log-sum held as an absolute double lost |z_max|·2⁻⁵³, and
  // float's tied ±3e38 tokens collapsed to log-probability 0 with the row's mass wrong). The
  // values are now formed relative to the row's largest logit (detail::row_log_sums).
  std::mt19937_64 g(77);
  const std::vector<std::vector<T>> rows = huge_rows<T>();
  const std::size_t vocab = rows[0].size(), n_rows = rows.size();
  std::vector<T> z;
  for (const auto& r : rows) z.insert(z.end(), r.begin(), r.end());
  const auto logits = troll::make_batch<const T>(z.data(), n_rows, vocab);
  for (int k : {1, 3, 5}) {
    for (double delta : {0.0, 0.1}) {
      for (bool with_sampled : {false, true}) {
        CAPTURE(k);
        CAPTURE(delta);
        CAPTURE(with_sampled);
        const troll::sparsify_options opt{k, delta};
        std::vector<troll::token_id> sampled(n_rows);
        for (std::size_t r = 0; r < n_rows; ++r) sampled[r] = troll::token_id((3 * r + 2) % vocab);
        const troll::token_id* smp = with_sampled ? sampled.data() : nullptr;
        // sparsify against the dense definition: values, remainder and mass.
        sparse_rows<T> sp(n_rows, std::size_t(k) + 1, vocab);
        troll::sparsify(troll::cpu, logits, smp, opt, sp.view());
        for (std::size_t r = 0; r < n_rows; ++r) {
          CAPTURE(r);
          const std::vector<ld> lp = log_softmax_ld(rows[r]);
          std::vector<int> support;
          for (int i = 0; i < sp.counts[r]; ++i) support.push_back(sp.indices[r * sp.k_max + std::size_t(i)]);
          REQUIRE(!support.empty());
          // The support holds the K largest logits (ties to the lower index) at least.
          const oracle_row o = gather(rows[r], support);
          double mass = 0.0;
          for (std::size_t i = 0; i < support.size(); ++i) {
            const T got = sp.log_probs[r * sp.k_max + i];
            CHECK(close_lp<T>(got, lp[std::size_t(support[i])]));
            CHECK(close_lp<T>(got, o.lp[i]));
            mass += std::exp(double(got));
          }
          CHECK(close_lp<T>(sp.log_remainder[r], o.log_r));
          mass += std::exp(double(sp.log_remainder[r]));
          CHECK(std::fabs(mass - 1.0) <= troll::sparse_mass_tolerance<T>());
        }
        // Vocabulary shards (2 and 3 pieces): bit for bit the whole-row sparsify, and the shards'
        // backward bit for bit sparsify_backward (check_shards).
        check_shards<T>(z, n_rows, vocab, {0, 3, vocab}, smp, opt, g);
        check_shards<T>(z, n_rows, vocab, {0, 1, 5, vocab}, smp, opt, g);
        // sparsify_backward against the formula in long double from the dense probabilities.
        sparse_grads<T> up(n_rows, sp.k_max);
        std::normal_distribution<double> n01(0.0, 1.0);
        for (auto& x : up.log_probs) x = T(n01(g));
        for (auto& x : up.log_remainder) x = T(n01(g));
        std::vector<T> gz(n_rows * vocab, T(9));
        troll::sparsify_backward(troll::cpu, logits, troll::sparse_input<T>(sp.view()),
                                 troll::sparse_grad_input<T>(up.view()), troll::make_batch(gz.data(), n_rows, vocab));
        for (std::size_t r = 0; r < n_rows; ++r) {
          const std::vector<ld> lp = log_softmax_ld(rows[r]);
          std::vector<char> in(vocab, 0);
          // An entry whose sparse value is −inf is a masked output (docs/api.md): its upstream g
          // is ignored. Here that is float's sampled −3e38 beside +3e38 tokens, whose
          // log-probability −6e38 rounds to −inf in the stored row.
          auto counted = [&](int i) {
            const std::size_t at = r * sp.k_max + std::size_t(i);
            return sp.log_probs[at] > -std::numeric_limits<T>::infinity() ? ld(up.log_probs[at]) : ld(0);
          };
          ld sum_g = up.log_remainder[r];
          for (int i = 0; i < sp.counts[r]; ++i) {
            in[std::size_t(sp.indices[r * sp.k_max + std::size_t(i)])] = 1;
            sum_g += counted(i);
          }
          // p_k / r: the tail's own softmax, relative to the tail's max (at ±3e38 even long
          // double keeps none of the tail's shape in lp_k − log r).
          ld m_tail = -ld_inf;
          for (std::size_t j = 0; j < vocab; ++j)
            if (!in[j]) m_tail = std::max(m_tail, ld(rows[r][j]));
          std::vector<ld> tail;
          for (std::size_t j = 0; j < vocab; ++j)
            if (!in[j]) tail.push_back(ld(rows[r][j]) - m_tail);
          const ld log_t = m_tail > -ld_inf ? lse(tail) : -ld_inf;
          ld scale = 1;
          std::vector<ld> want(vocab);
          for (std::size_t j = 0; j < vocab; ++j) {
            const ld p = std::exp(lp[j]);
            want[j] = -p * sum_g;
            if (!in[j] && log_t > -ld_inf)
              want[j] += ld(up.log_remainder[r]) * std::exp((ld(rows[r][j]) - m_tail) - log_t);
            scale = std::max(scale, std::fabs(want[j]));
          }
          for (int i = 0; i < sp.counts[r]; ++i) want[std::size_t(sp.indices[r * sp.k_max + std::size_t(i)])] += counted(i);
          for (std::size_t j = 0; j < vocab; ++j) {
            CAPTURE(r);
            CAPTURE(j);
            CHECK(std::fabs(double(gz[r * vocab + j]) - double(want[j])) <= 16 * ulp<T>() * double(scale));
          }
        }
        // align(new_logits, new_support = the sparsified rows, old): the new side on U gathered
        // exactly, its bucket the exact tail.
        sparse_rows<T> old(n_rows, 4, vocab);
        for (std::size_t r = 0; r < n_rows; ++r) put_row(old, r, gather(rows[r], {int((r + 1) % vocab)}));
        aligned_rows<T> al(n_rows, 16, vocab);
        troll::align(troll::cpu, logits, troll::sparse_batch_view<const T>(sp.view()), old.view(), al.view());
        for (std::size_t r = 0; r < n_rows; ++r) {
          CAPTURE(r);
          std::vector<int> u;
          for (int i = 0; i < al.counts[r]; ++i) u.push_back(al.indices[r * al.k_max + std::size_t(i)]);
          const oracle_row o = gather(rows[r], u);
          double mass = std::exp(double(al.new_log_remainder[r]));
          for (std::size_t i = 0; i < u.size(); ++i) {
            CHECK(close_lp<T>(al.new_log_probs[r * al.k_max + i], o.lp[i]));
            mass += std::exp(double(al.new_log_probs[r * al.k_max + i]));
          }
          CHECK(close_lp<T>(al.new_log_remainder[r], o.log_r));
          CHECK(std::fabs(mass - 1.0) <= troll::sparse_mass_tolerance<T>());
        }
      }
    }
  }
}

TEST_CASE("huge logits: sparsify_backward on a row at 1e12 matches central differences of the long-double definition") {
  // Finite differences are meaningful at 1e12 in long double (ulp 2⁻²⁴ there, step 2⁻¹⁰).
  const std::vector<double> z = huge_rows<double>()[0];
  const std::size_t vocab = z.size();
  sparse_rows<double> sp(1, 4, vocab);
  troll::sparsify(troll::cpu, troll::make_batch<const double>(z.data(), 1, vocab), nullptr, {3, 0.0}, sp.view());
  std::vector<int> support;
  for (int i = 0; i < sp.counts[0]; ++i) support.push_back(sp.indices[std::size_t(i)]);
  sparse_grads<double> up(1, 4);
  for (std::size_t i = 0; i < 4; ++i) up.log_probs[i] = 0.3 * double(i) - 0.7;
  up.log_remainder[0] = 1.25;
  // L(z) = Σ_S g_i log p_i + g_R log r, in long double.
  auto loss = [&](const std::vector<ld>& x) {
    ld m = -ld_inf;
    for (ld v : x) m = std::max(m, v);
    std::vector<ld> d(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) d[i] = x[i] - m;
    const ld total = lse(d);
    std::vector<char> in(x.size(), 0);
    ld l = 0;
    for (std::size_t i = 0; i < support.size(); ++i) {
      in[std::size_t(support[i])] = 1;
      l += ld(up.log_probs[i]) * (d[std::size_t(support[i])] - total);
    }
    std::vector<ld> tail;
    for (std::size_t j = 0; j < x.size(); ++j)
      if (!in[j]) tail.push_back(d[j]);
    return l + ld(up.log_remainder[0]) * (lse(tail) - total);
  };
  std::vector<double> gz(vocab);
  troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(z.data(), 1, vocab),
                           troll::sparse_input<double>(sp.view()), troll::sparse_grad_input<double>(up.view()),
                           troll::make_batch(gz.data(), 1, vocab));
  for (std::size_t j = 0; j < vocab; ++j) {
    std::vector<ld> a(z.begin(), z.end()), b(z.begin(), z.end());
    const ld h = 1.0L / 1024;  // exact at 1e12 in long double (ulp 2⁻²⁴)
    a[j] += h, b[j] -= h;
    const ld fd = (loss(a) - loss(b)) / (a[j] - b[j]);
    CAPTURE(j);
    CHECK(std::fabs(double(fd) - gz[j]) <= 1e-6 * (1 + std::fabs(gz[j])));
  }
}

TEST_CASE_TEMPLATE("sparsify_backward: tail entries where the bucket holds nearly all the mass", T, double, float) {
  // The thirty-sixth session's sparse-derivative audit: logits (−gap, 0, −gap − 1) with the
  // support {0} and only the bucket's upstream g_R = 1, so G = g_R and a tail token's entry is
  // p_k (g_R / r − G) = p_k p_0 / r with r = 1 − p_0. Formed as p_k (e^{−log r} − 1) it came out 0
  // for 4.2e-18 at a gap of 40 (5.6% off at 35); now p_k (g_R expm1(−log r) − (G − g_R)).
  for (const double gap : {30.0, 35.0, 40.0}) {
    if (!std::is_same<T, double>::value && gap > 35.0) continue;  // float: p_0 ~ 1e-18 is fine, but keep to its range
    CAPTURE(gap);
    const std::vector<T> z = {T(-gap), T(0), T(-gap - 1)};
    const ld lse = std::log(std::exp(ld(z[0])) + 1 + std::exp(ld(z[2])));
    const ld p0 = std::exp(ld(z[0]) - lse), p1 = std::exp(ld(z[1]) - lse), p2 = std::exp(ld(z[2]) - lse);
    const ld r = p1 + p2;
    sparse_rows<T> sp(1, 1, 3);
    sp.indices[0] = 0;
    sp.counts[0] = 1;
    sp.log_probs[0] = T(std::log(p0));
    sp.log_remainder[0] = T(std::log(r));
    sparse_grads<T> up(1, 1);
    up.log_remainder[0] = T(1);
    std::vector<T> gz(3);
    troll::sparsify_backward(troll::cpu, troll::make_batch<const T>(z.data(), 1, 3),
                             troll::sparse_input<T>(static_cast<const sparse_rows<T>&>(sp).view()),
                             troll::sparse_grad_input<T>(up.view()), troll::make_batch(gz.data(), 1, 3));
    const std::vector<ld> want = {-p0, p1 * p0 / r, p2 * p0 / r};
    const double tol = std::is_same<T, double>::value ? 1e-13 : 1e-6;
    for (std::size_t j = 0; j < 3; ++j) {
      CAPTURE(j);
      CHECK(std::fabs(ld(gz[j]) - want[j]) <= ld(tol) * std::fabs(want[j]));
    }
  }
}

// The objectives on adversarial batches (oracle loss, gradients by central differences, zero
// masks), one body for every backend (also compiled for troll::cuda by
// tests/cuda/test_cuda_objectives.cu).
#include "../bodies/adversarial_objectives.hpp"

TEST_CASE("bad input: the lowest bad row is named and no output is touched (sparse entry points, objectives)") {
  std::mt19937_64 g(61);
  const std::size_t vocab = 17, rows = 4;
  aligned_rows<double> a = make_aligned<double>(g, vocab, rows, 0);
  // Rows 1 and 3 bad (NaN): row 1 named, outputs untouched.
  aligned_rows<double> bad = a;
  bad.new_log_probs[1 * bad.k_max] = std::nan("");
  bad.old_log_remainder[3] = std::nan("");
  sparse_rows<double> out(rows, a.k_max, vocab);
  const sparse_rows<double> fresh = out;
  std::vector<troll::projection_stats> st(rows);
  troll_test::expect_row_error<troll::domain_error>(
      [&] { troll::project(troll::cpu.with_threads(2), troll::aligned_input<double>(bad.view()), 0.05, out.view(), st.data()); }, 1);
  CHECK(out.log_probs == fresh.log_probs);
  CHECK(out.indices == fresh.indices);
  CHECK(out.counts == fresh.counts);
  std::vector<double> kl(rows, -3.0);
  troll_test::expect_row_error<troll::domain_error>(
      [&] { troll::kl(troll::cpu, troll::aligned_input<double>(bad.view()), kl.data()); }, 1);
  for (double x : kl) CHECK(x == -3.0);
  // ε out of range.
  for (double eps : {0.0, -1.0, inf, std::nan("")})
    CHECK_THROWS_AS(troll::project(troll::cpu, troll::aligned_input<double>(a.view()), eps, out.view(), st.data()),
                    troll::domain_error);
  CHECK(out.log_probs == fresh.log_probs);
  // align: a duplicate index in row 2 of the old rows.
  sparse_rows<double> sa(rows, 4, vocab), sb(rows, 4, vocab);
  std::vector<double> z(vocab);
  for (std::size_t i = 0; i < vocab; ++i) z[i] = double(i % 5);
  for (std::size_t r = 0; r < rows; ++r) put_row(sa, r, gather(z, {1, 2})), put_row(sb, r, gather(z, {3, 4}));
  sb.indices[2 * sb.k_max + 1] = 3;
  aligned_rows<double> ao(rows, 8, vocab);
  const aligned_rows<double> ao_fresh = ao;
  troll_test::expect_row_error<troll::shape_error>([&] { troll::align(troll::cpu, sa.view(), sb.view(), ao.view()); }, 2);
  CHECK(ao.indices == ao_fresh.indices);
  CHECK(ao.new_log_probs == ao_fresh.new_log_probs);
  // sparsify_shard_backward: a NaN gradient in row 3, log-sums NaN in row 2 → row 2 named first?
  // (log-sums are checked before gradients; each check names its lowest bad row.)
  sparse_rows<double> sup(rows, 4, vocab);
  for (std::size_t r = 0; r < rows; ++r) put_row(sup, r, gather(z, {4}));
  std::vector<double> logits(rows * vocab);
  for (std::size_t r = 0; r < rows; ++r) std::copy(z.begin(), z.end(), logits.begin() + std::ptrdiff_t(r * vocab));
  sparse_grads<double> up(rows, 4);
  up.log_probs[3 * 4] = std::nan("");
  std::vector<double> log_sums(troll::sparsify_log_sums_width * rows, 5.0);
  std::vector<double> gs(rows * vocab, 11.0);
  troll_test::expect_row_error<troll::domain_error>(
      [&] {
        troll::sparsify_shard_backward(troll::cpu, troll::make_batch<const double>(logits.data(), rows, vocab), 0,
                                       sup.view(), troll::sparse_grad_input<double>(up.view()), log_sums.data(),
                                       troll::make_batch(gs.data(), rows, vocab));
      },
      3);
  for (double x : gs) CHECK(x == 11.0);
  // Objectives: a token out of range in row 2 and a NaN advantage in row 3.
  std::vector<double> zn(rows * vocab), zo(rows * vocab), adv{1, 1, 1, std::nan("")};
  for (std::size_t i = 0; i < rows * vocab; ++i) zn[i] = double(i % 7), zo[i] = double(i % 5);
  std::vector<troll::token_id> tok{0, 1, troll::token_id(vocab), 2};
  troll::token_batch<double> in;
  in.tokens = tok.data();
  in.advantages = adv.data();
  std::vector<double> loss(rows, -9.0), lp(rows * vocab, -9.0), grad(rows * vocab, -9.0);
  std::vector<troll::projection_stats> ost(rows);
  troll::objective_metrics met;
  troll_test::expect_row_error<troll::domain_error>(
      [&] {
        troll::objective_forward(troll::cpu, troll::trust_region_objective{}, troll::make_batch<const double>(zn.data(), rows, vocab),
                                 troll::make_batch<const double>(zo.data(), rows, vocab), in,
                                 troll::make_batch(lp.data(), rows, vocab), ost.data(), loss.data(), &met);
      },
      2);
  for (double x : loss) CHECK(x == -9.0);
  for (double x : lp) CHECK(x == -9.0);
  troll_test::expect_row_error<troll::domain_error>(
      [&] {
        troll::objective_backward(troll::cpu, troll::ppo_clip_objective{}, troll::make_batch<const double>(zn.data(), rows, vocab),
                                  troll::make_batch<const double>(zo.data(), rows, vocab), in,
                                  troll::make_batch(grad.data(), rows, vocab));
      },
      2);
  for (double x : grad) CHECK(x == -9.0);
  // 0 rows: every entry point returns without touching anything.
  aligned_rows<double> empty(0, 4, vocab);
  troll::kl(troll::cpu, troll::aligned_input<double>(empty.view()), static_cast<double*>(nullptr));
}

TEST_CASE_TEMPLATE("align(logits, new_support, old) reads new_support's ids and counts only; sparsify_backward refuses a NaN support value", T, float, double) {
  // docs/sparse.md "Mass tolerance": new_support's values are never read, so any values (NaN,
  // +inf, above 0, unset) give the same aligned rows bit for bit, while its ids are checked.
  // sparsify_backward reads which support values are −inf, so NaN or above 0 there is refused.
  const std::size_t vocab = 23, rows = 3;
  std::vector<T> z(rows * vocab);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = T(0.37 * double((i * 7) % 11) - 1.1);
  const auto logits = troll::make_batch<const T>(z.data(), rows, vocab);
  sparse_rows<T> support(rows, 6, vocab), old(rows, 6, vocab);
  troll::sparsify(troll::cpu, logits, nullptr, {4, 0.0}, support.view());
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> row(z.begin() + std::ptrdiff_t(r * vocab), z.begin() + std::ptrdiff_t((r + 1) * vocab));
    for (double& x : row) x = -x;
    put_row(old, r, gather(row, {int(r), int(r + 5), int(r + 9)}));
  }
  aligned_rows<T> want(rows, 12, vocab);
  troll::align(troll::cpu, logits, troll::sparse_input<T>(support.view()), troll::sparse_input<T>(old.view()), want.view());
  for (const double value : {std::nan(""), inf, 0.5, -inf, 3e38}) {
    CAPTURE(value);
    sparse_rows<T> odd = support;
    for (T& x : odd.log_probs) x = T(value);
    for (T& x : odd.log_remainder) x = T(value);
    aligned_rows<T> got(rows, 12, vocab);
    troll::align(troll::cpu, logits, troll::sparse_input<T>(odd.view()), troll::sparse_input<T>(old.view()), got.view());
    CHECK(got.indices == want.indices);
    CHECK(got.counts == want.counts);
    CHECK(std::memcmp(got.new_log_probs.data(), want.new_log_probs.data(), got.new_log_probs.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(got.old_log_probs.data(), want.old_log_probs.data(), got.old_log_probs.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(got.new_log_remainder.data(), want.new_log_remainder.data(), rows * sizeof(T)) == 0);
    CHECK(std::memcmp(got.old_log_remainder.data(), want.old_log_remainder.data(), rows * sizeof(T)) == 0);
  }
  // Its ids are still checked: a repeated id in row 1 is named, nothing written.
  sparse_rows<T> repeated = support;
  repeated.indices[1 * repeated.k_max + 1] = repeated.indices[1 * repeated.k_max];
  aligned_rows<T> untouched(rows, 12, vocab);
  const aligned_rows<T> fresh = untouched;
  troll_test::expect_row_error<troll::shape_error>(
      [&] {
        troll::align(troll::cpu, logits, troll::sparse_input<T>(repeated.view()), troll::sparse_input<T>(old.view()),
                     untouched.view());
      },
      1);
  CHECK(untouched.indices == fresh.indices);
  CHECK(untouched.new_log_probs == fresh.new_log_probs);
  // sparsify_backward: a NaN value at row 2's support entry 0 is refused, nothing written.
  sparse_rows<T> nan_value = support;
  nan_value.log_probs[2 * nan_value.k_max] = T(std::nan(""));
  sparse_grads<T> up(rows, 6);
  for (T& x : up.log_probs) x = T(0.25);
  for (T& x : up.log_remainder) x = T(-0.5);
  std::vector<T> grad(rows * vocab, T(7));
  troll_test::expect_rejected<troll::domain_error>(
      [&] {
        troll::sparsify_backward(troll::cpu, logits, troll::sparse_input<T>(nan_value.view()),
                                 troll::sparse_grad_input<T>(up.view()), troll::make_batch(grad.data(), rows, vocab));
      },
      2, "support");
  for (T x : grad) CHECK(x == T(7));
}
