// examples/quickstart.cpp — project a batch of LLM-like next-token distributions onto the
// KL trust region around the old policy, then run the backward pass a trainer would call.
//
// Rows mimic a language model head: Zipf-shaped logits over a Qwen-sized vocabulary; the "new"
// policy is the old one after a gradient step of varying size, so some rows already respect the
// bound (inactive) and others are projected onto it.
#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const std::size_t rows = 16, vocab = 151936;
  const double eps = 0.05;  // TROLL's default bound on KL(π ‖ π_old) per token

  std::mt19937_64 rng(2025);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<float> old_logits(rows * vocab), new_logits(rows * vocab);
  for (std::size_t r = 0; r < rows; ++r) {
    const double step = 0.05 * double(r);  // size of the policy update for this row
    for (std::size_t v = 0; v < vocab; ++v) {
      // Zipf-like: logit ≈ −1.1·log(rank) plus token-level noise.
      const double base = -1.1 * std::log(1.0 + double((v * 7919) % vocab)) + 0.5 * noise(rng);
      old_logits[r * vocab + v] = float(base);
      new_logits[r * vocab + v] = float(base + step * noise(rng) * (v < 64 ? 8.0 : 1.0));
    }
  }

  std::vector<float> log_probs(rows * vocab);
  std::vector<troll::projection_stats> stats(rows);
  troll::project(troll::cpu, troll::make_batch(new_logits.data(), rows, vocab),
                 troll::make_batch(old_logits.data(), rows, vocab), eps,
                 troll::make_batch(log_probs.data(), rows, vocab), stats.data());

  std::printf("troll %d.%d.%d quickstart: %zu rows x V = %zu, eps = %g\n", troll::version.major,
              troll::version.minor, troll::version.patch, rows, vocab, eps);
  std::printf("%4s  %-10s  %12s  %12s  %10s  %10s  %5s\n", "row", "status", "KL before", "KL after",
              "eta", "t", "iters");
  int projected = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const auto& s = stats[r];
    const char* status = troll::status_name(s.status);
    projected += s.status == troll::row_status::projected;
    std::printf("%4zu  %-10s  %12.6g  %12.6g  %10.4g  %10.6f  %5d\n", r, status, s.kl_before,
                s.kl_after, s.eta, s.t, s.iterations);
  }

  // Backward: a toy loss L = Σ_rows log π*(token 0), i.e. upstream g = e_0 per row.
  std::vector<float> upstream(rows * vocab, 0.0f), grad_new(rows * vocab);
  for (std::size_t r = 0; r < rows; ++r) upstream[r * vocab] = 1.0f;
  troll::project_backward(troll::cpu, troll::make_batch(new_logits.data(), rows, vocab),
                          troll::make_batch(old_logits.data(), rows, vocab),
                          troll::make_batch(log_probs.data(), rows, vocab), stats.data(),
                          troll::make_batch(upstream.data(), rows, vocab),
                          troll::make_batch(grad_new.data(), rows, vocab));
  double max_abs = 0.0;
  for (float g : grad_new) max_abs = std::max(max_abs, double(std::fabs(g)));
  std::printf("%d of %zu rows projected; every KL after <= eps; backward max |dL/dz| = %.4g\n",
              projected, rows, max_abs);

  for (const auto& s : stats)
    if (s.kl_after > eps * (1 + 1e-6)) return 1;
  return 0;
}
