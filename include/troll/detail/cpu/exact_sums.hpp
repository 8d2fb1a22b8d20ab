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

/// out[i] = e^{x[i] − shift} for i < count, every entry through the same packet exponential
/// (a partial last packet is padded), so an entry's value does not depend on its position.
/// Arguments below −709 (where Eigen 3.4's vectorised exp returns ~5.6e-309, −inf included) are
/// redone with std::exp, which gives the subnormal or 0.
inline void packet_exp(const double* x, Eigen::Index count, double shift, double* out) {
  using packet = Eigen::internal::packet_traits<double>::type;
  constexpr Eigen::Index lanes = Eigen::internal::packet_traits<double>::size;
  const packet s = Eigen::internal::pset1<packet>(shift);
  Eigen::Index i = 0;
  for (; i + lanes <= count; i += lanes)
    Eigen::internal::pstoreu(out + i, Eigen::internal::pexp(Eigen::internal::psub(Eigen::internal::ploadu<packet>(x + i), s)));
  if (i < count) {
    double in[lanes], res[lanes];
    for (Eigen::Index j = 0; j < lanes; ++j) in[j] = i + j < count ? x[i + j] : shift;
    Eigen::internal::pstoreu(res, Eigen::internal::pexp(Eigen::internal::psub(Eigen::internal::ploadu<packet>(in), s)));
    for (Eigen::Index j = 0; i + j < count; ++j) out[i + j] = res[j];
  }
  for (Eigen::Index k = 0; k < count; ++k)
    if (!(x[k] - shift >= -709.0)) out[k] = std::exp(x[k] - shift);
}

/// The block [begin, begin + count) of a range of tokens (z points at token `first`) widened to
/// double into x, with the support's tokens set to −inf. `sorted` holds the support's slots
/// inside the range, by index; `next` walks them.
template <class T>
inline void load_outside(const T* z, std::size_t first, std::size_t begin, Eigen::Index count,
                         const index_slot* sorted, int n, int& next, double* x) {
  for (Eigen::Index k = 0; k < count; ++k) x[k] = static_cast<double>(z[begin + std::size_t(k)]);
  while (next < n && std::size_t(sorted[next].index) - first < begin + std::size_t(count)) {
    x[std::size_t(sorted[next].index) - first - begin] = neg_inf();
    ++next;
  }
}

/// max z_j over the tokens [first, first + size) outside the support (−inf when none).
template <class T>
inline double tail_max(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n) {
  alignas(64) double x[block_size];
  double m = neg_inf();
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_outside(z, first, begin, count, sorted, n, next, x);
    const double b = Eigen::Map<const Eigen::ArrayXd>(x, count).maxCoeff();
    if (b > m) m = b;
  });
  return m;
}

/// Σ e^{z_j − m} over the tokens [first, first + size) outside the support, as an exact_sum
/// (eight interleaved TwoSum accumulators, merged at the end). m = −inf gives an empty sum.
template <class T>
inline exact_sum tail_exp_sum(const T* z, std::size_t size, std::size_t first, const index_slot* sorted, int n,
                              double m) {
  constexpr int lanes = 8;
  exact_sum part[lanes];
  if (m == neg_inf()) return part[0];
  alignas(64) double x[block_size], e[block_size];
  int next = 0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_outside(z, first, begin, count, sorted, n, next, x);
    packet_exp(x, count, m, e);
    Eigen::Index k = 0;
    for (; k + lanes <= count; k += lanes)
      for (int j = 0; j < lanes; ++j) exact_add(part[j], e[k + j]);
    for (; k < count; ++k) exact_add(part[0], e[k]);
  });
  exact_sum total;
  for (int j = 0; j < lanes; ++j) total = exact_add(total, part[j]);
  return total;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
