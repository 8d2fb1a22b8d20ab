// tests/bodies/backward_gradient.hpp — project_backward, project_jvp and project_jacobian against
// troll's gradient checker (finite differences of the double CPU projection, Richardson-extrapolated) and against
// each other: one body compiled per backend (as bodies/kl_gradient.hpp): tests/test_backward.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_backward_gradient.cu with backend<cuda_policy> inside its "device" suite.
// The forward (log π*, stats) is always the CPU projection; only the derivative runs on the
// backend. Include after "grad_helpers.hpp", "backend.hpp", `using namespace grad_helpers;` and
// the definition of troll_test::oracle_backend.

namespace {

using backend = troll_test::oracle_backend;

/// One test row (single-row batch), its bound and the status it must have.
struct row_case {
  std::string name;
  pair_batch batch;
  double eps;
  troll::row_status status;
  double step = 1e-6;  // checker step: larger where the forward's own rounding is large vs ε
};

pair_batch one_row(const std::vector<double>& zn, const std::vector<double>& zo) {
  pair_batch b(1, zn.size());
  b.set_row(0, zn, zo);
  return b;
}

/// zo ~ N(0, 1), zn = zo + N(0, spread²), V tokens.
pair_batch gaussian_row(rng& g, std::size_t v, double spread) {
  std::vector<double> zo = g.normals(v, 1.0), zn = zo;
  for (double& z : zn) z += spread * g.normal();
  return one_row(zn, zo);
}

/// The cases of the full-Jacobian checks (V = 7..9). Each has a clear margin between
/// KL(p̃‖q) (over the joint support for restricted rows) and ε.
std::vector<row_case> small_cases() {
  rng g(2024);
  std::vector<row_case> cases;
  const troll::row_status projected = troll::row_status::projected;
  const troll::row_status inactive = troll::row_status::inactive;
  const troll::row_status restricted = troll::row_status::restricted;

  cases.push_back({"projected eps=0.05", gaussian_row(g, 7, 1.5), 0.05, projected});
  cases.push_back({"inactive eps=0.5", gaussian_row(g, 7, 0.05), 0.5, inactive});
  // At ε = 1e-6 the forward's KL carries ~1e-16 absolute rounding, i.e. 1e-10 relative to ε,
  // which moves log π* by ~1e-13: a step of 1e-6 would turn that into 1e-7 of noise.
  cases.push_back({"projected eps=1e-6", gaussian_row(g, 8, 1.0), 1e-6, projected, 1e-4});
  cases.push_back({"projected eps=1e-3", gaussian_row(g, 8, 1.0), 1e-3, projected});
  cases.push_back({"projected eps=0.5", gaussian_row(g, 8, 3.0), 0.5, projected});
  {  // KL(p̃‖q) ≈ 17: the new row is nearly one-hot on a token the old row gives e^-15
    std::vector<double> zo = g.normals(8, 0.5), zn = zo;
    zo[0] = -15.0;
    zn[0] = 20.0;
    cases.push_back({"projected eps=5", one_row(zn, zo), 5.0, projected});
  }
  {  // near-deterministic new row: one token 25 nats above the rest
    pair_batch b = gaussian_row(g, 8, 0.3);
    b.new_row(0)[3] += 25.0;
    cases.push_back({"near-deterministic new row", b, 0.05, projected});
  }
  {  // near-deterministic old row, new row elsewhere
    pair_batch b = gaussian_row(g, 8, 0.3);
    b.old_row(0)[5] += 18.0;
    b.new_row(0)[1] += 6.0;
    cases.push_back({"near-deterministic old row", b, 0.05, projected});
  }
  {  // large logits of both signs
    std::vector<double> zn(9), zo(9);
    for (std::size_t j = 0; j < 9; ++j) {
      zn[j] = 50.0 * (2.0 * g.uniform() - 1.0);
      zo[j] = 50.0 * (2.0 * g.uniform() - 1.0);
    }
    zn[2] = 50.0, zo[6] = -50.0, zo[4] = 49.0;
    cases.push_back({"logits in [-50, 50]", one_row(zn, zo), 0.1, projected});
  }
  {  // large common offset: only differences matter
    pair_batch b = gaussian_row(g, 7, 1.0);
    for (double& z : b.new_logits) z += 40.0;
    for (double& z : b.old_logits) z -= 45.0;
    cases.push_back({"offset logits +40 / -45", b, 0.05, projected});
  }
  {  // p̃ ≈ q: KL(p̃‖q) ~ 1e-7, bound a quarter of it
    pair_batch b = gaussian_row(g, 8, 1e-3);
    const double kl = reference_kl(b.new_row(0), b.old_row(0), 8);
    // d varies on a 1e-3 scale; ε ~ 3e-8 makes the forward's rounding ~1e-9 relative: step 1e-5.
    cases.push_back({"p~q, eps = KL/4", b, kl / 4, projected, 1e-5});
  }
  {  // restricted: the new row has 1e-9 mass on a token the old row masks
    std::vector<double> zo = g.normals(7, 1.0), zn = zo;
    for (double& z : zn) z += 0.1 * g.normal();
    zo[4] = neg_inf;
    zn[4] = -20.0;
    cases.push_back({"restricted", one_row(zn, zo), 0.2, restricted});
  }
  {  // masks on both sides of a projected row: token 1 masked in both, token 3 only in the old
     // row (new-only), token 5 only in the new row (old-only, small old mass)
    std::vector<double> zo = g.normals(8, 1.0), zn = zo;
    for (double& z : zn) z += 1.5 * g.normal();
    zn[1] = zo[1] = neg_inf;
    zo[3] = neg_inf;
    zn[5] = neg_inf;
    zo[5] = -3.0;
    cases.push_back({"masked both sides, projected", one_row(zn, zo), 0.1, projected});
  }
  {  // the same masks on an inactive row (no new-only token there: that would make KL infinite)
    std::vector<double> zo = g.normals(8, 1.0), zn = zo;
    for (double& z : zn) z += 0.05 * g.normal();
    zn[2] = zo[2] = neg_inf;
    zn[6] = neg_inf;
    zo[6] = -4.0;
    cases.push_back({"masked both sides, inactive", one_row(zn, zo), 0.5, inactive});
  }
  {  // tokens masked in both rows and nowhere else (vocabulary padding), projected
    std::vector<double> zo = g.normals(8, 1.0), zn = zo;
    for (double& z : zn) z += 1.5 * g.normal();
    zn[0] = zo[0] = neg_inf;
    zn[6] = zo[6] = neg_inf;
    cases.push_back({"masked in both rows only, projected", one_row(zn, zo), 0.05, projected});
  }
  return cases;
}

troll::gradcheck_options opts(double atol = 1e-7, double rtol = 1e-5, double step = 1e-6) {
  troll::gradcheck_options o;
  o.step = step;
  o.atol = atol;
  o.rtol = rtol;
  return o;
}

/// The forward's outputs and the input rows, uploaded to the backend.
struct backend_state {
  typename backend::template buffer<double> zn, zo, log_probs;
  typename backend::template buffer<troll::projection_stats> stats;
  backend_state(const pair_batch& b, const forward_result& f)
      : zn(b.new_logits), zo(b.old_logits), log_probs(f.log_probs), stats(f.stats) {}
  troll::batch_view<const double> view(typename backend::template buffer<double>& m, std::size_t rows,
                                       std::size_t cols) {
    return troll::make_batch<const double>(m.get(), rows, cols);
  }
};

/// The VJP through the backend's project_backward as a gradient-checker callable vjp(x, gy, gx).
struct backend_vjp {
  const packing* pack;
  void operator()(const double* x, const double* gy, double* gx) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    const std::size_t rows = b.rows, cols = b.cols;
    backend_state s(b, f);
    typename backend::template buffer<double> g(std::vector<double>(gy, gy + rows * cols));
    typename backend::template buffer<double> gn(std::vector<double>(rows * cols, 0.0));
    typename backend::template buffer<double> go(std::vector<double>(rows * cols, 0.0));
    typename backend::template buffer<double> ge(std::vector<double>(rows, 0.0));
    troll::batch_view<double> old_view{};
    if (pack->with_old()) old_view = troll::make_batch(go.get(), rows, cols);
    troll::project_backward(backend::policy(), s.view(s.zn, rows, cols), s.view(s.zo, rows, cols),
                            s.view(s.log_probs, rows, cols), s.stats.get(), s.view(g, rows, cols),
                            troll::make_batch(gn.get(), rows, cols), old_view,
                            pack->with_eps() ? ge.get() : nullptr);
    pack->pack_gradient(gn.download(), go.download(), ge.download(), eps, gx);
  }
};

/// The JVP through the backend's project_jvp as a gradient-checker callable jvp(x, dx, dy).
struct backend_jvp {
  const packing* pack;
  void operator()(const double* x, const double* dx, double* dy) const {
    pair_batch b;
    double eps;
    pack->unpack(x, b, eps);
    const forward_result f = forward(b, eps);
    const std::size_t rows = b.rows, cols = b.cols;
    std::vector<double> tn, to;
    double teps = 0;
    pack->spread_tangent(dx, eps, tn, to, teps);
    if (to.size() != rows * cols) to.assign(rows * cols, 0.0);
    backend_state s(b, f);
    typename backend::template buffer<double> tn_b(tn), to_b(to);
    typename backend::template buffer<double> out(std::vector<double>(rows * cols, 0.0));
    troll::batch_view<const double> old_tangent{};
    if (pack->with_old()) old_tangent = s.view(to_b, rows, cols);
    troll::project_jvp(backend::policy(), s.view(s.zn, rows, cols), s.view(s.zo, rows, cols),
                       s.view(s.log_probs, rows, cols), s.stats.get(), s.view(tn_b, rows, cols),
                       old_tangent, teps, troll::make_batch(out.get(), rows, cols));
    const std::vector<double> host = out.download();
    std::copy(host.begin(), host.end(), dy);
  }
};

/// project_jacobian on the backend (with the workspace its query asks for), downloaded.
void backend_jacobians(const pair_batch& b, const forward_result& f, std::vector<double>& jn,
                       std::vector<double>& jo, std::vector<double>& je) {
  const std::size_t rows = b.rows, cols = b.cols;
  backend_state s(b, f);
  typename backend::template buffer<double> jn_b(rows * cols * cols), jo_b(rows * cols * cols), je_b(rows * cols);
  const auto policy = backend::policy();
  const std::size_t bytes = troll::workspace_bytes(policy, troll::op::project_jacobian{}, rows, cols);
  typename backend::template buffer<double> scratch(bytes / sizeof(double) + 1);
  troll::project_jacobian(policy.with_workspace(scratch.get(), bytes), s.view(s.zn, rows, cols),
                          s.view(s.zo, rows, cols), s.view(s.log_probs, rows, cols), s.stats.get(), jn_b.get(),
                          jo_b.get(), je_b.get());
  jn = jn_b.download();
  jo = jo_b.download();
  je = je_b.download();
}

}  // namespace

TEST_CASE("project_jacobian: against the checker's numeric Jacobian") {
  for (const row_case& c : small_cases()) {
    const packing pack(c.batch, true, true, c.eps);
    projection_full_jacobian jacobian = make_full_jacobian(pack);
    jacobian.source = backend_jacobians;
    const troll::gradcheck_result r = troll::check_jacobian(projection_function{&pack}, jacobian, pack.x0(),
                                                            pack.outputs(), opts(1e-7, 1e-5, c.step));
    INFO(c.name << "\n" << r.report());
    CHECK(r.ok);
  }
}

TEST_CASE("project_backward: full Jacobian check w.r.t. new logits, old logits and eps") {
  for (const row_case& c : small_cases()) {
    SUBCASE(c.name.c_str()) {
      const packing pack(c.batch, true, true, c.eps);
      const troll::gradcheck_result r = troll::check_vjp(
          projection_function{&pack}, backend_vjp{&pack}, pack.x0(), pack.outputs(), opts(1e-7, 1e-5, c.step));
      INFO(c.name << "\n" << r.report());
      CHECK(r.ok);
      CHECK(r.checked > 0);
    }
  }
}

TEST_CASE("project_backward: new logits alone (old logits and eps held fixed)") {
  for (const row_case& c : small_cases()) {
    const packing pack(c.batch, false, false, c.eps);
    const troll::gradcheck_result r = troll::check_vjp(
        projection_function{&pack}, backend_vjp{&pack}, pack.x0(), pack.outputs(), opts(1e-7, 1e-5, c.step));
    INFO(c.name << "\n" << r.report());
    CHECK(r.ok);
  }
}

TEST_CASE("project_jvp: full Jacobian check (tangents in new, old and eps)") {
  for (const row_case& c : small_cases()) {
    const packing pack(c.batch, true, true, c.eps);
    const troll::gradcheck_result r = troll::check_jvp(
        projection_function{&pack}, backend_jvp{&pack}, pack.x0(), pack.outputs(), opts(1e-7, 1e-5, c.step));
    INFO(c.name << "\n" << r.report());
    CHECK(r.ok);
  }
  // tangent_old empty: the JVP in the new logits alone
  for (const row_case& c : small_cases()) {
    const packing pack(c.batch, false, false, c.eps);
    const troll::gradcheck_result r = troll::check_jvp(
        projection_function{&pack}, backend_jvp{&pack}, pack.x0(), pack.outputs(), opts(1e-7, 1e-5, c.step));
    INFO(c.name << " (no old tangent)\n" << r.report());
    CHECK(r.ok);
  }
}

TEST_CASE("JVP and VJP agree: <u, J v> computed both ways on a mixed batch") {
  // A batch mixing every regime, one shared eps: projected, inactive, restricted, masked rows.
  rng g(77);
  const std::size_t v = 33, rows = 5;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    const double spread = r == 1 ? 0.02 : 1.5;
    for (double& z : zn) z += spread * g.normal();
    if (r == 2) zo[7] = neg_inf, zn[7] = -25.0, zn[3] = zo[3] - 0.01;  // restricted
    if (r == 3) zn[0] = zo[0] = neg_inf, zo[9] = neg_inf, zn[11] = neg_inf, zo[11] = -2.0;
    b.set_row(r, zn, zo);
  }
  // Row 2 must be restricted: the new row is a small perturbation of the old one on J.
  for (std::size_t j = 0; j < v; ++j)
    if (j != 7) b.new_row(2)[j] = b.old_row(2)[j] + 0.02 * g.normal();
  const double eps = 0.1;
  const forward_result f = forward(b, eps);
  CHECK(f.stats[0].status == troll::row_status::projected);
  CHECK(f.stats[1].status == troll::row_status::inactive);
  CHECK(f.stats[2].status == troll::row_status::restricted);
  CHECK(f.stats[3].status == troll::row_status::projected);
  CHECK(f.stats[4].status == troll::row_status::projected);

  for (int trial = 0; trial < 8; ++trial) {
    std::vector<double> u = g.normals(rows * v, 1.0), tn = g.normals(rows * v, 1.0),
                        to = g.normals(rows * v, 1.0);
    const double teps = g.normal();
    backend_state s(b, f);
    typename backend::template buffer<double> u_b(u), tn_b(tn), to_b(to);
    typename backend::template buffer<double> jv_b(std::vector<double>(rows * v, 0.0));
    typename backend::template buffer<double> gn_b(std::vector<double>(rows * v, 0.0));
    typename backend::template buffer<double> go_b(std::vector<double>(rows * v, 0.0));
    typename backend::template buffer<double> ge_b(std::vector<double>(rows, 0.0));
    troll::project_jvp(backend::policy(), s.view(s.zn, rows, v), s.view(s.zo, rows, v),
                       s.view(s.log_probs, rows, v), s.stats.get(), s.view(tn_b, rows, v),
                       s.view(to_b, rows, v), teps, troll::make_batch(jv_b.get(), rows, v));
    troll::project_backward(backend::policy(), s.view(s.zn, rows, v), s.view(s.zo, rows, v),
                            s.view(s.log_probs, rows, v), s.stats.get(), s.view(u_b, rows, v),
                            troll::make_batch(gn_b.get(), rows, v), troll::make_batch(go_b.get(), rows, v),
                            ge_b.get());
    const std::vector<double> jv = jv_b.download(), gn = gn_b.download(), go = go_b.download(),
                              ge = ge_b.download();
    for (std::size_t r = 0; r < rows; ++r) {
      long double forward_side = 0, backward_side = 0, magnitude = 0;
      for (std::size_t j = 0; j < v; ++j) {
        const std::size_t k = r * v + j;
        if (f.log_probs[k] != neg_inf) forward_side += (long double)u[k] * jv[k];
        else CHECK(jv[k] == 0.0);  // masked outputs get a zero tangent
        // masked inputs carry no tangent: the VJP gives them (numerically) zero
        if (b.new_logits[k] == neg_inf) CHECK(std::fabs(gn[k]) <= 1e-300);
        if (b.old_logits[k] == neg_inf) CHECK(std::fabs(go[k]) <= 1e-300);
        const double tn_k = b.new_logits[k] == neg_inf ? 0.0 : tn[k];
        const double to_k = b.old_logits[k] == neg_inf ? 0.0 : to[k];
        backward_side += (long double)gn[k] * tn_k + (long double)go[k] * to_k;
        magnitude += std::fabs(gn[k] * tn_k) + std::fabs(go[k] * to_k);
      }
      backward_side += (long double)ge[r] * teps;
      magnitude += std::fabs(ge[r] * teps);
      INFO("trial " << trial << " row " << r);
      CHECK(std::fabs(double(forward_side - backward_side)) <= 1e-11 * double(magnitude) + 1e-14);
    }
  }
}

TEST_CASE("project_backward, random directions, V up to 4096") {
  for (std::size_t v : {std::size_t(257), std::size_t(1024), std::size_t(4096)}) {
    rng g(1000 + v);
    pair_batch b(2, v);
    for (std::size_t r = 0; r < 2; ++r) {
      std::vector<double> zo = g.normals(v, 2.0), zn = zo;
      for (double& z : zn) z += (r == 0 ? 1.0 : 0.01) * g.normal();
      if (r == 0) zo[v / 3] = neg_inf, zn[v / 2] = neg_inf, zo[v / 2] = -6.0;
      b.set_row(r, zn, zo);
    }
    const double eps = 0.05;
    const forward_result f = forward(b, eps);
    REQUIRE(f.stats[0].status == troll::row_status::projected);
    REQUIRE(f.stats[0].kl_before > 2 * eps);
    REQUIRE(f.stats[1].status == troll::row_status::inactive);
    REQUIRE(f.stats[1].kl_before < 0.5 * eps);

    const packing pack(b, true, true, eps);
    troll::gradcheck_options o = opts(1e-8, 1e-5);
    o.directions = 12;
    const troll::gradcheck_result rv = troll::check_vjp_random(
        projection_function{&pack}, backend_vjp{&pack}, pack.x0(), pack.outputs(), o);
    INFO("V = " << v << "\n" << rv.report());
    CHECK(rv.ok);
    CHECK(rv.checked == 12);
    o.seed = 99;
    const troll::gradcheck_result rj = troll::check_jvp_random(
        projection_function{&pack}, backend_jvp{&pack}, pack.x0(), pack.outputs(), o);
    INFO("V = " << v << "\n" << rj.report());
    CHECK(rj.ok);
  }
}

TEST_CASE("a composite user loss through the projection: check_gradient") {
  // L = Σ_r [ A_r · exp(log π*_{r,a_r} − log q_{r,a_r}) + Σ_i w_{r,i} log π*_{r,i} ]
  // (a TROLL-like surrogate plus a weighted log-likelihood), as a function of (z̃, z°, log ε).
  rng g(404);
  const std::size_t v = 10, rows = 3;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += (r == 1 ? 0.02 : 1.3) * g.normal();
    if (r == 2) zo[6] = neg_inf, zn[8] = neg_inf, zo[8] = -3.5;
    b.set_row(r, zn, zo);
  }
  const double eps = 0.08;
  const std::size_t sampled[rows] = {2, 5, 1};
  const double advantage[rows] = {1.5, -0.7, 2.0};
  const std::vector<double> w = g.normals(rows * v, 1.0);
  const packing pack(b, true, true, eps);

  auto log_q = [&](const pair_batch& bb, std::size_t r, std::size_t a) {
    long double m = -INFINITY, s = 0;
    for (std::size_t j = 0; j < v; ++j) m = std::max(m, (long double)bb.old_logits[r * v + j]);
    for (std::size_t j = 0; j < v; ++j) s += std::exp((long double)bb.old_logits[r * v + j] - m);
    return double(bb.old_logits[r * v + a] - m - std::log(s));
  };
  auto loss = [&](const double* x) {
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    double total = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      total += advantage[r] * std::exp(f.log_probs[r * v + sampled[r]] - log_q(bb, r, sampled[r]));
      for (std::size_t j = 0; j < v; ++j)
        if (f.log_probs[r * v + j] != neg_inf) total += w[r * v + j] * f.log_probs[r * v + j];
    }
    return total;
  };
  auto grad = [&](const double* x, double* gx) {
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    std::vector<double> up(w);
    std::vector<double> direct_old(rows * v, 0.0);  // ∂L/∂z° through log q_a (not via π*)
    for (std::size_t r = 0; r < rows; ++r) {
      const double ratio = std::exp(f.log_probs[r * v + sampled[r]] - log_q(bb, r, sampled[r]));
      up[r * v + sampled[r]] += advantage[r] * ratio;
      const double lq_shift = log_q(bb, r, sampled[r]) - bb.old_logits[r * v + sampled[r]];
      for (std::size_t j = 0; j < v; ++j) {
        const double zj = bb.old_logits[r * v + j];
        const double q = zj == neg_inf ? 0.0 : std::exp(zj + lq_shift);
        direct_old[r * v + j] = -advantage[r] * ratio * ((j == sampled[r] ? 1.0 : 0.0) - q);
      }
    }
    backend_state s(bb, f);  // project_backward on the backend, fed the CPU forward
    typename backend::template buffer<double> up_b(up), gn_b(std::vector<double>(rows * v, 0.0)),
        go_b(std::vector<double>(rows * v, 0.0)), ge_b(std::vector<double>(rows, 0.0));
    troll::project_backward(backend::policy(), s.view(s.zn, rows, v), s.view(s.zo, rows, v),
                            s.view(s.log_probs, rows, v), s.stats.get(), s.view(up_b, rows, v),
                            troll::make_batch(gn_b.get(), rows, v), troll::make_batch(go_b.get(), rows, v), ge_b.get());
    std::vector<double> go = go_b.download();
    for (std::size_t k = 0; k < go.size(); ++k) go[k] += direct_old[k];
    pack.pack_gradient(gn_b.download(), go, ge_b.download(), e, gx);
  };
  const troll::gradcheck_result r = troll::check_gradient(loss, grad, pack.x0(), opts());
  INFO(r.report());
  CHECK(r.ok);
}

TEST_CASE("a token masked in both rows, and no one-sided mask: the derivatives pass the checker") {
  // z̃ = {0, 1, -inf, 0.5}, z° = {0, 0, -inf, 0.2} (test_backward.cpp checks the forward against
  // the V = 3 row without token 2).
  const std::vector<double> zn = {0.0, 1.0, neg_inf, 0.5}, zo = {0.0, 0.0, neg_inf, 0.2};
  const packing pack(one_row(zn, zo), true, true, 0.01);
  const troll::gradcheck_result r = troll::check_vjp(
      projection_function{&pack}, backend_vjp{&pack}, pack.x0(), pack.outputs(), opts());
  INFO(r.report());
  CHECK(r.ok);
}
