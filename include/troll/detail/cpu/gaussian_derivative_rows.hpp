// troll/detail/cpu/gaussian_derivative_rows.hpp — the CPU driver shared by the Gaussian backward
// (VJP) and JVP: validate the rows and the stats, then run one row kernel per row in parallel.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../execution.hpp"
#include "../../gaussian_types.hpp"
#include "../gaussian_checks.hpp"
#include "../gaussian_row_io.hpp"
#include "parallel.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// After validate_gaussian_rows with a derivative's own checks, row by row (the statistics, `what`:
/// "backward" or "JVP" in the message; then the upstream gradients or input tangents), runs `full`
/// (full covariance; with the saved factorisation's row, or null) or `diag`
/// on every row with t = 1 for an inactive row and the io that `make_io(r)` returns.
template <class T, class Io, class MakeIo>
void gaussian_derivative_rows(cpu_policy policy, const gaussian_call& call, batch_view<const T> mean,
                              batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                              double eps_mean, const gaussian::gaussian_stats* stats,
                              gaussian::saved_factorisation<const double> saved, const char* what,
                              const finite_operands<T>& operands, MakeIo make_io,
                              void (*full)(bool, std::size_t, const T*, const T*, const T*, const T*, double, double,
                                           double, const Io&, const double*),
                              void (*diag)(bool, std::size_t, const T*, const T*, const T*, const T*, double, double,
                                           double, const Io&)) {
  validate_gaussian_rows(policy.threads, call, mean, cov, old_mean, old_cov,
                         gaussian_derivative_extra<T, gaussian::gaussian_stats>{stats, what, &operands});
  const std::size_t work = call.full ? 200 * call.dim * call.dim * call.dim : 200 * call.dim;
  parallel_for(policy.threads, mean.rows, work, [&](std::size_t r) {
    const Io io = make_io(r);
    // t and the exact s = 1 − t (solved_tilt, solved_gap: 1 − t from the stored t carries half
    // an ulp of t, 5e-10 of s at 1 − t* = 1e-7, and the old mean's derivative moved by as much).
    const double t = solved_tilt(stats[r]), s = solved_gap(stats[r]);
    if (call.full) {
      full(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), eps_mean, t, s, io,
           saved.data == nullptr ? nullptr : saved.row(r));
    } else {
      diag(call.split, call.dim, mean.row(r), cov.row(r), old_mean.row(r), old_cov.row(r), eps_mean, t, s, io);
    }
  });
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
