// tests/cuda/test_cuda_objectives.cu — TROLL's objective and PPO clip under the CUDA policy
// (troll/cuda_objectives.cuh) against the CPU objectives: forward (log π*, stats, per-token
// losses, metrics) and backward, both aggregations, masks; device row reports, the checked
// mode's exceptions, and the host-side argument checks. Also the objectives' gradients against
// troll's finite-difference checker (tests/bodies/objective_gradients.hpp, the body of
// tests/test_objectives.cpp) run on the device, and the adversarial batches of
// tests/bodies/adversarial_objectives.hpp (the body of tests/test_adversarial_sparse.cpp: PPO
// clip's loss against long double, PPO clip / DPPO / TROLL gradients against central differences
// of the device forward, zero masks). DPPO's CUDA tests are tests/cuda/test_cuda_dppo.cu.
//
// Without a CUDA device the "device" test suite is excluded, "SKIPPED: no CUDA device" is
// printed, the host-only cases still run and the exit code is 0.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "cuda_objective_batch.cuh"
#include "grad_helpers.hpp"
#include "objective_batch.hpp"
#include "objective_cases.hpp"
#include "oracle.hpp"
#include "sparse_oracle.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/gradcheck.hpp"
#include "troll/objectives.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

namespace {

using troll_test::device_array;
using troll_test::device_batch;
using troll_test::host_batch;
using troll_test::message_of;
using troll_test::objective_between_backends;
using troll_test::test_stream;

using troll_test::tolerance;
using troll_test::unit_roundoff;

using troll_test::nan_value;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-only cases: they run with or without a device.
// ---------------------------------------------------------------------------------------------

TEST_CASE("objective workspace size: a header and one record per row") {
  const std::size_t header = troll::objective_workspace_bytes(0);
  const std::size_t per_row = troll::objective_workspace_bytes(1) - header;
  CHECK(header > 0);
  CHECK(per_row >= 4 * sizeof(double));
  CHECK(troll::objective_workspace_bytes(10) == header + 10 * per_row);
}

TEST_CASE("cuda objective entry points check their arguments on the host, before any CUDA call") {
  // Dangling but non-null "device" pointers: none of these calls may touch them.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  const std::int64_t* fake_ids = reinterpret_cast<const std::int64_t*>(std::uintptr_t(512));
  auto* fake_stats = reinterpret_cast<troll::projection_stats*>(std::uintptr_t(1024));
  auto* fake_metrics = reinterpret_cast<troll::objective_metrics*>(std::uintptr_t(2048));
  void* fake_workspace = reinterpret_cast<void*>(std::uintptr_t(4096));
  const auto z = troll::make_batch<const float>(fake, 4, 8);
  const auto out = troll::make_batch<float>(fake, 4, 8);
  const auto narrow = troll::make_batch<float>(fake, 4, 7);
  troll::token_batch<float> in;
  in.tokens = fake_ids;
  in.advantages = fake;
  const auto policy = troll::cuda.on(nullptr);
  troll::trust_region_objective objective;

  auto forward = [&](const troll::trust_region_objective& o, troll::batch_view<float> lp,
                     const troll::token_batch<float>& b, troll::objective_metrics* m, void* w) {
    troll::objective_forward(policy.with_workspace(w, std::size_t(1) << 30), o, z, z, b, lp, fake_stats, fake, m);
  };
  troll::trust_region_objective bad_eps;
  bad_eps.eps = 0.0;
  CHECK_THROWS_AS(forward(bad_eps, out, in, fake_metrics, fake_workspace), troll::domain_error);
  troll::trust_region_objective bad_alpha;
  bad_alpha.alpha = -1.0;
  CHECK_THROWS_AS(forward(bad_alpha, out, in, fake_metrics, fake_workspace), troll::domain_error);
  CHECK_THROWS_AS(forward(objective, narrow, in, fake_metrics, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(objective, out, in, nullptr, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(objective, out, in, fake_metrics, nullptr), troll::shape_error);
  troll::token_batch<float> no_tokens = in;
  no_tokens.tokens = nullptr;
  CHECK_THROWS_AS(forward(objective, out, no_tokens, fake_metrics, fake_workspace),
                  troll::shape_error);
  troll::token_batch<float> no_ids = in;
  no_ids.aggregation = troll::loss_aggregation::sequence_mean;
  CHECK_THROWS_AS(forward(objective, out, no_ids, fake_metrics, fake_workspace),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::objective_forward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), objective, z, z, in, out, nullptr, fake,
                                           fake_metrics),
                  troll::shape_error);

  CHECK_THROWS_AS(troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), objective, z, z, in, z, fake_stats, out, nan_value),
                  troll::domain_error);
  CHECK_THROWS_AS(
      troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), objective, z, z, in, z, fake_stats, narrow),
      troll::shape_error);
  CHECK_THROWS_AS(
      troll::objective_backward(policy, objective, z, z, in, z, fake_stats, out),
      troll::shape_error);
  CHECK_THROWS_AS(
      troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), objective, z, z, in, z, nullptr, out),
      troll::shape_error);
  troll::ppo_clip_objective bad_clip;
  bad_clip.clip_low = 1.5;
  CHECK_THROWS_AS(
      troll::objective_forward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), bad_clip, z, z, in, fake, fake_metrics),
      troll::domain_error);
  CHECK_THROWS_AS(troll::objective_forward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), troll::ppo_clip_objective{}, z, z, in, fake,
                                           nullptr),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), troll::ppo_clip_objective{}, z, z, in, narrow),
                  troll::shape_error);
  CHECK_THROWS_AS(troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), troll::ppo_clip_objective{}, z, z, in, out, nan_value),
                  troll::domain_error);
}

TEST_CASE("device reports of objective rows become the CPU's exceptions, message for message") {
  using e = troll::row_error;
  struct pair {
    e error;
    e kind;  // the CPU's code for the same row
    double value;
  };
  const pair cases[] = {
      {e::bad_sampled, e::token_range, 99.0},          {e::bad_advantage, e::bad_advantage, nan_value},
      {e::bad_mask, e::bad_mask, -1.0},                {e::sequence_order, e::sequence_order, 2.0},
      {e::old_token_masked, e::old_token_masked, 5.0}, {e::regression_inf, e::regression_inf, 0.0},
  };
  static const char* const names[3] = {"new_logits", "old_logits", ""};
  for (const pair& c : cases) {
    troll::cuda_row_report report;
    report.error = c.error;
    report.value = c.value;
    const troll::detail::row_problem p = troll::detail::make_problem(c.kind, "", 0, c.value);
    const std::string want = message_of([&] { troll::detail::throw_row_problem("objective_forward", 3, p); });
    const std::string got = message_of([&] {
      troll::detail::cuda::throw_objective_report{}("objective_forward", 3, report, names);
    });
    CHECK(!want.empty());
    CHECK(got == want);
  }
  // Logit problems go through the projection's translation, as the CPU's logit checks.
  troll::cuda_row_report report;
  report.error = troll::cuda_row_error::nan_value;
  report.operand = 1;
  report.token = 4;
  const troll::detail::row_problem p = troll::detail::make_problem(e::nan_value, "old_logits", 4, 0.0);
  CHECK(message_of([&] {
          troll::detail::cuda::throw_objective_report{}("objective_forward", 0, report, names);
        }) ==
        message_of([&] { troll::detail::throw_row_problem("objective_forward", 0, p); }));
}

// ---------------------------------------------------------------------------------------------
// Device cases: skipped (filtered out) without a device.
// ---------------------------------------------------------------------------------------------

namespace {

/// Runs TROLL's forward and backward on both backends for one batch and compares everything.
template <class T>
void compare_with_cpu(std::size_t rows, std::size_t cols, unsigned seed,
                      troll::loss_aggregation how, double alpha, int mask_exponent = 0) {
  CAPTURE(rows);
  CAPTURE(cols);
  CAPTURE(alpha);
  CAPTURE(mask_exponent);
  host_batch<T> h(rows, cols, seed);
  // Masks scaled by 2^mask_exponent (2^1021: their sum overflows a double).
  for (T& w : h.mask) w = T(std::ldexp(double(w), mask_exponent));
  troll::trust_region_objective objective;
  objective.eps = 0.02;
  objective.alpha = alpha;

  std::vector<T> cpu_log_probs(rows * cols), cpu_loss(rows), cpu_grad(rows * cols);
  std::vector<troll::projection_stats> cpu_stats(rows);
  const troll::objective_metrics want = troll::objective_forward(
      troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how),
      troll::make_batch(cpu_log_probs.data(), rows, cols), cpu_stats.data(), cpu_loss.data());
  const double grad_loss = 0.75;
  troll::objective_backward(troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how),
                            troll::make_batch<const T>(cpu_log_probs.data(), rows, cols),
                            cpu_stats.data(), troll::make_batch(cpu_grad.data(), rows, cols),
                            grad_loss);

  test_stream stream;
  const device_batch<T> d(h);
  device_array<T> log_probs(rows * cols), token_loss(rows), grad(rows * cols);
  device_array<troll::projection_stats> stats(rows);
  device_array<troll::objective_metrics> metrics(1);
  device_array<unsigned char> workspace(troll::objective_workspace_bytes(rows));
  device_array<troll::cuda_row_report> reports(rows);
  troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get()}), objective, d.new_view(), d.old_view(),
                           d.tokens_view(how), troll::make_batch(log_probs.get(), rows, cols),
                           stats.get(), token_loss.get(), metrics.get());
  troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), objective, d.new_view(), d.old_view(),
                            d.tokens_view(how),
                            troll::make_batch<const T>(log_probs.get(), rows, cols), stats.get(),
                            troll::make_batch(grad.get(), rows, cols), grad_loss);
  stream.sync();

  for (const troll::cuda_row_report& r : reports.download())
    CHECK(r.error == troll::cuda_row_error::none);
  const tolerance tol = objective_between_backends<T>();
  const std::vector<T> got_log_probs = log_probs.download(), got_loss = token_loss.download(),
                       got_grad = grad.download();
  const std::vector<troll::projection_stats> got_stats = stats.download();
  std::size_t projected = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    CHECK(got_stats[r].status == cpu_stats[r].status);
    projected += cpu_stats[r].status == troll::row_status::projected ? 1 : 0;
    CHECK(tol.scaled(16).accepts(got_stats[r].kl_after, cpu_stats[r].kl_after));
    CHECK(tol.scaled(16).accepts(got_loss[r], cpu_loss[r]));
    for (std::size_t j = 0; j < cols; ++j) {
      CHECK(tol.scaled(16).accepts(got_log_probs[r * cols + j], cpu_log_probs[r * cols + j]));
      CHECK(tol.scaled(64).accepts(got_grad[r * cols + j], cpu_grad[r * cols + j]));
    }
  }
  CHECK(projected > rows / 4);  // the batch exercises the projected rows' formulas

  const troll::objective_metrics got = metrics.download()[0];
  CHECK(got.tokens == want.tokens);
  CHECK(got.sequences == want.sequences);
  CHECK(tol.scaled(16).accepts(got.loss, want.loss));
  CHECK(tol.scaled(16).accepts(got.ratio_mean, want.ratio_mean));
  CHECK(tol.scaled(16).accepts(got.kl_before_mean, want.kl_before_mean));
  CHECK(tol.scaled(16).accepts(got.kl_before_max, want.kl_before_max));
  CHECK(tol.scaled(16).accepts(got.kl_after_mean, want.kl_after_mean));
  CHECK(tol.scaled(16).accepts(got.kl_after_max, want.kl_after_max));
  CHECK(tol.scaled(16).accepts(got.regression_kl_mean, want.regression_kl_mean));
  CHECK(tol.scaled(16).accepts(got.eta_mean, want.eta_mean));
  CHECK(got.projected_fraction == want.projected_fraction);
}

/// PPO clip on both backends for one batch (dual clip on, asymmetric bounds).
template <class T>
void compare_ppo_with_cpu(std::size_t rows, std::size_t cols, unsigned seed,
                          troll::loss_aggregation how, int mask_exponent = 0) {
  CAPTURE(rows);
  CAPTURE(cols);
  CAPTURE(mask_exponent);
  host_batch<T> h(rows, cols, seed);
  for (T& w : h.mask) w = T(std::ldexp(double(w), mask_exponent));
  troll::ppo_clip_objective objective;
  objective.clip_low = 0.2;
  objective.clip_high = 0.28;
  objective.dual_clip = 3.0;
  std::vector<T> cpu_loss(rows), cpu_grad(rows * cols);
  const troll::objective_metrics want = troll::objective_forward(
      troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how), cpu_loss.data());
  const double grad_loss = 1.5;
  troll::objective_backward(troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how),
                            troll::make_batch(cpu_grad.data(), rows, cols), grad_loss);

  test_stream stream;
  const device_batch<T> d(h);
  device_array<T> token_loss(rows), grad(rows * cols);
  device_array<troll::objective_metrics> metrics(1);
  device_array<unsigned char> workspace(troll::objective_workspace_bytes(rows));
  troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), objective, d.new_view(), d.old_view(),
                           d.tokens_view(how), token_loss.get(), metrics.get());
  troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), objective, d.new_view(), d.old_view(),
                            d.tokens_view(how), troll::make_batch(grad.get(), rows, cols), grad_loss);
  stream.sync();

  const tolerance tol = objective_between_backends<T>();
  const std::vector<T> got_loss = token_loss.download(), got_grad = grad.download();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    CHECK(tol.scaled(16).accepts(got_loss[r], cpu_loss[r]));
    for (std::size_t j = 0; j < cols; ++j)
      CHECK(tol.scaled(16).accepts(got_grad[r * cols + j], cpu_grad[r * cols + j]));
  }
  const troll::objective_metrics got = metrics.download()[0];
  CHECK(want.limited_fraction > 0.0);  // the batch exercises the clip
  CHECK(got.tokens == want.tokens);
  CHECK(got.sequences == want.sequences);
  CHECK(got.limited_fraction == want.limited_fraction);
  CHECK(tol.scaled(16).accepts(got.loss, want.loss));
  CHECK(tol.scaled(16).accepts(got.ratio_mean, want.ratio_mean));
  CHECK(tol.scaled(16).accepts(got.kl_before_mean, want.kl_before_mean));
  CHECK(tol.scaled(16).accepts(got.kl_after_max, want.kl_after_max));
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE_TEMPLATE("PPO clip forward and backward match the CPU objective", T, float, double) {
    for (const auto how :
         {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
      CAPTURE(static_cast<int>(how));
      compare_ppo_with_cpu<T>(24, 257, 21u, how);
    }
  }

  TEST_CASE_TEMPLATE("TROLL objective forward and backward match the CPU objective", T, float,
                     double) {
    for (const auto how :
         {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
      CAPTURE(static_cast<int>(how));
      compare_with_cpu<T>(24, 257, 11u, how, 1.0);
      compare_with_cpu<T>(9, 1031, 12u, how, 0.0);
    }
  }

  TEST_CASE("loss masks whose sum overflows a double weigh by their ratios, as on the CPU") {
    for (const auto how :
         {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
      CAPTURE(static_cast<int>(how));
      compare_ppo_with_cpu<double>(24, 257, 21u, how, 1021);
      compare_with_cpu<double>(24, 257, 11u, how, 1.0, 1021);
      compare_with_cpu<double>(24, 257, 11u, how, 1.0, -1060);  // subnormal masks
    }
  }

  TEST_CASE("an all-zero mask gives loss 0, zero metrics and zero gradients") {
    host_batch<double> h(6, 64, 3u);
    std::fill(h.mask.begin(), h.mask.end(), 0.0);
    const device_batch<double> d(h);
    test_stream stream;
    device_array<double> log_probs(6 * 64), grad(6 * 64);
    device_array<troll::projection_stats> stats(6);
    device_array<troll::objective_metrics> metrics(1);
    device_array<unsigned char> workspace(troll::objective_workspace_bytes(6));
    const auto in = d.tokens_view(troll::loss_aggregation::sequence_mean);
    troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), troll::trust_region_objective{},
                             d.new_view(), d.old_view(), in,
                             troll::make_batch(log_probs.get(), 6, 64), stats.get(), nullptr,
                             metrics.get());
    troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), troll::trust_region_objective{},
                              d.new_view(), d.old_view(), in,
                              troll::make_batch<const double>(log_probs.get(), 6, 64), stats.get(),
                              troll::make_batch(grad.get(), 6, 64));
    stream.sync();
    const troll::objective_metrics m = metrics.download()[0];
    CHECK(m.loss == 0.0);
    CHECK(m.tokens == 0);
    CHECK(m.sequences == 0);
    for (double g : grad.download()) CHECK(g == 0.0);
  }

  TEST_CASE_TEMPLATE(
      "bad token rows: reports, first_bad_row, NaN outputs; checked mode throws the CPU's error", T,
      float, double) {
    host_batch<T> h(8, 64, 5u);
    h.advantages[5] = T(nan_value);
    h.tokens[6] = 64;  // outside [0, V)
    h.mask[6] = T(1);
    const device_batch<T> d(h);
    const auto how = troll::loss_aggregation::token_mean;
    test_stream stream;
    device_array<T> log_probs(8 * 64), token_loss(8);
    device_array<troll::projection_stats> stats(8);
    device_array<troll::objective_metrics> metrics(1);
    device_array<unsigned char> workspace(troll::objective_workspace_bytes(8));
    device_array<troll::cuda_row_report> reports(8);
    device_array<unsigned long long> first_bad(1);
    troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), troll::trust_region_objective{},
                             d.new_view(), d.old_view(), d.tokens_view(how),
                             troll::make_batch(log_probs.get(), 8, 64), stats.get(),
                             token_loss.get(), metrics.get());
    stream.sync();
    const std::vector<troll::cuda_row_report> rep = reports.download();
    CHECK(rep[5].error == troll::cuda_row_error::bad_advantage);
    CHECK(rep[6].error == troll::cuda_row_error::bad_sampled);
    CHECK(first_bad.download()[0] == 5ull);
    CHECK(std::isnan(static_cast<double>(token_loss.download()[5])));
    CHECK(std::isnan(metrics.download()[0].loss));

    std::vector<T> cpu_log_probs(8 * 64);
    std::vector<troll::projection_stats> cpu_stats(8);
    const std::string want = message_of([&] {
      troll::objective_forward(troll::cpu, troll::trust_region_objective{}, h.new_view(),
                               h.old_view(), h.tokens_view(how),
                               troll::make_batch(cpu_log_probs.data(), 8, 64), cpu_stats.data());
    });
    const std::string got = message_of([&] {
      troll::objective_forward(
          troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).checked(), troll::trust_region_objective{}, d.new_view(),
          d.old_view(), d.tokens_view(how), troll::make_batch(log_probs.get(), 8, 64), stats.get(),
          token_loss.get(), metrics.get());
    });
    CHECK(!want.empty());
    CHECK(got == want);
  }
}

namespace {

/// One near one-hot row (the thirty-sixth session's audits) through both backends, double: the
/// device's gradient against the CPU's (held to long-double references in
/// tests/test_objective_extremes.cpp) relative to the gradient's own largest entry, where
/// objective_between_backends' absolute part would accept a 0 for an entry of 1e-18.
template <class Objective>
void near_one_hot_row(const Objective& objective, const std::vector<double>& zn, const std::vector<double>& zo,
                      std::int64_t token, double advantage) {
  const std::size_t v = zn.size();
  std::vector<std::int64_t> tok = {token};
  std::vector<double> adv = {advantage}, want(v);
  troll::token_batch<double> h;
  h.tokens = tok.data();
  h.advantages = adv.data();
  device_array<double> d_zn(zn), d_zo(zo), d_adv(adv), d_grad(v);
  device_array<std::int64_t> d_tok(tok);
  troll::token_batch<double> d;
  d.tokens = d_tok.get();
  d.advantages = d_adv.get();
  device_array<unsigned char> workspace(troll::objective_workspace_bytes(1));
  device_array<troll::objective_metrics> metrics(1);
  test_stream stream;
  const auto policy = troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes());
  troll::objective_metrics cpu_metrics;
  if constexpr (std::is_same<Objective, troll::trust_region_objective>::value) {
    std::vector<double> lp(v);
    troll::projection_stats st;
    cpu_metrics = troll::objective_forward(troll::cpu, objective, troll::make_batch<const double>(zn.data(), 1, v),
                                           troll::make_batch<const double>(zo.data(), 1, v), h,
                                           troll::make_batch(lp.data(), 1, v), &st);
    troll::objective_backward(troll::cpu, objective, troll::make_batch<const double>(zn.data(), 1, v),
                              troll::make_batch<const double>(zo.data(), 1, v), h,
                              troll::make_batch<const double>(lp.data(), 1, v), &st,
                              troll::make_batch(want.data(), 1, v));
    device_array<double> d_lp(v);
    device_array<troll::projection_stats> d_st(1);
    troll::objective_forward(policy, objective, troll::make_batch<const double>(d_zn.get(), 1, v),
                             troll::make_batch<const double>(d_zo.get(), 1, v), d, troll::make_batch(d_lp.get(), 1, v),
                             d_st.get(), nullptr, metrics.get());
    troll::objective_backward(policy, objective, troll::make_batch<const double>(d_zn.get(), 1, v),
                              troll::make_batch<const double>(d_zo.get(), 1, v), d,
                              troll::make_batch<const double>(d_lp.get(), 1, v), d_st.get(),
                              troll::make_batch(d_grad.get(), 1, v));
  } else {
    cpu_metrics = troll::objective_forward(troll::cpu, objective, troll::make_batch<const double>(zn.data(), 1, v),
                                           troll::make_batch<const double>(zo.data(), 1, v), h);
    troll::objective_backward(troll::cpu, objective, troll::make_batch<const double>(zn.data(), 1, v),
                              troll::make_batch<const double>(zo.data(), 1, v), h, troll::make_batch(want.data(), 1, v));
    troll::objective_forward(policy, objective, troll::make_batch<const double>(d_zn.get(), 1, v),
                             troll::make_batch<const double>(d_zo.get(), 1, v), d, nullptr, metrics.get());
    troll::objective_backward(policy, objective, troll::make_batch<const double>(d_zn.get(), 1, v),
                              troll::make_batch<const double>(d_zo.get(), 1, v), d, troll::make_batch(d_grad.get(), 1, v));
  }
  stream.sync();
  const std::vector<double> got = d_grad.download();
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (std::size_t j = 0; j < v; ++j) {
    CAPTURE(j);
    CHECK(std::fabs(got[j] - want[j]) <= 1e-12 * scale);
  }
  const troll::objective_metrics m = metrics.download()[0];
  CHECK(m.limited_fraction == cpu_metrics.limited_fraction);
  CHECK(m.divergence_mean == doctest::Approx(cpu_metrics.divergence_mean).epsilon(1e-12));
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE("near one-hot rows: the device's objective gradients match the CPU's, relative to themselves") {
    troll::trust_region_objective troll_objective;
    // an inactive row sampled at its dominant token (the entry was 0 for −3.5e-135)
    troll_objective.eps = 5.3442873218253979e-06;
    near_one_hot_row(troll_objective,
                     {0.85628676220478528, 1.6595079310927789, -0.23469957593696841, 311.91325000725573,
                      -1.228563896856355, 0.41671610732941278, 0.26311804451127285, -2.3823859683752153},
                     {1.1275662150887551, 2.8622119622156199, -1.8050688560718902, 148.42430902085141,
                      -0.66725579786105949, 0.41713620671365104, -0.46723612477328846, -2.2974142667247093},
                     3, 0.87636609357581741);
    // the regression term at p̃'s dominant token, π*'s another (A = 0)
    troll_objective.eps = 0.05;
    near_one_hot_row(troll_objective, {-40.0, 0.0, -41.0, -42.0},
                     {-3.0983564697167347e-09, -20.000000003098357, -21.000000003098357, -22.000000003098357}, 0, 0.0);
    // PPO clip, unclipped at a huge ratio: the sampled token's entry (was 0 for 7.47)
    const std::vector<double> zn = {37.93256159712966, -2.569795519014507}, zo = {0.295021767249682, 43.572481144786586};
    near_one_hot_row(troll::ppo_clip_objective{}, zn, zo, 0, -0.46599421569978794);
    // DPPO binary KL just short of log p̃_a = 0: the token is masked (divergence 0.0503 > 0.05)
    near_one_hot_row(troll::dppo_objective::defaults(troll::dppo_divergence::binary_kl), {36.5, 0.0},
                     {6.360101178210273, 0.0}, 0, 1.0);
  }
}

TEST_SUITE("device") {
#include "../bodies/objective_gradients.hpp"
#include "../bodies/adversarial_objectives.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
