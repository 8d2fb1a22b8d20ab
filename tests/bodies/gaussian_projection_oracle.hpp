// tests/bodies/gaussian_projection_oracle.hpp — the Gaussian projections (joint and split, full
// and diagonal) against the long-double bisection oracle of support/gaussian_oracle.hpp: the
// status, t*, the written mean and covariance, KL at the output; the hard cases (nearly equal
// Gaussians, tiny and large ε, ill-conditioned covariances, d = 1 and d = 256); float inputs;
// inactive rows copied bit for bit; gaussian::kl against the textbook formula. Everything runs on
// the backend (full rows above d = 32 with the workspace troll::workspace_bytes asks for).
//
// One body compiled per backend (as bodies/gaussian_diag_derivatives.hpp): tests/test_gaussian.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_gaussian.cu with backend<cuda_policy> (checked policy) inside its "device"
// suite. Its names live in namespace gaussian_oracle_tests. Include after "gaussian_oracle.hpp",
// <troll/gaussian.hpp>, <troll/workspace.hpp>, "backend.hpp" and the definition of
// troll_test::oracle_backend.

namespace gaussian_oracle_tests {

namespace gauss = troll_test::gauss;
using gauss::real;
using troll::gaussian::gaussian_stats;
using backend = troll_test::oracle_backend;
template <class E>
using buffer = typename backend::template buffer<E>;

/// Whether this instantiation is the CPU's: there the tolerances are the ones the CPU suite has
/// always asserted; on a device each oracle tolerance is widened by the device-vs-CPU bound of
/// docs/cuda.md and tests/cuda/test_cuda_gaussian.cu (1e-8 in double, 2e-4 in float; the KL
/// 1e-10), the device's eigensolver and summation order differing from the CPU's.
constexpr bool cpu_instance = std::is_same<backend, troll_test::backend<troll::cpu_policy>>::value;

template <class T>
double widened(double rtol) {
  return cpu_instance ? rtol : rtol + (std::is_same<T, float>::value ? 2e-4 : 1e-8);
}

/// The backend's policy with the workspace Op needs for one row of dimension d (none for the
/// CPU; above d = 32 for CUDA's full rows).
template <class Op>
using scratch_policy = troll_test::workspace_policy<backend, Op>;

/// One row pair in double, full (factor, d²) or diagonal (std devs, d).
struct pair_row {
  std::size_t d = 0;
  bool full = true;
  std::vector<double> mean, cov, old_mean, old_cov;
  gauss::normal target() const {
    return full ? gauss::normal::from_factor(mean.data(), cov.data(), d)
                : gauss::normal::from_std(mean.data(), cov.data(), d);
  }
  gauss::normal old() const {
    return full ? gauss::normal::from_factor(old_mean.data(), old_cov.data(), d)
                : gauss::normal::from_std(old_mean.data(), old_cov.data(), d);
  }
};

pair_row random_pair(gauss::generator& gen, std::size_t d, bool full, double mean_scale,
                     double spread) {
  pair_row p;
  p.d = d;
  p.full = full;
  p.mean = gen.mean(d, mean_scale);
  p.old_mean = gen.mean(d, mean_scale);
  p.cov = full ? gen.factor(d, spread) : gen.std_dev(d, spread);
  p.old_cov = full ? gen.factor(d, spread) : gen.std_dev(d, spread);
  return p;
}

template <class T>
struct result {
  std::vector<T> mean, cov;
  gaussian_stats stats;
};

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

/// Runs the projection of p (split when eps_cov > 0) in element type T on the backend (outputs
/// start at −7).
template <class T>
result<T> run(const pair_row& p, double eps, double eps_cov = 0.0) {
  namespace g = troll::gaussian;
  namespace op = troll::op;
  const std::size_t d = p.d, cc = p.cov.size();
  buffer<T> m(cast<T>(p.mean)), c(cast<T>(p.cov)), om(cast<T>(p.old_mean)), oc(cast<T>(p.old_cov));
  buffer<T> ym(std::vector<T>(d, T(-7))), yc(std::vector<T>(cc, T(-7)));
  buffer<gaussian_stats> st(1);
  auto in = [](buffer<T>& v, std::size_t cols) {
    return troll::make_batch(static_cast<const T*>(v.get()), 1, cols);
  };
  auto out = [](buffer<T>& v, std::size_t cols) { return troll::make_batch(v.get(), 1, cols); };
  const bool split = eps_cov > 0.0;
  if (p.full && !split)
    g::project_joint(scratch_policy<op::gaussian_project_joint>(1, d).get(), in(m, d), in(c, cc),
                     in(om, d), in(oc, cc), eps, out(ym, d), out(yc, cc), st.get());
  if (p.full && split)
    g::project_split(scratch_policy<op::gaussian_project_split>(1, d).get(), in(m, d), in(c, cc),
                     in(om, d), in(oc, cc), eps, eps_cov, out(ym, d), out(yc, cc), st.get());
  if (!p.full && !split)
    g::project_joint_diag(backend::policy(), in(m, d), in(c, cc), in(om, d), in(oc, cc), eps,
                          out(ym, d), out(yc, cc), st.get());
  if (!p.full && split)
    g::project_split_diag(backend::policy(), in(m, d), in(c, cc), in(om, d), in(oc, cc), eps,
                          eps_cov, out(ym, d), out(yc, cc), st.get());
  result<T> r;
  r.mean = ym.download();
  r.cov = yc.download();
  r.stats = st.download()[0];
  return r;
}

/// max |a − b| / (atol + rtol·max|b|) over the entries: ≤ 1 passes.
real closeness(const gauss::mat& a, const gauss::mat& b, real atol, real rtol) {
  return (a - b).cwiseAbs().maxCoeff() / (atol + rtol * b.cwiseAbs().maxCoeff());
}

/// Checks a projection against the oracle: the status, t* and the written Gaussian.
template <class T>
void check_against_oracle(const pair_row& p, double eps, double eps_cov, double cpu_rtol,
                          const std::string& what) {
  INFO(what, " d=", p.d, " eps=", eps, " eps_cov=", eps_cov);
  const double rtol = widened<T>(cpu_rtol);
  const bool split = eps_cov > 0.0;
  const gauss::normal target = p.target(), old = p.old();
  const result<T> r = run<T>(p, eps, eps_cov);
  const real t = gauss::solve_t(target, old, split ? eps_cov : eps, !split);
  gauss::normal want = gauss::member(target, old, t, !split);
  if (split) {
    const gauss::vec diff = target.mean - old.mean;
    const real m = diff.dot(gauss::inverse(old.cov) * diff) / 2;
    const real kappa = m > eps ? std::sqrt(static_cast<real>(eps) / m) : 1;
    want.mean = old.mean + kappa * diff;
    CHECK(r.stats.mean_kl_before == doctest::Approx(double(m)).epsilon(rtol));
    CHECK(r.stats.omega == doctest::Approx(double(1 / kappa - 1)).epsilon(rtol).scale(1.0));
  }
  if (t == 1) {
    CHECK(r.stats.status == troll::row_status::inactive);
  } else {
    REQUIRE(r.stats.status == troll::row_status::projected);
    CHECK(r.stats.t == doctest::Approx(double(t)).epsilon(rtol));
    CHECK(r.stats.kl_after == doctest::Approx(split ? eps_cov : eps).epsilon(rtol));
  }
  const gauss::normal got = p.full ? gauss::normal::from_factor(r.mean.data(), r.cov.data(), p.d)
                                   : gauss::normal::from_std(r.mean.data(), r.cov.data(), p.d);
  const real scale = std::sqrt(want.cov.diagonal().maxCoeff());
  CHECK(closeness(got.mean, want.mean, rtol * scale, rtol) <= 1);
  CHECK(closeness(got.cov, want.cov, 0, rtol) <= 1);
  if (p.full) {  // the factor is lower-triangular with a positive diagonal
    for (std::size_t i = 0; i < p.d; ++i) {
      CHECK(r.cov[i * p.d + i] > T(0));
      for (std::size_t j = i + 1; j < p.d; ++j) CHECK(r.cov[i * p.d + j] == T(0));
    }
  }
}

TEST_CASE("joint and split projections match the long-double oracle (full and diagonal, double)") {
  gauss::generator gen(14);
  for (const bool full : {true, false}) {
    for (const std::size_t d : {std::size_t(1), std::size_t(2), std::size_t(5), std::size_t(16)}) {
      for (int k = 0; k < 3; ++k) {
        const pair_row p = random_pair(gen, d, full, 1.0, 0.5);
        for (const double eps : {1e-6, 1e-3, 0.05, 1.0, 1e3}) {
          check_against_oracle<double>(p, eps, 0.0, 1e-8, full ? "joint full" : "joint diag");
          check_against_oracle<double>(p, eps, eps * 0.5, 1e-8, full ? "split full" : "split diag");
        }
      }
    }
  }
}

TEST_CASE("hard rows: nearly equal Gaussians, tiny eps, ill-conditioned covariances") {
  gauss::generator gen(7);
  for (const bool full : {true, false}) {
    for (const std::size_t d : {std::size_t(1), std::size_t(8)}) {
      // Nearly equal: the new Gaussian is the old one moved by ~1e-6.
      pair_row p = random_pair(gen, d, full, 1.0, 0.5);
      p.old_mean = p.mean;
      p.old_cov = p.cov;
      for (std::size_t i = 0; i < d; ++i) p.mean[i] += 1e-6 * gen.normal01();
      for (std::size_t i = 0; i < p.cov.size(); ++i)
        if (p.cov[i] != 0.0) p.cov[i] *= 1.0 + 1e-6 * gen.normal01();
      for (const double eps :
           {1e-14, 1e-13, 1e-12})  // below 1e-14 the oracle's own cancellation dominates
        check_against_oracle<double>(p, eps, 0.0, 1e-6, "nearly equal, joint");
      check_against_oracle<double>(p, 1e-14, 1e-14, 1e-6, "nearly equal, split");
      // Tiny eps on a far pair: t* ~ 1e-6.
      const pair_row far = random_pair(gen, d, full, 3.0, 1.0);
      check_against_oracle<double>(far, 1e-12, 0.0, 1e-7, "tiny eps");
      check_against_oracle<double>(far, 1e-12, 1e-12, 1e-7, "tiny eps, split");
      // Ill-conditioned: standard deviations spread over e^{±6}.
      const pair_row ill = random_pair(gen, d, full, 1.0, 2.0);
      for (const double eps : {1e-4, 0.1, 10.0}) {
        check_against_oracle<double>(ill, eps, 0.0, 1e-6, "ill-conditioned");
        check_against_oracle<double>(ill, eps, eps, 1e-6, "ill-conditioned split");
      }
    }
  }
}

TEST_CASE("float inputs agree with the oracle to float accuracy") {
  gauss::generator gen(3);
  for (const bool full : {true, false}) {
    for (const std::size_t d : {std::size_t(1), std::size_t(6)}) {
      pair_row p = random_pair(gen, d, full, 1.0, 0.4);
      // Round the inputs to float so that the oracle sees what troll sees.
      for (auto* v : {&p.mean, &p.cov, &p.old_mean, &p.old_cov})
        for (auto& x : *v) x = static_cast<double>(static_cast<float>(x));
      for (const double eps : {1e-3, 0.1}) {
        check_against_oracle<float>(p, eps, 0.0, 2e-5, "float joint");
        check_against_oracle<float>(p, eps, eps, 2e-5, "float split");
      }
    }
  }
}

TEST_CASE("d = 256: the output lies on the path and on the boundary") {
  gauss::generator gen(256);
  for (const bool full : {true, false}) {
    const std::size_t d = 256;
    const pair_row p = random_pair(gen, d, full, 0.3, 0.2);
    const double eps = 0.5;
    const result<double> r = run<double>(p, eps);
    REQUIRE(r.stats.status == troll::row_status::projected);
    const gauss::normal target = p.target(), old = p.old();
    const gauss::normal got = full ? gauss::normal::from_factor(r.mean.data(), r.cov.data(), d)
                                   : gauss::normal::from_std(r.mean.data(), r.cov.data(), d);
    CHECK(double(gauss::kl(got, old)) == doctest::Approx(eps).epsilon(1e-8));
    const gauss::normal on_path = gauss::member(target, old, r.stats.t);
    CHECK(closeness(got.cov, on_path.cov, 0, 1e-9) <= 1);
    CHECK(closeness(got.mean, on_path.mean, 1e-9, 1e-9) <= 1);
  }
}

TEST_CASE("inactive rows are copied bit for bit; stats describe them") {
  gauss::generator gen(5);
  for (const bool full : {true, false}) {
    const pair_row p = random_pair(gen, 4, full, 0.1, 0.1);
    const result<double> r = run<double>(p, 1e6);
    CHECK(r.stats.status == troll::row_status::inactive);
    CHECK(r.stats.t == 1.0);
    CHECK(r.stats.iterations == 0);
    CHECK(r.stats.kl_after == r.stats.kl_before);
    CHECK(r.mean == p.mean);
    CHECK(r.cov == p.cov);
    const result<double> s = run<double>(p, 1e6, 1e6);
    CHECK(s.mean == p.mean);
    CHECK(s.cov == p.cov);
    CHECK(s.stats.omega == 0.0);
  }
}

TEST_CASE("gaussian::kl matches the textbook formula") {
  gauss::generator gen(11);
  for (const bool full : {true, false}) {
    for (const std::size_t d : {std::size_t(1), std::size_t(7), std::size_t(40)}) {
      const pair_row p = random_pair(gen, d, full, 1.0, 0.7);
      const std::size_t cc = p.cov.size();
      buffer<double> m(p.mean), c(p.cov), om(p.old_mean), oc(p.old_cov),
          out(std::vector<double>{-1.0});
      auto v = [](buffer<double>& x, std::size_t cols) {
        return troll::make_batch(static_cast<const double*>(x.get()), 1, cols);
      };
      if (full) {
        troll::gaussian::kl(scratch_policy<troll::op::gaussian_kl>(1, d).get(), v(m, d), v(c, cc),
                            v(om, d), v(oc, cc), out.get());
      } else {
        troll::gaussian::kl_diag(backend::policy(), v(m, d), v(c, cc), v(om, d), v(oc, cc),
                                 out.get());
      }
      const double value = out.download()[0];
      const double tol = cpu_instance ? 1e-11 : 1e-11 + 1e-10;
      CHECK(value == doctest::Approx(double(gauss::kl(p.target(), p.old()))).epsilon(tol));
    }
  }
}

}  // namespace gaussian_oracle_tests
