#include <doctest/doctest.h>

// The CPU backend's packet exponentials (detail/cpu/packet_exp.hpp), the one-pass tilted reduction
// (detail/cpu/finite_rows.hpp) and the packet VJP of long rows (detail/cpu/backward_kernels.hpp),
// against long double oracles and against the general paths they replace on the common rows.

#include <troll/detail/cpu/finite_rows.hpp>
#include <troll/detail/cpu/backward_kernels.hpp>
#include <troll/detail/cpu/exact_sums.hpp>
#include <troll/detail/cpu/row_kernels.hpp>
#include <troll/projection.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <random>
#include <vector>

#include "bits.hpp"

namespace {

using troll_test::ulps;
using namespace troll::detail;
using packet = Eigen::internal::packet_traits<double>::type;
constexpr int lanes = int(sizeof(packet) / sizeof(double));

/// f applied lane by lane to xs (a whole number of packets is formed, padded with 0).
template <class F>
std::vector<double> apply_packets(const std::vector<double>& xs, F f) {
  std::vector<double> in(xs), out(xs.size() + lanes);
  while (in.size() % lanes) in.push_back(0.0);
  for (std::size_t k = 0; k < in.size(); k += lanes)
    Eigen::internal::pstoreu(out.data() + k, f(Eigen::internal::ploadu<packet>(in.data() + k)));
  out.resize(xs.size());
  return out;
}

/// Random points of [lo, hi] plus the ends, 0 and the points near multiples of ln 2 / 16 and of
/// ln 2 / 2 (where the reductions change n).
std::vector<double> exp_points(double lo, double hi, int random_count) {
  std::mt19937_64 gen(20261124);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> xs{lo, hi, 0.0, -0.0, std::nextafter(lo, hi), std::nextafter(hi, lo)};
  for (int k = 0; k < random_count; ++k) xs.push_back(u(gen));
  const double step = std::log(2.0) / 32.0;
  for (double x = lo; x <= hi; x += 37.0 * step) {
    xs.push_back(x);
    xs.push_back(std::nextafter(x, hi));
    xs.push_back(std::nextafter(x, lo));
  }
  return xs;
}

}  // namespace

// In every build: AVX-512's sixteen-entry table kernel, AVX2's two-entry one (AVX2 without FMA:
// the degree-13 polynomial) and exp_portable (SSE2, NEON).
constexpr double exp_bounded_ulps = 1.5;

TEST_CASE("exp_bounded is within 1.5 ulp of expl where the reductions switch n (|r| at its largest)") {
  // x = (k + 1/2)·ln 2 / 16 and its neighbours: the half-way points of the AVX-512 kernel's
  // reduction, which include those of AVX2's (ln 2 / 4) and of the degree-13 kernels (ln 2 / 2)
  std::vector<double> xs;
  const long double step = std::log(2.0L) / 16;
  for (long k = -16358; k <= 16356; ++k) {
    const double x = static_cast<double>((k + 0.5L) * step);
    if (x < -708.0 || x > 708.0) continue;
    double lo = x, hi = x;
    xs.push_back(x);
    for (int j = 0; j < 3; ++j) {
      lo = std::nextafter(lo, -1e300), hi = std::nextafter(hi, 1e300);
      xs.push_back(lo), xs.push_back(hi);
    }
  }
  const std::vector<double> got = apply_packets(xs, [](const packet& p) { return cpu::exp_bounded(p); });
  double worst = 0.0, worst_at = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    const double e = ulps(got[k], std::exp(static_cast<long double>(xs[k])));
    if (e > worst) worst = e, worst_at = xs[k];
  }
  INFO("worst ", worst, " ulp at x = ", worst_at, " over ", xs.size(), " points");
  CHECK(worst <= exp_bounded_ulps);
}

TEST_CASE("exp_bounded gives the powers of two and of sqrt 2 to within an ulp") {
  // e^{k·ln 2 / 2}: r near 0, the result the table entry (1 or sqrt 2) times 2^{floor(k/2)}
  std::vector<double> xs;
  for (long k = -2040; k <= 2040; ++k) xs.push_back(static_cast<double>(k * (std::log(2.0L) / 2)));
  const std::vector<double> got = apply_packets(xs, [](const packet& p) { return cpu::exp_bounded(p); });
  double worst = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) worst = std::max(worst, ulps(got[k], std::exp(static_cast<long double>(xs[k]))));
  INFO("worst ", worst, " ulp");
  CHECK(worst <= 1.0);
}

TEST_CASE("exp_bounded is within 1.5 ulp of expl on [-708, 708]") {
  const std::vector<double> xs = exp_points(-708.0, 708.0, 400000);
  const std::vector<double> got = apply_packets(xs, [](const packet& p) { return cpu::exp_bounded(p); });
  double worst = 0.0, worst_at = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    const double e = ulps(got[k], std::exp(static_cast<long double>(xs[k])));
    if (e > worst) worst = e, worst_at = xs[k];
  }
  INFO("worst ", worst, " ulp at x = ", worst_at);
  CHECK(worst <= exp_bounded_ulps);
  CHECK(got[2] == 1.0);  // e^0 exactly
  CHECK(got[3] == 1.0);
}

TEST_CASE("exp_in_range is exp_bounded to the bit on [-708, 708]") {
  // The unclamped kernel of the passes whose inputs are in range (or whose results are then
  // discarded): the same value wherever the clamp does nothing.
  const std::vector<double> xs = exp_points(-708.0, 708.0, 100000);
  const std::vector<double> clamped = apply_packets(xs, [](const packet& p) { return cpu::exp_bounded(p); });
  const std::vector<double> unclamped = apply_packets(xs, [](const packet& p) { return cpu::exp_in_range(p); });
  std::size_t differ = 0;
  for (std::size_t k = 0; k < xs.size(); ++k) differ += clamped[k] == unclamped[k] ? 0 : 1;
  CHECK(differ == 0);
}

TEST_CASE("exp_bounded clamps: below -708 (-745, -1e300, -inf) gives e^-708, above 708 gives e^708") {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> xs{-708.0, -708.5, -745.0, -746.0, -1e300, -inf, 708.0, 709.5, 1e300, inf};
  const std::vector<double> got = apply_packets(xs, [](const packet& p) { return cpu::exp_bounded(p); });
  for (std::size_t k = 1; k < 6; ++k) CHECK(got[k] == got[0]);
  for (std::size_t k = 7; k < 10; ++k) CHECK(got[k] == got[6]);
  CHECK(ulps(got[0], std::exp(-708.0L)) <= 2.0);
  CHECK(ulps(got[6], std::exp(708.0L)) <= 2.0);
  CHECK(std::isfinite(got[6]));
  CHECK(got[0] >= std::numeric_limits<double>::min());  // a normal double
}

TEST_CASE("exp_nonpositive is within 2 ulp of expl on [-700, 0] and clamps below") {
  const std::vector<double> xs = exp_points(-700.0, 0.0, 200000);
  const std::vector<double> got = apply_packets(xs, [](const packet& p) { return cpu::exp_nonpositive(p); });
  double worst = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) worst = std::max(worst, ulps(got[k], std::exp(static_cast<long double>(xs[k]))));
  INFO("worst ", worst, " ulp");
  CHECK(worst <= 2.0);
  const std::vector<double> low{-700.0, -745.0, -std::numeric_limits<double>::infinity()};
  const std::vector<double> low_got = apply_packets(low, [](const packet& p) { return cpu::exp_nonpositive(p); });
  CHECK(low_got[1] == low_got[0]);
  CHECK(low_got[2] == low_got[0]);
}

namespace {

/// The row pair's reduction in long double, relative to its exact maximum.
struct exact_state {
  long double m = -std::numeric_limits<long double>::infinity(), s0 = 0, s1 = 0, s2 = 0;
  std::size_t at = 0;
};

template <class T>
exact_state reduce_exact(const std::vector<T>& zn, const std::vector<T>& zo, const tilt_param& u, const tilt_ref& ref) {
  exact_state st;
  std::vector<long double> x(zn.size()), w(zn.size());
  for (std::size_t i = 0; i < zn.size(); ++i) {
    const long double dn = static_cast<long double>(zn[i]) - ref.zn, dold = static_cast<long double>(zo[i]) - ref.zo;
    x[i] = dn - dold;
    w[i] = dold + static_cast<long double>(u.t) * x[i];
    if (w[i] > st.m) st.m = w[i], st.at = i;
  }
  for (std::size_t i = 0; i < zn.size(); ++i) {
    const long double e = std::exp(w[i] - st.m);
    st.s0 += e, st.s1 += e * x[i], st.s2 += e * x[i] * x[i];
  }
  return st;
}

template <class T>
void check_one_pass(std::size_t size, double t, unsigned seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> logit(0.0, 3.0), noise(0.0, 0.45);
  std::vector<T> zo(size), zn(size);
  for (std::size_t i = 0; i < size; ++i) {
    zo[i] = static_cast<T>(logit(gen));
    zn[i] = static_cast<T>(static_cast<double>(zo[i]) + noise(gen));
  }
  const std::size_t r = size / 3;  // a token of the row as the reference, as the solver passes
  const tilt_ref ref{static_cast<double>(zn[r]), static_cast<double>(zo[r])};
  const tilt_param u = tilt_at(t);
  lse_state one;
  REQUIRE(cpu::tilt_reduce_one_pass(zn.data(), zo.data(), static_cast<long>(size), u, ref, one));
  // the two-pass reduction per block, as before (float rows widened first)
  std::vector<double> a(zn.begin(), zn.end()), b(zo.begin(), zo.end());
  std::vector<double> x(cpu::block_size + 16), w(cpu::block_size + 16);
  lse_state two;
  for (std::size_t begin = 0; begin < size; begin += cpu::block_size) {
    const long count = static_cast<long>(std::min<std::size_t>(cpu::block_size, size - begin));
    two = merge(two, cpu::tilt_reduce_finite(a.data() + begin, b.data() + begin, count, u, ref, x.data(), w.data()));
  }
  const exact_state ex = reduce_exact(zn, zo, u, ref);
  INFO("size ", size, " t ", t);
  // the same maximum (the old scalar tail may round w once less, by a fused multiply-add) and token
  CHECK(std::fabs(one.m - two.m) <= 4e-16 * (1.0 + std::fabs(two.m)));
  CHECK(one.ref_new == two.ref_new);
  CHECK(one.ref_old == two.ref_old);
  CHECK(one.ref_new == static_cast<double>(zn[ex.at]));
  CHECK(std::fabs(static_cast<long double>(one.m) - ex.m) <= 1e-13L * (1.0L + std::fabs(ex.m)));
  // the sums relative to their long double values (s1 against the scale of s0·|x|)
  const double tol = 1e-13;
  const long double scale1 = std::sqrt(ex.s0 * ex.s2);
  CHECK(std::fabs(one.s0 - ex.s0) <= tol * ex.s0);
  CHECK(std::fabs(one.s1 - ex.s1) <= tol * scale1);
  CHECK(std::fabs(one.s2 - ex.s2) <= tol * ex.s2);
  CHECK(std::fabs(one.s0 - two.s0) <= tol * two.s0);
  CHECK(std::fabs(one.s2 - two.s2) <= tol * two.s2);
}

}  // namespace

TEST_CASE("tilt_reduce_one_pass agrees with the two-pass reduction and with long double") {
  for (std::size_t size : {1u, 3u, 7u, 8u, 9u, 16u, 17u, 77u, 511u, 512u, 513u, 1000u, 4099u, 151936u}) {
    for (double t : {0.0, 0.3, 0.5, 0.7, 1.0}) {
      check_one_pass<double>(size, t, 7u * unsigned(size) + unsigned(10 * t));
      check_one_pass<float>(size, t, 11u * unsigned(size) + unsigned(10 * t));
    }
  }
}

TEST_CASE("tilt_reduce_one_pass declines a reference far from the mode (w above 600)") {
  const std::vector<double> zn{0.0, 650.0, 1.0}, zo{0.0, 0.0, 0.0};
  lse_state st;
  CHECK_FALSE(cpu::tilt_reduce_one_pass(zn.data(), zo.data(), 3, tilt_at(1.0), tilt_ref{0.0, 0.0}, st));
  CHECK(st.empty());
  // and one whose w falls below −707 somewhere
  const std::vector<double> zn2{0.0, -710.0, 1.0};
  CHECK_FALSE(cpu::tilt_reduce_one_pass(zn2.data(), zo.data(), 3, tilt_at(1.0), tilt_ref{0.0, 0.0}, st));
  // with the reference at the mode the first row is fine
  CHECK(cpu::tilt_reduce_one_pass(zn.data(), zo.data(), 3, tilt_at(1.0), tilt_ref{650.0, 0.0}, st));
  CHECK(st.m == 0.0);
  CHECK(st.ref_new == 650.0);
}

TEST_CASE("tilt_reduce_one_pass takes the first token of the largest w (ties across chunks and the tail)") {
  for (std::size_t first : {3u, 700u, 1501u}) {
    std::vector<double> zn(1503, -1.0), zo(1503, 0.0);
    zn[first] = 2.0, zo[first] = 0.5;  // the mode, tied at t = 1 with the last token
    zn[1502] = 2.0, zo[1502] = -0.5;
    if (first == 1501) zn[1502] = -1.0, zn[1501] = 2.0;
    lse_state st;
    REQUIRE(cpu::tilt_reduce_one_pass(zn.data(), zo.data(), 1503, tilt_at(1.0), tilt_ref{-1.0, 0.0}, st));
    CHECK(st.m == 3.0);
    CHECK(st.ref_old == 0.5);
    const double ties = first == 1501 ? 1.0 : 2.0;
    CHECK(st.s0 == doctest::Approx(ties + (1503.0 - ties) * std::exp(-3.0)).epsilon(1e-14));
  }
}

namespace {

/// vjp_row's ∂L/∂z̃ without grad_old (the packet passes where the row allows) against the same
/// call with grad_old (the general block path), on a projected row of `size` tokens.
template <class T>
void check_packet_vjp(std::size_t size, double spread_scale, unsigned seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> logit(0.0, spread_scale), noise(0.0, 0.45), up(0.0, 1.0);
  std::vector<T> zo(size), zn(size), g(size), logp(size);
  for (std::size_t i = 0; i < size; ++i) {
    zo[i] = static_cast<T>(logit(gen));
    zn[i] = static_cast<T>(static_cast<double>(zo[i]) + noise(gen));
    g[i] = static_cast<T>(up(gen));
  }
  troll::projection_stats stats;
  troll::project(troll::cpu.with_threads(1), troll::make_batch(zn.data(), 1, size),
                 troll::make_batch(zo.data(), 1, size), 0.01, troll::make_batch(logp.data(), 1, size), &stats);
  std::vector<T> fast(size), general(size), old(size);
  double eps_fast = 0.0, eps_general = 0.0;
  const bool ok_fast = cpu::vjp_row(zn.data(), zo.data(), logp.data(), g.data(), size, stats, fast.data(),
                                    static_cast<T*>(nullptr), &eps_fast);
  const bool ok_general =
      cpu::vjp_row(zn.data(), zo.data(), logp.data(), g.data(), size, stats, general.data(), old.data(), &eps_general);
  INFO("size ", size, " scale ", spread_scale, " status ", int(stats.status));
  CHECK(ok_fast == ok_general);
  CHECK(eps_fast == doctest::Approx(eps_general).epsilon(1e-12));
  // the sums are the same up to summation order, each π within an ulp or two: the gradients
  // agree to a few ulps of T relative to the row's largest
  double largest = 0.0;
  for (std::size_t i = 0; i < size; ++i) largest = std::max(largest, std::fabs(static_cast<double>(general[i])));
  const double tol = (sizeof(T) == 4 ? 4e-7 : 1e-13) * largest;
  double worst = 0.0;
  for (std::size_t i = 0; i < size; ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(fast[i]) - static_cast<double>(general[i])));
  CHECK(worst <= tol);
}

}  // namespace

TEST_CASE("the packet VJP of long rows agrees with the general path") {
  for (std::size_t size : {3u, 9u, 600u, 4099u, 40000u}) {
    for (double scale : {3.0, 60.0, 400.0}) {  // the last reaches log π* below −700: general path
      check_packet_vjp<double>(size, scale, 3u * unsigned(size) + unsigned(scale));
      check_packet_vjp<float>(size, scale, 5u * unsigned(size) + unsigned(scale));
    }
  }
}

namespace {

/// tail_exp_sum (one packet pass) against its definition: in double rows the terms of
/// packet_exp, in float rows tail_term_fixed (summed by tail_fixed_sum_scalar, token by token);
/// the canonical sum rounds to the same double whatever the order of its terms. Against long
/// double too: float terms within a few float ulps plus the 2^−51 grid, double terms to 1e-15.
template <class T>
void check_tail_sum(std::size_t size, std::size_t first, int support, unsigned seed, bool near_floor = false) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> logit(0.0, 4.0);
  std::uniform_int_distribution<int> kind(0, 19);
  std::vector<T> z(size);
  for (std::size_t i = 0; i < size; ++i) {
    const int k = kind(gen);
    // mostly ordinary logits, some masked, some far below the exponentials' range
    z[i] = k == 0 ? -std::numeric_limits<T>::infinity() : k == 1 ? T(-95.0 - 30.0 * std::fabs(logit(gen))) : T(logit(gen));
    // near_floor: the max at 0 and the rest near the floor of the terms: double's packet exp
    // (−87 in float before, subnormal terms), float's fixed grid (terms near 2^−51)
    if (near_floor && k != 0)
      z[i] = i == size / 2 ? T(0) : sizeof(T) == 4 ? T(-33.0 - 2.0 * std::fabs(logit(gen))) : T(-80.0 - 2.0 * std::fabs(logit(gen)));
  }
  std::vector<troll::detail::index_slot> slots;
  std::uniform_int_distribution<std::size_t> any(0, size - 1);
  for (int i = 0; i < support; ++i) slots.push_back({troll::sparse_index(first + any(gen)), i});
  std::sort(slots.begin(), slots.end(), [](const auto& a, const auto& b) { return a.index < b.index; });
  slots.erase(std::unique(slots.begin(), slots.end(), [](const auto& a, const auto& b) { return a.index == b.index; }),
              slots.end());
  double m = -std::numeric_limits<double>::infinity();
  std::size_t s = 0;
  std::vector<bool> in_support(size, false);
  for (std::size_t i = 0; i < size; ++i) {
    const bool in = s < slots.size() && std::size_t(slots[s].index) - first == i;
    if (in) {
      ++s;
      in_support[i] = true;
    } else {
      m = std::max(m, double(z[i]));
    }
  }
  const int n = int(slots.size());
  const exact_sum got = cpu::tail_exp_sum(z.data(), size, first, slots.data(), n, m);
  long double exact = 0.0L;
  for (std::size_t i = 0; i < size; ++i)
    if (!in_support[i] && m > -std::numeric_limits<double>::infinity())
      exact += std::exp(static_cast<long double>(z[i]) - static_cast<long double>(m));
  INFO("size ", size, " first ", first, " support ", n);
  if constexpr (sizeof(T) == 4) {
    const exact_sum want = cpu::tail_fixed_sum_scalar(z.data(), size, first, slots.data(), n, m);
    CHECK(got.value() == want.value());
    CHECK(std::fabs(static_cast<long double>(got.value()) - exact) <=
          3.0L * 0x1p-24L * exact + static_cast<long double>(size) * 0x1p-51L);
  } else {
    std::vector<T> e(size);
    cpu::packet_exp(z.data(), Eigen::Index(size), static_cast<T>(m), e.data());
    for (const auto& slot : slots) e[std::size_t(slot.index) - first] = T(0);
    exact_sum want;
    for (std::size_t i = 0; i < size; ++i) exact_add(want, double(e[i]));
    CHECK(got.value() == want.value());
    CHECK(std::fabs(static_cast<long double>(got.value()) - exact) <= 1e-15L * exact);
  }
}

/// The worst error of tail_term_fixed over logits zs below a tail max m, in float ulps of
/// e^{z−m} once the 2^−50 grid's half step is allowed: |q·2^−50 − e^{z−m}| − 2^−51 over 2^−24·e^{z−m}.
double worst_term_error(const std::vector<float>& zs, float m) {
  double worst = 0.0;
  for (float z : zs) {
    const long double e = std::exp(static_cast<long double>(z) - static_cast<long double>(m));
    const long double q = std::ldexp(static_cast<long double>(cpu::tail_term_fixed(z, m)), -cpu::tail_fixed_bits);
    const long double excess = std::fabs(q - e) - 0x1p-51L;
    if (excess > 0) worst = std::max(worst, static_cast<double>(excess / (e * 0x1p-24L)));
  }
  return worst;
}

}  // namespace

TEST_CASE("tail_exp_sum in one packet pass gives the canonical sum of its terms") {
  unsigned seed = 1;
  for (std::size_t size : {1u, 5u, 16u, 17u, 31u, 33u, 100u, 511u, 512u, 513u, 5000u, 151936u, 300000u}) {
    for (std::size_t first : {0u, 1000u}) {
      for (int support : {0, 1, 65}) {
        check_tail_sum<float>(size, first, support, ++seed);
        check_tail_sum<double>(size, first, support, ++seed);
        check_tail_sum<float>(size, first, support, ++seed, true);
      }
    }
  }
}

TEST_CASE("tail_term_fixed: float rows' tail terms within 2.5 float ulps of long double") {
  std::mt19937_64 gen(20261124);
  std::vector<float> zs;
  auto check = [&](float m, const char* what) {
    INFO(what, " m = ", m);
    CHECK(worst_term_error(zs, m) <= 2.5);
    for (float z : zs) CHECK(cpu::tail_term_fixed(z, m) >= 0);
  };
  // flat, Zipf-like and wide rows below their tail max, m of several magnitudes (z − m then
  // rounds in float; the TwoSum keeps its error)
  for (float m : {0.0f, 0.3f, -4.52573586f, 20.3f, 31.999998f, -50.25f}) {
    zs.clear();
    std::normal_distribution<double> flat(double(m) - 0.5, 0.2);
    std::uniform_real_distribution<double> wide(double(m) - 40.0, double(m));
    for (int i = 0; i < 20000; ++i) zs.push_back(std::min(m, float(flat(gen))));
    for (int i = 0; i < 20000; ++i) zs.push_back(float(wide(gen)));
    for (int rank = 1; rank <= 20000; ++rank) zs.push_back(std::min(m, float(double(m) - 1.1 * std::log(double(rank)))));
    zs.push_back(m);
    zs.push_back(std::nextafter(m, -1e30f));
    check(m, "rows");
  }
  // a sharp row: the tail far below its own max and a dense sweep of d = z − m over [−36, 0]
  zs.clear();
  for (float z = -36.0f; z <= 0.0f; z += 0.0009765625f) zs.push_back(z);
  check(0.0f, "sweep");
  // huge logits: tail tokens just below a tail max near float's largest (and −3e38, 1e30)
  for (float m : {3.0e38f, std::numeric_limits<float>::max(), -3.0e38f, 1.0e30f}) {
    zs.clear();
    float z = m;
    for (int i = 0; i < 200; ++i) zs.push_back(z = std::nextafter(z, -std::numeric_limits<float>::infinity()));
    zs.push_back(-std::numeric_limits<float>::max());
    zs.push_back(-std::numeric_limits<float>::infinity());
    check(m, "huge");
  }
  CHECK(cpu::tail_term_fixed(-std::numeric_limits<float>::infinity(), 1.0f) == 0);
  CHECK(cpu::tail_term_fixed(-3.0e38f, 3.0e38f) == 0);
  CHECK(cpu::tail_term_fixed(-40.0f, 0.0f) == 0);
  CHECK(cpu::tail_term_fixed(2.0f, 2.0f) == (std::int64_t(1) << cpu::tail_fixed_bits));
}

TEST_CASE("expm1_near_zero_packet is within 1.5 ulp of expm1l on [-1/2, 1/2]") {
  std::vector<double> xs = exp_points(-0.5, 0.5, 200000);
  for (int e = 1; e < 60; ++e) {  // tiny arguments, where expm1(x) ≈ x
    xs.push_back(std::ldexp(1.0, -e));
    xs.push_back(-std::ldexp(1.0, -e) * 0.75);
  }
  const std::vector<double> got =
      apply_packets(xs, [](const packet& x) { return cpu::expm1_near_zero_packet(x); });
  double worst = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    if (xs[k] == 0.0) {
      CHECK(got[k] == 0.0);
      continue;
    }
    worst = std::max(worst, ulps(got[k], std::expm1(static_cast<long double>(xs[k]))));
  }
  INFO("worst ", worst, " ulp");
  CHECK(worst <= 1.5);
}

TEST_CASE("block_exp: exp_in_range's 1.5 ulp in range, std::exp's values outside, any block length") {
  // Blocks of every length mod the packet width, holding in-range arguments, arguments below
  // −708 (subnormal results, 0), −inf, above 708, +inf and NaN.
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> u(-700.0, 700.0);
  const double specials[] = {-709.5, -745.0, -800.0, -std::numeric_limits<double>::infinity(), 708.5, 709.7,
                             710.0, std::numeric_limits<double>::infinity()};
  double worst = 0.0;
  for (Eigen::Index size : {1, 7, 8, 9, 15, 16, 17, 63, 512}) {
    for (int with_special = 0; with_special < 2; ++with_special) {
      cpu::block_array x(size);
      for (Eigen::Index k = 0; k < size; ++k) x[k] = u(gen);
      if (with_special)
        for (Eigen::Index k = 0; k < size; k += 5) x[k] = specials[(k / 5) % 8];
      const cpu::block_array e = cpu::block_exp(x);
      for (Eigen::Index k = 0; k < size; ++k) {
        const double want = std::exp(x[k]);
        if (x[k] >= -708.0 && x[k] <= 708.0) {
          worst = std::max(worst, ulps(e[k], std::exp(static_cast<long double>(x[k]))));
        } else {
          CHECK(e[k] == want);  // libm's: subnormals, 0 at −inf, +inf above ~709.78
        }
      }
    }
  }
  cpu::block_array nan_block = cpu::block_array::Constant(9, 1.0);
  nan_block[4] = std::numeric_limits<double>::quiet_NaN();
  const cpu::block_array e = cpu::block_exp(nan_block);
  CHECK(std::isnan(e[4]));
  if (lanes > 1) CHECK(e[5] == std::exp(1.0));  // its packet (with entry 4) went through std::exp
  INFO("worst ", worst, " ulp");
  CHECK(worst <= exp_bounded_ulps);
}
