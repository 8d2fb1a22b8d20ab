// test_gaussian_diag_derivatives.cpp — the Gaussian KL and the diagonal projections' VJP / JVP on
// the CPU backend (tests/bodies/gaussian_diag_derivatives.hpp, also compiled for troll::cuda by
// tests/cuda/test_cuda_gaussian_derivatives.cu).
#include <doctest/doctest.h>

#include "gaussian_oracle.hpp"  // first: Eigen/Core before troll's headers

#include <troll/gaussian.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "gaussian_narrow_axis_reference.hpp"

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "../bodies/gaussian_diag_derivatives.hpp"
