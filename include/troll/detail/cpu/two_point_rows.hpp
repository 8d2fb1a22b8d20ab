// troll/detail/cpu/two_point_rows.hpp — the CPU's row driver of the two-point rule
// (detail/two_point.hpp): on a projected row whose new-side entries are suspect, find the two
// heaviest tokens of π*, form the others' sums in one scalar pass (a fixed order: the same bits
// on every ISA and from every caller given the same row), and return the two entries the rule
// gives, where its bound is the better.
#pragma once

#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../two_point.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The two tokens of largest log π* of a row (heavy_pair).
template <class T>
inline heavy_pair heaviest_two(const T* logp, std::size_t size) {
  heavy_pair h;
  for (std::size_t j = 0; j < size; ++j) {
    const double x = static_cast<double>(logp[j]);
    if (x > h.log_2) h.add(j, x);  // most tokens fall below the second and are skipped here
  }
  return h;
}

/// The rule's entries for a projected row of `size` tokens with new-side frame `f`, where the
/// row's largest new-side entry is `largest` and its largest |upstream| `widest_g`.
/// `upstream(j)` is g_j and `centred(j)` is c_j (d_j − μ with the row's centring), both read only
/// on the support (log π* > −inf). Returns take = false (and leaves `h` unspecified) where the
/// row is not suspect, not nearly two-point, or the direct entries are the better.
template <class T, class Upstream, class Centred>
inline two_point_values two_point_entries(const T* zn, const T* zo, const T* logp, std::size_t size,
                                          const two_point_frame& f, double largest, double widest_g,
                                          Upstream&& upstream, Centred&& centred, heavy_pair& h) {
  if (!two_point_suspect(largest, f.t, widest_g)) return {};
  h = heaviest_two(logp, size);
  if (!h.found_two() || !two_point_candidate(h.log_1, h.log_2)) return {};
  const double zn1 = static_cast<double>(zn[h.first]), zo1 = static_cast<double>(zo[h.first]);
  const double zn2 = static_cast<double>(zn[h.second]), zo2 = static_cast<double>(zo[h.second]);
  two_point_sums sums;
  for (std::size_t j = 0; j < size; ++j) {
    const double lp = static_cast<double>(logp[j]);
    if (j == h.first || j == h.second || !(lp > neg_inf())) continue;
    const double pi = ::exp(lp), c = centred(j), g = upstream(j);
    const double zn_j = static_cast<double>(zn[j]), zo_j = static_cast<double>(zo[j]);
    sums.add(f.entry(g, pi, c), f.terms(g, pi, c, lp), zn1 - zn_j, zo1 - zo_j, zn2 - zn_j, zo2 - zo_j);
  }
  const double direct = f.terms(upstream(h.first), ::exp(h.log_1), centred(h.first), h.log_1) +
                        f.terms(upstream(h.second), ::exp(h.log_2), centred(h.second), h.log_2);
  return two_point_resolve(sums, zn1 - zn2, zo1 - zo2, direct);
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
