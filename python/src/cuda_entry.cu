// python/src/cuda_entry.cu — troll._troll_cuda's wrappers over troll's CUDA overloads (nvcc):
// each forwards to troll::<function>(troll::cuda.on(stream), ...) with the caller's views; the
// only code of its own packs / unpacks the projection statistics between troll's
// projection_stats and the module's two packed arrays (a one-thread-per-row copy kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include <troll/cuda.cuh>
#include <troll/cuda_sparse.cuh>

#include "cuda_entry.hpp"

namespace troll_py {
namespace cuda_entry {
namespace {

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

troll::cuda_checks checks_for(bool checked) { return checked ? troll::cuda_checked : troll::cuda_checks{}; }

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw troll::backend_error(std::string("troll._troll_cuda: ") + what + ": " + cudaGetErrorName(e) + ": " +
                               cudaGetErrorString(e));
}

/// A stream-ordered device buffer of projection_stats (cudaMallocAsync / cudaFreeAsync).
struct stats_buffer {
  troll::projection_stats* data = nullptr;
  cudaStream_t stream;

  stats_buffer(std::size_t rows, cudaStream_t s) : stream(s) {
    if (rows) check(cudaMallocAsync(reinterpret_cast<void**>(&data), rows * sizeof(troll::projection_stats), s),
                    "cudaMallocAsync (projection stats)");
  }
  ~stats_buffer() {
    if (data) cudaFreeAsync(data, stream);
  }
  stats_buffer(const stats_buffer&) = delete;
  stats_buffer& operator=(const stats_buffer&) = delete;
};

__global__ void pack_stats(const troll::projection_stats* s, std::size_t rows, double* values, std::int32_t* counters) {
  const std::size_t r = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  double* v = values + 6 * r;
  v[0] = s[r].t;
  v[1] = s[r].eta;
  v[2] = s[r].kl_before;
  v[3] = s[r].kl_after;
  v[4] = s[r].mu;
  v[5] = s[r].sigma2;
  counters[2 * r] = s[r].iterations;
  counters[2 * r + 1] = static_cast<std::int32_t>(s[r].status);
}

__global__ void unpack_stats(const double* values, const std::int32_t* counters, std::size_t rows,
                             troll::projection_stats* s) {
  const std::size_t r = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const double* v = values + 6 * r;
  s[r].t = v[0];
  s[r].eta = v[1];
  s[r].kl_before = v[2];
  s[r].kl_after = v[3];
  s[r].mu = v[4];
  s[r].sigma2 = v[5];
  s[r].iterations = counters[2 * r];
  s[r].status = static_cast<troll::row_status>(counters[2 * r + 1]);
}

unsigned blocks_for(std::size_t rows) { return unsigned((rows + 255) / 256); }

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for this query
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.name;
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

template <class T>
void log_softmax(void* stream, troll::batch_view<const T> logits, troll::batch_view<T> out, bool checked) {
  troll::log_softmax(troll::cuda.on(as_stream(stream)), logits, out, checks_for(checked));
}

template <class T>
void kl(void* stream, troll::batch_view<const T> p, troll::batch_view<const T> q, T* out, bool checked) {
  troll::kl(troll::cuda.on(as_stream(stream)), p, q, out, checks_for(checked));
}

template <class T>
void project(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits, double eps,
             troll::batch_view<T> out, double* stats_values, std::int32_t* stats_counters,
             const troll::projection_options& options, bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(new_logits.rows, s);
  troll::project(troll::cuda.on(s), new_logits, old_logits, eps, out, stats.data, options, checks_for(checked));
  if (new_logits.rows) {
    pack_stats<<<blocks_for(new_logits.rows), 256, 0, s>>>(stats.data, new_logits.rows, stats_values, stats_counters);
    check(cudaGetLastError(), "pack_stats launch");
  }
}

template <class T>
void project_backward(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                      troll::batch_view<const T> log_probs, const double* stats_values,
                      const std::int32_t* stats_counters, troll::batch_view<const T> grad_log_probs,
                      troll::batch_view<T> grad_new, troll::batch_view<T> grad_old, T* grad_eps, bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(new_logits.rows, s);
  if (new_logits.rows) {
    unpack_stats<<<blocks_for(new_logits.rows), 256, 0, s>>>(stats_values, stats_counters, new_logits.rows,
                                                               stats.data);
    check(cudaGetLastError(), "unpack_stats launch");
  }
  troll::project_backward(troll::cuda.on(s), new_logits, old_logits, log_probs, stats.data, grad_log_probs, grad_new,
                          grad_old, grad_eps, checks_for(checked));
}

template <class T>
void sparsify(void* stream, const any_logits& logits, const troll::sparse_index* sampled,
              const troll::sparsify_options& options, troll::sparse_batch_view<T> out, bool checked) {
  const auto policy = troll::cuda.on(as_stream(stream));
  auto run = [&](auto tag) {
    using L = decltype(tag);
    const troll::batch_view<const L> x{static_cast<const L*>(logits.data), logits.rows, logits.cols, logits.stride};
    troll::sparsify(policy, x, sampled, options, out, checks_for(checked));
  };
  switch (logits.kind) {
    case logit_kind::f16: return run(__half{});
    case logit_kind::bf16: return run(__nv_bfloat16{});
    case logit_kind::f32: return run(float{});
    case logit_kind::f64: return run(double{});
  }
}

#define TROLL_PY_INSTANTIATE(T)                                                                                     \
  template void log_softmax<T>(void*, troll::batch_view<const T>, troll::batch_view<T>, bool);                     \
  template void kl<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>, T*, bool);                     \
  template void project<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>, double,                  \
                           troll::batch_view<T>, double*, std::int32_t*, const troll::projection_options&, bool);  \
  template void project_backward<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>,                 \
                                    troll::batch_view<const T>, const double*, const std::int32_t*,                \
                                    troll::batch_view<const T>, troll::batch_view<T>, troll::batch_view<T>, T*,    \
                                    bool);                                                                         \
  template void sparsify<T>(void*, const any_logits&, const troll::sparse_index*, const troll::sparsify_options&,  \
                            troll::sparse_batch_view<T>, bool);
TROLL_PY_INSTANTIATE(float)
TROLL_PY_INSTANTIATE(double)
#undef TROLL_PY_INSTANTIATE

}  // namespace cuda_entry
}  // namespace troll_py
