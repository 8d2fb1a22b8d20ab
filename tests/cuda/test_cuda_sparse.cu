// tests/cuda/test_cuda_sparse.cu — the CUDA sparse path (troll/cuda_sparse.cuh) against the CPU
// backend: sparsify from fp32, fp16 and bf16 logits (the CPU fed the same values as float), align
// (sparse and dense), kl, project, project_backward and sparsify_backward, device reports and
// the checked mode. Without a CUDA device the "device" suite is skipped as in
// test_cuda_projection.cu ("SKIPPED: no CUDA device", exit 0). Tolerances: docs/cuda.md. The
// vocabulary shards, align_backward and double sparsify are tests/cuda/test_cuda_sparse_shards.cu.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_sparse_batch.cuh"
#include "troll/cuda.cuh"
#include "troll/sparse.hpp"

namespace {

using troll_test::close;
using troll_test::device_array;
using troll_test::llm_rows;
using troll_test::sparse_pair;
using troll_test::test_stream;

/// sparsify on the device (logits of type L) against the CPU on the same values as float.
template <class L>
void check_sparsify(std::size_t rows, std::size_t vocab, int k, double delta, bool with_sampled, unsigned seed) {
  CAPTURE(vocab);
  CAPTURE(k);
  CAPTURE(delta);
  test_stream s;
  std::vector<L> values;
  const std::vector<float> host = llm_rows<L>(rows, vocab, seed, values);
  std::vector<troll::token_id> sampled(rows);
  for (std::size_t r = 0; r < rows; ++r) sampled[r] = troll::token_id((r * 7919 + 13) % vocab);
  const std::size_t k_max = std::size_t(k) + 1;
  sparse_pair<float> want(rows, k_max, vocab), got(rows, k_max, vocab);
  const troll::sparsify_options options{k, delta};
  troll::sparsify(troll::cpu, troll::make_batch(host.data(), rows, vocab), with_sampled ? sampled.data() : nullptr,
                  options, want.host());
  device_array<L> d_values(values);
  device_array<troll::token_id> d_sampled(sampled);
  device_array<troll::cuda_row_report> reports(rows);
  troll::sparsify(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const L>(d_values.get(), rows, vocab),
                  with_sampled ? d_sampled.get() : nullptr, options, got.device());
  CUDA_REQUIRE(cudaStreamSynchronize(s.stream));
  const auto counts = got.d_counts.download();
  const auto indices = got.d_indices.download();
  const auto log_probs = got.d_log_probs.download();
  const auto remainder = got.d_log_remainder.download();
  const auto rep = reports.download();
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    REQUIRE(rep[r].error == troll::cuda_row_error::none);
    REQUIRE(counts[r] == want.counts[r]);
    for (std::size_t i = 0; i < k_max; ++i) {
      CHECK(indices[r * k_max + i] == want.indices[r * k_max + i]);
      CHECK_MESSAGE(close(log_probs[r * k_max + i], want.log_probs[r * k_max + i], 2e-6, 1e-5), "entry ", i);
    }
    // Float exp per token, double sums: the tail's log-mass to ~1e-6 relative.
    CHECK_MESSAGE(close(remainder[r], want.log_remainder[r], 4e-6, 1e-5), remainder[r], " vs ", want.log_remainder[r]);
  }
}

}  // namespace

// One API shape: generic code may name the element type, `f<T>(policy, batch_view<const T>, ...)`,
// as on the CPU, or let it be deduced from const or mutable views (fp16 / bf16 logits too). The
// CUDA overloads whose logits type may differ from the rows' took only a deduced mutable form.
namespace api_shape {
template <class T> using cv = troll::batch_view<const T>;
template <class T> using mv = troll::batch_view<T>;
const troll::token_id* const no_ids = nullptr;
#define TROLL_API_SHAPE_PROBE(name, expr)                                      \
  template <class P, class L, class T, class = void>                           \
  struct name : std::false_type {};                                            \
  template <class P, class L, class T>                                         \
  struct name<P, L, T, std::void_t<decltype(expr)>> : std::true_type {};
TROLL_API_SHAPE_PROBE(sparsify_named, troll::sparsify<T>(P{}, cv<T>{}, no_ids, troll::sparsify_options{}, troll::sparse_batch_view<T>{}))
TROLL_API_SHAPE_PROBE(sparsify_deduced, troll::sparsify(P{}, L{}, no_ids, troll::sparsify_options{}, troll::sparse_batch_view<T>{}))
TROLL_API_SHAPE_PROBE(shard_named, troll::sparsify_shard<T>(P{}, cv<T>{}, 0, 0, no_ids, troll::sparsify_options{}, static_cast<troll::sparsify_state*>(nullptr)))
TROLL_API_SHAPE_PROBE(shard_deduced, troll::sparsify_shard(P{}, L{}, 0, 0, no_ids, troll::sparsify_options{}, static_cast<troll::sparsify_state*>(nullptr)))
TROLL_API_SHAPE_PROBE(align_named, troll::align<T>(P{}, cv<T>{}, troll::sparse_input<T>{}, troll::sparse_input<T>{}, troll::aligned_batch_view<T>{}))
TROLL_API_SHAPE_PROBE(align_deduced, troll::align(P{}, L{}, troll::sparse_input<T>{}, troll::sparse_input<T>{}, troll::aligned_batch_view<T>{}))
TROLL_API_SHAPE_PROBE(backward_named, troll::sparsify_backward<T>(P{}, cv<T>{}, troll::sparse_input<T>{}, troll::sparse_grad_input<T>{}, mv<T>{}))
TROLL_API_SHAPE_PROBE(backward_deduced, troll::sparsify_backward(P{}, L{}, troll::sparse_input<T>{}, troll::sparse_grad_input<T>{}, mv<T>{}))
TROLL_API_SHAPE_PROBE(shard_backward_named, troll::sparsify_shard_backward<T>(P{}, cv<T>{}, 0, troll::sparse_input<T>{}, troll::sparse_grad_input<T>{}, static_cast<const double*>(nullptr), mv<T>{}))
TROLL_API_SHAPE_PROBE(shard_backward_deduced, troll::sparsify_shard_backward(P{}, L{}, 0, troll::sparse_input<T>{}, troll::sparse_grad_input<T>{}, static_cast<const double*>(nullptr), mv<T>{}))
#undef TROLL_API_SHAPE_PROBE
template <class P, class L, class T>
constexpr bool all_forms() {
  return sparsify_named<P, L, T>::value && sparsify_deduced<P, L, T>::value && shard_named<P, L, T>::value &&
         shard_deduced<P, L, T>::value && align_named<P, L, T>::value && align_deduced<P, L, T>::value &&
         backward_named<P, L, T>::value && backward_deduced<P, L, T>::value && shard_backward_named<P, L, T>::value &&
         shard_backward_deduced<P, L, T>::value;
}
static_assert(all_forms<troll::cpu_policy, cv<float>, float>() && all_forms<troll::cpu_policy, mv<double>, double>());
static_assert(all_forms<troll::cuda_policy, cv<float>, float>() && all_forms<troll::cuda_policy, mv<float>, float>());
static_assert(all_forms<troll::cuda_policy, cv<double>, double>() && all_forms<troll::cuda_policy, mv<double>, double>());
static_assert(sparsify_deduced<troll::cuda_policy, cv<__nv_bfloat16>, float>::value &&
              sparsify_deduced<troll::cuda_policy, mv<__half>, float>::value &&
              backward_deduced<troll::cuda_policy, mv<__nv_bfloat16>, float>::value &&
              shard_backward_deduced<troll::cuda_policy, cv<__half>, float>::value);
}  // namespace api_shape

TEST_CASE("cuda sparse entry points check shapes and options on the host, before any CUDA call") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  troll::sparse_index* fake_index = reinterpret_cast<troll::sparse_index*>(std::uintptr_t(512));
  const troll::sparse_batch_view<float> out{fake_index, fake, fake_index, fake, 3, 4, 10};
  const auto logits = troll::make_batch<const float>(fake, 3, 10);
  CHECK_THROWS_AS(troll::sparsify(troll::cuda, logits, nullptr, troll::sparsify_options{0, 1e-5}, out),
                  troll::domain_error);
  CHECK_THROWS_AS(troll::sparsify(troll::cuda, logits, nullptr, troll::sparsify_options{8, 1e-5}, out),
                  troll::shape_error);  // k_max 4 < k 8
  const troll::aligned_batch_view<float> aligned{fake_index, fake_index, fake, fake, fake, fake, 3, 4, 10};
  CHECK_THROWS_AS(troll::project(troll::cuda, aligned, -1.0, out, reinterpret_cast<troll::projection_stats*>(fake)),
                  troll::domain_error);
  const troll::sparse_batch_view<float> other_vocab{fake_index, fake, fake_index, fake, 3, 4, 11};
  CHECK_THROWS_AS(troll::align(troll::cuda, out, other_vocab, aligned), troll::shape_error);
}

TEST_CASE("cuda sparse reports become the CPU's exceptions and messages") {
  troll::detail::cuda::sparse_thrower thrower{{"new", "old"}, 10};
  troll::cuda_row_report report;
  report.error = troll::cuda_row_error::sparse_duplicate;
  report.operand = 1;
  report.token = 3;
  report.value = 17;
  std::string message;
  try {
    thrower("align", 2, report, nullptr);
  } catch (const troll::shape_error& e) {
    message = e.what();
    CHECK(e.row() == 2);
  }
  CHECK(message.find("old: entry 3 repeats token index 17") != std::string::npos);
  report.error = troll::cuda_row_error::sparse_nan;
  report.operand = 0;
  report.token = ~0ull;
  CHECK_THROWS_WITH_AS(thrower("align", 0, report, nullptr), doctest::Contains("new log_remainder is NaN"),
                       troll::domain_error);
  report.error = troll::cuda_row_error::bad_sampled;
  report.value = 12;
  CHECK_THROWS_WITH_AS(thrower("sparsify", 1, report, nullptr), doctest::Contains("sampled token 12 is outside"),
                       troll::domain_error);
}

TEST_SUITE("device") {
  TEST_CASE("cuda sparsify matches the CPU for float, fp16 and bf16 logits") {
    check_sparsify<float>(12, 1000, 64, 1e-5, true, 1);
    check_sparsify<float>(6, 5000, 256, 0.0, false, 2);
    check_sparsify<float>(9, 7, 4, 1e-3, true, 3);
    check_sparsify<__half>(12, 5000, 64, 1e-5, true, 4);
    check_sparsify<__nv_bfloat16>(12, 5000, 64, 1e-5, true, 5);  // bf16: many tied logits
    check_sparsify<__nv_bfloat16>(3, 151936, 64, 1e-5, true, 6);
  }

  TEST_CASE("cuda align, kl, project, project_backward and sparsify_backward match the CPU") {
    test_stream s;
    const std::size_t rows = 16, vocab = 3000, k = 32, k_max = k + 1, u_max = 2 * k_max;
    std::vector<double> values_new, values_old;
    const std::vector<float> fn = llm_rows<double>(rows, vocab, 11, values_new);
    const std::vector<float> fo = llm_rows<double>(rows, vocab, 12, values_old);
    std::vector<double> zn(fn.begin(), fn.end()), zo(fo.begin(), fo.end());
    for (std::size_t i = 0; i < zn.size(); ++i) zn[i] = 0.8 * zn[i] + 0.2 * zo[i];  // overlapping supports
    std::vector<troll::token_id> sampled(rows, 3);
    const troll::sparsify_options options{int(k), 1e-5};
    sparse_pair<double> sn(rows, k_max, vocab), so(rows, k_max, vocab);
    troll::sparsify(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), sampled.data(), options, sn.host());
    troll::sparsify(troll::cpu, troll::make_batch<const double>(zo.data(), rows, vocab), sampled.data(), options, so.host());
    sn.upload();
    so.upload();

    // align(sparse, sparse)
    struct aligned_owner {
      std::vector<troll::sparse_index> indices, counts;
      std::vector<double> ln, lo, rn, ro;
      aligned_owner(std::size_t n, std::size_t kk) : indices(n * kk), counts(n), ln(n * kk), lo(n * kk), rn(n), ro(n) {}
    };
    aligned_owner want(rows, u_max);
    const troll::aligned_batch_view<double> want_view{want.indices.data(), want.counts.data(), want.ln.data(),
                                                      want.lo.data(), want.rn.data(), want.ro.data(), rows, u_max, vocab};
    troll::align(troll::cpu, sn.host(), so.host(), want_view);
    device_array<troll::sparse_index> a_idx(rows * u_max), a_cnt(rows);
    device_array<double> a_ln(rows * u_max), a_lo(rows * u_max), a_rn(rows), a_ro(rows);
    const troll::aligned_batch_view<double> got_view{a_idx.get(), a_cnt.get(), a_ln.get(), a_lo.get(),
                                                     a_rn.get(), a_ro.get(), rows, u_max, vocab};
    troll::align(troll::cuda.on(s.stream).checked(), sn.device(), so.device(), got_view);
    CHECK(a_idx.download() == want.indices);
    CHECK(a_cnt.download() == want.counts);
    CHECK(a_ln.download() == want.ln);  // copies and the same double arithmetic: exact
    CHECK(a_lo.download() == want.lo);
    const auto rn = a_rn.download(), ro = a_ro.download();
    for (std::size_t r = 0; r < rows; ++r) {
      CHECK(close(rn[r], want.rn[r], 1e-15, 1e-15));
      CHECK(close(ro[r], want.ro[r], 1e-15, 1e-15));
    }

    // align(dense new logits, support, old)
    aligned_owner want_dense(rows, u_max);
    const troll::aligned_batch_view<double> want_dense_view{want_dense.indices.data(), want_dense.counts.data(),
                                                            want_dense.ln.data(), want_dense.lo.data(),
                                                            want_dense.rn.data(), want_dense.ro.data(), rows, u_max, vocab};
    troll::align(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), sn.host(), so.host(), want_dense_view);
    device_array<double> d_zn(zn);
    troll::align(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(d_zn.get(), rows, vocab), sn.device(),
                 so.device(), got_view);
    CHECK(a_idx.download() == want_dense.indices);
    {
      const auto ln = a_ln.download(), rnd = a_rn.download();
      for (std::size_t i = 0; i < ln.size(); ++i) CHECK(close(ln[i], want_dense.ln[i], 1e-12, 1e-12));
      for (std::size_t r = 0; r < rows; ++r) CHECK(close(rnd[r], want_dense.rn[r], 1e-12, 1e-12));
    }
    {  // new_support's values are never read (ids and counts only), as on the CPU: NaN values
       // give the same aligned rows bit for bit, in checked mode
      const auto first_ln = a_ln.download(), first_rn = a_rn.download();
      sparse_pair<double> ids_only(rows, k_max, vocab);
      ids_only.indices = sn.indices, ids_only.counts = sn.counts;
      std::fill(ids_only.log_probs.begin(), ids_only.log_probs.end(), std::nan(""));
      std::fill(ids_only.log_remainder.begin(), ids_only.log_remainder.end(), std::nan(""));
      ids_only.upload();
      troll::align(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(d_zn.get(), rows, vocab),
                   ids_only.device(), so.device(), got_view);
      CHECK(a_idx.download() == want_dense.indices);
      CHECK(a_ln.download() == first_ln);
      CHECK(a_rn.download() == first_rn);
    }

    // kl and project of the (CPU-aligned) rows, uploaded as they are
    device_array<troll::sparse_index> w_idx(want.indices), w_cnt(want.counts);
    device_array<double> w_ln(want.ln), w_lo(want.lo), w_rn(want.rn), w_ro(want.ro);
    const troll::aligned_batch_view<const double> rows_dev{w_idx.get(), w_cnt.get(), w_ln.get(), w_lo.get(),
                                                           w_rn.get(), w_ro.get(), rows, u_max, vocab};
    std::vector<double> kl_want(rows);
    troll::kl(troll::cpu, want_view, kl_want.data());
    device_array<double> kl_got(rows);
    troll::kl(troll::cuda.on(s.stream).checked(), rows_dev, kl_got.get());
    const auto kl_values = kl_got.download();
    for (std::size_t r = 0; r < rows; ++r) CHECK(close(kl_values[r], kl_want[r], 1e-13, 1e-10));

    for (const double eps : {0.01, 0.05, 0.5}) {
      CAPTURE(eps);
      sparse_pair<double> pw(rows, u_max, vocab), pg(rows, u_max, vocab);
      std::vector<troll::projection_stats> st_want(rows);
      troll::project(troll::cpu, want_view, eps, pw.host(), st_want.data());
      device_array<troll::projection_stats> st_got(rows);
      troll::project(troll::cuda.on(s.stream).checked(), rows_dev, eps, pg.device(), st_got.get(), troll::projection_options{});
      const auto st = st_got.download();
      const auto lp = pg.d_log_probs.download(), lr = pg.d_log_remainder.download();
      CHECK(pg.d_indices.download() == pw.indices);
      for (std::size_t r = 0; r < rows; ++r) {
        CAPTURE(r);
        REQUIRE(st[r].status == st_want[r].status);
        CHECK(close(st[r].t, st_want[r].t, 1e-9, 1e-8));
        if (st[r].status == troll::row_status::projected) CHECK(std::fabs(st[r].kl_after - eps) <= 1e-13 + 1e-10 * eps);
        for (std::size_t i = 0; i < u_max; ++i) CHECK(close(lp[r * u_max + i], pw.log_probs[r * u_max + i], 1e-8, 1e-8));
        CHECK(close(lr[r], pw.log_remainder[r], 1e-8, 1e-8));
      }

      // backward, fed the CPU forward
      std::mt19937 gen(7);
      std::normal_distribution<double> normal;
      std::vector<double> g(rows * u_max), g_r(rows);
      for (auto& x : g) x = normal(gen);
      for (auto& x : g_r) x = normal(gen);
      std::vector<double> gn_want(rows * u_max), go_want(rows * u_max), gnr_want(rows), gor_want(rows), ge_want(rows);
      troll::project_backward(troll::cpu, want_view, pw.host(), st_want.data(),
                              troll::sparse_grad_view<double>{g.data(), g_r.data(), rows, u_max},
                              troll::sparse_grad_view<double>{gn_want.data(), gnr_want.data(), rows, u_max},
                              troll::sparse_grad_view<double>{go_want.data(), gor_want.data(), rows, u_max},
                              ge_want.data());
      pw.upload();
      device_array<troll::projection_stats> d_st(st_want);
      device_array<double> d_g(g), d_gr(g_r), d_gn(rows * u_max), d_gnr(rows), d_go(rows * u_max), d_gor(rows),
          d_ge(rows);
      troll::project_backward(troll::cuda.on(s.stream).checked(), rows_dev, pw.device(), d_st.get(),
                              troll::sparse_grad_view<double>{d_g.get(), d_gr.get(), rows, u_max},
                              troll::sparse_grad_view<double>{d_gn.get(), d_gnr.get(), rows, u_max},
                              troll::sparse_grad_view<double>{d_go.get(), d_gor.get(), rows, u_max}, d_ge.get());
      const auto gn = d_gn.download(), go = d_go.download(), gnr = d_gnr.download(), gor = d_gor.download(),
                 ge = d_ge.download();
      for (std::size_t i = 0; i < gn.size(); ++i) {
        CHECK(close(gn[i], gn_want[i], 1e-10, 1e-9));
        CHECK(close(go[i], go_want[i], 1e-10, 1e-9));
      }
      for (std::size_t r = 0; r < rows; ++r) {
        CHECK(close(gnr[r], gnr_want[r], 1e-10, 1e-9));
        CHECK(close(gor[r], gor_want[r], 1e-10, 1e-9));
        CHECK(close(ge[r], ge_want[r], 1e-10, 1e-9));
      }
    }

    // sparsify_backward of the new rows' support
    std::mt19937 gen(9);
    std::normal_distribution<double> normal;
    std::vector<double> g(rows * k_max), g_r(rows), dz_want(rows * vocab);
    for (auto& x : g) x = normal(gen);
    for (auto& x : g_r) x = normal(gen);
    troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), sn.host(),
                             troll::sparse_grad_view<double>{g.data(), g_r.data(), rows, k_max},
                             troll::make_batch(dz_want.data(), rows, vocab));
    device_array<double> d_g(g), d_gr(g_r), d_dz(rows * vocab);
    troll::sparsify_backward(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(d_zn.get(), rows, vocab),
                             sn.device(), troll::sparse_grad_view<double>{d_g.get(), d_gr.get(), rows, k_max},
                             troll::make_batch(d_dz.get(), rows, vocab));
    const auto dz = d_dz.download();
    for (std::size_t i = 0; i < dz.size(); ++i) CHECK(close(dz[i], dz_want[i], 1e-13, 1e-10));
  }

  TEST_CASE("cuda sparsify reports bad rows and throws the CPU's exception in checked mode") {
    test_stream s;
    const std::size_t rows = 4, vocab = 300;
    std::vector<float> z(rows * vocab, -1.0f);
    z[2 * vocab + 17] = std::numeric_limits<float>::quiet_NaN();
    for (std::size_t i = 0; i < vocab; ++i) z[3 * vocab + i] = -std::numeric_limits<float>::infinity();
    device_array<float> dz(z);
    sparse_pair<float> out(rows, 8, vocab);
    device_array<troll::cuda_row_report> reports(rows);
    device_array<unsigned long long> first_bad(1);
    const auto view = troll::make_batch<const float>(dz.get(), rows, vocab);
    troll::sparsify(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), view, nullptr, troll::sparsify_options{8, 1e-5}, out.device());
    const auto rep = reports.download();
    CHECK(rep[0].error == troll::cuda_row_error::none);
    CHECK(rep[2].error == troll::cuda_row_error::nan_value);
    CHECK(rep[2].token == 17);
    CHECK(rep[3].error == troll::cuda_row_error::all_masked);
    CHECK(first_bad.download()[0] == 2);
    CHECK(out.d_counts.download()[2] == 0);
    std::string cpu_message;
    try {
      sparse_pair<float> host_out(rows, 8, vocab);
      troll::sparsify(troll::cpu, troll::make_batch<const float>(z.data(), rows, vocab), nullptr,
                      troll::sparsify_options{8, 1e-5}, host_out.host());
    } catch (const troll::domain_error& e) {
      cpu_message = e.what();
    }
    CHECK_THROWS_WITH_AS(troll::sparsify(troll::cuda.on(s.stream).checked(), view, nullptr, troll::sparsify_options{8, 1e-5},
                                         out.device()),
                         cpu_message.c_str(), troll::domain_error);
  }
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
