// tests/cuda/test_cuda_kl_oracle.cu — the oracle tests of log_softmax and kl
// (tests/bodies/kl_oracle.hpp: long-double values, +inf exactly where p has mass that q masks,
// KL(p‖p) = 0, shift invariance, the two-sided-mask regressions) run on the device: the same test
// body as tests/test_kl.cpp, compiled for troll::cuda. Without a GPU the "device" suite is skipped
// and only the compile is checked.
#include "cuda_support.cuh"  // first: doctest's main, EIGEN_NO_CUDA, warning suppressions

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
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
#include "../bodies/kl_oracle.hpp"
}

#ifndef TROLL_TEST_GROUP  // grouped, the generated translation unit supplies main
int main(int argc, char** argv) { return troll_test::run_cuda_tests(argc, argv, __FILE__); }
#endif
