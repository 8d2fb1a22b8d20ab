// python/src/module.cpp — the extension module troll._troll: troll's exceptions as Python
// exceptions (troll/_errors.py), and the dense entry points (log_softmax, kl, project and their
// backward passes). Every function takes caller-allocated outputs and releases the GIL while
// troll runs; the Python layer (troll/_core.py) allocates outputs in the caller's framework.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>

#include "errors.hpp"
#include "views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

void log_softmax(const in_array& logits, const out_array& out, unsigned threads) {
  constexpr const char* fn = "log_softmax";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    require_same_shape(fn, "out", out, "logits", logits);
    const auto x = as_batch<const T>(fn, "logits", logits);
    const auto y = as_batch<T>(fn, "out", out);
    require_disjoint(fn, "out", y, "logits", x);
    nb::gil_scoped_release release;
    troll::log_softmax(policy(threads), x, y);
  });
}

void kl(const in_array& p, const in_array& q, const out_array& out, unsigned threads) {
  constexpr const char* fn = "kl";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    using T = decltype(tag);
    require_same_shape(fn, "q_logits", q, "p_logits", p);
    const auto pv = as_batch<const T>(fn, "p_logits", p);
    const auto qv = as_batch<const T>(fn, "q_logits", q);
    T* y = as_rows<T>(fn, "out", out, pv.rows);
    const auto yv = troll::make_batch(y, pv.rows == 0 ? 0 : 1, pv.rows);
    require_disjoint(fn, "out", yv, "p_logits", pv);
    require_disjoint(fn, "out", yv, "q_logits", qv);
    nb::gil_scoped_release release;
    troll::kl(policy(threads), pv, qv, y);
  });
}

void kl_backward(const in_array& p, const in_array& q, const in_array& grad_kl,
                 const std::optional<out_array>& grad_p, const std::optional<out_array>& grad_q,
                 unsigned threads) {
  constexpr const char* fn = "kl_backward";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    using T = decltype(tag);
    require_same_shape(fn, "q_logits", q, "p_logits", p);
    const auto pv = as_batch<const T>(fn, "p_logits", p);
    const auto qv = as_batch<const T>(fn, "q_logits", q);
    const T* g = as_rows<const T>(fn, "grad_kl", grad_kl, pv.rows);
    troll::batch_view<T> gp{}, gq{};
    if (grad_p) {
      require_same_shape(fn, "grad_p", *grad_p, "p_logits", p);
      gp = as_batch<T>(fn, "grad_p", *grad_p);
      require_disjoint(fn, "grad_p", gp, "p_logits", pv);
      require_disjoint(fn, "grad_p", gp, "q_logits", qv);
    }
    if (grad_q) {
      require_same_shape(fn, "grad_q", *grad_q, "p_logits", p);
      gq = as_batch<T>(fn, "grad_q", *grad_q);
      require_disjoint(fn, "grad_q", gq, "p_logits", pv);
      require_disjoint(fn, "grad_q", gq, "q_logits", qv);
    }
    nb::gil_scoped_release release;
    troll::kl_backward(policy(threads), pv, qv, g, gp, gq);
  });
}

void project(const in_array& new_logits, const in_array& old_logits, double eps,
             const out_array& out, const out_array& stats_values, const out_array& stats_counters,
             double rtol, double atol, int max_iterations, unsigned threads) {
  constexpr const char* fn = "project";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    require_same_shape(fn, "old_logits", old_logits, "new_logits", new_logits);
    require_same_shape(fn, "out", out, "new_logits", new_logits);
    const auto nv = as_batch<const T>(fn, "new_logits", new_logits);
    const auto ov = as_batch<const T>(fn, "old_logits", old_logits);
    const auto y = as_batch<T>(fn, "out", out);
    require_disjoint(fn, "out", y, "new_logits", nv);
    require_disjoint(fn, "out", y, "old_logits", ov);
    const stats_out st(fn, stats_values, stats_counters, nv.rows);
    troll::projection_options options;
    options.rtol = rtol;
    options.atol = atol;
    options.max_iterations = max_iterations;
    std::vector<troll::projection_stats> stats(nv.rows);
    {
      nb::gil_scoped_release release;
      troll::project(policy(threads), nv, ov, eps, y, stats.data(), options);
    }
    st.write(stats);
  });
}

void project_backward(const in_array& new_logits, const in_array& old_logits,
                      const in_array& log_probs, const in_array& stats_values,
                      const in_array& stats_counters, const in_array& grad_log_probs,
                      const out_array& grad_new, const std::optional<out_array>& grad_old,
                      const std::optional<out_array>& grad_eps, unsigned threads) {
  constexpr const char* fn = "project_backward";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    for (auto* a : {&old_logits, &log_probs, &grad_log_probs})
      require_same_shape(fn, "an input", *a, "new_logits", new_logits);
    require_same_shape(fn, "grad_new", grad_new, "new_logits", new_logits);
    const auto nv = as_batch<const T>(fn, "new_logits", new_logits);
    const auto ov = as_batch<const T>(fn, "old_logits", old_logits);
    const auto lp = as_batch<const T>(fn, "log_probs", log_probs);
    const auto g = as_batch<const T>(fn, "grad_log_probs", grad_log_probs);
    const auto gn = as_batch<T>(fn, "grad_new", grad_new);
    troll::batch_view<T> go{};
    T* ge = nullptr;
    if (grad_old) {
      require_same_shape(fn, "grad_old", *grad_old, "new_logits", new_logits);
      go = as_batch<T>(fn, "grad_old", *grad_old);
    }
    if (grad_eps) ge = as_rows<T>(fn, "grad_eps", *grad_eps, nv.rows);
    const troll::batch_view<T>* outputs[] = {&gn, &go};
    for (const troll::batch_view<T>* out : outputs) {
      require_disjoint(fn, "a gradient", *out, "new_logits", nv);
      require_disjoint(fn, "a gradient", *out, "old_logits", ov);
      require_disjoint(fn, "a gradient", *out, "log_probs", lp);
      require_disjoint(fn, "a gradient", *out, "grad_log_probs", g);
    }
    require_disjoint(fn, "grad_old", go, "grad_new", gn);
    const auto stats = read_stats(fn, stats_values, stats_counters, nv.rows);
    nb::gil_scoped_release release;
    troll::project_backward(policy(threads), nv, ov, lp, stats.data(), g, gn, go, ge);
  });
}

}  // namespace

void bind_dense(nb::module_& m) {
  using namespace nb::literals;
  m.def("log_softmax", &log_softmax, "logits"_a, "out"_a, "threads"_a = 0,
        "out = log_softmax(logits) per row (caller-allocated out).");
  m.def("kl", &kl, "p_logits"_a, "q_logits"_a, "out"_a, "threads"_a = 0,
        "out[r] = KL(softmax(p[r]) || softmax(q[r])) (caller-allocated out, one entry a row).");
  m.def("kl_backward", &kl_backward, "p_logits"_a, "q_logits"_a, "grad_kl"_a,
        "grad_p"_a.none(), "grad_q"_a.none(), "threads"_a = 0,
        "Gradients of the per-row KL w.r.t. both logits, scaled by grad_kl.");
  m.def("project", &project, "new_logits"_a, "old_logits"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = 1e-12, "atol"_a = 1e-15, "max_iterations"_a = 50,
        "threads"_a = 0,
        "The KL trust-region projection: log pi* to out, the statistics to the packed buffers.");
  m.def("project_backward", &project_backward, "new_logits"_a, "old_logits"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad_log_probs"_a, "grad_new"_a,
        "grad_old"_a.none(), "grad_eps"_a.none(), "threads"_a = 0,
        "The projection's vector-Jacobian product w.r.t. new logits, old logits and eps.");
}

}  // namespace troll_py

NB_MODULE(_troll, m) {
  namespace nb = nanobind;
  troll_py::register_errors();
  m.attr("__version__") = std::to_string(troll::version.major) + "." +
                          std::to_string(troll::version.minor) + "." +
                          std::to_string(troll::version.patch);
  m.attr("cuda") = false;
  m.attr("STATS_COLUMNS") = nb::make_tuple("t", "eta", "kl_before", "kl_after", "mu", "sigma2");
  m.attr("STATS_COUNTERS") = nb::make_tuple("iterations", "status");
  troll_py::bind_dense(m);
  troll_py::bind_sparse(m);
  troll_py::bind_objectives(m);
  troll_py::bind_gaussian(m);
}
