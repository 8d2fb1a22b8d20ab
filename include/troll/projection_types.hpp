// troll/projection_types.hpp — the options and per-row statistics of the trust-region projection.
// Plain aggregates, trivially copyable, identical on host and device.
#pragma once

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
};

/// The status as a lower-case word ("inactive", "projected", ...), for logs and reports.
TROLL_HOST_DEVICE inline const char* status_name(row_status s) {
  switch (s) {
    case row_status::inactive: return "inactive";
    case row_status::projected: return "projected";
    case row_status::restricted: return "restricted";
    case row_status::infeasible: return "infeasible";
    case row_status::rejected: return "rejected";
  }
  return "unknown";
}

/// Controls of the scalar root solve. The Newton iteration stops once
///     |KL(π_t ‖ q) − ε| ≤ atol + rtol · ε,
/// or when the bracket around t* has shrunk to a few ulps (then the feasible end is returned).
/// The defaults sit well inside troll's documented guarantee (rtol 1e-10, atol 1e-13 in double)
/// because every reduction runs in double, for float inputs too.
struct projection_options {
  double rtol = 1e-12;
  double atol = 1e-15;
  int max_iterations = 50;
};

/// Per-row results of the forward projection, consumed by the backward passes.
/// η = (1 − t)/t; μ and σ² are the mean and variance of d = z̃ − z° under π* (at t*), in
/// absolute units. `iterations` counts the Newton evaluations (the two bracket-end evaluations
/// at t = 0 and t = 1 are not counted; 0 for inactive and restricted rows).
struct projection_stats {
  double eta = 0.0;
  double t = 1.0;
  double kl_before = 0.0;  ///< KL(p̃ ‖ q); +inf when p̃ has mass where q has none
  double kl_after = 0.0;   ///< KL(π* ‖ q)
  double mu = 0.0;
  double sigma2 = 0.0;
  int iterations = 0;
  row_status status = row_status::inactive;

  TROLL_HOST_DEVICE bool active() const { return status != row_status::inactive; }
};

TROLL_END_NAMESPACE
