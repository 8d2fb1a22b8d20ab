// tests/support/expect_error.hpp — the one check every bad-input test makes: a call throws a
// troll exception of a given type that names the offending row (in row() and in its message)
// and says what is wrong. Include after doctest.
#pragma once

#include <cstddef>
#include <string>

namespace troll_test {

/// Runs `call`; expects an exception E (that class or a subclass) with row() == `row` and
/// `fragment` in its message (by default "row <row>").
template <class E, class Call>
void expect_rejected(Call&& call, std::size_t row, const std::string& fragment) {
  bool thrown = false;
  try {
    call();
  } catch (const E& e) {
    thrown = true;
    CHECK(e.row() == row);
    CHECK_MESSAGE(std::string(e.what()).find(fragment) != std::string::npos, std::string(e.what()));
  }
  CHECK_MESSAGE(thrown, fragment);
}

template <class E, class Call>
void expect_row_error(Call&& call, std::size_t row) {
  expect_rejected<E>(call, row, "row " + std::to_string(row));
}

}  // namespace troll_test
