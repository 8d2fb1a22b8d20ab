// troll/detail/cuda/gradient_kernels.cuh — the remaining dense derivatives on the device, one
// block per row: kl_backward, the JVP of the projection, and the per-row pass of its full
// Jacobian (whose rows·V·V entries are then written by a Thrust for_each, see jacobian_entry).
// Same formulas as troll/kl.hpp and cpu::jvp_row / cpu::jacobian_row (math.md §1, §3):
//   ∂L/∂p_j = g · p_j (log p_j − log q_j − KL),      ∂L/∂q_j = g · (q_j − p_j);
//   JVP_i   = t (u_i − Σ_J π u) + (d_i − μ) ṫ + (1 − t)(v_i − Σ_J π v)        on J,
//        ṫ  = −t/σ² Σ_J π (d − μ) u + Σ_j ∂t/∂z°_j v_j + ε̇ / (t σ²)      (projected rows);
//   ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²),
//        π_j − q_j = q_j · expm1(t (d_j − μ) + KL(π‖q)) where that exponent is below 1/2.
// Every d − μ of a projected row is re-centred by m = Σ_J π (d − μ) where that exceeds its noise,
// as the CPU (detail::centring_sums, troll/detail/tilt_derivatives.hpp).
#pragma once

#include <cuda/std/functional>
#include <cuda_runtime.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system/system_error.h>

#include <cstddef>
#include <string>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../errors.hpp"
#include "../../projection_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../row_problem.hpp"
#include "../tilt_derivatives.hpp"
#include "../trust_region_solver.hpp"
#include "../workspace_layout.hpp"
#include "backward_kernels.cuh"
#include "block_reduce.cuh"
#include "offset_reference.cuh"
#include "forward_kernels.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

// ---- Reports the derivatives add to those of project_backward ----

/// not_finite `operand` of project_jvp's tangent_old (operands 0–2: new_logits, old_logits,
/// tangent_new).
constexpr int operand_tangent_old = 3;

/// Checked mode of the derivative entry points: their reports become the CPU's exceptions,
/// including the two the projection's reports do not carry (an infinite KL in kl_backward, a
/// non-finite tangent_old).
struct throw_derivative_report {
  [[noreturn]] void operator()(const char* function, std::size_t row, const cuda_row_report& report,
                               const char* const operand_names[3]) const {
    if (report.error == cuda_row_error::not_finite && report.operand == operand_tangent_old)
      throw_row_problem(function, row,
                        make_problem(row_error::nan_value, "tangent_old", static_cast<long long>(report.token), report.value));
    throw_report(function, row, report, operand_names);
  }
};

// ---- kl_backward ----

/// Rows of `range`: grad_p and grad_q (each skipped when its view has no rows) from the upstream
/// g = grad_kl[r]. A row's checks in the CPU's order: its logits, then g, then the KL's
/// finiteness (disjoint supports are no logits problem here: KL = +inf, so infinite_kl).
template <class T>
__global__ void __launch_bounds__(block_threads)
    kl_backward_kernel(batch_view<const T> p_logits, batch_view<const T> q_logits, const T* grad_kl,
                       batch_view<T> grad_p, batch_view<T> grad_q, row_range range,
                       device_checks checks) {
  __shared__ reduce_storage<lse_state> lse_storage;
  const std::size_t size = p_logits.cols;
  for_each_pair_row(p_logits, q_logits, range,
                    [&](std::size_t r, const T* zp, const T* zq, const pair_scan& scan) {
    cuda_row_report report = kl_pair_problem(scan, zp, zq);
    const double g = static_cast<double>(grad_kl[r]);
    if (report.error == cuda_row_error::none) {
      if (!(g - g == 0.0)) {
        // One value per row: no token (~0 reads as entry −1 on the host, as the CPU's).
        report.error = cuda_row_error::not_finite, report.operand = 2, report.token = ~0ull, report.value = g;
      } else if (scan.new_only) {
        report.error = cuda_row_error::infinite_kl;
      }
    }
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) return;

    T* out_p = grad_p.rows != 0 ? grad_p.row(r) : nullptr;
    T* out_q = grad_q.rows != 0 ? grad_q.row(r) : nullptr;
    if (report.error != cuda_row_error::none) {
      fill_nan(out_p, size);
      fill_nan(out_q, size);
      return;
    }
    const double log_sum_q = old_log_sum(scan);
    const block_tilt_evaluator<T> eval{zp, zq, size, scan.old.lse.m, log_sum_q, &lse_storage};
    const double kl = evaluate_at_one(eval, make_setup(scan), log_sum_q).kl;
    const double max_p = scan.fresh.lse.m, log_sum_p = ::log(scan.fresh.lse.s0);
    const double max_q = scan.old.lse.m;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double log_p = (static_cast<double>(zp[i]) - max_p) - log_sum_p;
      const double log_q = (static_cast<double>(zq[i]) - max_q) - log_sum_q;
      const bool p_on = log_p > neg_inf();
      const double p = p_on ? ::exp(log_p) : 0.0;
      if (out_p != nullptr) out_p[i] = static_cast<T>(g * (p_on ? p * (log_p - log_q - kl) : 0.0));
      if (out_q != nullptr) {
        const double q = log_q > neg_inf() ? ::exp(log_q) : 0.0;
        out_q[i] = static_cast<T>(g * (q - p));
      }
    }
  });
}

// ---- project_jvp ----

/// Pass 1 of the JVP: the pair scan, the first non-finite tangent entries and the sums over J.
struct jvp_scan {
  pair_scan pair;
  std::size_t first_bad_new = no_token;  // tangent_new
  std::size_t first_bad_old = no_token;  // tangent_old
  std::size_t first_bad_log_prob = no_token;  // log_probs that cannot be log π* (detail::log_prob_fits)
  double pi_tn = 0.0;                    // Σ_J π u
  double pi_centred_tn = 0.0;            // Σ_J π (d − μ) u
  double pi_to = 0.0;                    // Σ_J π v
  centring_sums centring;                // Σ_J π (d − μ) and its noise
  old_side_sums dominant;                // the token of π ≥ 1/2, if any (its sum is unused)
};

struct merge_jvp_scan {
  __device__ jvp_scan operator()(const jvp_scan& a, const jvp_scan& b) const {
    jvp_scan s;
    s.pair = merge(a.pair, b.pair);
    s.first_bad_new = a.first_bad_new < b.first_bad_new ? a.first_bad_new : b.first_bad_new;
    s.first_bad_old = a.first_bad_old < b.first_bad_old ? a.first_bad_old : b.first_bad_old;
    s.first_bad_log_prob = a.first_bad_log_prob < b.first_bad_log_prob ? a.first_bad_log_prob : b.first_bad_log_prob;
    s.pi_tn = a.pi_tn + b.pi_tn;
    s.pi_centred_tn = a.pi_centred_tn + b.pi_centred_tn;
    s.pi_to = a.pi_to + b.pi_to;
    s.centring = a.centring + b.centring;
    s.dominant = a.dominant + b.dominant;
    return s;
  }
};

/// Rows of `range`: tangent_out = the directional derivative of log π* along (tangent_new,
/// tangent_old — absent when its view has no rows — and eps_dot). Rejected rows get NaN.
template <class T>
__global__ void __launch_bounds__(block_threads)
    project_jvp_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                       batch_view<const T> log_probs, const projection_stats* stats,
                       batch_view<const T> tangent_new, batch_view<const T> tangent_old, double eps_dot,
                       batch_view<T> tangent_out, row_range range, device_checks checks) {
  __shared__ reduce_storage<jvp_scan> scan_storage;
  __shared__ reduce_storage<double_pair> sum_storage;
  __shared__ reference_storage ref_storage;
  const std::size_t size = new_logits.cols, end = range.begin + range.count;
  const bool with_old = tangent_old.rows != 0;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const T* zn = new_logits.row(r);
    const T* zo = old_logits.row(r);
    const T* logp = log_probs.row(r);
    const T* tn = tangent_new.row(r);
    const T* to = with_old ? tangent_old.row(r) : nullptr;
    const projection_stats s = stats[r];
    const centring_reference ref = block_reference(zn, zo, logp, size, s, ref_storage);  // d − μ from here

    jvp_scan local;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double a = static_cast<double>(zn[i]), b = static_cast<double>(zo[i]);
      add(local.pair, i, a, b);
      const double u = static_cast<double>(tn[i]);
      if (!(u - u == 0.0) && i < local.first_bad_new) local.first_bad_new = i;
      const double v = to != nullptr ? static_cast<double>(to[i]) : 0.0;
      if (!(v - v == 0.0) && i < local.first_bad_old) local.first_bad_old = i;
      const double lp = static_cast<double>(logp[i]);
      if (!log_prob_fits(lp, a > neg_inf() && b > neg_inf()) && i < local.first_bad_log_prob)
        local.first_bad_log_prob = i;
      if (lp > neg_inf()) {
        const double pi = ::exp(lp), c = ref.centred(a, b);
        local.pi_tn += pi * u;
        local.pi_centred_tn += pi * c * u;
        local.pi_to += pi * v;
        local.centring.add(pi, c, lp);
        local.dominant.add(i, lp, 0.0);
      }
    }
    const jvp_scan scan = block_all_reduce(scan_storage, local, merge_jvp_scan{});

    cuda_row_report report = derivative_problem(scan.pair, zn, zo, s, logp, scan.first_bad_log_prob);
    if (report.error == cuda_row_error::none && scan.first_bad_new != no_token)
      report.error = cuda_row_error::not_finite, report.operand = 2, report.token = scan.first_bad_new,
      report.value = static_cast<double>(tn[scan.first_bad_new]);
    if (report.error == cuda_row_error::none && scan.first_bad_old != no_token)
      report.error = cuda_row_error::not_finite, report.operand = operand_tangent_old,
      report.token = scan.first_bad_old, report.value = static_cast<double>(to[scan.first_bad_old]);
    if (record_or_reject(checks, range, r, report, tangent_out, size)) continue;
    T* out = tangent_out.row(r);

    const bool projected = s.status == row_status::projected;
    const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
    const double m = projected ? scan.centring.step<T>() : 0.0;  // the re-centring (top of this file)
    double t_dot = 0.0;
    // The old tangent less its value at the dominant token (detail::old_side_sums): the JVP does
    // not change when every old logit moves alike, and that token's own terms then drop out.
    const double shift = projected && to != nullptr && scan.dominant.found()
                             ? static_cast<double>(to[scan.dominant.top]) : 0.0;
    double pi_to = scan.pi_to;
    if (projected) {
      t_dot = -t / s.sigma2 * (scan.pi_centred_tn - m * scan.pi_tn);
      if (to != nullptr) {
        // Σ_j ∂t/∂z°_j (v_j − shift) over every token z° gives mass to (off J too: there
        // π_j − q_j = −q_j), and Σ_J π (v − shift).
        const double old_max = scan.pair.old.lse.m, log_sum_old = old_log_sum(scan.pair);
        double_pair partial;
        for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
          const double b = static_cast<double>(zo[i]);
          if (!(b > neg_inf())) continue;
          const double lp = static_cast<double>(logp[i]);
          const bool on_support = lp > neg_inf();
          const double pi = on_support ? ::exp(lp) : 0.0;
          const double centred = on_support ? ref.centred(static_cast<double>(zn[i]), b) - m : 0.0;
          const double q = old_probability(b, old_max, log_sum_old);
          const double v = static_cast<double>(to[i]) - shift;
          partial.first += dt_dold(on_support, pi, centred, q, s) * v;
          partial.second += pi * v;
        }
        const double_pair total = block_all_reduce(sum_storage, partial, add_pair{});
        t_dot += total.first;
        pi_to = total.second;
      }
      t_dot += eps_dot / (t * s.sigma2);
    }
    const bool old_term = projected && to != nullptr;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      double value = 0.0;
      if (static_cast<double>(logp[i]) > neg_inf()) {
        const double centred = ref.centred(static_cast<double>(zn[i]), static_cast<double>(zo[i])) - m;
        value = t * (static_cast<double>(tn[i]) - scan.pi_tn) + centred * t_dot;
        if (old_term) value += rest * ((static_cast<double>(to[i]) - shift) - pi_to);
      }
      out[i] = static_cast<T>(value);
    }
  }
}

// ---- project_jacobian ----

/// Rows of `range`: validation (as the CPU's validate_backward without an upstream) and the
/// row's jacobian_row_terms (not written with checks.validate_only).
template <class T>
__global__ void __launch_bounds__(block_threads)
    jacobian_rows_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                         batch_view<const T> log_probs, const projection_stats* stats,
                         jacobian_row_terms* terms, row_range range, device_checks checks) {
  __shared__ reduce_storage<std::size_t> token_storage;
  __shared__ reduce_storage<centring_sums> centring_storage;
  __shared__ reduce_storage<old_side_sums> dominant_storage;
  __shared__ reference_storage ref_storage;
  const std::size_t size = new_logits.cols;
  for_each_pair_row(new_logits, old_logits, range,
                    [&](std::size_t r, const T* zn, const T* zo, const pair_scan& scan) {
    const projection_stats s = stats[r];
    cuda_row_report report = derivative_problem(scan, zn, zo, s);
    // log_probs after the logits and before the stats, as the CPU checks them (block-uniform).
    if (report.error == cuda_row_error::none || report.error == cuda_row_error::bad_stats) {
      const std::size_t bad = block_first_bad_log_prob(log_probs.row(r), zn, zo, size, token_storage);
      if (bad != no_token) {
        report = cuda_row_report{};
        report.error = cuda_row_error::bad_log_probs, report.token = bad;
        report.value = static_cast<double>(log_probs.row(r)[bad]);
      }
    }
    const bool rejected = report.error != cuda_row_error::none;  // block-uniform
    const bool differentiated = !checks.validate_only && !rejected && s.status == row_status::projected;
    const centring_reference ref =
        differentiated ? block_reference(zn, zo, log_probs.row(r), size, s, ref_storage) : plain_reference(s);
    const double m = differentiated ? block_centring(zn, zo, log_probs.row(r), size, ref, centring_storage) : 0.0;
    // The dominant token (π ≥ 1/2), as cpu::jacobian_row's dominant_index finds it (block-uniform).
    unsigned dominant = jacobian_row_terms::no_dominant;
    if (differentiated) {
      old_side_sums local;
      const T* logp = log_probs.row(r);
      for (std::size_t i = threadIdx.x; i < size; i += block_threads) local.add(i, static_cast<double>(logp[i]), 0.0);
      const old_side_sums found = block_all_reduce(dominant_storage, local, merge_old_side{});
      if (found.found()) dominant = static_cast<unsigned>(found.top);
    }
    if (threadIdx.x == 0) {  // no early return: a barrier added below must still see every thread
      record_row(checks, range, r, report);
      if (!checks.validate_only)
        terms[r] = jacobian_row_terms{rejected ? 0.0 : scan.old.lse.m, rejected ? 0.0 : old_log_sum(scan), m,
                                      rejected ? 1 : 0, dominant, ref};
    }
  });
}

/// One entry (row r, output i, input j) of the Jacobians, as cpu::jacobian_row computes it; the
/// entry with j = 0 also writes jac_eps[r·V + i]. Applied by thrust::for_each_n over the
/// flattened index k = (r·V + i)·V + j. Rejected rows get NaN everywhere. The entry of jac_old
/// at a projected row's dominant token j = top is minus the sum of the row's other entries, in
/// the CPU's order (detail::old_side_sums: its own ∂t/∂z° is rounding noise on rows whose other
/// tokens carry tiny masses); the thread that writes it forms those V − 1 entries again.
template <class T>
struct jacobian_entry {
  batch_view<const T> new_logits;
  batch_view<const T> old_logits;
  batch_view<const T> log_probs;
  const projection_stats* stats;
  const jacobian_row_terms* terms;
  T* jac_new;
  T* jac_old;  // may be null
  T* jac_eps;  // may be null

  /// The parts of entry (i, j) of a row that depend on j alone: π_j, whether j is on J, d_j − μ.
  struct column {
    bool on = false;
    double pi = 0.0, centred = 0.0;
  };
  __device__ column column_of(const jacobian_row_terms& row, const T* zn, const T* zo, const T* logp,
                              std::size_t j) const {
    column c;
    const double lp = static_cast<double>(logp[j]);
    c.on = lp > neg_inf();
    if (c.on) {
      c.pi = ::exp(lp);
      c.centred = row.ref.centred(static_cast<double>(zn[j]), static_cast<double>(zo[j])) - row.centring;
    }
    return c;
  }
  /// ∂log π*_i/∂z°_j of a projected row, for an output i on J with d_i − μ = centred_i.
  __device__ double old_entry(const jacobian_row_terms& row, const projection_stats& s, double rest,
                              const T* zo, std::size_t i, double centred_i, std::size_t j, const column& c) const {
    const double delta = i == j ? 1.0 : 0.0;
    double jo = c.on ? rest * (delta - c.pi) : 0.0;
    const double q_j = old_probability(static_cast<double>(zo[j]), row.old_max, row.old_log_sum);
    jo += centred_i * dt_dold(c.on, c.pi, c.centred, q_j, s);
    return jo;
  }

  __device__ void operator()(std::size_t k) const {
    const std::size_t size = new_logits.cols;
    const std::size_t j = k % size, ri = k / size, i = ri % size, r = ri / size;
    const jacobian_row_terms row = terms[r];
    if (row.rejected != 0) {
      const T nan = static_cast<T>(quiet_nan());
      jac_new[k] = nan;
      if (jac_old != nullptr) jac_old[k] = nan;
      if (jac_eps != nullptr && j == 0) jac_eps[ri] = nan;
      return;
    }
    const projection_stats s = stats[r];
    const bool projected = s.status == row_status::projected;
    const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
    const T* zn = new_logits.row(r);
    const T* zo = old_logits.row(r);
    const T* logp = log_probs.row(r);
    const column ci = column_of(row, zn, zo, logp, i), cj = column_of(row, zn, zo, logp, j);
    const double delta = i == j ? 1.0 : 0.0;
    double jn = 0.0;
    if (ci.on && cj.on) {
      jn = t * (delta - cj.pi);
      if (projected) jn -= t * ci.centred * cj.centred * cj.pi / s.sigma2;
    }
    jac_new[k] = static_cast<T>(jn);
    if (jac_old != nullptr) {
      double jo = 0.0;
      if (ci.on && projected) {
        if (row.dominant != jacobian_row_terms::no_dominant && j == row.dominant) {
          double others = 0.0;
          for (std::size_t l = 0; l < size; ++l)
            if (l != j) others += old_entry(row, s, rest, zo, i, ci.centred, l, column_of(row, zn, zo, logp, l));
          jo = 0.0 - others;
        } else {
          jo = old_entry(row, s, rest, zo, i, ci.centred, j, cj);
        }
      }
      jac_old[k] = static_cast<T>(jo);
    }
    if (jac_eps != nullptr && j == 0)
      jac_eps[ri] = static_cast<T>(ci.on && projected ? ci.centred / (t * s.sigma2) : 0.0);
  }
};

/// Writes every entry of the Jacobians of rows `range` (whose terms the row kernel left) with one
/// thrust::for_each_n over a counting iterator, enqueued on `stream` under par_nosync: no
/// allocation, no synchronisation. A failed launch becomes backend_error.
template <class T>
void write_jacobian_entries(const char* function, cudaStream_t stream, row_range range,
                            const jacobian_entry<T>& entry) {
  const std::size_t block = entry.new_logits.cols * entry.new_logits.cols;
  try {
    thrust::for_each_n(thrust::cuda::par_nosync.on(stream),
                       thrust::counting_iterator<std::size_t>(range.begin * block), range.count * block, entry);
  } catch (const thrust::system_error& e) {
    throw backend_error(std::string("troll::") + function + ": thrust::for_each_n failed: " + e.what());
  }
}

/// Bytes of the workspace project_jacobian needs: one jacobian_row_terms per row.

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
