// troll/objectives.hpp — training objectives over a batch of sampled tokens (math.md §5): TROLL's
// trust-region objective with its fused backward, and the baselines it replaces, PPO clip and
// DPPO. Every objective is returned as a loss (−objective, to be minimised), aggregated over the
// batch by token mean or sequence mean, with per-batch metrics.
//
//   TROLL      ℓ = −(π*_a / q_a)·A + α·KL(p̃ ‖ stopgrad(π*)),   π* = project(p̃, q, ε)
//   PPO clip   ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)  [dual clip: −max(·, c·A), A < 0]
//   DPPO       ℓ = −M·r·A,  M = 0 when the divergence of the update exceeds δ in the direction
//              the advantage pushes it (binary TV / binary KL / top-K TV / top-K KL)
//
// with r = p̃_a / q_a, p̃ = softmax(new logits), q = softmax(old logits), a the sampled token.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "backward.hpp"
#include "batch.hpp"
#include "config.hpp"
#include "detail/cpu/objective_kernels.hpp"
#include "detail/cpu/objective_scratch.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "detail/objective_arguments.hpp"
#include "detail/objective_row.hpp"
#include "detail/row_problem.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "objective_types.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// The per-row part of the checks shared by every objective: mask, token, advantage, sequence
/// order, the old logit at the sampled token (skipped when `old_row` is null: sparse old rows
/// check their own entry). Logit rows are checked by the caller.
template <class T>
row_problem check_token_row(const token_batch<T>& in, std::size_t r, std::size_t size,
                                  const T* old_row) {
  row_problem p;
  using k = row_error;
  if (in.aggregation == loss_aggregation::sequence_mean && r > 0 &&
      in.sequence_ids[r] < in.sequence_ids[r - 1]) {
    p.kind = k::sequence_order;
    p.value = double(in.sequence_ids[r]);
    return p;
  }
  const double w = in.loss_mask ? static_cast<double>(in.loss_mask[r]) : 1.0;
  if (!(w >= 0.0 && w < inf())) {
    p.kind = k::bad_mask;
    p.value = w;
    return p;
  }
  if (w == 0.0) return p;
  const std::int64_t a = in.tokens[r];
  if (a < 0 || std::uint64_t(a) >= size) {
    p.kind = k::token_range;
    p.value = double(a);
    return p;
  }
  const double adv = static_cast<double>(in.advantages[r]);
  if (!(adv - adv == 0.0)) {
    p.kind = k::bad_advantage;
    p.value = adv;
    return p;
  }
  if (old_row != nullptr && is_masked(static_cast<double>(old_row[a]))) {
    p.kind = k::old_token_masked;
    p.value = double(a);
  }
  return p;
}

/// The aggregation weights c_r (times `scale`) of every row, and the number of counted sequences.
template <class T>
void aggregation_weights(const token_batch<T>& in, std::size_t rows, double scale, std::size_t* sequences,
                         double* c) {
  for (std::size_t r = 0; r < rows; ++r) c[r] = 0.0;
  auto mask = [&](std::size_t r) {  // counted_weight: as the CUDA backend (validated rows: the mask)
    return in.loss_mask ? counted_weight(static_cast<double>(in.loss_mask[r])) : 1.0;
  };
  if (sequences) *sequences = 0;
  if (in.aggregation == loss_aggregation::token_mean) {
    double total = 0.0;
    for (std::size_t r = 0; r < rows; ++r) total += mask(r);
    if (total > 0.0)
      for (std::size_t r = 0; r < rows; ++r) c[r] = scale * mask(r) / total;
    return;
  }
  std::size_t counted = 0;
  for (std::size_t begin = 0, end; begin < rows; begin = end) {
    end = begin;
    while (end < rows && in.sequence_ids[end] == in.sequence_ids[begin]) ++end;
    double total = 0.0;
    for (std::size_t r = begin; r < end; ++r) total += mask(r);
    if (!(total > 0.0)) continue;
    ++counted;
    for (std::size_t r = begin; r < end; ++r) c[r] = mask(r) / total;
  }
  if (counted > 0)
    for (std::size_t r = 0; r < rows; ++r) c[r] *= scale / double(counted);
  if (sequences) *sequences = counted;
}

/// Validates an objective call row by row (in parallel, the lowest bad row reported). `pair_scan`
/// checks rows as the projection does (values, supports, feasibility at `eps`, and, with
/// `regression`, that KL(p̃‖π*) is finite); otherwise each row only needs values and some support.
template <class T>
void validate_objective(const char* fn, unsigned threads, batch_view<const T> new_logits,
                        batch_view<const T> old_logits, const token_batch<T>& in, bool pair_scan,
                        double eps, bool regression) {
  const std::size_t size = new_logits.cols;
  auto problem = [&](std::size_t r) {
    row_problem p = check_token_row(in, r, size, old_logits.row(r));
    if (p) return p;
    if (pair_scan) {
      row_setup setup;
      p = cpu::scan_pair(new_logits.row(r), old_logits.row(r), size, setup, "new_logits",
                          "old_logits");
      if (!p && setup.old_only) {
        const double floor = cpu::min_reachable_kl(new_logits.row(r), old_logits.row(r), size, setup);
        if (floor >= eps) {
          p.kind = row_error::infeasible;
          p.value = floor;
        }
      }
      if (!p && regression && setup.new_only) p.kind = row_error::regression_inf;
    } else {
      const char* names[2] = {"new_logits", "old_logits"};
      const T* rows[2] = {new_logits.row(r), old_logits.row(r)};
      for (int side = 0; side < 2 && !p; ++side) {
        p = cpu::find_bad_value(rows[side], size, names[side]);
        if (!p && cpu::row_max(rows[side], size) == neg_inf()) {
          p.kind = row_error::all_masked;
          p.operand = names[side];
        }
      }
    }
    return p;
  };
  cpu::throw_first_problem(fn, threads, new_logits.rows, 2 * size, problem, &throw_row_problem);
}

/// Reduces per-row results to the batch metrics, in row order (deterministic).
struct metrics_sum {
  objective_metrics m;
  double kl_before = 0, kl_after = 0, reg = 0, ratio = 0, eta = 0, limited = 0, projected = 0,
         divergence = 0;
  void add(double loss_contribution, double ratio_value, double kb, double ka) {
    m.loss += loss_contribution;
    ++m.tokens;
    ratio += ratio_value;
    kl_before += kb;
    kl_after += ka;
    m.kl_before_max = maximum(m.kl_before_max, kb);
    m.kl_after_max = maximum(m.kl_after_max, ka);
  }
  objective_metrics finish() {
    if (m.tokens == 0) return m;
    const double n = double(m.tokens);
    m.ratio_mean = ratio / n;
    m.kl_before_mean = kl_before / n;
    m.kl_after_mean = kl_after / n;
    m.regression_kl_mean = reg / n;
    m.eta_mean = eta / n;
    m.projected_fraction = projected / n;
    m.limited_fraction = limited / n;
    m.divergence_mean = divergence / n;
    return m;
  }
};

/// The end of TROLL's forward on both row layouts (dense, sparse): the weighted losses c·ℓ are
/// checked (`throw_problem(r, p)` for the lowest row that does not fit) before any token loss is
/// written, then `token_loss` (when given) and the metrics, in row order.
template <class T, class Throw>
objective_metrics finish_troll_forward(const token_batch<T>& in, std::size_t rows, const double* c,
                                       const cpu::troll_row_result* results, T* token_loss, metrics_sum sum,
                                       Throw throw_problem) {
  auto counted = [&](std::size_t r) { return (in.loss_mask ? static_cast<double>(in.loss_mask[r]) : 1.0) != 0.0; };
  for (std::size_t r = 0; r < rows; ++r) {
    if (!counted(r)) continue;
    const row_problem p =
        check_token_result<T>(results[r].ratio, results[r].log_ratio, results[r].loss, c[r], in.tokens[r]);
    if (p) throw_problem(r, p);
  }
  for (std::size_t r = 0; r < rows; ++r) {
    if (token_loss) token_loss[r] = T(counted(r) ? results[r].loss : 0.0);
    if (!counted(r)) continue;
    const cpu::troll_row_result& x = results[r];
    sum.add(c[r] * x.loss, x.ratio, x.stats.kl_before, x.stats.kl_after);
    sum.reg += x.kl_reg;
    sum.eta += x.stats.active() ? x.stats.eta : 0.0;
    sum.projected += x.stats.active() ? 1.0 : 0.0;
  }
  return sum.finish();
}

template <class T>
objective_metrics ratio_forward(const char* fn, cpu_policy policy, const cpu::ratio_objective_spec& spec,
                                batch_view<const T> new_logits, batch_view<const T> old_logits,
                                const token_batch<T>& in, T* token_loss) {
  check_objective_shapes(fn, new_logits, old_logits, in);
  validate_objective(fn, policy.threads, new_logits, old_logits, in, false, 0.0, false);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const cpu::carved_scratch<cpu::ratio_forward_scratch> scratch(fn, policy.workspace, rows, 0);
  const double* c = scratch.parts.weights;
  cpu::ratio_row_result* results = scratch.parts.records;
  unsigned char* counted = scratch.parts.flags;
  metrics_sum sum;
  aggregation_weights(in, rows, 1.0, &sum.m.sequences, scratch.parts.weights);
  cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    const double w = in.loss_mask ? static_cast<double>(in.loss_mask[r]) : 1.0;
    if (w == 0.0) return;
    counted[r] = 1;
    results[r] = cpu::ratio_forward_row(new_logits.row(r), old_logits.row(r), size, spec,
                                        in.tokens[r], static_cast<double>(in.advantages[r]));
  });
  for (std::size_t r = 0; r < rows; ++r) {
    if (!counted[r]) continue;
    const row_problem p = check_token_result<T>(results[r].ratio, results[r].log_ratio,
                                                      results[r].token.loss, c[r], in.tokens[r]);
    if (p) throw_row_problem(fn, r, p);
  }
  for (std::size_t r = 0; r < rows; ++r) {
    if (token_loss) token_loss[r] = T(counted[r] ? results[r].token.loss : 0.0);
    if (!counted[r]) continue;
    const cpu::ratio_row_result& x = results[r];
    sum.add(c[r] * x.token.loss, x.ratio, x.kl, x.kl);
    sum.limited += x.token.limited ? 1.0 : 0.0;
    sum.divergence += x.divergence;
  }
  return sum.finish();
}

template <class T>
void ratio_backward(const char* fn, cpu_policy policy, cpu::ratio_objective_spec spec,
                    batch_view<const T> new_logits, batch_view<const T> old_logits,
                    const token_batch<T>& in, batch_view<T> grad_new, double grad_loss) {
  check_ratio_backward_arguments<T>(fn, new_logits, old_logits, in, grad_new, grad_loss);
  validate_objective(fn, policy.threads, new_logits, old_logits, in, false, 0.0, false);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const cpu::carved_scratch<cpu::ratio_backward_scratch> scratch(fn, policy.workspace, rows, 2 * rows);
  const double* c = scratch.parts.weights;
  double* coef = scratch.parts.extra;
  double* log_norm_new = scratch.parts.extra + rows;
  row_problem* problems = scratch.parts.records;
  aggregation_weights(in, rows, grad_loss, nullptr, scratch.parts.weights);
  spec.compute_kl = false;
  // Every row's coefficient c·(∂ℓ/∂r)·r first: a row whose gradient overflows T is reported
  // before anything is written (the entries are bounded by |coef|).
  cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    if (c[r] == 0.0) return;
    const std::int64_t token = in.tokens[r];
    const T* zn = new_logits.row(r);
    const cpu::ratio_row_result x = cpu::ratio_forward_row(
        zn, old_logits.row(r), size, spec, token, static_cast<double>(in.advantages[r]));
    coef[r] = c[r] * x.token.dloss_dr * x.ratio;
    problems[r] = check_token_gradient<T>(x.ratio, x.log_ratio, coef[r], token);
    if (coef[r] != 0.0) log_norm_new[r] = cpu::log_normaliser(zn, size);
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (problems[r]) throw_row_problem(fn, r, problems[r]);
  cpu::parallel_for(policy.threads, rows, 2 * size, [&](std::size_t r) {
    cpu::ratio_backward_row(new_logits.row(r), size, log_norm_new[r], coef[r],
                            coef[r] != 0.0 ? in.tokens[r] : 0, grad_new.row(r));
  });
}

}  // namespace detail

// ---- TROLL ----

/// Forward of TROLL's objective. Projects every row (log π* to `log_probs`, statistics to
/// `stats`, N entries — both kept for objective_backward), evaluates the per-token losses
///   ℓ_r = −(π*_{r,a} / q_{r,a}) A_r + α KL(p̃_r ‖ π*_r),
/// aggregates them (token_batch::aggregation) and returns the loss with the batch metrics.
/// `token_loss` (optional, N entries) receives ℓ_r (0 on rows with mask 0).
/// Throws before writing anything: shape_error, domain_error (NaN / +inf logits, a token outside
/// [0, V), a non-finite advantage, a negative or non-finite mask, decreasing sequence ids, a
/// sampled token the old logits mask, a row whose new logits have mass where the old ones mask
/// while α > 0, bad ε / α / options) and infeasible_error, each naming the row.
template <class T>
objective_metrics objective_forward(cpu_policy policy, const trust_region_objective& objective,
                                    input_view<T> new_logits, input_view<T> old_logits,
                                    const token_batch<T>& in, batch_view<T> log_probs,
                                    projection_stats* stats, T* token_loss = nullptr) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_forward";
  detail::check_troll_forward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats);
  detail::validate_objective(fn, policy.threads, new_logits, old_logits, in, true, objective.eps,
                             objective.alpha > 0.0);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::troll_forward_scratch<T>> scratch(fn, policy.workspace, rows,
                                                                                    size);
  const detail::cpu::troll_forward_scratch<T>& ws = scratch.parts;
  // A counted token far in the old row's tail (−log q_a ≤ max z° − z°_a + log V) is projected
  // once into the scratch row first (one such row at a time, in row order), so that a ratio or
  // loss that overflows is reported before anything is written.
  detail::cpu::parallel_for(policy.threads, rows, size, [&](std::size_t r) {
    if ((in.loss_mask ? static_cast<double>(in.loss_mask[r]) : 1.0) == 0.0) return;
    const T* zo = old_logits.row(r);
    const double bound = detail::cpu::row_max(zo, size) - static_cast<double>(zo[in.tokens[r]]) +
                         std::log(double(size));
    ws.flags[r] = detail::ratio_may_overflow<T>(bound, static_cast<double>(in.advantages[r]));
  });
  for (std::size_t r = 0; r < rows; ++r) {
    if (!ws.flags[r]) continue;
    const std::int64_t a = in.tokens[r];
    const detail::cpu::troll_row_result x = detail::cpu::troll_forward_row(
        new_logits.row(r), old_logits.row(r), size, objective.eps, objective.projection, true, a,
        static_cast<double>(in.advantages[r]), objective.alpha, ws.extra);
    const detail::row_problem p = detail::check_token_result<T>(x.ratio, x.log_ratio, x.loss, 1.0, a);
    if (p) detail::throw_row_problem(fn, r, p);
  }

  detail::metrics_sum sum;
  detail::aggregation_weights(in, rows, 1.0, &sum.m.sequences, ws.weights);
  detail::cpu::parallel_for(policy.threads, rows, 12 * size, [&](std::size_t r) {
    const double w = in.loss_mask ? static_cast<double>(in.loss_mask[r]) : 1.0;
    const bool counted = w != 0.0;
    ws.records[r] = detail::cpu::troll_forward_row(
        new_logits.row(r), old_logits.row(r), size, objective.eps, objective.projection, counted,
        counted ? in.tokens[r] : 0, counted ? static_cast<double>(in.advantages[r]) : 0.0,
        objective.alpha, log_probs.row(r));
    stats[r] = ws.records[r].stats;
  });
  return detail::finish_troll_forward(in, rows, ws.weights, ws.records, token_loss, sum,
                                      [&](std::size_t r, const detail::row_problem& p) {
                                        detail::throw_row_problem(fn, r, p);
                                      });
}

/// The same forward with the result written to `*metrics` (host memory): the argument list of the
/// CUDA overload, so one call serves both policies. Throws shape_error for a null `metrics`.
template <class T>
void objective_forward(cpu_policy policy, const trust_region_objective& objective, input_view<T> new_logits,
                       input_view<T> old_logits, const token_batch<T>& in, batch_view<T> log_probs,
                       projection_stats* stats, typename detail::identity<T>::type* token_loss,
                       objective_metrics* metrics) {
  if (metrics == nullptr) detail::throw_shape("objective_forward", "metrics is a null pointer");
  *metrics = objective_forward(policy, objective, new_logits, old_logits, in, log_probs, stats, token_loss);
}

/// Fused backward of TROLL's objective: grad_new = grad_loss · ∂L/∂z̃ for the loss L of
/// objective_forward, through the projection's VJP (ratio term) and the regression term's
/// gradient w.r.t. p̃ only (π* held constant), in one pass per row:
///   ∂ℓ/∂z̃_j = −ρA·t [δ_ja − π*_j − π*_j (d_j − μ)(d_a − μ)/σ²] + α p̃_j (log p̃_j − log π*_j − KL(p̃‖π*)).
/// `log_probs` and `stats` are objective_forward's outputs for the same inputs. Rows with mask 0
/// get zero gradients. Throws as objective_forward does, and domain_error for log_probs NaN, +inf,
/// above 0 or finite where a logit is −inf, unusable stats or a non-finite grad_loss, before
/// writing.
template <class T>
void objective_backward(cpu_policy policy, const trust_region_objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                        input_view<T> log_probs, const projection_stats* stats,
                        batch_view<T> grad_new, double grad_loss = 1.0) {
  detail::require_float_type<T>();
  constexpr const char* fn = "objective_backward";
  detail::check_troll_backward_arguments<T>(fn, objective, new_logits, old_logits, in, log_probs, stats,
                                            grad_new, grad_loss);
  detail::validate_objective(fn, policy.threads, new_logits, old_logits, in, true, objective.eps,
                             objective.alpha > 0.0);
  const std::size_t bad_log_probs =
      detail::cpu::first_bad_row(policy.threads, log_probs.rows, log_probs.cols, [&](std::size_t r) {
        return bool(detail::find_bad_log_prob(log_probs.row(r), new_logits.row(r), old_logits.row(r), log_probs.cols,
                                              "log_probs"));
      });
  if (bad_log_probs != log_probs.rows)
    detail::throw_row_problem(fn, bad_log_probs,
                          detail::find_bad_log_prob(log_probs.row(bad_log_probs), new_logits.row(bad_log_probs),
                                                    old_logits.row(bad_log_probs), log_probs.cols, "log_probs"));
  for (std::size_t r = 0; r < new_logits.rows; ++r) {
    const detail::row_problem p = detail::check_stats(stats[r]);
    if (p) detail::throw_row_problem(fn, r, p);
  }
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const detail::cpu::carved_scratch<detail::cpu::troll_backward_scratch> scratch(fn, policy.workspace, rows, rows);
  const double* c = scratch.parts.weights;
  detail::cpu::troll_backward_plan* plans = scratch.parts.records;
  detail::row_problem* problems = scratch.parts.extra;
  unsigned char* overflowed = scratch.parts.flags;
  detail::aggregation_weights(in, rows, grad_loss, nullptr, scratch.parts.weights);
  // Every row's coefficients first, so that a ratio term that overflows T (the sampled token's
  // entry is about c·A·ρ·t) is reported before anything is written.
  detail::cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    if (c[r] == 0.0) return;
    const std::int64_t token = in.tokens[r];
    plans[r] = detail::cpu::troll_backward_prepare(
        new_logits.row(r), old_logits.row(r), log_probs.row(r), size, stats[r], c[r], token,
        static_cast<double>(in.advantages[r]), objective.alpha);
    problems[r] = detail::check_token_gradient<T>(plans[r].ratio, plans[r].log_ratio, plans[r].ratio_scale(), token);
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (problems[r]) detail::throw_row_problem(fn, r, problems[r]);
  // A last guard: an entry beyond the sampled token's that overflows (a huge regression term or
  // cross term) is reported after the pass; grad_new then holds unspecified values.
  detail::cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    const bool counted = c[r] != 0.0;
    overflowed[r] = !detail::cpu::troll_backward_write(new_logits.row(r), old_logits.row(r),
                                                       log_probs.row(r), size, stats[r],
                                                       counted ? &plans[r] : nullptr,
                                                       counted ? in.tokens[r] : 0, grad_new.row(r));
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (overflowed[r])
      detail::throw_row_problem(
          fn, r, detail::overflow_problem(detail::overflow_operand<T>(detail::overflow_quantity::gradient),
                                   plans[r].log_ratio, in.tokens[r]));
}

// ---- Baselines: PPO clip and DPPO (no projection; the ratio is p̃_a / q_a) ----

/// Forward of a ratio baseline, PPO clip or DPPO (see ppo_clip_objective, dppo_objective; no
/// projection, the ratio is p̃_a / q_a): returns the aggregated loss and the metrics
/// (limited_fraction = clipped (PPO) or masked (DPPO) tokens; divergence_mean = DPPO's mean
/// divergence estimate). `token_loss` (optional, N entries) receives ℓ_r. Throws as
/// objective_forward does (no projection checks), before writing.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
objective_metrics objective_forward(cpu_policy policy, const Objective& objective,
                                    input_view<T> new_logits, input_view<T> old_logits,
                                    const token_batch<T>& in, T* token_loss = nullptr) {
  detail::require_float_type<T>();
  const auto spec = detail::make_spec("objective_forward", objective);
  return detail::ratio_forward("objective_forward", policy, spec, new_logits, old_logits, in, token_loss);
}

/// The same forward with the result written to `*metrics` (host memory), as the CUDA overload.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_forward(cpu_policy policy, const Objective& objective, input_view<T> new_logits,
                       input_view<T> old_logits, const token_batch<T>& in,
                       typename detail::identity<T>::type* token_loss, objective_metrics* metrics) {
  if (metrics == nullptr) detail::throw_shape("objective_forward", "metrics is a null pointer");
  *metrics = objective_forward(policy, objective, new_logits, old_logits, in, token_loss);
}

/// Backward of a ratio baseline: grad_new = grad_loss · ∂L/∂z̃ with
/// ∂ℓ/∂z̃_j = (∂ℓ/∂r)·r·(δ_ja − p̃_j): PPO clip's ∂ℓ/∂r = −A on unclipped tokens and 0 on clipped
/// ones; DPPO's −M·A, the mask M held constant.
template <class T, class Objective, detail::if_ratio_objective<Objective> = 0>
void objective_backward(cpu_policy policy, const Objective& objective,
                        input_view<T> new_logits, input_view<T> old_logits, const token_batch<T>& in,
                        batch_view<T> grad_new, double grad_loss = 1.0) {
  detail::require_float_type<T>();
  const auto spec = detail::make_spec("objective_backward", objective);
  detail::ratio_backward("objective_backward", policy, spec, new_logits, old_logits, in, grad_new,
                         grad_loss);
}

TROLL_END_NAMESPACE
