// python/src/module.cpp — the CPU extension module: troll's exceptions as Python exceptions
// (troll/_errors.py), and the dense entry points (log_softmax, kl, project and their backward
// passes). The same sources build troll._troll (the baseline: AVX2 + FMA on x86-64) and, where
// the compiler can target x86-64-v4, troll._troll_avx512 (TROLL_PY_MODULE, TROLL_PY_ISA); the
// Python layer runs the second on CPUs that have AVX-512 (troll/_cpu.py). Every function takes caller-allocated outputs and releases the GIL while
// troll runs; the Python layer (troll/_core.py) allocates outputs in the caller's framework.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>

#include "errors.hpp"
#include "dense_args.hpp"
#include "views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

void log_softmax(const in_array& logits, const out_array& out, unsigned threads) {
  constexpr const char* fn = "log_softmax";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    const log_softmax_args<decltype(tag)> a(fn, logits, out);
    nb::gil_scoped_release release;
    troll::log_softmax(policy(threads), a.logits, a.out);
  });
}

void kl(const in_array& p, const in_array& q, const out_array& out, unsigned threads) {
  constexpr const char* fn = "kl";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    const kl_args<decltype(tag)> a(fn, p, q, out);
    nb::gil_scoped_release release;
    troll::kl(policy(threads), a.p, a.q, a.out);
  });
}

void kl_backward(const in_array& p, const in_array& q, const in_array& grad_kl,
                 const std::optional<out_array>& grad_p, const std::optional<out_array>& grad_q,
                 unsigned threads) {
  constexpr const char* fn = "kl_backward";
  dispatch_float(fn, "p_logits", p, [&](auto tag) {
    using T = decltype(tag);
    const kl_backward_args<T> a(fn, p, q, grad_kl, grad_p, grad_q);
    nb::gil_scoped_release release;
    troll::kl_backward(policy(threads), a.p, a.q, a.grad_kl, a.grad_p, a.grad_q);
  });
}

void project(const in_array& new_logits, const in_array& old_logits, double eps,
             const out_array& out, const out_array& stats_values, const out_array& stats_counters,
             double rtol, double atol, int max_iterations, unsigned threads) {
  constexpr const char* fn = "project";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    const project_args<decltype(tag)> a(fn, new_logits, old_logits, out);
    const stats_out st(fn, stats_values, stats_counters, a.new_logits.rows);
    require_stats_disjoint(fn, st.values, st.counters, a.new_logits, a.old_logits, a.out);
    const troll::projection_options options = projection_settings(rtol, atol, max_iterations);
    std::vector<troll::projection_stats> stats(a.new_logits.rows);
    {
      nb::gil_scoped_release release;
      troll::project(policy(threads), a.new_logits, a.old_logits, eps, a.out, stats.data(), options);
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
    const project_backward_args<decltype(tag)> a(fn, new_logits, old_logits, log_probs, grad_log_probs,
                                                 grad_new, grad_old, grad_eps);
    const auto stats = read_stats(fn, stats_values, stats_counters, a.new_logits.rows);
    nb::gil_scoped_release release;
    troll::project_backward(policy(threads), a.new_logits, a.old_logits, a.log_probs, stats.data(),
                            a.grad_log_probs, a.grad_new, a.grad_old, a.grad_eps);
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
        "stats_counters"_a, "rtol"_a = troll::projection_options{}.rtol, "atol"_a = troll::projection_options{}.atol,
        "max_iterations"_a = troll::projection_options{}.max_iterations,
        "threads"_a = 0,
        "The KL trust-region projection: log pi* to out, the statistics to the packed buffers.");
  m.def("project_backward", &project_backward, "new_logits"_a, "old_logits"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad_log_probs"_a, "grad_new"_a,
        "grad_old"_a.none(), "grad_eps"_a.none(), "threads"_a = 0,
        "The projection's vector-Jacobian product w.r.t. new logits, old logits and eps.");
}

}  // namespace troll_py

#ifndef TROLL_PY_MODULE
#define TROLL_PY_MODULE _troll
#endif
#ifndef TROLL_PY_ISA
#define TROLL_PY_ISA "generic"
#endif

NB_MODULE(TROLL_PY_MODULE, m) {
  namespace nb = nanobind;
  troll_py::register_errors();
  // The instruction set this module was compiled for, and whether the running CPU (and its OS)
  // can run the x86-64-v4 build: AVX-512 F, BW, CD, DQ and VL (the CPUID bits and the saved
  // register state, as GCC and Clang's __builtin_cpu_supports read them).
  m.attr("ISA") = TROLL_PY_ISA;
  m.def("cpu_supports_avx512", [] {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") != 0;  // every feature the level implies
#elif (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#else
    return false;
#endif
  }, "Whether this CPU runs troll._troll_avx512 (x86-64-v4: AVX-512 F, BW, CD, DQ, VL).");
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
