// troll/detail/gaussian_checks.hpp — the host-side checks of the Gaussian projections' arguments:
// the views and their shapes, then every row's values, before anything is written.
#pragma once

#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "../batch.hpp"
#include "../config.hpp"
#include "../errors.hpp"
#include "../gaussian_types.hpp"
#include "../projection_types.hpp"
#include "arguments.hpp"
#include "cpu/parallel.hpp"
#include "gaussian_family.hpp"
#include "numeric.hpp"
#include "number_text.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Which Gaussian entry point runs: its name for messages, the covariance layout (full:
/// N × d² Cholesky factors; else N × d standard deviations), the bound (joint or split), and d
/// (filled in by check_gaussian_arguments).
struct gaussian_call {
  const char* function = "";
  bool full = true;
  bool split = false;
  std::size_t dim = 0;
  /// gaussian::kl / kl_diag: a KL that overflows is +inf, not an error (validate_gaussian_rows).
  bool kl_only = false;
};

/// Checks the views: means N × d with d ≥ 1, covariances N × d² (full) or N × d, outputs alike.
/// Returns the call with d set. Throws shape_error.
template <class T, class U>
gaussian_call check_gaussian_arguments(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                       batch_view<const T> old_mean, batch_view<const T> old_cov,
                                       batch_view<U> out_mean, batch_view<U> out_cov) {
  const char* fn = call.function;
  const char* cov_name = call.full ? "cov_chol" : "std_dev";
  const std::string old_cov_name = std::string("old_") + cov_name;
  const std::string out_cov_name = std::string("out_") + cov_name;
  check_view(fn, "mean", mean);
  check_view(fn, cov_name, cov);
  check_view(fn, "old_mean", old_mean);
  check_view(fn, old_cov_name.c_str(), old_cov);
  check_view(fn, "out_mean", out_mean);
  check_view(fn, out_cov_name.c_str(), out_cov);
  check_same_shape(fn, "mean", mean, "old_mean", old_mean);
  check_same_shape(fn, "mean", mean, "out_mean", out_mean);
  check_same_shape(fn, cov_name, cov, old_cov_name.c_str(), old_cov);
  check_same_shape(fn, cov_name, cov, out_cov_name.c_str(), out_cov);
  call.dim = mean.cols;
  if (mean.rows != cov.rows)
    throw_shape(fn, std::string("mean has ") + std::to_string(mean.rows) + " rows but " + cov_name + " has " +
                        std::to_string(cov.rows));
  const std::size_t want = call.full ? call.dim * call.dim : call.dim;
  if (mean.rows != 0 && cov.cols != want)
    throw_shape(fn, std::string(cov_name) + " has " + std::to_string(cov.cols) + " columns but d = " +
                        std::to_string(call.dim) + " needs " + std::to_string(want) +
                        (call.full ? " (a row-major d x d factor)" : ""));
  return call;
}

/// Every check of a forward projection's arguments that reads no row values: the views (above),
/// the stats pointer, the bounds (eps_cov only for a split bound) and the solver options. Shared
/// by the CPU and CUDA backends; returns the call with d set. Throws shape_error / domain_error.
template <class T, class U, class S>
gaussian_call check_projection_arguments(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                         batch_view<const T> old_mean, batch_view<const T> old_cov,
                                         batch_view<U> out_mean, batch_view<U> out_cov, const S* stats,
                                         double eps_mean, double eps_cov, const projection_options& opt) {
  const gaussian_call c = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov);
  if (stats == nullptr && mean.rows != 0) throw_shape(c.function, "stats is a null pointer");
  check_eps(c.function, eps_mean, c.split ? "eps_mean" : "eps");
  if (c.split) check_eps(c.function, eps_cov, "eps_cov");
  check_options(c.function, opt);
  return c;
}

/// Every check of kl's arguments that reads no row values: the four operands (the view checks
/// above) and the output pointer. Shared by the CPU and CUDA backends; returns the call with d set.
template <class T>
gaussian_call check_kl_arguments(const gaussian_call& call, batch_view<const T> mean, batch_view<const T> cov,
                                 batch_view<const T> old_mean, batch_view<const T> old_cov, const double* out) {
  const gaussian_call c = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, mean, cov);
  if (out == nullptr && mean.rows != 0) throw_shape(c.function, "out is a null pointer");
  return c;
}

/// An optional gradient or tangent view: empty (data == nullptr) or shaped like its input.
template <class T, class U>
void check_optional_view(const char* function, const char* name, batch_view<T> view, batch_view<U> like) {
  if (view.data == nullptr) return;
  check_view(function, name, view);
  check_same_shape(function, name, view, "its input", like);
}

/// Every check of a derivative's (VJP or JVP) arguments that reads no row values: the forward's
/// inputs and outputs, the upstream (VJP) or output-tangent (JVP) views shaped like the outputs,
/// the stats pointer and the bounds. Shared by the CPU and CUDA backends; returns the call with d
/// set. Throws shape_error / domain_error.
template <class T, class U>
gaussian_call check_derivative_arguments(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                         batch_view<const T> old_mean, batch_view<const T> old_cov,
                                         batch_view<const T> out_mean, batch_view<const T> out_cov,
                                         batch_view<U> second_mean, batch_view<U> second_cov, const void* stats,
                                         double eps_mean, double eps_cov) {
  call = check_gaussian_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov);
  check_gaussian_arguments(call, mean, cov, old_mean, old_cov, second_mean, second_cov);
  if (stats == nullptr && mean.rows != 0) throw_shape(call.function, "stats is a null pointer");
  check_eps(call.function, eps_mean, call.split ? "eps_mean" : "eps");
  if (call.split) check_eps(call.function, eps_cov, "eps_cov");
  return call;
}

/// The JVP's input tangents: each view empty or shaped like its input; the bound tangents finite.
template <class Tangents, class T>
void check_jvp_tangents(const char* fn, const Tangents& tangents, batch_view<const T> mean, batch_view<const T> cov,
                        batch_view<const T> old_mean, batch_view<const T> old_cov) {
  check_optional_view(fn, "tangents.mean", tangents.mean, mean);
  check_optional_view(fn, "tangents.cov", tangents.cov, cov);
  check_optional_view(fn, "tangents.old_mean", tangents.old_mean, old_mean);
  check_optional_view(fn, "tangents.old_cov", tangents.old_cov, old_cov);
  if (!(tangents.eps - tangents.eps == 0.0) || !(tangents.eps_mean - tangents.eps_mean == 0.0))
    throw domain_error(std::string("troll::") + fn + ": a bound tangent is not finite");
}

/// The problem of one row's forward statistics for a derivative ("" when usable: solved, t in
/// (0, 1]). `what` names the derivative ("backward" or "JVP").
template <class Stats>
std::string gaussian_stats_problem(const Stats& stats, const char* what) {
  if (!(stats.solved() && stats.t > 0.0 && stats.t <= 1.0))
    return std::string("forward statistics are unusable: status ") + status_name(stats.status) +
           ", t = " + number_text(stats.t) + " (the " + what + " needs a solved row: inactive or projected)";
  // I(t*) is summed in double; where it overflows (a standard-deviation ratio below ~1e-77, a
  // whitened mean step above ~1e154) the derivatives' implicit term through t* would be lost
  // (an audit: ∂μ*/∂ε = 0 for 1.28), so they are refused; the forward itself stays exact.
  if (stats.status == row_status::projected && !(stats.fisher < inf()))
    return std::string("the Fisher information I(t*) of the projection (stats.fisher) is ") +
           number_text(stats.fisher) + ": it overflows a double, which the " + what +
           " does not support (a standard-deviation ratio below ~1e-77 or a whitened mean step above ~1e154)";
  return std::string();
}

/// A saved factorisation (gaussian_types.hpp) is empty, or full rows of this batch's shape.
template <class D>
void check_saved_factorisation(const gaussian_call& call, std::size_t rows,
                               const gaussian::saved_factorisation<D>& saved) {
  if (saved.data == nullptr) return;
  if (!call.full)
    throw_shape(call.function, "a saved factorisation is for full covariances (Cholesky factors) only");
  if (saved.rows != rows || saved.dim != call.dim)
    throw_shape(call.function, "the saved factorisation holds " + std::to_string(saved.rows) + " rows of d = " +
                                   std::to_string(saved.dim) + " but the batch has " + std::to_string(rows) +
                                   " rows of d = " + std::to_string(call.dim));
}

/// Every check of a backward's (VJP's) arguments that reads no row values:
/// check_derivative_arguments, each gradient view empty or shaped like its input, and the saved
/// factorisation (empty, or of this batch). Shared by the CPU and CUDA backends; returns the call
/// with d set.
template <class T, class Grads, class D = const double>
gaussian_call check_backward_arguments(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                       batch_view<const T> old_mean, batch_view<const T> old_cov,
                                       batch_view<const T> out_mean, batch_view<const T> out_cov,
                                       batch_view<const T> grad_out_mean, batch_view<const T> grad_out_cov,
                                       const void* stats, double eps_mean, double eps_cov, const Grads& grads,
                                       const gaussian::saved_factorisation<D>& saved = {}) {
  call = check_derivative_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, grad_out_mean,
                                    grad_out_cov, stats, eps_mean, eps_cov);
  check_optional_view(call.function, "grads.mean", grads.mean, mean);
  check_optional_view(call.function, "grads.cov", grads.cov, cov);
  check_optional_view(call.function, "grads.old_mean", grads.old_mean, old_mean);
  check_optional_view(call.function, "grads.old_cov", grads.old_cov, old_cov);
  check_saved_factorisation(call, mean.rows, saved);
  return call;
}

/// The JVP's counterpart of check_backward_arguments (the input tangents by check_jvp_tangents).
template <class T, class U, class Tangents, class D = const double>
gaussian_call check_jvp_arguments(gaussian_call call, batch_view<const T> mean, batch_view<const T> cov,
                                  batch_view<const T> old_mean, batch_view<const T> old_cov,
                                  batch_view<const T> out_mean, batch_view<const T> out_cov,
                                  batch_view<U> tangent_out_mean, batch_view<U> tangent_out_cov, const void* stats,
                                  double eps_mean, double eps_cov, const Tangents& tangents,
                                  const gaussian::saved_factorisation<D>& saved = {}) {
  call = check_derivative_arguments(call, mean, cov, old_mean, old_cov, out_mean, out_cov, tangent_out_mean,
                                    tangent_out_cov, stats, eps_mean, eps_cov);
  check_jvp_tangents(call.function, tangents, mean, cov, old_mean, old_cov);
  check_saved_factorisation(call, mean.rows, saved);
  return call;
}

/// The first problem of one row's operand, as a message ("" when fine): a non-finite entry, a
/// standard deviation or factor diagonal ≤ 0, a non-zero entry above a factor's diagonal.
template <class T>
std::string gaussian_operand_problem(const gaussian_call& call, const T* mean, const T* cov, bool old) {
  const std::size_t d = call.dim;
  const char* prefix = old ? "old_" : "";
  auto message = [&](const char* operand, double x, const std::string& where, const char* why) {
    std::ostringstream msg;
    msg.precision(17);
    msg << prefix << operand << " is " << x << " at " << where << why;
    return msg.str();
  };
  for (std::size_t i = 0; i < d; ++i) {
    const double x = static_cast<double>(mean[i]);
    if (!(x - x == 0.0)) return message("mean", x, "entry " + std::to_string(i), " (must be finite)");
  }
  if (!call.full) {
    for (std::size_t i = 0; i < d; ++i) {
      const double x = static_cast<double>(cov[i]);
      if (!(x > 0.0 && x < inf()))
        return message("std_dev", x, "entry " + std::to_string(i), " (must be finite and > 0)");
    }
    return std::string();
  }
  for (std::size_t i = 0; i < d; ++i) {
    for (std::size_t j = 0; j < d; ++j) {
      const double x = static_cast<double>(cov[i * d + j]);
      const char* why = nullptr;
      if (!(x - x == 0.0)) {
        why = " (must be finite)";
      } else if (j > i && x != 0.0) {
        why = " above the diagonal (a Cholesky factor is lower-triangular)";
      } else if (j == i && !(x > 0.0)) {
        why = " on the diagonal (a Cholesky factor has a positive diagonal)";
      }
      if (why != nullptr)
        return message("cov_chol", x, "(" + std::to_string(i) + ", " + std::to_string(j) + ")", why);
    }
  }
  return std::string();
}

/// A projection's check of a row pair whose operands passed gaussian_operand_problem: the mean
/// step in the old Gaussian's whitened coordinates, y = L°⁻¹(μ̃ − μ°) (y_i = (μ̃_i − μ°_i)/σ°_i
/// for diagonal rows), must be finite, and for a split bound so must ½|y|². Where it overflows a double, KL(p̃ ‖ q) ≥ ½ y_i² is far past
/// the doubles and the projection's t* ≈ sqrt(2ε)/|y| below them: no member along the path can
/// be evaluated, so the row is refused rather than written as NaN (docs/gaussian.md, Accuracy).
/// "" when fine.
template <class T>
std::string gaussian_mean_step_problem(const gaussian_call& call, const T* mean, const T* old_mean, const T* old_cov) {
  const std::size_t d = call.dim;
  // Forward substitution with the old factor (finite, positive diagonal: checked before), its
  // steps on the stack up to d = 64 (no allocation per row on the common sizes).
  constexpr std::size_t on_stack = 64;
  double small[on_stack] = {};
  std::vector<double> large(call.full && d > on_stack ? d : 0);
  double* step = large.empty() ? small : large.data();
  double squares = 0.0;
  for (std::size_t i = 0; i < d; ++i) {
    double y = static_cast<double>(mean[i]) - static_cast<double>(old_mean[i]);
    if (call.full) {
      for (std::size_t j = 0; j < i; ++j) y -= static_cast<double>(old_cov[i * d + j]) * step[j];
      y /= static_cast<double>(old_cov[i * d + i]);
    } else {
      y /= static_cast<double>(old_cov[i]);
    }
    if (!(y - y == 0.0)) {  // a NaN only from ±inf steps
      std::ostringstream msg;
      msg.precision(17);
      msg << "the mean step " << (call.full ? "L_old^-1 (mean - old_mean)" : "(mean - old_mean) / old_std_dev")
          << " overflows a double at entry " << i << " (mean " << static_cast<double>(mean[i]) << ", old_mean "
          << static_cast<double>(old_mean[i])
          << "): KL(new || old) and the projection's t are beyond the doubles";
      return msg.str();
    }
    if (call.full) step[i] = y;
    squares += y * y;
  }
  if (call.split && !(squares < inf())) {
    // The split mean step's m = ½|y|² overflows (|y| above ~1.3e154): κ = sqrt(ε_μ/m) would be
    // taken as 0 (the old mean written, ∂/∂ε_μ lost) where the true κ = sqrt(2ε_μ)/|y| is tiny
    // but its step κ(μ̃ − μ°) is not.
    return "the split mean step's KL, 1/2 |" + std::string(call.full ? "L_old^-1 (mean - old_mean)" : "(mean - old_mean) / old_std_dev") +
           "|^2, overflows a double (|step| above ~1.3e154), which the split mean step does not support";
  }
  return std::string();
}

/// A projection's check of a row pair whose operands passed gaussian_operand_problem: no
/// coordinate's γ − 1 = 1/r² − 1 may pass the doubles (gaussian_diag_beyond: r below ~7.5e-155),
/// with r = σ̃/σ° on diagonal rows and r = L̃_ii / L°_ii on full rows (M = L°⁻¹L̃ is lower
/// triangular with that diagonal, so its smallest singular value, the square root of the smallest
/// eigenvalue λ = 1/γ of Σ°⁻¹Σ̃, is at most min r: a sufficient test, exact for diagonal factors).
/// The solve in t sees such a coordinate only through t·(γ − 1) with γ − 1 clamped, and its t*
/// lies near 1/γ, below the doubles: it would write a wrong t and a wrong KL(p̃ ‖ q) and, with
/// two such coordinates, a wrong member, while reporting `projected` (docs/gaussian.md,
/// Accuracy). KL(p̃ ‖ q) ≥ 354 there, so only a bound ε ≥ 354 could leave such a row inactive.
/// "" when fine.
template <class T>
std::string gaussian_ratio_problem(const gaussian_call& call, const T* cov, const T* old_cov) {
  const std::size_t step = call.full ? call.dim + 1 : 1;  // a factor's diagonal: entries (i, i)
  for (std::size_t i = 0; i < call.dim; ++i) {
    const double s = static_cast<double>(cov[i * step]), so = static_cast<double>(old_cov[i * step]);
    if (!gaussian_diag_beyond(s, so)) continue;
    std::ostringstream msg;
    msg.precision(17);
    if (call.full)
      msg << "cov_chol[" << i << "][" << i << "] / old_cov_chol[" << i << "][" << i << "] is " << s / so << " ("
          << s << " / " << so << ")";
    else
      msg << "std_dev / old_std_dev is " << s / so << " at entry " << i << " (std_dev " << s << ", old_std_dev "
          << so << ")";
    msg << ", below ~7.5e-155: the precision ratio 1/r^2 overflows a double, which the projection does not "
           "support";
    return msg.str();
  }
  return std::string();
}

/// What the full-covariance factorisation (cpu::factor_full) can form of a row pair: it solves
/// with the old factor, whose triangular solve multiplies by 1/L°_ii, and forms E + Eᵀ + EEᵀ with
/// E = L°⁻¹(L̃ − L°), so it needs every 1/L°_ii finite (no subnormal old diagonal below ~5.6e-309)
/// and every |E_ij| at most sqrt(DBL_MAX / (2d)) (~9.5e153/√d). Beyond either, it had written NaN
/// or inf silently (t = 0 and `not_converged`, or a `projected` row with an inf factor).
struct gaussian_full_reach {
  long long old_diag = -1;  ///< the first i whose 1/L°_ii overflows, or −1
  long long row = -1, col = -1;  ///< the first E entry beyond the bound (or not finite), or −1
  double value = 0.0;            ///< that entry (or L°_ii)
  bool fine() const { return old_diag < 0 && row < 0; }
};

/// gaussian_full_reach of a full row pair: M = L°⁻¹L̃ column by column by forward substitution with
/// divisions (exact where the reciprocal would overflow), E = M − I. O(d³/6), d doubles of
/// scratch. `m` (d² doubles, row-major, optional) receives M for the caller.
template <class T>
gaussian_full_reach gaussian_full_factor_reach(const T* chol, const T* old_chol, std::size_t d, double* m = nullptr) {
  gaussian_full_reach reach;
  for (std::size_t i = 0; i < d && reach.old_diag < 0; ++i) {
    const double lo = static_cast<double>(old_chol[i * d + i]);
    if (!(1.0 / lo < inf())) {
      reach.old_diag = static_cast<long long>(i);
      reach.value = lo;
      if (m == nullptr) return reach;
    }
  }
  const double bound = std::sqrt(largest_finite<double>() / (2.0 * static_cast<double>(d)));
  constexpr std::size_t on_stack = 64;
  double small[on_stack] = {};
  std::vector<double> large(d > on_stack ? d : 0);
  double* x = large.empty() ? small : large.data();
  for (std::size_t j = 0; j < d; ++j) {
    for (std::size_t i = j; i < d; ++i) {
      double v = static_cast<double>(chol[i * d + j]);
      for (std::size_t k = j; k < i; ++k) v -= static_cast<double>(old_chol[i * d + k]) * x[k];
      v /= static_cast<double>(old_chol[i * d + i]);
      x[i] = v;
      const double e = i == j ? v - 1.0 : v;
      if (!(std::fabs(e) <= bound) && reach.row < 0 && reach.old_diag < 0) {
        reach.row = static_cast<long long>(i);
        reach.col = static_cast<long long>(j);
        reach.value = e;
        if (m == nullptr) return reach;
      }
    }
    if (m != nullptr)
      for (std::size_t i = 0; i < d; ++i) m[i * d + j] = i >= j ? x[i] : 0.0;
  }
  return reach;
}

/// The message of a full row pair the factorisation cannot form (gaussian_full_factor_reach), or "".
inline std::string gaussian_full_reach_problem(const gaussian_full_reach& reach) {
  if (reach.fine()) return std::string();
  std::ostringstream msg;
  msg.precision(17);
  if (reach.old_diag >= 0) {
    msg << "old_cov_chol[" << reach.old_diag << "][" << reach.old_diag << "] is " << reach.value
        << ": its reciprocal overflows a double (a subnormal diagonal), which the full-covariance path does not "
           "support";
  } else {
    msg << "L_old^-1 (cov_chol - old_cov_chol) has entry (" << reach.row << ", " << reach.col << ") = "
        << reach.value
        << ", beyond ~sqrt(DBL_MAX / 2d): Sigma_old^-1 Sigma_new overflows a double, which the full-covariance "
           "projection does not support";
  }
  return msg.str();
}

/// Finds nothing: validate_gaussian_rows' default for a caller's own checks.
struct no_gaussian_extra {
  std::string operator()(std::size_t) const { return std::string(); }
};

/// Throws domain_error naming the first bad row (the smallest index, whatever the threads,
/// whatever its problem), checked row by row: its operands (gaussian_operand_problem), then, for a
/// projection or its derivatives (not kl), the mean step (gaussian_mean_step_problem) and a
/// diagonal row's ratios (gaussian_ratio_problem), then the caller's `extra(r)` (a derivative's
/// statistics and upstream operands: gaussian_derivative_extra).
template <class T, class Extra = no_gaussian_extra>
void validate_gaussian_rows(unsigned threads, const gaussian_call& call, batch_view<const T> mean,
                            batch_view<const T> cov, batch_view<const T> old_mean, batch_view<const T> old_cov,
                            Extra&& extra = Extra{}) {
  auto problem = [&](std::size_t r) {
    std::string p = gaussian_operand_problem(call, mean.row(r), cov.row(r), false);
    if (p.empty()) p = gaussian_operand_problem(call, old_mean.row(r), old_cov.row(r), true);
    if (p.empty() && !call.kl_only) p = gaussian_mean_step_problem(call, mean.row(r), old_mean.row(r), old_cov.row(r));
    if (p.empty() && !call.kl_only) p = gaussian_ratio_problem(call, cov.row(r), old_cov.row(r));
    // kl takes the rows the factorisation cannot form by its closed form instead (gaussian_kl).
    if (p.empty() && !call.kl_only && call.full)
      p = gaussian_full_reach_problem(gaussian_full_factor_reach(cov.row(r), old_cov.row(r), call.dim));
    if (p.empty()) p = extra(r);
    return p;
  };
  const std::size_t work = 4 * (call.full ? call.dim * call.dim : call.dim);
  const std::size_t bad =
      cpu::first_bad_row(threads, mean.rows, work, [&](std::size_t r) { return !problem(r).empty(); });
  if (bad != mean.rows) throw domain_error(row_prefix(call.function, bad) + problem(bad), bad);
}

/// A derivative's operands whose every entry read must be finite: the backward's upstream
/// gradients, the JVP's input tangents (docs/api.md: "a non-finite upstream gradient or tangent"
/// is a domain_error). An empty view (data null) is skipped; an operand with a factor_dim d > 0 is
/// a d×d factor of which only the lower triangle is read, and only that is checked.
template <class T>
struct finite_operands {
  const char* names[4] = {nullptr, nullptr, nullptr, nullptr};
  batch_view<const T> views[4] = {};
  std::size_t factor_dim[4] = {0, 0, 0, 0};
};

/// The backward's upstream gradients as finite_operands.
template <class T>
finite_operands<T> upstream_operands(const gaussian_call& call, batch_view<const T> grad_out_mean,
                                     batch_view<const T> grad_out_cov) {
  finite_operands<T> ops;
  ops.names[0] = "grad_out_mean", ops.views[0] = grad_out_mean;
  ops.names[1] = call.full ? "grad_out_cov_chol" : "grad_out_std_dev", ops.views[1] = grad_out_cov;
  if (call.full) ops.factor_dim[1] = call.dim;
  return ops;
}

/// The JVP's input tangents as finite_operands.
template <class T>
finite_operands<T> tangent_operands(const gaussian_call& call, const gaussian::gaussian_tangents<T>& tangents) {
  finite_operands<T> ops;
  ops.names[0] = "tangents.mean", ops.views[0] = tangents.mean;
  ops.names[1] = "tangents.cov", ops.views[1] = tangents.cov;
  ops.names[2] = "tangents.old_mean", ops.views[2] = tangents.old_mean;
  ops.names[3] = "tangents.old_cov", ops.views[3] = tangents.old_cov;
  if (call.full) ops.factor_dim[1] = ops.factor_dim[3] = call.dim;
  return ops;
}

/// The first NaN or ±inf of row r of `ops`, as a message ("" when every entry is finite).
template <class T>
std::string finite_operand_problem(const finite_operands<T>& ops, std::size_t r) {
  for (int o = 0; o < 4; ++o) {
    const batch_view<const T>& v = ops.views[o];
    if (ops.names[o] == nullptr || v.data == nullptr) continue;
    const T* row = v.row(r);
    const std::size_t d = ops.factor_dim[o];
    for (std::size_t j = 0; j < v.cols; ++j) {
      if (d > 0 && j % d > j / d) continue;  // a factor's strict upper triangle: not read
      const double x = static_cast<double>(row[j]);
      if (x - x == 0.0) continue;
      std::ostringstream msg;
      msg << ops.names[o] << " is " << x;
      if (d > 0)
        msg << " at entry (" << j / d << ", " << j % d << ")";
      else
        msg << " at entry " << j;
      msg << " (must be finite)";
      return msg.str();
    }
  }
  return std::string();
}

/// A derivative's own checks of row r, after validate_gaussian_rows' checks of the same row: its
/// forward statistics (gaussian_stats_problem; `what` names the derivative), then its upstream
/// gradients or input tangents (finite_operand_problem). Either pointer may be null (not checked).
template <class T, class Stats>
struct gaussian_derivative_extra {
  const Stats* stats = nullptr;
  const char* what = "";
  const finite_operands<T>* operands = nullptr;
  std::string operator()(std::size_t r) const {
    if (stats != nullptr) {
      std::string p = gaussian_stats_problem(stats[r], what);
      if (!p.empty()) return p;
    }
    return operands != nullptr ? finite_operand_problem(*operands, r) : std::string();
  }
};

}  // namespace detail
TROLL_END_NAMESPACE
