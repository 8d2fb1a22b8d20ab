// tests/cuda/test_cuda_sparse_shards.cu — the CUDA vocabulary shards (sparsify_shard /
// sparsify_merge / sparsify_finalize, GPU states merged with each other and with CPU states),
// align_backward and sparsify from double logits against the CPU backend (the rest of the sparse
// path is tests/cuda/test_cuda_sparse.cu), with device reports and the checked mode giving the
// CPU's exceptions and messages. Host-side argument checks and the report→exception translation
// run without a device; the "device" suite is skipped without one ("SKIPPED: no CUDA device",
// exit 0).
//
// Tolerances (double): indices and counts exact; log-probs and log-remainders to 1e-12 absolute
// + relative against the CPU (the backends' exponentials differ); a sharded CUDA sparsify
// finalised in two stages (canonical tail sums) equals the whole-row CUDA sparsify bit for bit;
// align_backward entries exact (copies), its remainder to 1e-13.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_sparse_batch.cuh"
#include "troll/cuda.cuh"
#include "troll/sparse.hpp"

namespace {

using troll_test::close;
using troll_test::device_array;
using troll_test::message_of;
using troll_test::sparse_pair;
using troll_test::test_stream;

constexpr double inf = std::numeric_limits<double>::infinity();

/// Double logits shaped like an LLM's (llm_rows widened, plus a double-only jitter so that many
/// values are not floats), with rows that stress the ranking: exact ties, distinct doubles within
/// one float ulp of each other, a row of one finite token, a near-uniform row.
std::vector<double> double_rows(std::size_t rows, std::size_t vocab, unsigned seed) {
  std::vector<float> unused;
  const std::vector<float> base = troll_test::llm_rows<float>(rows, vocab, seed, unused);
  std::mt19937 gen(seed + 1000);
  std::uniform_real_distribution<double> jitter(-1e-9, 1e-9);
  std::vector<double> z(base.begin(), base.end());
  for (std::size_t r = 0; r < rows; ++r) {
    double* row = z.data() + r * vocab;
    switch (r % 5) {
      case 0:  // plain, with double-only digits
        for (std::size_t i = 0; i < vocab; ++i)
          if (std::isfinite(row[i])) row[i] += jitter(gen);
        break;
      case 1:  // exact ties: a coarse grid of values
        for (std::size_t i = 0; i < vocab; ++i)
          if (std::isfinite(row[i])) row[i] = std::round(row[i] * 2.0) / 2.0;
        break;
      case 2:  // the head within one float ulp: distinct doubles, equal as floats
        for (std::size_t i = 0; i < vocab; ++i) row[i] = 3.0 + 1e-12 * double((i * 7919) % 4093) - (i % 3 == 0 ? 30.0 : 0.0);
        break;
      case 3:  // a single finite token
        for (std::size_t i = 0; i < vocab; ++i) row[i] = i == vocab / 2 ? 0.25 : -inf;
        break;
      default:  // near uniform
        for (std::size_t i = 0; i < vocab; ++i) row[i] = 1e-3 * double(i % 11);
        break;
    }
  }
  return z;
}

/// Device sparse rows (downloaded) equal the CPU's: indices and counts exactly, values closely.
void require_same_rows(sparse_pair<double>& got, const sparse_pair<double>& want, double tol) {
  got.download();
  for (std::size_t r = 0; r < want.rows; ++r) {
    CAPTURE(r);
    REQUIRE(got.counts[r] == want.counts[r]);
    for (std::size_t i = 0; i < want.k_max; ++i) {
      CAPTURE(i);
      CHECK(got.indices[r * want.k_max + i] == want.indices[r * want.k_max + i]);
      CHECK(close(got.log_probs[r * want.k_max + i], want.log_probs[r * want.k_max + i], tol, tol));
    }
    CHECK_MESSAGE(close(got.log_remainder[r], want.log_remainder[r], tol, tol), got.log_remainder[r], " vs ",
                  want.log_remainder[r]);
  }
}

std::vector<troll::token_id> sampled_tokens(std::size_t rows, std::size_t vocab) {
  std::vector<troll::token_id> sampled(rows);
  for (std::size_t r = 0; r < rows; ++r) sampled[r] = troll::token_id((r * 7919 + 13) % vocab);
  return sampled;
}

void check_double_sparsify(std::size_t rows, std::size_t vocab, int k, double delta, bool with_sampled,
                           unsigned seed) {
  CAPTURE(vocab);
  CAPTURE(k);
  CAPTURE(delta);
  CAPTURE(with_sampled);
  test_stream s;
  const std::vector<double> z = double_rows(rows, vocab, seed);
  const std::vector<troll::token_id> sampled = sampled_tokens(rows, vocab);
  const std::size_t k_max = std::size_t(k) + 1;
  sparse_pair<double> want(rows, k_max, vocab), got(rows, k_max, vocab);
  const troll::sparsify_options options{k, delta};
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), with_sampled ? sampled.data() : nullptr,
                  options, want.host());
  device_array<double> d_z(z);
  device_array<troll::token_id> d_sampled(sampled);
  device_array<troll::cuda_row_report> reports(rows);
  troll::sparsify(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get()}), troll::make_batch<const double>(d_z.get(), rows, vocab),
                  with_sampled ? d_sampled.get() : nullptr, options, got.device());
  s.sync();
  const auto rep = reports.download();
  for (std::size_t r = 0; r < rows; ++r) REQUIRE(rep[r].error == troll::cuda_row_error::none);
  require_same_rows(got, want, 1e-12);
  for (std::size_t r = 0; with_sampled && r < rows; ++r) {
    const auto* begin = got.indices.data() + r * k_max;
    CHECK(std::find(begin, begin + got.counts[r], sampled[r]) != begin + got.counts[r]);
  }
}

/// Cut points 0 = c_0 < c_1 < … < c_shards = vocab (random, each shard non-empty).
std::vector<std::size_t> shard_cuts(std::size_t vocab, std::size_t shards, std::mt19937& gen) {
  std::vector<std::size_t> cuts{0, vocab};
  std::uniform_int_distribution<std::size_t> pick(1, vocab - 1);
  while (cuts.size() < shards + 1) {
    const std::size_t c = pick(gen);
    if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

/// The rows of merged device states `d_states` finalised in two stages (troll::sparsify_finalize,
/// then each shard's sparsify_tail_sums on the device logits d_z cut at `cuts`, in reverse shard
/// order, then sparsify_finalize again with the sums): the canonical values, downloaded into out.
template <class L, class T>
void finalize_exact(test_stream& s, const troll::sparsify_state* d_states, const troll::sparsify_options& options,
                    const L* d_z, std::size_t rows, std::size_t vocab, const std::vector<std::size_t>& cuts,
                    sparse_pair<T>& out) {
  const std::size_t shards = cuts.size() - 1;
  device_array<double> tail_max(rows), tail_sums(2 * rows * shards), log_sums(troll::sparsify_log_sums_width * rows);
  troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), d_states, options, out.device(), log_sums.get(),
                           tail_max.get());
  const troll::sparse_input<T> support(out.device());
  for (std::size_t j = shards; j-- > 0;)
    troll::sparsify_tail_sums<T>(troll::cuda.on(s.stream).checked(),
                              troll::make_batch<const L>(d_z + cuts[j], rows, cuts[j + 1] - cuts[j], vocab), cuts[j],
                              support, tail_max.get(), tail_sums.get() + 2 * rows * (shards - 1 - j));
  troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), d_states, options, out.device(), log_sums.get(),
                           tail_max.get(), tail_sums.get(), shards);
  out.download();
}

/// The same two stages on the host (troll::cpu) for host states and logits.
template <class T>
void finalize_exact_cpu(const troll::sparsify_state* states, const troll::sparsify_options& options, const T* z,
                        std::size_t rows, std::size_t vocab, const std::vector<std::size_t>& cuts, sparse_pair<T>& out) {
  const std::size_t shards = cuts.size() - 1;
  std::vector<double> tail_max(rows), tail_sums(2 * rows * shards);
  troll::sparsify_finalize(troll::cpu, states, options, out.host(), nullptr, tail_max.data());
  for (std::size_t j = 0; j < shards; ++j)
    troll::sparsify_tail_sums<T>(troll::cpu, troll::make_batch<const T>(z + cuts[j], rows, cuts[j + 1] - cuts[j], vocab),
                              cuts[j], troll::sparse_input<T>(out.host()), tail_max.data(),
                              tail_sums.data() + 2 * rows * j);
  troll::sparsify_finalize(troll::cpu, states, options, out.host(), nullptr, tail_max.data(), tail_sums.data(),
                           shards);
}

/// Two sets of sparse rows equal bit for bit (NaN-free rows; −inf padding compares equal).
template <class T>
void require_identical(const sparse_pair<T>& got, const sparse_pair<T>& want) {
  REQUIRE(got.counts == want.counts);
  REQUIRE(got.indices == want.indices);
  for (std::size_t i = 0; i < want.log_probs.size(); ++i) {
    CAPTURE(i);
    CHECK(got.log_probs[i] == want.log_probs[i]);
  }
  for (std::size_t r = 0; r < want.rows; ++r) {
    CAPTURE(r);
    CHECK(got.log_remainder[r] == want.log_remainder[r]);
  }
}

/// Whole rows via 1..4 shards: GPU shard states merged on the GPU (a left fold and its mirror),
/// finalised on the GPU; and the same shards with every other one made on the CPU, merged and
/// finalised on the CPU and on the GPU. Every result equals the CPU's whole-row sparsify (to
/// 1e-12: the backends' exponentials differ); finalised in two stages with the canonical tail
/// sums, the GPU's equal the GPU's whole-row sparsify and the CPU's the CPU's, bit for bit.
void check_shards(std::size_t rows, std::size_t vocab, int k, bool with_sampled, unsigned seed) {
  CAPTURE(vocab);
  CAPTURE(k);
  CAPTURE(with_sampled);
  test_stream s;
  const std::vector<double> z = double_rows(rows, vocab, seed);
  const std::vector<troll::token_id> sampled = sampled_tokens(rows, vocab);
  const troll::token_id* h_sampled = with_sampled ? sampled.data() : nullptr;
  const troll::sparsify_options options{k, 1e-5};
  const std::size_t k_max = std::size_t(k) + 1;
  sparse_pair<double> want(rows, k_max, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), h_sampled, options, want.host());

  device_array<double> d_z(z);
  device_array<troll::token_id> d_sampled_array(sampled);
  const troll::token_id* d_sampled = with_sampled ? d_sampled_array.get() : nullptr;
  sparse_pair<double> gpu_whole(rows, k_max, vocab);
  troll::sparsify(troll::cuda.on(s.stream).checked(), troll::make_batch<const double>(d_z.get(), rows, vocab), d_sampled,
                  options, gpu_whole.device());
  gpu_whole.download();
  require_same_rows(gpu_whole, want, 1e-12);
  std::mt19937 gen(seed);
  for (std::size_t shards = 1; shards <= 4 && shards <= vocab; ++shards) {
    CAPTURE(shards);
    const std::vector<std::size_t> cuts = shard_cuts(vocab, shards, gen);
    std::vector<std::unique_ptr<device_array<troll::sparsify_state>>> gpu;  // one state array per shard
    std::vector<std::vector<troll::sparsify_state>> cpu(shards, std::vector<troll::sparsify_state>(rows));
    for (std::size_t j = 0; j < shards; ++j) {
      const std::size_t width = cuts[j + 1] - cuts[j];
      gpu.push_back(std::make_unique<device_array<troll::sparsify_state>>(rows));
      troll::sparsify_shard(troll::cuda.on(s.stream).checked(),
                            troll::make_batch<const double>(d_z.get() + cuts[j], rows, width, vocab), cuts[j], vocab,
                            d_sampled, options, gpu[j]->get());
      troll::sparsify_shard(troll::cpu, troll::make_batch<const double>(z.data() + cuts[j], rows, width, vocab),
                            cuts[j], vocab, h_sampled, options, cpu[j].data());
    }
    // GPU only: into = shard 0, then 1, 2, … merged in.
    for (std::size_t j = 1; j < shards; ++j)
      troll::sparsify_merge(troll::cuda.on(s.stream).checked(), gpu[0]->get(), gpu[j]->get(), rows);
    sparse_pair<double> got(rows, k_max, vocab);
    troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), gpu[0]->get(), options, got.device());
    require_same_rows(got, want, 1e-12);
    sparse_pair<double> exact(rows, k_max, vocab);
    finalize_exact(s, gpu[0]->get(), options, d_z.get(), rows, vocab, cuts, exact);
    require_identical(exact, gpu_whole);

    // Mixed: even shards from the GPU (fresh states), odd ones from the CPU, merged right to left.
    std::vector<std::vector<troll::sparsify_state>> mixed(shards);
    for (std::size_t j = 0; j < shards; ++j) {
      if (j % 2 == 1) {
        mixed[j] = cpu[j];
        continue;
      }
      const std::size_t width = cuts[j + 1] - cuts[j];
      troll::sparsify_shard(troll::cuda.on(s.stream),
                            troll::make_batch<const double>(d_z.get() + cuts[j], rows, width, vocab), cuts[j], vocab,
                            d_sampled, options, gpu[j]->get());
      mixed[j] = gpu[j]->download();
    }
    std::vector<troll::sparsify_state> host_into = mixed[shards - 1];
    for (std::size_t j = shards - 1; j-- > 0;) troll::sparsify_merge(troll::cpu, host_into.data(), mixed[j].data(), rows);
    sparse_pair<double> on_cpu(rows, k_max, vocab);
    troll::sparsify_finalize(troll::cpu, host_into.data(), options, on_cpu.host());
    CHECK(on_cpu.indices == want.indices);
    CHECK(on_cpu.counts == want.counts);
    for (std::size_t i = 0; i < want.log_probs.size(); ++i) CHECK(close(on_cpu.log_probs[i], want.log_probs[i], 1e-12, 1e-12));
    for (std::size_t r = 0; r < rows; ++r) CHECK(close(on_cpu.log_remainder[r], want.log_remainder[r], 1e-12, 1e-12));
    sparse_pair<double> on_cpu_exact(rows, k_max, vocab);
    finalize_exact_cpu(host_into.data(), options, z.data(), rows, vocab, cuts, on_cpu_exact);
    require_identical(on_cpu_exact, want);

    // The same mixed states merged and finalised on the GPU.
    device_array<troll::sparsify_state> d_into(mixed[0]), d_from(rows);
    for (std::size_t j = 1; j < shards; ++j) {
      d_from.upload(mixed[j]);
      troll::sparsify_merge(troll::cuda.on(s.stream).checked(), d_into.get(), d_from.get(), rows);
    }
    sparse_pair<double> mixed_gpu(rows, k_max, vocab);
    troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), d_into.get(), options, mixed_gpu.device());
    require_same_rows(mixed_gpu, want, 1e-12);
    sparse_pair<double> mixed_exact(rows, k_max, vocab);
    finalize_exact(s, d_into.get(), options, d_z.get(), rows, vocab, cuts, mixed_exact);
    require_identical(mixed_exact, gpu_whole);
  }
}

/// float logits through GPU shards against the CPU's float sparsify (the states hold the same
/// float values widened).
void check_float_shards(std::size_t rows, std::size_t vocab, int k, unsigned seed) {
  test_stream s;
  std::vector<float> values;
  const std::vector<float> z = troll_test::llm_rows<float>(rows, vocab, seed, values);
  const std::vector<troll::token_id> sampled = sampled_tokens(rows, vocab);
  const troll::sparsify_options options{k, 1e-5};
  const std::size_t k_max = std::size_t(k) + 1;
  sparse_pair<float> want(rows, k_max, vocab);
  troll::sparsify(troll::cpu, troll::make_batch(z.data(), rows, vocab), sampled.data(), options, want.host());
  device_array<float> d_z(z);
  device_array<troll::token_id> d_sampled(sampled);
  const std::size_t half = vocab / 2;
  device_array<troll::sparsify_state> a(rows), b(rows);
  troll::sparsify_shard(troll::cuda.on(s.stream), troll::make_batch<const float>(d_z.get(), rows, half, vocab), 0,
                        vocab, d_sampled.get(), options, a.get());
  troll::sparsify_shard(troll::cuda.on(s.stream),
                        troll::make_batch<const float>(d_z.get() + half, rows, vocab - half, vocab), half, vocab,
                        d_sampled.get(), options, b.get());
  troll::sparsify_merge(troll::cuda.on(s.stream), b.get(), a.get(), rows);
  sparse_pair<float> got(rows, k_max, vocab);
  troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), b.get(), options, got.device());
  got.download();
  CHECK(got.indices == want.indices);
  CHECK(got.counts == want.counts);
  for (std::size_t i = 0; i < want.log_probs.size(); ++i) CHECK(close(got.log_probs[i], want.log_probs[i], 2e-6, 1e-5));
  for (std::size_t r = 0; r < rows; ++r) CHECK(close(got.log_remainder[r], want.log_remainder[r], 4e-6, 1e-5));

  // Two-stage finalize: bit for bit the GPU's whole-row float sparsify.
  sparse_pair<float> gpu_whole(rows, k_max, vocab), exact(rows, k_max, vocab);
  troll::sparsify(troll::cuda.on(s.stream).checked(), troll::make_batch<const float>(d_z.get(), rows, vocab),
                  d_sampled.get(), options, gpu_whole.device());
  gpu_whole.download();
  finalize_exact(s, b.get(), options, d_z.get(), rows, vocab, std::vector<std::size_t>{0, half, vocab}, exact);
  require_identical(exact, gpu_whole);
}

/// bf16 logits through 1..6 random shards: the two-stage finalize equals the whole-row CUDA
/// sparsify of the same bf16 logits bit for bit (terms in float, as the whole row takes them).
void check_bf16_shards(std::size_t rows, std::size_t vocab, int k, unsigned seed) {
  test_stream s;
  std::vector<__nv_bfloat16> values;
  troll_test::llm_rows<__nv_bfloat16>(rows, vocab, seed, values);
  const std::vector<troll::token_id> sampled = sampled_tokens(rows, vocab);
  const troll::sparsify_options options{k, 1e-5};
  const std::size_t k_max = std::size_t(k) + 1;
  device_array<__nv_bfloat16> d_z(values);
  device_array<troll::token_id> d_sampled(sampled);
  sparse_pair<float> whole(rows, k_max, vocab);
  troll::sparsify(troll::cuda.on(s.stream).checked(), troll::make_batch<const __nv_bfloat16>(d_z.get(), rows, vocab),
                  d_sampled.get(), options, whole.device());
  whole.download();
  std::mt19937 gen(seed);
  for (std::size_t shards = 1; shards <= 6; ++shards) {
    CAPTURE(shards);
    const std::vector<std::size_t> cuts = shard_cuts(vocab, shards, gen);
    std::vector<std::unique_ptr<device_array<troll::sparsify_state>>> states;
    for (std::size_t j = 0; j < shards; ++j) {
      states.push_back(std::make_unique<device_array<troll::sparsify_state>>(rows));
      troll::sparsify_shard(troll::cuda.on(s.stream).checked(),
                            troll::make_batch<const __nv_bfloat16>(d_z.get() + cuts[j], rows, cuts[j + 1] - cuts[j], vocab),
                            cuts[j], vocab, d_sampled.get(), options, states[j]->get());
    }
    for (std::size_t j = shards - 1; j > 0; --j)  // right to left
      troll::sparsify_merge(troll::cuda.on(s.stream).checked(), states[j - 1]->get(), states[j]->get(), rows);
    sparse_pair<float> exact(rows, k_max, vocab);
    finalize_exact(s, states[0]->get(), options, d_z.get(), rows, vocab, cuts, exact);
    require_identical(exact, whole);
  }
}

/// Aligned rows on the host and the device (owner of both copies).
struct shard_rows {
  std::size_t rows, k_max, vocab;
  std::vector<troll::sparse_index> indices, counts;
  std::vector<double> ln, lo, rn, ro;
  shard_rows(std::size_t n, std::size_t k, std::size_t v)
      : rows(n), k_max(k), vocab(v), indices(n * k), counts(n), ln(n * k), lo(n * k), rn(n), ro(n) {}
  troll::aligned_batch_view<double> host() {
    return {indices.data(), counts.data(), ln.data(), lo.data(), rn.data(), ro.data(), rows, k_max, vocab};
  }
};

/// A device copy of a shard_rows' rows.
struct aligned_device {
  device_array<troll::sparse_index> indices, counts;
  device_array<double> ln, lo, rn, ro;
  std::size_t rows, k_max, vocab;
  explicit aligned_device(const shard_rows& a)
      : indices(a.indices), counts(a.counts), ln(a.ln), lo(a.lo), rn(a.rn), ro(a.ro), rows(a.rows), k_max(a.k_max),
        vocab(a.vocab) {}
  troll::aligned_batch_view<const double> view() const {
    return {indices.get(), counts.get(), ln.get(), lo.get(), rn.get(), ro.get(), rows, k_max, vocab};
  }
};

/// New and old sparse rows (CPU sparsify of overlapping logits) and their CPU alignment.
struct align_fixture {
  static constexpr std::size_t rows = 12, vocab = 2000, k = 24, k_max = k + 1, u_max = 2 * k_max;
  sparse_pair<double> fresh{rows, k_max, vocab}, old{rows, k_max, vocab};
  shard_rows aligned{rows, u_max, vocab};
  std::vector<double> g, g_r;

  align_fixture() {
    std::vector<float> unused;
    const std::vector<float> fn = troll_test::llm_rows<float>(rows, vocab, 21, unused);
    const std::vector<float> fo = troll_test::llm_rows<float>(rows, vocab, 22, unused);
    std::vector<double> zn(fn.begin(), fn.end()), zo(fo.begin(), fo.end());
    for (std::size_t i = 0; i < zn.size(); ++i) zn[i] = 0.7 * zn[i] + 0.3 * zo[i];
    const std::vector<troll::token_id> sampled(rows, 5);
    const troll::sparsify_options options{int(k), 1e-5};
    troll::sparsify(troll::cpu, troll::make_batch<const double>(zn.data(), rows, vocab), sampled.data(), options,
                    fresh.host());
    troll::sparsify(troll::cpu, troll::make_batch<const double>(zo.data(), rows, vocab), sampled.data(), options,
                    old.host());
    fresh.upload();
    old.upload();
    troll::align(troll::cpu, fresh.host(), old.host(), aligned.host());
    std::mt19937 gen(23);
    std::normal_distribution<double> normal;
    g.resize(rows * u_max);
    g_r.resize(rows);
    for (auto& x : g) x = normal(gen);
    for (auto& x : g_r) x = normal(gen);
  }
};

}  // namespace

TEST_CASE("cuda shard, merge, finalize, align_backward and double sparsify check arguments on the host") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  double* fake_double = reinterpret_cast<double*>(std::uintptr_t(256));
  troll::sparse_index* fake_index = reinterpret_cast<troll::sparse_index*>(std::uintptr_t(512));
  troll::sparsify_state* fake_states = reinterpret_cast<troll::sparsify_state*>(std::uintptr_t(1024));
  const troll::sparsify_options options{8, 1e-5};

  // sparsify from double logits: options and capacity.
  const troll::sparse_batch_view<double> out{fake_index, fake_double, fake_index, fake_double, 3, 4, 10};
  const auto logits = troll::make_batch<const double>(fake_double, 3, 10);
  CHECK_THROWS_AS(troll::sparsify(troll::cuda, logits, nullptr, troll::sparsify_options{0, 1e-5}, out),
                  troll::domain_error);
  CHECK_THROWS_AS(troll::sparsify(troll::cuda, logits, nullptr, options, out), troll::shape_error);

  // sparsify_shard: the shard must fit the vocabulary; options; states.
  const auto shard = troll::make_batch<const float>(fake, 3, 6, 10);
  CHECK_THROWS_WITH_AS(troll::sparsify_shard(troll::cuda, shard, 5, 10, nullptr, options, fake_states),
                       doctest::Contains("the shard of 6 tokens at offset 5 does not fit in the vocabulary [0, 10)"), troll::shape_error);
  CHECK_THROWS_AS(troll::sparsify_shard(troll::cuda, shard, 0, 10, nullptr, troll::sparsify_options{8, 1.5},
                                        fake_states),
                  troll::domain_error);
  CHECK_THROWS_AS(troll::sparsify_shard(troll::cuda, shard, 0, 10, nullptr, options, nullptr), troll::shape_error);
  // The CPU and CUDA overloads share the checks: the same message.
  std::vector<float> host_logits(30, 0.0f);
  std::vector<troll::sparsify_state> host_states(3);
  const std::string cpu_shard = message_of<troll::shape_error>([&] {
    troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(host_logits.data(), 3, 6, 10), 5, 10, nullptr,
                          options, host_states.data());
  });
  CHECK(cpu_shard == message_of<troll::shape_error>([&] {
          troll::sparsify_shard(troll::cuda, shard, 5, 10, nullptr, options, fake_states);
        }));

  // sparsify_merge and sparsify_finalize: pointers, options.
  CHECK_THROWS_AS(troll::sparsify_merge(troll::cuda, nullptr, fake_states, 2), troll::shape_error);
  CHECK_THROWS_AS(troll::sparsify_merge(troll::cuda, fake_states, nullptr, 2), troll::shape_error);
  troll::sparsify_merge(troll::cuda, nullptr, nullptr, 0);  // nothing to do: no CUDA call
  const troll::sparse_batch_view<float> out_float{fake_index, fake, fake_index, fake, 3, 9, 10};
  CHECK_THROWS_AS(troll::sparsify_finalize(troll::cuda, nullptr, options, out_float), troll::shape_error);
  CHECK_THROWS_AS(troll::sparsify_finalize(troll::cuda, fake_states, troll::sparsify_options{300, 0.0}, out_float),
                  troll::domain_error);

  // align_backward: rows, vocabularies, gradient shapes.
  const troll::sparse_batch_view<const double> row{fake_index, fake_double, fake_index, fake_double, 3, 4, 10};
  const troll::aligned_batch_view<const double> aligned{fake_index,  fake_index,  fake_double, fake_double, fake_double,
                                                        fake_double, 3,           8,           10};
  const troll::aligned_batch_view<const double> other_vocab{fake_index,  fake_index,  fake_double, fake_double,
                                                            fake_double, fake_double, 3,           8,
                                                            11};
  const troll::sparse_grad_view<const double> grad_aligned{fake_double, fake_double, 3, 8};
  const troll::sparse_grad_view<double> grad_row{fake_double, fake_double, 3, 4};
  const troll::sparse_grad_view<double> small_grad_row{fake_double, fake_double, 3, 3};
  CHECK_THROWS_AS(troll::align_backward(troll::cuda, row, other_vocab, grad_aligned, grad_row), troll::shape_error);
  CHECK_THROWS_AS(troll::align_backward(troll::cuda, row, aligned, grad_aligned, small_grad_row), troll::shape_error);
  CHECK_THROWS_AS(troll::align_backward(troll::cuda, row, aligned,
                                        troll::sparse_grad_view<const double>{fake_double, fake_double, 2, 8}, grad_row),
                  troll::shape_error);
}

TEST_CASE("cuda mass, log_probs-id and dense log_probs reports become the CPU's exceptions and messages") {
  // A sparse row of mass 1.5 (float and double tolerances), as align(cpu) words it.
  const troll::detail::cuda::sparse_thrower align_thrower{{"new", "old"}, 0};
  std::vector<troll::sparse_index> idx{0, 1}, cnt{2};
  for (const bool single : {true, false}) {
    CAPTURE(single);
    troll::cuda_row_report report;
    report.error = troll::cuda_row_error::sparse_mass, report.operand = 1;
    report.token = single ? sizeof(float) : sizeof(double);
    std::string cpu;
    if (single) {
      std::vector<float> lp{std::log(0.5f), std::log(0.25f)}, lr{std::log(0.25f)}, bad{std::log(0.5f), std::log(0.25f)},
          bad_r{std::log(0.75f)};
      std::vector<troll::sparse_index> oi(4), oc(1);
      std::vector<float> a(4), b(4), ar(1), br(1);
      // The mass as the device sums it: the remainder, then the entries, in double.
      report.value = std::exp(double(bad_r[0])) + std::exp(double(bad[0])) + std::exp(double(bad[1]));
      cpu = message_of<troll::domain_error>([&] {
        troll::align(troll::cpu, troll::sparse_batch_view<const float>{idx.data(), lp.data(), cnt.data(), lr.data(), 1, 2, 4},
                     troll::sparse_batch_view<const float>{idx.data(), bad.data(), cnt.data(), bad_r.data(), 1, 2, 4},
                     troll::aligned_batch_view<float>{oi.data(), oc.data(), a.data(), b.data(), ar.data(), br.data(), 1, 4, 4});
      });
    } else {
      std::vector<double> lp{std::log(0.5), std::log(0.25)}, lr{std::log(0.25)}, bad{std::log(0.5), std::log(0.25)},
          bad_r{std::log(0.75)};
      std::vector<troll::sparse_index> oi(4), oc(1);
      std::vector<double> a(4), b(4), ar(1), br(1);
      report.value = std::exp(bad_r[0]) + std::exp(bad[0]) + std::exp(bad[1]);
      cpu = message_of<troll::domain_error>([&] {
        troll::align(troll::cpu, troll::sparse_batch_view<const double>{idx.data(), lp.data(), cnt.data(), lr.data(), 1, 2, 4},
                     troll::sparse_batch_view<const double>{idx.data(), bad.data(), cnt.data(), bad_r.data(), 1, 2, 4},
                     troll::aligned_batch_view<double>{oi.data(), oc.data(), a.data(), b.data(), ar.data(), br.data(), 1, 4, 4});
      });
    }
    REQUIRE(cpu.find("the probabilities sum to 1.") != std::string::npos);
    CHECK(cpu == message_of<troll::domain_error>([&] { align_thrower("align", 0, report, nullptr); }));
  }
  // project_backward(aligned): log_probs entry 1 holds token 9 where the aligned rows hold 4.
  const troll::detail::cuda::sparse_thrower backward_thrower{
      {"new", "old", "new (lumped)", "old (lumped)", "log_probs", "grad"}, 0};
  troll::cuda_row_report wrong;
  wrong.error = troll::cuda_row_error::sparse_wrong_token, wrong.token = 1, wrong.value = 9, wrong.operand = 4;
  CHECK_THROWS_WITH_AS(backward_thrower("project_backward", 2, wrong, nullptr),
                       "troll::project_backward: row 2: log_probs: entry 1 holds token 9 where the aligned rows hold "
                       "token 4 (log_probs must be project()'s output for these rows)",
                       troll::shape_error);
  // Dense derivatives: +inf / NaN in log_probs, as validate_backward words it.
  const char* const names[3] = {"new_logits", "old_logits", "grad_log_probs"};
  troll::cuda_row_report dense;
  dense.error = troll::cuda_row_error::bad_log_probs, dense.token = 5;
  dense.value = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(troll::detail::cuda::throw_report("project_backward", 3, dense, names),
                       "troll::project_backward: row 3: log_probs is +inf at token 5 (only -inf, a masked token, is "
                       "allowed)",
                       troll::domain_error);
  dense.value = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(troll::detail::cuda::throw_report("project_jvp", 0, dense, names),
                       "troll::project_jvp: row 0: log_probs is NaN at token 5", troll::domain_error);
  // −inf at a token both logits keep: a log-probability below the type's range (log_prob_underflow).
  dense.value = -std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(troll::detail::cuda::throw_report("project_jacobian", 1, dense, names),
                       doctest::Contains("troll::project_jacobian: row 1: log_probs is -inf at token 5, whose new and "
                                         "old logits are finite"),
                       troll::domain_error);
}

TEST_CASE("cuda shard-state and align_backward reports become the CPU's exceptions and messages") {
  const troll::sparsify_options options{4, 1e-5};
  std::vector<float> z(2 * 10);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = float(i % 10) * 0.5f;
  std::vector<troll::sparsify_state> a(2), b(2);
  troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(z.data(), 2, 5, 10), 0, 10, nullptr, options,
                        a.data());
  troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(z.data() + 5, 2, 5, 10), 5, 10, nullptr,
                        troll::sparsify_options{5, 1e-5}, b.data());
  troll::cuda_row_report report;

  // merge: different k
  const troll::detail::cuda::sparse_thrower merge_thrower{{"into", "from"}, 0};
  const std::string cpu_merge =
      message_of<troll::invalid_input>([&] { troll::sparsify_merge(troll::cpu, a.data(), b.data(), 2); });
  REQUIRE(!cpu_merge.empty());
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = 32 + int(troll::detail::state_problem_kind::k_mismatch), report.value = 5;
  CHECK(message_of<troll::invalid_input>([&] { merge_thrower("sparsify_merge", 0, report, nullptr); }) == cpu_merge);
  // The same shard merged twice: both states cover token 0.
  const std::string cpu_twice =
      message_of<troll::invalid_input>([&] { troll::sparsify_merge(troll::cpu, a.data(), a.data(), 2); });
  REQUIRE(cpu_twice.find("both states cover token 0") != std::string::npos);
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = 32 + int(troll::detail::state_problem_kind::overlap), report.value = 0;
  CHECK(message_of<troll::invalid_input>([&] { merge_thrower("sparsify_merge", 0, report, nullptr); }) == cpu_twice);

  // finalize: k, capacity, sampled token missing, no support
  const troll::detail::cuda::sparse_thrower finalize_thrower{{"states"}, 0};
  std::vector<troll::sparse_index> indices(2 * 8), counts(2);
  std::vector<float> log_probs(2 * 8), remainder(2);
  const troll::sparse_batch_view<float> out{indices.data(), log_probs.data(), counts.data(), remainder.data(), 2, 8, 10};
  const auto cpu_finalize = [&](std::vector<troll::sparsify_state> states, const troll::sparse_batch_view<float>& o) {
    return [states, o, options]() mutable { troll::sparsify_finalize(troll::cpu, states.data(), options, o); };
  };
  std::vector<troll::sparsify_state> wrong_k = b;
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = int(troll::detail::state_problem_kind::k_mismatch), report.value = 5;
  CHECK(message_of<troll::invalid_input>(cpu_finalize(wrong_k, out)) ==
        message_of<troll::invalid_input>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));
  // A state of half the row; a state with a NaN heap logit.
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = int(troll::detail::state_problem_kind::incomplete), report.token = 5, report.value = 5;
  const std::string cpu_half = message_of<troll::invalid_input>(cpu_finalize(a, out));
  REQUIRE(cpu_half.find("token 5 is missing") != std::string::npos);
  CHECK(cpu_half == message_of<troll::invalid_input>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));
  std::vector<troll::sparsify_state> whole(2);
  troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(z.data(), 2, 10, 10), 0, 10, nullptr, options,
                        whole.data());
  std::vector<troll::sparsify_state> nan_heap = whole;
  nan_heap[0].heap[1].logit = std::numeric_limits<double>::quiet_NaN();
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = int(troll::detail::state_problem_kind::heap_logit), report.token = 1;
  report.value = std::numeric_limits<double>::quiet_NaN();
  const std::string cpu_nan_heap = message_of<troll::domain_error>(cpu_finalize(nan_heap, out));
  REQUIRE(!cpu_nan_heap.empty());
  CHECK(cpu_nan_heap ==
        message_of<troll::domain_error>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));

  const troll::sparse_batch_view<float> small{indices.data(), log_probs.data(), counts.data(), remainder.data(), 2, 3, 10};
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_capacity, report.token = 3, report.value = 4;
  const std::string cpu_capacity = message_of<troll::shape_error>(cpu_finalize(whole, small));
  REQUIRE(!cpu_capacity.empty());
  CHECK(cpu_capacity ==
        message_of<troll::shape_error>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));

  // A whole-row state that covers the sampled token but does not hold it (corrupted).
  std::vector<troll::sparsify_state> missing(2);
  const troll::token_id sampled[2] = {7, 7};
  troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(z.data(), 2, 10, 10), 0, 10, sampled, options,
                        missing.data());
  missing[0].has_sampled = false;
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::state_invalid;
  report.operand = int(troll::detail::state_problem_kind::sampled_unseen), report.value = 7;
  const std::string cpu_missing = message_of<troll::domain_error>(cpu_finalize(missing, out));
  REQUIRE(!cpu_missing.empty());
  CHECK(cpu_missing == message_of<troll::domain_error>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));

  std::vector<float> masked(2 * 10, -std::numeric_limits<float>::infinity());
  std::vector<troll::sparsify_state> empty(2);
  troll::sparsify_shard(troll::cpu, troll::make_batch<const float>(masked.data(), 2, 10), 0, 10, nullptr, options,
                        empty.data());
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::no_support;
  const std::string cpu_empty = message_of<troll::domain_error>(cpu_finalize(empty, out));
  REQUIRE(!cpu_empty.empty());
  CHECK(cpu_empty == message_of<troll::domain_error>([&] { finalize_thrower("sparsify_finalize", 0, report, nullptr); }));

  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::bad_state, report.operand = 1, report.value = 0, report.token = 0;
  CHECK_THROWS_WITH_AS(merge_thrower("sparsify_merge", 1, report, nullptr),
                       doctest::Contains("from: the state has k = 0 and size = 0"), troll::invalid_input);

  // align_backward: an entry of row missing from the aligned support; a NaN gradient
  const troll::detail::cuda::sparse_thrower align_thrower{
      {"row", "aligned", nullptr, nullptr, nullptr, "grad_aligned", nullptr, nullptr}, 0};
  std::vector<troll::sparse_index> ri{3, 4}, rc{2}, ai{3, 5, -1}, ac{2};
  // Normalised rows (mass 0.3 + 0.2 + 0.5).
  std::vector<double> rl{std::log(0.3), std::log(0.2)}, rr{std::log(0.5)}, al{std::log(0.3), std::log(0.2), -inf},
      ar{std::log(0.5)}, arr{std::log(0.5)};
  std::vector<double> g{1.0, 2.0, 0.0}, gr{0.5}, out_g(2), out_r(1);
  const troll::sparse_batch_view<const double> row{ri.data(), rl.data(), rc.data(), rr.data(), 1, 2, 10};
  const troll::aligned_batch_view<const double> aligned{ai.data(), ac.data(), al.data(), al.data(), ar.data(),
                                                        arr.data(), 1, 3, 10};
  const troll::sparse_grad_view<const double> grad{g.data(), gr.data(), 1, 3};
  const troll::sparse_grad_view<double> grad_row{out_g.data(), out_r.data(), 1, 2};
  const std::string cpu_not_aligned =
      message_of<troll::shape_error>([&] { troll::align_backward(troll::cpu, row, aligned, grad, grad_row); });
  REQUIRE(!cpu_not_aligned.empty());
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::sparse_not_aligned, report.operand = 0, report.token = 1, report.value = 4;
  CHECK(cpu_not_aligned ==
        message_of<troll::shape_error>([&] { align_thrower("align_backward", 0, report, nullptr); }));
  ai[1] = 4;
  gr[0] = std::numeric_limits<double>::quiet_NaN();
  const std::string cpu_nan =
      message_of<troll::domain_error>([&] { troll::align_backward(troll::cpu, row, aligned, grad, grad_row); });
  REQUIRE(!cpu_nan.empty());
  report = troll::cuda_row_report{};
  report.error = troll::cuda_row_error::sparse_nan, report.operand = 5, report.token = ~0ull;
  CHECK(cpu_nan == message_of<troll::domain_error>([&] { align_thrower("align_backward", 0, report, nullptr); }));
}

TEST_SUITE("device") {
  TEST_CASE("cuda sparsify from double logits matches the CPU's double sparsify") {
    check_double_sparsify(10, 7, 4, 1e-3, true, 1);
    check_double_sparsify(10, 1000, 1, 1e-5, true, 2);
    check_double_sparsify(10, 1000, 64, 1e-5, false, 3);
    check_double_sparsify(10, 5000, 256, 0.0, true, 4);
    check_double_sparsify(10, 5000, 256, 1e-12, false, 5);
    check_double_sparsify(5, 151936, 64, 1e-5, true, 6);
    check_double_sparsify(5, 151936, 256, 1e-5, true, 7);
    check_double_sparsify(3, 151936, 1, 0.0, false, 8);
  }

  TEST_CASE("cuda vocabulary shards (GPU, and GPU mixed with CPU) equal the whole-row sparsify") {
    check_shards(10, 9, 4, true, 11);
    check_shards(10, 3000, 64, true, 12);
    check_shards(10, 3000, 256, false, 13);
    check_shards(5, 151936, 64, true, 14);
    check_float_shards(8, 5000, 64, 15);
    check_bf16_shards(6, 50000, 64, 16);
  }

  TEST_CASE("cuda align_backward matches the CPU for both sides") {
    test_stream s;
    align_fixture f;
    const std::size_t rows = f.rows, u_max = f.u_max, k_max = f.k_max;
    const aligned_device d_aligned(f.aligned);
    device_array<double> d_g(f.g), d_gr(f.g_r);
    for (sparse_pair<double>* side : {&f.fresh, &f.old}) {
      // The same upstream gradient routed to either input row (the support U is shared).
      std::vector<double> want(rows * k_max), want_r(rows);
      troll::align_backward(troll::cpu, side->host(), f.aligned.host(),
                            troll::sparse_grad_view<const double>{f.g.data(), f.g_r.data(), rows, u_max},
                            troll::sparse_grad_view<double>{want.data(), want_r.data(), rows, k_max});
      device_array<double> got(rows * k_max), got_r(rows);
      device_array<troll::cuda_row_report> reports(rows);
      troll::align_backward(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get()}), side->device(), d_aligned.view(),
                            troll::sparse_grad_view<const double>{d_g.get(), d_gr.get(), rows, u_max},
                            troll::sparse_grad_view<double>{got.get(), got_r.get(), rows, k_max});
      s.sync();
      for (const auto& rep : reports.download()) CHECK(rep.error == troll::cuda_row_error::none);
      CHECK(got.download() == want);  // copies of upstream entries and exact zeros
      const auto r_values = got_r.download();
      for (std::size_t r = 0; r < rows; ++r) CHECK(close(r_values[r], want_r[r], 1e-13, 1e-13));
    }
  }

  TEST_CASE("cuda align_backward and the shard functions report bad rows; checked mode throws the CPU's error") {
    test_stream s;
    align_fixture f;
    const std::size_t rows = f.rows, u_max = f.u_max, k_max = f.k_max;
    // Row 3: an entry of the new row replaced by a token outside the aligned support. Row 7: a
    // NaN upstream gradient on the bucket.
    std::vector<troll::sparse_index> used(f.aligned.indices.begin() + 3 * u_max,
                                          f.aligned.indices.begin() + 3 * u_max + f.aligned.counts[3]);
    troll::sparse_index stranger = 0;
    while (std::find(used.begin(), used.end(), stranger) != used.end()) ++stranger;
    f.fresh.indices[3 * k_max + 1] = stranger;
    f.fresh.upload();
    f.g_r[7] = std::numeric_limits<double>::quiet_NaN();
    const aligned_device d_aligned(f.aligned);
    device_array<double> d_g(f.g), d_gr(f.g_r), got(rows * k_max), got_r(rows);
    device_array<troll::cuda_row_report> reports(rows);
    device_array<unsigned long long> first_bad(1);
    const troll::sparse_grad_view<const double> grad{d_g.get(), d_gr.get(), rows, u_max};
    const troll::sparse_grad_view<double> grad_row{got.get(), got_r.get(), rows, k_max};
    troll::align_backward(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{reports.get(), first_bad.get()}), f.fresh.device(), d_aligned.view(), grad, grad_row);
    const auto rep = reports.download();
    CHECK(rep[3].error == troll::cuda_row_error::sparse_not_aligned);
    CHECK(rep[3].token == 1);
    CHECK(rep[7].error == troll::cuda_row_error::sparse_nan);
    CHECK(rep[0].error == troll::cuda_row_error::none);
    CHECK(first_bad.download()[0] == 3);
    CHECK(std::isnan(got_r.download()[3]));
    std::vector<double> h_out(rows * k_max), h_out_r(rows);
    const std::string cpu_message = message_of<troll::shape_error>([&] {
      troll::align_backward(troll::cpu, f.fresh.host(), f.aligned.host(),
                            troll::sparse_grad_view<const double>{f.g.data(), f.g_r.data(), rows, u_max},
                            troll::sparse_grad_view<double>{h_out.data(), h_out_r.data(), rows, k_max});
    });
    REQUIRE(!cpu_message.empty());
    CHECK_THROWS_WITH_AS(troll::align_backward(troll::cuda.on(s.stream).checked(), f.fresh.device(), d_aligned.view(), grad,
                                               grad_row),
                         cpu_message.c_str(), troll::shape_error);

    // Shards: a NaN logit (row 1) and a masked shard row (row 2, fine); a k mismatch at merge.
    const std::size_t vocab = 300, n = 4;
    std::vector<double> z(n * vocab, -1.0);
    z[1 * vocab + 17] = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t i = 0; i < vocab; ++i) z[2 * vocab + i] = -inf;
    device_array<double> d_z(z);
    const troll::sparsify_options options{8, 1e-5};
    device_array<troll::sparsify_state> states(n), other(n);
    device_array<troll::cuda_row_report> shard_reports(n);
    const auto shard = troll::make_batch<const double>(d_z.get(), n, 100, vocab);
    troll::sparsify_shard(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{shard_reports.get()}), shard, 0, vocab, nullptr, options, states.get());
    const auto shard_rep = shard_reports.download();
    CHECK(shard_rep[1].error == troll::cuda_row_error::nan_value);
    CHECK(shard_rep[1].token == 17);
    CHECK(shard_rep[2].error == troll::cuda_row_error::none);
    CHECK(states.download()[1].k == 0);  // rejected: an invalid state
    std::vector<troll::sparsify_state> host_states(n);
    const std::string cpu_shard = message_of<troll::domain_error>([&] {
      troll::sparsify_shard(troll::cpu, troll::make_batch<const double>(z.data(), n, 100, vocab), 0, vocab, nullptr,
                            options, host_states.data());
    });
    REQUIRE(!cpu_shard.empty());
    CHECK_THROWS_WITH_AS(troll::sparsify_shard(troll::cuda.on(s.stream).checked(), shard, 0, vocab, nullptr, options,
                                               states.get()),
                         cpu_shard.c_str(), troll::domain_error);

    // Merge with states of another k: state_mismatch, the CPU's invalid_input in checked mode.
    const auto tail = troll::make_batch<const double>(d_z.get() + 100, n, 200, vocab);
    troll::sparsify_shard(troll::cuda.on(s.stream), tail, 100, vocab, nullptr, troll::sparsify_options{9, 1e-5},
                          other.get());
    device_array<troll::cuda_row_report> merge_reports(n);
    troll::sparsify_merge(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{merge_reports.get()}), states.get(), other.get(), n);
    const auto merge_rep = merge_reports.download();
    // Row 0: k 8 vs 9; row 1: the rejected NaN row's invalid state (k = 0), found first, as on the CPU.
    CHECK(merge_rep[0].error == troll::cuda_row_error::state_invalid);
    CHECK(merge_rep[0].operand == 32 + int(troll::detail::state_problem_kind::k_mismatch));
    CHECK(merge_rep[1].error == troll::cuda_row_error::state_invalid);
    CHECK(merge_rep[1].operand == int(troll::detail::state_problem_kind::bad_k));
    std::vector<troll::sparsify_state> host_other = other.download();
    std::vector<troll::sparsify_state> host_into = states.download();
    const std::string cpu_merge = message_of<troll::invalid_input>(
        [&] { troll::sparsify_merge(troll::cpu, host_into.data(), host_other.data(), n); });
    REQUIRE(!cpu_merge.empty());
    CHECK_THROWS_WITH_AS(
        troll::sparsify_merge(troll::cuda.on(s.stream).checked(), states.get(), other.get(), n),
        cpu_merge.c_str(), troll::invalid_input);

    // Finalize of one shard of the row (a shard never merged): invalid_input, count 0 and NaN.
    const std::vector<troll::token_id> sampled(n, 250);
    device_array<troll::token_id> d_sampled(sampled);
    troll::sparsify_shard(troll::cuda.on(s.stream), troll::make_batch<const double>(d_z.get(), n, 100, vocab), 0, vocab,
                          d_sampled.get(), options, states.get());
    sparse_pair<double> out(n, 9, vocab);
    device_array<troll::cuda_row_report> final_reports(n);
    troll::sparsify_finalize(troll::cuda.on(s.stream).with_checks(troll::cuda_checks{final_reports.get()}), states.get(), options, out.device());
    const auto final_rep = final_reports.download();
    CHECK(final_rep[0].error == troll::cuda_row_error::state_invalid);
    CHECK(final_rep[0].operand == int(troll::detail::state_problem_kind::incomplete));
    CHECK(final_rep[0].value == 100.0);  // the first token no shard covered
    CHECK(final_rep[1].error == troll::cuda_row_error::state_invalid);  // the rejected NaN row's invalid state
    CHECK(final_rep[1].operand == int(troll::detail::state_problem_kind::bad_k));
    out.download();
    CHECK(out.counts[0] == 0);
    CHECK(std::isnan(out.log_remainder[0]));
    const std::vector<troll::sparsify_state> sampled_states = states.download();
    sparse_pair<double> host_out(n, 9, vocab);
    const std::string cpu_final = message_of<troll::invalid_input>(
        [&] { troll::sparsify_finalize(troll::cpu, sampled_states.data(), options, host_out.host()); });
    REQUIRE(cpu_final.find("token 100 is missing") != std::string::npos);  // row 0: shards missing
    CHECK_THROWS_WITH_AS(troll::sparsify_finalize(troll::cuda.on(s.stream).checked(), states.get(), options, out.device()),
                         cpu_final.c_str(), troll::invalid_input);
  }

  TEST_CASE("cuda sparsify_tail_sums: a tail logit above tail_max gives NaN sums, or the CPU's error when checked") {
    test_stream s;
    const std::size_t rows = 3, offset = 4, shard = 5;  // tokens 4 .. 8 of a 9-token row
    std::vector<double> z(rows * shard);
    for (std::size_t i = 0; i < z.size(); ++i) z[i] = 0.25 * double(i % 7) - 1.0;
    std::vector<troll::sparse_index> ids(rows, 6), counts(rows, 1);  // shard token 2 in every row
    std::vector<double> lp(rows, -0.5), rem(rows, -1.0), tail_max(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      double m = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < shard; ++j)
        if (j != 2) m = std::max(m, z[r * shard + j]);
      tail_max[r] = m;
    }
    z[1 * shard + 2] = tail_max[1] + 5.0;  // the support's own token may lie above tail_max
    z[2 * shard + 4] = tail_max[2] + 1.0;  // row 2, shard token 4: refused
    const troll::sparse_batch_view<const double> host_support{ids.data(), lp.data(), counts.data(), rem.data(),
                                                              rows, 1, offset + shard};
    std::vector<double> host_sums(2 * rows);
    const std::string cpu_error = message_of<troll::invalid_input>([&] {
      troll::sparsify_tail_sums(troll::cpu, troll::make_batch<const double>(z.data(), rows, shard), offset, host_support,
                                tail_max.data(), host_sums.data());
    });
    REQUIRE(cpu_error.find("row 2: shard token 4") != std::string::npos);
    device_array<double> d_z(z), d_lp(lp), d_rem(rem), d_tail_max(tail_max), d_sums(2 * rows);
    device_array<troll::sparse_index> d_ids(ids), d_counts(counts);
    const troll::sparse_batch_view<const double> support{d_ids.get(), d_lp.get(), d_counts.get(), d_rem.get(),
                                                         rows, 1, offset + shard};
    const auto d_shard = troll::make_batch<const double>(d_z.get(), rows, shard);
    troll::sparsify_tail_sums(troll::cuda.on(s.stream), d_shard, offset, support, d_tail_max.get(), d_sums.get());
    s.sync();
    const std::vector<double> sums = d_sums.download();
    CHECK(std::isfinite(sums[0]));
    CHECK(std::isfinite(sums[2]));
    CHECK(std::isnan(sums[4]));
    CHECK(std::isnan(sums[5]));
    CHECK_THROWS_WITH_AS(troll::sparsify_tail_sums(troll::cuda.on(s.stream).checked(), d_shard, offset, support,
                                                   d_tail_max.get(), d_sums.get()),
                         cpu_error.c_str(), troll::domain_error);
  }

  TEST_CASE("cuda sparsify_backward and sparsify_shard_backward near the largest double match the CPU (g_R / r overflows alone)") {
    // V = 4 equal logits, support {0}: p = 1/4, r = 3/4, g = 0, g_R = 1.5e308. The entries
    // (1.25e307 on the tail, -3.75e307 on the support) fit, although g_R / r does not.
    test_stream s;
    const double big = 1.5e308;
    std::vector<double> z(4, 0.0), want(4);
    std::vector<troll::sparse_index> ids{0}, counts{1};
    std::vector<double> lp{std::log(0.25)}, rem{std::log(0.75)}, g{0.0}, g_r{big};
    const double log_sums[4] = {0.0, std::log(4.0), 0.0, std::log(3.0)};
    troll::sparsify_backward(troll::cpu, troll::make_batch<const double>(z.data(), 1, 4),
                             troll::sparse_batch_view<const double>{ids.data(), lp.data(), counts.data(), rem.data(),
                                                                    1, 1, 4},
                             troll::sparse_grad_view<const double>{g.data(), g_r.data(), 1, 1},
                             troll::make_batch(want.data(), 1, 4));
    for (double w : want) REQUIRE(std::isfinite(w));
    device_array<double> d_z(z), d_lp(lp), d_rem(rem), d_g(g), d_gr(g_r),
        d_sums(std::vector<double>(log_sums, log_sums + 4)), d_out(4), d_shard_out(4);
    device_array<troll::sparse_index> d_ids(ids), d_counts(counts);
    const troll::sparse_batch_view<const double> support{d_ids.get(), d_lp.get(), d_counts.get(), d_rem.get(), 1, 1, 4};
    const troll::sparse_grad_view<const double> grad{d_g.get(), d_gr.get(), 1, 1};
    const auto d_logits = troll::make_batch<const double>(d_z.get(), 1, 4);
    troll::sparsify_backward(troll::cuda.on(s.stream).checked(), d_logits, support, grad,
                             troll::make_batch(d_out.get(), 1, 4));
    troll::sparsify_shard_backward(troll::cuda.on(s.stream).checked(), d_logits, 0, support, grad, d_sums.get(),
                                   troll::make_batch(d_shard_out.get(), 1, 4));
    s.sync();
    const std::vector<double> got = d_out.download(), got_shard = d_shard_out.download();
    for (std::size_t k = 0; k < 4; ++k) {
      CHECK(got[k] == doctest::Approx(want[k]).epsilon(1e-14));
      CHECK(got_shard[k] == doctest::Approx(want[k]).epsilon(1e-14));
    }
  }
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
