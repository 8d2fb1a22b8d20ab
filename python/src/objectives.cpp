// python/src/objectives.cpp — troll's training objectives (docs/objectives.md) for Python:
// TROLL's trust-region loss against dense or sparse old rows, PPO clip and DPPO, each a forward
// that returns the aggregated loss with its metrics and a fused backward to the new logits.
// The token batch travels as a tuple (tokens, advantages, loss_mask | None, sequence_ids | None,
// aggregation) and sparse rows as in sparse.cpp.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "objective_args.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

nb::dict metrics_dict(const troll::objective_metrics& m) {
  nb::dict d;
  d["loss"] = m.loss;
  d["tokens"] = m.tokens;
  d["sequences"] = m.sequences;
  d["ratio_mean"] = m.ratio_mean;
  d["kl_before_mean"] = m.kl_before_mean;
  d["kl_before_max"] = m.kl_before_max;
  d["kl_after_mean"] = m.kl_after_mean;
  d["kl_after_max"] = m.kl_after_max;
  d["regression_kl_mean"] = m.regression_kl_mean;
  d["projected_fraction"] = m.projected_fraction;
  d["eta_mean"] = m.eta_mean;
  d["limited_fraction"] = m.limited_fraction;
  d["divergence_mean"] = m.divergence_mean;
  return d;
}

/// Calls `body` with T the dtype of `probe` and returns its metrics as a dict.
template <class F>
nb::dict with_metrics(const char* fn, const in_array& probe, F&& body) {
  troll::objective_metrics m;
  dispatch_float(fn, "new_logits", probe, [&](auto tag) { m = body(tag); });
  return metrics_dict(m);
}

nb::dict trust_region_forward(const in_array& n, const in_array& o, nb::handle batch, double eps,
                              double alpha, double rtol, double atol, int max_iterations,
                              const out_array& log_probs, const out_array& stats_values,
                              const out_array& stats_counters,
                              const std::optional<out_array>& token_loss, unsigned threads) {
  constexpr const char* fn = "trust_region_loss";
  return with_metrics(fn, n, [&](auto tag) {
    const trust_region_forward_args<decltype(tag), stats_out> a(fn, n, o, batch, log_probs, stats_values,
                                                                stats_counters, token_loss);
    std::vector<troll::projection_stats> stats(a.logits.new_logits.rows);
    troll::objective_metrics m;
    {
      nb::gil_scoped_release release;
      m = troll::objective_forward(policy(threads), trust_region(eps, alpha, rtol, atol, max_iterations),
                                   a.logits.new_logits, a.logits.old_logits, a.in.batch, a.log_probs,
                                   stats.data(), a.token_loss);
    }
    a.stats.write(stats);
    return m;
  });
}

void trust_region_backward(const in_array& n, const in_array& o, nb::handle batch, double eps,
                           double alpha, double rtol, double atol, int max_iterations,
                           const in_array& log_probs, const in_array& stats_values,
                           const in_array& stats_counters, const out_array& grad_new,
                           double grad_loss, unsigned threads) {
  constexpr const char* fn = "trust_region_loss_backward";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    const trust_region_backward_args<decltype(tag), stats_in> a(fn, n, o, batch, log_probs, stats_values,
                                                                stats_counters, grad_new);
    nb::gil_scoped_release release;
    troll::objective_backward(policy(threads), trust_region(eps, alpha, rtol, atol, max_iterations),
                              a.logits.new_logits, a.logits.old_logits, a.in.batch, a.log_probs,
                              a.stats.data(), a.grad_new, grad_loss);
  });
}

/// PPO clip and DPPO share one forward and one backward: `objective` is built per call.
template <class Objective>
nb::dict ratio_forward(const char* fn, const Objective& objective, const in_array& n,
                       const in_array& o, nb::handle batch,
                       const std::optional<out_array>& token_loss, unsigned threads) {
  return with_metrics(fn, n, [&](auto tag) {
    const ratio_forward_args<decltype(tag)> a(fn, n, o, batch, token_loss);
    nb::gil_scoped_release release;
    return troll::objective_forward(policy(threads), objective, a.logits.new_logits,
                                    a.logits.old_logits, a.in.batch, a.token_loss);
  });
}

template <class Objective>
void ratio_backward(const char* fn, const Objective& objective, const in_array& n,
                    const in_array& o, nb::handle batch, const out_array& grad_new,
                    double grad_loss, unsigned threads) {
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    const ratio_backward_args<decltype(tag)> a(fn, n, o, batch, grad_new);
    nb::gil_scoped_release release;
    troll::objective_backward(policy(threads), objective, a.logits.new_logits, a.logits.old_logits,
                              a.in.batch, a.grad_new, grad_loss);
  });
}

nb::dict sparse_trust_region_forward(const in_array& n, nb::handle old_rows, nb::handle batch,
                                     double eps, double alpha, double rtol, double atol,
                                     int max_iterations, int new_k, double new_delta,
                                     nb::handle aligned, nb::handle log_probs,
                                     const out_array& stats_values, const out_array& stats_counters,
                                     const std::optional<out_array>& token_loss, unsigned threads) {
  constexpr const char* fn = "trust_region_loss";
  return with_metrics(fn, n, [&](auto tag) {
    const sparse_trust_region_forward_args<decltype(tag), stats_out> a(
        fn, n, old_rows, batch, aligned, log_probs, stats_values, stats_counters, token_loss);
    std::vector<troll::projection_stats> stats(a.new_logits.rows);
    troll::objective_metrics m;
    {
      nb::gil_scoped_release release;
      m = troll::objective_forward(
          policy(threads), sparse_trust_region(eps, alpha, rtol, atol, max_iterations, new_k, new_delta),
          a.new_logits, a.old.view, a.in.batch, a.aligned.view, a.log_probs.view, stats.data(),
          a.token_loss);
    }
    a.stats.write(stats);
    return m;
  });
}

void sparse_trust_region_backward(const in_array& n, nb::handle aligned, nb::handle batch,
                                  double eps, double alpha, double rtol, double atol,
                                  int max_iterations, int new_k, double new_delta,
                                  nb::handle log_probs, const in_array& stats_values,
                                  const in_array& stats_counters, const out_array& grad_new,
                                  double grad_loss, unsigned threads) {
  constexpr const char* fn = "trust_region_loss_backward";
  dispatch_float(fn, "new_logits", n, [&](auto tag) {
    const sparse_trust_region_backward_args<decltype(tag), stats_in> a(
        fn, n, aligned, batch, log_probs, stats_values, stats_counters, grad_new);
    nb::gil_scoped_release release;
    troll::objective_backward(
        policy(threads), sparse_trust_region(eps, alpha, rtol, atol, max_iterations, new_k, new_delta),
        a.new_logits, a.aligned.view, a.in.batch, a.log_probs.view, a.stats.data(), a.grad_new,
        grad_loss);
  });
}

}  // namespace

void bind_objectives(nb::module_& m) {
  using namespace nb::literals;
  m.def("trust_region_forward", &trust_region_forward, "new_logits"_a, "old_logits"_a, "batch"_a,
        "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "token_loss"_a.none(), "threads"_a = 0,
        "TROLL's objective against dense old logits: the loss and metrics (a dict).");
  m.def("trust_region_backward", &trust_region_backward, "new_logits"_a, "old_logits"_a, "batch"_a,
        "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad_new"_a, "grad_loss"_a, "threads"_a = 0,
        "The fused backward of trust_region_forward to the new logits.");
  m.def("sparse_trust_region_forward", &sparse_trust_region_forward, "new_logits"_a, "old"_a,
        "batch"_a, "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a, "new_k"_a,
        "new_delta"_a, "aligned"_a, "log_probs"_a, "stats_values"_a, "stats_counters"_a,
        "token_loss"_a.none(), "threads"_a = 0,
        "TROLL's objective against sparse old rows: the loss and metrics (a dict).");
  m.def("sparse_trust_region_backward", &sparse_trust_region_backward, "new_logits"_a,
        "aligned"_a, "batch"_a, "eps"_a, "alpha"_a, "rtol"_a, "atol"_a, "max_iterations"_a,
        "new_k"_a, "new_delta"_a, "log_probs"_a, "stats_values"_a, "stats_counters"_a,
        "grad_new"_a, "grad_loss"_a, "threads"_a = 0,
        "The fused backward of sparse_trust_region_forward to the dense new logits.");
  m.def(
      "ppo_clip_forward",
      [](const in_array& n, const in_array& o, nb::handle batch, double clip_low, double clip_high,
         double dual_clip, bool kl_metrics, const std::optional<out_array>& token_loss,
         unsigned threads) {
        return ratio_forward("ppo_clip_loss", ppo_clip(clip_low, clip_high, dual_clip, kl_metrics),
                             n, o, batch, token_loss, threads);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "clip_low"_a, "clip_high"_a, "dual_clip"_a,
      "kl_metrics"_a, "token_loss"_a.none(), "threads"_a = 0, "PPO's clipped surrogate loss.");
  m.def(
      "ppo_clip_backward",
      [](const in_array& n, const in_array& o, nb::handle batch, double clip_low, double clip_high,
         double dual_clip, const out_array& grad_new, double grad_loss, unsigned threads) {
        ratio_backward("ppo_clip_loss_backward", ppo_clip(clip_low, clip_high, dual_clip, false),
                       n, o, batch, grad_new, grad_loss, threads);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "clip_low"_a, "clip_high"_a, "dual_clip"_a,
      "grad_new"_a, "grad_loss"_a, "threads"_a = 0, "Backward of ppo_clip_forward.");
  m.def(
      "dppo_forward",
      [](const in_array& n, const in_array& o, nb::handle batch, const std::string& divergence,
         double delta_low, double delta_high, int top_k, bool kl_metrics,
         const std::optional<out_array>& token_loss, unsigned threads) {
        return ratio_forward("dppo_loss", dppo(divergence, delta_low, delta_high, top_k, kl_metrics),
                             n, o, batch, token_loss, threads);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "divergence"_a, "delta_low"_a, "delta_high"_a,
      "top_k"_a, "kl_metrics"_a, "token_loss"_a.none(), "threads"_a = 0,
      "DPPO's masked surrogate loss.");
  m.def(
      "dppo_backward",
      [](const in_array& n, const in_array& o, nb::handle batch, const std::string& divergence,
         double delta_low, double delta_high, int top_k, const out_array& grad_new,
         double grad_loss, unsigned threads) {
        ratio_backward("dppo_loss_backward", dppo(divergence, delta_low, delta_high, top_k, false),
                       n, o, batch, grad_new, grad_loss, threads);
      },
      "new_logits"_a, "old_logits"_a, "batch"_a, "divergence"_a, "delta_low"_a, "delta_high"_a,
      "top_k"_a, "grad_new"_a, "grad_loss"_a, "threads"_a = 0, "Backward of dppo_forward.");
}

}  // namespace troll_py
