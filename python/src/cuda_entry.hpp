// python/src/cuda_entry.hpp — the host-callable wrappers troll._troll_cuda binds, declared without
// any CUDA header: cuda_entry.cu (compiled by nvcc) defines them over troll's CUDA overloads,
// cuda_module.cpp (a plain C++ nanobind translation unit) turns DLPack arrays into the views.
// `stream` is a cudaStream_t (the caller's current stream); every call enqueues on it. With
// `checked`, troll's cuda_checked mode: bad rows throw the CPU's exceptions (a synchronisation);
// without, bad rows get NaN outputs and the call never synchronises (docs/cuda.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <troll/batch.hpp>
#include <troll/projection_types.hpp>
#include <troll/sparse_types.hpp>

namespace troll_py {
namespace cuda_entry {

/// The element types of logits the CUDA sparsify reads.
enum class logit_kind { f16, bf16, f32, f64 };

/// Logits of any of those element types, rows × cols with a row stride (elements).
struct any_logits {
  logit_kind kind = logit_kind::f32;
  const void* data = nullptr;
  std::size_t rows = 0, cols = 0, stride = 0;
};

int device_count();
std::string device_name(int device);
/// Makes `device` current for the calling thread (arrays on another GPU than the current one).
void set_device(int device);

template <class T>
void log_softmax(void* stream, troll::batch_view<const T> logits, troll::batch_view<T> out, bool checked);

template <class T>
void kl(void* stream, troll::batch_view<const T> p, troll::batch_view<const T> q, T* out, bool checked);

/// stats_values (rows × 6 float64: t, eta, kl_before, kl_after, mu, sigma2) and stats_counters
/// (rows × 2 int32: iterations, status) are packed device arrays, as the CPU module's.
template <class T>
void project(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits, double eps,
             troll::batch_view<T> out, double* stats_values, std::int32_t* stats_counters,
             const troll::projection_options& options, bool checked);

template <class T>
void project_backward(void* stream, troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                      troll::batch_view<const T> log_probs, const double* stats_values,
                      const std::int32_t* stats_counters, troll::batch_view<const T> grad_log_probs,
                      troll::batch_view<T> grad_new, troll::batch_view<T> grad_old, T* grad_eps, bool checked);

template <class T>
void sparsify(void* stream, const any_logits& logits, const troll::sparse_index* sampled,
              const troll::sparsify_options& options, troll::sparse_batch_view<T> out, bool checked);

}  // namespace cuda_entry
}  // namespace troll_py
