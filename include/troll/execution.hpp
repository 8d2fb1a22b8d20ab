// troll/execution.hpp — execution policies. Every entry point takes the policy first and the same
// arguments under both backends; what differs between backends travels in the policy object:
//   troll::project(troll::cpu.with_threads(4), ...);
//   troll::project(troll::cuda.on(stream).checked(), ...);
// Scratch memory is the caller's, passed with its size (.with_workspace(data, bytes)); the size an
// entry point needs comes from troll::workspace_bytes (troll/workspace.hpp).
#pragma once

#include <cstddef>
#include <type_traits>

#include "config.hpp"
#include "cuda_report.hpp"

// Forward declaration of the CUDA runtime's stream type so this header needs no CUDA headers;
// cudaStream_t is `CUstream_st*`.
struct CUstream_st;

TROLL_BEGIN_NAMESPACE

/// Caller-owned scratch memory: `bytes` bytes at `data` (host memory for cpu_policy, device memory
/// for cuda_policy). troll checks the size and the 8-byte alignment before writing anything and
/// never keeps a pointer past the call; the contents need no initialisation.
struct scratch_memory {
  void* data = nullptr;
  std::size_t bytes = 0;
};

namespace detail {
/// A copy of `policy` with one member replaced (the policies' builder methods).
template <class Policy, class Member, class Value>
constexpr Policy with_member(Policy policy, Member Policy::*member, const Value& value) {
  policy.*member = value;
  return policy;
}
}  // namespace detail

/// CPU backend (Eigen for the per-row vector work, a worker pool across rows).
///
/// * `threads`: 0 means "use std::thread::hardware_concurrency()"; 1 forces a serial run.
/// * `workspace`: scratch for the entry points whose workspace_bytes is non-zero. When it is
///   empty (the default) such an entry point takes its scratch from the calling thread's
///   reusable arena (detail/workspace.hpp: allocates only when it grows); when it is given it
///   must hold workspace_bytes(...) bytes, else shape_error before anything is written.
struct cpu_policy {
  unsigned threads = 0;
  scratch_memory workspace{};

  constexpr cpu_policy with_threads(unsigned n) const { return detail::with_member(*this, &cpu_policy::threads, n); }
  constexpr cpu_policy with_workspace(void* data, std::size_t bytes) const {
    return detail::with_member(*this, &cpu_policy::workspace, scratch_memory{data, bytes});
  }
};

/// CUDA backend: device pointers in and out, work enqueued on `stream` (nullptr = default stream);
/// the kernels live in troll/cuda.cuh.
///
/// * `checks`: what happens to a rejected row (see cuda_checks): by default NaN outputs and no
///   synchronisation; `.reporting(reports, first_bad_row)` records per-row reports and the lowest
///   bad row in device memory; `.checked()` validates first and throws the CPU's exception.
/// * `workspace`: device scratch for the entry points whose workspace_bytes is non-zero (the
///   objectives, project_jacobian): required there, checked for size and alignment (shape_error).
struct cuda_policy {
  CUstream_st* stream = nullptr;
  cuda_checks checks{};
  scratch_memory workspace{};

  constexpr cuda_policy on(CUstream_st* s) const { return detail::with_member(*this, &cuda_policy::stream, s); }
  /// Validate first, synchronise, and throw the CPU backend's exception for the lowest bad row.
  constexpr cuda_policy checked(bool on = true) const {
    cuda_checks c = checks;
    c.checked = on;
    return with_checks(c);
  }
  /// Per-row reports (`reports`: rows device entries, may be null) and the lowest bad row
  /// (`first_bad_row`: one device word, may be null), stream-ordered, nothing synchronises.
  constexpr cuda_policy reporting(cuda_row_report* reports, unsigned long long* first_bad_row = nullptr) const {
    cuda_checks c = checks;
    c.reports = reports;
    c.first_bad_row = first_bad_row;
    return with_checks(c);
  }
  constexpr cuda_policy with_checks(const cuda_checks& c) const {
    return detail::with_member(*this, &cuda_policy::checks, c);
  }
  constexpr cuda_policy with_workspace(void* data, std::size_t bytes) const {
    return detail::with_member(*this, &cuda_policy::workspace, scratch_memory{data, bytes});
  }
};

inline constexpr cpu_policy cpu{};
inline constexpr cuda_policy cuda{};

/// True for troll's execution policies (cpu_policy, cuda_policy) and types derived from them, as
/// the overloads taking cpu_policy / cuda_policy accept them; is_execution_policy_v ignores
/// cv-qualifiers and references. The entry points written once for both backends
/// (gaussian_api.hpp) accept these first arguments and run under execution_policy_base_t.
template <class T>
struct is_execution_policy
    : std::bool_constant<std::is_base_of<cpu_policy, T>::value || std::is_base_of<cuda_policy, T>::value> {};
template <class T>
inline constexpr bool is_execution_policy_v = is_execution_policy<std::remove_cv_t<std::remove_reference_t<T>>>::value;

/// The troll policy a policy type is (or derives from): cpu_policy or cuda_policy.
template <class T>
using execution_policy_base_t =
    std::conditional_t<std::is_base_of<cuda_policy, std::remove_cv_t<std::remove_reference_t<T>>>::value,
                       cuda_policy, cpu_policy>;

TROLL_END_NAMESPACE
