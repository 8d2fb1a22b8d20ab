// python/src/cuda_gaussian_entry.cu — troll._troll_cuda's Gaussian wrappers (nvcc): each forwards
// to troll::gaussian::<function>(troll::cuda.on(stream), ...) with the caller's views. Its own
// code: the packing of gaussian_stats to and from the module's two arrays (one thread a row), and
// the stream-ordered workspace of full rows above d = 32 (troll::workspace_bytes).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <troll/cuda_gaussian.cuh>
#include <troll/workspace.hpp>

#include "cuda_gaussian_entry.hpp"

namespace troll_py {
namespace cuda_entry {
namespace {

namespace g = troll::gaussian;

cudaStream_t as_cuda_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

troll::cuda_policy gaussian_policy(void* stream, bool checked) {
  return troll::cuda.on(as_cuda_stream(stream)).checked(checked);
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw troll::backend_error(std::string("troll._troll_cuda: ") + what + ": " + cudaGetErrorName(e) + ": " +
                               cudaGetErrorString(e));
}

/// Stream-ordered device memory of n elements of E, freed (stream-ordered) on scope exit.
template <class E>
struct device_scratch {
  E* data = nullptr;
  cudaStream_t stream;
  device_scratch(std::size_t n, cudaStream_t s, const char* what) : stream(s) {
    if (n) check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&data), n * sizeof(E), s), what);
  }
  ~device_scratch() {
    if (data) cudaFreeAsync(data, stream);
  }
  device_scratch(const device_scratch&) = delete;
  device_scratch& operator=(const device_scratch&) = delete;
};

/// The policy with a stream-ordered workspace of the size `Op` needs (none up to d = 32).
template <class Op>
struct gaussian_workspace {
  device_scratch<unsigned char> memory;
  troll::cuda_policy policy;
  gaussian_workspace(troll::cuda_policy p, Op op, std::size_t rows, std::size_t d)
      : memory(troll::workspace_bytes(troll::cuda, op, rows, d), p.stream, "cudaMallocAsync (Gaussian workspace)"),
        policy(p.with_workspace(memory.data, troll::workspace_bytes(troll::cuda, op, rows, d))) {}
};

__global__ void pack_gaussian_stats(const g::gaussian_stats* s, std::size_t rows, troll::batch_view<double> values,
                                    troll::batch_view<std::int32_t> counters) {
  const std::size_t r = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  double* v = values.row(r);
  v[0] = s[r].t;
  v[1] = s[r].eta;
  v[2] = s[r].omega;
  v[3] = s[r].kl_before;
  v[4] = s[r].kl_after;
  v[5] = s[r].mean_kl_before;
  v[6] = s[r].mean_kl_after;
  v[7] = s[r].fisher;
  counters.row(r)[0] = s[r].iterations;
  counters.row(r)[1] = static_cast<std::int32_t>(s[r].status);
}

__global__ void unpack_gaussian_stats(troll::batch_view<const double> values,
                                      troll::batch_view<const std::int32_t> counters, std::size_t rows,
                                      g::gaussian_stats* s) {
  const std::size_t r = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const double* v = values.row(r);
  s[r].t = v[0];
  s[r].eta = v[1];
  s[r].omega = v[2];
  s[r].kl_before = v[3];
  s[r].kl_after = v[4];
  s[r].mean_kl_before = v[5];
  s[r].mean_kl_after = v[6];
  s[r].fisher = v[7];
  s[r].iterations = counters.row(r)[0];
  s[r].status = static_cast<troll::row_status>(counters.row(r)[1]);
}

unsigned row_blocks(std::size_t rows) { return unsigned((rows + 255) / 256); }

/// The forward's packed stats as gaussian_stats in stream-ordered device memory.
struct unpacked_stats : device_scratch<g::gaussian_stats> {
  unpacked_stats(troll::batch_view<const double> values, troll::batch_view<const std::int32_t> counters,
                 cudaStream_t s)
      : device_scratch<g::gaussian_stats>(values.rows, s, "cudaMallocAsync (Gaussian stats)") {
    if (values.rows == 0) return;
    unpack_gaussian_stats<<<row_blocks(values.rows), 256, 0, s>>>(values, counters, values.rows, data);
    check_cuda(cudaGetLastError(), "unpack_gaussian_stats launch");
  }
};

}  // namespace

template <class T>
void gaussian_project(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                      troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                      troll::batch_view<const T> old_cov, double eps_mean, double eps_cov, troll::batch_view<T> out_mean,
                      troll::batch_view<T> out_cov, troll::batch_view<double> stats_values,
                      troll::batch_view<std::int32_t> stats_counters, const troll::projection_options& options,
                      g::saved_factorisation<double> saved, bool checked) {
  const cudaStream_t s = as_cuda_stream(stream);
  device_scratch<g::gaussian_stats> stats(mean.rows, s, "cudaMallocAsync (Gaussian stats)");
  const gaussian_workspace<troll::op::gaussian_project_joint> w(gaussian_policy(stream, checked), {}, mean.rows,
                                                                full ? mean.cols : 0);
  if (full && split) {
    g::project_split(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov, stats.data,
                     options, saved);
  } else if (full) {
    g::project_joint(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data, options, saved);
  } else if (split) {
    g::project_split_diag(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov, stats.data,
                          options);
  } else {
    g::project_joint_diag(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data, options);
  }
  if (mean.rows == 0) return;
  pack_gaussian_stats<<<row_blocks(mean.rows), 256, 0, s>>>(stats.data, mean.rows, stats_values, stats_counters);
  check_cuda(cudaGetLastError(), "pack_gaussian_stats launch");
}

template <class T>
void gaussian_project_backward(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                               troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                               troll::batch_view<const T> old_cov, double eps_mean, double eps_cov,
                               troll::batch_view<const T> out_mean, troll::batch_view<const T> out_cov,
                               troll::batch_view<const double> stats_values,
                               troll::batch_view<const std::int32_t> stats_counters,
                               troll::batch_view<const T> grad_out_mean, troll::batch_view<const T> grad_out_cov,
                               const g::gaussian_grads<T>& grads, g::saved_factorisation<const double> saved,
                               bool checked) {
  const cudaStream_t s = as_cuda_stream(stream);
  const unpacked_stats stats(stats_values, stats_counters, s);
  const gaussian_workspace<troll::op::gaussian_project_joint_backward> w(gaussian_policy(stream, checked), {},
                                                                         mean.rows, full ? mean.cols : 0);
  if (full && split) {
    g::project_split_backward(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov,
                              stats.data, grad_out_mean, grad_out_cov, grads, saved);
  } else if (full) {
    g::project_joint_backward(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data,
                              grad_out_mean, grad_out_cov, grads, saved);
  } else if (split) {
    g::project_split_diag_backward(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov,
                                   stats.data, grad_out_mean, grad_out_cov, grads);
  } else {
    g::project_joint_diag_backward(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data,
                                   grad_out_mean, grad_out_cov, grads);
  }
}

template <class T>
void gaussian_project_jvp(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                          troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                          troll::batch_view<const T> old_cov, double eps_mean, double eps_cov,
                          troll::batch_view<const T> out_mean, troll::batch_view<const T> out_cov,
                          troll::batch_view<const double> stats_values,
                          troll::batch_view<const std::int32_t> stats_counters,
                          const g::gaussian_tangents<T>& tangents, troll::batch_view<T> tangent_out_mean,
                          troll::batch_view<T> tangent_out_cov, g::saved_factorisation<const double> saved,
                          bool checked) {
  const cudaStream_t s = as_cuda_stream(stream);
  const unpacked_stats stats(stats_values, stats_counters, s);
  const gaussian_workspace<troll::op::gaussian_project_joint_jvp> w(gaussian_policy(stream, checked), {}, mean.rows,
                                                                    full ? mean.cols : 0);
  if (full && split) {
    g::project_split_jvp(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov, stats.data,
                         tangents, tangent_out_mean, tangent_out_cov, saved);
  } else if (full) {
    g::project_joint_jvp(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data, tangents,
                         tangent_out_mean, tangent_out_cov, saved);
  } else if (split) {
    g::project_split_diag_jvp(w.policy, mean, cov, old_mean, old_cov, eps_mean, eps_cov, out_mean, out_cov,
                              stats.data, tangents, tangent_out_mean, tangent_out_cov);
  } else {
    g::project_joint_diag_jvp(w.policy, mean, cov, old_mean, old_cov, eps_mean, out_mean, out_cov, stats.data,
                              tangents, tangent_out_mean, tangent_out_cov);
  }
}

template <class T>
void gaussian_kl(void* stream, bool full, troll::batch_view<const T> mean, troll::batch_view<const T> cov,
                 troll::batch_view<const T> old_mean, troll::batch_view<const T> old_cov, double* out, bool checked) {
  const gaussian_workspace<troll::op::gaussian_kl> w(gaussian_policy(stream, checked), {}, mean.rows,
                                                     full ? mean.cols : 0);
  if (full) {
    g::kl(w.policy, mean, cov, old_mean, old_cov, out);
  } else {
    g::kl_diag(w.policy, mean, cov, old_mean, old_cov, out);
  }
}

#define TROLL_PY_GAUSSIAN_INSTANCES(T)                                                                               \
  template void gaussian_project<T>(void*, bool, bool, troll::batch_view<const T>, troll::batch_view<const T>,        \
                                    troll::batch_view<const T>, troll::batch_view<const T>, double, double,           \
                                    troll::batch_view<T>, troll::batch_view<T>, troll::batch_view<double>,            \
                                    troll::batch_view<std::int32_t>, const troll::projection_options&,                \
                                    g::saved_factorisation<double>, bool);                                            \
  template void gaussian_project_backward<T>(                                                                         \
      void*, bool, bool, troll::batch_view<const T>, troll::batch_view<const T>, troll::batch_view<const T>,          \
      troll::batch_view<const T>, double, double, troll::batch_view<const T>, troll::batch_view<const T>,             \
      troll::batch_view<const double>, troll::batch_view<const std::int32_t>, troll::batch_view<const T>,             \
      troll::batch_view<const T>, const g::gaussian_grads<T>&, g::saved_factorisation<const double>, bool);           \
  template void gaussian_project_jvp<T>(                                                                              \
      void*, bool, bool, troll::batch_view<const T>, troll::batch_view<const T>, troll::batch_view<const T>,          \
      troll::batch_view<const T>, double, double, troll::batch_view<const T>, troll::batch_view<const T>,             \
      troll::batch_view<const double>, troll::batch_view<const std::int32_t>, const g::gaussian_tangents<T>&,         \
      troll::batch_view<T>, troll::batch_view<T>, g::saved_factorisation<const double>, bool);                        \
  template void gaussian_kl<T>(void*, bool, troll::batch_view<const T>, troll::batch_view<const T>,                   \
                               troll::batch_view<const T>, troll::batch_view<const T>, double*, bool);

TROLL_PY_GAUSSIAN_INSTANCES(float)
TROLL_PY_GAUSSIAN_INSTANCES(double)
#undef TROLL_PY_GAUSSIAN_INSTANCES

}  // namespace cuda_entry
}  // namespace troll_py
