// tests/bodies/gaussian_diag_derivatives.hpp — the Gaussian KL and the diagonal projections'
// VJP and JVP on one backend, against independent oracles: the KL against the long-double
// textbook formula (gaussian_oracle.hpp), the JVP against a five-point central difference of the
// double CPU forward along a random direction of every input and the bounds, the VJP against the
// same directional derivative (⟨u, J v⟩ = ⟨Jᵀu, v⟩), and bad rows (a typed error naming the row,
// nothing written). One body per backend: tests/test_gaussian_diag_derivatives.cpp includes it
// with troll_test::oracle_backend = backend<cpu_policy>, tests/cuda/test_cuda_gaussian_derivatives.cu
// with backend<cuda_policy> (checked policy) inside its "device" suite. Batches hold d > 32 so a
// warp's lanes take several coordinates each. Include after "gaussian_oracle.hpp", "backend.hpp",
// "gaussian_narrow_axis_reference.hpp" and the definition of troll_test::oracle_backend.

namespace {

using backend = troll_test::oracle_backend;
using stats_t = troll::gaussian::gaussian_stats;

/// N diagonal row pairs of dimension d; every third row nearly equal to its old row (inactive).
struct diag_batch {
  std::size_t n = 0, d = 0;
  std::vector<double> mean, sd, old_mean, old_sd;
};

diag_batch make_diag(std::size_t n, std::size_t d, unsigned seed) {
  troll_test::gauss::generator gen(seed);
  diag_batch b;
  b.n = n;
  b.d = d;
  for (std::size_t r = 0; r < n; ++r) {
    const double scale = r % 3 == 2 ? 1e-4 : 0.3;
    const std::vector<double> m = gen.mean(d, 1.0), om = gen.mean(d, 1.0);
    const std::vector<double> s = gen.std_dev(d, 0.3), os = gen.std_dev(d, 0.3);
    for (std::size_t i = 0; i < d; ++i) {
      b.old_mean.push_back(om[i]);
      b.mean.push_back(om[i] + scale * (m[i] - om[i]));
      b.old_sd.push_back(os[i]);
      b.sd.push_back(os[i] * std::exp(scale * std::log(s[i] / os[i])));
    }
  }
  return b;
}

/// b + h·v, entry by entry (the bounds travel separately).
diag_batch shifted(const diag_batch& b, double h, const diag_batch& v) {
  diag_batch s = b;
  for (std::size_t i = 0; i < b.mean.size(); ++i) {
    s.mean[i] += h * v.mean[i];
    s.sd[i] += h * v.sd[i];
    s.old_mean[i] += h * v.old_mean[i];
    s.old_sd[i] += h * v.old_sd[i];
  }
  return s;
}

troll::batch_view<const double> view(const std::vector<double>& v, std::size_t n, std::size_t d) {
  return troll::make_batch(v.data(), n, d);
}

struct diag_forward {
  std::vector<double> mean, sd;
  std::vector<stats_t> stats;
};

/// The double CPU forward (eps_mean: joint ε or split ε_μ).
diag_forward cpu_forward(const diag_batch& b, bool split, double eps_mean, double eps_cov) {
  diag_forward f;
  f.mean.resize(b.n * b.d);
  f.sd.resize(b.n * b.d);
  f.stats.resize(b.n);
  namespace g = troll::gaussian;
  const auto m = view(b.mean, b.n, b.d), s = view(b.sd, b.n, b.d);
  const auto om = view(b.old_mean, b.n, b.d), os = view(b.old_sd, b.n, b.d);
  auto ym = troll::make_batch(f.mean.data(), b.n, b.d), ys = troll::make_batch(f.sd.data(), b.n, b.d);
  if (split) {
    g::project_split_diag(troll::cpu, m, s, om, os, eps_mean, eps_cov, ym, ys, f.stats.data());
  } else {
    g::project_joint_diag(troll::cpu, m, s, om, os, eps_mean, ym, ys, f.stats.data());
  }
  return f;
}

/// A direction of every input and bound: entries N(0, 1)·scale of their input, bounds ±.
struct direction {
  diag_batch v;
  double eps = 0.0, eps_mean = 0.0;  // split: ε_Σ', ε_μ'; joint: eps_mean carries ε'
};

direction make_direction(const diag_batch& b, unsigned seed) {
  troll_test::gauss::generator gen(seed);
  direction dir;
  dir.v = b;
  for (std::size_t i = 0; i < b.mean.size(); ++i) {
    dir.v.mean[i] = gen.normal01();
    dir.v.sd[i] = 0.2 * b.sd[i] * gen.normal01();
    dir.v.old_mean[i] = gen.normal01();
    dir.v.old_sd[i] = 0.2 * b.old_sd[i] * gen.normal01();
  }
  dir.eps = 0.01 * gen.normal01();
  dir.eps_mean = 0.01 * gen.normal01();
  return dir;
}

/// The five-point central difference of the CPU forward along `dir` (outputs: mean then sd).
std::vector<double> fd_directional(const diag_batch& b, bool split, double eps_mean, double eps_cov,
                                   const direction& dir, double h) {
  auto at = [&](double k) {
    const double em = eps_mean + k * h * dir.eps_mean;
    const double ec = eps_cov + k * h * dir.eps;
    const diag_forward f = cpu_forward(shifted(b, k * h, dir.v), split, em, ec);
    std::vector<double> flat = f.mean;
    flat.insert(flat.end(), f.sd.begin(), f.sd.end());
    return flat;
  };
  const std::vector<double> p1 = at(1), m1 = at(-1), p2 = at(2), m2 = at(-2);
  std::vector<double> d(p1.size());
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = (8.0 * (p1[i] - m1[i]) - (p2[i] - m2[i])) / (12.0 * h);
  return d;
}

bool close(double got, double want, double atol, double rtol) {
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

/// The backend's JVP along `dir` (outputs: mean then sd tangents).
std::vector<double> backend_jvp(const diag_batch& b, bool split, double eps_mean, double eps_cov,
                                const diag_forward& f, const direction& dir) {
  using buf = backend::buffer<double>;
  buf m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), ym(f.mean), ys(f.sd);
  buf tm(dir.v.mean), ts(dir.v.sd), tom(dir.v.old_mean), tos(dir.v.old_sd);
  buf out_m(b.n * b.d), out_s(b.n * b.d);
  backend::buffer<stats_t> st(f.stats);
  const std::size_t n = b.n, d = b.d;
  auto in = [&](buf& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
  namespace g = troll::gaussian;
  g::gaussian_tangents<double> tan{in(tm), in(ts), in(tom), in(tos), split ? dir.eps : dir.eps_mean,
                                   split ? dir.eps_mean : 0.0};
  if (split) {
    g::project_split_diag_jvp(backend::policy(), in(m), in(s), in(om), in(os), eps_mean, eps_cov, in(ym), in(ys),
                              st.get(), tan, troll::make_batch(out_m.get(), n, d),
                              troll::make_batch(out_s.get(), n, d));
  } else {
    g::project_joint_diag_jvp(backend::policy(), in(m), in(s), in(om), in(os), eps_mean, in(ym), in(ys), st.get(),
                              tan, troll::make_batch(out_m.get(), n, d), troll::make_batch(out_s.get(), n, d));
  }
  std::vector<double> flat = out_m.download();
  const std::vector<double> sd = out_s.download();
  flat.insert(flat.end(), sd.begin(), sd.end());
  return flat;
}

/// The backend's VJP of upstream u (mean then sd), contracted with `dir` row by row.
std::vector<double> backend_vjp_dot(const diag_batch& b, bool split, double eps_mean, double eps_cov,
                                    const diag_forward& f, const std::vector<double>& u, const direction& dir) {
  using buf = backend::buffer<double>;
  const std::size_t n = b.n, d = b.d, nd = n * d;
  buf m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), ym(f.mean), ys(f.sd);
  buf um(std::vector<double>(u.begin(), u.begin() + long(nd))), us(std::vector<double>(u.begin() + long(nd), u.end()));
  buf gm(nd), gs(nd), gom(nd), gos(nd), ge(n), gem(n);
  backend::buffer<stats_t> st(f.stats);
  auto in = [&](buf& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
  auto out = [&](buf& x) { return troll::make_batch(x.get(), n, d); };
  namespace g = troll::gaussian;
  const g::gaussian_grads<double> grads{out(gm), out(gs), out(gom), out(gos), ge.get(), gem.get()};
  if (split) {
    g::project_split_diag_backward(backend::policy(), in(m), in(s), in(om), in(os), eps_mean, eps_cov, in(ym),
                                   in(ys), st.get(), in(um), in(us), grads);
  } else {
    g::project_joint_diag_backward(backend::policy(), in(m), in(s), in(om), in(os), eps_mean, in(ym), in(ys),
                                   st.get(), in(um), in(us), grads);
  }
  const std::vector<double> hm = gm.download(), hs = gs.download(), hom = gom.download(), hos = gos.download();
  const std::vector<double> he = ge.download(), hem = gem.download();
  std::vector<double> dots(n, 0.0);
  for (std::size_t r = 0; r < n; ++r) {
    for (std::size_t i = r * d; i < (r + 1) * d; ++i)
      dots[r] += hm[i] * dir.v.mean[i] + hs[i] * dir.v.sd[i] + hom[i] * dir.v.old_mean[i] + hos[i] * dir.v.old_sd[i];
    dots[r] += split ? he[r] * dir.eps + hem[r] * dir.eps_mean : he[r] * dir.eps_mean;
  }
  return dots;
}

void check_derivatives(std::size_t n, std::size_t d, bool split, unsigned seed) {
  const double eps_mean = 0.05, eps_cov = 0.03;
  const diag_batch b = make_diag(n, d, seed);
  const diag_forward f = cpu_forward(b, split, eps_mean, eps_cov);
  std::size_t projected = 0;
  for (const stats_t& s : f.stats) projected += s.status == troll::row_status::projected;
  REQUIRE(projected >= n / 2);
  const direction dir = make_direction(b, seed + 1);
  const std::vector<double> fd = fd_directional(b, split, eps_mean, eps_cov, dir, 1e-4);
  const std::vector<double> jvp = backend_jvp(b, split, eps_mean, eps_cov, f, dir);
  REQUIRE(jvp.size() == fd.size());
  for (std::size_t i = 0; i < fd.size(); ++i) {
    INFO("entry " << i << " (row " << (i % (n * d)) / d << ")");
    CHECK(close(jvp[i], fd[i], 1e-7, 1e-6));
  }
  troll_test::gauss::generator gen(seed + 2);
  std::vector<double> u(fd.size());
  for (double& x : u) x = gen.normal01();
  const std::vector<double> dots = backend_vjp_dot(b, split, eps_mean, eps_cov, f, u, dir);
  for (std::size_t r = 0; r < n; ++r) {
    double want = 0.0, scale = 0.0;
    for (std::size_t i = r * d; i < (r + 1) * d; ++i) {
      for (std::size_t k : {i, i + n * d}) {
        want += u[k] * fd[k];
        scale += std::fabs(u[k] * fd[k]);
      }
    }
    INFO("row " << r);
    CHECK(close(dots[r], want, 1e-7 * (1.0 + scale), 1e-6));
  }
}

}  // namespace

TEST_CASE("Gaussian diag JVP and VJP against central differences of the CPU forward") {
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(3), std::size_t(40), std::size_t(300)}) {
      CAPTURE(split);
      CAPTURE(d);
      check_derivatives(12, d, split, static_cast<unsigned>(7 * d + split));
    }
  }
}

namespace {

/// The table's rows (gaussian_narrow_axis_reference.hpp): the backend's JVP along each listed
/// input and its VJP on the narrow axes' outputs against mpmath's Jacobian columns.
void check_narrow_axis_rows() {
  // The narrow axis holds nearly all of dKL/dt: its σ̃ derivatives are written from the other
  // coordinates' shares (gaussian_diag_derivatives.hpp, "The dominant coordinate"). The textbook
  // form kept ~u/r² of their digits (3.9e-5 relative at r = 1e-6, the wrong sign at r = 1e-8).
  // d = 40: the narrow axis sits at index 37 or 5 (another lane of the device's warp than lane 0),
  // and the split row has a second narrow axis.
  for (const troll_test::gaussian_narrow_axis_case& c : troll_test::gaussian_narrow_axis_cases()) {
    const std::size_t d = c.mean.size();
    diag_batch b;
    b.n = 1;
    b.d = d;
    b.mean = c.mean;
    b.sd = c.sd;
    b.old_mean = c.old_mean;
    b.old_sd = c.old_sd;
    const double eps_mean = c.eps, eps_cov = c.eps_cov;
    const diag_forward f = cpu_forward(b, c.split, eps_mean, eps_cov);
    REQUIRE(f.stats[0].status == troll::row_status::projected);
    CAPTURE(d);
    CAPTURE(c.split);
    auto unit = [&](std::size_t input) {
      direction dir;
      dir.v = b;
      for (std::vector<double>* v : {&dir.v.mean, &dir.v.sd, &dir.v.old_mean, &dir.v.old_sd})
        std::fill(v->begin(), v->end(), 0.0);
      std::vector<double>* block[4] = {&dir.v.mean, &dir.v.sd, &dir.v.old_mean, &dir.v.old_sd};
      (*block[input / d])[input % d] = 1.0;
      return dir;
    };
    // Outputs the VJP is checked on: all of a small row, the narrow axes' of d = 40.
    std::vector<std::size_t> outputs;
    for (std::size_t r = 0; r < 2 * d; ++r) {
      bool listed = d <= 3;
      for (std::size_t col : c.cols) listed = listed || (col < d && r % d == col);
      if (listed) outputs.push_back(r);
    }
    for (std::size_t j = 0; j < c.cols.size(); ++j) {
      CAPTURE(c.cols[j]);
      const std::vector<double>& want = c.jac[j];
      double scale = 0.0;
      for (double x : want) scale = std::max(scale, std::fabs(x));
      const direction dir = unit(c.cols[j]);
      const std::vector<double> jvp = backend_jvp(b, c.split, eps_mean, eps_cov, f, dir);
      for (std::size_t r = 0; r < 2 * d; ++r) {
        CAPTURE(r);
        CHECK(close(jvp[r], want[r], 1e-12 * scale, 1e-9));
      }
      for (std::size_t r : outputs) {
        CAPTURE(r);
        std::vector<double> u(2 * d, 0.0);
        u[r] = 1.0;
        const double got = backend_vjp_dot(b, c.split, eps_mean, eps_cov, f, u, dir)[0];
        CHECK(close(got, want[r], 1e-12 * scale, 1e-9));
      }
    }
  }
}

}  // namespace

TEST_CASE("Gaussian diag VJP and JVP do not depend on a common shift of the means") {
  // The projections commute with a shift of both means, so their derivatives do not depend on
  // it. Means on a 2^-12 grid shifted by 2^40 (~1.1e12; every sum exact, so both batches have the
  // same μ̃ − μ° and the same t*): the derivatives must agree to double's digits. Before the
  // thirty-fourth session the diagonal joint derivatives carried ~u·|μ°|/σ° (2e-4 here).
  for (const bool split : {false, true}) {
    CAPTURE(split);
    const double eps_mean = 0.05, eps_cov = 0.03, shift = std::ldexp(1.0, 40);
    diag_batch b = make_diag(6, 40, 91);
    for (std::vector<double>* m : {&b.mean, &b.old_mean})
      for (double& x : *m) x = std::ldexp(std::round(std::ldexp(x, 12)), -12);
    diag_batch far = b;
    for (std::vector<double>* m : {&far.mean, &far.old_mean})
      for (double& x : *m) x += shift;
    const diag_forward f = cpu_forward(b, split, eps_mean, eps_cov), g = cpu_forward(far, split, eps_mean, eps_cov);
    std::size_t projected = 0;
    for (std::size_t r = 0; r < b.n; ++r) {
      REQUIRE(f.stats[r].t == g.stats[r].t);
      projected += f.stats[r].status == troll::row_status::projected;
    }
    REQUIRE(projected >= b.n / 2);
    const auto dir = make_direction(b, 92);
    const std::vector<double> near_jvp = backend_jvp(b, split, eps_mean, eps_cov, f, dir),
                              far_jvp = backend_jvp(far, split, eps_mean, eps_cov, g, dir);
    double scale = 0.0, worst = 0.0;
    for (double x : near_jvp) scale = std::max(scale, std::fabs(x));
    for (std::size_t i = 0; i < near_jvp.size(); ++i) worst = std::max(worst, std::fabs(far_jvp[i] - near_jvp[i]));
    CHECK(worst <= 1e-13 * scale);
    // The VJP contracted with several directions (each a row's ⟨Jᵀu, v⟩).
    troll_test::gauss::generator gen(93);
    std::vector<double> u(near_jvp.size());
    for (double& x : u) x = gen.normal01();
    for (unsigned k = 0; k < 3; ++k) {
      const auto v = make_direction(b, 94 + k);
      const std::vector<double> near_dot = backend_vjp_dot(b, split, eps_mean, eps_cov, f, u, v),
                                far_dot = backend_vjp_dot(far, split, eps_mean, eps_cov, g, u, v);
      for (std::size_t r = 0; r < b.n; ++r) {
        INFO("row " << r);
        CHECK(std::fabs(far_dot[r] - near_dot[r]) <= 1e-13 * (1.0 + std::fabs(near_dot[r])));
      }
    }
  }
}

TEST_CASE("Gaussian diag VJP and JVP with a new standard deviation 1e-6 ... 1e-8 of the old: against mpmath") {
  check_narrow_axis_rows();
}

TEST_CASE("Gaussian KL (diagonal, and full at d <= 32) against the long-double formula") {
  const std::size_t n = 9;
  for (std::size_t d : {std::size_t(1), std::size_t(5), std::size_t(32), std::size_t(100)}) {
    CAPTURE(d);
    const diag_batch b = make_diag(n, d, static_cast<unsigned>(d));
    using buf = backend::buffer<double>;
    buf m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), out(n);
    auto in = [&](buf& x, std::size_t cols) { return troll::make_batch(static_cast<const double*>(x.get()), n, cols); };
    troll::gaussian::kl_diag(backend::policy(), in(m, d), in(s, d), in(om, d), in(os, d), out.get());
    const std::vector<double> got = out.download();
    for (std::size_t r = 0; r < n; ++r) {
      namespace o = troll_test::gauss;
      const o::normal p = o::normal::from_std(&b.mean[r * d], &b.sd[r * d], d);
      const o::normal q = o::normal::from_std(&b.old_mean[r * d], &b.old_sd[r * d], d);
      CHECK(close(got[r], static_cast<double>(o::kl(p, q)), 1e-15, 1e-11));
    }
    if (d > 32) continue;
    // The same rows as full factors: random lower triangles scaled by the std devs.
    troll_test::gauss::generator gen(static_cast<unsigned>(d + 100));
    std::vector<double> l(n * d * d), ol(n * d * d);
    for (std::size_t r = 0; r < n; ++r) {
      const std::vector<double> a = gen.factor(d, 0.3), c = gen.factor(d, 0.3);
      for (std::size_t k = 0; k < d * d; ++k) {
        ol[r * d * d + k] = c[k];
        l[r * d * d + k] = c[k] + (r % 3 == 2 ? 1e-5 : 0.3) * (a[k] - c[k]);
      }
    }
    buf lf(l), olf(ol), out_full(n);
    troll::gaussian::kl(backend::policy(), in(m, d), in(lf, d * d), in(om, d), in(olf, d * d), out_full.get());
    const std::vector<double> got_full = out_full.download();
    for (std::size_t r = 0; r < n; ++r) {
      namespace o = troll_test::gauss;
      const o::normal p = o::normal::from_factor(&b.mean[r * d], &l[r * d * d], d);
      const o::normal q = o::normal::from_factor(&b.old_mean[r * d], &ol[r * d * d], d);
      CHECK(close(got_full[r], static_cast<double>(o::kl(p, q)), 1e-13, 1e-9));
    }
  }
}

TEST_CASE("Gaussian kl_diag with ratios whose gamma - 1 overflows a double, against the long-double formula") {
  // σ̃/σ° from 1e-155 to 1e-310 on some axes: γ − 1 = 1/r² − 1 is beyond the doubles, and kl_diag
  // adds those axes' terms ½[r² − 1 − 2 log r + b²] exactly (before: γ − 1 was taken as the
  // largest double, KL 354.4 for 460.0 at r = 1e-200).
  const std::size_t n = 6, d = 40;
  diag_batch b = make_diag(n, d, 77);
  const double ratios[] = {1e-155, 1e-160, 1e-200, 1e-300, 1e-310};
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t i = r % 3; i < d; i += 13) b.sd[r * d + i] = ratios[(r + i) % 5] * b.old_sd[r * d + i];
  using buf = backend::buffer<double>;
  buf m(b.mean), s(b.sd), om(b.old_mean), os(b.old_sd), out(n);
  auto in = [&](buf& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
  troll::gaussian::kl_diag(backend::policy(), in(m), in(s), in(om), in(os), out.get());
  const std::vector<double> got = out.download();
  for (std::size_t r = 0; r < n; ++r) {
    long double want = 0.0L;
    for (std::size_t i = r * d; i < (r + 1) * d; ++i) {
      const long double q = static_cast<long double>(b.sd[i]) / b.old_sd[i];
      const long double y = (static_cast<long double>(b.mean[i]) - b.old_mean[i]) / b.old_sd[i];
      want += 0.5L * (q * q - 1.0L - 2.0L * std::log(q) + y * y);
    }
    CAPTURE(r);
    CHECK(close(got[r], static_cast<double>(want), 0.0, 1e-14));
  }
}

TEST_CASE("Gaussian kl of full rows with a tiny eigenvalue, against the long-double formula") {
  // Old factor I, new factor lower triangular with one tiny diagonal entry r and an entry below
  // it (not graded): the factorisation knows the smallest eigenvalue only to an absolute floor;
  // kl takes the log-determinant from the diagonals there (d = 3, r = 1e-100: 230.6, not 77.4).
  // d = 40 takes the device's block kernel.
  const double ratios[] = {1e-6, 1e-20, 1e-100, 1e-200};
  const std::size_t n = 4;
  for (const std::size_t d : {std::size_t(3), std::size_t(40)}) {
    CAPTURE(d);
    std::vector<double> m(n * d), om(n * d, 0.0), l(n * d * d, 0.0), lo(n * d * d, 0.0);
    for (std::size_t r = 0; r < n; ++r) {
      double* f = &l[r * d * d];
      for (std::size_t i = 0; i < d; ++i) {
        f[i * d + i] = 1.0 + 0.1 * double(i % 5);
        if (i > 0) f[i * d + i - 1] = 0.05 * double(i % 3) - 0.05;
        lo[r * d * d + i * d + i] = 1.0;
        m[r * d + i] = 0.25 * double(i % 4 + r) - 0.5;
      }
      f[0] = 0.7, f[d] = 0.2, f[d + 1] = ratios[r], f[2 * d] = -0.1, f[2 * d + 1] = 0.3, f[2 * d + 2] = 1.2;
    }
    using buf = backend::buffer<double>;
    buf bm(m), bom(om), bl(l), blo(lo), out(n);
    auto in = [&](buf& x, std::size_t cols) { return troll::make_batch(static_cast<const double*>(x.get()), n, cols); };
    troll::gaussian::kl(backend::policy(), in(bm, d), in(bl, d * d), in(bom, d), in(blo, d * d), out.get());
    const std::vector<double> got = out.download();
    for (std::size_t r = 0; r < n; ++r) {
      long double want = -static_cast<long double>(d);  // tr(Σ̃) − d − log det Σ̃ + |μ̃|², halved
      for (std::size_t i = 0; i < d; ++i) {
        for (std::size_t j = 0; j <= i; ++j)
          want += static_cast<long double>(l[r * d * d + i * d + j]) * l[r * d * d + i * d + j];
        want -= 2.0L * std::log(static_cast<long double>(l[r * d * d + i * d + i]));
        want += static_cast<long double>(m[r * d + i]) * m[r * d + i];
      }
      CAPTURE(r);
      CHECK(close(got[r], static_cast<double>(0.5L * want), 0.0, 1e-14));
    }
  }
}

TEST_CASE("Gaussian diag derivatives: a bad row throws naming it, before anything is written") {
  const std::size_t n = 4, d = 35;
  const double eps = 0.05;
  const diag_batch b = make_diag(n, d, 5);
  const diag_forward f = cpu_forward(b, false, eps, eps);
  using buf = backend::buffer<double>;
  namespace g = troll::gaussian;
  const double sentinel = 12345.0;
  for (int kind = 0; kind < 4; ++kind) {
    CAPTURE(kind);
    diag_batch bad = b;
    std::vector<stats_t> stats = f.stats;
    if (kind == 0) bad.old_sd[2 * d + 7] = -1.0;                                     // row 2: std dev ≤ 0
    if (kind == 1) bad.mean[2 * d + 3] = std::numeric_limits<double>::quiet_NaN();  // row 2: NaN
    if (kind == 2) stats[2].status = troll::row_status::not_converged;              // row 2: unusable stats
    if (kind == 3) bad.sd[2 * d + 9] = 1e-200 * bad.old_sd[2 * d + 9];  // row 2: γ − 1 beyond the doubles
    buf m(bad.mean), s(bad.sd), om(bad.old_mean), os(bad.old_sd), ym(f.mean), ys(f.sd);
    buf gm(std::vector<double>(n * d, sentinel)), ge(std::vector<double>(n, sentinel));
    backend::buffer<stats_t> st(stats);
    auto in = [&](buf& x) { return troll::make_batch(static_cast<const double*>(x.get()), n, d); };
    const g::gaussian_grads<double> grads{troll::make_batch(gm.get(), n, d), {}, {}, {}, ge.get(), nullptr};
    bool threw = false;
    try {
      g::project_joint_diag_backward(backend::policy(), in(m), in(s), in(om), in(os), eps, in(ym), in(ys), st.get(),
                                     in(ym), in(ys), grads);
    } catch (const troll::domain_error& e) {
      threw = true;
      CHECK(e.row() == 2);
      CHECK(std::string(e.what()).find("row 2") != std::string::npos);
    }
    CHECK(threw);
    const std::vector<double> hm = gm.download(), he = ge.download();
    CHECK(std::all_of(hm.begin(), hm.end(), [&](double x) { return x == sentinel; }));
    CHECK(std::all_of(he.begin(), he.end(), [&](double x) { return x == sentinel; }));
    if (kind >= 2) continue;  // kl needs no stats, and takes a γ beyond the doubles exactly
    buf out(std::vector<double>(n, sentinel));
    CHECK_THROWS_AS(g::kl_diag(backend::policy(), in(m), in(s), in(om), in(os), out.get()), troll::domain_error);
    const std::vector<double> ho = out.download();
    CHECK(std::all_of(ho.begin(), ho.end(), [&](double x) { return x == sentinel; }));
  }
}

TEST_CASE("Gaussian diag VJP, JVP and KL in float agree with double") {
  const std::size_t n = 6, d = 45;
  const double eps = 0.05;
  const diag_batch b = make_diag(n, d, 77);
  namespace g = troll::gaussian;
  auto to_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  // The double reference, on the CPU.
  const diag_forward f = cpu_forward(b, false, eps, eps);
  std::vector<double> ref_gm(n * d), ref_gs(n * d), ref_e(n), ref_tm(n * d), ref_ts(n * d), ref_kl(n);
  {
    const g::gaussian_grads<double> gr{troll::make_batch(ref_gm.data(), n, d), troll::make_batch(ref_gs.data(), n, d),
                                       {}, {}, ref_e.data(), nullptr};
    g::project_joint_diag_backward(troll::cpu, view(b.mean, n, d), view(b.sd, n, d), view(b.old_mean, n, d),
                                   view(b.old_sd, n, d), eps, view(f.mean, n, d), view(f.sd, n, d), f.stats.data(),
                                   view(f.mean, n, d), view(f.sd, n, d), gr);
    const g::gaussian_tangents<double> tan{view(b.sd, n, d), view(b.mean, n, d), {}, {}, 0.01, 0.0};
    g::project_joint_diag_jvp(troll::cpu, view(b.mean, n, d), view(b.sd, n, d), view(b.old_mean, n, d),
                              view(b.old_sd, n, d), eps, view(f.mean, n, d), view(f.sd, n, d), f.stats.data(), tan,
                              troll::make_batch(ref_tm.data(), n, d), troll::make_batch(ref_ts.data(), n, d));
    g::kl_diag(troll::cpu, view(b.mean, n, d), view(b.sd, n, d), view(b.old_mean, n, d), view(b.old_sd, n, d),
               ref_kl.data());
  }
  // float on the backend, from the float forward on the CPU.
  const std::vector<float> m = to_float(b.mean), s = to_float(b.sd), om = to_float(b.old_mean),
                           os = to_float(b.old_sd);
  std::vector<float> ym(n * d), ys(n * d);
  std::vector<stats_t> st(n);
  auto fin = [&](const std::vector<float>& v) { return troll::make_batch(v.data(), n, d); };
  g::project_joint_diag(troll::cpu, fin(m), fin(s), fin(om), fin(os), eps, troll::make_batch(ym.data(), n, d),
                        troll::make_batch(ys.data(), n, d), st.data());
  using fbuf = backend::buffer<float>;
  fbuf dm(m), ds(s), dom(om), dos(os), dym(ym), dys(ys), gm(n * d), gs(n * d), tm(n * d), ts(n * d);
  backend::buffer<double> ge(n), kl(n);
  backend::buffer<stats_t> dst(st);
  auto in = [&](fbuf& x) { return troll::make_batch(static_cast<const float*>(x.get()), n, d); };
  const g::gaussian_grads<float> gr{troll::make_batch(gm.get(), n, d), troll::make_batch(gs.get(), n, d), {}, {},
                                    ge.get(), nullptr};
  g::project_joint_diag_backward(backend::policy(), in(dm), in(ds), in(dom), in(dos), eps, in(dym), in(dys),
                                 dst.get(), in(dym), in(dys), gr);
  const g::gaussian_tangents<float> tan{in(ds), in(dm), {}, {}, 0.01, 0.0};
  g::project_joint_diag_jvp(backend::policy(), in(dm), in(ds), in(dom), in(dos), eps, in(dym), in(dys), dst.get(),
                            tan, troll::make_batch(tm.get(), n, d), troll::make_batch(ts.get(), n, d));
  g::kl_diag(backend::policy(), in(dm), in(ds), in(dom), in(dos), kl.get());
  auto compare = [&](const std::vector<float>& got, const std::vector<double>& want, const char* what) {
    double scale = 0.0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO(what << " entry " << i);
      CHECK(close(double(got[i]), want[i], 2e-3 * scale, 2e-3));
    }
  };
  compare(gm.download(), ref_gm, "grad mean");
  compare(gs.download(), ref_gs, "grad std");
  compare(tm.download(), ref_tm, "tangent mean");
  compare(ts.download(), ref_ts, "tangent std");
  const std::vector<double> he = ge.download(), hk = kl.download();
  for (std::size_t r = 0; r < n; ++r) {
    CHECK(close(he[r], ref_e[r], 2e-3 * (1.0 + std::fabs(ref_e[r])), 2e-3));
    CHECK(close(hk[r], ref_kl[r], 1e-6, 1e-5));
  }
}
