// troll/detail/cuda/launch.cuh — how every CUDA entry point launches its kernels: over all rows
// with the policy's cuda_checks, and in checked mode a validation pass first that throws the CPU's
// exception for the lowest bad row.
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

/// Checked mode: runs `launch` in validate-only mode over all rows, synchronises, and throws the
/// first rejected row's exception (after re-validating that single row for its report) through
/// `thrower` (called as throw_report is).
template <class Launch, class Thrower = throw_dense_report>
void validate_or_throw(const char* function, cudaStream_t stream, std::size_t rows,
                       const char* const operand_names[3], const Launch& launch,
                       const Thrower& thrower = {}) {
  struct scratch {
    unsigned long long first_bad_row;
    cuda_row_report report;
  };
  const stream_allocation memory(function, sizeof(scratch), stream);
  scratch* device = static_cast<scratch*>(memory.get());
  check(cudaMemsetAsync(&device->first_bad_row, 0xFF, sizeof(unsigned long long), stream), function,
        "cudaMemsetAsync");
  launch(row_range{0, rows}, device_checks{nullptr, &device->first_bad_row, true});
  check_launch(function);
  unsigned long long first_bad = no_bad_row;
  check(cudaMemcpyAsync(&first_bad, &device->first_bad_row, sizeof first_bad, cudaMemcpyDeviceToHost, stream),
        function, "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), function, "cudaStreamSynchronize (checked mode)");
  if (first_bad == no_bad_row) return;

  const std::size_t row = static_cast<std::size_t>(first_bad);
  launch(row_range{row, 1}, device_checks{&device->report, nullptr, true});
  check_launch(function);
  cuda_row_report report;
  check(cudaMemcpyAsync(&report, &device->report, sizeof report, cudaMemcpyDeviceToHost, stream), function,
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), function, "cudaStreamSynchronize (checked mode)");
  thrower(function, row, report, operand_names);
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

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
