// tests/support/doctest_runner.cpp — doctest's implementation without main(), compiled once and
// linked into every CUDA test executable (tests/CMakeLists.txt, troll_doctest_runner): their
// main() calls troll_test::run_cuda_tests (cuda_support.cuh), which drives a doctest::Context.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
