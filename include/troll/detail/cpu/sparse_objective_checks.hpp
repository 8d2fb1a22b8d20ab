// troll/detail/cpu/sparse_objective_checks.hpp — the sparse objective's row checks (the dense new logits' scan, the
// lumped pair's feasibility, the token data), kept out of the public
// <troll/sparse_objectives.hpp>. Host-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../batch.hpp"
#include "../../config.hpp"
#include "objective_kernels.hpp"
#include "objective_scratch.hpp"
#include "parallel.hpp"
#include "row_kernels.hpp"
#include "sparse_kernels.hpp"
#include "../objective_arguments.hpp"
#include "../objective_row.hpp"
#include "../row_problem.hpp"
#include "../sparse_row.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../../objectives.hpp"
#include "../../projection_types.hpp"
#include "../../sparse.hpp"
#include "../../sparse_objective_types.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// One pass over a dense logit row: its first NaN / +inf, whether it has no finite entry, and
/// whether any entry is −inf (a masked token).
struct logit_scan {
  row_problem problem;
  bool any_masked = false;
  double highest = neg_inf(), lowest = inf();  // over the finite logits
};

template <class T>
logit_scan scan_logits(const T* z, std::size_t size, const char* operand) {
  logit_scan s;
  bool any_finite = false;
  cpu::for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    if (s.problem) return;
    const cpu::block_array a = cpu::load(z, begin, count);
    const double top = a.template maxCoeff<Eigen::PropagateNaN>();
    if (!(top < inf())) {
      s.problem = cpu::find_bad_value(z + begin, std::size_t(count), operand);
      s.problem.entry += static_cast<long long>(begin);
      return;
    }
    any_finite = any_finite || top > neg_inf();
    const double bottom = a.minCoeff();
    s.any_masked = s.any_masked || bottom == neg_inf();
    s.highest = maximum(s.highest, top);
    s.lowest = minimum(s.lowest, bottom > neg_inf() ? bottom : (a > neg_inf()).select(a, inf()).minCoeff());
  });
  if (!s.problem && !any_finite) {
    s.problem.kind = row_error::all_masked;
    s.problem.operand = operand;
  }
  return s;
}

/// Room for one aligned row on the stack (validation builds rows it must not write).
template <class T>
struct aligned_row_buffer {
  sparse_index indices[sparse_max_entries];
  T new_log_probs[sparse_max_entries];
  T old_log_probs[sparse_max_entries];
  T new_log_remainder;
  T old_log_remainder;
  sparse_index count;

  aligned_batch_view<T> view(std::size_t vocab) {
    return aligned_batch_view<T>{indices,
                                 &count,
                                 new_log_probs,
                                 old_log_probs,
                                 &new_log_remainder,
                                 &old_log_remainder,
                                 1,
                                 std::size_t(sparse_max_entries),
                                 vocab};
  }
};

/// Writes row `r_out` of `out`: U = S_new ∪ S_old (the new row's sparsify prefix, then the old
/// entries it lacks, as align orders them), the new side gathered exactly from the dense row z
/// (log p̃_i = z_i − logsumexp(z), bucket = the exact log tail mass over V∖U), the old side
/// aligned as in align (uniform tail value on U∖S_old, shrunk bucket). Two passes over z (the
/// sparsify scan, the log-sums). The caller has validated both rows and out's capacity.
template <class T>
void gather_aligned_row(const T* z, std::size_t vocab, const sparse_batch_view<const T>& old_rows,
                        std::size_t r, int new_k, double log_delta,
                        const aligned_batch_view<T>& out, std::size_t r_out) {
  sparse_index new_indices[sparsify_max_k + 1];
  double new_values[sparsify_max_k + 1];
  int new_count = 0;
  if (new_k > 0) {
    sparsify_state st;
    reset(st, new_k, -1, static_cast<sparse_index>(vocab), 0, static_cast<sparse_index>(vocab));
    cpu::sparsify_scan(z, vocab, 0, st);
    double unused_remainder = 0.0;
    finalize(st, log_delta, new_indices, new_values, new_count, unused_remainder);
  }
  index_slot scratch[sparse_max_entries];
  int new_pos[sparse_max_entries], old_pos[sparse_max_entries];
  const int old_count = int(old_rows.count(r));
  sparse_index* indices = out.indices + r_out * out.k_max;
  const int u = union_support(new_indices, new_count, old_rows.row_indices(r), old_count, scratch,
                              indices, new_pos, old_pos);
  for (int i = 0; i < u; ++i) scratch[i] = index_slot{indices[i], i};
  sort_by_index(scratch, u);
  const row_log_sums sums = cpu::log_sums_outside(z, vocab, scratch, u);
  const long long m_old = static_cast<long long>(vocab) - old_count;
  const long long m_u = static_cast<long long>(vocab) - u;
  const double lr_old = double(old_rows.log_remainder[r]);
  const double tail_old = tail_log_value(lr_old, m_old);
  T* ln = out.new_log_probs + r_out * out.k_max;
  T* lo = out.old_log_probs + r_out * out.k_max;
  for (int i = 0; i < u; ++i) {
    ln[i] = T(sums.log_prob(double(z[indices[i]])));
    lo[i] = old_pos[i] >= 0 ? old_rows.row_log_probs(r)[old_pos[i]] : T(tail_old);
  }
  out.counts[r_out] = u;
  out.new_log_remainder[r_out] = T(sums.stored_log_remainder());
  out.old_log_remainder[r_out] = T(shrink_log_remainder(lr_old, m_old, m_u));
  pad_row(indices, ln, std::size_t(u), out.k_max);
  for (std::size_t i = std::size_t(u); i < out.k_max; ++i) lo[i] = T(neg_inf());
}

/// The lumped category (index into lumped_pair's arrays) of token `a` of aligned row r, or −1.
template <class T>
int lumped_category_of(const aligned_batch_view<const T>& a, std::size_t r, const int* slot, int n,
                       std::int64_t token) {
  const sparse_index* indices = a.indices + r * a.k_max;
  int position = -1;
  for (int i = 0; i < int(a.counts[r]); ++i)
    if (indices[i] == token) position = i;
  if (position < 0) return -1;
  for (int j = 0; j < n; ++j)
    if (slot[j] == position) return j;
  return -1;
}

/// The first checks of a sparse objective's row r, shared by forward and backward: the token
/// data, then the dense new logits (their scan is left in `scan`).
template <class T>
row_problem check_token_and_logits(const token_batch<T>& in, std::size_t r, batch_view<const T> new_logits,
                                   logit_scan& scan) {
  const row_problem token = check_token_row(in, r, new_logits.cols, static_cast<const T*>(nullptr));
  if (token) return token;
  scan = scan_logits(new_logits.row(r), new_logits.cols, "new_logits");
  return scan.problem;
}
template <class T>
row_problem check_token_and_logits(const token_batch<T>& in, std::size_t r, batch_view<const T> new_logits) {
  logit_scan scan;
  return check_token_and_logits(in, r, new_logits, scan);
}

}  // namespace detail

TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
