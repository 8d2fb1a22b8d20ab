// troll/detail/cpu/sparse_checks.hpp — the CPU sparse entry points' row checks and the row helpers
// they share (validation of sparse and aligned rows, the lumped (|U|+1)-category pair, the union's
// capacity, writing a lumped row back), kept out of the public <troll/sparse.hpp>. Host-only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "../../backward.hpp"
#include "../../batch.hpp"
#include "../../config.hpp"
#include "backward_kernels.hpp"
#include "parallel.hpp"
#include "row_kernels.hpp"
#include "sparse_backward_rows.hpp"
#include "sparse_fast_checks.hpp"
#include "sparse_kernels.hpp"
#include "sparse_lumped_rows.hpp"
#include "../row_problem.hpp"
#include "../sparse_arguments.hpp"
#include "../sparse_row.hpp"
#include "../../errors.hpp"
#include "../../execution.hpp"
#include "../workspace.hpp"
#include "../../workspace.hpp"
#include "../../kl.hpp"
#include "../../projection_types.hpp"
#include "../../sparse_types.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {

/// Runs check(r) → row_problem over the rows [from, rows) and throws the problem of the lowest
/// bad row. Every entry point's checks run this way, row by row: check(r) runs every check of row
/// r in the documented order, so the row reported is the lowest row with any problem (as the
/// device's per-row reports), whatever its problem.
template <class Check>
void first_row_problem(const char* fn, unsigned threads, std::size_t rows, std::size_t work,
                          Check&& check, std::size_t from = 0) {
  if (from >= rows) return;
  const std::size_t bad =
      cpu::first_bad_row(threads, rows - from, work, [&](std::size_t i) { return bool(check(from + i)); });
  if (bad != rows - from) throw_row_problem(fn, from + bad, check(from + bad));
}

/// first_row_problem over checks that sort a row: check(r, scratch), `scratch` holding
/// sparse_max_entries slots on the checking thread's stack (4·sparse_max_entries work a row).
template <class Check>
void first_sorted_row_problem(const char* fn, unsigned threads, std::size_t rows, Check&& check,
                              std::size_t from = 0, std::size_t work = 4 * std::size_t(sparse_max_entries)) {
  first_row_problem(fn, threads, rows, work, [&](std::size_t r) {
    index_slot scratch[sparse_max_entries];
    return check(r, scratch);
  }, from);
}

template <class T>
row_problem check_sparse_row_of(const sparse_batch_view<T>& v, std::size_t r,
                                        const char* name, index_slot* scratch) {
  return cpu::check_sparse_row(v.row_indices(r), v.row_log_probs(r), v.count(r), v.log_remainder[r],
                               v.k_max, v.vocab, name, scratch);
}

/// Row r of a support used for its ids (sparsify_backward's, which reads of its values only which
/// are −inf, and align's new_support): its count, indices (in [0, V), distinct) and values (not
/// NaN, ≤ 0) checked as check_sparse_row
/// does without the remainder and mass rules; with `indices_only` its values are not read at all
/// (sparsify_tail_sums, align's new_support). The device's warp_check_sparse_row with
/// remainder_rules = false.
template <class T>
row_problem check_support_row(const sparse_batch_view<T>& support, std::size_t r, const char* name,
                              index_slot* scratch, bool indices_only = false) {
  return cpu::check_sparse_row(support.row_indices(r), indices_only ? nullptr : support.row_log_probs(r),
                               support.count(r), T(0), support.k_max, support.vocab, name, scratch, false);
}

/// The first NaN or infinite entry of an upstream sparse gradient's row r (entries −1 = the
/// bucket, then 0 … count − 1), as a problem naming `operand`.
template <class T>
row_problem check_grad_row(const sparse_grad_view<const T>& grad, std::size_t r, long long count,
                                   const char* operand) {
  row_problem p;
  for (long long i = -1; i < count; ++i) {
    const double g = i < 0 ? double(grad.log_remainder[r]) : double(grad.row(r)[i]);
    if (!(g - g == 0.0)) {
      p.kind = row_error::sparse_nan;
      p.operand = operand;
      p.entry = i;
      p.value = g;
      return p;
    }
  }
  return p;
}

/// The problem of row r's sampled token (none where `sampled` is null or the id is in [0, vocab)).
inline row_problem sampled_problem(const token_id* sampled, std::size_t r, std::size_t vocab) {
  if (sampled != nullptr && (sampled[r] < 0 || std::size_t(sampled[r]) >= vocab))
    return make_problem(row_error::bad_sampled, "", 0, double(sampled[r]), double(vocab));
  return row_problem{};
}

/// A sampled token outside [0, vocab) (where `sampled` is given), then NaN / +inf anywhere in a
/// shard's logits (an all −inf shard is fine: another shard may hold the mass), row by row; throws
/// the lowest bad row's problem (as the device's per-row reports).
template <class T>
void validate_shard_values(const char* fn, unsigned threads, batch_view<const T> shard_logits,
                           const token_id* sampled = nullptr, std::size_t vocab = 0) {
  auto problem = [&](std::size_t r) {
    const row_problem p = sampled_problem(sampled, r, vocab);
    return p ? p : cpu::find_bad_value(shard_logits.row(r), shard_logits.cols, "shard_logits");
  };
  const std::size_t bad = cpu::first_bad_row(threads, shard_logits.rows, shard_logits.cols,
                                             [&](std::size_t r) { return bool(problem(r)); });
  if (bad != shard_logits.rows) throw_row_problem(fn, bad, problem(bad));
}

/// Whether row r of a sparse batch passes check_sparse_row (the fast yes/no checks).
template <class T>
bool sparse_row_fine(const sparse_batch_view<T>& v, std::size_t r, sparse_index* table) {
  return cpu::sparse_indices_fine(v.row_indices(r), v.count(r), v.k_max, v.vocab, table) &&
         cpu::sparse_values_fine(v.row_log_probs(r), v.count(r), v.log_remainder[r], v.vocab);
}

/// The problem of row r of a sparse batch, if any (check_sparse_row): the fast yes/no checks
/// first (sparse_row_fine), the full ones, which name the problem, only for a row they refuse.
template <class T>
row_problem sparse_row_problem(const sparse_batch_view<T>& v, std::size_t r, const char* name, index_slot* scratch) {
  sparse_index table[cpu::distinct_table_slots];
  return sparse_row_fine(v, r, table) ? row_problem{} : check_sparse_row_of(v, r, name, scratch);
}

/// Sampled tokens must lie in [0, V).

/// The lumped (|U|+1)-category rows of aligned row r: new and old logits on the support entries
/// and the bucket. Categories that are −inf on both sides carry no mass in any π_t and are left
/// out (the dense row maths wants each token finite on at least one side); slot[j] is the entry
/// of lumped category j (count = the bucket). Returns the number of categories kept.
template <class T>
int lumped_pair(const aligned_batch_view<const T>& a, std::size_t r, double* zn, double* zo, int* slot) {
  const int count = static_cast<int>(a.counts[r]);
  const bool tail = static_cast<long long>(a.vocab) > count;
  const T* new_lp = a.new_log_probs + r * a.k_max;
  const T* old_lp = a.old_log_probs + r * a.k_max;
  // Widen every entry (a loop the compiler vectorises), then drop the categories masked on both
  // sides, which are rare, in a second pass only when there are any.
  // Separate loops: GCC vectorises each (one mixing the widening, the ids and the test did not).
  for (int i = 0; i < count; ++i) zn[i] = double(new_lp[i]);
  for (int i = 0; i < count; ++i) zo[i] = double(old_lp[i]);
  for (int i = 0; i < count; ++i) slot[i] = i;
  int both_masked = 0;
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  for (int i = 0; i < count; ++i) both_masked |= int(new_lp[i] == lowest) & int(old_lp[i] == lowest);
  zn[count] = tail ? double(a.new_log_remainder[r]) : neg_inf();
  zo[count] = tail ? double(a.old_log_remainder[r]) : neg_inf();
  slot[count] = count;
  both_masked |= int(zn[count] == neg_inf()) & int(zo[count] == neg_inf());
  if (both_masked == 0) return count + 1;
  int n = 0;
  for (int i = 0; i <= count; ++i) {
    if (zn[i] == neg_inf() && zo[i] == neg_inf()) continue;
    zn[n] = zn[i];
    zo[n] = zo[i];
    slot[n] = i;
    ++n;
  }
  return n;
}

/// lumped_pair and scan_pair's setup of aligned row r (solver-ready): the common row, every
/// category finite on both sides, in one pass of the caller's type (cpu::lumped_pair_finite),
/// any other through lumped_pair and scan_pair. Returns the number of categories kept.
template <class T>
int lumped_pair_setup(const aligned_batch_view<const T>& a, std::size_t r, double* zn, double* zo, int* slot,
                      row_setup& setup) {
  const int count = static_cast<int>(a.counts[r]);
  const std::size_t at = r * a.k_max;
  const T masked = T(neg_inf());
  const bool tail = a.vocab > std::size_t(count);
  if (cpu::lumped_pair_finite(a.new_log_probs + at, a.old_log_probs + at, count,
                              tail ? a.new_log_remainder[r] : masked, tail ? a.old_log_remainder[r] : masked, zn, zo,
                              setup))
    return count + 1;  // slot[j] = j: not written (write_lumped_row reads slot only when n < count + 1)
  const int n = lumped_pair(a, r, zn, zo, slot);
  cpu::scan_pair(zn, zo, std::size_t(n), setup, "", "");
  return n;
}

namespace cpu {
/// The lowest index j of a shard row z (global token offset + j) whose logit is above `tail_max`
/// and whose token is not among ids[0..count), or −1: sparsify_tail_sums' check that tail_max
/// bounds the row's tail. Blocks of 64 logits are compared in one vectorised pass; only a block
/// with a logit above tail_max (mostly the support's own tokens) is walked, its hits looked up in
/// the ids.
template <class T>
long long first_tail_above(const T* z, std::size_t size, std::size_t offset, const sparse_index* ids,
                           long long count, double tail_max) {
  constexpr std::size_t block = 64;
  for (std::size_t begin = 0; begin < size; begin += block) {
    const std::size_t end = begin + block < size ? begin + block : size;
    int any = 0;
    for (std::size_t j = begin; j < end; ++j) any |= int(static_cast<double>(z[j]) > tail_max);
    if (!any) continue;
    for (std::size_t j = begin; j < end; ++j) {
      if (!(static_cast<double>(z[j]) > tail_max)) continue;
      bool held = false;
      for (long long i = 0; i < count && !held; ++i) held = static_cast<std::size_t>(ids[i]) == offset + j;
      if (!held) return static_cast<long long>(j);
    }
  }
  return -1;
}
}  // namespace cpu

/// cpu::first_bad_row for checks that test distinct ids: the rows in runs of 256, each run on one
/// thread with one distinct_ids_scratch (on its stack, cleared once per run); check(r, scratch)
/// says whether row r is bad. Returns the lowest bad row, or rows.
template <class Check>
std::size_t first_bad_row_with_ids(unsigned threads, std::size_t rows, std::size_t work_per_row, Check&& check) {
  constexpr std::size_t run = 256;
  std::atomic<std::size_t> first{rows};
  cpu::parallel_for(threads, (rows + run - 1) / run, run * work_per_row, [&](std::size_t b) {
    cpu::distinct_ids_scratch scratch;
    const std::size_t end = std::min(rows, (b + 1) * run);
    for (std::size_t r = b * run; r < end; ++r) {
      if (r >= first.load(std::memory_order_relaxed)) return;
      if (check(r, scratch)) {
        cpu::lower_to(first, r);
        return;
      }
    }
  });
  return first.load();
}

/// What check_lumped refuses on a lumped row pair besides NaN / +inf and all-masked sides.
struct lumped_checks {
  double eps = 0.0;         ///< > 0: a floor KL(π_0+ ‖ q) ≥ eps (infeasible at eps)
  bool disjoint_ok = false;  ///< a KL: disjoint supports are +inf there (as the dense kl), not an error
  bool regression = false;   ///< new mass on a category the old row has none on (KL(p̃ ‖ π*) = +inf)
  /// The output's capacity (the projection's out.k_max): a row with more entries is refused after
  /// the lumped scan and before infeasibility, the device's order.
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
};

/// The checks the projection, the KL and the regression term need on the lumped pair of aligned
/// row r: disjoint supports (unless `disjoint_ok`), more entries than `capacity`, infeasibility at
/// eps (when eps > 0) and, with `regression`, new mass where the old row has none.
template <class T>
row_problem check_lumped(const aligned_batch_view<const T>& a, std::size_t r, const lumped_checks& checks) {
  double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1];
  int slot[sparse_max_entries + 1];
  const int n = lumped_pair(a, r, zn, zo, slot);
  row_setup setup;
  row_problem p = cpu::scan_pair(zn, zo, std::size_t(n), setup, "new (lumped)", "old (lumped)");
  if (checks.disjoint_ok && p.kind == row_error::disjoint) p = row_problem{};
  if (!p && std::size_t(a.counts[r]) > checks.capacity)
    return make_problem(row_error::sparse_capacity, "", static_cast<long long>(checks.capacity), double(a.counts[r]));
  if (!p && checks.eps > 0.0 && setup.old_only) {
    const double floor = cpu::min_reachable_kl(zn, zo, std::size_t(n), setup);
    if (floor >= checks.eps) {
      p.kind = row_error::infeasible;
      p.value = floor;
    }
  }
  if (!p && checks.regression && setup.new_only) p.kind = row_error::regression_inf;
  return p;
}

/// Never refuses a row: validate_aligned's default extra check.
struct no_extra_check {
  bool operator()(std::size_t, bool) const { return false; }
};
/// Prefetches nothing: validate_aligned's default for the caller's own operands.
struct no_prefetch {
  void operator()(std::size_t, long long) const {}
};
/// Finds nothing: validate_aligned's default for the caller's own full checks.
struct no_extra_problem {
  row_problem operator()(std::size_t) const { return row_problem{}; }
};

/// Validates an aligned batch for KL / projection, row by row (the lowest row with any problem is
/// thrown): its new side's sparse checks, its old side's, the dense row checks on the lumped rows
/// (check_lumped with `checks`), then the caller's own, `extra_problem(r)` (project_backward's
/// other operands). One fast yes/no pass first, over both sides and, while the row is in cache,
/// the caller's `extra_bad(r, finite)` (told whether every lumped category of the row is finite
/// on both sides; it must say yes wherever extra_problem finds a problem); only a batch with a
/// refused row runs the full checks, from that row on.
template <class T, class Extra = no_extra_check, class Prefetch = no_prefetch, class ExtraProblem = no_extra_problem>
void validate_aligned(const char* fn, unsigned threads, const aligned_batch_view<const T>& a,
                      const lumped_checks& checks, Extra&& extra_bad = Extra{}, Prefetch&& prefetch_extra = Prefetch{},
                      ExtraProblem&& extra_problem = ExtraProblem{}) {
  const sparse_batch_view<const T> new_side = a.new_side(), old_side = a.old_side();
  const std::size_t any_bad =
      first_bad_row_with_ids(threads, a.rows, 16 * std::size_t(a.k_max) + 64,
                             [&](std::size_t r, cpu::distinct_ids_scratch& ids) {
        if (r + cpu::prefetch_rows_ahead < a.rows) {  // the rows ahead, while this one is checked
          const std::size_t ahead = r + cpu::prefetch_rows_ahead, at = ahead * a.k_max;
          const long long c = a.counts[ahead];
          cpu::prefetch_entries(a.indices + at, c);
          cpu::prefetch_entries(a.new_log_probs + at, c);
          cpu::prefetch_entries(a.old_log_probs + at, c);
          prefetch_extra(ahead, c);
        }
        bool new_finite = false, old_finite = false;
        if (!cpu::sparse_indices_fine(new_side.row_indices(r), new_side.count(r), new_side.k_max, new_side.vocab,
                                      ids) ||
            !cpu::aligned_values_fine(new_side.row_log_probs(r), new_side.log_remainder[r],
                                      old_side.row_log_probs(r), old_side.log_remainder[r], new_side.count(r),
                                      new_side.vocab, &new_finite, &old_finite))
          return true;
        if (std::size_t(a.counts[r]) > checks.capacity) return true;
        // Every lumped category finite on both sides (values ≤ 0, a non-empty tail): the lumped
        // checks cannot fail (no NaN or +inf, nothing masked, so nothing disjoint or infeasible).
        const bool all_finite = new_finite && old_finite && a.vocab > std::size_t(a.counts[r]);
        if (extra_bad(r, all_finite)) return true;
        if (all_finite) return false;
        return bool(check_lumped(a, r, checks));
      });
  first_sorted_row_problem(fn, threads, a.rows, [&](std::size_t r, index_slot* scratch) {
    row_problem p = check_sparse_row_of(new_side, r, "new", scratch);
    if (!p) p = check_sparse_row_of(old_side, r, "old", scratch);
    if (!p) p = check_lumped(a, r, checks);
    return p ? p : extra_problem(r);
  }, any_bad, 16 * std::size_t(sparse_max_entries));
}

template <class T>
void pad_row(sparse_index* indices, T* log_probs, std::size_t from, std::size_t k_max) {
  for (std::size_t i = from; i < k_max; ++i) {
    indices[i] = -1;
    log_probs[i] = T(neg_inf());
  }
}

}  // namespace detail

namespace detail {

/// The problem of a row whose union of supports (u entries) exceeds align's output capacity.
inline row_problem union_capacity_problem(int u, std::size_t cap) {
  row_problem p;
  if (std::size_t(u) > cap) {
    p.kind = row_error::sparse_count;
    p.operand = "out (the union of the supports)";
    p.value = u;
  }
  return p;
}

/// Align's checks, row by row (naming the lowest row with any problem): `row_problem_of(r,
/// scratch)`, the caller's checks of row r's operands in their order, then whether U = S_new ∪
/// S_old is larger than the output's capacity; S_new is new_side's support, empty when
/// new_side.rows = 0. `scratch` holds sparse_max_entries slots; `work` is the caller's per-row
/// cost beyond the sort.
template <class T, class RowProblem>
void check_union_capacity(const char* fn, unsigned threads, const sparse_batch_view<const T>& new_side,
                          const sparse_batch_view<const T>& old_rows, std::size_t k_max, RowProblem row_problem_of,
                          std::size_t work = 0) {
  const std::size_t cap = k_max < std::size_t(sparse_max_entries) ? k_max : sparse_max_entries;
  first_sorted_row_problem(fn, threads, old_rows.rows, [&](std::size_t r, index_slot* scratch) {
    const row_problem p = row_problem_of(r, scratch);
    if (p) return p;
    const long long cn = new_side.rows != 0 ? new_side.count(r) : 0, co = old_rows.count(r);
    if (std::size_t(cn + co) <= cap) return row_problem{};  // |U| ≤ |S_new| + |S_old|: no sort needed
    const int u = new_side.rows != 0 ? union_size(new_side.row_indices(r), int(cn), old_rows.row_indices(r),
                                                  int(co), scratch)
                                     : int(co);
    return union_capacity_problem(u, cap);
  }, 0, work + 4 * std::size_t(sparse_max_entries));
}

/// The old side of align's output row r, U (u tokens) already in out.indices and old_pos[i] the
/// old row's entry of U_i (−1 where it has none): the old row's values, its uniform tail value
/// log(r/m) on U∖S_old, the bucket shrunk to V∖U, −inf padding; and out.counts[r] = u.
template <class T>
void write_aligned_old(const aligned_batch_view<T>& out, std::size_t r, int u,
                       const sparse_batch_view<const T>& old_rows, const int* old_pos) {
  const long long vocab = static_cast<long long>(out.vocab);
  const long long m_old = vocab - old_rows.count(r), m_u = vocab - u;
  const double lr_old = double(old_rows.log_remainder[r]);
  const double tail_old = tail_log_value(lr_old, m_old);
  T* lo = out.old_log_probs + r * out.k_max;
  for (int i = 0; i < u; ++i) lo[i] = old_pos[i] >= 0 ? old_rows.row_log_probs(r)[old_pos[i]] : T(tail_old);
  for (std::size_t i = std::size_t(u); i < out.k_max; ++i) lo[i] = T(neg_inf());
  out.counts[r] = u;
  out.old_log_remainder[r] = T(shrink_log_remainder(lr_old, m_old, m_u));
}

/// One row of align: U = new_indices ∪ S_old (union_support) into out's indices, the new side's
/// log-probs on U (and its bucket) by new_side(u, indices, new_pos, scratch, ln), then the
/// padding and the old side (write_aligned_old).
template <class T, class NewSide>
void align_row(const aligned_batch_view<T>& out, std::size_t r, const sparse_index* new_indices, int new_count,
               const sparse_batch_view<const T>& old_rows, NewSide&& new_side) {
  index_slot scratch[sparse_max_entries];
  int new_pos[sparse_max_entries], old_pos[sparse_max_entries];
  sparse_index* indices = out.indices + r * out.k_max;
  const int u = union_support(new_indices, new_count, old_rows.row_indices(r), int(old_rows.count(r)), scratch,
                              indices, new_pos, old_pos);
  T* ln = out.new_log_probs + r * out.k_max;
  new_side(u, indices, new_pos, scratch, ln);
  pad_row(indices, ln, std::size_t(u), out.k_max);
  write_aligned_old(out, r, u, old_rows, old_pos);
}

}  // namespace detail

namespace detail {

/// Row r of a sparse output on the aligned rows' support U from log π* over the n lumped
/// categories (slot[j]: the entry of U of category j, or count for the bucket): U's ids, log π*
/// on U (−inf on entries no category reached), the bucket, the count, padding.
template <class T>
void write_lumped_row(const aligned_batch_view<const T>& rows, std::size_t r, const int* slot, int n,
                      const double* lp, const sparse_batch_view<T>& out) {
  const int count = static_cast<int>(rows.counts[r]);
  T* out_lp = out.row_log_probs(r);
  sparse_index* out_ids = out.row_indices(r);
  const sparse_index* ids = rows.indices + r * rows.k_max;
  for (int i = 0; i < count; ++i) out_ids[i] = ids[i];
  if (n == count + 1) {  // every category kept: slot[j] = j
    for (int i = 0; i < count; ++i) out_lp[i] = T(lp[i]);
    out.log_remainder[r] = T(lp[count]);
  } else {
    for (int i = 0; i < count; ++i) out_lp[i] = T(neg_inf());
    out.log_remainder[r] = T(neg_inf());
    for (int j = 0; j < n; ++j) (slot[j] < count ? out_lp[slot[j]] : out.log_remainder[r]) = T(lp[j]);
  }
  out.counts[r] = count;
  pad_row(out.row_indices(r), out_lp, std::size_t(count), out.k_max);
}

}  // namespace detail

TROLL_END_NAMESPACE
