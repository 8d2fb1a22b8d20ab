// tests/cuda/test_cuda_backward_gradient.cu — project_backward and project_jvp against troll's
// finite-difference gradient checker and against each other (tests/bodies/backward_gradient.hpp),
// run on the device: the same test body as tests/test_backward.cpp, compiled for troll::cuda; and
// the derivatives of the device project() against central differences of itself on adversarial
// rows (tests/bodies/adversarial_derivatives.hpp, the body of tests/test_adversarial.cpp).
// Without a GPU the "device" suite is skipped and only the compile is checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include "grad_helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "adversarial_rows.hpp"
#include "backend.hpp"
#include "troll/cuda.cuh"
#include "troll/gradcheck.hpp"
#include "troll/projection.hpp"

using namespace grad_helpers;

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/backward_gradient.hpp"
#include "../bodies/adversarial_derivatives.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
