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
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "support/llm_rows.hpp"
#include "troll/objectives.hpp"

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t max_rows = 32;  // 19 MB of float logits per side

struct inputs {
  std::vector<float> new_logits, old_logits, advantages, log_probs, grad;
  std::vector<std::int64_t> tokens;
  std::vector<troll::projection_stats> stats;
};

const inputs& data() {
  static const inputs in = [] {
    const troll_bench::logit_pair pair = troll_bench::make_logit_pair(max_rows, vocab, 0.25, 0.05, 7);
    inputs d;
    d.new_logits.assign(pair.new_logits.begin(), pair.new_logits.end());
    d.old_logits.assign(pair.old_logits.begin(), pair.old_logits.end());
    for (std::size_t r = 0; r < max_rows; ++r) {
      // A likely token of the old row (its argmax) for half the rows, a random one otherwise.
      const float* zo = &d.old_logits[r * vocab];
      std::size_t best = 0;
      for (std::size_t v = 1; v < vocab; ++v)
        if (zo[v] > zo[best]) best = v;
      d.tokens.push_back(std::int64_t(r % 2 ? best : (r * 7919) % vocab));
      d.advantages.push_back(r % 3 ? 1.0f : -1.0f);
    }
    return d;
  }();
  return in;
}

troll::cpu_policy policy(int parallel) { return parallel ? troll::cpu : troll::cpu.with_threads(1); }

template <class Objective>
void run_objective(benchmark::State& state, const Objective& objective) {
  const inputs& d = data();
  const std::size_t rows = std::size_t(state.range(1));
  std::vector<float> log_probs(rows * vocab), grad(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::token_batch<float> tokens;
  tokens.tokens = d.tokens.data();
  tokens.advantages = d.advantages.data();
  const auto zn = troll::make_batch(d.new_logits.data(), rows, vocab);
  const auto zo = troll::make_batch(d.old_logits.data(), rows, vocab);
  const auto g = troll::make_batch(grad.data(), rows, vocab);
  for (auto _ : state) {
    if constexpr (std::is_same<Objective, troll::trust_region_objective>::value) {
      const auto lp = troll::make_batch(log_probs.data(), rows, vocab);
      benchmark::DoNotOptimize(
          troll::objective_forward(policy(int(state.range(0))), objective, zn, zo, tokens, lp, stats.data()));
      troll::objective_backward(policy(int(state.range(0))), objective, zn, zo, tokens, lp, stats.data(), g);
    } else {
      benchmark::DoNotOptimize(troll::objective_forward(policy(int(state.range(0))), objective, zn, zo, tokens));
      troll::objective_backward(policy(int(state.range(0))), objective, zn, zo, tokens, g);
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(rows));
  // Seconds per token (the console prints it with an SI prefix, e.g. 250u = 250 µs).
  state.counters["time/token"] = benchmark::Counter(
      double(rows), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
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

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"parallel", "rows"})->Args({0, 8})->Args({1, 32})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(troll_dense)->Apply(shapes);
BENCHMARK(ppo_clip)->Apply(shapes);
BENCHMARK(ppo_clip_with_kl)->Apply(shapes);
BENCHMARK(dppo_binary_tv)->Apply(shapes);
BENCHMARK(dppo_topk_kl)->Apply(shapes);

/// Console output plus a record of each run's real time per token, for the ratio table.
class ratio_reporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> ns_per_token;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      const auto it = run.counters.find("time/token");
      if (run.run_type == Run::RT_Iteration && it != run.counters.end())
        ns_per_token[run.benchmark_name()] = it->second.value * 1e9;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ratio_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nper-token cost relative to ppo_clip (forward + backward, same rows, V = %zu):\n", vocab);
  for (const char* shape : {"parallel:0/rows:8", "parallel:1/rows:32"}) {
    const auto base = reporter.ns_per_token.find(std::string("ppo_clip/") + shape + "/real_time");
    if (base == reporter.ns_per_token.end()) continue;
    for (const char* name : {"troll_dense", "ppo_clip_with_kl", "dppo_binary_tv", "dppo_topk_kl"}) {
      const auto it = reporter.ns_per_token.find(std::string(name) + "/" + shape + "/real_time");
      if (it == reporter.ns_per_token.end()) continue;
      std::printf("  %-18s %-20s %10.0f ns/token  %5.2fx ppo_clip (%.0f ns/token)\n", name, shape,
                  it->second, it->second / base->second, base->second);
    }
  }
  benchmark::Shutdown();
  return 0;
}
