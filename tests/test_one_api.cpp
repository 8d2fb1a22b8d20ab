// One API for both backends: tests/consumer/every_entry_point.hpp calls every entry point from a
// function template over the policy; here it runs under troll::cpu (serial and threaded, the
// results identical), and the workspace mechanism is checked: the size query and an undersized,
// misaligned or null workspace refused with shape_error before anything is written.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "consumer/every_entry_point.hpp"

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
  CHECK(workspace_bytes(cpu, op::objective_forward{}, sparse, 10, 100, 64) == 0);
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
