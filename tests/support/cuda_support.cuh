// tests/support/cuda_support.cuh — what every CUDA test binary shares: CUDA_REQUIRE, device
// memory freed on scope exit, a private stream per case, and the main() that skips the "device"
// test suite cleanly when no CUDA device is present.
//
// A test file includes this first (it defines EIGEN_NO_CUDA and
// silences the warnings below before doctest and Eigen are seen) and ends with
//
//   #ifndef TROLL_TEST_GROUP
//   int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
//   #endif
//
// (tests/CMakeLists.txt compiles the CUDA test files in groups, one translation unit per group;
// the group's generated source supplies main). Cases that need a device go in
// TEST_SUITE("device"); everything else (host-side argument checks) runs with or without one.
// Without a device the binary prints "SKIPPED: no CUDA device", runs the host-only cases and
// exits with their result (77, skipped, when none was selected).
#pragma once

// doctest's implementation is compiled once, in tests/support/doctest_runner.cpp (C++, no main);
// every CUDA test binary supplies its own main() (run_cuda_tests below).
// Eigen serves the CPU reference only. Without EIGEN_NO_CUDA nvcc sees Eigen's __host__
// __device__ annotations; and the CPU backend's host instantiation of the shared solve_row (an
// Eigen evaluator) makes nvcc warn (#20011, #20014) although it only ever runs on the host.
#ifndef EIGEN_NO_CUDA
#define EIGEN_NO_CUDA
#endif
#pragma nv_diag_suppress 20011
#pragma nv_diag_suppress 20014
// GCC's -Wmaybe-uninitialized misfires on Eigen's fixed-capacity block arrays in host code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "special_values.hpp"  // nan_value, inf_value, minus_inf
#include "troll/errors.hpp"
#include "troll/execution.hpp"

#define CUDA_REQUIRE(call)                                                                       \
  do {                                                                                           \
    const cudaError_t cuda_status_ = (call);                                                     \
    REQUIRE_MESSAGE(cuda_status_ == cudaSuccess, #call, ": ", cudaGetErrorString(cuda_status_)); \
  } while (false)

namespace troll_test {

/// Largest |finite entry| of a row: the magnitude every rounding scales with.
template <class T>
double finite_scale(const T* z, std::size_t size) {
  double s = 0.0;
  for (std::size_t i = 0; i < size; ++i)
    if (std::isfinite(static_cast<double>(z[i]))) s = std::max(s, std::fabs(static_cast<double>(z[i])));
  return s;
}

/// Device memory of n elements of E (at least one element is allocated), freed on scope exit.
template <class E>
class device_array {
 public:
  /// n elements poisoned with 0xFF bytes (NaN for floating types, −1 for signed integers), so
  /// that an entry a kernel leaves unwritten shows in the values, and a whole-buffer download
  /// (row padding included) reads no uninitialised memory (compute-sanitizer initcheck).
  explicit device_array(std::size_t n) : size_(n) {
    CUDA_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<std::size_t>(n, 1) * sizeof(E)));
    CUDA_REQUIRE(cudaMemset(data_, 0xFF, std::max<std::size_t>(n, 1) * sizeof(E)));
    CUDA_REQUIRE(cudaDeviceSynchronize());
  }
  explicit device_array(const std::vector<E>& host) : device_array(host.size()) { upload(host); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { cudaFree(data_); }

  E* get() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(E); }
  /// Copy from the host, ordered after and before the work of every stream. cudaMemcpy runs on
  /// the legacy default stream, which does not order the tests' non-blocking streams, so:
  /// * before the copy, wait for the whole device: a kernel enqueued earlier (even by a checked
  ///   call, which synchronises only for its validation pass, then enqueues the work and returns)
  ///   may not yet have read the old contents. On an H100 a sparsify_merge queued on a test
  ///   stream read the *next* state uploaded into its reused `from` buffer (write-after-read);
  /// * after it, wait again: a pageable upload may return before its DMA lands.
  void upload(const std::vector<E>& host) {
    REQUIRE(host.size() <= size_);
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CUDA_REQUIRE(cudaMemcpy(data_, host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice));
    CUDA_REQUIRE(cudaDeviceSynchronize());
  }
  /// Copy to the host after every stream has finished. cudaMemcpy alone runs on the legacy
  /// default stream, which does not wait for streams created with cudaStreamNonBlocking (the
  /// tests' streams): on an H100 it read buffers before the kernels had written them.
  std::vector<E> download() const {
    std::vector<E> host(size_);
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CUDA_REQUIRE(cudaMemcpy(host.data(), data_, size_ * sizeof(E), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  E* data_ = nullptr;
  std::size_t size_;
};

/// The message of the exception of type E (by default any troll::invalid_input) a call throws,
/// or "" when it throws none: how the CUDA tests compare a device entry point's exception with
/// the CPU's, message for message.
template <class E = troll::invalid_input, class Call>
std::string message_of(Call&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

/// A non-blocking stream of its own per case, so the default stream is never relied upon.
struct test_stream {
  cudaStream_t stream = nullptr;
  test_stream() { CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  ~test_stream() { cudaStreamDestroy(stream); }
  void sync() const { CUDA_REQUIRE(cudaStreamSynchronize(stream)); }
};

/// Whether a CUDA device is usable; `why` says why not ("" when it is).
inline bool cuda_device_present(std::string* why = nullptr) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  cudaGetLastError();  // clear a "no device" error so it cannot leak into a later call
  if (why != nullptr) *why = status != cudaSuccess ? cudaGetErrorString(status) : count == 0 ? "0 devices" : "";
  return status == cudaSuccess && count > 0;
}

/// How many test cases the last doctest run executed (a listener: doctest calls it beside the
/// reporter). `ended` stays false for a query such as --count, which runs nothing.
struct run_counter : doctest::IReporter {
  struct totals {
    bool ended = false;
    unsigned ran = 0;
  };
  static totals& last() {
    static totals t;
    return t;
  }
  explicit run_counter(const doctest::ContextOptions&) {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    last().ended = true;
    last().ran = stats.numTestCasesPassingFilters;
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
DOCTEST_REGISTER_LISTENER("troll_run_counter", 0, run_counter);

/// The body of every CUDA test binary's main(): runs doctest, excluding the "device" suite (and
/// saying so) when no device is present. `file` names the binary's source in the messages.
/// Without a device, a run whose selection holds only device cases exits with 77 (ctest's
/// SKIP_RETURN_CODE: skipped, not passed).
inline int run_cuda_tests(int argc, char** argv, const char* file) {
  std::string why;
  const bool has_device = cuda_device_present(&why);
  doctest::Context context;
  if (has_device) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
      std::printf("%s: running on %s (sm_%d%d)\n", file, prop.name, prop.major, prop.minor);
  } else {
    std::printf("SKIPPED: no CUDA device (%s): the \"device\" test suite of %s is skipped; only the "
                "host-side checks run.\n",
                why.c_str(), file);
    context.addFilter("test-suite-exclude", "device");
  }
  context.applyCommandLine(argc, argv);
  const int result = context.run();
  if (!has_device) {
    std::printf("SKIPPED: no CUDA device; nothing in this binary ran on a GPU.\n");
    if (result == 0 && run_counter::last().ended && run_counter::last().ran == 0) {
      std::printf("SKIPPED: every selected test case needs a device.\n");
      return 77;
    }
  }
  return result;
}

/// The CUDA backend of the one-test-body pattern (backend.hpp): the checked policy on the default
/// stream (a bad row throws the CPU's exception) and device buffers filled from the host; download()
/// synchronises.
template <>
struct backend<troll::cuda_policy> {
  static troll::cuda_policy policy() { return troll::cuda.checked(); }
  template <class E>
  class buffer {
   public:
    explicit buffer(std::size_t n) : memory_(n) {}
    explicit buffer(const std::vector<E>& host) : memory_(host) {}
    E* get() { return memory_.get(); }
    std::vector<E> download() const { return memory_.download(); }

   private:
    device_array<E> memory_;
  };
};

}  // namespace troll_test
