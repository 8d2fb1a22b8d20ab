// troll/detail/cpu/objective_scratch.hpp — the CPU objectives' scratch memory: what each pass keeps
// per row (the aggregation weights, the row results, flags), carved from the policy's workspace,
// or from the calling thread's reusable arena (detail/workspace.hpp) when the policy carries none. No Eigen: the public size query
// (troll/workspace.hpp) counts the same layouts.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>

#include "../../config.hpp"
#include "../row_problem.hpp"
#include "../workspace.hpp"
#include "objective_records.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// Where an array of `X` starts after `used` bytes of a block (aligned for X).
template <class X>
constexpr std::size_t scratch_offset(std::size_t used) {
  return (used + alignof(X) - 1) / alignof(X) * alignof(X);
}

/// Hands out consecutive, aligned, value-initialised arrays of a block of bytes.
class scratch_arena {
 public:
  explicit scratch_arena(unsigned char* base) : base_(base) {}
  template <class X>
  X* take(std::size_t n) {
    static_assert(alignof(X) <= workspace_alignment && std::is_trivially_destructible<X>::value,
                  "scratch holds plain records");
    used_ = scratch_offset<X>(used_);
    X* p = reinterpret_cast<X*>(base_ + used_);
    std::uninitialized_value_construct_n(p, n);
    used_ += n * sizeof(X);
    return p;
  }
  std::size_t used() const { return used_; }

 private:
  unsigned char* base_;
  std::size_t used_ = 0;
};

/// One objective pass's scratch: the aggregation weights c, one record per row (a row's result,
/// plan or problem), one flag per row, and `extra` further elements (TROLL's dense forward: one
/// row of T to project a row without writing; the dense backward: every row's problem; the ratio
/// baselines' backward: c·(∂ℓ/∂r)·r and the new rows' log-normalisers in two parts, 3 × rows doubles).
template <class Record, class Extra = unsigned char>
struct row_scratch {
  /// Bytes of the layout for `rows` rows and `extra` further elements: the offsets the
  /// constructor's takes reach, in the same order (a constant expression, for the size query).
  static constexpr std::size_t bytes(std::size_t rows, std::size_t extra_count) {
    std::size_t used = scratch_offset<double>(0) + rows * sizeof(double);
    used = scratch_offset<Record>(used) + rows * sizeof(Record);
    used = scratch_offset<unsigned char>(used) + rows;
    return scratch_offset<Extra>(used) + extra_count * sizeof(Extra);
  }
  double* weights;
  Record* records;
  unsigned char* flags;
  Extra* extra;
  row_scratch(scratch_arena& a, std::size_t rows, std::size_t extra_count)
      : weights(a.take<double>(rows)),
        records(a.take<Record>(rows)),
        flags(a.take<unsigned char>(rows)),
        extra(a.take<Extra>(extra_count)) {}
};

template <class T>
using troll_forward_scratch = row_scratch<troll_row_result, T>;                      // extra: cols
using troll_backward_scratch = row_scratch<troll_backward_plan, row_problem>;  // extra: rows
using ratio_forward_scratch = row_scratch<ratio_row_result>;                         // extra: 0
using ratio_backward_scratch = row_scratch<row_problem, double>;               // extra: 3 rows
using sparse_forward_scratch = row_scratch<troll_row_result>;                        // extra: 0
using sparse_backward_scratch = row_scratch<row_problem>;                      // extra: 0

/// Bytes one layout takes for `rows` rows and `extra` further elements.
template <class Scratch>
constexpr std::size_t scratch_bytes(std::size_t rows, std::size_t extra) {
  return Scratch::bytes(rows, extra);
}

/// One layout carved from the policy's workspace (checked: shape_error when it is null,
/// misaligned or short, before anything is written) or, when the policy carries none, from the
/// calling thread's host_arena (allocates only when the arena grows).
template <class Scratch>
class carved_scratch {
 public:
  carved_scratch(const char* fn, const scratch_memory& workspace, std::size_t rows, std::size_t extra)
      : memory_(fn, workspace, scratch_bytes<Scratch>(rows, extra)),
        arena_(memory_.data()),
        parts(arena_, rows, extra) {}

 private:
  host_scratch memory_;
  scratch_arena arena_;

 public:
  const Scratch parts;
};

/// The bytes the CPU objectives need, forward and backward alike (one allocation serves both;
/// constant expressions, as the CUDA sizes are).
constexpr std::size_t dense_troll_bytes(std::size_t rows, std::size_t cols) {
  return std::max(scratch_bytes<troll_forward_scratch<double>>(rows, cols),
                  scratch_bytes<troll_backward_scratch>(rows, rows));
}
constexpr std::size_t ratio_bytes(std::size_t rows) {
  return std::max(scratch_bytes<ratio_forward_scratch>(rows, 0), scratch_bytes<ratio_backward_scratch>(rows, 3 * rows));
}
constexpr std::size_t sparse_troll_bytes(std::size_t rows) {
  return std::max(scratch_bytes<sparse_forward_scratch>(rows, 0), scratch_bytes<sparse_backward_scratch>(rows, 0));
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
