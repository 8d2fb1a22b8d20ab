#pragma once

/// \file
/// detail::number_text: a double as the shortest decimal text that reads back as the same
/// double, for error messages ("got eps = 1e-300", not std::to_string's "0.000000").

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace troll::detail {

inline std::string number_text(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buffer[40];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buffer, sizeof buffer, "%.*g", digits, x);
    if (std::strtod(buffer, nullptr) == x) break;
  }
  return buffer;
}

}  // namespace troll::detail
