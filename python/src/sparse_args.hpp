// python/src/sparse_args.hpp — the arguments of the sparse path's entry points (sparsify_backward,
// align, kl_sparse, project_sparse and its backward) as both extension modules take them
// (troll._troll on host arrays, troll._troll_cuda on device arrays: views.hpp's device rule
// differs, nothing here does). Each struct parses, checks and holds one call's views in the order
// the checks run; the modules differ only in the call they make with them. The projection
// statistics are a module's own (`Stats`: host vectors or packed device buffers), parsed here
// in their place. No maths here.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>

#include <troll/sparse_types.hpp>

#include "dense_args.hpp"
#include "sparse_views.hpp"

namespace troll_py {

/// The sparsify settings every sparsify binding takes.
inline troll::sparsify_options sparsify_settings(int k, double delta) {
  troll::sparsify_options options;
  options.k = k;
  options.delta = delta;
  return options;
}

/// Calls f(tag) with tag's type the element type of the sparse rows `out` (their log_probs).
template <class F>
decltype(auto) dispatch_sparse_out(const char* fn, nb::handle out, F&& f) {
  const nb::tuple t = as_tuple(fn, "out", out, 5);
  const out_array probe = item<out_array>(fn, "out", t, 1);
  return dispatch_float(fn, "out.log_probs", probe, std::forward<F>(f));
}

/// Calls f(tag) with tag's type the element type of aligned rows (their new_log_probs).
template <class F>
decltype(auto) dispatch_aligned(const char* fn, nb::handle rows, F&& f) {
  const nb::tuple t = as_tuple(fn, "rows", rows, 7);
  const in_array probe = item<in_array>(fn, "rows", t, 2);
  return dispatch_float(fn, "rows.new_log_probs", probe, std::forward<F>(f));
}

/// sparsify_backward: dense logits, the support and gradient on sparse rows, the dense gradient.
template <class T>
struct sparsify_backward_args {
  troll::batch_view<const T> logits;
  troll::batch_view<T> grad_logits;
  sparse_rows<const T> support;
  sparse_grad<const T> grad;

  sparsify_backward_args(const char* fn, const in_array& x, nb::handle s, nb::handle g, const out_array& gx)
      : logits((require_same_shape(fn, "grad_logits", gx, "logits", x), as_batch<const T>(fn, "logits", x))),
        grad_logits(disjoint_from(fn, "grad_logits", as_batch<T>(fn, "grad_logits", gx), "logits", logits)),
        support(fn, "support", s),
        grad(fn, "grad", g) {
    require_same_rows(fn, support.rows, rows_of("logits", x));
    require_same_rows(fn, grad.rows, support.rows);
  }
};

/// align: dense new logits, their own support (None: empty), sparse old rows, the aligned output.
template <class T>
struct align_args {
  troll::batch_view<const T> new_logits;
  std::optional<sparse_rows<const T>> support_rows;
  troll::sparse_batch_view<const T> support{};
  sparse_rows<const T> old;
  aligned_rows<T> out;

  align_args(const char* fn, const in_array& n, nb::handle new_support, nb::handle old_rows, nb::handle o)
      : new_logits(as_batch<const T>(fn, "new_logits", n)),
        support_rows(new_support.is_none() ? std::nullopt
                                           : std::make_optional<sparse_rows<const T>>(fn, "new_support", new_support)),
        support(support_rows ? support_rows->view : troll::sparse_batch_view<const T>{}),
        old(fn, "old", old_rows),
        out(fn, "out", o) {
    const rows_shape rows = rows_of("new_logits", n);
    if (support_rows) require_same_rows(fn, support_rows->rows, rows);
    require_same_rows(fn, old.rows, rows);
    require_same_rows(fn, out.rows, rows);
  }
};

/// kl_sparse: aligned rows and one output entry a row.
template <class T>
struct kl_aligned_args {
  aligned_rows<const T> rows;
  T* out;

  kl_aligned_args(const char* fn, nb::handle r, const out_array& o)
      : rows(fn, "rows", r), out(as_rows<T>(fn, "out", o, rows_of("rows.indices", rows.indices))) {}
};

/// project_sparse: aligned rows, the sparse output, the statistics' output (`StatsOut`).
template <class T, class StatsOut>
struct project_aligned_args {
  aligned_rows<const T> rows;
  sparse_rows<T> out;
  StatsOut stats;

  project_aligned_args(const char* fn, nb::handle r, nb::handle o, const out_array& values,
                       const out_array& counters)
      : rows(fn, "rows", r), out(fn, "out", o), stats(fn, values, counters, rows.view.rows) {
    require_same_rows(fn, out.rows, rows.rows);
  }
};

/// project_sparse_backward: aligned rows, the forward's log_probs, the upstream gradient, the
/// gradients to new (and old, None: not wanted) rows and eps, the statistics' input (`StatsIn`).
template <class T, class StatsIn>
struct project_aligned_backward_args {
  aligned_rows<const T> rows;
  sparse_rows<const T> log_probs;
  sparse_grad<const T> grad;
  sparse_grad<T> grad_new;
  std::optional<sparse_grad<T>> grad_old_rows;
  troll::sparse_grad_view<T> grad_old{};
  T* grad_eps;
  StatsIn stats;

  project_aligned_backward_args(const char* fn, nb::handle r, nb::handle lp, const in_array& values,
                                const in_array& counters, nb::handle g, nb::handle gn, nb::handle go,
                                const std::optional<out_array>& ge)
      : rows(fn, "rows", r),
        log_probs(fn, "log_probs", lp),
        grad(fn, "grad", g),
        grad_new(fn, "grad_new", gn),
        grad_old_rows(go.is_none() ? std::nullopt : std::make_optional<sparse_grad<T>>(fn, "grad_old", go)),
        grad_old(grad_old_rows ? grad_old_rows->view : troll::sparse_grad_view<T>{}),
        grad_eps(ge ? as_rows<T>(fn, "grad_eps", *ge, rows_of("rows.indices", rows.indices)) : nullptr),
        stats(fn, values, counters, rows.view.rows) {
    require_same_rows(fn, log_probs.rows, rows.rows);
    require_same_rows(fn, grad.rows, rows.rows);
    require_same_rows(fn, grad_new.rows, rows.rows);
    if (grad_old_rows) require_same_rows(fn, grad_old_rows->rows, rows.rows);
  }
};

}  // namespace troll_py
