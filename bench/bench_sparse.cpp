// bench/bench_sparse.cpp — CPU costs of the sparse path: sparsify of float rows at V = 151,936
// beside a plain read of the same bytes (the memory-bandwidth bound, same binary, same buffer),
// and the sparse projection forward and forward + backward at K = 64 (|U| ≤ 130 categories).
//
// Names read  <op>/<serial|parallel>/rows:<batch>. Items are rows; bytes are the logits read.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "troll/sparse.hpp"

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t batch = 64;  // 39 MB of float logits: well beyond the caches

/// Zipf-like LLM rows: the token at rank j has logit −s·log(j + 1) + noise, ranks shuffled.
std::vector<float> llm_rows(std::size_t rows, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<float> z(rows * vocab);
  std::vector<std::size_t> perm(vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), std::size_t(0));
    std::shuffle(perm.begin(), perm.end(), rng);
    const double s = 1.1 + 0.01 * double(r % 20);
    for (std::size_t j = 0; j < vocab; ++j)
      z[r * vocab + perm[j]] = float(-s * std::log(double(j + 1)) + 0.3 * n01(rng));
  }
  return z;
}

const std::vector<float>& logits() {
  static const std::vector<float> z = llm_rows(batch, 1);
  return z;
}

troll::cpu_policy policy(int parallel) { return parallel ? troll::cpu : troll::cpu.with_threads(1); }

void set_counters(benchmark::State& state, std::size_t rows, std::size_t bytes_per_row) {
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(rows));
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(rows * bytes_per_row));
  state.counters["rows/s"] = benchmark::Counter(double(state.iterations()) * double(rows),
                                                benchmark::Counter::kIsRate);
}

/// The bandwidth bound: sum every float of the batch (vectorised, one pass), split over rows
/// like troll splits work.
void plain_read(benchmark::State& state) {
  const std::vector<float>& z = logits();
  const int parallel = int(state.range(0));
  std::vector<float> sums(batch);
  for (auto _ : state) {
    troll::detail::cpu::parallel_for(policy(parallel).threads, batch, vocab, [&](std::size_t r) {
      const float* row = z.data() + r * vocab;
      float acc[16] = {};
      for (std::size_t i = 0; i + 16 <= vocab; i += 16)
        for (int k = 0; k < 16; ++k) acc[k] += row[i + std::size_t(k)];
      sums[r] = std::accumulate(acc, acc + 16, 0.0f);
    });
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch, vocab * sizeof(float));
}

void sparsify_float(benchmark::State& state) {
  const std::vector<float>& z = logits();
  const int parallel = int(state.range(0));
  std::vector<troll::sparse_index> indices(batch * 65), counts(batch);
  std::vector<troll::token_id> sampled(batch);
  std::vector<float> log_probs(batch * 65), log_remainder(batch);
  for (std::size_t r = 0; r < batch; ++r) sampled[r] = troll::token_id((r * 7919) % vocab);
  troll::sparse_batch_view<float> out{indices.data(), log_probs.data(), counts.data(),
                                      log_remainder.data(), batch, 65, vocab};
  for (auto _ : state) {
    troll::sparsify(policy(parallel), troll::make_batch(z.data(), batch, vocab), sampled.data(),
                    {64, 1e-5}, out);
    benchmark::DoNotOptimize(log_probs.data());
  }
  set_counters(state, batch, vocab * sizeof(float));
  double mean_count = 0;
  for (auto c : counts) mean_count += c;
  state.counters["mean_count"] = mean_count / double(batch);
}

/// Aligned K = 64 rows: new and old sparsified from related LLM rows, aligned on the union.
struct aligned_inputs {
  std::size_t rows;
  std::vector<troll::sparse_index> indices, counts;
  std::vector<float> new_lp, old_lp, new_lr, old_lr;
  troll::aligned_batch_view<const float> view() const {
    return {indices.data(), counts.data(), new_lp.data(), old_lp.data(), new_lr.data(), old_lr.data(),
            rows, 130, vocab};
  }
};

const aligned_inputs& aligned() {
  static const aligned_inputs a = [] {
    const std::size_t n = batch;
    std::vector<float> zn = llm_rows(n, 2), zo = zn;
    std::mt19937_64 rng(3);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    for (float& v : zo) v += 0.6f * noise(rng);  // an old policy one update behind
    std::vector<troll::sparse_index> si(n * 65), sc(n), oi(n * 65), oc(n);
    std::vector<float> sl(n * 65), sr(n), ol(n * 65), orr(n);
    troll::sparse_batch_view<float> sn{si.data(), sl.data(), sc.data(), sr.data(), n, 65, vocab};
    troll::sparse_batch_view<float> so{oi.data(), ol.data(), oc.data(), orr.data(), n, 65, vocab};
    troll::sparsify(troll::cpu, troll::make_batch(zn.data(), n, vocab), nullptr, {64, 1e-5}, sn);
    troll::sparsify(troll::cpu, troll::make_batch(zo.data(), n, vocab), nullptr, {64, 1e-5}, so);
    aligned_inputs a{n, std::vector<troll::sparse_index>(n * 130), std::vector<troll::sparse_index>(n),
                     std::vector<float>(n * 130), std::vector<float>(n * 130), std::vector<float>(n),
                     std::vector<float>(n)};
    troll::aligned_batch_view<float> out{a.indices.data(), a.counts.data(), a.new_lp.data(), a.old_lp.data(),
                                         a.new_lr.data(),  a.old_lr.data(), n, 130, vocab};
    troll::align(troll::cpu, troll::sparse_batch_view<const float>(sn), troll::sparse_batch_view<const float>(so),
                 out);
    // Tile the 64 distinct rows to a batch of 4096.
    const std::size_t tiles = 64;
    aligned_inputs big{n * tiles, {}, {}, {}, {}, {}, {}};
    for (std::size_t t = 0; t < tiles; ++t) {
      big.indices.insert(big.indices.end(), a.indices.begin(), a.indices.end());
      big.counts.insert(big.counts.end(), a.counts.begin(), a.counts.end());
      big.new_lp.insert(big.new_lp.end(), a.new_lp.begin(), a.new_lp.end());
      big.old_lp.insert(big.old_lp.end(), a.old_lp.begin(), a.old_lp.end());
      big.new_lr.insert(big.new_lr.end(), a.new_lr.begin(), a.new_lr.end());
      big.old_lr.insert(big.old_lr.end(), a.old_lr.begin(), a.old_lr.end());
    }
    return big;
  }();
  return a;
}

/// The first `rows` rows of the tiled batch (all of it when rows = 0).
troll::aligned_batch_view<const float> first_rows(const aligned_inputs& a, std::size_t rows) {
  troll::aligned_batch_view<const float> v = a.view();
  if (rows != 0) v.rows = std::min(rows, v.rows);
  return v;
}

void sparse_project(benchmark::State& state, bool backward) {
  const aligned_inputs& a = aligned();
  const int parallel = int(state.range(0));
  const troll::aligned_batch_view<const float> view = first_rows(a, std::size_t(state.range(1)));
  const std::size_t n = view.rows;
  std::vector<troll::sparse_index> oi(n * 130), oc(n);
  std::vector<float> ol(n * 130), orr(n), g(n * 130, 0.5f), gr(n, -0.25f), gn(n * 130), gnr(n);
  std::vector<troll::projection_stats> st(n);
  troll::sparse_batch_view<float> out{oi.data(), ol.data(), oc.data(), orr.data(), n, 130, vocab};
  for (auto _ : state) {
    troll::project(policy(parallel), view, 0.05, out, st.data());
    if (backward)
      troll::project_backward(policy(parallel), view, troll::sparse_batch_view<const float>(out), st.data(),
                              troll::sparse_grad_view<const float>{g.data(), gr.data(), n, 130},
                              troll::sparse_grad_view<float>{gn.data(), gnr.data(), n, 130});
    benchmark::DoNotOptimize(ol.data());
    benchmark::DoNotOptimize(gn.data());
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(n));
  state.counters["rows/s"] = benchmark::Counter(double(state.iterations()) * double(n), benchmark::Counter::kIsRate);
  std::size_t active = 0, entries = 0, iterations = 0;
  for (std::size_t r = 0; r < n; ++r) {
    active += st[r].active() ? 1 : 0;
    entries += std::size_t(a.counts[r]);
    iterations += std::size_t(st[r].iterations);
  }
  state.counters["active_fraction"] = double(active) / double(n);
  state.counters["newton_iters"] = active ? double(iterations) / double(active) : 0.0;
  state.counters["mean_union"] = double(entries) / double(n);
}

void sparse_forward(benchmark::State& state) { sparse_project(state, false); }
void sparse_forward_backward(benchmark::State& state) { sparse_project(state, true); }

}  // namespace

BENCHMARK(plain_read)->Name("read/float/V:151936/rows:64")->ArgName("parallel")->Arg(0)->Arg(1)->UseRealTime();
BENCHMARK(sparsify_float)->Name("sparsify/float/K:64/V:151936/rows:64")->ArgName("parallel")->Arg(0)->Arg(1)->UseRealTime();
BENCHMARK(sparse_forward)->Name("project_sparse/float/K:64")->ArgNames({"parallel", "rows"})->ArgsProduct({{0, 1}, {4096}})->UseRealTime();
// rows:256 is a small batch: one call takes ~1 ms, where starting threads per call would show.
BENCHMARK(sparse_forward_backward)->Name("project_sparse+backward/float/K:64")->ArgNames({"parallel", "rows"})->ArgsProduct({{0, 1}, {256, 4096}})->UseRealTime();

BENCHMARK_MAIN();
