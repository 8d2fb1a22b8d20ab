// troll/detail/cuda/launch.cuh — how every CUDA entry point launches its kernels: over all rows
// with the policy's cuda_checks, and in checked mode one validation pass first (one launch, one
// synchronisation) that throws the CPU's exception for the lowest bad row.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../../config.hpp"
#include "../../cuda_report.hpp"
#include "error_check.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// The default translation of a device report into an exception (dense entry points).
struct throw_dense_report {
  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const operand_names[3]) const {
    throw_report(function, row, report, operand_names);
  }
};

/// Checked mode: runs `launch` in validate-only mode over all rows, each row's report kept and
/// the lowest bad row found by an atomicMin, one synchronisation; then throws the CPU's exception
/// for that row through `thrower` (called as throw_report is). Every kernel checks a row in the
/// CPU's order, so the same row and problem are reported. No second validation pass.
template <class Launch, class Thrower = throw_dense_report>
void validate_or_throw(const char* function, cudaStream_t stream, std::size_t rows,
                       const char* const operand_names[3], const Launch& launch, const Thrower& thrower = {}) {
  const stream_allocation memory(function, sizeof(unsigned long long) + rows * sizeof(cuda_row_report), stream);
  unsigned long long* device_first_bad = static_cast<unsigned long long*>(memory.get());
  cuda_row_report* reports = reinterpret_cast<cuda_row_report*>(device_first_bad + 1);
  check(cudaMemsetAsync(device_first_bad, 0xFF, sizeof(unsigned long long), stream), function, "cudaMemsetAsync");
  launch(row_range{0, rows}, device_checks{reports, device_first_bad, true});
  check_launch(function);
  unsigned long long first_bad = no_bad_row;
  check(cudaMemcpyAsync(&first_bad, device_first_bad, sizeof first_bad, cudaMemcpyDeviceToHost, stream), function,
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), function, "cudaStreamSynchronize (checked mode)");
  if (first_bad == no_bad_row) return;
  // Only the bad row's report comes back (written by the validation launch, so initialised).
  cuda_row_report report;
  check(cudaMemcpyAsync(&report, reports + first_bad, sizeof report, cudaMemcpyDeviceToHost, stream), function,
        "cudaMemcpyAsync (checked mode's report)");
  check(cudaStreamSynchronize(stream), function, "cudaStreamSynchronize (checked mode's report)");
  thrower(function, static_cast<std::size_t>(first_bad), report, operand_names);
}

/// Enqueues `launch(row_range, device_checks)` over all rows with the caller's checks.
template <class Launch, class Thrower = throw_dense_report>
void run(const char* function, cudaStream_t stream, std::size_t rows, const cuda_checks& checks,
         const char* const operand_names[3], const Launch& launch, const Thrower& thrower = {}) {
  if (rows == 0) return;
  if (checks.checked) validate_or_throw(function, stream, rows, operand_names, launch, thrower);
  if (checks.first_bad_row != nullptr)
    check(cudaMemsetAsync(checks.first_bad_row, 0xFF, sizeof(unsigned long long), stream), function,
          "cudaMemsetAsync (first_bad_row)");
  launch(row_range{0, rows}, device_checks{checks.reports, checks.first_bad_row, false});
  check_launch(function);
}

/// The launch that run() and validate_*_or_throw call for a one-block-per-row kernel:
/// kernel(args..., range, device) on grid_for(range.count) blocks of block_threads threads, no
/// dynamic shared memory, on `stream`. The arguments are copied into the launch.
template <class... Params, class... Args>
auto block_per_row(cudaStream_t stream, void (*kernel)(Params...), const Args&... args) {
  return [=](row_range range, device_checks device) {
    kernel<<<grid_for(range.count), block_threads, 0, stream>>>(args..., range, device);
  };
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
