// tests/consumer/every_entry_point.hpp — a trainer's step written once, as a function template over
// the execution policy, calling every entry point that both backends run. It is instantiated for
// troll::cpu (and run) by tests/test_one_api.cpp and the consumer project, and for troll::cuda
// (compiled; run where a GPU is present) by tests/cuda/test_cuda_one_api.cu. Only the memory helper
// `space<Policy>` knows where the bytes live.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include <troll/gaussian.hpp>
#include <troll/projection.hpp>
#include <troll/workspace.hpp>

namespace consumer {

/// Where a policy's arrays live. The CPU's: std::vector. tests/cuda/test_cuda_one_api.cu adds the
/// CUDA one (cudaMalloc, upload, download).
template <class Policy>
struct space;

template <>
struct space<troll::cpu_policy> {
  template <class E>
  class array {
   public:
    explicit array(std::size_t n) : host_(n == 0 ? 1 : n) {}
    explicit array(const std::vector<E>& host) : host_(host) {}
    E* get() { return host_.data(); }
    std::size_t bytes() const { return host_.size() * sizeof(E); }
    std::vector<E> download() const { return host_; }

   private:
    std::vector<E> host_;
  };
  static void sync(const troll::cpu_policy&) {}
};

/// What the step hands back to the host, for the caller to check.
struct step_results {
  std::vector<double> log_softmax, kl, project, project_stats_kl, grad_new, jvp, jacobian;
  std::vector<double> sparse_log_probs, sparse_kl, sparse_grad, sparse_shard_grad;
  std::vector<double> whole_rows, shard_rows;  ///< sparsify's and the two-shard finalize's values, then remainders
  std::vector<int> sparse_counts;
  std::vector<double> gaussian_mean, gaussian_chol, gaussian_split_mean, gaussian_split_chol;
  std::vector<double> gaussian_diag_mean, gaussian_diag_std, gaussian_split_diag_mean, gaussian_split_diag_std;
  std::vector<double> gaussian_kl_after;  ///< kl_after of every row of the four projections, in call order
  std::vector<double> gaussian_kl, gaussian_kl_diag;                 ///< kl / kl_diag of the new vs old rows
  std::vector<double> gaussian_kl_mutable_views;  ///< kl then kl_diag again, from views of non-const elements
  std::vector<double> gaussian_diag_grad_mean, gaussian_diag_grad_eps;  ///< project_joint_diag_backward
  std::vector<double> gaussian_split_diag_jvp_std;                   ///< project_split_diag_jvp
  std::vector<double> gaussian_full_derivatives;  ///< the full rows' backward / JVP and the other diagonal ones
  double troll_loss = 0.0, ppo_loss = 0.0, dppo_loss = 0.0, sparse_troll_loss = 0.0;
};

/// rows × cols logits with one −inf-free, deterministic pattern per seed, in T.
template <class T>
std::vector<T> logits(std::size_t rows, std::size_t cols, double seed) {
  std::vector<T> z(rows * cols);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<T>(std::sin(seed * double(i + 1)) * 2.0);
  return z;
}

/// Literal values in T (written as doubles; rounded once, explicitly).
template <class T>
std::vector<T> values(std::initializer_list<double> list) {
  std::vector<T> v;
  for (double x : list) v.push_back(static_cast<T>(x));
  return v;
}

/// n copies of x in T.
template <class T>
std::vector<T> filled(std::size_t n, double x) {
  return std::vector<T>(n, static_cast<T>(x));
}

template <class E>
std::vector<double> as_double(const std::vector<E>& v) {
  return std::vector<double>(v.begin(), v.end());
}

/// One training step's worth of calls: every entry point, the same argument lists on every policy,
/// in the element type T (double or float; the statistics and bound gradients are double in both).
template <class Policy, class T = double>
step_results run_every_entry_point(Policy policy) {
  using S = space<Policy>;
  constexpr std::size_t rows = 2, V = 8, k_max = V;
  const double eps = 0.05;
  step_results out;

  // ---- Dense rows ----
  typename S::template array<T> z_new(logits<T>(rows, V, 0.7)), z_old(logits<T>(rows, V, 1.3));
  const auto new_in = troll::make_batch<const T>(z_new.get(), rows, V);
  const auto old_in = troll::make_batch<const T>(z_old.get(), rows, V);
  typename S::template array<T> lsm(rows * V), kl_out(rows), log_probs(rows * V);
  typename S::template array<troll::projection_stats> stats(rows);
  troll::log_softmax(policy, new_in, troll::make_batch(lsm.get(), rows, V));
  troll::kl(policy, new_in, old_in, kl_out.get());
  typename S::template array<T> grad_kl(filled<T>(rows, 1.0)), grad_p(rows * V), grad_q(rows * V);
  troll::kl_backward(policy, new_in, old_in, grad_kl.get(), troll::make_batch(grad_p.get(), rows, V),
                     troll::make_batch(grad_q.get(), rows, V));
  troll::project(policy, new_in, old_in, eps, troll::make_batch(log_probs.get(), rows, V), stats.get(),
                 troll::projection_options{});
  const auto lp_in = troll::make_batch<const T>(log_probs.get(), rows, V);

  std::vector<T> upstream_host(rows * V);
  for (std::size_t i = 0; i < upstream_host.size(); ++i) upstream_host[i] = static_cast<T>(0.1 * double(i % 5) - 0.2);
  typename S::template array<T> upstream(upstream_host), grad_new(rows * V), grad_old(rows * V), grad_eps(rows);
  const auto upstream_in = troll::make_batch<const T>(upstream.get(), rows, V);
  {
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::project_backward{}, rows, V);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    troll::project_backward(policy.with_workspace(scratch.get(), bytes), new_in, old_in, lp_in, stats.get(),
                            upstream_in, troll::make_batch(grad_new.get(), rows, V),
                            troll::make_batch(grad_old.get(), rows, V), grad_eps.get());
    // The optional outputs spelled as their defaults are: an empty grad_old, a literal nullptr.
    troll::project_backward(policy.with_workspace(scratch.get(), bytes), new_in, old_in, lp_in, stats.get(),
                            upstream_in, troll::make_batch(grad_new.get(), rows, V), {}, nullptr);
  }
  typename S::template array<T> tangent_out(rows * V);
  troll::project_jvp(policy, new_in, old_in, lp_in, stats.get(), upstream_in, upstream_in, 0.5,
                     troll::make_batch(tangent_out.get(), rows, V));
  typename S::template array<T> jac_new(rows * V * V), jac_old(rows * V * V), jac_eps(rows * V);
  {
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::project_jacobian{}, rows, V);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    troll::project_jacobian(policy.with_workspace(scratch.get(), bytes), new_in, old_in, lp_in, stats.get(),
                            jac_new.get(), jac_old.get(), jac_eps.get());
    troll::project_jacobian(policy.with_workspace(scratch.get(), bytes), new_in, old_in, lp_in, stats.get(),
                            jac_new.get(), nullptr, nullptr);
  }
  // The objectives' size query is a constant expression under both policies.
  static_assert(troll::workspace_bytes(Policy{}, troll::op::objective_forward{}, troll::ppo_clip_objective{}, 2, 8) > 0,
                "the objectives take scratch under both policies");
  static_assert(troll::workspace_bytes(Policy{}, troll::op::objective_backward{}, troll::trust_region_objective{}, 2,
                                       8) > 0,
                "the objectives take scratch under both policies");

  // ---- Objectives on dense rows ----
  typename S::template array<troll::token_id> tokens(std::vector<troll::token_id>{2, 5});
  typename S::template array<T> advantages(values<T>({1.0, -0.5})), token_loss(rows);
  typename S::template array<troll::objective_metrics> metrics(1);
  troll::token_batch<T> batch;
  batch.tokens = tokens.get();
  batch.advantages = advantages.get();
  typename S::template array<T> grad_objective(rows * V);
  const auto grad_objective_view = troll::make_batch(grad_objective.get(), rows, V);
  {
    const troll::trust_region_objective objective;
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::objective_forward{}, objective, rows, V);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    const Policy p = policy.with_workspace(scratch.get(), bytes);
    troll::objective_forward(p, objective, new_in, old_in, batch, troll::make_batch(log_probs.get(), rows, V),
                             stats.get(), token_loss.get(), metrics.get());
    S::sync(p);
    out.troll_loss = metrics.download()[0].loss;
    troll::objective_backward(p, objective, new_in, old_in, batch, lp_in, stats.get(), grad_objective_view, 1.0);
  }
  {
    const troll::ppo_clip_objective objective;
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::objective_forward{}, objective, rows, V);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    const Policy p = policy.with_workspace(scratch.get(), bytes);
    troll::objective_forward(p, objective, new_in, old_in, batch, token_loss.get(), metrics.get());
    S::sync(p);
    out.ppo_loss = metrics.download()[0].loss;
    troll::objective_backward(p, objective, new_in, old_in, batch, grad_objective_view, 1.0);
  }
  {
    const troll::dppo_objective objective;
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::objective_backward{}, objective, rows, V);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    const Policy p = policy.with_workspace(scratch.get(), bytes);
    troll::objective_forward(p, objective, new_in, old_in, batch, token_loss.get(), metrics.get());
    S::sync(p);
    out.dppo_loss = metrics.download()[0].loss;
    troll::objective_backward(p, objective, new_in, old_in, batch, grad_objective_view, 1.0);
  }

  // ---- Sparse rows ----
  troll::sparsify_options options;
  options.k = 3;
  options.delta = 1e-6;
  const std::size_t sparse_k = std::size_t(options.k) + 1;
  struct sparse_arrays {
    typename S::template array<troll::sparse_index> indices, counts;
    typename S::template array<T> values, remainder;
    std::size_t k;
    sparse_arrays(std::size_t r, std::size_t k_) : indices(r * k_), counts(r), values(r * k_), remainder(r), k(k_) {}
    troll::sparse_batch_view<T> view(std::size_t r, std::size_t vocab) {
      return troll::sparse_batch_view<T>{indices.get(), values.get(), counts.get(), remainder.get(), r, k, vocab};
    }
  };
  sparse_arrays new_rows(rows, sparse_k), old_rows(rows, sparse_k), finalized(rows, sparse_k);
  troll::sparsify(policy, new_in, tokens.get(), options, new_rows.view(rows, V));
  troll::sparsify(policy, old_in, tokens.get(), options, old_rows.view(rows, V));

  typename S::template array<troll::sparsify_state> states(rows), other(rows);
  const std::size_t half = V / 2;
  troll::sparsify_shard(policy, troll::make_batch<const T>(z_new.get(), rows, half, V), 0, V, tokens.get(), options,
                        states.get());
  troll::sparsify_shard(policy, troll::make_batch<const T>(z_new.get() + half, rows, V - half, V), half, V,
                        tokens.get(), options, other.get());
  troll::sparsify_merge(policy, states.get(), other.get(), rows);
  // Two stages: the support and tail_max, each shard's exact tail sum, then the canonical values.
  typename S::template array<double> log_sums(troll::sparsify_log_sums_width * rows), tail_max(rows), tail_sums(4 * rows);
  static_assert(troll::workspace_bytes(Policy{}, troll::op::sparsify_tail_sums{}, rows, V) == 0,
                "sparsify_tail_sums needs no workspace");
  troll::sparsify_finalize(policy, states.get(), options, finalized.view(rows, V), log_sums.get(), tail_max.get());
  const troll::sparse_input<T> support(finalized.view(rows, V));
  troll::sparsify_tail_sums<T>(policy, troll::make_batch<const T>(z_new.get(), rows, half, V), 0, support,
                               tail_max.get(), tail_sums.get());
  // The second shard in the deduced form: views of non-const elements, no <T> (both policies).
  troll::sparsify_tail_sums(policy, troll::make_batch(z_new.get() + half, rows, V - half, V), half,
                            finalized.view(rows, V), tail_max.get(), tail_sums.get() + 2 * rows);
  troll::sparsify_finalize(policy, states.get(), options, finalized.view(rows, V), log_sums.get(), tail_max.get(),
                           tail_sums.get(), 2);

  typename S::template array<T> g_values(filled<T>(rows * sparse_k, 0.05)), g_remainder(filled<T>(rows, 0.01)), grad_logits(rows * V);
  const troll::sparse_grad_view<T> g{g_values.get(), g_remainder.get(), rows, sparse_k};
  troll::sparsify_backward(policy, new_in, troll::sparse_input<T>(new_rows.view(rows, V)), troll::sparse_grad_input<T>(g),
                           troll::make_batch(grad_logits.get(), rows, V));
  typename S::template array<T> grad_shard(rows * half);
  troll::sparsify_shard_backward(policy, troll::make_batch<const T>(z_new.get(), rows, half, V), 0,
                                 troll::sparse_input<T>(finalized.view(rows, V)), troll::sparse_grad_input<T>(g),
                                 log_sums.get(), troll::make_batch(grad_shard.get(), rows, half));

  struct aligned_arrays {
    typename S::template array<troll::sparse_index> indices, counts;
    typename S::template array<T> new_values, old_values, new_remainder, old_remainder;
    std::size_t k;
    aligned_arrays(std::size_t r, std::size_t k_)
        : indices(r * k_), counts(r), new_values(r * k_), old_values(r * k_), new_remainder(r), old_remainder(r), k(k_) {}
    troll::aligned_batch_view<T> view(std::size_t r, std::size_t vocab) {
      return troll::aligned_batch_view<T>{indices.get(),       counts.get(),        new_values.get(), old_values.get(),
                                          new_remainder.get(), old_remainder.get(), r,                k,
                                          vocab};
    }
  };
  aligned_arrays aligned(rows, k_max), aligned_dense(rows, k_max);
  troll::align(policy, troll::sparse_input<T>(new_rows.view(rows, V)), troll::sparse_input<T>(old_rows.view(rows, V)),
               aligned.view(rows, V));
  troll::align(policy, new_in, troll::sparse_input<T>(new_rows.view(rows, V)),
               troll::sparse_input<T>(old_rows.view(rows, V)), aligned_dense.view(rows, V));
  const troll::aligned_input<T> aligned_in = aligned.view(rows, V);

  typename S::template array<T> ga_values(filled<T>(rows * k_max, 0.02)), ga_remainder(filled<T>(rows, 0.03));
  typename S::template array<T> gr_values(rows * sparse_k), gr_remainder(rows);
  troll::align_backward(policy, troll::sparse_input<T>(new_rows.view(rows, V)), aligned_in,
                        troll::sparse_grad_input<T>(troll::sparse_grad_view<T>{ga_values.get(), ga_remainder.get(), rows, k_max}),
                        troll::sparse_grad_view<T>{gr_values.get(), gr_remainder.get(), rows, sparse_k});

  typename S::template array<T> sparse_kl(rows);
  troll::kl(policy, aligned_in, sparse_kl.get());
  sparse_arrays projected(rows, k_max);
  typename S::template array<troll::projection_stats> sparse_stats(rows);
  troll::project(policy, aligned_in, eps, projected.view(rows, V), sparse_stats.get(), troll::projection_options{});
  typename S::template array<T> gn_values(rows * k_max), gn_remainder(rows), go_values(rows * k_max),
      go_remainder(rows), sparse_grad_eps(rows);
  const std::size_t sparse_bytes = troll::workspace_bytes(policy, troll::op::project_backward{}, rows, V, k_max);
  typename S::template array<double> sparse_scratch(sparse_bytes / sizeof(double) + 1);
  troll::project_backward(policy.with_workspace(sparse_scratch.get(), sparse_bytes), aligned_in,
                          troll::sparse_input<T>(projected.view(rows, V)), sparse_stats.get(),
                          troll::sparse_grad_input<T>(troll::sparse_grad_view<T>{ga_values.get(), ga_remainder.get(), rows, k_max}),
                          troll::sparse_grad_view<T>{gn_values.get(), gn_remainder.get(), rows, k_max},
                          troll::sparse_grad_view<T>{go_values.get(), go_remainder.get(), rows, k_max},
                          sparse_grad_eps.get());
  troll::project_backward(policy.with_workspace(sparse_scratch.get(), sparse_bytes), aligned_in,
                          troll::sparse_input<T>(projected.view(rows, V)), sparse_stats.get(),
                          troll::sparse_grad_input<T>(troll::sparse_grad_view<T>{ga_values.get(), ga_remainder.get(), rows, k_max}),
                          troll::sparse_grad_view<T>{gn_values.get(), gn_remainder.get(), rows, k_max}, {}, nullptr);

  // ---- The sparse objective ----
  {
    troll::sparse_trust_region_objective objective;
    objective.new_support = options;
    const std::size_t bytes =
        troll::workspace_bytes(policy, troll::op::objective_forward{}, objective, rows, V, k_max);
    typename S::template array<double> scratch(bytes / sizeof(double) + 1);
    const Policy p = policy.with_workspace(scratch.get(), bytes);
    aligned_arrays objective_aligned(rows, k_max);
    sparse_arrays objective_log_probs(rows, k_max);
    troll::objective_forward(p, objective, new_in, troll::sparse_input<T>(old_rows.view(rows, V)), batch,
                             objective_aligned.view(rows, V), objective_log_probs.view(rows, V), sparse_stats.get(),
                             token_loss.get(), metrics.get());
    S::sync(p);
    out.sparse_troll_loss = metrics.download()[0].loss;
    troll::objective_backward(p, objective, new_in, troll::aligned_input<T>(objective_aligned.view(rows, V)), batch,
                              troll::sparse_input<T>(objective_log_probs.view(rows, V)), sparse_stats.get(),
                              grad_objective_view, 1.0);
  }

  // ---- Gaussian rows (d = 2): Cholesky factors and standard deviations ----
  {
    constexpr std::size_t d = 2;
    typename S::template array<T> mu(values<T>({0.4, -0.3, -0.2, 0.5})), mu_old(values<T>({0.0, 0.1, 0.1, 0.0}));
    typename S::template array<T> chol(values<T>({1.5, 0.0, 0.3, 0.6, 0.7, 0.0, -0.2, 1.4}));
    typename S::template array<T> chol_old(values<T>({1.0, 0.0, 0.1, 0.9, 1.1, 0.0, 0.0, 1.0}));
    typename S::template array<T> sd(values<T>({1.6, 0.5, 0.7, 1.3})), sd_old(values<T>({1.0, 0.9, 1.1, 1.0}));
    const auto mu_in = troll::make_batch<const T>(mu.get(), rows, d);
    const auto mu_old_in = troll::make_batch<const T>(mu_old.get(), rows, d);
    const auto chol_in = troll::make_batch<const T>(chol.get(), rows, d * d);
    const auto chol_old_in = troll::make_batch<const T>(chol_old.get(), rows, d * d);
    const auto sd_in = troll::make_batch<const T>(sd.get(), rows, d);
    const auto sd_old_in = troll::make_batch<const T>(sd_old.get(), rows, d);
    typename S::template array<T> m1(rows * d), c1(rows * d * d), m2(rows * d), c2(rows * d * d);
    typename S::template array<T> m3(rows * d), s3(rows * d), m4(rows * d), s4(rows * d);
    typename S::template array<troll::gaussian::gaussian_stats> g_stats(4 * rows);
    static_assert(troll::workspace_bytes(Policy{}, troll::op::gaussian_project_joint{}, rows, d) == 0,
                  "the Gaussian projections need no scratch");
    typename S::template array<double> saved(rows * troll::gaussian::saved_factorisation<double>::saved_doubles(d));
    const troll::gaussian::saved_factorisation<double> saved_rows{saved.get(), rows, d};
    troll::gaussian::project_joint(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.05,
                                   troll::make_batch(m1.get(), rows, d), troll::make_batch(c1.get(), rows, d * d),
                                   g_stats.get(), troll::projection_options{}, saved_rows);
    troll::gaussian::project_split(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.02, 0.05,
                                   troll::make_batch(m2.get(), rows, d), troll::make_batch(c2.get(), rows, d * d),
                                   g_stats.get() + rows, troll::projection_options{});
    troll::gaussian::project_joint_diag(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.05,
                                        troll::make_batch(m3.get(), rows, d), troll::make_batch(s3.get(), rows, d),
                                        g_stats.get() + 2 * rows, troll::projection_options{});
    troll::gaussian::project_split_diag(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.02, 0.05,
                                        troll::make_batch(m4.get(), rows, d), troll::make_batch(s4.get(), rows, d),
                                        g_stats.get() + 3 * rows, troll::projection_options{});
    // KL, and the derivatives of the diagonal projections (upstream: the outputs themselves).
    typename S::template array<double> kl_full(rows), kl_diag(rows), g_eps(rows);
    typename S::template array<T> g_mean(rows * d), t_std(rows * d), t_mean(rows * d);
    troll::gaussian::kl(policy, mu_in, chol_in, mu_old_in, chol_old_in, kl_full.get());
    troll::gaussian::kl_diag(policy, mu_in, sd_in, mu_old_in, sd_old_in, kl_diag.get());
    // Views of non-const elements, as make_batch gives them (T named by nothing else: the
    // deducing overloads), into a second array that must agree bit for bit.
    typename S::template array<double> kl_mutable(2 * rows);
    troll::gaussian::kl(policy, troll::make_batch(mu.get(), rows, d), troll::make_batch(chol.get(), rows, d * d),
                        troll::make_batch(mu_old.get(), rows, d), chol_old_in, kl_mutable.get());
    troll::gaussian::kl_diag(policy, troll::make_batch(mu.get(), rows, d), troll::make_batch(sd.get(), rows, d),
                             mu_old_in, troll::make_batch(sd_old.get(), rows, d), kl_mutable.get() + rows);
    const auto m3_in = troll::make_batch<const T>(m3.get(), rows, d);
    const auto s3_in = troll::make_batch<const T>(s3.get(), rows, d);
    const auto m4_in = troll::make_batch<const T>(m4.get(), rows, d);
    const auto s4_in = troll::make_batch<const T>(s4.get(), rows, d);
    const troll::gaussian::gaussian_grads<T> diag_grads{troll::make_batch(g_mean.get(), rows, d), {}, {}, {},
                                                        g_eps.get(), nullptr};
    troll::gaussian::project_joint_diag_backward(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.05, m3_in, s3_in,
                                                 g_stats.get() + 2 * rows, m3_in, s3_in, diag_grads);
    const troll::gaussian::gaussian_tangents<T> diag_tangents{mu_in, sd_in, {}, {}, 0.01, 0.0};
    troll::gaussian::project_split_diag_jvp(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.02, 0.05, m4_in, s4_in,
                                            g_stats.get() + 3 * rows, diag_tangents,
                                            troll::make_batch(t_mean.get(), rows, d),
                                            troll::make_batch(t_std.get(), rows, d));
    // The full rows' derivatives (the joint ones reading the forward's saved factorisation) and
    // the other two diagonal ones; upstream and tangents are the inputs themselves.
    const auto m1_in = troll::make_batch<const T>(m1.get(), rows, d);
    const auto c1_in = troll::make_batch<const T>(c1.get(), rows, d * d);
    const auto m2_in = troll::make_batch<const T>(m2.get(), rows, d);
    const auto c2_in = troll::make_batch<const T>(c2.get(), rows, d * d);
    typename S::template array<T> f_mean(rows * d), f_chol(rows * d * d), f_tangent_mean(rows * d);
    typename S::template array<T> f_tangent_chol(rows * d * d), f_tangent_std(rows * d), f_grad_std(rows * d);
    typename S::template array<double> f_eps(rows), f_eps_mean(rows);
    const troll::gaussian::gaussian_grads<T> full_grads{troll::make_batch(f_mean.get(), rows, d),
                                                        troll::make_batch(f_chol.get(), rows, d * d), {}, {},
                                                        f_eps.get(), f_eps_mean.get()};
    const troll::gaussian::gaussian_tangents<T> full_tangents{mu_in, chol_in, {}, {}, 0.01, 0.005};
    const auto f_tangent_mean_out = troll::make_batch(f_tangent_mean.get(), rows, d);
    troll::gaussian::project_joint_backward(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.05, m1_in, c1_in,
                                            g_stats.get(), m1_in, c1_in, full_grads, saved_rows);
    troll::gaussian::project_split_backward(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.02, 0.05, m2_in, c2_in,
                                            g_stats.get() + rows, m2_in, c2_in, full_grads);
    troll::gaussian::project_joint_jvp(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.05, m1_in, c1_in,
                                       g_stats.get(), full_tangents, f_tangent_mean_out,
                                       troll::make_batch(f_tangent_chol.get(), rows, d * d), saved_rows);
    troll::gaussian::project_split_jvp(policy, mu_in, chol_in, mu_old_in, chol_old_in, 0.02, 0.05, m2_in, c2_in,
                                       g_stats.get() + rows, full_tangents, f_tangent_mean_out,
                                       troll::make_batch(f_tangent_chol.get(), rows, d * d));
    const troll::gaussian::gaussian_grads<T> std_grads{f_tangent_mean_out, troll::make_batch(f_grad_std.get(), rows, d),
                                                       {}, {}, f_eps.get(), f_eps_mean.get()};
    troll::gaussian::project_split_diag_backward(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.02, 0.05, m4_in,
                                                 s4_in, g_stats.get() + 3 * rows, m4_in, s4_in, std_grads);
    troll::gaussian::project_joint_diag_jvp(policy, mu_in, sd_in, mu_old_in, sd_old_in, 0.05, m3_in, s3_in,
                                            g_stats.get() + 2 * rows, diag_tangents, f_tangent_mean_out,
                                            troll::make_batch(f_tangent_std.get(), rows, d));
    S::sync(policy);
    out.gaussian_kl = kl_full.download();
    out.gaussian_kl_diag = kl_diag.download();
    out.gaussian_kl_mutable_views = kl_mutable.download();
    out.gaussian_diag_grad_mean = as_double(g_mean.download());
    out.gaussian_diag_grad_eps = g_eps.download();
    out.gaussian_split_diag_jvp_std = as_double(t_std.download());
    out.gaussian_full_derivatives = as_double(f_chol.download());
    for (const T v : f_tangent_chol.download()) out.gaussian_full_derivatives.push_back(double(v));
    for (const T v : f_grad_std.download()) out.gaussian_full_derivatives.push_back(double(v));
    for (const T v : f_tangent_std.download()) out.gaussian_full_derivatives.push_back(double(v));
    out.gaussian_mean = as_double(m1.download());
    out.gaussian_chol = as_double(c1.download());
    out.gaussian_split_mean = as_double(m2.download());
    out.gaussian_split_chol = as_double(c2.download());
    out.gaussian_diag_mean = as_double(m3.download());
    out.gaussian_diag_std = as_double(s3.download());
    out.gaussian_split_diag_mean = as_double(m4.download());
    out.gaussian_split_diag_std = as_double(s4.download());
    for (const troll::gaussian::gaussian_stats& s : g_stats.download()) out.gaussian_kl_after.push_back(s.kl_after);
  }

  S::sync(policy);
  out.log_softmax = as_double(lsm.download());
  out.kl = as_double(kl_out.download());
  out.project = as_double(log_probs.download());
  for (const troll::projection_stats& s : stats.download()) out.project_stats_kl.push_back(s.kl_after);
  out.grad_new = as_double(grad_new.download());
  out.jvp = as_double(tangent_out.download());
  out.jacobian = as_double(jac_new.download());
  out.sparse_log_probs = as_double(projected.values.download());
  out.whole_rows = as_double(new_rows.values.download());
  out.shard_rows = as_double(finalized.values.download());
  for (const T r : new_rows.remainder.download()) out.whole_rows.push_back(double(r));
  for (const T r : finalized.remainder.download()) out.shard_rows.push_back(double(r));
  for (troll::sparse_index c : projected.counts.download()) out.sparse_counts.push_back(int(c));
  out.sparse_kl = as_double(sparse_kl.download());
  out.sparse_grad = as_double(grad_logits.download());
  out.sparse_shard_grad = as_double(grad_shard.download());
  return out;
}

}  // namespace consumer
