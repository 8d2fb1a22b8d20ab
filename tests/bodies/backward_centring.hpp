// tests/bodies/backward_centring.hpp — the derivatives of troll::project and TROLL's objective
// backward on rows whose π* is nearly one-hot on large logits (|d| ~ 1e4, minor masses ~1e-13):
// the dominant token's d − μ is then ~π_minor·Δd, far below the rounding of μ (held in absolute
// units in projection_stats), and the VJP / JVP / Jacobian multiply it by Σ g (d − μ)/σ², which is
// large. Every backend re-centres d − μ (detail::centring_sums, troll/detail/tilt_derivatives.hpp);
// without it the double VJP of the first row here is off by 1.6e-3 relative. Reference: math.md §3
// in long double at the forward's t, with d − μ formed as Σ_i π_i (d_j − d_i) (no absolute mean).
// Also rows far from the origin (an old row shifted by up to 3e38), whose derivatives every
// backend forms against a reference token (detail/centring_reference.hpp): softmax invariance makes
// the unshifted row's derivatives, on the same backend, the exact reference.
//
// One body compiled per backend: tests/test_backward_centring.cpp includes it with
// troll_test::oracle_backend = backend<cpu_policy>, tests/cuda/test_cuda_gradients.cu with
// backend<cuda_policy> inside its "device" suite (inputs uploaded, outputs downloaded, scratch sized
// by troll::workspace_bytes for the backend's policy). Its names live in namespace
// backward_centring. Include after <troll/projection.hpp>, <troll/objectives.hpp>, "backend.hpp" and
// the definition of troll_test::oracle_backend.

namespace backward_centring {

using backend = troll_test::oracle_backend;
template <class E>
using buffer = typename backend::template buffer<E>;

struct reference {
  std::vector<long double> pi, centred;
  long double sigma2 = 0;
};

// π_t = softmax(z° + t d) and the centred d, in long double.
template <class T>
reference at_t(const std::vector<T>& zn, const std::vector<T>& zo, double t) {
  const std::size_t n = zn.size();
  reference r;
  std::vector<long double> u(n), d(n);
  long double top = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    d[i] = static_cast<long double>(zn[i]) - static_cast<long double>(zo[i]);
    u[i] = static_cast<long double>(zo[i]) + static_cast<long double>(t) * d[i];
    top = std::max(top, u[i]);
  }
  long double sum = 0;
  r.pi.resize(n);
  for (std::size_t i = 0; i < n; ++i) sum += (r.pi[i] = std::exp(u[i] - top));
  for (auto& p : r.pi) p /= sum;
  r.centred.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    long double c = 0;
    for (std::size_t i = 0; i < n; ++i) c += r.pi[i] * (d[j] - d[i]);
    r.centred[j] = c;
  }
  for (std::size_t i = 0; i < n; ++i) r.sigma2 += r.pi[i] * r.centred[i] * r.centred[i];
  return r;
}

/// One row (1 × n) staged on the backend.
template <class T>
troll::input_view<T> row_view(buffer<T>& b, std::size_t n) {
  return troll::make_batch<const T>(b.get(), 1, n);
}

template <class T>
void check_row(const std::vector<T>& zn_host, const std::vector<T>& zo_host, double eps, double tolerance) {
  const std::size_t n = zn_host.size();
  std::vector<T> g_host(n);
  for (std::size_t i = 0; i < n; ++i) g_host[i] = T(std::cos(0.7 * double(i)) + 0.25);
  buffer<T> zn(zn_host), zo(zo_host), g(g_host), log_probs(n), grad_new(n), grad_new_general(n), grad_old(n),
      jvp(n);
  buffer<troll::projection_stats> stats(1);
  const auto nv = row_view(zn, n), ov = row_view(zo, n), gv = row_view(g, n);
  troll::project(backend::policy(), nv, ov, eps, troll::make_batch(log_probs.get(), 1, n), stats.get());
  const troll::projection_stats st = stats.download()[0];
  REQUIRE(st.status == troll::row_status::projected);
  const reference r = at_t(zn_host, zo_host, st.t);
  const long double t = st.t;

  // VJP w.r.t. z̃: t [g_j − π_j Σg − π_j c_j Σ g c / σ²]
  long double sg = 0, sgc = 0;
  for (std::size_t i = 0; i < n; ++i) sg += g_host[i], sgc += g_host[i] * r.centred[i];
  std::vector<long double> want(n);
  long double scale = 0;
  for (std::size_t j = 0; j < n; ++j) {
    want[j] = t * (g_host[j] - r.pi[j] * sg - r.pi[j] * r.centred[j] * sgc / r.sigma2);
    scale = std::max(scale, std::fabs(want[j]));
  }
  const auto lp = row_view(log_probs, n);
  const troll::projection_stats* sp = stats.get();
  troll::project_backward(backend::policy(), nv, ov, lp, sp, gv, troll::make_batch(grad_new.get(), 1, n));
  troll::project_backward(backend::policy(), nv, ov, lp, sp, gv, troll::make_batch(grad_new_general.get(), 1, n),
                          troll::make_batch(grad_old.get(), 1, n));
  const std::vector<T> got = grad_new.download(), got_general = grad_new_general.download();
  for (std::size_t j = 0; j < n; ++j) {
    CAPTURE(j);
    CHECK(std::fabs(double(got[j] - T(want[j]))) <= tolerance * double(scale));
    CHECK(std::fabs(double(got_general[j] - T(want[j]))) <= tolerance * double(scale));
  }

  // JVP along u = g (z̃ only): t (u_i − Σ π u − c_i Σ π c u / σ²); and the Jacobian's rows.
  long double spu = 0, spcu = 0;
  for (std::size_t j = 0; j < n; ++j) spu += r.pi[j] * g_host[j], spcu += r.pi[j] * r.centred[j] * g_host[j];
  troll::project_jvp(backend::policy(), nv, ov, lp, sp, gv, troll::input_view<T>{}, 0.0,
                     troll::make_batch(jvp.get(), 1, n));
  const std::vector<T> got_jvp = jvp.download();
  std::vector<T> jac;
  if (n <= 64) {
    troll_test::workspace_policy<backend, troll::op::project_jacobian> scratch(1, n);
    buffer<T> jac_dev(n * n);
    troll::project_jacobian(scratch.get(), nv, ov, lp, sp, jac_dev.get());
    jac = jac_dev.download();
  }
  for (std::size_t i = 0; i < n; ++i) {
    const long double want_jvp = t * (g_host[i] - spu - r.centred[i] * spcu / r.sigma2);
    CAPTURE(i);
    CHECK(std::fabs(double(got_jvp[i] - T(want_jvp))) <= tolerance * (std::fabs(double(want_jvp)) + 1.0));
    if (n > 64) continue;
    long double jv = 0;
    for (std::size_t j = 0; j < n; ++j) jv += static_cast<long double>(jac[i * n + j]) * g_host[j];
    CHECK(std::fabs(double(jv - want_jvp)) <= tolerance * (std::fabs(double(want_jvp)) + 1.0));
  }
}

TEST_CASE("derivatives of near-one-hot rows with large logits: d − mu is re-centred") {
  // double: the short VJP path (V = 3), the general one (grad_old), the JVP and the Jacobian
  check_row<double>({1e4, -1e4, 0.0}, {-1e4, 1e4, 5.0}, 1e-9, 1e-10);
  check_row<double>({12000.0, -17000.0, 25.0}, {-17000.0, 12000.0, 0.0}, 1e-9, 1e-10);
  check_row<double>({3e4, 0.0, 1.0}, {0.0, 2e4, 1.0}, 1e-6, 1e-10);
  check_row<float>({1e4f, -1e4f, 0.0f}, {-1e4f, 1e4f, 5.0f}, 1e-9, 1e-5);
  // a long row (the CPU's packet VJP path): the same three tokens among 997 far-below ones
  std::vector<double> zn(1000, -3e4), zo(1000, -3e4);
  zn[0] = 1e4, zn[500] = -1e4, zn[999] = 0.0;
  zo[0] = -1e4, zo[500] = 1e4, zo[999] = 5.0;
  check_row<double>(zn, zo, 1e-9, 1e-10);
  std::vector<float> fn(zn.begin(), zn.end()), fo(zo.begin(), zo.end());
  check_row<float>(fn, fo, 1e-9, 1e-5);
}

TEST_CASE("TROLL objective backward on a near-one-hot row with large logits: d - mu is re-centred") {
  // α = 0, one row, token_mean: ℓ = −ρ A, ∂ℓ/∂z̃_j = −A ρ t (δ_aj − π_j − c_a c_j π_j / σ²), with
  // the sampled token a the dominant one (its c_a = d_a − μ is the small, hard one).
  for (int long_row = 0; long_row < 2; ++long_row) {
    std::vector<double> zn_host{1e4, -1e4, 0.0}, zo_host{-1e4, 1e4, 5.0};
    if (long_row) {
      zn_host.assign(700, -3e4), zo_host.assign(700, -3e4);
      zn_host[0] = 1e4, zn_host[1] = -1e4, zn_host[2] = 0.0, zo_host[0] = -1e4, zo_host[1] = 1e4, zo_host[2] = 5.0;
    }
    const std::size_t n = zn_host.size();
    const troll::token_id token = 1;
    const double advantage = 0.75;
    buffer<double> zn(zn_host), zo(zo_host), advantages(std::vector<double>{advantage}), log_probs(n), grad(n);
    buffer<troll::token_id> tokens(std::vector<troll::token_id>{token});
    buffer<troll::projection_stats> stats(1);
    buffer<troll::objective_metrics> metrics(1);
    troll::token_batch<double> batch;
    batch.tokens = tokens.get();
    batch.advantages = advantages.get();
    troll::trust_region_objective objective;
    objective.eps = 1e-9;
    objective.alpha = 0.0;
    const std::size_t bytes = troll::workspace_bytes(backend::policy(), troll::op::objective_forward{}, objective, 1, n);
    buffer<double> scratch(bytes / sizeof(double) + 1);
    const auto policy = backend::policy().with_workspace(scratch.get(), bytes);
    const auto nv = row_view(zn, n), ov = row_view(zo, n);
    troll::objective_forward(policy, objective, nv, ov, batch, troll::make_batch(log_probs.get(), 1, n), stats.get(),
                             nullptr, metrics.get());
    const troll::projection_stats st = stats.download()[0];
    REQUIRE(st.status == troll::row_status::projected);
    troll::objective_backward(policy, objective, nv, ov, batch, row_view(log_probs, n),
                              static_cast<const troll::projection_stats*>(stats.get()),
                              troll::make_batch(grad.get(), 1, n));
    const std::vector<double> got = grad.download();
    const reference r = at_t(zn_host, zo_host, st.t);
    long double old_top = -INFINITY, old_sum = 0;
    for (double z : zo_host) old_top = std::max(old_top, static_cast<long double>(z));
    for (double z : zo_host) old_sum += std::exp(static_cast<long double>(z) - old_top);
    const long double log_q_a = zo_host[token] - old_top - std::log(old_sum);
    const long double rho = std::exp(std::log(r.pi[token]) - log_q_a);
    for (std::size_t j = 0; j < n; ++j) {
      // per entry: the three terms cancel at the dominant token, so each entry is held to 1e-10 of
      // its own terms' size (the minor tokens' third term is where a lost c_a shows)
      const long double delta = j == std::size_t(token) ? 1 : 0;
      const long double third = r.centred[token] * r.centred[j] * r.pi[j] / r.sigma2;
      const long double factor = -advantage * rho * st.t;
      const long double want = factor * (delta - r.pi[j] - third);
      const long double size = std::fabs(factor) * (delta + r.pi[j] + std::fabs(third));
      CAPTURE(long_row);
      CAPTURE(j);
      CHECK(std::fabs(double(got[j] - want)) <= 1e-10 * double(size) + 1e-300);
    }
  }
}

/// The projection's derivatives of one row (VJP with grad_old and ε, JVP along (e_0, ε' = 1),
/// the three Jacobian blocks), in double for comparison.
struct row_derivatives {
  std::vector<double> grad_new, grad_old, jvp, jac_new, jac_old, jac_eps;
  double grad_eps = 0.0;
  troll::row_status status{};
};

template <class T>
row_derivatives derivatives_of(const std::vector<T>& zn_host, const std::vector<T>& zo_host, double eps) {
  const std::size_t v = zn_host.size();
  std::vector<T> g_host(v), tangent_host(v, T(0));
  for (std::size_t j = 0; j < v; ++j) g_host[j] = T(0.5 * std::sin(1.7 * double(j + 1)));
  tangent_host[0] = T(1);
  buffer<T> zn(zn_host), zo(zo_host), g(g_host), tangent(tangent_host), lp(v), gn(v), go(v), jvp(v), jn(v * v),
      jo(v * v), je(v), ge(1);
  buffer<troll::projection_stats> stats(1);
  const auto n = row_view(zn, v), o = row_view(zo, v);
  troll::project(backend::policy(), n, o, eps, troll::make_batch(lp.get(), 1, v), stats.get());
  const auto lpv = row_view(lp, v);
  const troll::projection_stats* st = stats.get();
  troll::project_backward(backend::policy(), n, o, lpv, st, row_view(g, v), troll::make_batch(gn.get(), 1, v),
                          troll::make_batch(go.get(), 1, v), ge.get());
  troll::project_jvp(backend::policy(), n, o, lpv, st, row_view(tangent, v), row_view(tangent, v), 1.0,
                     troll::make_batch(jvp.get(), 1, v));
  troll_test::workspace_policy<backend, troll::op::project_jacobian> scratch(1, v);
  troll::project_jacobian(scratch.get(), n, o, lpv, st, jn.get(), jo.get(), je.get());
  const auto as_double = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
  row_derivatives r;
  r.grad_new = as_double(gn.download());
  r.grad_old = as_double(go.download());
  r.jvp = as_double(jvp.download());
  r.jac_new = as_double(jn.download());
  r.jac_old = as_double(jo.download());
  r.jac_eps = as_double(je.download());
  r.grad_eps = double(ge.download()[0]);
  r.status = stats.download()[0].status;
  return r;
}

void check_same(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t j = 0; j < got.size(); ++j) {
    INFO("entry " << j << ": got " << got[j] << ", want " << want[j]);
    CHECK(std::abs(got[j] - want[j]) <= tol * (scale + std::abs(want[j])));
  }
}

/// Every derivative of `got` against `want`.
void check_all(const row_derivatives& got, const row_derivatives& want, double tol) {
  check_same(got.grad_new, want.grad_new, tol);
  check_same(got.grad_old, want.grad_old, tol);
  check_same({got.grad_eps}, {want.grad_eps}, tol);
  check_same(got.jvp, want.jvp, tol);
  check_same(got.jac_new, want.jac_new, tol);
  check_same(got.jac_old, want.jac_old, tol);
  check_same(got.jac_eps, want.jac_eps, tol);
}

TEST_CASE("derivatives of rows shifted far from the origin equal the unshifted row's (softmax invariance)") {
  // softmax(z° + c) = softmax(z°): a row whose old logits carry a constant c has the same π*,
  // statistics (but μ) and derivatives as c = 0, an exact oracle. The kernels formed d_j − μ from
  // d_j = z̃_j − z°_j rounded to ulp(c) on each token (16384 at c = 1e20): ∂/∂ε had the wrong sign
  // at c = 1e16 and was 0 beyond 1e20, in float and double (the forward was right). Such rows are
  // now differentiated against a reference token (detail/centring_reference.hpp).
  const std::vector<double> base_new = {0.0, 1.0, 2.0, -0.75, 0.5};
  for (double c : {1e8, 1e12, 1e16, 1e20, -1e25, 1e30, 3e38}) {
    for (double eps : {0.05, 1e-6}) {
      INFO("c = " << c << ", eps = " << eps);
      {  // float: the old row a constant c (exactly representable), the new row small
        std::vector<float> zn(base_new.begin(), base_new.end()), zo(zn.size(), 0.0f), zc(zn.size(), float(c));
        const row_derivatives want = derivatives_of(zn, zo, eps), got = derivatives_of(zn, zc, eps);
        REQUIRE(got.status == troll::row_status::projected);
        check_all(got, want, 2e-6);
      }
      if (std::abs(c) <= 1e300) {  // double: the same, and the new row shifted by c instead
        std::vector<double> zn = base_new, zo(zn.size(), 0.0), zc(zn.size(), c);
        const row_derivatives want = derivatives_of(zn, zo, eps), got = derivatives_of(zn, zc, eps);
        check_all(got, want, 1e-9);
        // z̃ + c with z̃ on multiples of ulp(c): exactly the shifted row.
        const double unit = std::abs(c) * 0x1p-52 * 2.0;
        std::vector<double> wide(zn.size()), shifted(zn.size());
        for (std::size_t j = 0; j < zn.size(); ++j) {
          wide[j] = std::max(unit, 1.0) * std::round(zn[j] * 4.0) / 4.0;
          shifted[j] = wide[j] + c;
        }
        if (unit <= 1.0) {  // otherwise `wide` is far from a moderate row: left to the float case
          const row_derivatives w2 = derivatives_of(wide, zo, eps), g2 = derivatives_of(shifted, zo, eps);
          check_same(g2.grad_new, w2.grad_new, 1e-9);
          check_same({g2.grad_eps}, {w2.grad_eps}, 1e-9);
          check_same(g2.jvp, w2.jvp, 1e-9);
        }
      }
    }
  }
}

TEST_CASE("the TROLL objective's gradient on rows shifted far from the origin equals the unshifted row's") {
  // The fused objective backward formed d − μ as the projection's derivatives did (the cross term
  // of the sampled token's ratio): the same invariance oracle, dense old rows shifted by c.
  const std::size_t rows = 2, v = 5;
  auto gradient = [&](const std::vector<double>& zn_host, const std::vector<double>& zo_host) {
    buffer<double> zn(zn_host), zo(zo_host), lp(rows * v), grad(rows * v), token_loss(rows);
    buffer<double> advantages(std::vector<double>{1.0, -0.7});
    buffer<troll::token_id> tokens(std::vector<troll::token_id>{1, 3});
    buffer<troll::projection_stats> st(rows);
    buffer<troll::objective_metrics> metrics(1);
    const auto n = troll::make_batch<const double>(zn.get(), rows, v);
    const auto o = troll::make_batch<const double>(zo.get(), rows, v);
    troll::token_batch<double> batch;
    batch.tokens = tokens.get();
    batch.advantages = advantages.get();
    troll::trust_region_objective objective;
    objective.eps = 0.05;
    objective.alpha = 0.1;
    const std::size_t bytes =
        troll::workspace_bytes(backend::policy(), troll::op::objective_forward{}, objective, rows, v);
    buffer<double> scratch(bytes / sizeof(double) + 1);
    const auto policy = backend::policy().with_workspace(scratch.get(), bytes);
    troll::objective_forward(policy, objective, n, o, batch, troll::make_batch(lp.get(), rows, v), st.get(),
                             token_loss.get(), metrics.get());
    for (const troll::projection_stats& s : st.download()) REQUIRE(s.status == troll::row_status::projected);
    troll::objective_backward(policy, objective, n, o, batch, troll::make_batch<const double>(lp.get(), rows, v),
                              static_cast<const troll::projection_stats*>(st.get()),
                              troll::make_batch(grad.get(), rows, v), 1.0);
    return grad.download();
  };
  const std::vector<double> zn = {0.0, 1.0, 2.0, -0.75, 0.5, 1.5, -1.0, 0.25, 0.0, 2.5};
  const std::vector<double> zo(rows * v, 0.0);
  const std::vector<double> want = gradient(zn, zo);
  for (double c : {1e16, 1e20, -3e30}) {
    INFO("c = " << c);
    const std::vector<double> shifted(rows * v, c);
    check_same(gradient(zn, shifted), want, 1e-9);
  }
}

}  // namespace backward_centring
