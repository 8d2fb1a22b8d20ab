// troll/detail/cuda/backward_kernels.cuh — the vector–Jacobian product of the projection on the
// device (math.md §3), one block per row, two passes: (1) validation fused with Σ g and
// Σ g·(d − μ) over J = {log π* > −inf}; (2) the write of ∂L/∂z̃ and ∂L/∂z°. Same formulas as
// cpu::vjp_row:
//   ∂L/∂z̃_j = t [ g_j − π_j Σg − π_j (d_j − μ) Σg(d−μ) / σ² ]
//   ∂L/∂z°_j = (1 − t)(g_j − π_j Σg) + Σg(d−μ) · ∂t/∂z°_j,
//        ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²),    ∂L/∂ε = Σg(d−μ) / (t σ²),
//        (detail::dt_dold, troll/detail/tilt_derivatives.hpp: π_j − q_j from the log-ratio)
// with d − μ re-centred by m = Σ_J π (d − μ) where that exceeds its noise, as the CPU
// (detail::centring_sums; pass 1 forms the sums on projected rows).
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../tilt_derivatives.hpp"
#include "block_reduce.cuh"
#include "offset_reference.cuh"
#include "row_report.cuh"
#include "row_scan.cuh"
#include "two_point_block.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

/// Pass 1 of the backward: the pair scan, the first non-finite upstream entry and the two sums.
struct backward_scan {
  pair_scan pair;
  std::size_t first_bad_upstream = no_token;
  std::size_t first_bad_log_prob = no_token;  // log_probs that cannot be log π* (detail::log_prob_fits)
  double sum_g = 0.0;
  double sum_gc = 0.0;  // Σ g (d − μ)
  centring_sums centring;  // Σ π (d − μ) and its noise (projected rows)
};

struct merge_backward_scan {
  __device__ backward_scan operator()(const backward_scan& a, const backward_scan& b) const {
    backward_scan s;
    s.pair = merge(a.pair, b.pair);
    s.first_bad_upstream = a.first_bad_upstream < b.first_bad_upstream ? a.first_bad_upstream : b.first_bad_upstream;
    s.first_bad_log_prob = a.first_bad_log_prob < b.first_bad_log_prob ? a.first_bad_log_prob : b.first_bad_log_prob;
    s.sum_g = a.sum_g + b.sum_g;
    s.sum_gc = a.sum_gc + b.sum_gc;
    s.centring = a.centring + b.centring;
    return s;
  }
};

/// centring_sums as a block reduction operator.
struct merge_centring {
  __device__ centring_sums operator()(const centring_sums& a, const centring_sums& b) const { return a + b; }
};

/// The re-centring m of a projected row (detail::centring_sums over J = {log π* > −inf}) with
/// d − μ formed against `ref` (offset_reference.cuh), by the whole block (all threads call it;
/// the result in every thread).
template <class T>
__device__ double block_centring(const T* zn, const T* zo, const T* log_probs, std::size_t size,
                                 const centring_reference& ref, reduce_storage<centring_sums>& storage) {
  centring_sums local;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
    const double lp = static_cast<double>(log_probs[i]);
    if (lp > neg_inf()) local.add(::exp(lp), ref.centred(static_cast<double>(zn[i]), static_cast<double>(zo[i])), lp);
  }
  return block_all_reduce(storage, local, merge_centring{}).template step<T>();
}

/// old_side_sums as a block reduction operator.
struct merge_old_side {
  __device__ old_side_sums operator()(const old_side_sums& a, const old_side_sums& b) const { return a + b; }
};

/// The field of `s` a backward pass cannot use (cuda_row_report::operand for bad_stats: 0 t,
/// 1 sigma2, 2 mu, 3 status, 4 kl_after), or −1. Mirrors check_stats of troll/backward.hpp.
__device__ inline int unusable_stats_field(const projection_stats& s) {
  switch (s.status) {
    case row_status::inactive:
    case row_status::restricted:
      return -1;
    case row_status::projected:
      if (!(s.t > 0.0 && s.t <= 1.0)) return 0;
      if (!(s.sigma2 > 0.0 && s.sigma2 < inf())) return 1;
      if (!(s.mu - s.mu == 0.0)) return 2;
      if (!(s.kl_after >= 0.0 && s.kl_after < inf())) return 4;
      return -1;
    default:
      return 3;
  }
}

/// Makes `report` bad_stats naming the field of `s` a backward pass cannot use
/// (unusable_stats_field), with the status in `value` when the field is the status (3), so that
/// the host words it as the CPU's check_stats does (not_converged apart). Leaves it otherwise.
__device__ inline void report_unusable_stats(const projection_stats& s, cuda_row_report& report) {
  const int field = unusable_stats_field(s);
  if (field < 0) return;
  report.error = cuda_row_error::bad_stats, report.operand = field;
  if (field == 3) report.value = static_cast<double>(static_cast<int>(s.status));
}

/// The problem of a row a derivative of project() reads, in the order of the CPU's
/// validate_backward: the logits pair, log_probs (find_bad_log_prob's rules, first failing at
/// `first_bad_log_prob`; no_token
/// where the caller has no log_probs), then the statistics (t, σ², μ, status, kl_after).
template <class T>
__device__ cuda_row_report derivative_problem(const pair_scan& scan, const T* zn, const T* zo,
                                              const projection_stats& s, const T* log_probs = nullptr,
                                              std::size_t first_bad_log_prob = no_token) {
  cuda_row_report report = pair_problem(scan, zn, zo);
  if (report.error != cuda_row_error::none) return report;
  if (first_bad_log_prob != no_token) {
    report.error = cuda_row_error::bad_log_probs, report.token = first_bad_log_prob;
    report.value = static_cast<double>(log_probs[first_bad_log_prob]);
    return report;
  }
  report_unusable_stats(s, report);
  return report;
}

/// The first token at which log_probs cannot be the forward's log π* (detail::log_prob_fits: NaN,
/// +inf, above 0, above −inf where a logit is −inf, or −inf where both are finite; no_token:
/// none), by the whole block.
template <class T>
__device__ std::size_t block_first_bad_log_prob(const T* log_probs, const T* new_logits, const T* old_logits,
                                                std::size_t size, reduce_storage<std::size_t>& storage) {
  std::size_t first = no_token;
  for (std::size_t i = threadIdx.x; i < size && first == no_token; i += block_threads) {
    const double lp = static_cast<double>(log_probs[i]);
    const bool open = static_cast<double>(new_logits[i]) > neg_inf() && static_cast<double>(old_logits[i]) > neg_inf();
    if (!log_prob_fits(lp, open)) first = i;
  }
  return block_all_reduce(storage, first, min_token{});
}

/// q_j = exp(z°_j − M° − log Σ e^{z° − M°}), 0 where z°_j = −inf.
__device__ inline double old_probability(double old_logit, double old_max, double old_log_sum) {
  return old_logit > neg_inf() ? ::exp((old_logit - old_max) - old_log_sum) : 0.0;
}

/// Rows of `range`: grad_new (and grad_old when grad_old.rows != 0, grad_eps when not null) from
/// the upstream gradient g = ∂L/∂log π*. Rejected rows get NaN gradients.
template <class T>
__global__ void __launch_bounds__(block_threads, solver_blocks_per_sm)
    project_backward_kernel(batch_view<const T> new_logits, batch_view<const T> old_logits,
                            batch_view<const T> log_probs, const projection_stats* stats,
                            batch_view<const T> grad_log_probs, batch_view<T> grad_new,
                            batch_view<T> grad_old, T* grad_eps, row_range range, device_checks checks) {
  __shared__ reduce_storage<backward_scan> scan_storage;
  __shared__ reduce_storage<old_side_sums> old_storage;
  __shared__ reference_storage ref_storage;
  __shared__ two_point_storage pair_storage;
  const std::size_t size = new_logits.cols, end = range.begin + range.count;
  const bool want_old = grad_old.rows != 0;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const T* zn = new_logits.row(r);
    const T* zo = old_logits.row(r);
    const T* logp = log_probs.row(r);
    const T* g = grad_log_probs.row(r);
    const projection_stats s = stats[r];
    const centring_reference ref = block_reference(zn, zo, logp, size, s, ref_storage);  // d − μ from here
    const bool projected = s.status == row_status::projected;

    backward_scan local;
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double a = static_cast<double>(zn[i]), b = static_cast<double>(zo[i]);
      add(local.pair, i, a, b);
      const double gi = static_cast<double>(g[i]);
      if (!(gi - gi == 0.0) && i < local.first_bad_upstream) local.first_bad_upstream = i;
      const double lp = static_cast<double>(logp[i]);
      if (!log_prob_fits(lp, a > neg_inf() && b > neg_inf()) && i < local.first_bad_log_prob)
        local.first_bad_log_prob = i;
      if (lp > neg_inf()) {
        const double c = ref.centred(a, b);
        local.sum_g += gi;
        local.sum_gc += gi * c;
        if (projected) local.centring.add(::exp(lp), c, lp);
      }
    }
    const backward_scan scan = block_all_reduce(scan_storage, local, merge_backward_scan{});

    cuda_row_report report = derivative_problem(scan.pair, zn, zo, s, logp, scan.first_bad_log_prob);
    if (report.error == cuda_row_error::none && scan.first_bad_upstream != no_token)
      report.error = cuda_row_error::not_finite, report.operand = 2, report.token = scan.first_bad_upstream,
      report.value = static_cast<double>(g[scan.first_bad_upstream]);
    if (threadIdx.x == 0) record_row(checks, range, r, report);
    if (checks.validate_only) continue;

    T* out_new = grad_new.row(r);
    T* out_old = want_old ? grad_old.row(r) : nullptr;
    if (report.error != cuda_row_error::none) {
      fill_nan(out_new, size);
      fill_nan(out_old, size);
      if (threadIdx.x == 0 && grad_eps != nullptr) grad_eps[r] = static_cast<T>(quiet_nan());
      continue;
    }

    const double m = projected ? scan.centring.step<T>() : 0.0;  // the re-centring (top of this file)
    const double sum_gc = scan.sum_gc - m * scan.sum_g;
    const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
    const double h_over_var = projected ? sum_gc / s.sigma2 : 0.0;
    const double old_max = scan.pair.old.lse.m, log_sum_old = old_log_sum(scan.pair);
    old_side_sums old_sums, new_sums;
    double largest = 0.0, widest_g = 0.0;  // this thread's max |gn| and |g| (two_point_suspect)
    for (std::size_t i = threadIdx.x; i < size; i += block_threads) {
      const double lp = static_cast<double>(logp[i]);
      const bool on_support = lp > neg_inf();
      const double pi = ::exp(lp);
      const double a = static_cast<double>(zn[i]), b = static_cast<double>(zo[i]);
      const double centred = on_support ? ref.centred(a, b) - m : 0.0;
      const double gb = on_support ? static_cast<double>(g[i]) : 0.0;
      const double explicit_part = gb - pi * scan.sum_g;
      const double gn = t * (explicit_part - pi * centred * h_over_var);
      new_sums.add(i, lp, gn);
      out_new[i] = static_cast<T>(gn);
      largest = larger_of{}(largest, ::fabs(gn));
      widest_g = larger_of{}(widest_g, ::fabs(gb));
      if (out_old == nullptr) continue;
      if (!projected) {
        out_old[i] = T(0);
        continue;
      }
      const double q = old_probability(b, old_max, log_sum_old);
      const double value = rest * explicit_part + sum_gc * dt_dold(on_support, pi, centred, q, s);
      old_sums.add(i, lp, value);
      out_old[i] = static_cast<T>(value);
    }
    if (out_old != nullptr && projected) {  // block-uniform; the dominant token's from the others'
      const old_side_sums total = block_all_reduce(old_storage, old_sums, merge_old_side{});
      if (threadIdx.x == 0 && total.found()) out_old[total.top] = static_cast<T>(total.top_entry());
    }
    {  // ∂L/∂z̃ sums to 0 too: its dominant token's entry from the others' (the CPU's
       // new_side_dominant; every thread reaches this, its barriers order the writes above)
      const old_side_sums total = block_all_reduce(old_storage, new_sums, merge_old_side{});
      if (threadIdx.x == 0 && total.found()) out_new[total.top] = static_cast<T>(total.top_entry());
    }
    if (projected) {  // block-uniform: the two-point rule (troll/detail/two_point.hpp), as the CPU
      const two_point_frame f{t, scan.sum_g, h_over_var, two_point_pi_ulps<T>()};
      heavy_pair h;
      const two_point_values tp = group_two_point(
          two_point_block{pair_storage}, size, f, largest, widest_g,
          [&](std::size_t j) { return static_cast<double>(logp[j]); },
          [&](std::size_t j, double& a, double& b) { a = static_cast<double>(zn[j]), b = static_cast<double>(zo[j]); },
          [&](std::size_t j) { return static_cast<double>(g[j]); },
          [&](std::size_t j) { return ref.centred(static_cast<double>(zn[j]), static_cast<double>(zo[j])) - m; }, h);
      if (threadIdx.x == 0 && tp.take)
        out_new[h.first] = static_cast<T>(tp.v1), out_new[h.second] = static_cast<T>(tp.v2);
    }
    if (threadIdx.x == 0 && grad_eps != nullptr)
      grad_eps[r] = static_cast<T>(projected ? sum_gc / (s.t * s.sigma2) : 0.0);
  }
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
