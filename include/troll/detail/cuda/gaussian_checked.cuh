// troll/detail/cuda/gaussian_checked.cuh — the checked mode of the CUDA Gaussian entry points
// (troll::cuda.on(s).checked(), cuda_report.hpp): the operands (and the forward's stats of a
// derivative) are copied to the host, the stream is synchronised, and the CPU backend's checks
// run on them, so a bad row throws the CPU's typed exception, naming the row, before any kernel
// writes an output. Meant for debugging and tests, not for the training hot path.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../execution.hpp"
#include "../../gaussian_types.hpp"
#include "../gaussian_checks.hpp"
#include "error_check.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Enqueues the copy of a device view into a dense host array.
template <class T>
void enqueue_download(batch_view<const T> v, std::vector<T>& host, cudaStream_t stream, const char* function) {
  host.resize(v.rows * v.cols);
  if (host.empty()) return;
  check(cudaMemcpy2DAsync(host.data(), v.cols * sizeof(T), v.data, v.stride * sizeof(T), v.cols * sizeof(T),
                          v.rows, cudaMemcpyDeviceToHost, stream),
        function, "copy to the host (checked mode)");
}

/// In checked mode: the CPU's checks, row by row (each row's values, then, when given, the
/// forward's stats for `what`, "backward" or "JVP", then `operands`: the upstream gradients or
/// input tangents), on host copies. Nothing happens otherwise.
template <class T>
void check_gaussian_rows_on_host(const cuda_policy& policy, const gaussian_call& call, batch_view<const T> mean,
                                 batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                                 const gaussian::gaussian_stats* stats = nullptr, const char* what = nullptr,
                                 const finite_operands<T>* operands = nullptr) {
  if (!policy.checks.checked || mean.rows == 0) return;
  const char* fn = call.function;
  std::vector<T> m, c, om, oc;
  enqueue_download(mean, m, policy.stream, fn);
  enqueue_download(cov, c, policy.stream, fn);
  enqueue_download(old_mean, om, policy.stream, fn);
  enqueue_download(old_cov, oc, policy.stream, fn);
  std::vector<T> extra[4];
  if (operands != nullptr)
    for (int o = 0; o < 4; ++o)
      if (operands->views[o].data != nullptr) enqueue_download(operands->views[o], extra[o], policy.stream, fn);
  std::vector<gaussian::gaussian_stats> s(stats == nullptr ? 0 : mean.rows);
  if (stats != nullptr)
    check(cudaMemcpyAsync(s.data(), stats, s.size() * sizeof(gaussian::gaussian_stats), cudaMemcpyDeviceToHost,
                          policy.stream),
          fn, "copy to the host (checked mode)");
  check(cudaStreamSynchronize(policy.stream), fn, "stream synchronisation (checked mode)");
  auto dense = [](const std::vector<T>& h, batch_view<const T> like) {
    return batch_view<const T>{h.data(), like.rows, like.cols, like.cols};
  };
  finite_operands<T> host;
  if (operands != nullptr) {
    host = *operands;
    for (int o = 0; o < 4; ++o)
      if (host.views[o].data != nullptr) host.views[o] = dense(extra[o], operands->views[o]);
  }
  // Row by row, as the CPU: the rows' operands, the statistics, the upstream operands.
  validate_gaussian_rows(1, call, dense(m, mean), dense(c, cov), dense(om, old_mean), dense(oc, old_cov),
                         gaussian_derivative_extra<T, gaussian::gaussian_stats>{stats != nullptr ? s.data() : nullptr,
                                                                                what,
                                                                                operands != nullptr ? &host : nullptr});
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
