// python/src/cuda_gaussian_entry.hpp — the host-callable wrappers of troll's CUDA Gaussian entry
// points (troll/cuda_gaussian.cuh) that troll._troll_cuda binds (cuda_gaussian_module.cpp),
// declared without any CUDA header; cuda_gaussian_entry.cu (nvcc) defines them. As
// cuda_entry.hpp: `stream` is the caller's cudaStream_t, `checked` troll's checked mode. The
// statistics travel packed in device memory (values rows × 8 float64, counters rows × 2 int32, as
// troll/gaussian.py lays them out); the wrappers unpack them into troll's gaussian_stats and back,
// and allocate the full rows' workspace above d = 32 (stream-ordered, troll::workspace_bytes).
#pragma once

#include <cstdint>

#include <troll/batch.hpp>
#include <troll/gaussian_types.hpp>
#include <troll/projection_types.hpp>

namespace troll_py {
namespace cuda_entry {

/// The four projections (full: Cholesky factors, else standard deviations; split, else joint
/// with eps_mean the bound); `saved` (full only) may be empty.
template <class T>
void gaussian_project(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                      troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                      troll::batch_view<const T> old_cov, double eps_mean, double eps_cov, troll::batch_view<T> out_mean,
                      troll::batch_view<T> out_cov, troll::batch_view<double> stats_values,
                      troll::batch_view<std::int32_t> stats_counters, const troll::projection_options& options,
                      troll::gaussian::saved_factorisation<double> saved, bool checked);

template <class T>
void gaussian_project_backward(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                               troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                               troll::batch_view<const T> old_cov, double eps_mean, double eps_cov,
                               troll::batch_view<const T> out_mean, troll::batch_view<const T> out_cov,
                               troll::batch_view<const double> stats_values,
                               troll::batch_view<const std::int32_t> stats_counters,
                               troll::batch_view<const T> grad_out_mean, troll::batch_view<const T> grad_out_cov,
                               const troll::gaussian::gaussian_grads<T>& grads,
                               troll::gaussian::saved_factorisation<const double> saved, bool checked);

template <class T>
void gaussian_project_jvp(void* stream, bool full, bool split, troll::batch_view<const T> mean,
                          troll::batch_view<const T> cov, troll::batch_view<const T> old_mean,
                          troll::batch_view<const T> old_cov, double eps_mean, double eps_cov,
                          troll::batch_view<const T> out_mean, troll::batch_view<const T> out_cov,
                          troll::batch_view<const double> stats_values,
                          troll::batch_view<const std::int32_t> stats_counters,
                          const troll::gaussian::gaussian_tangents<T>& tangents, troll::batch_view<T> tangent_out_mean,
                          troll::batch_view<T> tangent_out_cov, troll::gaussian::saved_factorisation<const double> saved,
                          bool checked);

template <class T>
void gaussian_kl(void* stream, bool full, troll::batch_view<const T> mean, troll::batch_view<const T> cov,
                 troll::batch_view<const T> old_mean, troll::batch_view<const T> old_cov, double* out, bool checked);

}  // namespace cuda_entry
}  // namespace troll_py
