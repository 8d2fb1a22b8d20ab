// troll/detail/arguments.hpp — checks of the scalar arguments every backend's projection takes
// (ε and the solver options). Host-only, Eigen-free, so CPU and CUDA entry points share them.
#pragma once

#include <string>

#include "../config.hpp"
#include "../errors.hpp"
#include "../projection_types.hpp"
#include "numeric.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// Throws domain_error unless 0 < eps < inf.
inline void check_eps(const char* function, double eps) {
  if (!(eps > 0.0) || !(eps < inf()))
    throw domain_error(std::string("troll::") + function +
                       ": the bound eps must be finite and > 0, got " + std::to_string(eps));
}

/// Throws domain_error unless rtol, atol ≥ 0 with a positive sum and max_iterations ≥ 1.
inline void check_options(const char* function, const projection_options& opt) {
  if (!(opt.rtol >= 0.0) || !(opt.atol >= 0.0) || !(opt.rtol + opt.atol > 0.0) ||
      opt.max_iterations < 1)
    throw domain_error(std::string("troll::") + function +
                       ": projection_options need rtol >= 0, atol >= 0, rtol + atol > 0 and "
                       "max_iterations >= 1");
}

}  // namespace detail
TROLL_END_NAMESPACE
