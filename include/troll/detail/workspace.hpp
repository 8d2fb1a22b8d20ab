// troll/detail/workspace.hpp — the host check of a caller's scratch memory (size, alignment) and
// the CPU's fallback when the policy carries none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../config.hpp"
#include "../errors.hpp"
#include "../execution.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Alignment every workspace must have (the doubles the kernels keep there).
constexpr std::size_t workspace_alignment = alignof(double);

/// Throws shape_error unless `w` can hold `needed` bytes: not null, 8-byte aligned, large enough.
/// Nothing is checked when `needed` is 0.
inline void check_workspace(const char* function, const scratch_memory& w, std::size_t needed) {
  if (needed == 0) return;
  if (w.data == nullptr) throw_shape(function, "workspace is a null pointer");
  if (reinterpret_cast<std::uintptr_t>(w.data) % workspace_alignment != 0)
    throw_shape(function, "workspace is not " + std::to_string(workspace_alignment) + "-byte aligned");
  if (w.bytes < needed)
    throw_shape(function, "workspace holds " + std::to_string(w.bytes) + " bytes but the call needs " +
                              std::to_string(needed) + " (troll::workspace_bytes)");
}

/// CPU scratch: the policy's workspace when it carries one (checked), else memory owned here.
class host_scratch {
 public:
  host_scratch(const char* function, const scratch_memory& w, std::size_t needed) {
    if (w.data == nullptr && w.bytes == 0) {
      owned_.assign(needed, 0);
      data_ = owned_.data();
      return;
    }
    check_workspace(function, w, needed);
    data_ = static_cast<unsigned char*>(w.data);
  }
  host_scratch(const host_scratch&) = delete;
  host_scratch& operator=(const host_scratch&) = delete;
  unsigned char* data() const { return data_; }

 private:
  std::vector<unsigned char> owned_;
  unsigned char* data_ = nullptr;
};

}  // namespace detail
TROLL_END_NAMESPACE
