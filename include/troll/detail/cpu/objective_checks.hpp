// troll/detail/cpu/objective_checks.hpp — the dense objectives' row checks (token data, logits, feasibility),
// the aggregation weights, the metrics' sums and the end of TROLL's forward shared by both row
// layouts, kept out of the public <troll/objectives.hpp>. Host-only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "../../backward.hpp"
#include "../../batch.hpp"
#include "../../config.hpp"
#include "objective_kernels.hpp"
#include "objective_scratch.hpp"
#include "parallel.hpp"
#include "row_kernels.hpp"
#include "../objective_arguments.hpp"
#include "../objective_row.hpp"
#include "../row_problem.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../../objective_types.hpp"
#include "../../projection_types.hpp"

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
  const double w = mask_of(in, r);
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
/// Each group's masks are scaled by mask_scale of its largest first, so that masks whose sum
/// overflows (two of 1e308) still give their ratios, as the CUDA backend does.
template <class T>
void aggregation_weights(const token_batch<T>& in, std::size_t rows, double scale, std::size_t* sequences,
                         double* c) {
  for (std::size_t r = 0; r < rows; ++r) c[r] = 0.0;
  auto mask = [&](std::size_t r) {  // counted_weight: as the CUDA backend (validated rows: the mask)
    return counted_weight(mask_of(in, r));
  };
  // Σ s·w over [begin, end) with s = mask_scale(max w), through `s`.
  auto scaled_total = [&](std::size_t begin, std::size_t end, double& s) {
    double largest = 0.0;
    for (std::size_t r = begin; r < end; ++r) largest = maximum(largest, mask(r));
    s = mask_scale(largest);
    double total = 0.0;
    for (std::size_t r = begin; r < end; ++r) total += s * mask(r);
    return total;
  };
  if (sequences) *sequences = 0;
  if (in.aggregation == loss_aggregation::token_mean) {
    double s = 1.0;
    const double total = scaled_total(0, rows, s);
    if (total > 0.0)
      for (std::size_t r = 0; r < rows; ++r) c[r] = scale * (s * mask(r) / total);
    return;
  }
  std::size_t counted = 0;
  for (std::size_t begin = 0, end; begin < rows; begin = end) {
    end = begin;
    while (end < rows && in.sequence_ids[end] == in.sequence_ids[begin]) ++end;
    double s = 1.0;
    const double total = scaled_total(begin, end, s);
    if (!(total > 0.0)) continue;
    ++counted;
    for (std::size_t r = begin; r < end; ++r) c[r] = s * mask(r) / total;
  }
  if (counted > 0)
    for (std::size_t r = 0; r < rows; ++r) c[r] *= scale / double(counted);
  if (sequences) *sequences = counted;
}

/// Finds nothing: validate_objective's default extra check.
struct no_row_check {
  row_problem operator()(std::size_t) const { return row_problem{}; }
};

/// Validates an objective call row by row (in parallel, the lowest bad row reported). `pair_scan`
/// checks rows as the projection does (values, supports, feasibility at `eps`, and, with
/// `regression`, that KL(p̃‖π*) is finite where the mask is not 0); otherwise each row only needs
/// values and some support. `extra(r)`, the caller's own checks of row r's other operands
/// (objective_backward's log_probs and stats), runs after those, in the same row.
template <class T, class Extra = no_row_check>
void validate_objective(const char* fn, unsigned threads, batch_view<const T> new_logits,
                        batch_view<const T> old_logits, const token_batch<T>& in, bool pair_scan,
                        double eps, bool regression, Extra&& extra = Extra{}) {
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
      // A row with mask 0 adds nothing, so an infinite KL(p̃‖π*) there is no problem (padding).
      const bool counted = mask_of(in, r) != 0.0;
      if (!p && regression && counted && setup.new_only) p.kind = row_error::regression_inf;
    } else {
      const char* names[2] = {"new_logits", "old_logits"};
      const T* rows[2] = {new_logits.row(r), old_logits.row(r)};
      for (int side = 0; side < 2 && !p; ++side) p = cpu::logits_row_problem(rows[side], size, names[side]);
    }
    return p ? p : extra(r);
  };
  cpu::throw_first_problem(fn, threads, new_logits.rows, 2 * size, problem, &throw_row_problem);
}

/// Reduces per-row results to the batch metrics, in row order (deterministic).
struct metrics_sum {
  objective_metrics m;
  metric_sum kl_before, kl_after, reg, ratio, eta, divergence;  // means that must not overflow
  double limited = 0, projected = 0;
  void add(double loss_contribution, double ratio_value, double kb, double ka) {
    m.loss += loss_contribution;
    ++m.tokens;
    ratio.add(ratio_value);
    kl_before.add(kb);
    kl_after.add(ka);
    m.kl_before_max = maximum(m.kl_before_max, kb);
    m.kl_after_max = maximum(m.kl_after_max, ka);
  }
  objective_metrics finish() {
    if (m.tokens == 0) return m;
    const double n = double(m.tokens);
    m.ratio_mean = ratio.mean(n);
    m.kl_before_mean = kl_before.mean(n);
    m.kl_after_mean = kl_after.mean(n);
    m.regression_kl_mean = reg.mean(n);
    m.eta_mean = eta.mean(n);
    m.projected_fraction = projected / n;
    m.limited_fraction = limited / n;
    m.divergence_mean = divergence.mean(n);
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
  auto counted = [&](std::size_t r) { return mask_of(in, r) != 0.0; };
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
    sum.reg.add(x.kl_reg);
    sum.eta.add(x.stats.active() ? x.stats.eta : 0.0);
    sum.projected += x.stats.active() ? 1.0 : 0.0;
  }
  return sum.finish();
}

template <class T>
objective_metrics ratio_forward(const char* fn, cpu_policy policy, const cpu::ratio_objective_spec& spec,
                                batch_view<const T> new_logits, batch_view<const T> old_logits,
                                const token_batch<T>& in, T* token_loss) {
  check_objective_shapes(fn, new_logits, old_logits, in);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const cpu::carved_scratch<cpu::ratio_forward_scratch> scratch(fn, policy.workspace, rows, 0);
  validate_objective(fn, policy.threads, new_logits, old_logits, in, false, 0.0, false);
  const double* c = scratch.parts.weights;
  cpu::ratio_row_result* results = scratch.parts.records;
  unsigned char* counted = scratch.parts.flags;
  metrics_sum sum;
  aggregation_weights(in, rows, 1.0, &sum.m.sequences, scratch.parts.weights);
  cpu::parallel_for(policy.threads, rows, 4 * size, [&](std::size_t r) {
    const double w = mask_of(in, r);
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
    sum.divergence.add(x.divergence);
  }
  return sum.finish();
}

template <class T>
void ratio_backward(const char* fn, cpu_policy policy, cpu::ratio_objective_spec spec,
                    batch_view<const T> new_logits, batch_view<const T> old_logits,
                    const token_batch<T>& in, batch_view<T> grad_new, double grad_loss) {
  check_ratio_backward_arguments<T>(fn, new_logits, old_logits, in, grad_new, grad_loss);
  const std::size_t rows = new_logits.rows, size = new_logits.cols;
  const cpu::carved_scratch<cpu::ratio_backward_scratch> scratch(fn, policy.workspace, rows, 3 * rows);
  validate_objective(fn, policy.threads, new_logits, old_logits, in, false, 0.0, false);
  const double* c = scratch.parts.weights;
  double* coef = scratch.parts.extra;
  double* norm_max = scratch.parts.extra + rows;  // the new rows' log-normalisers, in two parts
  double* norm_log_sum = scratch.parts.extra + 2 * rows;
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
    if (coef[r] != 0.0) {
      const cpu::log_normaliser_parts n = cpu::log_normaliser(zn, size);
      norm_max[r] = n.max;
      norm_log_sum[r] = n.log_sum;
    }
  });
  for (std::size_t r = 0; r < rows; ++r)
    if (problems[r]) throw_row_problem(fn, r, problems[r]);
  cpu::parallel_for(policy.threads, rows, 2 * size, [&](std::size_t r) {
    cpu::log_normaliser_parts n;
    if (coef[r] != 0.0) n = {norm_max[r], norm_log_sum[r]};
    cpu::ratio_backward_row(new_logits.row(r), size, n, coef[r],
                            coef[r] != 0.0 ? in.tokens[r] : 0, grad_new.row(r));
  });
}

}  // namespace detail

TROLL_END_NAMESPACE
