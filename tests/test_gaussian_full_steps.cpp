// tests/test_gaussian_full_steps.cpp — the full-covariance VJP and JVP written as plain-array
// matrix steps (detail/gaussian_full_derivatives.hpp, the code the CUDA backend runs with a warp
// per row) run on the host and compared with the CPU backend's Eigen implementation
// (gaussian_backward / gaussian_jvp), row by row, joint and split, projected and inactive rows.
// The Eigen version is itself checked against finite differences of the long-double oracle
// (test_gaussian_backward.cpp), so this ties the shared steps to that oracle without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "support/gaussian_oracle.hpp"
#include "troll/detail/gaussian_full_derivatives.hpp"
#include "troll/detail/gaussian_full_forward.hpp"
#include "troll/detail/gaussian_jacobi.hpp"
#include "troll/gaussian.hpp"

namespace {

namespace g = troll::gaussian;
namespace gauss = troll_test::gauss;

/// |a − b| ≤ atol + rtol·max|ref| entry by entry (the scale of the whole vector: entries that
/// cancel to near 0 are compared at the vector's scale).
void check_close(const std::vector<double>& got, const std::vector<double>& ref, double rtol) {
  REQUIRE(got.size() == ref.size());
  double scale = 0.0;
  for (double x : ref) scale = std::max(scale, std::fabs(x));
  for (std::size_t i = 0; i < ref.size(); ++i) {
    CAPTURE(i);
    CHECK(std::fabs(got[i] - ref[i]) <= 1e-12 + rtol * scale);
  }
}

struct batch {
  std::size_t n = 4, d = 0;
  std::vector<double> m, l, om, ol, ym, yl, saved;
  std::vector<g::gaussian_stats> st;
};

batch make_batch(std::size_t d, bool split, unsigned seed) {
  batch b;
  b.d = d;
  const std::size_t n = b.n, dd = d * d;
  gauss::generator gen(seed);
  for (std::size_t r = 0; r < n; ++r) {
    const double scale = r == 2 ? 1e-4 : 1.0;  // row 2 inactive
    const std::vector<double> a = gen.mean(d, 1.0), c = gen.mean(d, 1.0), f = gen.factor(d, 0.3),
                              e = gen.factor(d, 0.3);
    for (std::size_t i = 0; i < d; ++i) b.om.push_back(c[i]), b.m.push_back(c[i] + scale * (a[i] - c[i]));
    for (std::size_t i = 0; i < dd; ++i) b.ol.push_back(e[i]), b.l.push_back(e[i] + scale * (f[i] - e[i]));
  }
  b.ym.resize(n * d);
  b.yl.resize(n * dd);
  b.st.resize(n);
  b.saved.resize(n * g::saved_factorisation<double>::saved_doubles(d));
  const g::saved_factorisation<double> save{b.saved.data(), n, d};
  auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
  if (split)
    g::project_split(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05, 0.03,
                     troll::make_batch(b.ym.data(), n, d), troll::make_batch(b.yl.data(), n, dd), b.st.data(), {},
                     save);
  else
    g::project_joint(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05,
                     troll::make_batch(b.ym.data(), n, d), troll::make_batch(b.yl.data(), n, dd), b.st.data(), {},
                     save);
  return b;
}

/// The row's scratch with the factorisation in place (L°, then V, g, b from the saved one).
std::vector<double> scratch_for(const batch& b, std::size_t r) {
  const std::size_t d = b.d, dd = d * d;
  std::vector<double> ws(troll::detail::full_scratch::doubles(d), 0.0);
  const troll::detail::full_scratch w{ws.data(), static_cast<int>(d)};
  const double* saved = b.saved.data() + r * g::saved_factorisation<double>::saved_doubles(d);
  std::copy(b.ol.begin() + static_cast<std::ptrdiff_t>(r * dd), b.ol.begin() + static_cast<std::ptrdiff_t>((r + 1) * dd),
            w.mat(0));
  std::copy(saved, saved + dd, w.mat(1));
  std::copy(saved + dd, saved + dd + d, w.vec(0));
  std::copy(saved + dd + d, saved + dd + 2 * d, w.vec(1));
  return ws;
}

}  // namespace

TEST_CASE("the shared full-covariance VJP steps match the Eigen backward") {
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(3), std::size_t(8), std::size_t(24)}) {
      CAPTURE(split);
      CAPTURE(d);
      const batch b = make_batch(d, split, static_cast<unsigned>(7 * d + split));
      const std::size_t n = b.n, dd = d * d;
      gauss::generator gen(99);
      std::vector<double> up_m(n * d), up_l(n * dd);
      for (double& x : up_m) x = gen.normal01();
      for (double& x : up_l) x = gen.normal01();
      std::vector<double> rm(n * d), rl(n * dd), rom(n * d), rol(n * dd), re(n), rem(n);
      auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
      const g::gaussian_grads<double> gr{troll::make_batch(rm.data(), n, d), troll::make_batch(rl.data(), n, dd),
                                         troll::make_batch(rom.data(), n, d), troll::make_batch(rol.data(), n, dd),
                                         re.data(), rem.data()};
      if (split)
        g::project_split_backward(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05, 0.03,
                                  in(b.ym, d), in(b.yl, dd), b.st.data(), in(up_m, d), in(up_l, dd), gr);
      else
        g::project_joint_backward(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05, in(b.ym, d),
                                  in(b.yl, dd), b.st.data(), in(up_m, d), in(up_l, dd), gr);
      for (std::size_t r = 0; r < n; ++r) {
        CAPTURE(r);
        for (bool own : {false, true}) {  // the saved factorisation, or the team's own (factor_full_team)
        CAPTURE(own);
        std::vector<double> ws = scratch_for(b, r);
        if (own)
          troll::detail::factor_full_team(troll::detail::host_team{}, b.m.data() + r * d, b.l.data() + r * dd,
                                          b.om.data() + r * d, b.ol.data() + r * dd,
                                          troll::detail::full_scratch{ws.data(), static_cast<int>(d)});
        std::vector<double> om(d), ol(dd), oom(d), ool(dd);
        double oe = -1.0, oem = -1.0;
        const troll::detail::gaussian_vjp_io<double> io{b.yl.data() + r * dd, up_m.data() + r * d, up_l.data() + r * dd,
                                                    om.data(),            ol.data(),           oom.data(),
                                                    ool.data(),           &oe,                 &oem};
        const double t = b.st[r].status == troll::row_status::inactive ? 1.0 : b.st[r].t;
        troll::detail::gaussian_full_vjp_row(troll::detail::host_team{}, split, b.m.data() + r * d,
                                             b.l.data() + r * dd, b.om.data() + r * d, 0.05, t, io,
                                             troll::detail::full_scratch{ws.data(), static_cast<int>(d)});
        auto slice = [](const std::vector<double>& v, std::size_t r0, std::size_t len) {
          return std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(r0 * len),
                                     v.begin() + static_cast<std::ptrdiff_t>((r0 + 1) * len));
        };
        check_close(om, slice(rm, r, d), 1e-9);
        check_close(ol, slice(rl, r, dd), 1e-9);
        check_close(oom, slice(rom, r, d), 1e-9);
        check_close(ool, slice(rol, r, dd), 1e-9);
        CHECK(std::fabs(oe - re[r]) <= 1e-12 + 1e-9 * std::fabs(re[r]));
        if (split) CHECK(std::fabs(oem - rem[r]) <= 1e-12 + 1e-9 * std::fabs(rem[r]));
        }
      }
    }
  }
}

TEST_CASE("the shared full-covariance JVP steps match the Eigen JVP") {
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(3), std::size_t(8), std::size_t(24)}) {
      CAPTURE(split);
      CAPTURE(d);
      const batch b = make_batch(d, split, static_cast<unsigned>(11 * d + split));
      const std::size_t n = b.n, dd = d * d;
      gauss::generator gen(5);
      std::vector<double> tm(n * d), tl(n * dd), tom(n * d), tol(n * dd);
      for (auto* v : {&tm, &tl, &tom, &tol})
        for (double& x : *v) x = gen.normal01();
      for (std::size_t r = 0; r < n; ++r)  // factor tangents lower-triangular (the upper is ignored anyway)
        for (std::size_t i = 0; i < d; ++i)
          for (std::size_t j = i + 1; j < d; ++j) tl[r * dd + i * d + j] = tol[r * dd + i * d + j] = 0.0;
      auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
      const g::gaussian_tangents<double> tan{in(tm, d), in(tl, dd), in(tom, d), in(tol, dd), 0.01, 0.02};
      std::vector<double> rm(n * d), rl(n * dd);
      if (split)
        g::project_split_jvp(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05, 0.03, in(b.ym, d),
                             in(b.yl, dd), b.st.data(), tan, troll::make_batch(rm.data(), n, d),
                             troll::make_batch(rl.data(), n, dd));
      else
        g::project_joint_jvp(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), 0.05, in(b.ym, d),
                             in(b.yl, dd), b.st.data(), tan, troll::make_batch(rm.data(), n, d),
                             troll::make_batch(rl.data(), n, dd));
      for (std::size_t r = 0; r < n; ++r) {
        CAPTURE(r);
        std::vector<double> ws = scratch_for(b, r);
        std::vector<double> om(d), ol(dd);
        const troll::detail::gaussian_jvp_io<double> io{b.yl.data() + r * dd, tm.data() + r * d, tl.data() + r * dd,
                                                    tom.data() + r * d,   tol.data() + r * dd, 0.01,
                                                    0.02,                 om.data(),           ol.data()};
        const double t = b.st[r].status == troll::row_status::inactive ? 1.0 : b.st[r].t;
        troll::detail::gaussian_full_jvp_row(troll::detail::host_team{}, split, b.m.data() + r * d,
                                             b.l.data() + r * dd, b.om.data() + r * d, 0.05, t, io,
                                             troll::detail::full_scratch{ws.data(), static_cast<int>(d)});
        check_close(om, std::vector<double>(rm.begin() + static_cast<std::ptrdiff_t>(r * d),
                                            rm.begin() + static_cast<std::ptrdiff_t>((r + 1) * d)),
                    1e-9);
        check_close(ol, std::vector<double>(rl.begin() + static_cast<std::ptrdiff_t>(r * dd),
                                            rl.begin() + static_cast<std::ptrdiff_t>((r + 1) * dd)),
                    1e-9);
      }
    }
  }
}

TEST_CASE("the parallel-order Jacobi eigensolver against Eigen's") {
  for (int d : {1, 2, 5, 8, 33, 64}) {
    CAPTURE(d);
    gauss::generator gen(static_cast<unsigned>(d));
    Eigen::MatrixXd m(d, d);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j <= i; ++j) m(i, j) = m(j, i) = gen.normal01();
    if (d == 8) m(3, 3) = m(4, 4), m(3, 4) = m(4, 3) = 0.0;  // a repeated-ish pair and a zero plane
    std::vector<double> a(static_cast<std::size_t>(d * d)), v(a.size()),
        cs(static_cast<std::size_t>(troll::detail::jacobi_scratch_doubles(d)));
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) a[static_cast<std::size_t>(i * d + j)] = m(i, j);
    troll::detail::jacobi_eigen(troll::detail::host_team{}, d, a.data(), v.data(), cs.data());
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(m);
    std::vector<double> got(static_cast<std::size_t>(d));
    for (int i = 0; i < d; ++i) got[static_cast<std::size_t>(i)] = a[static_cast<std::size_t>(i * d + i)];
    std::sort(got.begin(), got.end());
    const double scale = eig.eigenvalues().cwiseAbs().maxCoeff();
    for (int i = 0; i < d; ++i) CHECK(std::fabs(got[static_cast<std::size_t>(i)] - eig.eigenvalues()[i]) <= 1e-13 * scale);
    // V orthonormal and M V = V diag(a).
    Eigen::MatrixXd vm(d, d);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) vm(i, j) = v[static_cast<std::size_t>(i * d + j)];
    CHECK((vm.transpose() * vm - Eigen::MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff() <= 1e-13 * d);
    Eigen::MatrixXd diag = Eigen::MatrixXd::Zero(d, d);
    for (int i = 0; i < d; ++i) diag(i, i) = a[static_cast<std::size_t>(i * d + i)];
    CHECK((m * vm - vm * diag).cwiseAbs().maxCoeff() <= 1e-12 * scale);
  }
}

TEST_CASE("the shared full-row forward (team steps) matches the CPU backend") {
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(4), std::size_t(33), std::size_t(70)}) {
      CAPTURE(split);
      CAPTURE(d);
      const batch b = make_batch(d, split, static_cast<unsigned>(17 * d + split));
      const std::size_t dd = d * d;
      for (std::size_t r = 0; r < b.n; ++r) {
        CAPTURE(r);
        std::vector<double> ws(troll::detail::full_scratch::doubles(d));
        const troll::detail::full_scratch w{ws.data(), static_cast<int>(d), troll::detail::forward_matrices};
        std::vector<double> ym(d), yl(dd), saved(g::saved_factorisation<double>::saved_doubles(d));
        g::gaussian_stats st;
        troll::detail::gaussian_full_forward_row(troll::detail::host_team{}, split, b.m.data() + r * d,
                                                 b.l.data() + r * dd, b.om.data() + r * d, b.ol.data() + r * dd,
                                                 0.05, 0.03, troll::projection_options{}, ym.data(), yl.data(), &st,
                                                 saved.data(), w);
        CHECK(st.status == b.st[r].status);
        CHECK(std::fabs(st.t - b.st[r].t) <= 1e-12);
        CHECK(std::fabs(st.kl_after - b.st[r].kl_after) <= 1e-12 + 1e-9 * b.st[r].kl_after);
        CHECK(std::fabs(st.kl_before - b.st[r].kl_before) <= 1e-12 + 1e-9 * b.st[r].kl_before);
        CHECK(std::fabs(st.mean_kl_before - b.st[r].mean_kl_before) <= 1e-12 + 1e-9 * b.st[r].mean_kl_before);
        check_close(ym, std::vector<double>(b.ym.begin() + static_cast<std::ptrdiff_t>(r * d),
                                            b.ym.begin() + static_cast<std::ptrdiff_t>((r + 1) * d)),
                    1e-10);
        check_close(yl, std::vector<double>(b.yl.begin() + static_cast<std::ptrdiff_t>(r * dd),
                                            b.yl.begin() + static_cast<std::ptrdiff_t>((r + 1) * dd)),
                    1e-10);
      }
    }
  }
}
