// troll/detail/cpu/offset_rows.hpp — the projection's derivatives on rows whose logit difference
// d = z̃ − z° sits far from the origin against its own spread (|μ| ≫ σ): an old row shifted by
// 1e20, or new logits near 3e38 against small old ones.
//
// The derivative kernels form d_j − μ from the logits as given. Where |d_j| ≫ σ every d_j is
// rounded to ulp(|d_j|) before μ is subtracted: at d ≈ 1e20 that is 16384 per token, a different
// error on each, which no common re-centring (backward_kernels.hpp, Centring) removes. The
// forward is right on such rows (it works with shifted logits), the derivatives were silently
// wrong (∂/∂ε with the wrong sign at an old-row shift of 1e16, exactly 0 beyond 1e20).
//
// Such rows are differentiated here from copies in double relative to one reference token k (the
// largest log π*): z̃'_j = z̃_j − z̃_k and z°'_j = z°_j − z°_k, which the common shift leaves exact,
// and μ' = Σ_J π_j (z̃'_j − z°'_j) / Σ_J π_j, the same mean in those units. Softmax, π and every
// derivative are invariant under the shifts, so the same kernels (T = double) give the row's
// derivatives, which are then stored in T. The test: |μ| > 2^20 σ (below it d_j − μ keeps
// ~2^-33 σ, ~1e-10 of the spread). Rare rows; the common ones do not pay for it.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../centring_reference.hpp"
#include "../numeric.hpp"
#include "backward_kernels.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// One thread's copies of an offset row (reused from row to row: no allocation once grown).
struct offset_row_copies {
  std::vector<double> zn, zo, logp, first, second, out_first, out_second;
  projection_stats stats{};
};

inline offset_row_copies& offset_copies() {
  thread_local offset_row_copies copies;
  return copies;
}

template <class T>
inline void copy_to_double(const T* x, std::size_t size, std::vector<double>& out) {
  out.resize(size);
  for (std::size_t j = 0; j < size; ++j) out[j] = static_cast<double>(x[j]);
}

/// Stores `values` in T; false when one does not fit T (the caller reports the row).
template <class T>
inline bool store_fitting(const std::vector<double>& values, T* out) {
  bool fits = true;
  for (std::size_t j = 0; j < values.size(); ++j) {
    const T x = static_cast<T>(values[j]);
    fits &= x - x == T(0);
    out[j] = x;
  }
  return fits;
}

/// The reference of a row (centring_reference.hpp): plain, or the token with the largest log π*
/// and μ' for an offset row.
template <class T>
inline centring_reference reference_of(const T* zn, const T* zo, const T* logp, std::size_t size,
                                       const projection_stats& s) {
  centring_reference r = plain_reference(s);
  if (!offset_row(s)) return r;
  std::size_t k = 0;
  double best = neg_inf();
  for (std::size_t j = 0; j < size; ++j) {
    const double v = static_cast<double>(logp[j]);
    if (v > best) {
      best = v;
      k = j;
    }
  }
  // k is on J (a projected row has mass somewhere), so both its logits are finite.
  r.offset = true;
  r.new_ref = static_cast<double>(zn[k]);
  r.old_ref = static_cast<double>(zo[k]);
  double weighted = 0.0, mass = 0.0;
  for (std::size_t j = 0; j < size; ++j) {
    const double v = static_cast<double>(logp[j]);
    if (!(v > neg_inf())) continue;
    const double p = std::exp(v);
    weighted += p * r.difference(static_cast<double>(zn[j]), static_cast<double>(zo[j]));
    mass += p;
  }
  r.mu = weighted / mass;
  return r;
}

/// The row's logits relative to its reference token, log π* in double and μ' (top of this file).
template <class T>
inline void load_offset_row(const T* zn, const T* zo, const T* logp, std::size_t size, const projection_stats& s,
                            offset_row_copies& c) {
  const centring_reference r = reference_of(zn, zo, logp, size, s);
  c.zn.resize(size);
  c.zo.resize(size);
  c.logp.resize(size);
  for (std::size_t j = 0; j < size; ++j) {
    c.zn[j] = static_cast<double>(zn[j]) - r.new_ref;
    c.zo[j] = static_cast<double>(zo[j]) - r.old_ref;
    c.logp[j] = static_cast<double>(logp[j]);
  }
  c.stats = s;
  c.stats.mu = r.mu;
}

/// vjp_row of an offset row (same contract).
template <class T>
inline bool vjp_offset_row(const T* zn, const T* zo, const T* logp, const T* g, std::size_t size,
                           const projection_stats& s, T* grad_new, T* grad_old, double* grad_eps,
                           double pi_ulps = two_point_pi_ulps<T>()) {
  offset_row_copies& c = offset_copies();
  load_offset_row(zn, zo, logp, size, s, c);
  copy_to_double(g, size, c.first);
  c.out_first.resize(size);
  c.out_second.resize(grad_old ? size : 0);
  const bool done = vjp_row<double>(c.zn.data(), c.zo.data(), c.logp.data(), c.first.data(), size, c.stats,
                                    c.out_first.data(), grad_old ? c.out_second.data() : nullptr, grad_eps,
                                    nullptr, pi_ulps);
  bool fits = store_fitting(c.out_first, grad_new);
  if (grad_old) fits &= store_fitting(c.out_second, grad_old);
  return done && fits && fits_in<T>(*grad_eps);
}

/// jvp_row of an offset row (same contract).
template <class T>
inline bool jvp_offset_row(const T* zn, const T* zo, const T* logp, const T* tn, const T* to, double eps_dot,
                           std::size_t size, const projection_stats& s, T* out) {
  offset_row_copies& c = offset_copies();
  load_offset_row(zn, zo, logp, size, s, c);
  copy_to_double(tn, size, c.first);
  if (to) copy_to_double(to, size, c.second);
  c.out_first.resize(size);
  const bool done = jvp_row<double>(c.zn.data(), c.zo.data(), c.logp.data(), c.first.data(),
                                    to ? c.second.data() : nullptr, eps_dot, size, c.stats, c.out_first.data());
  return store_fitting(c.out_first, out) && done;
}

/// jacobian_row of an offset row (same contract; V² doubles of copies per wanted block).
template <class T>
inline bool jacobian_offset_row(const T* zn, const T* zo, const T* logp, std::size_t size, const projection_stats& s,
                                T* jac_new, T* jac_old, T* jac_eps) {
  offset_row_copies& c = offset_copies();
  load_offset_row(zn, zo, logp, size, s, c);
  std::vector<double> new_block(size * size), old_block(jac_old ? size * size : 0), eps_block(jac_eps ? size : 0);
  const bool done = jacobian_row<double>(c.zn.data(), c.zo.data(), c.logp.data(), size, c.stats, new_block.data(),
                                         jac_old ? old_block.data() : nullptr, jac_eps ? eps_block.data() : nullptr);
  bool fits = store_fitting(new_block, jac_new);
  if (jac_old) fits &= store_fitting(old_block, jac_old);
  if (jac_eps) fits &= store_fitting(eps_block, jac_eps);
  return done && fits;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
