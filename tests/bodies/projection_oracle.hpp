// tests/bodies/projection_oracle.hpp — the oracle tests of the dense forward projection, written
// once and compiled per backend (the Kokkos pattern): tests/test_projection.cpp includes it with
// troll_test::oracle_backend = backend<cpu_policy>, tests/cuda/test_cuda_projection_oracle.cu with
// backend<cuda_policy> inside its "device" suite. Every call goes through oracle_backend's policy
// and buffers; the oracles (bisection on t, long-double sums, feasible competitors) are the same.
// Include after <troll/projection.hpp>, "corpus.hpp", "oracle.hpp", "tolerance.hpp" and the
// definition of troll_test::oracle_backend.

namespace {

using troll_test::corpus_block;
using troll_test::row_pair;
namespace oracle = troll_test::oracle;
using real = oracle::real;

const double minus_inf = -std::numeric_limits<double>::infinity();

const std::vector<corpus_block>& corpus() {
  static const std::vector<corpus_block> blocks = troll_test::make_corpus();
  return blocks;
}

const char* name(troll::row_status s) { return troll::status_name(s); }

troll::row_status expected_status(oracle::status s) {
  switch (s) {
    case oracle::status::inactive: return troll::row_status::inactive;
    case oracle::status::projected: return troll::row_status::projected;
    case oracle::status::restricted: return troll::row_status::restricted;
    case oracle::status::infeasible: return troll::row_status::infeasible;
  }
  return troll::row_status::infeasible;
}

/// log((1 − λ) e^a + λ e^b) in long double (a, b may be −inf).
real log_mix(real a, real b, real lambda) {
  if (lambda <= 0) return a;
  const real hi = std::max(a, b);
  if (hi == -oracle::infinity()) return hi;
  return hi + std::log((1 - lambda) * std::exp(a - hi) + lambda * std::exp(b - hi));
}

/// What one (row, ε) projection produced, measured against the oracle while its output was live.
struct outcome {
  const row_pair* row = nullptr;
  std::size_t cols = 0;
  double eps = 0;
  bool is_float = false;
  troll::projection_stats stats;
  oracle::solution expected;    // oracle class (t from bisection when `bisected`)
  bool bisected = false;
  double kl_before_bound = 0;   // allowed |stats.kl_before − KL(p̃‖q)|
  real kl_out = 0;              // KL(π_out‖q), π_out = the returned row renormalised
  real log_mass = 0;            // log Σ exp(returned row)
  double t_bound = 0;           // allowed |t − t*| from the conditioning of the root
  bool t_certified = true;      // KL(π_{t−t_bound}‖q) < ε < KL(π_{t+t_bound}‖q)
  real mu = 0, sigma2 = 0;      // oracle moments of d under π_t at the returned t
  std::size_t bad_tokens = 0;   // entries that are not log π_t at the returned t (or wrong mask)
  std::size_t first_bad = 0;
  bool bitwise_inactive = true;  // inactive rows: memcmp with troll::log_softmax
  bool competitors_checked = false;
  real objective = 0;            // KL(π_out‖p̃)
  real worst_gap = 0;            // min over feasible competitors of (J_c − J*) / tolerance
  real kl_old_to_new = 0;        // KL(q‖p̃)

  std::string describe() const {
    std::ostringstream s;
    s.precision(17);
    s << row->label() << (is_float ? " float" : " double") << " eps=" << eps
      << " status=" << name(stats.status) << " t=" << stats.t
      << " oracle_t=" << static_cast<double>(expected.t) << " t_bound=" << t_bound
      << " kl_after=" << stats.kl_after << " kl_out=" << static_cast<double>(kl_out)
      << " kl_before=" << stats.kl_before
      << " oracle_kl_before=" << static_cast<double>(expected.kl_before)
      << " iterations=" << stats.iterations;
    return s.str();
  }
};

/// Projects the rows of `block` (as T) for every ε of `eps_list` and measures each active row.
/// Rows whose only masks are two-sided are taken iff `two_sided` (a known bug, see the end).
template <class T>
void run_block(const corpus_block& block, const std::vector<double>& eps_list, bool bisect,
               bool competitors, bool two_sided, std::vector<outcome>& results) {
  const std::size_t n = block.cols;
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  // The rows in T (the oracle sees exactly the values troll sees) and their oracle views.
  std::vector<const row_pair*> rows;
  std::vector<std::vector<T>> zn, zo;
  for (const row_pair& r : block.rows) {
    std::vector<T> a(r.new_logits.begin(), r.new_logits.end());
    std::vector<T> b(r.old_logits.begin(), r.old_logits.end());
    if (oracle::only_two_sided_masks(a.data(), b.data(), n) != two_sided) continue;
    rows.push_back(&r);
    zn.push_back(std::move(a));
    zo.push_back(std::move(b));
  }
  std::vector<oracle::tilted_row> tilted;
  std::vector<double> kl_bounds;
  std::vector<real> kl_old_to_new;
  for (std::size_t k = 0; k < rows.size(); ++k) {
    tilted.emplace_back(zn[k].data(), zo[k].data(), n);
    const oracle::kl_value v = oracle::kl_with_condition(zn[k].data(), zo[k].data(), n);
    kl_bounds.push_back(troll_test::kl_tolerance<double>(double(v.condition)).bound(double(v.value)));
    kl_old_to_new.push_back(competitors ? oracle::kl(tilted[k].log_old(), tilted[k].log_new()) : 0);
  }

  for (double eps : eps_list) {
    // Infeasible rows would make the whole call throw: they are tested on their own.
    std::vector<std::size_t> live;
    std::vector<oracle::solution> classes;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      const oracle::solution s = oracle::classify(tilted[k], eps);
      if (s.status == oracle::status::infeasible) continue;
      live.push_back(k);
      classes.push_back(s);
    }
    if (live.empty()) continue;
    const std::size_t m = live.size();
    std::vector<T> a(m * n), b(m * n), out(m * n), plain(m * n);
    for (std::size_t j = 0; j < m; ++j) {
      std::copy(zn[live[j]].begin(), zn[live[j]].end(), a.begin() + j * n);
      std::copy(zo[live[j]].begin(), zo[live[j]].end(), b.begin() + j * n);
    }
    std::vector<troll::projection_stats> stats(m);
    {
      // The same calls under every backend: memory through the backend's buffers.
      using backend = troll_test::oracle_backend;
      typename backend::template buffer<T> da(a), db(b), dout(m * n), dplain(m * n);
      typename backend::template buffer<troll::projection_stats> dstats(m);
      troll::project(backend::policy(), troll::make_batch<const T>(da.get(), m, n),
                     troll::make_batch<const T>(db.get(), m, n), eps, troll::make_batch(dout.get(), m, n),
                     dstats.get());
      troll::log_softmax(backend::policy(), troll::make_batch<const T>(da.get(), m, n),
                         troll::make_batch(dplain.get(), m, n));
      out = dout.download();
      plain = dplain.download();
      stats = dstats.download();
    }

    for (std::size_t j = 0; j < m; ++j) {
      const std::size_t k = live[j];
      const oracle::tilted_row& row = tilted[k];
      const T* o = out.data() + j * n;
      outcome r;
      r.row = rows[k];
      r.cols = n;
      r.eps = eps;
      r.is_float = std::is_same<T, float>::value;
      r.stats = stats[j];
      r.expected = classes[j];
      r.kl_before_bound = kl_bounds[k];
      r.kl_old_to_new = kl_old_to_new[k];
      const std::vector<real> renormalised = oracle::log_softmax(o, n);
      r.kl_out = oracle::kl(renormalised, row.log_old());
      r.log_mass = oracle::log_total_mass(o, n);
      const bool inactive = r.stats.status == troll::row_status::inactive;
      if (inactive) {
        r.bitwise_inactive = std::memcmp(o, plain.data() + j * n, n * sizeof(T)) == 0;
      }
      // The row must be log π_t at the reported t (log p̃ for inactive rows), masks included.
      const real t = static_cast<real>(r.stats.t);
      const std::vector<real> reference = inactive ? row.log_new() : row.log_pi(t);
      if (!inactive) row.moments(t, r.mu, r.sigma2);
      real top_new = -oracle::infinity(), top_old = -oracle::infinity();
      for (std::size_t i = 0; i < n; ++i) {
        top_new = std::max(top_new, static_cast<real>(zn[k][i]));
        top_old = std::max(top_old, static_cast<real>(zo[k][i]));
      }
      for (std::size_t i = 0; i < n; ++i) {
        bool ok;
        if (reference[i] == -oracle::infinity()) {
          ok = o[i] == T(minus_inf);
        } else {
          const real scale = std::fabs(reference[i]) + (top_new - zn[k][i]) +
                             (inactive ? 0 : (top_old - zo[k][i]) + t * (std::fabs(row.diff(i)) +
                                                                          std::fabs(r.mu)));
          ok = std::fabs(static_cast<real>(o[i]) - reference[i]) <=
               troll_test::log_prob_tolerance<T>(double(reference[i]), double(scale));
        }
        if (!ok && r.bad_tokens++ == 0) r.first_bad = i;
      }
      if (r.stats.status == troll::row_status::projected) {
        // A KL error δ at the root moves t by δ / (t σ²): allow twice the guarantee.
        r.t_bound = troll_test::t_tolerance(r.stats.t, double(r.sigma2), 2.0 * guarantee.bound(eps),
                                            1e-12);
        r.t_certified = oracle::brackets_root(row, eps, t - r.t_bound, t + r.t_bound);
        if (bisect) {
          r.expected = oracle::project(row, eps);
          r.bisected = true;
        }
        if (competitors) {
          // Feasible competitors of π*: members π_s of the path with s < t; mixtures with q;
          // random tilts of π* pulled back into the ball by mixing with q (KL is convex).
          r.competitors_checked = true;
          r.objective = oracle::kl(renormalised, row.log_new());
          const real eta = (1 - t) / t;
          const real unit = static_cast<real>(troll_test::unit_roundoff<T>());
          const real tol = (eta + 1) * 2 * static_cast<real>(guarantee.bound(eps)) +
                           16 * unit * (r.objective + 1);
          real worst = oracle::infinity();
          auto consider = [&](const std::vector<real>& log_c) {
            const real kl_c = oracle::kl(log_c, row.log_old());
            if (!(kl_c <= eps)) return;
            worst = std::min(worst, (oracle::kl(log_c, row.log_new()) - r.objective) / tol);
          };
          for (real s : {t / 4, t / 2, 3 * t / 4}) consider(row.log_pi(s));
          std::vector<real> log_c(n);
          for (real lambda : {real(1e-3), real(0.3)}) {
            for (std::size_t i = 0; i < n; ++i) log_c[i] = log_mix(renormalised[i], row.log_old()[i], lambda);
            consider(log_c);
          }
          troll_test::rng g(1234 + k);
          for (int trial = 0; trial < 3; ++trial) {
            std::vector<real> tilt(n);
            for (std::size_t i = 0; i < n; ++i) tilt[i] = renormalised[i] + real(0.1) * g.normal();
            tilt = oracle::log_softmax(tilt.data(), n);
            const real kl_tilt = oracle::kl(tilt, row.log_old());
            const real lambda = kl_tilt <= real(0.99) * eps ? 0 : 1 - real(0.99) * eps / kl_tilt;
            for (std::size_t i = 0; i < n; ++i) log_c[i] = log_mix(tilt[i], row.log_old()[i], lambda);
            consider(log_c);
          }
          r.worst_gap = worst;
        }
      }
      results.push_back(std::move(r));
    }
  }
}

/// The bounds swept at a given V: all of them, but three at the largest V (oracle time).
const std::vector<double>& eps_for(std::size_t cols) {
  static const std::vector<double> few = {1e-8, 0.05, 10.0};
  return cols > 32768 ? few : troll_test::eps_grid();
}

/// The corpus sweep, computed once per type. double: every block, bisection oracle for t and
/// competitor checks up to V = 4096, root certificates above. float: blocks up to V = 4096.
template <class T>
const std::vector<outcome>& sweep(bool two_sided = false) {
  static std::map<bool, std::vector<outcome>> cache;
  auto found = cache.find(two_sided);
  if (found != cache.end()) return found->second;
  std::vector<outcome>& results = cache[two_sided];
  const bool is_double = std::is_same<T, double>::value;
  for (const corpus_block& block : corpus()) {
    if (!is_double && block.cols > 4096) continue;
    const bool small = block.cols <= 4096;
    run_block<T>(block, eps_for(block.cols), is_double && small, is_double && small, two_sided,
                 results);
  }
  return results;
}

bool projected(const outcome& r) { return r.stats.status == troll::row_status::projected; }

// Checks shared by the main sweep tests and the known-bug tests at the end.
template <class T>
void check_bound(const std::vector<outcome>& results) {
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  std::size_t active = 0;
  for (const outcome& r : results) {
    if (r.stats.status == troll::row_status::inactive) continue;
    ++active;
    INFO(r.describe());
    if (projected(r)) {
      CHECK(std::fabs(r.kl_out - r.eps) <= guarantee.bound(r.eps));
      CHECK(r.kl_out <= r.eps + guarantee.bound(r.eps));
      CHECK(guarantee.accepts(r.stats.kl_after, r.eps));
    } else {
      CHECK(r.kl_out <= r.eps + guarantee.bound(r.eps));
    }
    CHECK(std::fabs(r.log_mass) <= 64 * troll_test::unit_roundoff<T>());
  }
  MESSAGE(active << " active (row, eps) pairs checked");
}

template <class T>
void check_status(const std::vector<outcome>& results) {
  for (const outcome& r : results) {
    INFO(r.describe());
    CHECK(r.stats.status == expected_status(r.expected.status));
    CHECK(troll_test::tolerance{r.kl_before_bound, 0}.accepts(r.stats.kl_before, r.expected.kl_before));
    if (r.stats.status != troll::row_status::projected) {
      CHECK(r.stats.t == 1.0);
      CHECK(r.stats.eta == 0.0);
      CHECK(r.stats.iterations == 0);
    }
    if (r.stats.status == troll::row_status::restricted) {
      CHECK(r.stats.kl_before == std::numeric_limits<double>::infinity());
    }
  }
}

template <class T>
void check_output_is_pi_t(const std::vector<outcome>& results) {
  for (const outcome& r : results) {
    INFO(r.describe(), " first bad token ", r.first_bad);
    CHECK(r.bad_tokens == 0);
    if (r.stats.status == troll::row_status::inactive) CHECK(r.bitwise_inactive);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("projected rows meet the bound |KL(pi*||q) - eps| <= atol + rtol eps", T, float,
                   double) {
  check_bound<T>(sweep<T>());
}

TEST_CASE_TEMPLATE("row status and kl_before agree with the oracle", T, float, double) {
  check_status<T>(sweep<T>());
}

TEST_CASE_TEMPLATE("the output is log pi_t at the reported t; inactive rows are log_softmax bit "
                   "for bit",
                   T, float, double) {
  check_output_is_pi_t<T>(sweep<T>());
}

TEST_CASE_TEMPLATE("t* agrees with the bisection oracle within its conditioning", T, float, double) {
  std::size_t bisected = 0, certified = 0;
  for (const outcome& r : sweep<T>()) {
    if (!projected(r)) continue;
    INFO(r.describe());
    CHECK(r.stats.t > 0.0);
    CHECK(r.stats.t < 1.0);
    CHECK(r.stats.eta == doctest::Approx((1.0 - r.stats.t) / r.stats.t).epsilon(1e-12));
    CHECK(r.t_certified);
    ++certified;
    if (r.bisected) {
      ++bisected;
      CHECK(std::fabs(static_cast<real>(r.stats.t) - r.expected.t) <= r.t_bound);
    }
  }
  MESSAGE(bisected << " roots compared with bisection, " << certified << " certified by bracketing");
}

TEST_CASE_TEMPLATE("mu and sigma2 are the moments of d under pi* (oracle)", T, float, double) {
  for (const outcome& r : sweep<T>()) {
    if (!projected(r)) continue;
    INFO(r.describe(), " mu ", r.stats.mu, " oracle ", double(r.mu), " sigma2 ", r.stats.sigma2,
         " oracle ", double(r.sigma2));
    const real spread = std::sqrt(r.sigma2);
    CHECK(std::fabs(r.stats.mu - r.mu) <= 1e-9 * spread + 1e-12 * (1 + std::fabs(r.mu)));
    CHECK(std::fabs(r.stats.sigma2 - r.sigma2) <= 1e-9 * r.sigma2 + 1e-11 * (1 + std::fabs(r.mu)) * spread);
  }
}

TEST_CASE("pi* minimises KL(pi||p~) over feasible competitors and lies between p~ and q") {
  std::size_t checked = 0;
  for (const outcome& r : sweep<double>()) {
    if (!r.competitors_checked) continue;
    ++checked;
    INFO(r.describe(), " objective ", double(r.objective), " worst gap ", double(r.worst_gap),
         " KL(q||p~) ", double(r.kl_old_to_new));
    CHECK(r.worst_gap >= -1);
    CHECK(r.kl_out <= r.expected.kl_before);
    CHECK(r.objective <= r.kl_old_to_new * (1 + 1e-12) + 1e-13);
  }
  CHECK(checked > 100);
}

TEST_CASE_TEMPLATE("t*(eps) and KL(pi*||q) increase with eps", T, float, double) {
  // Group each row's outcomes (swept in increasing ε).
  std::map<std::pair<const row_pair*, bool>, std::vector<const outcome*>> by_row;
  for (const outcome& r : sweep<T>()) by_row[{r.row, r.is_float}].push_back(&r);
  for (const auto& entry : by_row) {
    const std::vector<const outcome*>& list = entry.second;
    for (std::size_t k = 1; k < list.size(); ++k) {
      const outcome& a = *list[k - 1];
      const outcome& b = *list[k];
      INFO(a.describe(), "\n then ", b.describe());
      CHECK(a.eps < b.eps);
      CHECK(a.stats.t <= b.stats.t + a.t_bound + b.t_bound);
      CHECK(a.kl_out <= b.kl_out + 1e-12);
    }
  }
}

TEST_CASE_TEMPLATE("p~ = q rows are inactive for every eps", T, float, double) {
  std::size_t seen = 0;
  for (const outcome& r : sweep<T>()) {
    if (r.row->kind != troll_test::row_kind::equal) continue;
    ++seen;
    INFO(r.describe());
    CHECK(r.stats.status == troll::row_status::inactive);
    // Even variants copy the logits (KL = 0 up to round-off); odd ones add 123.25, which rounds
    // in T, so p̃ and q differ by that rounding (KL ≈ 1e-12 in float).
    CHECK(r.stats.kl_before <= (r.row->variant % 2 == 0 ? 8 * troll_test::unit_roundoff<double>() : 1e-10));
    CHECK(r.bitwise_inactive);
  }
  CHECK(seen > 0);
}


TEST_CASE_TEMPLATE("t* just above the feasibility floor -log q(J) is good to the floor's own rounding", T, float,
                   double) {
  // A token masked in the new row only (old mass q_J^c > 0) puts the floor K(0+) = −log q(J)
  // under every admissible KL. With ε = floor·(1 + f), t* is fixed by K − floor = KL(π‖q_J) =
  // ε − floor, so a tolerance on K itself (rtol·ε) spans ~rtol/f of that distance: t* was off by
  // 4e-7 relative at f = 1e-5 and 5e-5 at f = 1e-7. Solved on the distance from the floor, t* is
  // good to the floor's rounding, a few ulps of the floor against ε − floor, ~ulp/f relative.
  constexpr std::size_t n = 12;
  constexpr troll_test::tolerance guarantee = troll_test::projection_guarantee<T>();
  const T ninf = -std::numeric_limits<T>::infinity();
  std::size_t checked = 0;
  for (int k = 0; k < 6; ++k) {
    std::vector<T> zn(n), zo(n);
    for (std::size_t i = 0; i < n; ++i) {
      zn[i] = T(2.0 * std::sin(1.7 * double(i) + 0.3 * k));
      zo[i] = T(2.0 * std::cos(2.3 * double(i) + 0.7 * k));
    }
    zn[3] = ninf;
    if (k % 2 == 1) zn[7] = ninf;
    if (k % 3 == 0) zo[3] = T(double(zo[3]) + 3.0);  // a floor of ~0.5 rather than ~0.05
    const oracle::tilted_row row(zn.data(), zo.data(), n);
    const real floor = row.min_kl();
    REQUIRE(floor > 0);
    for (double f : {1e-5, 1e-7, 1e-9}) {
      const double eps = static_cast<double>(floor * (1 + static_cast<real>(f)));
      using backend = troll_test::oracle_backend;
      typename backend::template buffer<T> da(zn), db(zo), dout(n);
      typename backend::template buffer<troll::projection_stats> dstats(1);
      troll::project(backend::policy(), troll::make_batch<const T>(da.get(), 1, n),
                     troll::make_batch<const T>(db.get(), 1, n), eps, troll::make_batch(dout.get(), 1, n),
                     dstats.get());
      const troll::projection_stats s = dstats.download()[0];
      const oracle::solution o = oracle::project(row, eps, std::ldexp(real(1), -60));
      const double error = static_cast<double>(std::fabs(static_cast<real>(s.t) - o.t) / o.t);
      const double bound = 16 * troll_test::unit_roundoff<double>() / f + 1e-10;
      INFO("row ", k, " floor ", double(floor), " f ", f, " t ", s.t, " oracle ", double(o.t), " error ", error,
           " bound ", bound);
      REQUIRE(s.status == troll::row_status::projected);
      CHECK(error <= bound);
      CHECK(std::fabs(s.kl_after - eps) <= guarantee.bound(eps));
      ++checked;
    }
  }
  CHECK(checked == 18);
}
