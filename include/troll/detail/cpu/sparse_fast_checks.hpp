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

/// Asks for the cache lines of p[0..count) ahead of their use: the passes over a batch of short
/// sparse rows read half a dozen arrays a row, each only a few lines long, faster than the
/// hardware prefetchers follow them.
template <class T>
inline void prefetch_entries(const T* p, long long count) {
  constexpr long long per_line = 64 / static_cast<long long>(sizeof(T));
  for (long long i = 0; i < count; i += per_line) __builtin_prefetch(p + i);
}

/// How many rows ahead the passes over a sparse batch prefetch.
inline constexpr std::size_t prefetch_rows_ahead = 4;

/// Slots of the hash table sparse_indices_fine needs: twice the largest support.
inline constexpr int distinct_table_slots = 2 * sparse_max_entries;

/// The longest support distinct_ids_lanes takes (eight packets of sixteen ids); longer ones go
/// through the hash table.
inline constexpr int distinct_lanes_max = 128;

#if defined(__AVX512F__)
/// Whether ids[0..n) (n ≤ distinct_lanes_max) are distinct ids in [0, V), all in registers: the
/// ids in packets of sixteen (the last padded with values no id takes), the range in one unsigned
/// compare per packet, then each packet against every id of the packets before it (broadcast) and
/// against its own lanes rotated by 1 … 8 places. About n²/32 packet operations,
/// no branches on the data, no scratch: for the supports of K = 64 rows (|U| ≈ 70–130) about
/// twice as fast as the hash table's probes.
inline bool distinct_ids_lanes(const sparse_index* ids, int n, std::size_t vocab) {
  const int packets = (n + 15) / 16;
  __m512i v[distinct_lanes_max / 16];
  // An id is in [0, V) exactly when, read as unsigned, it is below min(V, 2^31).
  constexpr std::size_t above_ids = std::size_t(1) << 31;
  const __m512i bound = _mm512_set1_epi32(int(std::uint32_t(vocab < above_ids ? vocab : above_ids)));
  // Padding lanes hold −1 − lane: distinct, and (as unsigned) at least 2^31, so equal to no id in
  // range and to no other padding lane.
  const __m512i padding =
      _mm512_sub_epi32(_mm512_set1_epi32(-1), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  __mmask16 outside = 0;
  for (int b = 0; b < packets; ++b) {
    const int left = n - 16 * b;
    const __mmask16 live = left >= 16 ? __mmask16(0xffffu) : __mmask16((1u << unsigned(left)) - 1u);
    v[b] = _mm512_mask_loadu_epi32(padding, live, ids + 16 * b);
    outside |= _mm512_mask_cmpge_epu32_mask(live, v[b], bound);
  }
  if (outside != 0) return false;
  // Packet c against every id before it: acc = min(acc, v[c] XOR id) is zero in a lane exactly
  // when that lane repeats the id (padding lanes hold −1, which no id in range equals). Plain
  // vector ALU work in four independent accumulators (mask compares are slower here).
  const __m512i ones = _mm512_set1_epi32(-1);
  __m512i least = ones;
  for (int c = 0; c < packets; ++c) {
    const __m512i w = v[c];
    __m512i a0 = ones, a1 = ones, a2 = ones, a3 = ones;
    const int before = 16 * c;
    int i = 0;
    for (; i + 4 <= before; i += 4) {
      a0 = _mm512_min_epu32(a0, _mm512_xor_si512(w, _mm512_set1_epi32(ids[i])));
      a1 = _mm512_min_epu32(a1, _mm512_xor_si512(w, _mm512_set1_epi32(ids[i + 1])));
      a2 = _mm512_min_epu32(a2, _mm512_xor_si512(w, _mm512_set1_epi32(ids[i + 2])));
      a3 = _mm512_min_epu32(a3, _mm512_xor_si512(w, _mm512_set1_epi32(ids[i + 3])));
    }
    // Within packet c: every lane against the lanes 1 … 8 places further round the packet, which
    // meets every pair of lanes (plain rotations: vpconflictd is microcoded on some cores, ~20
    // cycles a packet).
    a0 = _mm512_min_epu32(a0, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 1)));
    a1 = _mm512_min_epu32(a1, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 2)));
    a2 = _mm512_min_epu32(a2, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 3)));
    a3 = _mm512_min_epu32(a3, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 4)));
    a0 = _mm512_min_epu32(a0, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 5)));
    a1 = _mm512_min_epu32(a1, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 6)));
    a2 = _mm512_min_epu32(a2, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 7)));
    a3 = _mm512_min_epu32(a3, _mm512_xor_si512(w, _mm512_alignr_epi32(w, w, 8)));
    const __m512i pairs = _mm512_min_epu32(_mm512_min_epu32(a0, a1), _mm512_min_epu32(a2, a3));
    least = _mm512_min_epu32(least, pairs);
  }
  return _mm512_cmpeq_epi32_mask(least, _mm512_setzero_si512()) == 0;
}
#endif

/// Whether count lies in [0, min(capacity, V, sparse_max_entries)] and indices[0..count) are
/// distinct ids in [0, V): one pass through an open-addressed hash set in `table`
/// (distinct_table_slots entries, of which the first power of two ≥ 2·count, at least 16, are
/// used), in place of check_sparse_row's sort; with AVX-512, supports of at most
/// distinct_lanes_max ids by distinct_ids_lanes instead.
inline bool sparse_indices_fine(const sparse_index* indices, long long count, std::size_t capacity,
                                std::size_t vocab, sparse_index* table) {
  if (!sparse_count_fits(count, capacity, vocab))
    return false;
  const int n = static_cast<int>(count);
#if defined(__AVX512F__)
  if (n <= distinct_lanes_max) return distinct_ids_lanes(indices, n, vocab);
#endif
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

/// Scratch of the distinct-id checks of a run of rows (one thread's run of a batch, on its
/// stack): an open-addressed table whose entries carry the stamp of the row that filled them,
/// (stamp << 32) | id, so that a new row empties it by taking the next stamp, not by clearing.
struct distinct_ids_scratch {
  std::uint64_t slots[distinct_table_slots] = {};  // stamp 0: empty for every row
  std::uint64_t stamp = 0;
};

/// sparse_indices_fine through the stamped table of `scratch` (with AVX-512, supports of at most
/// distinct_lanes_max ids through distinct_ids_lanes instead; the first power of two ≥ 4·count
/// slots, at least 16 and at most distinct_table_slots: a quarter full for the supports
/// sparsify writes), with nothing to clear per row.
inline bool sparse_indices_fine(const sparse_index* indices, long long count, std::size_t capacity,
                                std::size_t vocab, distinct_ids_scratch& scratch) {
  if (!sparse_count_fits(count, capacity, vocab))
    return false;
  const int n = static_cast<int>(count);
#if defined(__AVX512F__)
  if (n <= distinct_lanes_max) return distinct_ids_lanes(indices, n, vocab);
#endif
  int bits = 4;
  while ((1 << bits) < 4 * n && (1 << bits) < distinct_table_slots) ++bits;
  const std::uint32_t mask = (std::uint32_t(1) << bits) - 1;
  const std::uint64_t stamp = ++scratch.stamp << 32;
  constexpr std::uint64_t stamp_bits = ~std::uint64_t(0xffffffffu);
  std::uint64_t* slots = scratch.slots;
  for (int i = 0; i < n; ++i) {
    const sparse_index v = indices[i];
    if (v < 0 || static_cast<std::size_t>(v) >= vocab) return false;
    const std::uint32_t id = static_cast<std::uint32_t>(v);
    std::uint32_t h = (id * 2654435761u) >> (32 - bits);  // Knuth's multiplier
    for (std::uint64_t e = slots[h]; (e & stamp_bits) == stamp; e = slots[h]) {
      if (std::uint32_t(e) == id) return false;
      h = (h + 1) & mask;
    }
    slots[h] = stamp | id;
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
  T last[std::size_t(lanes)];
  for (int j = 0; j < lanes; ++j) last[j] = k + j < n ? log_probs[k + j] : lowest;
  return ploadu<Packet>(last);
}

/// e^r on the reduced argument r of Eigen 3.4's float exponentials (`pexp_float` and the AVX-512
/// `pexp<Packet16f>` share it): Eigen's (Cephes') coefficients in Eigen's two interleaved Horner
/// chains, with fused multiply-adds as Eigen's pmadd has them where FMA is on, so Eigen's bits.
template <class Packet>
inline Packet eigen_exp_polynomial(const Packet& r) {
  using namespace Eigen::internal;
  const Packet r2 = pmul(r, r), r3 = pmul(r2, r);
  Packet odd = pmadd(pset1<Packet>(1.9875691500E-4f), r, pset1<Packet>(1.3981999507E-3f));
  Packet even = pmadd(pset1<Packet>(4.1665795894E-2f), r, pset1<Packet>(1.6666665459E-1f));
  const Packet low = padd(r, pset1<Packet>(1.0f));
  odd = pmadd(odd, r, pset1<Packet>(8.3334519073E-3f));
  even = pmadd(even, r, pset1<Packet>(5.0000001201E-1f));
  return pmadd(pmadd(odd, r3, even), r2, low);
}

#if defined(__AVX512F__) && defined(__FMA__)
/// Eigen 3.4's AVX-512 float exponential (`pexp<Packet16f>`: its operations in its order, so its
/// bits) for x in [−87, 0], where Eigen's clamps change nothing and 2^m · polynomial is a normal
/// float: the scaling is one `scalef` (13 operations instead of 19). Outside [−87, 0] the value
/// is unspecified; fast_values clamps its arguments to −87 first.
inline __m512 exp_eigen_bounded(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 m = _mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.6931471805599453f), x);
  return _mm512_scalef_ps(eigen_exp_polynomial(Eigen::internal::Packet16f(r)), m);
}
#elif defined(__AVX2__) && defined(__FMA__)
/// Eigen 3.4's float exponential on AVX2 (`pexp<Packet8f>`, the generic `pexp_float`: its
/// operations in its order, so its bits) for x in [−87, 0], where its clamps and its final max
/// change nothing and 2^m · polynomial is a normal float: the scaling is one multiplication by
/// 2^m built in the exponent bits (exact, as Eigen's four-factor pldexp is there), 16 operations
/// where Eigen's generic path takes about twice as many. Outside [−87, 0] the value is
/// unspecified; fast_values clamps its arguments to −87 first.
inline __m256 exp_eigen_bounded(__m256 x) {
  const __m256 m = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // Eigen's reduction in two parts
  __m256 r = _mm256_fmadd_ps(m, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(m, _mm256_set1_ps(2.12194440e-4f), r);
  // m ∈ [−126, 0]: 2^m is a normal float, its biased exponent m + 127 ∈ [1, 127]
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(eigen_exp_polynomial(Eigen::internal::Packet8f(r)), _mm256_castsi256_ps(power));
}
#endif

/// What one packet pass over a sparse row's log-probs finds: Σ_i exp(l_i) + exp(log_remainder)
/// and the bound on its rounding error, and whether some log-prob is NaN or above 0 (`bad`),
/// −inf (`masked`) or above −inf (`some`).
struct fast_row_values {
  double mass = 0.0, error = 0.0;
  bool bad = false, masked = false, some = false;
};

/// The running state of fast_values over one row: the sum of the exponentials and the flags as
/// lane masks. Float rows take their exponentials and the sum in float, sixteen lanes with
/// AVX-512: each term within a few float ulps, so the total within (n + 3)·2.5e-7 of the exact
/// sum when it is near 1 (every term is ≤ 1). Double rows in double (exp_nonpositive: e^{−700}
/// at most for a term below −700).
template <class T>
struct fast_values_state {
  using packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int lanes = int(sizeof(packet) / sizeof(T));
  packet acc, bad, masked, some;  // the flags as lane masks

  fast_values_state() {
    using namespace Eigen::internal;
    acc = bad = masked = some = pset1<packet>(T(0));
  }
  static packet exp_of(const packet& l) {
    using namespace Eigen::internal;
    if constexpr (sizeof(T) < sizeof(double)) {
#if defined(__AVX512F__) && defined(__FMA__)
      if constexpr (lanes == 16) {
        // Eigen's float exp in 13 operations (exp_eigen_bounded) on max(l, −87): the same bits
        // for l ≥ −87; below, e^{−87} ≈ 1.6e-38 in place of a term below it (−inf included), a
        // change far inside the error bound. NaN and +inf lanes are flagged bad, not summed.
        return packet(exp_eigen_bounded(_mm512_max_ps(l, _mm512_set1_ps(-87.0f))));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (lanes == 8) {  // the same with AVX2: Eigen's bits for l ≥ −87, e^{−87} below
        return packet(exp_eigen_bounded(_mm256_max_ps(l, _mm256_set1_ps(-87.0f))));
      }
#endif
      return pexp(l);  // Eigen's float exp: exp(−inf) is a tiny positive number, harmless here
    } else {
      return exp_nonpositive(l);
    }
  }
  void flags(const packet& l) {
    using namespace Eigen::internal;
    const packet zero = pset1<packet>(T(0)), lowest = pset1<packet>(-std::numeric_limits<T>::infinity());
    bad = por(bad, pcmp_lt_or_nan(zero, l));  // !(l ≤ 0)
    masked = por(masked, pcmp_eq(l, lowest));
    some = por(some, pcmp_lt(lowest, l));
  }
  /// A whole packet of log-probs.
  void add(const T* at) {
    const packet l = Eigen::internal::ploadu<packet>(at);
    flags(l);
    acc = Eigen::internal::padd(acc, exp_of(l));
  }
  /// log_probs[k..n) (n − k < lanes, the whole packets before k added) and the remainder: the
  /// last packet padded with −inf, the remainder in its first padding lane, or in a packet of
  /// its own when n is whole packets; then the result.
  fast_row_values finish(const T* log_probs, int k, int n, T log_remainder) {
    using namespace Eigen::internal;
    const packet zero = pset1<packet>(T(0)), lowest = pset1<packet>(-std::numeric_limits<T>::infinity());
    const packet lane = plset<packet>(T(0)), first_pad = pset1<packet>(T(n - k));
    if (k < n) {  // padding lanes are −inf: neither bad nor some, and kept out of masked
      const packet l = load_padded<packet>(log_probs, k, n);
      const packet masked_before = masked;
      flags(l);
      masked = por(masked_before, pand(pcmp_lt(lane, first_pad), pcmp_eq(l, lowest)));
      acc = padd(acc, exp_of(pselect(pcmp_eq(lane, first_pad), pset1<packet>(log_remainder), l)));
    } else {
      acc = padd(acc, exp_of(pselect(pcmp_eq(lane, zero), pset1<packet>(log_remainder), lowest)));
    }
    fast_row_values v;
    v.mass = static_cast<double>(predux(acc));
    v.error = sizeof(T) < sizeof(double) ? (n + 3) * 2.5e-7 : 1e-9;
    v.bad = predux_any(bad);
    v.masked = predux_any(masked);
    v.some = predux_any(some);
    return v;
  }
};

/// fast_row_values of log_probs[0..n) and log_remainder (the mass is meaningful only when
/// nothing is bad), in whole packets (fast_values_state).
template <class T>
inline fast_row_values fast_values(const T* log_probs, int n, T log_remainder) {
  fast_values_state<T> st;
  constexpr int lanes = fast_values_state<T>::lanes;
  int k = 0;
  for (; k + lanes <= n; k += lanes) st.add(log_probs + k);
  return st.finish(log_probs, k, n, log_remainder);
}

/// fast_values of two rows of the same length (an aligned row's new and old sides) in one loop:
/// the same operations on each row as fast_values, so the same results, with the two rows'
/// exponentials interleaved.
template <class T>
inline void fast_values_pair(const T* a, T a_remainder, const T* b, T b_remainder, int n, fast_row_values& va,
                             fast_row_values& vb) {
  fast_values_state<T> sa, sb;
  constexpr int lanes = fast_values_state<T>::lanes;
  int k = 0;
  for (; k + lanes <= n; k += lanes) {
    sa.add(a + k);
    sb.add(b + k);
  }
  va = sa.finish(a, k, n, a_remainder);
  vb = sb.finish(b, k, n, b_remainder);
}

/// sparse_values_fine's verdict on a row from its fast_row_values.
template <class T>
inline bool values_fine_given(const fast_row_values& v, const T* log_probs, int n, T log_remainder,
                              std::size_t vocab, bool* finite) {
  const double r = static_cast<double>(log_remainder);
  if (finite) *finite = !v.masked && r > neg_inf();
  if (v.bad || !(r <= 0.0)) return false;
  if (static_cast<std::size_t>(n) == vocab && r > neg_inf()) return false;
  if (!v.some && !(r > neg_inf())) return false;
  const double tol = sparse_mass_tolerance<T>();
  if (v.mass >= 1.0 - tol + v.error && v.mass <= 1.0 + tol - v.error) return true;
  const double exact = sparse_row_mass(log_probs, n, r);
  return exact >= 1.0 - tol && exact <= 1.0 + tol;
}

/// Whether the values of a sparse row with distinct in-range indices pass check_sparse_row:
/// log-probs and log-remainder not NaN and ≤ 0, no remainder mass when count = V, some mass, and
/// Σ p_i + r within sparse_mass_tolerance<T>() of 1. One packet pass (fast_values) finds the
/// flags and the sum; where the sum lands within its error bound of the tolerance's edge (or
/// outside) the scalar double sum of check_sparse_row decides, so both accept the same rows.
/// `finite`, when given, receives whether every log-prob and the log-remainder are above −inf.
template <class T>
inline bool sparse_values_fine(const T* log_probs, long long count, T log_remainder, std::size_t vocab,
                               bool* finite = nullptr) {
  const int n = static_cast<int>(count);
  return values_fine_given(fast_values(log_probs, n, log_remainder), log_probs, n, log_remainder, vocab, finite);
}

/// sparse_values_fine of both sides of an aligned row (count entries each) in one pass
/// (fast_values_pair): whether both pass, with each side's `finite`. The same verdicts as two
/// calls of sparse_values_fine.
template <class T>
inline bool aligned_values_fine(const T* new_lp, T new_remainder, const T* old_lp, T old_remainder,
                                long long count, std::size_t vocab, bool* new_finite, bool* old_finite) {
  const int n = static_cast<int>(count);
  fast_row_values vn, vo;
  fast_values_pair(new_lp, new_remainder, old_lp, old_remainder, n, vn, vo);
  const bool new_fine = values_fine_given(vn, new_lp, n, new_remainder, vocab, new_finite);
  const bool old_fine = values_fine_given(vo, old_lp, n, old_remainder, vocab, old_finite);
  return new_fine && old_fine;
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
/// bucket included (its sides −inf when the tail is empty), passing backward_entry_bad. Entry by
/// entry; backward_row_fine is the same test in packets.
template <class T>
inline bool backward_row_fine_scalar(const sparse_index* ids, const sparse_index* aligned_ids, const T* log_probs,
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

/// backward_row_fine_scalar in packets of T: the ids compared in an integer OR-reduction the
/// compiler vectorises, the four value rows as lane masks (the last partial packet's padding
/// lanes read log π* = −inf, which no check refuses), the bucket by backward_entry_bad.
/// `sides_finite` says the caller knows new_lp and old_lp hold no −inf (validate_aligned's value
/// pass found none): the sides' test then cannot refuse an entry and they are not read.
/// Accepts exactly the rows backward_row_fine_scalar accepts (tests/test_sparse_fast_checks.cpp).
template <class T>
inline bool backward_row_fine(const sparse_index* ids, const sparse_index* aligned_ids, const T* log_probs,
                              const T* new_lp, const T* old_lp, const T* g, int count, T log_remainder,
                              T new_remainder, T old_remainder, T g_remainder, bool sides_finite = false) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr int lanes = int(sizeof(packet) / sizeof(T));
  std::uint32_t differ = 0;
  for (int i = 0; i < count; ++i) differ |= std::uint32_t(ids[i]) ^ std::uint32_t(aligned_ids[i]);
  const packet zero = pset1<packet>(T(0)), lowest = pset1<packet>(-std::numeric_limits<T>::infinity());
  packet bad = zero;
  auto entry = [&](const packet& l, const packet& side_masked, const packet& gk) {
    const packet live = pcmp_lt(lowest, l);
    const packet g_odd = pcmp_lt_or_nan(zero, pabs(psub(gk, gk)));  // g − g is 0 unless g is NaN or ±inf
    bad = por(bad, por(pcmp_lt_or_nan(zero, l), pand(live, por(side_masked, g_odd))));
  };
  auto masked_of = [&](const packet& zn, const packet& zo) { return por(pcmp_eq(zn, lowest), pcmp_eq(zo, lowest)); };
  int k = 0;
  if (sides_finite) {
    for (; k + lanes <= count; k += lanes) entry(ploadu<packet>(log_probs + k), zero, ploadu<packet>(g + k));
    if (k < count) entry(load_padded<packet>(log_probs, k, count), zero, load_padded<packet>(g, k, count));
  } else {
    for (; k + lanes <= count; k += lanes)
      entry(ploadu<packet>(log_probs + k), masked_of(ploadu<packet>(new_lp + k), ploadu<packet>(old_lp + k)),
            ploadu<packet>(g + k));
    if (k < count) {  // padding: log π* = −inf (not live, not above 0); the other rows' padding unread
      entry(load_padded<packet>(log_probs, k, count),
            masked_of(load_padded<packet>(new_lp, k, count), load_padded<packet>(old_lp, k, count)),
            load_padded<packet>(g, k, count));
    }
  }
  return differ == 0 && !predux_any(bad) &&
         backward_entry_bad(log_remainder, new_remainder, old_remainder, g_remainder) == 0;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
