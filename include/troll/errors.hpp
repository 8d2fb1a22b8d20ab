// troll/errors.hpp — the typed exceptions troll throws.
// All input problems derive from troll::invalid_input (itself a std::invalid_argument) and are
// raised before any output is written; messages name the row and the problem.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "config.hpp"
#include "row_error.hpp"

TROLL_BEGIN_NAMESPACE

/// Base of every error about the caller's arguments. `row()` is the offending row, or npos when
/// the problem is not tied to one row (a shape mismatch, a bad option); `code()` says what is
/// wrong with that row (troll/row_error.hpp; the same code on both backends), row_error::none
/// when the problem is not a row's.
class invalid_input : public std::invalid_argument {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  invalid_input(const std::string& what, std::size_t row = npos, row_error code = row_error::none)
      : std::invalid_argument(what), row_(row), code_(code) {}
  std::size_t row() const noexcept { return row_; }
  row_error code() const noexcept { return code_; }

 private:
  std::size_t row_;
  row_error code_;
};

/// Shapes disagree, a pointer is null, a dimension is zero, a stride is too small.
class shape_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

/// A value is outside the domain: NaN or +inf logits, a row with no finite logit, ε ≤ 0 or NaN.
class domain_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

/// The trust region holds no distribution the new row can reach: the new logits mask (−inf)
/// tokens that carry so much old mass that even the closest admissible π has KL(π‖q) ≥ ε.
class infeasible_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

/// A backend call failed (for CUDA: the runtime's error text is in the message).
class backend_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
inline std::string row_prefix(const char* function, std::size_t row) {
  return std::string("troll::") + function + ": row " + std::to_string(row) + ": ";
}
[[noreturn]] inline void throw_shape(const char* function, const std::string& what) {
  throw shape_error(std::string("troll::") + function + ": " + what);
}
}  // namespace detail

TROLL_END_NAMESPACE
