// troll/detail/cpu/sparse_fast_checks.hpp — yes/no versions of the sparse row checks for the CPU
// backend's first pass over a batch: O(|S|) per row, vectorised, no sort. They accept exactly the
// rows check_sparse_row (sparse_kernels.hpp) accepts; a row they refuse is handed to the full
// check, which names the problem (so a batch of good rows never sorts anything).
#pragma once

#include "eigen.hpp"
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../sparse_row.hpp"
#include "finite_rows.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// Slots of the hash table sparse_indices_fine needs: twice the largest support.
inline constexpr int distinct_table_slots = 2 * sparse_max_entries;

/// Whether count lies in [0, min(capacity, V, sparse_max_entries)] and indices[0..count) are
/// distinct ids in [0, V): one pass through an open-addressed hash set in `table`
/// (distinct_table_slots entries, of which the first power of two ≥ 2·count, at least 16, are
/// used), in place of check_sparse_row's sort.
inline bool sparse_indices_fine(const sparse_index* indices, long long count, std::size_t capacity,
                                std::size_t vocab, sparse_index* table) {
  if (count < 0 || count > static_cast<long long>(capacity) || count > static_cast<long long>(vocab) ||
      count > sparse_max_entries)
    return false;
  const int n = static_cast<int>(count);
  int bits = 4;
  while ((1 << bits) < 2 * n) ++bits;
  const std::uint32_t mask = (std::uint32_t(1) << bits) - 1;
  for (std::uint32_t i = 0; i <= mask; ++i) table[i] = -1;
  for (int i = 0; i < n; ++i) {
    const sparse_index v = indices[i];
    if (v < 0 || static_cast<std::size_t>(v) >= vocab) return false;
    std::uint32_t h = (static_cast<std::uint32_t>(v) * 2654435761u) >> (32 - bits);  // Knuth's multiplier
    while (table[h] >= 0) {
      if (table[h] == v) return false;
      h = (h + 1) & mask;
    }
    table[h] = v;
  }
  return true;
}

/// The last partial packet of log_probs[k..n) (n − k < lanes), padded with −inf: a masked load
/// with AVX-512 (nothing read past n), else a copy.
template <class Packet, class T>
inline Packet load_padded(const T* log_probs, int k, int n) {
  using namespace Eigen::internal;
  constexpr int lanes = int(sizeof(Packet) / sizeof(T));
  constexpr T lowest = -std::numeric_limits<T>::infinity();
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value && lanes == 16) {
    const __mmask16 m = __mmask16((1u << unsigned(n - k)) - 1u);
    return Packet(_mm512_mask_loadu_ps(_mm512_set1_ps(lowest), m, log_probs + k));
  }
  if constexpr (std::is_same<T, double>::value && lanes == 8) {
    const __mmask8 m = __mmask8((1u << unsigned(n - k)) - 1u);
    return Packet(_mm512_mask_loadu_pd(_mm512_set1_pd(lowest), m, log_probs + k));
  }
#endif
  T last[lanes];
  for (int j = 0; j < lanes; ++j) last[j] = k + j < n ? log_probs[k + j] : lowest;
  return ploadu<Packet>(last);
}

/// Σ_i exp(l_i) + exp(log_remainder) over a row's log-probs (all ≤ 0 or −inf) and the bound on
/// its rounding error used by sparse_values_fine, in whole packets (the last one padded with
/// −inf, the remainder in its first padding lane). Float rows take their exponentials
/// and the sum in float, sixteen lanes with AVX-512: each term within a few float ulps, so the
/// total within (n + 3)·2.5e-7 of the exact sum when it is near 1 (every term is ≤ 1). Double
/// rows in double (exp_nonpositive: e^{−700} at most for a term below −700).
template <class T>
inline double fast_mass(const T* log_probs, int n, T log_remainder, double& error) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr int lanes = int(sizeof(packet) / sizeof(T));
  error = sizeof(T) < sizeof(double) ? (n + 3) * 2.5e-7 : 1e-9;
  auto exp_of = [](const packet& l) {
    if constexpr (sizeof(T) < sizeof(double)) {
      return pexp(l);  // Eigen's float exp: exp(−inf) is a tiny positive number, harmless here
    } else {
      return exp_nonpositive(l);
    }
  };
  // The remainder takes the first padding lane of the last packet (a packet of its own when n
  // is whole packets): one more term of the same kind, no scalar exponential.
  packet acc = pset1<packet>(T(0));
  int k = 0;
  for (; k + lanes <= n; k += lanes) acc = padd(acc, exp_of(ploadu<packet>(log_probs + k)));
  // lane n − k of the padded last packet (lane 0 of an all −inf one when n is whole packets)
  const packet last = k < n ? load_padded<packet>(log_probs, k, n) : pset1<packet>(-std::numeric_limits<T>::infinity());
  const packet at = pcmp_eq(plset<packet>(T(0)), pset1<packet>(T(n - k)));
  acc = padd(acc, exp_of(pselect(at, pset1<packet>(log_remainder), last)));
  return static_cast<double>(predux(acc));
}

/// Whether the values of a sparse row with distinct in-range indices pass check_sparse_row:
/// log-probs and log-remainder not NaN and ≤ 0, no remainder mass when count = V, some mass, and
/// Σ p_i + r within sparse_mass_tolerance<T>() of 1. The sum is taken with vectorised
/// exponentials (fast_mass); where it lands within its error bound of the tolerance's edge (or
/// outside) the scalar double sum of check_sparse_row decides, so both accept the same rows.
/// `finite`, when given, receives whether every log-prob and the log-remainder are above −inf.
template <class T>
inline bool sparse_values_fine(const T* log_probs, long long count, T log_remainder, std::size_t vocab,
                               bool* finite = nullptr) {
  const int n = static_cast<int>(count);
  // Integer OR-reductions in T, which the compiler vectorises (a running max would not be).
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  int bad = 0, masked = 0, some = 0;
  for (int i = 0; i < n; ++i) {
    const T l = log_probs[i];
    bad |= !(l <= T(0));
    masked |= l == lowest;
    some |= l > lowest;
  }
  const double r = static_cast<double>(log_remainder);
  if (finite) *finite = masked == 0 && r > neg_inf();
  if (bad != 0 || !(r <= 0.0)) return false;
  if (static_cast<std::size_t>(n) == vocab && r > neg_inf()) return false;
  if (some == 0 && !(r > neg_inf())) return false;
  double error = 0.0;
  const double mass = fast_mass(log_probs, n, log_remainder, error);
  const double tol = sparse_mass_tolerance<T>();
  if (mass >= 1.0 - tol + error && mass <= 1.0 + tol - error) return true;
  const double exact = sparse_row_mass(log_probs, n, r);
  return exact >= 1.0 - tol && exact <= 1.0 + tol;
}

/// Whether one entry (log π* = l, aligned sides zn, zo, upstream g) passes project_backward's
/// checks: l not NaN and ≤ 0, and where l > −inf both sides above −inf and g finite.
template <class T>
inline int backward_entry_bad(T l, T zn, T zo, T g) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  const int live = l > lowest;
  return int(!(l <= T(0))) | (live & (int(zn == lowest) | int(zo == lowest) | int(!(g - g == T(0)))));
}

/// The yes/no form of project_backward's per-row checks of log_probs and the upstream gradient
/// for a row whose counts already agree: every id equal to the aligned id and every entry, the
/// bucket included (its sides −inf when the tail is empty), passing backward_entry_bad. One
/// vectorised pass of integer OR-reductions; a row it refuses goes to the full check.
template <class T>
inline bool backward_row_fine(const sparse_index* ids, const sparse_index* aligned_ids, const T* log_probs,
                              const T* new_lp, const T* old_lp, const T* g, int count, T log_remainder,
                              T new_remainder, T old_remainder, T g_remainder) {
  int bad = 0;
  for (int i = 0; i < count; ++i) {
    bad |= int(ids[i] != aligned_ids[i]);
    bad |= backward_entry_bad(log_probs[i], new_lp[i], old_lp[i], g[i]);
  }
  bad |= backward_entry_bad(log_remainder, new_remainder, old_remainder, g_remainder);
  return bad == 0;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
