// tests/cuda/test_cuda_dppo.cu — DPPO under the CUDA policy (troll/cuda_objectives.cuh)
// against the CPU objective: the four divergences (binary TV / KL, top-K TV / KL) with masks in
// both directions, token and sequence mean, loss masks, float and double; top-K selections with
// exact ties (and −0 against +0) at the K-th old logit, K above the finite entries and K = 256
// across a row wider than a block; device row reports and the checked mode's exceptions; the
// host-side argument checks.
//
// Without a CUDA device the "device" test suite is excluded, "SKIPPED: no CUDA device" is
// printed, the host-only cases still run and the exit code is 0.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda_objective_batch.cuh"
#include "objective_batch.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/objectives.hpp"

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
using troll_test::inf_value;

/// Every odd row samples the old row's most likely token, so that μ = q_a is large enough for
/// the binary divergences to cross their bounds.
template <class T>
void sample_likely_tokens(host_batch<T>& h) {
  for (std::size_t r = 1; r < h.rows; r += 2) {
    const T* old = h.old.data() + r * h.cols;
    h.tokens[r] = std::int64_t(std::max_element(old, old + h.cols) - old);
  }
}

/// Old logits rounded to multiples of 1/2: many exact ties at the K-th value of the top-K
/// selection (and −0 next to +0).
template <class T>
void quantize_old(host_batch<T>& h) {
  for (T& x : h.old) x = T(std::round(2.0 * static_cast<double>(x)) / 2.0);
}

/// The DPPO batches of the comparisons (24 rows, V = 257): plain or with quantized old logits.
template <class T>
host_batch<T> dppo_batch(bool quantized) {
  host_batch<T> h(24, 257, quantized ? 32u : 31u);
  sample_likely_tokens(h);
  if (quantized) quantize_old(h);
  return h;
}

/// DPPO with bounds that mask tokens in both directions on dppo_batch (asymmetric: δ_low = δ/2).
troll::dppo_objective dppo_for(troll::dppo_divergence d) {
  troll::dppo_objective o = troll::dppo_objective::defaults(d);
  const double delta = d == troll::dppo_divergence::binary_tv   ? 1e-3
                       : d == troll::dppo_divergence::binary_kl ? 1e-4
                                                                : 0.15;
  o.delta_high = delta;
  o.delta_low = 0.5 * delta;
  o.top_k = 20;
  return o;
}

const troll::dppo_divergence all_divergences[] = {
    troll::dppo_divergence::binary_tv, troll::dppo_divergence::binary_kl,
    troll::dppo_divergence::topk_tv, troll::dppo_divergence::topk_kl};

/// Counted rows the CPU masked, split by the sign of the advantage (a masked token's loss is 0).
template <class T>
void count_masked(const host_batch<T>& h, const std::vector<T>& loss, int& positive, int& negative) {
  positive = negative = 0;
  for (std::size_t r = 0; r < h.rows; ++r) {
    if (h.mask[r] == T(0) || loss[r] != T(0)) continue;
    (h.advantages[r] > T(0) ? positive : negative) += 1;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-only cases: they run with or without a device.
// ---------------------------------------------------------------------------------------------

TEST_CASE("objective workspace size: room for DPPO's divergence in every row record") {
  const std::size_t per_row =
      troll::objective_workspace_bytes(1) - troll::objective_workspace_bytes(0);
  CHECK(per_row >= 6 * sizeof(double));
}

TEST_CASE("cuda DPPO entry points check their arguments on the host, before any CUDA call") {
  // Dangling but non-null "device" pointers: none of these calls may touch them.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  const std::int64_t* fake_ids = reinterpret_cast<const std::int64_t*>(std::uintptr_t(512));
  auto* fake_metrics = reinterpret_cast<troll::objective_metrics*>(std::uintptr_t(2048));
  void* fake_workspace = reinterpret_cast<void*>(std::uintptr_t(4096));
  const auto z = troll::make_batch<const float>(fake, 4, 8);
  const auto narrow_in = troll::make_batch<const float>(fake, 4, 7);
  const auto out = troll::make_batch<float>(fake, 4, 8);
  const auto narrow = troll::make_batch<float>(fake, 4, 7);
  troll::token_batch<float> in;
  in.tokens = fake_ids;
  in.advantages = fake;
  const auto policy = troll::cuda.on(nullptr);
  const troll::dppo_objective good = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);

  auto forward = [&](const troll::dppo_objective& o, troll::input_view<float> old_view,
                     const troll::token_batch<float>& b, troll::objective_metrics* m, void* w) {
    troll::objective_forward(policy.with_workspace(w, std::size_t(1) << 30), o, z, old_view, b, fake, m);
  };
  auto backward = [&](const troll::dppo_objective& o, troll::batch_view<float> g, void* w,
                      double grad_loss) {
    troll::objective_backward(policy.with_workspace(w, std::size_t(1) << 30), o, z, z, in, g, grad_loss);
  };

  troll::dppo_objective bad = good;
  bad.delta_low = -0.1;
  CHECK_THROWS_AS(forward(bad, z, in, fake_metrics, fake_workspace), troll::domain_error);
  CHECK_THROWS_AS(backward(bad, out, fake_workspace, 1.0), troll::domain_error);
  bad = good;
  bad.delta_high = inf_value;
  CHECK_THROWS_AS(forward(bad, z, in, fake_metrics, fake_workspace), troll::domain_error);
  for (int k : {0, 257}) {
    CAPTURE(k);
    bad = good;
    bad.top_k = k;
    CHECK_THROWS_AS(forward(bad, z, in, fake_metrics, fake_workspace), troll::domain_error);
    CHECK_THROWS_AS(backward(bad, out, fake_workspace, 1.0), troll::domain_error);
    // The message is the CPU's (the same host check).
    std::vector<float> host(32, 0.0f);
    const auto hz = troll::make_batch<const float>(host.data(), 4, 8);
    const std::string want = message_of([&] {
      troll::objective_forward(troll::cpu, bad, hz, hz, troll::token_batch<float>{});
    });
    CHECK(!want.empty());
    CHECK(message_of([&] { forward(bad, z, in, fake_metrics, fake_workspace); }) == want);
  }
  bad = good;
  bad.divergence = static_cast<troll::dppo_divergence>(7);
  CHECK_THROWS_AS(forward(bad, z, in, fake_metrics, fake_workspace), troll::domain_error);

  CHECK_THROWS_AS(forward(good, narrow_in, in, fake_metrics, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(good, z, in, nullptr, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(good, z, in, fake_metrics, nullptr), troll::shape_error);
  troll::token_batch<float> no_tokens = in;
  no_tokens.tokens = nullptr;
  CHECK_THROWS_AS(forward(good, z, no_tokens, fake_metrics, fake_workspace), troll::shape_error);
  troll::token_batch<float> no_advantages = in;
  no_advantages.advantages = nullptr;
  CHECK_THROWS_AS(forward(good, z, no_advantages, fake_metrics, fake_workspace),
                  troll::shape_error);
  troll::token_batch<float> no_ids = in;
  no_ids.aggregation = troll::loss_aggregation::sequence_mean;
  CHECK_THROWS_AS(forward(good, z, no_ids, fake_metrics, fake_workspace), troll::shape_error);

  CHECK_THROWS_AS(backward(good, narrow, fake_workspace, 1.0), troll::shape_error);
  CHECK_THROWS_AS(backward(good, out, nullptr, 1.0), troll::shape_error);
  CHECK_THROWS_AS(backward(good, out, fake_workspace, nan_value), troll::domain_error);
  CHECK_THROWS_AS(backward(good, out, fake_workspace, inf_value), troll::domain_error);
  // A binary divergence ignores top_k, as on the CPU; zero rows enqueue nothing.
  troll::dppo_objective binary = troll::dppo_objective::defaults(troll::dppo_divergence::binary_kl);
  binary.top_k = 0;
  CHECK_NOTHROW(troll::objective_backward(policy.with_workspace(fake_workspace, std::size_t(1) << 30), binary, troll::make_batch<const float>(fake, 0, 8),
                                          troll::make_batch<const float>(fake, 0, 8), in,
                                          troll::make_batch<float>(fake, 0, 8)));
}

TEST_CASE_TEMPLATE("the DPPO test batches mask tokens in both directions on the CPU", T, float,
                   double) {
  // What the device comparisons rely on to exercise both branches of dppo_keep.
  for (const bool quantized : {false, true}) {
    const host_batch<T> h = dppo_batch<T>(quantized);
    for (const troll::dppo_divergence d : all_divergences) {
      CAPTURE(quantized);
      CAPTURE(static_cast<int>(d));
      std::vector<T> loss(h.rows);
      troll::objective_forward(troll::cpu, dppo_for(d), h.new_view(), h.old_view(),
                               h.tokens_view(troll::loss_aggregation::token_mean), loss.data());
      int positive = 0, negative = 0;
      count_masked(h, loss, positive, negative);
      if (!quantized || d == troll::dppo_divergence::topk_tv ||
          d == troll::dppo_divergence::topk_kl) {
        CHECK(positive > 0);
        CHECK(negative > 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Device cases: skipped (filtered out) without a device.
// ---------------------------------------------------------------------------------------------

namespace {

/// DPPO on both backends for one batch and one aggregation: per-token losses, gradients (with
/// grad_loss ≠ 1) and every metric DPPO fills.
template <class T>
void compare_dppo_with_cpu(const host_batch<T>& h, const troll::dppo_objective& objective,
                           troll::loss_aggregation how) {
  const std::size_t rows = h.rows, cols = h.cols;
  CAPTURE(rows);
  CAPTURE(cols);
  CAPTURE(static_cast<int>(objective.divergence));
  CAPTURE(objective.top_k);
  CAPTURE(static_cast<int>(how));
  std::vector<T> cpu_loss(rows), cpu_grad(rows * cols);
  const troll::objective_metrics want = troll::objective_forward(
      troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how), cpu_loss.data());
  const double grad_loss = 1.25;
  troll::objective_backward(troll::cpu, objective, h.new_view(), h.old_view(), h.tokens_view(how),
                            troll::make_batch(cpu_grad.data(), rows, cols), grad_loss);

  test_stream stream;
  const device_batch<T> d(h);
  device_array<T> token_loss(rows), grad(rows * cols);
  device_array<troll::objective_metrics> metrics(1);
  device_array<unsigned char> workspace(troll::objective_workspace_bytes(rows));
  device_array<troll::cuda_row_report> reports(rows);
  troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get()}), objective, d.new_view(), d.old_view(),
                           d.tokens_view(how), token_loss.get(), metrics.get());
  troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), objective, d.new_view(), d.old_view(),
                            d.tokens_view(how), troll::make_batch(grad.get(), rows, cols), grad_loss);
  stream.sync();

  for (const troll::cuda_row_report& r : reports.download())
    CHECK(r.error == troll::cuda_row_error::none);
  const tolerance tol = objective_between_backends<T>();
  const std::vector<T> got_loss = token_loss.download(), got_grad = grad.download();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    CHECK((got_loss[r] == T(0)) == (cpu_loss[r] == T(0)));  // the same tokens masked
    CHECK(tol.scaled(16).accepts(got_loss[r], cpu_loss[r]));
    for (std::size_t j = 0; j < cols; ++j)
      CHECK(tol.scaled(16).accepts(got_grad[r * cols + j], cpu_grad[r * cols + j]));
  }
  const troll::objective_metrics got = metrics.download()[0];
  CHECK(got.tokens == want.tokens);
  CHECK(got.sequences == want.sequences);
  CHECK(got.limited_fraction == want.limited_fraction);
  CHECK(tol.scaled(16).accepts(got.loss, want.loss));
  CHECK(tol.scaled(16).accepts(got.ratio_mean, want.ratio_mean));
  CHECK(tol.scaled(64).accepts(got.divergence_mean, want.divergence_mean));
  CHECK(tol.scaled(16).accepts(got.kl_before_mean, want.kl_before_mean));
  CHECK(tol.scaled(16).accepts(got.kl_before_max, want.kl_before_max));
  CHECK(tol.scaled(16).accepts(got.kl_after_mean, want.kl_after_mean));
  CHECK(got.projected_fraction == 0.0);
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE_TEMPLATE("DPPO forward and backward match the CPU objective: four divergences", T,
                     float, double) {
    for (const bool quantized : {false, true}) {
      CAPTURE(quantized);
      const host_batch<T> h = dppo_batch<T>(quantized);
      for (const troll::dppo_divergence d : all_divergences)
        for (const auto how :
             {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean})
          compare_dppo_with_cpu<T>(h, dppo_for(d), how);
    }
  }

  TEST_CASE_TEMPLATE("DPPO binary KL: tokens whose probability only rounds to 1 are kept, as on the CPU", T,
                     float, double) {
    // log p̃_a rounds to 0 at a top-logit gap of ~37; binary_kl took π = 1 and gave +inf (token
    // dropped, divergence_mean +inf) until both backends refined it from the other tokens' mass.
    host_batch<T> h(8, 300, 43u);
    for (std::size_t r = 0; r < h.rows; ++r) {
      const std::size_t a = std::size_t(h.tokens[r]);
      for (std::size_t j = 0; j < h.cols; ++j) {
        const double spread = 0.01 * double((j * 7 + r) % 13);
        h.fresh[r * h.cols + j] = j == a ? T(0) : T(-46.0 - spread);  // 1 − π ~ 3e-18: log π = 0
        h.old[r * h.cols + j] = j == a ? T(0) : T(-20.0 - spread);    // 1 − μ ~ 6e-7
      }
      h.advantages[r] = T(r % 2 ? 1.0 : -1.0);
    }
    const troll::dppo_objective o = troll::dppo_objective::defaults(troll::dppo_divergence::binary_kl);
    std::vector<T> loss(h.rows);
    const troll::objective_metrics cpu =
        troll::objective_forward(troll::cpu, o, h.new_view(), h.old_view(),
                                 h.tokens_view(troll::loss_aggregation::token_mean), loss.data());
    REQUIRE(std::isfinite(cpu.divergence_mean));  // the CPU's own result first
    CHECK(cpu.limited_fraction == 0.0);
    compare_dppo_with_cpu<T>(h, o, troll::loss_aggregation::token_mean);
  }

  TEST_CASE_TEMPLATE("DPPO top-K: K above the finite entries, K = 1, K = 256 over a wide row", T,
                     float, double) {
    for (const troll::dppo_divergence d :
         {troll::dppo_divergence::topk_tv, troll::dppo_divergence::topk_kl}) {
      troll::dppo_objective o = troll::dppo_objective::defaults(d);
      o.delta_low = 0.02;
      o.delta_high = 0.05;
      host_batch<T> narrow(12, 16, 41u);  // rows with a −inf entry hold 15 finite: all taken
      sample_likely_tokens(narrow);
      o.top_k = 20;
      compare_dppo_with_cpu<T>(narrow, o, troll::loss_aggregation::token_mean);
      o.top_k = 1;
      compare_dppo_with_cpu<T>(narrow, o, troll::loss_aggregation::sequence_mean);
      host_batch<T> wide(7, 1031, 42u);
      sample_likely_tokens(wide);
      quantize_old(wide);  // ties at the 256th value, the row spans four block strides
      o.top_k = 256;
      compare_dppo_with_cpu<T>(wide, o, troll::loss_aggregation::token_mean);
      o.top_k = 100;
      compare_dppo_with_cpu<T>(wide, o, troll::loss_aggregation::sequence_mean);
    }
  }

  TEST_CASE("DPPO without kl_metrics and with an unweighted batch (no loss mask)") {
    host_batch<double> h = dppo_batch<double>(false);
    troll::dppo_objective o = dppo_for(troll::dppo_divergence::topk_tv);
    o.kl_metrics = false;
    const auto how = troll::loss_aggregation::token_mean;
    auto in = h.tokens_view(how);
    in.loss_mask = nullptr;
    const troll::objective_metrics want =
        troll::objective_forward(troll::cpu, o, h.new_view(), h.old_view(), in);
    const device_batch<double> d(h);
    auto din = d.tokens_view(how);
    din.loss_mask = nullptr;
    test_stream stream;
    device_array<troll::objective_metrics> metrics(1);
    device_array<unsigned char> workspace(troll::objective_workspace_bytes(h.rows));
    troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), o, d.new_view(), d.old_view(), din,
                             nullptr, metrics.get());
    stream.sync();
    const troll::objective_metrics got = metrics.download()[0];
    const tolerance tol = objective_between_backends<double>();
    CHECK(got.tokens == h.rows);
    CHECK(got.tokens == want.tokens);
    CHECK(got.kl_before_mean == 0.0);
    CHECK(got.limited_fraction == want.limited_fraction);
    CHECK(tol.scaled(16).accepts(got.loss, want.loss));
    CHECK(tol.scaled(64).accepts(got.divergence_mean, want.divergence_mean));
  }

  TEST_CASE("DPPO: an all-zero mask gives loss 0, zero metrics and zero gradients") {
    host_batch<double> h(6, 64, 3u);
    std::fill(h.mask.begin(), h.mask.end(), 0.0);
    const device_batch<double> d(h);
    test_stream stream;
    device_array<double> grad(6 * 64);
    device_array<troll::objective_metrics> metrics(1);
    device_array<unsigned char> workspace(troll::objective_workspace_bytes(6));
    const auto in = d.tokens_view(troll::loss_aggregation::sequence_mean);
    const auto o = troll::dppo_objective::defaults(troll::dppo_divergence::topk_kl);
    troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), o, d.new_view(), d.old_view(), in,
                             nullptr, metrics.get());
    troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()), o, d.new_view(), d.old_view(), in,
                              troll::make_batch(grad.get(), 6, 64));
    stream.sync();
    const troll::objective_metrics m = metrics.download()[0];
    CHECK(m.loss == 0.0);
    CHECK(m.tokens == 0);
    CHECK(m.sequences == 0);
    CHECK(m.divergence_mean == 0.0);
    for (double g : grad.download()) CHECK(g == 0.0);
  }

  TEST_CASE_TEMPLATE(
      "DPPO bad rows: reports, first_bad_row, NaN outputs; checked mode throws the CPU's error", T,
      float, double) {
    host_batch<T> h(8, 64, 5u);
    for (std::size_t j = 0; j < 64; ++j) h.fresh[3 * 64 + j] = T(-inf_value);  // all masked
    h.mask[3] = T(1);
    h.mask[5] = T(nan_value);
    h.tokens[6] = -1;
    h.mask[6] = T(1);
    const device_batch<T> d(h);
    const auto how = troll::loss_aggregation::token_mean;
    const auto o = troll::dppo_objective::defaults(troll::dppo_divergence::topk_tv);
    test_stream stream;
    device_array<T> token_loss(8), grad(8 * 64);
    device_array<troll::objective_metrics> metrics(1);
    device_array<unsigned char> workspace(troll::objective_workspace_bytes(8));
    device_array<troll::cuda_row_report> reports(8);
    device_array<unsigned long long> first_bad(1);
    troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), o, d.new_view(), d.old_view(),
                             d.tokens_view(how), token_loss.get(), metrics.get());
    stream.sync();
    const std::vector<troll::cuda_row_report> rep = reports.download();
    CHECK(rep[3].error == troll::cuda_row_error::all_masked);
    CHECK(rep[3].operand == 0);
    CHECK(rep[5].error == troll::cuda_row_error::bad_mask);
    CHECK(rep[6].error == troll::cuda_row_error::bad_sampled);
    CHECK(rep[0].error == troll::cuda_row_error::none);
    CHECK(first_bad.download()[0] == 3ull);
    const std::vector<T> losses = token_loss.download();
    CHECK(std::isnan(static_cast<double>(losses[3])));
    CHECK(std::isnan(static_cast<double>(losses[6])));
    CHECK(!std::isnan(static_cast<double>(losses[0])));
    CHECK(std::isnan(metrics.download()[0].loss));

    troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).with_checks(troll::cuda_checks{reports.get()}), o, d.new_view(), d.old_view(),
                              d.tokens_view(how), troll::make_batch(grad.get(), 8, 64), 1.0);
    stream.sync();
    const std::vector<T> g = grad.download();
    CHECK(std::isnan(static_cast<double>(g[3 * 64])));
    CHECK(!std::isnan(static_cast<double>(g[0])));
    CHECK(reports.download()[5].error == troll::cuda_row_error::bad_mask);

    const std::string want_forward = message_of([&] {
      troll::objective_forward(troll::cpu, o, h.new_view(), h.old_view(), h.tokens_view(how));
    });
    const std::string got_forward = message_of([&] {
      troll::objective_forward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).checked(), o, d.new_view(), d.old_view(),
                               d.tokens_view(how), token_loss.get(), metrics.get());
    });
    CHECK(!want_forward.empty());
    CHECK(got_forward == want_forward);
    std::vector<T> cpu_grad(8 * 64);
    const std::string want_backward = message_of([&] {
      troll::objective_backward(troll::cpu, o, h.new_view(), h.old_view(), h.tokens_view(how),
                                troll::make_batch(cpu_grad.data(), 8, 64));
    });
    const std::string got_backward = message_of([&] {
      troll::objective_backward(troll::cuda.on(stream.stream).with_workspace(workspace.get(), workspace.bytes()).checked(), o, d.new_view(), d.old_view(),
                                d.tokens_view(how), troll::make_batch(grad.get(), 8, 64), 1.0);
    });
    CHECK(!want_backward.empty());
    CHECK(got_backward == want_backward);
  }
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
