// python/src/dense_args.hpp — the arguments of the dense entry points (log_softmax, kl, kl_backward,
// project, project_backward), checked and turned into troll views once for both extension modules:
// troll._troll (module.cpp, host arrays) and troll._troll_cuda (cuda_module.cpp, device arrays —
// views.hpp's device rule differs, the checks here do not). Each function throws the same
// ShapeError / TypeError text on both, before anything is written.
#pragma once

#include <optional>

#include "views.hpp"

namespace troll_py {

/// log_softmax: logits in, out of the same shape, not overlapping.
template <class T>
struct log_softmax_args {
  troll::batch_view<const T> logits;
  troll::batch_view<T> out;

  log_softmax_args(const char* fn, const in_array& x, const out_array& y) {
    require_same_shape(fn, "out", y, "logits", x);
    logits = as_batch<const T>(fn, "logits", x);
    out = as_batch<T>(fn, "out", y);
    require_disjoint(fn, "out", out, "logits", logits);
  }
};

/// kl: two logits of one shape, one output entry a row.
template <class T>
struct kl_args {
  troll::batch_view<const T> p, q;
  T* out = nullptr;

  kl_args(const char* fn, const in_array& pa, const in_array& qa, const out_array& y) {
    require_same_shape(fn, "q_logits", qa, "p_logits", pa);
    p = as_batch<const T>(fn, "p_logits", pa);
    q = as_batch<const T>(fn, "q_logits", qa);
    out = as_rows<T>(fn, "out", y, rows_of("p_logits", pa));
    const auto column = troll::make_batch(out, p.rows == 0 ? 0 : 1, p.rows);
    require_disjoint(fn, "out", column, "p_logits", p);
    require_disjoint(fn, "out", column, "q_logits", q);
  }
};

/// kl_backward: two logits of one shape, the upstream gradient one entry a row, the wanted
/// gradients (either may be absent: an empty view) of that shape, not overlapping the inputs.
template <class T>
struct kl_backward_args {
  troll::batch_view<const T> p, q;
  const T* grad_kl = nullptr;
  troll::batch_view<T> grad_p{}, grad_q{};

  kl_backward_args(const char* fn, const in_array& pa, const in_array& qa, const in_array& g,
                   const std::optional<out_array>& gp, const std::optional<out_array>& gq) {
    require_same_shape(fn, "q_logits", qa, "p_logits", pa);
    p = as_batch<const T>(fn, "p_logits", pa);
    q = as_batch<const T>(fn, "q_logits", qa);
    grad_kl = as_rows<const T>(fn, "grad_kl", g, rows_of("p_logits", pa));
    if (gp) {
      require_same_shape(fn, "grad_p", *gp, "p_logits", pa);
      grad_p = as_batch<T>(fn, "grad_p", *gp);
      require_disjoint(fn, "grad_p", grad_p, "p_logits", p);
      require_disjoint(fn, "grad_p", grad_p, "q_logits", q);
    }
    if (gq) {
      require_same_shape(fn, "grad_q", *gq, "p_logits", pa);
      grad_q = as_batch<T>(fn, "grad_q", *gq);
      require_disjoint(fn, "grad_q", grad_q, "p_logits", p);
      require_disjoint(fn, "grad_q", grad_q, "q_logits", q);
    }
  }
};

/// project: new and old logits of one shape, the log-probabilities out of that shape.
template <class T>
struct project_args {
  troll::batch_view<const T> new_logits, old_logits;
  troll::batch_view<T> out;

  project_args(const char* fn, const in_array& n, const in_array& o, const out_array& y) {
    require_same_shape(fn, "old_logits", o, "new_logits", n);
    require_same_shape(fn, "out", y, "new_logits", n);
    new_logits = as_batch<const T>(fn, "new_logits", n);
    old_logits = as_batch<const T>(fn, "old_logits", o);
    out = as_batch<T>(fn, "out", y);
    require_disjoint(fn, "out", out, "new_logits", new_logits);
    require_disjoint(fn, "out", out, "old_logits", old_logits);
  }
};

/// The solver settings every project binding takes.
inline troll::projection_options projection_settings(double rtol, double atol, int max_iterations) {
  troll::projection_options options;
  options.rtol = rtol;
  options.atol = atol;
  options.max_iterations = max_iterations;
  return options;
}

/// project_backward: four inputs of one shape, grad_new (and grad_old) of that shape, grad_eps one
/// entry a row; no gradient overlaps an input or another gradient. The statistics are read by each
/// module (host vector or packed device buffers).
template <class T>
struct project_backward_args {
  troll::batch_view<const T> new_logits, old_logits, log_probs, grad_log_probs;
  troll::batch_view<T> grad_new, grad_old{};
  T* grad_eps = nullptr;

  project_backward_args(const char* fn, const in_array& n, const in_array& o, const in_array& lp,
                        const in_array& g, const out_array& gn, const std::optional<out_array>& go,
                        const std::optional<out_array>& ge) {
    for (const in_array* a : {&o, &lp, &g}) require_same_shape(fn, "an input", *a, "new_logits", n);
    require_same_shape(fn, "grad_new", gn, "new_logits", n);
    new_logits = as_batch<const T>(fn, "new_logits", n);
    old_logits = as_batch<const T>(fn, "old_logits", o);
    log_probs = as_batch<const T>(fn, "log_probs", lp);
    grad_log_probs = as_batch<const T>(fn, "grad_log_probs", g);
    grad_new = as_batch<T>(fn, "grad_new", gn);
    if (go) {
      require_same_shape(fn, "grad_old", *go, "new_logits", n);
      grad_old = as_batch<T>(fn, "grad_old", *go);
    }
    if (ge) grad_eps = as_rows<T>(fn, "grad_eps", *ge, rows_of("new_logits", n));
    for (const troll::batch_view<T>* out : {&grad_new, &grad_old}) {
      require_disjoint(fn, "a gradient", *out, "new_logits", new_logits);
      require_disjoint(fn, "a gradient", *out, "old_logits", old_logits);
      require_disjoint(fn, "a gradient", *out, "log_probs", log_probs);
      require_disjoint(fn, "a gradient", *out, "grad_log_probs", grad_log_probs);
    }
    require_disjoint(fn, "grad_old", grad_old, "grad_new", grad_new);
  }
};

}  // namespace troll_py
