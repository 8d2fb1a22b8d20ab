// troll/detail/gaussian_matrix_steps.hpp — small dense-matrix steps over plain row-major d×d
// arrays of doubles, written once for host and device (the full-covariance Gaussian derivatives,
// gaussian_full_derivatives.hpp, are a sequence of them).
//
// Every step is done by a "team": `lane()` of `size()` workers, each taking every size()-th
// column (or entry) of the result, `sync()` between steps and `sum(x)` over the workers in one
// fixed order. host_team is one worker (the CPU, and the host tests of these steps); the device
// uses a warp or a block (detail/cuda/gaussian_full_derivative_kernels.cuh). Every step ends
// with team.sync(), and no output may alias an input unless the step says so.
#pragma once

#include "../config.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// One worker: the host.
struct host_team {
  TROLL_HOST_DEVICE int lane() const { return 0; }
  TROLL_HOST_DEVICE int size() const { return 1; }
  TROLL_HOST_DEVICE void sync() const {}
  TROLL_HOST_DEVICE double sum(double x) const { return x; }
};

namespace steps {

/// C = α op(A) op(B) + β C (op: transpose when the flag is set). β = 0 ignores C's old value.
template <class Team>
TROLL_HOST_DEVICE void mul(const Team& tm, int d, const double* a, bool ta, const double* b, bool tb, double* c,
                           double alpha = 1.0, double beta = 0.0) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    double x = 0.0;
    for (int m = 0; m < d; ++m) x += (ta ? a[m * d + i] : a[i * d + m]) * (tb ? b[j * d + m] : b[m * d + j]);
    c[e] = beta == 0.0 ? alpha * x : alpha * x + beta * c[e];
  }
  tm.sync();
}

/// C = α A diag(x) Aᵀ + β C (symmetric).
template <class Team>
TROLL_HOST_DEVICE void mul_diag(const Team& tm, int d, const double* a, const double* x, double* c,
                                double alpha = 1.0, double beta = 0.0) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    double s = 0.0;
    for (int m = 0; m < d; ++m) s += a[i * d + m] * x[m] * a[j * d + m];
    c[e] = beta == 0.0 ? alpha * s : alpha * s + beta * c[e];
  }
  tm.sync();
}

/// C = αA + βB, elementwise (C may alias A or B).
template <class Team>
TROLL_HOST_DEVICE void axpby(const Team& tm, int n, double alpha, const double* a, double beta, const double* b,
                             double* c) {
  for (int e = tm.lane(); e < n; e += tm.size()) c[e] = alpha * a[e] + beta * b[e];
  tm.sync();
}

/// C += α(u vᵀ + v uᵀ).
template <class Team>
TROLL_HOST_DEVICE void add_rank2(const Team& tm, int d, const double* u, const double* v, double alpha, double* c) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    c[e] += alpha * (u[i] * v[j] + v[i] * u[j]);
  }
  tm.sync();
}

/// C = ½(A + Aᵀ) (C may not alias A).
template <class Team>
TROLL_HOST_DEVICE void symmetrise(const Team& tm, int d, const double* a, double* c) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    c[e] = 0.5 * (a[i * d + j] + a[j * d + i]);
  }
  tm.sync();
}

/// C = A + Aᵀ (C may not alias A).
template <class Team>
TROLL_HOST_DEVICE void plus_transpose(const Team& tm, int d, const double* a, double* c) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    c[e] = a[i * d + j] + a[j * d + i];
  }
  tm.sync();
}

/// Φ(A) in place: the lower triangle with the diagonal halved, the upper set to 0.
template <class Team>
TROLL_HOST_DEVICE void lower_half_diagonal(const Team& tm, int d, double* a) {
  for (int e = tm.lane(); e < d * d; e += tm.size()) {
    const int i = e / d, j = e % d;
    a[e] = j < i ? a[e] : j == i ? 0.5 * a[e] : 0.0;
  }
  tm.sync();
}

/// L⁻¹ of a lower-triangular L with a non-zero diagonal, column by column (forward substitution;
/// one worker per column). Linv's upper triangle is set to 0.
template <class Team>
TROLL_HOST_DEVICE void lower_inverse(const Team& tm, int d, const double* l, double* linv) {
  for (int j = tm.lane(); j < d; j += tm.size()) {
    for (int i = 0; i < d; ++i) {
      if (i < j) {
        linv[i * d + j] = 0.0;
        continue;
      }
      double x = i == j ? 1.0 : 0.0;
      for (int m = j; m < i; ++m) x -= l[i * d + m] * linv[m * d + j];
      linv[i * d + j] = x / l[i * d + i];
    }
  }
  tm.sync();
}

/// y = α op(A) x + β y (y may not alias x).
template <class Team>
TROLL_HOST_DEVICE void mul_vec(const Team& tm, int d, const double* a, bool ta, const double* x, double* y,
                               double alpha = 1.0, double beta = 0.0) {
  for (int i = tm.lane(); i < d; i += tm.size()) {
    double s = 0.0;
    for (int m = 0; m < d; ++m) s += (ta ? a[m * d + i] : a[i * d + m]) * x[m];
    y[i] = beta == 0.0 ? alpha * s : alpha * s + beta * y[i];
  }
  tm.sync();
}

/// Σ_e a_e b_e over n entries (every worker gets the same value).
template <class Team>
TROLL_HOST_DEVICE double dot(const Team& tm, int n, const double* a, const double* b) {
  double s = 0.0;
  for (int e = tm.lane(); e < n; e += tm.size()) s += a[e] * b[e];
  return tm.sum(s);
}

/// x = v (n entries).
template <class Team>
TROLL_HOST_DEVICE void fill(const Team& tm, int n, double v, double* x) {
  for (int e = tm.lane(); e < n; e += tm.size()) x[e] = v;
  tm.sync();
}

}  // namespace steps
}  // namespace detail
TROLL_END_NAMESPACE
