// tests/bodies/sparse_objective_gradients.hpp — the sparse TROLL objective's gradient (dense new
// logits against sparse old rows) against troll's finite-difference checker (double): the loss
// composed from troll's public sparse pieces (sparsify → align → project) with lumped log p̃ in
// long double and the regression term against a frozen π*, both aggregations, each term alone,
// U = S_old only, masked (−inf) new tokens with sampled tokens outside the old top-K, and LLM-like
// rows in random directions.
//
// One body compiled per backend (as bodies/backward_gradient.hpp): tests/test_sparse_objectives.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_sparse_objectives.cu with backend<cuda_policy> inside its "device" suite.
// What the checker differentiates is always the CPU (loss_frozen); the gradient under test (the
// fused objective_forward then objective_backward) runs on the backend, inputs uploaded, scratch
// sized by troll::workspace_bytes for the backend's policy.
//
// Include after doctest, <troll/gradcheck.hpp>, "backend.hpp", "sparse_objective_cases.hpp" and
// the definition of troll_test::oracle_backend.

namespace {

namespace soc = troll_test::sparse_objective_cases;
using sparse_objective_backend = troll_test::oracle_backend;
template <class E>
using sparse_objective_buffer = typename sparse_objective_backend::template buffer<E>;

/// The checker's tolerances for a gradient computed in T: its defaults (atol 1e-6, rtol 1e-4,
/// step 1e-6) in double, far above the difference's own error and docs/cuda.md's
/// device-vs-CPU bound for the objectives (1e-9 + 64u_T); float adds its rounding.
template <class T>
troll::gradcheck_options sparse_objective_fd_options() {
  troll::gradcheck_options o;
  if (std::is_same<T, float>::value) {
    o.atol = 1e-4;
    o.rtol = 1e-3;
  }
  return o;
}

/// What the gradient tests read back from the backend's forward + backward.
struct backend_sparse_run {
  std::vector<double> grad;
  std::vector<troll::projection_stats> stats;
  troll::objective_metrics metrics;
};

/// The sparse objective's forward then backward on the backend at new logits x (rows × V).
backend_sparse_run backend_run_sparse(const soc::sparse_case& c,
                                      const troll::sparse_trust_region_objective& o, const double* x) {
  using buffer_index = sparse_objective_buffer<troll::sparse_index>;
  using buffer_double = sparse_objective_buffer<double>;
  const std::size_t N = c.rows, V = c.vocab, cap = c.old.k_max + std::size_t(o.new_support.k);
  buffer_double z(std::vector<double>(x, x + N * V));
  buffer_index old_indices(c.old.indices), old_counts(c.old.counts);
  buffer_double old_lp(c.old.log_probs), old_rem(c.old.log_remainder);
  sparse_objective_buffer<std::int64_t> tokens(c.tokens), sequence_ids(c.sequence_ids);
  buffer_double advantages(c.advantages), mask(c.mask);
  buffer_index al_indices(N * cap), al_counts(N), lp_indices(N * cap), lp_counts(N);
  buffer_double al_new(N * cap), al_old(N * cap), al_new_rem(N), al_old_rem(N), lp_values(N * cap), lp_rem(N),
      token_loss(N), grad(N * V);
  sparse_objective_buffer<troll::projection_stats> stats(N);
  sparse_objective_buffer<troll::objective_metrics> metrics(1);
  const std::size_t words =
      (troll::workspace_bytes(sparse_objective_backend::policy(), troll::op::objective_forward{}, o, N, V, cap) +
       sizeof(double) - 1) /
      sizeof(double);
  buffer_double scratch(words);
  const auto policy = sparse_objective_backend::policy().with_workspace(scratch.get(), words * sizeof(double));

  troll::token_batch<double> in;
  in.tokens = tokens.get();
  in.advantages = advantages.get();
  in.loss_mask = c.mask.empty() ? nullptr : mask.get();
  in.sequence_ids = c.sequence_ids.empty() ? nullptr : sequence_ids.get();
  in.aggregation = c.aggregation;
  const troll::sparse_batch_view<const double> old{old_indices.get(), old_lp.get(), old_counts.get(), old_rem.get(),
                                                   c.old.rows,        c.old.k_max,  V};
  const troll::aligned_batch_view<double> aligned{al_indices.get(), al_counts.get(),  al_new.get(), al_old.get(),
                                                  al_new_rem.get(), al_old_rem.get(), N,            cap,
                                                  V};
  const troll::sparse_batch_view<double> log_probs{lp_indices.get(), lp_values.get(), lp_counts.get(), lp_rem.get(),
                                                   N,                cap,             V};
  const troll::input_view<double> logits = troll::make_batch<const double>(z.get(), N, V);
  troll::objective_forward(policy, o, logits, old, in, aligned, log_probs, stats.get(), token_loss.get(), metrics.get());
  troll::objective_backward(policy, o, logits, troll::aligned_batch_view<const double>(aligned), in,
                            troll::sparse_batch_view<const double>(log_probs),
                            static_cast<const troll::projection_stats*>(stats.get()), troll::make_batch(grad.get(), N, V));
  return {grad.download(), stats.download(), metrics.download()[0]};
}

/// Gradient check of the sparse objective's backward on the backend against central differences
/// of loss_frozen (the CPU) over every new logit.
troll::gradcheck_result check_sparse_gradient(const soc::sparse_case& c,
                                              const troll::sparse_trust_region_objective& o) {
  std::vector<std::vector<double>> frozen(c.rows);
  for (std::size_t r = 0; r < c.rows; ++r)
    frozen[r] = soc::oracle_forward(c, r, c.new_logits.data() + r * c.vocab, o).log_pi;
  auto loss = [&](const double* x) { return soc::loss_frozen(c, x, o, frozen); };
  auto grad = [&](const double* x, double* gx) {
    const backend_sparse_run run = backend_run_sparse(c, o, x);
    std::copy(run.grad.begin(), run.grad.end(), gx);
  };
  return troll::check_gradient(loss, grad, c.new_logits, sparse_objective_fd_options<double>());
}

}  // namespace

TEST_CASE(
    "sparse TROLL gradient: dense logits -> align with the sparse old row -> project -> "
    "objective") {
  for (auto aggregation :
       {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
    CAPTURE(int(aggregation));
    soc::sparse_case c = soc::make_sparse_case(10, 40, 11);
    c.aggregation = aggregation;
    REQUIRE(soc::min_rank_gap(c, 5) > 1e-3);
    const troll::gradcheck_result full = check_sparse_gradient(c, soc::objective(1.0));
    INFO(full.report());
    CHECK(full.ok);
    // The parts on their own: the ratio term (α = 0) and the regression term (A = 0).
    const troll::gradcheck_result ratio_only = check_sparse_gradient(c, soc::objective(0.0));
    INFO(ratio_only.report());
    CHECK(ratio_only.ok);
    soc::sparse_case regression = c;
    for (double& a : regression.advantages) a = 0.0;
    const troll::gradcheck_result reg_only = check_sparse_gradient(regression, soc::objective(2.5));
    INFO(reg_only.report());
    CHECK(reg_only.ok);
    // Both branches of the projection were exercised.
    const backend_sparse_run run = backend_run_sparse(c, soc::objective(1.0), c.new_logits.data());
    int projected = 0, inactive = 0;
    for (std::size_t r = 0; r < c.rows; ++r) (run.stats[r].active() ? projected : inactive) += 1;
    CHECK(projected > 0);
    CHECK(inactive > 0);
  }
}

TEST_CASE("sparse TROLL gradient with U = S_old only (new_support.k = 0)") {
  const soc::sparse_case c = soc::make_sparse_case(6, 32, 29);
  const troll::gradcheck_result r = check_sparse_gradient(c, soc::objective(1.0, {0, 1e-5}));
  INFO(r.report());
  CHECK(r.ok);
}

TEST_CASE("sparse TROLL gradient on LLM-like rows (random directions, V = 4096, K = 16)") {
  // Zipf-like rows; the new row's own top-16 (δ = 1e-5) joins the old support.
  std::mt19937_64 rng(5);
  soc::sparse_case c;
  c.rows = 4;
  c.vocab = 4096;
  for (std::size_t r = 0; r < c.rows; ++r) {
    const std::vector<double> zo = sparse_test::zipf_logits<double>(c.vocab, 1.1, 0.5, rng);
    std::normal_distribution<double> n01;
    for (std::size_t j = 0; j < c.vocab; ++j) {
      c.old_logits.push_back(zo[j]);
      c.new_logits.push_back(zo[j] + 0.7 * double(r % 2 + 1) * n01(rng));
    }
    c.tokens.push_back(std::int64_t(std::max_element(zo.begin(), zo.end()) - zo.begin()) +
                       (r == 3 ? 1 : 0));
    c.advantages.push_back(r % 2 ? 1.0 : -0.6);
  }
  c.sparsify_old({16, 1e-5});
  const troll::sparse_trust_region_objective o = soc::objective(1.0, {16, 1e-5});
  std::vector<std::vector<double>> frozen(c.rows);
  for (std::size_t r = 0; r < c.rows; ++r)
    frozen[r] = soc::oracle_forward(c, r, c.new_logits.data() + r * c.vocab, o).log_pi;
  auto f = [&](const double* x, double* y) { y[0] = soc::loss_frozen(c, x, o, frozen); };
  auto vjp = [&](const double* x, const double* gy, double* gx) {  // on the backend
    const backend_sparse_run run = backend_run_sparse(c, o, x);
    for (std::size_t k = 0; k < run.grad.size(); ++k) gx[k] = gy[0] * run.grad[k];
  };
  const troll::gradcheck_result r = troll::check_vjp_random(f, vjp, c.new_logits, 1, sparse_objective_fd_options<double>());
  INFO(r.report());
  CHECK(r.ok);
  const backend_sparse_run run = backend_run_sparse(c, o, c.new_logits.data());
  CHECK(run.metrics.projected_fraction > 0.0);
}

TEST_CASE("sparse TROLL with masked new tokens and a sampled token outside the old top-K") {
  // A −inf new logit in the tail takes the checked path (a lumped category may be −inf); it is
  // legal while the old row has tail mass. Rows 0, 3, 6 sample a token sparsify had to add.
  soc::sparse_case c = soc::make_sparse_case(7, 40, 31);
  for (std::size_t r = 0; r < c.rows; ++r) {
    const double* zo = c.old_logits.data() + r * c.vocab;
    std::size_t lowest = 0;
    for (std::size_t j = 1; j < c.vocab; ++j)
      if (zo[j] < zo[lowest] && std::int64_t(j) != c.tokens[r]) lowest = j;
    c.new_logits[r * c.vocab + lowest] = soc::minus_inf;
  }
  const troll::sparse_trust_region_objective o = soc::objective(1.0);
  const backend_sparse_run run = backend_run_sparse(c, o, c.new_logits.data());
  CHECK(std::isfinite(run.metrics.loss));
  for (std::size_t k = 0; k < run.grad.size(); ++k)  // zero up to Eigen's clamped exp(−inf)
    if (c.new_logits[k] == soc::minus_inf) CHECK(std::fabs(run.grad[k]) < 1e-300);
  // Finite differences over the finite logits only (the −inf ones stay −inf).
  std::vector<std::size_t> free;
  for (std::size_t k = 0; k < c.new_logits.size(); ++k)
    if (c.new_logits[k] > soc::minus_inf) free.push_back(k);
  std::vector<double> x0;
  for (std::size_t k : free) x0.push_back(c.new_logits[k]);
  auto expand = [&](const double* x) {
    std::vector<double> full = c.new_logits;
    for (std::size_t i = 0; i < free.size(); ++i) full[free[i]] = x[i];
    return full;
  };
  std::vector<std::vector<double>> frozen(c.rows);
  for (std::size_t r = 0; r < c.rows; ++r)
    frozen[r] = soc::oracle_forward(c, r, c.new_logits.data() + r * c.vocab, o).log_pi;
  auto loss = [&](const double* x) { return soc::loss_frozen(c, expand(x).data(), o, frozen); };
  auto grad = [&](const double* x, double* gx) {
    const std::vector<double> full = expand(x);
    const backend_sparse_run at = backend_run_sparse(c, o, full.data());  // on the backend
    for (std::size_t i = 0; i < free.size(); ++i) gx[i] = at.grad[free[i]];
  };
  const troll::gradcheck_result r = troll::check_gradient(loss, grad, x0, sparse_objective_fd_options<double>());
  INFO(r.report());
  CHECK(r.ok);
}
