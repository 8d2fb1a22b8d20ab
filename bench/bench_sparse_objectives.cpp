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
#include <cstdio>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "support/llm_rows.hpp"
#include "troll/objectives.hpp"
#include "troll/sparse_objectives.hpp"

namespace {

constexpr std::size_t vocab = 151936;
constexpr std::size_t max_rows = 32;  // 19 MB of float logits per side
constexpr int old_k = 64;

struct inputs {
  std::vector<float> new_logits, old_logits, advantages;
  std::vector<std::int64_t> tokens;
  // Sparse old rows: max_rows × (old_k + 1), the sampled token kept.
  std::vector<troll::sparse_index> old_indices, old_counts;
  std::vector<float> old_log_probs, old_log_remainder;
  troll::sparse_batch_view<const float> old_rows(std::size_t rows) const {
    return {old_indices.data(),
            old_log_probs.data(),
            old_counts.data(),
            old_log_remainder.data(),
            rows,
            std::size_t(old_k) + 1,
            vocab};
  }
};

const inputs& data() {
  static const inputs in = [] {
    const troll_bench::logit_pair pair =
        troll_bench::make_logit_pair(max_rows, vocab, 0.25, 0.05, 7);
    inputs d;
    d.new_logits.assign(pair.new_logits.begin(), pair.new_logits.end());
    d.old_logits.assign(pair.old_logits.begin(), pair.old_logits.end());
    std::vector<troll::sparse_index> sampled;
    for (std::size_t r = 0; r < max_rows; ++r) {
      // A likely token of the old row (its argmax) for half the rows, a random one otherwise.
      const float* zo = &d.old_logits[r * vocab];
      std::size_t best = 0;
      for (std::size_t v = 1; v < vocab; ++v)
        if (zo[v] > zo[best]) best = v;
      d.tokens.push_back(std::int64_t(r % 2 ? best : (r * 7919) % vocab));
      sampled.push_back(troll::sparse_index(d.tokens.back()));
      d.advantages.push_back(r % 3 ? 1.0f : -1.0f);
    }
    const std::size_t k_max = std::size_t(old_k) + 1;
    d.old_indices.resize(max_rows * k_max);
    d.old_log_probs.resize(max_rows * k_max);
    d.old_counts.resize(max_rows);
    d.old_log_remainder.resize(max_rows);
    troll::sparse_batch_view<float> out{d.old_indices.data(),
                                        d.old_log_probs.data(),
                                        d.old_counts.data(),
                                        d.old_log_remainder.data(),
                                        max_rows,
                                        k_max,
                                        vocab};
    troll::sparsify(troll::cpu, troll::make_batch(d.old_logits.data(), max_rows, vocab),
                    sampled.data(), {old_k, 1e-5}, out);
    return d;
  }();
  return in;
}

troll::cpu_policy policy(int parallel) {
  return parallel ? troll::cpu : troll::cpu.with_threads(1);
}

void set_counters(benchmark::State& state, std::size_t rows) {
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(rows));
  // Seconds per token (the console prints it with an SI prefix, e.g. 250u = 250 µs).
  state.counters["time/token"] = benchmark::Counter(
      double(rows), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
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
  troll::token_batch<float> tokens;
  tokens.tokens = d.tokens.data();
  tokens.advantages = d.advantages.data();
  const auto zn = troll::make_batch(d.new_logits.data(), rows, vocab);
  const auto g = troll::make_batch(grad.data(), rows, vocab);
  troll::objective_metrics m;
  for (auto _ : state) {
    m = troll::objective_forward(policy(int(state.range(0))), objective, zn, d.old_rows(rows),
                                 tokens, aligned, log_probs, stats.data());
    troll::objective_backward(policy(int(state.range(0))), objective, zn, aligned, tokens,
                              log_probs, stats.data(), g);
    benchmark::ClobberMemory();
  }
  set_counters(state, rows);
  double union_size = 0;
  for (std::size_t r = 0; r < rows; ++r) union_size += al_counts[r];
  state.counters["mean_U"] = union_size / double(rows);
  state.counters["projected"] = m.projected_fraction;
}

template <class Objective>
void run_dense(benchmark::State& state, const Objective& objective) {
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
      benchmark::DoNotOptimize(troll::objective_forward(policy(int(state.range(0))), objective, zn,
                                                        zo, tokens, lp, stats.data()));
      troll::objective_backward(policy(int(state.range(0))), objective, zn, zo, tokens, lp,
                                stats.data(), g);
    } else {
      benchmark::DoNotOptimize(
          troll::objective_forward(policy(int(state.range(0))), objective, zn, zo, tokens));
      troll::objective_backward(policy(int(state.range(0))), objective, zn, zo, tokens, g);
    }
    benchmark::ClobberMemory();
  }
  set_counters(state, rows);
}

void troll_sparse_k64(benchmark::State& state) { run_sparse(state, 64); }
void troll_sparse_old_support(benchmark::State& state) { run_sparse(state, 0); }
void troll_dense(benchmark::State& state) { run_dense(state, troll::trust_region_objective{}); }
void ppo_clip(benchmark::State& state) {
  troll::ppo_clip_objective o;
  o.kl_metrics = false;  // the bare PPO loss: what a trainer computes without monitoring
  run_dense(state, o);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"parallel", "rows"})
      ->Args({0, 8})
      ->Args({1, 32})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

BENCHMARK(ppo_clip)->Apply(shapes);
BENCHMARK(troll_sparse_k64)->Apply(shapes);
BENCHMARK(troll_sparse_old_support)->Apply(shapes);
BENCHMARK(troll_dense)->Apply(shapes);

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
  std::printf("\nper-token cost relative to ppo_clip (forward + backward, same rows, V = %zu):\n",
              vocab);
  for (const char* shape : {"parallel:0/rows:8", "parallel:1/rows:32"}) {
    const auto base = reporter.ns_per_token.find(std::string("ppo_clip/") + shape + "/real_time");
    if (base == reporter.ns_per_token.end()) continue;
    for (const char* name : {"troll_sparse_k64", "troll_sparse_old_support", "troll_dense"}) {
      const auto it = reporter.ns_per_token.find(std::string(name) + "/" + shape + "/real_time");
      if (it == reporter.ns_per_token.end()) continue;
      std::printf("  %-26s %-20s %10.0f ns/token  %5.2fx ppo_clip (%.0f ns/token)\n", name, shape,
                  it->second, it->second / base->second, base->second);
    }
  }
  benchmark::Shutdown();
  return 0;
}
