// troll/detail/cpu/backward_kernels.hpp — per-row VJP, JVP and full Jacobian of the projection
// on the CPU (math.md §3), from the forward inputs, its output log π* and its statistics.
//
// With J the tokens where log π* > −inf, d = z̃ − z°, and t, μ, σ² at t*:
//   ∂log π_i/∂z̃_j = t [δ_ij − π_j − (d_i − μ)(d_j − μ) π_j / σ²]
//   ∂log π_i/∂z°_j = (1 − t)(δ_ij − π_j) + (d_i − μ) ∂t/∂z°_j,
//        ∂t/∂z°_j = −[(1 − t) t π_j (d_j − μ) − (π_j − q_j)] / (t σ²),
//        π_j − q_j = q_j · expm1(t (d_j − μ) + KL(π‖q)), π_j = q_j + that   (where π ≈ q;
//        troll/detail/tilt_derivatives.hpp)
//   ∂log π_i/∂ε   = (d_i − μ) / (t σ²)
// Inactive and restricted rows: ∂log π_i/∂z̃_j = δ_ij − π_j on J, nothing else depends.
// Entries off J (masked outputs) take no upstream gradient and give none to masked inputs.
//
// Centring. μ arrives in absolute units (projection_stats), so d_j − μ formed in double carries
// a rounding of ~ulp·(|μ| + |d_j|). Where π* is nearly one-hot on large logits (scale 1e4, t*
// small) the dominant token's true d_j − μ is ~π_minor·Δd, far below that rounding, and it is
// multiplied by Σ g_i (d_i − μ) / σ², which is large: the gradient came out wrong in the fourth
// digit (double). Every path therefore re-centres: with c_j = d_j − μ as rounded and
// m = Σ_J π_j c_j (0 in exact arithmetic), it uses c_j − m, which cancels μ's rounding and, for
// the tokens that carry the mass, d's own (the error left is Σ π_i e_i − e_j, weighted by the
// small masses). The sums linear in c are corrected afterwards (Σ g c − m Σ g). m is formed from
// π read back from log π* in T, so it carries its own noise of about ulp_T·Σ π_j |c_j| (1 + |log π_j|)
// (float: ~6e-8 relative per token); it is applied only where it exceeds twice that estimate
// (centring_step), i.e. where μ's rounding, not π's, dominates.
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../numeric.hpp"
#include "../tilt_derivatives.hpp"
#include "finite_rows.hpp"
#include "row_kernels.hpp"
#include "two_point_rows.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// log-normaliser of the old row, log Σ exp(z°), split as (max, log Σ exp(z° − max)).
struct old_normaliser {
  double max = 0.0;
  double log_sum = 0.0;
};
template <class T>
inline old_normaliser normalise_old(const T* zo, std::size_t size) {
  old_normaliser n;
  n.max = row_max(zo, size);
  n.log_sum = log_sum_exp_shifted(zo, size, n.max);
  return n;
}

/// The centring correction m = Σ π (d − μ) and its noise estimate (the top of this file): the
/// host/device detail::centring_sums of tilt_derivatives.hpp, shared with the CUDA kernels.
using detail::centring_sums;

/// Everything the backward formulas need from one row at one block. Blocks without a masked
/// token (the common case) skip every select: Eigen 3.4 evaluates a select with a boolean
/// condition one coefficient at a time, which would also de-vectorise the exp inside it.
struct backward_block {
  bool full = true;       // every token of the block is on J (log π > −inf)
  block_mask on_support;  // J within the block; meaningful only when !full
  block_array pi;         // π (0 off J)
  block_array centred;    // d − μ (0 off J)
  block_array log_pi;     // log π* (0 off J)

  /// Zeroes `values` off J.
  void restrict(block_array& values) const {
    if (!full) values = on_support.select(values, 0.0);
  }
  /// Subtracts the centring correction m (see the top of this file) from d − μ on J.
  void recentre(double m) {
    if (m == 0.0) return;
    centred -= m;
    restrict(centred);
  }
  /// J as a mask, also when the block is full.
  block_mask support(Eigen::Index count) const {
    return full ? block_mask::Constant(count, true) : on_support;
  }
};

template <class T>
inline void load_backward_block(const T* zn, const T* zo, const T* logp, double mu, std::size_t begin,
                                Eigen::Index count, backward_block& b) {
  const block_array lp = load(logp, begin, count);
  b.pi = exact_exp(lp);
  b.centred = load(zn, begin, count) - load(zo, begin, count) - mu;
  b.log_pi = lp;
  b.full = lp.minCoeff() > neg_inf();
  if (b.full) return;
  // Off J: π is 0 (block_exp(−inf)) and d may be NaN.
  b.on_support = lp > neg_inf();
  b.restrict(b.pi);
  b.restrict(b.centred);
  b.restrict(b.log_pi);
}

// expm1_near_zero (the block expm1 for |x| ≤ 1/2) lives in row_kernels.hpp.

/// log(1/2): a token whose log π* exceeds it is the row's new_side_dominant token.
inline constexpr double dominant_log_pi = -0.6931471805599453;

/// Σ_{i≠skip} x_i in four interleaved partial sums (i mod 4), added pairwise: the same bits
/// wherever it is called on the same values, and about four times faster than one chain.
inline double sum_except(const double* x, long n, long skip) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  for (long i = 0; i < n; ++i) s[i & 3] += i == skip ? 0.0 : x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// new_side_dominant: ∂L/∂z̃ sums to 0 over a row (moving every new logit alike leaves π* alone),
// and at a token k of π_k > 1/2 its entry t((g_k − π_k Σg) − π_k c_k h/σ²) is a difference of
// O(|g|) terms that cancel where the other tokens' mass is tiny (upstream on k alone: 0 for
// 5.8e-18 at a logit gap of 40, an audit of the sparse derivatives). So every VJP path writes
// that entry as minus the sum of the others (as old_side_sums does on the old side; π > 1/2
// strictly, so at most one token qualifies).

/// The dominant token of a row (detail::old_side_sums: π ≥ 1/2, the largest log π*, the lowest
/// index on ties), found by a scan of log π*, or `size` where there is none.
template <class T>
inline std::size_t dominant_index(const T* logp, std::size_t size) {
  old_side_sums scan;
  for (std::size_t j = 0; j < size; ++j) scan.add(j, static_cast<double>(logp[j]), 0.0);
  return scan.found() ? scan.top : size;
}

/// ∂t/∂z°_j on a block (math at the top of this file); 0 where z° = −inf.
template <class T>
inline block_array dt_dold_block(const T* zo, const backward_block& b, const projection_stats& s,
                                 const old_normaliser& on, std::size_t begin, Eigen::Index count) {
  const double t = s.t, rest = one_minus_t(s);
  const block_array old_logits = load(zo, begin, count);
  block_array q = exact_exp((old_logits - on.max) - on.log_sum);
  zero_where_masked(old_logits, q);
  // detail::dt_dold in block form (troll/detail/tilt_derivatives.hpp says why): where
  // |log π_j/q_j| < 1/2, the bracket comes from the log-ratio x = t(d_j − μ) + KL(π‖q) with its
  // O(t) parts cancelled by hand; elsewhere there is no cancellation (and q may underflow while the
  // ratio overflows). Off J the bracket is q_j.
  const block_array tc = t * b.centred;
  const block_array log_ratio = tc + s.kl_after;
  const block_array x = log_ratio.max(-0.5).min(0.5);  // used where |ratio| < 1/2
  const block_array phi = expm1_minus_x_near_zero(x);
  const block_array near = q * ((rest * tc * (x + phi) - phi) - (t * tc + s.kl_after));
  const block_mask support = b.support(count);
  const block_mask close = support && (log_ratio.abs() < 0.5);
  const block_array bracket = close.select(near, support.select(rest * t * b.pi * b.centred - (b.pi - q), q));
  return -bracket / (t * s.sigma2);
}

/// A packet of doubles from p[0..n), n < lanes, the other lanes `fill`: a masked load with AVX-512
/// (nothing read past n), else a copy.
template <class Packet>
inline Packet load_partial(const double* p, long n, double fill) {
  using namespace Eigen::internal;
  constexpr long lanes = long(sizeof(Packet) / sizeof(double));
#if defined(__AVX512F__)
  if constexpr (lanes == 8) return _mm512_mask_loadu_pd(_mm512_set1_pd(fill), __mmask8((1u << unsigned(n)) - 1u), p);
#endif
  double copy[std::size_t(lanes)];
  for (long j = 0; j < lanes; ++j) copy[j] = j < n ? p[j] : fill;
  return ploadu<Packet>(copy);
}

/// The arithmetic of vjp_row_short on a row of `size` ≤ block_size entries whose packets come
/// from read(k, zn, zo, logp, g) (the lanes from entry k on; lanes past `size` read as g = 0,
/// log π = −700 and z̃ = z° = 0, which add nothing to the sums and whose π is never read).
/// Shared by the dense rows' reader (double arrays) and the sparse backward's (the aligned float
/// rows in place, their bucket as the last entry), so both give the same bits. Returns −1,
/// writing nothing, unless every d − μ is finite and every log π* lies in [−700, 0] (checked
/// ≥ −700 here); else writes grad_new[0..size) (doubles) and *grad_eps and returns 1, or 0 when
/// an output does not fit double. π = e^{log π*} by exp_bounded (within 1.5 ulp, as
/// vjp_row_packets), about half the multiply-adds of exp_nonpositive.
/// `pi_ulps`: two_point_frame::pi_ulps of the type log π* was stored in. `magnitude` (optional):
/// receives a bound on max |grad_new| (at least it; NaN or +inf where an entry is not finite), so a
/// caller storing a narrower type checks its entries only where the bound says they may not fit.
template <class Read>
inline int vjp_row_short_core(long size, Read&& read, const projection_stats& s, double* grad_new,
                              double* grad_eps, double pi_ulps = 1.0, double* magnitude = nullptr) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  if (size > long(block_size) || size == 0) return -1;
  const long padded = (size + lanes - 1) / lanes * lanes;
  const bool projected = s.status == row_status::projected;
  double pi[block_size], centred[block_size], gd[block_size], lps[block_size];
  const packet mu = pset1<packet>(s.mu), one = pset1<packet>(1.0), zero = pset1<packet>(0.0);
  packet lowest = zero, odd = zero, sg = zero, sgc = zero, spc = zero, spread = zero;
  // lane j of the packet at k holds entry k + j: the padding's π c (e^{−700}·(−μ)) is kept out
  // of the centring sums
  const packet lane = plset<packet>(0.0), last = pset1<packet>(double(size));
  for (long k = 0; k < padded; k += lanes) {
    packet zn, zo, lp, gk;
    read(k, zn, zo, lp, gk);
    const packet c = psub(psub(zn, zo), mu);
    lowest = pmin(lowest, lp);
    odd = padd(odd, padd(psub(c, c), psub(lp, lp)));  // NaN unless every d − μ and log π is finite
    const packet p = exp_bounded(lp);
    pstoreu(pi + k, p);
    pstoreu(lps + k, lp);
    pstoreu(centred + k, c);
    pstoreu(gd + k, gk);
    sg = padd(sg, gk);
    sgc = padd(sgc, pmul(gk, c));
    // the centring correction (top of this file), in packets: Σ π c and Σ |π c| (1 − log π)
    const packet pc = pand(pmul(p, c), pcmp_lt(padd(lane, pset1<packet>(double(k))), last));
    spc = padd(spc, pc);
    spread = padd(spread, pmul(pabs(pc), psub(one, lp)));
  }
  if (!(predux_min(lowest) >= -700.0 && predux(odd) == 0.0)) return -1;
  centring_sums cs;
  cs.m = predux(spc);
  cs.spread = predux(spread);
  const double m = projected ? cs.step<double>() : 0.0;
  const double sum_g = predux(sg), sum_gc = projected ? predux(sgc) - m * sum_g : 0.0;
  const double t = projected ? s.t : 1.0;
  const double h_over_var = projected ? sum_gc / s.sigma2 : 0.0;
  // The gradient in packets (GCC left this loop scalar once it held four reductions): the padding
  // lanes are zeroed, so they add nothing to the reductions and the last packet's store writes
  // only the row's entries.
  const packet t_p = pset1<packet>(t), sum_gp = pset1<packet>(sum_g), mp = pset1<packet>(m),
               hp = pset1<packet>(h_over_var);
  packet bad = zero, most_p = pset1<packet>(-700.0), largest_p = zero, widest_p = zero;
  for (long k = 0; k < padded; k += lanes) {
    const packet p = ploadu<packet>(pi + k), gk = ploadu<packet>(gd + k), lp = ploadu<packet>(lps + k);
    const packet c = psub(ploadu<packet>(centred + k), mp);
    packet gn = pmul(t_p, psub(psub(gk, pmul(p, sum_gp)), pmul(pmul(p, c), hp)));
    if (k + lanes > size) gn = pand(gn, pcmp_lt(padd(lane, pset1<packet>(double(k))), last));
    bad = padd(bad, psub(gn, gn));  // NaN unless every entry is finite
    most_p = pmax(most_p, lp);
    largest_p = pmax(largest_p, pabs(gn));
    widest_p = pmax(widest_p, pabs(gk));
    if (k + lanes <= size) {
      pstoreu(grad_new + k, gn);
    } else {
      double rest[lanes];
      pstoreu(rest, gn);
      for (long j = 0; j < size - k; ++j) grad_new[k + j] = rest[j];
    }
  }
  const int overflow = predux(bad) == 0.0 ? 0 : 1;
  const double most = predux_max(most_p);  // the largest log π
  const double largest = predux_max(largest_p), widest_g = predux_max(widest_p);  // for two_point_suspect
  double bound = overflow == 0 ? largest : inf();  // max |grad_new|, with the entries replaced below
  if (most > dominant_log_pi) {  // new_side_dominant: the token of π > 1/2 from the others' sum
    long top = 0;
    while (!(lps[top] > dominant_log_pi)) ++top;
    grad_new[top] = 0.0 - sum_except(grad_new, size, top);  // vjp_row's bits on such a row
    bound = bound_max(bound, ::fabs(grad_new[top]));
  }
  if (projected && two_point_suspect(largest, t, widest_g)) {
    // The row's entries again as doubles (a rare row), for the two-point rule on vjp_row's terms.
    double row_zn[block_size], row_zo[block_size];
    for (long k = 0; k < padded; k += lanes) {
      packet zn, zo, lp, gk;
      read(k, zn, zo, lp, gk);
      pstoreu(row_zn + k, zn);
      pstoreu(row_zo + k, zo);
    }
    const two_point_frame f{t, sum_g, h_over_var, pi_ulps};
    heavy_pair h;
    const two_point_values tp = two_point_entries(
        row_zn, row_zo, lps, std::size_t(size), f, largest, widest_g, [&](std::size_t j) { return gd[j]; },
        [&](std::size_t j) { return ((row_zn[j] - row_zo[j]) - s.mu) - m; }, h);
    if (tp.take) {
      grad_new[h.first] = tp.v1, grad_new[h.second] = tp.v2;
      bound = bound_max(bound, bound_max(::fabs(tp.v1), ::fabs(tp.v2)));
    }
  }
  if (magnitude) *magnitude = bound;
  *grad_eps = projected ? sum_gc / (s.t * s.sigma2) : 0.0;
  // `bound` also covers the entries replaced above (a sum of finite entries can still overflow)
  return overflow == 0 && fits_in<double>(bound) && fits_in<double>(*grad_eps) ? 1 : 0;
}

/// vjp_row without grad_old for a double row of at most block_size tokens whose logits are finite
/// and whose log π* all lie in [−700, 0] (every token on J, no exponent where the packet exp
/// clamps): two fused packet passes (π and d − μ with the two sums, then the gradient). Returns
/// −1, writing nothing, for any other row (the caller takes the general path), else what vjp_row
/// returns (0 or 1).
inline int vjp_row_short(const double* zn, const double* zo, const double* logp, const double* g, long size,
                         const projection_stats& s, double* grad_new, double* grad_eps, double pi_ulps) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  const long whole = size - size % lanes;
  auto read = [&](const double* p, long k, double fill) {
    return k < whole ? ploadu<packet>(p + k) : load_partial<packet>(p + k, size - k, fill);
  };
  return vjp_row_short_core(
      size,
      [&](long k, packet& a, packet& b, packet& lp, packet& gk) {
        a = read(zn, k, 0.0);
        b = read(zo, k, 0.0);
        lp = read(logp, k, -700.0);
        gk = read(g, k, 0.0);
      },
      s, grad_new, grad_eps, pi_ulps);
}

/// The first pass of vjp_row_packets: Σg and Σg(d − μ) of a row (chunk sums added up, as the
/// blocks do), read once from T, and with `centring` the centring sums Σ π (d − μ) and its noise
/// (the one exponential of the pass; only a projected row applies the correction, so the others
/// skip it and leave them 0). `fine` comes back true only where the packet path applies and the
/// row passes every value check of the backward's validation at once: every d − μ and g finite
/// (so every logit is), every log π* in [−700, 0] (with or without `centring`).
struct vjp_sums {
  double sum_g = 0.0, sum_gc = 0.0;
  centring_sums centring;  ///< Σ π (d − μ), the centring correction (top of this file)
  double widest = 0.0;     ///< max |d − μ| over the row
  double widest_g = 0.0;   ///< max |g| over the row
  bool fine = false;
};

template <bool Centring, class T>
inline vjp_sums vjp_first_pass_of(const T* zn, const T* zo, const T* logp, const T* g, long size, double mu_value) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  vjp_sums r;
  if (size <= 0) return r;
  const long whole = size - size % lanes;
  const packet mu = pset1<packet>(mu_value);
  packet lowest = pset1<packet>(0.0), highest = pset1<packet>(-1.0), odd = pset1<packet>(0.0);
  packet widest = pset1<packet>(0.0), widest_g = widest;
  const packet one = pset1<packet>(1.0);
  auto first = [&](const packet& lp, const packet& c, const packet& gk, packet& sg, packet& sgc, packet& spc,
                   packet& spread) {
    widest = pmax(widest, pabs(c));
    widest_g = pmax(widest_g, pabs(gk));
    if constexpr (Centring) {
      const packet pc = pmul(exp_in_range(lp), c);  // meaningful only when the row is `fine`
      spc = padd(spc, pc);
      spread = padd(spread, pmul(pabs(pc), psub(one, lp)));
    }
    lowest = pmin(lowest, lp);
    highest = pmax(highest, lp);
    // NaN unless every d − μ, log π and g is finite
    odd = padd(odd, padd(padd(psub(c, c), psub(lp, lp)), psub(gk, gk)));
    sg = padd(sg, gk);
    sgc = padd(sgc, pmul(gk, c));
  };
  for (long begin = 0; begin < whole; begin += chunk) {
    const long end = begin + chunk < whole ? begin + chunk : whole;
    packet sg = pset1<packet>(0.0), sgc = sg, spc = sg, spread = sg;
    for (long k = begin; k < end; k += lanes) {
      const packet c = psub(psub(load_as_double<packet>(zn + k), load_as_double<packet>(zo + k)), mu);
      first(load_as_double<packet>(logp + k), c, load_as_double<packet>(g + k), sg, sgc, spc, spread);
    }
    r.sum_g += predux(sg), r.sum_gc += predux(sgc);
    r.centring.m += predux(spc), r.centring.spread += predux(spread);
  }
  if (whole < size) {  // padded with g = 0, d = μ and log π = 0: adds nothing
    double tail_zn[lanes], tail_zo[lanes], tail_lp[lanes], tail_g[lanes];
    for (long j = 0; j < lanes; ++j) {
      const bool in = whole + j < size;
      tail_zn[j] = in ? double(zn[whole + j]) : mu_value;
      tail_zo[j] = in ? double(zo[whole + j]) : 0.0;
      tail_lp[j] = in ? double(logp[whole + j]) : 0.0;
      tail_g[j] = in ? double(g[whole + j]) : 0.0;
    }
    packet sg = pset1<packet>(0.0), sgc = sg, spc = sg, spread = sg;
    const packet c = psub(psub(ploadu<packet>(tail_zn), ploadu<packet>(tail_zo)), mu);
    first(ploadu<packet>(tail_lp), c, ploadu<packet>(tail_g), sg, sgc, spc, spread);
    r.sum_g += predux(sg), r.sum_gc += predux(sgc);
    r.centring.m += predux(spc), r.centring.spread += predux(spread);
  }
  r.fine = predux_min(lowest) >= -700.0 && predux_max(highest) <= 0.0 && predux(odd) == 0.0;
  r.widest = predux_max(widest);
  r.widest_g = predux_max(widest_g);
  return r;
}

/// Whether the centring correction of a projected row of T (`size` tokens, μ and σ² from its
/// stats, L = max |d − μ|) provably stays below its threshold, so that m need not be formed.
/// With c_j = d_j − μ as rounded, m = Σ π c is, besides its own rounding, the error δμ' of μ (the
/// forward's sums: a few thousand ulps of |μ| + 4L at most, k below, plus c's own roundings)
/// plus Σ π α c, α the relative error of π read back from log π* in T (ulp_T·|log π|: inside the
/// noise estimate ulp_T Σ π |c| (1 + |log π|)). Where δμ' ≤ ulp_T Σ π |c| / 4, |m| stays below
/// the noise, never above twice it, and the correction is 0 whatever the exponentials give;
/// Σ π |c| ≥ Σ π c² / L = σ² / L makes that checkable before the pass. Holds on ordinary float
/// rows by orders of magnitude ((|μ| + 4L)·L/σ² ~ 1e3 against ~1e4 … 1e5 allowed); fails where
/// the centring matters (a nearly one-hot π* on large logits: σ² tiny against L²), and always
/// in double (ulp_T = ulp of double).
template <class T>
inline bool centring_negligible(double mu, double sigma2, double widest, long size) {
  if constexpr (!(sizeof(T) < sizeof(double))) {
    (void)mu, (void)sigma2, (void)widest, (void)size;
    return false;
  } else {
    const double unit = std::numeric_limits<double>::epsilon(), unit_t = std::numeric_limits<T>::epsilon();
    const double k = 4.0 * (double(size) / 512.0 + 128.0);  // the sums' depth, with margin
    return k * unit * (::fabs(mu) + 4.0 * widest) * widest <= 0.25 * unit_t * sigma2;
  }
}

/// The first pass of row s: the centring sums only for a projected row that needs them
/// (centring_negligible decides from the pass without them, whose sums it then keeps).
template <class T>
inline vjp_sums vjp_first_pass(const T* zn, const T* zo, const T* logp, const T* g, long size,
                               const projection_stats& s) {
  if (s.status != row_status::projected) return vjp_first_pass_of<false>(zn, zo, logp, g, size, s.mu);
  if constexpr (sizeof(T) < sizeof(double)) {
    const vjp_sums r = vjp_first_pass_of<false>(zn, zo, logp, g, size, s.mu);
    if (!r.fine || centring_negligible<T>(s.mu, s.sigma2, r.widest, size)) return r;
  }
  return vjp_first_pass_of<true>(zn, zo, logp, g, size, s.mu);
}

/// vjp_row without grad_old for a row of any length whose d − μ are finite and whose log π* all
/// lie in [−700, 0] (every token on J; exp_bounded exact there): two packet passes reading T
/// directly, the first for Σg and Σg(d − μ) (no exponential, nothing kept), the second for π and
/// the gradient. Returns −1, writing nothing, for any other row (the caller takes the general
/// path), else what vjp_row returns (0 or 1).
/// `pre`: its first pass already taken (by the validation), else null.
template <class T>
inline int vjp_row_packets(const T* zn, const T* zo, const T* logp, const T* g, long size,
                           const projection_stats& s, T* grad_new, double* grad_eps, const vjp_sums* pre = nullptr,
                           double pi_ulps = two_point_pi_ulps<T>()) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  if (size == 0) return -1;
  const long whole = size - size % lanes;
  double tail_zn[lanes], tail_zo[lanes], tail_lp[lanes], tail_g[lanes];
  for (long j = 0; j < lanes; ++j) {
    const bool in = whole + j < size;
    tail_zn[j] = in ? double(zn[whole + j]) : s.mu;
    tail_zo[j] = in ? double(zo[whole + j]) : 0.0;
    tail_lp[j] = in ? double(logp[whole + j]) : -700.0;  // π ≈ 0: the padding adds nothing
    tail_g[j] = in ? double(g[whole + j]) : 0.0;
  }
  const bool projected = s.status == row_status::projected;
  const vjp_sums sums = pre ? *pre : vjp_first_pass(zn, zo, logp, g, size, s);
  if (!sums.fine) return -1;
  const double m = projected ? sums.centring.step<T>() : 0.0;  // the centring correction (top of this file)
  const packet mu = pset1<packet>(s.mu), pm = pset1<packet>(m);
  const double sum_g = sums.sum_g;
  double sum_gc = sums.sum_gc - m * sum_g;
  if (!projected) sum_gc = 0.0;
  const double t = projected ? s.t : 1.0;
  const packet pt = pset1<packet>(t), psum_g = pset1<packet>(sum_g);
  const packet ph = pset1<packet>(projected ? sum_gc / s.sigma2 : 0.0);
  packet largest = pset1<packet>(0.0), bad = largest, others = largest;
  const packet log_half = pset1<packet>(dominant_log_pi), zero = largest;
  long top = -1;  // a token of π > 1/2 (new_side_dominant), found in the packet that holds it
  // gn = t·((g − π·Σg) − π·(d − μ)·h/σ²), written in T; the largest |gn| and a NaN unless every
  // gn is finite, for the check that they fit T; Σ gn but at a token of π > 1/2.
  auto account = [&](long k, const packet& lp, const packet& gn) {
    largest = pmax(largest, pabs(gn));
    bad = padd(bad, psub(gn, gn));
    const packet dominant = pcmp_lt(log_half, lp);
    others = padd(others, pselect(dominant, zero, gn));
    if (any_lane(dominant)) {
      double lps[lanes];
      pstoreu(lps, lp);
      for (long j = 0; j < lanes; ++j)
        if (lps[j] > dominant_log_pi) top = k + j;
    }
  };
  auto second = [&](long k, const packet& lp, const packet& c, const packet& gk) {
    const packet pi = exp_in_range(lp);  // lp ∈ [−700, 0]: the row is `fine`
    const packet gn = pmul(pt, psub(psub(gk, pmul(pi, psum_g)), pmul(pmul(pi, c), ph)));
    account(k, lp, gn);
    return gn;
  };
  // A row that is not projected has h = 0 and t = 1: gn = g − π·Σg, which reads neither logit
  // row (both passed the first pass's checks).
  auto second_unprojected = [&](long k, const packet& lp, const packet& gk) {
    const packet gn = psub(gk, pmul(exp_in_range(lp), psum_g));
    account(k, lp, gn);
    return gn;
  };
  if (projected) {
    for (long k = 0; k < whole; k += lanes) {
      const packet c = psub(psub(psub(load_as_double<packet>(zn + k), load_as_double<packet>(zo + k)), mu), pm);
      store_from_double(grad_new + k, second(k, load_as_double<packet>(logp + k), c, load_as_double<packet>(g + k)));
    }
  } else {
    for (long k = 0; k < whole; k += lanes)
      store_from_double(grad_new + k,
                        second_unprojected(k, load_as_double<packet>(logp + k), load_as_double<packet>(g + k)));
  }
  if (whole < size) {  // the padding's log π = −700: never dominant, and its gn is 0
    const packet c = psub(psub(psub(ploadu<packet>(tail_zn), ploadu<packet>(tail_zo)), mu), pm);
    double out[lanes];
    pstoreu(out, projected ? second(whole, ploadu<packet>(tail_lp), c, ploadu<packet>(tail_g))
                           : second_unprojected(whole, ploadu<packet>(tail_lp), ploadu<packet>(tail_g)));
    for (long k = whole; k < size; ++k) grad_new[k] = T(out[k - whole]);
  }
  if (top >= 0) grad_new[top] = T(0.0 - predux(others));  // new_side_dominant
  double most = predux_max(largest);
  if (projected) {
    const two_point_frame f{t, sum_g, sum_gc / s.sigma2, pi_ulps};
    heavy_pair h;
    const two_point_values tp = two_point_entries(
        zn, zo, logp, std::size_t(size), f, most, sums.widest_g, [&](std::size_t j) { return double(g[j]); },
        [&](std::size_t j) { return ((double(zn[j]) - double(zo[j])) - s.mu) - m; }, h);
    if (tp.take) {
      grad_new[h.first] = T(tp.v1), grad_new[h.second] = T(tp.v2);
      most = maximum(most, maximum(::fabs(tp.v1), ::fabs(tp.v2)));
    }
  }
  *grad_eps = projected ? sum_gc / (s.t * s.sigma2) : 0.0;
  return predux(bad) == 0.0 && fits_in<T>(most) && fits_in<T>(*grad_eps) ? 1 : 0;
}

/// VJP of one row. grad_old may be null; grad_eps receives ∂L/∂ε of this row. Returns false when
/// an output does not fit T (an upstream gradient on a token the row all but masks, with a tiny
/// σ², can make the true derivative overflow): the caller reports the row. `pi_ulps`:
/// two_point_frame::pi_ulps of the type log π* was stored in (the lumped sparse rows and offset
/// rows are double copies of T rows).
template <class T>
inline bool vjp_row(const T* zn, const T* zo, const T* logp, const T* g, std::size_t size,
                    const projection_stats& s, T* grad_new, T* grad_old, double* grad_eps,
                    const vjp_sums* pre = nullptr, double pi_ulps = two_point_pi_ulps<T>()) {
  if constexpr (std::is_same<T, double>::value) {  // the lumped sparse rows
    if (!grad_old) {
      const int done = vjp_row_short(zn, zo, logp, g, static_cast<long>(size), s, grad_new, grad_eps, pi_ulps);
      if (done >= 0) return done == 1;
    }
  }
  if constexpr (std::is_same<T, double>::value || std::is_same<T, float>::value) {  // long rows
    if (!grad_old) {
      const int done =
          vjp_row_packets(zn, zo, logp, g, static_cast<long>(size), s, grad_new, grad_eps, pre, pi_ulps);
      if (done >= 0) return done == 1;
    }
  }
  const bool projected = s.status == row_status::projected;
  const double mu = s.mu;
  backward_block b;
  double sum_g = 0.0, sum_gc = 0.0, widest_g = 0.0;
  centring_sums cs;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_backward_block(zn, zo, logp, mu, begin, count, b);
    block_array gb = load(g, begin, count);
    b.restrict(gb);
    sum_g += gb.sum();
    widest_g = maximum(widest_g, gb.abs().maxCoeff());
    if (projected) {
      sum_gc += (gb * b.centred).sum();
      cs.m += (b.pi * b.centred).sum();
      cs.spread += ((b.pi * b.centred).abs() * (1.0 - b.log_pi)).sum();
    }
  });
  const double m = cs.step<T>();  // the centring correction (top of this file)
  sum_gc -= m * sum_g;
  const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
  const double h_over_var = projected ? sum_gc / s.sigma2 : 0.0;
  const old_normaliser on = (projected && grad_old) ? normalise_old(zo, size) : old_normaliser{};
  double largest = 0.0, others = 0.0;  // Σ of grad_old but at the dominant token (old_side_sums)
  double largest_new = 0.0;            // max |grad_new| before the dominant rules (two_point_suspect)
  double others_new = 0.0;             // Σ of grad_new but at a token of π > 1/2 (new_side_dominant)
  std::size_t top_new = size;
  const std::size_t top = (grad_old && projected) ? dominant_index(logp, size) : size;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_backward_block(zn, zo, logp, mu, begin, count, b);
    b.recentre(m);
    block_array gb = load(g, begin, count);
    b.restrict(gb);
    const block_array explicit_part = gb - b.pi * sum_g;  // 0 off J since g, π are 0 there
    const block_array gn = t * (explicit_part - b.pi * b.centred * h_over_var);
    largest_new = bound_max(largest_new, gn.abs().template maxCoeff<Eigen::PropagateNaN>());
    store(grad_new, begin, count, gn);
    const block_array lp = load(logp, begin, count);  // (b.log_pi is 0 off J)
    if (lp.maxCoeff() > dominant_log_pi) {  // the block of the dominant token: the short path's sum
      Eigen::Index j = 0;
      while (!(lp[j] > dominant_log_pi)) ++j;
      top_new = begin + std::size_t(j);
      others_new += sum_except(gn.data(), long(count), long(j));
    } else {
      others_new += gn.sum();
    }
    if (!grad_old) return;
    if (!projected) {
      store(grad_old, begin, count, block_array::Zero(count));
      return;
    }
    const block_array go = rest * explicit_part + sum_gc * dt_dold_block(zo, b, s, on, begin, count);
    largest = bound_max(largest, go.abs().template maxCoeff<Eigen::PropagateNaN>());
    if (top >= begin && top < begin + std::size_t(count)) {
      block_array rest_of_block = go;
      rest_of_block[Eigen::Index(top - begin)] = 0.0;
      others += rest_of_block.sum();
    } else {
      others += go.sum();
    }
    store(grad_old, begin, count, go);
  });
  if (top < size) {  // Σ_j ∂L/∂z°_j = 0: the dominant token's entry from the others'
    largest = bound_max(largest, ::fabs(others));
    grad_old[top] = T(0.0 - others);
  }
  largest = bound_max(largest, largest_new);
  if (top_new < size) {  // new_side_dominant
    largest = bound_max(largest, ::fabs(others_new));
    grad_new[top_new] = T(0.0 - others_new);
  }
  if (projected) {  // the two-point rule (detail/two_point.hpp)
    const two_point_frame f{t, sum_g, h_over_var, pi_ulps};
    heavy_pair h;
    const two_point_values tp = two_point_entries(
        zn, zo, logp, size, f, largest_new, widest_g, [&](std::size_t j) { return double(g[j]); },
        [&](std::size_t j) { return ((double(zn[j]) - double(zo[j])) - mu) - m; }, h);
    if (tp.take) {
      grad_new[h.first] = T(tp.v1), grad_new[h.second] = T(tp.v2);
      largest = bound_max(largest, bound_max(::fabs(tp.v1), ::fabs(tp.v2)));
    }
  }
  *grad_eps = projected ? sum_gc / (s.t * s.sigma2) : 0.0;
  return fits_in<T>(largest) && fits_in<T>(*grad_eps);
}

/// Σ_J π_j (d_j − μ) of a row: the centring correction (top of this file).
template <class T>
inline double centring_correction(const T* zn, const T* zo, const T* logp, double mu, std::size_t size) {
  backward_block b;
  centring_sums cs;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_backward_block(zn, zo, logp, mu, begin, count, b);
    cs.m += (b.pi * b.centred).sum();
    cs.spread += ((b.pi * b.centred).abs() * (1.0 - b.log_pi)).sum();
  });
  return cs.step<T>();
}

/// JVP of one row: tangent_old may be null (treated as zero). Returns false when an output does
/// not fit T.
template <class T>
inline bool jvp_row(const T* zn, const T* zo, const T* logp, const T* tn, const T* to, double eps_dot,
                    std::size_t size, const projection_stats& s, T* out) {
  const bool projected = s.status == row_status::projected;
  const double mu = s.mu, t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
  const old_normaliser on = (projected && to) ? normalise_old(zo, size) : old_normaliser{};
  backward_block b;
  const double m = projected ? centring_correction(zn, zo, logp, mu, size) : 0.0;
  // The old tangent less its value at the dominant token (detail::old_side_sums): the JVP does not
  // change when every old logit moves alike, and the dominant token's own terms then drop out.
  const std::size_t top = (projected && to) ? dominant_index(logp, size) : size;
  const double shift = top < size ? static_cast<double>(to[top]) : 0.0;
  double pi_tn = 0.0, pi_to = 0.0, t_dot = 0.0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_backward_block(zn, zo, logp, mu, begin, count, b);
    b.recentre(m);
    block_array un = load(tn, begin, count);
    b.restrict(un);
    pi_tn += (b.pi * un).sum();
    if (!projected) return;
    t_dot -= t / s.sigma2 * (b.pi * b.centred * un).sum();
    if (!to) return;
    const block_array uo = (load(zo, begin, count) > neg_inf()).select(load(to, begin, count) - shift, 0.0);
    pi_to += (b.pi * uo).sum();
    t_dot += (dt_dold_block(zo, b, s, on, begin, count) * uo).sum();
  });
  if (projected) t_dot += eps_dot / (t * s.sigma2);
  double largest = 0.0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_backward_block(zn, zo, logp, mu, begin, count, b);
    b.recentre(m);
    block_array value = t * (load(tn, begin, count) - pi_tn) + b.centred * t_dot;
    if (projected && to) value += rest * ((load(to, begin, count) - shift) - pi_to);
    b.restrict(value);
    largest = bound_max(largest, value.abs().template maxCoeff<Eigen::PropagateNaN>());
    store(out, begin, count, value);
  });
  return fits_in<T>(largest);
}

/// Full Jacobians of one row (row-major V×V): jac_new = ∂log π/∂z̃, jac_old = ∂log π/∂z° (may be
/// null), jac_eps = ∂log π/∂ε (V entries, may be null). Direct formulas, O(V²). Returns false
/// when an entry does not fit T (written as ±inf).
template <class T>
inline bool jacobian_row(const T* zn, const T* zo, const T* logp, std::size_t size,
                         const projection_stats& s, T* jac_new, T* jac_old, T* jac_eps) {
  const bool projected = s.status == row_status::projected;
  const double t = projected ? s.t : 1.0, rest = projected ? one_minus_t(s) : 0.0;
  const old_normaliser on = projected ? normalise_old(zo, size) : old_normaliser{};
  auto on_support = [&](std::size_t i) { return static_cast<double>(logp[i]) > neg_inf(); };
  auto pi = [&](std::size_t i) { return on_support(i) ? ::exp(static_cast<double>(logp[i])) : 0.0; };
  const double m = projected ? centring_correction(zn, zo, logp, s.mu, size) : 0.0;
  auto centred = [&](std::size_t i) {
    return on_support(i) ? (static_cast<double>(zn[i]) - static_cast<double>(zo[i]) - s.mu) - m : 0.0;
  };
  // ∂t/∂z°_j once per token; each row of jac_old sums to 0 (every old logit moved alike), and its
  // entry at the dominant token (detail::old_side_sums) is taken as minus the others' sum.
  std::vector<double> dt(projected && jac_old ? size : 0);
  for (std::size_t j = 0; j < dt.size(); ++j) {
    const double zj = static_cast<double>(zo[j]);
    const double q = zj > neg_inf() ? ::exp((zj - on.max) - on.log_sum) : 0.0;
    dt[j] = detail::dt_dold(on_support(j), pi(j), centred(j), q, s);
  }
  const std::size_t top = dt.empty() ? size : dominant_index(logp, size);
  auto dt_dold = [&](std::size_t j) { return dt[j]; };
  // Whether every entry written fits T (a finite mask in the old row only gives ∂log π*/∂ε ~
  // |z°|/(tσ²): 6.7e39 with a −3e38 float mask; the caller reports such a row as the VJP does).
  bool fits = true;
  auto put = [&](T* at, double value) {
    const T x = T(value);
    fits &= x - x == T(0);
    *at = x;
  };
  for (std::size_t i = 0; i < size; ++i) {
    const bool row_on = on_support(i);
    double row_sum = 0.0, row_largest = 0.0;
    for (std::size_t j = 0; j < size; ++j) {
      const double delta = i == j ? 1.0 : 0.0;
      double jn = 0.0, jo = 0.0;
      if (row_on && on_support(j)) {
        jn = t * (delta - pi(j));
        if (projected) {
          jn -= t * centred(i) * centred(j) * pi(j) / s.sigma2;
          jo = rest * (delta - pi(j));
        }
      }
      if (row_on && projected && jac_old) jo += centred(i) * dt_dold(j);
      row_largest = bound_max(row_largest, ::fabs(jn));
      put(jac_new + i * size + j, jn);
      if (jac_old && j != top) {
        row_sum += jo;
        put(jac_old + i * size + j, jo);
      }
    }
    if (jac_old && top < size) put(jac_old + i * size + top, row_on ? 0.0 - row_sum : 0.0);
    if (row_on && projected) {  // row i of ∂log π*/∂z̃ is the VJP of e_i: the two-point rule
      const two_point_frame f{t, 1.0, centred(i) / s.sigma2, two_point_pi_ulps<T>()};
      heavy_pair h;
      const two_point_values tp = two_point_entries(
          zn, zo, logp, size, f, row_largest, 1.0, [&](std::size_t j) { return j == i ? 1.0 : 0.0; }, centred, h);
      if (tp.take) put(jac_new + i * size + h.first, tp.v1), put(jac_new + i * size + h.second, tp.v2);
    }
    if (jac_eps) put(jac_eps + i, row_on && projected ? centred(i) / (t * s.sigma2) : 0.0);
  }
  return fits;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
