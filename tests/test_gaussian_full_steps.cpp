// tests/test_gaussian_full_steps.cpp — the full-covariance VJP and JVP written as plain-array
// matrix steps (detail/gaussian_full_derivatives.hpp, the code the CUDA backend runs with a warp
// per row) run on the host and compared with the CPU backend's Eigen implementation
// (gaussian_backward / gaussian_jvp), row by row, joint and split, projected and inactive rows.
// The Eigen version is itself checked against finite differences of the long-double oracle
// (test_gaussian_backward.cpp), so this ties the shared steps to that oracle without a GPU.
#include <doctest/doctest.h>

#include "troll/detail/cpu/eigen.hpp"  // Eigen/Core first, AVX-512-clean on GCC 12
#include <Eigen/Eigenvalues>
#include <Eigen/Cholesky>
#include <Eigen/QR>
#include <Eigen/SVD>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "support/gaussian_oracle.hpp"
#include "troll/detail/cpu/one_sided_jacobi.hpp"
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
        const double t = troll::detail::solved_tilt(b.st[r]), gap = troll::detail::solved_gap(b.st[r]);
        troll::detail::gaussian_full_vjp_row(troll::detail::host_team{}, split, b.m.data() + r * d,
                                             b.l.data() + r * dd, b.om.data() + r * d, 0.05, t, gap, io,
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
        const double t = troll::detail::solved_tilt(b.st[r]), gap = troll::detail::solved_gap(b.st[r]);
        troll::detail::gaussian_full_jvp_row(troll::detail::host_team{}, split, b.m.data() + r * d,
                                             b.l.data() + r * dd, b.om.data() + r * d, 0.05, t, gap, io,
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

TEST_CASE("the one-sided Jacobi SVD (the full rows' SVD route) against Eigen's QR-preconditioned Jacobi SVD") {
  using troll::detail::cpu::one_sided_jacobi_svd;
  using matrix = troll::detail::cpu::gaussian_matrix;  // the library's type: its instantiations
  constexpr double u = 2.220446049250313e-16;
  // kind 0: Gaussian entries; 1: columns graded over 12 decades (B·D, B random): σ to high
  // relative accuracy; 2: a whitened factor L°⁻¹L̃ with an old covariance of condition 1e12.
  for (int kind : {0, 1, 2}) {
    for (int d : {1, 3, 17, 24, 48}) {
      CAPTURE(kind);
      CAPTURE(d);
      gauss::generator gen(static_cast<unsigned>(100 * kind + d));
      Eigen::MatrixXd a(d, d);
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j) a(i, j) = gen.normal01();
      if (kind == 1) {
        for (int j = 0; j < d; ++j) a.col(j) *= std::pow(10.0, d > 1 ? -12.0 * j / (d - 1) : 0.0);
      } else if (kind == 2) {
        // Σ° = Q₁ diag(10^(−12 i/(d−1))) Q₁ᵀ, Σ̃ = Q₂ diag(1 + 0.1|z|) Q₂ᵀ, Q random orthogonal.
        auto orthogonal = [&]() {
          matrix g(d, d);
          for (int i = 0; i < d; ++i)
            for (int j = 0; j < d; ++j) g(i, j) = gen.normal01();
          return matrix(Eigen::HouseholderQR<matrix>(g).householderQ());
        };
        const matrix q1 = orthogonal(), q2 = orthogonal();
        Eigen::VectorXd s1(d), s2(d);
        for (int i = 0; i < d; ++i)
          s1[i] = std::pow(10.0, d > 1 ? -12.0 * i / (d - 1) : 0.0), s2[i] = 1.0 + 0.1 * std::fabs(gen.normal01());
        const matrix old_l = Eigen::LLT<matrix>(matrix(q1 * s1.asDiagonal() * q1.transpose())).matrixL();
        const matrix new_l = Eigen::LLT<matrix>(matrix(q2 * s2.asDiagonal() * q2.transpose())).matrixL();
        a = old_l.triangularView<Eigen::Lower>().solve(new_l);
      }
      const matrix am = a;
      const auto got = one_sided_jacobi_svd(am);
      REQUIRE(got.converged);
      const Eigen::JacobiSVD<matrix, Eigen::ColPivHouseholderQRPreconditioner> ref(am, Eigen::ComputeFullU);
      std::vector<double> sigma(got.sigma.data(), got.sigma.data() + d);
      std::sort(sigma.begin(), sigma.end(), [](double x, double y) { return x > y; });
      const double top = ref.singularValues()[0];
      for (int i = 0; i < d; ++i) {
        CAPTURE(i);
        const double want = ref.singularValues()[i];
        // Absolute accuracy u·σ_max (Eigen's square two-sided Jacobi has no QR preconditioning
        // and is no more accurate than that on graded columns: 3e-10 relative where the
        // one-sided is 2e-15 against mpmath; the hard-coded case below tests the latter).
        const double tol = 64.0 * d * u * top;
        CHECK(std::fabs(sigma[static_cast<std::size_t>(i)] - want) <= tol);
      }
      // U orthonormal, and A Aᵀ U = U Σ².
      CHECK((got.u.transpose() * got.u - Eigen::MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff() <= 64.0 * d * u);
      const Eigen::MatrixXd residual = a * (a.transpose() * got.u) - got.u * got.sigma.cwiseAbs2().asDiagonal();
      CHECK(residual.cwiseAbs().maxCoeff() <= 64.0 * d * u * top * top);
    }
  }
  // Columns graded over 11 decades, A = B·D with B = (pattern − ½ + I) (column-normalised
  // condition number 14) and D = diag(4^−j), every entry exact: each σ to high relative accuracy
  // against a 60-digit mpmath SVD of the same doubles.
  {
    constexpr int d = 20;
    matrix graded(d, d);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j)
        graded(i, j) = (double((37 * i + 91 * j + 11 * i * j) % 97) / 97.0 - 0.5 + (i == j ? 1.0 : 0.0)) *
                       std::ldexp(1.0, -2 * j);
    const double want[d] = {1.3205933158120694286,   0.39985118983827396893,  0.076411622941770896952,
                            0.028606790113629604075, 0.004904966104482418793, 0.0015110378964509912833,
                            0.0002096846721558334656, 0.000095106227146596401076, 0.000021722945365276832247,
                            4.357334281169458745e-6,  1.2951801623585198689e-6, 2.6285223609912424818e-7,
                            6.8658136404857861109e-8, 1.2488325368721293648e-8, 4.4436123126544628719e-9,
                            8.4346647857923476333e-10, 9.2869770770120108526e-11, 3.198988193036377731e-11,
                            1.8131239539424295323e-11, 1.0177259641260924614e-12};
    const auto got = one_sided_jacobi_svd(graded);
    REQUIRE(got.converged);
    std::vector<double> sigma(got.sigma.data(), got.sigma.data() + d);
    std::sort(sigma.begin(), sigma.end(), [](double x, double y) { return x > y; });
    for (int i = 0; i < d; ++i) {
      CAPTURE(i);
      CHECK(std::fabs(sigma[static_cast<std::size_t>(i)] - want[i]) <= 32.0 * d * u * want[i]);
    }
  }
  // No left vector for a zero column: reported, for the caller's fallback.
  matrix z = matrix::Identity(3, 3);
  z(1, 1) = 0.0;
  CHECK_FALSE(one_sided_jacobi_svd(z).converged);
  CHECK_FALSE(one_sided_jacobi_svd(matrix(matrix::Zero(2, 2))).converged);
  // Huge and tiny entries: the power-of-two scaling keeps the squared norms finite.
  matrix big(2, 2);
  big << 1e300, 2e300, -3e300, 1e300;
  const auto hb = one_sided_jacobi_svd(big);
  REQUIRE(hb.converged);
  const Eigen::JacobiSVD<matrix, Eigen::ColPivHouseholderQRPreconditioner> rb(big, Eigen::ComputeFullU);
  std::vector<double> sb(hb.sigma.data(), hb.sigma.data() + 2);
  std::sort(sb.begin(), sb.end(), [](double x, double y) { return x > y; });
  for (int i = 0; i < 2; ++i) CHECK(std::fabs(sb[static_cast<std::size_t>(i)] - rb.singularValues()[i]) <= 1e-14 * rb.singularValues()[0]);
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

TEST_CASE("the shared full-row forward refuses what the CPU throws for (the device's default mode rejects it)") {
  // gaussian_row_refused, the yes/no form of gaussian_ratio_problem and gaussian_mean_step_problem:
  // a factor diagonal ratio below ~7.5e-155, a whitened mean step beyond the doubles, and under a
  // split bound ½|step|² beyond them (a step of 1e160: refused when split only). The CPU entry
  // point throws for each; the shared row returns false and writes nothing.
  namespace gg = troll::gaussian;
  for (std::size_t d : {std::size_t(3), std::size_t(34)}) {
    for (bool split : {false, true}) {
      CAPTURE(d);
      CAPTURE(split);
      const batch base = make_batch(d, split, static_cast<unsigned>(5 * d + split));
      const std::size_t dd = d * d;
      for (int kind = 0; kind < 4; ++kind) {
        CAPTURE(kind);
        std::vector<double> m(base.m.begin(), base.m.begin() + static_cast<std::ptrdiff_t>(d));
        std::vector<double> om(base.om.begin(), base.om.begin() + static_cast<std::ptrdiff_t>(d));
        std::vector<double> l(base.l.begin(), base.l.begin() + static_cast<std::ptrdiff_t>(dd));
        std::vector<double> ol(base.ol.begin(), base.ol.begin() + static_cast<std::ptrdiff_t>(dd));
        if (kind == 1) l[1 * d + 1] = 1e-200 * ol[1 * d + 1];
        if (kind == 2) m[d - 1] = 1.7e308, om[d - 1] = -1.7e308;
        if (kind == 3) m[0] = om[0] + 1e160 * ol[0];
        const bool refused = kind == 1 || kind == 2 || (kind == 3 && split);
        std::vector<double> ws(troll::detail::full_scratch::doubles(d));
        const troll::detail::full_scratch w{ws.data(), static_cast<int>(d), troll::detail::forward_matrices};
        std::vector<double> ym(d, 42.0), yl(dd, 42.0);
        gg::gaussian_stats st;
        st.t = 42.0;
        const bool written = troll::detail::gaussian_full_forward_row(
            troll::detail::host_team{}, split, m.data(), l.data(), om.data(), ol.data(), 0.05, 0.03,
            troll::projection_options{}, ym.data(), yl.data(), &st, nullptr, w);
        CHECK(written == !refused);
        if (refused) {
          CHECK(st.t == 42.0);
          CHECK(ym == std::vector<double>(d, 42.0));
        }
        // The CPU entry point throws for exactly these rows.
        std::vector<double> out_m(d), out_l(dd);
        auto in = [](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), 1, cols); };
        auto call = [&] {
          if (split)
            gg::project_split(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), 0.05, 0.03,
                              troll::make_batch(out_m.data(), 1, d), troll::make_batch(out_l.data(), 1, dd), &st);
          else
            gg::project_joint(troll::cpu, in(m, d), in(l, dd), in(om, d), in(ol, dd), 0.05,
                              troll::make_batch(out_m.data(), 1, d), troll::make_batch(out_l.data(), 1, dd), &st);
        };
        if (refused) {
          CHECK_THROWS_AS(call(), troll::domain_error);
        } else {
          CHECK_NOTHROW(call());
        }
      }
    }
  }
}
