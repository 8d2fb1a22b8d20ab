// tests/support/sparse_oracle.hpp — independent long-double references for the sparse path
// (sort-everything sparsify, bisection projection of small dense rows) and owners of sparse
// batches for tests. Written from math.md §4 without troll's kernels.
#pragma once

#include <troll/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "special_values.hpp"

namespace sparse_test {

using ld = long double;
using troll_test::minus_inf;

/// Owns the buffers of a padded sparse batch.
template <class T>
struct sparse_rows {
  std::vector<troll::sparse_index> indices, counts;
  std::vector<T> log_probs, log_remainder;
  std::size_t rows = 0, k_max = 0, vocab = 0;

  sparse_rows() = default;
  sparse_rows(std::size_t n, std::size_t k, std::size_t v)
      : indices(n * k, -7), counts(n, -7), log_probs(n * k, T(-7)), log_remainder(n, T(-7)),
        rows(n), k_max(k), vocab(v) {}
  troll::sparse_batch_view<T> view() {
    return {indices.data(), log_probs.data(), counts.data(), log_remainder.data(), rows, k_max, vocab};
  }
  troll::sparse_batch_view<const T> view() const {
    return {indices.data(), log_probs.data(), counts.data(), log_remainder.data(), rows, k_max, vocab};
  }
};

template <class T>
struct aligned_rows {
  std::vector<troll::sparse_index> indices, counts;
  std::vector<T> new_log_probs, old_log_probs, new_log_remainder, old_log_remainder;
  std::size_t rows = 0, k_max = 0, vocab = 0;

  aligned_rows() = default;
  aligned_rows(std::size_t n, std::size_t k, std::size_t v)
      : indices(n * k, -7), counts(n, -7), new_log_probs(n * k, T(-7)), old_log_probs(n * k, T(-7)),
        new_log_remainder(n, T(-7)), old_log_remainder(n, T(-7)), rows(n), k_max(k), vocab(v) {}
  troll::aligned_batch_view<T> view() {
    return {indices.data(),          counts.data(),           new_log_probs.data(),
            old_log_probs.data(),    new_log_remainder.data(), old_log_remainder.data(),
            rows,                    k_max,                   vocab};
  }
  troll::aligned_batch_view<const T> const_view() const {
    return {indices.data(),          counts.data(),           new_log_probs.data(),
            old_log_probs.data(),    new_log_remainder.data(), old_log_remainder.data(),
            rows,                    k_max,                   vocab};
  }
};

template <class T>
struct sparse_grads {
  std::vector<T> log_probs, log_remainder;
  std::size_t rows = 0, k_max = 0;
  sparse_grads(std::size_t n, std::size_t k) : log_probs(n * k, T(0)), log_remainder(n, T(0)), rows(n), k_max(k) {}
  troll::sparse_grad_view<T> view() { return {log_probs.data(), log_remainder.data(), rows, k_max}; }
};

/// log Σ exp over a list (long double).
inline ld log_sum_exp(const std::vector<ld>& v) {
  ld m = -std::numeric_limits<ld>::infinity();
  for (ld x : v) m = std::max(m, x);
  if (m == -std::numeric_limits<ld>::infinity()) return m;
  ld s = 0;
  for (ld x : v) s += std::exp(x - m);
  return m + std::log(s);
}

struct oracle_sparse_row {
  std::vector<int> indices;
  std::vector<ld> log_probs;
  ld log_remainder = 0;
};

/// Sparsify by sorting the whole row: shortest prefix with mass ≥ 1 − δ (prefix mass summed
/// forward in long double), at most k, then the sampled token (−1: none).
template <class T>
oracle_sparse_row oracle_sparsify(const T* z, std::size_t vocab, int k, double delta, int sampled) {
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ld(z[a]) > ld(z[b]); });
  std::vector<ld> all(vocab);
  for (std::size_t i = 0; i < vocab; ++i) all[i] = ld(z[i]);
  const ld total = log_sum_exp(all);
  oracle_sparse_row out;
  ld mass = 0;
  const std::size_t limit = std::min<std::size_t>(std::size_t(k), vocab);
  for (std::size_t j = 0; j < limit; ++j) {
    out.indices.push_back(order[j]);
    mass += std::exp(ld(z[order[j]]) - total);
    if (mass >= 1 - ld(delta)) break;
  }
  if (sampled >= 0 && std::find(out.indices.begin(), out.indices.end(), sampled) == out.indices.end())
    out.indices.push_back(sampled);
  std::vector<char> kept(vocab, 0);
  for (int i : out.indices) {
    kept[std::size_t(i)] = 1;
    out.log_probs.push_back(ld(z[i]) - total);
  }
  std::vector<ld> tail;
  for (std::size_t i = 0; i < vocab; ++i)
    if (!kept[i]) tail.push_back(ld(z[i]));
  out.log_remainder = log_sum_exp(tail) - total;
  return out;
}

inline std::vector<ld> log_softmax(const std::vector<ld>& z) {
  const ld s = log_sum_exp(z);
  std::vector<ld> out(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) out[i] = z[i] - s;
  return out;
}

inline ld kl(const std::vector<ld>& lp, const std::vector<ld>& lq) {
  ld sum = 0;
  for (std::size_t i = 0; i < lp.size(); ++i)
    if (lp[i] > -std::numeric_limits<ld>::infinity()) sum += std::exp(lp[i]) * (lp[i] - lq[i]);
  return sum;
}

/// The projection of a small dense row pair by bisection on t (long double); every logit finite.
inline std::vector<ld> oracle_project(const std::vector<ld>& zn, const std::vector<ld>& zo, ld eps,
                                      ld* t_out = nullptr) {
  const std::vector<ld> lq = log_softmax(zo);
  auto at = [&](ld t) {
    std::vector<ld> w(zn.size());
    for (std::size_t i = 0; i < zn.size(); ++i) w[i] = zo[i] + t * (zn[i] - zo[i]);
    return log_softmax(w);
  };
  if (kl(at(1), lq) <= eps) {
    if (t_out) *t_out = 1;
    return at(1);
  }
  ld lo = 0, hi = 1;
  for (int it = 0; it < 200; ++it) {
    const ld mid = (lo + hi) / 2;
    (kl(at(mid), lq) < eps ? lo : hi) = mid;
  }
  if (t_out) *t_out = (lo + hi) / 2;
  return at((lo + hi) / 2);
}

/// Zipf-like LLM row: logit of the token at rank j is −s·log(j + 1) + noise, ranks shuffled.
template <class T>
std::vector<T> zipf_logits(std::size_t vocab, double s, double noise, std::mt19937_64& rng) {
  std::vector<std::size_t> perm(vocab);
  std::iota(perm.begin(), perm.end(), std::size_t(0));
  std::shuffle(perm.begin(), perm.end(), rng);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<T> z(vocab);
  for (std::size_t j = 0; j < vocab; ++j) z[perm[j]] = T(-s * std::log(double(j + 1)) + noise * n01(rng));
  return z;
}

}  // namespace sparse_test
