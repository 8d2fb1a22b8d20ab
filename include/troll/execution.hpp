// troll/execution.hpp — execution policy tags. Entry points take the policy first:
//   troll::project(troll::cpu, ...);  troll::project(troll::cuda.on(stream), ...);
#pragma once

#include <cstddef>

#include "config.hpp"

// Forward declaration of the CUDA runtime's stream type so this header needs no CUDA headers;
// cudaStream_t is `CUstream_st*`.
struct CUstream_st;

TROLL_BEGIN_NAMESPACE

/// CPU backend (Eigen for the per-row vector work, std::thread across rows).
/// `threads == 0` means "use std::thread::hardware_concurrency()"; 1 forces a serial run.
struct cpu_policy {
  unsigned threads = 0;
  constexpr cpu_policy with_threads(unsigned n) const { return cpu_policy{n}; }
};

/// CUDA backend: device pointers in and out, work enqueued on `stream` (nullptr = default
/// stream). Declared here so the API is stable; the kernels live in troll/cuda.cuh.
struct cuda_policy {
  CUstream_st* stream = nullptr;
  constexpr cuda_policy on(CUstream_st* s) const { return cuda_policy{s}; }
};

inline constexpr cpu_policy cpu{};
inline constexpr cuda_policy cuda{};

template <class P>
struct is_execution_policy {
  static constexpr bool value = false;
};
template <>
struct is_execution_policy<cpu_policy> {
  static constexpr bool value = true;
};
template <>
struct is_execution_policy<cuda_policy> {
  static constexpr bool value = true;
};

TROLL_END_NAMESPACE
