// troll/detail/cpu/sparse_lumped_rows.hpp — the lumped (|U|+1)-category pair of an aligned row
// whose every category is finite on both sides (the common row: nothing masked, a non-empty
// tail): widened to double and its solver setup found in packets of the caller's type, in place
// of lumped_pair and scan_pair on the widened rows. The same doubles and the same setup.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../trust_region_solver.hpp"
#include "finite_rows.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The lumped pair of one aligned row (count entries of each side, then the buckets; a bucket is
/// −inf when the tail is empty) into zn, zo[0..count] with scan_pair's setup, when every value is
/// finite: then no category is dropped (lumped_pair's slot[j] = j, n = count + 1) and the setup
/// is the one scan_pair finds on the widened rows (extremes are exact in either type; the first
/// index of a maximum is the same, the bucket coming last; x_range from the differences in
/// double, as scan_pair forms them on the widened rows). Returns false otherwise (zn, zo then
/// hold nothing meaningful: the caller takes lumped_pair and scan_pair).
template <class T>
inline bool lumped_pair_finite(const T* new_lp, const T* old_lp, int count, T new_bucket, T old_bucket,
                               double* zn, double* zo, row_setup& setup) {
  const double bn = static_cast<double>(new_bucket), bo = static_cast<double>(old_bucket);
  if (!(bn - bn == 0.0 && bo - bo == 0.0)) return false;
  pair_extremes e;
  if (!finite_extremes(new_lp, old_lp, static_cast<long>(count), e)) return false;
  for (int i = 0; i < count; ++i) zn[i] = static_cast<double>(new_lp[i]);
  for (int i = 0; i < count; ++i) zo[i] = static_cast<double>(old_lp[i]);
  zn[count] = bn;
  zo[count] = bo;
  // The first index of each side's maximum over the entries, then the bucket.
  const bool entry_new = count > 0 && e.max_new >= bn, entry_old = count > 0 && e.max_old >= bo;
  const int at_new = entry_new ? int(first_index_of(new_lp, count, static_cast<T>(e.max_new))) : count;
  const int at_old = entry_old ? int(first_index_of(old_lp, count, static_cast<T>(e.max_old))) : count;
  const double max_new = entry_new ? e.max_new : bn, max_old = entry_old ? e.max_old : bo;
  const double min_new = count > 0 ? minimum(e.min_new, bn) : bn, min_old = count > 0 ? minimum(e.min_old, bo) : bo;
  setup = row_setup{};
  setup.old_max = max_old;
  setup.new_top = tilt_ref{zn[at_new], zo[at_new]};
  setup.old_top = tilt_ref{zn[at_old], zo[at_old]};
  setup.spread = maximum(max_new, max_old) - minimum(min_new, min_old);
  // scan_pair's x_range on the widened rows: the differences z̃ − z° taken in double (as there,
  // not in T), widened by their rounding (unit 2^-53: scan_pair reads the double rows) and by
  // that of the solver's own x.
  // In packets (a scalar max/min chain does not vectorise); max and min round nothing.
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr int lanes = int(sizeof(packet) / sizeof(double));
  const int size = count + 1, whole = size - size % lanes;
  double max_diff = zn[0] - zo[0], min_diff = max_diff;
  if (whole > 0) {
    packet hi = psub(ploadu<packet>(zn), ploadu<packet>(zo)), lo = hi;
    for (int k = lanes; k < whole; k += lanes) {
      const packet d = psub(ploadu<packet>(zn + k), ploadu<packet>(zo + k));
      hi = pmax(hi, d);
      lo = pmin(lo, d);
    }
    max_diff = predux_max(hi);
    min_diff = predux_min(lo);
  }
  for (int i = whole; i < size; ++i) {
    const double d = zn[i] - zo[i];
    max_diff = d > max_diff ? d : max_diff;
    min_diff = d < min_diff ? d : min_diff;
  }
  constexpr double unit = 0x1p-53;
  const double largest = maximum(maximum(::fabs(max_new), ::fabs(min_new)), maximum(::fabs(max_old), ::fabs(min_old)));
  setup.x_range =
      ((max_diff - min_diff) + 2.0 * unit * (::fabs(max_diff) + ::fabs(min_diff)) + 8.0 * 0x1p-53 * largest) *
      (1.0 + 0x1p-50);
  return true;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
