// troll/detail/cpu/row_fingerprint.hpp — projection_stats::row_fingerprint: what the CPU
// backend's project() records of the row pair it solved, and what its derivatives compare with
// the row pair they are given, so that statistics of another row or call are refused rather than
// used. A few reads a row: it tells rows apart, it does not certify every entry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../../config.hpp"
#include "../../sparse_types.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// The bits of v rounded to float (beyond float's range: ±inf), so that a row and its float or
/// double copy give the same fingerprint.
inline std::uint64_t fingerprint_bits(double v) {
  constexpr double top = static_cast<double>(std::numeric_limits<float>::max());
  constexpr float inf = std::numeric_limits<float>::infinity();
  const float f = v > top ? inf : (v < -top ? -inf : static_cast<float>(v));
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// Two values' bits in one word.
inline std::uint64_t fingerprint_pair(double a, double b) { return (fingerprint_bits(a) << 32) | fingerprint_bits(b); }

/// h with x mixed in (a 64-bit finaliser after the xor: every bit of x moves every bit of h).
inline std::uint64_t fingerprint_mix(std::uint64_t h, std::uint64_t x) {
  std::uint64_t z = h ^ (x + 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The fingerprint of a dense row pair of V tokens: V and both rows' logits at tokens 0, V/2 and
/// V − 1 (never 0).
template <class T>
std::uint64_t dense_row_fingerprint(const T* new_logits, const T* old_logits, std::size_t size) {
  std::uint64_t h = fingerprint_mix(0x243f6a8885a308d3ull, static_cast<std::uint64_t>(size));
  for (const std::size_t j : {std::size_t(0), size / 2, size - 1})
    h = fingerprint_mix(h, fingerprint_pair(static_cast<double>(new_logits[j]), static_cast<double>(old_logits[j])));
  return h == 0 ? 1 : h;
}

/// The fingerprint of aligned row r (its count in [0, k_max], which the caller has checked): the
/// count, V, both buckets, and the ids and both sides' log-probabilities of its first and last
/// entries (never 0).
template <class T>
std::uint64_t aligned_row_fingerprint(const aligned_batch_view<const T>& a, std::size_t r) {
  const auto n = static_cast<std::uint64_t>(a.counts[r]);
  std::uint64_t h = fingerprint_mix(0x13198a2e03707344ull, (n << 40) ^ static_cast<std::uint64_t>(a.vocab));
  h = fingerprint_mix(h, fingerprint_pair(static_cast<double>(a.new_log_remainder[r]),
                                          static_cast<double>(a.old_log_remainder[r])));
  if (n > 0) {
    const std::size_t first = r * a.k_max, last = first + static_cast<std::size_t>(n) - 1;
    h = fingerprint_mix(h, (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a.indices[first])) << 32) |
                               static_cast<std::uint32_t>(a.indices[last]));
    h = fingerprint_mix(h, fingerprint_pair(static_cast<double>(a.new_log_probs[first]),
                                            static_cast<double>(a.old_log_probs[first])));
    h = fingerprint_mix(h, fingerprint_pair(static_cast<double>(a.new_log_probs[last]),
                                            static_cast<double>(a.old_log_probs[last])));
  }
  return h == 0 ? 1 : h;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
