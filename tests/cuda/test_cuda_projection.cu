// tests/cuda/test_cuda_projection.cu — the CUDA backend (troll/cuda.cuh) against the CPU backend:
// log_softmax, kl, project and project_backward over the shared corpus, device-side row reports,
// the checked mode's exceptions, and the host-side argument checks.
//
// Without a CUDA device the "device" test suite is excluded (doctest counts it as skipped), a
// line "SKIPPED: no CUDA device" is printed, the host-only cases still run and the exit code is
// 0. Tolerances against the CPU are documented in docs/cuda.md ("How the tests compare").
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "corpus.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/projection.hpp"

namespace {

using troll_test::device_array;
using troll_test::message_of;
using troll_test::test_stream;
using troll_test::tolerance;
using troll_test::unit_roundoff;

using troll_test::minus_inf;
using troll_test::nan_value;

/// One batch of rows packed with a row stride larger than V; the padding holds NaN so that a
/// kernel reading past a row's end poisons its result.
template <class T>
struct packed_batch {
  std::size_t rows = 0, cols = 0, stride = 0;
  std::vector<T> fresh, old;

  const T* new_row(std::size_t r) const { return fresh.data() + r * stride; }
  const T* old_row(std::size_t r) const { return old.data() + r * stride; }
};

template <class T>
packed_batch<T> pack_block(const troll_test::corpus_block& block) {
  std::vector<const troll_test::row_pair*> rows;
  for (const auto& r : block.rows) rows.push_back(&r);
  packed_batch<T> b;
  b.rows = rows.size();
  b.cols = block.cols;
  b.stride = block.cols + 3;
  b.fresh = troll_test::pack<T>(rows, true, b.stride, static_cast<T>(nan_value));
  b.old = troll_test::pack<T>(rows, false, b.stride, static_cast<T>(nan_value));
  return b;
}

using troll_test::finite_scale;

/// KL tolerance of one row pair between two backends that both reduce in double.
template <class T>
tolerance kl_between_backends(double scale) {
  return tolerance{256.0 * unit_roundoff<double>() * (1.0 + scale), 1e-10 + 4.0 * unit_roundoff<T>()};
}

/// A stream of its own for each test case, so the default stream is never relied upon.

// ---------------------------------------------------------------------------------------------
// Forward comparisons
// ---------------------------------------------------------------------------------------------

/// Runs log_softmax on the device for one corpus block and compares every entry with the CPU.
template <class T>
void check_log_softmax_block(const troll_test::corpus_block& block, cudaStream_t stream) {
  const packed_batch<T> b = pack_block<T>(block);
  device_array<T> z(b.fresh), out(b.rows * b.stride);
  device_array<troll::cuda_row_report> reports(b.rows);
  troll::log_softmax(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(z.get(), b.rows, b.cols, b.stride),
                     troll::make_batch(out.get(), b.rows, b.cols, b.stride));
  const std::vector<T> got = out.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();
  std::vector<T> want(b.cols);
  for (std::size_t r = 0; r < b.rows; ++r) {
    CAPTURE(block.rows[r].label());
    const std::string cpu_error = message_of([&] {
      troll::log_softmax(troll::cpu.with_threads(1), troll::make_batch(b.new_row(r), 1, b.cols),
                         troll::make_batch(want.data(), 1, b.cols));
    });
    if (!cpu_error.empty()) {
      CHECK(rep[r].error != troll::cuda_row_error::none);
      continue;
    }
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    const double scale = finite_scale(b.new_row(r), b.cols);
    for (std::size_t i = 0; i < b.cols; ++i) {
      const double w = want[i], g = got[r * b.stride + i];
      const tolerance tol{4.0 * troll_test::log_prob_tolerance<T>(w, scale), 0.0};
      if (!tol.accepts(g, w)) {
        FAIL_CHECK("log_softmax token " << i << ": cuda " << g << " cpu " << w);
        break;
      }
    }
  }
}

template <class T>
void check_kl_block(const troll_test::corpus_block& block, cudaStream_t stream) {
  const packed_batch<T> b = pack_block<T>(block);
  device_array<T> zp(b.fresh), zq(b.old), out(b.rows);
  device_array<troll::cuda_row_report> reports(b.rows);
  troll::kl(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(zp.get(), b.rows, b.cols, b.stride),
            troll::make_batch<const T>(zq.get(), b.rows, b.cols, b.stride), out.get());
  const std::vector<T> got = out.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();
  for (std::size_t r = 0; r < b.rows; ++r) {
    CAPTURE(block.rows[r].label());
    T want = T(0);
    const std::string cpu_error = message_of([&] {
      troll::kl(troll::cpu.with_threads(1), troll::make_batch(b.new_row(r), 1, b.cols),
                troll::make_batch(b.old_row(r), 1, b.cols), &want);
    });
    if (!cpu_error.empty()) {
      CHECK(rep[r].error != troll::cuda_row_error::none);
      CHECK(std::isnan(static_cast<double>(got[r])));
      continue;
    }
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    const double scale = std::max(finite_scale(b.new_row(r), b.cols), finite_scale(b.old_row(r), b.cols));
    CHECK_MESSAGE(kl_between_backends<T>(scale).accepts(got[r], want), "kl: cuda ", got[r], " cpu ", want);
  }
}

/// Bound on |t_cuda − t_cpu|: both roots satisfy |KL − ε| ≤ their own error, and dKL/dt = tσ².
inline double root_spread(const troll::projection_stats& a, const troll::projection_stats& b, double eps) {
  const double kl_error = std::fabs(a.kl_after - eps) + std::fabs(b.kl_after - eps) + 1e-15 + 1e-12 * eps;
  return troll_test::t_tolerance(b.t, b.sigma2, 2.0 * kl_error);
}

template <class T>
void check_project_block(const troll_test::corpus_block& block, double eps, cudaStream_t stream) {
  const packed_batch<T> b = pack_block<T>(block);
  device_array<T> zn(b.fresh), zo(b.old), out(b.rows * b.stride);
  device_array<troll::projection_stats> stats(b.rows);
  device_array<troll::cuda_row_report> reports(b.rows);
  troll::project(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(zn.get(), b.rows, b.cols, b.stride),
                 troll::make_batch<const T>(zo.get(), b.rows, b.cols, b.stride), eps,
                 troll::make_batch(out.get(), b.rows, b.cols, b.stride), stats.get(), troll::projection_options{});
  const std::vector<T> got = out.download();
  const std::vector<troll::projection_stats> got_stats = stats.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();
  const tolerance guarantee = troll_test::projection_guarantee<T>();

  std::vector<T> want(b.cols);
  for (std::size_t r = 0; r < b.rows; ++r) {
    CAPTURE(block.rows[r].label());
    CAPTURE(eps);
    troll::projection_stats want_stats;
    const std::string cpu_error = message_of([&] {
      troll::project(troll::cpu.with_threads(1), troll::make_batch(b.new_row(r), 1, b.cols),
                     troll::make_batch(b.old_row(r), 1, b.cols), eps, troll::make_batch(want.data(), 1, b.cols),
                     &want_stats);
    });
    const troll::projection_stats& gs = got_stats[r];
    if (!cpu_error.empty()) {
      CAPTURE(cpu_error);
      CHECK(rep[r].error != troll::cuda_row_error::none);
      CHECK((gs.status == troll::row_status::infeasible || gs.status == troll::row_status::rejected));
      CHECK(std::isnan(static_cast<double>(got[r * b.stride])));
      continue;
    }
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    REQUIRE(gs.status == want_stats.status);

    const double scale = std::max(finite_scale(b.new_row(r), b.cols), finite_scale(b.old_row(r), b.cols));
    const tolerance kl_tol = kl_between_backends<T>(scale);
    CHECK_MESSAGE(kl_tol.accepts(gs.kl_before, want_stats.kl_before), "kl_before ", gs.kl_before, " vs ",
                  want_stats.kl_before);
    const bool projected = want_stats.status == troll::row_status::projected;
    const double spread = projected ? root_spread(gs, want_stats, eps) : 0.0;
    if (projected) {
      // The bound holds on the device, with the documented guarantee.
      CHECK_MESSAGE(guarantee.accepts(gs.kl_after, eps), "kl_after ", gs.kl_after, " eps ", eps);
      CHECK(std::fabs(gs.t - want_stats.t) <= spread + 1e-13 * want_stats.t);
      CHECK(std::fabs(gs.mu - want_stats.mu) <=
            want_stats.sigma2 * spread + 256.0 * unit_roundoff<double>() * (1.0 + scale));
      CHECK(std::fabs(gs.sigma2 - want_stats.sigma2) <= 1e-6 * want_stats.sigma2 + 1e-300);
    } else {
      CHECK(gs.t == 1.0);
      CHECK(kl_tol.accepts(gs.kl_after, want_stats.kl_after));
    }

    for (std::size_t i = 0; i < b.cols; ++i) {
      const double w = want[i], g = got[r * b.stride + i];
      if (std::isinf(w)) {
        if (!(g == w)) {
          FAIL_CHECK("token " << i << ": cuda " << g << ", cpu " << w);
          break;
        }
        continue;
      }
      // First order in t: ∂log π_i/∂t = d_i − μ.
      const double centred = std::fabs(static_cast<double>(b.new_row(r)[i]) - static_cast<double>(b.old_row(r)[i]) -
                                       want_stats.mu);
      const double bound = 2.0 * centred * spread + 8.0 * troll_test::log_prob_tolerance<T>(w, scale);
      if (!(std::fabs(g - w) <= bound)) {
        FAIL_CHECK("token " << i << ": cuda " << g << ", cpu " << w << ", allowed " << bound);
        break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward comparison: the device VJP fed the CPU forward's outputs, against the CPU VJP.
// ---------------------------------------------------------------------------------------------

template <class T>
void check_backward_block(const troll_test::corpus_block& block, double eps, cudaStream_t stream) {
  const packed_batch<T> b = pack_block<T>(block);
  // Keep only the rows the CPU forward accepts, repacked.
  std::vector<const troll_test::row_pair*> kept;
  for (std::size_t r = 0; r < b.rows; ++r) {
    std::vector<T> scratch(b.cols);
    troll::projection_stats st;
    const std::string err = message_of([&] {
      troll::project(troll::cpu.with_threads(1), troll::make_batch(b.new_row(r), 1, b.cols),
                     troll::make_batch(b.old_row(r), 1, b.cols), eps, troll::make_batch(scratch.data(), 1, b.cols),
                     &st);
    });
    if (err.empty()) kept.push_back(&block.rows[r]);
  }
  if (kept.empty()) return;
  const std::size_t rows = kept.size(), cols = b.cols, stride = cols + 1;
  const std::vector<T> zn_host = troll_test::pack<T>(kept, true, stride, static_cast<T>(nan_value));
  const std::vector<T> zo_host = troll_test::pack<T>(kept, false, stride, static_cast<T>(nan_value));
  std::vector<T> logp(rows * stride, static_cast<T>(nan_value)), g(rows * stride, static_cast<T>(nan_value));
  std::vector<troll::projection_stats> st(rows);
  troll::project(troll::cpu, troll::make_batch(zn_host.data(), rows, cols, stride),
                 troll::make_batch(zo_host.data(), rows, cols, stride), eps,
                 troll::make_batch(logp.data(), rows, cols, stride), st.data());
  troll_test::rng gen(0xC0DA + cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t i = 0; i < cols; ++i) g[r * stride + i] = static_cast<T>(gen.normal());

  std::vector<T> want_new(rows * stride), want_old(rows * stride), want_eps(rows);
  troll::project_backward(troll::cpu, troll::make_batch(zn_host.data(), rows, cols, stride),
                          troll::make_batch(zo_host.data(), rows, cols, stride),
                          troll::make_batch(logp.data(), rows, cols, stride), st.data(),
                          troll::make_batch(g.data(), rows, cols, stride),
                          troll::make_batch(want_new.data(), rows, cols, stride),
                          troll::make_batch(want_old.data(), rows, cols, stride), want_eps.data());

  device_array<T> d_zn(zn_host), d_zo(zo_host), d_logp(logp), d_g(g);
  device_array<troll::projection_stats> d_st(st);
  device_array<T> d_new(rows * stride), d_old(rows * stride), d_eps(rows);
  device_array<troll::cuda_row_report> reports(rows);
  troll::project_backward(troll::cuda.on(stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(d_zn.get(), rows, cols, stride),
                          troll::make_batch<const T>(d_zo.get(), rows, cols, stride),
                          troll::make_batch<const T>(d_logp.get(), rows, cols, stride), d_st.get(),
                          troll::make_batch<const T>(d_g.get(), rows, cols, stride),
                          troll::make_batch(d_new.get(), rows, cols, stride),
                          troll::make_batch(d_old.get(), rows, cols, stride), d_eps.get());
  const std::vector<T> got_new = d_new.download(), got_old = d_old.download(), got_eps = d_eps.download();
  const std::vector<troll::cuda_row_report> rep = reports.download();

  const double u = unit_roundoff<double>(), u_out = 2.0 * unit_roundoff<T>();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(kept[r]->label());
    CAPTURE(eps);
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    const troll::projection_stats& s = st[r];
    const bool projected = s.status == troll::row_status::projected;
    const double t = projected ? s.t : 1.0;
    // Condition of the two sums: Σ|g| and Σ|g (d − μ)| over J, and max π|d − μ|.
    double abs_g = 0.0, abs_gc = 0.0, max_pc = 0.0, max_g = 0.0;
    for (std::size_t i = 0; i < cols; ++i) {
      const double lp = logp[r * stride + i];
      if (!(lp > minus_inf)) continue;
      const double c = std::fabs(double(zn_host[r * stride + i]) - double(zo_host[r * stride + i]) - s.mu);
      const double gi = std::fabs(double(g[r * stride + i]));
      abs_g += gi;
      abs_gc += gi * c;
      max_pc = std::max(max_pc, std::exp(lp) * c);
      max_g = std::max(max_g, gi);
    }
    const double var = projected ? s.sigma2 : 1.0;
    const double scale_new = t * (max_g + abs_g + (projected ? abs_gc * max_pc / var : 0.0));
    const double scale_old = projected ? abs_g + abs_gc * ((1.0 - t) * t * max_pc + 2.0) / (t * var) : 0.0;
    const double scale_eps = projected ? abs_gc / (t * var) : 0.0;
    const double rel = 1024.0 * u;
    for (std::size_t i = 0; i < cols; ++i) {
      const std::size_t k = r * stride + i;
      const double bn = rel * scale_new + u_out * std::fabs(double(want_new[k]));
      if (!(std::fabs(double(got_new[k]) - double(want_new[k])) <= bn)) {
        FAIL_CHECK("grad_new token " << i << ": cuda " << got_new[k] << ", cpu " << want_new[k]);
        break;
      }
      const double bo = rel * scale_old + u_out * std::fabs(double(want_old[k]));
      if (!(std::fabs(double(got_old[k]) - double(want_old[k])) <= bo)) {
        FAIL_CHECK("grad_old token " << i << ": cuda " << got_old[k] << ", cpu " << want_old[k]);
        break;
      }
    }
    CHECK(std::fabs(double(got_eps[r]) - double(want_eps[r])) <=
          rel * scale_eps + u_out * std::fabs(double(want_eps[r])));
  }
}

// ---------------------------------------------------------------------------------------------
// A batch with one bad row of every kind, for reports and the checked mode.
// ---------------------------------------------------------------------------------------------

template <class T>
struct bad_batch {
  static constexpr std::size_t rows = 8, cols = 4;
  std::vector<T> fresh, old;
  // Expected device code of each row for project.
  std::vector<troll::cuda_row_error> expected;

  bad_batch() {
    const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
    fresh = {
        T(0.1), T(-0.3), T(1.2), T(0.0),  // 0: fine, projected for small eps
        T(0.0), T(0.0),  T(0.0), T(0.0),  // 1: fine, inactive
        T(0.0), T(1.0),  T(2.0), nan,     // 2: NaN in new_logits at token 3
        T(0.0), -inf,    -inf,   -inf,    // 3: infeasible: q(J) = 1/4 -> KL >= log 4
        -inf,   -inf,    -inf,   -inf,    // 4: new row all masked
        T(0.0), -inf,    T(1.0), -inf,    // 5: disjoint supports
        T(0.0), T(0.0),  inf,    T(0.0),  // 6: +inf in new_logits at token 2
        T(0.0), T(0.0),  nan,    T(0.0),  // 7: NaN in new_logits at token 2, +inf in old_logits at token 1
    };
    old = {
        T(2.0), T(0.0), T(-1.0), T(0.5),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        -inf,   T(0.0), -inf,    T(0.0),  //
        T(0.0), T(0.0), T(0.0),  T(0.0),  //
        T(0.0), inf,    T(0.0),  T(0.0),  // 7: the lower token of either row is named (the CPU's scan_pair)
    };
    using e = troll::cuda_row_error;
    expected = {e::none, e::none, e::nan_value, e::infeasible, e::all_masked, e::disjoint, e::pos_inf, e::pos_inf};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-only cases: they run with or without a device.
// ---------------------------------------------------------------------------------------------

TEST_CASE("cuda entry points check shapes, eps and options on the host, before any CUDA call") {
  // Dangling but non-null "device" pointers: none of these calls may touch them.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  troll::projection_stats* fake_stats = reinterpret_cast<troll::projection_stats*>(std::uintptr_t(512));
  const auto a = troll::make_batch<const float>(fake, 3, 5);
  const auto out = troll::make_batch(fake, 3, 5);
  const auto narrow = troll::make_batch(fake, 3, 4);
  CHECK_THROWS_AS(troll::project(troll::cuda, a, a, 0.05, narrow, fake_stats), troll::shape_error);
  CHECK_THROWS_AS(troll::project(troll::cuda, a, a, 0.05, out, nullptr), troll::shape_error);
  CHECK_THROWS_AS(troll::project(troll::cuda, a, a, 0.0, out, fake_stats), troll::domain_error);
  CHECK_THROWS_AS(troll::project(troll::cuda, a, a, std::nan(""), out, fake_stats), troll::domain_error);
  troll::projection_options bad_options;
  bad_options.max_iterations = 0;
  CHECK_THROWS_AS(troll::project(troll::cuda, a, a, 0.05, out, fake_stats, bad_options), troll::domain_error);
  CHECK_THROWS_AS(troll::kl(troll::cuda, a, troll::make_batch<const float>(fake, 2, 5), fake),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::kl<float>(troll::cuda, a, a, nullptr), troll::shape_error);
  CHECK_THROWS_AS(troll::log_softmax(troll::cuda, a, narrow), troll::shape_error);
  CHECK_THROWS_AS(troll::project_backward(troll::cuda, a, a, a, fake_stats, a, narrow), troll::shape_error);
  CHECK_THROWS_AS(troll::project_backward(troll::cuda, a, a, a, nullptr, a, out), troll::shape_error);
  CHECK_THROWS_AS(troll::project_backward(troll::cuda, a, a, a, fake_stats, troll::input_view<float>{}, out),
                  troll::shape_error);
  // The CPU's messages, word for word.
  std::string cpu_message, cuda_message;
  try {
    troll::project(troll::cpu, a, a, -1.0, out, fake_stats);
  } catch (const troll::domain_error& e) {
    cpu_message = e.what();
  }
  try {
    troll::project(troll::cuda, a, a, -1.0, out, fake_stats);
  } catch (const troll::domain_error& e) {
    cuda_message = e.what();
  }
  CHECK(!cpu_message.empty());
  CHECK(cuda_message == cpu_message);
  // An empty batch enqueues nothing (and so needs no device).
  const auto empty = troll::make_batch<const float>(nullptr, 0, 5);
  CHECK_NOTHROW(troll::project(troll::cuda, empty, empty, 0.05, troll::make_batch<float>(nullptr, 0, 5), nullptr));
  CHECK_NOTHROW(troll::log_softmax(troll::cuda, empty, troll::make_batch<float>(nullptr, 0, 5)));
}

TEST_CASE("device row reports become the CPU's exceptions, message for message") {
  using e = troll::cuda_row_error;
  const char* const names[3] = {"new_logits", "old_logits", "grad_log_probs"};
  bad_batch<double> batch;
  std::vector<double> out(batch.rows * batch.cols);
  std::vector<troll::projection_stats> stats(batch.rows);
  struct probe {
    std::size_t row;
    troll::cuda_row_report report;
  };
  // The reports the device writes for rows 2..6 of bad_batch (the floor of row 3 is log 4).
  const std::vector<probe> probes = {
      {2, {e::nan_value, 0, 3, 0.0}},  {3, {e::infeasible, 0, 0, std::log(4.0)}},
      {4, {e::all_masked, 0, 0, 0.0}}, {5, {e::disjoint, 0, 0, 0.0}},
      {6, {e::pos_inf, 0, 2, 0.0}},    {7, {e::pos_inf, 1, 1, 0.0}}};
  for (const probe& p : probes) {
    CAPTURE(p.row);
    std::string cpu_message, cuda_message;
    std::size_t cuda_row = 0;
    try {
      troll::project(troll::cpu, troll::make_batch<const double>(batch.fresh.data() + p.row * batch.cols, 1, batch.cols),
                     troll::make_batch<const double>(batch.old.data() + p.row * batch.cols, 1, batch.cols), 0.05,
                     troll::make_batch(out.data(), 1, batch.cols), stats.data());
    } catch (const troll::invalid_input& ex) {
      cpu_message = ex.what();
    }
    try {
      troll::detail::cuda::throw_report("project", 0, p.report, names);
    } catch (const troll::invalid_input& ex) {
      cuda_message = ex.what();
      cuda_row = ex.row();
    }
    CHECK(cuda_row == 0);
    CHECK(!cpu_message.empty());
    CHECK(cuda_message == cpu_message);
  }
  // Row 0's backward on the CPU with stats `st` and upstream `g`, against the host's wording of
  // the device's `report`: the same message.
  troll::projection_stats solved;
  troll::project(troll::cpu, troll::make_batch<const double>(batch.fresh.data(), 1, batch.cols),
                 troll::make_batch<const double>(batch.old.data(), 1, batch.cols), 0.05,
                 troll::make_batch(out.data(), 1, batch.cols), &solved);
  auto same_backward_message = [&](const troll::projection_stats& st, const std::vector<double>& g,
                                   const troll::cuda_row_report& report) {
    std::vector<double> grad(batch.cols);
    std::string cpu_message, cuda_message;
    try {
      troll::project_backward(troll::cpu, troll::make_batch<const double>(batch.fresh.data(), 1, batch.cols),
                              troll::make_batch<const double>(batch.old.data(), 1, batch.cols),
                              troll::make_batch<const double>(out.data(), 1, batch.cols), &st,
                              troll::make_batch<const double>(g.data(), 1, batch.cols),
                              troll::make_batch(grad.data(), 1, batch.cols));
    } catch (const troll::domain_error& ex) {
      cpu_message = ex.what();
    }
    try {
      troll::detail::cuda::throw_report("project_backward", 0, report, names);
    } catch (const troll::domain_error& ex) {
      cuda_message = ex.what();
    }
    CHECK(!cpu_message.empty());
    CHECK(cuda_message == cpu_message);
  };
  {
    // A NaN upstream gradient in the backward.
    std::vector<double> g(batch.cols, 0.5);
    g[1] = nan_value;
    same_backward_message(solved, g, {e::not_finite, 2, 1, 0.0});
  }
  // Stats of a row whose forward solve stopped short (or was rejected): the device reports field 3
  // (status) with the status in `value`, and the host words it as the CPU does.
  for (const troll::row_status status : {troll::row_status::not_converged, troll::row_status::rejected}) {
    troll::projection_stats st = solved;
    st.status = status;
    same_backward_message(st, std::vector<double>(batch.cols, 0.5),
                          {e::bad_stats, 3, 0, double(static_cast<int>(status))});
  }
  CHECK_THROWS_AS(troll::detail::cuda::throw_report("project", 1, {e::disjoint, 0, 0, 0.0}, names),
                  troll::infeasible_error);
  CHECK_THROWS_AS(troll::detail::cuda::throw_report("project_backward", 1, {e::not_finite, 2, 7, 0.0}, names),
                  troll::domain_error);
  CHECK_THROWS_AS(troll::detail::cuda::throw_report("project_backward", 1, {e::bad_stats, 1, 0, 0.0}, names),
                  troll::domain_error);
}

TEST_CASE("CUDA runtime errors become backend_error carrying the runtime's text") {
  std::string message;
  try {
    troll::detail::cuda::check(cudaErrorInvalidValue, "project", "cudaMemsetAsync");
  } catch (const troll::backend_error& ex) {
    message = ex.what();
  }
  CHECK(message.find("troll::project: cudaMemsetAsync failed: ") == 0);
  CHECK(message.find(cudaGetErrorString(cudaErrorInvalidValue)) != std::string::npos);
  CHECK_NOTHROW(troll::detail::cuda::check(cudaSuccess, "project", "nothing"));
}

// ---------------------------------------------------------------------------------------------
// Device cases: skipped (filtered out) without a device.
// ---------------------------------------------------------------------------------------------

TEST_SUITE("device") {
  TEST_CASE_TEMPLATE("log_softmax and kl match the CPU backend over the corpus", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      CAPTURE(block.cols);
      check_log_softmax_block<T>(block, s.stream);
      check_kl_block<T>(block, s.stream);
    }
  }

  TEST_CASE_TEMPLATE("project matches the CPU backend over the corpus and the eps grid", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      CAPTURE(block.cols);
      for (double eps : troll_test::eps_grid()) check_project_block<T>(block, eps, s.stream);
    }
  }

  TEST_CASE_TEMPLATE("project_backward matches the CPU backend on the CPU forward's outputs", T, float, double) {
    test_stream s;
    for (const auto& block : troll_test::make_corpus()) {
      CAPTURE(block.cols);
      for (double eps : {1e-4, 0.05, 1.0}) check_backward_block<T>(block, eps, s.stream);
    }
  }

  TEST_CASE("device forward then device backward stays close to the CPU pipeline") {
    // Zipf rows at V = 151,936: the sizes of the benchmark, float as in training.
    const std::size_t rows = 4, cols = 151936;
    test_stream s;
    std::vector<const troll_test::row_pair*> picked;
    std::vector<troll_test::row_pair> storage;
    for (std::size_t r = 0; r < rows; ++r) storage.push_back(troll_test::make_row(troll_test::row_kind::zipf, cols, int(r)));
    for (const auto& p : storage) picked.push_back(&p);
    const std::vector<float> zn = troll_test::pack<float>(picked, true, cols);
    const std::vector<float> zo = troll_test::pack<float>(picked, false, cols);
    std::vector<float> cpu_out(rows * cols);
    std::vector<troll::projection_stats> cpu_stats(rows);
    troll::project(troll::cpu, troll::make_batch(zn.data(), rows, cols), troll::make_batch(zo.data(), rows, cols), 0.05,
                   troll::make_batch(cpu_out.data(), rows, cols), cpu_stats.data());

    device_array<float> d_zn(zn), d_zo(zo), d_out(rows * cols);
    device_array<troll::projection_stats> d_stats(rows);
    device_array<unsigned long long> first_bad(1);
    troll::project(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{nullptr, first_bad.get()}), troll::make_batch<const float>(d_zn.get(), rows, cols),
                   troll::make_batch<const float>(d_zo.get(), rows, cols), 0.05,
                   troll::make_batch(d_out.get(), rows, cols), d_stats.get(), troll::projection_options{});
    s.sync();
    CHECK(first_bad.download()[0] == ~0ull);
    const std::vector<troll::projection_stats> got_stats = d_stats.download();
    for (std::size_t r = 0; r < rows; ++r) {
      CHECK(got_stats[r].status == cpu_stats[r].status);
      if (got_stats[r].status == troll::row_status::projected)
        CHECK(troll_test::projection_guarantee<float>().accepts(got_stats[r].kl_after, 0.05));
    }
    // The bound on the written (float) output, measured by the CPU kl.
    const std::vector<float> got = d_out.download();
    std::vector<float> kl_after(rows);
    troll::kl(troll::cpu, troll::make_batch(got.data(), rows, cols), troll::make_batch(zo.data(), rows, cols),
              kl_after.data());
    for (std::size_t r = 0; r < rows; ++r)
      if (cpu_stats[r].status == troll::row_status::projected)
        CHECK(troll_test::projection_guarantee<float>().accepts(kl_after[r], 0.05));
  }

  TEST_CASE_TEMPLATE("bad rows: reports, first_bad_row and NaN outputs without synchronising", T, float, double) {
    bad_batch<T> batch;
    const std::size_t rows = batch.rows, cols = batch.cols;
    test_stream s;
    device_array<T> zn(batch.fresh), zo(batch.old), out(rows * cols);
    device_array<troll::projection_stats> stats(rows);
    device_array<troll::cuda_row_report> reports(rows);
    device_array<unsigned long long> first_bad(1);
    troll::project(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), troll::make_batch<const T>(zn.get(), rows, cols),
                   troll::make_batch<const T>(zo.get(), rows, cols), 0.05, troll::make_batch(out.get(), rows, cols),
                   stats.get(), troll::projection_options{});
    s.sync();
    const std::vector<troll::cuda_row_report> rep = reports.download();
    const std::vector<troll::projection_stats> st = stats.download();
    const std::vector<T> got = out.download();
    CHECK(first_bad.download()[0] == 2ull);
    for (std::size_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      CHECK(rep[r].error == batch.expected[r]);
      const bool bad = batch.expected[r] != troll::cuda_row_error::none;
      CHECK(std::isnan(static_cast<double>(got[r * cols])) == bad);
      if (bad) {
        const bool no_solution = batch.expected[r] == troll::cuda_row_error::disjoint ||
                                 batch.expected[r] == troll::cuda_row_error::infeasible;
        CHECK(st[r].status ==
              (no_solution ? troll::row_status::infeasible : troll::row_status::rejected));
      }
    }
    CHECK(rep[2].token == 3);
    CHECK(rep[6].token == 2);
    CHECK(rep[7].token == 1);
    CHECK(rep[7].operand == 1);
    CHECK(rep[3].value == doctest::Approx(std::log(4.0)).epsilon(1e-12));
    // Good rows are the CPU's.
    std::vector<T> want(2 * cols);
    std::vector<troll::projection_stats> want_stats(2);
    troll::project(troll::cpu, troll::make_batch(batch.fresh.data(), 2, cols), troll::make_batch(batch.old.data(), 2, cols),
                   0.05, troll::make_batch(want.data(), 2, cols), want_stats.data());
    for (std::size_t k = 0; k < 2 * cols; ++k)
      CHECK(static_cast<double>(got[k]) == doctest::Approx(static_cast<double>(want[k])).epsilon(1e-5));
    // The backward rejects the forward's rejected rows through their stats.
    device_array<T> g(std::vector<T>(rows * cols, T(1))), grad(rows * cols);
    troll::project_backward(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const T>(zn.get(), rows, cols),
                            troll::make_batch<const T>(zo.get(), rows, cols), troll::make_batch<const T>(out.get(), rows, cols),
                            stats.get(), troll::make_batch<const T>(g.get(), rows, cols),
                            troll::make_batch(grad.get(), rows, cols), {}, static_cast<T*>(nullptr));
    s.sync();
    const std::vector<troll::cuda_row_report> back = reports.download();
    CHECK(back[0].error == troll::cuda_row_error::none);
    CHECK(back[1].error == troll::cuda_row_error::none);
    for (std::size_t r = 2; r < rows; ++r) CHECK(back[r].error != troll::cuda_row_error::none);
  }

  TEST_CASE_TEMPLATE("checked mode throws what the CPU throws, before writing", T, float, double) {
    bad_batch<T> batch;
    const std::size_t cols = batch.cols;
    test_stream s;
    for (std::size_t first = 2; first < batch.rows; ++first) {
      CAPTURE(first);
      // Rows 0, 1 (good) and `first`..end: the lowest bad row is `first`.
      std::vector<T> zn_host(batch.fresh.begin(), batch.fresh.begin() + 2 * cols);
      std::vector<T> zo_host(batch.old.begin(), batch.old.begin() + 2 * cols);
      zn_host.insert(zn_host.end(), batch.fresh.begin() + first * cols, batch.fresh.end());
      zo_host.insert(zo_host.end(), batch.old.begin() + first * cols, batch.old.end());
      const std::size_t rows = zn_host.size() / cols;
      std::vector<T> cpu_out(rows * cols);
      std::vector<troll::projection_stats> cpu_stats(rows);
      std::string cpu_message;
      std::size_t cpu_row = 0;
      try {
        troll::project(troll::cpu, troll::make_batch(zn_host.data(), rows, cols),
                       troll::make_batch(zo_host.data(), rows, cols), 0.05, troll::make_batch(cpu_out.data(), rows, cols),
                       cpu_stats.data());
      } catch (const troll::invalid_input& ex) {
        cpu_message = ex.what();
        cpu_row = ex.row();
      }
      REQUIRE(!cpu_message.empty());

      device_array<T> zn(zn_host), zo(zo_host);
      const std::vector<T> sentinel(rows * cols, T(7));
      device_array<T> out(sentinel);
      device_array<troll::projection_stats> stats(rows);
      std::string cuda_message;
      std::size_t cuda_row = 0;
      try {
        troll::project(troll::cuda.on(s.stream).checked(), troll::make_batch<const T>(zn.get(), rows, cols),
                       troll::make_batch<const T>(zo.get(), rows, cols), 0.05, troll::make_batch(out.get(), rows, cols),
                       stats.get(), troll::projection_options{});
      } catch (const troll::invalid_input& ex) {
        cuda_message = ex.what();
        cuda_row = ex.row();
      }
      CHECK(cuda_message == cpu_message);
      CHECK(cuda_row == cpu_row);
      CHECK(out.download() == sentinel);  // nothing written
    }
  }

  TEST_CASE("checked mode passes a clean batch through and computes it") {
    bad_batch<double> batch;
    const std::size_t rows = 2, cols = batch.cols;
    test_stream s;
    device_array<double> zn(std::vector<double>(batch.fresh.begin(), batch.fresh.begin() + rows * cols));
    device_array<double> zo(std::vector<double>(batch.old.begin(), batch.old.begin() + rows * cols));
    device_array<double> out(rows * cols), kl_out(rows);
    device_array<troll::projection_stats> stats(rows);
    CHECK_NOTHROW(troll::project(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(zn.get(), rows, cols),
                                 troll::make_batch<const double>(zo.get(), rows, cols), 0.05,
                                 troll::make_batch(out.get(), rows, cols), stats.get(), troll::projection_options{}));
    CHECK_NOTHROW(troll::kl(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(out.get(), rows, cols),
                            troll::make_batch<const double>(zo.get(), rows, cols), kl_out.get()));
    const std::vector<double> kl_values = kl_out.download();
    const std::vector<troll::projection_stats> st = stats.download();
    CHECK(st[0].status == troll::row_status::projected);
    CHECK(troll_test::projection_guarantee<double>().accepts(kl_values[0], 0.05));
  }

  TEST_CASE("kl of rows with disjoint supports is +inf, as on the CPU, and no error") {
    // Row 0: p on tokens {0, 1}, q on {2, 3}; row 1: p's support inside q's (finite KL).
    const double m = minus_inf;
    const std::vector<double> p = {0.0, 1.0, m, m, 0.5, m, 1.0, 2.0};
    const std::vector<double> q = {m, m, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0};
    std::vector<double> want(2);
    troll::kl(troll::cpu, troll::make_batch(p.data(), 2, 4), troll::make_batch(q.data(), 2, 4), want.data());
    REQUIRE(std::isinf(want[0]));
    test_stream s;
    device_array<double> dp(p), dq(q), kl_out(2);
    device_array<troll::cuda_row_report> reports(2);
    troll::kl(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const double>(dp.get(), 2, 4),
              troll::make_batch<const double>(dq.get(), 2, 4), kl_out.get());
    const std::vector<double> got = kl_out.download();
    const std::vector<troll::cuda_row_report> rep = reports.download();
    CHECK(rep[0].error == troll::cuda_row_error::none);
    CHECK(rep[1].error == troll::cuda_row_error::none);
    CHECK(std::isinf(got[0]));
    CHECK(got[0] > 0.0);
    CHECK(got[1] == doctest::Approx(want[1]).epsilon(1e-12));
    CHECK_NOTHROW(troll::kl(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(dp.get(), 2, 4),
                            troll::make_batch<const double>(dq.get(), 2, 4), kl_out.get()));
  }
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
