// troll/detail/arguments.hpp — checks of the scalar arguments every backend's projection takes
// (ε and the solver options). Host-only, Eigen-free, so CPU and CUDA entry points share them.
#pragma once

#include <string>

#include "../batch.hpp"
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

/// Every host-side check of project()'s arguments that does not read the logits: the views,
/// their shapes, the stats pointer, ε and the options. Shared by the CPU and CUDA overloads.
template <class T>
void check_projection_arguments(const char* function, batch_view<const T> new_logits,
                                batch_view<const T> old_logits, batch_view<T> out_log_probs,
                                const projection_stats* stats, double eps,
                                const projection_options& options) {
  check_view(function, "new_logits", new_logits);
  check_view(function, "old_logits", old_logits);
  check_view(function, "out_log_probs", out_log_probs);
  check_same_shape(function, "new_logits", new_logits, "old_logits", old_logits);
  check_same_shape(function, "new_logits", new_logits, "out_log_probs", out_log_probs);
  if (new_logits.rows != 0 && stats == nullptr) throw_shape(function, "stats is a null pointer");
  check_eps(function, eps);
  check_options(function, options);
}

}  // namespace detail
TROLL_END_NAMESPACE
