// troll/projection_types.hpp — the options and per-row statistics of the trust-region projection.
// Plain aggregates, trivially copyable, identical on host and device.
#pragma once

#include <cstdint>

#include "config.hpp"

TROLL_BEGIN_NAMESPACE

/// What the projection did to one row.
enum class row_status : int {
  inactive = 0,    ///< KL(p̃‖q) ≤ ε: the row is log_softmax(z̃), bit for bit.
  projected = 1,   ///< the bound was active: π* = π_t* on the boundary KL(π*‖q) = ε.
  restricted = 2,  ///< p̃ had mass where q has none, but p̃ restricted to supp(q) and
                   ///< renormalised already satisfies the bound: π* is that restriction (t = 1).
  infeasible = 3,  ///< no reachable π satisfies the bound (see infeasible_error). CPU entry points
                   ///< throw instead of reporting this; it exists for device-side status words.
  rejected = 4,    ///< the row failed input validation on the device (NaN / +inf logits, an
                   ///< all −inf row, ...); its outputs are NaN. CPU entry points throw instead.
  not_converged = 5,  ///< the solver stopped (max_iterations, or t* resolved to adjacent doubles)
                      ///< before |KL(π‖q) − ε| ≤ atol + rtol·ε: the row holds its best feasible
                      ///< member (KL(π‖q) < ε, so the trust region holds) but is not π*. Every
                      ///< backward rejects it.
};

/// The status as a lower-case word ("inactive", "projected", ...), for logs and reports.
TROLL_HOST_DEVICE inline const char* status_name(row_status s) {
  switch (s) {
    case row_status::inactive: return "inactive";
    case row_status::projected: return "projected";
    case row_status::restricted: return "restricted";
    case row_status::infeasible: return "infeasible";
    case row_status::rejected: return "rejected";
    case row_status::not_converged: return "not_converged";
  }
  return "unknown";
}

/// Controls of the scalar root solve. A row is `projected` once
///     |KL(π_t ‖ q) − ε| ≤ atol + rtol · ε,
/// with KL evaluated in double (for float inputs too) and, where the closed form would cancel,
/// by a sum of non-negative terms; otherwise it is `not_converged`. The defaults give
/// KL(π*‖q) ∈ ε·[1 − 1e-10, 1 + 1e-10] with a margin (docs/api.md, "Accuracy"): atol = 0, so the
/// tolerance is relative down to the smallest ε. rtol and atol must be finite and ≥ 0 with a
/// positive sum, max_iterations ≥ 1.
struct projection_options {
  double rtol = 1e-11;
  double atol = 0.0;
  int max_iterations = 100;
};

/// Per-row results of the forward projection, consumed by the backward passes.
/// η = (1 − t)/t; μ and σ² are the mean and variance of d = z̃ − z° under π* (at t*), in
/// absolute units. `iterations` counts the Newton evaluations (the two bracket-end evaluations
/// at t = 0 and t = 1 are not counted; 0 for inactive and restricted rows). A last member the
/// solver predicted from the one before it instead of evaluating it counts as one.
struct projection_stats {
  double eta = 0.0;
  double t = 1.0;
  double kl_before = 0.0;  ///< KL(p̃ ‖ q); +inf when p̃ has mass where q has none
  double kl_after = 0.0;   ///< KL(π* ‖ q)
  double mu = 0.0;
  double sigma2 = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;
  /// A fingerprint of the row pair these statistics were computed from: the CPU backend's
  /// project() and TROLL objective_forward() (dense and sparse) write it, never 0; 0 means "not
  /// known" (the device, the Python package's round trip, statistics made by hand). The CPU
  /// derivatives recompute it from the rows they are given and refuse statistics whose
  /// fingerprint differs (domain_error, bad_stats: statistics of another row or call). It reads
  /// V, the buckets and a few entries, each rounded to float, so a row and its float or double
  /// copy agree; it finds mix-ups, not every edit.
  std::uint64_t row_fingerprint = 0;

  TROLL_HOST_DEVICE bool active() const { return status != row_status::inactive; }
  /// Whether the row holds the exact projection (inactive, projected or restricted).
  TROLL_HOST_DEVICE bool solved() const {
    return status == row_status::inactive || status == row_status::projected || status == row_status::restricted;
  }
};

TROLL_END_NAMESPACE
