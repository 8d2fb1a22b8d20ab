// troll/detail/workspace.hpp — the host check of a caller's scratch memory (size, alignment) and
// the CPU's fallback when the policy carries none (a per-thread arena, reused across calls).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
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

/// Alignment of the per-thread arena's blocks (a cache line).
constexpr std::size_t host_arena_alignment = 64;

/// The CPU's scratch when the policy carries none: per thread, one block per nesting level, each
/// grown (never shrunk) to the largest size asked of it and then reused, 64-byte aligned, not
/// zero-filled (every user writes a row's scratch before reading it). Level d serves the d-th
/// host_scratch live at once on this thread, so a call that needed scratch while another's is
/// live would get its own block. Held until the thread exits.
class host_arena {
 public:
  host_arena() = default;
  host_arena(const host_arena&) = delete;
  host_arena& operator=(const host_arena&) = delete;
  ~host_arena() {
    for (block& b : levels_) release(b);
  }

  /// This thread's arena.
  static host_arena& local() {
    thread_local host_arena arena;
    return arena;
  }

  /// The next level's block, holding at least `bytes` (grown first when smaller).
  unsigned char* acquire(std::size_t bytes) {
    if (depth_ == levels_.size()) levels_.push_back(block{});
    block& b = levels_[depth_];
    if (b.capacity < bytes) {
      const std::size_t rounded = (bytes + host_arena_alignment - 1) / host_arena_alignment * host_arena_alignment;
      unsigned char* grown =
          static_cast<unsigned char*>(::operator new(rounded, std::align_val_t(host_arena_alignment)));
      release(b);
      b.data = grown;
      b.capacity = rounded;
      ++growths_;
    }
    ++depth_;
    return b.data;
  }
  /// Gives the innermost level back.
  void release_level() { --depth_; }

  std::size_t growths() const { return growths_; }  ///< allocations made so far
  std::size_t depth() const { return depth_; }      ///< levels live now
  std::size_t capacity(std::size_t level = 0) const {
    return level < levels_.size() ? levels_[level].capacity : 0;
  }

 private:
  struct block {
    unsigned char* data = nullptr;
    std::size_t capacity = 0;
  };
  static void release(block& b) {
    if (b.data) ::operator delete(b.data, std::align_val_t(host_arena_alignment));
    b = block{};
  }
  std::vector<block> levels_;
  std::size_t depth_ = 0;
  std::size_t growths_ = 0;
};

/// CPU scratch: the policy's workspace when it carries one (checked), else a block of this
/// thread's host_arena (no allocation once it has grown to the call's size).
class host_scratch {
 public:
  host_scratch(const char* function, const scratch_memory& w, std::size_t needed) {
    if (w.data == nullptr && w.bytes == 0) {
      data_ = host_arena::local().acquire(needed);
      from_arena_ = true;
      return;
    }
    check_workspace(function, w, needed);
    data_ = static_cast<unsigned char*>(w.data);
  }
  host_scratch(const host_scratch&) = delete;
  host_scratch& operator=(const host_scratch&) = delete;
  ~host_scratch() {
    if (from_arena_) host_arena::local().release_level();
  }
  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_ = nullptr;
  bool from_arena_ = false;
};

}  // namespace detail
TROLL_END_NAMESPACE
