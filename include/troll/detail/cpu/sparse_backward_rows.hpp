// troll/detail/cpu/sparse_backward_rows.hpp — the sparse projection's VJP of one aligned row read
// in place: the lumped (|U|+1)-category row (U's entries, then the bucket) is never copied out;
// its packets are widened straight from the caller's float or double rows into the arithmetic
// of vjp_row_short (vjp_row_short_core), so the gradient has the bits of the lumped path
// (lumped_pair, vjp_row, the scatter) it replaces.
#pragma once

#include "eigen.hpp"
#include <cstddef>
#include <type_traits>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../numeric.hpp"
#include "backward_kernels.hpp"
#include "finite_rows.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// One aligned row and its output as the sparse VJP reads them: `count` entries of each side, of
/// log π* and of the upstream gradient, then the bucket's four values (its sides −inf when the
/// tail is empty, as lumped_pair writes them).
template <class T>
struct sparse_vjp_row_view {
  const T* new_lp;
  const T* old_lp;
  const T* log_probs;
  const T* g;
  int count;
  T new_bucket, old_bucket, log_prob_bucket, g_bucket;
};

/// The sparse VJP without grad_old of one row every lumped category of which is kept (no
/// category −inf on both sides) and finite on both sides, whose log π* all lie in [−700, 0]:
/// grad[0..count) and *grad_bucket written in T, grad[count..k_max) zeroed, *grad_eps the row's
/// ∂L/∂ε. Returns −1, writing nothing, for any other row (the caller takes the lumped path, which
/// handles it), else 1, or 0 when an output (an entry, the bucket, ∂L/∂ε) does not fit T (what the
/// lumped path reports).
template <class T>
inline int sparse_vjp_row_short(const sparse_vjp_row_view<T>& v, const projection_stats& s, T* grad,
                                std::size_t k_max, T* grad_bucket, double* grad_eps) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr long lanes = long(sizeof(packet) / sizeof(double));
  const long count = v.count;
  const long direct = count - count % lanes;  // packets read in place; the rest through a copy
  auto read = [&](long k, packet& zn, packet& zo, packet& lp, packet& gk) {
    if (k < direct) {
      zn = load_as_double<packet>(v.new_lp + k);
      zo = load_as_double<packet>(v.old_lp + k);
      lp = load_as_double<packet>(v.log_probs + k);
      gk = load_as_double<packet>(v.g + k);
      return;
    }
    // The last entries, the bucket, then vjp_row_short's padding (g = 0, log π = −700, z = 0).
#if defined(__AVX512F__)
    if constexpr (lanes == 8) {  // masked loads (nothing read past count), the bucket blended in
      const unsigned at = unsigned(count - k);  // the bucket's lane, 0 … 7
      const __mmask8 in = __mmask8((1u << at) - 1u), bucket = __mmask8(1u << at);
      auto tail = [&](const T* p, T last, double fill) {
        __m512d x;
        if constexpr (std::is_same<T, float>::value) {
          x = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, p + k));
        } else {
          x = _mm512_maskz_loadu_pd(in, p + k);
        }
        x = _mm512_mask_blend_pd(bucket, x, _mm512_set1_pd(double(last)));
        return packet(_mm512_mask_blend_pd(__mmask8(in | bucket), _mm512_set1_pd(fill), x));
      };
      zn = tail(v.new_lp, v.new_bucket, 0.0);
      zo = tail(v.old_lp, v.old_bucket, 0.0);
      lp = tail(v.log_probs, v.log_prob_bucket, -700.0);
      gk = tail(v.g, v.g_bucket, 0.0);
      return;
    }
#endif
    double a[lanes], b[lanes], l[lanes], h[lanes];
    for (long j = 0; j < lanes; ++j) {
      const long i = k + j;
      const bool in = i < count, bucket = i == count;
      a[j] = in ? double(v.new_lp[i]) : bucket ? double(v.new_bucket) : 0.0;
      b[j] = in ? double(v.old_lp[i]) : bucket ? double(v.old_bucket) : 0.0;
      l[j] = in ? double(v.log_probs[i]) : bucket ? double(v.log_prob_bucket) : -700.0;
      h[j] = in ? double(v.g[i]) : bucket ? double(v.g_bucket) : 0.0;
    }
    zn = ploadu<packet>(a);
    zo = ploadu<packet>(b);
    lp = ploadu<packet>(l);
    gk = ploadu<packet>(h);
  };
  double gn[block_size];
  double magnitude = 0.0;
  const int done = vjp_row_short_core(count + 1, read, s, gn, grad_eps, two_point_pi_ulps<T>(), &magnitude);
  if (done < 0) return done;
  for (long j = 0; j < count; ++j) grad[j] = T(gn[j]);
  for (std::size_t i = std::size_t(count); i < k_max; ++i) grad[i] = T(0);
  *grad_bucket = T(gn[count]);
  if constexpr (!std::is_same<T, double>::value) {
    // Formed in double, a T entry can still overflow: the written entries are checked only where
    // the core's bound on |grad| passes T's largest value (a rare row).
    if (done == 1 && !fits_in<T>(magnitude)) {
      bool fine = *grad_bucket - *grad_bucket == T(0);
      for (long j = 0; j < count; ++j) fine &= grad[j] - grad[j] == T(0);
      if (!fine) return 0;
    }
    if (!fits_in<T>(*grad_eps)) return 0;
  }
  return done;
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
