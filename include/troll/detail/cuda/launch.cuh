// troll/detail/cuda/launch.cuh — how every CUDA entry point launches its kernels: over all rows
// with the policy's cuda_checks, and in checked mode one validation pass first (one launch per
// stage of the CPU's checks, one synchronisation) that throws the CPU's exception for the lowest
// bad row.
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

/// After stage `stage_key`'s validation launch: when the lowest key so far belongs to that stage,
/// copies its row's report to `out` (one thread; stream-ordered after the launch).
template <int = 0>
__global__ void select_report_kernel(const unsigned long long* first_bad, unsigned long long stage_key,
                                     const cuda_row_report* reports, cuda_row_report* out) {
  const unsigned long long key = *first_bad;
  if (key != no_bad_row && (key & ~row_of_key) == stage_key) *out = reports[key & row_of_key];
}

/// Checked mode: runs `launch_of(s)` for the stages s = 0 … stages − 1 in validate-only mode over
/// all rows, each row's report kept and the lowest bad (stage, row) found by one atomicMin of
/// stage_key_of(s) | row, so that every row's earlier checks come before any row's later ones (the
/// CPU's order). One synchronisation at the end; then throws the CPU's exception for that row
/// through `thrower` (called as throw_report is). No second validation pass.
template <class LaunchOf, class Thrower = throw_dense_report>
void validate_stages_or_throw(const char* function, cudaStream_t stream, std::size_t rows,
                              const char* const operand_names[3], int stages, const LaunchOf& launch_of,
                              const Thrower& thrower = {}) {
  struct outcome {
    unsigned long long first_bad;
    cuda_row_report report;
  };
  const stream_allocation memory(function, sizeof(outcome) + rows * sizeof(cuda_row_report), stream);
  outcome* device = static_cast<outcome*>(memory.get());
  cuda_row_report* reports = reinterpret_cast<cuda_row_report*>(device + 1);
  // The whole outcome, not only first_bad: the copy below reads the report too (used only when a
  // row is bad), and compute-sanitizer's initcheck flagged that copy of unwritten bytes.
  check(cudaMemsetAsync(device, 0xFF, sizeof(outcome), stream), function, "cudaMemsetAsync");
  for (int stage = 0; stage < stages; ++stage) {
    launch_of(stage)(row_range{0, rows}, device_checks{reports, &device->first_bad, true, stage_key_of(stage)});
    select_report_kernel<<<1, 1, 0, stream>>>(&device->first_bad, stage_key_of(stage), reports, &device->report);
    check_launch(function);
  }
  outcome host;
  check(cudaMemcpyAsync(&host, device, sizeof host, cudaMemcpyDeviceToHost, stream), function, "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), function, "cudaStreamSynchronize (checked mode)");
  if (host.first_bad == no_bad_row) return;
  thrower(function, static_cast<std::size_t>(host.first_bad & row_of_key), host.report, operand_names);
}

/// Checked mode with one validation stage.
template <class Launch, class Thrower = throw_dense_report>
void validate_or_throw(const char* function, cudaStream_t stream, std::size_t rows,
                       const char* const operand_names[3], const Launch& launch, const Thrower& thrower = {}) {
  validate_stages_or_throw(
      function, stream, rows, operand_names, 1, [&](int) -> const Launch& { return launch; }, thrower);
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
