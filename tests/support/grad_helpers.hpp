// grad_helpers.hpp — shared scaffolding of the derivative and bad-input tests: a reproducible
// generator of logit rows, a one-call wrapper of the forward projection, and the packing of a
// batch's *finite* logits (and log ε) into the flat double vector troll's gradient checker sees.
#pragma once

// GCC 12 false positives the release preset (-Werror) would turn into errors, silenced for the
// tests that include this header before troll's: -Wmaybe-uninitialized inside Eigen's packet
// loads of the backward kernels' block arrays (every loaded entry is written first), and, with
// -march=native on AVX-512, -Wuninitialized on the `__Y = __Y` of _mm512_undefined_pd inside
// Eigen's vectorised exp (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <troll/projection.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <functional>
#include <vector>

namespace grad_helpers {

inline constexpr double neg_inf = -std::numeric_limits<double>::infinity();

/// splitmix64 with a Box–Muller normal: the same stream on every platform.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t bits() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(bits() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    return r * std::cos(6.283185307179586 * uniform());
  }
  std::vector<double> normals(std::size_t n, double scale, double offset = 0.0) {
    std::vector<double> v(n);
    for (double& x : v) x = offset + scale * normal();
    return v;
  }

 private:
  std::uint64_t state_;
};

/// A batch of (new, old) logit rows, row-major and packed (stride = V).
struct pair_batch {
  std::size_t rows = 0, cols = 0;
  std::vector<double> new_logits, old_logits;

  pair_batch() = default;
  pair_batch(std::size_t r, std::size_t v) : rows(r), cols(v), new_logits(r * v), old_logits(r * v) {}

  double* new_row(std::size_t r) { return new_logits.data() + r * cols; }
  double* old_row(std::size_t r) { return old_logits.data() + r * cols; }
  const double* new_row(std::size_t r) const { return new_logits.data() + r * cols; }
  const double* old_row(std::size_t r) const { return old_logits.data() + r * cols; }
  void set_row(std::size_t r, const std::vector<double>& zn, const std::vector<double>& zo) {
    for (std::size_t j = 0; j < cols; ++j) new_row(r)[j] = zn[j], old_row(r)[j] = zo[j];
  }
};

/// Forward projection of a whole batch (double); log π* and stats.
struct forward_result {
  std::vector<double> log_probs;
  std::vector<troll::projection_stats> stats;
};

inline troll::projection_options tight_options() {
  troll::projection_options o;
  o.rtol = 1e-14;  // a tighter solve keeps finite differences of the output smooth
  o.atol = 1e-300;
  return o;
}

inline forward_result forward(const double* zn, const double* zo, std::size_t rows, std::size_t cols,
                              double eps, const troll::projection_options& opt = tight_options()) {
  forward_result f;
  f.log_probs.assign(rows * cols, 0.0);
  f.stats.assign(rows, troll::projection_stats{});
  troll::project(troll::cpu.with_threads(1), troll::make_batch(zn, rows, cols),
                 troll::make_batch(zo, rows, cols), eps, troll::make_batch(f.log_probs.data(), rows, cols),
                 f.stats.data(), opt);
  return f;
}

inline forward_result forward(const pair_batch& b, double eps,
                              const troll::projection_options& opt = tight_options()) {
  return forward(b.new_logits.data(), b.old_logits.data(), b.rows, b.cols, eps, opt);
}

/// KL(softmax(a) ‖ softmax(b)) in long double, independent of troll (0·log 0 = 0).
inline double reference_kl(const double* a, const double* b, std::size_t n) {
  long double ma = -INFINITY, mb = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] > ma) ma = a[i];
    if (b[i] > mb) mb = b[i];
  }
  long double sa = 0, sb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sa += std::exp((long double)a[i] - ma);
    sb += std::exp((long double)b[i] - mb);
  }
  const long double la = ma + std::log(sa), lb = mb + std::log(sb);
  long double kl = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] == neg_inf) continue;
    if (b[i] == neg_inf) return INFINITY;
    const long double lpa = a[i] - la;
    kl += std::exp(lpa) * (lpa - (b[i] - lb));
  }
  return double(kl);
}

/// The flat parameter vector of a gradient check over a batch: the finite entries of the new
/// logits, then (optionally) the finite entries of the old logits, then (optionally) log ε.
/// Masked (−inf) entries stay fixed; ε enters through its logarithm so that the checker's
/// relative step never pushes a tiny ε below zero (∂/∂log ε = ε · ∂/∂ε).
class packing {
 public:
  packing(const pair_batch& base, bool with_old, bool with_eps, double eps)
      : base_(base), with_old_(with_old), with_eps_(with_eps), eps_(eps) {
    for (std::size_t k = 0; k < base.new_logits.size(); ++k)
      if (base.new_logits[k] != neg_inf) new_index_.push_back(k);
    if (with_old)
      for (std::size_t k = 0; k < base.old_logits.size(); ++k)
        if (base.old_logits[k] != neg_inf) old_index_.push_back(k);
  }

  std::size_t size() const { return new_index_.size() + old_index_.size() + (with_eps_ ? 1 : 0); }
  std::size_t outputs() const { return base_.rows * base_.cols; }

  std::vector<double> x0() const {
    std::vector<double> x;
    x.reserve(size());
    for (std::size_t k : new_index_) x.push_back(base_.new_logits[k]);
    for (std::size_t k : old_index_) x.push_back(base_.old_logits[k]);
    if (with_eps_) x.push_back(std::log(eps_));
    return x;
  }

  /// The batch and ε at the flat point x.
  void unpack(const double* x, pair_batch& b, double& eps) const {
    b = base_;
    std::size_t at = 0;
    for (std::size_t k : new_index_) b.new_logits[k] = x[at++];
    for (std::size_t k : old_index_) b.old_logits[k] = x[at++];
    eps = with_eps_ ? std::exp(x[at]) : eps_;
  }

  /// Packs full-size gradients (new, old, per-row ε) into a flat gradient w.r.t. x.
  void pack_gradient(const std::vector<double>& grad_new, const std::vector<double>& grad_old,
                     const std::vector<double>& grad_eps, double eps, double* gx) const {
    std::size_t at = 0;
    for (std::size_t k : new_index_) gx[at++] = grad_new[k];
    for (std::size_t k : old_index_) gx[at++] = grad_old[k];
    if (with_eps_) {
      double total = 0;
      for (double g : grad_eps) total += g;
      gx[at] = eps * total;
    }
  }

  /// Spreads a flat tangent dx into full-size tangents (0 at masked entries) and d(ε).
  void spread_tangent(const double* dx, double eps, std::vector<double>& tn, std::vector<double>& to,
                      double& teps) const {
    tn.assign(base_.new_logits.size(), 0.0);
    to.assign(base_.old_logits.size(), 0.0);
    std::size_t at = 0;
    for (std::size_t k : new_index_) tn[k] = dx[at++];
    for (std::size_t k : old_index_) to[k] = dx[at++];
    teps = with_eps_ ? eps * dx[at] : 0.0;
  }

  bool with_old() const { return with_old_; }
  bool with_eps() const { return with_eps_; }
  const pair_batch& base() const { return base_; }

 private:
  pair_batch base_;
  bool with_old_, with_eps_;
  double eps_;
  std::vector<std::size_t> new_index_, old_index_;
};

/// The projection as a gradient-checker function f(x, y): y = log π* of the whole batch.
struct projection_function {
  const packing* pack;
  void operator()(const double* x, double* y) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    for (std::size_t k = 0; k < f.log_probs.size(); ++k) y[k] = f.log_probs[k];
  }
};

/// The VJP through troll::project_backward as a gradient-checker callable vjp(x, gy, gx).
struct projection_vjp {
  const packing* pack;
  void operator()(const double* x, const double* gy, double* gx) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    const std::size_t rows = b.rows, cols = b.cols;
    std::vector<double> g(gy, gy + rows * cols), grad_new(rows * cols), grad_old(rows * cols),
        grad_eps(rows);
    troll::batch_view<double> old_view{};
    if (pack->with_old()) old_view = troll::make_batch(grad_old.data(), rows, cols);
    troll::project_backward(troll::cpu, troll::make_batch(b.new_logits.data(), rows, cols),
                            troll::make_batch(b.old_logits.data(), rows, cols),
                            troll::make_batch(f.log_probs.data(), rows, cols), f.stats.data(),
                            troll::make_batch(g.data(), rows, cols),
                            troll::make_batch(grad_new.data(), rows, cols), old_view,
                            pack->with_eps() ? grad_eps.data() : nullptr);
    pack->pack_gradient(grad_new, grad_old, grad_eps, eps, gx);
  }
};

/// The JVP through troll::project_jvp as a gradient-checker callable jvp(x, dx, dy).
struct projection_jvp {
  const packing* pack;
  void operator()(const double* x, const double* dx, double* dy) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    const std::size_t rows = b.rows, cols = b.cols;
    std::vector<double> tn, to, out(rows * cols);
    double teps = 0;
    pack->spread_tangent(dx, eps, tn, to, teps);
    troll::batch_view<const double> old_tangent{};
    if (pack->with_old()) old_tangent = troll::make_batch(to.data(), rows, cols);
    troll::project_jvp(troll::cpu, troll::make_batch(b.new_logits.data(), rows, cols),
                       troll::make_batch(b.old_logits.data(), rows, cols),
                       troll::make_batch(f.log_probs.data(), rows, cols), f.stats.data(),
                       troll::make_batch(tn.data(), rows, cols), old_tangent, teps,
                       troll::make_batch(out.data(), rows, cols));
    for (std::size_t k = 0; k < out.size(); ++k) dy[k] = out[k];
  }
};

/// project_jacobian's three outputs for a batch and its forward: jn, jo (rows · V · V), je (rows · V).
using jacobian_source = std::function<void(const pair_batch&, const forward_result&, std::vector<double>& jn,
                                           std::vector<double>& jo, std::vector<double>& je)>;

/// The full Jacobian through troll::project_jacobian, as a checker callable jac(x, J) over x.
/// `source` computes the Jacobians (empty: troll::project_jacobian under troll::cpu).
struct projection_full_jacobian {
  const packing* pack;
  std::vector<std::size_t> new_index, old_index;  // filled by the constructor helper below
  jacobian_source source;

  void operator()(const double* x, double* J) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    const std::size_t rows = b.rows, cols = b.cols, block = cols * cols;
    std::vector<double> jn(rows * block), jo(rows * block), je(rows * cols);
    if (source) {
      source(b, f, jn, jo, je);
    } else {
      troll::project_jacobian(troll::cpu, troll::make_batch(b.new_logits.data(), rows, cols),
                              troll::make_batch(b.old_logits.data(), rows, cols),
                              troll::make_batch(f.log_probs.data(), rows, cols), f.stats.data(), jn.data(),
                              jo.data(), je.data());
    }
    const std::size_t n = pack->size();
    for (std::size_t k = 0; k < rows * cols * n; ++k) J[k] = 0.0;
    for (std::size_t i = 0; i < rows * cols; ++i) {
      const std::size_t r = i / cols, ii = i % cols;
      std::size_t at = 0;
      for (std::size_t k : new_index) {
        J[i * n + at++] = (k / cols == r) ? jn[r * block + ii * cols + k % cols] : 0.0;
      }
      for (std::size_t k : old_index) {
        J[i * n + at++] = (k / cols == r) ? jo[r * block + ii * cols + k % cols] : 0.0;
      }
      if (pack->with_eps()) J[i * n + at] = eps * je[r * cols + ii];
    }
  }
};

inline projection_full_jacobian make_full_jacobian(const packing& p) {
  projection_full_jacobian j{&p, {}, {}, {}};
  const pair_batch& b = p.base();
  for (std::size_t k = 0; k < b.new_logits.size(); ++k)
    if (b.new_logits[k] != neg_inf) j.new_index.push_back(k);
  if (p.with_old())
    for (std::size_t k = 0; k < b.old_logits.size(); ++k)
      if (b.old_logits[k] != neg_inf) j.old_index.push_back(k);
  return j;
}

}  // namespace grad_helpers
