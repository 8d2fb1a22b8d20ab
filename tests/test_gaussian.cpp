// tests/test_gaussian.cpp — the Gaussian projections (joint and split, full and diagonal) against
// the long-double bisection oracle of support/gaussian_oracle.hpp: t*, the written mean and
// covariance, KL at the output; the hard cases (nearly equal Gaussians, tiny and large ε,
// ill-conditioned covariances, d = 1 and d = 256); float against double: the body
// tests/bodies/gaussian_projection_oracle.hpp compiled for the CPU (also compiled for troll::cuda).
// Then, CPU only: bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "support/expect_error.hpp"
#include "support/gaussian_oracle.hpp"
#include "troll/gaussian.hpp"
#include "troll/workspace.hpp"

#include "backend.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The oracle tests, one body for every backend (also compiled for troll::cuda by
// tests/cuda/test_cuda_gaussian.cu).
#include "bodies/gaussian_projection_oracle.hpp"

using namespace gaussian_oracle_tests;


TEST_CASE("bad input: a typed error naming the row, nothing written") {
  gauss::generator gen(9);
  constexpr std::size_t d = 3, rows = 4;
  for (const bool full : {true, false}) {
    const std::size_t cc = full ? d * d : d;
    std::vector<double> m, c, om, oc;
    for (std::size_t r = 0; r < rows; ++r) {
      const pair_row p = random_pair(gen, d, full, 1.0, 0.3);
      m.insert(m.end(), p.mean.begin(), p.mean.end());
      c.insert(c.end(), p.cov.begin(), p.cov.end());
      om.insert(om.end(), p.old_mean.begin(), p.old_mean.end());
      oc.insert(oc.end(), p.old_cov.begin(), p.old_cov.end());
    }
    auto attempt = [&](std::vector<double> bm, std::vector<double> bc, std::vector<double> bom,
                       std::vector<double> boc, double eps, std::size_t row, const std::string& fragment) {
      std::vector<double> out_m(rows * d, -7.0), out_c(rows * cc, -7.0);
      std::vector<gaussian_stats> stats(rows);
      auto call = [&] {
        auto in = [&](const std::vector<double>& x, std::size_t cols) {
          return troll::make_batch(x.data(), rows, cols);
        };
        auto out = [&](std::vector<double>& x, std::size_t cols) { return troll::make_batch(x.data(), rows, cols); };
        if (full) {
          troll::gaussian::project_joint(troll::cpu, in(bm, d), in(bc, cc), in(bom, d), in(boc, cc), eps,
                                         out(out_m, d), out(out_c, cc), stats.data());
        } else {
          troll::gaussian::project_split_diag(troll::cpu, in(bm, d), in(bc, cc), in(bom, d), in(boc, cc), eps, eps,
                                              out(out_m, d), out(out_c, cc), stats.data());
        }
      };
      if (row == troll::invalid_input::npos) {
        CHECK_THROWS_AS(call(), troll::domain_error);
      } else {
        troll_test::expect_rejected<troll::domain_error>(call, row, fragment);
      }
      for (const double x : out_m) CHECK(x == -7.0);
      for (const double x : out_c) CHECK(x == -7.0);
    };
    const std::size_t npos = troll::invalid_input::npos;
    std::vector<double> bad = m;
    bad[2 * d + 1] = std::nan("");
    attempt(bad, c, om, oc, 0.1, 2, "row 2: mean is nan at entry 1");
    bad = om;
    bad[3 * d] = HUGE_VAL;
    attempt(m, c, bad, oc, 0.1, 3, "old_mean is inf");
    bad = c;
    bad[1 * cc] = full ? 0.0 : -1.0;  // a zero diagonal / a negative std dev
    attempt(m, bad, om, oc, 0.1, 1, full ? "on the diagonal" : "must be finite and > 0");
    if (full) {
      bad = oc;
      bad[0 * cc + 1] = 0.5;  // above the diagonal
      attempt(m, c, om, bad, 0.1, 0, "above the diagonal");
    }
    attempt(m, c, om, oc, 0.0, npos, "");
    attempt(m, c, om, oc, -1.0, npos, "");
    attempt(m, c, om, oc, std::nan(""), npos, "");
  }
}
