// tests/bodies/kl_gradient.hpp — troll::kl against a long-double reference and troll::kl_backward
// (both gradients) against troll's gradient checker (finite differences), masked tokens included,
// full Jacobians and random directions at V = 4096; and the composite loss KL(p̃ ‖ π*) + Σ w log π*
// chaining kl_backward into project_backward (also with a masked new token):
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

troll::gradcheck_options kl_opts(double atol = 1e-7, double rtol = 1e-5) {
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

namespace {

/// kl_backward of one row pair in T through the backend, against the long-double textbook
/// gradients g(q − p) and g·p(log p − log q − KL): grad_q to 64 ulp of max(|g(q − p)|, q) +
/// 1e-300, grad_p to 1e-12 (double) or 1e-5 (float) relative to the row's largest entry.
template <class T>
void check_kl_backward_row(const std::vector<T>& zp, const std::vector<T>& zq, double g) {
  const std::size_t v = zp.size();
  typename backend::template buffer<T> p(zp), q(zq), gp(v), gq(v);
  typename backend::template buffer<T> up(std::vector<T>{static_cast<T>(g)});
  troll::kl_backward(backend::policy(), troll::make_batch<const T>(p.get(), 1, v),
                     troll::make_batch<const T>(q.get(), 1, v), static_cast<const T*>(up.get()),
                     troll::make_batch(gp.get(), 1, v), troll::make_batch(gq.get(), 1, v));
  const std::vector<T> got_p = gp.download(), got_q = gq.download();
  auto log_softmax = [](const std::vector<T>& z) {
    long double m = -INFINITY, s = 0.0L;
    for (T x : z) m = std::max(m, static_cast<long double>(x));
    for (T x : z) s += std::exp(static_cast<long double>(x) - m);
    std::vector<long double> out;
    for (T x : z) out.push_back(static_cast<long double>(x) - m - std::log(s));
    return out;
  };
  const std::vector<long double> lp = log_softmax(zp), lq = log_softmax(zq);
  long double kl = 0.0L;
  for (std::size_t j = 0; j < v; ++j)
    if (zp[j] > -INFINITY) kl += std::exp(lp[j]) * (lp[j] - lq[j]);
  const double ulp = std::numeric_limits<T>::epsilon();
  double scale_p = 0.0;
  std::vector<double> want_p(v);
  for (std::size_t j = 0; j < v; ++j) {
    want_p[j] = zp[j] > -INFINITY ? static_cast<double>(g * std::exp(lp[j]) * (lp[j] - lq[j] - kl)) : 0.0;
    scale_p = std::max(scale_p, std::fabs(want_p[j]));
  }
  for (std::size_t j = 0; j < v; ++j) {
    CAPTURE(j);
    const long double pj = std::exp(lp[j]), qj = std::exp(lq[j]);
    const double want_q = static_cast<double>(g * (qj - pj));
    const double tol_q = 64.0 * ulp * std::max<double>(std::fabs(want_q), static_cast<double>(qj + pj)) + 1e-300;
    CHECK(std::fabs(static_cast<double>(got_q[j]) - want_q) <= tol_q);
    CHECK(std::fabs(static_cast<double>(got_p[j]) - want_p[j]) <=
          (sizeof(T) == sizeof(double) ? 1e-12 : 1e-5) * scale_p);
  }
}

}  // namespace

TEST_CASE("kl_backward with a huge finite mask in the old row: grad_q keeps p at every token") {
  // A finite −1e17 … −1e300 (float: −1e30 … −3e38) old logit beside O(1) ones: q_j e^{x_j} was
  // formed as e^{log q_j + x_j}, a sum of two numbers of that size, wrong by their ulps, and the
  // reference token's grad_q came out g·q_r instead of g(q_r − p_r).
  for (double mask : {-3e16, -1e17, -1e30, -1e300}) {
    CAPTURE(mask);
    check_kl_backward_row<double>({2.0, -0.5, -0.2}, {-2.0, -0.2, mask}, 1.0);
    check_kl_backward_row<double>({0.3, 1.7, -0.4, 0.9, -2.0}, {mask, 0.1, -0.3, 0.5, 1.1}, -0.7);
    check_kl_backward_row<double>({0.3, mask, -0.4, 0.9}, {0.5, mask, mask, 0.2}, 2.0);
  }
  for (float mask : {-1e9f, -1e30f, -3e38f}) {
    CAPTURE(mask);
    check_kl_backward_row<float>({-0.28f, -0.67f, -1.06f, -INFINITY, 0.48f, -0.24f},
                                 {0.1f, -0.3f, 0.2f, 0.0f, 0.4f, mask}, 1.0);
    check_kl_backward_row<float>({2.0f, -0.5f, -0.2f}, {-2.0f, -0.2f, mask}, 1.0);
  }
}

TEST_CASE("kl_backward: full Jacobian check of both gradients, masked tokens included") {
  rng g(10);
  for (std::size_t v : {std::size_t(6), std::size_t(11)}) {
    const pair_batch b = kl_rows(g, v);
    const packing pack(b, true, false, 0.0);
    const troll::gradcheck_result r =
        troll::check_vjp(kl_function{&pack}, kl_vjp{&pack}, pack.x0(), b.rows, kl_opts());
    INFO("V = " << v << "\n" << r.report());
    CHECK(r.ok);
    CHECK(r.checked == b.rows * pack.size());
  }
}

TEST_CASE("kl_backward: random directions at V = 4096") {
  rng g(12);
  const pair_batch b = kl_rows(g, 4096);
  const packing pack(b, true, false, 0.0);
  troll::gradcheck_options o = kl_opts(1e-8, 1e-5);
  o.directions = 12;
  const troll::gradcheck_result r =
      troll::check_vjp_random(kl_function{&pack}, kl_vjp{&pack}, pack.x0(), b.rows, o);
  INFO(r.report());
  CHECK(r.ok);
  CHECK(r.checked == 12);
}

namespace {

/// L = Σ_r KL(p̃_r ‖ π*_r) + Σ w log π* through kl_backward and project_backward, checked with
/// check_gradient over (z̃, z°, log ε): the loss through the CPU, the gradient's kl_backward and
/// project_backward on the backend (fed the CPU forward). KL's gradient w.r.t. the logits of its second argument,
/// fed log π* as logits, is the upstream ∂L/∂log π* of the projection (log π* is normalised, so
/// log_softmax is the identity there). With `new_row_mask`, row 1's new logits mask a token.
void check_composite_kl_loss(bool new_row_mask) {
  rng g(21);
  const std::size_t v = 9, rows = 3;
  pair_batch b(rows, v);
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> zo = g.normals(v, 1.0), zn = zo;
    for (double& z : zn) z += (r == 2 ? 0.02 : 1.4) * g.normal();
    if (r == 1 && new_row_mask) zn[3] = neg_inf, zo[3] = -4.0;  // π* masks it too
    b.set_row(r, zn, zo);
  }
  const double eps = 0.06;
  const std::vector<double> w = g.normals(rows * v, 1.0);
  const packing pack(b, true, true, eps);

  auto loss = [&](const double* x) {
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    std::vector<double> k(rows);
    troll::kl(troll::cpu, troll::make_batch(bb.new_logits.data(), rows, v),
              troll::make_batch(f.log_probs.data(), rows, v), k.data());
    double total = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      total += k[r];
      for (std::size_t j = 0; j < v; ++j)
        if (f.log_probs[r * v + j] != neg_inf) total += w[r * v + j] * f.log_probs[r * v + j];
    }
    return total;
  };
  auto grad = [&](const double* x, double* gx) {  // kl_backward and project_backward on the backend
    pair_batch bb;
    double e;
    pack.unpack(x, bb, e);
    const forward_result f = forward(bb, e);
    using buffer = typename backend::template buffer<double>;
    buffer zn(bb.new_logits), zo(bb.old_logits), lp(f.log_probs), ones(std::vector<double>(rows, 1.0)),
        gp(std::vector<double>(rows * v, 0.0)), gq(std::vector<double>(rows * v, 0.0));
    typename backend::template buffer<troll::projection_stats> stats(f.stats);
    troll::kl_backward(backend::policy(), troll::make_batch<const double>(zn.get(), rows, v),
                       troll::make_batch<const double>(lp.get(), rows, v), static_cast<const double*>(ones.get()),
                       troll::make_batch(gp.get(), rows, v), troll::make_batch(gq.get(), rows, v));
    const std::vector<double> gp_host = gp.download(), gq_host = gq.download();
    std::vector<double> up(rows * v);
    for (std::size_t k = 0; k < up.size(); ++k) up[k] = gq_host[k] + w[k];
    buffer up_b(up), gn(std::vector<double>(rows * v, 0.0)), go(std::vector<double>(rows * v, 0.0)),
        ge(std::vector<double>(rows, 0.0));
    troll::project_backward(backend::policy(), troll::make_batch<const double>(zn.get(), rows, v),
                            troll::make_batch<const double>(zo.get(), rows, v),
                            troll::make_batch<const double>(lp.get(), rows, v),
                            static_cast<const troll::projection_stats*>(stats.get()),
                            troll::make_batch<const double>(up_b.get(), rows, v), troll::make_batch(gn.get(), rows, v),
                            troll::make_batch(go.get(), rows, v), ge.get());
    std::vector<double> gn_host = gn.download();
    for (std::size_t k = 0; k < gn_host.size(); ++k) gn_host[k] += gp_host[k];  // the direct p̃ path of KL
    pack.pack_gradient(gn_host, go.download(), ge.download(), e, gx);
  };
  const forward_result f0 = forward(b, eps);
  CHECK(f0.stats[0].status == troll::row_status::projected);
  CHECK(f0.stats[1].status == troll::row_status::projected);
  CHECK(f0.stats[2].status == troll::row_status::inactive);
  const troll::gradcheck_result r = troll::check_gradient(loss, grad, pack.x0(), kl_opts());
  INFO(r.report());
  CHECK(r.ok);
}

}  // namespace

TEST_CASE("composite: L = KL(p̃ ‖ π*) + Σ w log π*, kl_backward chained into project_backward") {
  check_composite_kl_loss(false);
}

TEST_CASE("composite KL(p̃ ‖ π*) loss when the new row masks a token") {
  // The TROLL regulariser KL(p̃ ‖ π*) on a row whose new logits mask a token: p̃ and π* are then
  // both −inf there and nothing else is masked (was NaN, through the bug above).
  check_composite_kl_loss(true);
}
