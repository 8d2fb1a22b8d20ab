// tests/support/adversarial_sparse_rows.hpp — the adversarial sparse rows of
// tests/test_adversarial_sparse.cpp (and its shared body bodies/adversarial_sparse_backward.hpp):
// dense logits of eight kinds (huge shift, near-deterministic, ties, masks, all but one masked,
// wide spread, ±1e4), supports of their top tokens, sparse rows with exact long-double values on a
// support, and aligned pairs built from them through the CPU's troll::align.
#pragma once

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "sparse_oracle.hpp"

namespace adversarial_sparse {

using ld = long double;

/// A sparse row built by the oracle: exact long-double values on a given support.
struct oracle_row {
  std::vector<int> support;
  std::vector<ld> lp;  // on the support
  ld log_r = 0;        // bucket log-mass
};

template <class T>
oracle_row gather(const std::vector<T>& z, const std::vector<int>& support) {
  // Differences from the maximum first, so that rows at ±1e4 or ±3e38 lose nothing to the shift.
  ld m = -std::numeric_limits<ld>::infinity();
  for (T x : z) m = std::max(m, ld(x));
  std::vector<ld> all(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) all[i] = ld(z[i]) - m;
  const ld total = sparse_test::log_sum_exp(all);
  std::vector<char> in(z.size(), 0);
  oracle_row o;
  o.support = support;
  for (int i : support) in[std::size_t(i)] = 1, o.lp.push_back(all[std::size_t(i)] - total);
  std::vector<ld> tail;
  for (std::size_t i = 0; i < z.size(); ++i)
    if (!in[i]) tail.push_back(all[i]);
  o.log_r = sparse_test::log_sum_exp(tail) - total;
  return o;
}

/// Row r of `s` set to the oracle row, rounded to T.
template <class T>
void put_row(sparse_test::sparse_rows<T>& s, std::size_t r, const oracle_row& o) {
  s.counts[r] = troll::sparse_index(o.support.size());
  for (std::size_t i = 0; i < o.support.size(); ++i) {
    s.indices[r * s.k_max + i] = o.support[i];
    s.log_probs[r * s.k_max + i] = T(o.lp[i]);
  }
  s.log_remainder[r] = T(o.log_r);
}

/// Random dense logits of a given kind (kind % 8).
template <class T>
std::vector<T> dense_row(std::mt19937_64& g, std::size_t vocab, int kind) {
  const double inf = std::numeric_limits<double>::infinity();
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<T> z(vocab);
  for (auto& x : z) x = T(2 * n01(g));
  switch (kind % 8) {
    case 1:  // huge shift
      for (auto& x : z) x = T(double(x) + 1e4);
      break;
    case 2:  // near-deterministic
      z[vocab / 2] = T(double(z[vocab / 2]) + 60);
      break;
    case 3:  // ties everywhere
      for (std::size_t i = 0; i < vocab; ++i) z[i] = T(double(i % 3));
      break;
    case 4:  // masked tokens
      for (std::size_t i = 0; i < vocab; i += 3) z[i] = T(-inf);
      if (vocab >= 2)
        z[1] = T(1);
      else
        z[0] = T(0);
      break;
    case 5:  // all but one masked
      for (auto& x : z) x = T(-inf);
      z[vocab / 3] = T(0.25);
      break;
    case 6:  // a wide spread (tail mass far below one ulp)
      for (auto& x : z) x = T(double(x) * 300);
      break;
    case 7:  // float-sized extremes when T = float; double big otherwise
      for (std::size_t i = 0; i < vocab; ++i)
        z[i] = T((i % 2 ? 1e4 : -1e4) * (n01(g) > 0 ? 1 : 0.5));  // ±3e38: see the limit test
      break;
    default:
      break;
  }
  return z;
}

/// A support of size k: the k largest logits (ties to the lower index), optionally one more token.
template <class T>
std::vector<int> top_support(const std::vector<T>& z, std::size_t k, int extra = -1) {
  std::vector<int> order(z.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return z[std::size_t(a)] > z[std::size_t(b)]; });
  order.resize(std::min(k, z.size()));
  if (extra >= 0 && std::find(order.begin(), order.end(), extra) == order.end())
    order.push_back(extra);
  return order;
}

/// Aligned rows (count rows) from random adversarial dense pairs, through the oracle's exact
/// sparse rows and the CPU's troll::align.
template <class T>
sparse_test::aligned_rows<T> make_aligned(std::mt19937_64& g, std::size_t vocab, std::size_t rows,
                                          int kind0) {
  const std::size_t k_max = std::min<std::size_t>(vocab, 12) * 2 + 2;
  sparse_test::sparse_rows<T> a(rows, k_max, vocab), b(rows, k_max, vocab);
  std::uniform_int_distribution<std::size_t> pick_k(0, std::min<std::size_t>(vocab, 12));
  for (std::size_t r = 0; r < rows; ++r) {
    const int kind = kind0 + int(r);
    std::vector<T> zn = dense_row<T>(g, vocab, kind), zo = dense_row<T>(g, vocab, kind + 3);
    if (kind % 4 == 1) zo = zn;  // p == q
    if (kind % 5 == 2)           // the old row near-deterministic somewhere else
      zo[vocab - 1] = T(double(zo[vocab - 1]) + 40);
    // Masks that leave a joint support: the old row's mask never covers every finite new token.
    bool joint = false;
    for (std::size_t i = 0; i < vocab; ++i)
      joint |= std::isfinite(double(zn[i])) && std::isfinite(double(zo[i]));
    if (!joint) zo = dense_row<T>(g, vocab, 0);
    put_row(a, r, gather(zn, top_support(zn, pick_k(g))));
    put_row(b, r, gather(zo, top_support(zo, pick_k(g))));
  }
  sparse_test::aligned_rows<T> out(rows, k_max, vocab);
  troll::align(troll::cpu, a.view(), b.view(), out.view());
  return out;
}

}  // namespace adversarial_sparse
