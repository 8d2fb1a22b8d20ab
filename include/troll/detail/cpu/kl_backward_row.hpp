// troll/detail/cpu/kl_backward_row.hpp — the gradient of KL(p‖q) w.r.t. both logit rows on the
// CPU (math.md §1), free of cancellation.
//
// With d_j = z_p,j − z_q,j, a reference token r of the joint support and x_j = d_j − d_r
// (kl_centred: exact where the rows are close), σ_j = log p_j − log q_j = x_j − a with
// a = log Σ_{supp p} q_i e^{x_i} (centred_log_ratio), and KL = E_p[σ], so
//     ∂KL/∂z_p,j = p_j (σ_j − KL) = p_j (x_j − E_p[x]),
//     ∂KL/∂z_q,j = q_j − p_j     = −q_j expm1(σ_j)          (|σ_j| ≤ 1/2; q_j − p_j elsewhere).
// The textbook forms p_j (log p_j − log q_j − KL) and q_j − p_j subtract quantities of the size
// of the log-probabilities (or of the probabilities) to get values of the size of the rows'
// difference: on nearly equal rows (KL ~1e-31) and on near one-hot rows whose minor tokens
// differ, they came out wrong in the first digit (normwise 0.65 to 1.0, and 1.4e8 where the
// minor masses are ~1e-87).
#pragma once

#include "eigen.hpp"
#include <cmath>
#include <cstddef>

#include "../../config.hpp"
#include "../numeric.hpp"
#include "../tilt_family.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// One block of a validated row pair: x_j (0 off the joint support), p_j and q_j (exactly 0
/// where masked: exact_exp(−inf) = 0), log q_j.
struct kl_block {
  block_array zp, zq, x, p, q;
};

template <class T>
inline void load_kl_block(const T* zp, const T* zq, std::size_t begin, Eigen::Index count, const tilt_ref& ref,
                          double p_max, double p_log_sum, double q_max, double q_log_sum, kl_block& b) {
  b.zp = load(zp, begin, count);
  b.zq = load(zq, begin, count);
  centred_block(b.zp, b.zq, ref, b.x);
  b.p = exact_exp((b.zp - p_max) - p_log_sum);
  b.q = exact_exp((b.zq - q_max) - q_log_sum);
}

/// kl_backward_row for a pair whose logits are all finite with a spread of at most 700 (no
/// masks, nothing to clamp): the same formulas in packets, reading T in place, in two passes and
/// without block temporaries. The first pass sums, relative to the rows' maxima (the setup's),
/// e^{z_p − M_p}, e^{z_q − M_q}, e^{z_p − M_p}·x and e^{z_q − M_q}·expm1(x) (e^{z_q − M_q + x} −
/// e^{z_q − M_q} where |x| > 1/2): the normalisers, E_p[x] and e^a − 1 = Σ q_i expm1(x_i) in one
/// go (every exponent of the normalisers in [−700, 0]); the second writes the gradients. Returns
/// false, writing nothing, for any other pair.
template <class T>
inline bool kl_backward_row_finite(const T* zp, const T* zq, std::size_t size, const row_setup& setup, double g,
                                   T* grad_p, T* grad_q) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  constexpr long chunk = 512;
  if (setup.any_masked || !(setup.spread <= 700.0) || size == 0) return false;
  const long n = static_cast<long>(size), whole = n - n % lanes, padded = (n + lanes - 1) / lanes * lanes;
  const tilt_ref ref = setup.new_top;  // a token both rows keep; its z_p is the row's maximum
  const double p_max = ref.zn, q_max = setup.old_max;
  // Every packet of the row, the last one padded with the reference token's logits (x = 0,
  // exponents in range), which the sums weight by 0 and the writes skip.
  auto read = [&](long k, packet& a, packet& b) {
    if (k < whole) {
      a = load_as_double<packet>(zp + k);
      b = load_as_double<packet>(zq + k);
      return;
    }
    double ta[lanes], tb[lanes];
    for (long j = 0; j < lanes; ++j) {
      ta[j] = k + j < n ? double(zp[k + j]) : ref.zn;
      tb[j] = k + j < n ? double(zq[k + j]) : ref.zo;
    }
    a = ploadu<packet>(ta);
    b = ploadu<packet>(tb);
  };
  const packet pm = pset1<packet>(p_max), qm = pset1<packet>(q_max), half = pset1<packet>(0.5);
  const centred_reference cr(ref);
  const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), rd = pset1<packet>(cr.rd);
  const packet abs_rd = pset1<packet>(cr.abs_rd), rd_error = pset1<packet>(cr.rd_error);
  const packet ro_shift = pset1<packet>(ref.zo - q_max);  // log q_r + log Σ: the far terms' exponent less z_p − z_p,r
  auto centred = [&](const packet& a, const packet& b) {
    return kl_centred_packet(a, b, rn, ro, rd, abs_rd, rd_error);
  };
  double sum_p = 0.0, sum_q = 0.0, sum_px = 0.0, sum_t = 0.0;
  for (long begin = 0; begin < padded; begin += chunk) {
    const long end = begin + chunk < padded ? begin + chunk : padded;
    packet sp = pset1<packet>(0.0), sq = sp, spx = sp, st = sp;
    for (long k = begin; k < end; k += lanes) {
      packet a, b;
      read(k, a, b);
      const packet x = centred(a, b), uq = psub(b, qm);
      packet ep = exp_in_range(psub(a, pm)), eq = exp_in_range(uq);  // exponents in [−700, 0]
      packet term = ratio_term_packet(eq, padd(psub(a, rn), ro_shift), x);  // relative to M_q: scaled by 1/Σ below
      if (k + lanes > n) {  // the padded packet: weight 0 on the padding
        double w[lanes];
        for (long j = 0; j < lanes; ++j) w[j] = k + j < n ? 1.0 : 0.0;
        const packet live = ploadu<packet>(w);
        ep = pmul(ep, live), eq = pmul(eq, live), term = pmul(term, live);
      }
      sp = padd(sp, ep);
      sq = padd(sq, eq);
      spx = pmadd(ep, x, spx);
      st = padd(st, term);
    }
    sum_p += predux(sp), sum_q += predux(sq), sum_px += predux(spx), sum_t += predux(st);
  }
  const double p_log_sum = ::log(sum_p), q_log_sum = ::log(sum_q);
  const double mean_x = sum_px / sum_p, sum = sum_t / sum_q;  // E_p[x], Σ q_i expm1(x_i)
  double a_log = 0.0;
  if (!(sum > -0.5 && sum < inf())) {  // the rows are far apart: the closed form is exact enough
    a_log = ((ref.zo - q_max) - q_log_sum) - ((ref.zn - p_max) - p_log_sum);
  } else {
    a_log = ::log1p(sum);
  }
  // Second pass: the gradients.
  const packet pls = pset1<packet>(p_log_sum), qls = pset1<packet>(q_log_sum);
  const packet mx = pset1<packet>(mean_x), pa = pset1<packet>(a_log), pg = pset1<packet>(g);
  for (long k = 0; k < padded; k += lanes) {
    packet a, b;
    read(k, a, b);
    const packet x = centred(a, b);
    const packet p = exp_any(psub(psub(a, pm), pls)), q = exp_any(psub(psub(b, qm), qls));
    const packet gp = pmul(pg, pmul(p, psub(x, mx)));
    // σ = x − a alone: here |x| and |a| stay below ~1400, so it errs by ~1e-14 at most (within
    // the documented 2.6e-14); the general path's per-token choice (below) cost 8% in float.
    const packet sigma = psub(x, pa);
    packet gq = pnegate(pmul(q, expm1_near_zero_packet(pmax(pmin(sigma, half), pnegate(half)))));
    if (any_lane(pcmp_lt(half, pabs(sigma))))  // some |σ| > 1/2: q − p there
      gq = pselect(pcmp_le(pabs(sigma), half), gq, psub(q, p));
    gq = pmul(pg, gq);
    if (k + lanes <= n) {
      if (grad_p) store_from_double(grad_p + k, gp);
      if (grad_q) store_from_double(grad_q + k, gq);
    } else {
      double tp[lanes], tq[lanes];
      pstoreu(tp, gp);
      pstoreu(tq, gq);
      for (long j = 0; k + j < n; ++j) {
        if (grad_p) grad_p[k + j] = T(tp[j]);
        if (grad_q) grad_q[k + j] = T(tq[j]);
      }
    }
  }
  return true;
}

/// grad_p[j] = g ∂KL/∂z_p,j and grad_q[j] = g ∂KL/∂z_q,j of one validated row pair with a finite
/// KL (setup from scan_pair); either output may be null.
template <class T>
inline void kl_backward_row(const T* zp, const T* zq, std::size_t size, const row_setup& setup, double g,
                            T* grad_p, T* grad_q) {
  if (kl_backward_row_finite(zp, zq, size, setup, g, grad_p, grad_q)) return;
  const tilt_ref ref = setup.new_top;  // a token both rows keep
  const double p_max = row_max(zp, size), q_max = setup.old_max;
  const double p_log_sum = log_sum_exp_shifted(zp, size, p_max);
  const double q_log_sum = log_sum_exp_shifted(zq, size, q_max);
  kl_block b;
  block_array term;
  // First pass: E_p[x] and e^a − 1 = Σ_{supp p} q_i expm1(x_i) − q(old only).
  double mean_x = 0.0, sum = 0.0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    load_kl_block(zp, zq, begin, count, ref, p_max, p_log_sum, q_max, q_log_sum, b);
    mean_x += (b.p * b.x).sum();
    sum += centred_ratio_terms(b.zp, b.x, b.q, ref.zn, (ref.zo - q_max) - q_log_sum, term) ? term.sum() : inf();
  });
  double a = 0.0;
  if (!(sum > -0.5 && sum < inf())) {  // the rows are far apart: the closed form is exact enough
    a = ((ref.zo - q_max) - q_log_sum) - ((ref.zn - p_max) - p_log_sum);
  } else {
    a = ::log1p(sum);
  }
  // Second pass: the gradients.
  block_array out;
  const bool one_block = size <= std::size_t(block_size);  // then b still holds the row
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    if (!one_block) load_kl_block(zp, zq, begin, count, ref, p_max, p_log_sum, q_max, q_log_sum, b);
    out.resize(count);
    if (grad_p != nullptr) {
      out = g * (b.p * (b.x - mean_x));  // p = 0 and x = 0 where p masks the token
      store(grad_p, begin, count, out);
    }
    if (grad_q != nullptr) {
      // σ_j = x_j − a where that is the better conditioned form, else log p_j − log q_j. The
      // centred form errs by ~ulp(max(|x_j|, |a|)) (x and a carry relative accuracy), the direct
      // one by ~ulp(max(|log p_j|, |log q_j|, 1)) (each log-normaliser errs by up to an ulp of
      // 1). On close and on near one-hot rows x and a are tiny and the direct form would cancel;
      // but where the reference token is all but masked in q by a huge finite logit (z_q,r =
      // −1e9 … −1e300) every x_j and a are of that size and x_j − a lost σ_j entirely (q_j − p_j
      // came out 0 at −1e300, 1.4e-8 off at −1e9), while log p_j and log q_j are O(1).
      block_array sigma = b.x - a;
      const double* __restrict xs = b.x.data();
      const double* __restrict ps = b.zp.data();
      const double* __restrict qs = b.zq.data();
      double* __restrict sm = sigma.data();
      const double centred_scale_a = ::fabs(a);
      for (Eigen::Index k = 0; k < count; ++k) {
        const double log_p = (ps[k] - p_max) - p_log_sum, log_q = (qs[k] - q_max) - q_log_sum;
        const double direct_scale = std::max(std::max(::fabs(log_p), ::fabs(log_q)), 1.0);  // +inf where masked
        if (std::max(::fabs(xs[k]), centred_scale_a) > direct_scale) sm[k] = log_p - log_q;
      }
      out = -(b.q * expm1_near_zero(sigma.max(-0.5).min(0.5)));
      const double* __restrict sg = sigma.data();
      const double* __restrict pp = b.p.data();
      const double* __restrict qq = b.q.data();
      double* __restrict o = out.data();
      for (Eigen::Index k = 0; k < count; ++k) {
        const double w = double(::fabs(sg[k]) <= 0.5);
        o[k] = g * (w * o[k] + (1.0 - w) * (qq[k] - pp[k]));
      }
      if (b.zp.minCoeff() == neg_inf()) {  // p masks the token: q_j − p_j = q_j (0 where q does too)
        for (Eigen::Index k = 0; k < count; ++k)
          if (b.zp[k] == neg_inf()) o[k] = g * qq[k];
      }
      store(grad_q, begin, count, out);
    }
  });
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
