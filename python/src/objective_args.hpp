// python/src/objective_args.hpp — the arguments of the training objectives as both extension
// modules take them (troll._troll on host arrays, troll._troll_cuda on device arrays: views.hpp's
// device rule differs, nothing here does): the token batch, passed from Python as a tuple
// (tokens, advantages, loss_mask | None, sequence_ids | None, aggregation), and troll's objective
// structs built from the keyword arguments. No maths here.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include <troll/objective_types.hpp>
#include <troll/sparse_objective_types.hpp>

#include "sparse_views.hpp"

namespace troll_py {

/// The token batch of `rows` rows, its arrays held for the call.
template <class T>
struct token_rows {
  in_array tokens, advantages, mask, sequence_ids;
  troll::token_batch<T> batch;

  token_rows(const char* fn, nb::handle h, const rows_shape& rows) {
    const nb::tuple t = as_tuple(fn, "batch", h, 5);
    tokens = item<in_array>(fn, "batch", t, 0);
    advantages = item<in_array>(fn, "batch", t, 1);
    batch.tokens = as_rows<const std::int64_t>(fn, "tokens", tokens, rows);
    batch.advantages = as_rows<const T>(fn, "advantages", advantages, rows);
    if (!t[2].is_none()) {
      mask = item<in_array>(fn, "batch", t, 2);
      batch.loss_mask = as_rows<const T>(fn, "mask", mask, rows);
    }
    if (!t[3].is_none()) {
      sequence_ids = item<in_array>(fn, "batch", t, 3);
      batch.sequence_ids = as_rows<const std::int64_t>(fn, "sequence_ids", sequence_ids, rows);
    }
    const std::string aggregation = nb::cast<std::string>(t[4]);
    if (aggregation == "token_mean") {
      batch.aggregation = troll::loss_aggregation::token_mean;
    } else if (aggregation == "sequence_mean") {
      batch.aggregation = troll::loss_aggregation::sequence_mean;
    } else {
      throw troll::domain_error(std::string("troll.") + fn + ": aggregation must be 'token_mean' or "
                                "'sequence_mean', got '" + aggregation + "'");
    }
  }
};

inline troll::trust_region_objective trust_region(double eps, double alpha, double rtol, double atol,
                                                  int max_iterations) {
  troll::trust_region_objective o;
  o.eps = eps;
  o.alpha = alpha;
  o.projection.rtol = rtol;
  o.projection.atol = atol;
  o.projection.max_iterations = max_iterations;
  return o;
}

inline troll::dppo_divergence divergence_of(const std::string& name) {
  if (name == "binary_tv") return troll::dppo_divergence::binary_tv;
  if (name == "binary_kl") return troll::dppo_divergence::binary_kl;
  if (name == "topk_tv") return troll::dppo_divergence::topk_tv;
  if (name == "topk_kl") return troll::dppo_divergence::topk_kl;
  throw troll::domain_error("troll.dppo_loss: divergence must be binary_tv, binary_kl, topk_tv or "
                            "topk_kl, got '" + name + "'");
}

inline troll::ppo_clip_objective ppo_clip(double clip_low, double clip_high, double dual_clip,
                                          bool kl_metrics) {
  troll::ppo_clip_objective p;
  p.clip_low = clip_low;
  p.clip_high = clip_high;
  p.dual_clip = dual_clip;
  p.kl_metrics = kl_metrics;
  return p;
}

inline troll::dppo_objective dppo(const std::string& divergence, double delta_low, double delta_high,
                                  int top_k, bool kl_metrics) {
  troll::dppo_objective p;
  p.divergence = divergence_of(divergence);
  p.delta_low = delta_low;
  p.delta_high = delta_high;
  p.top_k = top_k;
  p.kl_metrics = kl_metrics;
  return p;
}

inline troll::sparse_trust_region_objective sparse_trust_region(double eps, double alpha, double rtol,
                                                                double atol, int max_iterations,
                                                                int new_k, double new_delta) {
  troll::sparse_trust_region_objective o;
  o.eps = eps;
  o.alpha = alpha;
  o.projection.rtol = rtol;
  o.projection.atol = atol;
  o.projection.max_iterations = max_iterations;
  o.new_support.k = new_k;
  o.new_support.delta = new_delta;
  return o;
}

/// The dense views every dense objective call shares: new and old logits of one shape.
template <class T>
struct dense_pair {
  troll::batch_view<const T> new_logits, old_logits;
  dense_pair(const char* fn, const in_array& n, const in_array& o)
      : new_logits((require_same_shape(fn, "old_logits", o, "new_logits", n),
                    as_batch<const T>(fn, "new_logits", n))),
        old_logits(as_batch<const T>(fn, "old_logits", o)) {}
};

/// A (..., V) gradient output shaped like new_logits and disjoint from the inputs.
template <class T>
troll::batch_view<T> grad_output(const char* fn, const out_array& g, const in_array& n,
                                 const troll::batch_view<const T>& nv) {
  require_same_shape(fn, "grad_new", g, "new_logits", n);
  const auto gv = as_batch<T>(fn, "grad_new", g);
  require_disjoint(fn, "grad_new", gv, "new_logits", nv);
  return gv;
}

/// The optional per-token loss output (None: not wanted), one entry a row.
template <class T>
T* token_loss_out(const char* fn, const std::optional<out_array>& token_loss, const rows_shape& rows) {
  return token_loss ? as_rows<T>(fn, "token_loss", *token_loss, rows) : nullptr;
}

// ---- Each objective entry point's arguments, parsed and checked in order and held for the
// call; the statistics are the module's own (`StatsOut` / `StatsIn`: host vectors or packed
// device buffers), parsed here in their place ----

/// trust_region_forward: dense new and old logits, the token batch, log_probs (the projection's
/// output, shaped as and disjoint from the logits), the statistics, the per-token loss.
template <class T, class StatsOut>
struct trust_region_forward_args {
  dense_pair<T> logits;
  token_rows<T> in;
  troll::batch_view<T> log_probs;
  StatsOut stats;
  T* token_loss;

  trust_region_forward_args(const char* fn, const in_array& n, const in_array& o, nb::handle batch,
                            const out_array& lp, const out_array& values, const out_array& counters,
                            const std::optional<out_array>& tl)
      : logits(fn, n, o),
        in(fn, batch, rows_of("new_logits", n)),
        log_probs(disjoint_from(fn, "log_probs",
                                disjoint_from(fn, "log_probs",
                                              (require_same_shape(fn, "log_probs", lp, "new_logits", n),
                                               as_batch<T>(fn, "log_probs", lp)),
                                              "new_logits", logits.new_logits),
                                "old_logits", logits.old_logits)),
        stats(fn, values, counters, logits.new_logits.rows),
        token_loss(token_loss_out<T>(fn, tl, rows_of("new_logits", n))) {}
};

/// trust_region_backward: as the forward, log_probs an input, grad_new disjoint from every input.
template <class T, class StatsIn>
struct trust_region_backward_args {
  dense_pair<T> logits;
  token_rows<T> in;
  troll::batch_view<const T> log_probs;
  troll::batch_view<T> grad_new;
  StatsIn stats;

  trust_region_backward_args(const char* fn, const in_array& n, const in_array& o, nb::handle batch,
                             const in_array& lp, const in_array& values, const in_array& counters,
                             const out_array& g)
      : logits(fn, n, o),
        in(fn, batch, rows_of("new_logits", n)),
        log_probs((require_same_shape(fn, "log_probs", lp, "new_logits", n), as_batch<const T>(fn, "log_probs", lp))),
        grad_new(disjoint_from(
            fn, "grad_new",
            disjoint_from(fn, "grad_new", grad_output<T>(fn, g, n, logits.new_logits), "old_logits", logits.old_logits),
            "log_probs", log_probs)),
        stats(fn, values, counters, logits.new_logits.rows) {}
};

/// PPO clip and DPPO's forward: dense new and old logits, the token batch, the per-token loss.
template <class T>
struct ratio_forward_args {
  dense_pair<T> logits;
  token_rows<T> in;
  T* token_loss;

  ratio_forward_args(const char* fn, const in_array& n, const in_array& o, nb::handle batch,
                     const std::optional<out_array>& tl)
      : logits(fn, n, o), in(fn, batch, rows_of("new_logits", n)),
        token_loss(token_loss_out<T>(fn, tl, rows_of("new_logits", n))) {}
};

/// Their backward: grad_new disjoint from both logits.
template <class T>
struct ratio_backward_args {
  dense_pair<T> logits;
  token_rows<T> in;
  troll::batch_view<T> grad_new;

  ratio_backward_args(const char* fn, const in_array& n, const in_array& o, nb::handle batch, const out_array& g)
      : logits(fn, n, o),
        in(fn, batch, rows_of("new_logits", n)),
        grad_new(disjoint_from(fn, "grad_new", grad_output<T>(fn, g, n, logits.new_logits), "old_logits",
                               logits.old_logits)) {}
};

/// sparse_trust_region_forward: dense new logits, sparse old rows, the token batch, the aligned
/// rows and projected log_probs (outputs), the statistics, the per-token loss.
template <class T, class StatsOut>
struct sparse_trust_region_forward_args {
  troll::batch_view<const T> new_logits;
  sparse_rows<const T> old;
  token_rows<T> in;
  aligned_rows<T> aligned;
  sparse_rows<T> log_probs;
  StatsOut stats;
  T* token_loss;

  sparse_trust_region_forward_args(const char* fn, const in_array& n, nb::handle old_rows, nb::handle batch,
                                   nb::handle al, nb::handle lp, const out_array& values,
                                   const out_array& counters, const std::optional<out_array>& tl)
      : new_logits(as_batch<const T>(fn, "new_logits", n)),
        old(fn, "old", old_rows),
        in(fn, batch, rows_of("new_logits", n)),
        aligned(fn, "aligned", al),
        log_probs(fn, "log_probs", lp),
        stats(fn, values, counters, new_logits.rows),
        token_loss(token_loss_out<T>(fn, tl, rows_of("new_logits", n))) {
    const rows_shape rows = rows_of("new_logits", n);
    require_same_rows(fn, old.rows, rows);
    require_same_rows(fn, aligned.rows, rows);
    require_same_rows(fn, log_probs.rows, rows);
  }
};

/// sparse_trust_region_backward: the forward's aligned rows and log_probs (inputs), grad_new.
template <class T, class StatsIn>
struct sparse_trust_region_backward_args {
  troll::batch_view<const T> new_logits;
  aligned_rows<const T> aligned;
  token_rows<T> in;
  sparse_rows<const T> log_probs;
  troll::batch_view<T> grad_new;
  StatsIn stats;

  sparse_trust_region_backward_args(const char* fn, const in_array& n, nb::handle al, nb::handle batch,
                                    nb::handle lp, const in_array& values, const in_array& counters,
                                    const out_array& g)
      : new_logits(as_batch<const T>(fn, "new_logits", n)),
        aligned(fn, "aligned", al),
        in(fn, batch, rows_of("new_logits", n)),
        log_probs(fn, "log_probs", lp),
        grad_new(grad_output<T>(fn, g, n, new_logits)),
        stats(fn, values, counters, new_logits.rows) {
    const rows_shape rows = rows_of("new_logits", n);
    require_same_rows(fn, aligned.rows, rows);
    require_same_rows(fn, log_probs.rows, rows);
  }
};

}  // namespace troll_py
