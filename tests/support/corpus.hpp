// tests/support/corpus.hpp — a fixed-seed corpus of hard (new, old) logit row pairs for the
// forward tests: V from 2 to 262,144, logits up to ±1e4, near-deterministic rows, Zipf-like LLM
// rows, p̃ = q, tiny differences, masked tokens on either side. Header-only, no test framework.
//
// The generator is self-contained (splitmix64 + Box–Muller), so the corpus is the same on every
// platform and standard library. Rows are grouped in blocks of equal V, ready to be packed into
// one troll batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace troll_test {

/// Deterministic pseudo-random numbers: splitmix64, uniform doubles in [0, 1), Box–Muller normals.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [0, n).
  std::size_t index(std::size_t n) { return static_cast<std::size_t>(next() % n); }
  /// Standard normal.
  double normal() {
    const double two_pi = 6.283185307179586476925286766559;
    const double u = 1.0 - uniform();  // (0, 1]
    return std::sqrt(-2.0 * std::log(u)) * std::cos(two_pi * uniform());
  }

 private:
  std::uint64_t state_;
};

/// The families of rows in the corpus (see make_row for what each variant holds).
enum class row_kind {
  gaussian,            ///< N(0, s²) logits, old = new + τ·noise
  zipf,                ///< LLM-like: logit ≈ −a·log(rank), new promotes one token
  near_deterministic,  ///< max prob 1 − 1e-15; old sharp on the same or another token, or soft
  huge_logits,         ///< logits up to ±1e4, or all near 1e4
  equal,               ///< p̃ = q: identical logits or shifted by a constant
  tiny_difference,     ///< old = new + δ·noise, δ from 1e-12 to 3e-4
  masked_old,          ///< −inf old logits where new is finite (restricted / projected)
  masked_new,          ///< −inf new logits where old is finite (feasible or infeasible per ε)
  masked_both,         ///< tokens masked on both sides, plus one-sided masks
};
constexpr int row_kind_count = 9;

inline const char* name(row_kind kind) {
  switch (kind) {
    case row_kind::gaussian: return "gaussian";
    case row_kind::zipf: return "zipf";
    case row_kind::near_deterministic: return "near_deterministic";
    case row_kind::huge_logits: return "huge_logits";
    case row_kind::equal: return "equal";
    case row_kind::tiny_difference: return "tiny_difference";
    case row_kind::masked_old: return "masked_old";
    case row_kind::masked_new: return "masked_new";
    case row_kind::masked_both: return "masked_both";
  }
  return "?";
}

/// One (new, old) logit row pair: new = z̃ (the unprojected policy), old = z° (the reference).
struct row_pair {
  row_kind kind = row_kind::gaussian;
  int variant = 0;
  std::vector<double> new_logits;
  std::vector<double> old_logits;

  std::size_t size() const { return new_logits.size(); }
  std::string label() const {
    return std::string(name(kind)) + "/" + std::to_string(variant) + " V=" + std::to_string(size());
  }
};

/// Rows of one vocabulary size.
struct corpus_block {
  std::size_t cols = 0;
  std::vector<row_pair> rows;
};

/// The bounds ε every forward test sweeps.
inline const std::vector<double>& eps_grid() {
  static const std::vector<double> grid = {1e-8, 1e-6, 1e-4, 1e-2, 0.05, 0.2, 1.0, 10.0};
  return grid;
}

enum class corpus_size { full, quick };

/// quick when built with a sanitizer (TROLL_TEST_SANITIZED, or ASan detected by the compiler) or
/// when the environment sets TROLL_TEST_QUICK to a non-empty value other than "0"; full otherwise.
inline corpus_size default_corpus_size() {
#if defined(TROLL_TEST_SANITIZED) || defined(__SANITIZE_ADDRESS__)
  return corpus_size::quick;
#else
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
  return corpus_size::quick;
#endif
#endif
  const char* quick = std::getenv("TROLL_TEST_QUICK");
  return quick != nullptr && *quick != '\0' && std::string(quick) != "0" ? corpus_size::quick
                                                                         : corpus_size::full;
#endif
}

namespace corpus_detail {

inline std::vector<double> normal_row(rng& g, std::size_t n, double scale) {
  std::vector<double> z(n);
  for (double& value : z) value = scale * g.normal();
  return z;
}

inline void add_noise(rng& g, std::vector<double>& z, double scale) {
  for (double& value : z) value += scale * g.normal();
}

/// Indices 0..n−1 in random order (Fisher–Yates).
inline std::vector<std::size_t> permutation(rng& g, std::size_t n) {
  std::vector<std::size_t> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = i;
  for (std::size_t i = n; i > 1; --i) std::swap(p[i - 1], p[g.index(i)]);
  return p;
}

/// The `count` indices with the smallest values of z (ties: lower index first), count ≤ n.
inline std::vector<std::size_t> smallest(const std::vector<double>& z, std::size_t count) {
  std::vector<std::size_t> order(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(count), order.end(),
                    [&](std::size_t a, std::size_t b) { return z[a] < z[b] || (z[a] == z[b] && a < b); });
  order.resize(count);
  return order;
}

/// Number of tokens to mask: a `fraction` of n, at least 1, at most n − 1 (one token stays).
inline std::size_t mask_count(std::size_t n, double fraction) {
  std::size_t k = static_cast<std::size_t>(fraction * static_cast<double>(n));
  if (k < 1) k = 1;
  if (k > n - 1) k = n - 1;
  return k;
}

}  // namespace corpus_detail

/// One row pair of `kind`, size n ≥ 2, variant v (each kind cycles through its variants with v),
/// drawn from a generator seeded by (kind, n, v) so that rows do not depend on corpus order.
inline row_pair make_row(row_kind kind, std::size_t n, int v) {
  using namespace corpus_detail;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  rng g(0x7201100000000000ull ^ (std::uint64_t(kind) << 48) ^ (std::uint64_t(n) << 16) ^
        std::uint64_t(v));
  row_pair r;
  r.kind = kind;
  r.variant = v;
  const double ln_rest = std::log(static_cast<double>(n - 1));
  switch (kind) {
    case row_kind::gaussian: {
      const double scale[] = {0.5, 2.0, 5.0};
      const double tau[] = {0.02, 0.3, 1.5};
      r.new_logits = normal_row(g, n, scale[v % 3]);
      r.old_logits = r.new_logits;
      add_noise(g, r.old_logits, tau[(v / 3 + v) % 3]);
      break;
    }
    case row_kind::zipf: {
      const double slope = 1.0 + 0.1 * (v % 5);
      const double tau[] = {0.05, 0.2, 0.5};
      const double boost[] = {1.0, 3.0, 6.0};
      const std::vector<std::size_t> rank = permutation(g, n);
      r.old_logits.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        r.old_logits[i] = -slope * std::log(1.0 + static_cast<double>(rank[i])) + 0.2 * g.normal();
      }
      r.new_logits = r.old_logits;
      add_noise(g, r.new_logits, tau[v % 3]);
      r.new_logits[g.index(n)] += boost[(v / 3 + v) % 3];  // the sampled, reinforced token
      break;
    }
    case row_kind::near_deterministic: {
      // Top token at 0, the n − 1 others near −(log(n−1) + 34.54): their total mass ≈ 1e-15.
      const std::size_t top = g.index(n);
      r.new_logits.assign(n, 0.0);
      for (std::size_t i = 0; i < n; ++i) {
        if (i != top) r.new_logits[i] = -(ln_rest + 34.54) + 0.1 * g.normal();
      }
      r.old_logits.assign(n, 0.0);
      if (v % 3 == 2) {
        r.old_logits = normal_row(g, n, 1.0);
      } else {
        // v % 3 == 0: sharp on the same token (other mass ≈ 1e-9); 1: sharp on another token.
        const std::size_t old_top = v % 3 == 0 ? top : (top + 1) % n;
        for (std::size_t i = 0; i < n; ++i) {
          if (i != old_top) r.old_logits[i] = -(ln_rest + (v % 3 == 0 ? 20.72 : 34.54)) + 0.1 * g.normal();
        }
      }
      break;
    }
    case row_kind::huge_logits: {
      r.new_logits.resize(n);
      r.old_logits.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        if (v % 3 == 0) {
          r.new_logits[i] = g.uniform(-1e4, 1e4);
          r.old_logits[i] = g.uniform(-1e4, 1e4);
        } else if (v % 3 == 1) {
          r.new_logits[i] = g.uniform(-1e4, 1e4);
          r.old_logits[i] = r.new_logits[i] + g.uniform(-3.0, 3.0);
        } else {
          r.new_logits[i] = 1e4 - g.uniform(0.0, 20.0);
          r.old_logits[i] = r.new_logits[i] + 0.5 * g.normal();
        }
      }
      break;
    }
    case row_kind::equal: {
      r.new_logits = normal_row(g, n, 2.0);
      r.old_logits = r.new_logits;
      if (v % 2 == 1) {
        for (double& z : r.old_logits) z += 123.25;
      }
      break;
    }
    case row_kind::tiny_difference: {
      const double delta[] = {1e-12, 1e-7, 3e-4};
      r.new_logits = normal_row(g, n, 2.0);
      r.old_logits = r.new_logits;
      add_noise(g, r.old_logits, delta[v % 3]);
      break;
    }
    case row_kind::masked_old: {
      // v even: old close to new (restricted for larger ε); odd: far. v % 4 ≥ 2: the masked
      // tokens carry much new mass, else little.
      r.new_logits = normal_row(g, n, 2.0);
      r.old_logits = r.new_logits;
      add_noise(g, r.old_logits, v % 2 == 0 ? 0.01 : 0.5);
      const std::vector<std::size_t> order = permutation(g, n);
      const std::size_t k = mask_count(n, v % 3 == 0 ? 0.0 : 0.05);
      for (std::size_t j = 0; j < k; ++j) {
        r.old_logits[order[j]] = minus_inf;
        r.new_logits[order[j]] += v % 4 >= 2 ? 3.0 : -10.0;
      }
      break;
    }
    case row_kind::masked_new: {
      // v even: mask the lowest old tokens (little old mass); odd: random tokens.
      r.old_logits = normal_row(g, n, 2.0);
      r.new_logits = r.old_logits;
      add_noise(g, r.new_logits, v % 3 == 0 ? 0.01 : 0.4);
      const std::size_t k = mask_count(n, 0.02);
      const std::vector<std::size_t> masked =
          v % 2 == 0 ? smallest(r.old_logits, k) : permutation(g, n);
      for (std::size_t j = 0; j < k; ++j) r.new_logits[masked[j]] = minus_inf;
      break;
    }
    case row_kind::masked_both: {
      r.new_logits = normal_row(g, n, 1.5);
      r.old_logits = r.new_logits;
      add_noise(g, r.old_logits, 0.3);
      const std::vector<std::size_t> order = permutation(g, n);
      const std::size_t k = n >= 3 ? mask_count(n - 1, 0.1) : 0;
      for (std::size_t j = 0; j < k; ++j) {
        r.new_logits[order[j]] = minus_inf;
        r.old_logits[order[j]] = minus_inf;
      }
      // One extra one-sided mask on a token of little old mass (needs a third token).
      if (n >= k + 3) {
        const std::size_t extra = order[k];
        r.old_logits[extra] = v % 3 == 1 ? minus_inf : r.old_logits[extra] - 8.0;
        if (v % 3 == 2) r.new_logits[extra] = minus_inf;
      }
      break;
    }
  }
  return r;
}

/// The corpus: blocks of equal V. full: V ∈ {2, 3, 5, 17, 100, 1000, 4096, 32768, 262144}, every
/// kind at every V up to 32768 (several variants at small V), three rows at V = 262144.
/// quick (sanitizers): V ≤ 4096 with fewer variants, one row at 32768 and one at 262144.
inline std::vector<corpus_block> make_corpus(corpus_size size = default_corpus_size()) {
  struct plan {
    std::size_t cols;
    int variants;  // per kind; 0: only the kinds listed in `large_kinds`
  };
  const bool quick = size == corpus_size::quick;
  const std::vector<plan> plans =
      quick ? std::vector<plan>{{2, 3}, {3, 3}, {5, 2}, {17, 2}, {100, 2}, {1000, 1}, {4096, 1},
                                {32768, 0}, {262144, 0}}
            : std::vector<plan>{{2, 6}, {3, 6}, {5, 6}, {17, 6}, {100, 6}, {1000, 3}, {4096, 2},
                                {32768, 1}, {262144, 0}};
  std::vector<corpus_block> corpus;
  for (const plan& p : plans) {
    corpus_block block;
    block.cols = p.cols;
    if (p.variants > 0) {
      for (int k = 0; k < row_kind_count; ++k) {
        for (int v = 0; v < p.variants; ++v) {
          block.rows.push_back(make_row(static_cast<row_kind>(k), p.cols, v));
        }
      }
    } else if (quick) {
      block.rows.push_back(make_row(p.cols > 100000 ? row_kind::zipf : row_kind::gaussian, p.cols, 1));
    } else {
      block.rows.push_back(make_row(row_kind::zipf, p.cols, 1));
      block.rows.push_back(make_row(row_kind::gaussian, p.cols, 4));
      block.rows.push_back(make_row(row_kind::near_deterministic, p.cols, 0));
    }
    corpus.push_back(std::move(block));
  }
  return corpus;
}

/// Packs selected rows (new side or old side) into a row-major buffer of element type T with
/// row stride `stride` ≥ V; the padding between rows is filled with `pad`.
template <class T>
std::vector<T> pack(const std::vector<const row_pair*>& rows, bool new_side, std::size_t stride,
                    T pad = T(0)) {
  const std::size_t cols = rows.empty() ? 0 : rows.front()->size();
  std::vector<T> out(rows.size() * stride, pad);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::vector<double>& src = new_side ? rows[r]->new_logits : rows[r]->old_logits;
    for (std::size_t i = 0; i < cols; ++i) out[r * stride + i] = static_cast<T>(src[i]);
  }
  return out;
}

}  // namespace troll_test
