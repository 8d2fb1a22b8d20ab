// tests/support/sparse_objective_cases.hpp — what the sparse-objective tests share: a batch of
// dense new logits against sparse old rows (sparse_case, make_sparse_case), the aggregation weights from
// their definition, TROLL with tight projection options, one row through troll's public sparse
// pieces with lumped log p̃ in long double (oracle_forward), the loss evaluated without
// sparse_objectives.hpp against a frozen π* (loss_frozen), and the CPU's fused forward + backward
// (run_sparse). Used by tests/test_sparse_objectives.cpp and the gradient body
// tests/bodies/sparse_objective_gradients.hpp. Include after doctest (loss_frozen REQUIREs).
#pragma once

#include <troll/objectives.hpp>
#include <troll/sparse_objectives.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "grad_helpers.hpp"
#include "token_fields.hpp"
#include "sparse_oracle.hpp"
#include "special_values.hpp"

namespace troll_test {
namespace sparse_objective_cases {

using sparse_test::aligned_rows;
using sparse_test::ld;
using sparse_test::sparse_rows;

using troll_test::nan_value;
// A fixed thread count: the default (0 = every hardware thread) asks the OS on each call, which
// dominates the thousands of tiny calls of a finite-difference check.
const troll::cpu_policy cpu = troll::cpu.with_threads(2);
using troll_test::minus_inf;

/// A batch: dense new logits (the variable), dense old logits and the sparse old rows made from
/// them with the sampled tokens kept, and the token data.
struct sparse_case : token_fields {
  std::size_t rows = 0, vocab = 0, old_k = 0;
  std::vector<double> new_logits, old_logits;
  sparse_rows<double> old;
  /// Row r of the old sparse rows as a one-row batch.
  troll::sparse_batch_view<const double> old_row(std::size_t r) const {
    return {old.indices.data() + r * old.k_max,
            old.log_probs.data() + r * old.k_max,
            old.counts.data() + r,
            old.log_remainder.data() + r,
            1,
            old.k_max,
            vocab};
  }
  /// (Re)builds the sparse old rows from old_logits with the sampled tokens kept.
  void sparsify_old(const troll::sparsify_options& options) {
    old = sparse_rows<double>(rows, std::size_t(options.k) + 1, vocab);
    std::vector<troll::token_id> sampled(tokens.begin(), tokens.end());
    troll::sparsify(cpu, troll::make_batch(old_logits.data(), rows, vocab), sampled.data(), options,
                    old.view());
  }
};

/// N rows over V tokens: old logits 2·N(0,1); new = old + step·N(0,1), steps cycling through
/// small (inactive at ε = 0.05) and large (projected) values. Rows r ≡ 0 (mod 3) sample a token
/// ranked low in the old row (sparsify adds it), the others one of its top tokens. Three
/// sequences; mask 0 on rows r ≡ 4 (mod 5).
inline sparse_case make_sparse_case(std::size_t rows, std::size_t vocab, std::uint64_t seed, int old_k = 6,
                      double old_delta = 1e-3) {
  grad_helpers::rng g(seed);
  sparse_case c;
  c.rows = rows;
  c.vocab = vocab;
  c.new_logits.resize(rows * vocab);
  c.old_logits.resize(rows * vocab);
  const double steps[4] = {0.03, 0.9, 1.6, 0.5};
  for (std::size_t r = 0; r < rows; ++r) {
    double* zo = c.old_logits.data() + r * vocab;
    double* zn = c.new_logits.data() + r * vocab;
    for (std::size_t j = 0; j < vocab; ++j) {
      zo[j] = 2.0 * g.normal();
      zn[j] = zo[j] + steps[r % 4] * g.normal();
    }
    std::vector<std::size_t> order(vocab);
    for (std::size_t j = 0; j < vocab; ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return zo[a] > zo[b]; });
    c.tokens.push_back(std::int64_t(r % 3 == 0 ? order[vocab - 3] : order[r % 4]));
    c.advantages.push_back(r % 3 == 0 ? -0.8 : 1.1 + 0.1 * double(r));
    c.mask.push_back(r % 5 == 4 ? 0.0 : (r % 2 ? 1.0 : 0.5));
    c.sequence_ids.push_back(std::int64_t(r * 3 / rows));
  }
  c.old_k = std::size_t(old_k) + 1;
  c.sparsify_old({old_k, old_delta});
  return c;
}

/// The aggregation weights c_r from their definition (not by troll).
inline std::vector<double> weights_of(const sparse_case& c) {
  const std::size_t n = c.rows;
  std::vector<double> w(n, 0.0);
  auto m = [&](std::size_t r) { return c.mask.empty() ? 1.0 : c.mask[r]; };
  if (c.aggregation == troll::loss_aggregation::token_mean) {
    double total = 0;
    for (std::size_t r = 0; r < n; ++r) total += m(r);
    for (std::size_t r = 0; r < n; ++r) w[r] = total > 0 ? m(r) / total : 0.0;
    return w;
  }
  std::vector<std::int64_t> ids;
  for (std::int64_t id : c.sequence_ids)
    if (ids.empty() || ids.back() != id) ids.push_back(id);
  auto total_of = [&](std::int64_t id) {
    double total = 0;
    for (std::size_t r = 0; r < n; ++r)
      if (c.sequence_ids[r] == id) total += m(r);
    return total;
  };
  double counted = 0;
  for (std::int64_t id : ids) counted += total_of(id) > 0 ? 1 : 0;
  for (std::size_t r = 0; r < n; ++r) {
    const double total = total_of(c.sequence_ids[r]);
    if (total > 0) w[r] = m(r) / total / counted;
  }
  return w;
}

inline troll::sparse_trust_region_objective objective(double alpha,
                                               troll::sparsify_options new_support = {5, 0.0}) {
  troll::sparse_trust_region_objective o;
  o.alpha = alpha;
  o.projection = grad_helpers::tight_options();
  o.new_support = new_support;
  return o;
}

/// One row through troll's public sparse pieces at new logits x (V entries): U, log π* on U and
/// the bucket (last), and the lumped log p̃ in long double (same order).
struct oracle_row {
  std::vector<troll::sparse_index> support;
  std::vector<double> log_pi;
  std::vector<ld> log_p;
  troll::projection_stats stats;
};

inline oracle_row oracle_forward(const sparse_case& c, std::size_t r, const double* x,
                          const troll::sparse_trust_region_objective& o) {
  const std::size_t V = c.vocab;
  const int k = o.new_support.k;
  sparse_rows<double> support(1, std::size_t(std::max(k, 1)), V);
  troll::sparse_batch_view<const double> support_view{};
  if (k > 0) {
    troll::sparsify(cpu, troll::make_batch(x, 1, V), nullptr, o.new_support, support.view());
    support_view = support.view();
  }
  const std::size_t cap = c.old.k_max + std::size_t(k);
  aligned_rows<double> al(1, cap, V);
  troll::align(cpu, troll::make_batch(x, 1, V), support_view, c.old_row(r), al.view());
  sparse_rows<double> out(1, cap, V);
  oracle_row row;
  troll::project(cpu, al.view(), o.eps, out.view(), &row.stats, o.projection);
  const std::size_t u = std::size_t(al.counts[0]);
  row.support.assign(al.indices.begin(), al.indices.begin() + long(u));
  row.log_pi.assign(out.log_probs.begin(), out.log_probs.begin() + long(u));
  row.log_pi.push_back(out.log_remainder[0]);
  std::vector<ld> all(x, x + V), tail;
  std::vector<char> in_u(V, 0);
  for (troll::sparse_index i : row.support) in_u[std::size_t(i)] = 1;
  for (std::size_t j = 0; j < V; ++j)
    if (!in_u[j]) tail.push_back(ld(x[j]));
  const ld total = sparse_test::log_sum_exp(all);
  for (troll::sparse_index i : row.support) row.log_p.push_back(ld(x[i]) - total);
  row.log_p.push_back(tail.empty() ? -std::numeric_limits<ld>::infinity()
                                   : sparse_test::log_sum_exp(tail) - total);
  return row;
}

/// The old log-probability of token a in row r (from the sparse old row).
inline double old_log_prob(const sparse_case& c, std::size_t r, std::int64_t a) {
  for (int i = 0; i < c.old.counts[r]; ++i)
    if (c.old.indices[r * c.old.k_max + std::size_t(i)] == a)
      return c.old.log_probs[r * c.old.k_max + std::size_t(i)];
  return nan_value;
}

/// The batch loss at new logits x, evaluated without sparse_objectives.hpp; the regression term
/// uses `frozen` (log π* per row at the base point: on U, then the bucket) — stopgrad as finite
/// differences see it. Rows with weight 0 are skipped.
inline double loss_frozen(const sparse_case& c, const double* x,
                   const troll::sparse_trust_region_objective& o,
                   const std::vector<std::vector<double>>& frozen) {
  const std::vector<double> w = weights_of(c);
  ld loss = 0;
  for (std::size_t r = 0; r < c.rows; ++r) {
    if (w[r] == 0.0) continue;
    const oracle_row row = oracle_forward(c, r, x + r * c.vocab, o);
    REQUIRE(frozen[r].size() == row.log_pi.size());
    const std::size_t a = std::size_t(
        std::find(row.support.begin(), row.support.end(), troll::sparse_index(c.tokens[r])) -
        row.support.begin());
    const ld ratio = std::exp(ld(row.log_pi[a]) - ld(old_log_prob(c, r, c.tokens[r])));
    ld kl = 0;
    for (std::size_t i = 0; i < row.log_p.size(); ++i)
      if (row.log_p[i] > -std::numeric_limits<ld>::infinity())
        kl += std::exp(row.log_p[i]) * (row.log_p[i] - ld(frozen[r][i]));
    loss += ld(w[r]) * (-ratio * ld(c.advantages[r]) + ld(o.alpha) * kl);
  }
  return double(loss);
}

/// Everything objective_forward / objective_backward (sparse) write.
template <class T>
struct sparse_run {
  aligned_rows<T> aligned;
  sparse_rows<T> log_probs;
  std::vector<troll::projection_stats> stats;
  std::vector<T> token_loss, grad;
  troll::objective_metrics metrics;
};

template <class T>
sparse_run<T> run_sparse(const sparse_case& c, const T* x, const sparse_rows<T>& old,
                         const troll::token_batch<T>& batch,
                         const troll::sparse_trust_region_objective& o, double grad_loss = 1.0) {
  const std::size_t N = c.rows, V = c.vocab, cap = old.k_max + std::size_t(o.new_support.k);
  sparse_run<T> run{aligned_rows<T>(N, cap, V),
                    sparse_rows<T>(N, cap, V),
                    std::vector<troll::projection_stats>(N),
                    std::vector<T>(N),
                    std::vector<T>(N * V),
                    {}};
  run.metrics = troll::objective_forward(cpu, o, troll::make_batch(x, N, V), old.view(), batch,
                                         run.aligned.view(), run.log_probs.view(), run.stats.data(),
                                         run.token_loss.data());
  troll::objective_backward(cpu, o, troll::make_batch(x, N, V), run.aligned.view(), batch,
                            run.log_probs.view(), run.stats.data(),
                            troll::make_batch(run.grad.data(), N, V), grad_loss);
  return run;
}

inline sparse_run<double> run_sparse(const sparse_case& c, const troll::sparse_trust_region_objective& o,
                              const double* x = nullptr) {
  return run_sparse<double>(c, x ? x : c.new_logits.data(), c.old, c.batch(), o);
}

/// The gap between the k-th and (k+1)-th largest logit of each new row: S_new must not change
/// within a finite-difference step.
inline double min_rank_gap(const sparse_case& c, int k) {
  double gap = 1e300;
  for (std::size_t r = 0; r < c.rows; ++r) {
    std::vector<double> z(c.new_logits.begin() + long(r * c.vocab),
                          c.new_logits.begin() + long((r + 1) * c.vocab));
    std::sort(z.begin(), z.end(), std::greater<double>());
    gap = std::min(gap, z[std::size_t(k) - 1] - z[std::size_t(k)]);
  }
  return gap;
}

}  // namespace sparse_objective_cases
}  // namespace troll_test
