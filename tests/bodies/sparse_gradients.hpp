// tests/bodies/sparse_gradients.hpp — the gradients of the sparse path against troll's gradient
// checker (finite differences, Richardson-extrapolated) and against each other: each backward
// (sparsify, align, project) with full Jacobians, the compositions
//   dense logits → sparsify → align → project → scalar loss
// with the support held fixed (logits well separated, δ away from the prefix boundary), the float
// backward against the double one, and the vocabulary-shard backward against the whole-row one.
//
// One body compiled per backend (as bodies/backward_gradient.hpp): tests/test_sparse_gradients.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_sparse_projection_oracle.cu with backend<cuda_policy> inside its "device"
// suite. The finite-difference side (the function the checker differentiates) is always the double
// CPU forward; the derivative under test runs its forward and backward on the backend, so a
// device forward feeds the device backward. Inputs are uploaded and outputs downloaded per call.
// The float-vs-double and shard comparisons run entirely on the backend.
//
// Include after <troll/gradcheck.hpp>, <troll/sparse.hpp>, "backend.hpp", "sparse_oracle.hpp",
// "sparse_staging.hpp", "tolerance.hpp",
// `using namespace sparse_test;` and the definition of troll_test::oracle_backend.

namespace {

using grad_backend = troll_test::oracle_backend;
template <class E>
using grad_buffer = typename grad_backend::template buffer<E>;

/// Whether this instantiation is the CPU's: there the tolerances are the ones the CPU suite has
/// always asserted; on a device they are widened to what docs/cuda.md documents where that is looser.
constexpr bool grad_on_cpu = std::is_same<grad_backend, troll_test::backend<troll::cpu_policy>>::value;

/// The finite-difference checker's tolerances for a gradient computed in T: the checker's defaults
/// (atol 1e-6, rtol 1e-4, step 1e-6) in double, which sit four orders above both the
/// difference's own error (~1e-8) and docs/cuda.md's device-vs-CPU bounds (project_backward
/// 1e-10 + 1e-9|v|, sparsify_backward 1e-13 + 1e-10|v|); float (not checked by differences here)
/// would add its rounding.
template <class T>
troll::gradcheck_options fd_options() {
  troll::gradcheck_options o;
  if (std::is_same<T, float>::value) {
    o.atol = 1e-4;
    o.rtol = 1e-3;
  }
  return o;
}

/// The float backward against the double one: |Δ| ≤ atol + rtol·max|g| over the batch
/// (docs/cuda.md's float sparsify bound, rtol 1e-5, is below this on the device too).
inline troll_test::tolerance float_vs_double_tolerance() { return {0.0, 1e-4}; }

/// The shard backward against the whole-row one (same backend, elements of type T):
/// |Δ| ≤ rtol·|whole| + atol·max|whole|. CPU: 1e-13 / 2e-7 relative, 1e-3 of that absolute; a
/// device: no tighter than docs/cuda.md's sparsify_backward bound (1e-13 + 1e-10|v| in double,
/// rtol 1e-5 for float values).
template <class T>
troll_test::tolerance shard_tolerance() {
  const bool is_float = std::is_same<T, float>::value;
  const double rel = grad_on_cpu ? (is_float ? 2e-7 : 1e-13) : (is_float ? 1e-5 : 1e-10);
  return {rel * 1e-3, rel};
}

/// Sparse batches staged on the backend (support/sparse_staging.hpp).
template <class T>
using staged_sparse = troll_test::staged_sparse<grad_backend, T>;
template <class T>
using staged_aligned = troll_test::staged_aligned<grad_backend, T>;
template <class T>
using staged_grads = troll_test::staged_grads<grad_backend, T>;

/// Host tokens (null: none) staged on the backend; get() is null when there are none.
struct staged_tokens {
  bool present;
  grad_buffer<troll::token_id> ids;
  staged_tokens(const troll::token_id* host, std::size_t rows)
      : present(host != nullptr),
        ids(host != nullptr ? std::vector<troll::token_id>(host, host + rows) : std::vector<troll::token_id>{}) {}
  const troll::token_id* get() { return present ? ids.get() : nullptr; }
};

/// The backend's sparsify of dense `z` (rows × vocab) into `out`.
template <class L, class T>
void bk_sparsify(const std::vector<L>& z, std::size_t rows, std::size_t vocab, const troll::token_id* sampled,
                 const troll::sparsify_options& opt, sparse_rows<T>& out) {
  grad_buffer<L> dz(z);
  staged_tokens ds(sampled, rows);
  staged_sparse<T> so(out);
  troll::sparsify(grad_backend::policy(), troll::make_batch(static_cast<const L*>(dz.get()), rows, vocab), ds.get(),
                  opt, so.view());
  so.download_to(out);
}

/// The backend's align of dense new logits `z` (their support `support`) with sparse old rows.
template <class L, class T>
void bk_align(const std::vector<L>& z, std::size_t rows, std::size_t vocab, const sparse_rows<T>& support,
              const sparse_rows<T>& old, aligned_rows<T>& out) {
  grad_buffer<L> dz(z);
  staged_sparse<T> ds(support), dold(old);
  staged_aligned<T> dout(out);
  troll::align(grad_backend::policy(), troll::make_batch(static_cast<const L*>(dz.get()), rows, vocab), ds.input(),
               dold.input(), dout.view());
  dout.download_to(out);
}

/// The backend's align of two sparse batches.
template <class T>
void bk_align(const sparse_rows<T>& new_rows, const sparse_rows<T>& old_rows, aligned_rows<T>& out) {
  staged_sparse<T> dn(new_rows), dold(old_rows);
  staged_aligned<T> dout(out);
  troll::align(grad_backend::policy(), dn.input(), dold.input(), dout.view());
  dout.download_to(out);
}

template <class T>
void bk_align_backward(const sparse_rows<T>& row, const aligned_rows<T>& aligned, const sparse_grads<T>& grad_aligned,
                       sparse_grads<T>& grad_row) {
  staged_sparse<T> dr(row);
  staged_aligned<T> da(aligned);
  staged_grads<T> dg(grad_aligned), dgr(grad_row);
  troll::align_backward(grad_backend::policy(), dr.input(), da.input(), dg.input(), dgr.view());
  dgr.download_to(grad_row);
}

/// The backend's sparsify_backward of dense `z` given a support as a device sparse view.
template <class L, class T, class SupportView>
std::vector<T> bk_sparsify_backward_on(const std::vector<L>& z, std::size_t rows, std::size_t vocab,
                                       SupportView support, const sparse_grads<T>& grad) {
  grad_buffer<L> dz(z);
  staged_grads<T> dg(grad);
  grad_buffer<T> dgz(rows * vocab);
  troll::sparsify_backward(grad_backend::policy(), troll::make_batch(static_cast<const L*>(dz.get()), rows, vocab),
                           support, dg.input(), troll::make_batch(dgz.get(), rows, vocab));
  return dgz.download();
}

template <class L, class T>
std::vector<T> bk_sparsify_backward(const std::vector<L>& z, std::size_t rows, std::size_t vocab,
                                    const sparse_rows<T>& support, const sparse_grads<T>& grad) {
  staged_sparse<T> ds(support);
  return bk_sparsify_backward_on(z, rows, vocab, ds.input(), grad);
}

/// As above with the new side of aligned rows as the support.
template <class L, class T>
std::vector<T> bk_sparsify_backward(const std::vector<L>& z, std::size_t rows, std::size_t vocab,
                                    const aligned_rows<T>& support, const sparse_grads<T>& grad) {
  staged_aligned<T> ds(support);
  return bk_sparsify_backward_on(z, rows, vocab, ds.input().new_side(), grad);
}

constexpr std::size_t vocab = 40;

/// Logits with gaps ≥ 0.05 between any two tokens, so a 1e-6 step never reorders them.
std::vector<double> separated_logits(std::mt19937_64& rng, double scale) {
  std::vector<double> z(vocab);
  std::vector<std::size_t> perm(vocab);
  std::iota(perm.begin(), perm.end(), std::size_t(0));
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<double> jitter(0.0, 0.02);
  for (std::size_t j = 0; j < vocab; ++j) z[perm[j]] = -scale * 0.1 * double(j) + jitter(rng);
  return z;
}

struct fixture {
  std::vector<double> x0, zo;
  sparse_rows<double> so;
  std::vector<double> weight;  // loss weight per token id
  double weight_bucket = 0.7;
  double eps = 0.02;
  troll::token_id sampled = 0;

  explicit fixture(unsigned seed) : so(1, 7, vocab), weight(vocab) {
    std::mt19937_64 rng(seed);
    x0 = separated_logits(rng, 2.0);
    zo = separated_logits(rng, 1.5);
    troll::sparsify(troll::cpu, troll::make_batch(zo.data(), 1, vocab), nullptr, {6, 1e-3}, so.view());
    std::normal_distribution<double> n01;
    for (double& w : weight) w = n01(rng);
    // A sampled token ranked low in the new row, so it is added, not selected.
    std::vector<std::size_t> order(vocab);
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return x0[a] > x0[b]; });
    sampled = troll::token_id(order[vocab - 5]);
  }

  double loss_of(const sparse_rows<double>& out) const {
    double sum = weight_bucket * out.log_remainder[0];
    for (int i = 0; i < out.counts[0]; ++i) sum += weight[std::size_t(out.indices[std::size_t(i)])] * out.log_probs[std::size_t(i)];
    return sum;
  }
  void seed_grad(const sparse_rows<double>& out, sparse_grads<double>& g) const {
    for (int i = 0; i < out.counts[0]; ++i) g.log_probs[std::size_t(i)] = weight[std::size_t(out.indices[std::size_t(i)])];
    g.log_remainder[0] = weight_bucket;
  }
};

}  // namespace

TEST_CASE("composition: dense logits -> sparsify -> align(logits, support, old) -> project -> loss") {
  for (unsigned seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    fixture fx(seed);
    std::vector<troll::sparse_index> base_support;
    auto loss = [&](const double* x) {  // the CPU forward, differentiated by the checker
      sparse_rows<double> sn(1, 6, vocab), out(1, 16, vocab);
      aligned_rows<double> al(1, 16, vocab);
      troll::projection_stats st;
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, {5, 0.0}, sn.view());
      troll::align(troll::cpu, troll::make_batch(x, 1, vocab), troll::sparse_batch_view<const double>(sn.view()),
                   fx.so.view(), al.view());
      troll::project(troll::cpu, al.view(), fx.eps, out.view(), &st);
      REQUIRE(std::vector<troll::sparse_index>(sn.indices.begin(), sn.indices.begin() + sn.counts[0]) == base_support);
      return fx.loss_of(out);
    };
    auto grad = [&](const double* x, double* gx) {  // forward and backward on the backend
      const std::vector<double> z(x, x + vocab);
      sparse_rows<double> sn(1, 6, vocab), out(1, 16, vocab);
      aligned_rows<double> al(1, 16, vocab);
      std::vector<troll::projection_stats> st(1);
      bk_sparsify(z, 1, vocab, &fx.sampled, {5, 0.0}, sn);
      bk_align(z, 1, vocab, sn, fx.so, al);
      troll_test::project_on<grad_backend>(al, fx.eps, out, st);
      CHECK(st[0].status == troll::row_status::projected);
      sparse_grads<double> g(1, 16), gnew(1, 16);
      fx.seed_grad(out, g);
      troll_test::project_backward_on<grad_backend>(al, out, st, g, gnew);
      const std::vector<double> gz = bk_sparsify_backward(z, 1, vocab, al, gnew);
      std::copy(gz.begin(), gz.end(), gx);
    };
    {
      sparse_rows<double> sn(1, 6, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, {5, 0.0}, sn.view());
      base_support.assign(sn.indices.begin(), sn.indices.begin() + sn.counts[0]);
      REQUIRE(sn.counts[0] == 6);
    }
    const troll::gradcheck_result res = troll::check_gradient(loss, grad, fx.x0, fd_options<double>());
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("composition: dense logits -> sparsify -> align(sparse, sparse) -> project -> loss") {
  for (unsigned seed : {4u, 5u, 6u}) {
    CAPTURE(seed);
    fixture fx(seed);
    const troll::sparsify_options opt{8, 2e-2};
    std::vector<troll::sparse_index> base_support;
    auto loss = [&](const double* x) {  // the CPU forward, differentiated by the checker
      sparse_rows<double> sn(1, 9, vocab), out(1, 20, vocab);
      aligned_rows<double> al(1, 20, vocab);
      troll::projection_stats st;
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, opt, sn.view());
      troll::align(troll::cpu, troll::sparse_batch_view<const double>(sn.view()), fx.so.view(), al.view());
      troll::project(troll::cpu, al.view(), fx.eps, out.view(), &st);
      REQUIRE(std::vector<troll::sparse_index>(sn.indices.begin(), sn.indices.begin() + sn.counts[0]) == base_support);
      return fx.loss_of(out);
    };
    auto grad = [&](const double* x, double* gx) {  // forward and backward on the backend
      const std::vector<double> z(x, x + vocab);
      sparse_rows<double> sn(1, 9, vocab), out(1, 20, vocab);
      aligned_rows<double> al(1, 20, vocab);
      std::vector<troll::projection_stats> st(1);
      bk_sparsify(z, 1, vocab, &fx.sampled, opt, sn);
      bk_align(sn, fx.so, al);
      troll_test::project_on<grad_backend>(al, fx.eps, out, st);
      CHECK(st[0].status == troll::row_status::projected);
      sparse_grads<double> g(1, 20), gal(1, 20), gsn(1, 9);
      fx.seed_grad(out, g);
      troll_test::project_backward_on<grad_backend>(al, out, st, g, gal);
      bk_align_backward(sn, al, gal, gsn);
      const std::vector<double> gz = bk_sparsify_backward(z, 1, vocab, sn, gsn);
      std::copy(gz.begin(), gz.end(), gx);
    };
    {
      sparse_rows<double> sn(1, 9, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, opt, sn.view());
      base_support.assign(sn.indices.begin(), sn.indices.begin() + sn.counts[0]);
      // δ is not near the prefix boundary: the kept prefix's rest mass is well below δ and the
      // one before it well above.
      INFO("support size " << sn.counts[0]);
      REQUIRE(sn.counts[0] >= 2);
    }
    const troll::gradcheck_result res = troll::check_gradient(loss, grad, fx.x0, fd_options<double>());
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("project_backward on aligned rows: full Jacobian in new, old and eps") {
  fixture fx(7);
  sparse_rows<double> sn(1, 7, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), nullptr, {6, 1e-3}, sn.view());
  aligned_rows<double> al0(1, 14, vocab);
  troll::align(troll::cpu, sn.view(), fx.so.view(), al0.view());
  const int u = al0.counts[0];
  const std::size_t m = std::size_t(u) + 1;
  // x = [new entries, new bucket, old entries, old bucket, eps]
  std::vector<double> x0;
  for (int i = 0; i < u; ++i) x0.push_back(al0.new_log_probs[std::size_t(i)]);
  x0.push_back(al0.new_log_remainder[0]);
  for (int i = 0; i < u; ++i) x0.push_back(al0.old_log_probs[std::size_t(i)]);
  x0.push_back(al0.old_log_remainder[0]);
  x0.push_back(fx.eps);
  auto unpack = [&](const double* x, aligned_rows<double>& al) {
    al = al0;
    for (int i = 0; i < u; ++i) {
      al.new_log_probs[std::size_t(i)] = x[i];
      al.old_log_probs[std::size_t(i)] = x[std::size_t(u) + 1 + std::size_t(i)];
    }
    al.new_log_remainder[0] = x[u];
    al.old_log_remainder[0] = x[2 * std::size_t(u) + 1];
  };
  auto f = [&](const double* x, double* y) {  // the CPU forward
    aligned_rows<double> al;
    unpack(x, al);
    sparse_rows<double> out(1, 14, vocab);
    troll::projection_stats st;
    troll::project(troll::cpu, al.view(), x[2 * m], out.view(), &st);
    for (int i = 0; i < u; ++i) y[i] = out.log_probs[std::size_t(i)];
    y[u] = out.log_remainder[0];
  };
  auto vjp = [&](const double* x, const double* gy, double* gx) {  // on the backend
    aligned_rows<double> al;
    unpack(x, al);
    sparse_rows<double> out(1, 14, vocab);
    std::vector<troll::projection_stats> st(1);
    troll_test::project_on<grad_backend>(al, x[2 * m], out, st);
    REQUIRE(st[0].status == troll::row_status::projected);
    sparse_grads<double> g(1, 14), gn(1, 14), go(1, 14);
    std::copy(gy, gy + u, g.log_probs.begin());
    g.log_remainder[0] = gy[u];
    double ge = 0.0;
    troll_test::project_backward_on<grad_backend>(al, out, st, g, gn, &go, &ge);
    for (int i = 0; i < u; ++i) {
      gx[i] = gn.log_probs[std::size_t(i)];
      gx[m + std::size_t(i)] = go.log_probs[std::size_t(i)];
    }
    gx[u] = gn.log_remainder[0];
    gx[m + std::size_t(u)] = go.log_remainder[0];
    gx[2 * m] = ge;
  };
  const troll::gradcheck_result res = troll::check_vjp(f, vjp, x0, m, fd_options<double>());
  INFO(res.report());
  CHECK(res.ok);
}

TEST_CASE("align_backward and sparsify_backward: full Jacobians") {
  fixture fx(8);
  sparse_rows<double> sn0(1, 9, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(fx.x0.data(), 1, vocab), &fx.sampled, {8, 1e-3}, sn0.view());
  const int c = sn0.counts[0];
  SUBCASE("align_backward, both sides") {
    for (int side = 0; side < 2; ++side) {
      CAPTURE(side);
      std::vector<double> x0(sn0.log_probs.begin(), sn0.log_probs.begin() + c);
      x0.push_back(sn0.log_remainder[0]);
      aligned_rows<double> probe(1, 20, vocab);
      troll::align(troll::cpu, sn0.view(), fx.so.view(), probe.view());
      const std::size_t m = std::size_t(probe.counts[0]) + 1;
      auto with = [&](const double* x) {
        sparse_rows<double> sn = sn0;
        std::copy(x, x + c, sn.log_probs.begin());
        sn.log_remainder[0] = x[c];
        return sn;
      };
      auto f = [&](const double* x, double* y) {  // the CPU forward
        aligned_rows<double> al(1, 20, vocab);
        const sparse_rows<double> sn = with(x);
        if (side == 0) troll::align(troll::cpu, sn.view(), fx.so.view(), al.view());
        else troll::align(troll::cpu, fx.so.view(), sn.view(), al.view());
        const auto& lp = side == 0 ? al.new_log_probs : al.old_log_probs;
        for (std::size_t i = 0; i + 1 < m; ++i) y[i] = lp[i];
        y[m - 1] = side == 0 ? al.new_log_remainder[0] : al.old_log_remainder[0];
      };
      auto vjp = [&](const double* x, const double* gy, double* gx) {  // on the backend
        aligned_rows<double> al(1, 20, vocab);
        const sparse_rows<double> sn = with(x);
        if (side == 0) bk_align(sn, fx.so, al);
        else bk_align(fx.so, sn, al);
        sparse_grads<double> g(1, 20), gs(1, 9);
        std::copy(gy, gy + m - 1, g.log_probs.begin());
        g.log_remainder[0] = gy[m - 1];
        bk_align_backward(sn, al, g, gs);
        std::copy(gs.log_probs.begin(), gs.log_probs.begin() + c, gx);
        gx[c] = gs.log_remainder[0];
      };
      const troll::gradcheck_result res = troll::check_vjp(f, vjp, x0, m, fd_options<double>());
      INFO(res.report());
      CHECK(res.ok);
    }
  }
  SUBCASE("sparsify_backward") {
    const std::size_t m = std::size_t(c) + 1;
    auto f = [&](const double* x, double* y) {  // the CPU forward
      sparse_rows<double> sn(1, 9, vocab);
      troll::sparsify(troll::cpu, troll::make_batch(x, 1, vocab), &fx.sampled, {8, 1e-3}, sn.view());
      REQUIRE(sn.indices == sn0.indices);
      std::copy(sn.log_probs.begin(), sn.log_probs.begin() + c, y);
      y[c] = sn.log_remainder[0];
    };
    auto vjp = [&](const double* x, const double* gy, double* gx) {  // on the backend
      sparse_grads<double> g(1, 9);
      std::copy(gy, gy + c, g.log_probs.begin());
      g.log_remainder[0] = gy[c];
      const std::vector<double> gz = bk_sparsify_backward(std::vector<double>(x, x + vocab), 1, vocab, sn0, g);
      std::copy(gz.begin(), gz.end(), gx);
    };
    const troll::gradcheck_result res = troll::check_vjp(f, vjp, fx.x0, m, fd_options<double>());
    INFO(res.report());
    CHECK(res.ok);
  }
}

TEST_CASE("float backward agrees with double") {
  std::mt19937_64 rng(12);
  const std::size_t big = 20000, rows = 3;
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    auto a = zipf_logits<double>(big, 1.2, 0.3, rng);
    auto b = zipf_logits<double>(big, 1.2, 0.3, rng);
    zn.insert(zn.end(), a.begin(), a.end());
    zo.insert(zo.end(), b.begin(), b.end());
  }
  std::vector<float> znf(zn.begin(), zn.end()), zof(zo.begin(), zo.end());
  std::vector<double> zn_round(znf.begin(), znf.end()), zo_round(zof.begin(), zof.end());
  auto run = [&](auto tag, const auto& z_new, const auto& z_old, std::vector<double>& grad_out) {
    using T = decltype(tag);
    sparse_rows<T> sn(rows, 65, big), so(rows, 65, big), out(rows, 130, big);
    aligned_rows<T> al(rows, 130, big);
    bk_sparsify(z_new, rows, big, nullptr, {64, 1e-5}, sn);
    bk_sparsify(z_old, rows, big, nullptr, {64, 1e-5}, so);
    bk_align(z_new, rows, big, sn, so, al);
    std::vector<troll::projection_stats> st(rows);
    troll_test::project_on<grad_backend>(al, 0.05, out, st);
    sparse_grads<T> g(rows, 130), gn(rows, 130);
    for (std::size_t r = 0; r < rows; ++r)
      for (int i = 0; i < out.counts[r]; ++i) g.log_probs[r * 130 + std::size_t(i)] = T(std::sin(double(out.indices[r * 130 + std::size_t(i)])));
    troll_test::project_backward_on<grad_backend>(al, out, st, g, gn);
    const std::vector<T> gz = bk_sparsify_backward(z_new, rows, big, al, gn);
    grad_out.assign(gz.begin(), gz.end());
  };
  std::vector<double> gd, gf;
  run(double{}, zn_round, zo_round, gd);
  run(float{}, znf, zof, gf);
  double scale = 0.0, worst = 0.0;
  for (std::size_t i = 0; i < gd.size(); ++i) {
    scale = std::max(scale, std::fabs(gd[i]));
    worst = std::max(worst, std::fabs(gd[i] - gf[i]));
  }
  const troll_test::tolerance tol = float_vs_double_tolerance();
  CHECK(worst <= tol.atol + tol.rtol * scale);
}

namespace {

/// Shard s of n of a row of `vocab` tokens: [cut(s), cut(s + 1)), uneven widths.
std::size_t shard_cut(std::size_t s, std::size_t n, std::size_t vocab) { return vocab * s * s / (n * n); }

template <class T>
void shard_backward_matches_whole_row(std::size_t big, std::size_t shards) {
  std::mt19937_64 rng(21 + big);
  const std::size_t rows = 4;
  const troll::sparsify_options opt{16, 1e-4};
  std::vector<T> z;
  for (std::size_t r = 0; r < rows; ++r) {
    auto row = zipf_logits<T>(big, 1.1, 0.4, rng);
    if (r == 2)
      for (std::size_t j = 0; j < big; j += 3) row[j] = -std::numeric_limits<T>::infinity();  // masked tokens
    z.insert(z.end(), row.begin(), row.end());
  }
  const std::vector<troll::token_id> sampled{3, troll::token_id(big - 1), 1, troll::token_id(big / 2)};
  const auto policy = grad_backend::policy();
  grad_buffer<T> dz(z);
  grad_buffer<troll::token_id> dsampled(sampled);
  grad_buffer<troll::sparsify_state> states(shards * rows);  // shard s: rows states from s · rows
  auto state = [&](std::size_t s) { return states.get() + s * rows; };
  for (std::size_t s = 0; s < shards; ++s) {
    const std::size_t begin = shard_cut(s, shards, big), end = shard_cut(s + 1, shards, big);
    troll::sparsify_shard(policy, troll::batch_view<const T>{dz.get() + begin, rows, end - begin, big}, begin, big,
                          static_cast<const troll::token_id*>(dsampled.get()), opt, state(s));
  }
  for (std::size_t s = 1; s < shards; ++s)
    troll::sparsify_merge(policy, state(0), static_cast<const troll::sparsify_state*>(state(s)), rows);
  sparse_rows<T> support_host(rows, 17, big);
  staged_sparse<T> support(support_host);
  grad_buffer<double> log_sums(troll::sparsify_log_sums_width * rows);
  troll::sparsify_finalize(policy, static_cast<const troll::sparsify_state*>(state(0)), opt, support.view(),
                           log_sums.get());
  sparse_grads<T> g(rows, 17);
  for (std::size_t i = 0; i < g.log_probs.size(); ++i) g.log_probs[i] = T(std::sin(0.7 * double(i)));
  for (std::size_t r = 0; r < rows; ++r) g.log_remainder[r] = T(0.3 - 0.2 * double(r));
  staged_grads<T> dg(g);
  grad_buffer<T> dwhole(rows * big), dsharded(std::vector<T>(rows * big, T(-99)));
  troll::sparsify_backward(policy, troll::make_batch(static_cast<const T*>(dz.get()), rows, big), support.input(),
                           dg.input(), troll::make_batch(dwhole.get(), rows, big));
  for (std::size_t s = 0; s < shards; ++s) {
    const std::size_t begin = shard_cut(s, shards, big), end = shard_cut(s + 1, shards, big);
    troll::sparsify_shard_backward(policy, troll::batch_view<const T>{dz.get() + begin, rows, end - begin, big}, begin,
                                   support.input(), dg.input(), static_cast<const double*>(log_sums.get()),
                                   troll::batch_view<T>{dsharded.get() + begin, rows, end - begin, big});
  }
  const std::vector<T> whole = dwhole.download(), sharded = dsharded.download();
  double scale = 0.0;
  for (T v : whole) scale = std::max(scale, std::fabs(double(v)));
  const troll_test::tolerance tol = shard_tolerance<T>();
  for (std::size_t i = 0; i < whole.size(); ++i) {
    CAPTURE(i);
    CHECK(std::fabs(double(whole[i]) - double(sharded[i])) <= tol.rtol * std::fabs(double(whole[i])) + tol.atol * scale);
  }
}

}  // namespace

TEST_CASE("sparsify_shard_backward: each shard's columns of sparsify_backward, from the finalised log-sums") {
  // sparsify_backward is checked against full Jacobians above; the shard path must agree with it.
  for (std::size_t shards : {1u, 2u, 3u, 5u}) {
    CAPTURE(shards);
    shard_backward_matches_whole_row<double>(4099, shards);
    shard_backward_matches_whole_row<float>(4099, shards);
  }
}
