// troll/detail/cuda/row_scan.cuh — the first pass over a row on the device: validation (NaN,
// +inf, all-masked rows, disjoint supports) fused with what the solve needs (max and log-sum of
// each row, the centring shifts). The device counterpart of cpu::scan_pair, as one mergeable
// summary per thread reduced over the block.
#pragma once

#include <cstddef>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../trust_region_solver.hpp"
#include "block_reduce.cuh"
#include "row_report.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

constexpr std::size_t no_token = ~std::size_t(0);

/// One operand of a row: its first NaN / +inf and log Σ exp(z) as an lse_state of the pairs
/// (z_i, 0), so lse.m = max z and lse.log_sum() = log Σ e^z (−inf entries add nothing).
struct row_scan {
  std::size_t first_bad = no_token;
  lse_state lse;
};

__device__ inline void add(row_scan& s, std::size_t token, double z) {
  if (!(z < inf())) {
    if (token < s.first_bad) s.first_bad = token;
    return;
  }
  push(s.lse, z, 0.0);
}

__device__ inline row_scan merge(const row_scan& a, const row_scan& b) {
  return row_scan{a.first_bad < b.first_bad ? a.first_bad : b.first_bad, merge(a.lse, b.lse)};
}

struct merge_row_scan {
  __device__ row_scan operator()(const row_scan& a, const row_scan& b) const { return merge(a, b); }
};

/// A (new, old) pair of rows: both operands' scans, the support flags of row_setup, and the
/// arg-max over the joint support of each operand (lowest token on ties) with d = z̃ − z° there.
struct pair_scan {
  row_scan fresh;  // the new / p row
  row_scan old;    // the old / q row
  bool new_only = false;
  bool old_only = false;
  double best_new = neg_inf();
  std::size_t at_new = no_token;
  double partner_new = 0.0;  // z° at the arg-max of z̃ over J
  double best_old = neg_inf();
  std::size_t at_old = no_token;
  double partner_old = 0.0;  // z̃ at the arg-max of z° over J
};

__device__ inline void add(pair_scan& s, std::size_t token, double a, double b) {
  add(s.fresh, token, a);
  add(s.old, token, b);
  const bool finite_new = a > neg_inf(), finite_old = b > neg_inf();
  s.new_only = s.new_only || (finite_new && !finite_old);
  s.old_only = s.old_only || (!finite_new && finite_old);
  if (!(finite_new && finite_old)) return;
  // Tokens arrive in increasing order within a thread: strict > keeps the lowest on ties.
  if (a > s.best_new) s.best_new = a, s.at_new = token, s.partner_new = b;
  if (b > s.best_old) s.best_old = b, s.at_old = token, s.partner_old = a;
}

/// Larger value wins, the lower token on ties (the CPU's first-occurrence arg-max).
__device__ inline bool wins(double value, std::size_t token, double other_value, std::size_t other_token) {
  return value > other_value || (value == other_value && token < other_token);
}

__device__ inline pair_scan merge(const pair_scan& a, const pair_scan& b) {
  pair_scan s;
  s.fresh = merge(a.fresh, b.fresh);
  s.old = merge(a.old, b.old);
  s.new_only = a.new_only || b.new_only;
  s.old_only = a.old_only || b.old_only;
  const pair_scan& n = wins(a.best_new, a.at_new, b.best_new, b.at_new) ? a : b;
  s.best_new = n.best_new, s.at_new = n.at_new, s.partner_new = n.partner_new;
  const pair_scan& o = wins(a.best_old, a.at_old, b.best_old, b.at_old) ? a : b;
  s.best_old = o.best_old, s.at_old = o.at_old, s.partner_old = o.partner_old;
  return s;
}

struct merge_pair_scan {
  __device__ pair_scan operator()(const pair_scan& a, const pair_scan& b) const { return merge(a, b); }
};

/// Report for a NaN / +inf found at `token` of `operand`.
__device__ inline cuda_row_report bad_value_report(int operand, std::size_t token, double value) {
  cuda_row_report r;
  r.error = value != value ? cuda_row_error::nan_value : cuda_row_error::pos_inf;
  r.operand = operand;
  r.token = token;
  return r;
}

/// The problem of a single row (log_softmax): a NaN / +inf, or no finite entry.
template <class T>
__device__ cuda_row_report single_problem(const row_scan& s, const T* z) {
  cuda_row_report r;
  if (s.first_bad != no_token) return bad_value_report(0, s.first_bad, static_cast<double>(z[s.first_bad]));
  if (s.lse.empty()) r.error = cuda_row_error::all_masked;
  return r;
}

/// The problem of a row pair, in the order the CPU's scan_pair reports them: the first token at
/// which either row holds a NaN / +inf (the new row's on a tie: scan_pair walks both rows
/// together), then an all −inf new row, old row, disjoint supports.
template <class T>
__device__ cuda_row_report pair_problem(const pair_scan& s, const T* zn, const T* zo) {
  cuda_row_report r;
  const std::size_t bad_new = s.fresh.first_bad, bad_old = s.old.first_bad;
  if (bad_new != no_token && (bad_old == no_token || bad_new <= bad_old))
    return bad_value_report(0, bad_new, static_cast<double>(zn[bad_new]));
  if (bad_old != no_token) return bad_value_report(1, bad_old, static_cast<double>(zo[bad_old]));
  if (s.fresh.lse.empty()) {
    r.error = cuda_row_error::all_masked;
  } else if (s.old.lse.empty()) {
    r.error = cuda_row_error::all_masked;
    r.operand = 1;
  } else if (s.at_new == no_token) {
    r.error = cuda_row_error::disjoint;
  }
  return r;
}

/// pair_problem for kl and kl_backward: disjoint supports are no error there (KL = +inf), as the
/// CPU's validate_pairs has it.
template <class T>
__device__ cuda_row_report kl_pair_problem(const pair_scan& s, const T* zp, const T* zq) {
  const cuda_row_report r = pair_problem(s, zp, zq);
  return r.error == cuda_row_error::disjoint ? cuda_row_report{} : r;
}

/// The solver's view of a scanned pair.
__device__ inline row_setup make_setup(const pair_scan& s) {
  row_setup setup;
  setup.old_max = s.old.lse.m;
  setup.new_top = tilt_ref{s.best_new, s.partner_new};
  setup.old_top = tilt_ref{s.partner_old, s.best_old};
  setup.new_only = s.new_only;
  setup.old_only = s.old_only;
  return setup;
}

/// log Σ_i exp(z°_i − M°): log q_i = z°_i − M° − old_log_sum.
__device__ inline double old_log_sum(const pair_scan& s) { return ::log(s.old.lse.s0); }

/// Scans one row pair with the whole block; every thread gets the block's summary.
template <class T>
__device__ pair_scan scan_pair_row(const T* zn, const T* zo, std::size_t size,
                                   reduce_storage<pair_scan>& storage) {
  pair_scan local;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads)
    add(local, i, static_cast<double>(zn[i]), static_cast<double>(zo[i]));
  return block_all_reduce(storage, local, merge_pair_scan{});
}

/// The grid-stride loop of the dense row-pair kernels: the block takes rows range.begin +
/// blockIdx.x, then every gridDim.x-th row of `range`, scans each pair with scan_pair_row and
/// calls body(r, zp, zq, scan) (returning from the body ends that row).
template <class T, class Body>
__device__ void for_each_pair_row(batch_view<const T> p_logits, batch_view<const T> q_logits, row_range range,
                                  Body&& body) {
  __shared__ reduce_storage<pair_scan> storage;
  const std::size_t size = p_logits.cols, end = range.begin + range.count;
  for (std::size_t r = range.begin + blockIdx.x; r < end; r += gridDim.x) {
    const T* zp = p_logits.row(r);
    const T* zq = q_logits.row(r);
    const pair_scan scan = scan_pair_row(zp, zq, size, storage);
    body(r, zp, zq, scan);
  }
}

/// Scans one row with the whole block; every thread gets the block's summary.
template <class T>
__device__ row_scan scan_row(const T* z, std::size_t size, reduce_storage<row_scan>& storage) {
  row_scan local;
  for (std::size_t i = threadIdx.x; i < size; i += block_threads) add(local, i, static_cast<double>(z[i]));
  return block_all_reduce(storage, local, merge_row_scan{});
}

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
