// tests/cuda/test_cuda_sparse_objectives.cu — TROLL's objective on sparse old rows under the CUDA
// policy (troll/cuda_sparse_objectives.cuh) against the CPU overloads (troll/sparse_objectives.hpp):
// forward (aligned rows, log π*, stats, per-token losses, metrics) and fused backward, float and
// double, new_k 0 and > 0, both aggregations, masks, projected and inactive rows; rejected rows
// (reports, NaN outputs) and the checked mode's exceptions; the host-side argument checks, the
// workspace size and the translation of device reports into the CPU's messages. Also the sparse
// objective's gradient against troll's finite-difference checker
// (tests/bodies/sparse_objective_gradients.hpp, the body of tests/test_sparse_objectives.cpp) run
// on the device.
//
// Without a CUDA device the "device" test suite is excluded, "SKIPPED: no CUDA device" is
// printed, the host-only cases still run and the exit code is 0.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "cuda_objective_batch.cuh"
#include "cuda_sparse_batch.cuh"
#include "grad_helpers.hpp"
#include "objective_batch.hpp"
#include "sparse_objective_cases.hpp"
#include "sparse_oracle.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/gradcheck.hpp"
#include "troll/objectives.hpp"
#include "troll/sparse_objectives.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

namespace {

using troll_test::device_array;
using troll_test::device_batch;
using troll_test::host_batch;
using troll_test::message_of;
using troll_test::sparse_pair;
using troll_test::test_stream;
using troll_test::tolerance;
using troll_test::unit_roundoff;

using troll_test::nan_value;
using troll_test::inf_value;

/// Tolerance between the two backends: both reduce in double (in different orders, and the
/// solver's stopping test may fall an iteration apart, as in test_cuda_sparse.cu's 1e-8 for the
/// projection), the outputs are T, and the CUDA ratio and KL read π* back as T where the CPU
/// keeps it in double.
template <class T>
tolerance between_backends() {
  return tolerance{1e-8 + 256.0 * unit_roundoff<T>(), 1e-8 + 256.0 * unit_roundoff<T>()};
}

/// Aligned rows on the host and their device copy.
template <class T>
struct aligned_pair {
  std::size_t rows, k_max, vocab;
  std::vector<troll::sparse_index> indices, counts;
  std::vector<T> fresh, old, fresh_r, old_r;
  device_array<troll::sparse_index> d_indices, d_counts;
  device_array<T> d_fresh, d_old, d_fresh_r, d_old_r;

  aligned_pair(std::size_t n, std::size_t k, std::size_t v)
      : rows(n), k_max(k), vocab(v), indices(n * k, -7), counts(n, -7), fresh(n * k, T(-7)), old(n * k, T(-7)),
        fresh_r(n, T(-7)), old_r(n, T(-7)), d_indices(n * k), d_counts(n), d_fresh(n * k), d_old(n * k),
        d_fresh_r(n), d_old_r(n) {}
  troll::aligned_batch_view<T> host() {
    return {indices.data(), counts.data(), fresh.data(), old.data(), fresh_r.data(), old_r.data(), rows, k_max, vocab};
  }
  troll::aligned_batch_view<T> device() {
    return {d_indices.get(), d_counts.get(), d_fresh.get(), d_old.get(), d_fresh_r.get(), d_old_r.get(),
            rows,            k_max,          vocab};
  }
  void download() {
    indices = d_indices.download();
    counts = d_counts.download();
    fresh = d_fresh.download();
    old = d_old.download();
    fresh_r = d_fresh_r.download();
    old_r = d_old_r.download();
  }
};

/// A batch with sparse old rows: host_batch's dense rows, the old ones sparsified on the CPU
/// (k = 8, δ = 1e-3) with the sampled tokens kept; aligned / log_probs capacity 9 + new_k.
template <class T>
struct sparse_batch {
  std::size_t rows, vocab, k_max;
  host_batch<T> host;
  sparse_pair<T> old;

  sparse_batch(std::size_t n, std::size_t v, unsigned seed, int new_k)
      : rows(n), vocab(v), k_max(9 + std::size_t(new_k)), host(n, v, seed), old(n, 9, v) {
    resparsify();
  }
  void resparsify() {
    std::vector<troll::token_id> sampled(host.tokens.begin(), host.tokens.end());
    troll::sparsify(troll::cpu, host.old_view(), sampled.data(), troll::sparsify_options{8, 1e-3}, old.host());
    old.upload();
  }
};

troll::sparse_trust_region_objective objective_with(int new_k, double alpha = 1.0) {
  troll::sparse_trust_region_objective o;
  o.eps = 0.05;
  o.alpha = alpha;
  o.new_support = troll::sparsify_options{new_k, new_k > 0 ? 1e-4 : 1e-5};
  return o;
}

/// What one backend's forward and backward produced.
template <class T>
struct run_result {
  std::vector<troll::sparse_index> aligned_indices, aligned_counts, lp_indices, lp_counts;
  std::vector<T> aligned_new, aligned_old, aligned_new_r, aligned_old_r, lp, lp_r, token_loss, grad;
  std::vector<troll::projection_stats> stats;
  troll::objective_metrics metrics;
};

template <class T>
run_result<T> run_cpu(sparse_batch<T>& b, const troll::sparse_trust_region_objective& o, troll::loss_aggregation how,
                      double grad_loss) {
  aligned_pair<T> aligned(b.rows, b.k_max, b.vocab);
  sparse_pair<T> lp(b.rows, b.k_max, b.vocab);
  run_result<T> r;
  r.stats.resize(b.rows);
  r.token_loss.assign(b.rows, T(-7));
  r.grad.assign(b.rows * b.vocab, T(-7));
  const troll::token_batch<T> in = b.host.tokens_view(how);
  r.metrics = troll::objective_forward(troll::cpu, o, b.host.new_view(), troll::sparse_input<T>(b.old.host()), in,
                                       aligned.host(), lp.host(), r.stats.data(), r.token_loss.data());
  troll::objective_backward(troll::cpu, o, b.host.new_view(), troll::aligned_input<T>(aligned.host()), in,
                            troll::sparse_input<T>(lp.host()), r.stats.data(),
                            troll::make_batch(r.grad.data(), b.rows, b.vocab), grad_loss);
  r.aligned_indices = aligned.indices, r.aligned_counts = aligned.counts;
  r.aligned_new = aligned.fresh, r.aligned_old = aligned.old, r.aligned_new_r = aligned.fresh_r,
  r.aligned_old_r = aligned.old_r;
  r.lp_indices = lp.indices, r.lp_counts = lp.counts, r.lp = lp.log_probs, r.lp_r = lp.log_remainder;
  return r;
}

/// The device run; `checks` for both calls (its report arrays, if any, are the caller's).
template <class T>
run_result<T> run_cuda(sparse_batch<T>& b, const troll::sparse_trust_region_objective& o, troll::loss_aggregation how,
                       double grad_loss, const troll::cuda_checks& forward_checks = {},
                       const troll::cuda_checks& backward_checks = {}) {
  test_stream s;
  device_batch<T> d(b.host);
  aligned_pair<T> aligned(b.rows, b.k_max, b.vocab);
  sparse_pair<T> lp(b.rows, b.k_max, b.vocab);
  device_array<troll::projection_stats> stats(b.rows);
  device_array<T> token_loss(b.rows), grad(b.rows * b.vocab);
  device_array<troll::objective_metrics> metrics(1);
  const std::size_t bytes = troll::sparse_objective_workspace_bytes(b.rows, b.k_max, o.new_support.k);
  device_array<double> workspace((bytes + sizeof(double) - 1) / sizeof(double));
  const troll::token_batch<T> in = d.tokens_view(how);
  const auto policy = troll::cuda.on(s.stream);
  troll::objective_forward(policy.with_workspace(workspace.get(), workspace.bytes()).with_checks(forward_checks), o, d.new_view(), troll::sparse_input<T>(b.old.device()), in, aligned.device(),
                           lp.device(), stats.get(), token_loss.get(), metrics.get());
  troll::objective_backward(policy.with_workspace(workspace.get(), workspace.bytes()).with_checks(backward_checks), o, d.new_view(), troll::aligned_input<T>(aligned.device()), in,
                            troll::sparse_input<T>(lp.device()), stats.get(),
                            troll::make_batch(grad.get(), b.rows, b.vocab), grad_loss);
  s.sync();
  CUDA_REQUIRE(cudaGetLastError());
  run_result<T> r;
  aligned.download();
  lp.download();
  r.aligned_indices = aligned.indices, r.aligned_counts = aligned.counts;
  r.aligned_new = aligned.fresh, r.aligned_old = aligned.old, r.aligned_new_r = aligned.fresh_r,
  r.aligned_old_r = aligned.old_r;
  r.lp_indices = lp.indices, r.lp_counts = lp.counts, r.lp = lp.log_probs, r.lp_r = lp.log_remainder;
  r.stats = stats.download();
  r.token_loss = token_loss.download();
  r.grad = grad.download();
  r.metrics = metrics.download()[0];
  return r;
}

/// Row r of both runs agrees (skip_grad: the backward is not compared on this row).
template <class T>
void check_row(const run_result<T>& got, const run_result<T>& want, std::size_t r, std::size_t k_max,
               std::size_t vocab) {
  const tolerance tol = between_backends<T>();
  CAPTURE(r);
  REQUIRE(got.aligned_counts[r] == want.aligned_counts[r]);
  REQUIRE(got.lp_counts[r] == want.lp_counts[r]);
  for (std::size_t i = 0; i < std::size_t(want.aligned_counts[r]); ++i) {
    const std::size_t at = r * k_max + i;
    CAPTURE(i);
    CHECK(got.aligned_indices[at] == want.aligned_indices[at]);
    CHECK(got.lp_indices[at] == want.lp_indices[at]);
    CHECK(tol.accepts(got.aligned_new[at], want.aligned_new[at]));
    CHECK(tol.accepts(got.aligned_old[at], want.aligned_old[at]));
    CHECK(tol.accepts(got.lp[at], want.lp[at]));
  }
  CHECK(tol.accepts(got.aligned_new_r[r], want.aligned_new_r[r]));
  CHECK(tol.accepts(got.aligned_old_r[r], want.aligned_old_r[r]));
  CHECK(tol.accepts(got.lp_r[r], want.lp_r[r]));
  CHECK(got.stats[r].status == want.stats[r].status);
  CHECK(tol.accepts(got.stats[r].kl_before, want.stats[r].kl_before));
  if (want.stats[r].active()) {
    CHECK(tol.accepts(got.stats[r].kl_after, want.stats[r].kl_after));
    CHECK(tol.accepts(got.stats[r].t, want.stats[r].t));
  }
  CHECK(tol.accepts(got.token_loss[r], want.token_loss[r]));
  for (std::size_t j = 0; j < vocab; ++j) {
    CAPTURE(j);
    CHECK(tol.accepts(got.grad[r * vocab + j], want.grad[r * vocab + j]));
  }
}

template <class T>
void check_metrics(const troll::objective_metrics& got, const troll::objective_metrics& want) {
  const tolerance tol = between_backends<T>();
  CHECK(tol.accepts(got.loss, want.loss));
  CHECK(got.tokens == want.tokens);
  CHECK(got.sequences == want.sequences);
  CHECK(tol.accepts(got.ratio_mean, want.ratio_mean));
  CHECK(tol.accepts(got.kl_before_mean, want.kl_before_mean));
  CHECK(tol.accepts(got.kl_after_mean, want.kl_after_mean));
  CHECK(tol.accepts(got.kl_before_max, want.kl_before_max));
  CHECK(tol.accepts(got.kl_after_max, want.kl_after_max));
  CHECK(tol.accepts(got.regression_kl_mean, want.regression_kl_mean));
  CHECK(tol.accepts(got.eta_mean, want.eta_mean));
  CHECK(tol.accepts(got.projected_fraction, want.projected_fraction));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host-only cases: they run with or without a device.
// ---------------------------------------------------------------------------------------------

TEST_CASE("sparse objective workspace size: records, row outcomes, then the larger scratch") {
  const std::size_t fixed = troll::sparse_objective_workspace_bytes(0, 16, 4);
  CHECK(fixed > 0);
  // k_max drives the size once the backward's upstream (rows × (k_max + 1) doubles) dominates.
  const std::size_t a = troll::sparse_objective_workspace_bytes(10, 64, 0);
  const std::size_t b = troll::sparse_objective_workspace_bytes(10, 128, 0);
  CHECK(b - a == 10 * 64 * sizeof(double));
  CHECK(a >= troll::objective_workspace_bytes(10) + 10 * (64 + 1) * sizeof(double));
  // new_k drives it once the forward's sparsify prefix dominates; new_k ≤ 0 adds nothing.
  CHECK(troll::sparse_objective_workspace_bytes(10, 1, 256) > troll::sparse_objective_workspace_bytes(10, 1, 128));
  CHECK(troll::sparse_objective_workspace_bytes(10, 1, 0) == troll::sparse_objective_workspace_bytes(10, 1, -3));
  static_assert(troll::sparse_objective_workspace_bytes(3, 8, 2) > 0, "usable in constant expressions");
}

TEST_CASE("cuda sparse objective entry points check their arguments on the host, before any CUDA call") {
  // Dangling but non-null "device" pointers: none of these calls may touch them.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  auto* fake_index = reinterpret_cast<troll::sparse_index*>(std::uintptr_t(384));
  const std::int64_t* fake_ids = reinterpret_cast<const std::int64_t*>(std::uintptr_t(512));
  auto* fake_stats = reinterpret_cast<troll::projection_stats*>(std::uintptr_t(1024));
  auto* fake_metrics = reinterpret_cast<troll::objective_metrics*>(std::uintptr_t(2048));
  void* fake_workspace = reinterpret_cast<void*>(std::uintptr_t(4096));
  void* odd_workspace = reinterpret_cast<void*>(std::uintptr_t(4100));
  const std::size_t rows = 4, vocab = 32, k = 8;
  const auto z = troll::make_batch<const float>(fake, rows, vocab);
  const auto grad = troll::make_batch<float>(fake, rows, vocab);
  const auto narrow = troll::make_batch<float>(fake, rows, vocab - 1);
  const troll::sparse_batch_view<float> sparse{fake_index, fake, fake_index, fake, rows, k, vocab};
  const troll::sparse_batch_view<float> other_vocab{fake_index, fake, fake_index, fake, rows, k, vocab + 1};
  const troll::sparse_batch_view<float> fewer_rows{fake_index, fake, fake_index, fake, rows - 1, k, vocab};
  const troll::aligned_batch_view<float> aligned{fake_index, fake_index, fake, fake, fake, fake, rows, k, vocab};
  troll::token_batch<float> in;
  in.tokens = fake_ids;
  in.advantages = fake;
  const auto policy = troll::cuda.on(nullptr);
  const troll::sparse_trust_region_objective objective = objective_with(4);

  auto forward = [&](const troll::sparse_trust_region_objective& o, troll::sparse_batch_view<float> old,
                     troll::sparse_batch_view<float> lp, const troll::token_batch<float>& b,
                     troll::projection_stats* st, troll::objective_metrics* m, void* w) {
    troll::objective_forward(policy.with_workspace(w, std::size_t(1) << 30), o, z, troll::sparse_input<float>(old), b, aligned, lp, st, fake, m);
  };
  auto cpu_message = [&](const troll::sparse_trust_region_objective& o) {
    return message_of([&] {
      troll::objective_forward(troll::cpu, o, z, troll::sparse_input<float>(sparse), in, aligned, sparse,
                               fake_stats, fake);
    });
  };
  troll::sparse_trust_region_objective bad_eps = objective;
  bad_eps.eps = 0.0;
  troll::sparse_trust_region_objective bad_alpha = objective;
  bad_alpha.alpha = -1.0;
  troll::sparse_trust_region_objective bad_k = objective;
  bad_k.new_support.k = 300;
  troll::sparse_trust_region_objective bad_delta = objective;
  bad_delta.new_support = troll::sparsify_options{0, 1.5};
  for (const auto& o : {bad_eps, bad_alpha, bad_k, bad_delta}) {
    CHECK_THROWS_AS(forward(o, sparse, sparse, in, fake_stats, fake_metrics, fake_workspace), troll::domain_error);
    // The CPU's checks and messages (it throws before reading a value too).
    CHECK(message_of([&] { forward(o, sparse, sparse, in, fake_stats, fake_metrics, fake_workspace); }) ==
          cpu_message(o));
  }
  CHECK_THROWS_AS(forward(objective, other_vocab, sparse, in, fake_stats, fake_metrics, fake_workspace),
                  troll::shape_error);
  CHECK_THROWS_AS(forward(objective, sparse, fewer_rows, in, fake_stats, fake_metrics, fake_workspace),
                  troll::shape_error);
  CHECK_THROWS_AS(forward(objective, sparse, sparse, in, nullptr, fake_metrics, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(objective, sparse, sparse, in, fake_stats, nullptr, fake_workspace), troll::shape_error);
  CHECK_THROWS_AS(forward(objective, sparse, sparse, in, fake_stats, fake_metrics, nullptr), troll::shape_error);
  CHECK_THROWS_AS(forward(objective, sparse, sparse, in, fake_stats, fake_metrics, odd_workspace),
                  troll::shape_error);
  troll::token_batch<float> no_tokens = in;
  no_tokens.tokens = nullptr;
  CHECK_THROWS_AS(forward(objective, sparse, sparse, no_tokens, fake_stats, fake_metrics, fake_workspace),
                  troll::shape_error);
  troll::token_batch<float> no_ids = in;
  no_ids.aggregation = troll::loss_aggregation::sequence_mean;
  CHECK_THROWS_AS(forward(objective, sparse, sparse, no_ids, fake_stats, fake_metrics, fake_workspace),
                  troll::shape_error);

  auto backward = [&](troll::sparse_batch_view<float> lp, troll::batch_view<float> g, const troll::projection_stats* st,
                      void* w, double grad_loss) {
    troll::objective_backward(policy.with_workspace(w, std::size_t(1) << 30), objective, z, troll::aligned_input<float>(aligned), in,
                              troll::sparse_input<float>(lp), st, g, grad_loss);
  };
  CHECK_THROWS_AS(backward(sparse, grad, fake_stats, fake_workspace, nan_value), troll::domain_error);
  CHECK(message_of([&] { backward(sparse, grad, fake_stats, fake_workspace, nan_value); }) ==
        message_of([&] {
          troll::objective_backward(troll::cpu, objective, z, troll::aligned_input<float>(aligned), in,
                                    troll::sparse_input<float>(sparse), fake_stats, grad, nan_value);
        }));
  CHECK_THROWS_AS(backward(sparse, narrow, fake_stats, fake_workspace, 1.0), troll::shape_error);
  CHECK_THROWS_AS(backward(other_vocab, grad, fake_stats, fake_workspace, 1.0), troll::shape_error);
  CHECK_THROWS_AS(backward(sparse, grad, nullptr, fake_workspace, 1.0), troll::shape_error);
  CHECK_THROWS_AS(backward(sparse, grad, fake_stats, nullptr, 1.0), troll::shape_error);
}

TEST_CASE("device reports of sparse objective rows become the CPU's exceptions, message for message") {
  using problem = troll::detail::row_problem;
  struct expectation {
    troll::cuda_row_report report;
    problem want;
    bool backward;
  };
  auto report = [](troll::cuda_row_error e, double value, int operand = 0, unsigned long long token = 0) {
    troll::cuda_row_report r;
    r.error = e, r.value = value, r.operand = operand, r.token = token;
    return r;
  };
  using e = troll::row_error;
  auto make = [](e kind, const char* operand, long long entry, double value, double other = 0.0) {
    return troll::detail::make_problem(kind, operand, entry, value, other);
  };
  const long long capacity = 12;
  const expectation cases[] = {
      {report(e::bad_sampled, 99.0), make(e::token_range, "", 0, 99.0), false},
      {report(e::bad_advantage, nan_value), make(e::bad_advantage, "", 0, nan_value), false},
      {report(e::bad_mask, -1.0), make(e::bad_mask, "", 0, -1.0), true},
      {report(e::sequence_order, 2.0), make(e::sequence_order, "", 0, 2.0), false},
      {report(e::regression_inf, 0.0), make(e::regression_inf, "", 0, 0.0), true},
      {report(e::old_entry_masked, 5.0), make(e::old_entry_masked, "", 0, 5.0), false},
      {report(e::old_token_masked, 5.0), make(e::old_entry_masked, "", 0, 5.0), false},
      {report(e::objective_capacity, 20.0), make(e::objective_capacity, "", 0, 20.0, double(capacity)), false},
      {report(e::not_in_support, 7.0), make(e::not_in_support, "", 0, 7.0), false},
      {report(e::not_in_aligned, 7.0), make(e::not_in_aligned, "", 0, 7.0), true},
      {report(e::log_probs_mismatch, 3.0, 5, ~0ull), make(e::log_probs_mismatch, "", -1, 3.0, 5.0), true},
      {report(e::log_probs_mismatch, 11.0, 13, 2), make(e::log_probs_mismatch, "", 2, 11.0, 13.0), true},
      {report(e::nan_value, nan_value, 0, 4), make(e::nan_value, "new_logits", 4, nan_value), false},
      {report(e::pos_inf, inf_value, 0, 6), make(e::pos_inf, "new_logits", 6, inf_value), true},
      {report(e::all_masked, 0.0, 0), make(e::all_masked, "new_logits", 0, 0.0), false},
      {report(e::all_masked, 0.0, 3), make(e::all_masked, "old (lumped)", 0, 0.0), false},
      {report(e::disjoint, 0.0), make(e::disjoint, "new_logits", 0, 0.0), true},
      {report(e::infeasible, 0.25), make(e::infeasible, "new_logits", 0, 0.25), false},
      {report(e::sparse_index, 40.0, 1, 2), make(e::sparse_index, "old", 2, 40.0), false},
      {report(e::sparse_nan, nan_value, 1, ~0ull), make(e::sparse_nan, "old", -1, nan_value), false},
      {report(e::sparse_above_one, 0.5, 0, 1), make(e::sparse_above_one, "aligned (new side)", 1, 0.5), true},
      {report(e::sparse_duplicate, 3.0, 4, 2), make(e::sparse_duplicate, "log_probs", 2, 3.0), true},
  };
  for (const expectation& c : cases) {
    const char* fn = c.backward ? "objective_backward" : "objective_forward";
    CAPTURE(static_cast<int>(c.report.error));
    const std::string want = message_of([&] { troll::detail::throw_row_problem(fn, 3, c.want); });
    const std::string got = message_of([&] {
      troll::detail::cuda::throw_sparse_objective_report{c.backward, capacity}(fn, 3, c.report, nullptr);
    });
    CHECK(!want.empty());
    CHECK(got == want);
    // The exception carries the CPU's code.
    try {
      troll::detail::cuda::throw_sparse_objective_report{c.backward, capacity}(fn, 3, c.report, nullptr);
    } catch (const troll::invalid_input& error) {
      CHECK(error.code() == c.want.kind);
      CHECK(error.row() == 3);
    }
  }
  // Unusable stats: the CPU's check_stats wording.
  troll::projection_stats bad;
  bad.status = troll::row_status::projected;
  bad.t = 2.0;
  troll::cuda_row_report stats_report = report(e::bad_stats, 0.0, 0);
  CHECK(message_of([&] {
          troll::detail::cuda::throw_sparse_objective_report{true, 0}("objective_backward", 1, stats_report, nullptr);
        }) == message_of([&] {
          troll::detail::throw_row_problem("objective_backward", 1, troll::detail::check_stats(bad));
        }));
}

// ---------------------------------------------------------------------------------------------
// Device cases: skipped (filtered out) without a device.
// ---------------------------------------------------------------------------------------------

TEST_SUITE("device") {
  TEST_CASE_TEMPLATE("the sparse objective matches the CPU overloads: forward and fused backward", T, float,
                     double) {
    for (const int new_k : {0, 5}) {
      for (const auto how : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
        for (const double alpha : {1.0, 0.0}) {
         for (const double eps : {0.05, 5.0}) {  // projected rows; every row inactive
          CAPTURE(new_k);
          CAPTURE(static_cast<int>(how));
          CAPTURE(alpha);
          CAPTURE(eps);
          sparse_batch<T> b(23, 300, 11u + unsigned(new_k), new_k);
          troll::sparse_trust_region_objective o = objective_with(new_k, alpha);
          o.eps = eps;
          const run_result<T> want = run_cpu(b, o, how, 0.75);
          const run_result<T> got = run_cuda(b, o, how, 0.75);
          std::size_t projected = 0, inactive = 0;
          for (std::size_t r = 0; r < b.rows; ++r) {
            check_row(got, want, r, b.k_max, b.vocab);
            projected += want.stats[r].status == troll::row_status::projected ? 1 : 0;
            inactive += want.stats[r].status == troll::row_status::inactive ? 1 : 0;
          }
          if (eps < 1.0) {
            CHECK(projected > 0);
          } else {
            CHECK(inactive == b.rows);
          }
          check_metrics<T>(got.metrics, want.metrics);
         }
        }
      }
    }
  }

  TEST_CASE_TEMPLATE("rejected rows are reported, get NaN outputs and leave the other rows as the CPU's", T, float,
                     double) {
    const std::size_t rows = 12;
    sparse_batch<T> b(rows, 200, 5u, 4);
    const troll::sparse_trust_region_objective o = objective_with(4);
    const auto how = troll::loss_aggregation::token_mean;
    const run_result<T> want = run_cpu(b, o, how, 1.0);
    // Row 5 (mask 1): a NaN advantage; row 8 (mask 1): a token outside the old row's support.
    REQUIRE(b.host.mask[5] != T(0));
    REQUIRE(b.host.mask[8] != T(0));
    b.host.advantages[5] = T(nan_value);
    std::int64_t outside = 0;
    while (true) {
      bool in_support = false;
      for (int i = 0; i < b.old.counts[8]; ++i) in_support = in_support || b.old.indices[8 * 9 + std::size_t(i)] == outside;
      if (!in_support) break;
      ++outside;
    }
    b.host.tokens[8] = outside;
    device_array<troll::cuda_row_report> reports(rows), backward_reports(rows);
    device_array<unsigned long long> first_bad(1), backward_first_bad(1);
    const run_result<T> got =
        run_cuda(b, o, how, 1.0, troll::cuda_checks{reports.get(), first_bad.get(), false},
                 troll::cuda_checks{backward_reports.get(), backward_first_bad.get(), false});
    const std::vector<troll::cuda_row_report> r = reports.download();
    const std::vector<troll::cuda_row_report> rb = backward_reports.download();
    CHECK(first_bad.download()[0] == 5u);
    CHECK(backward_first_bad.download()[0] == 5u);
    for (std::size_t row = 0; row < rows; ++row) {
      CAPTURE(row);
      const troll::cuda_row_error expected = row == 5   ? troll::cuda_row_error::bad_advantage
                                             : row == 8 ? troll::cuda_row_error::not_in_support
                                                        : troll::cuda_row_error::none;
      CHECK(r[row].error == expected);
      if (row == 5 || row == 8) {
        CHECK(std::isnan(double(got.token_loss[row])));
        CHECK(got.aligned_counts[row] == 0);
        CHECK(got.lp_counts[row] == 0);
        CHECK(std::isnan(double(got.lp_r[row])));
        CHECK(got.stats[row].status == troll::row_status::rejected);
        // The backward sees the rejected forward rows (NaN remainders) or the bad token data.
        CHECK(rb[row].error != troll::cuda_row_error::none);
        for (std::size_t j = 0; j < b.vocab; ++j) CHECK(std::isnan(double(got.grad[row * b.vocab + j])));
        continue;
      }
      CHECK(rb[row].error == troll::cuda_row_error::none);
      CHECK(between_backends<T>().accepts(got.token_loss[row], want.token_loss[row]));
    }
    CHECK(std::isnan(got.metrics.loss));  // counted bad rows make the loss NaN
  }

  TEST_CASE_TEMPLATE("rows the solver stops early on are kept with their loss, as on the CPU", T, float, double) {
    // One Newton member per row: most projected rows end not_converged, holding a feasible member
    // (docs/api.md). The forward keeps them on both backends; only their backward refuses them.
    sparse_batch<T> b(17, 300, 31u, 5);
    troll::sparse_trust_region_objective o = objective_with(5);
    o.projection.max_iterations = 1;
    const auto how = troll::loss_aggregation::token_mean;
    const troll::token_batch<T> host_in = b.host.tokens_view(how);
    aligned_pair<T> want_aligned(b.rows, b.k_max, b.vocab);
    sparse_pair<T> want_lp(b.rows, b.k_max, b.vocab);
    std::vector<troll::projection_stats> want_stats(b.rows);
    std::vector<T> want_loss(b.rows, T(-7));
    const troll::objective_metrics want_metrics =
        troll::objective_forward(troll::cpu, o, b.host.new_view(), troll::sparse_input<T>(b.old.host()), host_in,
                                 want_aligned.host(), want_lp.host(), want_stats.data(), want_loss.data());
    test_stream s;
    device_batch<T> d(b.host);
    aligned_pair<T> aligned(b.rows, b.k_max, b.vocab);
    sparse_pair<T> lp(b.rows, b.k_max, b.vocab);
    device_array<troll::projection_stats> stats(b.rows);
    device_array<T> token_loss(b.rows);
    device_array<troll::objective_metrics> metrics(1);
    const std::size_t bytes = troll::sparse_objective_workspace_bytes(b.rows, b.k_max, o.new_support.k);
    device_array<double> workspace((bytes + sizeof(double) - 1) / sizeof(double));
    troll::objective_forward(troll::cuda.on(s.stream).with_workspace(workspace.get(), workspace.bytes()), o,
                             d.new_view(), troll::sparse_input<T>(b.old.device()), d.tokens_view(how),
                             aligned.device(), lp.device(), stats.get(), token_loss.get(), metrics.get());
    s.sync();
    CUDA_REQUIRE(cudaGetLastError());
    aligned.download();
    lp.download();
    const std::vector<troll::projection_stats> got_stats = stats.download();
    const std::vector<T> got_loss = token_loss.download();
    const troll::objective_metrics got_metrics = metrics.download()[0];
    std::size_t stopped = 0;
    for (std::size_t r = 0; r < b.rows; ++r) {
      CAPTURE(r);
      CHECK(got_stats[r].status == want_stats[r].status);
      CHECK(aligned.counts[r] == want_aligned.counts[r]);
      CHECK(lp.counts[r] == want_lp.counts[r]);
      if (want_stats[r].status != troll::row_status::not_converged) continue;
      ++stopped;
      CHECK(std::isfinite(double(got_loss[r])));
      CHECK(got_stats[r].kl_after < o.eps);
      CHECK(between_backends<T>().accepts(got_loss[r], want_loss[r]));
      CHECK(between_backends<T>().accepts(got_stats[r].t, want_stats[r].t));
    }
    CHECK(stopped > 0);
    CHECK(std::isfinite(got_metrics.loss));
    CHECK(between_backends<T>().accepts(got_metrics.loss, want_metrics.loss));
  }

  TEST_CASE_TEMPLATE("checked mode throws the CPU's exception for the lowest bad row", T, float, double) {
    const std::size_t rows = 10;
    const troll::sparse_trust_region_objective o = objective_with(3);
    const auto how = troll::loss_aggregation::sequence_mean;
    // Each setup breaks the batch in one way; the device must throw the CPU's message.
    for (int which = 0; which < 4; ++which) {
      CAPTURE(which);
      sparse_batch<T> b(rows, 150, 21u, 3);
      REQUIRE(b.host.mask[6] != T(0));
      if (which == 0) b.host.advantages[6] = T(nan_value);
      if (which == 1) b.host.fresh[4 * b.vocab + 3] = T(nan_value);
      if (which == 2) b.old.log_probs[7 * 9] = T(0.5), b.old.upload();   // old row 7: a probability above 1
      if (which == 3) b.host.tokens[6] = b.host.tokens[6] == 0 ? 1 : 0, b.host.mask[6] = T(1);
      const std::string want = message_of([&] { run_cpu(b, o, how, 1.0); });
      if (which == 3 && want.empty()) continue;  // the replaced token happened to be in S_old
      REQUIRE(!want.empty());
      std::string got;
      try {
        run_cuda(b, o, how, 1.0, troll::cuda_checked, troll::cuda_checked);
      } catch (const troll::invalid_input& e) {
        got = e.what();
      }
      CHECK(got == want);
    }
    // When it throws, no output has been written: the caller's buffers keep their sentinels.
    {
      sparse_batch<T> b(rows, 150, 23u, 3);
      b.host.advantages[6] = T(nan_value);
      test_stream s;
      device_batch<T> d(b.host);
      aligned_pair<T> aligned(b.rows, b.k_max, b.vocab);
      sparse_pair<T> lp(b.rows, b.k_max, b.vocab);
      aligned.d_indices.upload(aligned.indices), aligned.d_counts.upload(aligned.counts);
      aligned.d_fresh.upload(aligned.fresh), aligned.d_old.upload(aligned.old);
      aligned.d_fresh_r.upload(aligned.fresh_r), aligned.d_old_r.upload(aligned.old_r);
      lp.upload();
      const std::vector<T> sentinel(b.rows, T(-7));
      device_array<T> token_loss(sentinel);
      device_array<troll::projection_stats> stats(b.rows);
      device_array<troll::objective_metrics> metrics(1);
      const std::vector<troll::projection_stats> stats_before = stats.download();
      const std::size_t bytes = troll::sparse_objective_workspace_bytes(b.rows, b.k_max, o.new_support.k);
      device_array<double> workspace((bytes + sizeof(double) - 1) / sizeof(double));
      const std::string want = message_of([&] { run_cpu(b, o, how, 1.0); });
      REQUIRE(!want.empty());
      const std::string got = message_of([&] {
        troll::objective_forward(troll::cuda.on(s.stream).with_workspace(workspace.get(), workspace.bytes()).checked(), o, d.new_view(), troll::sparse_input<T>(b.old.device()),
                                 d.tokens_view(how), aligned.device(), lp.device(), stats.get(), token_loss.get(),
                                 metrics.get());
      });
      CHECK(got == want);
      s.sync();
      const std::vector<troll::sparse_index> indices = aligned.d_indices.download(), counts = aligned.d_counts.download();
      CHECK(indices == aligned.indices);
      CHECK(counts == aligned.counts);
      CHECK(aligned.d_fresh.download() == aligned.fresh);
      CHECK(aligned.d_old.download() == aligned.old);
      CHECK(aligned.d_fresh_r.download() == aligned.fresh_r);
      CHECK(aligned.d_old_r.download() == aligned.old_r);
      const std::vector<troll::sparse_index> lp_indices = lp.indices, lp_counts = lp.counts;
      const std::vector<T> lp_values = lp.log_probs, lp_remainders = lp.log_remainder;  // the uploaded sentinels
      lp.download();
      CHECK(lp.indices == lp_indices);
      CHECK(lp.counts == lp_counts);
      CHECK(lp.log_probs == lp_values);
      CHECK(lp.log_remainder == lp_remainders);
      CHECK(token_loss.download() == sentinel);
      const std::vector<troll::projection_stats> stats_after = stats.download();
      CHECK(std::memcmp(stats_after.data(), stats_before.data(), stats_after.size() * sizeof(stats_after[0])) == 0);
    }
    // A clean batch passes the checked mode and gives the default mode's results.
    sparse_batch<T> b(rows, 150, 22u, 3);
    const run_result<T> want = run_cpu(b, o, how, 1.0);
    const run_result<T> got = run_cuda(b, o, how, 1.0, troll::cuda_checked, troll::cuda_checked);
    for (std::size_t r = 0; r < rows; ++r) check_row(got, want, r, b.k_max, b.vocab);
    check_metrics<T>(got.metrics, want.metrics);
  }
}

TEST_SUITE("device") {
#include "../bodies/sparse_objective_gradients.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
