// tests/support/special_values.hpp — the non-finite values the tests plant in their inputs, defined
// once: test files that share a translation unit (troll_add_test_group, CPU or CUDA) would
// otherwise each bring their own.
#pragma once

#include <limits>

namespace troll_test {

inline const double nan_value = std::numeric_limits<double>::quiet_NaN();
inline const double inf_value = std::numeric_limits<double>::infinity();
inline constexpr double plus_inf = std::numeric_limits<double>::infinity();
inline constexpr double minus_inf = -std::numeric_limits<double>::infinity();

}  // namespace troll_test
