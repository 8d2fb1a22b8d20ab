#include <doctest/doctest.h>

// Correctness of the dense forward projection troll::project (math.md §2) against independent
// oracles (tests/support/oracle.hpp: long-double direct sums, plain bisection on t):
// the bound is met on every active row of the fixed-seed corpus, t* agrees with bisection within
// the tolerance its conditioning implies, the output is π_t at the reported t, inactive rows are
// bit-identical to troll::log_softmax, π* beats every feasible competitor on KL(π‖p̃), t*(ε)
// increases with ε, shifts change nothing, float agrees with double, results do not depend on
// the thread count or the row stride, masked tokens follow the documented semantics, and the
// Newton solve needs few iterations (TROLL_PRINT_ITERATIONS=1 prints the table of
// docs/iterations.md).

#include <troll/projection.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
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

#include "../bodies/projection_oracle.hpp"

TEST_CASE("Newton iterations: median <= 6, maximum <= 30 over the corpus") {
  // Histogram bins: 1..8 iterations, then 9-12, 13-20, 21+.
  const std::vector<int> edges = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 21};
  auto bin_of = [&](int it) {
    std::size_t b = 0;
    while (b + 1 < edges.size() && it >= edges[b + 1]) ++b;
    return b;
  };
  struct tally {
    std::vector<std::size_t> bins = std::vector<std::size_t>(11, 0);
    std::vector<int> all;
  };
  std::map<double, tally> by_eps;
  std::map<std::string, tally> by_kind;
  tally total;
  for (const bool is_double : {true, false}) {
    const std::vector<outcome>& results = is_double ? sweep<double>() : sweep<float>();
    for (const outcome& r : results) {
      if (!projected(r)) continue;
      const int it = r.stats.iterations;
      INFO(r.describe());
      CHECK(it >= 1);
      CHECK(it <= 30);
      if (!is_double) continue;  // the table describes the double sweep
      for (tally* t : {&by_eps[r.eps], &by_kind[troll_test::name(r.row->kind)], &total}) {
        t->bins[bin_of(it)]++;
        t->all.push_back(it);
      }
    }
  }
  REQUIRE(!total.all.empty());
  auto median = [](std::vector<int> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 == 1 ? double(v[v.size() / 2])
                             : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  CHECK(median(total.all) <= 6.0);
  CHECK(*std::max_element(total.all.begin(), total.all.end()) <= 30);

  const char* print = std::getenv("TROLL_PRINT_ITERATIONS");
  if (print != nullptr && *print != '\0' && std::string(print) != "0") {
    std::ostringstream table;
    table.precision(3);
    auto header = [&](const char* first) {
      table << "| " << first << " | rows | median | mean | max | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9–12 | 13–20 | 21+ |\n"
            << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    };
    auto line = [&](const std::string& label, const tally& t) {
      double mean = 0;
      for (int it : t.all) mean += it;
      mean /= double(t.all.size());
      table << "| " << label << " | " << t.all.size() << " | " << median(t.all) << " | " << mean
            << " | " << *std::max_element(t.all.begin(), t.all.end()) << " |";
      for (std::size_t c : t.bins) table << ' ' << c << " |";
      table << '\n';
    };
    header("ε");
    for (const auto& e : by_eps) {
      std::ostringstream label;
      label << e.first;
      line(label.str(), e.second);
    }
    line("all", total);
    table << '\n';
    header("row kind");
    for (const auto& k : by_kind) line(k.first, k.second);
    MESSAGE("Newton iterations of the double corpus sweep (projected rows):\n" << table.str());
  }
}

// ---- Properties that need their own runs ----

TEST_CASE_TEMPLATE("per-row shifts of the new or old logits change nothing beyond round-off", T,
                   float, double) {
  // Logits rounded to a binary grid fine enough for the row but coarse enough that adding the
  // shift is exact in T: the shifted problem is the same problem, only troll's arithmetic moves.
  const int bits = std::is_same<T, float>::value ? 16 : 40;
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  for (const corpus_block& block : corpus()) {
    if (block.cols > 4096 || block.cols < 3) continue;
    const std::size_t n = block.cols;
    for (const row_pair& source : block.rows) {
      std::vector<T> a(n), b(n);
      double largest = 1.0;
      for (std::size_t i = 0; i < n; ++i) {
        for (double z : {source.new_logits[i], source.old_logits[i]}) {
          if (std::isfinite(z)) largest = std::max(largest, std::fabs(z));
        }
      }
      const int exponent = std::ilogb(largest) + 2;  // |z| and |z + shift| < 2^exponent
      const double grid = std::ldexp(1.0, exponent - bits);
      auto snap = [&](double z) { return std::isfinite(z) ? T(std::round(z / grid) * grid) : T(z); };
      for (std::size_t i = 0; i < n; ++i) {
        a[i] = snap(source.new_logits[i]);
        b[i] = snap(source.old_logits[i]);
      }
      if (oracle::only_two_sided_masks(a.data(), b.data(), n)) continue;
      const oracle::tilted_row row(a.data(), b.data(), n);
      const double shift = std::ldexp(1.0, exponent - 2) * 1.5;
      for (double eps : {1e-6, 0.05, 1.0}) {
        if (oracle::classify(row, eps).status == oracle::status::infeasible) continue;
        std::vector<T> out(n), out_new(n), out_old(n), a_shift = a, b_shift = b;
        for (T& z : a_shift) z += T(shift);
        for (T& z : b_shift) z -= T(shift);
        troll::projection_stats s, s_new, s_old;
        troll::project(troll::cpu, troll::make_batch(a.data(), 1, n), troll::make_batch(b.data(), 1, n),
                       eps, troll::make_batch(out.data(), 1, n), &s);
        troll::project(troll::cpu, troll::make_batch(a_shift.data(), 1, n),
                       troll::make_batch(b.data(), 1, n), eps, troll::make_batch(out_new.data(), 1, n),
                       &s_new);
        troll::project(troll::cpu, troll::make_batch(a.data(), 1, n),
                       troll::make_batch(b_shift.data(), 1, n), eps,
                       troll::make_batch(out_old.data(), 1, n), &s_old);
        real mu = 0, sigma2 = 0;
        row.moments(static_cast<real>(s.t), mu, sigma2);
        const double t_bound =
            s.status == troll::row_status::projected
                ? troll_test::t_tolerance(s.t, double(sigma2), 2.0 * guarantee.bound(eps), 1e-12)
                : 0.0;
        for (const auto* other : {&s_new, &s_old}) {
          INFO(source.label(), " eps ", eps, " t ", s.t, " shifted t ", other->t);
          CHECK(other->status == s.status);
          CHECK(std::fabs(other->t - s.t) <= 2 * t_bound);
        }
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i) {
          for (const std::vector<T>* o : {&out_new, &out_old}) {
            if (std::isinf(out[i]) || std::isinf((*o)[i])) {
              bad += out[i] != (*o)[i];
              continue;
            }
            const double scale = std::fabs(double(out[i])) + 4 * shift + std::fabs(double(a[i])) +
                                 std::fabs(double(b[i]));
            const double allowed = troll_test::log_prob_tolerance<T>(double(out[i]), scale) +
                                   2 * t_bound * std::fabs(double(row.diff(i) - mu));
            bad += !(std::fabs(double(out[i]) - double((*o)[i])) <= allowed);
          }
        }
        INFO(source.label(), " eps ", eps);
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("float and double agree on float-representable inputs") {
  // Both solve the same problem in double; float differs only in the rounding of its output.
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<double>();
  for (const corpus_block& block : corpus()) {
    const std::size_t n = block.cols;
    std::vector<const row_pair*> rows;
    for (const row_pair& r : block.rows) {
      std::vector<float> a(r.new_logits.begin(), r.new_logits.end());
      std::vector<float> b(r.old_logits.begin(), r.old_logits.end());
      if (!oracle::only_two_sided_masks(a.data(), b.data(), n)) rows.push_back(&r);
    }
    for (double eps : eps_for(n)) {
      std::vector<const row_pair*> live;
      for (const row_pair* r : rows) {
        std::vector<float> a(r->new_logits.begin(), r->new_logits.end());
        std::vector<float> b(r->old_logits.begin(), r->old_logits.end());
        const oracle::tilted_row row(a.data(), b.data(), n);
        if (row.disjoint() || row.min_kl() < eps * 0.999) live.push_back(r);
      }
      const std::size_t m = live.size();
      if (m == 0) continue;
      std::vector<float> af = troll_test::pack<float>(live, true, n), bf = troll_test::pack<float>(live, false, n);
      std::vector<double> ad(af.begin(), af.end()), bd(bf.begin(), bf.end());
      std::vector<float> of(m * n);
      std::vector<double> od(m * n);
      std::vector<troll::projection_stats> sf(m), sd(m);
      troll::project(troll::cpu, troll::make_batch(af.data(), m, n), troll::make_batch(bf.data(), m, n),
                     eps, troll::make_batch(of.data(), m, n), sf.data());
      troll::project(troll::cpu, troll::make_batch(ad.data(), m, n), troll::make_batch(bd.data(), m, n),
                     eps, troll::make_batch(od.data(), m, n), sd.data());
      for (std::size_t j = 0; j < m; ++j) {
        INFO(live[j]->label(), " eps ", eps, " t float ", sf[j].t, " t double ", sd[j].t);
        CHECK(sf[j].status == sd[j].status);
        // Two solutions of one problem agree within what the KL guarantee pins t* down to (as
        // the shift test above): |KL − ε| within the bound moves t by up to bound / (t·σ²). The
        // paths share their maths but not every rounding (GCC contracts a·b + c differently in
        // the two instantiations), and near a small ε the closed-form KL's rounding is ~1e-12 of ε.
        const double t_bound = sd[j].status == troll::row_status::projected
                                   ? troll_test::t_tolerance(sd[j].t, sd[j].sigma2, 2.0 * guarantee.bound(eps), 1e-12)
                                   : 1e-12 * sd[j].t;
        CHECK(std::fabs(sf[j].t - sd[j].t) <= t_bound);
        CHECK(troll_test::tolerance{1e-300, 1e-12}.accepts(sf[j].kl_before, sd[j].kl_before));
        std::size_t bad = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const double x = od[j * n + i];
          const float y = of[j * n + i];
          if (std::isinf(x) || std::isinf(y)) {
            bad += double(y) != x;
          } else {
            bad += !(std::fabs(double(y) - x) <=
                     troll_test::log_prob_tolerance<float>(x, std::fabs(x)) + 1e-12 * (1 + std::fabs(x)));
          }
        }
        CHECK(bad == 0);
      }
    }
  }
}

namespace {
bool same_bits(const troll::projection_stats& a, const troll::projection_stats& b) {
  return std::memcmp(&a.eta, &b.eta, sizeof(double)) == 0 && std::memcmp(&a.t, &b.t, sizeof(double)) == 0 &&
         std::memcmp(&a.kl_before, &b.kl_before, sizeof(double)) == 0 &&
         std::memcmp(&a.kl_after, &b.kl_after, sizeof(double)) == 0 &&
         std::memcmp(&a.mu, &b.mu, sizeof(double)) == 0 &&
         std::memcmp(&a.sigma2, &b.sigma2, sizeof(double)) == 0 && a.iterations == b.iterations &&
         a.status == b.status;
}

/// Rows of `block` (as T) feasible at ε, each repeated `copies` times, for the batch-layout tests.
template <class T>
std::vector<const row_pair*> feasible_rows(const corpus_block& block, double eps, std::size_t copies) {
  std::vector<const row_pair*> rows;
  for (const row_pair& r : block.rows) {
    std::vector<T> a(r.new_logits.begin(), r.new_logits.end());
    std::vector<T> b(r.old_logits.begin(), r.old_logits.end());
    if (oracle::only_two_sided_masks(a.data(), b.data(), r.size())) continue;
    const oracle::tilted_row row(a.data(), b.data(), r.size());
    if (row.disjoint() || !(row.min_kl() < eps * 0.999)) continue;
    for (std::size_t c = 0; c < copies; ++c) rows.push_back(&r);
  }
  return rows;
}
}  // namespace

TEST_CASE_TEMPLATE("results are bit-identical for any thread count and any row stride", T, float,
                   double) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T sentinel = T(12345.5);
  for (const corpus_block& block : corpus()) {
    if (block.cols > 32768) continue;
    const std::size_t n = block.cols;
    // Enough rows that the default policy really runs several threads (≥ 2^17 elements).
    const std::size_t copies = std::max<std::size_t>(1, (std::size_t(1) << 17) / (n * block.rows.size()) + 1);
    for (double eps : {1e-4, 0.2}) {
      const std::vector<const row_pair*> rows = feasible_rows<T>(block, eps, copies);
      const std::size_t m = rows.size();
      if (m == 0) continue;
      const std::size_t stride = n + 13;
      const std::vector<T> a = troll_test::pack<T>(rows, true, n), b = troll_test::pack<T>(rows, false, n);
      const std::vector<T> as = troll_test::pack<T>(rows, true, stride, nan);
      const std::vector<T> bs = troll_test::pack<T>(rows, false, stride, nan);
      std::vector<T> o_default(m * n), o_serial(m * n), o_three(m * n), o_strided(m * stride, sentinel);
      std::vector<troll::projection_stats> s_default(m), s_serial(m), s_three(m), s_strided(m);
      const auto na = troll::make_batch(a.data(), m, n), nb = troll::make_batch(b.data(), m, n);
      troll::project(troll::cpu, na, nb, eps, troll::make_batch(o_default.data(), m, n), s_default.data());
      troll::project(troll::cpu.with_threads(1), na, nb, eps, troll::make_batch(o_serial.data(), m, n),
                     s_serial.data());
      troll::project(troll::cpu.with_threads(3), na, nb, eps, troll::make_batch(o_three.data(), m, n),
                     s_three.data());
      troll::project(troll::cpu, troll::make_batch(as.data(), m, n, stride),
                     troll::make_batch(bs.data(), m, n, stride), eps,
                     troll::make_batch(o_strided.data(), m, n, stride), s_strided.data());
      INFO("V=", n, " rows=", m, " eps=", eps);
      CHECK(std::memcmp(o_default.data(), o_serial.data(), m * n * sizeof(T)) == 0);
      CHECK(std::memcmp(o_default.data(), o_three.data(), m * n * sizeof(T)) == 0);
      std::size_t stat_mismatch = 0, stride_mismatch = 0, padding_touched = 0;
      for (std::size_t j = 0; j < m; ++j) {
        stat_mismatch += !same_bits(s_default[j], s_serial[j]) + !same_bits(s_default[j], s_three[j]) +
                         !same_bits(s_default[j], s_strided[j]);
        stride_mismatch += std::memcmp(o_default.data() + j * n, o_strided.data() + j * stride, n * sizeof(T)) != 0;
        for (std::size_t i = n; i < stride; ++i) padding_touched += o_strided[j * stride + i] != sentinel;
      }
      CHECK(stat_mismatch == 0);
      CHECK(stride_mismatch == 0);
      CHECK(padding_touched == 0);
    }
  }
}

// ---- Masked tokens (math.md §2; projection.hpp): hand-made rows with known answers ----

TEST_CASE_TEMPLATE("old-side masks: restricted rows and projected rows", T, float, double) {
  const T ninf = -std::numeric_limits<T>::infinity();
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  // Row 0: p̃ has mass on token 2 where q is −inf, but p̃ restricted to {0, 1, 3} is within
  // ε = 0.01 of q: restricted, t = 1, output = that restriction. Row 1: the restriction is too far
  // (KL ≈ 0.2): projected onto the boundary, still no mass on token 2.
  const std::vector<T> zn = {1, 0, 2, T(-0.5), 1, 0, 2, T(-0.5)};
  const std::vector<T> zo = {T(1.01), T(0.02), ninf, T(-0.49), T(1.5), 0, ninf, -1};
  const double eps = 0.01;
  std::vector<T> out(8);
  troll::projection_stats s[2];
  troll::project(troll::cpu, troll::make_batch(zn.data(), 2, 4), troll::make_batch(zo.data(), 2, 4), eps,
                 troll::make_batch(out.data(), 2, 4), s);
  const oracle::tilted_row r0(zn.data(), zo.data(), 4), r1(zn.data() + 4, zo.data() + 4, 4);
  REQUIRE(oracle::classify(r0, eps).status == oracle::status::restricted);
  REQUIRE(oracle::classify(r1, eps).status == oracle::status::projected);

  CHECK(s[0].status == troll::row_status::restricted);
  CHECK(s[0].t == 1.0);
  CHECK(s[0].kl_before == std::numeric_limits<double>::infinity());
  CHECK(s[0].kl_after == doctest::Approx(double(r0.kl_to_old(1))).epsilon(1e-9));
  const T restricted_in[3] = {1, 0, T(-0.5)};
  const std::vector<real> restriction = oracle::log_softmax(restricted_in, 3);
  CHECK(out[2] == ninf);
  for (std::size_t i : {0u, 1u, 3u}) {
    const real expected = restriction[i == 3 ? 2 : i];
    CHECK(std::fabs(out[i] - expected) <= troll_test::log_prob_tolerance<T>(double(expected), 4.0));
  }

  CHECK(s[1].status == troll::row_status::projected);
  CHECK(s[1].t < 1.0);
  CHECK(out[6] == ninf);
  const real kl1 = oracle::kl(oracle::log_softmax(out.data() + 4, 4), r1.log_old());
  CHECK(std::fabs(kl1 - eps) <= guarantee.bound(eps));
  CHECK(std::fabs(s[1].t - double(oracle::project(r1, eps).t)) <=
        troll_test::t_tolerance(s[1].t, s[1].sigma2, 2 * guarantee.bound(eps)));
}

TEST_CASE_TEMPLATE("new-side masks: feasible when -log q(J) < eps, else infeasible_error", T, float,
                   double) {
  const T ninf = -std::numeric_limits<T>::infinity();
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  // p̃ masks token 1, which carries old mass q_1 = e^-3 / (1 + e^-3 + e^0.5 + e^0.2) ≈ 0.0127:
  // −log q(J) ≈ 0.0128.
  const std::vector<T> zn = {T(0.5), ninf, 1, 0};
  const std::vector<T> zo = {0, -3, T(0.5), T(0.2)};
  const oracle::tilted_row row(zn.data(), zo.data(), 4);
  const double floor = double(row.min_kl());
  REQUIRE(floor > 0.0125);
  REQUIRE(floor < 0.0131);
  for (double eps : {0.0135, 0.02, 0.05, 0.2, 10.0}) {
    std::vector<T> out(4);
    troll::projection_stats s;
    troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 4), troll::make_batch(zo.data(), 1, 4),
                   eps, troll::make_batch(out.data(), 1, 4), &s);
    const oracle::solution expected = oracle::project(row, eps);
    INFO("eps ", eps, " status ", name(s.status), " t ", s.t);
    CHECK(s.status == expected_status(expected.status));
    CHECK(out[1] == ninf);
    const real kl_out = oracle::kl(oracle::log_softmax(out.data(), 4), row.log_old());
    if (s.status == troll::row_status::projected) {
      CHECK(std::fabs(kl_out - eps) <= guarantee.bound(eps));
      CHECK(std::fabs(s.t - double(expected.t)) <=
            troll_test::t_tolerance(s.t, s.sigma2, 2 * guarantee.bound(eps)));
    } else {
      CHECK(kl_out <= eps);
    }
  }
  // ε at or below the floor: nothing admissible is inside the ball. The error names the row and
  // nothing is written, also for the feasible row before it.
  for (double eps : {0.0125, 1e-4}) {
    const std::vector<T> zn2 = {0, 0, 0, 0, T(0.5), ninf, 1, 0};
    const std::vector<T> zo2 = {0, 0, 0, 0, 0, -3, T(0.5), T(0.2)};
    std::vector<T> out(8, T(7));
    std::vector<troll::projection_stats> s(2);
    bool thrown = false;
    try {
      troll::project(troll::cpu, troll::make_batch(zn2.data(), 2, 4), troll::make_batch(zo2.data(), 2, 4),
                     eps, troll::make_batch(out.data(), 2, 4), s.data());
    } catch (const troll::infeasible_error& e) {
      thrown = true;
      CHECK(e.row() == 1);
    }
    INFO("eps ", eps);
    CHECK(thrown);
    CHECK(std::all_of(out.begin(), out.end(), [](T v) { return v == T(7); }));
  }
}

TEST_CASE_TEMPLATE("disjoint supports throw infeasible_error; V = 2 edge cases", T, float, double) {
  const T ninf = -std::numeric_limits<T>::infinity();
  {
    const std::vector<T> zn = {0, ninf}, zo = {ninf, 0};
    std::vector<T> out(2);
    troll::projection_stats s;
    CHECK_THROWS_AS(troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 2),
                                   troll::make_batch(zo.data(), 1, 2), 1.0,
                                   troll::make_batch(out.data(), 1, 2), &s),
                    troll::infeasible_error);
  }
  {
    // Old masks token 1: π_t = (1, 0) for every t, KL = 0: restricted for any ε.
    const std::vector<T> zn = {0, 0}, zo = {0, ninf};
    std::vector<T> out(2);
    troll::projection_stats s;
    troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 2), troll::make_batch(zo.data(), 1, 2),
                   1e-8, troll::make_batch(out.data(), 1, 2), &s);
    CHECK(s.status == troll::row_status::restricted);
    CHECK(s.t == 1.0);
    CHECK(out[0] == T(0));
    CHECK(out[1] == ninf);
  }
  {
    // New masks token 1 with old mass q_1 = 1/(1 + e^5): KL(π‖q) = −log q_0 ≈ 0.00672 for the only
    // admissible π: inactive above it, infeasible below.
    const std::vector<T> zn = {0, ninf}, zo = {0, -5};
    std::vector<T> out(2);
    troll::projection_stats s;
    troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 2), troll::make_batch(zo.data(), 1, 2),
                   0.01, troll::make_batch(out.data(), 1, 2), &s);
    CHECK(s.status == troll::row_status::inactive);
    CHECK(out[0] == T(0));
    CHECK(out[1] == ninf);
    CHECK(s.kl_before == doctest::Approx(std::log1p(std::exp(-5.0))).epsilon(1e-6));
    CHECK_THROWS_AS(troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 2),
                                   troll::make_batch(zo.data(), 1, 2), 0.005,
                                   troll::make_batch(out.data(), 1, 2), &s),
                    troll::infeasible_error);
  }
}

// ---- Regression: rows whose masked tokens are all masked on BOTH sides once took the unmasked
// fast path of tilt_evaluator and computed (−inf) − (−inf) = NaN (status projected, t ≈ 3e-45,
// NaN log-probs) for new = {0, 1, −inf}, old = {0.5, 0, −inf}, ε = 0.01. The tests below run
// exactly those rows. ----

TEST_CASE("two-sided masks: a masked token equals the problem without it (regression: once NaN)") {
  const double ninf = -std::numeric_limits<double>::infinity();
  const std::vector<double> zn = {0, 1, ninf}, zo = {0.5, 0, ninf};
  const std::vector<double> zn_small = {0, 1}, zo_small = {0.5, 0};
  std::vector<double> out(3), out_small(2);
  troll::projection_stats s, s_small;
  troll::project(troll::cpu, troll::make_batch(zn.data(), 1, 3), troll::make_batch(zo.data(), 1, 3), 0.01,
                 troll::make_batch(out.data(), 1, 3), &s);
  troll::project(troll::cpu, troll::make_batch(zn_small.data(), 1, 2),
                 troll::make_batch(zo_small.data(), 1, 2), 0.01,
                 troll::make_batch(out_small.data(), 1, 2), &s_small);
  CHECK(s.status == s_small.status);
  CHECK(s.t == doctest::Approx(s_small.t).epsilon(1e-12));
  CHECK(out[0] == doctest::Approx(out_small[0]).epsilon(1e-12));
  CHECK(out[1] == doctest::Approx(out_small[1]).epsilon(1e-12));
  CHECK(out[2] == ninf);
}

TEST_CASE_TEMPLATE("corpus rows with only two-sided masks (regression: once NaN)", T,
                   float, double) {
  const std::vector<outcome>& results = sweep<T>(true);
  CHECK(!results.empty());
  check_bound<T>(results);
  check_status<T>(results);
  check_output_is_pi_t<T>(results);
}
