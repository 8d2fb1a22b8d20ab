// tests/bodies/adversarial_objectives.hpp — the dense objectives on adversarial batches (V = 1, 2,
// 3, 17; advantages 0, 1, −1e6, 2.5; a half-weighted token): PPO clip's token-mean loss against
// long double; the gradients of PPO clip (unclipped), DPPO (binary TV, nothing masked) and TROLL
// (α = 0) against central differences of the same backend's forward (troll::check_gradient);
// masks all zero give loss 0 and zero gradients. Forward and backward run on the backend, inputs
// uploaded and scratch sized by troll::workspace_bytes for the backend's policy.
//
// One body compiled per backend (as bodies/objective_gradients.hpp):
// tests/test_adversarial_sparse.cpp includes it with troll_test::oracle_backend =
// backend<cpu_policy>, tests/cuda/test_cuda_objectives.cu with backend<cuda_policy> inside its
// "device" suite. Its names live in namespace adversarial_objectives. Include after
// <troll/gradcheck.hpp>, <troll/objectives.hpp>, "backend.hpp", "sparse_oracle.hpp" (log_sum_exp)
// and the definition of troll_test::oracle_backend.

namespace adversarial_objectives {

using backend = troll_test::oracle_backend;
template <class E>
using buffer = typename backend::template buffer<E>;
using ld = long double;

/// Whether this instantiation is the CPU's (its bounds are the ones the CPU suite always asserted).
constexpr bool cpu_instance = std::is_same<backend, troll_test::backend<troll::cpu_policy>>::value;

/// A batch's old logits and token data staged on the backend.
struct staged_tokens {
  std::size_t rows, vocab;
  buffer<double> old, advantages, mask;
  buffer<troll::token_id> tokens;
  staged_tokens(const std::vector<double>& zo, const std::vector<troll::token_id>& tok,
                const std::vector<double>& adv, const std::vector<double>& weights,
                std::size_t vocab_size)
      : rows(tok.size()), vocab(vocab_size), old(zo), advantages(adv), mask(weights), tokens(tok) {}
  troll::token_batch<double> batch() {
    troll::token_batch<double> in;
    in.tokens = tokens.get();
    in.advantages = advantages.get();
    in.loss_mask = mask.get();
    return in;
  }
  troll::input_view<double> old_view() {
    return troll::make_batch<const double>(old.get(), rows, vocab);
  }
};

/// One objective's forward (and backward) on the backend at new logits `zn` (host), with the
/// scratch its workspace query asks for.
template <class Objective>
struct objective_on {
  static constexpr bool is_troll = std::is_same<Objective, troll::trust_region_objective>::value;
  const Objective& objective;
  staged_tokens& s;
  std::size_t bytes;
  buffer<double> fresh, log_probs, scratch;
  buffer<troll::projection_stats> stats;
  objective_on(const Objective& o, staged_tokens& staged, const double* zn)
      : objective(o),
        s(staged),
        bytes(troll::workspace_bytes(backend::policy(), troll::op::objective_forward{}, o,
                                     staged.rows, staged.vocab)),
        fresh(std::vector<double>(zn, zn + staged.rows * staged.vocab)),
        log_probs(staged.rows * staged.vocab),
        scratch(bytes / sizeof(double) + 1),
        stats(staged.rows) {}
  auto policy() { return backend::policy().with_workspace(scratch.get(), bytes); }
  troll::input_view<double> new_view() {
    return troll::make_batch<const double>(fresh.get(), s.rows, s.vocab);
  }
  troll::objective_metrics forward() {
    buffer<troll::objective_metrics> metrics(1);
    if constexpr (is_troll)
      troll::objective_forward(policy(), objective, new_view(), s.old_view(), s.batch(),
                               troll::make_batch(log_probs.get(), s.rows, s.vocab), stats.get(),
                               nullptr, metrics.get());
    else
      troll::objective_forward(policy(), objective, new_view(), s.old_view(), s.batch(), nullptr,
                               metrics.get());
    return metrics.download()[0];
  }
  /// The gradient to gx; its buffer starts at 7 so that an entry left unwritten shows.
  void backward(double* gx) {
    buffer<double> g(std::vector<double>(s.rows * s.vocab, 7.0));
    if constexpr (is_troll) {
      forward();
      troll::objective_backward(policy(), objective, new_view(), s.old_view(), s.batch(),
                                troll::make_batch<const double>(log_probs.get(), s.rows, s.vocab),
                                static_cast<const troll::projection_stats*>(stats.get()),
                                troll::make_batch(g.get(), s.rows, s.vocab));
    } else {
      troll::objective_backward(policy(), objective, new_view(), s.old_view(), s.batch(),
                                troll::make_batch(g.get(), s.rows, s.vocab));
    }
    const std::vector<double> host = g.download();
    std::copy(host.begin(), host.end(), gx);
  }
};

TEST_CASE(
    "objectives: PPO clip / DPPO / TROLL losses against long double; gradients by central "
    "differences; A = 0, huge A, masks all zero") {
  std::mt19937_64 g(51);
  std::normal_distribution<double> n01(0.0, 1.0);
  for (std::size_t vocab : {std::size_t(1), std::size_t(2), std::size_t(3), std::size_t(17)}) {
    const std::size_t rows = 4;
    std::vector<double> zn(rows * vocab), zo(rows * vocab), adv{0.0, 1.0, -1e6, 2.5},
        mask{1, 1, 1, 0.5};
    std::vector<troll::token_id> tok(rows);
    for (std::size_t i = 0; i < rows * vocab; ++i) zo[i] = 2 * n01(g), zn[i] = zo[i] + n01(g);
    for (std::size_t r = 0; r < rows; ++r) tok[r] = troll::token_id(r % vocab);
    staged_tokens staged(zo, tok, adv, mask, vocab);
    // Oracle PPO clip loss (token mean), long double.
    ld num = 0, den = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      std::vector<ld> a(vocab), b(vocab);
      for (std::size_t i = 0; i < vocab; ++i) a[i] = zn[r * vocab + i], b[i] = zo[r * vocab + i];
      const ld la = a[std::size_t(tok[r])] - sparse_test::log_sum_exp(a);
      const ld lb = b[std::size_t(tok[r])] - sparse_test::log_sum_exp(b);
      const ld ratio = std::exp(la - lb), A = adv[r];
      const ld clipped = std::min(std::max(ratio, ld(0.8)), ld(1.2));
      num += mask[r] * -std::min(ratio * A, clipped * A);
      den += mask[r];
    }
    troll::ppo_clip_objective ppo;
    const troll::objective_metrics m =
        objective_on<troll::ppo_clip_objective>(ppo, staged, zn.data()).forward();
    // The CPU's bound; on a device docs/cuda.md's device-vs-CPU bound for the objectives (1e-9).
    const double loss_rtol = cpu_instance ? 1e-12 : 1e-9;
    CHECK(std::fabs(m.loss - double(num / den)) <= loss_rtol * (1 + std::fabs(double(num / den))));
    // Gradients of the whole loss: PPO clip, DPPO (binary TV), TROLL with α = 0 (its regression
    // term differentiates p̃ only; α = 0 makes the loss a function of the logits).
    auto grad_check = [&](auto objective, bool troll_objective) {
      using Objective = decltype(objective);
      auto loss = [&](const double* x) {
        return objective_on<Objective>(objective, staged, x).forward().loss;
      };
      auto grad = [&](const double* x, double* gx) {
        objective_on<Objective>(objective, staged, x).backward(gx);
      };
      troll::gradcheck_options opt;
      opt.atol = 1e-6 * 1e6;  // the loss carries A = −1e6
      opt.rtol = 1e-5;
      const troll::gradcheck_result res = troll::check_gradient(loss, grad, zn, opt);
      INFO("V ", vocab, " troll ", troll_objective, "\n", res.report());
      CHECK(res.ok);
    };
    troll::ppo_clip_objective wide;  // unclipped everywhere: a smooth loss for the differences
    wide.clip_high = 1e6;
    wide.clip_low = 0.999;
    grad_check(wide, false);
    troll::dppo_objective dppo;
    dppo.delta_low = dppo.delta_high = 10;  // no token masked: smooth
    grad_check(dppo, false);
    troll::trust_region_objective tr;
    tr.alpha = 0;
    tr.eps = 0.01;
    grad_check(tr, true);

    // Masks all zero: loss 0, every gradient 0.
    staged_tokens none(zo, tok, adv, std::vector<double>(rows, 0.0), vocab);
    objective_on<troll::ppo_clip_objective> zero(ppo, none, zn.data());
    CHECK(zero.forward().loss == 0.0);
    std::vector<double> gx(rows * vocab, 7.0);
    zero.backward(gx.data());
    for (double x : gx) CHECK(x == 0.0);
  }
}

TEST_CASE("TROLL backward: an entry beyond the sampled token's that overflows is reported for its row") {
  // Row 1 (V = 3, sampled token 2, t* ≈ 0.82, ρ ≈ 1.9e3) has a gradient whose largest entry, at
  // another token, is ~9 times the sampled token's scale c·A·ρ·t. With A chosen so that this
  // scale is max/4 (the forward's loss ρ·A ≈ 0.6·max and the backward's first check fit) the
  // largest entry is about 2·max: the backward's last check must name row 1 (never ±inf written
  // silently).
  const std::size_t vocab = 3;
  const std::vector<double> zn{0.5, -1.0, 2.0, 6.0, 8.0, 1.0}, zo{0.0, 0.0, 1.0, 13.0, 14.0, -2.0};
  const std::vector<troll::token_id> tok{0, 2};
  troll::trust_region_objective tr;
  tr.alpha = 0;
  tr.eps = 0.05;
  // ρ and t* of row 1 alone (A = 1).
  staged_tokens alone(std::vector<double>(zo.begin() + 3, zo.end()), {2}, {1.0}, {1.0}, vocab);
  objective_on<troll::trust_region_objective> probe(tr, alone, zn.data() + 3);
  const double rho = probe.forward().ratio_mean;
  const troll::projection_stats st = probe.stats.download()[0];
  REQUIRE(st.status == troll::row_status::projected);
  REQUIRE(st.t > 0.7);
  REQUIRE(rho > 1.0);
  const double c = 0.5;  // the token mean over two tokens
  const double advantage = std::numeric_limits<double>::max() / 4 / (c * rho * st.t);
  staged_tokens staged(zo, tok, {1.0, advantage}, {1.0, 1.0}, vocab);
  objective_on<troll::trust_region_objective> both(tr, staged, zn.data());
  std::vector<double> gx(2 * vocab);
  try {
    both.backward(gx.data());
    FAIL("no exception: the gradient overflows a double");
  } catch (const troll::domain_error& err) {
    CHECK(err.row() == 1);
    const std::string message = err.what();
    CHECK_MESSAGE(message.find("gradient") != std::string::npos, message);
    CHECK_MESSAGE(message.find("overflows") != std::string::npos, message);
  }
}

}  // namespace adversarial_objectives
