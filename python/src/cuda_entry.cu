// python/src/cuda_entry.cu — troll._troll_cuda's wrappers over troll's CUDA overloads (nvcc):
// each forwards to troll::<function>(troll::cuda.on(stream), ...) with the caller's views; the
// only code of its own packs / unpacks the projection statistics between troll's
// projection_stats and the module's two packed arrays (a one-thread-per-row copy kernel) and
// allocates the objectives' workspaces (stream-ordered, troll::workspace_bytes bytes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include <troll/cuda.cuh>
#include <troll/cuda_sparse.cuh>
#include <troll/workspace.hpp>

#include "cuda_entry.hpp"

namespace troll_py {
namespace cuda_entry {
namespace {

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

/// The policy of a call: the caller's stream, checked mode on request (it travels in the policy).
troll::cuda_policy policy_for(void* stream, bool checked) { return troll::cuda.on(as_stream(stream)).checked(checked); }

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw troll::backend_error(std::string("troll._troll_cuda: ") + what + ": " + cudaGetErrorName(e) + ": " +
                               cudaGetErrorString(e));
}

/// A stream-ordered device buffer of n elements of E (cudaMallocAsync / cudaFreeAsync on the
/// caller's stream): the projection stats, token ids and objective workspaces of a call.
template <class E>
struct stream_buffer {
  E* data = nullptr;
  cudaStream_t stream;

  stream_buffer(std::size_t n, cudaStream_t s, const char* what) : stream(s) {
    if (n) check(cudaMallocAsync(reinterpret_cast<void**>(&data), n * sizeof(E), s), what);
  }
  ~stream_buffer() {
    if (data) cudaFreeAsync(data, stream);
  }
  stream_buffer(const stream_buffer&) = delete;
  stream_buffer& operator=(const stream_buffer&) = delete;
};

struct stats_buffer : stream_buffer<troll::projection_stats> {
  stats_buffer(std::size_t rows, cudaStream_t s)
      : stream_buffer<troll::projection_stats>(rows, s, "cudaMallocAsync (projection stats)") {}
};

struct token_buffer : stream_buffer<troll::token_id> {
  token_buffer(std::size_t rows, cudaStream_t s) : stream_buffer<troll::token_id>(rows, s, "cudaMallocAsync (token ids)") {}
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

/// Enqueues the copy of `rows` projection_stats into the module's packed arrays.
void pack(const troll::projection_stats* stats, std::size_t rows, double* values, std::int32_t* counters,
          cudaStream_t s) {
  if (rows == 0) return;
  pack_stats<<<blocks_for(rows), 256, 0, s>>>(stats, rows, values, counters);
  check(cudaGetLastError(), "pack_stats launch");
}

/// Enqueues the copy of the module's packed arrays into `rows` projection_stats.
void unpack(const double* values, const std::int32_t* counters, std::size_t rows, troll::projection_stats* stats,
            cudaStream_t s) {
  if (rows == 0) return;
  unpack_stats<<<blocks_for(rows), 256, 0, s>>>(values, counters, rows, stats);
  check(cudaGetLastError(), "unpack_stats launch");
}

/// Scratch bytes of an objective call, from troll::workspace_bytes.
struct workspace : stream_buffer<unsigned char> {
  workspace(std::size_t bytes, cudaStream_t s) : stream_buffer<unsigned char>(bytes, s, "cudaMallocAsync (workspace)") {}
};

__global__ void widen_tokens(const troll::sparse_index* in, std::size_t rows, troll::token_id* out) {
  const std::size_t r = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (r < rows) out[r] = in[r];
}

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
  troll::log_softmax(policy_for(stream, checked), logits, out);
}

template <class T>
void kl(void* stream, troll::batch_view<const T> p, troll::batch_view<const T> q, T* out, bool checked) {
  troll::kl(policy_for(stream, checked), p, q, out);
}

template <class T>
void kl_backward(void* stream, troll::batch_view<const T> p, troll::batch_view<const T> q, const T* grad_kl,
                 troll::batch_view<T> grad_p, troll::batch_view<T> grad_q, bool checked) {
  troll::kl_backward(policy_for(stream, checked), p, q, grad_kl, grad_p, grad_q);
}

template <class T>
void project(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits, double eps,
             troll::batch_view<T> out, double* stats_values, std::int32_t* stats_counters,
             const troll::projection_options& options, bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(new_logits.rows, s);
  troll::project(policy_for(stream, checked), new_logits, old_logits, eps, out, stats.data, options);
  pack(stats.data, new_logits.rows, stats_values, stats_counters, s);
}

template <class T>
void project_backward(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                      troll::batch_view<const T> log_probs, const double* stats_values,
                      const std::int32_t* stats_counters, troll::batch_view<const T> grad_log_probs,
                      troll::batch_view<T> grad_new, troll::batch_view<T> grad_old, T* grad_eps, bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(new_logits.rows, s);
  unpack(stats_values, stats_counters, new_logits.rows, stats.data, s);
  troll::project_backward(policy_for(stream, checked), new_logits, old_logits, log_probs, stats.data, grad_log_probs,
                          grad_new, grad_old, grad_eps);
}

template <class T>
void sparsify(void* stream, const any_logits& logits, const troll::sparse_index* sampled,
              const troll::sparsify_options& options, troll::sparse_batch_view<T> out, bool checked) {
  const troll::cuda_policy policy = policy_for(stream, checked);
  // troll's token ids are troll::token_id (int64); the module's sampled tokens are int32.
  token_buffer ids(sampled != nullptr ? logits.rows : 0, policy.stream);
  if (sampled != nullptr && logits.rows) {
    widen_tokens<<<blocks_for(logits.rows), 256, 0, policy.stream>>>(sampled, logits.rows, ids.data);
    check(cudaGetLastError(), "widen_tokens launch");
  }
  auto run = [&](auto tag) {
    using L = decltype(tag);
    const troll::batch_view<const L> x{static_cast<const L*>(logits.data), logits.rows, logits.cols, logits.stride};
    troll::sparsify(policy, x, sampled != nullptr ? ids.data : nullptr, options, out);
  };
  switch (logits.kind) {
    case logit_kind::f16: return run(__half{});
    case logit_kind::bf16: return run(__nv_bfloat16{});
    case logit_kind::f32: return run(float{});
    case logit_kind::f64: return run(double{});
  }
}

template <class T>
void sparsify_backward(void* stream, troll::batch_view<const T> logits, troll::sparse_batch_view<const T> support,
                       troll::sparse_grad_view<const T> grad, troll::batch_view<T> grad_logits, bool checked) {
  troll::sparsify_backward(policy_for(stream, checked), logits, support, grad, grad_logits);
}

template <class T>
void align(void* stream, troll::batch_view<const T> new_logits, troll::sparse_batch_view<const T> new_support,
           troll::sparse_batch_view<const T> old_rows, troll::aligned_batch_view<T> out, bool checked) {
  troll::align(policy_for(stream, checked), new_logits, new_support, old_rows, out);
}

template <class T>
void kl_sparse(void* stream, troll::aligned_batch_view<const T> rows, T* out, bool checked) {
  troll::kl(policy_for(stream, checked), rows, out);
}

template <class T>
void project_sparse(void* stream, troll::aligned_batch_view<const T> rows, double eps, troll::sparse_batch_view<T> out,
                    double* stats_values, std::int32_t* stats_counters, const troll::projection_options& options,
                    bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(rows.rows, s);
  troll::project(policy_for(stream, checked), rows, eps, out, stats.data, options);
  pack(stats.data, rows.rows, stats_values, stats_counters, s);
}

template <class T>
void project_sparse_backward(void* stream, troll::aligned_batch_view<const T> rows,
                             troll::sparse_batch_view<const T> log_probs, const double* stats_values,
                             const std::int32_t* stats_counters, troll::sparse_grad_view<const T> grad,
                             troll::sparse_grad_view<T> grad_new, troll::sparse_grad_view<T> grad_old, T* grad_eps,
                             bool checked) {
  const cudaStream_t s = as_stream(stream);
  stats_buffer stats(rows.rows, s);
  unpack(stats_values, stats_counters, rows.rows, stats.data, s);
  troll::project_backward(policy_for(stream, checked), rows, log_probs, stats.data, grad, grad_new, grad_old,
                          grad_eps);
}

template <class T>
void trust_region_forward(void* stream, const troll::trust_region_objective& objective,
                          troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                          const troll::token_batch<T>& batch, troll::batch_view<T> log_probs, double* stats_values,
                          std::int32_t* stats_counters, T* token_loss, troll::objective_metrics* metrics,
                          bool checked) {
  const cudaStream_t s = as_stream(stream);
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes =
      troll::workspace_bytes(base, troll::op::objective_forward{}, objective, new_logits.rows, new_logits.cols);
  workspace ws(bytes, s);
  stats_buffer stats(new_logits.rows, s);
  troll::objective_forward(base.with_workspace(ws.data, bytes), objective, new_logits, old_logits, batch, log_probs,
                           stats.data, token_loss, metrics);
  pack(stats.data, new_logits.rows, stats_values, stats_counters, s);
}

template <class T>
void trust_region_backward(void* stream, const troll::trust_region_objective& objective,
                           troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                           const troll::token_batch<T>& batch, troll::batch_view<const T> log_probs,
                           const double* stats_values, const std::int32_t* stats_counters,
                           troll::batch_view<T> grad_new, double grad_loss, bool checked) {
  const cudaStream_t s = as_stream(stream);
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes =
      troll::workspace_bytes(base, troll::op::objective_backward{}, objective, new_logits.rows, new_logits.cols);
  workspace ws(bytes, s);
  stats_buffer stats(new_logits.rows, s);
  unpack(stats_values, stats_counters, new_logits.rows, stats.data, s);
  troll::objective_backward(base.with_workspace(ws.data, bytes), objective, new_logits, old_logits, batch, log_probs,
                            stats.data, grad_new, grad_loss);
}

template <class T, class Objective>
void ratio_forward(void* stream, const Objective& objective, troll::batch_view<const T> new_logits,
                   troll::batch_view<const T> old_logits, const troll::token_batch<T>& batch, T* token_loss,
                   troll::objective_metrics* metrics, bool checked) {
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes =
      troll::workspace_bytes(base, troll::op::objective_forward{}, objective, new_logits.rows, new_logits.cols);
  workspace ws(bytes, as_stream(stream));
  troll::objective_forward(base.with_workspace(ws.data, bytes), objective, new_logits, old_logits, batch, token_loss,
                           metrics);
}

template <class T, class Objective>
void ratio_backward(void* stream, const Objective& objective, troll::batch_view<const T> new_logits,
                    troll::batch_view<const T> old_logits, const troll::token_batch<T>& batch,
                    troll::batch_view<T> grad_new, double grad_loss, bool checked) {
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes =
      troll::workspace_bytes(base, troll::op::objective_backward{}, objective, new_logits.rows, new_logits.cols);
  workspace ws(bytes, as_stream(stream));
  troll::objective_backward(base.with_workspace(ws.data, bytes), objective, new_logits, old_logits, batch, grad_new,
                            grad_loss);
}

template <class T>
void sparse_trust_region_forward(void* stream, const troll::sparse_trust_region_objective& objective,
                                 troll::batch_view<const T> new_logits, troll::sparse_batch_view<const T> old_rows,
                                 const troll::token_batch<T>& batch, troll::aligned_batch_view<T> aligned,
                                 troll::sparse_batch_view<T> log_probs, double* stats_values,
                                 std::int32_t* stats_counters, T* token_loss, troll::objective_metrics* metrics,
                                 bool checked) {
  const cudaStream_t s = as_stream(stream);
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes = troll::workspace_bytes(base, troll::op::objective_forward{}, objective, new_logits.rows,
                                                   new_logits.cols, aligned.k_max);
  workspace ws(bytes, s);
  stats_buffer stats(new_logits.rows, s);
  troll::objective_forward(base.with_workspace(ws.data, bytes), objective, new_logits, old_rows, batch, aligned,
                           log_probs, stats.data, token_loss, metrics);
  pack(stats.data, new_logits.rows, stats_values, stats_counters, s);
}

template <class T>
void sparse_trust_region_backward(void* stream, const troll::sparse_trust_region_objective& objective,
                                  troll::batch_view<const T> new_logits, troll::aligned_batch_view<const T> aligned,
                                  const troll::token_batch<T>& batch, troll::sparse_batch_view<const T> log_probs,
                                  const double* stats_values, const std::int32_t* stats_counters,
                                  troll::batch_view<T> grad_new, double grad_loss, bool checked) {
  const cudaStream_t s = as_stream(stream);
  const troll::cuda_policy base = policy_for(stream, checked);
  const std::size_t bytes = troll::workspace_bytes(base, troll::op::objective_backward{}, objective, new_logits.rows,
                                                   new_logits.cols, aligned.k_max);
  workspace ws(bytes, s);
  stats_buffer stats(new_logits.rows, s);
  unpack(stats_values, stats_counters, new_logits.rows, stats.data, s);
  troll::objective_backward(base.with_workspace(ws.data, bytes), objective, new_logits, aligned, batch, log_probs,
                            stats.data, grad_new, grad_loss);
}

#define TROLL_PY_INSTANTIATE(T)                                                                                     \
  template void log_softmax<T>(void*, troll::batch_view<const T>, troll::batch_view<T>, bool);                     \
  template void kl<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>, T*, bool);                     \
  template void kl_backward<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>, const T*,            \
                               troll::batch_view<T>, troll::batch_view<T>, bool);                                  \
  template void project<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>, double,                  \
                           troll::batch_view<T>, double*, std::int32_t*, const troll::projection_options&, bool);  \
  template void project_backward<T>(void*, troll::batch_view<const T>, troll::batch_view<const T>,                 \
                                    troll::batch_view<const T>, const double*, const std::int32_t*,                \
                                    troll::batch_view<const T>, troll::batch_view<T>, troll::batch_view<T>, T*,    \
                                    bool);                                                                         \
  template void sparsify<T>(void*, const any_logits&, const troll::sparse_index*, const troll::sparsify_options&,  \
                            troll::sparse_batch_view<T>, bool);                                                \
  template void sparsify_backward<T>(void*, troll::batch_view<const T>, troll::sparse_batch_view<const T>,        \
                                     troll::sparse_grad_view<const T>, troll::batch_view<T>, bool);                \
  template void align<T>(void*, troll::batch_view<const T>, troll::sparse_batch_view<const T>,                    \
                         troll::sparse_batch_view<const T>, troll::aligned_batch_view<T>, bool);                   \
  template void kl_sparse<T>(void*, troll::aligned_batch_view<const T>, T*, bool);                                 \
  template void project_sparse<T>(void*, troll::aligned_batch_view<const T>, double, troll::sparse_batch_view<T>,  \
                                  double*, std::int32_t*, const troll::projection_options&, bool);                 \
  template void project_sparse_backward<T>(void*, troll::aligned_batch_view<const T>,                              \
                                           troll::sparse_batch_view<const T>, const double*, const std::int32_t*,  \
                                           troll::sparse_grad_view<const T>, troll::sparse_grad_view<T>,           \
                                           troll::sparse_grad_view<T>, T*, bool);                                  \
  template void trust_region_forward<T>(void*, const troll::trust_region_objective&, troll::batch_view<const T>,   \
                                        troll::batch_view<const T>, const troll::token_batch<T>&,                  \
                                        troll::batch_view<T>, double*, std::int32_t*, T*,                          \
                                        troll::objective_metrics*, bool);                                          \
  template void trust_region_backward<T>(void*, const troll::trust_region_objective&, troll::batch_view<const T>,  \
                                         troll::batch_view<const T>, const troll::token_batch<T>&,                 \
                                         troll::batch_view<const T>, const double*, const std::int32_t*,           \
                                         troll::batch_view<T>, double, bool);                                      \
  template void ratio_forward<T, troll::ppo_clip_objective>(                                                       \
      void*, const troll::ppo_clip_objective&, troll::batch_view<const T>, troll::batch_view<const T>,             \
      const troll::token_batch<T>&, T*, troll::objective_metrics*, bool);                                          \
  template void ratio_forward<T, troll::dppo_objective>(                                                           \
      void*, const troll::dppo_objective&, troll::batch_view<const T>, troll::batch_view<const T>,                 \
      const troll::token_batch<T>&, T*, troll::objective_metrics*, bool);                                          \
  template void ratio_backward<T, troll::ppo_clip_objective>(                                                      \
      void*, const troll::ppo_clip_objective&, troll::batch_view<const T>, troll::batch_view<const T>,             \
      const troll::token_batch<T>&, troll::batch_view<T>, double, bool);                                           \
  template void ratio_backward<T, troll::dppo_objective>(                                                          \
      void*, const troll::dppo_objective&, troll::batch_view<const T>, troll::batch_view<const T>,                 \
      const troll::token_batch<T>&, troll::batch_view<T>, double, bool);                                           \
  template void sparse_trust_region_forward<T>(                                                                    \
      void*, const troll::sparse_trust_region_objective&, troll::batch_view<const T>,                              \
      troll::sparse_batch_view<const T>, const troll::token_batch<T>&, troll::aligned_batch_view<T>,               \
      troll::sparse_batch_view<T>, double*, std::int32_t*, T*, troll::objective_metrics*, bool);                   \
  template void sparse_trust_region_backward<T>(                                                                   \
      void*, const troll::sparse_trust_region_objective&, troll::batch_view<const T>,                              \
      troll::aligned_batch_view<const T>, const troll::token_batch<T>&, troll::sparse_batch_view<const T>,         \
      const double*, const std::int32_t*, troll::batch_view<T>, double, bool);
TROLL_PY_INSTANTIATE(float)
TROLL_PY_INSTANTIATE(double)
#undef TROLL_PY_INSTANTIATE

}  // namespace cuda_entry
}  // namespace troll_py
