// troll/detail/arguments.hpp — the host-side argument checks every backend shares: ε and the
// solver options of the projection, the views and shapes of its derivatives. Host-only,
// Eigen-free, so CPU and CUDA entry points throw the same errors before touching any data.
#pragma once

#include <cstddef>
#include <string>

#include "../batch.hpp"
#include "../config.hpp"
#include "../errors.hpp"
#include "../projection_types.hpp"
#include "numeric.hpp"
#include "number_text.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Throws domain_error unless eps is finite and at least the smallest normal double. A subnormal
/// bound (below 2.2250738585072014e-308) has fewer than 53 significant bits, and the KL the
/// solvers compare with it (~t²σ²/2 at a t*, ~1e-160, whose square is subnormal too) can no longer
/// be formed to the tolerance: measured, t* was 2.5e-4 off at ε = 1e-320 (categorical) and 17%
/// off at 5e-324 (Gaussian), every row still reported `projected`. Shared by every entry point
/// that takes a bound (projections, the TROLL objective, the Gaussian projections; CPU and CUDA).
inline void check_eps(const char* function, double eps, const char* name = "eps") {
  if (!(eps > 0.0) || !(eps < inf()))
    throw domain_error(std::string("troll::") + function + ": the bound " + name + " must be finite and > 0, got " +
                       number_text(eps));
  if (eps < 0x1p-1022)
    throw domain_error(std::string("troll::") + function + ": the bound " + name + " = " + number_text(eps) +
                       " is subnormal (below 2.2250738585072014e-308, the smallest normal double): the "
                       "projection's KL cannot be resolved that far; use a normal bound");
}

/// Throws domain_error unless rtol and atol are finite and ≥ 0 with a positive sum and
/// max_iterations ≥ 1 (projection_options, and the same fields of the objectives' options).
inline void check_solver_options(const char* function, double rtol, double atol, int max_iterations,
                                 const char* type = "projection_options") {
  if (!(rtol >= 0.0 && rtol < inf()) || !(atol >= 0.0 && atol < inf()) || !(rtol + atol > 0.0) ||
      max_iterations < 1)
    throw domain_error(std::string("troll::") + function + ": " + type +
                       " need finite rtol >= 0 and atol >= 0 with rtol + atol > 0, and "
                       "max_iterations >= 1 (got rtol = " + number_text(rtol) + ", atol = " +
                       number_text(atol) + ", max_iterations = " + std::to_string(max_iterations) + ")");
}

inline void check_options(const char* function, const projection_options& opt) {
  check_solver_options(function, opt.rtol, opt.atol, opt.max_iterations);
}

/// project_jacobian's output size: rows · V² entries of `element` bytes must be addressable
/// (a size_t byte count); throws shape_error naming the shape otherwise. Shared by both backends.
inline void check_jacobian_size(const char* function, std::size_t rows, std::size_t cols, std::size_t element) {
  const std::size_t most = ~std::size_t(0);
  if (rows == 0 || cols == 0) return;
  if (cols > most / cols || cols * cols > most / element / rows)
    throw_shape(function, "rows * V^2 Jacobian entries overflow the address space (rows = " + std::to_string(rows) +
                              ", V = " + std::to_string(cols) + ")");
}

/// Every host-side check of project()'s arguments that does not read the logits: the views,
/// their shapes, the stats pointer, ε and the options. Shared by the CPU and CUDA overloads.
template <class T>
void check_projection_arguments(const char* function, batch_view<const T> new_logits,
                                batch_view<const T> old_logits, batch_view<T> out_log_probs,
                                const projection_stats* stats, double eps,
                                const projection_options& options) {
  check_view(function, "new_logits", new_logits);
  check_view(function, "old_logits", old_logits);
  check_view(function, "out_log_probs", out_log_probs);
  check_same_shape(function, "new_logits", new_logits, "old_logits", old_logits);
  check_same_shape(function, "new_logits", new_logits, "out_log_probs", out_log_probs);
  if (new_logits.rows != 0 && stats == nullptr) throw_shape(function, "stats is a null pointer");
  check_eps(function, eps);
  check_options(function, options);
}

/// The host-side half of the derivatives' validation (project_backward, project_jvp,
/// project_jacobian; CPU and CUDA): the views, their shapes and the stats pointer, in this order.
/// `upstream` (named `upstream_name`) is the VJP's grad_log_probs or the JVP's tangent_new;
/// project_jacobian has none (an empty view and ""). `upstream_old` is the JVP's tangent_old
/// (checked only when it has rows).
template <class T>
void check_backward_views(const char* fn, batch_view<const T> new_logits, batch_view<const T> old_logits,
                          batch_view<const T> log_probs, const projection_stats* stats,
                          batch_view<const T> upstream, const char* upstream_name,
                          batch_view<const T> upstream_old) {
  check_view(fn, "new_logits", new_logits);
  check_view(fn, "old_logits", old_logits);
  check_view(fn, "log_probs", log_probs);
  check_same_shape(fn, "new_logits", new_logits, "old_logits", old_logits);
  check_same_shape(fn, "new_logits", new_logits, "log_probs", log_probs);
  if (upstream.data != nullptr || upstream.rows != 0) {  // absent for project_jacobian
    check_view(fn, upstream_name, upstream);
    check_same_shape(fn, "new_logits", new_logits, upstream_name, upstream);
  } else if (new_logits.rows != 0 && upstream_name[0] != '\0') {
    throw_shape(fn, std::string(upstream_name) + " is a null pointer");
  }
  if (upstream_old.rows != 0) {
    check_view(fn, "tangent_old", upstream_old);
    check_same_shape(fn, "new_logits", new_logits, "tangent_old", upstream_old);
  }
  if (new_logits.rows != 0 && stats == nullptr) throw_shape(fn, "stats is a null pointer");
}

/// The host-side checks of kl (CPU and CUDA): the logits pair and one value per row at `kl`
/// (named `kl_name`).
template <class T>
void check_kl_arguments(const char* fn, batch_view<const T> p_logits, batch_view<const T> q_logits, const T* kl,
                        const char* kl_name = "kl_out") {
  check_view(fn, "p_logits", p_logits);
  check_view(fn, "q_logits", q_logits);
  check_same_shape(fn, "p_logits", p_logits, "q_logits", q_logits);
  if (p_logits.rows != 0 && kl == nullptr) throw_shape(fn, std::string(kl_name) + " is a null pointer");
}

/// The host-side checks of kl_backward (CPU and CUDA): the logits pair, grad_kl, and each
/// gradient view that has rows (an empty one is skipped).
template <class T>
void check_kl_backward_arguments(const char* fn, batch_view<const T> p_logits, batch_view<const T> q_logits,
                                 const T* grad_kl, batch_view<T> grad_p, batch_view<T> grad_q) {
  check_kl_arguments(fn, p_logits, q_logits, grad_kl, "grad_kl");
  if (grad_p.rows != 0) {
    check_view(fn, "grad_p", grad_p);
    check_same_shape(fn, "p_logits", p_logits, "grad_p", grad_p);
  }
  if (grad_q.rows != 0) {
    check_view(fn, "grad_q", grad_q);
    check_same_shape(fn, "p_logits", p_logits, "grad_q", grad_q);
  }
}

/// Throws shape_error unless `out` is a usable view shaped like `like` (named new_logits).
template <class T>
void check_output(const char* fn, const char* name, batch_view<const T> like, batch_view<T> out) {
  check_view(fn, name, out);
  check_same_shape(fn, "new_logits", like, name, out);
}

}  // namespace detail
TROLL_END_NAMESPACE
