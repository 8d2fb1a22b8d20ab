#include <doctest/doctest.h>

// Correctness of troll::log_softmax and troll::kl (math.md §1) on the fixed-seed corpus: the
// oracle tests (tests/bodies/kl_oracle.hpp, shared with the CUDA backend), then what is particular
// to the CPU backend: exact shifts, strided and threaded batches.

#include <troll/projection.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "corpus.hpp"
#include "oracle.hpp"
#include "tolerance.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

// The oracle tests, one body for every backend (also compiled for troll::cuda by
// tests/cuda/test_cuda_kl_oracle.cu). The suite, to the end of the file, is a namespace of its
// own: the body's helpers do not meet bodies/projection_oracle.hpp's where the two share a
// translation unit (troll_add_test_group).
TEST_SUITE("cpu") {
#include "../bodies/kl_oracle.hpp"

TEST_CASE("kl of identical rows shifted exactly is the same value") {
  // Logits on a coarse binary grid: adding 2^10 is exact, so the problem is unchanged.
  const std::size_t n = 257, rows = 4;
  troll_test::rng g(17);
  std::vector<double> p(rows * n), q(rows * n);
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = std::ldexp(std::round(std::ldexp(3.0 * g.normal(), 20)), -20);
    q[i] = std::ldexp(std::round(std::ldexp(3.0 * g.normal(), 20)), -20);
  }
  std::vector<double> p_shift = p, q_shift = q;
  for (double& z : p_shift) z += 1024.0;
  for (double& z : q_shift) z -= 2048.0;
  std::vector<double> base(rows), shifted(rows);
  troll::kl(troll::cpu, troll::make_batch(p.data(), rows, n), troll::make_batch(q.data(), rows, n),
            base.data());
  troll::kl(troll::cpu, troll::make_batch(p_shift.data(), rows, n),
            troll::make_batch(q_shift.data(), rows, n), shifted.data());
  for (std::size_t r = 0; r < rows; ++r) {
    const oracle::kl_value reference = oracle::kl_with_condition(p.data() + r * n, q.data() + r * n, n);
    CHECK(troll_test::kl_tolerance<double>(double(reference.condition)).accepts(shifted[r], base[r]));
  }
}

TEST_CASE_TEMPLATE("kl honours row strides and gives the same bits for any thread count", T, float,
                   double) {
  const corpus_block* block = nullptr;
  for (const corpus_block& b : corpus()) {
    if (b.cols == 1000) block = &b;
  }
  REQUIRE(block != nullptr);
  const std::vector<const row_pair*> rows = rows_of(*block);
  const std::size_t n = block->cols, stride = n + 13;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // Packed rows, and the same rows at a larger stride with NaN in the gaps (never read).
  std::vector<T> p = troll_test::pack<T>(rows, true, n), q = troll_test::pack<T>(rows, false, n);
  std::vector<T> ps = troll_test::pack<T>(rows, true, stride, nan);
  std::vector<T> qs = troll_test::pack<T>(rows, false, stride, nan);
  std::vector<T> packed(rows.size()), strided(rows.size()), serial(rows.size());
  troll::kl(troll::cpu, troll::make_batch(p.data(), rows.size(), n),
            troll::make_batch(q.data(), rows.size(), n), packed.data());
  troll::kl(troll::cpu, troll::make_batch(ps.data(), rows.size(), n, stride),
            troll::make_batch(qs.data(), rows.size(), n, stride), strided.data());
  troll::kl(troll::cpu.with_threads(1), troll::make_batch(p.data(), rows.size(), n),
            troll::make_batch(q.data(), rows.size(), n), serial.data());
  CHECK(std::memcmp(packed.data(), strided.data(), rows.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(packed.data(), serial.data(), rows.size() * sizeof(T)) == 0);
}

}  // TEST_SUITE("cpu")

TEST_CASE("kl in float: a finite KL beyond float's range throws (not a +inf that reads as a masked token)") {
  // p = (F, 0, 0), q = (-F, F, 0) with F = FLT_MAX: KL = log p_0 - log q_0 ~ 2F ~ 6.8e38 > FLT_MAX.
  const float F = std::numeric_limits<float>::max();
  std::vector<float> p{0.f, 0.f, 0.f, F, 0.f, 0.f, 0.f, 0.f, 0.f}, q{0.f, 1.f, 0.f, -F, F, 0.f, 0.f, 0.f, 0.f};
  std::vector<float> out(3, 7.f);
  for (unsigned threads : {1u, 3u}) {
    CAPTURE(threads);
    CHECK_THROWS_WITH_AS(troll::kl(troll::cpu.with_threads(threads), troll::make_batch<const float>(p.data(), 3, 3),
                                   troll::make_batch<const float>(q.data(), 3, 3), out.data()),
                         doctest::Contains("row 1: the KL does not fit float"), troll::domain_error);
  }
  // The same rows in double fit; a masked token in q with mass in p is +inf, as documented.
  const std::vector<double> pd(p.begin(), p.end());
  std::vector<double> qd(q.begin(), q.end()), outd(3);
  troll::kl(troll::cpu, troll::make_batch<const double>(pd.data(), 3, 3),
            troll::make_batch<const double>(qd.data(), 3, 3), outd.data());
  CHECK(outd[1] == doctest::Approx(2.0 * double(F)).epsilon(1e-12));
  qd[0] = -std::numeric_limits<double>::infinity();
  troll::kl(troll::cpu, troll::make_batch<const double>(pd.data(), 3, 3),
            troll::make_batch<const double>(qd.data(), 3, 3), outd.data());
  CHECK(outd[0] == std::numeric_limits<double>::infinity());
}
