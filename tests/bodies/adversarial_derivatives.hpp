// tests/bodies/adversarial_derivatives.hpp — the derivatives of project() on adversarial row pairs
// (ties in the maximum, near-deterministic rows, logits shifted by ±1e3, V = 1..17, ε from 1e-3
// to 1) against central differences of project() itself: project_backward (new, old, ε),
// project_jvp and project_jacobian through troll::check_vjp / check_jvp / check_jacobian. Forward
// and derivatives both run on the backend (a device forward feeds the device derivative); inputs
// are uploaded and outputs downloaded per call.
//
// One body compiled per backend (as bodies/backward_gradient.hpp): tests/test_adversarial.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_backward_gradient.cu with backend<cuda_policy> inside its "device" suite.
// Its names live in namespace adversarial_derivatives (the .cu file also holds
// bodies/backward_gradient.hpp). Include after <troll/gradcheck.hpp>, <troll/projection.hpp>,
// "backend.hpp", "adversarial_rows.hpp" and the definition of troll_test::oracle_backend.

namespace adversarial_derivatives {

using backend = troll_test::oracle_backend;
template <class E>
using buffer = typename backend::template buffer<E>;
using troll_test::describe;
using troll_test::gaussian_row;
using troll_test::row_case;

/// One row pair x = [z̃, z°, ε] (host) projected on the backend: the inputs, log π* and the
/// stats stay there for the derivative calls.
struct staged_projection {
  std::size_t n;
  buffer<double> zn, zo, log_probs;
  buffer<troll::projection_stats> stats;
  staged_projection(const double* x, std::size_t size, const troll::projection_options& options)
      : n(size),
        zn(std::vector<double>(x, x + size)),
        zo(std::vector<double>(x + size, x + 2 * size)),
        log_probs(size),
        stats(1) {
    troll::project(backend::policy(), row(zn), row(zo), x[2 * n],
                   troll::make_batch(log_probs.get(), 1, n), stats.get(), options);
  }
  troll::batch_view<const double> row(buffer<double>& b) const {
    return troll::make_batch<const double>(b.get(), 1, n);
  }
};

/// The derivatives of project() on one row pair (x = [z̃, z°, ε]) against central differences
/// of project() itself: project_backward (new, old, ε), project_jvp and project_jacobian.
void check_derivatives(const row_case& c, double eps) {
  const std::size_t n = c.zn.size();
  INFO(c.name, " eps=", eps, " rows ", describe(c));
  std::vector<double> x(c.zn);
  x.insert(x.end(), c.zo.begin(), c.zo.end());
  x.push_back(eps);
  troll::projection_options tight;
  tight.rtol = 1e-14;  // the differences need the solve well below their step
  auto f = [&](const double* in, double* y) {
    staged_projection s(in, n, tight);
    const std::vector<double> lp = s.log_probs.download();
    std::copy(lp.begin(), lp.end(), y);
  };
  auto vjp = [&](const double* in, const double* gy, double* gx) {
    staged_projection s(in, n, tight);
    buffer<double> up(std::vector<double>(gy, gy + n)), gn(n), go(n), ge(std::vector<double>{0.0});
    troll::project_backward(backend::policy(), s.row(s.zn), s.row(s.zo), s.row(s.log_probs),
                            s.stats.get(), s.row(up), troll::make_batch(gn.get(), 1, n),
                            troll::make_batch(go.get(), 1, n), ge.get());
    const std::vector<double> gn_host = gn.download(), go_host = go.download();
    std::copy(gn_host.begin(), gn_host.end(), gx);
    std::copy(go_host.begin(), go_host.end(), gx + n);
    gx[2 * n] = ge.download()[0];
  };
  auto jvp = [&](const double* in, const double* dx, double* dy) {
    staged_projection s(in, n, tight);
    buffer<double> dn(std::vector<double>(dx, dx + n)),
        dold(std::vector<double>(dx + n, dx + 2 * n)), out(n);
    troll::project_jvp(backend::policy(), s.row(s.zn), s.row(s.zo), s.row(s.log_probs),
                       s.stats.get(), s.row(dn), s.row(dold), dx[2 * n],
                       troll::make_batch(out.get(), 1, n));
    const std::vector<double> host = out.download();
    std::copy(host.begin(), host.end(), dy);
  };
  auto jac = [&](const double* in, double* J) {  // m × (2n + 1), from project_jacobian
    staged_projection s(in, n, tight);
    buffer<double> jn_b(n * n), jo_b(n * n), je_b(n);
    const auto policy = backend::policy();
    const std::size_t bytes = troll::workspace_bytes(policy, troll::op::project_jacobian{}, 1, n);
    buffer<double> scratch(bytes / sizeof(double) + 1);
    troll::project_jacobian(policy.with_workspace(scratch.get(), bytes), s.row(s.zn), s.row(s.zo),
                            s.row(s.log_probs), s.stats.get(), jn_b.get(), jo_b.get(), je_b.get());
    const std::vector<double> jn = jn_b.download(), jo = jo_b.download(), je = je_b.download();
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t j = 0; j < n; ++j)
        J[i * (2 * n + 1) + j] = jn[i * n + j], J[i * (2 * n + 1) + n + j] = jo[i * n + j];
      J[i * (2 * n + 1) + 2 * n] = je[i];
    }
  };
  troll::gradcheck_options opt;
  opt.atol = 1e-6;
  opt.rtol = 1e-5;
  const auto a = troll::check_vjp(f, vjp, x, n, opt);
  CHECK_MESSAGE(a.ok, a.report());
  const auto b = troll::check_jvp(f, jvp, x, n, opt);
  CHECK_MESSAGE(b.ok, b.report());
  const auto d = troll::check_jacobian(f, jac, x, n, opt);
  CHECK_MESSAGE(d.ok, d.report());
}

TEST_CASE("derivatives of project against central differences on adversarial rows") {
  std::mt19937_64 g(5);
  for (std::size_t n : {1, 2, 3, 17}) {
    for (double eps : {1e-3, 0.05, 1.0}) {
      check_derivatives(row_case{"gaussian", gaussian_row(g, n, 2), gaussian_row(g, n, 2)}, eps);
      std::vector<double> a(n, -3.0), b(n, -3.0);  // ties, modes differ
      a[0] = 5, b[n - 1] = 5;
      check_derivatives(row_case{"ties", a, b}, eps);
      a = gaussian_row(g, n, 1), b = gaussian_row(g, n, 1);  // near-deterministic old row
      b[n / 2] += 25;
      check_derivatives(row_case{"sharp old", a, b}, eps);
      a = gaussian_row(g, n, 1), b = gaussian_row(g, n, 1);  // near-deterministic new row
      a[0] += 25;
      check_derivatives(row_case{"sharp new", a, b}, eps);
      a = gaussian_row(g, n, 1, 1e3), b = gaussian_row(g, n, 1, -1e3);  // shifted rows
      check_derivatives(row_case{"shifted", a, b}, eps);
    }
  }
}

}  // namespace adversarial_derivatives
