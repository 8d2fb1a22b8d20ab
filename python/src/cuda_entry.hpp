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
#include <troll/objective_types.hpp>
#include <troll/projection_types.hpp>
#include <troll/sparse_objective_types.hpp>
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

/// grad_p / grad_q may be empty views (rows == 0): not wanted.
template <class T>
void kl_backward(void* stream, troll::batch_view<const T> p, troll::batch_view<const T> q, const T* grad_kl,
                 troll::batch_view<T> grad_p, troll::batch_view<T> grad_q, bool checked);

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

// ---- The sparse path (troll/cuda_sparse.cuh) ----

/// Scatters a gradient on sparse rows gathered from `logits` back to the dense logits.
template <class T>
void sparsify_backward(void* stream, troll::batch_view<const T> logits, troll::sparse_batch_view<const T> support,
                       troll::sparse_grad_view<const T> grad, troll::batch_view<T> grad_logits, bool checked);

/// Dense new logits aligned with sparse old rows on U = S ∪ S_old (new_support.rows == 0: S empty).
template <class T>
void align(void* stream, troll::batch_view<const T> new_logits, troll::sparse_batch_view<const T> new_support,
           troll::sparse_batch_view<const T> old_rows, troll::aligned_batch_view<T> out, bool checked);

template <class T>
void kl_sparse(void* stream, troll::aligned_batch_view<const T> rows, T* out, bool checked);

/// The projection of aligned rows; stats packed as project()'s.
template <class T>
void project_sparse(void* stream, troll::aligned_batch_view<const T> rows, double eps, troll::sparse_batch_view<T> out,
                    double* stats_values, std::int32_t* stats_counters, const troll::projection_options& options,
                    bool checked);

/// Its VJP (grad_old.rows == 0: not wanted; grad_eps may be null).
template <class T>
void project_sparse_backward(void* stream, troll::aligned_batch_view<const T> rows,
                             troll::sparse_batch_view<const T> log_probs, const double* stats_values,
                             const std::int32_t* stats_counters, troll::sparse_grad_view<const T> grad,
                             troll::sparse_grad_view<T> grad_new, troll::sparse_grad_view<T> grad_old, T* grad_eps,
                             bool checked);

// ---- The objectives (troll/cuda_objectives.cuh, troll/cuda_sparse_objectives.cuh) ----
// Every pointer of `batch` is device memory; `metrics` is one device objective_metrics (the
// module passes a float64 array of 13 entries: loss first). The workspace is a stream-ordered
// allocation of the entry's own.

template <class T>
void trust_region_forward(void* stream, const troll::trust_region_objective& objective,
                          troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                          const troll::token_batch<T>& batch, troll::batch_view<T> log_probs, double* stats_values,
                          std::int32_t* stats_counters, T* token_loss, troll::objective_metrics* metrics,
                          bool checked);

template <class T>
void trust_region_backward(void* stream, const troll::trust_region_objective& objective,
                           troll::batch_view<const T> new_logits, troll::batch_view<const T> old_logits,
                           const troll::token_batch<T>& batch, troll::batch_view<const T> log_probs,
                           const double* stats_values, const std::int32_t* stats_counters,
                           troll::batch_view<T> grad_new, double grad_loss, bool checked);

/// PPO clip and DPPO (Objective: troll::ppo_clip_objective or troll::dppo_objective).
template <class T, class Objective>
void ratio_forward(void* stream, const Objective& objective, troll::batch_view<const T> new_logits,
                   troll::batch_view<const T> old_logits, const troll::token_batch<T>& batch, T* token_loss,
                   troll::objective_metrics* metrics, bool checked);

template <class T, class Objective>
void ratio_backward(void* stream, const Objective& objective, troll::batch_view<const T> new_logits,
                    troll::batch_view<const T> old_logits, const troll::token_batch<T>& batch,
                    troll::batch_view<T> grad_new, double grad_loss, bool checked);

template <class T>
void sparse_trust_region_forward(void* stream, const troll::sparse_trust_region_objective& objective,
                                 troll::batch_view<const T> new_logits, troll::sparse_batch_view<const T> old_rows,
                                 const troll::token_batch<T>& batch, troll::aligned_batch_view<T> aligned,
                                 troll::sparse_batch_view<T> log_probs, double* stats_values,
                                 std::int32_t* stats_counters, T* token_loss, troll::objective_metrics* metrics,
                                 bool checked);

template <class T>
void sparse_trust_region_backward(void* stream, const troll::sparse_trust_region_objective& objective,
                                  troll::batch_view<const T> new_logits, troll::aligned_batch_view<const T> aligned,
                                  const troll::token_batch<T>& batch, troll::sparse_batch_view<const T> log_probs,
                                  const double* stats_values, const std::int32_t* stats_counters,
                                  troll::batch_view<T> grad_new, double grad_loss, bool checked);

}  // namespace cuda_entry
}  // namespace troll_py
