// examples/toy_rl.cpp — TROLL against PPO clip and DPPO on a small RL problem with a categorical
// policy over a realistic vocabulary, trained from the same seeds and the same prompts.
//
// The task. A prompt x (one of `prompt_count`) asks for an answer of `answer_length` tokens from a
// vocabulary of V tokens; the reward is verifiable: the fraction of positions k whose token equals
// the rule's answer (7x + 31k + 3) mod V. The policy is a "pretrained" language-model head: the
// logits of position k are a learnable table θ[x][k] (initialised Zipf-like, with a likely wrong
// "distractor" token and a less likely right one) plus a fixed low-rank context term that depends
// on the previous token, so that every sampled row is its own distribution.
//
// The RL loop, as in GRPO: each step samples a group of answers per prompt, normalises rewards
// within the group into advantages, then runs several optimisation epochs over the batch (SGD on
// θ through the objective's gradient w.r.t. the logits). Across epochs the new policy drifts from
// the sampling policy; that is where clipping lets the per-token KL exceed its nominal bound and
// TROLL's projection does not.
//
// Output: <dir>/<method>.csv per method (default dir build/toy_rl, or argv[1]) with
//   step, reward, kl_mean, kl_max, raw_kl_mean, raw_kl_max, entropy, constrained_fraction
// where kl_* is KL(π ‖ π_old) per token of the policy each method optimises after the step's
// update (TROLL: the projected π*; the baselines: the network p̃), raw_kl_* is KL(p̃ ‖ π_old) of
// the network itself, entropy is the network's mean per-token entropy, constrained_fraction the
// share of tokens the method constrained (projected / clipped / masked). With gnuplot on the
// PATH it also renders toy_rl_reward.png, toy_rl_kl_max.png, toy_rl_kl_mean.png and
// toy_rl_entropy.png. Exit status 0 iff TROLL's KL never exceeded ε beyond the solver tolerance
// and PPO clip's did.
#include <troll/objectives.hpp>
#include <troll/projection.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

// ---- The problem ----

constexpr std::size_t vocab = 1024;         // V
constexpr std::size_t prompt_count = 32;    // distinct prompts
constexpr std::size_t answer_length = 4;    // tokens per answer
constexpr std::size_t prompts_per_step = 8;
constexpr std::size_t group_size = 16;      // answers per prompt (GRPO group)
constexpr std::size_t context_rank = 8;     // rank of the previous-token context term
constexpr int epochs = 4;                   // optimisation epochs over each batch
constexpr double learning_rate = 20.0;      // SGD on θ (token-mean losses are O(1/N) per row)
constexpr double eps = 0.05;                // TROLL's bound (the paper's default)
constexpr std::uint64_t seed = 2025;
#ifdef NDEBUG
constexpr int steps = 100;
#else
constexpr int steps = 12;  // unoptimised builds: a short smoke run
#endif

constexpr std::size_t rows_per_step = prompts_per_step * group_size * answer_length;

/// splitmix64: the same stream on every platform.
struct rng {
  std::uint64_t state;
  std::uint64_t bits() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(bits() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  }
};

std::size_t answer_token(std::size_t prompt, std::size_t position) {
  return (7 * prompt + 31 * position + 3) % vocab;
}

/// The fixed parts of the policy and its initial table.
struct task {
  std::vector<double> context_in, context_out;  // (V+1)×r and r×V: context(y) = in[y]·out
  std::vector<double> initial_table;            // (prompt_count·answer_length)×V

  task() {
    rng g{seed};
    context_in.resize((vocab + 1) * context_rank);
    context_out.resize(context_rank * vocab);
    for (double& v : context_in) v = g.normal() / std::sqrt(double(context_rank));
    for (double& v : context_out) v = 0.8 * g.normal();
    initial_table.resize(prompt_count * answer_length * vocab);
    for (std::size_t x = 0; x < prompt_count; ++x) {
      for (std::size_t k = 0; k < answer_length; ++k) {
        double* row = &initial_table[(x * answer_length + k) * vocab];
        for (std::size_t v = 0; v < vocab; ++v) {
          const double rank = double((v * 389 + x * 17 + k * 5) % vocab) + 1.0;
          row[v] = -1.1 * std::log(rank) + 0.5 * g.normal();
        }
        row[(answer_token(x, k) + 1 + (x + k) % 50) % vocab] += 4.0;  // a likely wrong answer
        row[answer_token(x, k)] += 3.0 + 0.5 * g.normal();            // the right one, less likely
      }
    }
  }

  /// out[v] = context term of previous token `prev` (vocab = beginning of the answer).
  void context(std::size_t prev, double* out) const {
    std::fill(out, out + vocab, 0.0);
    for (std::size_t r = 0; r < context_rank; ++r) {
      const double a = context_in[prev * context_rank + r];
      const double* w = &context_out[r * vocab];
      for (std::size_t v = 0; v < vocab; ++v) out[v] += a * w[v];
    }
  }
};

/// One step's batch: the sampling policy's logits per row, the rows' fixed context terms, which
/// table row each one reads, the sampled tokens and their advantages.
struct batch {
  std::vector<double> old_logits, context;
  std::vector<std::size_t> table_row;
  std::vector<std::int64_t> tokens;
  std::vector<double> advantages;
  double mean_reward = 0.0;
};

/// Samples `group_size` answers to each of this step's prompts from the policy `table`.
batch rollout(const task& t, const std::vector<double>& table, int step) {
  batch b;
  b.old_logits.resize(rows_per_step * vocab);
  b.context.resize(rows_per_step * vocab);
  b.table_row.resize(rows_per_step);
  b.tokens.resize(rows_per_step);
  b.advantages.resize(rows_per_step);
  rng prompts{seed * 7919 + std::uint64_t(step)};
  rng sampler{seed * 104729 + std::uint64_t(step)};
  std::vector<double> rewards(group_size), probs(vocab);
  std::size_t row = 0;
  for (std::size_t p = 0; p < prompts_per_step; ++p) {
    const std::size_t x = prompts.bits() % prompt_count;
    const std::size_t group_begin = row;
    for (std::size_t s = 0; s < group_size; ++s) {
      std::size_t prev = vocab, correct = 0;
      for (std::size_t k = 0; k < answer_length; ++k, ++row) {
        double* ctx = &b.context[row * vocab];
        double* z = &b.old_logits[row * vocab];
        t.context(prev, ctx);
        b.table_row[row] = x * answer_length + k;
        const double* th = &table[b.table_row[row] * vocab];
        double top = -INFINITY;
        for (std::size_t v = 0; v < vocab; ++v) top = std::max(top, z[v] = th[v] + ctx[v]);
        double total = 0.0;
        for (std::size_t v = 0; v < vocab; ++v) total += probs[v] = std::exp(z[v] - top);
        double u = sampler.uniform() * total;
        std::size_t y = 0;
        while (y + 1 < vocab && (u -= probs[y]) > 0.0) ++y;
        b.tokens[row] = std::int64_t(y);
        correct += y == answer_token(x, k);
        prev = y;
      }
      rewards[s] = double(correct) / double(answer_length);
    }
    double mean = 0.0, var = 0.0;
    for (double r : rewards) mean += r / double(group_size);
    for (double r : rewards) var += (r - mean) * (r - mean) / double(group_size);
    const double scale = var > 0.0 ? 1.0 / std::sqrt(var) : 0.0;
    for (std::size_t s = 0; s < group_size; ++s)
      for (std::size_t k = 0; k < answer_length; ++k)
        b.advantages[group_begin + s * answer_length + k] = (rewards[s] - mean) * scale;
    b.mean_reward += mean / double(prompts_per_step);
  }
  return b;
}

// ---- The methods ----

enum class method { troll, ppo_clip, dppo_tv, dppo_kl };
const char* name_of(method m) {
  switch (m) {
    case method::troll: return "troll";
    case method::ppo_clip: return "ppo_clip";
    case method::dppo_tv: return "dppo_binary_tv";
    default: return "dppo_binary_kl";
  }
}

struct step_record {
  int step;
  double reward, kl_mean, kl_max, raw_kl_mean, raw_kl_max, entropy, constrained;
};

/// Trains one method for `steps` steps and returns its records.
std::vector<step_record> train(const task& t, method m) {
  std::vector<double> table = t.initial_table;
  std::vector<double> new_logits(rows_per_step * vocab), grad(rows_per_step * vocab);
  std::vector<double> log_probs(rows_per_step * vocab), kl(rows_per_step);
  std::vector<troll::projection_stats> stats(rows_per_step);
  const auto view = [](std::vector<double>& v) { return troll::make_batch(v.data(), rows_per_step, vocab); };
  troll::trust_region_objective troll_obj;  // ε = 0.05, α = 1
  troll_obj.eps = eps;
  troll::ppo_clip_objective ppo;  // ε_c = 0.2
  ppo.kl_metrics = false;
  troll::dppo_objective dppo = troll::dppo_objective::defaults(
      m == method::dppo_kl ? troll::dppo_divergence::binary_kl : troll::dppo_divergence::binary_tv);
  dppo.kl_metrics = false;

  std::vector<step_record> records;
  for (int step = 0; step < steps; ++step) {
    batch b = rollout(t, table, step);
    troll::token_batch<double> tokens;
    tokens.tokens = b.tokens.data();
    tokens.advantages = b.advantages.data();
    const auto old_view = troll::make_batch(b.old_logits.data(), rows_per_step, vocab);
    auto refresh = [&] {
      for (std::size_t r = 0; r < rows_per_step; ++r) {
        const double* th = &table[b.table_row[r] * vocab];
        const double* ctx = &b.context[r * vocab];
        double* z = &new_logits[r * vocab];
        for (std::size_t v = 0; v < vocab; ++v) z[v] = th[v] + ctx[v];
      }
    };
    double constrained = 0.0;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      refresh();
      troll::objective_metrics metrics;
      if (m == method::troll) {
        metrics = troll::objective_forward(troll::cpu, troll_obj, view(new_logits), old_view, tokens,
                                           view(log_probs), stats.data());
        troll::objective_backward(troll::cpu, troll_obj, view(new_logits), old_view, tokens,
                                  view(log_probs), stats.data(), view(grad));
        constrained = metrics.projected_fraction;
      } else if (m == method::ppo_clip) {
        metrics = troll::objective_forward(troll::cpu, ppo, view(new_logits), old_view, tokens);
        troll::objective_backward(troll::cpu, ppo, view(new_logits), old_view, tokens, view(grad));
        constrained = metrics.limited_fraction;
      } else {
        metrics = troll::objective_forward(troll::cpu, dppo, view(new_logits), old_view, tokens);
        troll::objective_backward(troll::cpu, dppo, view(new_logits), old_view, tokens, view(grad));
        constrained = metrics.limited_fraction;
      }
      for (std::size_t r = 0; r < rows_per_step; ++r) {
        double* th = &table[b.table_row[r] * vocab];
        const double* g = &grad[r * vocab];
        for (std::size_t v = 0; v < vocab; ++v) th[v] -= learning_rate * g[v];
      }
    }

    // After the update: KL of each method's policy to the sampling policy, per token.
    refresh();
    step_record rec{step, b.mean_reward, 0, 0, 0, 0, 0, constrained};
    troll::kl(troll::cpu, view(new_logits), old_view, kl.data());
    if (m == method::troll)
      troll::project(troll::cpu, view(new_logits), old_view, eps, view(log_probs), stats.data());
    for (std::size_t r = 0; r < rows_per_step; ++r) {
      const double policy_kl = m == method::troll ? stats[r].kl_after : kl[r];
      rec.kl_mean += policy_kl / double(rows_per_step);
      rec.kl_max = std::max(rec.kl_max, policy_kl);
      rec.raw_kl_mean += kl[r] / double(rows_per_step);
      rec.raw_kl_max = std::max(rec.raw_kl_max, kl[r]);
      const double* z = &new_logits[r * vocab];
      const double top = *std::max_element(z, z + vocab);
      double total = 0.0, weighted = 0.0;
      for (std::size_t v = 0; v < vocab; ++v) {
        const double e = std::exp(z[v] - top);
        total += e;
        weighted += e * (z[v] - top);
      }
      rec.entropy += (std::log(total) - weighted / total) / double(rows_per_step);
    }
    records.push_back(rec);
  }
  return records;
}

void write_csv(const std::filesystem::path& file, const std::vector<step_record>& records) {
  std::ofstream out(file);
  out << "step,reward,kl_mean,kl_max,raw_kl_mean,raw_kl_max,entropy,constrained_fraction\n";
  out.precision(10);
  for (const step_record& r : records)
    out << r.step << ',' << r.reward << ',' << r.kl_mean << ',' << r.kl_max << ',' << r.raw_kl_mean
        << ',' << r.raw_kl_max << ',' << r.entropy << ',' << r.constrained << '\n';
}

/// Writes toy_rl.gp into `dir` and runs gnuplot there; returns false when gnuplot is missing.
bool render_plots(const std::filesystem::path& dir, const std::vector<method>& methods) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return false;
  std::ofstream gp(dir / "toy_rl.gp");
  gp << "set datafile separator ','\nset terminal pngcairo size 900,560 noenhanced\n"
        "set key outside right top\nset grid\nset xlabel 'step'\n";
  auto plot = [&](const char* file, const char* title, const char* ylabel, int column, bool log_y,
                  bool with_eps) {
    gp << "set output '" << file << "'\nset title '" << title << "'\nset ylabel '" << ylabel << "'\n"
       << (log_y ? "set logscale y\n" : "unset logscale y\n") << "plot ";
    for (std::size_t i = 0; i < methods.size(); ++i)
      gp << (i ? ", " : "") << "'" << name_of(methods[i]) << ".csv' using 1:" << column
         << " skip 1 with lines lw 2 title '" << name_of(methods[i]) << "'";
    if (with_eps) gp << ", " << eps << " with lines dt 2 lc rgb 'black' title 'eps = " << eps << "'";
    gp << "\n";
  };
  plot("toy_rl_reward.png", "reward (fraction of correct answer tokens)", "mean reward", 2, false, false);
  plot("toy_rl_kl_max.png", "max per-token KL(pi || pi_old) after each update", "max KL", 4, true, true);
  plot("toy_rl_kl_mean.png", "mean per-token KL(pi || pi_old) after each update", "mean KL", 3, true, true);
  plot("toy_rl_entropy.png", "mean per-token entropy of the network policy", "entropy (nats)", 7, false,
       false);
  gp.close();
  const std::string command = "cd '" + dir.string() + "' && gnuplot toy_rl.gp";
  return std::system(command.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : "build/toy_rl";
  std::filesystem::create_directories(dir);
  const auto start = std::chrono::steady_clock::now();
  std::printf("toy RL: V = %zu, %zu prompts x %zu answers x %zu tokens = %zu rows per step, "
              "%d epochs per batch, %d steps, eps = %g\n",
              vocab, prompts_per_step, group_size, answer_length, rows_per_step, epochs, steps, eps);

  const task t;
  const std::vector<method> methods = {method::troll, method::ppo_clip, method::dppo_tv, method::dppo_kl};
  const double tolerance = eps * 1e-10 + 1e-13;  // the projection's documented guarantee
  bool troll_within = true, clip_exceeds = false;
  std::printf("\n%-16s %9s %9s %12s %12s %12s %9s\n", "method", "reward0", "reward", "mean KL",
              "max KL", "steps>eps", "entropy");
  for (method m : methods) {
    const std::vector<step_record> records = train(t, m);
    write_csv(dir / (std::string(name_of(m)) + ".csv"), records);
    double mean_kl = 0.0, max_kl = 0.0, final_reward = 0.0;
    int over = 0;
    for (const step_record& r : records) {
      mean_kl += r.kl_mean / double(records.size());
      max_kl = std::max(max_kl, r.kl_max);
      over += r.kl_max > eps + tolerance;
    }
    const std::size_t tail = std::min<std::size_t>(10, records.size());
    for (std::size_t i = records.size() - tail; i < records.size(); ++i)
      final_reward += records[i].reward / double(tail);
    std::printf("%-16s %9.3f %9.3f %12.4g %12.4g %8d/%-3d %9.3f\n", name_of(m), records.front().reward,
                final_reward, mean_kl, max_kl, over, int(records.size()), records.back().entropy);
    if (m == method::troll) troll_within = over == 0;
    if (m == method::ppo_clip) clip_exceeds = over > 0;
  }
  std::printf("(reward: last %d steps' mean; KL: of the policy each method optimises, TROLL's "
              "projected pi*; see the CSVs for the network's raw KL)\n",
              std::min(10, steps));

  const bool plotted = render_plots(dir, methods);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\nwrote %s/{troll,ppo_clip,dppo_binary_tv,dppo_binary_kl}.csv%s in %.1f s\n",
              dir.string().c_str(),
              plotted ? " and toy_rl_{reward,kl_max,kl_mean,entropy}.png" : " (gnuplot not found: no plots)",
              seconds);
  std::printf("check: TROLL's per-token KL <= eps + %.1e at every step: %s\n", tolerance,
              troll_within ? "yes" : "NO");
  std::printf("check: PPO clip's per-token KL exceeds eps at some step: %s\n", clip_exceeds ? "yes" : "NO");
  return troll_within && clip_exceeds ? 0 : 1;
}
