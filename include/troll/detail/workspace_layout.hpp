// troll/detail/workspace_layout.hpp — what the CUDA entry points keep in the caller's workspace
// and how many bytes that takes: plain structs and constexpr sizes, host and device, so the public
// size query (troll/workspace.hpp) compiles without CUDA.
#pragma once

#include <cstddef>

#include "../config.hpp"
#include "centring_reference.hpp"
#include "../cuda_report.hpp"
#include "../sparsify_state.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// One row's slot of the caller's workspace: what the forward's row kernel leaves for the
/// aggregation (loss, ratio, regression KL), and the backward's unnormalised weight.
struct objective_row_record {
  double loss = 0.0;
  double ratio = 0.0;
  double kl_reg = 0.0;   ///< TROLL: KL(p̃ ‖ π*); PPO: KL(p̃ ‖ q) (0 without kl_metrics)
  double limited = 0.0;  ///< PPO / DPPO: 1 when the clip (the mask) took the gradient away
  double weight = 0.0;   ///< backward: w_r (token mean) or w_r / Σ_{seq} w (sequence mean)
  double divergence = 0.0;  ///< DPPO: the divergence estimate
};

/// c_r = grad_loss · w_r / Σ w of the backward (0 when no token counts), from the aggregation
/// header and the row's record.
TROLL_HOST_DEVICE inline double backward_row_weight(double grad_loss, const objective_row_record& header,
                                                    const objective_row_record& row) {
  return header.weight == 0.0 ? 0.0 : grad_loss * (row.weight / header.weight);
}

/// Workspace layout: one header record (its `weight` holds the normaliser Σ w or S), then one
/// record per row.
TROLL_HOST_DEVICE constexpr std::size_t objective_workspace_bytes(std::size_t rows) {
  return (rows + 1) * sizeof(objective_row_record);
}


/// What the Jacobian's entries need of one row beyond its stats: the old normaliser, where
/// d − μ is formed from, whether the row was rejected, and its dominant token. One per row in the
/// caller's workspace (64 bytes: `dominant` sits in what was the padding after `rejected`).
struct jacobian_row_terms {
  double old_max;
  double old_log_sum;
  double centring;          // the re-centring m of d − μ (detail::centring_sums; 0 unless projected)
  int rejected;
  /// The token of π ≥ 1/2 of a projected row (detail::old_side_sums), whose column of ∂log π*/∂z°
  /// is minus the sum of the others; no_dominant where there is none or the row is not projected.
  /// 32 bits suffice: project_jacobian's V² entries per row bound V below 2^32.
  unsigned dominant;
  centring_reference ref;  // (0, 0, μ), or an offset row's reference token and μ' (centring_reference.hpp)

  static constexpr unsigned no_dominant = ~0u;
};
static_assert(sizeof(jacobian_row_terms) == 64, "docs/cuda.md and docs/api.md promise rows · 64 bytes");

TROLL_HOST_DEVICE constexpr std::size_t jacobian_workspace_bytes(std::size_t rows) { return rows * sizeof(jacobian_row_terms); }

/// Workspace of the sparse objective (8-byte aligned pieces, in this order):
///   records   (rows + 1) objective_row_record   the dense objective's header and row records
///   outcome   rows cuda_row_report              forward: each row's pre-alignment check
///   scratch   forward: the new rows' sparsify prefix (rows × new_k values and indices, rows
///             remainders and counts); backward: the upstream gradient on the aligned rows
///             (rows × k_max values, rows remainders). Values are sized as doubles.
TROLL_HOST_DEVICE constexpr std::size_t sparse_objective_fixed_bytes(std::size_t rows) {
  return (rows + 1) * sizeof(objective_row_record) + rows * sizeof(cuda_row_report);
}
TROLL_HOST_DEVICE constexpr std::size_t sparse_support_bytes(std::size_t rows, std::size_t new_k) {
  return rows * new_k * (sizeof(double) + sizeof(sparse_index)) + rows * (sizeof(double) + sizeof(double));
}
TROLL_HOST_DEVICE constexpr std::size_t sparse_upstream_bytes(std::size_t rows, std::size_t k_max) {
  return rows * (k_max + 1) * sizeof(double);
}
TROLL_HOST_DEVICE constexpr std::size_t sparse_objective_bytes(std::size_t rows, std::size_t k_max,
                                                               std::size_t new_k) {
  return sparse_objective_fixed_bytes(rows) + (sparse_support_bytes(rows, new_k) > sparse_upstream_bytes(rows, k_max)
                                                   ? sparse_support_bytes(rows, new_k)
                                                   : sparse_upstream_bytes(rows, k_max));
}

/// Full-covariance Gaussian rows on the device: up to gaussian_full_warp_dim one warp (or, for
/// the derivatives, one block) per row with the row's work in shared memory and no workspace;
/// above, up to gaussian_full_block_dim, one block per row with the row's scratch in the caller's
/// workspace: gaussian_full_blocks(rows, row_bytes) blocks (each holding one row at a time, so the
/// workspace does not grow with rows beyond that), row_bytes each. Forward and KL rows take
/// (4d² + 8d) doubles (detail/gaussian_full_forward.hpp), derivative rows (13d² + 18d)
/// (detail/gaussian_full_derivatives.hpp's full_scratch).
constexpr std::size_t gaussian_full_warp_dim = 32;
constexpr std::size_t gaussian_full_block_dim = 256;
constexpr std::size_t gaussian_full_workspace_budget = std::size_t(512) << 20;
constexpr std::size_t gaussian_full_max_blocks = 1024;
TROLL_HOST_DEVICE constexpr std::size_t gaussian_forward_row_bytes(std::size_t d) {
  return (4 * d * d + 8 * d) * sizeof(double);
}
TROLL_HOST_DEVICE constexpr std::size_t gaussian_derivative_row_bytes(std::size_t d) {
  return (13 * d * d + 18 * d) * sizeof(double);
}
TROLL_HOST_DEVICE constexpr std::size_t gaussian_full_blocks(std::size_t rows, std::size_t row_bytes) {
  const std::size_t fit = gaussian_full_workspace_budget / row_bytes;
  const std::size_t cap = fit < 1 ? 1 : fit > gaussian_full_max_blocks ? gaussian_full_max_blocks : fit;
  return rows < cap ? rows : cap;
}
TROLL_HOST_DEVICE constexpr std::size_t gaussian_full_workspace_bytes(std::size_t rows, std::size_t d,
                                                                      std::size_t row_bytes) {
  return d <= gaussian_full_warp_dim ? 0 : gaussian_full_blocks(rows, row_bytes) * row_bytes;
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
