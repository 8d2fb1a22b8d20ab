// tests/cuda/test_cuda_one_api.cu — the one-API consumer (tests/consumer/every_entry_point.hpp)
// instantiated for troll::cuda: compiling this file is the check that every entry point takes the
// same arguments under both policies. With a GPU, the device run is compared with the CPU's.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "troll/cuda.cuh"  // first: the template's qualified calls see the overloads declared before it
#include "../consumer/every_entry_point.hpp"

namespace consumer {

/// Device arrays for the CUDA policy: cudaMalloc'd, filled from the host, read back synchronously.
template <>
struct space<troll::cuda_policy> {
  template <class E>
  class array {
   public:
    explicit array(std::size_t n) : memory_(n == 0 ? 1 : n) {}
    explicit array(const std::vector<E>& host) : memory_(host.size() == 0 ? 1 : host.size()) {
      memory_.upload(host);
    }
    E* get() { return memory_.get(); }
    std::size_t bytes() const { return memory_.bytes(); }
    std::vector<E> download() const { return memory_.download(); }

   private:
    troll_test::device_array<E> memory_;
  };
  static void sync(const troll::cuda_policy& p) { CUDA_REQUIRE(cudaStreamSynchronize(p.stream)); }
};

}  // namespace consumer

/// The instantiations are the compile check (double and float); a no-device build still names them.
template consumer::step_results consumer::run_every_entry_point<troll::cuda_policy>(troll::cuda_policy);
template consumer::step_results consumer::run_every_entry_point<troll::cuda_policy, float>(troll::cuda_policy);

namespace {

/// Entry by entry: equal infinities, else within atol + rtol |b|.
void close_within(const std::vector<double>& a, const std::vector<double>& b, double atol, double rtol) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      CHECK(a[i] == b[i]);
      continue;
    }
    CHECK(std::abs(a[i] - b[i]) <= atol + rtol * std::abs(b[i]));
  }
}

/// The device step against the CPU's, every result entry by entry within atol + rtol |cpu|.
void compare_steps(const consumer::step_results& gpu, const consumer::step_results& cpu, double atol, double rtol) {
  auto close = [&](const std::vector<double>& a, const std::vector<double>& b) { close_within(a, b, atol, rtol); };
  close(gpu.log_softmax, cpu.log_softmax);
  close(gpu.kl, cpu.kl);
  close(gpu.project, cpu.project);
  close(gpu.grad_new, cpu.grad_new);
  close(gpu.jacobian, cpu.jacobian);
  close(gpu.sparse_kl, cpu.sparse_kl);
  close(gpu.sparse_log_probs, cpu.sparse_log_probs);
  close(gpu.sparse_grad, cpu.sparse_grad);
  close(gpu.sparse_shard_grad, cpu.sparse_shard_grad);
  CHECK(gpu.sparse_counts == cpu.sparse_counts);
  CHECK(gpu.shard_rows == gpu.whole_rows);  // two shards, two-stage finalize: bit for bit the whole row's
  close(gpu.gaussian_mean, cpu.gaussian_mean);
  close(gpu.gaussian_chol, cpu.gaussian_chol);
  close(gpu.gaussian_split_mean, cpu.gaussian_split_mean);
  close(gpu.gaussian_split_chol, cpu.gaussian_split_chol);
  close(gpu.gaussian_diag_mean, cpu.gaussian_diag_mean);
  close(gpu.gaussian_diag_std, cpu.gaussian_diag_std);
  close(gpu.gaussian_split_diag_mean, cpu.gaussian_split_diag_mean);
  close(gpu.gaussian_split_diag_std, cpu.gaussian_split_diag_std);
  close(gpu.gaussian_kl, cpu.gaussian_kl);
  close(gpu.gaussian_kl_diag, cpu.gaussian_kl_diag);
  close(gpu.gaussian_kl_mutable_views, cpu.gaussian_kl_mutable_views);
  close(gpu.gaussian_diag_grad_mean, cpu.gaussian_diag_grad_mean);
  close(gpu.gaussian_diag_grad_eps, cpu.gaussian_diag_grad_eps);
  close(gpu.gaussian_split_diag_jvp_std, cpu.gaussian_split_diag_jvp_std);
  close(gpu.gaussian_full_derivatives, cpu.gaussian_full_derivatives);
  CHECK(std::abs(gpu.troll_loss - cpu.troll_loss) <= atol + rtol * std::abs(cpu.troll_loss));
  CHECK(std::abs(gpu.sparse_troll_loss - cpu.sparse_troll_loss) <= atol + rtol * std::abs(cpu.sparse_troll_loss));
}

}  // namespace

TEST_SUITE("device") {
  TEST_CASE("every entry point runs under troll::cuda from the CPU's function template") {
    troll_test::test_stream s;
    const consumer::step_results gpu = consumer::run_every_entry_point(troll::cuda.on(s.stream).checked());
    const consumer::step_results cpu = consumer::run_every_entry_point(troll::cpu);
    compare_steps(gpu, cpu, 1e-8, 1e-8);
  }

  TEST_CASE("every entry point runs in float under troll::cuda, close to the CPU's float step") {
    troll_test::test_stream s;
    const consumer::step_results gpu =
        consumer::run_every_entry_point<troll::cuda_policy, float>(troll::cuda.on(s.stream).checked());
    const consumer::step_results cpu = consumer::run_every_entry_point<troll::cpu_policy, float>(troll::cpu);
    compare_steps(gpu, cpu, 1e-5, 1e-4);  // every result, at float tolerances
  }
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
