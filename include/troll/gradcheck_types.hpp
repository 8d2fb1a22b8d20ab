// troll/gradcheck_types.hpp — the settings and the result of a finite-difference gradient check
// (troll/gradcheck.hpp documents the checker, its modes and its default tolerances).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "config.hpp"

TROLL_BEGIN_NAMESPACE

/// Settings of a gradient check. The defaults suit functions of O(1) size checked in double; see
/// the header comment for the reasoning.
struct gradcheck_options {
  double step = 1e-6;           ///< relative central-difference step: h_k = step · max(1, |x_k|)
  double atol = 1e-6;           ///< absolute tolerance
  double rtol = 1e-4;           ///< relative tolerance (against |numeric| in full mode)
  int directions = 16;          ///< random-direction mode: how many (u, v) pairs to draw
  std::uint64_t seed = 0x7201;  ///< random-direction mode: generator seed
  bool richardson = true;       ///< Richardson extrapolation over h and h/2 (O(h⁴) differences)
};

/// Outcome of a gradient check. In full-Jacobian mode the "entries" are the (output, input)
/// pairs; in random mode they are the directions.
struct gradcheck_result {
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  bool ok = false;                  ///< every compared entry within tolerance, nothing non-finite
  std::string mode;                 ///< the entry point, e.g. "check_vjp_random"
  bool random_directions = false;   ///< true for the random-direction modes
  std::string reason;               ///< empty when ok; otherwise why the check failed
  std::size_t outputs = 0;          ///< m
  std::size_t inputs = 0;           ///< n
  std::size_t checked = 0;          ///< entries (full mode) or directions (random mode) compared
  std::size_t failed = 0;           ///< compared entries or directions beyond tolerance
  std::size_t nonfinite = 0;        ///< non-finite problems found (each one fails the check)
  std::size_t skipped_outputs = 0;  ///< outputs that are −inf at x, treated as constant

  double max_abs_error = 0;  ///< max |analytic − numeric| over compared entries
  double max_rel_error = 0;  ///< max |analytic − numeric| / max(|analytic|, |numeric|), 0 if both 0
  double max_error_ratio = 0;  ///< max |analytic − numeric| / tolerance; ≤ 1 means within tolerance

  /// The worst entry: the first non-finite problem if there is one, else the compared entry with
  /// the largest error ratio. worst_output and worst_input index it in full mode; in random mode
  /// worst_direction is the direction, and worst_output names an output only for a non-finite one.
  std::size_t worst_output = npos;
  std::size_t worst_input = npos;
  std::size_t worst_direction = npos;
  double analytic_at_worst = 0;
  double numeric_at_worst = 0;
  double tolerance_at_worst = 0;

  gradcheck_options options;  ///< the settings the check ran with

  /// Multi-line readable summary: mode, pass/fail and reason, the worst entry with both values,
  /// counts, and the tolerances.
  std::string report() const;
};

TROLL_END_NAMESPACE
