// tests/cuda/test_cuda_kl_gradient.cu — kl against a long-double reference and kl_backward against
// troll's finite-difference gradient checker (tests/bodies/kl_gradient.hpp), run on the device:
// the same test body as tests/test_kl_gradient.cpp, compiled for troll::cuda. Without a GPU the
// "device" suite is skipped and only the compile is checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include "grad_helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "troll/cuda.cuh"
#include "troll/projection.hpp"

using namespace grad_helpers;

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/kl_gradient.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
