// tests/cuda/test_cuda_gaussian_derivatives.cu — the CUDA Gaussian KL and diagonal VJP / JVP
// (troll/cuda_gaussian_derivatives.cuh): the test body of tests/test_gaussian_diag_derivatives.cpp
// (oracles: long-double KL, central differences of the CPU forward) run on the device with the
// checked policy, the device's own handling of bad rows (NaN, nothing thrown) and the host-side
// argument checks, which run without a device.
//
// Without a CUDA device the "device" suite is skipped and "SKIPPED: no CUDA device" is printed.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include "gaussian_oracle.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "gaussian_narrow_axis_reference.hpp"
#include "troll/cuda_gaussian.cuh"
#include "troll/gaussian.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/gaussian_diag_derivatives.hpp"

TEST_CASE("unchecked: a bad row gets NaN gradients, the others match the CPU") {
  const std::size_t n = 5, d = 70;
  const double eps = 0.05;
  diag_batch b = make_diag(n, d, 11);
  const diag_forward f = cpu_forward(b, false, eps, eps);
  b.sd[3 * d + 1] = 0.0;  // row 3 bad after the forward
  using troll_test::device_array;
  device_array<double> m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), ym(f.mean), ys(f.sd);
  device_array<double> gm(n * d), ge(n);
  device_array<stats_t> st(f.stats);
  auto in = [&](const device_array<double>& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
  const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.get(), n, d), {}, {}, {}, ge.get(), nullptr};
  const troll_test::test_stream stream;
  troll::gaussian::project_joint_diag_backward(troll::cuda.on(stream.stream), in(m), in(s), in(om), in(os), eps,
                                               in(ym), in(ys), st.get(), in(ym), in(ys), grads);
  stream.sync();
  const std::vector<double> hm = gm.download(), he = ge.download();
  for (std::size_t i = 0; i < d; ++i) CHECK(std::isnan(hm[3 * d + i]));
  CHECK(std::isnan(he[3]));
  // The good rows against the CPU.
  std::vector<double> cm(n * d), ce(n);
  diag_batch good = b;
  good.sd[3 * d + 1] = 1.0;
  const troll::gaussian::gaussian_grads<double> cg{troll::make_batch(cm.data(), n, d), {}, {}, {}, ce.data(), nullptr};
  troll::gaussian::project_joint_diag_backward(troll::cpu, view(good.mean, n, d), view(good.sd, n, d),
                                               view(good.old_mean, n, d), view(good.old_sd, n, d), eps,
                                               view(f.mean, n, d), view(f.sd, n, d), f.stats.data(),
                                               view(f.mean, n, d), view(f.sd, n, d), cg);
  for (std::size_t r = 0; r < n; ++r) {
    if (r == 3) continue;
    CHECK(close(he[r], ce[r], 1e-13, 1e-10));
    for (std::size_t i = r * d; i < (r + 1) * d; ++i) CHECK(close(hm[i], cm[i], 1e-13, 1e-10));
  }
}

TEST_CASE("unchecked: a non-finite upstream gradient or tangent gives the row NaN, the others match the CPU") {
  const std::size_t n = 5, d = 70;
  const double eps = 0.05;
  const diag_batch b = make_diag(n, d, 12);
  const diag_forward f = cpu_forward(b, false, eps, eps);
  std::vector<double> up_m(n * d, 0.5), up_s(n * d, -0.25), tan_m(n * d, 0.125);
  for (std::size_t i = 0; i < n * d; ++i) up_m[i] += 1e-3 * double(i % 17), tan_m[i] -= 1e-3 * double(i % 13);
  // The CPU on the clean operands.
  const troll::gaussian::gaussian_tangents<double> cpu_tangents{view(tan_m, n, d), {}, {}, {}, 0.01, 0.0};
  std::vector<double> cm(n * d), ce(n), ctm(n * d), cts(n * d);
  const troll::gaussian::gaussian_grads<double> cg{troll::make_batch(cm.data(), n, d), {}, {}, {}, ce.data(), nullptr};
  troll::gaussian::project_joint_diag_backward(troll::cpu, view(b.mean, n, d), view(b.sd, n, d),
                                               view(b.old_mean, n, d), view(b.old_sd, n, d), eps, view(f.mean, n, d),
                                               view(f.sd, n, d), f.stats.data(), view(up_m, n, d), view(up_s, n, d),
                                               cg);
  troll::gaussian::project_joint_diag_jvp(troll::cpu, view(b.mean, n, d), view(b.sd, n, d), view(b.old_mean, n, d),
                                          view(b.old_sd, n, d), eps, view(f.mean, n, d), view(f.sd, n, d),
                                          f.stats.data(), cpu_tangents, troll::make_batch(ctm.data(), n, d),
                                          troll::make_batch(cts.data(), n, d));
  up_s[2 * d + 69] = std::numeric_limits<double>::infinity();  // the VJP's row 2 (last lane's share)
  tan_m[4 * d + 40] = std::nan("");                             // the JVP's row 4
  using troll_test::device_array;
  device_array<double> m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), ym(f.mean), ys(f.sd), um(up_m), us(up_s),
      tm(tan_m);
  device_array<double> gm(n * d), ge(n), om_t(n * d), os_t(n * d);
  device_array<stats_t> st(f.stats);
  auto in = [&](const device_array<double>& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
  const troll::gaussian::gaussian_grads<double> grads{troll::make_batch(gm.get(), n, d), {}, {}, {}, ge.get(), nullptr};
  const troll::gaussian::gaussian_tangents<double> device_tangents{in(tm), {}, {}, {}, 0.01, 0.0};
  const troll_test::test_stream stream;
  troll::gaussian::project_joint_diag_backward(troll::cuda.on(stream.stream), in(m), in(s), in(om), in(os), eps,
                                               in(ym), in(ys), st.get(), in(um), in(us), grads);
  troll::gaussian::project_joint_diag_jvp(troll::cuda.on(stream.stream), in(m), in(s), in(om), in(os), eps, in(ym),
                                          in(ys), st.get(), device_tangents,
                                          troll::make_batch(om_t.get(), n, d), troll::make_batch(os_t.get(), n, d));
  stream.sync();
  const std::vector<double> hm = gm.download(), he = ge.download(), htm = om_t.download(), hts = os_t.download();
  CHECK(std::isnan(he[2]));
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t i = r * d; i < (r + 1) * d; ++i) {
      CAPTURE(r);
      if (r == 2) {
        CHECK(std::isnan(hm[i]));
      } else {
        CHECK(close(hm[i], cm[i], 1e-13, 1e-10));
      }
      if (r == 4) {
        CHECK(std::isnan(htm[i]));
        CHECK(std::isnan(hts[i]));
      } else {
        CHECK(close(htm[i], ctm[i], 1e-13, 1e-10));
        CHECK(close(hts[i], cts[i], 1e-13, 1e-10));
      }
    }
  for (std::size_t r = 0; r < n; ++r)
    if (r != 2) CHECK(close(he[r], ce[r], 1e-13, 1e-10));
}
}

TEST_CASE("host-side checks of the CUDA Gaussian derivatives (no device needed)") {
  namespace g = troll::gaussian;
  const double* p = reinterpret_cast<const double*>(0x1000);  // never read: the checks throw first
  double* w = reinterpret_cast<double*>(0x2000);
  const auto in = troll::make_batch(p, 2, 3);
  const auto out = troll::make_batch(w, 2, 3);
  const auto wrong = troll::make_batch(p, 2, 4);
  const auto big = troll::make_batch(p, 2, 2049);
  const auto big_out = troll::make_batch(w, 2, 2049);
  const g::gaussian_stats* stats = reinterpret_cast<const g::gaussian_stats*>(0x3000);
  const g::gaussian_grads<double> grads{out, out, out, out, w, w};
  CHECK_THROWS_AS(g::project_joint_diag_backward(troll::cuda, in, wrong, in, in, 0.1, in, in, stats, in, in, grads),
                  troll::shape_error);
  CHECK_THROWS_AS(g::project_joint_diag_backward(troll::cuda, in, in, in, in, 0.0, in, in, stats, in, in, grads),
                  troll::domain_error);
  CHECK_THROWS_AS(g::project_split_diag_backward(troll::cuda, in, in, in, in, 0.1, -1.0, in, in, stats, in, in, grads),
                  troll::domain_error);
  CHECK_THROWS_AS(g::project_joint_diag_backward(troll::cuda, in, in, in, in, 0.1, in, in, nullptr, in, in, grads),
                  troll::shape_error);
  const g::gaussian_grads<double> wrong_grads{troll::make_batch(w, 2, 4), {}, {}, {}, nullptr, nullptr};
  CHECK_THROWS_AS(
      g::project_joint_diag_backward(troll::cuda, in, in, in, in, 0.1, in, in, stats, in, in, wrong_grads),
      troll::shape_error);
  g::gaussian_tangents<double> tangents{in, in, in, in, 0.0, 0.0};
  CHECK_THROWS_AS(g::project_joint_diag_jvp(troll::cuda, in, in, in, in, 0.1, in, wrong, stats, tangents, out, out),
                  troll::shape_error);
  tangents.eps = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(g::project_joint_diag_jvp(troll::cuda, in, in, in, in, 0.1, in, in, stats, tangents, out, out),
                  troll::domain_error);
  tangents.eps = 0.0;
  const g::gaussian_tangents<double> big_tangents{big, big, big, big, 0.0, 0.0};
  CHECK_THROWS_AS(g::project_split_diag_jvp(troll::cuda, big, big, big, big, 0.1, 0.1, big, big, stats, big_tangents,
                                            big_out, big_out),
                  troll::shape_error);
  CHECK_THROWS_AS(g::kl_diag(troll::cuda, in, in, in, in, nullptr), troll::shape_error);
  const auto full = troll::make_batch(p, 2, 33 * 33), full_mean = troll::make_batch(p, 2, 33);
  CHECK_THROWS_AS(g::kl(troll::cuda, full_mean, full, full_mean, full, w), troll::shape_error);
  // Zero rows: nothing to do, nothing thrown.
  const auto none = troll::make_batch(p, 0, 3);
  const auto none_out = troll::make_batch(w, 0, 3);
  CHECK_NOTHROW(g::kl_diag(troll::cuda, none, none, none, none, nullptr));
  CHECK_NOTHROW(g::project_joint_diag_backward(troll::cuda, none, none, none, none, 0.1, none, none, nullptr, none,
                                               none, g::gaussian_grads<double>{none_out, none_out, none_out, none_out,
                                                                               nullptr, nullptr}));
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
