// One API for both backends: tests/consumer/every_entry_point.hpp calls every entry point from a
// function template over the policy; here it runs under troll::cpu (serial and threaded, the
// results identical), and the workspace mechanism is checked: the size query and an undersized,
// misaligned or null workspace refused with shape_error before anything is written.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "consumer/every_entry_point.hpp"

// The Gaussian entry points, written once over the policy (troll/gaussian_api.hpp), take troll's
// policies as a caller writes them (value, const reference, builder result) and nothing else.
namespace {
template <class P, class = void>
struct gaussian_kl_takes : std::false_type {};
template <class P>
struct gaussian_kl_takes<P, std::void_t<decltype(troll::gaussian::kl(std::declval<P>(), troll::batch_view<const double>{},
                                                                     troll::batch_view<const double>{},
                                                                     troll::batch_view<const double>{},
                                                                     troll::batch_view<const double>{},
                                                                     static_cast<double*>(nullptr)))>>
    : std::true_type {};
static_assert(gaussian_kl_takes<troll::cpu_policy>::value);
static_assert(gaussian_kl_takes<const troll::cpu_policy&>::value);
static_assert(gaussian_kl_takes<decltype(troll::cpu.with_threads(2))>::value);
static_assert(gaussian_kl_takes<const troll::cuda_policy&>::value);
static_assert(!gaussian_kl_takes<int>::value);
static_assert(!gaussian_kl_takes<const double*>::value);
static_assert(troll::is_execution_policy_v<const troll::cuda_policy&> && !troll::is_execution_policy_v<int>);
}  // namespace

TEST_CASE("every entry point runs under troll::cpu from one function template") {
  const consumer::step_results serial = consumer::run_every_entry_point(troll::cpu.with_threads(1));
  const consumer::step_results threaded = consumer::run_every_entry_point(troll::cpu.with_threads(4));
  CHECK(serial.project == threaded.project);
  CHECK(serial.jacobian == threaded.jacobian);
  CHECK(serial.troll_loss == threaded.troll_loss);
  for (double kl_after : serial.project_stats_kl) CHECK(kl_after <= 0.05 * (1 + 1e-9));
  for (double v : serial.log_softmax) CHECK(v <= 0.0);
  CHECK(std::isfinite(serial.troll_loss));
  CHECK(std::isfinite(serial.ppo_loss));
  CHECK(std::isfinite(serial.dppo_loss));
  CHECK(std::isfinite(serial.sparse_troll_loss));
  for (double g : serial.grad_new) CHECK(std::isfinite(g));
  for (int c : serial.sparse_counts) CHECK(c > 0);
  CHECK(serial.gaussian_chol == threaded.gaussian_chol);
  REQUIRE(serial.gaussian_kl_after.size() == 8);
  for (double kl_after : serial.gaussian_kl_after) CHECK(kl_after <= 0.05 * (1 + 1e-9));
  for (double v : serial.gaussian_diag_std) CHECK(v > 0.0);
  for (double v : serial.gaussian_split_diag_std) CHECK(v > 0.0);
  REQUIRE(serial.gaussian_kl.size() == 2);
  for (double v : serial.gaussian_kl) CHECK(v > 0.0);
  for (double v : serial.gaussian_kl_diag) CHECK(v > 0.0);
  for (double v : serial.gaussian_diag_grad_mean) CHECK(std::isfinite(v));
  for (double v : serial.gaussian_split_diag_jvp_std) CHECK(std::isfinite(v));
  CHECK(serial.gaussian_diag_grad_mean == threaded.gaussian_diag_grad_mean);
  REQUIRE(serial.gaussian_full_derivatives.size() == 24);
  for (double v : serial.gaussian_full_derivatives) CHECK(std::isfinite(v));
  CHECK(serial.gaussian_full_derivatives == threaded.gaussian_full_derivatives);
  // Two shards finalised in two stages give sparsify's rows bit for bit (canonical tail sums).
  CHECK(serial.shard_rows == serial.whole_rows);
  CHECK(threaded.shard_rows == serial.shard_rows);
  // The first shard's gradient is the first columns of the whole row's (same support, same g).
  const std::size_t rows = 2, V = 8, half = V / 2;
  REQUIRE(serial.sparse_shard_grad.size() == rows * half);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < half; ++j) {
      const double whole = serial.sparse_grad[r * V + j], shard = serial.sparse_shard_grad[r * half + j];
      CHECK(std::abs(shard - whole) <= 1e-14 + 1e-12 * std::abs(whole));
    }
}

TEST_CASE("workspace_bytes: defined for every entry point and both policies") {
  using namespace troll;
  static_assert(workspace_bytes(cpu, op::project{}, 10, 100) == 0, "the projection needs no scratch");
  static_assert(workspace_bytes(cuda, op::project{}, 10, 100) == 0, "the projection needs no scratch");
  static_assert(workspace_bytes(cpu, op::project_backward{}, 10, 100) == 10, "one flag per row");
  static_assert(workspace_bytes(cpu, op::project_jvp{}, 10, 100) == 10, "one flag per row");
  static_assert(workspace_bytes(cpu, op::project_jacobian{}, 10, 100) == 0, "none on the CPU");
  static_assert(workspace_bytes(cpu, op::gaussian_project_joint_backward{}, 10, 4) == 0, "Gaussians need none");
  static_assert(workspace_bytes(cuda, op::gaussian_project_split_diag{}, 10, 4) == 0, "Gaussians need none");
  static_assert(workspace_bytes(cuda, op::project_jacobian{}, 10, 100) == project_jacobian_workspace_bytes(10, 100),
                "the CUDA Jacobian's per-row terms");
  static_assert(workspace_bytes(cuda, op::project_jacobian{}, 0, 100) == 0, "no rows, no scratch");
  static_assert(workspace_bytes(cuda, op::objective_forward{}, trust_region_objective{}, 10, 100) ==
                    objective_workspace_bytes(10),
                "dense objective");
  static_assert(workspace_bytes(cuda, op::objective_backward{}, ppo_clip_objective{}, 10, 100) ==
                    workspace_bytes(cuda, op::objective_forward{}, dppo_objective{}, 10, 100),
                "one allocation serves every dense objective, forward and backward");
  sparse_trust_region_objective sparse;
  sparse.new_support.k = 16;
  CHECK(workspace_bytes(cuda, op::objective_forward{}, sparse, 10, 100, 64) ==
        sparse_objective_workspace_bytes(10, 64, 16));
  // The CPU objectives' scratch: per-row weights, results and flags (dense TROLL: one row more).
  CHECK(workspace_bytes(cpu, op::objective_forward{}, sparse, 10, 100, 64) ==
        workspace_bytes(cpu, op::objective_backward{}, sparse, 10, 100, 64));
  CHECK(workspace_bytes(cpu, op::objective_forward{}, sparse, 10, 100, 64) >= 10 * sizeof(double));
  CHECK(workspace_bytes(cpu, op::objective_forward{}, trust_region_objective{}, 10, 100) >= 100 * sizeof(double));
  CHECK(workspace_bytes(cpu, op::objective_backward{}, ppo_clip_objective{}, 10, 100) ==
        workspace_bytes(cpu, op::objective_forward{}, dppo_objective{}, 10, 100));
  CHECK(workspace_bytes(cpu, op::objective_forward{}, ppo_clip_objective{}, 0, 100) == 0);
  CHECK(workspace_bytes(cpu.with_threads(3), op::sparsify{}, 10, 100, 65) == 10 * (12 * 65 + 13));
  CHECK(workspace_bytes(cuda, op::sparsify{}, 10, 100, 65) == 0);
}

TEST_CASE("cpu workspace: undersized, misaligned or null memory throws shape_error before writing") {
  const std::size_t rows = 2, V = 8;
  const std::vector<double> zn = consumer::logits(rows, V, 0.7), zo = consumer::logits(rows, V, 1.3);
  std::vector<double> lp(rows * V);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(troll::cpu, troll::make_batch(zn.data(), rows, V), troll::make_batch(zo.data(), rows, V), 0.05,
                 troll::make_batch(lp.data(), rows, V), stats.data());
  const std::vector<double> g(rows * V, 0.25);
  const double sentinel = 1234.5;
  std::vector<double> grad(rows * V, sentinel);
  const std::size_t need = troll::workspace_bytes(troll::cpu, troll::op::project_backward{}, rows, V);
  REQUIRE(need == rows);
  alignas(16) unsigned char memory[64] = {};
  auto call = [&](troll::cpu_policy p) {
    troll::project_backward(p, troll::make_batch(zn.data(), rows, V), troll::make_batch(zo.data(), rows, V),
                            troll::make_batch(lp.data(), rows, V), stats.data(), troll::make_batch(g.data(), rows, V),
                            troll::make_batch(grad.data(), rows, V));
  };
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(memory, need - 1)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(memory + 1, need)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(nullptr, need)), troll::shape_error);
  for (double v : grad) CHECK(v == sentinel);
  CHECK_THROWS_WITH(call(troll::cpu.with_workspace(memory, need - 1)),
                    "troll::project_backward: workspace holds 1 bytes but the call needs 2 (troll::workspace_bytes)");
  call(troll::cpu.with_workspace(memory, need));
  std::vector<double> own(grad);
  call(troll::cpu);  // no workspace: the CPU allocates its own
  CHECK(own == grad);
  for (double v : grad) CHECK(v != sentinel);
}

namespace {

/// Calls `call(policy)` with the policy's workspace too short (8 bytes: not even the weights of
/// the rows), misaligned and null (each must throw shape_error and leave `out` as it was), then
/// with `need` bytes, the query's answer (the results must equal those of the call that
/// allocates its own scratch).
template <class Call, class Out>
void check_objective_workspace(std::size_t need, Call call, const Out& out) {
  REQUIRE(need > 0);
  std::vector<double> memory(need / sizeof(double) + 2);
  auto* bytes = reinterpret_cast<unsigned char*>(memory.data());
  const Out before = out;
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes, 8)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes + 1, need)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(nullptr, need)), troll::shape_error);
  CHECK(out == before);
  call(troll::cpu.with_workspace(bytes, need));
  const Out with_workspace = out;
  CHECK(with_workspace != before);
  call(troll::cpu.with_threads(3));  // no workspace: the documented convenience allocates
  CHECK(out == with_workspace);
}

}  // namespace

TEST_CASE("cpu objectives draw their scratch from the policy's workspace (sized, checked)") {
  using troll::make_batch;
  const std::size_t rows = 5, V = 12;
  const std::vector<double> zn = consumer::logits(rows, V, 0.7), zo = consumer::logits(rows, V, 1.3);
  const auto new_in = make_batch(zn.data(), rows, V);
  const auto old_in = make_batch(zo.data(), rows, V);
  const std::vector<troll::token_id> tokens{2, 5, 0, 11, 7};
  const std::vector<double> advantages{1.0, -0.5, 0.25, 2.0, -1.0}, mask{1, 1, 0, 1, 1};
  troll::token_batch<double> batch;
  batch.tokens = tokens.data();
  batch.advantages = advantages.data();
  batch.loss_mask = mask.data();
  const double sentinel = 1234.5;

  const troll::trust_region_objective troll_objective;
  std::vector<double> log_probs(rows * V, sentinel), token_loss(rows, sentinel);
  std::vector<troll::projection_stats> stats(rows);
  troll::objective_metrics metrics;
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, troll_objective, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_forward(p, troll_objective, new_in, old_in, batch, make_batch(log_probs.data(), rows, V),
                                 stats.data(), token_loss.data(), &metrics);
      },
      log_probs);
  std::vector<double> grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, troll_objective, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, troll_objective, new_in, old_in, batch, make_batch<const double>(log_probs.data(), rows, V),
                                  stats.data(), make_batch(grad.data(), rows, V), 1.0);
      },
      grad);

  troll::dppo_objective dppo;
  dppo.divergence = troll::dppo_divergence::topk_kl;
  dppo.top_k = 3;
  const troll::ppo_clip_objective ppo;
  std::vector<double> ppo_loss(rows, sentinel), ppo_grad(rows * V, sentinel), dppo_grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, ppo, rows, V),
      [&](troll::cpu_policy p) { troll::objective_forward(p, ppo, new_in, old_in, batch, ppo_loss.data(), &metrics); },
      ppo_loss);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, ppo, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, ppo, new_in, old_in, batch, make_batch(ppo_grad.data(), rows, V), 1.0);
      },
      ppo_grad);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, dppo, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, dppo, new_in, old_in, batch, make_batch(dppo_grad.data(), rows, V), 1.0);
      },
      dppo_grad);

  // The sparse objective on old rows from sparsify (k = 3 and the sampled token).
  troll::sparsify_options options;
  options.k = 3;
  const std::size_t k_old = 4, k_max = V;
  std::vector<troll::sparse_index> old_indices(rows * k_old), old_counts(rows);
  std::vector<double> old_values(rows * k_old), old_remainder(rows);
  const troll::sparse_batch_view<double> old_rows{old_indices.data(), old_values.data(), old_counts.data(),
                                                  old_remainder.data(), rows, k_old, V};
  troll::sparsify(troll::cpu, old_in, tokens.data(), options, old_rows);
  troll::sparse_trust_region_objective sparse;
  sparse.new_support = options;
  std::vector<troll::sparse_index> a_indices(rows * k_max), a_counts(rows), l_indices(rows * k_max), l_counts(rows);
  std::vector<double> a_new(rows * k_max), a_old(rows * k_max), a_new_r(rows), a_old_r(rows);
  std::vector<double> l_values(rows * k_max, sentinel), l_remainder(rows);
  const troll::aligned_batch_view<double> aligned{a_indices.data(), a_counts.data(), a_new.data(), a_old.data(),
                                                  a_new_r.data(),   a_old_r.data(),  rows,         k_max, V};
  const troll::sparse_batch_view<double> sparse_lp{l_indices.data(), l_values.data(), l_counts.data(),
                                                   l_remainder.data(), rows, k_max, V};
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, sparse, rows, V, k_max),
      [&](troll::cpu_policy p) {
        troll::objective_forward(p, sparse, new_in, troll::sparse_input<double>(old_rows), batch, aligned, sparse_lp,
                                 stats.data(), token_loss.data(), &metrics);
      },
      l_values);
  std::vector<double> sparse_grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, sparse, rows, V, k_max),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, sparse, new_in, troll::aligned_input<double>(aligned), batch,
                                  troll::sparse_input<double>(sparse_lp), stats.data(),
                                  make_batch(sparse_grad.data(), rows, V), 1.0);
      },
      sparse_grad);
}
