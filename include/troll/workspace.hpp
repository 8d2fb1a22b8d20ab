// troll/workspace.hpp — how much scratch memory an entry point needs (CUB's temp_storage_bytes
// idiom). One query for every entry point and both policies:
//
//   std::size_t bytes = troll::workspace_bytes(policy, troll::op::project_jacobian{}, rows, V);
//   auto p = policy.with_workspace(memory, bytes);          // host memory for cpu, device for cuda
//   troll::project_jacobian(p, new_logits, old_logits, log_probs, stats, jac_new);
//
//   std::size_t b = troll::workspace_bytes(policy, troll::op::objective_forward{}, objective, rows, V,
//                                          aligned.k_max);   // objectives name the objective
//
// 0 means the entry point needs none (most of them). The memory must be 8-byte aligned; a
// workspace that is null, misaligned or smaller than the query's answer throws shape_error before
// anything is written. A cpu_policy without a workspace lets the CPU entry points take their
// scratch from the calling thread's reusable arena (it allocates only when it grows); a
// cuda_policy must carry one wherever the answer is non-zero.
#pragma once

#include <cstddef>
#include <type_traits>

#include "config.hpp"
#include "detail/cpu/objective_scratch.hpp"
#include "detail/objective_arguments.hpp"
#include "detail/workspace_layout.hpp"
#include "execution.hpp"
#include "objective_types.hpp"
#include "sparse_objective_types.hpp"

TROLL_BEGIN_NAMESPACE

/// Tags naming the entry points, for workspace_bytes (troll::gaussian::X is op::gaussian_X).
namespace op {
struct log_softmax {};
struct kl {};
struct kl_backward {};
struct project {};
struct project_backward {};
struct project_jvp {};
struct project_jacobian {};
struct sparsify {};
struct sparsify_shard {};
struct sparsify_merge {};
struct sparsify_finalize {};
struct sparsify_tail_sums {};
struct sparsify_backward {};
struct sparsify_shard_backward {};
struct align {};
struct align_backward {};
struct objective_forward {};
struct objective_backward {};
struct gaussian_project_joint {};
struct gaussian_project_split {};
struct gaussian_project_joint_diag {};
struct gaussian_project_split_diag {};
struct gaussian_project_joint_backward {};
struct gaussian_project_split_backward {};
struct gaussian_project_joint_diag_backward {};
struct gaussian_project_split_diag_backward {};
struct gaussian_project_joint_jvp {};
struct gaussian_project_split_jvp {};
struct gaussian_project_joint_diag_jvp {};
struct gaussian_project_split_diag_jvp {};
struct gaussian_kl {};
struct gaussian_kl_diag {};
}  // namespace op

namespace detail {
template <class Op>
struct is_objective_op : std::integral_constant<bool, std::is_same<Op, op::objective_forward>::value ||
                                                          std::is_same<Op, op::objective_backward>::value> {};

constexpr std::size_t objective_scratch(const cpu_policy&, const trust_region_objective&, std::size_t rows,
                                        std::size_t cols, std::size_t) {
  return cpu::dense_troll_bytes(rows, cols);
}
template <class Objective, if_ratio_objective<Objective> = 0>
constexpr std::size_t objective_scratch(const cpu_policy&, const Objective&, std::size_t rows, std::size_t,
                                        std::size_t) {
  return cpu::ratio_bytes(rows);
}
constexpr std::size_t objective_scratch(const cpu_policy&, const sparse_trust_region_objective&, std::size_t rows,
                                        std::size_t, std::size_t) {
  return cpu::sparse_troll_bytes(rows);
}
constexpr std::size_t objective_scratch(const cuda_policy&, const trust_region_objective&, std::size_t rows,
                                        std::size_t, std::size_t) {
  return cuda::objective_workspace_bytes(rows);
}
template <class Objective, if_ratio_objective<Objective> = 0>
constexpr std::size_t objective_scratch(const cuda_policy&, const Objective&, std::size_t rows, std::size_t, std::size_t) {
  return cuda::objective_workspace_bytes(rows);
}
constexpr std::size_t objective_scratch(const cuda_policy&, const sparse_trust_region_objective& objective,
                                        std::size_t rows, std::size_t, std::size_t k_max) {
  return cuda::sparse_objective_bytes(rows, k_max,
                                      objective.new_support.k > 0 ? std::size_t(objective.new_support.k) : 0);
}

/// The CUDA full-covariance Gaussian entry points that need scratch above d = 32, and the bytes
/// of one row: the projections and the KL, or their backward and JVP.
template <class Op>
struct gaussian_full_scratch {
  static constexpr bool listed = false;
};
struct gaussian_forward_scratch {
  static constexpr bool listed = true;
  static constexpr std::size_t row_bytes(std::size_t d) { return cuda::gaussian_forward_row_bytes(d); }
};
struct gaussian_derivative_scratch {
  static constexpr bool listed = true;
  static constexpr std::size_t row_bytes(std::size_t d) { return cuda::gaussian_derivative_row_bytes(d); }
};
template <> struct gaussian_full_scratch<op::gaussian_project_joint> : gaussian_forward_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_project_split> : gaussian_forward_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_kl> : gaussian_forward_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_project_joint_backward> : gaussian_derivative_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_project_split_backward> : gaussian_derivative_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_project_joint_jvp> : gaussian_derivative_scratch {};
template <> struct gaussian_full_scratch<op::gaussian_project_split_jvp> : gaussian_derivative_scratch {};
}  // namespace detail

/// Bytes of scratch `Op` needs under `policy` for `rows` rows of `cols` tokens (`k_max`: the
/// capacity of the sparse rows involved, for the sparse entry points). 0 for every entry point
/// not listed below:
///   cpu  project_backward, project_jvp: rows (one overflow flag per row)
///   cpu  sparsify: rows · (12 · k_max + 13) (each row finished before any is written: its
///        indices, log-probs, remainder, count and a flag), k_max = out.k_max
///   cuda project_jacobian: rows · 64 (per-row terms)
///   cuda Gaussian full-covariance rows above d = 32 (below)
template <class Policy, class Op, std::enable_if_t<!detail::is_objective_op<Op>::value, int> = 0>
constexpr std::size_t workspace_bytes(const Policy&, Op, std::size_t = 0, std::size_t = 0, std::size_t = 0) {
  return 0;
}
constexpr std::size_t workspace_bytes(const cpu_policy&, op::project_backward, std::size_t rows, std::size_t = 0,
                                      std::size_t = 0) {
  return rows;
}
constexpr std::size_t workspace_bytes(const cpu_policy&, op::project_jvp, std::size_t rows, std::size_t = 0,
                                      std::size_t = 0) {
  return rows;
}
constexpr std::size_t workspace_bytes(const cpu_policy&, op::sparsify, std::size_t rows, std::size_t = 0,
                                      std::size_t k_max = 0) {
  return rows * (12 * k_max + 13);
}
constexpr std::size_t workspace_bytes(const cuda_policy&, op::project_jacobian, std::size_t rows, std::size_t = 0,
                                      std::size_t = 0) {
  return detail::cuda::jacobian_workspace_bytes(rows);
}

/// CUDA full-covariance Gaussian rows (`cols` is d, the dimension): 0 up to d = 32; above (up to
/// d = 256) blocks · row_bytes with blocks = min(rows, 1024, 512 MiB / row_bytes) and row_bytes
/// (4d² + 8d) · 8 for the projections and the KL, (13d² + 18d) · 8 for their backward and JVP.
/// The diagonal entry points need none.
template <class Op, std::enable_if_t<detail::gaussian_full_scratch<Op>::listed, int> = 0>
constexpr std::size_t workspace_bytes(const cuda_policy&, Op, std::size_t rows, std::size_t d = 0, std::size_t = 0) {
  return detail::cuda::gaussian_full_workspace_bytes(rows, d, detail::gaussian_full_scratch<Op>::row_bytes(d));
}

/// Bytes of scratch objective_forward / objective_backward need for `objective` (its type picks
/// the overload: trust_region_objective, ppo_clip_objective, dppo_objective,
/// sparse_trust_region_objective) on `rows` rows of `cols` tokens; `k_max` is aligned.k_max for
/// the sparse objective. CUDA: (rows + 1) · 48 for the dense objectives, and for the sparse one
/// (rows + 1) · 48 + rows · 24 + max(rows · (12 · new_k + 16), rows · (k_max + 1) · 8) with
/// new_k = objective.new_support.k. CPU: per-row weights, results and flags (today 89 bytes a row
/// for PPO clip and DPPO, 97 for sparse TROLL; dense TROLL the larger of 97 a row plus one row of
/// cols doubles, forward, and 161 a row, backward; detail/cpu/objective_scratch.hpp); the larger
/// of forward and backward. One allocation serves both.
template <class Policy, class Op, class Objective, std::enable_if_t<detail::is_objective_op<Op>::value, int> = 0>
constexpr std::size_t workspace_bytes(const Policy& policy, Op, const Objective& objective, std::size_t rows,
                                      std::size_t cols = 0, std::size_t k_max = 0) {
  return detail::objective_scratch(policy, objective, rows, cols, k_max);
}

/// The CUDA sizes under their earlier names (kept; equal to workspace_bytes(troll::cuda, ...)).
constexpr std::size_t objective_workspace_bytes(std::size_t rows) { return detail::cuda::objective_workspace_bytes(rows); }
constexpr std::size_t sparse_objective_workspace_bytes(std::size_t rows, std::size_t k_max, int new_k) {
  return detail::cuda::sparse_objective_bytes(rows, k_max, new_k > 0 ? std::size_t(new_k) : 0);
}
constexpr std::size_t project_jacobian_workspace_bytes(std::size_t rows, std::size_t /*cols*/) {
  return detail::cuda::jacobian_workspace_bytes(rows);
}

TROLL_END_NAMESPACE
