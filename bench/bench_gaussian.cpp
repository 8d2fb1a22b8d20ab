// bench/bench_gaussian.cpp — CPU costs of the Gaussian trust-region projections: forward and
// forward plus VJP, joint and split bounds, diagonal (standard deviations) and full (Cholesky
// factors) covariances, in double, one thread (CPU time: robust on a shared machine).
//
// Names read  gaussian/<fwd|fwd+bwd|fwd+bwd-saved>/<diag|full>/<joint|split>/d:<d>/rows:<N>. Items
// are rows; fwd+bwd-saved (full only) passes a saved_factorisation from the forward to the backward.
// Pairs: means N(0, 1); standard deviations exp(N(0, 0.3²)); factors with that diagonal and
// N(0, 0.3²/d) below it; ε = ε_μ = ε_Σ = 0.05 (nearly every row is projected).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "troll/gaussian.hpp"

namespace {

constexpr double bound = 0.05;

struct rows {
  std::size_t n = 0, d = 0;
  bool full = false;
  std::vector<double> mean, cov, old_mean, old_cov;
  std::size_t cov_cols() const { return full ? d * d : d; }
};

std::vector<double> make_cov(std::mt19937_64& gen, std::size_t n, std::size_t d, bool full) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> c(n * (full ? d * d : d), 0.0);
  for (std::size_t r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < d; ++i) {
      if (!full) {
        c[r * d + i] = std::exp(0.3 * normal(gen));
        continue;
      }
      double* row = &c[r * d * d + i * d];
      for (std::size_t j = 0; j < i; ++j) row[j] = 0.3 / std::sqrt(double(d)) * normal(gen);
      row[i] = std::exp(0.3 * normal(gen));
    }
  }
  return c;
}

rows make_rows(std::size_t n, std::size_t d, bool full) {
  std::mt19937_64 gen(0x6a55 + d + (full ? 1000 : 0));
  std::normal_distribution<double> normal(0.0, 1.0);
  rows x;
  x.n = n;
  x.d = d;
  x.full = full;
  x.mean.resize(n * d);
  x.old_mean.resize(n * d);
  for (double& v : x.mean) v = normal(gen);
  for (double& v : x.old_mean) v = normal(gen);
  x.cov = make_cov(gen, n, d, full);
  x.old_cov = make_cov(gen, n, d, full);
  return x;
}

void gaussian(benchmark::State& state, bool full, bool split, bool backward, bool save = false) {
  const auto d = static_cast<std::size_t>(state.range(0));
  const auto n = static_cast<std::size_t>(state.range(1));
  const rows x = make_rows(n, d, full);
  const std::size_t cc = x.cov_cols();
  auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
  std::vector<double> out_mean(n * d), out_cov(n * cc), g_mean(n * d, 1.0), g_cov(n * cc, 0.5);
  std::vector<double> gm(n * d), gc(n * cc), gom(n * d), goc(n * cc), ge(n), gem(n);
  std::vector<troll::gaussian::gaussian_stats> stats(n);
  const auto policy = troll::cpu.with_threads(1);
  std::vector<double> saved_memory(save ? n * troll::gaussian::saved_factorisation<double>::saved_doubles(d) : 0);
  const troll::gaussian::saved_factorisation<double> saved{save ? saved_memory.data() : nullptr, n, d};
  namespace g = troll::gaussian;
  const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.data(), n, d),
                                                      troll::make_batch(gc.data(), n, cc),
                                                      troll::make_batch(gom.data(), n, d),
                                                      troll::make_batch(goc.data(), n, cc),
                                                      ge.data(),
                                                      split ? gem.data() : nullptr};
  const auto ym = troll::make_batch(out_mean.data(), n, d);
  const auto yc = troll::make_batch(out_cov.data(), n, cc);
  for (auto _ : state) {
    if (full && split) {
      g::project_split(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound, bound, ym,
                       yc, stats.data(), {}, saved);
    } else if (full) {
      g::project_joint(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound, ym, yc,
                       stats.data(), {}, saved);
    } else if (split) {
      g::project_split_diag(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound,
                            bound, ym, yc, stats.data());
    } else {
      g::project_joint_diag(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound, ym,
                            yc, stats.data());
    }
    if (backward) {
      const auto om = troll::make_batch(static_cast<const double*>(out_mean.data()), n, d);
      const auto oc = troll::make_batch(static_cast<const double*>(out_cov.data()), n, cc);
      if (full && split) {
        g::project_split_backward(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound,
                                  bound, om, oc, stats.data(), in(g_mean, d), in(g_cov, cc), grads, saved);
      } else if (full) {
        g::project_joint_backward(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc), bound,
                                  om, oc, stats.data(), in(g_mean, d), in(g_cov, cc), grads, saved);
      } else if (split) {
        g::project_split_diag_backward(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc),
                                       bound, bound, om, oc, stats.data(), in(g_mean, d), in(g_cov, cc), grads);
      } else {
        g::project_joint_diag_backward(policy, in(x.mean, d), in(x.cov, cc), in(x.old_mean, d), in(x.old_cov, cc),
                                       bound, om, oc, stats.data(), in(g_mean, d), in(g_cov, cc), grads);
      }
    }
    benchmark::DoNotOptimize(out_mean.data());
    benchmark::DoNotOptimize(gm.data());
    benchmark::ClobberMemory();
  }
  double projected = 0, iterations = 0;
  for (const auto& s : stats) {
    if (s.status == troll::row_status::projected) {
      projected += 1;
      iterations += s.iterations;
    }
  }
  state.counters["active"] = projected / double(n);
  state.counters["newton_iters"] = projected > 0 ? iterations / projected : 0.0;
  state.SetItemsProcessed(std::int64_t(state.iterations()) * std::int64_t(n));
}

void register_all() {
  for (const bool backward : {false, true})
    for (const bool full : {false, true})
      for (const bool split : {false, true})
        for (const std::int64_t d : {8, 32, 128}) {
          // Full d = 128 costs ~10 ms a row (O(d³)): fewer rows keep one call under seconds.
          const std::int64_t n = full && d == 128 ? 256 : 4096;
          const std::string name = std::string("gaussian/") + (backward ? "fwd+bwd/" : "fwd/") +
                                   (full ? "full/" : "diag/") + (split ? "split" : "joint");
          benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) { gaussian(s, full, split, backward); })
              ->ArgNames({"d", "rows"})
              ->Args({d, n})
              ->Unit(benchmark::kMillisecond)
              ->MinTime(0.2);
          // Full rows: forward + backward with the forward's factorisation saved and reused.
          if (backward && full)
            benchmark::RegisterBenchmark((std::string("gaussian/fwd+bwd-saved/full/") + (split ? "split" : "joint")).c_str(),
                                         [=](benchmark::State& s) { gaussian(s, full, split, backward, true); })
                ->ArgNames({"d", "rows"})
                ->Args({d, n})
                ->Unit(benchmark::kMillisecond)
                ->MinTime(0.2);
        }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
