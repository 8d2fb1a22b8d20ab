// troll/detail/cuda/error_check.cuh — CUDA runtime errors become troll::backend_error carrying the
// runtime's own text, and the one launch shape every troll kernel uses (one block per row).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../../config.hpp"
#include "../../errors.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Threads per block. Every kernel gives one row to one block and walks the row with a
/// block-stride loop, so any V works; 256 keeps eight warps per row busy at V ≈ 10^5.
constexpr int block_threads = 256;
/// Blocks per multiprocessor the solver kernels (dense and sparse projection, their backward, the
/// TROLL objective) are compiled for: __launch_bounds__(block_threads, 2) caps them at 128
/// registers. Uncapped, the solver's state took 164–198 registers, one block per SM (12.5%
/// occupancy), and Nsight Compute on an H200 showed those kernels latency bound (issue slots
/// 16–27% busy, DRAM 3–12%).
constexpr int solver_blocks_per_sm = 2;

/// Largest grid: rows beyond it are taken by a grid-stride loop over rows.
constexpr std::size_t max_grid_rows = 1u << 20;

/// Throws backend_error("troll::<function>: <what> failed: <cudaGetErrorString>") unless ok.
inline void check(cudaError_t status, const char* function, const char* what) {
  if (status == cudaSuccess) return;
  throw backend_error(std::string("troll::") + function + ": " + what + " failed: " +
                      cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

/// Blocks to launch for `rows` rows.
inline unsigned grid_for(std::size_t rows) {
  return static_cast<unsigned>(rows < max_grid_rows ? rows : max_grid_rows);
}

/// Checks a kernel launch without synchronising (configuration errors only; faults inside the
/// kernel surface at the caller's next synchronisation).
inline void check_launch(const char* function) { check(cudaGetLastError(), function, "kernel launch"); }

/// Stream-ordered device memory owned for the length of one checked-mode call (cudaMallocAsync,
/// released with cudaFreeAsync on the same stream, also when the call throws). Only checked mode
/// allocates: the hot path runs in the caller's workspace.
class stream_allocation {
 public:
  stream_allocation(const char* function, std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    check(cudaMallocAsync(&memory_, bytes == 0 ? 1 : bytes, stream), function, "cudaMallocAsync (checked mode)");
  }
  stream_allocation(const stream_allocation&) = delete;
  stream_allocation& operator=(const stream_allocation&) = delete;
  ~stream_allocation() {
    if (memory_ != nullptr) static_cast<void>(cudaFreeAsync(memory_, stream_));
  }
  void* get() const { return memory_; }

 private:
  void* memory_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
