// test_two_point.cpp — the new-side derivatives on nearly two-point rows (tests/bodies/two_point_rows.hpp,
// also the body of the CUDA backend's test) and, on the CPU, the sparse projection's backward on the
// same rows held as aligned sparse rows (every token on the support, an empty bucket): its lumped
// rows take the VJP's short path, which re-reads the row for the rule.
#include <doctest/doctest.h>

#include <troll/objectives.hpp>
#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include "backend.hpp"
#include "oracle.hpp"
#include "sparse_oracle.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "bodies/two_point_rows.hpp"

namespace {

using two_point_rows::ld;
using sparse_test::aligned_rows;
using sparse_test::sparse_grads;
using sparse_test::sparse_rows;

template <class T>
void check_sparse(const two_point_rows::row& rw) {
  const std::size_t n = rw.zn.size();
  const std::vector<T> zn(rw.zn.begin(), rw.zn.end()), zo(rw.zo.begin(), rw.zo.end());
  aligned_rows<T> al(1, n, n);
  al.counts[0] = troll::sparse_index(n);
  auto log_softmax = [](const std::vector<T>& z, std::size_t j) {
    ld top = -INFINITY, sum = 0;
    for (T x : z) top = std::max(top, static_cast<ld>(x));
    for (T x : z) sum += std::exp(static_cast<ld>(x) - top);
    return static_cast<ld>(z[j]) - top - std::log(sum);
  };
  for (std::size_t j = 0; j < n; ++j) {
    al.indices[j] = troll::sparse_index(j);
    al.new_log_probs[j] = T(log_softmax(zn, j));
    al.old_log_probs[j] = T(log_softmax(zo, j));
  }
  al.new_log_remainder[0] = al.old_log_remainder[0] = -std::numeric_limits<T>::infinity();
  sparse_rows<T> out(1, n, n);
  troll::projection_stats st;
  troll::project(troll::cpu, al.view(), rw.eps, out.view(), &st);
  REQUIRE(st.status == troll::row_status::projected);
  // The reference at t on the aligned (normalised) rows as stored.
  std::vector<T> an(al.new_log_probs.begin(), al.new_log_probs.end()), ao(al.old_log_probs.begin(), al.old_log_probs.end());
  const two_point_rows::reference r = two_point_rows::at_t(an, ao, st.t);
  for (std::size_t kind = 0; kind < 2; ++kind) {
    sparse_grads<T> g(1, n), gn(1, n);
    g.log_probs[kind] = T(1);
    std::vector<ld> e(n, 0);
    e[kind] = 1;
    const troll::sparse_batch_view<const T> lp = out.view();
    troll::project_backward(troll::cpu, al.view(), lp, &st, g.view(), gn.view());
    CAPTURE(kind);
    CHECK(two_point_rows::normwise(gn.log_probs, two_point_rows::vjp(r, st.t, e)) <= two_point_rows::tolerance<T>());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("nearly two-point sparse rows: the lumped VJP is accurate relative to itself", T, double, float) {
  for (double so : {1e-5, 1e-6}) {
    for (double ra : {0.5, 0.7, 0.99}) {
      for (bool far : {false, true}) {
        CAPTURE(so);
        CAPTURE(ra);
        CAPTURE(far);
        check_sparse<T>(two_point_rows::make_row(3, so, ra, far));
        check_sparse<T>(two_point_rows::make_row(10, so, ra, far));
        check_sparse<T>(two_point_rows::make_row(60, so, ra, far));
      }
    }
  }
}
