// examples/cuda/quickstart_cuda.cu — the TROLL projection on the GPU: copy two batches of logits
// to the device, project them onto KL(π ‖ q) ≤ ε on a stream, backpropagate an upstream gradient,
// and read the results back. Without a CUDA device it says so and exits 0.
//
// The checks argument shows the non-synchronising validation: one report per row and the lowest
// rejected row, both in device memory and read back with the results.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "troll/cuda.cuh"

namespace {

void require(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  std::fprintf(stderr, "quickstart_cuda: %s failed: %s\n", what, cudaGetErrorString(status));
  std::exit(1);
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* device = nullptr;
  require(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T)), "cudaMalloc");
  require(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return device;
}

template <class T>
std::vector<T> to_host(const T* device, std::size_t n) {
  std::vector<T> host(n);
  require(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return host;
}

}  // namespace

int main() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::printf("quickstart_cuda: no CUDA device (%s); nothing to run. This example needs a GPU.\n",
                status == cudaSuccess ? "0 devices" : cudaGetErrorString(status));
    return 0;
  }

  // Two rows over a 5-token vocabulary: the new policy moved far from the old one in row 0 and
  // barely at all in row 1.
  const std::size_t rows = 2, vocab = 5;
  const double eps = 0.05;
  const std::vector<float> new_logits = {3.0f, 0.0f, -1.0f, 0.5f, -2.0f,  //
                                         0.1f, 0.0f, 0.0f,  0.0f, 0.0f};
  const std::vector<float> old_logits = {0.0f, 1.0f, 0.0f, 0.5f, -1.0f,  //
                                         0.0f, 0.0f, 0.0f, 0.0f, 0.0f};

  cudaStream_t stream = nullptr;
  require(cudaStreamCreate(&stream), "cudaStreamCreate");
  float* d_new = to_device(new_logits);
  float* d_old = to_device(old_logits);
  float* d_log_probs = to_device(std::vector<float>(rows * vocab));
  float* d_upstream = to_device(std::vector<float>(rows * vocab, 0.0f));
  float* d_grad = to_device(std::vector<float>(rows * vocab));
  troll::projection_stats* d_stats = nullptr;
  troll::cuda_row_report* d_reports = nullptr;
  unsigned long long* d_first_bad = nullptr;
  require(cudaMalloc(reinterpret_cast<void**>(&d_stats), rows * sizeof(troll::projection_stats)), "cudaMalloc");
  require(cudaMalloc(reinterpret_cast<void**>(&d_reports), rows * sizeof(troll::cuda_row_report)), "cudaMalloc");
  require(cudaMalloc(reinterpret_cast<void**>(&d_first_bad), sizeof(unsigned long long)), "cudaMalloc");

  const auto in = [&](const float* p) { return troll::make_batch(p, rows, vocab); };
  const auto out = [&](float* p) { return troll::make_batch(p, rows, vocab); };
  // The policy carries the stream and where per-row reports go; the arguments are the CPU's.
  const troll::cuda_policy policy = troll::cuda.on(stream).reporting(d_reports, d_first_bad);

  // Forward: log π* and per-row statistics, enqueued on `stream` (no synchronisation inside).
  troll::project(policy, in(d_new), in(d_old), eps, out(d_log_probs), d_stats);

  // Backward of L = log π*[0][0] (the first token of row 0): upstream gradient e_0 in row 0.
  const float one = 1.0f;
  require(cudaMemcpyAsync(d_upstream, &one, sizeof one, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  troll::project_backward(troll::cuda.on(stream), in(d_new), in(d_old), in(d_log_probs), d_stats, in(d_upstream),
                          out(d_grad));
  require(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  const unsigned long long first_bad = to_host(d_first_bad, 1)[0];
  if (first_bad != ~0ull) {
    std::printf("row %llu was rejected (error code %d)\n", first_bad,
                static_cast<int>(to_host(d_reports, rows)[first_bad].error));
    return 1;
  }
  const std::vector<float> log_probs = to_host(d_log_probs, rows * vocab);
  const std::vector<float> grad = to_host(d_grad, rows * vocab);
  const std::vector<troll::projection_stats> stats = to_host(d_stats, rows);
  for (std::size_t r = 0; r < rows; ++r) {
    std::printf("row %zu: %s, KL(p~||q) = %.5f -> KL(pi*||q) = %.5f, eta = %.4f\n  pi* =", r,
                stats[r].status == troll::row_status::projected ? "projected" : "unchanged", stats[r].kl_before,
                stats[r].kl_after, stats[r].eta);
    for (std::size_t i = 0; i < vocab; ++i) std::printf(" %.4f", std::exp(log_probs[r * vocab + i]));
    std::printf("\n");
  }
  std::printf("d log pi*[0][0] / d new_logits[0] =");
  for (std::size_t i = 0; i < vocab; ++i) std::printf(" %+.4f", grad[i]);
  std::printf("\n");

  for (void* p : {static_cast<void*>(d_new), static_cast<void*>(d_old), static_cast<void*>(d_log_probs),
                  static_cast<void*>(d_upstream), static_cast<void*>(d_grad), static_cast<void*>(d_stats),
                  static_cast<void*>(d_reports), static_cast<void*>(d_first_bad)})
    cudaFree(p);
  cudaStreamDestroy(stream);
  return 0;
}
