// tests/cuda/test_cuda_gaussian_full_derivatives.cu — the CUDA full-covariance VJP and JVP
// (project_joint_backward, project_split_backward, project_joint_jvp, project_split_jvp under
// troll::cuda; one block per row running detail/gaussian_full_derivatives.hpp's steps) against
// the CPU backend (itself checked against finite differences of the long-double oracle), with
// and without the factorisation a CUDA forward saved; bad rows: NaN unchecked, the CPU's typed
// error naming the row with nothing written in checked mode; host-side argument checks, which
// run without a device. Also the VJP / JVP of every Gaussian projection (full and diagonal)
// against central differences of the long-double oracle and of the device forward, and the two
// adjoint, run on the device (tests/bodies/gaussian_backward_fd.hpp, the body of
// tests/test_gaussian_backward.cpp).
//
// Without a CUDA device the "device" suite is skipped and "SKIPPED: no CUDA device" is printed.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include "gaussian_oracle.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "troll/cuda_gaussian.cuh"
#include "troll/gaussian.hpp"
#include "troll/workspace.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

namespace {

namespace g = troll::gaussian;
namespace gauss = troll_test::gauss;
using troll_test::device_array;

/// The policy with a device workspace of the size op needs for n rows of dimension d.
template <class Op>
struct with_scratch {
  device_array<unsigned char> memory;
  troll::cuda_policy policy;
  with_scratch(troll::cuda_policy p, Op op, std::size_t n, std::size_t d)
      : memory(troll::workspace_bytes(troll::cuda, op, n, d)),
        policy(p.with_workspace(memory.get(), troll::workspace_bytes(troll::cuda, op, n, d))) {}
};

/// One batch of full rows (row 2 inside the ball), its CPU forward and random upstream /
/// tangent data.
struct full_batch {
  std::size_t n = 5, d = 0;
  bool split = false;
  double eps = 0.05, eps_cov = 0.03;
  std::vector<double> m, l, om, ol, ym, yl, up_m, up_l, tm, tl, tom, tol;
  std::vector<g::gaussian_stats> st;
};

full_batch make_full(std::size_t d, bool split, unsigned seed) {
  full_batch b;
  b.d = d;
  b.split = split;
  const std::size_t n = b.n, dd = d * d;
  gauss::generator gen(seed);
  for (std::size_t r = 0; r < n; ++r) {
    const double scale = r == 2 ? 1e-4 : 1.0;
    const std::vector<double> a = gen.mean(d, 1.0), c = gen.mean(d, 1.0), f = gen.factor(d, 0.3),
                              e = gen.factor(d, 0.3);
    for (std::size_t i = 0; i < d; ++i) b.om.push_back(c[i]), b.m.push_back(c[i] + scale * (a[i] - c[i]));
    for (std::size_t i = 0; i < dd; ++i) b.ol.push_back(e[i]), b.l.push_back(e[i] + scale * (f[i] - e[i]));
  }
  auto normal = [&](std::size_t k, bool lower) {
    std::vector<double> v(k);
    for (std::size_t i = 0; i < k; ++i) v[i] = lower && (i % dd) % d > (i % dd) / d ? 0.0 : gen.normal01();
    return v;
  };
  b.up_m = normal(n * d, false);
  b.up_l = normal(n * dd, true);
  b.tm = normal(n * d, false);
  b.tl = normal(n * dd, true);
  b.tom = normal(n * d, false);
  b.tol = normal(n * dd, true);
  b.ym.resize(n * d);
  b.yl.resize(n * dd);
  b.st.resize(n);
  auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
  if (split)
    g::project_split(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps, b.eps_cov,
                     troll::make_batch(b.ym.data(), n, d), troll::make_batch(b.yl.data(), n, dd), b.st.data());
  else
    g::project_joint(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps,
                     troll::make_batch(b.ym.data(), n, d), troll::make_batch(b.yl.data(), n, dd), b.st.data());
  return b;
}

/// |got − ref| ≤ atol + rtol·max|ref| over each row's block of `len` entries, skipping `skip`.
void check_rows(const std::vector<double>& got, const std::vector<double>& ref, std::size_t len, double rtol,
                std::size_t skip = static_cast<std::size_t>(-1)) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t r = 0; r * len < ref.size(); ++r) {
    if (r == skip) continue;
    double scale = 0.0;
    for (std::size_t i = r * len; i < (r + 1) * len; ++i) scale = std::max(scale, std::fabs(ref[i]));
    for (std::size_t i = r * len; i < (r + 1) * len; ++i) {
      CAPTURE(r);
      CAPTURE(i);
      CHECK(std::fabs(got[i] - ref[i]) <= 1e-13 + rtol * scale);
    }
  }
}

struct vjp_out {
  std::vector<double> m, l, om, ol, e, em;
};

/// The VJP of the batch on the CPU, or on the device (optionally with a saved factorisation and
/// in checked mode); `b` may differ from the forward's inputs (bad rows).
vjp_out vjp_cpu(const full_batch& b) {
  const std::size_t n = b.n, d = b.d, dd = d * d;
  vjp_out o{std::vector<double>(n * d), std::vector<double>(n * dd), std::vector<double>(n * d),
            std::vector<double>(n * dd), std::vector<double>(n), std::vector<double>(n)};
  auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
  const g::gaussian_grads<double> gr{troll::make_batch(o.m.data(), n, d), troll::make_batch(o.l.data(), n, dd),
                                     troll::make_batch(o.om.data(), n, d), troll::make_batch(o.ol.data(), n, dd),
                                     o.e.data(), b.split ? o.em.data() : nullptr};
  if (b.split)
    g::project_split_backward(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps, b.eps_cov,
                              in(b.ym, d), in(b.yl, dd), b.st.data(), in(b.up_m, d), in(b.up_l, dd), gr);
  else
    g::project_joint_backward(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps, in(b.ym, d),
                              in(b.yl, dd), b.st.data(), in(b.up_m, d), in(b.up_l, dd), gr);
  return o;
}

/// In checked mode a thrown troll::invalid_input is caught: its row and message go to *row and
/// *error, and the outputs (filled with 7 before the call) are still downloaded.
vjp_out vjp_device(const full_batch& b, bool use_saved, bool checked = false, std::size_t* row = nullptr,
                   std::string* error = nullptr) {
  const std::size_t n = b.n, d = b.d, dd = d * d;
  device_array<double> m(b.m), l(b.l), om(b.om), ol(b.ol), ym(b.ym), yl(b.yl), um(b.up_m), ul(b.up_l);
  device_array<g::gaussian_stats> st(b.st);
  device_array<double> saved(n * g::saved_factorisation<double>::saved_doubles(d));
  const troll_test::test_stream stream;
  auto in = [&](const device_array<double>& x, std::size_t cols) {
    return troll::make_batch(static_cast<const double*>(x.get()), n, cols);
  };
  const g::saved_factorisation<double> save{saved.get(), n, d};
  if (use_saved) {  // a CUDA forward of the same inputs fills it (its outputs are not used)
    device_array<double> fm(n * d), fl(n * dd);
    device_array<g::gaussian_stats> fs(n);
    const with_scratch<troll::op::gaussian_project_joint> fw(troll::cuda.on(stream.stream), {}, n, d);
    if (b.split)
      g::project_split(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, b.eps_cov,
                       troll::make_batch(fm.get(), n, d), troll::make_batch(fl.get(), n, dd), fs.get(), {}, save);
    else
      g::project_joint(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps,
                       troll::make_batch(fm.get(), n, d), troll::make_batch(fl.get(), n, dd), fs.get(), {}, save);
    stream.sync();
  }
  std::vector<double> fill_m(n * d, 7.0), fill_l(n * dd, 7.0), fill_s(n, 7.0);
  device_array<double> gm(fill_m), gl(fill_l), gom(fill_m), gol(fill_l), ge(fill_s), gem(fill_s);
  const g::gaussian_grads<double> gr{troll::make_batch(gm.get(), n, d), troll::make_batch(gl.get(), n, dd),
                                     troll::make_batch(gom.get(), n, d), troll::make_batch(gol.get(), n, dd),
                                     ge.get(), b.split ? gem.get() : nullptr};
  const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
  const with_scratch<troll::op::gaussian_project_joint_backward> ws(
      checked ? troll::cuda.on(stream.stream).checked() : troll::cuda.on(stream.stream), {}, n, d);
  const troll::cuda_policy policy = ws.policy;
  try {
    if (b.split)
      g::project_split_backward(policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, b.eps_cov, in(ym, d),
                                in(yl, dd), st.get(), in(um, d), in(ul, dd), gr, s);
    else
      g::project_joint_backward(policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, in(ym, d), in(yl, dd),
                                st.get(), in(um, d), in(ul, dd), gr, s);
  } catch (const troll::invalid_input& e) {
    if (error == nullptr) throw;
    *error = e.what();
    *row = e.row();
  }
  stream.sync();
  return vjp_out{gm.download(), gl.download(), gom.download(), gol.download(), ge.download(), gem.download()};
}

std::vector<double> jvp_cpu(const full_batch& b) {
  const std::size_t n = b.n, d = b.d, dd = d * d;
  auto in = [&](const std::vector<double>& v, std::size_t cols) { return troll::make_batch(v.data(), n, cols); };
  const g::gaussian_tangents<double> tan{in(b.tm, d), in(b.tl, dd), in(b.tom, d), in(b.tol, dd), 0.01, 0.02};
  std::vector<double> om(n * d), ol(n * dd);
  if (b.split)
    g::project_split_jvp(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps, b.eps_cov,
                         in(b.ym, d), in(b.yl, dd), b.st.data(), tan, troll::make_batch(om.data(), n, d),
                         troll::make_batch(ol.data(), n, dd));
  else
    g::project_joint_jvp(troll::cpu, in(b.m, d), in(b.l, dd), in(b.om, d), in(b.ol, dd), b.eps, in(b.ym, d),
                         in(b.yl, dd), b.st.data(), tan, troll::make_batch(om.data(), n, d),
                         troll::make_batch(ol.data(), n, dd));
  om.insert(om.end(), ol.begin(), ol.end());
  return om;
}

std::vector<double> jvp_device(const full_batch& b, bool use_saved) {
  const std::size_t n = b.n, d = b.d, dd = d * d;
  device_array<double> m(b.m), l(b.l), om(b.om), ol(b.ol), ym(b.ym), yl(b.yl), tm(b.tm), tl(b.tl), tom(b.tom),
      tol(b.tol);
  device_array<g::gaussian_stats> st(b.st);
  device_array<double> saved(n * g::saved_factorisation<double>::saved_doubles(d));
  const troll_test::test_stream stream;
  auto in = [&](const device_array<double>& x, std::size_t cols) {
    return troll::make_batch(static_cast<const double*>(x.get()), n, cols);
  };
  const g::saved_factorisation<double> save{saved.get(), n, d};
  if (use_saved) {
    device_array<double> fm(n * d), fl(n * dd);
    device_array<g::gaussian_stats> fs(n);
    const with_scratch<troll::op::gaussian_project_split> fw(troll::cuda.on(stream.stream), {}, n, d);
    if (b.split)
      g::project_split(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, b.eps_cov,
                       troll::make_batch(fm.get(), n, d), troll::make_batch(fl.get(), n, dd), fs.get(), {}, save);
    else
      g::project_joint(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps,
                       troll::make_batch(fm.get(), n, d), troll::make_batch(fl.get(), n, dd), fs.get(), {}, save);
    stream.sync();
  }
  const g::gaussian_tangents<double> tan{in(tm, d), in(tl, dd), in(tom, d), in(tol, dd), 0.01, 0.02};
  device_array<double> out_m(n * d), out_l(n * dd);
  const g::saved_factorisation<const double> s = use_saved ? save : g::saved_factorisation<double>{};
  const with_scratch<troll::op::gaussian_project_split_jvp> ws(troll::cuda.on(stream.stream), {}, n, d);
  if (b.split)
    g::project_split_jvp(ws.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, b.eps_cov,
                         in(ym, d), in(yl, dd), st.get(), tan, troll::make_batch(out_m.get(), n, d),
                         troll::make_batch(out_l.get(), n, dd), s);
  else
    g::project_joint_jvp(ws.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, in(ym, d),
                         in(yl, dd), st.get(), tan, troll::make_batch(out_m.get(), n, d),
                         troll::make_batch(out_l.get(), n, dd), s);
  stream.sync();
  std::vector<double> o = out_m.download(), ol2 = out_l.download();
  o.insert(o.end(), ol2.begin(), ol2.end());
  return o;
}

}  // namespace

TEST_SUITE("device") {
TEST_CASE("full-covariance VJP and JVP on the device match the CPU, with and without a saved factorisation") {
  // d ≤ 32: the row in shared memory; above: one block per row with the row in the workspace.
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(1), std::size_t(5), std::size_t(17), std::size_t(32), std::size_t(33),
                          std::size_t(100), std::size_t(256)}) {
      for (bool use_saved : {false, true}) {
        CAPTURE(split);
        CAPTURE(d);
        CAPTURE(use_saved);
        const full_batch b = make_full(d, split, static_cast<unsigned>(13 * d + split));
        const vjp_out ref = vjp_cpu(b), got = vjp_device(b, use_saved);
        check_rows(got.m, ref.m, d, 1e-9);
        check_rows(got.l, ref.l, d * d, 1e-9);
        check_rows(got.om, ref.om, d, 1e-9);
        check_rows(got.ol, ref.ol, d * d, 1e-9);
        check_rows(got.e, ref.e, 1, 1e-9);
        if (split) check_rows(got.em, ref.em, 1, 1e-9);
        const std::vector<double> jr = jvp_cpu(b), jg = jvp_device(b, use_saved);
        const std::size_t nd = b.n * d;
        check_rows(std::vector<double>(jg.begin(), jg.begin() + static_cast<std::ptrdiff_t>(nd)),
                   std::vector<double>(jr.begin(), jr.begin() + static_cast<std::ptrdiff_t>(nd)), d, 1e-9);
        check_rows(std::vector<double>(jg.begin() + static_cast<std::ptrdiff_t>(nd), jg.end()),
                   std::vector<double>(jr.begin() + static_cast<std::ptrdiff_t>(nd), jr.end()), d * d, 1e-9);
      }
    }
  }
}

TEST_CASE("full-covariance VJP on the device: a bad row gets NaN unchecked, the CPU's error when checked") {
  full_batch b = make_full(6, false, 3);
  const vjp_out ref = vjp_cpu(b);
  b.l[3 * 36 + 2] = 0.5;  // row 3: a non-zero above the diagonal
  const vjp_out got = vjp_device(b, false);
  for (std::size_t i = 3 * 6; i < 4 * 6; ++i) CHECK(std::isnan(got.m[i]));
  CHECK(std::isnan(got.e[3]));
  check_rows(got.m, ref.m, 6, 1e-9, 3);
  check_rows(got.e, ref.e, 1, 1e-9, 3);
  // Checked: the CPU's typed error naming row 3, nothing written (the outputs keep their 7s).
  std::size_t row = 0;
  std::string error;
  const vjp_out kept = vjp_device(b, false, true, &row, &error);
  CHECK(row == 3);
  CHECK_MESSAGE(error.find("row 3") != std::string::npos, error);
  for (const std::vector<double>* v : {&kept.m, &kept.l, &kept.om, &kept.ol, &kept.e, &kept.em})
    CHECK(std::all_of(v->begin(), v->end(), [](double x) { return x == 7.0; }));
}
TEST_CASE("full-covariance VJP and JVP on the device: a non-finite upstream entry the row reads gives NaN unchecked") {
  // d = 6: the row in shared memory; d = 40: in the workspace. Factor gradients and tangents are
  // read on their lower triangle only: a NaN above it changes nothing (as on the CPU).
  for (std::size_t d : {std::size_t(6), std::size_t(40)}) {
    CAPTURE(d);
    const std::size_t dd = d * d;
    full_batch b = make_full(d, false, static_cast<unsigned>(5 + d));
    b.up_l[2 * dd + 1] = std::nan("");  // row 2, above the diagonal: not read
    b.tl[2 * dd + 1] = std::nan("");
    const vjp_out ref = vjp_cpu(b);
    const std::vector<double> jref = jvp_cpu(b);
    b.up_l[3 * dd + 2 * d + 1] = std::numeric_limits<double>::infinity();  // row 3 of the VJP, below it
    b.tl[1 * dd + d] = std::nan("");                                        // row 1 of the JVP
    const vjp_out got = vjp_device(b, false);
    for (std::size_t i = 3 * d; i < 4 * d; ++i) CHECK(std::isnan(got.m[i]));
    for (std::size_t i = 3 * dd; i < 4 * dd; ++i) CHECK(std::isnan(got.l[i]));
    CHECK(std::isnan(got.e[3]));
    check_rows(got.m, ref.m, d, 1e-9, 3);
    check_rows(got.l, ref.l, dd, 1e-9, 3);
    check_rows(got.e, ref.e, 1, 1e-9, 3);
    const std::vector<double> jg = jvp_device(b, false);
    const std::size_t nd = b.n * d;
    for (std::size_t i = d; i < 2 * d; ++i) CHECK(std::isnan(jg[i]));
    for (std::size_t i = nd + dd; i < nd + 2 * dd; ++i) CHECK(std::isnan(jg[i]));
    check_rows(std::vector<double>(jg.begin(), jg.begin() + static_cast<std::ptrdiff_t>(nd)),
               std::vector<double>(jref.begin(), jref.begin() + static_cast<std::ptrdiff_t>(nd)), d, 1e-9, 1);
    check_rows(std::vector<double>(jg.begin() + static_cast<std::ptrdiff_t>(nd), jg.end()),
               std::vector<double>(jref.begin() + static_cast<std::ptrdiff_t>(nd), jref.end()), dd, 1e-9, 1);
  }
}

TEST_CASE("full-covariance forward and KL above d = 32 (one block per row, workspace) match the CPU") {
  for (bool split : {false, true}) {
    for (std::size_t d : {std::size_t(33), std::size_t(64), std::size_t(256)}) {
      CAPTURE(split);
      CAPTURE(d);
      const full_batch b = make_full(d, split, static_cast<unsigned>(5 * d + split));
      const std::size_t n = b.n, dd = d * d;
      device_array<double> m(b.m), l(b.l), om(b.om), ol(b.ol), ym(n * d), yl(n * dd), kl(n);
      device_array<g::gaussian_stats> st(n);
      const troll_test::test_stream stream;
      auto in = [&](const device_array<double>& x, std::size_t cols) {
        return troll::make_batch(static_cast<const double*>(x.get()), n, cols);
      };
      const with_scratch<troll::op::gaussian_project_joint> fw(troll::cuda.on(stream.stream), {}, n, d);
      if (split)
        g::project_split(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, b.eps_cov,
                         troll::make_batch(ym.get(), n, d), troll::make_batch(yl.get(), n, dd), st.get());
      else
        g::project_joint(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps,
                         troll::make_batch(ym.get(), n, d), troll::make_batch(yl.get(), n, dd), st.get());
      const with_scratch<troll::op::gaussian_kl> kw(troll::cuda.on(stream.stream), {}, n, d);
      g::kl(kw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), kl.get());
      stream.sync();
      check_rows(ym.download(), b.ym, d, 1e-10);
      check_rows(yl.download(), b.yl, dd, 1e-10);
      const std::vector<g::gaussian_stats> hs = st.download();
      std::vector<double> ref_kl(n);
      g::kl(troll::cpu, troll::make_batch(b.m.data(), n, d), troll::make_batch(b.l.data(), n, dd),
            troll::make_batch(b.om.data(), n, d), troll::make_batch(b.ol.data(), n, dd), ref_kl.data());
      const std::vector<double> hk = kl.download();
      for (std::size_t r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(hs[r].status == b.st[r].status);
        CHECK(std::fabs(hs[r].t - b.st[r].t) <= 1e-10);
        CHECK(std::fabs(hs[r].kl_after - b.st[r].kl_after) <= 1e-12 + 1e-9 * b.st[r].kl_after);
        CHECK(std::fabs(hk[r] - ref_kl[r]) <= 1e-12 + 1e-9 * ref_kl[r]);
      }
    }
  }
}

TEST_CASE("full-covariance forward above d = 32: a bad row is rejected, the others match the CPU") {
  full_batch b = make_full(40, false, 21);
  const std::size_t n = b.n, d = 40, dd = d * d;
  const std::vector<double> ref_m = b.ym;
  b.ol[1 * dd + 5 * d + 5] = -1.0;  // row 1: a negative diagonal in the old factor
  device_array<double> m(b.m), l(b.l), om(b.om), ol(b.ol), ym(n * d), yl(n * dd);
  device_array<g::gaussian_stats> st(n);
  const troll_test::test_stream stream;
  auto in = [&](const device_array<double>& x, std::size_t cols) {
    return troll::make_batch(static_cast<const double*>(x.get()), n, cols);
  };
  const with_scratch<troll::op::gaussian_project_joint> fw(troll::cuda.on(stream.stream), {}, n, d);
  g::project_joint(fw.policy, in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps, troll::make_batch(ym.get(), n, d),
                   troll::make_batch(yl.get(), n, dd), st.get());
  stream.sync();
  const std::vector<g::gaussian_stats> hs = st.download();
  const std::vector<double> hm = ym.download();
  CHECK(hs[1].status == troll::row_status::rejected);
  for (std::size_t i = d; i < 2 * d; ++i) CHECK(std::isnan(hm[i]));
  check_rows(hm, ref_m, d, 1e-10, 1);
  // Checked mode: the CPU's error naming row 1, before anything is written.
  std::string error;
  try {
    g::project_joint(fw.policy.checked(), in(m, d), in(l, dd), in(om, d), in(ol, dd), b.eps,
                     troll::make_batch(ym.get(), n, d), troll::make_batch(yl.get(), n, dd), st.get());
  } catch (const troll::invalid_input& e) {
    CHECK(e.row() == 1);
    error = e.what();
  }
  CHECK_MESSAGE(error.find("row 1") != std::string::npos, error);
}
}

TEST_CASE("host-side checks of the CUDA full-covariance derivatives (no device needed)") {
  const double* p = reinterpret_cast<const double*>(0x1000);  // never read: the checks throw first
  double* w = reinterpret_cast<double*>(0x2000);
  const auto mean = troll::make_batch(p, 2, 3), chol = troll::make_batch(p, 2, 9);
  const auto out_mean = troll::make_batch(w, 2, 3), out_chol = troll::make_batch(w, 2, 9);
  const g::gaussian_stats* stats = reinterpret_cast<const g::gaussian_stats*>(0x3000);
  const g::gaussian_grads<double> grads{out_mean, out_chol, out_mean, out_chol, w, w};
  CHECK_THROWS_AS(g::project_joint_backward(troll::cuda, mean, chol, mean, chol, 0.0, mean, chol, stats, mean, chol,
                                            grads),
                  troll::domain_error);
  CHECK_THROWS_AS(g::project_joint_backward(troll::cuda, mean, troll::make_batch(p, 2, 8), mean, chol, 0.1, mean,
                                            chol, stats, mean, chol, grads),
                  troll::shape_error);
  // A saved factorisation of another shape.
  const g::saved_factorisation<const double> wrong{p, 3, 3};
  CHECK_THROWS_AS(g::project_split_backward(troll::cuda, mean, chol, mean, chol, 0.1, 0.1, mean, chol, stats, mean,
                                            chol, grads, wrong),
                  troll::shape_error);
  const g::gaussian_tangents<double> tangents{mean, chol, mean, chol, 0.0, 0.0};
  CHECK_THROWS_AS(g::project_joint_jvp(troll::cuda, mean, chol, mean, chol, 0.1, mean, chol, stats, tangents,
                                       out_mean, out_chol, wrong),
                  troll::shape_error);
  CHECK_THROWS_AS(g::project_split_jvp(troll::cuda, mean, chol, mean, chol, 0.1, 0.1, mean, chol, nullptr, tangents,
                                       out_mean, out_chol),
                  troll::shape_error);
  // Above d = 32 the workspace: none, too small or misaligned is a shape_error; above 256 too.
  const std::size_t d = 40, dd = d * d;
  const auto mean40 = troll::make_batch(p, 2, d), chol40 = troll::make_batch(p, 2, dd);
  const auto out_mean40 = troll::make_batch(w, 2, d), out_chol40 = troll::make_batch(w, 2, dd);
  g::gaussian_stats* wstats = reinterpret_cast<g::gaussian_stats*>(0x4000);
  const std::size_t need = troll::workspace_bytes(troll::cuda, troll::op::gaussian_project_joint{}, 2, d);
  CHECK(need == 2 * (4 * dd + 8 * d) * sizeof(double));
  CHECK(troll::workspace_bytes(troll::cuda, troll::op::gaussian_project_joint_backward{}, 2, d) ==
        2 * (13 * dd + 18 * d) * sizeof(double));
  CHECK(troll::workspace_bytes(troll::cuda, troll::op::gaussian_project_joint{}, 2, 32) == 0);
  CHECK(troll::workspace_bytes(troll::cuda, troll::op::gaussian_project_joint_diag{}, 2, 40) == 0);
  void* fake = reinterpret_cast<void*>(0x10000);
  CHECK_THROWS_AS(g::project_joint(troll::cuda, mean40, chol40, mean40, chol40, 0.1, out_mean40, out_chol40, wstats),
                  troll::shape_error);
  CHECK_THROWS_AS(g::project_joint(troll::cuda.with_workspace(fake, need - 8), mean40, chol40, mean40, chol40, 0.1,
                                   out_mean40, out_chol40, wstats),
                  troll::shape_error);
  CHECK_THROWS_AS(g::project_joint(troll::cuda.with_workspace(reinterpret_cast<void*>(0x10004), need), mean40,
                                   chol40, mean40, chol40, 0.1, out_mean40, out_chol40, wstats),
                  troll::shape_error);
  const g::gaussian_grads<double> grads40{out_mean40, out_chol40, {}, {}, nullptr, nullptr};
  CHECK_THROWS_AS(g::project_joint_backward(troll::cuda.with_workspace(fake, need), mean40, chol40, mean40, chol40,
                                            0.1, mean40, chol40, stats, mean40, chol40, grads40),
                  troll::shape_error);  // the forward's size is too small for the backward
  CHECK_THROWS_AS(g::kl(troll::cuda, mean40, chol40, mean40, chol40, w), troll::shape_error);
  const auto mean257 = troll::make_batch(p, 2, 257), chol257 = troll::make_batch(p, 2, 257 * 257);
  CHECK_THROWS_AS(g::kl(troll::cuda.with_workspace(fake, std::size_t(1) << 40), mean257, chol257, mean257, chol257, w),
                  troll::shape_error);
  // Zero rows: nothing to do, nothing thrown.
  const auto none = troll::make_batch(p, 0, 3), none9 = troll::make_batch(p, 0, 9);
  const auto none_out = troll::make_batch(w, 0, 3), none_out9 = troll::make_batch(w, 0, 9);
  CHECK_NOTHROW(g::project_joint_backward(troll::cuda, none, none9, none, none9, 0.1, none, none9, nullptr, none,
                                          none9,
                                          g::gaussian_grads<double>{none_out, none_out9, none_out, none_out9, nullptr,
                                                                    nullptr}));
}

TEST_SUITE("device") {
#include "../bodies/gaussian_backward_fd.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
