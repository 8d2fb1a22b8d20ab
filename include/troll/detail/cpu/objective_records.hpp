// troll/detail/cpu/objective_records.hpp — what the CPU objectives keep per row between their
// passes (plain structs, no Eigen), so that their scratch layout can be sized by the public
// workspace query without the kernels.
#pragma once

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../objective_row.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// What one row of TROLL's forward produced.
struct troll_row_result {
  projection_stats stats;
  double ratio = 0.0;      ///< ρ = π*_a / q_a (+inf where it overflows double)
  double log_ratio = 0.0;  ///< log π*_a − log q_a
  double kl_reg = 0.0;     ///< KL(p̃ ‖ π*)
  double loss = 0.0;       ///< −ρA + α KL(p̃‖π*)
};

/// log Σ_i exp(z_i) of a row with at least one finite entry, kept as its two parts: the row's
/// maximum and log Σ_i exp(z_i − max). A log-probability is (z_j − max) − log_sum, never
/// z_j − (max + log_sum): the sum would round to the ulp of the maximum (7.5e-9 at logits
/// of 1e8, 1.8e-12 at 1e4) and every ratio and p̃_j derived from it would carry that error.
struct log_normaliser_parts {
  double max = 0.0;
  double log_sum = 0.0;
  double log_prob(double z) const { return (z - max) - log_sum; }
};

/// What TROLL's backward needs of one row before it writes: the coefficients of
/// objective_row.hpp and the new row's log-normaliser. Computed for every row first, so that a
/// row whose gradient overflows is reported before anything is written.
struct troll_backward_plan {
  troll_row_coefficients k;
  log_normaliser_parts log_norm_new;
  double ratio = 0.0, log_ratio = 0.0;
  bool with_reg = false;
  /// m = Σ π* (d − μ) where it is significant, subtracted from every d − μ (the centring of
  /// detail/cpu/backward_kernels.hpp: μ in absolute units loses the dominant token's d − μ).
  double centring = 0.0;
  /// Where d − μ is formed from (detail/cpu/offset_rows.hpp: rows far from the origin).
  double new_ref = 0.0, old_ref = 0.0, mu = 0.0;
  /// The size of the sampled token's ratio term, |c·A·ρ·t|: what must fit the output type.
  double ratio_scale() const { return k.ratio_coef * k.t; }
};

/// The sampled-token quantities of a ratio-based baseline on one row.
struct ratio_row_result {
  surrogate_token token;
  double ratio = 0.0;       ///< p̃_a / q_a (+inf where it overflows double)
  double log_ratio = 0.0;   ///< log p̃_a − log q_a
  double kl = 0.0;          ///< KL(p̃ ‖ q) (when asked for)
  double divergence = 0.0;  ///< DPPO's divergence estimate
};

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
