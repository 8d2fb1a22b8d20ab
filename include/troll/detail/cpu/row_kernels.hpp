// troll/detail/cpu/row_kernels.hpp — the CPU backend's per-row passes, vectorised with Eigen.
// Each pass walks a row in fixed blocks held on the stack (no heap), widens the elements to
// double, and feeds the shared host/device maths (lse_state, trust_region_solver).
#pragma once

#include "eigen.hpp"
#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../row_problem.hpp"
#include "../tilt_family.hpp"
#include "../trust_region_solver.hpp"
#include "finite_rows.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

constexpr Eigen::Index block_size = 512;
using block_array = Eigen::Array<double, Eigen::Dynamic, 1, Eigen::ColMajor, block_size, 1>;
using block_mask = Eigen::Array<bool, Eigen::Dynamic, 1, Eigen::ColMajor, block_size, 1>;

template <class T>
using row_map = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using row_map_out = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

/// Calls fn(begin, count) for consecutive blocks of [0, size).
template <class Fn>
inline void for_each_block(std::size_t size, Fn&& fn) {
  for (std::size_t begin = 0; begin < size; begin += block_size) {
    const Eigen::Index count =
        static_cast<Eigen::Index>(size - begin < std::size_t(block_size) ? size - begin : block_size);
    fn(begin, count);
  }
}

template <class T>
inline block_array load(const T* p, std::size_t begin, Eigen::Index count) {
  return row_map<T>(p + begin, count).template cast<double>();
}

template <class T, class Expr>
inline void store(T* p, std::size_t begin, Eigen::Index count, const Expr& values) {
  row_map_out<T>(p + begin, count) = values.template cast<T>();
}

/// e^x of a block: exp_in_range (packet_exp.hpp: within 1.5 ulp, a 16-entry table and a
/// degree-7 polynomial with AVX-512, a 2-entry table and a degree-10 one with AVX2) on every packet whose arguments lie in [−708, 708], std::exp
/// on the entries of any other packet and on the block's last partial packet — so subnormal
/// results, exact zeros (−inf), +inf and NaN are std::exp's. Eigen 3.4's double exp, which this
/// replaces, divides in every packet (a rational approximation) and returns ~5.6e-309 for every
/// argument below about −709.8 (−inf included) instead of the subnormal or 0 it should.
inline block_array block_exp(const block_array& x) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr Eigen::Index lanes = Eigen::Index(sizeof(packet) / sizeof(double));
  const Eigen::Index n = x.size(), whole = n - n % lanes;
  block_array e(n);
  const packet lo = pset1<packet>(-708.0), hi = pset1<packet>(708.0);
  for (Eigen::Index k = 0; k < whole; k += lanes) {
    const packet v = ploadu<packet>(x.data() + k);
    if (!any_lane(por(pcmp_lt_or_nan(v, lo), pcmp_lt(hi, v)))) {
      pstoreu(e.data() + k, exp_in_range(v));
    } else {
      for (Eigen::Index j = k; j < k + lanes; ++j) e[j] = std::exp(x[j]);
    }
  }
  for (Eigen::Index j = whole; j < n; ++j) e[j] = std::exp(x[j]);
  return e;
}

/// exp of a block with a correct underflow: block_exp (which takes std::exp wherever an argument
/// leaves [−708, 708]).
inline block_array exact_exp(const block_array& x) { return block_exp(x); }

/// Zeroes `values` where `logits` is −inf. Eigen 3.4 runs a select one coefficient at a time, so
/// only a block that holds a masked entry pays for it; evaluate exponentials before, not inside.
inline void zero_where_masked(const block_array& logits, block_array& values) {
  if (logits.minCoeff() == neg_inf()) values = (logits > neg_inf()).select(values, 0.0);
}

/// Whether every entry of z[0..n) is below +inf (no NaN, no +inf): a plain loop with an integer
/// OR-reduction, which the compiler vectorises in T (Eigen's all() visits one coefficient at a
/// time).
template <class T>
inline bool all_below_inf(const T* z, std::size_t n) {
  constexpr T bound = std::numeric_limits<T>::infinity();
  int bad = 0;
  for (std::size_t k = 0; k < n; ++k) bad |= !(z[k] < bound);
  return bad == 0;
}

/// Whether every entry of z[0..n) is finite (no NaN, no ±inf), vectorised the same way.
template <class T>
inline bool all_finite(const T* z, std::size_t n) {
  int bad = 0;
  for (std::size_t k = 0; k < n; ++k) bad |= !(z[k] - z[k] == T(0));
  return bad == 0;
}

/// Whether a row passes validate_rows: no NaN or +inf and some entry above −inf. One pass, two
/// integer OR-reductions the compiler vectorises in T.
template <class T>
inline bool row_values_fine(const T* z, std::size_t n) {
  constexpr T bound = std::numeric_limits<T>::infinity();
  int bad = 0, some = 0;
  for (std::size_t k = 0; k < n; ++k) {
    bad |= !(z[k] < bound);
    some |= z[k] > -bound;
  }
  return bad == 0 && some != 0;
}

/// Whether a backward row pair passes every value check of validate_backward at once: z̃, z° and
/// the upstream g all finite, and every log π* finite and ≤ 0 (with every logit finite no token
/// is masked, so −inf would be a log-probability below T's range: find_bad_log_prob names it).
/// One pass, an integer OR-reduction the compiler vectorises in T.
template <class T>
inline bool backward_row_fine(const T* zn, const T* zo, const T* logp, const T* g, std::size_t n) {
  int bad = 0;
  for (std::size_t k = 0; k < n; ++k)
    bad |= !(zn[k] - zn[k] == T(0)) | !(zo[k] - zo[k] == T(0)) | !(logp[k] <= T(0)) |
           !(logp[k] >= std::numeric_limits<T>::lowest()) | !(g[k] - g[k] == T(0));
  return bad == 0 && n > 0;
}

/// First NaN or +inf of a row, if any (one vectorised scan; a bad row is then walked).
template <class T>
inline row_problem find_bad_value(const T* z, std::size_t size, const char* operand) {
  row_problem p;
  if (all_below_inf(z, size)) return p;
  for (std::size_t k = 0; k < size; ++k) {
    const double x = static_cast<double>(z[k]);
    if (!(x < inf())) {
      p.kind = x != x ? row_error::nan_value : row_error::pos_inf;
      p.operand = operand;
      p.entry = static_cast<long long>(k);
      return p;
    }
  }
  return p;
}

/// Validates a (new, old) row pair and fills the setup the solver needs, in one pass and without
/// exponentials. Problems reported: NaN / +inf entries (the first one), a row with no finite
/// entry, disjoint supports.
template <class T>
inline row_problem scan_pair(const T* zn, const T* zo, std::size_t size, row_setup& setup,
                             const char* new_name, const char* old_name) {
  setup = row_setup{};
  row_problem p;
  if constexpr (std::is_same<T, double>::value || std::is_same<T, float>::value) {
    // the common pair, every logit finite: one packet pass in T
    pair_extremes e;
    if (size > 0 && finite_extremes(zn, zo, static_cast<long>(size), e)) {
      const long n = static_cast<long>(size);
      const std::size_t at_new = std::size_t(first_index_of(zn, n, static_cast<T>(e.max_new)));
      const std::size_t at_old = std::size_t(first_index_of(zo, n, static_cast<T>(e.max_old)));
      setup.old_max = e.max_old;
      setup.new_top = tilt_ref{zn[at_new], zo[at_new]};
      setup.old_top = tilt_ref{zn[at_old], zo[at_old]};
      setup.spread = maximum(e.max_new, e.max_old) - minimum(e.min_new, e.min_old);
      // the differences were rounded once in T: widen their range by that rounding, and by the
      // rounding of the solver's own x = (z̃ − z̃_r) − (z° − z°_r) in double (a few ulps of the
      // largest logit)
      constexpr double unit = std::is_same<T, float>::value ? 0x1p-24 : 0x1p-53;
      const double largest = maximum(maximum(::fabs(e.max_new), ::fabs(e.min_new)),
                                     maximum(::fabs(e.max_old), ::fabs(e.min_old)));
      setup.x_range = ((e.max_diff - e.min_diff) + 2.0 * unit * (::fabs(e.max_diff) + ::fabs(e.min_diff)) +
                       8.0 * 0x1p-53 * largest) *
                      (1.0 + 0x1p-50);
      return p;
    }
  }
  double best_new = neg_inf(), best_old = neg_inf();
  double lowest = inf(), highest = neg_inf();  // over both rows, −inf included
  bool any_new = false, any_old = false;
  // The first index of `value` in `v` (known to be there): argmax without a scalar visitor pass
  // over every block, since a block's max rarely beats the running best.
  auto index_of = [](const auto& v, double value) {
    Eigen::Index k = 0;
    while (v[k] != value) ++k;
    return k;
  };
  // One block: double rows are read in place, float rows widened first.
  auto scan_block = [&](const auto& a, const auto& b, std::size_t begin, Eigen::Index count) {
    const double max_new = a.template maxCoeff<Eigen::PropagateNaN>();
    const double max_old = b.template maxCoeff<Eigen::PropagateNaN>();
    if (!(max_new < inf() && max_old < inf())) {  // a NaN or +inf somewhere in this block
      for (Eigen::Index k = 0; k < count && !p; ++k) {
        const bool bad_new = !(a[k] < inf());
        if (!bad_new && b[k] < inf()) continue;
        const double v = bad_new ? a[k] : b[k];
        p.kind = v != v ? row_error::nan_value : row_error::pos_inf;
        p.operand = bad_new ? new_name : old_name;
        p.entry = static_cast<long long>(begin + std::size_t(k));
      }
      return;
    }
    setup.old_max = maximum(setup.old_max, max_old);
    const double min_new = a.minCoeff(), min_old = b.minCoeff();
    lowest = minimum(lowest, minimum(min_new, min_old));
    highest = maximum(highest, maximum(max_new, max_old));
    if (min_new > neg_inf() && min_old > neg_inf()) {  // no masked token here
      any_new = any_old = true;
      if (max_new > best_new) {
        const Eigen::Index at = index_of(a, max_new);
        best_new = max_new, setup.new_top = tilt_ref{a[at], b[at]};
      }
      if (max_old > best_old) {
        const Eigen::Index at = index_of(b, max_old);
        best_old = max_old, setup.old_top = tilt_ref{a[at], b[at]};
      }
      return;
    }
    setup.any_masked = true;
    const block_mask fin_new = a > neg_inf();
    const block_mask fin_old = b > neg_inf();
    any_new = any_new || fin_new.any();
    any_old = any_old || fin_old.any();
    setup.new_only = setup.new_only || (fin_new && !fin_old).any();
    setup.old_only = setup.old_only || (!fin_new && fin_old).any();
    const block_mask joint = fin_new && fin_old;
    if (!joint.any()) return;
    Eigen::Index at = 0;
    const double vn = joint.select(a, neg_inf()).maxCoeff(&at);
    if (vn > best_new) best_new = vn, setup.new_top = tilt_ref{a[at], b[at]};
    const double vo = joint.select(b, neg_inf()).maxCoeff(&at);
    if (vo > best_old) best_old = vo, setup.old_top = tilt_ref{a[at], b[at]};
  };
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    if (p) return;
    if constexpr (std::is_same<T, double>::value) {
      scan_block(row_map<double>(zn + begin, count), row_map<double>(zo + begin, count), begin, count);
    } else {
      scan_block(load(zn, begin, count), load(zo, begin, count), begin, count);
    }
  });
  if (p) return p;
  setup.spread = highest - lowest;
  if (!any_new) {
    p.kind = row_error::all_masked;
    p.operand = new_name;
  } else if (!any_old) {
    p.kind = row_error::all_masked;
    p.operand = old_name;
  } else if (best_new == neg_inf()) {
    p.kind = row_error::disjoint;
  }
  return p;
}

/// max_i z_i (−inf for an all-masked row).
template <class T>
inline double row_max(const T* z, std::size_t size) {
  return static_cast<double>(row_map<T>(z, Eigen::Index(size)).maxCoeff());
}

/// The largest old logit and the range max − min of z̃ − z° over the tokens where both are finite
/// (−inf where there is none), in one vectorised pass over both rows (validated rows: no NaN, no
/// +inf). The range bounds KL(p̃‖π*) on a row whose p̃ has no mass outside q's support:
/// log(p̃_j/π*_j) = (1 − t)d_j − (A(1) − A(t)) and A(1) − A(t) ≥ (1 − t)·min d, so
/// KL(p̃‖π*) ≤ (1 − t)(max d − min d).
struct pair_extent {
  double old_max = neg_inf();
  double difference_range = neg_inf();
};
template <class T>
inline pair_extent pair_extents(const T* zn, const T* zo, std::size_t size) {
  double highest = neg_inf(), lowest = inf(), old_max = neg_inf();
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array a = load(zn, begin, count), b = load(zo, begin, count);
    old_max = maximum(old_max, b.maxCoeff());
    if (a.minCoeff() > neg_inf() && b.minCoeff() > neg_inf()) {
      const block_array d = a - b;
      highest = maximum(highest, d.maxCoeff());
      lowest = minimum(lowest, d.minCoeff());
      return;
    }
    const block_mask joint = (a > neg_inf()) && (b > neg_inf());
    if (!joint.any()) return;
    highest = maximum(highest, joint.select(a - b, neg_inf()).maxCoeff());
    lowest = minimum(lowest, joint.select(a - b, inf()).minCoeff());
  });
  pair_extent e;
  e.old_max = old_max;
  e.difference_range = highest > neg_inf() ? highest - lowest : neg_inf();
  return e;
}

/// The problem of a row of logits, if any: its first NaN or +inf entry, else no entry above −inf
/// (all_masked). A row that row_values_fine passes costs that one vectorised pass.
template <class T>
inline row_problem logits_row_problem(const T* z, std::size_t size, const char* operand) {
  row_problem p;
  if (row_values_fine(z, size)) return p;
  p = find_bad_value(z, size, operand);
  if (!p && row_max(z, size) == neg_inf()) {
    p.kind = row_error::all_masked;
    p.operand = operand;
  }
  return p;
}

/// log Σ_i exp(z_i − shift) over the row (masked entries add nothing).
template <class T>
inline double log_sum_exp_shifted(const T* z, std::size_t size, double shift) {
  double sum = 0.0;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    sum += block_exp(load(z, begin, count) - shift).sum();
  });
  return ::log(sum);
}

/// expm1(x) for |x| ≤ 1/2 by its Taylor series to x^17 (truncation < 1e-19 relative), nested as
/// x·(1 + x/2·(1 + x/3·(…))) in vectorised block arithmetic: within 1.5 ulp of the exact value
/// (checked against long double over 10^6 points), where Eigen 3.4's double expm1 is a scalar
/// call per coefficient. Inputs outside [−1/2, 1/2] must be clamped by the caller.
inline constexpr double expm1_series_inverse[18] = {0.0,      1.0,      1.0 / 2,  1.0 / 3,  1.0 / 4,  1.0 / 5,
                                                  1.0 / 6,  1.0 / 7,  1.0 / 8,  1.0 / 9,  1.0 / 10, 1.0 / 11,
                                                  1.0 / 12, 1.0 / 13, 1.0 / 14, 1.0 / 15, 1.0 / 16, 1.0 / 17};
inline block_array expm1_near_zero(const block_array& x) {
  block_array p = block_array::Ones(x.size());
  for (int k = 17; k >= 2; --k) p = 1.0 + (x * expm1_series_inverse[k]) * p;
  return x * p;
}

/// φ(x) = expm1(x) − x for |x| ≤ 1/2 without cancellation: x²/2·(1 + x/3·(1 + …)), the same
/// series as expm1_near_zero from its second term (detail::expm1_minus_x in block form). Inputs
/// outside [−1/2, 1/2] must be clamped by the caller.
inline block_array expm1_minus_x_near_zero(const block_array& x) {
  block_array p = block_array::Ones(x.size());
  for (int k = 17; k >= 3; --k) p = 1.0 + (x * expm1_series_inverse[k]) * p;
  return (0.5 * x * x) * p;
}

/// The tilted-family reduction of trust_region_solver.hpp over one row (tilt_family.hpp).
template <class T>
struct tilt_evaluator {
  const T* new_logits;
  const T* old_logits;
  std::size_t size;
  double old_max;
  bool masked;  // some token outside the joint support: take the select path
  double spread;  // max − min over both rows' logits (+inf with a masked token)

  /// x and w (tilt_family.hpp) on one block; w = −inf outside the joint support. Double rows are
  /// read in place, float rows widened into `a` and `b` first.
  void block(std::size_t begin, Eigen::Index count, const tilt_param& u, const tilt_ref& ref, block_array& a,
             block_array& b, block_array& x, block_array& w) const {
    if constexpr (std::is_same<T, double>::value) {
      tilt_block(row_map<double>(new_logits + begin, count), row_map<double>(old_logits + begin, count), u, ref,
                 x, w);
    } else {
      a = load(new_logits, begin, count);
      b = load(old_logits, begin, count);
      tilt_block(a, b, u, ref, x, w);
    }
  }

  template <class A, class B>
  void tilt_block(const A& a, const B& b, const tilt_param& u, const tilt_ref& ref, block_array& x,
                  block_array& w) const {
    // x = (z̃ − z̃_r) − (z° − z°_r) and w from the same two differences (tilt_family.hpp); float
    // logits cannot overflow them, double ones are clamped to ±DBL_MAX.
    if (sizeof(T) < sizeof(double)) {
      x = (a - ref.zn) - (b - ref.zo);
      if (u.t <= 0.5) {
        w = (b - ref.zo) + u.t * x;
      } else {
        w = (a - ref.zn) - u.s * x;
      }
    } else {
      const double big = max_difference();
      x = ((a - ref.zn).max(-big).min(big) - (b - ref.zo).max(-big).min(big)).max(-big).min(big);
      if (u.t <= 0.5) {
        w = (b - ref.zo).max(-big).min(big) + u.t * x;
      } else {
        w = (a - ref.zn).max(-big).min(big) - u.s * x;
      }
    }
    if (!masked) return;
    const block_mask joint = (a > neg_inf()) && (b > neg_inf());
    x = joint.select(x, 0.0);
    w = joint.select(w, neg_inf());
  }

  /// log Σ_i exp(z°_i − M°) over every finite old logit.
  double old_log_sum() const { return log_sum_exp_shifted(old_logits, size, old_max); }

  /// The reduction at (u, ref); with `cumulants`, also s3 and s4 where the one-pass reduction
  /// runs (left NaN elsewhere: the solver then evaluates instead of predicting).
  lse_state operator()(const tilt_param& u, const tilt_ref& ref, bool cumulants = false) const {
    // A logit spread beyond 700 in one of the rows, or a masked token: the blocked two-pass
    // reduction (exponents below −708 go through block_exp's std::exp).
    const bool wide = masked || !(spread <= 700.0);
    lse_state total;
    block_array a, b, x, w, e;
    if (!wide) {  // the common row: one fused pass (finite_rows.hpp), else two per block
      const long n = static_cast<long>(size);
      if (cumulants ? tilt_reduce_one_pass<true>(new_logits, old_logits, n, u, ref, total)
                    : tilt_reduce_one_pass<false>(new_logits, old_logits, n, u, ref, total))
        return total;
      for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
        lse_state part;
        if constexpr (std::is_same<T, double>::value) {
          part = tilt_reduce_finite(new_logits + begin, old_logits + begin, count, u, ref, x.data(), w.data());
        } else {
          a = load(new_logits, begin, count);
          b = load(old_logits, begin, count);
          part = tilt_reduce_finite(a.data(), b.data(), count, u, ref, x.data(), w.data());
        }
        total = merge(total, part);
      });
      return total;
    }
    for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
      block(begin, count, u, ref, a, b, x, w);
      const double m = w.maxCoeff();
      if (m == neg_inf()) return;
      e = block_exp(w - m);
      // (e·x)·x: a zero weight never meets an x² that overflowed.
      // depth: however Eigen orders the block's sum, at most one addition per term
      lse_state part{m, e.sum(), (e * x).sum(), ((e * x) * x).sum()};
      part.depth = double(count);
      if (m > total.m) {  // this block holds the mode so far: record its token as the reference
        Eigen::Index k = 0;
        while (!(w[k] == m)) ++k;
        part.ref_new = static_cast<double>(new_logits[begin + std::size_t(k)]);
        part.ref_old = static_cast<double>(old_logits[begin + std::size_t(k)]);
      }
      total = merge(total, part);
    });
    return total;
  }

  /// Both ends' reductions in one pass (tilt_reduce_ends: the same bits as two calls of
  /// operator() with these references), for the common pair; false, computing nothing, elsewhere.
  bool ends(const tilt_ref& zero_ref, const tilt_ref& one_ref, bool cumulants, lse_state& zero,
            lse_state& one) const {
    if constexpr (std::is_same<T, double>::value || std::is_same<T, float>::value) {
      if (masked || !(spread <= 700.0)) return false;
      const long n = static_cast<long>(size);
      if (cumulants) {
        tilt_reduce_ends<true>(new_logits, old_logits, n, zero_ref, one_ref, zero, one);
      } else {
        tilt_reduce_ends<false>(new_logits, old_logits, n, zero_ref, one_ref, zero, one);
      }
      return true;
    } else {
      (void)zero_ref, (void)one_ref, (void)cumulants, (void)zero, (void)one;
      return false;
    }
  }

  /// KL(π‖q) at an evaluated point as the sum of non-negative kl_terms (no cancellation).
  double exact_kl(const tilt_point& p) const {
    if (!masked && spread <= 700.0)  // the common pair: in packets (finite_rows.hpp)
      return exact_kl_finite(new_logits, old_logits, static_cast<long>(size), p);
    double sum = 0.0;
    for (std::size_t i = 0; i < size; ++i)
      sum += kl_term(static_cast<double>(new_logits[i]), static_cast<double>(old_logits[i]), p);
    return sum;
  }

  /// Σ_i ratio_term at an evaluated point (refine_a_c; only at a tiny ε, so one scalar pass).
  double ratio_sum(const tilt_point& p) const {
    double sum = 0.0;
    for (std::size_t i = 0; i < size; ++i)
      sum += ratio_term(static_cast<double>(new_logits[i]), static_cast<double>(old_logits[i]), p);
    return sum;
  }

  /// out_i = log π_t,i = w_i − log_norm at the evaluated point `p`.
  void write(const tilt_point& p, T* out) const {
    if (!masked && spread <= 700.0) {  // the common pair: one packet pass (finite_rows.hpp)
      write_tilted(new_logits, old_logits, static_cast<long>(size), tilt_param{p.t, p.s}, p.ref, p.log_norm, out);
      return;
    }
    block_array a, b, x, w;
    for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
      block(begin, count, tilt_param{p.t, p.s}, p.ref, a, b, x, w);
      store(out, begin, count, (w - p.log_norm).min(0.0));  // a log-probability: at most 0
    });
  }
};

/// The evaluator of a validated row pair.
template <class T>
inline tilt_evaluator<T> make_evaluator(const T* zn, const T* zo, std::size_t size, const row_setup& setup) {
  return tilt_evaluator<T>{zn, zo, size, setup.old_max, setup.any_masked, setup.spread};
}

/// out_i = (z_i − top) − log_sum: the write of every log_softmax row.
template <class T>
inline void write_log_softmax(const T* z, std::size_t size, double top, double log_sum, T* out) {
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    store(out, begin, count, (load(z, begin, count) - top) - log_sum);
  });
}

/// Whether log_softmax_row takes its packet path on z: every entry finite and within 700 of the
/// maximum `top` (then every e^{z − top} is exp_bounded's, exact to 1.5 ulp).
template <class T>
inline bool log_softmax_packets(const T* z, std::size_t size, double& top) {
  if constexpr (std::is_same<T, double>::value || std::is_same<T, float>::value) {
    double least = 0.0;
    return finite_range(z, static_cast<long>(size), top, least) && top - least <= 700.0;
  } else {
    (void)z, (void)size, (void)top;
    return false;
  }
}

/// out = log_softmax(z); the reference arithmetic for inactive rows: (z_i − M) − log Σ e^{z−M}.
/// The common row (finite, a spread of at most 700) sums its exponentials as the tilted
/// reduction at t = 1 does (exp_sum_below_top), so that write_solution can write an inactive
/// row from that reduction without another pass, to the same bits.
template <class T>
inline void log_softmax_row(const T* z, std::size_t size, T* out) {
  double m = 0.0;
  if (log_softmax_packets(z, size, m)) {
    write_log_softmax(z, size, m, ::log(exp_sum_below_top(z, static_cast<long>(size), m)), out);
    return;
  }
  m = row_max(z, size);
  write_log_softmax(z, size, m, log_sum_exp_shifted(z, size, m), out);
}

/// Writes log π* of a solved row (the log-softmax of the new row where inactive) and returns
/// its statistics. An inactive row whose t = 1 member came from the one-pass reduction (every
/// logit finite, spread ≤ 700: then the new row alone takes log_softmax_row's packet path with
/// the same sum) is written from that member's normaliser: log_softmax's bits, one pass fewer.
template <class T>
inline projection_stats write_solution(const tilt_evaluator<T>& eval, const solve_result& r, T* out) {
  if (r.status == row_status::inactive) {
    const bool one_pass = (std::is_same<T, double>::value || std::is_same<T, float>::value) && !eval.masked &&
                          eval.spread <= 700.0;
    if (one_pass) {
      write_log_softmax(eval.new_logits, eval.size, r.point.ref.zn, r.point.log_norm, out);
    } else {
      log_softmax_row(eval.new_logits, eval.size, out);
    }
  } else {
    eval.write(r.point, out);
  }
  return make_stats(r);
}

/// Whether a solved row's μ and σ² need refine_moments: a double pair, all finite, whose
/// differences d = z̃ − z° span less than 2⁻²⁰ of the logits' spread. The solver's
/// x = (z̃ − z̃_r) − (z° − z°_r) carries ~ulp(spread) of absolute error, so there its moments kept
/// only ~ulp(spread)/|d| of their digits (docs/math.md, "Rows nearly equal to the old ones"); a
/// float pair's differences are exact in double. Only rows the derivatives read σ² of.
template <class T>
inline bool moments_need_refining(const row_setup& setup, const solve_result& r) {
  return std::is_same<T, double>::value && !setup.any_masked && setup.spread < inf() &&
         setup.x_range < 0x1p-20 * setup.spread &&
         (r.status == row_status::projected || r.status == row_status::not_converged);
}

inline void centred_block(const block_array& zp, const block_array& zq, const tilt_ref& ref, block_array& x);

/// μ = E_π[d] and σ² = Var_π[d] of the member `p` again, with x_j = d_j − d_r formed by
/// centred_block (both differences' rounding errors compensated, as the cancellation-free KL
/// does): two passes over the row, for the rare rows of moments_need_refining.
template <class T>
inline void refine_moments(const tilt_evaluator<T>& eval, tilt_point& p) {
  const tilt_param u{p.t, p.s};
  double sum_pi = 0.0, sum_px = 0.0;
  block_array a, b, x, w, pi, c;
  auto weights = [&](std::size_t begin, Eigen::Index count) {
    eval.block(begin, count, u, p.ref, a, b, x, w);
    pi = block_exp(w - p.log_norm);
    centred_block(load(eval.new_logits, begin, count), load(eval.old_logits, begin, count), p.ref, c);
  };
  for_each_block(eval.size, [&](std::size_t begin, Eigen::Index count) {
    weights(begin, count);
    sum_pi += pi.sum();
    sum_px += (pi * c).sum();
  });
  const double mean = sum_px / sum_pi;
  double var = 0.0;
  for_each_block(eval.size, [&](std::size_t begin, Eigen::Index count) {
    weights(begin, count);
    var += (pi * (c - mean).square()).sum();
  });
  var /= sum_pi;
  if (!(var > 0.0 && var < inf() && mean - mean == 0.0)) return;  // keep the solver's where this fails
  p.mean_x = mean;
  p.mu = (p.ref.zn - p.ref.zo) + mean;
  p.sigma2 = var;
}

/// The projection of one validated row: solve, write log π*, return the statistics.
template <class T>
inline projection_stats project_row(const T* zn, const T* zo, std::size_t size, const row_setup& setup,
                                    double eps, const projection_options& opt, T* out) {
  const tilt_evaluator<T> eval = make_evaluator(zn, zo, size, setup);
  solve_result r = solve_row(eval, setup, eps, opt);
  if (moments_need_refining<T>(setup, r)) refine_moments(eval, r.point);
  return write_solution(eval, r, out);
}

/// KL(π_0+ ‖ q) = −log q(J): the smallest KL any admissible π reaches (old-only tokens only).
template <class T>
inline double min_reachable_kl(const T* zn, const T* zo, std::size_t size, const row_setup& setup) {
  const tilt_evaluator<T> eval = make_evaluator(zn, zo, size, setup);
  return evaluate_at_zero(eval, setup, eval.old_log_sum()).kl;
}

/// x_j = kl_centred(z_p,j, z_q,j, ref) on a block, 0 where either row masks the token. Both
/// candidates are formed and blended arithmetically, which the compiler vectorises (a branch per
/// token, or Eigen 3.4's select, costs several times more on rows whose choice varies).
inline void centred_block(const block_array& zp, const block_array& zq, const tilt_ref& ref, block_array& x) {
  const double big = max_difference(), ref_d = ref.zn - ref.zo, abs_ref_d = ::fabs(ref_d);
  const double ref_error = difference_error(ref.zn, ref.zo, ref_d);
  const Eigen::Index n = zp.size();
  x.resize(n);
  const double* __restrict a = zp.data();
  const double* __restrict b = zq.data();
  double* __restrict out = x.data();
  for (Eigen::Index k = 0; k < n; ++k) {
    const double dn = a[k] - ref.zn, dq = b[k] - ref.zo, d = a[k] - b[k];
    const double cn = std::min(std::max(dn, -big), big), cq = std::min(std::max(dq, -big), big);
    // kl_centred's rounding errors of dn and dq, where both are finite (else the clamped form).
    const double en = difference_error(a[k], ref.zn, dn), eq = difference_error(b[k], ref.zo, dq);
    const double fine = en - eq;
    const double by_ref = std::min(std::max((cn - cq) + (fine - fine == 0.0 ? fine : 0.0), -big), big);
    // With both differences' rounding errors (kl_centred); NaN where d or ref_d overflowed, and
    // clamped so (std::max(−big, NaN) is −big), where w is 0.
    const double by_row = std::min(big, std::max(-big, (d - ref_d) + (difference_error(a[k], b[k], d) - ref_error)));
    const double w = double(::fabs(d) + abs_ref_d < ::fabs(dn) + ::fabs(dq));  // kl_centred's choice
    out[k] = w * by_row + (1.0 - w) * by_ref;
  }
  if (zp.minCoeff() == neg_inf() || zq.minCoeff() == neg_inf()) {
    for (Eigen::Index k = 0; k < n; ++k)
      if (!(a[k] > neg_inf() && b[k] > neg_inf())) out[k] = 0.0;
  }
}

/// q_j e^{x_j} − q_j on a block (x from centred_block against the reference token r, q =
/// exact_exp(log q)): q·expm1(x) by its series where |x| ≤ 1/2, e^{(z_p,j − z_p,r) + log q_r} − q
/// elsewhere — log q_j + x_j without z_q,j, which cancels there: formed as log q + x, a huge
/// finite old mask (z_q,j = −1e17 beside O(1) logits) left the sum of two ~1e17 numbers, wrong by
/// their ulps (±16), and e^{±16} in place of p_j/p_r·q_r; −q_j where z_p masks the token (an
/// old-only token), 0 where z_q does. Returns false where a term overflows.
inline bool centred_ratio_terms(const block_array& zp, const block_array& x, const block_array& q, double zp_ref,
                                double log_q_ref, block_array& term) {
  term = q * expm1_near_zero(x.max(-0.5).min(0.5));
  if (x.abs().maxCoeff() > 0.5) {
    const block_array far = exact_exp((zp - zp_ref) + log_q_ref) - q;
    if (!(far.maxCoeff() < inf())) return false;
    const Eigen::Index n = x.size();
    const double* __restrict xs = x.data();
    const double* __restrict fs = far.data();
    double* __restrict ts = term.data();
    for (Eigen::Index k = 0; k < n; ++k) {
      const double w = double(::fabs(xs[k]) <= 0.5);
      ts[k] = w * ts[k] + (1.0 - w) * fs[k];
    }
  }
  if (zp.minCoeff() == neg_inf()) {
    for (Eigen::Index k = 0; k < x.size(); ++k)
      if (zp[k] == neg_inf()) term[k] = -q[k];
  }
  return true;
}

/// a = log Σ_{supp p} q_i e^{x_i} (x_i = kl_centred(z_p,i, z_q,i, ref), ref a token of the joint
/// support, which makes log p_i − log q_i = x_i − a) as log1p(Σ_{supp p} q_i expm1(x_i) − q(old
/// only)): exact to a few ulps of a itself, where the closed form log Z_p − log Z_q − d_r
/// (tilt_point::a_c) carries ulps of the log-sums. False, leaving `a` alone, where that sum is not
/// moderate (below −1/2, or an overflow): the rows are then far apart and the closed form is fine.
///
/// A pair whose logits are all finite with a spread of at most 700 (`finite`) takes the same
/// terms in packets (kl_centred_packet, ratio_term_packet), reading T in place.
template <class T>
inline bool centred_log_ratio(const T* zp, const T* zq, std::size_t size, const tilt_ref& ref, double q_max,
                              double q_log_sum, double& a, bool finite = false) {
  if (finite) {
    using namespace Eigen::internal;
    using packet = packet_traits<double>::type;
    constexpr long lanes = long(sizeof(packet) / sizeof(double));
    const long n = static_cast<long>(size), whole = n - n % lanes;
    const centred_reference cr(ref);
    const packet rn = pset1<packet>(ref.zn), ro = pset1<packet>(ref.zo), rd = pset1<packet>(cr.rd);
    const packet abs_rd = pset1<packet>(cr.abs_rd), rd_error = pset1<packet>(cr.rd_error);
    const packet shift = pset1<packet>(q_max + q_log_sum), log_q_ref = pset1<packet>((ref.zo - q_max) - q_log_sum);
    double total = 0.0;
    auto add = [&](const packet& zpk, const packet& zqk, const packet& live, packet& acc) {
      const packet x = kl_centred_packet(zpk, zqk, rn, ro, rd, abs_rd, rd_error);
      const packet log_far = padd(psub(zpk, rn), log_q_ref);  // log q + x without z_q
      acc = padd(acc, pmul(ratio_term_packet(exp_any(psub(zqk, shift)), log_far, x), live));
    };
    const packet one = pset1<packet>(1.0);
    for (long begin = 0; begin < whole; begin += 512) {
      const long end = begin + 512 < whole ? begin + 512 : whole;
      packet acc = pset1<packet>(0.0);
      for (long k = begin; k < end; k += lanes)
        add(load_as_double<packet>(zp + k), load_as_double<packet>(zq + k), one, acc);
      total += predux(acc);
    }
    if (whole < n) {  // the last partial packet, padded with the reference token (weight 0)
      double ta[lanes], tb[lanes], w[lanes];
      for (long j = 0; j < lanes; ++j) {
        ta[j] = whole + j < n ? double(zp[whole + j]) : ref.zn;
        tb[j] = whole + j < n ? double(zq[whole + j]) : ref.zo;
        w[j] = whole + j < n ? 1.0 : 0.0;
      }
      packet acc = pset1<packet>(0.0);
      add(ploadu<packet>(ta), ploadu<packet>(tb), ploadu<packet>(w), acc);
      total += predux(acc);
    }
    if (!(total > -0.5 && total < inf())) return false;
    a = ::log1p(total);
    return true;
  }
  double sum = 0.0;
  block_array x, term;
  for_each_block(size, [&](std::size_t begin, Eigen::Index count) {
    const block_array zpb = load(zp, begin, count), zqb = load(zq, begin, count);
    centred_block(zpb, zqb, ref, x);
    const block_array q = exact_exp((zqb - q_max) - q_log_sum);
    sum += centred_ratio_terms(zpb, x, q, ref.zn, (ref.zo - q_max) - q_log_sum, term) ? term.sum() : inf();
  });
  if (!(sum > -0.5 && sum < inf())) return false;
  a = ::log1p(sum);
  return true;
}

/// KL(p ‖ q) of one validated row pair (p as "new", q as "old"), +inf when p has mass where q
/// has none. The same tilted reduction at t = 1; where its closed form t·E[x] − a_c cancels, the
/// sum of non-negative kl_terms, with a_c from centred_log_ratio: an error δ in a_c moves that
/// sum by about δ²/2 (its first-order change, −δ·KL, is negligible), so with a_c formed from the
/// log-sums (δ ~ 1e-16) the KL of nearly equal rows was wrong below ~1e-30 (54% at 2e-32).
template <class T>
inline double kl_row(const T* zp, const T* zq, std::size_t size, const row_setup& setup) {
  if (setup.new_only) return inf();
  // Equal rows: exactly 0 (the sum below would leave the normalisers' last-bit difference, ~1e-32).
  if (std::equal(zp, zp + size, zq)) return 0.0;
  const tilt_evaluator<T> eval = make_evaluator(zp, zq, size, setup);
  const double old_log_sum = eval.old_log_sum();
  tilt_point p = make_point(eval(tilt_at(1.0), setup.new_top), tilt_at(1.0), setup.new_top, setup.old_max,
                            old_log_sum);
  if (p.kl_error <= 1e-11 * p.kl) return maximum(p.kl, 0.0);
  centred_log_ratio(zp, zq, size, p.ref, setup.old_max, old_log_sum, p.a_c,
                    !setup.any_masked && setup.spread <= 700.0);
  return maximum(eval.exact_kl(p), 0.0);
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
