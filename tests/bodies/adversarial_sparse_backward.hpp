// tests/bodies/adversarial_sparse_backward.hpp — the sparse project_backward (VJP) against central
// differences of the sparse project on adversarial aligned rows
// (support/adversarial_sparse_rows.hpp: V = 2 … 4097, ties, masks, near-deterministic rows, wide
// spreads; ε from 1e-4 to 1), in double, through troll::check_vjp. Forward and backward both run on
// the backend; inputs are uploaded and outputs downloaded per call (support/sparse_staging.hpp).
//
// One body compiled per backend (as bodies/sparse_gradients.hpp): tests/test_adversarial_sparse.cpp
// includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_sparse_projection_oracle.cu with backend<cuda_policy> inside its "device"
// suite. Its names live in namespace adversarial_sparse_backward. Include after
// <troll/gradcheck.hpp>, <troll/sparse.hpp>, "backend.hpp", "sparse_oracle.hpp",
// "sparse_staging.hpp", "adversarial_sparse_rows.hpp" and the definition of
// troll_test::oracle_backend.

namespace adversarial_sparse_backward {

using backend = troll_test::oracle_backend;
using sparse_test::aligned_rows;
using sparse_test::sparse_grads;
using sparse_test::sparse_rows;

TEST_CASE(
    "sparse project_backward: the VJP against central differences of the sparse project (double)") {
  std::mt19937_64 g(31);
  int checked = 0;
  for (std::size_t vocab : {std::size_t(2), std::size_t(3), std::size_t(17), std::size_t(4097)}) {
    for (int kind : {0, 2, 3, 4, 6}) {
      for (double eps : {1e-4, 0.05, 1.0}) {
        aligned_rows<double> a = adversarial_sparse::make_aligned<double>(g, vocab, 1, kind);
        const std::size_t c = std::size_t(a.counts[0]), k = a.k_max;
        const bool tail = vocab > c;
        // x = (new entries, new bucket, old entries, old bucket); y = log π* (entries, bucket).
        std::vector<double> x;
        for (std::size_t i = 0; i < c; ++i) x.push_back(a.new_log_probs[i]);
        x.push_back(tail ? a.new_log_remainder[0] : 0.0);
        for (std::size_t i = 0; i < c; ++i) x.push_back(a.old_log_probs[i]);
        x.push_back(tail ? a.old_log_remainder[0] : 0.0);
        bool finite = true;
        for (std::size_t i = 0; i < x.size(); ++i)
          finite &= std::isfinite(x[i]) && x[i] < -1e-5;  // a step must stay ≤ 0
        if (!finite || !tail)
          continue;  // −inf inputs are constants; tested through the dense maths
        std::vector<troll::projection_stats> st0(1);
        auto run = [&](const double* at, double* y, std::vector<troll::projection_stats>& st,
                       sparse_rows<double>* keep) {
          aligned_rows<double> b = a;
          for (std::size_t i = 0; i < c; ++i)
            b.new_log_probs[i] = at[i], b.old_log_probs[i] = at[c + 1 + i];
          b.new_log_remainder[0] = at[c];
          b.old_log_remainder[0] = at[2 * c + 1];
          sparse_rows<double> out(1, k, vocab);
          troll_test::project_on<backend>(b, eps, out, st);
          for (std::size_t i = 0; i < c; ++i) y[i] = out.log_probs[i];
          y[c] = out.log_remainder[0];
          if (keep) *keep = out;
          return b;
        };
        auto f = [&](const double* at, double* y) {
          std::vector<troll::projection_stats> st(1);
          run(at, y, st, nullptr);
        };
        auto vjp = [&](const double* at, const double* gy, double* gx) {
          std::vector<double> y(c + 1);
          sparse_rows<double> out;
          aligned_rows<double> b = run(at, y.data(), st0, &out);
          sparse_grads<double> up(1, k), gn(1, k), go(1, k);
          for (std::size_t i = 0; i < c; ++i) up.log_probs[i] = gy[i];
          up.log_remainder[0] = gy[c];
          troll_test::project_backward_on<backend>(b, out, st0, up, gn, &go);
          for (std::size_t i = 0; i < c; ++i)
            gx[i] = gn.log_probs[i], gx[c + 1 + i] = go.log_probs[i];
          gx[c] = gn.log_remainder[0];
          gx[2 * c + 1] = go.log_remainder[0];
        };
        troll::gradcheck_options opt;
        opt.rtol = 1e-5;
        // The differences' own noise: outputs of rows with logits near −5000 (kind 4) carry
        // rounding of a few ulp(5000) ≈ 1e-12, which Richardson's differences over a step of
        // 1e-6 turn into ~5e-6 (AVX-512 builds passed 1e-6 by chance; SSE2 and AVX2 did not).
        double largest = 0.0;
        for (double v : x) largest = std::max(largest, std::fabs(v));
        opt.atol = std::max(1e-6, 8 * std::numeric_limits<double>::epsilon() * largest / opt.step);
        INFO("V ", vocab, " kind ", kind, " eps ", eps);
        // The forward at x first: a row the backend leaves unsolved (rejected, infeasible, not
        // converged) is named here rather than as the backward's refusal of its statistics.
        {
          std::vector<double> y0(c + 1);
          run(x.data(), y0.data(), st0, nullptr);
        }
        INFO("forward: status ", troll::status_name(st0[0].status), " t ", st0[0].t, " iterations ",
             st0[0].iterations, " kl_after ", st0[0].kl_after);
        const troll::row_status status = st0[0].status;
        REQUIRE((status == troll::row_status::inactive || status == troll::row_status::projected ||
                 status == troll::row_status::restricted));
        const troll::gradcheck_result res = troll::check_vjp(f, vjp, x, c + 1, opt);
        INFO(res.report());
        CHECK(res.ok);
        ++checked;
      }
    }
  }
  CHECK(checked >= 12);
}

}  // namespace adversarial_sparse_backward
