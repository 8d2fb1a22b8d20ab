// troll/detail/gaussian_jacobi.hpp — the symmetric eigendecomposition of a full Gaussian row's
// whitened covariance excess (gaussian_family.hpp) by cyclic Jacobi rotations in parallel
// ("round-robin") order, written once for host and device as team steps
// (gaussian_matrix_steps.hpp): each round rotates d/2 disjoint planes (p, q) at once, so a
// block of threads works on all of them between two barriers; d − 1 rounds (d rounded up to
// even, the extra index a no-op) visit every plane once per sweep. Sweeps stop when the
// off-diagonal mass is below (1e-18 ‖A‖_F)², as the warp version (cuda/gaussian_kernels.cuh).
#pragma once

#include <cmath>

#include "../config.hpp"
#include "gaussian_matrix_steps.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Doubles of scratch jacobi_eigen needs besides A and V: c and s of each plane of a round.
TROLL_HOST_DEVICE constexpr int jacobi_scratch_doubles(int d) { return 2 * ((d + 1) / 2); }

/// The pair k of round `round` of the round-robin tournament of n (even) players: player 0 stays,
/// the others rotate; pair k is (position k, position n − 1 − k).
TROLL_HOST_DEVICE inline void jacobi_pair(int n, int round, int k, int* p, int* q) {
  auto player = [&](int pos) { return pos == 0 ? 0 : (pos - 1 + round) % (n - 1) + 1; };
  const int x = player(k), y = player(n - 1 - k);
  *p = x < y ? x : y;
  *q = x < y ? y : x;
}

/// The rotation (c, s) that zeroes a_pq ≠ 0 of a symmetric A: t = sgn(τ)/(|τ| + √(1 + τ²)) with
/// τ = (a_qq − a_pp)/(2 a_pq), c = 1/√(1 + t²), s = t c.
TROLL_HOST_DEVICE inline void jacobi_rotation(double app, double aqq, double apq, double* c, double* s) {
  const double tau = (aqq - app) / (2.0 * apq);
  const double t = (tau >= 0.0 ? 1.0 : -1.0) / (::fabs(tau) + ::hypot(1.0, tau));
  *c = 1.0 / ::sqrt(1.0 + t * t);
  *s = t * *c;
}

/// (x, y) ← (c x − s y, s x + c y): one rotation applied to a pair of entries.
TROLL_HOST_DEVICE inline void rotate_pair(double* x, double* y, double c, double s) {
  const double xv = *x, yv = *y;
  *x = c * xv - s * yv;
  *y = s * xv + c * yv;
}

/// Plane k of round `round` (p < q) and its rotation (c, s) from `cs`; false where there is
/// nothing to apply (the padding index, or an identity rotation).
TROLL_HOST_DEVICE inline bool round_rotation(int n, int d, int round, int k, const double* cs, int* p, int* q,
                                             double* c, double* s) {
  jacobi_pair(n, round, k, p, q);
  *c = cs[2 * k];
  *s = cs[2 * k + 1];
  return *q < d && *s != 0.0;
}

/// Applies the rotations of round `round` to the line pairs (p, q) of the d×d `a` and, when not
/// null, `v`: entry i of line p sits at i·entry_stride + p·line_stride (columns of every row:
/// entry_stride d, line_stride 1; rows of every column: entry_stride 1, line_stride d).
template <class Team>
TROLL_HOST_DEVICE void rotate_round(const Team& tm, int n, int d, int round, int pairs, const double* cs,
                                    int entry_stride, int line_stride, double* a, double* v) {
  for (int e = tm.lane(); e < pairs * d; e += tm.size()) {
    const int i = e % d;
    int p = 0, q = 0;
    double c = 1.0, s = 0.0;
    if (!round_rotation(n, d, round, e / d, cs, &p, &q, &c, &s)) continue;
    const int at_p = i * entry_stride + p * line_stride, at_q = i * entry_stride + q * line_stride;
    rotate_pair(&a[at_p], &a[at_q], c, s);
    if (v != nullptr) rotate_pair(&v[at_p], &v[at_q], c, s);
  }
}

/// Diagonalises the symmetric row-major d×d `a` in place (eigenvalues on its diagonal) and sets
/// `v` to the eigenvectors (columns; A₀ = V diag Vᵀ). `cs` holds jacobi_scratch_doubles(d).
template <class Team>
TROLL_HOST_DEVICE void jacobi_eigen(const Team& tm, int d, double* a, double* v, double* cs) {
  const int n = d + (d & 1);
  const int pairs = n / 2;
  for (int e = tm.lane(); e < d * d; e += tm.size()) v[e] = e / d == e % d ? 1.0 : 0.0;
  tm.sync();
  for (int sweep = 0; sweep < 40 && d > 1; ++sweep) {
    double off = 0.0, total = 0.0;
    for (int e = tm.lane(); e < d * d; e += tm.size()) {
      const double x = a[e];
      total += x * x;
      if (e / d != e % d) off += x * x;
    }
    off = tm.sum(off);
    total = tm.sum(total);
    if (!(off > 1e-36 * total)) break;
    for (int round = 0; round < n - 1; ++round) {
      // The rotation of every plane from the current A (disjoint planes: no interference).
      for (int k = tm.lane(); k < pairs; k += tm.size()) {
        int p = 0, q = 0;
        jacobi_pair(n, round, k, &p, &q);
        double c = 1.0, s = 0.0;
        if (q < d) {
          const double apq = a[p * d + q];
          if (apq != 0.0) jacobi_rotation(a[p * d + p], a[q * d + q], apq, &c, &s);
        }
        cs[2 * k] = c;
        cs[2 * k + 1] = s;
      }
      tm.sync();
      // A ← A J (columns p, q of every row) and V ← V J.
      rotate_round(tm, n, d, round, pairs, cs, d, 1, a, v);
      tm.sync();
      // A ← Jᵀ A (rows p, q of every column).
      rotate_round(tm, n, d, round, pairs, cs, 1, d, a, static_cast<double*>(nullptr));
      tm.sync();
    }
  }
}

}  // namespace detail
TROLL_END_NAMESPACE
