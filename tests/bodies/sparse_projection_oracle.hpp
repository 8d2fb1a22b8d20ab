// tests/bodies/sparse_projection_oracle.hpp — the projection of aligned sparse rows against a
// long-double bisection oracle (t* and log π* on U and the bucket), float and double: one body
// compiled per backend (as bodies/projection_oracle.hpp): tests/test_sparse.cpp includes it with
// troll_test::oracle_backend = backend<cpu_policy>, tests/cuda/test_cuda_sparse_projection_oracle.cu
// with backend<cuda_policy> inside its "device" suite. The inputs (sparsify, align) are built on
// the CPU; the projection runs on the backend. Include after <troll/sparse.hpp>, "backend.hpp",
// "sparse_oracle.hpp", `using namespace sparse_test;` and the definition of
// troll_test::oracle_backend.

namespace {

/// project(aligned rows) under the backend's policy: `al` uploaded, `out` and `stats` downloaded.
template <class T>
void backend_sparse_project(const aligned_rows<T>& al, double eps, sparse_rows<T>& out,
                            std::vector<troll::projection_stats>& stats) {
  using backend = troll_test::oracle_backend;
  typename backend::template buffer<troll::sparse_index> indices(al.indices), counts(al.counts),
      out_indices(out.indices), out_counts(out.counts);
  typename backend::template buffer<T> new_lp(al.new_log_probs), old_lp(al.old_log_probs),
      new_rem(al.new_log_remainder), old_rem(al.old_log_remainder), out_lp(out.log_probs),
      out_rem(out.log_remainder);
  typename backend::template buffer<troll::projection_stats> st(stats.size());
  const troll::aligned_batch_view<const T> rows{indices.get(), counts.get(), new_lp.get(), old_lp.get(),
                                                new_rem.get(),   old_rem.get(), al.rows,      al.k_max,
                                                al.vocab};
  troll::project(backend::policy(), rows, eps,
                 troll::sparse_batch_view<T>{out_indices.get(), out_lp.get(), out_counts.get(), out_rem.get(),
                                             out.rows, out.k_max, out.vocab},
                 st.get());
  out.indices = out_indices.download();
  out.counts = out_counts.download();
  out.log_probs = out_lp.download();
  out.log_remainder = out_rem.download();
  stats = st.download();
}

}  // namespace

TEST_CASE("sparse projection against a long-double bisection oracle, float and double") {
  std::mt19937_64 rng(33);
  const std::size_t vocab = 151936, rows = 4;
  std::vector<double> zn, zo;
  for (std::size_t r = 0; r < rows; ++r) {
    auto a = zipf_logits<double>(vocab, 1.3, 0.4, rng);
    auto b = zipf_logits<double>(vocab, 1.3, 0.4, rng);
    for (std::size_t i = 0; i < vocab; ++i) b[i] = 0.5 * b[i] + 0.5 * a[i];
    zn.insert(zn.end(), a.begin(), a.end());
    zo.insert(zo.end(), b.begin(), b.end());
  }
  sparse_rows<double> sn(rows, 65, vocab), so(rows, 65, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(zn.data(), rows, vocab), nullptr, {64, 1e-5}, sn.view());
  troll::sparsify(troll::cpu, troll::make_batch(zo.data(), rows, vocab), nullptr, {64, 1e-5}, so.view());
  aligned_rows<double> al(rows, 130, vocab);
  troll::align(troll::cpu, sn.view(), so.view(), al.view());
  aligned_rows<float> alf(rows, 130, vocab);
  alf.indices = al.indices;
  alf.counts = al.counts;
  for (std::size_t i = 0; i < al.new_log_probs.size(); ++i) {
    alf.new_log_probs[i] = float(al.new_log_probs[i]);
    alf.old_log_probs[i] = float(al.old_log_probs[i]);
  }
  for (std::size_t r = 0; r < rows; ++r) {
    alf.new_log_remainder[r] = float(al.new_log_remainder[r]);
    alf.old_log_remainder[r] = float(al.old_log_remainder[r]);
  }
  const double eps = 0.05;
  sparse_rows<double> out(rows, 130, vocab);
  sparse_rows<float> outf(rows, 130, vocab);
  std::vector<troll::projection_stats> st(rows), stf(rows);
  backend_sparse_project(al, eps, out, st);
  backend_sparse_project(alf, eps, outf, stf);
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    const int n = al.counts[r];
    std::vector<ld> ln, lo;
    for (int i = 0; i < n; ++i) {
      ln.push_back(ld(al.new_log_probs[r * 130 + std::size_t(i)]));
      lo.push_back(ld(al.old_log_probs[r * 130 + std::size_t(i)]));
    }
    ln.push_back(ld(al.new_log_remainder[r]));
    lo.push_back(ld(al.old_log_remainder[r]));
    ld t = 0;
    const std::vector<ld> ref = oracle_project(ln, lo, ld(eps), &t);
    CHECK(st[r].status == troll::row_status::projected);
    CHECK(st[r].t == doctest::Approx(double(t)).epsilon(1e-9));
    CHECK(std::fabs(st[r].kl_after - eps) <= 1e-12);
    for (int i = 0; i <= n; ++i) {
      const double got = i < n ? out.log_probs[r * 130 + std::size_t(i)] : out.log_remainder[r];
      const double gotf = i < n ? outf.log_probs[r * 130 + std::size_t(i)] : outf.log_remainder[r];
      CHECK(got == doctest::Approx(double(ref[std::size_t(i)])).epsilon(1e-10));
      CHECK(gotf == doctest::Approx(double(ref[std::size_t(i)])).epsilon(2e-5));
    }
  }
}


TEST_CASE_TEMPLATE("sparse kl of disjoint supports is +inf (as the dense kl), not an error", T, float, double) {
  // V = 2, U = {0, 1}: new = (1, 0), old = (0, 1), both buckets empty: KL(new ‖ old) = +inf. The
  // projection refuses such a row (no admissible π); the KL used to refuse it too
  // (infeasible_error). Row 1 is an ordinary pair, row 2 a disjoint one over a tail.
  const T ninf = -std::numeric_limits<T>::infinity();
  aligned_rows<T> al(3, 2, 2);
  const T half = T(std::log(0.5));
  const std::vector<std::vector<T>> new_lp = {{T(0), ninf}, {half, half}, {ninf, ninf}};
  const std::vector<std::vector<T>> old_lp = {{ninf, T(0)}, {T(std::log(0.25)), T(std::log(0.75))}, {ninf, ninf}};
  for (std::size_t r = 0; r < 3; ++r) {
    al.counts[r] = r == 2 ? 1 : 2;
    for (std::size_t i = 0; i < 2; ++i) {
      al.indices[r * 2 + i] = troll::sparse_index(i);
      al.new_log_probs[r * 2 + i] = new_lp[r][i];
      al.old_log_probs[r * 2 + i] = old_lp[r][i];
    }
    al.new_log_remainder[r] = al.old_log_remainder[r] = ninf;
  }
  // Row 2: U = {0}, new has all its mass on token 0, old all on the tail (token 1).
  al.new_log_probs[4] = T(0);
  al.old_log_probs[4] = ninf;
  al.old_log_remainder[2] = T(0);
  using backend = troll_test::oracle_backend;
  typename backend::template buffer<troll::sparse_index> indices(al.indices), counts(al.counts);
  typename backend::template buffer<T> new_p(al.new_log_probs), old_p(al.old_log_probs),
      new_r(al.new_log_remainder), old_r(al.old_log_remainder), out(std::vector<T>(3, T(7)));
  const troll::aligned_batch_view<const T> rows{indices.get(), counts.get(), new_p.get(), old_p.get(),
                                                new_r.get(),   old_r.get(),  3,           2,
                                                2};
  troll::kl(backend::policy(), rows, out.get());
  const std::vector<T> kl = out.download();
  CHECK(kl[0] == std::numeric_limits<T>::infinity());
  CHECK(kl[2] == std::numeric_limits<T>::infinity());
  const double want = 0.5 * std::log(0.5 / 0.25) + 0.5 * std::log(0.5 / 0.75);
  CHECK(std::fabs(double(kl[1]) - want) <= (sizeof(T) == 4 ? 1e-6 : 1e-14) * want);
}
