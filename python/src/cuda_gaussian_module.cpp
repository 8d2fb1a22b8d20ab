// python/src/cuda_gaussian_module.cpp — the Gaussian entry points of troll._troll_cuda
// (bind_cuda_gaussian, called by cuda_module.cpp): gaussian_project, gaussian_project_backward,
// gaussian_project_jvp and gaussian_kl on CUDA device arrays, with troll._troll's argument lists
// (gaussian.cpp) except `threads`, which becomes the caller's `stream` and the `checked` flag
// (`saved` stays the last, optional argument). The argument checks are gaussian_args.hpp's,
// shared with the host module; the work is in cuda_gaussian_entry.cu. No maths here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cuda_entry.hpp"
#include "cuda_gaussian_entry.hpp"
#include "gaussian_args.hpp"
#include "views.hpp"

namespace troll_py {
namespace {

void* as_stream_ptr(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

/// Makes the operands' device current (all arrays of a call must be on it).
void use_device(const char* fn, const in_array& mean, std::initializer_list<std::int32_t> others) {
  for (std::int32_t id : others)
    if (id != mean.device_id())
      fail(fn, "the arrays are on different CUDA devices (" + std::to_string(mean.device_id()) + " and " +
                   std::to_string(id) + ")");
  cuda_entry::set_device(mean.device_id());
}

void project(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
             double eps_mean, double eps_cov, bool full, bool split, const out_array& out_mean,
             const out_array& out_cov, const out_array& stats_values, const out_array& stats_counters, double rtol,
             double atol, int max_iterations, std::uintptr_t stream, bool checked,
             const std::optional<out_array>& saved) {
  const char* fn = gaussian_project_name(full, split);
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_project_args<T> a(fn, full, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                     stats_counters, rtol, atol, max_iterations, saved);
    use_device(fn, mean,
               {cov.device_id(), old_mean.device_id(), old_cov.device_id(), out_mean.device_id(), out_cov.device_id(),
                stats_values.device_id(), stats_counters.device_id(), saved ? saved->device_id() : mean.device_id()});
    nb::gil_scoped_release release;
    cuda_entry::gaussian_project<T>(as_stream_ptr(stream), full, split, a.in.mean, a.in.cov, a.in.old_mean,
                                    a.in.old_cov, eps_mean, eps_cov, a.out_mean, a.out_cov, a.values, a.counters,
                                    a.options, a.saved, checked);
  });
}

std::int32_t device_or(const std::optional<out_array>& a, std::int32_t fallback) {
  return a ? a->device_id() : fallback;
}
std::int32_t device_or(const std::optional<in_array>& a, std::int32_t fallback) {
  return a ? a->device_id() : fallback;
}

void project_backward(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
                      double eps_mean, double eps_cov, bool full, bool split, const in_array& out_mean,
                      const in_array& out_cov, const in_array& stats_values, const in_array& stats_counters,
                      const in_array& grad_out_mean, const in_array& grad_out_cov,
                      const std::optional<out_array>& grad_mean, const std::optional<out_array>& grad_cov,
                      const std::optional<out_array>& grad_old_mean, const std::optional<out_array>& grad_old_cov,
                      const std::optional<out_array>& grad_eps, const std::optional<out_array>& grad_eps_mean,
                      std::uintptr_t stream, bool checked, const std::optional<in_array>& saved) {
  const char* fn = "gaussian.project_backward";  // the entry point the caller named
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_backward_args<T> a(fn, full, split, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                      stats_counters, grad_out_mean, grad_out_cov, grad_mean, grad_cov,
                                      grad_old_mean, grad_old_cov, grad_eps, grad_eps_mean, saved);
    const std::int32_t id = mean.device_id();
    use_device(fn, mean,
               {cov.device_id(), old_mean.device_id(), old_cov.device_id(), out_mean.device_id(), out_cov.device_id(),
                stats_values.device_id(), stats_counters.device_id(), grad_out_mean.device_id(),
                grad_out_cov.device_id(), device_or(grad_mean, id), device_or(grad_cov, id),
                device_or(grad_old_mean, id), device_or(grad_old_cov, id), device_or(grad_eps, id),
                device_or(grad_eps_mean, id), device_or(saved, id)});
    nb::gil_scoped_release release;
    cuda_entry::gaussian_project_backward<T>(as_stream_ptr(stream), full, split, a.in.mean, a.in.cov, a.in.old_mean,
                                             a.in.old_cov, eps_mean, eps_cov, a.out_mean, a.out_cov, a.values,
                                             a.counters, a.grad_out_mean, a.grad_out_cov, a.grads, a.saved, checked);
  });
}

void project_jvp(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
                 double eps_mean, double eps_cov, bool full, bool split, const in_array& out_mean,
                 const in_array& out_cov, const in_array& stats_values, const in_array& stats_counters,
                 const std::optional<in_array>& tangent_mean, const std::optional<in_array>& tangent_cov,
                 const std::optional<in_array>& tangent_old_mean, const std::optional<in_array>& tangent_old_cov,
                 double tangent_eps, double tangent_eps_mean, const out_array& tangent_out_mean,
                 const out_array& tangent_out_cov, std::uintptr_t stream, bool checked,
                 const std::optional<in_array>& saved) {
  const char* fn = "gaussian.project_jvp";
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_jvp_args<T> a(fn, full, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                 stats_counters, tangent_mean, tangent_cov, tangent_old_mean, tangent_old_cov,
                                 tangent_eps, tangent_eps_mean, tangent_out_mean, tangent_out_cov, saved);
    const std::int32_t id = mean.device_id();
    use_device(fn, mean,
               {cov.device_id(), old_mean.device_id(), old_cov.device_id(), out_mean.device_id(), out_cov.device_id(),
                stats_values.device_id(), stats_counters.device_id(), device_or(tangent_mean, id),
                device_or(tangent_cov, id), device_or(tangent_old_mean, id), device_or(tangent_old_cov, id),
                tangent_out_mean.device_id(), tangent_out_cov.device_id(), device_or(saved, id)});
    nb::gil_scoped_release release;
    cuda_entry::gaussian_project_jvp<T>(as_stream_ptr(stream), full, split, a.in.mean, a.in.cov, a.in.old_mean,
                                        a.in.old_cov, eps_mean, eps_cov, a.out_mean, a.out_cov, a.values, a.counters,
                                        a.tangents, a.tangent_out_mean, a.tangent_out_cov, a.saved, checked);
  });
}

void kl(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov, bool full,
        const out_array& out, std::uintptr_t stream, bool checked) {
  const char* fn = full ? "gaussian.kl" : "gaussian.kl_diag";
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_kl_args<T> a(fn, full, mean, cov, old_mean, old_cov, out);
    use_device(fn, mean, {cov.device_id(), old_mean.device_id(), old_cov.device_id(), out.device_id()});
    nb::gil_scoped_release release;
    cuda_entry::gaussian_kl<T>(as_stream_ptr(stream), full, a.in.mean, a.in.cov, a.in.old_mean, a.in.old_cov, a.out,
                               checked);
  });
}

}  // namespace

void bind_cuda_gaussian(nb::module_& m) {
  using namespace nb::literals;
  m.def("gaussian_project", &project, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "eps_mean"_a, "eps_cov"_a,
        "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a, "stats_counters"_a, "rtol"_a = 1e-11,
        "atol"_a = 0.0, "max_iterations"_a = 100, "stream"_a = 0, "checked"_a = true, "saved"_a.none() = nb::none(),
        "troll._troll.gaussian_project on CUDA arrays, enqueued on `stream` (full rows above d = 32: a "
        "stream-ordered workspace).");
  m.def("gaussian_project_backward", &project_backward, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a,
        "eps_mean"_a, "eps_cov"_a, "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a,
        "stats_counters"_a, "grad_out_mean"_a, "grad_out_cov"_a, "grad_mean"_a.none(), "grad_cov"_a.none(),
        "grad_old_mean"_a.none(), "grad_old_cov"_a.none(), "grad_eps"_a.none(), "grad_eps_mean"_a.none(),
        "stream"_a = 0, "checked"_a = true, "saved"_a.none() = nb::none(),
        "troll._troll.gaussian_project_backward on CUDA arrays, enqueued on `stream`.");
  m.def("gaussian_project_jvp", &project_jvp, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "eps_mean"_a,
        "eps_cov"_a, "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a, "stats_counters"_a,
        "tangent_mean"_a.none(), "tangent_cov"_a.none(), "tangent_old_mean"_a.none(), "tangent_old_cov"_a.none(),
        "tangent_eps"_a, "tangent_eps_mean"_a, "tangent_out_mean"_a, "tangent_out_cov"_a, "stream"_a = 0,
        "checked"_a = true, "saved"_a.none() = nb::none(),
        "troll._troll.gaussian_project_jvp on CUDA arrays, enqueued on `stream`.");
  m.def("gaussian_kl", &kl, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "full"_a, "out"_a, "stream"_a = 0,
        "checked"_a = true, "troll._troll.gaussian_kl on CUDA arrays, enqueued on `stream`.");
}

}  // namespace troll_py
