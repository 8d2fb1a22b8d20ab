// troll/projection.hpp — the KL trust-region projection of TROLL (math.md §2), and the header
// users include: it pulls in the KL functions, the backward passes and the gradient checker.
//
//   π* = argmin_π KL(π ‖ p̃)  s.t.  KL(π ‖ q) ≤ ε,
//   log π* = log_softmax(z° + t*·(z̃ − z°)),  t* ∈ (0, 1] the root of KL(π_t ‖ q) = ε.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>

#include "backward.hpp"
#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/cpu/row_kernels.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "kl.hpp"
#include "projection_types.hpp"
#include "gradcheck.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {
/// Validates every (new, old) row before anything is written: values, supports, feasibility.
template <class T>
void validate_projection_rows(const char* function, unsigned threads, batch_view<const T> new_logits,
                              batch_view<const T> old_logits, double eps, row_setup* kept = nullptr,
                              std::size_t kept_rows = 0) {
  const std::size_t size = new_logits.cols;
  auto problem = [&](std::size_t r) {
    row_setup setup;
    row_problem p = cpu::scan_pair(new_logits.row(r), old_logits.row(r), size, setup,
                                   "new_logits", "old_logits");
    if (r < kept_rows) kept[r] = setup;
    if (!p && setup.old_only) {
      const double floor = cpu::min_reachable_kl(new_logits.row(r), old_logits.row(r), size, setup);
      if (floor >= eps) {
        p.kind = row_error::infeasible;
        p.value = floor;
      }
    }
    return p;
  };
  cpu::throw_first_problem(function, threads, new_logits.rows, 2 * size, problem, &throw_row_problem);
}
}  // namespace detail

/// Projects each row of `new_logits` (z̃) onto the KL ball of radius `eps` around the row of
/// `old_logits` (z°) and writes the projected log-probabilities log π* to `out_log_probs` and
/// one projection_stats per row to `stats` (rows entries).
///
/// Inactive rows (KL(p̃‖q) ≤ ε) are written as log_softmax(z̃), bit-identical to troll::log_softmax.
/// Tokens masked (−inf) in either input get log π* = −inf. Guarantee on projected rows:
/// |KL(π*‖q) − ε| ≤ atol + rtol·ε of the options (see docs/accuracy in docs/api.md).
///
/// Throws (before writing anything): shape_error (shapes, null pointers, V = 0), domain_error
/// (NaN / +inf logits, an all −inf row, eps ≤ 0 or not finite, bad options), infeasible_error
/// (disjoint supports, or new-side masks that leave no admissible π inside the ball).
template <class T>
void project(cpu_policy policy, input_view<T> new_logits, input_view<T> old_logits, double eps,
             batch_view<T> out_log_probs, projection_stats* stats,
             const projection_options& options = {}) {
  detail::require_float_type<T>();
  constexpr const char* fn = "project";
  detail::check_projection_arguments(fn, new_logits, old_logits, out_log_probs, stats, eps, options);
  // The setups the validation scan finds are kept for the first rows (on the stack, no heap), so
  // that those rows are not scanned a second time; later rows are scanned again.
  constexpr std::size_t kept_rows = 64;
  detail::row_setup kept[kept_rows];
  detail::validate_projection_rows(fn, policy.threads, new_logits, old_logits, eps, kept, kept_rows);

  const std::size_t size = new_logits.cols;
  detail::cpu::parallel_for(policy.threads, new_logits.rows, 8 * size, [&](std::size_t r) {
    detail::row_setup setup;
    if (r < kept_rows) {
      setup = kept[r];
    } else {
      detail::cpu::scan_pair(new_logits.row(r), old_logits.row(r), size, setup, "", "");
    }
    stats[r] = detail::cpu::project_row(new_logits.row(r), old_logits.row(r), size, setup, eps,
                                        options, out_log_probs.row(r));
    stats[r].row_fingerprint = detail::cpu::dense_row_fingerprint(new_logits.row(r), old_logits.row(r), size);
  });
}

TROLL_END_NAMESPACE

// The rest of the public API: sparse top-K rows and the training objectives built on project().
#include "objectives.hpp"
#include "sparse.hpp"
#include "sparse_objectives.hpp"
