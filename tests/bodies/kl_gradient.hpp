// tests/bodies/kl_gradient.hpp — troll::kl against a long-double reference and troll::kl_backward
// (both gradients) against troll's gradient checker (finite differences), masked tokens included:
// one body compiled per backend (as bodies/projection_oracle.hpp): tests/test_kl_gradient.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_kl_gradient.cu with backend<cuda_policy> inside its "device" suite.
// Include after "grad_helpers.hpp", "backend.hpp", `using namespace grad_helpers;` and the
// definition of troll_test::oracle_backend.

namespace {

using backend = troll_test::oracle_backend;

/// KL of one row pair through the backend.
double one_kl(const std::vector<double>& zp, const std::vector<double>& zq) {
  typename backend::template buffer<double> p(zp), q(zq), out(std::vector<double>{-1.0});
  troll::kl(backend::policy(), troll::make_batch<const double>(p.get(), 1, zp.size()),
            troll::make_batch<const double>(q.get(), 1, zq.size()), out.get());
  return out.download()[0];
}

/// KL per row as a checker function over the finite entries of (p logits, q logits).
struct kl_function {
  const packing* pack;
  void operator()(const double* x, double* y) const {
    pair_batch b;
    double unused;
    pack->unpack(x, b, unused);
    typename backend::template buffer<double> p(b.new_logits), q(b.old_logits), out(b.rows);
    troll::kl(backend::policy(), troll::make_batch<const double>(p.get(), b.rows, b.cols),
              troll::make_batch<const double>(q.get(), b.rows, b.cols), out.get());
    const std::vector<double> host = out.download();
    std::copy(host.begin(), host.end(), y);
  }
};

/// kl_backward as a checker VJP: upstream gy = ∂L/∂KL_r.
struct kl_vjp {
  const packing* pack;
  bool want_p = true, want_q = true;
  void operator()(const double* x, const double* gy, double* gx) const {
    pair_batch b;
    double unused;
    pack->unpack(x, b, unused);
    const std::size_t rows = b.rows, v = b.cols;
    typename backend::template buffer<double> p(b.new_logits), q(b.old_logits), up(std::vector<double>(gy, gy + rows));
    typename backend::template buffer<double> gp_out(std::vector<double>(rows * v, 0.0));
    typename backend::template buffer<double> gq_out(std::vector<double>(rows * v, 0.0));
    troll::kl_backward(backend::policy(), troll::make_batch<const double>(p.get(), rows, v),
                       troll::make_batch<const double>(q.get(), rows, v), up.get(),
                       want_p ? troll::make_batch(gp_out.get(), rows, v) : troll::batch_view<double>{},
                       want_q ? troll::make_batch(gq_out.get(), rows, v) : troll::batch_view<double>{});
    pack->pack_gradient(gp_out.download(), gq_out.download(), {}, 0.0, gx);
  }
};

/// Rows for the KL checks: plain, peaked, large logits, masks on the p side and on both sides.
pair_batch kl_rows(rng& g, std::size_t v) {
  const std::size_t rows = 5;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zq = g.normals(v, 1.0), zp = zq;
    for (double& z : zp) z += 1.2 * g.normal();
    if (r == 1) zp[1] += 15.0;                                           // peaked p
    if (r == 2) for (double& z : zp) z *= 30.0;                          // logits up to ~±100
    if (r == 3) zp[0] = neg_inf, zp[v - 1] = neg_inf;                    // p masks two tokens
    if (r == 4) zp[2] = zq[2] = neg_inf, zp[4] = neg_inf, zq[5] -= 8.0;  // masked in both + p-only
    b.set_row(r, zp, zq);
  }
  return b;
}

troll::gradcheck_options opts(double atol = 1e-7, double rtol = 1e-5) {
  troll::gradcheck_options o;
  o.atol = atol;
  o.rtol = rtol;
  return o;
}

}  // namespace

TEST_CASE("kl matches a long-double reference, with masks, and is +inf where q masks p's mass") {
  rng g(3);
  for (std::size_t v : {std::size_t(2), std::size_t(9), std::size_t(700), std::size_t(4096)}) {
    pair_batch b = kl_rows(g, std::max<std::size_t>(v, 6));
    const std::size_t n = b.cols;
    typename backend::template buffer<double> p(b.new_logits), q(b.old_logits), out_dev(std::vector<double>(b.rows, -1.0));
    troll::kl(backend::policy(), troll::make_batch<const double>(p.get(), b.rows, n),
              troll::make_batch<const double>(q.get(), b.rows, n), out_dev.get());
    const std::vector<double> out = out_dev.download();
    for (std::size_t r = 0; r < b.rows; ++r) {
      const double want = reference_kl(b.new_row(r), b.old_row(r), n);
      INFO("V = " << n << " row " << r);
      CHECK(out[r] >= 0.0);
      CHECK(std::fabs(out[r] - want) <= 1e-12 + 1e-11 * want);
    }
  }
  // p ≡ q (any shift): KL = 0 up to rounding
  std::vector<double> zp = {0.5, -1.0, 2.0, neg_inf}, zq = {3.5, 2.0, 5.0, neg_inf};
  zq[3] = -1.0;  // q has mass p lacks: still finite
  double k = one_kl(zp, zq);
  CHECK(k == doctest::Approx(reference_kl(zp.data(), zq.data(), 4)).epsilon(1e-12));
  // p has mass where q is -inf: exactly +inf
  std::vector<double> ap = {0.0, 1.0, 2.0}, aq = {0.0, neg_inf, 1.0};
  k = one_kl(ap, aq);
  CHECK(k == std::numeric_limits<double>::infinity());
}

TEST_CASE("kl_backward: full Jacobian check of both gradients, masked tokens included") {
  rng g(10);
  for (std::size_t v : {std::size_t(6), std::size_t(11)}) {
    const pair_batch b = kl_rows(g, v);
    const packing pack(b, true, false, 0.0);
    const troll::gradcheck_result r =
        troll::check_vjp(kl_function{&pack}, kl_vjp{&pack}, pack.x0(), b.rows, opts());
    INFO("V = " << v << "\n" << r.report());
    CHECK(r.ok);
    CHECK(r.checked == b.rows * pack.size());
  }
}
