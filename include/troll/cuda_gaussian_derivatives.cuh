// troll/cuda_gaussian_derivatives.cuh — the CUDA backend of the Gaussian KL and of the
// projections' derivatives (nvcc only): troll::gaussian::kl, kl_diag, project_joint_backward,
// project_split_backward, project_joint_jvp, project_split_jvp and their _diag forms under the
// troll::cuda policy tag (the entry points of gaussian_api.hpp, one for both policies; include
// troll/cuda_gaussian.cuh, which includes this header), the full ones with the optional saved
// factorisation:
//
//   troll::gaussian::project_joint_diag_backward(troll::cuda.on(stream), mean, std_dev, old_mean,
//       old_std_dev, eps, out_mean, out_std_dev, stats, grad_out_mean, grad_out_std_dev, grads);
//
// Every view, `stats`, `out`, `saved` and the bound-gradient arrays of `grads` are device memory;
// work is enqueued on policy.stream, nothing allocates and nothing synchronises. Diagonal rows:
// one warp per row up to d = 2048, no workspace. Full rows up to d = 256: the KL one warp per row
// up to d = 32, the backward and JVP one block per row running the matrix steps shared with the
// host (detail/gaussian_full_derivatives.hpp) with the row in shared memory up to d = 32; above
// d = 32 every full entry point keeps its rows' scratch in the caller's workspace
// (policy.with_workspace(p, troll::workspace_bytes(troll::cuda, troll::op::gaussian_X{}, rows, d));
// undersized, null or misaligned: shape_error before anything is written). Larger d: shape_error.
// The host checks shapes and bounds as the CPU does. By default some values are checked on the
// device: a row with bad operands (NaN / inf means, factors or standard deviations the CPU
// rejects), forward stats not solved with t in (0, 1], or a non-finite entry in an upstream
// gradient or input tangent the row reads (factors: the lower triangle) gets NaN in every
// requested output. The derivatives do not test the ratio and mean-step refusals themselves: the
// device forward gives such a row status rejected, whose stats are refused here, but stats from
// elsewhere pass (checked mode refuses the row).
// With troll::cuda.on(s).checked() the rows are checked on the host first (gaussian_checked.cuh),
// row by row as on the CPU, and the lowest bad one throws the CPU's exception, naming it, before
// anything is written.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/cuda/error_check.cuh"
#include "detail/cuda/gaussian_checked.cuh"
#include "detail/cuda/gaussian_derivative_kernels.cuh"
#include "detail/cuda/gaussian_full_block_kernels.cuh"
#include "detail/cuda/gaussian_full_derivative_kernels.cuh"
#include "detail/cuda/gaussian_kernels.cuh"
#include "detail/cuda/gaussian_launch.cuh"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_derivative_call.hpp"
#include "detail/workspace.hpp"
#include "detail/workspace_layout.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_api.hpp"
#include "gaussian_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The device's rows of gaussian::kl / kl_diag after their argument checks (gaussian_forward_call.hpp).
template <class T>
void gaussian_kl(cuda_policy policy, const gaussian_call& c, batch_view<const T> mean, batch_view<const T> cov,
                 batch_view<const T> old_mean, batch_view<const T> old_cov, double* out) {
  const std::size_t row_bytes = gaussian_forward_row_bytes(c.dim);
  double* workspace = full_workspace(policy, c, mean.rows, row_bytes);
  if (mean.rows == 0) return;
  check_gaussian_rows_on_host(policy, c, mean, cov, old_mean, old_cov);
  const gaussian_kl_launch<T> launch{mean, cov, old_mean, old_cov, out};
  launch_gaussian_rows<T>(policy, c, mean.rows, workspace, row_bytes, full_kl_op<T>{launch},
                          gaussian_kl_full_kernel<T>, gaussian_kl_diag_kernel<T>, 0, launch);
}

/// Dynamic shared memory of a full-covariance derivative row (the row scratch), raising the
/// kernel's limit above the default 48 KB when it needs more.
template <class Kernel>
std::size_t full_derivative_shared(Kernel kernel, std::size_t d, const char* function) {
  const std::size_t bytes = full_scratch::doubles(d) * sizeof(double);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        function, "shared memory limit of the full-covariance derivative kernel");
  return bytes;
}

/// The part of a backward or JVP after its argument checks (`what`: "backward" or "JVP"): the
/// device's limit on d, the workspace of full rows above d = 32, the checked mode's row checks,
/// then the launch — one warp a diagonal row (diag_op), one block a full row (full_op, its
/// scratch in shared memory up to d = 32, else in the workspace).
template <class T, class DiagOp, class FullOp>
void launch_gaussian_derivative(const cuda_policy& policy, const gaussian_call& call, batch_view<const T> mean,
                                batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                                const gaussian::gaussian_stats* stats, const char* what,
                                const finite_operands<T>& operands, gaussian::saved_factorisation<const double> saved,
                                const DiagOp& diag_op, const FullOp& full_op) {
  check_gaussian_dim(call);
  const std::size_t row_bytes = call.full ? gaussian_derivative_row_bytes(call.dim) : 0;
  double* workspace = full_workspace(policy, call, mean.rows, row_bytes);
  if (mean.rows == 0) return;
  check_gaussian_rows_on_host(policy, call, mean, cov, old_mean, old_cov, stats, what, &operands);
  if (call.full) {
    const auto kernel = gaussian_derivative_full_kernel<T, FullOp>;
    const std::size_t shared = workspace != nullptr ? 0 : full_derivative_shared(kernel, call.dim, call.function);
    kernel<<<full_grid(mean.rows, workspace, row_bytes), gaussian_full_threads, shared, policy.stream>>>(
        full_op, saved, workspace, row_bytes / sizeof(double));
  } else {
    gaussian_derivative_diag_kernel<T><<<grid_for(mean.rows), gaussian_warp, 0, policy.stream>>>(diag_op);
  }
  check_launch(call.function);
}

}  // namespace cuda

/// The device's rows of a Gaussian backward after its argument checks (gaussian_derivative_call.hpp).
template <>
struct gaussian_vjp_backend<cuda_policy> {
  template <class T>
  static void rows(const cuda_policy& policy, const gaussian_call& call, const gaussian_vjp_launch<T>& k,
                   gaussian::saved_factorisation<const double> saved) {
    cuda::launch_gaussian_derivative(policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.stats, "backward",
                                     upstream_operands(call, k.grad_out_mean, k.grad_out_cov), saved,
                                     cuda::diag_vjp_op<T>{k}, cuda::full_vjp_op<T>{k});
  }
};

/// The device's rows of a Gaussian JVP after its argument checks; out_cov: the forward's factor.
template <>
struct gaussian_jvp_backend<cuda_policy> {
  template <class T>
  static void rows(const cuda_policy& policy, const gaussian_call& call, const gaussian_jvp_launch<T>& k,
                   batch_view<const T> out_cov, gaussian::saved_factorisation<const double> saved) {
    cuda::launch_gaussian_derivative(policy, call, k.mean, k.cov, k.old_mean, k.old_cov, k.stats, "JVP",
                                     tangent_operands(call, k.tangents), saved, cuda::diag_jvp_op<T>{k},
                                     cuda::full_jvp_op<T>{k, out_cov});
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
