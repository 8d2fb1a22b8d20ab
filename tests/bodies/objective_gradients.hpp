// tests/bodies/objective_gradients.hpp — the dense objectives' gradients against troll's
// finite-difference gradient checker (double, Richardson-extrapolated): TROLL through the
// projection with stopgrad(π*) in the regression term (both aggregations, each term alone, masked
// tokens), PPO clip and DPPO's four divergences.
//
// One body compiled per backend (as bodies/backward_gradient.hpp): tests/test_objectives.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_objectives.cu with backend<cuda_policy> inside its "device" suite. What the
// checker differentiates is always evaluated on the CPU (TROLL's loss independently of
// objectives.hpp, with π* frozen at the base point; a baseline's loss by its CPU forward); the
// gradient under test (objective_forward, then objective_backward) runs on the backend, its inputs
// uploaded and its scratch sized by troll::workspace_bytes for the backend's policy.
//
// Include after <troll/objectives.hpp>, "backend.hpp", "grad_helpers.hpp", "oracle.hpp",
// "objective_cases.hpp" and the definition of troll_test::oracle_backend.

namespace {

using objective_backend = troll_test::oracle_backend;
template <class E>
using objective_buffer = typename objective_backend::template buffer<E>;

/// The checker's tolerances for an objective gradient computed in T: its defaults (atol 1e-6,
/// rtol 1e-4, step 1e-6) in double, far above the difference's own error (~1e-8) and docs/cuda.md's
/// device-vs-CPU bound for the objectives (1e-9 + 64u_T, atol and rtol); float adds its rounding.
template <class T>
troll::gradcheck_options objective_fd_options() {
  troll::gradcheck_options o;
  if (std::is_same<T, float>::value) {
    o.atol = 1e-4;
    o.rtol = 1e-3;
  }
  return o;
}

/// A token_case's logits and token data staged on the backend, with the scratch `objective`
/// needs there (the larger of forward and backward).
struct staged_objective_case {
  std::size_t rows, cols;
  objective_buffer<double> fresh, old, advantages, mask;
  objective_buffer<std::int64_t> tokens, sequence_ids;
  bool has_mask, has_sequences;
  troll::loss_aggregation aggregation;
  std::size_t bytes;
  objective_buffer<double> scratch;

  template <class Objective>
  staged_objective_case(const troll_test::objective_cases::token_case& c, const grad_helpers::pair_batch& logits,
                        const Objective& objective)
      : rows(logits.rows), cols(logits.cols), fresh(logits.new_logits), old(logits.old_logits),
        advantages(c.advantages), mask(c.mask), tokens(c.tokens), sequence_ids(c.sequence_ids),
        has_mask(!c.mask.empty()), has_sequences(!c.sequence_ids.empty()), aggregation(c.aggregation),
        bytes(troll::workspace_bytes(objective_backend::policy(), troll::op::objective_forward{}, objective, rows, cols)),
        scratch((bytes + sizeof(double) - 1) / sizeof(double)) {}

  auto policy() { return objective_backend::policy().with_workspace(scratch.get(), scratch_bytes()); }
  std::size_t scratch_bytes() const { return (bytes + sizeof(double) - 1) / sizeof(double) * sizeof(double); }
  troll::input_view<double> new_view() { return troll::make_batch<const double>(fresh.get(), rows, cols); }
  troll::input_view<double> old_view() { return troll::make_batch<const double>(old.get(), rows, cols); }
  troll::token_batch<double> batch() {
    troll::token_batch<double> b;
    b.tokens = tokens.get();
    b.advantages = advantages.get();
    b.loss_mask = has_mask ? mask.get() : nullptr;
    b.sequence_ids = has_sequences ? sequence_ids.get() : nullptr;
    b.aggregation = aggregation;
    return b;
  }
};

/// TROLL's batch loss at new logits `b`, evaluated independently of objectives.hpp: π* from
/// troll::project, log p̃ and log q in long double, and the regression term against a *frozen*
/// π* (`frozen_log_pi`, the projection at the base point): stopgrad as finite differences see it.
double troll_loss_frozen(const troll_test::objective_cases::token_case& c, const grad_helpers::pair_batch& b,
                         const troll::trust_region_objective& o, const std::vector<double>& frozen_log_pi) {
  const grad_helpers::forward_result f = grad_helpers::forward(b, o.eps, o.projection);
  const std::vector<double> w = troll_test::objective_cases::weights_of(c);
  const std::size_t V = b.cols;
  long double loss = 0;
  for (std::size_t r = 0; r < b.rows; ++r) {
    if (w[r] == 0.0) continue;
    const auto lq = troll_test::oracle::log_softmax(b.old_logits.data() + r * V, V);
    const auto lp = troll_test::oracle::log_softmax(b.new_logits.data() + r * V, V);
    const std::size_t a = std::size_t(c.tokens[r]);
    const long double ratio = std::exp((long double)f.log_probs[r * V + a] - lq[a]);
    long double kl = 0;
    for (std::size_t j = 0; j < V; ++j)
      if (troll_test::oracle::finite_logit(lp[j])) kl += std::exp(lp[j]) * (lp[j] - frozen_log_pi[r * V + j]);
    loss += w[r] * (-ratio * c.advantages[r] + o.alpha * kl);
  }
  return double(loss);
}

/// Gradient check of TROLL's objective_backward on the backend against central differences of
/// troll_loss_frozen over the finite new logits.
troll::gradcheck_result check_troll_gradient(const troll_test::objective_cases::token_case& c,
                                             const troll::trust_region_objective& o) {
  const grad_helpers::packing pack(c.logits, false, false, o.eps);
  const grad_helpers::forward_result base = grad_helpers::forward(c.logits, o.eps, o.projection);
  auto loss = [&](const double* x) {
    grad_helpers::pair_batch b;
    double eps;
    pack.unpack(x, b, eps);
    return troll_loss_frozen(c, b, o, base.log_probs);
  };
  auto grad = [&](const double* x, double* gx) {
    grad_helpers::pair_batch b;
    double eps;
    pack.unpack(x, b, eps);
    const std::size_t N = b.rows, V = b.cols;
    staged_objective_case s(c, b, o);
    objective_buffer<double> log_probs(N * V), g(N * V);
    objective_buffer<troll::projection_stats> stats(N);
    objective_buffer<troll::objective_metrics> metrics(1);
    troll::objective_forward(s.policy(), o, s.new_view(), s.old_view(), s.batch(), troll::make_batch(log_probs.get(), N, V),
                             stats.get(), nullptr, metrics.get());
    troll::objective_backward(s.policy(), o, s.new_view(), s.old_view(), s.batch(),
                              troll::make_batch<const double>(log_probs.get(), N, V),
                              static_cast<const troll::projection_stats*>(stats.get()), troll::make_batch(g.get(), N, V));
    pack.pack_gradient(g.download(), {}, {}, eps, gx);
  };
  return troll::check_gradient(loss, grad, pack.x0(), objective_fd_options<double>());
}

/// Gradient check of a baseline's objective_backward on the backend against differences of its
/// CPU forward.
template <class Objective>
troll::gradcheck_result check_baseline_gradient(const troll_test::objective_cases::token_case& c, const Objective& o) {
  const grad_helpers::packing pack(c.logits, false, false, 0.05);
  auto loss = [&](const double* x) {
    grad_helpers::pair_batch b;
    double eps;
    pack.unpack(x, b, eps);
    return troll::objective_forward(troll::cpu, o, troll::make_batch(b.new_logits.data(), b.rows, b.cols),
                                    troll::make_batch(b.old_logits.data(), b.rows, b.cols), c.batch())
        .loss;
  };
  auto grad = [&](const double* x, double* gx) {
    grad_helpers::pair_batch b;
    double eps;
    pack.unpack(x, b, eps);
    staged_objective_case s(c, b, o);
    objective_buffer<double> g(b.rows * b.cols);
    troll::objective_backward(s.policy(), o, s.new_view(), s.old_view(), s.batch(), troll::make_batch(g.get(), b.rows, b.cols));
    pack.pack_gradient(g.download(), {}, {}, eps, gx);
  };
  return troll::check_gradient(loss, grad, pack.x0(), objective_fd_options<double>());
}

}  // namespace

TEST_CASE("TROLL gradient through the projection, stopgrad(pi*) in the regression term") {
  using troll_test::objective_cases::make_case;
  using troll_test::objective_cases::tight_troll;
  using troll_test::objective_cases::token_case;
  for (auto aggregation : {troll::loss_aggregation::token_mean, troll::loss_aggregation::sequence_mean}) {
    token_case c = make_case(10, 12, 11);
    c.aggregation = aggregation;
    CAPTURE(int(aggregation));
    const troll::gradcheck_result full = check_troll_gradient(c, tight_troll(1.0));
    INFO(full.report());
    CHECK(full.ok);
    // The two parts separately: the ratio term alone (α = 0) and the regression term alone (A = 0).
    const troll::gradcheck_result ratio_only = check_troll_gradient(c, tight_troll(0.0));
    INFO(ratio_only.report());
    CHECK(ratio_only.ok);
    token_case regression = c;
    for (double& a : regression.advantages) a = 0.0;
    const troll::gradcheck_result reg_only = check_troll_gradient(regression, tight_troll(2.5));
    INFO(reg_only.report());
    CHECK(reg_only.ok);
  }
}

TEST_CASE("TROLL gradient with masked tokens (both rows, and new-row masks inside the ball)") {
  using troll_test::objective_cases::make_case;
  using troll_test::objective_cases::tight_troll;
  using troll_test::objective_cases::token_case;
  const double neg_inf = grad_helpers::neg_inf;
  token_case c = make_case(4, 10, 23);
  c.logits.new_row(0)[2] = c.logits.old_row(0)[2] = neg_inf;  // masked in both
  c.logits.new_row(3)[5] = c.logits.old_row(3)[5] = neg_inf;
  c.tokens[0] = 3;
  for (std::size_t r = 1; r < 3; ++r) {  // the new row masks a small old mass (projected rows)
    c.logits.new_row(r)[7] = neg_inf;
    c.logits.old_row(r)[7] = -6.0;
  }
  c.tokens[1] = 4, c.tokens[2] = 3;
  const troll::gradcheck_result r = check_troll_gradient(c, tight_troll(1.0));
  INFO(r.report());
  CHECK(r.ok);
}

TEST_CASE("PPO clip and DPPO gradients with the finite-difference checker") {
  using troll_test::objective_cases::make_case;
  using troll_test::objective_cases::token_case;
  token_case c = make_case(10, 12, 77);
  troll::ppo_clip_objective ppo;
  ppo.dual_clip = 3.0;
  const troll::gradcheck_result r1 = check_baseline_gradient(c, ppo);
  INFO(r1.report());
  CHECK(r1.ok);
  for (auto d : {troll::dppo_divergence::binary_tv, troll::dppo_divergence::binary_kl,
                 troll::dppo_divergence::topk_tv, troll::dppo_divergence::topk_kl}) {
    CAPTURE(int(d));
    troll::dppo_objective o = troll::dppo_objective::defaults(d);
    o.top_k = 4;
    token_case s = c;
    s.aggregation = troll::loss_aggregation::sequence_mean;
    // Move the sampled tokens clearly (both ways) so some cross the bounds and some do not.
    for (std::size_t r = 0; r < s.rows(); ++r)
      s.logits.new_row(r)[std::size_t(s.tokens[r])] += (r % 2 ? 2.5 : -2.5) * double(r % 3);
    const troll::gradcheck_result r = check_baseline_gradient(s, o);
    INFO(r.report());
    CHECK(r.ok);
    // Some tokens are masked and some are not, so both branches were checked (a property of the
    // case: the CPU forward).
    const auto m = troll::objective_forward(troll::cpu, o, troll::make_batch(s.logits.new_logits.data(), s.rows(), s.cols()),
                                            troll::make_batch(s.logits.old_logits.data(), s.rows(), s.cols()), s.batch());
    CHECK(m.limited_fraction > 0.0);
    CHECK(m.limited_fraction < 1.0);
  }
}
