// tests/support/adversarial_rows.hpp — the named dense row pair of the adversarial audits
// (tests/test_adversarial.cpp, tests/bodies/adversarial_derivatives.hpp): row_case, its printout
// for failure messages, and the Gaussian row generator they draw from.
#pragma once

#include <cstddef>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace troll_test {

/// One dense row pair (new logits zn, old logits zo) with a name for the failure message.
struct row_case {
  std::string name;
  std::vector<double> zn, zo;
};

/// "(zn_0, zo_0) (zn_1, zo_1) ..." to 17 digits.
inline std::string describe(const row_case& c) {
  std::string out;
  char buf[80];
  for (std::size_t i = 0; i < c.zn.size(); ++i) {
    std::snprintf(buf, sizeof buf, "(%.17g, %.17g) ", c.zn[i], c.zo[i]);
    out += buf;
  }
  return out;
}

/// n logits shift + N(0, scale²).
inline std::vector<double> gaussian_row(std::mt19937_64& g, std::size_t n, double scale,
                                        double shift = 0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> z(n);
  for (auto& v : z) v = shift + d(g);
  return z;
}

}  // namespace troll_test
