// troll/detail/cpu/objective_kernels.hpp — the CPU backend's per-row passes of the training
// objectives: TROLL's fused forward (projection, ratio, regression KL) and backward, and the
// ratio-based baselines (PPO clip, DPPO). Block-vectorised with Eigen like row_kernels.hpp; the
// scalar maths and the gradient coefficients come from detail/objective_row.hpp.
#pragma once

#include "eigen.hpp"
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../numeric.hpp"
#include "../objective_row.hpp"
#include "backward_kernels.hpp"
#include "offset_rows.hpp"
#include "objective_records.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// log Σ_i exp(z_i) of a row with at least one finite entry, as its two parts
/// (log_normaliser_parts, objective_records.hpp).
template <class T>
inline log_normaliser_parts log_normaliser(const T* z, std::size_t size) {
  log_normaliser_parts n;
  n.max = row_max(z, size);
  n.log_sum = log_sum_exp_shifted(z, size, n.max);
  return n;
}

/// KL(p̃ ‖ π) = Σ_j p̃_j (log p̃_j − log π_j) from new logits (normaliser `norm_new`) and a
/// row of log-probabilities; +inf when p̃ has mass where π has none.
template <class T>
inline double kl_logits_to_log_probs(const T* zn, const log_normaliser_parts& norm_new, const T* log_pi,
                                     std::size_t size) {
  double sum = 0.0;
  bool infinite = false;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array lp_new = (load(zn, begin, count) - norm_new.max) - norm_new.log_sum;
    const block_array lp = load(log_pi, begin, count);
    const block_array term = block_exp(lp_new) * (lp_new - lp);
    // NaN only where p̃_j = 0 (0·(−inf − log π_j)) or p̃_j > 0 = π_j; a NaN term makes the
    // (vectorised) block sum NaN, and only then is the block walked term by term.
    const double block_sum = term.sum();
    if (block_sum == block_sum) {
      sum += block_sum;
      return;
    }
    for (Eigen::Index j = 0; j < count; ++j) {
      if (!(lp_new[j] > neg_inf())) continue;
      if (!(lp[j] > neg_inf())) infinite = true;
      sum += term[j];
    }
  });
  return infinite ? inf() : maximum(sum, 0.0);
}


/// TROLL's forward on one validated row: projects (writing log π* to `out`), then the ratio at
/// the sampled token and the regression KL. `counted` false (mask 0) skips the loss terms.
template <class T>
inline troll_row_result troll_forward_row(const T* zn, const T* zo, std::size_t size, double eps,
                                          const projection_options& opt, bool counted,
                                          std::int64_t token, double advantage, double alpha,
                                          T* out) {
  troll_row_result r;
  row_setup setup;
  scan_pair(zn, zo, size, setup, "", "");
  r.stats = project_row(zn, zo, size, setup, eps, opt, out);
  if (!counted) return r;
  const double log_q_a = log_normaliser(zo, size).log_prob(static_cast<double>(zo[token]));
  r.log_ratio = static_cast<double>(out[token]) - log_q_a;
  r.ratio = ::exp(r.log_ratio);
  // An inactive row is log_softmax(z̃) bit for bit: KL(p̃‖π*) = 0 exactly.
  if (r.stats.status != row_status::inactive)
    r.kl_reg = kl_logits_to_log_probs(zn, log_normaliser(zn, size), out, size);
  r.loss = troll_token_loss(r.ratio, advantage, alpha, alpha != 0.0 ? r.kl_reg : 0.0);
  return r;
}


/// The plan of one row from the forward's log π* and statistics. `weight` = c (≠ 0).
template <class T>
inline troll_backward_plan troll_backward_prepare(const T* zn, const T* zo, const T* log_pi, std::size_t size,
                                                  const projection_stats& s, double weight,
                                                  std::int64_t token, double advantage, double alpha) {
  troll_backward_plan plan;
  plan.log_norm_new = log_normaliser(zn, size);
  const double log_q_a = log_normaliser(zo, size).log_prob(static_cast<double>(zo[token]));
  plan.log_ratio = static_cast<double>(log_pi[token]) - log_q_a;
  plan.ratio = ::exp(plan.log_ratio);
  plan.with_reg = alpha != 0.0 && s.status != row_status::inactive;
  const double kl_reg = plan.with_reg ? kl_logits_to_log_probs(zn, plan.log_norm_new, log_pi, size) : 0.0;
  // d − μ against a reference token on rows far from the origin (offset_rows.hpp), else as given.
  const centring_reference ref = reference_of(zn, zo, log_pi, size, s);
  plan.new_ref = ref.new_ref;
  plan.old_ref = ref.old_ref;
  plan.mu = ref.mu;
  const double d_a = (static_cast<double>(zn[token]) - ref.new_ref) - (static_cast<double>(zo[token]) - ref.old_ref);
  if (s.status == row_status::projected && !ref.offset)
    plan.centring = centring_correction(zn, zo, log_pi, s.mu, size);
  projection_stats shifted = s;
  shifted.mu = ref.mu;
  plan.k = troll_coefficients(weight, advantage, plan.ratio, plan.with_reg ? alpha : 0.0, kl_reg, d_a, shifted,
                              plan.centring);
  return plan;
}

/// Writes ∂(c·ℓ)/∂z̃ of one row (formula in objective_row.hpp) from its plan; `plan` null (mask
/// 0) writes zeros. Returns false when an entry does not fit T (the row's gradient overflows).
template <class T>
inline bool troll_backward_write(const T* zn, const T* zo, const T* log_pi, std::size_t size,
                                 const troll_backward_plan* plan,
                                 std::int64_t token, T* grad, double pi_ulps = two_point_pi_ulps<T>()) {
  if (plan == nullptr) {
    for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
      store(grad, begin, count, block_array::Zero(count));
    });
    return true;
  }
  const troll_row_coefficients& k = plan->k;
  const double ratio_scale = plan->ratio_scale();
  const double cross = k.centred_a * k.inv_sigma2;
  const std::size_t sampled = static_cast<std::size_t>(token);
  double largest = 0.0;
  // Both parts of the gradient sum to 0 and each cancels at its dominant token (π*'s for the
  // ratio part, p̃'s for the regression part: troll_dominant_sums), whose entry is then minus the
  // part's other entries: an inactive row sampled at its dominant token gave 0 for −3.5e-135, a
  // regression term at p̃'s dominant token 100% off where π*'s was another.
  troll_dominant_sums dominant;
  const double log_half = dominant.ratio.top_log_pi;  // below it no token is dominant
  double largest_ratio = 0.0;  // the ratio part's largest |entry| (two_point_suspect)
  block_array lp_new;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    // Every exp is evaluated on its own, outside the selects of zero_where_masked.
    const block_array lp = load(log_pi, begin, count);
    const block_array a = load(zn, begin, count);
    const block_array pi = block_exp(lp);
    block_array g = -ratio_scale * pi;
    if (cross != 0.0) {
      block_array centred = ((a - plan->new_ref) - (load(zo, begin, count) - plan->old_ref) - plan->mu) - plan->centring;
      zero_where_masked(lp, centred);
      g -= ratio_scale * cross * pi * centred;
    }
    if (sampled >= begin && sampled < begin + std::size_t(count)) g[Eigen::Index(sampled - begin)] += ratio_scale;
    block_array reg = block_array::Zero(count);
    if (plan->with_reg) {
      lp_new = (a - plan->log_norm_new.max) - plan->log_norm_new.log_sum;
      reg = block_exp(lp_new);
      reg = k.reg_coef * reg * (lp_new - lp - k.kl_reg);
      zero_where_masked(lp_new, reg);
    }
    const block_array total = g + reg;
    largest = bound_max(largest, total.abs().template maxCoeff<Eigen::PropagateNaN>());
    largest_ratio = maximum(largest_ratio, g.abs().template maxCoeff<Eigen::PropagateNaN>());
    store(grad, begin, count, total);
    // the parts' sums without a dominant token in them (one such block a row at most, per part)
    const bool ratio_candidate = lp.maxCoeff() >= log_half;
    const bool reg_candidate = plan->with_reg && lp_new.maxCoeff() >= log_half;
    if (ratio_candidate || reg_candidate) {
      for (Eigen::Index j = 0; j < count; ++j)
        dominant.add(begin + std::size_t(j), lp[j], plan->with_reg ? lp_new[j] : neg_inf(),
                     troll_gradient_parts{g[j], reg[j]});
    } else {
      dominant.ratio.others += g.sum();
      dominant.reg.others += reg.sum();
    }
  });
  if (dominant.ratio.found()) {
    const double value = dominant.at_ratio_top();
    largest = bound_max(largest, ::fabs(value));
    grad[dominant.ratio.top] = T(value);
  }
  if (dominant.reg.found()) {
    const double value = dominant.at_reg_top();
    largest = bound_max(largest, ::fabs(value));
    grad[dominant.reg.top] = T(value);
  }
  if (k.inv_sigma2 != 0.0) {
    // The ratio part is the projection's VJP of ratio_scale·e_a: where π* is nearly two-point its
    // entries at the two heaviest tokens come from the others' (detail/two_point.hpp); the
    // regression part is added as written (at p̃'s dominant token, its rule's value).
    const two_point_frame f{ratio_scale, 1.0, cross, pi_ulps};
    auto centred = [&](std::size_t j) {
      return ((static_cast<double>(zn[j]) - plan->new_ref) - (static_cast<double>(zo[j]) - plan->old_ref) -
              plan->mu) - plan->centring;
    };
    heavy_pair h;
    const two_point_values tp = two_point_entries(
        zn, zo, log_pi, size, f, largest_ratio, 1.0, [&](std::size_t j) { return j == sampled ? 1.0 : 0.0; },
        centred, h);
    if (tp.take) {
      auto reg_at = [&](std::size_t j) {
        const double ln = (static_cast<double>(zn[j]) - plan->log_norm_new.max) - plan->log_norm_new.log_sum;
        return troll_regression_written(k, dominant, j, j == sampled, static_cast<double>(log_pi[j]), ln);
      };
      const double v1 = tp.v1 + reg_at(h.first), v2 = tp.v2 + reg_at(h.second);
      grad[h.first] = T(v1), grad[h.second] = T(v2);
      largest = bound_max(largest, bound_max(::fabs(v1), ::fabs(v2)));
    }
  }
  return fits_in<T>(largest);
}

/// TROLL's fused backward on one row (prepare, then write); `weight` = c (0 writes zeros).
/// Returns false when the gradient overflows T.
template <class T>
inline bool troll_backward_row(const T* zn, const T* zo, const T* log_pi, std::size_t size,
                               const projection_stats& s, double weight, std::int64_t token,
                               double advantage, double alpha, T* grad, double pi_ulps = two_point_pi_ulps<T>()) {
  if (weight == 0.0) return troll_backward_write(zn, zo, log_pi, size, nullptr, token, grad);
  const troll_backward_plan plan =
      troll_backward_prepare(zn, zo, log_pi, size, s, weight, token, advantage, alpha);
  return troll_backward_write(zn, zo, log_pi, size, &plan, token, grad, pi_ulps);
}


// The spec, the top-K sums and the per-token surrogate are shared with the CUDA backend
// (objective_row.hpp).
using detail::dppo_max_top_k;
using detail::ratio_objective_spec;

/// The sums over the old row's top-K tokens (by logit, ties to the lower index; P old, Q new),
/// and the rests over every other token, summed directly (topk_sums).
template <class T>
inline topk_sums gather_topk_sums(const T* zn, const T* zo, std::size_t size,
                                  const log_normaliser_parts& norm_new, const log_normaliser_parts& norm_old,
                                  int k) {
  running_top_k<dppo_max_top_k> top(k);
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array b = load(zo, begin, count);
    if (!(b.maxCoeff() > top.threshold())) return;
    for (Eigen::Index j = 0; j < count; ++j) top.push(b[j], std::int64_t(begin) + j);
  });
  topk_sums sums;
  std::int64_t taken[dppo_max_top_k];
  for (int i = 0; i < top.size; ++i) {
    const std::int64_t j = top.index[i];
    taken[i] = j;
    sums.add(norm_old.log_prob(static_cast<double>(zo[j])), norm_new.log_prob(static_cast<double>(zn[j])));
  }
  // The rests: every block's exponentials with the top-K entries zeroed (exact_exp: 0 at −inf).
  std::sort(taken, taken + top.size);
  const std::int64_t* next = taken;
  const std::int64_t* const last = taken + top.size;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    block_array p = exact_exp((load(zo, begin, count) - norm_old.max) - norm_old.log_sum);
    block_array q = exact_exp((load(zn, begin, count) - norm_new.max) - norm_new.log_sum);
    for (; next != last && *next < std::int64_t(begin) + count; ++next)
      p[*next - std::int64_t(begin)] = q[*next - std::int64_t(begin)] = 0.0;
    sums.rest_p += p.sum();
    sums.rest_q += q.sum();
  });
  return sums;
}

/// log p_a of a token with p_a > 1/2 (refines_log_prob), as −log1p(Σ_{j≠a} e^{z_j − z_a}): the
/// other tokens' mass summed on its own, so that 1 − p_a = −expm1(log p_a) keeps its digits.
/// DPPO's binary KL reads 1 − π from it: with log π rounded to 0 (a top-logit gap of ~37) it took
/// π = 1 and returned +inf for a finite divergence (5e-15), and just short of that it kept less
/// than a digit of 1 − π (audits). Other values are returned as they are.
template <class T>
inline double refined_log_prob(const T* z, std::size_t size, std::int64_t token, double log_prob) {
  if (!refines_log_prob(log_prob)) return log_prob;
  const double za = static_cast<double>(z[token]);
  double rest = 0.0;
  for (std::size_t j = 0; j < size; ++j) {
    const double x = static_cast<double>(z[j]);
    if (std::int64_t(j) != token && x > neg_inf()) rest += ::exp(x - za);
  }
  return -::log1p(rest);
}

/// Forward of PPO clip or DPPO on one validated row (`counted`: mask > 0).
template <class T>
inline ratio_row_result ratio_forward_row(const T* zn, const T* zo, std::size_t size,
                                          const ratio_objective_spec& spec, std::int64_t token,
                                          double advantage) {
  ratio_row_result r;
  const log_normaliser_parts norm_new = log_normaliser(zn, size), norm_old = log_normaliser(zo, size);
  const double log_p_a = norm_new.log_prob(static_cast<double>(zn[token]));
  const double log_q_a = norm_old.log_prob(static_cast<double>(zo[token]));
  r.log_ratio = log_p_a - log_q_a;
  r.ratio = ::exp(r.log_ratio);
  if (spec.compute_kl) {
    row_setup setup;
    scan_pair(zn, zo, size, setup, "", "");
    r.kl = kl_row(zn, zo, size, setup);
  }
  const topk_sums sums = spec.needs_top_k()
                             ? gather_topk_sums(zn, zo, size, norm_new, norm_old, spec.top_k)
                             : topk_sums{};
  if (spec.which == ratio_objective_spec::kind::dppo_binary_kl) {  // 1 − π and 1 − μ from the other tokens
    r.token = ratio_token(spec, r.ratio, advantage, refined_log_prob(zn, size, token, log_p_a),
                          refined_log_prob(zo, size, token, log_q_a), sums, r.divergence);
  } else {
    r.token = ratio_token(spec, r.ratio, advantage, log_p_a, log_q_a, sums, r.divergence);
  }
  return r;
}

/// Backward of a ratio-based loss on one row: ∂(c·ℓ)/∂z̃_j = c·(∂ℓ/∂r)·r·(δ_ja − p̃_j).
template <class T>
inline void ratio_backward_row(const T* zn, std::size_t size, const log_normaliser_parts& norm_new, double coef,
                               std::int64_t token, T* grad) {
  double others = 0.0, p_a = 0.0;  // Σ_{j≠a} p̃_j and p̃_a (ratio_sampled_entry)
  const std::size_t a = static_cast<std::size_t>(token);
  block_array p;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    if (coef == 0.0) {
      store(grad, begin, count, block_array::Zero(count));
      return;
    }
    p = block_exp((load(zn, begin, count) - norm_new.max) - norm_new.log_sum);
    store(grad, begin, count, -coef * p);
    if (a >= begin && a < begin + std::size_t(count)) {
      p_a = p[Eigen::Index(a - begin)];
      p[Eigen::Index(a - begin)] = 0.0;  // never in the sum: its rounding would swamp the others
    }
    others += p.sum();
  });
  if (coef != 0.0) grad[token] = T(ratio_sampled_entry(coef, p_a, others));
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
