// bench/cuda/bench_cuda_projection.cu — the dense CUDA projection at V = 151,936 (Qwen2 size):
// forward, backward (VJP to the new logits) and forward + backward, TROLL's objective forward +
// backward (token-mean, one sampled token per row), against a log_softmax pass over the same bytes. Times are CUDA-event times of one call on its stream (manual time).
//
// Names read  cuda_<op>/<type>/active:<percent>/V:<vocab>/rows:<batch>.
// Items are rows; bytes are the compulsory traffic (each input read once, each output written
// once). Without a CUDA device every benchmark is skipped with the error "no CUDA device" and
// the binary exits 0. Numbers from an H100: docs/performance.md.
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../support/llm_rows.hpp"
#include "troll/cuda.cuh"

namespace {

constexpr double bound = 0.05;            // ε
constexpr std::size_t vocab = 151936;     // Qwen2 vocabulary
constexpr std::size_t unique_rows = 64;   // generated on the host, tiled over the batch

bool device_present = false;

/// The host rows of one active fraction, generated once.
const troll_bench::logit_pair& host_rows(double active_fraction) {
  static std::map<double, troll_bench::logit_pair> cache;
  auto it = cache.find(active_fraction);
  if (it == cache.end())
    it = cache.emplace(active_fraction, troll_bench::make_logit_pair(unique_rows, vocab, active_fraction, bound))
             .first;
  return it->second;
}

void require(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw troll::backend_error(std::string("bench_cuda_projection: ") + what + ": " + cudaGetErrorString(status));
}

/// Device arrays of one batch (rows × V, packed), freed on scope exit.
template <class T>
struct device_batch {
  std::size_t rows = 0;
  T* new_logits = nullptr;
  T* old_logits = nullptr;
  T* log_probs = nullptr;
  T* upstream = nullptr;
  T* grad_new = nullptr;
  troll::projection_stats* stats = nullptr;
  // TROLL's objective: one sampled token and one advantage per row, the batch metrics, scratch.
  troll::token_id* tokens = nullptr;
  T* advantages = nullptr;
  troll::objective_metrics* metrics = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_size = 0;
  troll::trust_region_objective objective{};
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;

  device_batch(std::size_t n, double active_fraction) : rows(n) {
    const std::size_t bytes = rows * vocab * sizeof(T);
    for (T** p : {&new_logits, &old_logits, &log_probs, &upstream, &grad_new})
      require(cudaMalloc(reinterpret_cast<void**>(p), bytes), "cudaMalloc");
    require(cudaMalloc(reinterpret_cast<void**>(&stats), rows * sizeof(troll::projection_stats)), "cudaMalloc");
    require(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    require(cudaEventCreate(&start), "cudaEventCreate");
    require(cudaEventCreate(&stop), "cudaEventCreate");
    const troll_bench::logit_pair& host = host_rows(active_fraction);
    tile(troll_bench::as<T>(host.new_logits), new_logits);
    tile(troll_bench::as<T>(host.old_logits), old_logits);
    tile(troll_bench::as<T>(troll_bench::upstream_gradient(unique_rows, vocab)), upstream);
    objective.eps = bound;
    std::vector<troll::token_id> host_tokens(rows);
    std::vector<T> host_advantages(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      host_tokens[r] = static_cast<troll::token_id>((r * 7919) % vocab);
      host_advantages[r] = (r % 2 == 0) ? T(1) : T(-0.5);
    }
    require(cudaMalloc(reinterpret_cast<void**>(&tokens), rows * sizeof(troll::token_id)), "cudaMalloc");
    require(cudaMalloc(reinterpret_cast<void**>(&advantages), rows * sizeof(T)), "cudaMalloc");
    require(cudaMalloc(reinterpret_cast<void**>(&metrics), sizeof(troll::objective_metrics)), "cudaMalloc");
    workspace_size = troll::workspace_bytes(troll::cuda, troll::op::objective_forward{}, objective, rows, vocab);
    require(cudaMalloc(&workspace, std::max<std::size_t>(workspace_size, 1)), "cudaMalloc");
    require(cudaMemcpy(tokens, host_tokens.data(), rows * sizeof(troll::token_id), cudaMemcpyHostToDevice),
            "cudaMemcpy");
    require(cudaMemcpy(advantages, host_advantages.data(), rows * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    // The uploads ran on the legacy stream, which does not order the non-blocking one.
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  device_batch(const device_batch&) = delete;
  device_batch& operator=(const device_batch&) = delete;
  ~device_batch() {
    for (T* p : {new_logits, old_logits, log_probs, upstream, grad_new}) cudaFree(p);
    cudaFree(stats);
    cudaFree(tokens);
    cudaFree(advantages);
    cudaFree(metrics);
    cudaFree(workspace);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }

  /// Copies the unique host rows over the whole batch, repeating them.
  void tile(const std::vector<T>& host, T* device) {
    for (std::size_t r = 0; r < rows; r += unique_rows) {
      const std::size_t count = std::min(unique_rows, rows - r);
      require(cudaMemcpy(device + r * vocab, host.data(), count * vocab * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy");
    }
  }

  troll::batch_view<const T> in(const T* p) const { return troll::make_batch(p, rows, vocab); }
  troll::batch_view<T> out(T* p) const { return troll::make_batch(p, rows, vocab); }

  void forward() {
    troll::project(troll::cuda.on(stream), in(new_logits), in(old_logits), bound, out(log_probs), stats);
  }
  void backward() {
    troll::project_backward(troll::cuda.on(stream), in(new_logits), in(old_logits), in(log_probs), stats,
                            in(upstream), out(grad_new));
  }
  troll::token_batch<T> token_data() const {
    troll::token_batch<T> b;
    b.tokens = tokens;
    b.advantages = advantages;
    return b;
  }
  void objective_forward_backward() {
    const auto p = troll::cuda.on(stream).with_workspace(workspace, workspace_size);
    troll::objective_forward(p, objective, in(new_logits), in(old_logits), token_data(), out(log_probs), stats,
                             static_cast<T*>(nullptr), metrics);
    troll::objective_backward(p, objective, in(new_logits), in(old_logits), token_data(), in(log_probs), stats,
                              out(grad_new));
  }
  void log_softmax() { troll::log_softmax(troll::cuda.on(stream), in(new_logits), out(log_probs)); }

  /// Seconds `work` takes on the stream, by CUDA events.
  template <class Work>
  double timed(Work&& work) {
    require(cudaEventRecord(start, stream), "cudaEventRecord");
    work();
    require(cudaEventRecord(stop, stream), "cudaEventRecord");
    require(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    require(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(ms) * 1e-3;
  }

  /// Mean Newton evaluations per row of the last forward.
  double mean_iterations() const {
    std::vector<troll::projection_stats> host(rows);
    require(cudaMemcpy(host.data(), stats, rows * sizeof(troll::projection_stats), cudaMemcpyDeviceToHost),
            "cudaMemcpy");
    double sum = 0.0;
    for (const auto& s : host) sum += s.iterations;
    return sum / static_cast<double>(rows);
  }
};

enum class op { log_softmax, forward, backward, forward_backward, objective };

/// Arrays of V elements read or written once per row by each op.
int arrays_touched(op o) {
  switch (o) {
    case op::log_softmax: return 2;       // z̃ in, log π out
    case op::forward: return 3;           // z̃, z° in, log π* out
    case op::backward: return 5;          // z̃, z°, log π*, g in, ∂L/∂z̃ out
    case op::forward_backward: return 8;  // both
    case op::objective: return 7;         // forward: z̃, z° in, log π* out; backward: those 3 in, ∂L/∂z̃ out
  }
  return 0;
}

template <class T>
void run(benchmark::State& state, op o, std::size_t rows, double active_fraction) {
  if (!device_present) {
    state.SkipWithError("SKIPPED: no CUDA device");
    return;
  }
  try {
    device_batch<T> batch(rows, active_fraction);
    batch.forward();  // warm-up, and the backward's inputs
    require(cudaStreamSynchronize(batch.stream), "cudaStreamSynchronize");
    for (auto _ : state) {
      double seconds = 0.0;
      switch (o) {
        case op::log_softmax: seconds = batch.timed([&] { batch.log_softmax(); }); break;
        case op::forward: seconds = batch.timed([&] { batch.forward(); }); break;
        case op::backward: seconds = batch.timed([&] { batch.backward(); }); break;
        case op::forward_backward:
          seconds = batch.timed([&] {
            batch.forward();
            batch.backward();
          });
          break;
        case op::objective: seconds = batch.timed([&] { batch.objective_forward_backward(); }); break;
      }
      state.SetIterationTime(seconds);
    }
    const auto items = static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(rows);
    state.SetItemsProcessed(items);
    state.SetBytesProcessed(items * static_cast<std::int64_t>(vocab * sizeof(T)) * arrays_touched(o));
    if (o != op::log_softmax) state.counters["newton_evals_per_row"] = batch.mean_iterations();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_all() {
  struct named_op {
    op o;
    const char* name;
  };
  const named_op ops[] = {{op::log_softmax, "cuda_log_softmax"},
                          {op::forward, "cuda_project"},
                          {op::backward, "cuda_project_backward"},
                          {op::forward_backward, "cuda_project_forward_backward"},
                          {op::objective, "cuda_troll_objective_forward_backward"}};
  for (const named_op& n : ops) {
    for (int active_percent : {25, 100}) {
      if ((n.o == op::log_softmax || n.o == op::objective) && active_percent != 100) continue;
      for (std::size_t rows : {64u, 1024u, 4096u}) {
        const std::string suffix = "/active:" + std::to_string(active_percent) +
                                   "%/V:" + std::to_string(vocab) + "/rows:" + std::to_string(rows);
        const double fraction = active_percent / 100.0;
        const op o = n.o;
        benchmark::RegisterBenchmark((std::string(n.name) + "/float" + suffix).c_str(),
                                     [=](benchmark::State& s) { run<float>(s, o, rows, fraction); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
        if (rows == 1024)
          benchmark::RegisterBenchmark((std::string(n.name) + "/double" + suffix).c_str(),
                                       [=](benchmark::State& s) { run<double>(s, o, rows, fraction); })
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  device_present = status == cudaSuccess && count > 0;
  cudaGetLastError();
  if (!device_present) {
    std::printf("SKIPPED: no CUDA device (%s): every benchmark reports \"SKIPPED: no CUDA device\".\n",
                status == cudaSuccess ? "0 devices" : cudaGetErrorString(status));
  } else {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("device: %s (sm_%d%d, %.0f GiB)\n", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  }
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
