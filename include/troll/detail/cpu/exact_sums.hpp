// troll/detail/cpu/exact_sums.hpp — the CPU passes behind the canonical log-sums of sparse rows
// (detail::exact_log_sums): the largest logit and the exact sum Σ e^{z − m} over the tokens of a
// range that lie outside a support. The value each token adds depends on its logit and m only —
// one exponential (Eigen's packet exp on every lane, a short tail padded into a full packet),
// never on where a block or a vocabulary shard starts — and the terms are summed as an
// exact_sum, so any split of a row into shards gives the same sum as the whole row.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// out[i] = e^{x[i] − shift} for i < count, in V (float or double), every entry through the same
/// packet exponential (a partial last packet is padded), so an entry's value does not depend on
/// its position. Arguments below the packet exp's range (where Eigen 3.4's vectorised exp
/// returns a tiny constant, −inf included) are redone with std::exp, which gives the subnormal
/// or 0; only a block that holds one pays.
template <class V>
inline void packet_exp(const V* x, Eigen::Index count, V shift, V* out) {
  using packet = typename Eigen::internal::packet_traits<V>::type;
  constexpr Eigen::Index lanes = Eigen::internal::packet_traits<V>::size;
  constexpr V lowest = sizeof(V) == sizeof(double) ? V(-709.0) : V(-87.0);
  const packet s = Eigen::internal::pset1<packet>(shift);
  Eigen::Index i = 0;
  for (; i + lanes <= count; i += lanes)
    Eigen::internal::pstoreu(out + i, Eigen::internal::pexp(Eigen::internal::psub(Eigen::internal::ploadu<packet>(x + i), s)));
  if (i < count) {
    V in[lanes], res[lanes];
    for (Eigen::Index j = 0; j < lanes; ++j) in[j] = i + j < count ? x[i + j] : shift;
    Eigen::internal::pstoreu(res, Eigen::internal::pexp(Eigen::internal::psub(Eigen::internal::ploadu<packet>(in), s)));
    for (Eigen::Index j = 0; i + j < count; ++j) out[i + j] = res[j];
  }
  using map = Eigen::Map<const Eigen::Array<V, Eigen::Dynamic, 1>>;
  if (count > 0 && map(x, count).minCoeff() - shift < lowest) {
    for (Eigen::Index k = 0; k < count; ++k)
      if (!(x[k] - shift >= lowest)) out[k] = std::exp(x[k] - shift);
  }
}

/// max z_j over the tokens [first, first + size) outside the support (−inf when none); z points
/// at token `first`, `sorted` holds the support's slots inside the range, by index.
template <class T>
inline double tail_max(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n) {
  alignas(64) double x[block_size];
  double m = neg_inf();
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    for (Eigen::Index k = 0; k < count; ++k) x[k] = static_cast<double>(z[begin + std::size_t(k)]);
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      x[std::size_t(sorted[next].index) - first - begin] = neg_inf();
      ++next;
    }
    const double b = Eigen::Map<const Eigen::ArrayXd>(x, count).maxCoeff();
    if (b > m) m = b;
  });
  return m;
}

/// Σ e^{z_j − m} over the tokens [first, first + size) outside the support, as an exact_sum
/// (eight interleaved TwoSum accumulators, merged at the end). The exponentials are taken in T
/// (float rows: eight or sixteen lanes, as sparsify's scan), the sum in double. m = −inf (or a
/// tail of masked tokens only) gives an empty sum.
template <class T>
inline exact_sum tail_exp_sum(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                              double m) {
  constexpr int lanes = 8;
  using lane_array = Eigen::Array<double, lanes, 1>;
  lane_array hi = lane_array::Zero(), lo = lane_array::Zero();
  exact_sum total;
  if (m == neg_inf()) return total;
  const T shift = static_cast<T>(m);  // m is one of the row's logits: exact in T
  alignas(64) T e[block_size];
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    packet_exp(z + begin, count, shift, e);
    while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
      e[std::size_t(sorted[next].index) - first - begin] = T(0);  // the support's own terms
      ++next;
    }
    Eigen::Index k = 0;
    for (; k + lanes <= count; k += lanes) {  // TwoSum, lane by lane
      const lane_array v = Eigen::Map<const Eigen::Array<T, lanes, 1>>(e + k).template cast<double>();
      const lane_array t = hi + v;
      const lane_array b = t - hi;
      lo += (hi - (t - b)) + (v - b);
      hi = t;
    }
    for (; k < count; ++k) exact_add(total, static_cast<double>(e[k]));
  });
  for (int j = 0; j < lanes; ++j) total = exact_add(total, exact_sum{hi[j], lo[j]});
  return total;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
