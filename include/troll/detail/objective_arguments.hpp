// troll/detail/objective_arguments.hpp — the host-side checks of the training objectives every
// backend shares: a counted token's ratio, loss and gradient, the argument lists' shapes, the
// objectives' parameters (make_spec), before any work. Eigen-free. The types they check are
// troll/objective_types.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "../batch.hpp"
#include "../config.hpp"
#include "../errors.hpp"
#include "../objective_types.hpp"
#include "../projection_types.hpp"
#include "arguments.hpp"
#include "numeric.hpp"
#include "objective_row.hpp"
#include "row_problem.hpp"
#include "number_text.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// The forward's check of a counted token: ρ (double), ℓ (T) and c·ℓ (double) fit.
template <class T>
row_problem check_token_result(double ratio, double log_ratio, double loss, double weight,
                                     std::int64_t token) {
  int operand = forward_overflow<T>(ratio, loss);
  if (operand < 0 && !fits_in<double>(weight * loss))
    operand = overflow_operand<double>(overflow_quantity::weighted_loss);
  return operand < 0 ? row_problem{} : overflow_problem(operand, log_ratio, token);
}

/// The backward's check of a counted token: ρ (double) and the sampled token's term (T) fit.
template <class T>
row_problem check_token_gradient(double ratio, double log_ratio, double scale, std::int64_t token) {
  const int operand = backward_overflow<T>(ratio, scale);
  return operand < 0 ? row_problem{} : overflow_problem(operand, log_ratio, token);
}

/// Whether a counted token's ratio term might not fit: ρ = π_a / q_a ≤ 1 / q_a, so only a token
/// with −log q_a ≥ `neg_log_q` near log(T's largest) can overflow (ρ in double, ρA in T). Such
/// rows (far in the old row's tail; none in ordinary use) are computed once more, without
/// writing, before a forward writes anything.
template <class T>
bool ratio_may_overflow(double neg_log_q, double advantage) {
  const double a = advantage < 0.0 ? -advantage : advantage;
  const double headroom = std::log(largest_finite<T>()) - 2.0;
  return !(neg_log_q + std::log(a > 1.0 ? a : 1.0) < headroom);
}

/// token_batch::aggregation is one of the enum's values (a value cast from an out-of-range integer
/// would take the sequence path without its ids).
inline void check_aggregation(const char* fn, loss_aggregation aggregation) {
  if (aggregation != loss_aggregation::token_mean && aggregation != loss_aggregation::sequence_mean)
    throw domain_error(std::string("troll::") + fn + ": unknown loss aggregation " +
                       std::to_string(static_cast<int>(aggregation)) + " (token_mean or sequence_mean)");
}

/// Whether a counted token's regression term α·KL(p̃‖π*) might not fit T: KL(p̃‖π*) is at most
/// `kl_bound` (the range of z̃ − z° over the row's joint support, cpu::pair_extents); such rows
/// (huge α or logits) are computed once more, without writing, as ratio_may_overflow's. The
/// margin keeps the loss −ρA + α·KL within T where both checks pass.
template <class T>
bool regression_may_overflow(double alpha, double kl_bound) {
  return alpha > 0.0 && !(alpha * kl_bound < largest_finite<T>() / 8.0);
}

/// Shape checks of an objective call (before any row is read).
template <class T>
void check_objective_shapes(const char* fn, batch_view<const T> new_logits,
                            batch_view<const T> old_logits, const token_batch<T>& in) {
  check_view(fn, "new_logits", new_logits);
  check_view(fn, "old_logits", old_logits);
  check_same_shape(fn, "new_logits", new_logits, "old_logits", old_logits);
  check_aggregation(fn, in.aggregation);
  if (new_logits.rows == 0) return;
  if (in.tokens == nullptr) throw_shape(fn, "tokens is a null pointer");
  if (in.advantages == nullptr) throw_shape(fn, "advantages is a null pointer");
  if (in.aggregation == loss_aggregation::sequence_mean && in.sequence_ids == nullptr)
    throw_shape(fn, "sequence_mean aggregation needs sequence_ids (a null pointer was given)");
}

inline void check_trust_region(const char* fn, const trust_region_objective& obj) {
  check_eps(fn, obj.eps);
  if (!(obj.alpha >= 0.0) || !(obj.alpha < inf()))
    throw domain_error(std::string("troll::") + fn + ": alpha must be finite and >= 0, got " +
                       number_text(obj.alpha));
  detail::check_options(fn, obj.projection);
}

/// The grad_loss check of every objective backward (host, both backends).
inline void check_grad_loss(const char* fn, double grad_loss) {
  if (!(grad_loss - grad_loss == 0.0))
    throw domain_error(std::string("troll::") + fn + ": grad_loss is not finite");
}

/// The host checks of TROLL's dense forward, shared by both backends: ε, α and the options, the
/// shapes, log_probs and stats. Nothing is read from the rows.
template <class T>
void check_troll_forward_arguments(const char* fn, const trust_region_objective& objective,
                                   batch_view<const T> new_logits, batch_view<const T> old_logits,
                                   const token_batch<T>& in, batch_view<const T> log_probs,
                                   const projection_stats* stats) {
  check_trust_region(fn, objective);
  check_objective_shapes(fn, new_logits, old_logits, in);
  check_view(fn, "log_probs", log_probs);
  check_same_shape(fn, "new_logits", new_logits, "log_probs", log_probs);
  if (new_logits.rows != 0 && stats == nullptr) throw_shape(fn, "stats is a null pointer");
}

/// The host checks of a ratio baseline's backward (both backends): shapes, grad_new, grad_loss.
template <class T>
void check_ratio_backward_arguments(const char* fn, batch_view<const T> new_logits,
                                    batch_view<const T> old_logits, const token_batch<T>& in,
                                    batch_view<const T> grad_new, double grad_loss) {
  check_objective_shapes(fn, new_logits, old_logits, in);
  check_view(fn, "grad_new", grad_new);
  check_same_shape(fn, "new_logits", new_logits, "grad_new", grad_new);
  check_grad_loss(fn, grad_loss);
}

/// The host checks of TROLL's dense backward (both backends): the forward's, grad_new, grad_loss.
template <class T>
void check_troll_backward_arguments(const char* fn, const trust_region_objective& objective,
                                    batch_view<const T> new_logits, batch_view<const T> old_logits,
                                    const token_batch<T>& in, batch_view<const T> log_probs,
                                    const projection_stats* stats, batch_view<const T> grad_new,
                                    double grad_loss) {
  check_troll_forward_arguments(fn, objective, new_logits, old_logits, in, log_probs, stats);
  check_view(fn, "grad_new", grad_new);
  check_same_shape(fn, "new_logits", new_logits, "grad_new", grad_new);
  check_grad_loss(fn, grad_loss);
}

/// The ratio baselines (PPO clip, DPPO): one overload of each entry point serves both.
template <class Objective>
using if_ratio_objective = std::enable_if_t<std::is_same<Objective, ppo_clip_objective>::value ||
                                                std::is_same<Objective, dppo_objective>::value,
                                            int>;

/// Throws domain_error unless 0 ≤ clip_low < 1, 0 ≤ clip_high < inf and dual_clip is 0 or in (1,
/// inf).
inline void check_ppo_clip(const char* fn, const ppo_clip_objective& o) {
  if (!(o.clip_low >= 0.0 && o.clip_low < 1.0) || !(o.clip_high >= 0.0 && o.clip_high < inf()))
    throw domain_error(std::string("troll::") + fn +
                       ": clip_low must lie in [0, 1) and clip_high be finite and >= 0");
  if (!(o.dual_clip == 0.0 || (o.dual_clip > 1.0 && o.dual_clip < inf())))
    throw domain_error(std::string("troll::") + fn +
                       ": dual_clip must be 0 (off) or finite and > 1");
}

/// The ratio-objective spec of PPO clip (checked: check_ppo_clip), for every backend.
inline ratio_objective_spec make_spec(const char* fn, const ppo_clip_objective& o) {
  check_ppo_clip(fn, o);
  ratio_objective_spec s;
  s.which = ratio_objective_spec::kind::ppo_clip;
  s.a = o.clip_low;
  s.b = o.clip_high;
  s.c = o.dual_clip;
  s.compute_kl = o.kl_metrics;
  return s;
}

/// The ratio-objective spec of DPPO. Throws domain_error for a negative or non-finite bound, an
/// unknown divergence, or top_k outside [1, 256] with a top-K divergence.
inline ratio_objective_spec make_spec(const char* fn, const dppo_objective& o) {
  using kind = ratio_objective_spec::kind;
  if (!(o.delta_low >= 0.0 && o.delta_low < inf()) || !(o.delta_high >= 0.0 && o.delta_high < inf()))
    throw domain_error(std::string("troll::") + fn + ": delta_low and delta_high must be finite and >= 0");
  ratio_objective_spec s;
  switch (o.divergence) {
    case dppo_divergence::binary_tv: s.which = kind::dppo_binary_tv; break;
    case dppo_divergence::binary_kl: s.which = kind::dppo_binary_kl; break;
    case dppo_divergence::topk_tv: s.which = kind::dppo_topk_tv; break;
    case dppo_divergence::topk_kl: s.which = kind::dppo_topk_kl; break;
    default: throw domain_error(std::string("troll::") + fn + ": unknown DPPO divergence");
  }
  if (s.needs_top_k() && !(o.top_k >= 1 && o.top_k <= dppo_max_top_k))
    throw domain_error(std::string("troll::") + fn + ": top_k must lie in [1, 256], got " +
                       std::to_string(o.top_k));
  s.a = o.delta_low;
  s.b = o.delta_high;
  s.top_k = o.top_k;
  s.compute_kl = o.kl_metrics;
  return s;
}

}  // namespace detail

TROLL_END_NAMESPACE
