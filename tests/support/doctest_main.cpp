// tests/support/doctest_main.cpp — doctest's implementation and main(), compiled once and linked
// into every C++ test executable (tests/CMakeLists.txt, troll_doctest_main). Test files include
// <doctest/doctest.h> without defining DOCTEST_CONFIG_IMPLEMENT*.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
