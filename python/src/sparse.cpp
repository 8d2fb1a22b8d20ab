// python/src/sparse.cpp — troll's sparse rows (top-K + remainder bucket, docs/sparse.md) for
// Python: sparsify and its backward, align dense new logits with sparse old rows, and the
// projection of aligned rows with its backward. Sparse rows travel as tuples of arrays (the
// NamedTuples of troll/_core.py): (indices, log_probs, counts, log_remainder, vocab) and, aligned,
// (indices, counts, new_log_probs, old_log_probs, new_log_remainder, old_log_remainder, vocab).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "sparse_views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

void sparsify(const in_array& logits, const std::optional<in_array>& sampled, int k, double delta,
              nb::handle out, unsigned threads) {
  constexpr const char* fn = "sparsify";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    const auto x = as_batch<const T>(fn, "logits", logits);
    const sparse_index* s =
        sampled ? as_rows<const sparse_index>(fn, "sampled", *sampled, x.rows) : nullptr;
    const sparse_rows<T> o(fn, "out", out);
    troll::sparsify_options options;
    options.k = k;
    options.delta = delta;
    nb::gil_scoped_release release;
    troll::sparsify(policy(threads), x, s, options, o.view);
  });
}

void sparsify_backward(const in_array& logits, nb::handle support, nb::handle grad,
                       const out_array& grad_logits, unsigned threads) {
  constexpr const char* fn = "sparsify_backward";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    require_same_shape(fn, "grad_logits", grad_logits, "logits", logits);
    const auto x = as_batch<const T>(fn, "logits", logits);
    const auto gx = as_batch<T>(fn, "grad_logits", grad_logits);
    require_disjoint(fn, "grad_logits", gx, "logits", x);
    const sparse_rows<const T> s(fn, "support", support);
    const sparse_grad<const T> g(fn, "grad", grad);
    nb::gil_scoped_release release;
    troll::sparsify_backward(policy(threads), x, s.view, g.view, gx);
  });
}

void align(const in_array& new_logits, nb::handle new_support, nb::handle old_rows, nb::handle out,
           unsigned threads) {
  constexpr const char* fn = "align";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    using T = decltype(tag);
    const auto x = as_batch<const T>(fn, "new_logits", new_logits);
    std::optional<sparse_rows<const T>> support;
    troll::sparse_batch_view<const T> support_view{};
    if (!new_support.is_none()) {
      support.emplace(fn, "new_support", new_support);
      support_view = support->view;
    }
    const sparse_rows<const T> old(fn, "old", old_rows);
    const aligned_rows<T> o(fn, "out", out);
    nb::gil_scoped_release release;
    troll::align(policy(threads), x, support_view, old.view, o.view);
  });
}

void kl_aligned(nb::handle rows, const out_array& out, unsigned threads) {
  constexpr const char* fn = "kl_sparse";
  const nb::tuple t = as_tuple(fn, "rows", rows, 7);
  const in_array probe = item<in_array>(fn, "rows", t, 2);
  dispatch_float(fn, "rows.new_log_probs", probe, [&](auto tag) {
    using T = decltype(tag);
    const aligned_rows<const T> a(fn, "rows", rows);
    T* y = as_rows<T>(fn, "out", out, a.view.rows);
    nb::gil_scoped_release release;
    troll::kl(policy(threads), a.view, y);
  });
}

void project_aligned(nb::handle rows, double eps, nb::handle out, const out_array& stats_values,
                     const out_array& stats_counters, double rtol, double atol, int max_iterations,
                     unsigned threads) {
  constexpr const char* fn = "project_sparse";
  const nb::tuple t = as_tuple(fn, "rows", rows, 7);
  const in_array probe = item<in_array>(fn, "rows", t, 2);
  dispatch_float(fn, "rows.new_log_probs", probe, [&](auto tag) {
    using T = decltype(tag);
    const aligned_rows<const T> a(fn, "rows", rows);
    const sparse_rows<T> o(fn, "out", out);
    const stats_out st(fn, stats_values, stats_counters, a.view.rows);
    troll::projection_options options;
    options.rtol = rtol;
    options.atol = atol;
    options.max_iterations = max_iterations;
    std::vector<troll::projection_stats> stats(a.view.rows);
    {
      nb::gil_scoped_release release;
      troll::project(policy(threads), a.view, eps, o.view, stats.data(), options);
    }
    st.write(stats);
  });
}

void project_aligned_backward(nb::handle rows, nb::handle log_probs, const in_array& stats_values,
                              const in_array& stats_counters, nb::handle grad, nb::handle grad_new,
                              nb::handle grad_old, const std::optional<out_array>& grad_eps,
                              unsigned threads) {
  constexpr const char* fn = "project_sparse_backward";
  const nb::tuple t = as_tuple(fn, "rows", rows, 7);
  const in_array probe = item<in_array>(fn, "rows", t, 2);
  dispatch_float(fn, "rows.new_log_probs", probe, [&](auto tag) {
    using T = decltype(tag);
    const aligned_rows<const T> a(fn, "rows", rows);
    const sparse_rows<const T> lp(fn, "log_probs", log_probs);
    const sparse_grad<const T> g(fn, "grad", grad);
    const sparse_grad<T> gn(fn, "grad_new", grad_new);
    std::optional<sparse_grad<T>> go;
    troll::sparse_grad_view<T> go_view{};
    if (!grad_old.is_none()) {
      go.emplace(fn, "grad_old", grad_old);
      go_view = go->view;
    }
    T* ge = grad_eps ? as_rows<T>(fn, "grad_eps", *grad_eps, a.view.rows) : nullptr;
    const auto stats = read_stats(fn, stats_values, stats_counters, a.view.rows);
    nb::gil_scoped_release release;
    troll::project_backward(policy(threads), a.view, lp.view, stats.data(), g.view, gn.view,
                            go_view, ge);
  });
}

}  // namespace

void bind_sparse(nb::module_& m) {
  using namespace nb::literals;
  m.attr("SPARSIFY_MAX_K") = troll::sparsify_max_k;
  m.attr("SPARSE_MAX_ENTRIES") = troll::sparse_max_entries;
  m.def("sparsify", &sparsify, "logits"_a, "sampled"_a.none(), "k"_a, "delta"_a, "out"_a,
        "threads"_a = 0, "Top-k + remainder rows of dense logits into caller-allocated sparse rows.");
  m.def("sparsify_backward", &sparsify_backward, "logits"_a, "support"_a, "grad"_a,
        "grad_logits"_a, "threads"_a = 0,
        "Scatters a gradient on sparse rows gathered from logits back to the dense logits.");
  m.def("align", &align, "new_logits"_a, "new_support"_a.none(), "old"_a, "out"_a,
        "threads"_a = 0, "Aligns dense new logits with sparse old rows on U = S_new | S_old.");
  m.def("kl_sparse", &kl_aligned, "rows"_a, "out"_a, "threads"_a = 0,
        "KL(new || old) of aligned rows (the lumped categories).");
  m.def("project_sparse", &project_aligned, "rows"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = 1e-12, "atol"_a = 1e-15, "max_iterations"_a = 50,
        "threads"_a = 0, "The trust-region projection of aligned rows.");
  m.def("project_sparse_backward", &project_aligned_backward, "rows"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad"_a, "grad_new"_a, "grad_old"_a.none(),
        "grad_eps"_a.none(), "threads"_a = 0,
        "VJP of project_sparse w.r.t. the aligned new (and old) log-probs and buckets, and eps.");
}

}  // namespace troll_py
