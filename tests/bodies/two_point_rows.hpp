// tests/bodies/two_point_rows.hpp — the new-side derivatives on rows whose π* is nearly two-point:
// two tokens hold all but S_o of the mass (S_o = 1e-5 … 1e-6 here). The direct formula's entries at
// those tokens are differences of terms of size |g| whose value is ~S_o|g|: before the two-point
// rule (troll/detail/two_point.hpp) the VJP was 4e-8 off (double) and 1.9× off (float) normwise at
// S_o = 1e-6, by an mpmath audit. Reference: math.md §3 in long double at the forward's t, whose own
// cancellation (~5e-20/S_o) stays far below the tolerances. Entry points: the VJP (its short, packet
// and general paths: V = 3, 10 and 700 rows, with and without grad_old), the sparse projection's
// VJP (aligned rows, V = 3, 10, 60), TROLL's objective backward (α = 0, the sampled token at either
// heavy token) and the Jacobian's rows.
//
// One body compiled per backend: tests/test_two_point.cpp includes it with
// troll_test::oracle_backend = backend<cpu_policy>, tests/cuda/test_cuda_gradients.cu with
// backend<cuda_policy> inside its "device" suite (the Jacobian's rows are checked on the CPU only:
// the device Jacobian keeps normwise accuracy, docs/cuda.md). Its names live in namespace
// two_point_rows. Include after <troll/projection.hpp>, <troll/objectives.hpp>, "backend.hpp",
// "oracle.hpp", "sparse_staging.hpp" and the definition of troll_test::oracle_backend.

namespace two_point_rows {

using backend = troll_test::oracle_backend;
template <class E>
using buffer = typename backend::template buffer<E>;
using ld = long double;

/// Whether this instantiation is the CPU's.
constexpr bool cpu_instance = std::is_same<backend, troll_test::backend<troll::cpu_policy>>::value;

/// A row whose π* at t = 1/2 is (ra, 1 − ra)·(1 − S_o) on tokens 0 and 1 and S_o spread over the
/// others, whose d lie between d_0 and d_1 (`far` = false) or 20 beyond (`far` = true).
struct row {
  std::vector<double> zn, zo;
  double eps = 0.0;
};

inline row make_row(std::size_t n, double so, double ra, bool far) {
  const double t0 = 0.5;
  row r;
  r.zn.resize(n), r.zo.resize(n);
  std::vector<double> log_pi(n), d(n);
  double weights = 0.0;
  for (std::size_t j = 2; j < n; ++j) weights += 1.0 + 0.5 * std::cos(double(j));
  log_pi[0] = std::log(ra * (1.0 - so)), log_pi[1] = std::log((1.0 - ra) * (1.0 - so));
  for (std::size_t j = 2; j < n; ++j) log_pi[j] = std::log(so * (1.0 + 0.5 * std::cos(double(j))) / weights);
  r.zo[0] = 0.0, r.zo[1] = 1.0;
  d[0] = (log_pi[0] - r.zo[0]) / t0, d[1] = (log_pi[1] - r.zo[1]) / t0;
  for (std::size_t j = 2; j < n; ++j) {
    const double f = 0.5 + 0.45 * std::sin(1.7 * double(j));
    d[j] = d[1] + f * (d[0] - d[1]) + (far ? (j % 2 ? 20.0 : -20.0) : 0.0);
    r.zo[j] = log_pi[j] - t0 * d[j];
  }
  for (std::size_t j = 0; j < n; ++j) r.zn[j] = r.zo[j] + d[j];
  const troll_test::oracle::tilted_row tilted(r.zn.data(), r.zo.data(), n);
  r.eps = static_cast<double>(tilted.kl_to_old(ld(t0)));
  return r;
}

/// π_t and c_j = Σ_i π_i (d_j − d_i) of a row of T at t, and σ², in long double.
struct reference {
  std::vector<ld> pi, centred;
  ld sigma2 = 0;
};
template <class T>
reference at_t(const std::vector<T>& zn, const std::vector<T>& zo, double t) {
  const std::size_t n = zn.size();
  reference r;
  std::vector<ld> u(n), d(n);
  ld top = -INFINITY, sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    d[i] = static_cast<ld>(zn[i]) - static_cast<ld>(zo[i]);
    u[i] = static_cast<ld>(zo[i]) + static_cast<ld>(t) * d[i];
    top = std::max(top, u[i]);
  }
  r.pi.resize(n), r.centred.resize(n);
  for (std::size_t i = 0; i < n; ++i) sum += (r.pi[i] = std::exp(u[i] - top));
  for (auto& p : r.pi) p /= sum;
  for (std::size_t j = 0; j < n; ++j) {
    ld c = 0;
    for (std::size_t i = 0; i < n; ++i) c += r.pi[i] * (d[j] - d[i]);
    r.centred[j] = c;
  }
  for (std::size_t i = 0; i < n; ++i) r.sigma2 += r.pi[i] * r.centred[i] * r.centred[i];
  return r;
}

/// t·[(g_j − π_j Σg) − π_j c_j Σ g c / σ²] in long double.
inline std::vector<ld> vjp(const reference& r, ld t, const std::vector<ld>& g) {
  const std::size_t n = g.size();
  ld sg = 0, sgc = 0;
  for (std::size_t i = 0; i < n; ++i) sg += g[i], sgc += g[i] * r.centred[i];
  std::vector<ld> out(n);
  for (std::size_t j = 0; j < n; ++j) out[j] = t * ((g[j] - r.pi[j] * sg) - r.pi[j] * r.centred[j] * sgc / r.sigma2);
  return out;
}

/// max_j |got_j − want_j| / max_j |want_j|.
template <class T>
double normwise(const std::vector<T>& got, const std::vector<ld>& want, std::size_t offset = 0) {
  ld num = 0, den = 0;
  for (std::size_t j = 0; j < want.size(); ++j) {
    num = std::max(num, std::fabs(static_cast<ld>(got[offset + j]) - want[j]));
    den = std::max(den, std::fabs(want[j]));
  }
  return static_cast<double>(num / den);
}

template <class T>
double tolerance() {
  return std::is_same<T, float>::value ? 3e-5 : 1e-11;
}

template <class T>
void check_row(const row& rw, const char* name) {
  const std::size_t n = rw.zn.size();
  const std::vector<T> zn_host(rw.zn.begin(), rw.zn.end()), zo_host(rw.zo.begin(), rw.zo.end());
  buffer<T> zn(zn_host), zo(zo_host), log_probs(n);
  buffer<troll::projection_stats> stats(1);
  const auto nv = troll::make_batch<const T>(zn.get(), 1, n), ov = troll::make_batch<const T>(zo.get(), 1, n);
  troll::project(backend::policy(), nv, ov, rw.eps, troll::make_batch(log_probs.get(), 1, n), stats.get());
  const troll::projection_stats st = stats.download()[0];
  REQUIRE(st.status == troll::row_status::projected);
  const reference r = at_t(zn_host, zo_host, st.t);
  const ld t = st.t;
  const auto lp = troll::make_batch<const T>(log_probs.get(), 1, n);
  const troll::projection_stats* sp = stats.get();
  INFO(name, " V ", n, " pi ", double(r.pi[0]), " / ", double(r.pi[1]));

  // The VJP for upstreams on token 0, on token 1, and π ⊙ u; without grad_old (the short and
  // packet paths) and with it (the general path).
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<ld> g(n, 0);
    std::vector<T> g_host(n, T(0));
    for (std::size_t j = 0; j < n; ++j) {
      const double value = kind == 2 ? double(r.pi[j]) * std::cos(1.3 * double(j) + 0.4) : (j == std::size_t(kind) ? 1.0 : 0.0);
      g_host[j] = T(value);
      g[j] = static_cast<ld>(g_host[j]);
    }
    const std::vector<ld> want = vjp(r, t, g);
    buffer<T> gb(g_host), grad_new(n), grad_new_general(n), grad_old(n);
    const auto gv = troll::make_batch<const T>(gb.get(), 1, n);
    troll::project_backward(backend::policy(), nv, ov, lp, sp, gv, troll::make_batch(grad_new.get(), 1, n));
    troll::project_backward(backend::policy(), nv, ov, lp, sp, gv, troll::make_batch(grad_new_general.get(), 1, n),
                            troll::make_batch(grad_old.get(), 1, n));
    CAPTURE(kind);
    CHECK(normwise(grad_new.download(), want) <= tolerance<T>());
    CHECK(normwise(grad_new_general.download(), want) <= tolerance<T>());
  }

  // The Jacobian's rows 0 and 1 (the VJPs of e_0 and e_1).
  if (cpu_instance && n <= 64) {
    troll_test::workspace_policy<backend, troll::op::project_jacobian> scratch(1, n);
    buffer<T> jac(n * n);
    troll::project_jacobian(scratch.get(), nv, ov, lp, sp, jac.get());
    const std::vector<T> got = jac.download();
    for (std::size_t i = 0; i < 2; ++i) {
      std::vector<ld> e(n, 0);
      e[i] = 1;
      CAPTURE(i);
      CHECK(normwise(got, vjp(r, t, e), i * n) <= tolerance<T>());
    }
  }

  // TROLL's objective (α = 0, one token, A = 1): ∂ℓ/∂z̃ = −ρ·VJP(e_a), the sampled token a at
  // either heavy token.
  for (troll::token_id token : {troll::token_id(0), troll::token_id(1)}) {
    buffer<T> advantages(std::vector<T>{T(1)}), obj_log_probs(n), grad(n);
    buffer<troll::token_id> tokens(std::vector<troll::token_id>{token});
    buffer<troll::projection_stats> obj_stats(1);
    buffer<troll::objective_metrics> metrics(1);
    troll::token_batch<T> batch;
    batch.tokens = tokens.get();
    batch.advantages = advantages.get();
    troll::trust_region_objective objective;
    objective.eps = rw.eps;
    objective.alpha = 0.0;
    const std::size_t bytes = troll::workspace_bytes(backend::policy(), troll::op::objective_forward{}, objective, 1, n);
    buffer<double> scratch(bytes / sizeof(double) + 1);
    const auto policy = backend::policy().with_workspace(scratch.get(), bytes);
    troll::objective_forward(policy, objective, nv, ov, batch, troll::make_batch(obj_log_probs.get(), 1, n),
                             obj_stats.get(), nullptr, metrics.get());
    const troll::projection_stats os = obj_stats.download()[0];
    REQUIRE(os.status == troll::row_status::projected);
    troll::objective_backward(policy, objective, nv, ov, batch,
                              troll::make_batch<const T>(obj_log_probs.get(), 1, n),
                              static_cast<const troll::projection_stats*>(obj_stats.get()),
                              troll::make_batch(grad.get(), 1, n));
    const reference ro = at_t(zn_host, zo_host, os.t);
    std::vector<ld> e(n, 0);
    e[std::size_t(token)] = 1;
    ld old_top = -INFINITY, old_sum = 0;
    for (T z : zo_host) old_top = std::max(old_top, static_cast<ld>(z));
    for (T z : zo_host) old_sum += std::exp(static_cast<ld>(z) - old_top);
    const ld log_q = static_cast<ld>(zo_host[std::size_t(token)]) - old_top - std::log(old_sum);
    const ld rho = std::exp(std::log(ro.pi[std::size_t(token)]) - log_q);
    std::vector<ld> want = vjp(ro, os.t, e);
    for (ld& w : want) w *= -rho;
    CAPTURE(token);
    CHECK(normwise(grad.download(), want) <= tolerance<T>());
  }
}

/// The sparse projection's VJP on the same rows held as aligned sparse rows (every token on the
/// support, an empty bucket), with and without grad_old: on the CPU its lumped rows take the
/// VJP's short path (which re-reads the row for the rule) and the general one.
template <class T>
void check_sparse_row(const row& rw) {
  const std::size_t n = rw.zn.size();
  const std::vector<T> zn(rw.zn.begin(), rw.zn.end()), zo(rw.zo.begin(), rw.zo.end());
  sparse_test::aligned_rows<T> al(1, n, n);
  al.counts[0] = troll::sparse_index(n);
  auto log_softmax = [](const std::vector<T>& z, std::size_t j) {
    ld top = -INFINITY, sum = 0;
    for (T x : z) top = std::max(top, static_cast<ld>(x));
    for (T x : z) sum += std::exp(static_cast<ld>(x) - top);
    return static_cast<ld>(z[j]) - top - std::log(sum);
  };
  for (std::size_t j = 0; j < n; ++j) {
    al.indices[j] = troll::sparse_index(j);
    al.new_log_probs[j] = T(log_softmax(zn, j));
    al.old_log_probs[j] = T(log_softmax(zo, j));
  }
  al.new_log_remainder[0] = al.old_log_remainder[0] = -std::numeric_limits<T>::infinity();
  sparse_test::sparse_rows<T> out(1, n, n);
  std::vector<troll::projection_stats> st(1);
  troll_test::project_on<backend>(al, rw.eps, out, st);
  REQUIRE(st[0].status == troll::row_status::projected);
  // The reference at t on the aligned (normalised) rows as stored.
  const reference r = at_t(al.new_log_probs, al.old_log_probs, st[0].t);
  for (std::size_t kind = 0; kind < 2; ++kind) {
    sparse_test::sparse_grads<T> g(1, n), gn(1, n), gn_general(1, n), go(1, n);
    g.log_probs[kind] = T(1);
    std::vector<ld> e(n, 0);
    e[kind] = 1;
    troll_test::project_backward_on<backend>(al, out, st, g, gn);
    troll_test::project_backward_on<backend>(al, out, st, g, gn_general, &go);
    const std::vector<ld> want = vjp(r, st[0].t, e);
    CAPTURE(kind);
    CHECK(normwise(gn.log_probs, want) <= tolerance<T>());
    CHECK(normwise(gn_general.log_probs, want) <= tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("nearly two-point rows: the new-side derivatives are accurate relative to themselves", T, double,
                   float) {
  for (double so : {1e-5, 1e-6}) {
    for (double ra : {0.5, 0.7, 0.99}) {
      for (bool far : {false, true}) {
        CAPTURE(so);
        CAPTURE(ra);
        CAPTURE(far);
        check_row<T>(make_row(3, so, ra, far), "V = 3");
        check_row<T>(make_row(10, so, ra, far), "V = 10");
        check_row<T>(make_row(700, so, ra, far), "V = 700");
        for (std::size_t n : {std::size_t(3), std::size_t(10), std::size_t(60)}) {
          CAPTURE(n);
          check_sparse_row<T>(make_row(n, so, ra, far));
        }
      }
    }
  }
}

}  // namespace two_point_rows
