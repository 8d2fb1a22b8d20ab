// troll/detail/cpu/lane_solver.hpp — short rows in SIMD lanes: the projection of many small row
// pairs (the lumped sparse rows, |U| + 1 ≲ 130 categories) with one row per lane of a double
// packet (eight with AVX-512, four with AVX2), so that one packet pass evaluates the pending
// member of eight rows, and the per-evaluation costs of a one-row pass (the partial last packet,
// the lane reductions, the call) are shared.
//
// Every decision is the per-row solver's (trust_region_solver.hpp, family_solver.hpp's
// bracket_search: the same functions, taken one member at a time), and every reduction is
// bit-identical to the row's own (tilt_evaluator: tilt_reduce_one_pass): each row keeps, per
// entry k, the partial sum of the lane k mod L it would have in a one-row pass (whole packets
// and the last partial packet apart), and the L partial sums are added by the same predux. So a row solved in a lane
// gives the same bits as project_row: t, the statistics, the iterations and the output.
#pragma once

#include "eigen.hpp"
#include <cstddef>
#include <type_traits>

#include "../../config.hpp"
#include "../../projection_types.hpp"
#include "../../sparsify_state.hpp"
#include "../family_solver.hpp"
#include "../lse_state.hpp"
#include "../numeric.hpp"
#include "../tilt_family.hpp"
#include "../trust_region_solver.hpp"
#include "finite_rows.hpp"
#include "row_kernels.hpp"

#include "eigen_warnings_push.inc"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// Rows per lane group: the double packet's width (1 without SIMD, where the driver is not used).
inline constexpr int solver_lanes =
    int(sizeof(Eigen::internal::packet_traits<double>::type) / sizeof(double));

/// The largest row (entries) a lane holds.
inline constexpr int lane_row_capacity = 136;

/// Whether a validated row pair takes the finite-row reduction in every evaluation (the lane
/// path's): nothing masked and a logit spread of at most 700 (tilt_evaluator's `wide` test).
inline bool lane_eligible(const row_setup& setup, std::size_t size) {
  return !setup.any_masked && setup.spread <= 700.0 && size >= 1 && size <= std::size_t(lane_row_capacity);
}

/// The rows of one lane group, entry-major (entry k of lane l at [k·L + l]), and each lane's
/// pending member.
struct lane_group {
  static constexpr int L = solver_lanes;
  alignas(64) double zn[lane_row_capacity * L];
  alignas(64) double zo[lane_row_capacity * L];
  alignas(64) double count[L];   // entries of each lane's row (0: an empty lane)
  alignas(64) double ref_n[L], ref_o[L], slope[L], low[L];
  const double* row_n[L];  // each lane's row in place (the two-pass fallback)
  const double* row_o[L];
};

/// lse_state of every lane's row at its pending (u, ref), bit-identical to tilt_evaluator's
/// reduction of that row alone (tilt_reduce_one_pass: the whole packets' lane sums, then the
/// last partial packet's, each added by predux; e^{w} at shift 0, rescaled by e^{−m}). A lane
/// whose w leaves [−707, 600] gets the evaluator's own reduction (the two-pass fallback).
/// Lanes with count 0 are left out.
inline void lane_reduce(const lane_group& g, lse_state* out, const tilt_param* u, const tilt_ref* ref,
                        const tilt_evaluator<double>* evals) {
  using namespace Eigen::internal;
  using packet = packet_traits<double>::type;
  constexpr int L = lane_group::L;
  double most_k = 0.0, least_k = double(lane_row_capacity);
  alignas(64) double whole_l[L];
  for (int l = 0; l < L; ++l) {
    whole_l[l] = g.count[l] - double(long(g.count[l]) % L);
    most_k = g.count[l] > most_k ? g.count[l] : most_k;
    if (g.count[l] > 0.0) least_k = whole_l[l] < least_k ? whole_l[l] : least_k;
  }
  // Entries below `shortest` lie in a whole packet of every lane's row (an empty lane's sums are
  // not read); above it, masks.
  const long entries = long(most_k), shortest = long(least_k);
  const packet cnt = pload<packet>(g.count), whole = pload<packet>(whole_l);
  const packet rn = pload<packet>(g.ref_n), ro = pload<packet>(g.ref_o), ps = pload<packet>(g.slope);
  const packet low = pcmp_eq(pload<packet>(g.low), pset1<packet>(1.0));
  const packet minus_inf = pset1<packet>(neg_inf()), plus_inf = pset1<packet>(inf()), zero = pset1<packet>(0.0);
  packet most = minus_inf, least = plus_inf, most_at = zero;
  // Lane j of the one-row pass (entries ≡ j mod L) of every row at once, in its order: the
  // whole packets' partial sums at body[j·L + l], the last partial packet's at tail[j·L + l].
  alignas(64) double body0[L * L], body1[L * L], body2[L * L], tail0[L * L], tail1[L * L], tail2[L * L];
  for (int j = 0; j < L; ++j) {
    packet s0 = zero, s1 = zero, s2 = zero, r0 = zero, r1 = zero, r2 = zero;
    auto add = [&](long k, auto masked) {
      const packet token = pset1<packet>(double(k));
      packet a = pload<packet>(g.zn + k * L), b = pload<packet>(g.zo + k * L), valid = zero, in_body = zero;
      if (decltype(masked)::value) {
        valid = pcmp_lt(token, cnt);
        in_body = pcmp_lt(token, whole);
        a = pselect(valid, a, rn);  // beyond the row: its reference (x = w = 0), left out below
        b = pselect(valid, b, ro);
      }
      const packet dn = psub(a, rn), dold = psub(b, ro);
      const packet xk = psub(dn, dold);
      const packet wk = pmadd(ps, xk, pselect(low, dold, dn));  // as tilt_reduce_one_pass
      const packet wmax = decltype(masked)::value ? pselect(valid, wk, minus_inf) : wk;
      const packet wmin = decltype(masked)::value ? pselect(valid, wk, plus_inf) : wk;
      // Entries come lane by lane, not in token order: ties keep the lower token explicitly.
      const packet above = por(pcmp_lt(most, wmax), pand(pcmp_eq(most, wmax), pcmp_lt(token, most_at)));
      most = pselect(above, wmax, most);
      most_at = pselect(above, token, most_at);
      least = pmin(least, wmin);
      const packet e = exp_bounded(wk);
      const packet ex = pmul(e, xk);
      if (decltype(masked)::value) {
        s0 = pselect(in_body, padd(s0, e), s0);
        s1 = pselect(in_body, padd(s1, ex), s1);
        s2 = pselect(in_body, pmadd(ex, xk, s2), s2);
        const packet in_tail = pandnot(valid, in_body);  // valid and not in a whole packet
        r0 = pselect(in_tail, e, r0);
        r1 = pselect(in_tail, ex, r1);
        r2 = pselect(in_tail, pmul(ex, xk), r2);
      } else {
        s0 = padd(s0, e);
        s1 = padd(s1, ex);
        s2 = pmadd(ex, xk, s2);
      }
    };
    long k = j;
    for (; k < shortest; k += L) add(k, std::false_type{});
    for (; k < entries; k += L) add(k, std::true_type{});
    pstore(body0 + j * L, s0);
    pstore(body1 + j * L, s1);
    pstore(body2 + j * L, s2);
    pstore(tail0 + j * L, r0);
    pstore(tail1 + j * L, r1);
    pstore(tail2 + j * L, r2);
  }
  alignas(64) double lane_most[L], lane_least[L], lane_at[L];
  pstore(lane_most, most);
  pstore(lane_least, least);
  pstore(lane_at, most_at);
  for (int l = 0; l < L; ++l) {
    if (g.count[l] == 0.0) continue;
    const double m = lane_most[l];
    if (!(m <= 600.0 && lane_least[l] >= -707.0)) {  // as the evaluator: its two-pass reduction
      out[l] = evals[l](u[l], ref[l]);
      continue;
    }
    // Row l's L partial sums of each kind, added as the one-row pass adds them.
    auto sum = [&](const double* part) {
      alignas(64) double t[L];
      for (int j = 0; j < L; ++j) t[j] = part[j * L + l];
      return predux(pload<packet>(t));
    };
    double t0 = 0.0, t1 = 0.0, t2 = 0.0;
    if (whole_l[l] > 0.0) t0 += sum(body0), t1 += sum(body1), t2 += sum(body2);
    if (whole_l[l] < g.count[l]) t0 += sum(tail0), t1 += sum(tail1), t2 += sum(tail2);
    alignas(64) double scale_lanes[L];
    pstore(scale_lanes, exp_bounded(pset1<packet>(-m)));
    lse_state st;
    st.m = m;
    st.s0 = t0 * scale_lanes[0];
    st.s1 = t1 * scale_lanes[0];
    st.s2 = t2 * scale_lanes[0];
    const long at = long(lane_at[l]);
    st.ref_new = g.row_n[l][at];
    st.ref_old = g.row_o[l][at];
    out[l] = st;
  }
}

/// One lumped row pair being solved in a lane (any lumped row fits its buffers; only rows of up
/// to lane_row_capacity entries go into the lanes).
struct lane_row {
  std::size_t row = 0;
  int size = 0;
  double zn[sparse_max_entries + 1], zo[sparse_max_entries + 1];
  int slot[sparse_max_entries + 1];
  row_setup setup;
  int phase = 0;  // 0: t = 0 pending, 1: t = 1 pending, 2: bracketed solve
  double old_log_sum = 0.0;
  tilt_point at_zero;
  solve_result result;
  bracket_search<tilt_point> search;
  tilt_evaluator<double> eval() const { return make_evaluator(zn, zo, std::size_t(size), setup); }
};

/// Rows per call of project_rows_in_lanes in project() (a thread's unit of work).
inline constexpr std::size_t lane_chunk_rows = 64;

/// Projects the rows [begin, end) of a validated batch, L at a time in lanes, with exactly
/// project_row's results. load(r, zn, zo, slot) fills a row's lumped pair (double) and returns
/// its size; emit(r, size, slot, lp, stats) takes the solved row's log π* (`size` entries).
/// Rows that do not fit a lane (masked entries, a spread beyond 700, longer than
/// lane_row_capacity) are projected one at a time by project_row as they come.
template <class Load, class Emit>
inline void project_rows_in_lanes(std::size_t begin, std::size_t end, double eps, const projection_options& opt,
                                  Load&& load, Emit&& emit) {
  constexpr int L = lane_group::L;
  lane_group g{};
  lane_row rows[L];
  std::size_t next = begin;
  double lp[sparse_max_entries + 1];
  // Puts the next row that fits a lane into lane l (rows that do not are projected here).
  auto refill = [&](int l) {
    g.count[l] = 0.0;
    while (next < end) {
      lane_row& w = rows[l];
      w.row = next++;
      w.size = load(w.row, w.zn, w.zo, w.slot);
      scan_pair(w.zn, w.zo, std::size_t(w.size), w.setup, "", "");
      if (!lane_eligible(w.setup, std::size_t(w.size))) {
        const projection_stats s = project_row(w.zn, w.zo, std::size_t(w.size), w.setup, eps, opt, lp);
        emit(w.row, w.size, w.slot, lp, s);
        continue;
      }
      for (int k = 0; k < w.size; ++k) g.zn[k * L + l] = w.zn[k], g.zo[k * L + l] = w.zo[k];
      g.count[l] = double(w.size);
      g.row_n[l] = w.zn;
      g.row_o[l] = w.zo;
      w.phase = 0;
      w.result = solve_result{};
      return;
    }
  };
  auto finish = [&](int l) {
    lane_row& w = rows[l];
    const projection_stats s = write_solution(w.eval(), w.result, lp);
    emit(w.row, w.size, w.slot, lp, s);
    refill(l);
  };
  for (int l = 0; l < L; ++l) refill(l);
  tilt_param u[L];
  tilt_ref ref[L];
  lse_state st[L];
  tilt_evaluator<double> evals[L] = {};
  for (;;) {
    bool any = false;
    for (int l = 0; l < L; ++l) {
      if (g.count[l] == 0.0) continue;
      any = true;
      const lane_row& w = rows[l];
      u[l] = w.phase == 0 ? tilt_at(0.0) : w.phase == 1 ? tilt_at(1.0) : w.search.u;
      ref[l] = w.phase == 0 ? w.setup.old_top : w.phase == 1 ? w.setup.new_top : w.search.near().mode;
      g.ref_n[l] = ref[l].zn;
      g.ref_o[l] = ref[l].zo;
      g.low[l] = u[l].t <= 0.5 ? 1.0 : 0.0;
      g.slope[l] = u[l].t <= 0.5 ? u[l].t : -u[l].s;
      evals[l] = w.eval();
    }
    if (!any) return;
    lane_reduce(g, st, u, ref, evals);
    for (int l = 0; l < L; ++l) {
      if (g.count[l] == 0.0) continue;
      lane_row& w = rows[l];
      const tilt_evaluator<double> eval = w.eval();
      if (w.phase == 0) {  // solve_row's steps, one member at a time
        w.old_log_sum = ends_old_log_sum(eval, w.setup, st[l]);
        w.at_zero = zero_point(eval, w.setup, st[l], w.old_log_sum);
        w.phase = 1;
      } else if (w.phase == 1) {
        const tilt_point at_one = one_point(eval, w.setup, st[l], w.old_log_sum);
        if (!needs_solve(w.setup, w.at_zero, at_one, eps, w.result)) {
          finish(l);
          continue;
        }
        w.search.start(w.at_zero, at_one, eps, opt);
        w.phase = 2;
        if (w.search.done()) {
          take_solution(w.search.solution(), w.result);
          finish(l);
        }
      } else {
        w.search.advance(
            evaluate_from(eval, st[l], u[l], ref[l], w.setup.old_max, w.old_log_sum, eps, w.search.tol));
        if (w.search.done()) {
          take_solution(w.search.solution(), w.result);
          finish(l);
        }
      }
    }
  }
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE

#include "eigen_warnings_pop.inc"
