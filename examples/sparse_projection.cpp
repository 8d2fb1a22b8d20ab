// examples/sparse_projection.cpp — the sparse TROLL projection end to end, and how far it lands
// from the dense projection on Zipf-like LLM rows (V = 151,936) as K and δ vary.
//
//   dense logits ─ sparsify ─┐
//                            ├─ align ─ project ─ (loss) ─ project_backward ─ sparsify_backward
//   old sparse row ──────────┘
//
// For each (K, δ) it prints, over a few rows: the mean support union |U|, the largest
// |log π_sparse − log π_dense| on U, the KL between the two projections over the whole
// vocabulary (the sparse one expanded with its uniform tail), and |t_sparse − t_dense|.
// docs/sparse.md holds the table this program printed.
#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t rows = 8;
constexpr double eps = 0.05;

std::vector<double> llm_row(std::mt19937_64& rng, double s) {
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<std::size_t> perm(vocab);
  std::iota(perm.begin(), perm.end(), std::size_t(0));
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> z(vocab);
  for (std::size_t j = 0; j < vocab; ++j) z[perm[j]] = -s * std::log(double(j + 1)) + 0.3 * n01(rng);
  return z;
}

/// Prints one table (see the header comment) for rows of Zipf exponent around `exponent`.
void table(double exponent, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::vector<double> row = llm_row(rng, exponent * (1.0 + 0.05 * double(r)));
    zn.insert(zn.end(), row.begin(), row.end());
    for (double v : row) zo.push_back(v + 0.5 * n01(rng));  // the old policy, one update behind
  }
  // The dense projection: the reference.
  std::vector<double> dense(rows * vocab);
  std::vector<troll::projection_stats> dense_stats(rows);
  troll::project(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::make_batch(zo.data(), rows, vocab),
                 eps, troll::make_batch(dense.data(), rows, vocab), dense_stats.data());
  std::vector<double> top64(rows);
  {
    std::vector<double> row(vocab);
    for (std::size_t r = 0; r < rows; ++r) {
      std::copy_n(zn.begin() + long(r * vocab), vocab, row.begin());
      std::sort(row.begin(), row.end(), std::greater<double>());
      double m = row[0], s = 0, s64 = 0;
      for (std::size_t i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
      for (std::size_t i = 0; i < 64; ++i) s64 += std::exp(row[i] - m);
      top64[r] = 1.0 - s64 / s;
    }
  }
  std::printf("\nZipf exponent ~%.1f: rows %zu, V %zu, eps %g; tail mass beyond the top 64 tokens %.1e..%.1e\n",
              exponent, rows, vocab, eps, *std::min_element(top64.begin(), top64.end()),
              *std::max_element(top64.begin(), top64.end()));
  std::printf("\n| K | δ | mean \\|U\\| | max \\|Δ log π\\| on U | max KL(π_sparse ‖ π_dense) | max \\|Δt\\| |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  for (int k : {8, 64, 256}) {
    for (double delta : {1e-3, 1e-5, 0.0}) {
      const std::size_t cap = std::size_t(k) + 1, ucap = 2 * cap;
      std::vector<troll::sparse_index> ni(rows * cap), nc(rows), oi(rows * cap), oc(rows);
      std::vector<double> nl(rows * cap), nr(rows), ol(rows * cap), orr(rows);
      troll::sparse_batch_view<double> sn{ni.data(), nl.data(), nc.data(), nr.data(), rows, cap, vocab};
      troll::sparse_batch_view<double> so{oi.data(), ol.data(), oc.data(), orr.data(), rows, cap, vocab};
      troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), nullptr, {k, delta}, sn);
      troll::sparsify(troll::cpu, troll::make_batch(zo.data(), rows, vocab), nullptr, {k, delta}, so);

      std::vector<troll::sparse_index> ui(rows * ucap), uc(rows);
      std::vector<double> unl(rows * ucap), uol(rows * ucap), unr(rows), uor(rows);
      troll::aligned_batch_view<double> al{ui.data(), uc.data(), unl.data(), uol.data(), unr.data(), uor.data(),
                                           rows, ucap, vocab};
      // The trainer's path: the new side gathered exactly from its dense logits.
      troll::align(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::sparse_batch_view<const double>(sn),
                   troll::sparse_batch_view<const double>(so), al);

      std::vector<troll::sparse_index> pi(rows * ucap), pc(rows);
      std::vector<double> pl(rows * ucap), pr(rows);
      troll::sparse_batch_view<double> out{pi.data(), pl.data(), pc.data(), pr.data(), rows, ucap, vocab};
      std::vector<troll::projection_stats> st(rows);
      troll::project(troll::cpu, al, eps, out, st.data());

      double union_sum = 0, max_diff = 0, max_kl = 0, max_dt = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        const double* d = dense.data() + r * vocab;
        const int n = pc[r];
        union_sum += n;
        std::vector<char> in_u(vocab, 0);
        double kl = 0;
        for (int i = 0; i < n; ++i) {
          const std::size_t tok = std::size_t(pi[r * ucap + std::size_t(i)]);
          const double ls = pl[r * ucap + std::size_t(i)];
          in_u[tok] = 1;
          max_diff = std::max(max_diff, std::fabs(ls - d[tok]));
          if (ls > -INFINITY) kl += std::exp(ls) * (ls - d[tok]);
        }
        const long long m = (long long)vocab - n;
        if (m > 0 && pr[r] > -INFINITY) {
          const double tail = pr[r] - std::log(double(m));
          for (std::size_t tok = 0; tok < vocab; ++tok)
            if (!in_u[tok]) kl += std::exp(tail) * (tail - d[tok]);
        }
        max_kl = std::max(max_kl, kl);
        max_dt = std::max(max_dt, std::fabs(st[r].t - dense_stats[r].t));
      }
      std::printf("| %d | %g | %.1f | %.2e | %.2e | %.2e |\n", k, delta, union_sum / rows, max_diff, max_kl,
                  max_dt);
    }
  }
}

}  // namespace

int main() {
  table(1.1, 7);  // flat rows: a heavy tail the top-K cannot hold
  table(2.0, 8);
  table(3.5, 9);  // confident rows: a few tokens carry nearly all mass
  std::mt19937_64 rng(10);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::vector<double> row = llm_row(rng, 2.0);
    zn.insert(zn.end(), row.begin(), row.end());
    for (double v : row) zo.push_back(v + 0.5 * n01(rng));
  }

  // The backward a trainer runs: upstream on the projected log-probs → gradient on dense logits.
  {
    const std::size_t cap = 65, ucap = 130;
    std::vector<troll::sparse_index> ni(rows * cap), nc(rows), oi(rows * cap), oc(rows), ui(rows * ucap), uc(rows),
        pi(rows * ucap), pc(rows);
    std::vector<double> nl(rows * cap), nr(rows), ol(rows * cap), orr(rows), unl(rows * ucap), uol(rows * ucap),
        unr(rows), uor(rows), pl(rows * ucap), pr(rows), g(rows * ucap, 0.0), gr(rows, 0.0), gn(rows * ucap),
        gnr(rows), gz(rows * vocab);
    troll::sparse_batch_view<double> sn{ni.data(), nl.data(), nc.data(), nr.data(), rows, cap, vocab};
    troll::sparse_batch_view<double> so{oi.data(), ol.data(), oc.data(), orr.data(), rows, cap, vocab};
    troll::aligned_batch_view<double> al{ui.data(), uc.data(), unl.data(), uol.data(), unr.data(), uor.data(),
                                         rows, ucap, vocab};
    troll::sparse_batch_view<double> out{pi.data(), pl.data(), pc.data(), pr.data(), rows, ucap, vocab};
    std::vector<troll::projection_stats> st(rows);
    troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), nullptr, {64, 1e-5}, sn);
    troll::sparsify(troll::cpu, troll::make_batch(zo.data(), rows, vocab), nullptr, {64, 1e-5}, so);
    troll::align(troll::cpu, troll::make_batch(zn.data(), rows, vocab), troll::sparse_batch_view<const double>(sn),
                 troll::sparse_batch_view<const double>(so), al);
    troll::project(troll::cpu, al, eps, out, st.data());
    for (std::size_t r = 0; r < rows; ++r) g[r * ucap] = 1.0;  // L = Σ_r log π*_r(top token)
    troll::project_backward(troll::cpu, troll::aligned_batch_view<const double>(al),
                            troll::sparse_batch_view<const double>(out), st.data(),
                            troll::sparse_grad_view<const double>{g.data(), gr.data(), rows, ucap},
                            troll::sparse_grad_view<double>{gn.data(), gnr.data(), rows, ucap});
    troll::sparsify_backward(troll::cpu, troll::make_batch(zn.data(), rows, vocab),
                             troll::aligned_batch_view<const double>(al).new_side(),
                             troll::sparse_grad_view<const double>{gn.data(), gnr.data(), rows, ucap},
                             troll::make_batch(gz.data(), rows, vocab));
    double total = 0;
    for (double v : gz) total += v;
    std::printf("\nbackward to dense logits: sum of the gradient %.2e (0 up to round-off: shift invariance)\n",
                total);
  }
  return 0;
}
