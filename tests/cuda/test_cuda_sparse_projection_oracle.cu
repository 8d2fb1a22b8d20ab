// tests/cuda/test_cuda_sparse_projection_oracle.cu — the projection of aligned sparse rows against
// its long-double bisection oracle (tests/bodies/sparse_projection_oracle.hpp), run on the device:
// the same test body as tests/test_sparse.cpp, compiled for troll::cuda. Without a GPU the "device"
// suite is skipped and only the compile is checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "backend.hpp"
#include "sparse_oracle.hpp"
#include "troll/cuda.cuh"
#include "troll/projection.hpp"
#include "troll/sparse.hpp"

using namespace sparse_test;

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/sparse_projection_oracle.hpp"
}

int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
