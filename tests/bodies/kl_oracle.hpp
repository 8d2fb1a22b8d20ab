// tests/bodies/kl_oracle.hpp — the oracle tests of troll::log_softmax and troll::kl (math.md §1),
// written once and compiled per backend (the Kokkos pattern, as bodies/projection_oracle.hpp):
// tests/test_kl.cpp includes it with troll_test::oracle_backend = backend<cpu_policy>,
// tests/cuda/test_cuda_kl_oracle.cu with backend<cuda_policy> inside its "device" suite. Against
// the long-double direct sums of tests/support/oracle.hpp: values, +inf exactly where p has mass
// that q masks, KL(p‖p) = 0, invariance under per-row shifts, and the two-sided-mask regressions.
// Include after <troll/projection.hpp>, "backend.hpp", "corpus.hpp", "oracle.hpp",
// "tolerance.hpp" and the definition of troll_test::oracle_backend.

namespace {

using backend = troll_test::oracle_backend;

using troll_test::corpus_block;
using troll_test::row_pair;
namespace oracle = troll_test::oracle;

const double minus_inf = -std::numeric_limits<double>::infinity();

const std::vector<corpus_block>& corpus() {
  static const std::vector<corpus_block> blocks = troll_test::make_corpus();
  return blocks;
}

std::vector<const row_pair*> rows_of(const corpus_block& block) {
  std::vector<const row_pair*> rows;
  for (const row_pair& r : block.rows) rows.push_back(&r);
  return rows;
}

/// Checks troll::kl(p, q) on every row of a block against the oracle; `reverse` swaps the roles
/// (KL(q‖p̃) is +inf on the rows whose new side masks tokens of old mass).
/// Rows whose masks are all two-sided once hit a troll bug (NaN; see the regression test cases at
/// the end): the main tests leave them out (`two_sided` false) and the regression tests take only
/// them (`two_sided` true).
template <class T>
bool selected(const T* p, const T* q, std::size_t n, bool two_sided) {
  return oracle::only_two_sided_masks(p, q, n) == two_sided;
}

/// Float rows up to this V (the float path differs from the double one only in its loads).
template <class T>
bool size_tested(std::size_t cols) {
  return std::is_same<T, double>::value || cols <= 32768;
}

template <class T>
void check_kl_block(const corpus_block& block, bool reverse, bool two_sided = false) {
  const std::vector<const row_pair*> rows = rows_of(block);
  const std::size_t n = block.cols;
  std::vector<T> p = troll_test::pack<T>(rows, !reverse, n);
  std::vector<T> q = troll_test::pack<T>(rows, reverse, n);
  typename backend::template buffer<T> p_in(p), q_in(q), out(std::vector<T>(rows.size(), T(-1)));
  troll::kl(backend::policy(), troll::make_batch<const T>(p_in.get(), rows.size(), n),
            troll::make_batch<const T>(q_in.get(), rows.size(), n), out.get());
  const std::vector<T> result = out.download();
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const T* pr = p.data() + r * n;
    const T* qr = q.data() + r * n;
    if (!selected(pr, qr, n, two_sided)) continue;
    const oracle::kl_value reference = oracle::kl_with_condition(pr, qr, n);
    const oracle::real expected = reference.value;
    const troll_test::tolerance tol = troll_test::kl_tolerance<T>(double(reference.condition));
    INFO(rows[r]->label(), (reverse ? " KL(q||p)" : " KL(p||q)"), " troll ", double(result[r]),
         " oracle ", double(expected), " bound ", tol.bound(double(expected)));
    CHECK(tol.accepts(result[r], expected));
    CHECK(result[r] >= T(0));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("log_softmax matches the long-double oracle on the corpus", T, float, double) {
  for (const corpus_block& block : corpus()) {
    if (!size_tested<T>(block.cols)) continue;
    const std::vector<const row_pair*> rows = rows_of(block);
    const std::size_t n = block.cols;
    for (bool new_side : {true, false}) {
      std::vector<T> z = troll_test::pack<T>(rows, new_side, n);
      typename backend::template buffer<T> z_in(z), out_dev(z.size());
      troll::log_softmax(backend::policy(), troll::make_batch<const T>(z_in.get(), rows.size(), n),
                         troll::make_batch(out_dev.get(), rows.size(), n));
      const std::vector<T> out = out_dev.download();
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const T* zr = z.data() + r * n;
        const std::vector<oracle::real> expected = oracle::log_softmax(zr, n);
        double top = minus_inf;
        for (std::size_t i = 0; i < n; ++i) top = std::max(top, double(zr[i]));
        std::size_t bad = 0, first_bad = n;
        for (std::size_t i = 0; i < n; ++i) {
          const T value = out[r * n + i];
          bool ok;
          if (std::isinf(expected[i])) {
            ok = value == T(minus_inf);
          } else {
            const double scale = std::fabs(double(expected[i])) + std::fabs(top - double(zr[i]));
            const double bound = troll_test::log_prob_tolerance<T>(double(expected[i]), scale);
            ok = std::fabs(static_cast<oracle::real>(value) - expected[i]) <= bound;
          }
          if (!ok && bad++ == 0) first_bad = i;
        }
        INFO(rows[r]->label(), (new_side ? " new" : " old"), " first bad token ", first_bad);
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE_TEMPLATE("kl matches the long-double direct sum on the corpus", T, float, double) {
  for (const corpus_block& block : corpus()) {
    if (!size_tested<T>(block.cols)) continue;
    check_kl_block<T>(block, false);
    check_kl_block<T>(block, true);
  }
}

TEST_CASE_TEMPLATE("kl is +inf exactly when p has mass where q masks", T, float, double) {
  const T ninf = -std::numeric_limits<T>::infinity();
  // Row 0: p has mass on token 1, masked in q: +inf. Row 1: q has mass where p masks: finite.
  // Row 2: both mask token 2, p also masks token 0: finite. Row 3: p's token 1 carries almost no
  // mass, q's token 2 tiny but > 0: finite.
  const std::vector<T> p = {0, 1, ninf, 0, ninf, 2, ninf, 1, ninf, 0, -700, 3};
  const std::vector<T> q = {0, ninf, 1, 0, 1, 0, 1, 0, ninf, 0, 5, -80};
  typename backend::template buffer<T> p_in(p), q_in(q), out(4);
  troll::kl(backend::policy(), troll::make_batch<const T>(p_in.get(), 4, 3),
            troll::make_batch<const T>(q_in.get(), 4, 3), out.get());
  const std::vector<T> result = out.download();
  CHECK(result[0] == std::numeric_limits<T>::infinity());
  for (std::size_t r = 1; r < 4; ++r) {
    INFO("row ", r);
    const oracle::real expected = oracle::kl_logits(p.data() + 3 * r, q.data() + 3 * r, 3);
    CHECK(std::isfinite(result[r]));
    CHECK(troll_test::kl_tolerance<T>(100.0).accepts(result[r], expected));
  }
}

/// KL(p‖p) ≈ 0 for every row of every block whose mask pattern is (two_sided) or is not
/// (!two_sided) a two-sided one (a row compared with itself masks only two-sided).
template <class T>
void check_self_kl(bool two_sided) {
  for (const corpus_block& block : corpus()) {
    if (!size_tested<T>(block.cols)) continue;
    const std::vector<const row_pair*> rows = rows_of(block);
    const std::size_t n = block.cols;
    for (bool new_side : {true, false}) {
      std::vector<T> z = troll_test::pack<T>(rows, new_side, n);
      typename backend::template buffer<T> z_in(z), out(std::vector<T>(rows.size(), T(-1)));
      const auto view = troll::make_batch<const T>(z_in.get(), rows.size(), n);
      troll::kl(backend::policy(), view, view, out.get());
      const std::vector<T> result = out.download();
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const T* zr = z.data() + r * n;
        if (!selected(zr, zr, n, two_sided)) continue;
        INFO(rows[r]->label(), (new_side ? " new" : " old"), " KL = ", double(result[r]));
        CHECK(result[r] >= T(0));
        CHECK(result[r] <= T(8 * troll_test::unit_roundoff<double>()));
      }
    }
  }
}

TEST_CASE_TEMPLATE("kl(p, p) is zero on every corpus row", T, float, double) {
  check_self_kl<T>(false);
}

TEST_CASE_TEMPLATE("kl is invariant under per-row shifts of either argument", T, float, double) {
  // Shifts that are exact in T for the moderate rows used here keep the problem identical;
  // the result may differ by the round-off of the shifted reductions only.
  for (const corpus_block& block : corpus()) {
    if (block.cols > 4096) continue;
    const std::vector<const row_pair*> rows = rows_of(block);
    const std::size_t n = block.cols;
    std::vector<T> p = troll_test::pack<T>(rows, true, n);
    std::vector<T> q = troll_test::pack<T>(rows, false, n);
    std::vector<T> p_shift = p, q_shift = q;
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const T cp = T(r % 2 == 0 ? 64.0 : -37.5), cq = T(r % 3 == 0 ? -1000.0 : 7.25);
      for (std::size_t i = 0; i < n; ++i) {
        p_shift[r * n + i] += cp;
        q_shift[r * n + i] += cq;
      }
    }
    typename backend::template buffer<T> p_in(p), q_in(q), ps_in(p_shift), qs_in(q_shift);
    typename backend::template buffer<T> base_out(rows.size()), shifted_out(rows.size());
    troll::kl(backend::policy(), troll::make_batch<const T>(p_in.get(), rows.size(), n),
              troll::make_batch<const T>(q_in.get(), rows.size(), n), base_out.get());
    troll::kl(backend::policy(), troll::make_batch<const T>(ps_in.get(), rows.size(), n),
              troll::make_batch<const T>(qs_in.get(), rows.size(), n), shifted_out.get());
    const std::vector<T> base = base_out.download(), shifted = shifted_out.download();
    for (std::size_t r = 0; r < rows.size(); ++r) {
      if (!selected(p.data() + r * n, q.data() + r * n, n, false)) continue;
      // The shifted inputs are rounded in T; compare against the oracle on the shifted values.
      const oracle::kl_value reference =
          oracle::kl_with_condition(p_shift.data() + r * n, q_shift.data() + r * n, n);
      INFO(rows[r]->label(), " base ", double(base[r]), " shifted ", double(shifted[r]));
      CHECK(troll_test::kl_tolerance<T>(double(reference.condition)).accepts(shifted[r], reference.value));
      if (std::isinf(base[r])) CHECK(std::isinf(shifted[r]));
    }
  }
}

// ---- Regression: a row pair whose masked tokens are all masked on BOTH sides once took the
// unmasked fast path, computed (−inf) − (−inf) = NaN and returned KL = NaN for
//     p = {0, 1, −inf}, q = {0.5, 0, −inf}  (oracle 0.2574).
// The two tests below run exactly those rows. ----

TEST_CASE("kl with tokens masked in both rows (regression: once NaN)") {
  const double ninf = -std::numeric_limits<double>::infinity();
  const double p[3] = {0.0, 1.0, ninf}, q[3] = {0.5, 0.0, ninf};
  typename backend::template buffer<double> p_in(std::vector<double>(p, p + 3)), q_in(std::vector<double>(q, q + 3));
  typename backend::template buffer<double> out(std::vector<double>{-1.0});
  troll::kl(backend::policy(), troll::make_batch<const double>(p_in.get(), 1, 3),
            troll::make_batch<const double>(q_in.get(), 1, 3), out.get());
  const double result = out.download()[0];
  CHECK(troll_test::kl_tolerance<double>(10.0).accepts(result, oracle::kl_logits(p, q, 3)));
  for (const corpus_block& block : corpus()) {
    check_kl_block<double>(block, false, true);
    check_kl_block<double>(block, true, true);
  }
}

TEST_CASE_TEMPLATE("kl(p, p) of rows with masked tokens (regression: once NaN)", T,
                   float, double) {
  check_self_kl<T>(true);
}
