// test_two_point.cpp — the new-side derivatives on nearly two-point rows, dense, sparse and TROLL's
// objective (tests/bodies/two_point_rows.hpp on the CPU backend; tests/cuda/test_cuda_gradients.cu
// runs the same body on the device).
#include <doctest/doctest.h>

#include <troll/objectives.hpp>
#include <troll/projection.hpp>
#include <troll/sparse.hpp>

#include "backend.hpp"
#include "oracle.hpp"
#include "sparse_oracle.hpp"
#include "sparse_staging.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

namespace troll_test {
using oracle_backend = backend<troll::cpu_policy>;
}  // namespace troll_test

#include "bodies/two_point_rows.hpp"

