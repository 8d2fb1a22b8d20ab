// bench/support/objective_bench.hpp — what the objective benchmarks (bench_objectives.cpp,
// bench_sparse_objectives.cpp) share: the token rows (LLM-like float logits, a sampled token and
// an advantage per row), one dense objective's forward + backward as a benchmark body, the
// per-token counter, and a main() that prints each objective's cost relative to PPO clip.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "llm_rows.hpp"
#include "troll/objectives.hpp"

namespace troll_bench {

/// Rows of float logits with a quarter aimed at KL(p̃‖q) ∈ [2ε, 8ε] (ε = 0.05) and the rest
/// inside the ball; the sampled token is the old row's arg-max on odd rows and a spread-out
/// token on even ones; advantages alternate −1, 1, 1.
struct token_rows {
  std::size_t rows = 0, vocab = 0;
  std::vector<float> new_logits, old_logits, advantages;
  std::vector<std::int64_t> tokens;

  troll::token_batch<float> batch() const {
    troll::token_batch<float> in;
    in.tokens = tokens.data();
    in.advantages = advantages.data();
    return in;
  }
};

inline token_rows make_token_rows(std::size_t rows, std::size_t vocab, unsigned seed = 7) {
  const logit_pair pair = make_logit_pair(rows, vocab, 0.25, 0.05, seed);
  token_rows d;
  d.rows = rows, d.vocab = vocab;
  d.new_logits.assign(pair.new_logits.begin(), pair.new_logits.end());
  d.old_logits.assign(pair.old_logits.begin(), pair.old_logits.end());
  for (std::size_t r = 0; r < rows; ++r) {
    const float* zo = &d.old_logits[r * vocab];
    std::size_t best = 0;
    for (std::size_t v = 1; v < vocab; ++v)
      if (zo[v] > zo[best]) best = v;
    d.tokens.push_back(std::int64_t(r % 2 ? best : (r * 7919) % vocab));
    d.advantages.push_back(r % 3 ? 1.0f : -1.0f);
  }
  return d;
}

/// Argument 0 of every objective benchmark: 0 one thread, 1 all cores.
inline troll::cpu_policy objective_policy(const benchmark::State& state) {
  return state.range(0) ? troll::cpu : troll::cpu.with_threads(1);
}

/// Items = rows (tokens), and a "time/token" counter in seconds per token.
inline void set_token_counters(benchmark::State& state, std::size_t rows) {
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(rows));
  state.counters["time/token"] = benchmark::Counter(
      double(rows), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

/// objective_forward then objective_backward of a dense objective (TROLL, PPO clip or DPPO) on
/// the first state.range(1) rows of `d`: what a trainer pays per micro-batch.
template <class Objective>
void run_dense_objective(benchmark::State& state, const token_rows& d, const Objective& objective) {
  const std::size_t rows = std::size_t(state.range(1)), vocab = d.vocab;
  std::vector<float> log_probs(rows * vocab), grad(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  const troll::token_batch<float> tokens = d.batch();
  const auto zn = troll::make_batch(d.new_logits.data(), rows, vocab);
  const auto zo = troll::make_batch(d.old_logits.data(), rows, vocab);
  const auto g = troll::make_batch(grad.data(), rows, vocab);
  const troll::cpu_policy policy = objective_policy(state);
  for (auto _ : state) {
    if constexpr (std::is_same<Objective, troll::trust_region_objective>::value) {
      const auto lp = troll::make_batch(log_probs.data(), rows, vocab);
      benchmark::DoNotOptimize(troll::objective_forward(policy, objective, zn, zo, tokens, lp, stats.data()));
      troll::objective_backward(policy, objective, zn, zo, tokens, lp, stats.data(), g);
    } else {
      benchmark::DoNotOptimize(troll::objective_forward(policy, objective, zn, zo, tokens));
      troll::objective_backward(policy, objective, zn, zo, tokens, g);
    }
    benchmark::ClobberMemory();
  }
  set_token_counters(state, rows);
}

/// The shapes every objective benchmark runs: 8 rows on one thread, 32 rows on all cores.
inline void objective_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"parallel", "rows"})->Args({0, 8})->Args({1, 32})->Unit(benchmark::kMillisecond)->UseRealTime();
}

/// Console output plus each run's real time per token, for the ratio table.
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

/// The whole main() of an objective benchmark: runs the benchmarks, then prints the per-token
/// cost of each of `names` relative to the benchmark named "ppo_clip" on the same shape.
inline int run_with_ratios(int argc, char** argv, std::size_t vocab, std::initializer_list<const char*> names) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ratio_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nper-token cost relative to ppo_clip (forward + backward, same rows, V = %zu):\n", vocab);
  for (const char* shape : {"parallel:0/rows:8", "parallel:1/rows:32"}) {
    const auto base = reporter.ns_per_token.find(std::string("ppo_clip/") + shape + "/real_time");
    if (base == reporter.ns_per_token.end()) continue;
    for (const char* name : names) {
      const auto it = reporter.ns_per_token.find(std::string(name) + "/" + shape + "/real_time");
      if (it == reporter.ns_per_token.end()) continue;
      std::printf("  %-26s %-20s %10.0f ns/token  %5.2fx ppo_clip (%.0f ns/token)\n", name, shape, it->second,
                  it->second / base->second, base->second);
    }
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace troll_bench
