// troll/detail/gaussian_backend.hpp — where the Gaussian entry points (troll/gaussian_api.hpp),
// written once for every execution policy, find their backend: class templates specialised per
// policy by the backend headers, looked up when an entry point is instantiated.
//   gaussian_backend<P>:     check_dim, project, kl (gaussian.hpp; cuda_gaussian.cuh), called by
//                            gaussian_forward_call.hpp after the shared argument checks
//   gaussian_vjp_backend<P>: rows          (gaussian_backward.hpp; cuda_gaussian_derivatives.cuh)
//   gaussian_jvp_backend<P>: rows          (gaussian_jvp.hpp; cuda_gaussian_derivatives.cuh)
// The primary templates are there only to say, at compile time, which header is missing.
#pragma once

#include <type_traits>

#include "../config.hpp"
#include "../execution.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {

/// False for every P, but only once P is known (a static_assert that fires on instantiation).
template <class P>
struct always_false : std::false_type {};

template <class Policy>
struct gaussian_backend {
  static_assert(always_false<Policy>::value,
                "troll::gaussian: no backend of this policy is included here: the projections and kl need "
                "<troll/gaussian.hpp> for troll::cpu, <troll/cuda_gaussian.cuh> (nvcc) for troll::cuda");
};

template <class Policy>
struct gaussian_vjp_backend {
  static_assert(always_false<Policy>::value,
                "troll::gaussian: no backward of this policy is included here: include "
                "<troll/gaussian_backward.hpp> for troll::cpu, <troll/cuda_gaussian.cuh> (nvcc) for troll::cuda");
};

template <class Policy>
struct gaussian_jvp_backend {
  static_assert(always_false<Policy>::value,
                "troll::gaussian: no JVP of this policy is included here: include <troll/gaussian_jvp.hpp> for "
                "troll::cpu, <troll/cuda_gaussian.cuh> (nvcc) for troll::cuda");
};

/// The entry points' constraint: a first argument that is one of troll's execution policies.
template <class Policy>
using if_execution_policy = std::enable_if_t<is_execution_policy_v<Policy>, int>;

}  // namespace detail
TROLL_END_NAMESPACE
