// troll/objective_types.hpp — the plain types of the training objectives (objectives.hpp): the
// token batch, the objectives' parameters and the metrics. The host-side argument checks every
// backend shares are in detail/objective_arguments.hpp. Eigen-free, so the CUDA entry points
// (troll/cuda_objectives.cuh) use it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "errors.hpp"
#include "projection_types.hpp"

TROLL_BEGIN_NAMESPACE
/// How per-token losses become the batch loss. With w_r the loss mask of row r:
///   token_mean:     L = Σ_r w_r ℓ_r / Σ_r w_r
///   sequence_mean:  L = (1/S) Σ_s Σ_{r∈s} w_r ℓ_r / Σ_{r∈s} w_r   (S: sequences with Σ w > 0)
/// An all-zero mask gives L = 0 and zero gradients.
enum class loss_aggregation { token_mean, sequence_mean };

/// The per-row data of a batch of sampled tokens (N rows, one per token position), all in caller
/// memory. Rows whose mask is 0 are not read beyond their logits: their token and advantage may be
/// anything (an ignore index, NaN padding).
template <class T>
struct token_batch {
  const token_id* tokens = nullptr;      ///< sampled token a_r ∈ [0, V), N entries
  const T* advantages = nullptr;         ///< A_r, finite, N entries
  const T* loss_mask = nullptr;          ///< w_r ≥ 0 (1/0 or weights), N entries; null: all 1
  /// Sequence of each row, N entries, non-decreasing (the rows of a sequence are contiguous);
  /// needed by sequence_mean only. sequence_ids_from_lengths() builds it from lengths.
  const std::int64_t* sequence_ids = nullptr;
  loss_aggregation aggregation = loss_aggregation::token_mean;
};

/// TROLL's objective: the projection bound ε (KL(π*‖q) ≤ ε per token) and the weight α of the
/// regression term KL(p̃‖stopgrad(π*)) that keeps the network close to its projection.
struct trust_region_objective {
  double eps = 0.05;
  double alpha = 1.0;
  projection_options projection{};
};

/// PPO's clipped surrogate with asymmetric bounds ("clip-higher" when clip_high > clip_low) and
/// the optional dual clip (dual_clip = c > 1 bounds the loss of negative-advantage tokens by −c·A;
/// 0 turns it off).
struct ppo_clip_objective {
  double clip_low = 0.2;
  double clip_high = 0.2;
  double dual_clip = 0.0;
  bool kl_metrics = true;  ///< also compute KL(p̃‖q) per row for the metrics (one more pass)
};

/// DPPO's divergence estimates (math.md §5), μ = q_a, π = p̃_a.
enum class dppo_divergence { binary_tv, binary_kl, topk_tv, topk_kl };

/// DPPO: the surrogate r·A with a token masked when its divergence exceeds delta_high while
/// A > 0 and π > μ, or delta_low while A < 0 and π < μ. Typical bounds: 0.15 for TV, 0.05 for
/// KL (what dppo_objective::defaults gives). top_k ≤ 256 for the top-K divergences.
struct dppo_objective {
  dppo_divergence divergence = dppo_divergence::binary_tv;
  double delta_low = 0.15;
  double delta_high = 0.15;
  int top_k = 20;
  bool kl_metrics = true;

  static dppo_objective defaults(dppo_divergence d) {
    const bool tv = d == dppo_divergence::binary_tv || d == dppo_divergence::topk_tv;
    dppo_objective o;
    o.divergence = d;
    o.delta_low = o.delta_high = tv ? 0.15 : 0.05;
    return o;
  }
};

/// What a forward pass measured over the rows with mask > 0 (unweighted means).
struct objective_metrics {
  double loss = 0.0;            ///< the aggregated loss L (what the backward differentiates)
  std::size_t tokens = 0;       ///< rows with mask > 0
  std::size_t sequences = 0;    ///< sequences with mask sum > 0 (sequence_mean; else 0)
  double ratio_mean = 0.0;      ///< mean ratio at the sampled token: π*_a/q_a (TROLL), p̃_a/q_a
  double kl_before_mean = 0.0;  ///< KL(p̃ ‖ q): the network's step from the old policy
  double kl_before_max = 0.0;
  double kl_after_mean = 0.0;  ///< KL(π* ‖ q) for TROLL (≤ ε); = kl_before for the baselines
  double kl_after_max = 0.0;
  double regression_kl_mean = 0.0;  ///< TROLL: KL(p̃ ‖ π*)
  double projected_fraction = 0.0;  ///< TROLL: rows whose projection was active
  double eta_mean = 0.0;            ///< TROLL: mean η* (0 on inactive rows)
  double limited_fraction = 0.0;    ///< PPO: clipped tokens; DPPO: masked tokens
  double divergence_mean = 0.0;     ///< DPPO: mean divergence estimate
};

/// ids[r] = index of the sequence row r belongs to, for `count` sequences of the given lengths
/// laid out one after the other (Σ lengths entries are written). Throws domain_error for a
/// negative length, before writing anything.
inline void sequence_ids_from_lengths(const std::int64_t* lengths, std::size_t count,
                                      std::int64_t* ids) {
  for (std::size_t s = 0; s < count; ++s)  // every length first: nothing is written on a throw
    if (lengths[s] < 0)
      throw domain_error("troll::sequence_ids_from_lengths: sequence " + std::to_string(s) +
                         " has negative length " + std::to_string(lengths[s]));
  std::size_t at = 0;
  for (std::size_t s = 0; s < count; ++s)
    for (std::int64_t k = 0; k < lengths[s]; ++k) ids[at++] = std::int64_t(s);
}

TROLL_END_NAMESPACE
