// troll/detail/cpu/finite_rows.hpp — fused SIMD passes (Eigen's packet primitives: AVX-512, AVX2,
// SSE or NEON as compiled, scalar otherwise) for the common row pair: every logit finite and a
// logit spread of at most 700, so no exponent falls below −700 (where the packet exponentials
// clamp) and no difference can overflow. The scan that recognises such a pair and the tilted
// reduction (tilt_family.hpp, lse_state.hpp) in two passes per block: x, w and their maximum, then
// the exponentials and the three weighted sums together. Rows of a few dozen entries (the lumped
// sparse rows) pay no per-expression setup.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "../../config.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../tilt_family.hpp"
#include "packet_exp.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// A packet of doubles from `lanes` consecutive T (float widened exactly; in registers where the
/// packet is AVX-512's or AVX's).
template <class Packet, class T>
inline Packet load_as_double(const T* p) {
  using namespace Eigen::internal;
  if constexpr (std::is_same<T, double>::value) {
    return ploadu<Packet>(p);
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same<T, float>::value && sizeof(Packet) == sizeof(__m512d)) {
      return Packet(_mm512_cvtps_pd(_mm256_loadu_ps(p)));
    }
#endif
#if defined(__AVX__)
    if constexpr (std::is_same<T, float>::value && sizeof(Packet) == sizeof(__m256d)) {
      return Packet(_mm256_cvtps_pd(_mm_loadu_ps(p)));
    }
#endif
    constexpr int lanes = int(sizeof(Packet) / sizeof(double));
    double wide[std::size_t(lanes)];
    for (int k = 0; k < lanes; ++k) wide[k] = double(p[k]);
    return ploadu<Packet>(wide);
  }
}

/// Stores a packet of doubles as `lanes` consecutive T (rounded to float for float rows; in
/// registers where the packet is AVX-512's or AVX's).
template <class T, class Packet>
inline void store_from_double(T* p, const Packet& v) {
  using namespace Eigen::internal;
  if constexpr (std::is_same<T, double>::value) {
    pstoreu(p, v);
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same<T, float>::value && sizeof(Packet) == sizeof(__m512d)) {
      _mm256_storeu_ps(p, _mm512_cvtpd_ps(v));
      return;
    }
#endif
#if defined(__AVX__)
    if constexpr (std::is_same<T, float>::value && sizeof(Packet) == sizeof(__m256d)) {
      _mm_storeu_ps(p, _mm256_cvtpd_ps(v));  // rounded to nearest, as float(double)
      return;
    }
#endif
    constexpr int lanes = int(sizeof(Packet) / sizeof(double));
    double wide[std::size_t(lanes)];
    pstoreu(wide, v);
    for (int k = 0; k < lanes; ++k) p[k] = T(wide[k]);
  }
}

/// Largest and smallest entries of a pair of double rows, and of their difference z̃ − z° as
/// formed in the rows' own type (each rounded once: within a relative 2^-24 (float) or 2^-53 of
/// the exact difference).
struct pair_extremes {
  double max_new, max_old, min_new, min_old;
  double max_diff, min_diff;
};

/// One packet pass over zn, zo[0..count) in T's own packets (float rows 16 lanes wide with
/// AVX-512): false when some entry is NaN or ±inf (x − x is then NaN, and so is the sum of those
/// differences), else true with the extremes of each row (exact: max and min round nothing).
template <class T>
inline bool finite_extremes(const T* zn, const T* zo, long count, pair_extremes& e) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  const long whole = count - count % lanes;
  packet hi_n = pset1<packet>(-std::numeric_limits<T>::infinity()), hi_o = hi_n;
  packet lo_n = pset1<packet>(std::numeric_limits<T>::infinity()), lo_o = lo_n;
  packet hi_d = hi_n, lo_d = lo_n;
  packet bad = pset1<packet>(T(0));
  for (long k = 0; k < whole; k += lanes) {
    const packet a = ploadu<packet>(zn + k), b = ploadu<packet>(zo + k);
    bad = padd(bad, padd(psub(a, a), psub(b, b)));
    hi_n = pmax(hi_n, a);
    hi_o = pmax(hi_o, b);
    lo_n = pmin(lo_n, a);
    lo_o = pmin(lo_o, b);
    const packet d = psub(a, b);  // ±inf where both are finite but far apart: max/min keep it
    hi_d = pmax(hi_d, d);
    lo_d = pmin(lo_d, d);
  }
  T odd = predux(bad);
  T most_n = predux_max(hi_n), most_o = predux_max(hi_o), least_n = predux_min(lo_n), least_o = predux_min(lo_o);
  T most_d = predux_max(hi_d), least_d = predux_min(lo_d);
  for (long k = whole; k < count; ++k) {
    odd += (zn[k] - zn[k]) + (zo[k] - zo[k]);
    most_n = zn[k] > most_n ? zn[k] : most_n;
    most_o = zo[k] > most_o ? zo[k] : most_o;
    least_n = zn[k] < least_n ? zn[k] : least_n;
    least_o = zo[k] < least_o ? zo[k] : least_o;
    const T d = zn[k] - zo[k];
    most_d = d > most_d ? d : most_d;
    least_d = d < least_d ? d : least_d;
  }
  e = pair_extremes{double(most_n), double(most_o), double(least_n), double(least_o), double(most_d), double(least_d)};
  return odd == T(0);
}

/// The first k < count with z[k] == value, packet by packet (value occurs in z; were it not, 0:
/// the search never reads past the row).
template <class T>
inline long first_index_of(const T* z, long count, T value) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  const long whole = count - count % lanes;
  const packet target = pset1<packet>(value);
  long k = 0;
  while (k < whole && !predux_any(pcmp_eq(ploadu<packet>(z + k), target))) k += lanes;
  while (k < count && z[k] != value) ++k;
  return k < count ? k : 0;
}

/// Lane by lane: where value > most, most ← value and most_at ← at (ties keep the earlier one).
template <class Packet>
inline void keep_first_max(const Packet& value, const Packet& at, Packet& most, Packet& most_at) {
  using namespace Eigen::internal;
  const Packet above = pcmp_lt(most, value);
  most = pselect(above, value, most);
  most_at = pselect(above, at, most_at);
}
inline void keep_first_max(double value, double at, double& most, double& most_at) {
  if (most < value) most = value, most_at = at;
}

/// lse_state::depth of a sum over `count` terms in packets of `lanes` accumulated over chunks of
/// `chunk` terms, each chunk's packet reduced and added to the total (tilt_reduce_one_pass,
/// tilt_reduce_ends): a lane's additions within a chunk, the reduction of the lanes (at most
/// `lanes` deep), one addition per chunk into the total and the last partial packet's.
inline double chunked_sum_depth(long count, long lanes, long chunk) {
  const long within = (count < chunk ? count : chunk) / lanes;
  return double(within + lanes + (count + chunk - 1) / chunk + 1);
}

/// tilt_reduce_finite in two passes: x, w and their maximum m, then e^{w − m} and the sums.
inline lse_state tilt_reduce_two_pass(const double* zn, const double* zo, long count, const tilt_param& u,
                                      const tilt_ref& ref, double* x, double* w) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  const long whole = count - count % lanes;
  // w = (z° − z°_r) + t·x for t ≤ 1/2, (z̃ − z̃_r) − s·x above: the same two writings as
  // tilt_family.hpp's tilt_weight.
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  // Each lane keeps its largest w and the first token that has it (the token ids as doubles).
  packet most = pset1<packet>(neg_inf()), most_at = pset1<packet>(0.0), token = plset<packet>(0.0);
  const packet step = pset1<packet>(double(lanes));
  for (long k = 0; k < whole; k += lanes) {
    const packet dn = psub(ploadu<packet>(zn + k), rn);
    const packet dold = psub(ploadu<packet>(zo + k), ro);
    const packet xk = psub(dn, dold);
    const packet wk = padd(low ? dold : dn, pmul(ps, xk));
    pstoreu(x + k, xk);
    pstoreu(w + k, wk);
    keep_first_max(wk, token, most, most_at);
    token = padd(token, step);
  }
  double lane_most[lanes], lane_at[lanes];
  pstoreu(lane_most, most);
  pstoreu(lane_at, most_at);
  double m = neg_inf();
  long at = 0;
  for (long j = 0; j < lanes; ++j) {  // the largest w, and the first token of it
    if (lane_most[j] > m || (lane_most[j] == m && long(lane_at[j]) < at)) m = lane_most[j], at = long(lane_at[j]);
  }
  for (long k = whole; k < count; ++k) {
    const double dn = zn[k] - ref.zn, dold = zo[k] - ref.zo;
    x[k] = dn - dold;
    w[k] = (low ? dold : dn) + slope * x[k];
    if (w[k] > m) m = w[k], at = k;
  }
  lse_state st;
  if (count == 0) return st;
  // The last partial packet is padded with w = −inf, x = 0: its weights come out ≤ 1e-304, which
  // leave s0 ≥ 1 unchanged, and multiply x = 0 in s1 and s2.
  const long padded = whole == count ? count : whole + lanes;
  for (long k = count; k < padded; ++k) x[k] = 0.0, w[k] = neg_inf();
  const packet pm = pset1<packet>(m);
  packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0;
  for (long k = 0; k < padded; k += lanes) {
    const packet e = exp_nonpositive(psub(ploadu<packet>(w + k), pm));
    const packet xk = ploadu<packet>(x + k);
    const packet ex = pmul(e, xk);
    s0 = padd(s0, e);
    s1 = padd(s1, ex);
    s2 = padd(s2, pmul(ex, xk));  // (e·x)·x, as tilt_evaluator
  }
  st.m = m;
  st.s0 = predux(s0);
  st.s1 = predux(s1);
  st.s2 = predux(s2);
  st.depth = double(padded / lanes + lanes);  // each lane's additions, then the lanes'
  st.ref_new = zn[at];
  st.ref_old = zo[at];
  return st;
}

/// The lse_state of the pairs (w_i, x_i), i < count, of the finite logits zn, zo at (u, ref), with
/// the (z̃, z°) of the first token of largest w as its reference. `x` and `w` are scratch of
/// `count` doubles rounded up to a whole packet (block_size holds any block). Precondition: every
/// logit finite and max − min over both rows ≤ 700.
///
/// One pass where it can: w is written relative to the reference, whose own w is 0, so the
/// weights e^{w} need not wait for the maximum m. They are taken as they come (e^w within 1 ulp
/// for w up to 32 as below 0; a weight below e^{−700} becomes e^{−700}, nothing beside the
/// reference's 1 or a block maximum above e^{−64}), the maximum and its first token found in the
/// same pass, and the sums rescaled by e^{−m} once at the end. A block whose maximum falls
/// outside [−64, 32] (the reference far from the mode, or outside the block) takes the two
/// passes of tilt_reduce_two_pass instead. The sums are those of the two-pass reduction up to
/// rounding (as for a different summation order).
inline lse_state tilt_reduce_finite(const double* zn, const double* zo, long count, const tilt_param& u,
                                    const tilt_ref& ref, double* x, double* w) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  if (count == 0) return lse_state{};
  const long whole = count - count % lanes;
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  packet most = pset1<packet>(neg_inf()), most_at = pset1<packet>(0.0), token = plset<packet>(0.0);
  packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0;
  const packet step = pset1<packet>(double(lanes));
  // One packet of pairs: x, w, the running maximum, the weight and the three sums.
  auto add = [&](const packet& a, const packet& b, const packet& valid, auto masked) {
    const packet dn = psub(a, rn), dold = psub(b, ro);
    const packet xk = psub(dn, dold);  // 0 in the padding (the reference's own logits)
    // Explicit fused multiply-adds (not left to the compiler's contraction), so that every
    // reduction of the same row (one pass or two) gives the same bits.
    packet wk = pmadd(ps, xk, low ? dold : dn);
    if (decltype(masked)::value) wk = pselect(valid, wk, pset1<packet>(neg_inf()));
    keep_first_max(wk, token, most, most_at);
    token = padd(token, step);
    const packet e = exp_nonpositive(wk);  // padding: w = −inf gives e^{−700} ≤ 1e-304, x = 0
    const packet ex = pmul(e, xk);
    s0 = padd(s0, e);
    s1 = padd(s1, ex);
    s2 = pmadd(ex, xk, s2);  // (e·x)·x, as tilt_evaluator
  };
  for (long k = 0; k < whole; k += lanes) add(ploadu<packet>(zn + k), ploadu<packet>(zo + k), step, std::false_type{});
  if (whole < count) {  // the last partial packet, padded with the reference's own logits
    double an[lanes], bo[lanes], valid[lanes];
    for (long j = 0; j < lanes; ++j) {
      const bool in = whole + j < count;
      an[j] = in ? zn[whole + j] : ref.zn;
      bo[j] = in ? zo[whole + j] : ref.zo;
      valid[j] = in ? 1.0 : 0.0;
    }
    add(ploadu<packet>(an), ploadu<packet>(bo), pcmp_eq(ploadu<packet>(valid), pset1<packet>(1.0)), std::true_type{});
  }
  double lane_most[lanes], lane_at[lanes];
  pstoreu(lane_most, most);
  pstoreu(lane_at, most_at);
  double m = neg_inf();
  long at = 0;
  for (long j = 0; j < lanes; ++j) {  // the largest w, and the first token of it
    if (lane_most[j] > m || (lane_most[j] == m && long(lane_at[j]) < at)) m = lane_most[j], at = long(lane_at[j]);
  }
  if (!(m >= -64.0 && m <= 32.0)) return tilt_reduce_two_pass(zn, zo, count, u, ref, x, w);
  lse_state st;
  st.m = m;
  st.s0 = predux(s0);
  st.s1 = predux(s1);
  st.s2 = predux(s2);
  if (m != 0.0) {
    const double scale = std::exp(-m);
    st.s0 *= scale;
    st.s1 *= scale;
    st.s2 *= scale;
  }
  st.depth = double((count + lanes - 1) / lanes + lanes + 2);  // lane additions, the lanes', the scale
  st.ref_new = zn[at];
  st.ref_old = zo[at];
  return st;
}

/// tilt_reduce_finite in one pass over the row and without scratch, for a reference whose w
/// stays in [−707, 600] over the row (as it does when the reference is a token of a row pair of
/// spread ≤ 700: w is then a convex combination of two differences in [−700, 700], and the
/// reference's own w = 0 makes the maximum ≥ 0). Every exponential is taken at the fixed shift
/// 0, e^{w_i} (a normal double, no overflow of the sums), while the same pass keeps the largest
/// w and its first token; the sums are rescaled by e^{−m} at the end. Reads the T rows directly
/// (float widened in registers). The sums run in packet accumulators over chunks of 512 tokens,
/// each chunk's sum added to the row's, as the blocked reduction does. Returns false (and
/// leaves `st` alone) where w left that range: the caller then takes the two-pass reduction.
///
/// With Cumulants, the same pass also forms s3 and s4 (two more multiplies and fused
/// multiply-adds per packet), which the solver's prediction of a nearby member needs.
template <bool Cumulants = false, class T>
inline bool tilt_reduce_one_pass(const T* zn, const T* zo, long count, const tilt_param& u, const tilt_ref& ref,
                                 lse_state& st) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  if (count <= 0) return false;
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  // w of one packet, the same arithmetic wherever it is evaluated (also when the mode is sought)
  auto weight = [&](const packet& a, const packet& b, packet& xk) {
    const packet dn = psub(a, rn), dold = psub(b, ro);
    xk = psub(dn, dold);
    return pmadd(ps, xk, low ? dold : dn);  // explicit FMA: the same bits in every pass
  };
  // Each lane keeps its largest w and the first token that has it (token ids as doubles), and
  // its smallest w: the first token of the row's largest w comes out of the same pass.
  packet most = pset1<packet>(neg_inf()), most_at = pset1<packet>(0.0), least = pset1<packet>(inf());
  packet token = plset<packet>(0.0);
  const packet step = pset1<packet>(double(lanes));
  double t0 = 0.0, t1 = 0.0, t2 = 0.0, t3 = 0.0, t4 = 0.0;
  const long whole = count - count % lanes;
  // One packet: x, w, e^w and the three weighted sums; returns w for the extremes.
  auto body = [&](const packet& a, const packet& b, packet& s0, packet& s1, packet& s2, packet& s3, packet& s4) {
    packet xk;
    const packet wk = weight(a, b, xk);
    const packet e = exp_in_range(wk);  // w outside [−707, 600]: the pass returns false below
    const packet ex = pmul(e, xk);
    s0 = padd(s0, e);
    s1 = padd(s1, ex);
    s2 = pmadd(ex, xk, s2);  // (e·x)·x, as tilt_evaluator
    if constexpr (Cumulants) {
      const packet exx = pmul(ex, xk);
      s3 = pmadd(exx, xk, s3);  // ((e·x)·x)·x, as push
      s4 = pmadd(pmul(exx, xk), xk, s4);
    }
    return wk;
  };
  for (long begin = 0; begin < whole; begin += chunk) {
    const long end = begin + chunk < whole ? begin + chunk : whole;
    packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0, s3 = s0, s4 = s0;
    for (long k = begin; k < end; k += lanes) {
      const packet wk = body(load_as_double<packet>(zn + k), load_as_double<packet>(zo + k), s0, s1, s2, s3, s4);
      keep_first_max(wk, token, most, most_at);
      least = pmin(least, wk);
      token = padd(token, step);
    }
    t0 += predux(s0), t1 += predux(s1), t2 += predux(s2);
    if constexpr (Cumulants) t3 += predux(s3), t4 += predux(s4);
  }
  if (whole < count) {  // the last partial packet: padded with the reference (x = w = 0), weight 0
    packet pa, pb, use;
#if defined(__AVX512F__)
    if constexpr (lanes == 8) {
      const __mmask8 in = __mmask8((1u << unsigned(count - whole)) - 1u);
      if constexpr (std::is_same<T, double>::value) {
        pa = _mm512_mask_loadu_pd(rn, in, zn + whole);
        pb = _mm512_mask_loadu_pd(ro, in, zo + whole);
      } else {
        pa = _mm512_mask_mov_pd(rn, in, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, zn + whole)));
        pb = _mm512_mask_mov_pd(ro, in, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, zo + whole)));
      }
      use = _mm512_maskz_mov_pd(in, _mm512_set1_pd(1.0));
    } else
#endif
    {
      double a[lanes], b[lanes], keep[lanes];
      for (long j = 0; j < lanes; ++j) {
        const bool in = whole + j < count;
        a[j] = in ? double(zn[whole + j]) : ref.zn;
        b[j] = in ? double(zo[whole + j]) : ref.zo;
        keep[j] = in ? 1.0 : 0.0;
      }
      pa = ploadu<packet>(a), pb = ploadu<packet>(b), use = ploadu<packet>(keep);
    }
    packet s0 = pset1<packet>(0.0), s1 = s0, s2 = s0, s3 = s0, s4 = s0;
    const packet wk = body(pa, pb, s0, s1, s2, s3, s4);
    // padded lanes change nothing: kept out of the extremes, their sums multiplied by 0
    const packet pad = pcmp_eq(use, pset1<packet>(0.0));
    keep_first_max(pselect(pad, pset1<packet>(neg_inf()), wk), token, most, most_at);
    least = pmin(least, pselect(pad, pset1<packet>(inf()), wk));
    t0 += predux(pmul(s0, use)), t1 += predux(pmul(s1, use)), t2 += predux(pmul(s2, use));
    if constexpr (Cumulants) t3 += predux(pmul(s3, use)), t4 += predux(pmul(s4, use));
  }
  const double m = predux_max(most);
  if (!(m <= 600.0 && predux_min(least) >= -707.0)) return false;
  // The first token of the largest w: the smallest first token among the lanes that reach it.
  double lane_most[lanes], lane_at[lanes];
  pstoreu(lane_most, most);
  pstoreu(lane_at, most_at);
  long at = count;
  for (long j = 0; j < lanes; ++j)
    if (lane_most[j] == m && long(lane_at[j]) < at) at = long(lane_at[j]);
  double scale_lanes[lanes];
  pstoreu(scale_lanes, exp_bounded(pset1<packet>(-m)));
  const double scale = scale_lanes[0];
  st.m = m;
  st.s0 = t0 * scale;
  st.s1 = t1 * scale;
  st.s2 = t2 * scale;
  if constexpr (Cumulants) st.s3 = t3 * scale, st.s4 = t4 * scale;
  st.depth = chunked_sum_depth(count, lanes, chunk) + 2.0;  // and the scale's two roundings
  st.ref_new = double(zn[at]);
  st.ref_old = double(zo[at]);
  return true;
}

/// The reductions of both ends, t = 0 relative to `zero_ref` and t = 1 relative to `one_ref`, in
/// one pass over the rows: what tilt_reduce_one_pass gives for each, bit for bit, where the
/// references are the first tokens of the largest z° and z̃ respectively and the pair is finite
/// with a spread of at most 700 (scan_pair's row_setup::old_top and new_top). There w is
/// exactly z° − z°_r at t = 0 and z̃ − z̃_r at t = 1 (tilt_reduce_one_pass's fused multiply-add by
/// a zero slope changes nothing), at most 0 with its maximum 0 at the reference: so no maximum
/// is sought, the sums need no rescaling, and the reference is the state's mode. Each end pads
/// the last partial packet with its own reference, as tilt_reduce_one_pass does.
template <bool Cumulants = false, class T>
inline void tilt_reduce_ends(const T* zn, const T* zo, long count, const tilt_ref& zero_ref, const tilt_ref& one_ref,
                             lse_state& zero, lse_state& one) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  const packet rn0 = pset1<packet>(zero_ref.zn), ro0 = pset1<packet>(zero_ref.zo);
  const packet rn1 = pset1<packet>(one_ref.zn), ro1 = pset1<packet>(one_ref.zo);
  struct sums {
    packet s0, s1, s2, s3, s4;
  };
  // One end's packet: x, e^w and the weighted sums, as tilt_reduce_one_pass's body.
  auto add = [](const packet& w, const packet& xk, sums& s) {
    const packet e = exp_in_range(w);  // w ∈ [−700, 0]
    const packet ex = pmul(e, xk);
    s.s0 = padd(s.s0, e);
    s.s1 = padd(s.s1, ex);
    s.s2 = pmadd(ex, xk, s.s2);
    if constexpr (Cumulants) {
      const packet exx = pmul(ex, xk);
      s.s3 = pmadd(exx, xk, s.s3);
      s.s4 = pmadd(pmul(exx, xk), xk, s.s4);
    }
  };
  auto zero_sums = [] {
    const packet z = pset1<packet>(0.0);
    return sums{z, z, z, z, z};
  };
  double u[5] = {0, 0, 0, 0, 0}, v[5] = {0, 0, 0, 0, 0};  // the t = 0 and t = 1 totals
  auto total = [](double* t, const sums& s, const packet& use) {
    t[0] += predux(pmul(s.s0, use)), t[1] += predux(pmul(s.s1, use)), t[2] += predux(pmul(s.s2, use));
    if constexpr (Cumulants) t[3] += predux(pmul(s.s3, use)), t[4] += predux(pmul(s.s4, use));
  };
  auto chunk_total = [](double* t, const sums& s) {
    t[0] += predux(s.s0), t[1] += predux(s.s1), t[2] += predux(s.s2);
    if constexpr (Cumulants) t[3] += predux(s.s3), t[4] += predux(s.s4);
  };
  const long whole = count - count % lanes;
  for (long begin = 0; begin < whole; begin += chunk) {
    const long end = begin + chunk < whole ? begin + chunk : whole;
    sums a0 = zero_sums(), a1 = zero_sums();
    for (long k = begin; k < end; k += lanes) {
      const packet a = load_as_double<packet>(zn + k), b = load_as_double<packet>(zo + k);
      const packet dn0 = psub(a, rn0), do0 = psub(b, ro0);
      add(do0, psub(dn0, do0), a0);
      const packet dn1 = psub(a, rn1), do1 = psub(b, ro1);
      add(dn1, psub(dn1, do1), a1);
    }
    chunk_total(u, a0);
    chunk_total(v, a1);
  }
  if (whole < count) {  // the last partial packet: each end padded with its reference, weight 0
    packet pa0, pb0, pa1, pb1, use;
#if defined(__AVX512F__)
    if constexpr (lanes == 8) {
      const __mmask8 in = __mmask8((1u << unsigned(count - whole)) - 1u);
      packet a, b;
      if constexpr (std::is_same<T, double>::value) {
        a = _mm512_maskz_loadu_pd(in, zn + whole);
        b = _mm512_maskz_loadu_pd(in, zo + whole);
      } else {
        a = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, zn + whole));
        b = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, zo + whole));
      }
      pa0 = _mm512_mask_mov_pd(rn0, in, a), pb0 = _mm512_mask_mov_pd(ro0, in, b);
      pa1 = _mm512_mask_mov_pd(rn1, in, a), pb1 = _mm512_mask_mov_pd(ro1, in, b);
      use = _mm512_maskz_mov_pd(in, _mm512_set1_pd(1.0));
    } else
#endif
    {
      double a0[lanes], b0[lanes], a1[lanes], b1[lanes], keep[lanes];
      for (long j = 0; j < lanes; ++j) {
        const bool in = whole + j < count;
        a0[j] = in ? double(zn[whole + j]) : zero_ref.zn;
        b0[j] = in ? double(zo[whole + j]) : zero_ref.zo;
        a1[j] = in ? double(zn[whole + j]) : one_ref.zn;
        b1[j] = in ? double(zo[whole + j]) : one_ref.zo;
        keep[j] = in ? 1.0 : 0.0;
      }
      pa0 = ploadu<packet>(a0), pb0 = ploadu<packet>(b0), pa1 = ploadu<packet>(a1), pb1 = ploadu<packet>(b1);
      use = ploadu<packet>(keep);
    }
    sums a0 = zero_sums(), a1 = zero_sums();
    const packet dn0 = psub(pa0, rn0), do0 = psub(pb0, ro0);
    add(do0, psub(dn0, do0), a0);
    const packet dn1 = psub(pa1, rn1), do1 = psub(pb1, ro1);
    add(dn1, psub(dn1, do1), a1);
    total(u, a0, use);
    total(v, a1, use);
  }
  auto state = [count](const double* t, const tilt_ref& ref) {
    lse_state st;
    st.m = 0.0;
    st.s0 = t[0], st.s1 = t[1], st.s2 = t[2];
    st.depth = chunked_sum_depth(count, lanes, chunk);
    if constexpr (Cumulants) st.s3 = t[3], st.s4 = t[4];
    st.ref_new = ref.zn;
    st.ref_old = ref.zo;
    return st;
  };
  zero = state(u, zero_ref);
  one = state(v, one_ref);
}

/// Largest and smallest entry of z[0..count) in T's own packets: false when some entry is NaN or
/// ±inf (or count is 0), else true with both (exact: max and min round nothing).
template <class T>
inline bool finite_range(const T* z, long count, double& most, double& least) {
  using namespace Eigen::internal;
  using packet = typename packet_traits<T>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(T));
  if (count <= 0) return false;
  const long whole = count - count % lanes;
  packet hi = pset1<packet>(-std::numeric_limits<T>::infinity());
  packet lo = pset1<packet>(std::numeric_limits<T>::infinity());
  packet bad = pset1<packet>(T(0));
  for (long k = 0; k < whole; k += lanes) {
    const packet a = ploadu<packet>(z + k);
    bad = padd(bad, psub(a, a));
    hi = pmax(hi, a);
    lo = pmin(lo, a);
  }
  T odd = predux(bad), top = predux_max(hi), bottom = predux_min(lo);
  for (long k = whole; k < count; ++k) {
    odd += z[k] - z[k];
    top = z[k] > top ? z[k] : top;
    bottom = z[k] < bottom ? z[k] : bottom;
  }
  most = double(top);
  least = double(bottom);
  return odd == T(0);
}

/// Σ_k e^{z_k − top} of a finite row whose entries lie within 700 of `top` = max_k z_k: the
/// arithmetic of tilt_reduce_one_pass's s0 at t = 1 relative to the row's first maximum, bit for
/// bit (the same exponentials, packet sums over the same chunks, the same tail), so that an
/// inactive row the projection writes from that pass's normaliser is log_softmax's to the bit.
template <class T>
inline double exp_sum_below_top(const T* z, long count, double top) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  const packet rn = pset1<packet>(top);
  double t0 = 0.0;
  const long whole = count - count % lanes;
  for (long begin = 0; begin < whole; begin += chunk) {
    const long end = begin + chunk < whole ? begin + chunk : whole;
    packet s0 = pset1<packet>(0.0);
    for (long k = begin; k < end; k += lanes) s0 = padd(s0, exp_in_range(psub(load_as_double<packet>(z + k), rn)));
    t0 += predux(s0);
  }
  if (whole < count) {  // as tilt_reduce_one_pass: padded with the reference, weight 0
    packet pa, use;
#if defined(__AVX512F__)
    if constexpr (lanes == 8) {
      const __mmask8 in = __mmask8((1u << unsigned(count - whole)) - 1u);
      if constexpr (std::is_same<T, double>::value) {
        pa = _mm512_mask_loadu_pd(rn, in, z + whole);
      } else {
        pa = _mm512_mask_mov_pd(rn, in, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, z + whole)));
      }
      use = _mm512_maskz_mov_pd(in, _mm512_set1_pd(1.0));
    } else
#endif
    {
      double a[lanes], keep[lanes];
      for (long j = 0; j < lanes; ++j) {
        const bool in = whole + j < count;
        a[j] = in ? double(z[whole + j]) : top;
        keep[j] = in ? 1.0 : 0.0;
      }
      pa = ploadu<packet>(a), use = ploadu<packet>(keep);
    }
    const packet s0 = padd(pset1<packet>(0.0), exp_in_range(psub(pa, rn)));
    t0 += predux(pmul(s0, use));
  }
  return t0;
}

/// out_i = log π_t,i = w_i − log_norm (tilt_family.hpp) of a row pair whose logits are all
/// finite with a spread of at most 700 (no difference can overflow, so nothing is clamped): one
/// packet pass reading the T rows directly (float widened in registers) and writing T, with w
/// formed by the same fused multiply-add as tilt_reduce_one_pass. Each value is at most 0 (a
/// log-probability; the rounding of w − log_norm can otherwise leave ~1e-179 above 0 on the
/// dominant token of a member with a tiny t).
template <class T>
inline void write_tilted(const T* zn, const T* zo, long count, const tilt_param& u, const tilt_ref& ref,
                         double log_norm, T* out) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  const bool low = u.t <= 0.5;
  const double slope = low ? u.t : -u.s;
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), ps = pset1<packet>(slope);
  const packet norm = pset1<packet>(log_norm), zero = pset1<packet>(0.0);
  const long whole = count - count % lanes;
  for (long k = 0; k < whole; k += lanes) {
    const packet dn = psub(load_as_double<packet>(zn + k), rn), dold = psub(load_as_double<packet>(zo + k), ro);
    const packet wk = pmadd(ps, psub(dn, dold), low ? dold : dn);
    store_from_double(out + k, pmin(psub(wk, norm), zero));
  }
  for (long k = whole; k < count; ++k) {
    const double dn = double(zn[k]) - ref.zn, dold = double(zo[k]) - ref.zo;
    // Eigen's scalar pmadd: std::fma where the packets' pmadd is fused (FMA builds), a·b + c
    // where it is not (SSE2) — the packets' arithmetic, and tilt_reduce_one_pass's, in every build
    out[k] = T(minimum(pmadd(slope, dn - dold, low ? dold : dn) - log_norm, 0.0));
  }
}

/// q·expm1(x) where |x| ≤ 1/2 and e^{log q + x} − q elsewhere, on one packet (q = e^{log q};
/// log_far = log q + x, formed by the caller as (z_p − z_p,r) + log q_r, without z_q):
/// centred_ratio_terms' term (row_kernels.hpp) without its masks, for kl's and kl_backward's
/// packet passes. An overflow of e^{log_far} gives +inf (exp_any), which the callers reject.
template <class Packet>
inline Packet ratio_term_packet(const Packet& q, const Packet& log_far, const Packet& x) {
  using namespace Eigen::internal;
  const Packet half = pset1<Packet>(0.5);
  const Packet term = pmul(q, expm1_near_zero_packet(pmax(pmin(x, half), pnegate(half))));
  if (!any_lane(pcmp_lt(half, pabs(x)))) return term;  // every |x| ≤ 1/2
  return pselect(pcmp_le(pabs(x), half), term, psub(exp_any(log_far), q));
}

/// difference_error (tilt_family.hpp) on a packet: a − b = d + error exactly, d = fl(a − b).
template <class Packet>
inline Packet difference_error_packet(const Packet& a, const Packet& b, const Packet& d) {
  using namespace Eigen::internal;
  const Packet b_part = psub(d, a);
  return psub(psub(a, psub(d, b_part)), padd(b, b_part));
}

/// The reference's part of kl_centred_packet: rd = z̃_r − z°_r, |rd| and rd's rounding error.
struct centred_reference {
  double rd = 0.0, abs_rd = 0.0, rd_error = 0.0;
  explicit centred_reference(const tilt_ref& ref)
      : rd(ref.zn - ref.zo), abs_rd(::fabs(rd)), rd_error(difference_error(ref.zn, ref.zo, rd)) {}
};

/// kl_centred (tilt_family.hpp) on one packet of a finite pair with a spread of at most 700
/// (nothing to clamp): the row difference d − d_r where it is the smaller, x = (z̃ − z̃_r) −
/// (z° − z°_r) elsewhere, each with its differences' rounding errors. rd = z̃_r − z°_r,
/// abs_rd = |rd|, rd_error its rounding error (centred_reference).
template <class Packet>
inline Packet kl_centred_packet(const Packet& a, const Packet& b, const Packet& rn, const Packet& ro,
                                const Packet& rd, const Packet& abs_rd, const Packet& rd_error) {
  using namespace Eigen::internal;
  const Packet dn = psub(a, rn), dq = psub(b, ro), d = psub(a, b);
  const Packet by_row = padd(psub(d, rd), psub(difference_error_packet(a, b, d), rd_error));
  const Packet by_ref =
      padd(psub(dn, dq), psub(difference_error_packet(a, rn, dn), difference_error_packet(b, ro, dq)));
  return pselect(pcmp_lt(padd(pabs(d), abs_rd), padd(pabs(dn), pabs(dq))), by_row, by_ref);
}

/// KL(π_p‖q) at an evaluated point p as the sum of kl_term (tilt_family.hpp) over a row pair whose
/// logits are all finite with a spread of at most 700 (nothing to clamp, every token on J), in
/// packets: the same formulas — σ by kl_centred's rule, the series where |σ| < 1, else
/// π(σ − 1) + q — with the exponentials by exp_in_range (within 1.5 ulp) in place of std::exp,
/// and the non-negative terms summed in packet accumulators over chunks of 512 tokens. A packet
/// that holds a log q below −708 or a term of the subnormal branch (σ > 1, π < 1e-290) is taken
/// token by token by kl_term itself. The solver asks for this sum where the closed-form KL is too
/// coarse (a KL far below its normalisers' rounding: rows nearly equal to the old ones, which is
/// where PPO-style training starts every update), so its cost is that of one member's pass.
template <class T>
inline double exact_kl_finite(const T* zn, const T* zo, long count, const tilt_point& p) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  const bool low = p.t <= 0.5;
  const double slope = low ? p.t : -p.s;
  const packet rn = pset1<packet>(p.ref.zn), ro = pset1<packet>(p.ref.zo), ps = pset1<packet>(slope);
  const packet pt = pset1<packet>(p.t), ac = pset1<packet>(p.a_c), norm = pset1<packet>(p.log_norm);
  const packet old_max = pset1<packet>(p.old_max), old_log_sum = pset1<packet>(p.old_log_sum);
  const centred_reference cr(p.ref);
  const packet rd = pset1<packet>(cr.rd), abs_rd = pset1<packet>(cr.abs_rd), rd_error = pset1<packet>(cr.rd_error);
  const packet one = pset1<packet>(1.0), zero = pset1<packet>(0.0);
  const packet q_floor = pset1<packet>(-708.0), pi_floor = pset1<packet>(-667.0);  // e^-667 < 1e-290
  // The series' coefficients as packets, set once (the Horner chain then runs in registers).
  packet coefficient[kl_series_terms];
  for (int k = 0; k < kl_series_terms; ++k) coefficient[k] = pset1<packet>(kl_series_coefficient(k));
  // The series from coefficient `first` on: the terms it drops are below 1e-17 of φ(σ) where
  // max|σ| ≤ 1/16 (first = 10, n ≤ 11 kept) or ≤ 1/256 (first = 14, n ≤ 7), as on rows nearly
  // equal to the old ones; all twenty terms otherwise.
  auto series = [&](const packet& sigma, int first) {
    packet acc = coefficient[first];
    for (int k = first + 1; k < kl_series_terms; ++k) acc = pmadd(acc, sigma, coefficient[k]);
    return acc;
  };
  const packet sixteenth = pset1<packet>(1.0 / 16), two56th = pset1<packet>(1.0 / 256);
  // One packet's terms, or false where a lane needs kl_term's own branches.
  auto terms = [&](const packet& a, const packet& b, packet& out) {
    const packet dn = psub(a, rn), dold = psub(b, ro), x = psub(dn, dold);
    const packet sigma = psub(pmul(pt, kl_centred_packet(a, b, rn, ro, rd, abs_rd, rd_error)), ac);
    const packet log_q = psub(psub(b, old_max), old_log_sum);
    const packet abs_sigma = pabs(sigma);
    if (!any_lane(por(pcmp_lt(log_q, q_floor), pcmp_lt(sixteenth, abs_sigma)))) {
      // the common packet: every |σ| ≤ 1/16 and log q in range
      const packet q = exp_in_range(log_q);
      const int first = any_lane(pcmp_lt(two56th, abs_sigma)) ? 10 : 14;
      out = pmul(pmul(q, pmul(sigma, sigma)), series(sigma, first));
      return true;
    }
    const packet log_pi = psub(pmadd(ps, x, low ? dold : dn), norm);
    const packet small = pcmp_lt(abs_sigma, one);
    if (any_lane(por(pcmp_lt(log_q, q_floor), pandnot(pcmp_lt(log_pi, pi_floor), small)))) return false;
    const packet q = exp_in_range(log_q);
    out = pmul(pmul(q, pmul(sigma, sigma)), series(sigma, 0));
    if (any_lane(pcmp_le(one, abs_sigma)))  // some |σ| ≥ 1: π(σ − 1) + q there
      out = pselect(small, out, pmadd(exp_in_range(log_pi), psub(sigma, one), q));
    return true;
  };
  double total = 0.0;
  const long whole = count - count % lanes;
  for (long begin = 0; begin < whole; begin += chunk) {
    const long end = begin + chunk < whole ? begin + chunk : whole;
    packet sum = zero;
    for (long k = begin; k < end; k += lanes) {
      packet term;
      if (terms(load_as_double<packet>(zn + k), load_as_double<packet>(zo + k), term)) {
        sum = padd(sum, term);
      } else {
        double one_by_one = 0.0;
        for (long j = k; j < k + lanes; ++j) one_by_one += kl_term(double(zn[j]), double(zo[j]), p);
        total += one_by_one;
      }
    }
    total += predux(sum);
  }
  for (long k = whole; k < count; ++k) total += kl_term(double(zn[k]), double(zo[k]), p);
  return total;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
