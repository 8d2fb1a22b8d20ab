// troll/detail/objective_row.hpp — the per-token maths of the training objectives (math.md §5),
// written once for host and device: TROLL's ratio and regression terms and their gradient
// coefficients, PPO's clipped surrogate, DPPO's divergence estimates and directional mask, the
// running top-K of DPPO's top-K divergences. Scalars only: no std containers, exceptions or
// allocation. The CPU loops live in detail/cpu/objective_kernels.hpp; a CUDA kernel calls the
// same functions.
//
// Conventions: every objective is reported as a loss ℓ = −J to be minimised. A token's
// contribution to the batch loss is c · ℓ, c being its aggregation weight (objectives.hpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../config.hpp"
#include "../projection_types.hpp"
#include "numeric.hpp"
#include "tilt_derivatives.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

// ---- Aggregation ----

/// A loss-mask entry as it enters the normalisers (Σ w, a sequence's Σ w) and the weights of the
/// other rows: itself when a valid weight (finite, ≥ 0), else 0. A bad mask rejects its own row
/// only (the CPU throws before aggregating; the CUDA backend reports the row and writes NaN to its
/// outputs), so it must not turn every row's weight into NaN or shift them (a negative mask).
TROLL_HOST_DEVICE inline double counted_weight(double mask) {
  return mask >= 0.0 && mask < inf() ? mask : 0.0;
}

/// Row r's loss-mask entry as a double: 1 where the batch has no mask (`loss_mask` null). Any
/// batch type with a `loss_mask` pointer (token_batch, the sparse objectives' batches). A row
/// counts when this is not 0; a bad entry (NaN, negative, infinite) counts too and is refused by
/// the row's checks.
template <class Batch>
TROLL_HOST_DEVICE inline double mask_of(const Batch& in, std::size_t r) {
  return in.loss_mask != nullptr ? static_cast<double>(in.loss_mask[r]) : 1.0;
}

/// The power of two s that brings the largest counted mask of a group (the batch for the token
/// mean, one sequence for the sequence mean) into [1/2, 1): the group's normaliser Σ s·w then
/// fits in a double however large the masks are (each mask is finite, so Σ s·w ≤ rows), and its
/// weights s·w / Σ s·w are the masks' ratios. Scaling by a power of two is exact, so the weights
/// are the unscaled ones bit for bit wherever those did not overflow; only masks below the
/// largest by a factor of ~2^-1074, whose weights are 0 to double precision anyway, are lost.
/// Tiny groups (subnormal masks) are scaled up, at most by 2^1022.
TROLL_HOST_DEVICE inline double mask_scale(double largest) {
  if (!(largest > 0.0) || !(largest < inf())) return 1.0;
  int e = 0;
  ::frexp(largest, &e);  // largest = f·2^e, f in [1/2, 1)
  return ::ldexp(1.0, -e < 1022 ? -e : 1022);
}

/// A batch metric's sum of non-negative per-token values (ratios, KLs, η, divergences) whose
/// mean must not overflow where the sum does: each value fits in a double, so their mean does,
/// but two ratios of 1e308 already sum to +inf. Beside the plain sum it keeps the sum of the
/// values times 2^-64, which cannot overflow for fewer than 2^64 tokens, and takes the mean from
/// it when the plain sum overflowed. An infinite value (a divergence that is +inf) or a NaN still
/// makes the mean +inf or NaN.
struct metric_sum {
  double plain = 0.0, scaled = 0.0;

  TROLL_HOST_DEVICE void add(double x) {
    plain += x;
    scaled += x * 0x1p-64;
  }
  TROLL_HOST_DEVICE metric_sum& operator+=(const metric_sum& o) {
    plain += o.plain;
    scaled += o.scaled;
    return *this;
  }
  /// Σ x / n (n > 0).
  TROLL_HOST_DEVICE double mean(double n) const {
    return plain < inf() ? plain / n : scaled / n * 0x1p64;
  }
};

// ---- TROLL: ℓ = −(π*_a / q_a)·A + α·KL(p̃ ‖ stopgrad(π*)) ----

/// Per-row coefficients of TROLL's fused backward. With c the token's aggregation weight
/// (times the upstream gradient of the batch loss), ρ = π*_a / q_a, and the statistics of the
/// projection (t, μ, σ² at t*):
///   ∂(cℓ)/∂z̃_j = ratio_coef · [δ_ja − π*_j − [projected] π*_j (d_j − μ)(d_a − μ)/σ²] · t
///               + reg_coef · p̃_j (log p̃_j − log π*_j − KL(p̃‖π*))
/// where ratio_coef = −c·A·ρ and reg_coef = c·α (math.md §3 for the projection's VJP; the
/// regression term differentiates p̃ only, π* held constant).
struct troll_row_coefficients {
  double ratio_coef = 0.0;  ///< −c·A·ρ: the upstream ∂(cℓ)/∂log π*_a
  double reg_coef = 0.0;    ///< c·α
  double t = 1.0;           ///< t* (1 when the row is not projected)
  double centred_a = 0.0;   ///< d_a − μ (0 when the row is not projected)
  double inv_sigma2 = 0.0;  ///< 1/σ² (0 when the row is not projected)
  double kl_reg = 0.0;      ///< KL(p̃ ‖ π*)
};

/// The ratio ρ = exp(log π*_a − log q_a) of a token.
TROLL_HOST_DEVICE inline double ratio_from_logs(double log_new, double log_old) {
  return ::exp(log_new - log_old);
}

/// What a counted token's results must fit: ρ in double (the metrics average it), the loss in
/// the output type T (token_loss), the sampled token's gradient term in T. A token this far in
/// the old policy's tail (log q_a ≈ −709 in double, −88 in float) is reported, not rounded to
/// ±inf or NaN. The CUDA reports carry which one as `overflow_operand` (quantity + 4 for float).
enum class overflow_quantity : int { ratio = 0, loss = 1, weighted_loss = 2, gradient = 3 };

template <class T>
TROLL_HOST_DEVICE inline int overflow_operand(overflow_quantity q) {
  return static_cast<int>(q) + (sizeof(T) == sizeof(float) ? 4 : 0);
}

/// The first quantity of a forward token that does not fit (−1: all fit).
template <class T>
TROLL_HOST_DEVICE inline int forward_overflow(double ratio, double loss) {
  if (!fits_in<double>(ratio)) return overflow_operand<double>(overflow_quantity::ratio);
  if (!fits_in<T>(loss)) return overflow_operand<T>(overflow_quantity::loss);
  return -1;
}

/// The first quantity of a backward token that does not fit (−1: all fit); `scale` is the
/// sampled token's gradient term (c·A·ρ·t for TROLL, c·∂ℓ/∂r·r for the baselines).
template <class T>
TROLL_HOST_DEVICE inline int backward_overflow(double ratio, double scale) {
  if (!fits_in<double>(ratio)) return overflow_operand<double>(overflow_quantity::ratio);
  if (!fits_in<T>(scale)) return overflow_operand<T>(overflow_quantity::gradient);
  return -1;
}

/// TROLL's per-token loss from its parts: −ρ·A + α·KL(p̃‖π*).
TROLL_HOST_DEVICE inline double troll_token_loss(double ratio, double advantage, double alpha,
                                                 double kl_reg) {
  return -ratio * advantage + alpha * kl_reg;
}

/// The coefficients of one row's backward. `d_a` = z̃_a − z°_a at the sampled token; `centring`
/// is subtracted from d_a − μ (the CPU's re-centring, detail/cpu/backward_kernels.hpp).
TROLL_HOST_DEVICE inline troll_row_coefficients troll_coefficients(
    double weight, double advantage, double ratio, double alpha, double kl_reg, double d_a,
    const projection_stats& s, double centring = 0.0) {
  troll_row_coefficients k;
  k.ratio_coef = -weight * advantage * ratio;
  k.reg_coef = weight * alpha;
  k.kl_reg = kl_reg;
  // ρ = 0: the sampled token is masked in the new logits, so π*_a ≡ 0 for every finite
  // perturbation and the ratio term has no gradient (d_a = −inf must not reach it).
  if (s.status == row_status::projected && ratio > 0.0) {
    k.t = s.t;
    k.centred_a = (d_a - s.mu) - centring;
    k.inv_sigma2 = 1.0 / s.sigma2;
  }
  return k;
}

/// The two parts of ∂(cℓ)/∂z̃_j for one token j of the row (formula at troll_row_coefficients):
/// the ratio term's and the regression term's. Each sums to 0 over the row (moving every new
/// logit alike changes neither p̃ nor π*), and each cancels at its own dominant token
/// (troll_dominant_sums). `on_support`: log π*_j > −inf; `on_new`: log p̃_j > −inf; `centred` =
/// d_j − μ (any value off the support).
struct troll_gradient_parts {
  double ratio = 0.0;
  double reg = 0.0;
};
TROLL_HOST_DEVICE inline troll_gradient_parts troll_gradient_split(const troll_row_coefficients& k, bool is_sampled,
                                                                   bool on_support, bool on_new, double log_pi,
                                                                   double log_p_new, double centred) {
  troll_gradient_parts g;
  if (on_support) {
    const double pi = ::exp(log_pi);
    g.ratio = k.ratio_coef * k.t * ((is_sampled ? 1.0 : 0.0) - pi - pi * centred * k.centred_a * k.inv_sigma2);
  }
  if (on_new && k.reg_coef != 0.0) {
    const double p = ::exp(log_p_new);
    g.reg = k.reg_coef * p * (log_p_new - log_pi - k.kl_reg);
  }
  return g;
}

/// The dominant-token rule of TROLL's objective gradient, part by part (old_side_sums' rule on
/// the new side). The ratio part cancels at π*'s dominant token (π_k ≥ 1/2: δ_ka − π_k and the
/// centring term are O(1) where the other tokens' mass is tiny), the regression part at p̃'s
/// (p̃_h ≥ 1/2: log p̃_h − log π*_h − KL), and the two can differ. Each part's entry there is minus
/// the sum of the part's other entries; the other part's value at that token is kept as it was
/// formed (it does not cancel there). Fed token by token (add) or merged (operator+).
struct troll_dominant_sums {
  old_side_sums ratio;              // over (j, log π*_j, ratio part)
  old_side_sums reg;                // over (j, log p̃_j, regression part)
  double reg_at_ratio_top = 0.0;    // the regression part at ratio.top
  double ratio_at_reg_top = 0.0;    // the ratio part at reg.top

  TROLL_HOST_DEVICE void add(std::size_t j, double log_pi, double log_p_new, const troll_gradient_parts& g) {
    const std::size_t ratio_top = ratio.top, reg_top = reg.top;
    ratio.add(j, log_pi, g.ratio);
    reg.add(j, log_p_new, g.reg);
    if (ratio.top != ratio_top) reg_at_ratio_top = g.reg;
    if (reg.top != reg_top) ratio_at_reg_top = g.ratio;
  }
  TROLL_HOST_DEVICE friend troll_dominant_sums operator+(const troll_dominant_sums& a, const troll_dominant_sums& b) {
    troll_dominant_sums m;
    m.ratio = a.ratio + b.ratio;
    m.reg = a.reg + b.reg;
    m.reg_at_ratio_top = b.ratio.found() && m.ratio.top == b.ratio.top ? b.reg_at_ratio_top : a.reg_at_ratio_top;
    m.ratio_at_reg_top = b.reg.found() && m.reg.top == b.reg.top ? b.ratio_at_reg_top : a.ratio_at_reg_top;
    return m;
  }
  /// The entry written at ratio.top (when found()) and at reg.top (when found()); one value
  /// where they are the same token.
  TROLL_HOST_DEVICE double at_ratio_top() const {
    return ratio.top_entry() + (reg.found() && reg.top == ratio.top ? reg.top_entry() : reg_at_ratio_top);
  }
  TROLL_HOST_DEVICE double at_reg_top() const {
    return (ratio.found() && ratio.top == reg.top ? ratio.top_entry() : ratio_at_reg_top) + reg.top_entry();
  }
};

/// The regression part as written at token j (its dominant-token rule's value at p̃'s dominant
/// token, else the part itself): what the two-point rule adds to the ratio part it rewrites.
TROLL_HOST_DEVICE inline double troll_regression_written(const troll_row_coefficients& k, const troll_dominant_sums& d,
                                                         std::size_t j, bool is_sampled, double log_pi,
                                                         double log_p_new) {
  if (k.reg_coef == 0.0) return 0.0;
  if (d.reg.found() && d.reg.top == j) return d.reg.top_entry();
  return troll_gradient_split(k, is_sampled, log_pi > neg_inf(), log_p_new > neg_inf(), log_pi, log_p_new, 0.0).reg;
}

/// ∂(cℓ)/∂z̃_j as one number (troll_gradient_split's parts added).
TROLL_HOST_DEVICE inline double troll_gradient_entry(const troll_row_coefficients& k, bool is_sampled,
                                                     bool on_support, bool on_new, double log_pi,
                                                     double log_p_new, double centred) {
  const troll_gradient_parts g = troll_gradient_split(k, is_sampled, on_support, on_new, log_pi, log_p_new, centred);
  return g.ratio + g.reg;
}

/// Whether DPPO's binary KL takes a sampled token's log-probability again from the other
/// tokens' mass (cpu::refined_log_prob, cuda::block_refined_log_prob): where p_a > 1/2. Read from
/// (z_a − max) − log Σ, log p_a carries an absolute error of ~2e-16, so 1 − p_a = −expm1(log p_a)
/// keeps only ~2e-16/(1 − p_a) of its digits: none at 1 − p_a = 1.4e-16, where log p_a is not yet
/// 0 (a token then sat on the wrong side of δ: divergence 0.04951 for 0.05030, an audit). Refined,
/// 1 − p_a is the others' sum to an ulp.
TROLL_HOST_DEVICE inline bool refines_log_prob(double log_prob) { return log_prob > -0.6931471805599453; }

/// The sampled token's entry c·(1 − p̃_a) of a ratio loss's gradient c·(δ_ja − p̃_j). Where
/// p̃_a > 1/2, 1 − p̃_a is formed from `others` = Σ_{j≠a} p̃_j (the row's entries sum to 0): read
/// from p̃_a it rounds to 0 once the other tokens' mass falls below an ulp of 1, while c = (∂ℓ/∂r)·r
/// can be large enough (a tiny q_a) to make that mass count; the entry was then 100% off.
TROLL_HOST_DEVICE inline double ratio_sampled_entry(double coef, double p_a, double others) {
  return p_a > 0.5 ? coef * others : coef * (1.0 - p_a);
}

// ---- PPO clip: J = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), dual clip max(J, c·A) for A < 0 ----

/// One token's value of a ratio-based surrogate and the derivative of its loss w.r.t. r.
struct surrogate_token {
  double loss = 0.0;      ///< ℓ = −J
  double dloss_dr = 0.0;  ///< ∂ℓ/∂r (0 on clipped or masked tokens)
  bool limited = false;   ///< the clip (or dual clip, or DPPO's mask) took the gradient away
};

/// PPO's clipped surrogate at ratio r. `dual_clip` > 1 enables the dual clip of Ye et al. (2020)
/// for negative advantages (J ≥ dual_clip·A); 0 disables it.
TROLL_HOST_DEVICE inline surrogate_token ppo_clip_token(double ratio, double advantage,
                                                        double clip_low, double clip_high,
                                                        double dual_clip) {
  const double clipped = minimum(maximum(ratio, 1.0 - clip_low), 1.0 + clip_high);
  const double unclipped_value = ratio * advantage, clipped_value = clipped * advantage;
  surrogate_token s;
  double value;
  if (unclipped_value <= clipped_value) {
    value = unclipped_value;
    s.dloss_dr = -advantage;
  } else {
    value = clipped_value;
    s.limited = true;
  }
  if (dual_clip > 0.0 && advantage < 0.0 && value < dual_clip * advantage) {
    value = dual_clip * advantage;
    s.dloss_dr = 0.0;
    s.limited = true;
  }
  s.loss = -value;
  return s;
}

// ---- DPPO: divergence estimates and the directional mask ----

/// Binary total variation between Bernoulli(μ) and Bernoulli(π): |π − μ|.
TROLL_HOST_DEVICE inline double binary_tv(double mu, double pi) {
  const double d = pi - mu;
  return d < 0.0 ? -d : d;
}

/// x·log(x/y) with 0·log(0/y) = 0 and x·log(x/0) = +inf for x > 0.
TROLL_HOST_DEVICE inline double xlog_ratio(double x, double y) {
  if (!(x > 0.0)) return 0.0;
  if (!(y > 0.0)) return inf();
  return x * ::log(x / y);
}

/// log(1 − e^l) for l ≤ 0, without cancellation at either end (−inf at l = 0).
TROLL_HOST_DEVICE inline double log1m_exp(double l) {
  return l > -0.6931471805599453 ? ::log(-::expm1(l)) : ::log1p(-::exp(l));
}

/// −log(1 − x) − x for |x| < ¼ by its series x²/2 + x³/3 + … (no cancellation).
TROLL_HOST_DEVICE inline double neg_log1m_minus_x(double x) {
  double sum = 0.0;
  for (int k = 28; k >= 2; --k) sum = sum * x + 1.0 / double(k);
  return sum * x * x;
}

/// Binary KL between Bernoulli(μ) and Bernoulli(π): μ log(μ/π) + (1−μ) log((1−μ)/(1−π)), from
/// the log-probabilities, as the sum of two non-negative terms: with δ = log π − log μ and
/// x = (π − μ)/(1 − μ) = μ·expm1(δ)/(1 − μ),
///   KL = μ·(e^δ − 1 − δ) + (1 − μ)·(−log(1 − x) − x).
/// The textbook form is a difference of two terms each ~|π − μ|: at μ ≈ π (KL ~ (π − μ)²) it kept
/// only ~KL/|π − μ| of its digits (μ = 0.497, π = μ(1 − 1e-7): 4.7e-3 relative), and its tail as
/// log of the rounded quotient (1−μ)/(1−π) cost 2.7e-6 at μ ~ 3e-13 (an audit, float DPPO).
TROLL_HOST_DEVICE inline double binary_kl(double log_mu, double log_pi) {
  if (log_mu == neg_inf()) return -log1m_exp(log_pi);  // μ = 0: −log(1 − π)
  if (log_pi == neg_inf()) return inf();               // π = 0 < μ
  const double rest_mu = -::expm1(log_mu);
  if (!(rest_mu > 0.0)) return -log_pi;  // μ = 1: −log π
  if (log_pi == 0.0) return inf();       // π = 1 > μ
  const double mu = ::exp(log_mu), d = log_pi - log_mu;
  const double head = mu * expm1_minus_x(d);
  // x = (π − μ)/(1 − μ) < 1; π − μ = μ·expm1(δ), or the exponentials' difference where δ is large
  // (μ·expm1(δ) would overflow for a subnormal μ).
  const double gap = d < 1.0 ? mu * ::expm1(d) : ::exp(log_pi) - mu;
  const double x = gap / rest_mu;
  // |x| ≥ ¼: −log(1 − x) = log(1 − μ) − log(1 − π) from the logs (1 − π may be far below 1 − μ,
  // where 1 − x would round to 0).
  const double tail = ::fabs(x) < 0.25 ? neg_log1m_minus_x(x) : (log1m_exp(log_mu) - log1m_exp(log_pi)) - x;
  return maximum(head + rest_mu * tail, 0.0);
}

/// Lumped top-K divergences from sums over the old row's top-K tokens K (P old, Q new) and over
/// the rest of the row (rest_p = Σ_{j∉K} p_j, rest_q = Σ_{j∉K} q_j):
///   TV = ½ (Σ_K |p − q| + |rest_p − rest_q|),   KL = Σ_K p (log p − log q) + rest_p log(rest_p/rest_q)
/// The rests are summed over the tokens outside K, never formed as 1 − Σ_K: when K holds (nearly)
/// all the mass, 1 − Σ_K is rounding noise of either sign (±1e-16), and a positive rest_p against
/// a rest_q rounded to 0 turned the KL into +inf (a token masked or kept by the summation order).
TROLL_HOST_DEVICE inline double topk_tv(double sum_abs_diff, double rest_p, double rest_q) {
  const double d = rest_p - rest_q;
  return 0.5 * (sum_abs_diff + (d < 0.0 ? -d : d));
}
TROLL_HOST_DEVICE inline double topk_kl(double sum_plogratio, double rest_p, double rest_q) {
  return maximum(sum_plogratio + xlog_ratio(rest_p, rest_q), 0.0);
}

/// DPPO's directional mask: a token is dropped (returns false) when A > 0, π > μ and the
/// divergence exceeds δ_high, or A < 0, π < μ and it exceeds δ_low. Only updates that push the
/// policy further along the divergent direction are stopped.
TROLL_HOST_DEVICE inline bool dppo_keep(double advantage, double divergence, double pi, double mu,
                                        double delta_low, double delta_high) {
  if (advantage > 0.0 && pi > mu && divergence > delta_high) return false;
  if (advantage < 0.0 && pi < mu && divergence > delta_low) return false;
  return true;
}

/// DPPO's per-token surrogate: ℓ = −M·r·A, M the directional mask (held constant).
TROLL_HOST_DEVICE inline surrogate_token dppo_token(double ratio, double advantage, bool keep) {
  surrogate_token s;
  s.limited = !keep;
  s.loss = keep ? -ratio * advantage : 0.0;
  s.dloss_dr = keep ? -advantage : 0.0;
  return s;
}

// ---- The ratio-based baselines as one spec (PPO clip and the four DPPO variants) ----

/// Which surrogate a baseline row evaluates, with its parameters (built and checked on the host
/// by make_spec in detail/objective_arguments.hpp; the CPU and CUDA row passes take it as is).
struct ratio_objective_spec {
  enum class kind { ppo_clip, dppo_binary_tv, dppo_binary_kl, dppo_topk_tv, dppo_topk_kl };
  kind which = kind::ppo_clip;
  double a = 0.0, b = 0.0, c = 0.0;  ///< ppo: clip_low, clip_high, dual_clip; dppo: δ_low, δ_high
  int top_k = 0;
  bool compute_kl = true;

  TROLL_HOST_DEVICE bool needs_top_k() const {
    return which == kind::dppo_topk_tv || which == kind::dppo_topk_kl;
  }
};

/// Largest K of DPPO's top-K divergences.
constexpr int dppo_max_top_k = 256;

/// The sums the top-K divergences lump (P old, Q new): over the old row's top-K tokens Σ |p − q|
/// and Σ p log(p/q) (+inf once q = 0 on one of them), over every other token (−inf in the old row
/// included) the rests Σ p and Σ q.
struct topk_sums {
  double abs_diff = 0.0, plog = 0.0, rest_p = 0.0, rest_q = 0.0;

  /// Adds one top-K token from its log-probabilities (old `log_p`, new `log_q`).
  TROLL_HOST_DEVICE void add(double log_p, double log_q) {
    const double pv = ::exp(log_p), qv = ::exp(log_q);
    abs_diff += pv > qv ? pv - qv : qv - pv;
    // q = 0 with p > 0 (log p is finite here): +inf. A p that underflows to 0 against q > 0
    // adds p·log(p/q) → 0, not 0·(−inf).
    if (!(log_q > neg_inf()))
      plog = inf();
    else if (pv > 0.0)
      plog += pv * (log_p - log_q);
  }
  /// Adds one token outside the top K (either log-probability may be −inf).
  TROLL_HOST_DEVICE void add_rest(double log_p, double log_q) {
    rest_p += log_p > neg_inf() ? ::exp(log_p) : 0.0;
    rest_q += log_q > neg_inf() ? ::exp(log_q) : 0.0;
  }
  /// The lumped divergences of these sums.
  TROLL_HOST_DEVICE double tv() const { return topk_tv(abs_diff, rest_p, rest_q); }
  TROLL_HOST_DEVICE double kl() const { return topk_kl(plog, rest_p, rest_q); }
};

/// One token of a baseline: the surrogate, and DPPO's divergence (0 for PPO) through
/// `divergence`. `log_p_a`, `log_q_a`: new and old log-probabilities of the sampled token;
/// `sums`: the top-K sums (read by the top-K divergences only).
TROLL_HOST_DEVICE inline surrogate_token ratio_token(const ratio_objective_spec& spec, double ratio,
                                                     double advantage, double log_p_a,
                                                     double log_q_a, const topk_sums& sums,
                                                     double& divergence) {
  using kind = ratio_objective_spec::kind;
  divergence = 0.0;
  if (spec.which == kind::ppo_clip) return ppo_clip_token(ratio, advantage, spec.a, spec.b, spec.c);
  const double mu = ::exp(log_q_a), pi = ::exp(log_p_a);
  switch (spec.which) {
    case kind::dppo_binary_tv:
      divergence = binary_tv(mu, pi);
      break;
    case kind::dppo_binary_kl:
      divergence = binary_kl(log_q_a, log_p_a);
      break;
    case kind::dppo_topk_tv:
      divergence = sums.tv();
      break;
    default:
      divergence = sums.kl();
      break;
  }
  return dppo_token(ratio, advantage, dppo_keep(advantage, divergence, pi, mu, spec.a, spec.b));
}

// ---- Running top-K by value (ties: lower index first), fixed capacity ----

/// The K largest (value, index) pairs seen so far, sorted by decreasing value. Capacity is a
/// template parameter so the state lives on the stack (or in registers / shared memory).
template <int Capacity>
struct running_top_k {
  double value[std::size_t(Capacity)];
  std::int64_t index[std::size_t(Capacity)];
  int k = 0;     // wanted
  int size = 0;  // held

  TROLL_HOST_DEVICE explicit running_top_k(int wanted) : k(wanted < Capacity ? wanted : Capacity) {}

  /// The smallest value a new entry must beat to enter (−inf while not full).
  TROLL_HOST_DEVICE double threshold() const { return size < k ? neg_inf() : value[size - 1]; }

  /// Offers (v, i); indices must be offered in increasing order for the tie rule to hold.
  TROLL_HOST_DEVICE void push(double v, std::int64_t i) {
    if (k == 0 || !(v > threshold()) || v == neg_inf()) return;
    int at = size < k ? size++ : size - 1;
    while (at > 0 && value[at - 1] < v) {
      value[at] = value[at - 1];
      index[at] = index[at - 1];
      --at;
    }
    value[at] = v;
    index[at] = i;
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
