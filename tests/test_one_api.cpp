// One API for both backends: tests/consumer/every_entry_point.hpp calls every entry point from a
// function template over the policy; here it runs under troll::cpu (serial and threaded, the
// results identical), and the workspace mechanism is checked: the size query and an undersized,
// misaligned or null workspace refused with shape_error before anything is written.
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
template <class X>
struct troll_test_type {
  using type = X;
};
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
// A caller's type derived from a policy: accepted by project (a cpu_policy parameter) and so by
// the Gaussian entry points too, which run it as its base.
struct user_policy : troll::cpu_policy {};
struct user_device_policy : troll::cuda_policy {};
static_assert(gaussian_kl_takes<user_policy>::value && gaussian_kl_takes<const user_device_policy&>::value);
static_assert(std::is_same<troll::execution_policy_base_t<const user_policy&>, troll::cpu_policy>::value);
static_assert(std::is_same<troll::execution_policy_base_t<user_device_policy>, troll::cuda_policy>::value);
}  // namespace

TEST_CASE("a policy type derived from troll::cpu_policy runs the Gaussian entry points as troll::cpu") {
  const std::vector<double> mean{0.1, -0.2}, std_dev{1.0, 0.5}, old_mean{0.0, 0.0}, old_std{0.9, 0.6};
  std::vector<double> kl_user(1), kl_cpu(1), out_mean(2), out_std(2);
  const auto view = [](const std::vector<double>& v) { return troll::make_batch<const double>(v.data(), 1, 2); };
  user_policy policy;
  policy.threads = 2;
  troll::gaussian::kl_diag(policy, view(mean), view(std_dev), view(old_mean), view(old_std), kl_user.data());
  troll::gaussian::kl_diag(troll::cpu, view(mean), view(std_dev), view(old_mean), view(old_std), kl_cpu.data());
  CHECK(kl_user == kl_cpu);
  troll::gaussian::gaussian_stats stats[1];
  troll::gaussian::project_joint_diag(policy, view(mean), view(std_dev), view(old_mean), view(old_std), 0.01,
                                      troll::make_batch(out_mean.data(), 1, 2), troll::make_batch(out_std.data(), 1, 2),
                                      stats);
  CHECK(stats[0].kl_after <= 0.01 * (1 + 1e-9));
}

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
  REQUIRE(serial.gaussian_kl_mutable_views.size() == 4);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(serial.gaussian_kl_mutable_views[r] == serial.gaussian_kl[r]);
    CHECK(serial.gaussian_kl_mutable_views[2 + r] == serial.gaussian_kl_diag[r]);
  }
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

TEST_CASE("every entry point runs in float from the same function template, close to double") {
  // The float instantiation of every entry point a consumer can name (the step above in T = float):
  // finite results within float's tolerances of the double step (inputs rounded to float first,
  // so the comparison measures the float computation, not the inputs' rounding: loose 1e-4).
  const consumer::step_results f = consumer::run_every_entry_point<troll::cpu_policy, float>(troll::cpu);
  const consumer::step_results d = consumer::run_every_entry_point<troll::cpu_policy, double>(troll::cpu);
  auto close = [](const std::vector<double>& a, const std::vector<double>& b, double atol, double rtol) {
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      INFO("entry " << i << ": float " << a[i] << ", double " << b[i]);
      CHECK(std::isfinite(a[i]) == std::isfinite(b[i]));
      if (std::isfinite(b[i])) CHECK(std::abs(a[i] - b[i]) <= atol + rtol * std::abs(b[i]));
    }
  };
  close(f.log_softmax, d.log_softmax, 1e-5, 1e-4);
  close(f.kl, d.kl, 1e-5, 1e-3);
  close(f.project, d.project, 1e-4, 1e-3);
  close(f.grad_new, d.grad_new, 1e-4, 1e-3);
  close(f.jvp, d.jvp, 1e-4, 1e-3);
  close(f.sparse_log_probs, d.sparse_log_probs, 1e-4, 1e-3);
  close(f.sparse_grad, d.sparse_grad, 1e-4, 1e-3);
  close(f.gaussian_mean, d.gaussian_mean, 1e-4, 1e-3);
  close(f.gaussian_chol, d.gaussian_chol, 1e-4, 1e-3);
  close(f.gaussian_diag_std, d.gaussian_diag_std, 1e-4, 1e-3);
  close(f.gaussian_full_derivatives, d.gaussian_full_derivatives, 1e-3, 1e-2);
  for (double kl_after : f.project_stats_kl) CHECK(kl_after <= 0.05 * (1 + 1e-4));
  for (double kl_after : f.gaussian_kl_after) CHECK(kl_after <= 0.05 * (1 + 1e-4));
  CHECK(f.sparse_counts == d.sparse_counts);
  CHECK(f.shard_rows == f.whole_rows);  // canonical tail sums in float too
  for (double loss : {f.troll_loss, f.ppo_loss, f.dppo_loss, f.sparse_troll_loss}) CHECK(std::isfinite(loss));
  CHECK(std::abs(f.troll_loss - d.troll_loss) <= 1e-4 + 1e-3 * std::abs(d.troll_loss));
  CHECK(std::abs(f.sparse_troll_loss - d.sparse_troll_loss) <= 1e-4 + 1e-3 * std::abs(d.sparse_troll_loss));
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
  const std::vector<double> zn = consumer::logits<double>(rows, V, 0.7), zo = consumer::logits<double>(rows, V, 1.3);
  std::vector<double> lp(rows * V);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(troll::cpu, troll::make_batch(zn.data(), rows, V), troll::make_batch(zo.data(), rows, V), 0.05,
                 troll::make_batch(lp.data(), rows, V), stats.data());
  std::vector<double> g(rows * V, 0.25);
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
  // The caller's workspace is an argument: checked before the rows, so a bad row with a short
  // workspace is a shape_error (as on the device), and a domain_error once the workspace fits.
  g[V + 3] = std::nan("");
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(memory, need - 1)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(memory, need)), troll::domain_error);
  std::vector<double> tangent_out(rows * V, sentinel);
  auto jvp = [&](troll::cpu_policy p) {
    troll::project_jvp(p, troll::make_batch(zn.data(), rows, V), troll::make_batch(zo.data(), rows, V),
                       troll::make_batch(lp.data(), rows, V), stats.data(), troll::make_batch(g.data(), rows, V),
                       troll::batch_view<const double>{}, 0.0, troll::make_batch(tangent_out.data(), rows, V));
  };
  CHECK_THROWS_AS(jvp(troll::cpu.with_workspace(memory, need - 1)), troll::shape_error);
  CHECK_THROWS_AS(jvp(troll::cpu.with_workspace(memory, need)), troll::domain_error);
  for (double v : grad) CHECK(v == sentinel);
  for (double v : tangent_out) CHECK(v == sentinel);
  g[V + 3] = 0.25;
  call(troll::cpu.with_workspace(memory, need));
  std::vector<double> own(grad);
  call(troll::cpu);  // no workspace: the thread's arena
  CHECK(own == grad);
  for (double v : grad) CHECK(v != sentinel);
}

namespace {

/// Calls `call(policy)` with the policy's workspace too short (8 bytes: not even the weights of
/// the rows), misaligned and null (each must throw shape_error and leave `out` as it was), the
/// same with a NaN in `spoil` (an input of a counted row: the workspace is checked first, so
/// still shape_error; domain_error once the workspace fits), then with `need` bytes, the query's
/// answer (the results must equal those of the call that takes its scratch from the thread's
/// arena).
template <class Call, class Out>
void check_objective_workspace(std::size_t need, Call call, const Out& out, double& spoil) {
  REQUIRE(need > 0);
  std::vector<double> memory(need / sizeof(double) + 2);
  auto* bytes = reinterpret_cast<unsigned char*>(memory.data());
  const Out before = out;
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes, 8)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes + 1, need)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(nullptr, need)), troll::shape_error);
  const double kept = spoil;
  spoil = std::nan("");
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes, 8)), troll::shape_error);
  CHECK_THROWS_AS(call(troll::cpu.with_workspace(bytes, need)), troll::domain_error);
  spoil = kept;
  CHECK(out == before);
  call(troll::cpu.with_workspace(bytes, need));
  const Out with_workspace = out;
  CHECK(with_workspace != before);
  call(troll::cpu.with_threads(3));  // no workspace: the thread's arena
  CHECK(out == with_workspace);
}

}  // namespace

TEST_CASE("cpu objectives draw their scratch from the policy's workspace (sized, checked)") {
  using troll::make_batch;
  const std::size_t rows = 5, V = 12;
  const std::vector<double> zn = consumer::logits<double>(rows, V, 0.7), zo = consumer::logits<double>(rows, V, 1.3);
  const auto new_in = make_batch(zn.data(), rows, V);
  const auto old_in = make_batch(zo.data(), rows, V);
  const std::vector<troll::token_id> tokens{2, 5, 0, 11, 7};
  std::vector<double> advantages{1.0, -0.5, 0.25, 2.0, -1.0};
  const std::vector<double> mask{1, 1, 0, 1, 1};
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
      log_probs, advantages[3]);
  std::vector<double> grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, troll_objective, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, troll_objective, new_in, old_in, batch, make_batch<const double>(log_probs.data(), rows, V),
                                  stats.data(), make_batch(grad.data(), rows, V), 1.0);
      },
      grad, advantages[3]);

  troll::dppo_objective dppo;
  dppo.divergence = troll::dppo_divergence::topk_kl;
  dppo.top_k = 3;
  const troll::ppo_clip_objective ppo;
  std::vector<double> ppo_loss(rows, sentinel), ppo_grad(rows * V, sentinel), dppo_grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, ppo, rows, V),
      [&](troll::cpu_policy p) { troll::objective_forward(p, ppo, new_in, old_in, batch, ppo_loss.data(), &metrics); },
      ppo_loss, advantages[3]);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, ppo, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, ppo, new_in, old_in, batch, make_batch(ppo_grad.data(), rows, V), 1.0);
      },
      ppo_grad, advantages[3]);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, dppo, rows, V),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, dppo, new_in, old_in, batch, make_batch(dppo_grad.data(), rows, V), 1.0);
      },
      dppo_grad, advantages[3]);

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
      l_values, advantages[3]);
  std::vector<double> sparse_grad(rows * V, sentinel);
  check_objective_workspace(
      troll::workspace_bytes(troll::cpu, troll::op::objective_backward{}, sparse, rows, V, k_max),
      [&](troll::cpu_policy p) {
        troll::objective_backward(p, sparse, new_in, troll::aligned_input<double>(aligned), batch,
                                  troll::sparse_input<double>(sparse_lp), stats.data(),
                                  make_batch(sparse_grad.data(), rows, V), 1.0);
      },
      sparse_grad, advantages[3]);

  // The sparse project_backward on the forward's aligned rows and log π*: its workspace too is
  // checked before the rows (a NaN upstream entry in row 1).
  std::vector<double> up(rows * k_max, 0.125), up_r(rows, 0.0), gn(rows * k_max, sentinel), gn_r(rows, sentinel);
  auto sparse_backward = [&](troll::cpu_policy p) {
    troll::project_backward(p, troll::aligned_input<double>(aligned), troll::sparse_input<double>(sparse_lp),
                            stats.data(),
                            troll::sparse_grad_input<double>(troll::sparse_grad_view<double>{up.data(), up_r.data(), rows, k_max}),
                            troll::sparse_grad_view<double>{gn.data(), gn_r.data(), rows, k_max});
  };
  const std::size_t sparse_need = troll::workspace_bytes(troll::cpu, troll::op::project_backward{}, rows);
  REQUIRE(sparse_need == rows);
  alignas(16) unsigned char short_memory[16] = {};
  up[k_max + 0] = std::nan("");
  CHECK_THROWS_AS(sparse_backward(troll::cpu.with_workspace(short_memory, sparse_need - 1)), troll::shape_error);
  CHECK_THROWS_AS(sparse_backward(troll::cpu.with_workspace(short_memory, sparse_need)), troll::domain_error);
  for (double v : gn) CHECK(v == sentinel);
  up[k_max + 0] = 0.125;
  sparse_backward(troll::cpu.with_workspace(short_memory, sparse_need));
  CHECK(gn[0] != sentinel);
}

TEST_CASE("cpu objectives' scratch: the size query's constant formula is where the carving ends") {
  namespace cpu = troll::detail::cpu;
  // Each layout carved from a block (the arena's aligned takes) ends exactly at the bytes the
  // query's formula gives, for several row counts and extras (ASan also guards the carving).
  auto check = [](auto tag, std::size_t rows, std::size_t extra) {
    using layout = typename decltype(tag)::type;
    const std::size_t bytes = cpu::scratch_bytes<layout>(rows, extra);
    std::vector<double> block(bytes / sizeof(double) + 1);
    cpu::scratch_arena arena(reinterpret_cast<unsigned char*>(block.data()));
    const layout parts(arena, rows, extra);
    static_cast<void>(parts);
    CHECK(arena.used() == bytes);
  };
  for (std::size_t rows : {std::size_t(0), std::size_t(1), std::size_t(3), std::size_t(17)}) {
    for (std::size_t extra : {std::size_t(0), std::size_t(5), std::size_t(64)}) {
      CAPTURE(rows);
      CAPTURE(extra);
      check(troll_test_type<cpu::troll_forward_scratch<float>>{}, rows, extra);
      check(troll_test_type<cpu::troll_forward_scratch<double>>{}, rows, extra);
      check(troll_test_type<cpu::troll_backward_scratch>{}, rows, extra);
      check(troll_test_type<cpu::ratio_forward_scratch>{}, rows, extra);
      check(troll_test_type<cpu::ratio_backward_scratch>{}, rows, extra);
      check(troll_test_type<cpu::sparse_forward_scratch>{}, rows, extra);
      check(troll_test_type<cpu::sparse_backward_scratch>{}, rows, extra);
    }
  }
  static_assert(troll::workspace_bytes(troll::cpu, troll::op::objective_forward{}, troll::trust_region_objective{},
                                       4, 100) >= 100 * sizeof(double),
                "a constant expression on the CPU too");
}

// ---- The CPU's scratch without a workspace: a per-thread arena, grown once, then reused ----

TEST_CASE("host_arena: 64-byte aligned blocks, grown only when a call needs more, one per nesting level") {
  troll::detail::host_arena& arena = troll::detail::host_arena::local();
  const troll::scratch_memory none{};
  const std::size_t big = arena.capacity(0) + 1000;
  std::size_t growths = arena.growths();
  unsigned char* first = nullptr;
  {
    const troll::detail::host_scratch s("test", none, big);
    first = s.data();
    CHECK(reinterpret_cast<std::uintptr_t>(first) % 64 == 0);
    CHECK(arena.growths() == growths + 1);
    CHECK(arena.depth() == 1);
    for (std::size_t i = 0; i < big; ++i) s.data()[i] = static_cast<unsigned char>(i);  // ASan: the bytes are ours
    // A second scratch live at the same time gets its own block.
    const troll::detail::host_scratch nested("test", none, 16);
    CHECK(nested.data() != first);
    CHECK(reinterpret_cast<std::uintptr_t>(nested.data()) % 64 == 0);
    CHECK(arena.depth() == 2);
  }
  CHECK(arena.depth() == 0);
  growths = arena.growths();
  {
    const troll::detail::host_scratch smaller("test", none, big / 2);
    CHECK(smaller.data() == first);  // reused, not reallocated
  }
  {
    const troll::detail::host_scratch same("test", none, big);
    CHECK(same.data() == first);
  }
  CHECK(arena.growths() == growths);
  // A caller's workspace is checked as before and never touches the arena.
  alignas(16) unsigned char memory[32] = {};
  CHECK_THROWS_AS(troll::detail::host_scratch("test", troll::scratch_memory{memory, 8}, 16), troll::shape_error);
  CHECK_THROWS_AS(troll::detail::host_scratch("test", troll::scratch_memory{memory + 1, 16}, 16), troll::shape_error);
  CHECK_THROWS_AS(troll::detail::host_scratch("test", troll::scratch_memory{nullptr, 16}, 16), troll::shape_error);
  CHECK(troll::detail::host_scratch("test", troll::scratch_memory{memory, 16}, 16).data() == memory);
  CHECK(arena.depth() == 0);
  CHECK(arena.growths() == growths);
}

TEST_CASE("every entry point with scratch, called again without a workspace: same results, no new allocation") {
  using troll::make_batch;
  using T = double;
  const std::size_t rows = 3, V = 10;
  const std::vector<T> zn = consumer::logits<double>(rows, V, 0.7), zo = consumer::logits<double>(rows, V, 1.3);
  const auto new_in = make_batch(zn.data(), rows, V);
  const auto old_in = make_batch(zo.data(), rows, V);
  const auto policy = troll::cpu.with_threads(1);
  std::vector<T> lp(rows * V);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(policy, new_in, old_in, 0.05, make_batch(lp.data(), rows, V), stats.data());
  const auto lp_in = make_batch<const T>(lp.data(), rows, V);
  std::vector<T> up(rows * V);
  for (std::size_t i = 0; i < up.size(); ++i) up[i] = 0.1 * double(i % 7) - 0.3;
  const auto up_in = make_batch<const T>(up.data(), rows, V);

  const troll::detail::host_arena& arena = troll::detail::host_arena::local();
  // Runs `call` three times: the first may grow the arena, the second and third must not, and
  // all three must give `out` bit for bit.
  auto twice = [&](const char* name, auto call, auto& out) {
    CAPTURE(name);
    call();
    const auto first = out;
    const std::size_t growths = arena.growths();
    for (int again = 0; again < 2; ++again) {
      for (auto& v : out) v = decltype(+v)(99);
      call();
      CHECK(out == first);
    }
    CHECK(arena.growths() == growths);
    CHECK(arena.depth() == 0);
  };

  std::vector<T> grad(rows * V), tangent(rows * V);
  twice("project_backward", [&] {
    troll::project_backward(policy, new_in, old_in, lp_in, stats.data(), up_in, make_batch(grad.data(), rows, V));
  }, grad);
  twice("project_jvp", [&] {
    troll::project_jvp(policy, new_in, old_in, lp_in, stats.data(), up_in, up_in, 0.5, make_batch(tangent.data(), rows, V));
  }, tangent);

  // Sparse rows: sparsify (its rows kept in scratch until every row has passed), align, project,
  // the sparse backward.
  troll::sparsify_options options;
  options.k = 4;
  options.delta = 1e-6;
  const std::size_t k = 5, k_max = V;
  const std::vector<troll::token_id> tokens{2, 5, 9};
  std::vector<troll::sparse_index> ni(rows * k), nc(rows), oi(rows * k), oc(rows);
  std::vector<T> nv(rows * k), nr(rows), ov(rows * k), orr(rows);
  const troll::sparse_batch_view<T> new_rows{ni.data(), nv.data(), nc.data(), nr.data(), rows, k, V};
  const troll::sparse_batch_view<T> old_rows{oi.data(), ov.data(), oc.data(), orr.data(), rows, k, V};
  twice("sparsify", [&] { troll::sparsify(policy, new_in, tokens.data(), options, new_rows); }, nv);
  troll::sparsify(policy, old_in, tokens.data(), options, old_rows);
  std::vector<troll::sparse_index> ai(rows * k_max), ac(rows);
  std::vector<T> anv(rows * k_max), aov(rows * k_max), anr(rows), aor(rows);
  const troll::aligned_batch_view<T> aligned{ai.data(), ac.data(), anv.data(), aov.data(), anr.data(), aor.data(),
                                             rows,      k_max,     V};
  troll::align(policy, troll::sparse_input<T>(new_rows), troll::sparse_input<T>(old_rows), aligned);
  std::vector<troll::sparse_index> pi(rows * k_max), pc(rows);
  std::vector<T> pv(rows * k_max), pr(rows);
  const troll::sparse_batch_view<T> projected{pi.data(), pv.data(), pc.data(), pr.data(), rows, k_max, V};
  std::vector<troll::projection_stats> sparse_stats(rows);
  troll::project(policy, troll::aligned_input<T>(aligned), 0.05, projected, sparse_stats.data());
  std::vector<T> gav(rows * k_max, 0.02), gar(rows, 0.03), gnv(rows * k_max), gnr(rows);
  twice("sparse project_backward", [&] {
    troll::project_backward(policy, troll::aligned_input<T>(aligned), troll::sparse_input<T>(projected),
                            sparse_stats.data(),
                            troll::sparse_grad_input<T>(troll::sparse_grad_view<T>{gav.data(), gar.data(), rows, k_max}),
                            troll::sparse_grad_view<T>{gnv.data(), gnr.data(), rows, k_max});
  }, gnv);

  // The objectives (their scratch: weights, row records, flags).
  const std::vector<T> advantages{1.0, -0.5, 0.25};
  troll::token_batch<T> batch;
  batch.tokens = tokens.data();
  batch.advantages = advantages.data();
  std::vector<T> token_loss(rows), olp(rows * V), ograd(rows * V);
  troll::objective_metrics metrics;
  const troll::trust_region_objective troll_objective;
  twice("trust region forward", [&] {
    troll::objective_forward(policy, troll_objective, new_in, old_in, batch, make_batch(olp.data(), rows, V),
                             stats.data(), token_loss.data(), &metrics);
  }, token_loss);
  twice("trust region backward", [&] {
    troll::objective_backward(policy, troll_objective, new_in, old_in, batch, make_batch<const T>(olp.data(), rows, V),
                              stats.data(), make_batch(ograd.data(), rows, V), 1.0);
  }, ograd);
  const troll::ppo_clip_objective ppo;
  twice("ppo forward", [&] {
    troll::objective_forward(policy, ppo, new_in, old_in, batch, token_loss.data(), &metrics);
  }, token_loss);
  twice("ppo backward", [&] {
    troll::objective_backward(policy, ppo, new_in, old_in, batch, make_batch(ograd.data(), rows, V), 1.0);
  }, ograd);
  troll::sparse_trust_region_objective sparse_objective;
  sparse_objective.new_support = options;
  std::vector<troll::sparse_index> si(rows * k_max), sc(rows), li(rows * k_max), lc(rows);
  std::vector<T> snv(rows * k_max), sov(rows * k_max), snr(rows), sor(rows), lv(rows * k_max), lr(rows);
  const troll::aligned_batch_view<T> s_aligned{si.data(), sc.data(), snv.data(), sov.data(), snr.data(), sor.data(),
                                               rows,      k_max,     V};
  const troll::sparse_batch_view<T> s_log_probs{li.data(), lv.data(), lc.data(), lr.data(), rows, k_max, V};
  twice("sparse trust region forward", [&] {
    troll::objective_forward(policy, sparse_objective, new_in, troll::sparse_input<T>(old_rows), batch, s_aligned,
                             s_log_probs, sparse_stats.data(), token_loss.data(), &metrics);
  }, token_loss);
  twice("sparse trust region backward", [&] {
    troll::objective_backward(policy, sparse_objective, new_in, troll::aligned_input<T>(s_aligned), batch,
                              troll::sparse_input<T>(s_log_probs), sparse_stats.data(), make_batch(ograd.data(), rows, V),
                              1.0);
  }, ograd);
}
