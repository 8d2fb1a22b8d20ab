// bench/cuda/bench_cuda_sparse.cu — the CUDA sparse path: sparsify of bf16 logits at N = 8,192 ×
// V = 151,936 (GB/s of logits read, beside a cudaMemcpy device-to-device of the same bytes
// measured in this binary: the copy moves 2× the bytes, read + write), and sparse projection
// forward + backward at N = 1,048,576 rows, K = 64 (rows/s). Timed with CUDA events on one
// stream. Every benchmark skips without a device. Numbers from an H100: docs/performance.md.
#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "troll/cuda.cuh"

namespace {

bool has_device() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return ok;
}

template <class T>
T* device_alloc(std::size_t n) {
  void* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) return nullptr;
  return static_cast<T*>(p);
}

/// Times `body` (enqueued on `stream`) with CUDA events, as manual time.
template <class Body>
void time_loop(benchmark::State& state, cudaStream_t stream, Body&& body) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  body();  // warm-up
  for (auto _ : state) {
    cudaEventRecord(start, stream);
    body();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(double(ms) * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

constexpr std::size_t sparsify_rows = 8192, vocab = 151936;

/// Fills bf16 logits on the device with a deterministic Zipf-like pattern (host generated).
__nv_bfloat16* make_logits() {
  __nv_bfloat16* d = device_alloc<__nv_bfloat16>(sparsify_rows * vocab);
  if (d == nullptr) return nullptr;
  std::vector<__nv_bfloat16> row(vocab);
  for (std::size_t r = 0; r < sparsify_rows; ++r) {
    if (r < 64) {
      for (std::size_t i = 0; i < vocab; ++i) {
        const std::size_t rank = (i * 2654435761u + r * 97) % vocab;
        row[i] = __float2bfloat16(-2.0f * std::log1p(float(rank)));
      }
    }
    cudaMemcpy(d + r * vocab, row.data(), vocab * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
  }
  return d;
}

void bm_copy_bf16(benchmark::State& state) {
  if (!has_device()) return state.SkipWithError("SKIPPED: no CUDA device");
  const std::size_t bytes = sparsify_rows * vocab * sizeof(__nv_bfloat16);
  char* a = device_alloc<char>(bytes);
  char* b = device_alloc<char>(bytes);
  if (a == nullptr || b == nullptr) return state.SkipWithError("cudaMalloc failed");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  time_loop(state, stream, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream); });
  state.counters["GB/s_read+write"] =
      benchmark::Counter(2.0 * double(bytes) * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
  cudaStreamDestroy(stream);
  cudaFree(a);
  cudaFree(b);
}

void bm_sparsify_bf16(benchmark::State& state) {
  if (!has_device()) return state.SkipWithError("SKIPPED: no CUDA device");
  const int k = int(state.range(0));
  __nv_bfloat16* logits = make_logits();
  const std::size_t k_max = std::size_t(k) + 1;
  troll::sparse_index* indices = device_alloc<troll::sparse_index>(sparsify_rows * k_max);
  troll::sparse_index* counts = device_alloc<troll::sparse_index>(sparsify_rows);
  float* log_probs = device_alloc<float>(sparsify_rows * k_max);
  float* remainder = device_alloc<float>(sparsify_rows);
  if (!logits || !indices || !counts || !log_probs || !remainder) return state.SkipWithError("cudaMalloc failed");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const troll::sparse_batch_view<float> out{indices, log_probs, counts, remainder, sparsify_rows, k_max, vocab};
  time_loop(state, stream, [&] {
    troll::sparsify(troll::cuda.on(stream), troll::make_batch<const __nv_bfloat16>(logits, sparsify_rows, vocab),
                    nullptr, troll::sparsify_options{k, 1e-5}, out);
  });
  const double bytes = double(sparsify_rows * vocab * sizeof(__nv_bfloat16));
  state.counters["GB/s_read"] = benchmark::Counter(bytes * double(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
  state.counters["rows/s"] = benchmark::Counter(double(sparsify_rows) * double(state.iterations()), benchmark::Counter::kIsRate);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(logits), static_cast<void*>(indices), static_cast<void*>(counts),
                  static_cast<void*>(log_probs), static_cast<void*>(remainder)})
    cudaFree(p);
}

/// Sparse projection forward + backward of N aligned rows with K = 64 entries each (new and old
/// supports share half their tokens: |U| = 96), float, ε = 0.05.
void bm_sparse_project_fwd_bwd(benchmark::State& state) {
  if (!has_device()) return state.SkipWithError("SKIPPED: no CUDA device");
  const std::size_t rows = std::size_t(state.range(0)), u = 96, k_max = 96;
  std::vector<troll::sparse_index> idx(u), cnt(1, troll::sparse_index(u));
  std::vector<float> ln(u), lo(u);
  for (std::size_t i = 0; i < u; ++i) {
    idx[i] = troll::sparse_index(i * 13);
    ln[i] = i < 64 ? -0.05f * float(i) - 3.0f : -20.0f;
    lo[i] = i >= 32 ? -0.05f * float(95 - i) - 3.0f : -20.0f;
  }
  troll::sparse_index* d_idx = device_alloc<troll::sparse_index>(rows * k_max);
  troll::sparse_index* d_cnt = device_alloc<troll::sparse_index>(rows);
  float* buffers[10];
  for (float*& b : buffers) b = device_alloc<float>(rows * k_max);
  troll::projection_stats* stats = device_alloc<troll::projection_stats>(rows);
  if (!d_idx || !d_cnt || !stats) return state.SkipWithError("cudaMalloc failed");
  for (float* b : buffers)
    if (!b) return state.SkipWithError("cudaMalloc failed");
  for (std::size_t r = 0; r < rows; ++r) {
    cudaMemcpy(d_idx + r * k_max, idx.data(), u * sizeof(troll::sparse_index), cudaMemcpyHostToDevice);
    cudaMemcpy(buffers[0] + r * k_max, ln.data(), u * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(buffers[1] + r * k_max, lo.data(), u * sizeof(float), cudaMemcpyHostToDevice);
    if (r % 65536 == 0) break;  // the rest: copied below in bulk
  }
  for (std::size_t r = 1; r < rows; r *= 2) {
    const std::size_t n = (r < rows - r ? r : rows - r) * k_max;
    cudaMemcpy(d_idx + r * k_max, d_idx, n * sizeof(troll::sparse_index), cudaMemcpyDeviceToDevice);
    cudaMemcpy(buffers[0] + r * k_max, buffers[0], n * sizeof(float), cudaMemcpyDeviceToDevice);
    cudaMemcpy(buffers[1] + r * k_max, buffers[1], n * sizeof(float), cudaMemcpyDeviceToDevice);
  }
  std::vector<troll::sparse_index> counts(rows, troll::sparse_index(u));
  cudaMemcpy(d_cnt, counts.data(), rows * sizeof(troll::sparse_index), cudaMemcpyHostToDevice);
  std::vector<float> rem(rows, -6.0f);
  cudaMemcpy(buffers[2], rem.data(), rows * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(buffers[3], rem.data(), rows * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(buffers[6], 0, rows * k_max * sizeof(float));
  const troll::aligned_batch_view<float> aligned{d_idx, d_cnt, buffers[0], buffers[1], buffers[2], buffers[3], rows, k_max,
                                                 151936};
  // The projection writes its own copy of the support: separate buffers, no aliasing of inputs.
  troll::sparse_index* out_idx = device_alloc<troll::sparse_index>(rows * k_max);
  troll::sparse_index* out_cnt = device_alloc<troll::sparse_index>(rows);
  if (!out_idx || !out_cnt) return state.SkipWithError("cudaMalloc failed");
  const troll::sparse_batch_view<float> out{out_idx, buffers[4], out_cnt, buffers[5], rows, k_max, 151936};
  const troll::sparse_grad_view<float> upstream{buffers[6], buffers[7], rows, k_max};
  const troll::sparse_grad_view<float> grad_new{buffers[8], buffers[9], rows, k_max};
  cudaMemset(buffers[7], 0, rows * sizeof(float));
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  time_loop(state, stream, [&] {
    troll::project(troll::cuda.on(stream), aligned, 0.05, out, stats);
    troll::project_backward(troll::cuda.on(stream), aligned, out, stats, upstream, grad_new);
  });
  state.counters["rows/s"] = benchmark::Counter(double(rows) * double(state.iterations()), benchmark::Counter::kIsRate);
  cudaStreamDestroy(stream);
  cudaFree(d_idx);
  cudaFree(d_cnt);
  cudaFree(out_idx);
  cudaFree(out_cnt);
  cudaFree(stats);
  for (float* b : buffers) cudaFree(b);
}

}  // namespace

BENCHMARK(bm_copy_bf16)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(bm_sparsify_bf16)->Arg(64)->Arg(256)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(bm_sparse_project_fwd_bwd)->Arg(1 << 20)->UseManualTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
