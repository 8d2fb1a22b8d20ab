// bench/bench_objectives.cpp — TROLL's loss forward + fused backward per token against PPO clip
// (and DPPO) on the same rows: float logits at V = 151,936, a quarter of the rows projected
// (KL(p̃‖q) aimed at 2ε–8ε) and the rest inside the ball, one sampled token and an advantage per
// row. Each iteration is what a trainer pays per micro-batch: objective_forward then
// objective_backward. After the runs the binary prints the per-token cost ratio TROLL / PPO clip.
//
// Names read  <objective>/<serial|parallel>/rows:<batch>. Items are rows (tokens).
//
// The sparse K = 64 objective (sparsify → align → TROLL loss on |U| + 1 lumped categories →
// scatter to the dense logits) has its own binary, bench/bench_sparse_objectives.cpp.
#include <benchmark/benchmark.h>

#include <cstddef>

#include "support/objective_bench.hpp"
#include "troll/objectives.hpp"

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t max_rows = 32;  // 19 MB of float logits per side

const troll_bench::token_rows& data() {
  static const troll_bench::token_rows rows = troll_bench::make_token_rows(max_rows, vocab);
  return rows;
}

template <class Objective>
void run_objective(benchmark::State& state, const Objective& objective) {
  troll_bench::run_dense_objective(state, data(), objective);
}

void troll_dense(benchmark::State& state) { run_objective(state, troll::trust_region_objective{}); }
void ppo_clip(benchmark::State& state) {
  troll::ppo_clip_objective o;
  o.kl_metrics = false;  // the bare PPO loss: what a trainer computes without monitoring
  run_objective(state, o);
}
void ppo_clip_with_kl(benchmark::State& state) { run_objective(state, troll::ppo_clip_objective{}); }
void dppo_binary_tv(benchmark::State& state) {
  troll::dppo_objective o;
  o.kl_metrics = false;
  run_objective(state, o);
}
void dppo_topk_kl(benchmark::State& state) {
  troll::dppo_objective o = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);
  o.kl_metrics = false;
  run_objective(state, o);
}

BENCHMARK(troll_dense)->Apply(troll_bench::objective_shapes);
BENCHMARK(ppo_clip)->Apply(troll_bench::objective_shapes);
BENCHMARK(ppo_clip_with_kl)->Apply(troll_bench::objective_shapes);
BENCHMARK(dppo_binary_tv)->Apply(troll_bench::objective_shapes);
BENCHMARK(dppo_topk_kl)->Apply(troll_bench::objective_shapes);

}  // namespace

int main(int argc, char** argv) {
  return troll_bench::run_with_ratios(argc, argv, vocab,
                                      {"troll_dense", "ppo_clip_with_kl", "dppo_binary_tv", "dppo_topk_kl"});
}
