// troll/gaussian.hpp — the trust-region projection for Gaussians (math.md §6, docs/gaussian.md),
// the second family of troll's one solver: for a batch of N pairs (new N(μ̃, Σ̃), old N(μ°, Σ°))
// of dimension d,
//   joint:  π* = argmin KL(π ‖ p̃) s.t. KL(π ‖ q) ≤ ε, the natural-parameter interpolation
//           Λ* = tΛ̃ + (1 − t)Λ°, h* = t h̃ + (1 − t) h°, t the root of KL(π_t ‖ q) = ε;
//   split:  the mean μ* = (μ̃ + ω μ°)/(1 + ω) against ε_μ in closed form, the covariance
//           Λ* = tΛ̃ + (1 − t)Λ° against ε_Σ (the trust-region layers of Otto et al., 2021).
// Covariances come as row-major d×d lower-triangular Cholesky factors (N × d² views) or, in the
// _diag variants, as standard deviations (N × d). This header is the CPU backend; the entry
// points, one for every policy, are in gaussian_api.hpp. Policy first, like troll::project:
//   troll::gaussian::project_joint(troll::cpu, mean, chol, old_mean, old_chol, eps, out_mean,
//                                  out_chol, stats);
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/arguments.hpp"
#include "detail/cpu/gaussian_kernels.hpp"
#include "detail/cpu/parallel.hpp"
#include "detail/gaussian_backend.hpp"
#include "detail/gaussian_checks.hpp"
#include "detail/gaussian_forward_call.hpp"
#include "errors.hpp"
#include "execution.hpp"
#include "gaussian_api.hpp"
#include "gaussian_types.hpp"
#include "projection_types.hpp"
#include "detail/cpu/gaussian_rows.hpp"

#include "gaussian_backward.hpp"
#include "gaussian_jvp.hpp"
