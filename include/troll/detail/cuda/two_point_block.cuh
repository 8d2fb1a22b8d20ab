// troll/detail/cuda/two_point_block.cuh — the two-point rule (troll/detail/two_point.hpp) by a
// whole block (the dense kernels) or one warp (the sparse kernels): the suspicion test from the
// threads' largest entries and upstreams, the two heaviest tokens, the others' sums, and the two
// entries the rule gives where its bound is the better (cpu::two_point_entries's decisions; the
// sums are reduced in the device's order, not the CPU's).
#pragma once

#include <cstddef>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../two_point.hpp"
#include "block_reduce.cuh"
#include "sparse_warp.cuh"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cuda {

#ifdef __CUDACC__

struct merge_heavy_pair {
  __device__ heavy_pair operator()(const heavy_pair& a, const heavy_pair& b) const { return a + b; }
};
struct merge_two_point_sums {
  __device__ two_point_sums operator()(const two_point_sums& a, const two_point_sums& b) const { return a + b; }
};

/// Shared memory of block_two_point.
struct two_point_storage {
  reduce_storage<double> largest;
  reduce_storage<heavy_pair> pair;
  reduce_storage<two_point_sums> sums;
};

/// All-reductions over a block (every thread of it calls them).
struct two_point_block {
  two_point_storage& st;
  __device__ double max(double v) const { return block_all_reduce(st.largest, v, larger_of{}); }
  __device__ heavy_pair pair(const heavy_pair& v) const { return block_all_reduce(st.pair, v, merge_heavy_pair{}); }
  __device__ two_point_sums sums(const two_point_sums& v) const {
    return block_all_reduce(st.sums, v, merge_two_point_sums{});
  }
  __device__ static unsigned first() { return threadIdx.x; }
  __device__ static unsigned stride() { return block_threads; }
};

/// All-reductions over a warp (its 32 lanes call them).
struct two_point_warp {
  __device__ double max(double v) const { return warp_all_reduce(v, larger_of{}); }
  __device__ heavy_pair pair(const heavy_pair& v) const { return warp_all_reduce(v, merge_heavy_pair{}); }
  __device__ two_point_sums sums(const two_point_sums& v) const { return warp_all_reduce(v, merge_two_point_sums{}); }
  __device__ static unsigned first() { return lane_id(); }
  __device__ static unsigned stride() { return warp_lanes; }
};

/// The rule's entries for a projected row of `size` categories with frame `f`; `largest` and
/// `widest_g` are this thread's largest |entry| and |upstream|. `log_pi(j)`, `logits(j, zn, zo)`,
/// `upstream(j)` and `centred(j)` read category j (the last two only on the support). Every
/// thread of the group gets the result (take uniform) and the pair `h`; reached by all of them.
template <class Reducer, class LogPi, class Logits, class Upstream, class Centred>
__device__ two_point_values group_two_point(const Reducer& reduce, std::size_t size, const two_point_frame& f,
                                            double largest, double widest_g, LogPi&& log_pi, Logits&& logits,
                                            Upstream&& upstream, Centred&& centred, heavy_pair& h) {
  const double most = reduce.max(largest);
  const double widest = reduce.max(widest_g);
  if (!two_point_suspect(most, f.t, widest)) return {};  // uniform
  heavy_pair local;
  for (std::size_t j = Reducer::first(); j < size; j += Reducer::stride()) local.add(j, log_pi(j));
  h = reduce.pair(local);
  if (!h.found_two() || !two_point_candidate(h.log_1, h.log_2)) return {};  // uniform
  double zn1, zo1, zn2, zo2;
  logits(h.first, zn1, zo1);
  logits(h.second, zn2, zo2);
  two_point_sums sums;
  for (std::size_t j = Reducer::first(); j < size; j += Reducer::stride()) {
    const double lp = log_pi(j);
    if (j == h.first || j == h.second || !(lp > neg_inf())) continue;
    const double pi = ::exp(lp), c = centred(j), g = upstream(j);
    double zn_j, zo_j;
    logits(j, zn_j, zo_j);
    sums.add(f.entry(g, pi, c), f.terms(g, pi, c, lp), zn1 - zn_j, zo1 - zo_j, zn2 - zn_j, zo2 - zo_j);
  }
  const two_point_sums total = reduce.sums(sums);
  const double direct = f.terms(upstream(h.first), ::exp(h.log_1), centred(h.first), h.log_1) +
                        f.terms(upstream(h.second), ::exp(h.log_2), centred(h.second), h.log_2);
  return two_point_resolve(total, zn1 - zn2, zo1 - zo2, direct);
}

/// group_two_point by one warp on a lumped sparse row (`row.count` categories and the bucket last;
/// a category −inf on both sides is off the support): `lp_row` / `lp_bucket` its log π*, `ref` and
/// `m` its centring, `upstream(i)` the upstream of category i. Shared by the sparse VJP and the
/// sparse TROLL objective.
template <class Row, class L, class Reference, class Upstream>
__device__ two_point_values warp_lumped_two_point(const Row& row, const L* lp_row, double lp_bucket,
                                                  const Reference& ref, double m, const two_point_frame& f,
                                                  double largest, double widest_g, Upstream&& upstream,
                                                  heavy_pair& h) {
  const auto log_pi = [&](std::size_t i) {
    double x, y;
    row.at(static_cast<int>(i), x, y);
    if (x == neg_inf() && y == neg_inf()) return neg_inf();
    return static_cast<int>(i) < row.count ? static_cast<double>(lp_row[i]) : lp_bucket;
  };
  const auto logits = [&](std::size_t i, double& x, double& y) { row.at(static_cast<int>(i), x, y); };
  const auto centred = [&](std::size_t i) {
    double x, y;
    row.at(static_cast<int>(i), x, y);
    return ref.centred(x, y) - m;
  };
  return group_two_point(two_point_warp{}, static_cast<std::size_t>(row.count) + 1, f, largest, widest_g, log_pi,
                         logits, upstream, centred, h);
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace detail
TROLL_END_NAMESPACE
