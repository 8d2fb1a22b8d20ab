// tests/cuda/test_cuda_sparse_projection_oracle.cu — the sparse path's oracle properties run on
// the device: the projection of aligned sparse rows against its long-double bisection oracle
// (tests/bodies/sparse_projection_oracle.hpp, the body of tests/test_sparse.cpp) and the sparse
// backward entry points against troll's finite-difference gradient checker and against each other
// (tests/bodies/sparse_gradients.hpp, the body of tests/test_sparse_gradients.cpp), and the sparse
// project_backward against central differences of the device project on adversarial rows
// (tests/bodies/adversarial_sparse_backward.hpp, the body of tests/test_adversarial_sparse.cpp),
// compiled for troll::cuda. Without a GPU the "device" suite is skipped and only the compile is
// checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "adversarial_sparse_rows.hpp"
#include "backend.hpp"
#include "sparse_oracle.hpp"
#include "sparse_staging.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/gradcheck.hpp"
#include "troll/projection.hpp"
#include "troll/sparse.hpp"

using namespace sparse_test;

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/sparse_projection_oracle.hpp"
#include "../bodies/sparse_gradients.hpp"
#include "../bodies/adversarial_sparse_backward.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
