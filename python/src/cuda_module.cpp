// python/src/cuda_module.cpp — the extension module troll._troll_cuda (built where nvcc is present:
// TROLL_ENABLE_CUDA, python/CMakeLists.txt): the dense entry points and sparsify on CUDA device
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

#include "cuda_entry.hpp"
#include "dense_args.hpp"
#include "errors.hpp"
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

void project(const in_array& new_logits, const in_array& old_logits, double eps, const out_array& out,
             const out_array& stats_values, const out_array& stats_counters, double rtol, double atol,
             int max_iterations, std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "project";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    const project_args<T> a(fn, new_logits, old_logits, out);
    const auto sv = as_packed<double>(fn, "stats.values", stats_values);
    const auto sc = as_packed<std::int32_t>(fn, "stats.counters", stats_counters);
    const std::size_t rows = a.new_logits.rows;
    if (sv.rows != rows || sv.cols != st_values || sc.rows != rows || sc.cols != st_counters)
      fail(fn, "the stats buffers must be (rows, 6) float64 and (rows, 2) int32 for " + std::to_string(rows) +
                   " rows");
    use_device_of(fn, new_logits, old_logits, out, stats_values, stats_counters);
    const troll::projection_options options = projection_settings(rtol, atol, max_iterations);
    nb::gil_scoped_release release;
    cuda_entry::project<T>(as_stream(stream), a.new_logits, a.old_logits, eps, a.out, sv.data, sc.data, options,
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
    const auto sv = as_packed<const double>(fn, "stats.values", stats_values);
    const auto sc = as_packed<const std::int32_t>(fn, "stats.counters", stats_counters);
    const std::size_t rows = a.new_logits.rows;
    if (sv.rows != rows || sv.cols != st_values || sc.rows != rows || sc.cols != st_counters)
      fail(fn, "stats do not match the batch (" + std::to_string(rows) +
                   " rows): pass the stats project() returned for these logits");
    use_device_of(fn, new_logits, old_logits, log_probs, grad_log_probs, grad_new, stats_values);
    nb::gil_scoped_release release;
    cuda_entry::project_backward<T>(as_stream(stream), a.new_logits, a.old_logits, a.log_probs, sv.data, sc.data,
                                    a.grad_log_probs, a.grad_new, a.grad_old, a.grad_eps, checked);
  });
}

/// The logits' element type for the CUDA sparsify: float16 and bfloat16 too.
cuda_entry::logit_kind logit_kind_of(const char* fn, const in_array& a) {
  const nb::dlpack::dtype d = a.dtype();
  if (d == nb::dtype<float>()) return cuda_entry::logit_kind::f32;
  if (d == nb::dtype<double>()) return cuda_entry::logit_kind::f64;
  if (d.bits == 16 && d.lanes == 1 && d.code == std::uint8_t(nb::dlpack::dtype_code::Float))
    return cuda_entry::logit_kind::f16;
  if (d.bits == 16 && d.lanes == 1 && d.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat))
    return cuda_entry::logit_kind::bf16;
  throw nb::type_error((std::string("troll.") + fn + ": logits have dtype " + dtype_text(a) +
                        "; the CUDA sparsify reads float16, bfloat16, float32 and float64")
                           .c_str());
}

void sparsify(const in_array& logits, const std::optional<in_array>& sampled, int k, double delta, nb::handle out,
              std::uintptr_t stream, bool checked) {
  constexpr const char* fn = "sparsify";
  const cuda_entry::logit_kind kind = logit_kind_of(fn, logits);
  // The views' checks in the logits' element size (the batch layout is all they read).
  cuda_entry::any_logits x;
  x.kind = kind;
  auto layout = [&](auto tag) {
    using L = decltype(tag);
    const auto v = as_batch<const L>(fn, "logits", logits);
    x.data = v.data;
    x.rows = v.rows;
    x.cols = v.cols;
    x.stride = v.stride;
  };
  if (kind == cuda_entry::logit_kind::f64) {
    layout(double{});
  } else if (kind == cuda_entry::logit_kind::f32) {
    layout(float{});
  } else {
    // 16-bit logits: the same device and layout rules (the dtype was checked above).
    if (logits.device_type() != module_device) fail(fn, std::string("logits ") + module_device_text);
    const auto v = as_layout<const std::uint16_t>(fn, "logits", logits);
    x.data = v.data;
    x.rows = v.rows;
    x.cols = v.cols;
    x.stride = v.stride;
  }
  const nb::tuple t = as_tuple(fn, "out", out, 5);
  const out_array probe = item<out_array>(fn, "out", t, 1);
  dispatch_float(fn, "out.log_probs", probe, [&](auto tag) {
    using T = decltype(tag);
    const sparse_rows<T> o(fn, "out", out);
    if (o.view.rows != x.rows)
      fail(fn, "out has " + std::to_string(o.view.rows) + " rows but logits have " + std::to_string(x.rows));
    const sparse_index* s = sampled ? as_rows<const sparse_index>(fn, "sampled", *sampled, x.rows) : nullptr;
    use_device_of(fn, logits, o.indices, o.log_probs);
    troll::sparsify_options options;
    options.k = k;
    options.delta = delta;
    nb::gil_scoped_release release;
    cuda_entry::sparsify<T>(as_stream(stream), x, s, options, o.view, checked);
  });
}

}  // namespace
}  // namespace troll_py

NB_MODULE(_troll_cuda, m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  troll_py::register_errors();
  m.attr("cuda") = true;
  m.def("device_count", &troll_py::cuda_entry::device_count, "CUDA devices visible (0 without a driver or GPU).");
  m.def("device_name", &troll_py::cuda_entry::device_name, "device"_a);
  m.def("log_softmax", &troll_py::log_softmax, "logits"_a, "out"_a, "stream"_a, "checked"_a = true,
        "out = log_softmax(logits) per row, enqueued on `stream`.");
  m.def("kl", &troll_py::kl, "p_logits"_a, "q_logits"_a, "out"_a, "stream"_a, "checked"_a = true,
        "out[r] = KL(softmax(p[r]) || softmax(q[r])), enqueued on `stream`.");
  m.def("project", &troll_py::project, "new_logits"_a, "old_logits"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = 1e-12, "atol"_a = 1e-15, "max_iterations"_a = 50, "stream"_a = 0,
        "checked"_a = true, "The KL trust-region projection on the device, enqueued on `stream`.");
  m.def("project_backward", &troll_py::project_backward, "new_logits"_a, "old_logits"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad_log_probs"_a, "grad_new"_a, "grad_old"_a.none(),
        "grad_eps"_a.none(), "stream"_a = 0, "checked"_a = true,
        "The projection's vector-Jacobian product on the device, enqueued on `stream`.");
  m.def("sparsify", &troll_py::sparsify, "logits"_a, "sampled"_a.none(), "k"_a, "delta"_a, "out"_a, "stream"_a = 0,
        "checked"_a = true, "Top-k + remainder rows of device logits (float16 / bfloat16 / float32 / float64).");
}
