// bench/bench_sparse_objectives.cpp — the sparse TROLL objective (sparse_objectives.hpp: dense
// new logits against sparse K = 64 old rows) per token against PPO clip on the same rows, float
// logits at V = 151,936, the rows of bench_objectives.cpp (a quarter aimed at KL(p̃‖q) ∈ [2ε, 8ε],
// the rest inside the ball). The old rows are sparsified once (K = 64, δ = 1e-5, the sampled
// token kept), as a trainer stores them at rollout; PPO clip reads the dense old logits they came
// from. Each iteration is objective_forward then objective_backward; afterwards the binary prints
// the per-token cost ratio to PPO clip.
//
// Names read  <objective>/<serial|parallel>/rows:<batch>. Items are rows (tokens).
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "support/objective_bench.hpp"
#include "troll/objectives.hpp"
#include "troll/sparse_objectives.hpp"

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t max_rows = 32;  // 19 MB of float logits per side
constexpr int old_k = 64;

/// The token rows of bench_objectives.cpp plus their old rows sparsified (max_rows × (old_k + 1),
/// the sampled token kept).
struct inputs {
  troll_bench::token_rows dense;
  std::vector<troll::sparse_index> old_indices, old_counts;
  std::vector<float> old_log_probs, old_log_remainder;
  troll::sparse_batch_view<const float> old_rows(std::size_t rows) const {
    return {old_indices.data(), old_log_probs.data(),   old_counts.data(), old_log_remainder.data(),
            rows,               std::size_t(old_k) + 1, vocab};
  }
};

const inputs& data() {
  static const inputs in = [] {
    inputs d;
    d.dense = troll_bench::make_token_rows(max_rows, vocab);
    const std::vector<troll::token_id> sampled(d.dense.tokens.begin(), d.dense.tokens.end());
    const std::size_t k_max = std::size_t(old_k) + 1;
    d.old_indices.resize(max_rows * k_max);
    d.old_log_probs.resize(max_rows * k_max);
    d.old_counts.resize(max_rows);
    d.old_log_remainder.resize(max_rows);
    troll::sparse_batch_view<float> out{d.old_indices.data(), d.old_log_probs.data(), d.old_counts.data(),
                                        d.old_log_remainder.data(), max_rows, k_max, vocab};
    troll::sparsify(troll::cpu, troll::make_batch(d.dense.old_logits.data(), max_rows, vocab), sampled.data(),
                    {old_k, 1e-5}, out);
    return d;
  }();
  return in;
}

/// The sparse objective; `new_k` = 0 aligns on the old support alone.
void run_sparse(benchmark::State& state, int new_k) {
  const inputs& d = data();
  const std::size_t rows = std::size_t(state.range(1));
  troll::sparse_trust_region_objective objective;
  objective.new_support = {new_k, 1e-5};
  const std::size_t cap = std::size_t(old_k) + 1 + std::size_t(new_k);
  std::vector<troll::sparse_index> al_indices(rows * cap), al_counts(rows), lp_indices(rows * cap),
      lp_counts(rows);
  std::vector<float> al_new(rows * cap), al_old(rows * cap), al_new_r(rows), al_old_r(rows),
      lp(rows * cap), lp_r(rows), grad(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::aligned_batch_view<float> aligned{al_indices.data(),
                                           al_counts.data(),
                                           al_new.data(),
                                           al_old.data(),
                                           al_new_r.data(),
                                           al_old_r.data(),
                                           rows,
                                           cap,
                                           vocab};
  troll::sparse_batch_view<float> log_probs{
      lp_indices.data(), lp.data(), lp_counts.data(), lp_r.data(), rows, cap, vocab};
  const troll::token_batch<float> tokens = d.dense.batch();
  const auto zn = troll::make_batch(d.dense.new_logits.data(), rows, vocab);
  const auto g = troll::make_batch(grad.data(), rows, vocab);
  const troll::cpu_policy policy = troll_bench::objective_policy(state);
  troll::objective_metrics m;
  for (auto _ : state) {
    m = troll::objective_forward(policy, objective, zn, d.old_rows(rows),
                                 tokens, aligned, log_probs, stats.data());
    troll::objective_backward(policy, objective, zn, aligned, tokens,
                              log_probs, stats.data(), g);
    benchmark::ClobberMemory();
  }
  troll_bench::set_token_counters(state, rows);
  double union_size = 0;
  for (std::size_t r = 0; r < rows; ++r) union_size += al_counts[r];
  state.counters["mean_U"] = union_size / double(rows);
  state.counters["projected"] = m.projected_fraction;
}

void troll_sparse_k64(benchmark::State& state) { run_sparse(state, 64); }
void troll_sparse_old_support(benchmark::State& state) { run_sparse(state, 0); }
void troll_dense(benchmark::State& state) {
  troll_bench::run_dense_objective(state, data().dense, troll::trust_region_objective{});
}
void ppo_clip(benchmark::State& state) {
  troll::ppo_clip_objective o;
  o.kl_metrics = false;  // the bare PPO loss: what a trainer computes without monitoring
  troll_bench::run_dense_objective(state, data().dense, o);
}

BENCHMARK(ppo_clip)->Apply(troll_bench::objective_shapes);
BENCHMARK(troll_sparse_k64)->Apply(troll_bench::objective_shapes);
BENCHMARK(troll_sparse_old_support)->Apply(troll_bench::objective_shapes);
BENCHMARK(troll_dense)->Apply(troll_bench::objective_shapes);

}  // namespace

int main(int argc, char** argv) {
  return troll_bench::run_with_ratios(argc, argv, vocab,
                                      {"troll_sparse_k64", "troll_sparse_old_support", "troll_dense"});
}
