// tests/cuda/test_cuda_projection_oracle.cu — the dense projection's oracle tests
// (tests/bodies/projection_oracle.hpp: the bound, the status, log π_t at the reported t, t* against
// bisection, the moments, feasible competitors, monotonicity in ε) run on the device: the same
// test body as tests/test_projection.cpp, compiled for troll::cuda. Without a GPU the "device"
// suite is skipped and only the compile is checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "corpus.hpp"
#include "oracle.hpp"
#include "tolerance.hpp"
#include "troll/cuda.cuh"
#include "troll/projection.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cuda_policy>;
}  // namespace troll_test

TEST_SUITE("device") {
#include "../bodies/projection_oracle.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
