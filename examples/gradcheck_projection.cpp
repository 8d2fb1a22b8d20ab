// examples/gradcheck_projection.cpp — validate the gradient of your own loss through the TROLL
// projection with troll's finite-difference checker.
//
// The loss is a TROLL-style surrogate on a small batch: the importance ratio of the projected
// policy at the sampled token times an advantage, plus an entropy bonus of the projected policy,
//     L(z̃) = −Σ_r A_r · π*_r(a_r) / q_r(a_r)  −  β Σ_r H(π*_r),
// differentiated by hand down to ∂L/∂log π* and then through troll::project_backward.
#include <troll/projection.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr std::size_t rows = 4, vocab = 40;
constexpr double eps = 0.05, beta = 0.01;

struct problem {
  std::vector<double> old_logits = std::vector<double>(rows * vocab);
  std::vector<double> old_log_probs = std::vector<double>(rows * vocab);
  std::vector<std::size_t> action = std::vector<std::size_t>(rows);
  std::vector<double> advantage = std::vector<double>(rows);
};

/// Forward: the projected log-probabilities and stats for new logits x, and the loss.
double loss_and_projection(const problem& pb, const double* x, std::vector<double>& log_probs,
                           std::vector<troll::projection_stats>& stats) {
  troll::project(troll::cpu, troll::make_batch(x, rows, vocab),
                 troll::make_batch(pb.old_logits.data(), rows, vocab), eps,
                 troll::make_batch(log_probs.data(), rows, vocab), stats.data());
  double loss = 0.0;
  for (std::size_t r = 0; r < rows; ++r) {
    const double* lp = &log_probs[r * vocab];
    const std::size_t a = pb.action[r];
    loss -= pb.advantage[r] * std::exp(lp[a] - pb.old_log_probs[r * vocab + a]);
    double entropy = 0.0;
    for (std::size_t v = 0; v < vocab; ++v) entropy -= std::exp(lp[v]) * lp[v];
    loss -= beta * entropy;
  }
  return loss;
}

}  // namespace

int main() {
  problem pb;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(rows * vocab);
  for (std::size_t i = 0; i < rows * vocab; ++i) {
    pb.old_logits[i] = 2.0 * normal(rng);
    x[i] = pb.old_logits[i] + 1.5 * normal(rng);  // a large step: every row is projected
  }
  troll::log_softmax(troll::cpu, troll::make_batch(pb.old_logits.data(), rows, vocab),
                     troll::make_batch(pb.old_log_probs.data(), rows, vocab));
  for (std::size_t r = 0; r < rows; ++r) {
    pb.action[r] = (r * 11) % vocab;
    pb.advantage[r] = r % 2 ? 1.0 : -0.5;
  }

  std::vector<double> log_probs(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);

  auto loss = [&](const double* at) { return loss_and_projection(pb, at, log_probs, stats); };
  auto gradient = [&](const double* at, double* grad) {
    loss_and_projection(pb, at, log_probs, stats);
    // ∂L/∂log π*_i for each row, by hand.
    std::vector<double> upstream(rows * vocab);
    for (std::size_t r = 0; r < rows; ++r) {
      const double* lp = &log_probs[r * vocab];
      for (std::size_t v = 0; v < vocab; ++v)
        upstream[r * vocab + v] = beta * std::exp(lp[v]) * (lp[v] + 1.0);  // −β ∂H/∂log π
      const std::size_t a = pb.action[r];
      upstream[r * vocab + a] -= pb.advantage[r] * std::exp(lp[a] - pb.old_log_probs[r * vocab + a]);
    }
    troll::project_backward(troll::cpu, troll::make_batch(at, rows, vocab),
                            troll::make_batch(pb.old_logits.data(), rows, vocab),
                            troll::make_batch(log_probs.data(), rows, vocab), stats.data(),
                            troll::make_batch(upstream.data(), rows, vocab),
                            troll::make_batch(grad, rows, vocab));
  };

  const troll::gradcheck_result result = troll::check_gradient(loss, gradient, x);
  std::printf("%s\n", result.report().c_str());
  int projected = 0;
  for (const auto& s : stats) projected += s.status == troll::row_status::projected;
  std::printf("%d of %zu rows projected at eps = %g\n", projected, rows, eps);
  return result.ok ? 0 : 1;
}
