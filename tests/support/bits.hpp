// tests/support/bits.hpp — bit-level comparisons the tests share: same_bits (two values, two
// arrays, two vectors: the same bytes, so NaN payloads and signed zeros count) and ulps (a
// double's distance from a long double reference in units of the reference's last place).
// One definition here, so test files that share a translation unit (troll_add_test_group) do
// not each bring their own.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace troll_test {

/// a and b hold the same bytes (arithmetic types: no padding).
template <class T, class = std::enable_if_t<std::is_arithmetic<T>::value>>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// a[0..n) and b[0..n) hold the same bytes.
template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  static_assert(std::is_arithmetic<T>::value, "same_bits compares arrays of numbers");
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

/// Equal sizes and the same bytes.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && same_bits(a.data(), b.data(), a.size());
}

/// |got − exact| in units of the last place of the double nearest to exact.
inline double ulps(double got, long double exact) {
  const double near = static_cast<double>(exact);
  const double ulp = std::nextafter(near, std::numeric_limits<double>::infinity()) - near;
  return static_cast<double>(std::fabs(static_cast<long double>(got) - exact) / ulp);
}

}  // namespace troll_test
