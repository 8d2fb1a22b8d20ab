// tests/cuda/test_cuda_gradients.cu — the CUDA kl_backward, project_jvp and project_jacobian
// (troll/cuda.cuh) against the CPU backend: the shared corpus (masked tokens included), V up to
// 151,936 for the O(V) derivatives and small V for the Jacobians, rejected rows with their
// reports and NaN outputs, the checked mode's exceptions, and the host-side argument checks.
//
// Without a CUDA device the "device" test suite is excluded, "SKIPPED: no CUDA device" is printed
// and only the host-side cases run. The device cases compare with the CPU backend entry by entry;
// the bounds are round-off of the same double formulas summed in another order (see each helper).
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "corpus.hpp"
#include "oracle.hpp"
#include "sparse_staging.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/objectives.hpp"
#include "troll/projection.hpp"

namespace {

using troll_test::device_array;
using troll_test::message_of;
using troll_test::test_stream;
using troll_test::unit_roundoff;

using troll_test::minus_inf;
using troll_test::nan_value;

/// Message and row of the troll exception a call throws ("" when none).
struct thrown {
  std::string message;
  std::size_t row = troll::invalid_input::npos;
};
template <class Call>
thrown catch_invalid(Call&& call) {
  thrown t;
  try {
    call();
  } catch (const troll::invalid_input& e) {
    t.message = e.what();
    t.row = e.row();
  }
  return t;
}

using troll_test::finite_scale;

/// Absolute round-off of a log-probability (log-sum-exp) formed on one backend or the other: a
/// few double ulps of the logits' scale, growing with the length of the sums (blocked on the CPU,
/// strided over 256 threads on the device).
double log_sum_spread(double scale, std::size_t cols) {
  return (256.0 + 8.0 * std::sqrt(static_cast<double>(cols))) * unit_roundoff<double>() * (1.0 + scale);
}

/// Rows of one corpus block as a packed batch (row stride V + 3, NaN padding).
template <class T>
struct pair_block {
  std::size_t rows = 0, cols = 0, stride = 0;
  std::vector<T> fresh, old;
  std::vector<std::string> labels;
  const T* new_row(std::size_t r) const { return fresh.data() + r * stride; }
  const T* old_row(std::size_t r) const { return old.data() + r * stride; }
};

template <class T>
pair_block<T> pack_rows(const std::vector<const troll_test::row_pair*>& rows, std::size_t cols) {
  pair_block<T> b;
  b.rows = rows.size();
  b.cols = cols;
  b.stride = cols + 3;
  b.fresh = troll_test::pack<T>(rows, true, b.stride, static_cast<T>(nan_value));
  b.old = troll_test::pack<T>(rows, false, b.stride, static_cast<T>(nan_value));
  for (const auto* r : rows) b.labels.push_back(r->label());
  return b;
}

template <class T>
pair_block<T> pack_pair_block(const troll_test::corpus_block& block) {
  std::vector<const troll_test::row_pair*> rows;
  for (const auto& r : block.rows) rows.push_back(&r);
  return pack_rows<T>(rows, block.cols);
}

std::vector<troll_test::row_pair> zipf_rows(std::size_t rows, std::size_t cols) {
  std::vector<troll_test::row_pair> out;
  for (std::size_t r = 0; r < rows; ++r) out.push_back(troll_test::make_row(troll_test::row_kind::zipf, cols, int(r)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// kl_backward
// ---------------------------------------------------------------------------------------------

/// kl_backward on the device for every row of `b`, compared with the CPU row by row: rows the CPU
/// rejects are reported and NaN; the others agree within the round-off of log p, log q and KL.
template <class T>
void check_kl_backward(const pair_block<T>& b, cudaStream_t stream) {
  const std::size_t rows = b.rows, cols = b.cols, stride = b.stride;
  troll_test::rng gen(0x6B1 + cols);
  std::vector<T> g(rows);
  for (T& value : g) value = static_cast<T>(gen.normal());
  device_array<T> zp(b.fresh), zq(b.old), d_g(g), gp(rows * stride), gq(rows * stride);
  device_array<troll::cuda_row_report> reports(rows);
  troll::kl_backward(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(zp.get(), rows, cols, stride),
                     troll::make_batch<const T>(zq.get(), rows, cols, stride), d_g.get(),
                     troll::make_batch(gp.get(), rows, cols, stride), troll::make_batch(gq.get(), rows, cols, stride));
  const std::vector<T> got_p = gp.download(), got_q = gq.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();

  const double u_out = 2.0 * unit_roundoff<T>();
  std::vector<T> want_p(cols), want_q(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(b.labels[r]);
    const std::string cpu_error = message_of([&] {
      troll::kl_backward(troll::cpu.with_threads(1), troll::make_batch(b.new_row(r), 1, cols),
                         troll::make_batch(b.old_row(r), 1, cols), &g[r], troll::make_batch(want_p.data(), 1, cols),
                         troll::make_batch(want_q.data(), 1, cols));
    });
    if (!cpu_error.empty()) {
      CAPTURE(cpu_error);
      CHECK(rep[r].error != troll::cuda_row_error::none);
      CHECK(std::isnan(static_cast<double>(got_p[r * stride])));
      CHECK(std::isnan(static_cast<double>(got_q[r * stride])));
      continue;
    }
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    // Host reference of log p, log q and KL in double: only the magnitudes the bound scales by.
    const T* zp_row = b.new_row(r);
    const T* zq_row = b.old_row(r);
    T kl_value = T(0);
    troll::kl(troll::cpu.with_threads(1), troll::make_batch(zp_row, 1, cols), troll::make_batch(zq_row, 1, cols),
              &kl_value);
    std::vector<double> log_p(cols), log_q(cols);
    std::vector<double> zp_d(zp_row, zp_row + cols), zq_d(zq_row, zq_row + cols);
    troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch<const double>(zp_d.data(), 1, cols),
                       troll::make_batch(log_p.data(), 1, cols));
    troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch<const double>(zq_d.data(), 1, cols),
                       troll::make_batch(log_q.data(), 1, cols));
    const double scale = std::max(finite_scale(zp_row, cols), finite_scale(zq_row, cols));
    const double spread = log_sum_spread(scale, cols);
    const double kl_spread = spread * (2.0 + std::fabs(static_cast<double>(kl_value)));
    const double gr = std::fabs(static_cast<double>(g[r]));
    for (std::size_t i = 0; i < cols; ++i) {
      const double p = log_p[i] > minus_inf ? std::exp(log_p[i]) : 0.0;
      const double q = log_q[i] > minus_inf ? std::exp(log_q[i]) : 0.0;
      const double wp = want_p[i], wq = want_q[i];
      const double gp_i = got_p[r * stride + i], gq_i = got_q[r * stride + i];
      double term = 0.0;
      if (p > 0.0) term = std::fabs(log_p[i] - log_q[i] - static_cast<double>(kl_value));
      const double bound_p = gr * p * ((term + 3.0) * spread + kl_spread) + u_out * std::fabs(wp) + 1e-300;
      if (!(std::fabs(gp_i - wp) <= bound_p)) {
        FAIL_CHECK("grad_p token " << i << ": cuda " << gp_i << ", cpu " << wp << ", allowed " << bound_p);
        break;
      }
      const double bound_q = gr * (p + q) * 2.0 * spread + u_out * std::fabs(wq) + 1e-300;
      if (!(std::fabs(gq_i - wq) <= bound_q)) {
        FAIL_CHECK("grad_q token " << i << ": cuda " << gq_i << ", cpu " << wq << ", allowed " << bound_q);
        break;
      }
    }
  }
}

/// Rows for kl_backward's reports: one fine row, then one of every rejection.
template <class T>
struct kl_bad_batch {
  static constexpr std::size_t rows = 8, cols = 4;
  std::vector<T> p, q, g;
  std::vector<troll::cuda_row_error> expected;
  kl_bad_batch() {
    const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
    p = {
        T(0.1), T(-0.3), T(1.2), T(0.0),  // 0: fine
        T(0.0), T(1.0),  nan,    T(0.0),  // 1: NaN in p_logits at token 2
        T(0.0), T(0.0),  T(0.0), T(0.0),  // 2: q all masked
        T(0.0), -inf,    T(1.0), -inf,    // 3: disjoint supports: KL = +inf
        T(0.0), T(1.0),  T(2.0), T(3.0),  // 4: p has mass where q is -inf: KL = +inf
        T(0.5), T(0.0),  T(0.0), T(0.0),  // 5: grad_kl NaN
        T(0.5), T(0.0),  T(0.0), T(0.0),  // 6: grad_kl +inf
        T(0.0), T(0.0),  T(0.0), inf,     // 7: +inf in p_logits at token 3
    };
    q = {
        T(2.0), T(0.0), T(-1.0), T(0.5),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        -inf,   -inf,   -inf,    -inf,    //
        -inf,   T(0.0), -inf,    T(0.0),  //
        T(0.0), T(0.0), -inf,    T(0.0),  //
        T(0.0), T(1.0), T(0.0),  T(0.0),  //
        T(0.0), T(1.0), T(0.0),  T(0.0),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
    };
    g = {T(1.5), T(1), T(1), T(1), T(1), nan, inf, T(1)};
    using e = troll::cuda_row_error;
    expected = {e::none,        e::nan_value,  e::all_masked, e::infinite_kl,
                e::infinite_kl, e::not_finite, e::not_finite, e::pos_inf};
  }
};

// ---------------------------------------------------------------------------------------------
// project_jvp and project_jacobian: the CPU forward's outputs as the device's inputs
// ---------------------------------------------------------------------------------------------

/// The rows of a block the CPU forward accepts, with its log π* and statistics.
template <class T>
struct forward_batch {
  std::size_t rows = 0, cols = 0, stride = 0;
  std::vector<T> zn, zo, logp;
  std::vector<troll::projection_stats> stats;
  std::vector<std::string> labels;

  troll::batch_view<const T> view(const std::vector<T>& v) const {
    return troll::make_batch(v.data(), rows, cols, stride);
  }
  const T* row(const std::vector<T>& v, std::size_t r) const { return v.data() + r * stride; }
};

template <class T>
forward_batch<T> cpu_forward(const std::vector<const troll_test::row_pair*>& candidates, std::size_t cols,
                             double eps) {
  std::vector<const troll_test::row_pair*> kept;
  for (const auto* pair : candidates) {
    const std::vector<T> zn = troll_test::pack<T>({pair}, true, cols), zo = troll_test::pack<T>({pair}, false, cols);
    std::vector<T> out(cols);
    troll::projection_stats st;
    const std::string err = message_of([&] {
      troll::project(troll::cpu.with_threads(1), troll::make_batch(zn.data(), 1, cols),
                     troll::make_batch(zo.data(), 1, cols), eps, troll::make_batch(out.data(), 1, cols), &st);
    });
    if (err.empty()) kept.push_back(pair);
  }
  forward_batch<T> f;
  f.rows = kept.size();
  f.cols = cols;
  f.stride = cols + 1;
  if (kept.empty()) return f;
  f.zn = troll_test::pack<T>(kept, true, f.stride, static_cast<T>(nan_value));
  f.zo = troll_test::pack<T>(kept, false, f.stride, static_cast<T>(nan_value));
  f.logp.assign(f.rows * f.stride, static_cast<T>(nan_value));
  f.stats.resize(f.rows);
  for (const auto* pair : kept) f.labels.push_back(pair->label());
  troll::project(troll::cpu, f.view(f.zn), f.view(f.zo), eps,
                 troll::make_batch(f.logp.data(), f.rows, f.cols, f.stride), f.stats.data());
  return f;
}

template <class T>
forward_batch<T> cpu_forward(const troll_test::corpus_block& block, double eps) {
  std::vector<const troll_test::row_pair*> rows;
  for (const auto& r : block.rows) rows.push_back(&r);
  return cpu_forward<T>(rows, block.cols, eps);
}

/// Host q = softmax(z°) of one row, in double.
template <class T>
std::vector<double> old_probabilities(const T* zo, std::size_t cols) {
  std::vector<double> z(zo, zo + cols), log_q(cols), q(cols);
  troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch<const double>(z.data(), 1, cols),
                     troll::make_batch(log_q.data(), 1, cols));
  for (std::size_t i = 0; i < cols; ++i) q[i] = log_q[i] > minus_inf ? std::exp(log_q[i]) : 0.0;
  return q;
}

/// The device JVP against the CPU JVP on `f`, with tangent_old when `with_old`.
template <class T>
void check_jvp(const forward_batch<T>& f, bool with_old, double tangent_eps, cudaStream_t stream) {
  if (f.rows == 0) return;
  const std::size_t rows = f.rows, cols = f.cols, stride = f.stride;
  troll_test::rng gen(0x7A9 + cols + (with_old ? 1 : 0));
  std::vector<T> tn(rows * stride, static_cast<T>(nan_value)), to;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t i = 0; i < cols; ++i) tn[r * stride + i] = static_cast<T>(gen.normal());
  if (with_old) {
    to.assign(rows * stride, static_cast<T>(nan_value));
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t i = 0; i < cols; ++i) to[r * stride + i] = static_cast<T>(gen.normal());
  }
  const troll::batch_view<const T> to_view = with_old ? f.view(to) : troll::batch_view<const T>{};
  std::vector<T> want(rows * stride);
  troll::project_jvp(troll::cpu, f.view(f.zn), f.view(f.zo), f.view(f.logp), f.stats.data(), f.view(tn), to_view,
                     tangent_eps, troll::make_batch(want.data(), rows, cols, stride));

  device_array<T> d_zn(f.zn), d_zo(f.zo), d_logp(f.logp), d_tn(tn), d_to(with_old ? to : std::vector<T>(1));
  device_array<troll::projection_stats> d_stats(f.stats);
  device_array<T> d_out(rows * stride);
  device_array<troll::cuda_row_report> reports(rows);
  const auto dview = [&](const device_array<T>& a) { return troll::make_batch<const T>(a.get(), rows, cols, stride); };
  troll::project_jvp(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), dview(d_zn), dview(d_zo), dview(d_logp), d_stats.get(), dview(d_tn),
                     with_old ? dview(d_to) : troll::batch_view<const T>{}, tangent_eps,
                     troll::make_batch(d_out.get(), rows, cols, stride));
  const std::vector<T> got = d_out.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();

  const double rel = 1024.0 * unit_roundoff<double>(), u_out = 2.0 * unit_roundoff<T>();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(f.labels[r]);
    CAPTURE(with_old);
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    const troll::projection_stats& s = f.stats[r];
    const bool projected = s.status == troll::row_status::projected;
    const double t = projected ? s.t : 1.0;
    const T* zn = f.row(f.zn, r);
    const T* zo = f.row(f.zo, r);
    const T* lp = f.row(f.logp, r);
    const std::vector<double> q = projected && with_old ? old_probabilities(zo, cols) : std::vector<double>();
    // Magnitudes of the sums each output entry is built from.
    double abs_pi_tn = 0.0, abs_pi_to = 0.0, abs_t_dot = 0.0;
    for (std::size_t i = 0; i < cols; ++i) {
      const double u = tn[r * stride + i], v = with_old ? double(to[r * stride + i]) : 0.0;
      const bool on = double(lp[i]) > minus_inf;
      const double pi = on ? std::exp(double(lp[i])) : 0.0;
      const double c = on ? std::fabs(double(zn[i]) - double(zo[i]) - s.mu) : 0.0;
      abs_pi_tn += pi * std::fabs(u);
      abs_pi_to += pi * std::fabs(v);
      if (projected) abs_t_dot += t / s.sigma2 * pi * c * std::fabs(u);
      if (projected && with_old && double(zo[i]) > minus_inf)
        abs_t_dot += ((1.0 - t) * t * pi * c + pi + q[i]) / (t * s.sigma2) * std::fabs(v);
    }
    if (projected) abs_t_dot += std::fabs(tangent_eps) / (t * s.sigma2);
    const double scale = std::max(finite_scale(zn, cols), finite_scale(zo, cols));
    for (std::size_t i = 0; i < cols; ++i) {
      const std::size_t k = r * stride + i;
      const double w = want[k], value = got[k];
      if (!(double(lp[i]) > minus_inf)) {
        if (!(value == 0.0)) {
          FAIL_CHECK("masked token " << i << ": cuda " << value << ", cpu " << w);
          break;
        }
        continue;
      }
      const double c = std::fabs(double(zn[i]) - double(zo[i]) - s.mu) + scale * unit_roundoff<double>();
      double magnitude = t * (std::fabs(double(tn[k])) + abs_pi_tn) + c * abs_t_dot;
      if (projected && with_old) magnitude += (1.0 - t) * (std::fabs(double(to[k])) + abs_pi_to);
      const double bound = rel * (1.0 + scale) * magnitude + u_out * std::fabs(w);
      if (!(std::fabs(value - w) <= bound)) {
        FAIL_CHECK("token " << i << ": cuda " << value << ", cpu " << w << ", allowed " << bound);
        break;
      }
    }
  }
}

/// The device Jacobians against the CPU's on `f` (small V), with or without jac_old / jac_eps.
template <class T>
void check_jacobian(const forward_batch<T>& f, bool with_old, bool with_eps, cudaStream_t stream) {
  if (f.rows == 0) return;
  const std::size_t rows = f.rows, cols = f.cols, stride = f.stride, block = cols * cols;
  std::vector<T> want_new(rows * block), want_old(rows * block), want_eps(rows * cols);
  troll::project_jacobian(troll::cpu, f.view(f.zn), f.view(f.zo), f.view(f.logp), f.stats.data(), want_new.data(),
                          with_old ? want_old.data() : nullptr, with_eps ? want_eps.data() : nullptr);

  device_array<T> d_zn(f.zn), d_zo(f.zo), d_logp(f.logp);
  device_array<troll::projection_stats> d_stats(f.stats);
  device_array<T> d_new(rows * block), d_old(rows * block), d_eps(rows * cols);
  device_array<unsigned char> workspace(troll::project_jacobian_workspace_bytes(rows, cols));
  device_array<troll::cuda_row_report> reports(rows);
  const auto dview = [&](const device_array<T>& a) { return troll::make_batch<const T>(a.get(), rows, cols, stride); };
  troll::project_jacobian(troll::cuda.on(stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get()}), dview(d_zn), dview(d_zo), dview(d_logp), d_stats.get(), d_new.get(), with_old ? d_old.get() : nullptr,
                          with_eps ? d_eps.get() : nullptr);
  const std::vector<T> got_new = d_new.download(), got_old = d_old.download(), got_eps = d_eps.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();

  const double rel = 1024.0 * unit_roundoff<double>(), u_out = 2.0 * unit_roundoff<T>();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(f.labels[r]);
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    const troll::projection_stats& s = f.stats[r];
    const bool projected = s.status == troll::row_status::projected;
    const double t = projected ? s.t : 1.0, var = projected ? s.sigma2 : 1.0;
    const T* zn = f.row(f.zn, r);
    const T* zo = f.row(f.zo, r);
    const T* lp = f.row(f.logp, r);
    const std::vector<double> q = old_probabilities(zo, cols);
    const double scale = std::max(finite_scale(zn, cols), finite_scale(zo, cols)) + 1.0;
    std::vector<double> pi(cols), c(cols);
    for (std::size_t i = 0; i < cols; ++i) {
      const bool on = double(lp[i]) > minus_inf;
      pi[i] = on ? std::exp(double(lp[i])) : 0.0;
      c[i] = on ? std::fabs(double(zn[i]) - double(zo[i]) - s.mu) + scale * unit_roundoff<double>() : 0.0;
    }
    bool failed = false;
    for (std::size_t i = 0; i < cols && !failed; ++i) {
      for (std::size_t j = 0; j < cols && !failed; ++j) {
        const std::size_t k = r * block + i * cols + j;
        const double mag_new = t * (1.0 + pi[j]) + (projected ? t * c[i] * c[j] * pi[j] / var : 0.0);
        const double bn = rel * scale * mag_new + u_out * std::fabs(double(want_new[k]));
        if (!(std::fabs(double(got_new[k]) - double(want_new[k])) <= bn)) {
          FAIL_CHECK("jac_new (" << i << ", " << j << "): cuda " << got_new[k] << ", cpu " << want_new[k]);
          failed = true;
        }
        if (!with_old) continue;
        const double dt_mag = ((1.0 - t) * t * pi[j] * c[j] + pi[j] + q[j]) / (t * var);
        const double mag_old = projected ? (1.0 - t) * (1.0 + pi[j]) + c[i] * dt_mag : 0.0;
        const double bo = rel * scale * mag_old + u_out * std::fabs(double(want_old[k]));
        if (!(std::fabs(double(got_old[k]) - double(want_old[k])) <= bo)) {
          FAIL_CHECK("jac_old (" << i << ", " << j << "): cuda " << got_old[k] << ", cpu " << want_old[k]);
          failed = true;
        }
      }
      if (with_eps && !failed) {
        const std::size_t k = r * cols + i;
        const double be = rel * scale * (projected ? c[i] / (t * var) : 0.0) + u_out * std::fabs(double(want_eps[k]));
        if (!(std::fabs(double(got_eps[k]) - double(want_eps[k])) <= be)) {
          FAIL_CHECK("jac_eps " << i << ": cuda " << got_eps[k] << ", cpu " << want_eps[k]);
          failed = true;
        }
      }
    }
  }
}

/// Forward inputs for the derivatives' reports: two good rows (projected, inactive) solved by the
/// CPU, then one rejection per row, each in the CPU's order of checks.
template <class T>
struct derivative_bad_batch {
  static constexpr std::size_t rows = 8, cols = 4;
  std::vector<T> zn, zo, logp, tn, to;
  std::vector<troll::projection_stats> stats;
  std::vector<troll::cuda_row_error> expected;  // for project_jvp with tangent_old
  std::vector<int> operand;

  derivative_bad_batch() {
    const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
    const std::vector<T> good_new = {T(0.1), T(-0.3), T(1.2), T(0.0)}, good_old = {T(2.0), T(0.0), T(-1.0), T(0.5)};
    const std::vector<T> flat(cols, T(0));
    // Rows 0 (projected) and 1 (inactive) from the CPU forward; the others copy row 0.
    std::vector<T> fwd_new = good_new, fwd_old = good_old;
    fwd_new.insert(fwd_new.end(), flat.begin(), flat.end());
    fwd_old.insert(fwd_old.end(), flat.begin(), flat.end());
    std::vector<T> fwd_out(2 * cols);
    std::vector<troll::projection_stats> fwd_stats(2);
    troll::project(troll::cpu, troll::make_batch<const T>(fwd_new.data(), 2, cols),
                   troll::make_batch<const T>(fwd_old.data(), 2, cols), 0.05, troll::make_batch(fwd_out.data(), 2, cols),
                   fwd_stats.data());
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t from = r == 1 ? 1 : 0;
      zn.insert(zn.end(), fwd_new.begin() + from * cols, fwd_new.begin() + (from + 1) * cols);
      zo.insert(zo.end(), fwd_old.begin() + from * cols, fwd_old.begin() + (from + 1) * cols);
      logp.insert(logp.end(), fwd_out.begin() + from * cols, fwd_out.begin() + (from + 1) * cols);
      stats.push_back(fwd_stats[from]);
      for (std::size_t i = 0; i < cols; ++i) {
        tn.push_back(static_cast<T>(0.25 * double(i) - 0.3));
        to.push_back(static_cast<T>(0.5 - 0.2 * double(i)));
      }
    }
    zn[2 * cols + 1] = nan;             // 2: NaN in new_logits at token 1
    zo[3 * cols + 2] = inf;             // 3: +inf in old_logits at token 2
    stats[4].sigma2 = -1.0;             // 4: bad sigma2 (field 1)
    stats[5].kl_after = nan_value;      // 5: bad kl_after (field 4)
    tn[6 * cols + 3] = -inf;            // 6: tangent_new infinite at token 3
    to[7 * cols + 0] = nan;             // 7: tangent_old NaN at token 0
    using e = troll::cuda_row_error;
    expected = {e::none, e::none, e::nan_value, e::pos_inf, e::bad_stats, e::bad_stats, e::not_finite, e::not_finite};
    operand = {0, 0, 0, 1, 1, 4, 2, 3};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-only cases: they run with or without a device.
// ---------------------------------------------------------------------------------------------

TEST_CASE("cuda kl_backward, project_jvp and project_jacobian check their arguments on the host") {
  // Dangling but non-null "device" pointers: none of these calls may touch them.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  void* fake_workspace = reinterpret_cast<void*>(std::uintptr_t(1024));
  troll::projection_stats* fake_stats = reinterpret_cast<troll::projection_stats*>(std::uintptr_t(512));
  const auto a = troll::make_batch<const float>(fake, 3, 5);
  const auto out = troll::make_batch(fake, 3, 5);
  const auto narrow = troll::make_batch(fake, 3, 4);
  const auto none = troll::input_view<float>{};

  // kl_backward
  CHECK_THROWS_AS(troll::kl_backward(troll::cuda, a, troll::make_batch<const float>(fake, 2, 5), fake, out, out),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::kl_backward<float>(troll::cuda, a, a, nullptr, out, out), troll::shape_error);
  CHECK_THROWS_AS(troll::kl_backward(troll::cuda, a, a, fake, narrow, out), troll::shape_error);
  CHECK_THROWS_AS(troll::kl_backward(troll::cuda, a, a, fake, out, narrow), troll::shape_error);
  CHECK_THROWS_AS(troll::kl_backward(troll::cuda, a, a, fake, out, troll::make_batch(fake, 3, 5, 4)),
                  troll::shape_error);
  // project_jvp
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, none, 0.0, narrow), troll::shape_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, none, std::nan(""), out),
                  troll::domain_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, none, HUGE_VAL, out), troll::domain_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, fake_stats, none, none, 0.0, out), troll::shape_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, troll::make_batch<const float>(fake, 3, 4),
                                     0.0, out),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, a, nullptr, a, a, 0.0, out), troll::shape_error);
  CHECK_THROWS_AS(troll::project_jvp(troll::cuda, a, a, narrow, fake_stats, a, a, 0.0, out), troll::shape_error);
  // project_jacobian
  CHECK_THROWS_AS(troll::project_jacobian<float>(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), a, a, a, fake_stats, nullptr),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::project_jacobian(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), a, a, a, nullptr, fake), troll::shape_error);
  CHECK_THROWS_AS(troll::project_jacobian(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), a, narrow, a, fake_stats, fake),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::project_jacobian(troll::cuda, a, a, a, fake_stats, fake), troll::shape_error);  // no workspace
  CHECK_THROWS_AS(troll::project_jacobian(troll::cuda.with_workspace(reinterpret_cast<void*>(std::uintptr_t(1028)),
                                                                     std::size_t(1) << 30),
                                          a, a, a, fake_stats, fake),
                  troll::shape_error);
  // An undersized workspace is refused on the host, naming both sizes, before anything is enqueued.
  const std::size_t need = troll::workspace_bytes(troll::cuda, troll::op::project_jacobian{}, 3, 5);
  CHECK(message_of([&] {
          troll::project_jacobian(troll::cuda.with_workspace(fake_workspace, need - 1), a, a, a, fake_stats, fake);
        }) == "troll::project_jacobian: workspace holds " + std::to_string(need - 1) + " bytes but the call needs " +
                  std::to_string(need) + " (troll::workspace_bytes)");
  static_assert(troll::project_jacobian_workspace_bytes(0, 7) == 0, "no rows, no workspace");
  CHECK(troll::project_jacobian_workspace_bytes(3, 5) >= 3 * (2 * sizeof(double) + sizeof(int)));

  // The CPU's messages, word for word (the CPU throws these before reading any data).
  const auto same_message = [](auto&& cpu_call, auto&& cuda_call) {
    const thrown cpu = catch_invalid(cpu_call), cuda = catch_invalid(cuda_call);
    CHECK(!cpu.message.empty());
    CHECK(cuda.message == cpu.message);
  };
  same_message([&] { troll::kl_backward<float>(troll::cpu, a, a, nullptr, out, out); },
               [&] { troll::kl_backward<float>(troll::cuda, a, a, nullptr, out, out); });
  same_message([&] { troll::kl_backward(troll::cpu, a, a, fake, out, narrow); },
               [&] { troll::kl_backward(troll::cuda, a, a, fake, out, narrow); });
  same_message([&] { troll::project_jvp(troll::cpu, a, a, a, fake_stats, a, none, std::nan(""), out); },
               [&] { troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, none, std::nan(""), out); });
  same_message([&] { troll::project_jvp(troll::cpu, a, a, a, fake_stats, none, none, 0.0, out); },
               [&] { troll::project_jvp(troll::cuda, a, a, a, fake_stats, none, none, 0.0, out); });
  same_message([&] { troll::project_jvp(troll::cpu, a, a, a, fake_stats, a, troll::make_batch<const float>(fake, 2, 5), 0.0, out); },
               [&] { troll::project_jvp(troll::cuda, a, a, a, fake_stats, a, troll::make_batch<const float>(fake, 2, 5), 0.0, out); });
  same_message([&] { troll::project_jacobian<float>(troll::cpu, a, a, a, fake_stats, nullptr); },
               [&] { troll::project_jacobian<float>(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), a, a, a, fake_stats, nullptr); });
  same_message([&] { troll::project_jacobian(troll::cpu, a, a, a, nullptr, fake); },
               [&] { troll::project_jacobian(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), a, a, a, nullptr, fake); });
  const troll::batch_view<const float> huge{fake, std::size_t(1) << 20, std::size_t(1) << 22, std::size_t(1) << 22};
  same_message([&] { troll::project_jacobian(troll::cpu, huge, huge, huge, fake_stats, fake); },
               [&] { troll::project_jacobian(troll::cuda.with_workspace(fake_workspace, std::size_t(1) << 30), huge, huge, huge, fake_stats, fake); });

  // An empty batch enqueues nothing (and so needs no device), checked mode included.
  const auto empty = troll::make_batch<const float>(nullptr, 0, 5);
  const auto empty_out = troll::make_batch<float>(nullptr, 0, 5);
  CHECK_NOTHROW(troll::kl_backward<float>(troll::cuda.checked(), empty, empty, nullptr, empty_out, empty_out));
  CHECK_NOTHROW(troll::project_jvp(troll::cuda, empty, empty, empty, nullptr, empty, empty, 0.0, empty_out));
  CHECK_NOTHROW(troll::project_jacobian<float>(troll::cuda, empty, empty, empty, nullptr, nullptr, nullptr));
}

TEST_CASE("the derivatives' device reports become the CPU's exceptions, message for message") {
  using e = troll::cuda_row_error;
  const troll::detail::cuda::throw_derivative_report thrower;
  const auto device_message = [&](const char* fn, const troll::cuda_row_report& report, const char* const names[3]) {
    return catch_invalid([&] { thrower(fn, 0, report, names); });
  };

  SUBCASE("kl_backward: a non-finite grad_kl, an infinite KL, bad logits") {
    const char* const names[3] = {"p_logits", "q_logits", "grad_kl"};
    kl_bad_batch<double> batch;
    const std::size_t cols = batch.cols;
    std::vector<double> gp(cols), gq(cols);
    for (std::size_t r = 1; r < batch.rows; ++r) {
      CAPTURE(r);
      const thrown cpu = catch_invalid([&] {
        troll::kl_backward(troll::cpu, troll::make_batch<const double>(batch.p.data() + r * cols, 1, cols),
                           troll::make_batch<const double>(batch.q.data() + r * cols, 1, cols), &batch.g[r],
                           troll::make_batch(gp.data(), 1, cols), troll::make_batch(gq.data(), 1, cols));
      });
      // The report the kernel writes for this row.
      troll::cuda_row_report report{batch.expected[r], 0, 0, 0.0};
      if (r == 1) report.token = 2;
      if (r == 2) report.operand = 1;
      if (r == 5 || r == 6) report.operand = 2, report.token = ~0ull, report.value = batch.g[r];  // one per row
      if (r == 7) report.token = 3;
      const thrown cuda = device_message("kl_backward", report, names);
      CHECK(!cpu.message.empty());
      CHECK(cuda.message == cpu.message);
      CHECK(cuda.row == 0);
    }
    CHECK_THROWS_AS(thrower("kl_backward", 3, {e::infinite_kl, 0, 0, 0.0}, names), troll::domain_error);
  }

  SUBCASE("project_jvp and project_jacobian: logits, stats (kl_after included), tangents") {
    const char* const names[3] = {"new_logits", "old_logits", "tangent_new"};
    derivative_bad_batch<double> batch;
    const std::size_t cols = batch.cols;
    std::vector<double> out(cols), jac(cols * cols);
    for (std::size_t r = 2; r < batch.rows; ++r) {
      CAPTURE(r);
      const auto row = [&](const std::vector<double>& v) { return troll::make_batch<const double>(v.data() + r * cols, 1, cols); };
      const thrown cpu = catch_invalid([&] {
        troll::project_jvp(troll::cpu, row(batch.zn), row(batch.zo), row(batch.logp), &batch.stats[r], row(batch.tn),
                           row(batch.to), 0.5, troll::make_batch(out.data(), 1, cols));
      });
      troll::cuda_row_report report{batch.expected[r], batch.operand[r], 0, 0.0};
      if (r == 2) report.token = 1;
      if (r == 3) report.token = 2;
      if (r == 6) report.token = 3, report.value = batch.tn[6 * cols + 3];  // -inf: the message names it
      if (r == 7) report.value = batch.to[7 * cols];
      const thrown cuda = device_message("project_jvp", report, names);
      CHECK(!cpu.message.empty());
      CHECK(cuda.message == cpu.message);
      if (r <= 5) {  // no tangents: the Jacobian rejects the same rows with the same words
        const thrown cpu_jac = catch_invalid([&] {
          troll::project_jacobian(troll::cpu, row(batch.zn), row(batch.zo), row(batch.logp), &batch.stats[r],
                                  jac.data());
        });
        const thrown cuda_jac = device_message("project_jacobian", report, names);
        CHECK(!cpu_jac.message.empty());
        CHECK(cuda_jac.message == cpu_jac.message);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Device cases: skipped (filtered out) without a device.
// ---------------------------------------------------------------------------------------------

TEST_SUITE("device") {
  TEST_CASE_TEMPLATE("kl_backward matches the CPU backend over the corpus", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      CAPTURE(block.cols);
      check_kl_backward(pack_pair_block<T>(block), s.stream);
    }
  }

  TEST_CASE_TEMPLATE("kl_backward at V = 151,936 matches the CPU backend", T, float, double) {
    test_stream s;
    const std::vector<troll_test::row_pair> rows = zipf_rows(3, 151936);
    std::vector<const troll_test::row_pair*> picked;
    for (const auto& r : rows) picked.push_back(&r);
    check_kl_backward(pack_rows<T>(picked, 151936), s.stream);
  }

  TEST_CASE_TEMPLATE("kl_backward: either gradient may be skipped", T, float, double) {
    test_stream s;
    kl_bad_batch<T> batch;
    const std::size_t cols = batch.cols;
    device_array<T> zp(batch.p), zq(batch.q), g(batch.g), both(cols), only(cols);
    const auto p = troll::make_batch<const T>(zp.get(), 1, cols), q = troll::make_batch<const T>(zq.get(), 1, cols);
    troll::kl_backward(troll::cuda.on(s.stream), p, q, g.get(), troll::make_batch(both.get(), 1, cols),
                       troll::batch_view<T>{});
    troll::kl_backward(troll::cuda.on(s.stream), p, q, g.get(), troll::batch_view<T>{},
                       troll::make_batch(only.get(), 1, cols));
    std::vector<T> want_p(cols), want_q(cols);
    troll::kl_backward(troll::cpu, troll::make_batch<const T>(batch.p.data(), 1, cols),
                       troll::make_batch<const T>(batch.q.data(), 1, cols), batch.g.data(),
                       troll::make_batch(want_p.data(), 1, cols), troll::make_batch(want_q.data(), 1, cols));
    const std::vector<T> got_p = both.download(), got_q = only.download();
    for (std::size_t i = 0; i < cols; ++i) {
      CHECK(double(got_p[i]) == doctest::Approx(double(want_p[i])).epsilon(1e-5).scale(1.0));
      CHECK(double(got_q[i]) == doctest::Approx(double(want_q[i])).epsilon(1e-5).scale(1.0));
    }
  }

  TEST_CASE_TEMPLATE("kl_backward: reports, first_bad_row and NaN gradients of rejected rows", T, float, double) {
    test_stream s;
    kl_bad_batch<T> batch;
    const std::size_t rows = batch.rows, cols = batch.cols;
    device_array<T> zp(batch.p), zq(batch.q), g(batch.g), gp(rows * cols), gq(rows * cols);
    device_array<troll::cuda_row_report> reports(rows);
    device_array<unsigned long long> first_bad(1);
    troll::kl_backward(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), troll::make_batch<const T>(zp.get(), rows, cols),
                       troll::make_batch<const T>(zq.get(), rows, cols), g.get(), troll::make_batch(gp.get(), rows, cols),
                       troll::make_batch(gq.get(), rows, cols));
    s.sync();
    const std::vector<troll::cuda_row_report> rep = reports.download();
    const std::vector<T> got_p = gp.download(), got_q = gq.download();
    CHECK(first_bad.download()[0] == 1ull);
    for (std::size_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      CHECK(rep[r].error == batch.expected[r]);
      const bool bad = batch.expected[r] != troll::cuda_row_error::none;
      for (std::size_t i = 0; i < cols; ++i) {
        CHECK(std::isnan(double(got_p[r * cols + i])) == bad);
        CHECK(std::isnan(double(got_q[r * cols + i])) == bad);
      }
    }
    CHECK(rep[1].token == 2);
    CHECK(rep[2].operand == 1);
    CHECK(rep[5].operand == 2);
    CHECK(rep[5].token == ~0ull);  // grad_kl: one value per row, no token
    CHECK(rep[6].value == std::numeric_limits<double>::infinity());
    CHECK(rep[7].token == 3);
  }

  TEST_CASE_TEMPLATE("kl_backward's checked mode throws what the CPU throws, before writing", T, float, double) {
    test_stream s;
    kl_bad_batch<T> batch;
    const std::size_t cols = batch.cols;
    // Row 0 plus rows first..end, then rows in other orders: the lowest bad row wins, whatever its
    // problem, on both backends (a bad grad_kl in row 1 against bad logits in row 2 names row 1;
    // the checks ran in two stages before, and named row 2).
    std::vector<std::vector<std::size_t>> selections;
    for (std::size_t first = 1; first < batch.rows; ++first) {
      std::vector<std::size_t> pick = {0};
      for (std::size_t r = first; r < batch.rows; ++r) pick.push_back(r);
      selections.push_back(pick);
    }
    selections.push_back({0, 5, 1});
    selections.push_back({0, 4, 7});
    for (const auto& pick : selections) {
      const std::size_t rows = pick.size();
      std::vector<T> p, q, g;
      for (std::size_t r : pick) {
        p.insert(p.end(), batch.p.begin() + r * cols, batch.p.begin() + (r + 1) * cols);
        q.insert(q.end(), batch.q.begin() + r * cols, batch.q.begin() + (r + 1) * cols);
        g.push_back(batch.g[r]);
      }
      std::vector<T> cpu_p(rows * cols), cpu_q(rows * cols);
      const thrown cpu = catch_invalid([&] {
        troll::kl_backward(troll::cpu, troll::make_batch<const T>(p.data(), rows, cols),
                           troll::make_batch<const T>(q.data(), rows, cols), g.data(),
                           troll::make_batch(cpu_p.data(), rows, cols), troll::make_batch(cpu_q.data(), rows, cols));
      });
      REQUIRE(!cpu.message.empty());
      device_array<T> zp(p), zq(q), d_g(g);
      const std::vector<T> sentinel(rows * cols, T(7));
      device_array<T> gp(sentinel), gq(sentinel);
      const thrown cuda = catch_invalid([&] {
        troll::kl_backward(troll::cuda.on(s.stream).checked(), troll::make_batch<const T>(zp.get(), rows, cols),
                           troll::make_batch<const T>(zq.get(), rows, cols), d_g.get(),
                           troll::make_batch(gp.get(), rows, cols), troll::make_batch(gq.get(), rows, cols));
      });
      CAPTURE(cpu.message);
      CHECK(cuda.message == cpu.message);
      CHECK(cuda.row == cpu.row);
      CHECK(gp.download() == sentinel);
      CHECK(gq.download() == sentinel);
    }
    // A clean batch passes through the checked mode and is computed.
    device_array<T> zp(batch.p), zq(batch.q), g(batch.g), gp(cols);
    CHECK_NOTHROW(troll::kl_backward(troll::cuda.on(s.stream).checked(), troll::make_batch<const T>(zp.get(), 1, cols),
                                     troll::make_batch<const T>(zq.get(), 1, cols), g.get(),
                                     troll::make_batch(gp.get(), 1, cols), troll::batch_view<T>{}));
    CHECK(std::isfinite(double(gp.download()[0])));
  }

  TEST_CASE_TEMPLATE("project_jvp matches the CPU backend on the CPU forward's outputs", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      CAPTURE(block.cols);
      for (double eps : {1e-4, 0.05, 1.0}) {
        CAPTURE(eps);
        const forward_batch<T> f = cpu_forward<T>(block, eps);
        check_jvp(f, true, 0.7, s.stream);
        check_jvp(f, false, -1.3, s.stream);
      }
    }
  }

  TEST_CASE_TEMPLATE("project_jvp at V = 151,936 matches the CPU backend", T, float, double) {
    test_stream s;
    const std::vector<troll_test::row_pair> rows = zipf_rows(3, 151936);
    std::vector<const troll_test::row_pair*> picked;
    for (const auto& r : rows) picked.push_back(&r);
    const forward_batch<T> f = cpu_forward<T>(picked, 151936, 0.05);
    REQUIRE(f.rows == 3);
    check_jvp(f, true, 0.3, s.stream);
    check_jvp(f, false, 0.0, s.stream);
  }

  TEST_CASE_TEMPLATE("project_jacobian matches the CPU backend at small V", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      if (block.cols > 100) continue;
      CAPTURE(block.cols);
      for (double eps : {1e-4, 0.05, 1.0}) {
        CAPTURE(eps);
        const forward_batch<T> f = cpu_forward<T>(block, eps);
        check_jacobian(f, true, true, s.stream);
        check_jacobian(f, false, false, s.stream);
        check_jacobian(f, true, false, s.stream);
      }
    }
  }

  TEST_CASE("old-side derivatives where t* is within a rounding of 1 match the CPU's") {
    // tests/test_backward.cpp holds the CPU to a long-double oracle on these rows: z° = (a, −1e30)
    // at ε = 10 puts 1 − t* near 7e-29, so the dominant token's own ∂t/∂z° is rounding noise and
    // its entry must come from the others' (detail::old_side_sums) on every path: the VJP, the
    // JVP along e_j and the Jacobian's column j (jacobian_entry's dominant column).
    test_stream s;
    const std::size_t v = 2;
    const std::vector<double> zn = {-0.7145797210329641, 0.4695680987474934}, g = {0.7, -1.3};
    for (const double shift : {0.03392818243710029, 2.5}) {
      CAPTURE(shift);
      const std::vector<double> zo = {shift, -1e30};
      std::vector<double> lp(v), go(v), gn(v), jn(v * v), jo(v * v);
      troll::projection_stats st;
      const auto host = [&](const std::vector<double>& a) { return troll::make_batch<const double>(a.data(), 1, v); };
      troll::project(troll::cpu, host(zn), host(zo), 10.0, troll::make_batch(lp.data(), 1, v), &st);
      REQUIRE(st.status == troll::row_status::projected);
      REQUIRE(st.t == 1.0);
      troll::project_backward(troll::cpu, host(zn), host(zo), host(lp), &st, host(g),
                              troll::make_batch(gn.data(), 1, v), troll::make_batch(go.data(), 1, v));
      troll::project_jacobian(troll::cpu, host(zn), host(zo), host(lp), &st, jn.data(), jo.data());
      const double scale = std::max(std::fabs(go[0]), std::fabs(go[1]));
      REQUIRE(scale > 0.0);

      device_array<double> d_zn(zn), d_zo(zo), d_lp(lp), d_g(g), d_gn(v), d_go(v), d_jn(v * v), d_jo(v * v),
          d_tn(std::vector<double>(v, 0.0)), d_out(v);
      device_array<troll::projection_stats> d_st(std::vector<troll::projection_stats>{st});
      device_array<unsigned char> workspace(troll::project_jacobian_workspace_bytes(1, v));
      const auto dev = [&](const device_array<double>& a) { return troll::make_batch<const double>(a.get(), 1, v); };
      const auto out = [&](device_array<double>& a) { return troll::make_batch(a.get(), 1, v); };
      troll::project_backward(troll::cuda.on(s.stream), dev(d_zn), dev(d_zo), dev(d_lp), d_st.get(), dev(d_g),
                              out(d_gn), out(d_go));
      troll::project_jacobian(troll::cuda.on(s.stream).with_workspace(workspace.get(), workspace.bytes()), dev(d_zn),
                              dev(d_zo), dev(d_lp), d_st.get(), d_jn.get(), d_jo.get());
      const std::vector<double> got_go = d_go.download(), got_jo = d_jo.download();
      for (std::size_t j = 0; j < v; ++j) {
        CAPTURE(j);
        CHECK(std::fabs(got_go[j] - go[j]) <= 1e-12 * scale);
        // gᵀ J° e_j, by the device's Jacobian and by its JVP along e_j
        const double by_jacobian = g[0] * got_jo[0 * v + j] + g[1] * got_jo[1 * v + j];
        CHECK(std::fabs(by_jacobian - go[j]) <= 1e-12 * scale);
        for (std::size_t i = 0; i < v; ++i) CHECK(std::fabs(got_jo[i * v + j] - jo[i * v + j]) <= 1e-12 * scale);
        std::vector<double> to(v, 0.0);
        to[j] = 1.0;
        device_array<double> d_to(to);
        troll::project_jvp(troll::cuda.on(s.stream), dev(d_zn), dev(d_zo), dev(d_lp), d_st.get(), dev(d_tn), dev(d_to),
                           0.0, out(d_out));
        const std::vector<double> jvp = d_out.download();
        CHECK(std::fabs(g[0] * jvp[0] + g[1] * jvp[1] - go[j]) <= 1e-12 * scale);
      }
    }
  }

  TEST_CASE_TEMPLATE("project_jvp and project_jacobian: reports and NaN outputs of rejected rows", T, float, double) {
    test_stream s;
    derivative_bad_batch<T> batch;
    const std::size_t rows = batch.rows, cols = batch.cols;
    device_array<T> zn(batch.zn), zo(batch.zo), logp(batch.logp), tn(batch.tn), to(batch.to), out(rows * cols);
    device_array<troll::projection_stats> stats(batch.stats);
    device_array<troll::cuda_row_report> reports(rows);
    device_array<unsigned long long> first_bad(1);
    const auto view = [&](const device_array<T>& a) { return troll::make_batch<const T>(a.get(), rows, cols); };
    troll::project_jvp(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), view(zn), view(zo), view(logp), stats.get(), view(tn), view(to), 0.5,
                       troll::make_batch(out.get(), rows, cols));
    s.sync();
    std::vector<troll::cuda_row_report> rep = reports.download();
    const std::vector<T> got = out.download();
    CHECK(first_bad.download()[0] == 2ull);
    for (std::size_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      CHECK(rep[r].error == batch.expected[r]);
      if (batch.expected[r] != troll::cuda_row_error::none) CHECK(rep[r].operand == batch.operand[r]);
      CHECK(std::isnan(double(got[r * cols])) == (r >= 2));
    }
    CHECK(rep[2].token == 1);
    CHECK(rep[6].token == 3);
    CHECK(rep[7].token == 0);
    // The good rows are the CPU's.
    std::vector<T> want(2 * cols);
    troll::project_jvp(troll::cpu, troll::make_batch<const T>(batch.zn.data(), 2, cols),
                       troll::make_batch<const T>(batch.zo.data(), 2, cols), troll::make_batch<const T>(batch.logp.data(), 2, cols),
                       batch.stats.data(), troll::make_batch<const T>(batch.tn.data(), 2, cols),
                       troll::make_batch<const T>(batch.to.data(), 2, cols), 0.5, troll::make_batch(want.data(), 2, cols));
    for (std::size_t k = 0; k < 2 * cols; ++k)
      CHECK(double(got[k]) == doctest::Approx(double(want[k])).epsilon(1e-5).scale(1.0));

    // The Jacobian has no tangents: rows 6 and 7 are fine there.
    device_array<T> jac_new(rows * cols * cols), jac_old(rows * cols * cols), jac_eps(rows * cols);
    device_array<unsigned char> workspace(troll::project_jacobian_workspace_bytes(rows, cols));
    troll::project_jacobian(troll::cuda.on(s.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), view(zn), view(zo), view(logp), stats.get(),
                            jac_new.get(), jac_old.get(), jac_eps.get());
    s.sync();
    rep = reports.download();
    const std::vector<T> jn = jac_new.download(), jo = jac_old.download(), je = jac_eps.download();
    CHECK(first_bad.download()[0] == 2ull);
    for (std::size_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      const bool bad = r >= 2 && r <= 5;
      CHECK(rep[r].error == (bad ? batch.expected[r] : troll::cuda_row_error::none));
      for (std::size_t k = 0; k < cols * cols; ++k) {
        CHECK(std::isnan(double(jn[r * cols * cols + k])) == bad);
        CHECK(std::isnan(double(jo[r * cols * cols + k])) == bad);
      }
      for (std::size_t i = 0; i < cols; ++i) CHECK(std::isnan(double(je[r * cols + i])) == bad);
    }
  }

  TEST_CASE_TEMPLATE("project_jvp and project_jacobian checked mode throws what the CPU throws", T, float, double) {
    test_stream s;
    derivative_bad_batch<T> batch;
    const std::size_t cols = batch.cols;
    for (std::size_t first = 2; first < batch.rows; ++first) {
      CAPTURE(first);
      // Rows 0, 1 (good) and first..end: the lowest bad row is `first`.
      std::vector<std::size_t> pick = {0, 1};
      for (std::size_t r = first; r < batch.rows; ++r) pick.push_back(r);
      const std::size_t rows = pick.size();
      std::vector<T> zn, zo, logp, tn, to;
      std::vector<troll::projection_stats> stats;
      for (std::size_t r : pick) {
        const auto append = [&](std::vector<T>& dst, const std::vector<T>& src) {
          dst.insert(dst.end(), src.begin() + r * cols, src.begin() + (r + 1) * cols);
        };
        append(zn, batch.zn), append(zo, batch.zo), append(logp, batch.logp), append(tn, batch.tn), append(to, batch.to);
        stats.push_back(batch.stats[r]);
      }
      const auto host = [&](const std::vector<T>& v) { return troll::make_batch<const T>(v.data(), rows, cols); };
      std::vector<T> cpu_out(rows * cols), cpu_jac(rows * cols * cols);
      const thrown cpu = catch_invalid([&] {
        troll::project_jvp(troll::cpu, host(zn), host(zo), host(logp), stats.data(), host(tn), host(to), 0.5,
                           troll::make_batch(cpu_out.data(), rows, cols));
      });
      REQUIRE(!cpu.message.empty());
      device_array<T> d_zn(zn), d_zo(zo), d_logp(logp), d_tn(tn), d_to(to);
      device_array<troll::projection_stats> d_stats(stats);
      const auto dev = [&](const device_array<T>& a) { return troll::make_batch<const T>(a.get(), rows, cols); };
      const std::vector<T> sentinel(rows * cols, T(7)), jac_sentinel(rows * cols * cols, T(7));
      device_array<T> out(sentinel), jac(jac_sentinel);
      const thrown cuda = catch_invalid([&] {
        troll::project_jvp(troll::cuda.on(s.stream).checked(), dev(d_zn), dev(d_zo), dev(d_logp), d_stats.get(), dev(d_tn),
                           dev(d_to), 0.5, troll::make_batch(out.get(), rows, cols));
      });
      CAPTURE(cpu.message);
      CHECK(cuda.message == cpu.message);
      CHECK(cuda.row == cpu.row);
      CHECK(out.download() == sentinel);

      const thrown cpu_jac_error = catch_invalid([&] {
        troll::project_jacobian(troll::cpu, host(zn), host(zo), host(logp), stats.data(), cpu_jac.data());
      });
      device_array<unsigned char> workspace(troll::project_jacobian_workspace_bytes(rows, cols));
      const thrown cuda_jac_error = catch_invalid([&] {
        troll::project_jacobian(troll::cuda.on(s.stream).with_workspace(workspace.get(), workspace.bytes()).checked(), dev(d_zn), dev(d_zo), dev(d_logp), d_stats.get(), jac.get(), static_cast<T*>(nullptr), static_cast<T*>(nullptr));
      });
      CHECK(cuda_jac_error.message == cpu_jac_error.message);
      CHECK(cuda_jac_error.row == cpu_jac_error.row);
      if (!cpu_jac_error.message.empty()) CHECK(jac.download() == jac_sentinel);
    }
  }
}

// The re-centring of d − μ on nearly one-hot rows with large logits (tests/bodies/backward_centring.hpp,
// also run on the CPU by tests/test_backward_centring.cpp): VJP, JVP, Jacobian and TROLL's objective
// backward against the long-double formulas of math.md §3.
namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/backward_centring.hpp"
}

// Nearly two-point rows (tests/bodies/two_point_rows.hpp, also run on the CPU by
// tests/test_two_point.cpp): the VJP and TROLL's objective backward against long double, relative
// to the gradient itself (the two-point rule); the device Jacobian keeps normwise accuracy only.
TEST_SUITE("device") {
#include "../bodies/two_point_rows.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
