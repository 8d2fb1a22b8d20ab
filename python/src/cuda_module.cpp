// python/src/cuda_module.cpp — the extension module troll._troll_cuda (built where nvcc is present:
// TROLL_ENABLE_CUDA, python/CMakeLists.txt): the dense entry points, the sparse path (sparsify,
// align, the sparse projection and their backward passes) and the objectives on CUDA device
// arrays, enqueued on the caller's stream (troll/_core.py passes torch.cuda.current_stream()).
// The same checks and views as troll._troll (views.hpp, compiled here with TROLL_PY_CUDA: arrays
// must be in CUDA memory, on one device); the work is in cuda_entry.cu. No maths here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "cuda_entry.hpp"
#include "dense_args.hpp"
#include "errors.hpp"
#include "objective_args.hpp"
#include "shard_args.hpp"
#include "sparse_args.hpp"
#include "sparse_views.hpp"
#include "views.hpp"

namespace troll_py {
namespace {

void* as_stream(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

/// Makes the arrays' device current (all of them must be on it).
template <class... A>
void use_device_of(const char* fn, const A&... arrays) {
  const std::int32_t ids[] = {arrays.device_id()...};
  for (std::int32_t id : ids)
    if (id != ids[0]) fail(fn, "the arrays are on different CUDA devices (" + std::to_string(ids[0]) + " and " +
                                   std::to_string(id) + ")");
  cuda_entry::set_device(ids[0]);
}

inline std::string packed_stats_text(std::size_t rows) {
  return "the stats must be (rows, 6) float64 and (rows, 2) int32 for " + std::to_string(rows) + " rows";
}

/// The packed stats arrays of `rows` rows (project()'s layout) in device memory, checked before
/// any work (StatsOut / StatsIn of the argument structs); `mismatch` words the error.
template <class V, class C, class A>
struct packed_stats {
  V* values;
  C* counters;

  packed_stats(const char* fn, const A& v, const A& c, std::size_t rows,
               std::string (*mismatch)(std::size_t) = packed_stats_text) {
    const auto sv = as_packed<V>(fn, "stats.values", v);
    const auto sc = as_packed<C>(fn, "stats.counters", c);
    if (sv.rows != rows || sv.cols != st_values || sc.rows != rows || sc.cols != st_counters)
      fail(fn, mismatch(rows));
    values = sv.data;
    counters = sc.data;
  }
};
using packed_stats_out = packed_stats<double, std::int32_t, out_array>;
using packed_stats_in = packed_stats<const double, const std::int32_t, in_array>;

void log_softmax(const in_array& logits, const out_array& out, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "log_softmax";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    const log_softmax_args<T> a(fn, logits, out);
    use_device_of(fn, logits, out);
    nb::gil_scoped_release release;
    cuda_entry::log_softmax<T>(as_stream(stream), a.logits, a.out, checked);
  });
}

void kl(const in_array& p, const in_array& q, const out_array& out, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "kl";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    using T = decltype(tag);
    const kl_args<T> a(fn, p, q, out);
    use_device_of(fn, p, q, out);
    nb::gil_scoped_release release;
    cuda_entry::kl<T>(as_stream(stream), a.p, a.q, a.out, checked);
  });
}

void kl_backward(const in_array& p, const in_array& q, const in_array& grad_kl, const std::optional<out_array>& grad_p,
                 const std::optional<out_array>& grad_q, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "kl_backward";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    using T = decltype(tag);
    const kl_backward_args<T> a(fn, p, q, grad_kl, grad_p, grad_q);
    use_device_of(fn, p, q, grad_kl);
    if (grad_p) use_device_of(fn, p, *grad_p);
    if (grad_q) use_device_of(fn, p, *grad_q);
    nb::gil_scoped_release release;
    cuda_entry::kl_backward<T>(as_stream(stream), a.p, a.q, a.grad_kl, a.grad_p, a.grad_q, checked);
  });
}

void project(const in_array& new_logits, const in_array& old_logits, double eps, const out_array& out,
             const out_array& stats_values, const out_array& stats_counters, double rtol, double atol,
             int max_iterations, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "project";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    const project_args<T> a(fn, new_logits, old_logits, out);
    const packed_stats_out st(fn, stats_values, stats_counters, a.new_logits.rows, stats_buffers_text);
    const std::size_t rows = a.new_logits.rows;
    const troll::batch_view<double> values{st.values, rows, st_values, st_values};
    const troll::batch_view<std::int32_t> counters{st.counters, rows, st_counters, st_counters};
    require_stats_disjoint(fn, values, counters, a.new_logits, a.old_logits, a.out);
    use_device_of(fn, new_logits, old_logits, out, stats_values, stats_counters);
    const troll::projection_options options = projection_settings(rtol, atol, max_iterations);
    nb::gil_scoped_release release;
    cuda_entry::project<T>(as_stream(stream), a.new_logits, a.old_logits, eps, a.out, st.values, st.counters, options,
                           checked);
  });
}

void project_backward(const in_array& new_logits, const in_array& old_logits, const in_array& log_probs,
                      const in_array& stats_values, const in_array& stats_counters, const in_array& grad_log_probs,
                      const out_array& grad_new, const std::optional<out_array>& grad_old,
                      const std::optional<out_array>& grad_eps, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "project_backward";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    const project_backward_args<T> a(fn, new_logits, old_logits, log_probs, grad_log_probs, grad_new, grad_old,
                                     grad_eps);
    const packed_stats_in st(fn, stats_values, stats_counters, a.new_logits.rows, stats_mismatch_text);
    use_device_of(fn, new_logits, old_logits, log_probs, grad_log_probs, grad_new, stats_values);
    nb::gil_scoped_release release;
    cuda_entry::project_backward<T>(as_stream(stream), a.new_logits, a.old_logits, a.log_probs, st.values, st.counters,
                                    a.grad_log_probs, a.grad_new, a.grad_old, a.grad_eps, checked);
  });
}

/// The logits' element type for the CUDA sparsify: float16 and bfloat16 too.
cuda_entry::logit_kind logit_kind_of(const char* fn, const char* name, const in_array& a) {
  const nb::dlpack::dtype d = a.dtype();
  if (d == nb::dtype<float>()) return cuda_entry::logit_kind::f32;
  if (d == nb::dtype<double>()) return cuda_entry::logit_kind::f64;
  if (d.bits == 16 && d.lanes == 1 && d.code == std::uint8_t(nb::dlpack::dtype_code::Float))
    return cuda_entry::logit_kind::f16;
  if (d.bits == 16 && d.lanes == 1 && d.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat))
    return cuda_entry::logit_kind::bf16;
  throw nb::type_error((std::string("troll.") + fn + ": " + name + " have dtype " + dtype_text(a) +
                        "; the CUDA sparsify reads float16, bfloat16, float32 and float64")
                           .c_str());
}

/// Logits of any element type sparsify reads, with the views' checks in their element size (the
/// batch layout is all they read).
cuda_entry::any_logits any_logits_of(const char* fn, const char* name, const in_array& logits) {
  cuda_entry::any_logits x;
  x.kind = logit_kind_of(fn, name, logits);
  auto layout = [&](const auto& v) {
    x.data = v.data;
    x.rows = v.rows;
    x.cols = v.cols;
    x.stride = v.stride;
  };
  if (x.kind == cuda_entry::logit_kind::f64) {
    layout(as_batch<const double>(fn, name, logits));
  } else if (x.kind == cuda_entry::logit_kind::f32) {
    layout(as_batch<const float>(fn, name, logits));
  } else {
    // 16-bit logits: the same device and layout rules (the dtype was checked above).
    if (logits.device_type() != module_device) fail(fn, std::string(name) + " " + module_device_text);
    layout(as_layout<const std::uint16_t>(fn, name, logits));
  }
  return x;
}

void sparsify(const in_array& logits, const std::optional<in_array>& sampled, int k, double delta, nb::handle out,
              std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify";
  const cuda_entry::any_logits x = any_logits_of(fn, "logits", logits);
  dispatch_sparse_out(fn, out, [&](auto tag) {
    using T = decltype(tag);
    const sparse_rows<T> o(fn, "out", out);
    require_same_rows(fn, o.rows, rows_of("logits", logits));
    const sparse_index* s = sampled ? as_rows<const sparse_index>(fn, "sampled", *sampled, rows_of("logits", logits)) : nullptr;
    use_device_of(fn, logits, o.indices, o.log_probs);
    const troll::sparsify_options options = sparsify_settings(k, delta);
    nb::gil_scoped_release release;
    cuda_entry::sparsify<T>(as_stream(stream), x, s, options, o.view, checked);
  });
}

// ---- Vocabulary shards: the packed states and arguments of troll._troll's (shard_args.hpp) ----

void sparsify_shard(const in_array& shard_logits, std::size_t vocab_offset, std::size_t vocab,
                    const std::optional<in_array>& sampled, int k, double delta, const out_array& states,
                    std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify_shard";
  const std::size_t bytes = packed_state_bytes(k);
  const cuda_entry::any_logits x = any_logits_of(fn, "shard_logits", shard_logits);
  const sparse_index* s = sampled ? as_rows<const sparse_index>(fn, "sampled", *sampled, rows_of("shard_logits", shard_logits)) : nullptr;
  std::uint8_t* out = shard_states_out(fn, states, x.rows, k);
  use_device_of(fn, shard_logits, states);
  if (sampled) use_device_of(fn, shard_logits, *sampled);
  const troll::sparsify_options options = sparsify_settings(k, delta);
  nb::gil_scoped_release release;
  cuda_entry::sparsify_shard(as_stream(stream), x, vocab_offset, vocab, s, options, out, bytes, checked);
}

void sparsify_finalize(const in_array& states, int k, double delta, nb::handle out,
                       const std::optional<out_array>& log_sums, const std::optional<out_array>& tail_max,
                       const std::optional<in_array>& tail_sums, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify_finalize";
  const stacked_states all(fn, states, k);
  dispatch_sparse_out(fn, out, [&](auto tag) {
    using T = decltype(tag);
    const finalize_args<T> a(fn, out, all.rows, log_sums, tail_max, tail_sums);
    use_device_of(fn, states, a.out.indices, a.out.log_probs);
    if (log_sums) use_device_of(fn, states, *log_sums);
    if (tail_max) use_device_of(fn, states, *tail_max);
    if (tail_sums) use_device_of(fn, states, *tail_sums);
    const troll::sparsify_options options = sparsify_settings(k, delta);
    nb::gil_scoped_release release;
    cuda_entry::sparsify_finalize<T>(as_stream(stream), all.data, all.shards, all.rows, all.bytes, options,
                                     a.out.view, a.log_sums, a.tail_max, a.tail_sums, a.tail_shards, checked);
  });
}

void sparsify_tail_sums(const in_array& shard_logits, std::size_t vocab_offset, nb::handle support,
                        const in_array& tail_max, const out_array& sums, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify_tail_sums";
  const cuda_entry::any_logits x = any_logits_of(fn, "shard_logits", shard_logits);
  const nb::tuple t = as_tuple(fn, "support", support, 5);
  const in_array probe = item<in_array>(fn, "support", t, 1);
  dispatch_float(fn, "support.log_probs", probe, [&](auto tag) {
    using T = decltype(tag);
    const tail_sums_args<T> a(fn, x.rows, support, tail_max, sums);
    use_device_of(fn, shard_logits, a.support.indices, tail_max, sums);
    nb::gil_scoped_release release;
    cuda_entry::sparsify_tail_sums<T>(as_stream(stream), x, vocab_offset, a.support.view, a.tail_max, a.sums,
                                      checked);
  });
}

void sparsify_shard_backward(const in_array& shard_logits, std::size_t vocab_offset, nb::handle support,
                             nb::handle grad, const in_array& log_sums, const out_array& grad_shard,
                             std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify_shard_backward";
  dispatch_float(fn, "shard_logits", shard_logits, [&](auto tag) {
    using T = decltype(tag);
    const shard_backward_args<T> a(fn, shard_logits, support, grad, log_sums, grad_shard);
    use_device_of(fn, shard_logits, grad_shard, a.support.indices, a.grad.log_probs, log_sums);
    nb::gil_scoped_release release;
    cuda_entry::sparsify_shard_backward<T>(as_stream(stream), a.logits, vocab_offset, a.support.view, a.grad.view,
                                           a.log_sums, a.grad_shard, checked);
  });
}

// ---- The sparse path: the same tuples as troll._troll's (sparse_views.hpp) ----

void sparsify_backward(const in_array& logits, nb::handle support, nb::handle grad, const out_array& grad_logits,
                       std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify_backward";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    const sparsify_backward_args<T> a(fn, logits, support, grad, grad_logits);
    use_device_of(fn, logits, grad_logits, a.support.indices, a.grad.log_probs);
    nb::gil_scoped_release release;
    cuda_entry::sparsify_backward<T>(as_stream(stream), a.logits, a.support.view, a.grad.view, a.grad_logits,
                                     checked);
  });
}

void align(const in_array& new_logits, nb::handle new_support, nb::handle old_rows, nb::handle out,
           std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "align";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    const align_args<T> a(fn, new_logits, new_support, old_rows, out);
    use_device_of(fn, new_logits, a.old.indices, a.out.indices);
    nb::gil_scoped_release release;
    cuda_entry::align<T>(as_stream(stream), a.new_logits, a.support, a.old.view, a.out.view, checked);
  });
}

void kl_aligned(nb::handle rows, const out_array& out, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "kl_sparse";
  dispatch_aligned(fn, rows, [&](auto tag) {
    using T = decltype(tag);
    const kl_aligned_args<T> a(fn, rows, out);
    use_device_of(fn, a.rows.indices, out);
    nb::gil_scoped_release release;
    cuda_entry::kl_sparse<T>(as_stream(stream), a.rows.view, a.out, checked);
  });
}

void project_aligned(nb::handle rows, double eps, nb::handle out, const out_array& stats_values,
                     const out_array& stats_counters, double rtol, double atol, int max_iterations,
                     std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "project_sparse";
  dispatch_aligned(fn, rows, [&](auto tag) {
    using T = decltype(tag);
    const project_aligned_args<T, packed_stats_out> a(fn, rows, out, stats_values, stats_counters);
    use_device_of(fn, a.rows.indices, a.out.indices, stats_values, stats_counters);
    const troll::projection_options options = projection_settings(rtol, atol, max_iterations);
    nb::gil_scoped_release release;
    cuda_entry::project_sparse<T>(as_stream(stream), a.rows.view, eps, a.out.view, a.stats.values,
                                  a.stats.counters, options, checked);
  });
}

void project_aligned_backward(nb::handle rows, nb::handle log_probs, const in_array& stats_values,
                              const in_array& stats_counters, nb::handle grad, nb::handle grad_new,
                              nb::handle grad_old, const std::optional<out_array>& grad_eps, std::uintptr_t stream,
                              bool checked) {
  constexpr const char* fn = "project_sparse_backward";
  dispatch_aligned(fn, rows, [&](auto tag) {
    using T = decltype(tag);
    const project_aligned_backward_args<T, packed_stats_in> a(fn, rows, log_probs, stats_values, stats_counters,
                                                              grad, grad_new, grad_old, grad_eps);
    use_device_of(fn, a.rows.indices, a.log_probs.indices, a.grad.log_probs, a.grad_new.log_probs, stats_values);
    nb::gil_scoped_release release;
    cuda_entry::project_sparse_backward<T>(as_stream(stream), a.rows.view, a.log_probs.view, a.stats.values,
                                           a.stats.counters, a.grad.view, a.grad_new.view, a.grad_old, a.grad_eps,
                                           checked);
  });
}

// ---- The objectives: the token batch tuple of objective_args.hpp (device arrays); the metrics
// go to a device float64 array of 13 entries (troll::objective_metrics, the loss first), which
// troll/torch reads without a synchronisation for the loss ----

constexpr std::size_t metrics_entries = 13;
static_assert(sizeof(troll::objective_metrics) == metrics_entries * sizeof(double),
              "objective_metrics is 13 eight-byte fields");

troll::objective_metrics* metrics_out(const char* fn, const out_array& metrics) {
  return reinterpret_cast<troll::objective_metrics*>(as_entries<double>(fn, "metrics", metrics, metrics_entries));
}

void trust_region_forward(const in_array& n, const in_array& o, nb::handle batch, double eps, double alpha,
                          double rtol, double atol, int max_iterations, const out_array& log_probs,
                          const out_array& stats_values, const out_array& stats_counters,
                          const std::optional<out_array>& token_loss, const out_array& metrics,
                          std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "trust_region_loss";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const trust_region_forward_args<T, packed_stats_out> a(fn, n, o, batch, log_probs, stats_values, stats_counters,
                                                           token_loss);
    troll::objective_metrics* m = metrics_out(fn, metrics);
    use_device_of(fn, n, o, a.in.tokens, a.in.advantages, log_probs, stats_values, metrics);
    nb::gil_scoped_release release;
    cuda_entry::trust_region_forward<T>(as_stream(stream), trust_region(eps, alpha, rtol, atol, max_iterations),
                                        a.logits.new_logits, a.logits.old_logits, a.in.batch, a.log_probs,
                                        a.stats.values, a.stats.counters, a.token_loss, m, checked);
  });
}

void trust_region_backward(const in_array& n, const in_array& o, nb::handle batch, double eps, double alpha,
                           double rtol, double atol, int max_iterations, const in_array& log_probs,
                           const in_array& stats_values, const in_array& stats_counters, const out_array& grad_new,
                           double grad_loss, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "trust_region_loss_backward";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const trust_region_backward_args<T, packed_stats_in> a(fn, n, o, batch, log_probs, stats_values, stats_counters,
                                                           grad_new);
    use_device_of(fn, n, o, a.in.tokens, log_probs, stats_values, grad_new);
    nb::gil_scoped_release release;
    cuda_entry::trust_region_backward<T>(as_stream(stream), trust_region(eps, alpha, rtol, atol, max_iterations),
                                         a.logits.new_logits, a.logits.old_logits, a.in.batch, a.log_probs,
                                         a.stats.values, a.stats.counters, a.grad_new, grad_loss, checked);
  });
}

template <class Objective>
void ratio_forward(const char* fn, const Objective& objective, const in_array& n, const in_array& o,
                   nb::handle batch, const std::optional<out_array>& token_loss, const out_array& metrics,
                   std::uintptr_t stream, bool checked) {
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const ratio_forward_args<T> a(fn, n, o, batch, token_loss);
    troll::objective_metrics* m = metrics_out(fn, metrics);
    use_device_of(fn, n, o, a.in.tokens, a.in.advantages, metrics);
    nb::gil_scoped_release release;
    cuda_entry::ratio_forward<T>(as_stream(stream), objective, a.logits.new_logits, a.logits.old_logits, a.in.batch,
                                 a.token_loss, m, checked);
  });
}

template <class Objective>
void ratio_backward(const char* fn, const Objective& objective, const in_array& n, const in_array& o,
                    nb::handle batch, const out_array& grad_new, double grad_loss, std::uintptr_t stream,
                    bool checked) {
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const ratio_backward_args<T> a(fn, n, o, batch, grad_new);
    use_device_of(fn, n, o, a.in.tokens, grad_new);
    nb::gil_scoped_release release;
    cuda_entry::ratio_backward<T>(as_stream(stream), objective, a.logits.new_logits, a.logits.old_logits, a.in.batch,
                                  a.grad_new, grad_loss, checked);
  });
}

void sparse_trust_region_forward(const in_array& n, nb::handle old_rows, nb::handle batch, double eps, double alpha,
                                 double rtol, double atol, int max_iterations, int new_k, double new_delta,
                                 nb::handle aligned, nb::handle log_probs, const out_array& stats_values,
                                 const out_array& stats_counters, const std::optional<out_array>& token_loss,
                                 const out_array& metrics, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "trust_region_loss";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const sparse_trust_region_forward_args<T, packed_stats_out> a(fn, n, old_rows, batch, aligned, log_probs,
                                                                  stats_values, stats_counters, token_loss);
    troll::objective_metrics* m = metrics_out(fn, metrics);
    use_device_of(fn, n, a.old.indices, a.in.tokens, a.in.advantages, a.aligned.indices, a.log_probs.indices,
                  stats_values, metrics);
    nb::gil_scoped_release release;
    cuda_entry::sparse_trust_region_forward<T>(
        as_stream(stream), sparse_trust_region(eps, alpha, rtol, atol, max_iterations, new_k, new_delta),
        a.new_logits, a.old.view, a.in.batch, a.aligned.view, a.log_probs.view, a.stats.values, a.stats.counters,
        a.token_loss, m, checked);
  });
}

void sparse_trust_region_backward(const in_array& n, nb::handle aligned, nb::handle batch, double eps, double alpha,
                                  double rtol, double atol, int max_iterations, int new_k, double new_delta,
                                  nb::handle log_probs, const in_array& stats_values, const in_array& stats_counters,
                                  const out_array& grad_new, double grad_loss, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "trust_region_loss_backward";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    using T = decltype(tag);
    const sparse_trust_region_backward_args<T, packed_stats_in> a(fn, n, aligned, batch, log_probs, stats_values,
                                                                  stats_counters, grad_new);
    use_device_of(fn, n, a.aligned.indices, a.in.tokens, a.log_probs.indices, stats_values, grad_new);
    nb::gil_scoped_release release;
    cuda_entry::sparse_trust_region_backward<T>(
        as_stream(stream), sparse_trust_region(eps, alpha, rtol, atol, max_iterations, new_k, new_delta),
        a.new_logits, a.aligned.view, a.in.batch, a.log_probs.view, a.stats.values, a.stats.counters, a.grad_new,
        grad_loss, checked);
  });
}

}  // namespace
}  // namespace troll_py

namespace troll_py {
void bind_cuda_gaussian(nb::module_& m);  // cuda_gaussian_module.cpp
}  // namespace troll_py

NB_MODULE(_troll_cuda, m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  troll_py::register_errors();
  troll_py::bind_cuda_gaussian(m);  // cuda_gaussian_module.cpp
  m.attr("cuda") = true;
  m.def("device_count", &troll_py::cuda_entry::device_count, "CUDA devices visible (0 without a driver or GPU).");
  m.def("device_name", &troll_py::cuda_entry::device_name, "device"_a);
  m.def("log_softmax", &troll_py::log_softmax, "logits"_a, "out"_a, "stream"_a, "checked"_a = true,
        "out = log_softmax(logits) per row, enqueued on `stream`.");
  m.def("kl", &troll_py::kl, "p_logits"_a, "q_logits"_a, "out"_a, "stream"_a, "checked"_a = true,
        "out[r] = KL(softmax(p[r]) || softmax(q[r])), enqueued on `stream`.");
  m.def("kl_backward", &troll_py::kl_backward, "p_logits"_a, "q_logits"_a, "grad_kl"_a, "grad_p"_a.none(),
        "grad_q"_a.none(), "stream"_a = 0, "checked"_a = true,
        "Gradients of the per-row KL w.r.t. both logits, scaled by grad_kl, enqueued on `stream`.");
  m.def("project", &troll_py::project, "new_logits"_a, "old_logits"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = troll::projection_options{}.rtol, "atol"_a = troll::projection_options{}.atol,
        "max_iterations"_a = troll::projection_options{}.max_iterations, "stream"_a = 0,
        "checked"_a = true, "The KL trust-region projection on the device, enqueued on `stream`.");
  m.def("project_backward", &troll_py::project_backward, "new_logits"_a, "old_logits"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad_log_probs"_a, "grad_new"_a, "grad_old"_a.none(),
        "grad_eps"_a.none(), "stream"_a = 0, "checked"_a = true,
        "The projection's vector-Jacobian product on the device, enqueued on `stream`.");
  m.def("sparsify", &troll_py::sparsify, "logits"_a, "sampled"_a.none(), "k"_a, "delta"_a, "out"_a, "stream"_a = 0,
        "checked"_a = true, "Top-k + remainder rows of device logits (float16 / bfloat16 / float32 / float64).");
  m.def("sparsify_state_bytes", &troll_py::packed_state_bytes, "k"_a,
        "Bytes of one packed sparsify state (one row of one vocabulary shard) for top-k.");
  m.def("sparsify_shard", &troll_py::sparsify_shard, "shard_logits"_a, "vocab_offset"_a, "vocab"_a,
        "sampled"_a.none(), "k"_a, "delta"_a, "states"_a, "stream"_a = 0, "checked"_a = true,
        "Packed sparsify states (rows x sparsify_state_bytes(k) uint8, device) of one vocabulary shard.");
  m.def("sparsify_finalize", &troll_py::sparsify_finalize, "states"_a, "k"_a, "delta"_a, "out"_a,
        "log_sums"_a.none(), "tail_max"_a.none() = nb::none(), "tail_sums"_a.none() = nb::none(), "stream"_a = 0,
        "checked"_a = true,
        "Merges packed device states (shards, ..., bytes) in shard order and writes the sparse rows; given "
        "the shards' tail_sums (shards, ..., 2), the exact values (bit for bit the whole-row sparsify).");
  m.def("sparsify_tail_sums", &troll_py::sparsify_tail_sums, "shard_logits"_a, "vocab_offset"_a, "support"_a,
        "tail_max"_a, "sums"_a, "stream"_a = 0, "checked"_a = true,
        "One shard's exact sum (hi, lo) of exp(z - tail_max) over its tokens outside each row's support.");
  m.def("sparsify_shard_backward", &troll_py::sparsify_shard_backward, "shard_logits"_a, "vocab_offset"_a,
        "support"_a, "grad"_a, "log_sums"_a, "grad_shard"_a, "stream"_a = 0, "checked"_a = true,
        "The gradient w.r.t. one vocabulary shard's device logits of a loss on sparse rows from all shards.");
  m.def("sparsify_backward", &troll_py::sparsify_backward, "logits"_a, "support"_a, "grad"_a, "grad_logits"_a,
        "stream"_a = 0, "checked"_a = true, "Scatters a gradient on sparse rows back to the dense device logits.");
  m.def("align", &troll_py::align, "new_logits"_a, "new_support"_a.none(), "old"_a, "out"_a, "stream"_a = 0,
        "checked"_a = true, "Aligns dense new device logits with sparse old rows on U = S_new | S_old.");
  m.def("kl_sparse", &troll_py::kl_aligned, "rows"_a, "out"_a, "stream"_a = 0, "checked"_a = true,
        "KL(new || old) of aligned device rows (the lumped categories).");
  m.def("project_sparse", &troll_py::project_aligned, "rows"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = troll::projection_options{}.rtol, "atol"_a = troll::projection_options{}.atol,
        "max_iterations"_a = troll::projection_options{}.max_iterations, "stream"_a = 0,
        "checked"_a = true, "The trust-region projection of aligned device rows.");
  m.def("project_sparse_backward", &troll_py::project_aligned_backward, "rows"_a, "log_probs"_a, "stats_values"_a,
        "stats_counters"_a, "grad"_a, "grad_new"_a, "grad_old"_a.none(), "grad_eps"_a.none(), "stream"_a = 0,
        "checked"_a = true, "VJP of project_sparse on the device.");
  m.attr("METRICS_ENTRIES") = troll_py::metrics_entries;
  m.def("trust_region_forward", &troll_py::trust_region_forward, "new_logits"_a, "old_logits"_a, "batch"_a, "eps"_a,
        "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "log_probs"_a, "stats_values"_a, "stats_counters"_a,
        "token_loss"_a.none(), "metrics"_a, "stream"_a = 0, "checked"_a = true,
        "TROLL's objective against dense old device logits; the loss and metrics to `metrics` (13 float64).");
  m.def("trust_region_backward", &troll_py::trust_region_backward, "new_logits"_a, "old_logits"_a, "batch"_a,
        "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "log_probs"_a, "stats_values"_a,
        "stats_counters"_a, "grad_new"_a, "grad_loss"_a, "stream"_a = 0, "checked"_a = true,
        "The fused backward of trust_region_forward on the device.");
  m.def("sparse_trust_region_forward", &troll_py::sparse_trust_region_forward, "new_logits"_a, "old"_a, "batch"_a,
        "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "new_k"_a, "new_delta"_a, "aligned"_a,
        "log_probs"_a, "stats_values"_a, "stats_counters"_a, "token_loss"_a.none(), "metrics"_a, "stream"_a = 0,
        "checked"_a = true, "TROLL's objective against sparse old device rows; metrics as trust_region_forward.");
  m.def("sparse_trust_region_backward", &troll_py::sparse_trust_region_backward, "new_logits"_a, "aligned"_a,
        "batch"_a, "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "new_k"_a, "new_delta"_a,
        "log_probs"_a, "stats_values"_a, "stats_counters"_a, "grad_new"_a, "grad_loss"_a, "stream"_a = 0,
        "checked"_a = true, "The fused backward of sparse_trust_region_forward on the device.");
  m.def(
      "ppo_clip_forward",
      [](const troll_py::in_array& n, const troll_py::in_array& o, nb::handle batch, double clip_low,
         double clip_high, double dual_clip, bool kl_metrics, const std::optional<troll_py::out_array>& token_loss,
         const troll_py::out_array& metrics, std::uintptr_t stream, bool checked) {
        troll_py::ratio_forward("ppo_clip_loss", troll_py::ppo_clip(clip_low, clip_high, dual_clip, kl_metrics), n,
                                o, batch, token_loss, metrics, stream, checked);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "clip_low"_a, "clip_high"_a, "dual_clip"_a, "kl_metrics"_a,
      "token_loss"_a.none(), "metrics"_a, "stream"_a = 0, "checked"_a = true, "PPO's clipped surrogate loss.");
  m.def(
      "ppo_clip_backward",
      [](const troll_py::in_array& n, const troll_py::in_array& o, nb::handle batch, double clip_low,
         double clip_high, double dual_clip, const troll_py::out_array& grad_new, double grad_loss,
         std::uintptr_t stream, bool checked) {
        troll_py::ratio_backward("ppo_clip_loss_backward", troll_py::ppo_clip(clip_low, clip_high, dual_clip, false),
                                 n, o, batch, grad_new, grad_loss, stream, checked);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "clip_low"_a, "clip_high"_a, "dual_clip"_a, "grad_new"_a,
      "grad_loss"_a, "stream"_a = 0, "checked"_a = true, "Backward of ppo_clip_forward.");
  m.def(
      "dppo_forward",
      [](const troll_py::in_array& n, const troll_py::in_array& o, nb::handle batch, const std::string& divergence,
         double delta_low, double delta_high, int top_k, bool kl_metrics,
         const std::optional<troll_py::out_array>& token_loss, const troll_py::out_array& metrics,
         std::uintptr_t stream, bool checked) {
        troll_py::ratio_forward("dppo_loss", troll_py::dppo(divergence, delta_low, delta_high, top_k, kl_metrics), n,
                                o, batch, token_loss, metrics, stream, checked);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "divergence"_a, "delta_low"_a, "delta_high"_a, "top_k"_a,
      "kl_metrics"_a, "token_loss"_a.none(), "metrics"_a, "stream"_a = 0, "checked"_a = true,
      "DPPO's masked surrogate loss.");
  m.def(
      "dppo_backward",
      [](const troll_py::in_array& n, const troll_py::in_array& o, nb::handle batch, const std::string& divergence,
         double delta_low, double delta_high, int top_k, const troll_py::out_array& grad_new, double grad_loss,
         std::uintptr_t stream, bool checked) {
        troll_py::ratio_backward("dppo_loss_backward", troll_py::dppo(divergence, delta_low, delta_high, top_k, false),
                                 n, o, batch, grad_new, grad_loss, stream, checked);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "divergence"_a, "delta_low"_a, "delta_high"_a, "top_k"_a,
      "grad_new"_a, "grad_loss"_a, "stream"_a = 0, "checked"_a = true, "Backward of dppo_forward.");
}
