// troll/detail/cpu/backward_checks.hpp — the derivative passes' row checks (non-finite upstream values, log
// π* that cannot be the forward's, unusable projection_stats) and their last guard, kept out of
// the public <troll/backward.hpp>. Host-only.
#pragma once

#include <cstddef>
#include <vector>
#include <limits>
#include <string>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../arguments.hpp"
#include "backward_kernels.hpp"
#include "parallel.hpp"
#include "row_fingerprint.hpp"
#include "row_kernels.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../workspace.hpp"
#include "../../workspace.hpp"
#include "../../projection_types.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// First non-finite entry (NaN or ±inf) of a row that must be finite everywhere (one vectorised
/// scan; a bad row is then walked).
template <class T>
row_problem find_nonfinite(const T* z, std::size_t size, const char* operand) {
  row_problem p;
  if (cpu::all_finite(z, size)) return p;
  for (std::size_t k = 0; k < size; ++k) {
    const double x = static_cast<double>(z[k]);
    if (!(x - x == 0.0)) {
      p.kind = row_error::nan_value;
      p.operand = operand;
      p.entry = static_cast<long long>(k);
      p.value = x;
      return p;
    }
  }
  return p;
}

/// First entry of a row of log-probabilities (the forward's log π*) that cannot be one
/// (detail::log_prob_fits): NaN, +inf, a finite value above 0 (a probability above 1), a value
/// above −inf where the new or the old logits are −inf (π* ≪ p̃ and π* ≪ q for every status), or
/// −inf where both are finite (a log-probability below T's range: the forward rounds it to −inf,
/// and the derivatives would take the token for a masked one). One vectorised scan; a bad row is
/// then walked.
template <class T>
row_problem find_bad_log_prob(const T* log_probs, const T* new_logits, const T* old_logits, std::size_t size,
                              const char* operand) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  row_problem p;
  unsigned char all_fine = 1;
  for (std::size_t k = 0; k < size; ++k)
    all_fine &= static_cast<unsigned char>(log_probs[k] <= T(0) && ((new_logits[k] > minus_inf && old_logits[k] > minus_inf) ==
                                                                    (log_probs[k] > minus_inf)));
  if (all_fine) return p;
  for (std::size_t k = 0; k < size; ++k) {
    const double x = static_cast<double>(log_probs[k]);
    const bool open = static_cast<double>(new_logits[k]) > neg_inf() && static_cast<double>(old_logits[k]) > neg_inf();
    if (log_prob_fits(x, open)) continue;
    p.kind = x != x ? row_error::nan_value
             : x == inf() ? row_error::pos_inf
             : x > 0.0    ? row_error::above_zero
             : open       ? row_error::log_prob_underflow
                          : row_error::masked_mass;
    p.operand = operand;
    p.entry = static_cast<long long>(k);
    p.value = x;
    return p;
  }
  return p;
}

inline row_problem check_stats(const projection_stats& s) {
  row_problem p;
  p.kind = row_error::bad_stats;
  switch (s.status) {
    case row_status::inactive:
    case row_status::restricted:
      return row_problem{};
    case row_status::projected:
      if (!(s.t > 0.0 && s.t <= 1.0)) {
        p.operand = "t of a projected row is not in (0, 1]";
      } else if (!(s.sigma2 > 0.0 && s.sigma2 < inf())) {
        p.operand = "sigma2 of a projected row is not finite and > 0";
      } else if (!(s.mu - s.mu == 0.0)) {
        p.operand = "mu of a projected row is not finite";
      } else if (!(s.kl_after >= 0.0 && s.kl_after < inf())) {
        p.operand = "kl_after of a projected row is not finite and >= 0";
      } else {
        return row_problem{};
      }
      return p;
    case row_status::not_converged:
      p.operand = not_converged_stats;
      return p;
    default:
      p.operand = "status is not inactive, projected or restricted";
      return p;
  }
}

/// check_stats, then that the statistics are project()'s of the rows the derivative was given:
/// a row_fingerprint (not 0) other than `fingerprint()` (the given rows', formed only when
/// needed) is statistics of another row or call.
template <class Fingerprint>
row_problem check_stats_for(const projection_stats& s, Fingerprint&& fingerprint) {
  row_problem p = check_stats(s);
  if (!p && s.row_fingerprint != 0 && s.row_fingerprint != fingerprint()) {
    p.kind = row_error::bad_stats;
    p.operand = "row_fingerprint differs from the given rows': these are project()'s statistics of other rows "
                "(another row of the batch, or another call)";
  }
  return p;
}

/// The last guard of a derivative pass: the lowest row whose outputs do not fit T (the true
/// derivative overflows, as with a sizeable upstream gradient on a token the row all but masks)
/// throws domain_error. The outputs are then unspecified; every other problem is found before
/// anything is written.
template <class T>
void throw_overflowed(const char* fn, const unsigned char* overflowed, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r)
    if (overflowed[r])
      throw domain_error(row_prefix(fn, r) + "a derivative does not fit " +
                             (sizeof(T) == sizeof(float) ? "float" : "double") +
                             " (its true value overflows: an upstream gradient on a token of "
                             "near-zero probability, with a tiny variance sigma2; or dL/deps, "
                             "~1/sqrt(eps), at a tiny eps such as 1e-300 in float)",
                         r);
}

/// The last guard of sparsify_backward and sparsify_shard_backward, given their lowest row with a
/// gradient entry beyond T (`rows`: none). Only an upstream gradient near the type's largest value
/// gets there (the entries are ~g·p, ~g_R·p/r and ~p·(Σ g + g_R)).
template <class T>
void throw_scatter_overflowed(const char* fn, std::size_t bad, std::size_t rows) {
  if (bad == rows) return;
  throw domain_error(row_prefix(fn, bad) + "a gradient entry does not fit " +
                         (sizeof(T) == sizeof(float) ? "float" : "double") +
                         " (its true value overflows: an upstream gradient near the type's largest value)",
                     bad);
}

/// throw_overflowed for project_jacobian, given its lowest row with an entry that does not fit
/// (`rows`: none).
template <class T>
void throw_jacobian_overflowed(const char* fn, std::size_t bad, std::size_t rows) {
  if (bad == rows) return;
  throw domain_error(row_prefix(fn, bad) + "a Jacobian entry does not fit " +
                         (sizeof(T) == sizeof(float) ? "float" : "double") +
                         " (its true value overflows: d log pi / d eps ~ |d - mu| / (t sigma2) of a token "
                         "the old row all but masks, e.g. a -3e38 mask in float)",
                     bad);
}

/// Shared argument checks of the backward entry points; throws before anything is written.
template <class T>
void validate_backward(const char* fn, unsigned threads, batch_view<const T> new_logits,
                       batch_view<const T> old_logits, batch_view<const T> log_probs,
                       const projection_stats* stats, batch_view<const T> upstream,
                       const char* upstream_name, batch_view<const T> upstream_old,
                       cpu::vjp_sums* kept = nullptr, std::size_t kept_rows = 0) {
  check_backward_views(fn, new_logits, old_logits, log_probs, stats, upstream, upstream_name, upstream_old);
  const std::size_t size = new_logits.cols;
  const bool four = upstream.data != nullptr && upstream_old.rows == 0;
  auto stats_problem = [&](std::size_t r) {
    return check_stats_for(stats[r], [&] { return cpu::dense_row_fingerprint(new_logits.row(r), old_logits.row(r), size); });
  };
  auto problem = [&](std::size_t r) {
    // The common row, every logit and upstream entry finite and every log π* ≤ 0, passes in one
    // vectorised read of the four rows; any other row is walked by the checks below, which name
    // its first problem.
    if (four && r < kept_rows && !stats_problem(r)) {  // the VJP's first pass is the check; sums kept
      kept[r] = cpu::vjp_first_pass(new_logits.row(r), old_logits.row(r), log_probs.row(r), upstream.row(r),
                                    static_cast<long>(size), stats[r]);
      if (kept[r].fine) return row_problem{};
    } else if (four && cpu::backward_row_fine(new_logits.row(r), old_logits.row(r), log_probs.row(r),
                                              upstream.row(r), size)) {
      return stats_problem(r);
    }
    row_setup setup;
    row_problem p = cpu::scan_pair(new_logits.row(r), old_logits.row(r), size, setup,
                                   "new_logits", "old_logits");
    if (!p) p = find_bad_log_prob(log_probs.row(r), new_logits.row(r), old_logits.row(r), size, "log_probs");
    if (!p) p = stats_problem(r);
    if (!p && upstream.data != nullptr) p = find_nonfinite(upstream.row(r), size, upstream_name);
    if (!p && upstream_old.rows != 0) p = find_nonfinite(upstream_old.row(r), size, "tangent_old");
    return p;
  };
  cpu::throw_first_problem(fn, threads, new_logits.rows, 3 * size, problem, &throw_row_problem);
}

}  // namespace detail

TROLL_END_NAMESPACE
