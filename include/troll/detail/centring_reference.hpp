// troll/detail/centring_reference.hpp — where every derivative of the projection forms
// d_j − μ from, CPU and CUDA alike (host/device).
//
// μ, the mean of d = z̃ − z° under π*, arrives in the stats in absolute units. On most rows
// c_j = (z̃_j − z°_j) − μ is formed as given. On a row whose d sits far from the origin against
// its spread (|μ| > 2^20 σ: an old row shifted by 1e20, new logits near 3e38 against small old
// ones) every d_j would be rounded to ulp(|d_j|) before μ is subtracted, a different error on
// each token that no common re-centring removes. Such rows are differentiated relative to a
// reference token k, the one with the largest log π*: c_j = ((z̃_j − z̃_k) − (z°_j − z°_k)) − μ',
// μ' = Σ_J π_j ((z̃_j − z̃_k) − (z°_j − z°_k)) / Σ_J π_j. Softmax, π* and every derivative are
// invariant under the two shifts. The CPU takes double copies of such rows
// (cpu/offset_rows.hpp); the CUDA kernels find k and μ' with two block reductions
// (cuda/offset_reference.cuh). Below 2^20 σ, d_j − μ keeps ~2^-33 σ: the plain form.
#pragma once

#include <cmath>

#include "../config.hpp"
#include "../projection_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Whether a row's derivatives are formed against a reference token (top of this file).
TROLL_HOST_DEVICE inline bool offset_row(const projection_stats& s) {
  return s.status == row_status::projected && ::fabs(s.mu) > 0x1p20 * ::sqrt(s.sigma2);
}

/// The references of a row: (0, 0, μ) for every row but the offset ones, whose references are the
/// logits of the token k with the largest log π* and mu = μ' (top of this file).
struct centring_reference {
  double new_ref = 0.0, old_ref = 0.0, mu = 0.0;
  bool offset = false;

  /// c_j = ((z̃_j − new_ref) − (z°_j − old_ref)) − mu; (z̃_j − z°_j) − μ bit for bit on plain rows.
  TROLL_HOST_DEVICE double centred(double new_logit, double old_logit) const {
    return ((new_logit - new_ref) - (old_logit - old_ref)) - mu;
  }
  /// d_j relative to the references (without μ).
  TROLL_HOST_DEVICE double difference(double new_logit, double old_logit) const {
    return (new_logit - new_ref) - (old_logit - old_ref);
  }
};

/// The plain reference of a row: (0, 0, μ).
TROLL_HOST_DEVICE inline centring_reference plain_reference(const projection_stats& s) {
  centring_reference r;
  r.mu = s.mu;
  return r;
}

}  // namespace detail
TROLL_END_NAMESPACE
