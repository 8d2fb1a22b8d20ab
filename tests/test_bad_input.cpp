// test_bad_input.cpp — every rejected input of the dense API, at every entry point (log_softmax,
// kl, kl_backward, project, project_backward, project_jvp, project_jacobian), in float and
// double: the exact exception type, `.row()`, a message naming the row and the problem, and
// not one byte written to any output (outputs are pre-filled with a sentinel bit pattern and
// compared with memcmp after the call).
#include <doctest/doctest.h>

#include "grad_helpers.hpp"  // first: it silences a GCC false positive in troll's headers
#include "special_values.hpp"

#include <troll/projection.hpp>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <typeinfo>
#include <vector>

namespace {

using troll::batch_view;
using troll::projection_stats;
constexpr std::size_t npos = troll::invalid_input::npos;
constexpr unsigned char sentinel = 0xA7;

enum class entry { log_softmax, kl, kl_backward, project, project_backward, project_jvp, project_jacobian };
const entry all_entries[] = {entry::log_softmax,      entry::kl,          entry::kl_backward,
                             entry::project,          entry::project_backward, entry::project_jvp,
                             entry::project_jacobian};

const char* name_of(entry e) {
  switch (e) {
    case entry::log_softmax: return "log_softmax";
    case entry::kl: return "kl";
    case entry::kl_backward: return "kl_backward";
    case entry::project: return "project";
    case entry::project_backward: return "project_backward";
    case entry::project_jvp: return "project_jvp";
    case entry::project_jacobian: return "project_jacobian";
  }
  return "?";
}
/// The operand names each entry point uses for its two logit inputs.
const char* new_name(entry e) {
  return e == entry::log_softmax ? "logits" : (e == entry::kl || e == entry::kl_backward) ? "p_logits" : "new_logits";
}
const char* old_name(entry e) { return (e == entry::kl || e == entry::kl_backward) ? "q_logits" : "old_logits"; }
bool has_old(entry e) { return e != entry::log_softmax; }
bool takes_stats(entry e) {
  return e == entry::project_backward || e == entry::project_jvp || e == entry::project_jacobian;
}

/// A valid batch (rows × V, every row projected at ε = 0.05), the forward's results, upstream
/// values, and sentinel-filled outputs; `a` holds the views an entry point is called with, which a
/// test corrupts one at a time.
template <class T>
struct fixture {
  struct arguments {
    batch_view<const T> zn, zo, lp, up, tn, to;
    const projection_stats* stats;
    const T* grad_kl;
    double eps, teps;
    batch_view<T> out, grad_a, grad_b;
    T *kl_out, *grad_eps, *jac_new, *jac_old, *jac_eps;
    projection_stats* stats_out;
  };

  std::size_t rows, v;
  std::vector<T> zn, zo, lp, up, tn, to, grad_kl;
  std::vector<projection_stats> stats;
  std::vector<T> out, grad_a, grad_b, kl_out, grad_eps, jac_new, jac_old, jac_eps;
  std::vector<projection_stats> stats_out;
  arguments a;

  explicit fixture(std::size_t rows_ = 4, std::size_t v_ = 6) : rows(rows_), v(v_) {
    grad_helpers::rng g(rows * 131 + v);
    std::vector<double> dn(rows * v), dz(rows * v);
    for (std::size_t k = 0; k < rows * v; ++k) {
      dz[k] = g.normal();
      dn[k] = dz[k] + 1.5 * g.normal();
    }
    zn.assign(dn.begin(), dn.end());
    zo.assign(dz.begin(), dz.end());
    lp.assign(rows * v, T(0));
    stats.assign(rows, projection_stats{});
    troll::project(troll::cpu, troll::make_batch(zn.data(), rows, v), troll::make_batch(zo.data(), rows, v),
                   0.05, troll::make_batch(lp.data(), rows, v), stats.data());
    for (const projection_stats& s : stats) REQUIRE(s.status == troll::row_status::projected);
    for (std::size_t k = 0; k < rows * v; ++k) {
      up.push_back(T(g.normal()));
      tn.push_back(T(g.normal()));
      to.push_back(T(g.normal()));
    }
    for (std::size_t r = 0; r < rows; ++r) grad_kl.push_back(T(g.normal()));
    out.resize(rows * v), grad_a.resize(rows * v), grad_b.resize(rows * v);
    kl_out.resize(rows), grad_eps.resize(rows);
    jac_new.resize(rows * v * v), jac_old.resize(rows * v * v), jac_eps.resize(rows * v);
    stats_out.resize(rows);
    reset_views();
  }

  void reset_views() {
    a.zn = troll::make_batch<const T>(zn.data(), rows, v);
    a.zo = troll::make_batch<const T>(zo.data(), rows, v);
    a.lp = troll::make_batch<const T>(lp.data(), rows, v);
    a.up = troll::make_batch<const T>(up.data(), rows, v);
    a.tn = troll::make_batch<const T>(tn.data(), rows, v);
    a.to = troll::make_batch<const T>(to.data(), rows, v);
    a.stats = stats.data();
    a.grad_kl = grad_kl.data();
    a.eps = 0.05;
    a.teps = 0.5;
    a.out = troll::make_batch(out.data(), rows, v);
    a.grad_a = troll::make_batch(grad_a.data(), rows, v);
    a.grad_b = troll::make_batch(grad_b.data(), rows, v);
    a.kl_out = kl_out.data();
    a.grad_eps = grad_eps.data();
    a.jac_new = jac_new.data();
    a.jac_old = jac_old.data();
    a.jac_eps = jac_eps.data();
    a.stats_out = stats_out.data();
  }

  template <class U>
  static void fill(std::vector<U>& x) {
    std::memset(static_cast<void*>(x.data()), sentinel, x.size() * sizeof(U));
  }
  template <class U>
  static bool intact(const std::vector<U>& x) {
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(x.data());
    std::vector<unsigned char> want(x.size() * sizeof(U), sentinel);
    return std::memcmp(bytes, want.data(), want.size()) == 0;
  }
  void fill_outputs() {
    fill(out), fill(grad_a), fill(grad_b), fill(kl_out), fill(grad_eps);
    fill(jac_new), fill(jac_old), fill(jac_eps), fill(stats_out);
  }
  /// Every output buffer still holds the sentinel, byte for byte.
  bool outputs_intact() const {
    return intact(out) && intact(grad_a) && intact(grad_b) && intact(kl_out) && intact(grad_eps) &&
           intact(jac_new) && intact(jac_old) && intact(jac_eps) && intact(stats_out);
  }

  void call(entry e, troll::cpu_policy policy = troll::cpu) const {
    switch (e) {
      case entry::log_softmax:
        troll::log_softmax(policy, a.zn, a.out);
        return;
      case entry::kl:
        troll::kl(policy, a.zn, a.zo, a.kl_out);
        return;
      case entry::kl_backward:
        troll::kl_backward(policy, a.zn, a.zo, a.grad_kl, a.grad_a, a.grad_b);
        return;
      case entry::project:
        troll::project(policy, a.zn, a.zo, a.eps, a.out, a.stats_out);
        return;
      case entry::project_backward:
        troll::project_backward(policy, a.zn, a.zo, a.lp, a.stats, a.up, a.grad_a, a.grad_b, a.grad_eps);
        return;
      case entry::project_jvp:
        troll::project_jvp(policy, a.zn, a.zo, a.lp, a.stats, a.tn, a.to, a.teps, a.out);
        return;
      case entry::project_jacobian:
        troll::project_jacobian(policy, a.zn, a.zo, a.lp, a.stats, a.jac_new, a.jac_old, a.jac_eps);
        return;
    }
  }
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Calls entry point `e` on `fx` and asserts: it throws exactly E (not a subclass, not a
/// sibling), `.row()` is `row`, the message starts "troll::<name>: ", names "row <row>" when a
/// row is at fault, and contains every one of `words`; and every output still holds the sentinel.
template <class E, class T>
void expect_error(entry e, fixture<T>& fx, std::size_t row, std::initializer_list<std::string> words,
                  troll::cpu_policy policy = troll::cpu) {
  INFO("entry point troll::" << name_of(e));
  fx.fill_outputs();
  CHECK_THROWS_AS(fx.call(e, policy), E);
  CHECK(fx.outputs_intact());
  fx.fill_outputs();
  try {
    fx.call(e, policy);
    FAIL("no exception");
  } catch (const troll::invalid_input& error) {
    const std::string message = error.what();
    INFO("message: " << message);
    CHECK(typeid(error) == typeid(E));
    CHECK(error.row() == row);
    CHECK(message.rfind(std::string("troll::") + name_of(e) + ": ", 0) == 0);
    if (row != npos) CHECK(contains(message, "row " + std::to_string(row) + ":"));
    for (const std::string& w : words) CHECK(contains(message, w));
  }
  CHECK(fx.outputs_intact());
}

template <class T>
void set_value(fixture<T>& fx, bool in_new, std::size_t row, std::size_t token, double value) {
  (in_new ? fx.zn : fx.zo)[row * fx.v + token] = T(value);
}

using troll_test::inf_value;
using troll_test::nan_value;

}  // namespace

TEST_CASE_TEMPLATE("NaN and +inf logits, in the new and the old row, at row 2", T, float, double) {
  for (entry e : all_entries) {
    for (bool in_new : {true, false}) {
      if (!in_new && !has_old(e)) continue;
      const char* operand = in_new ? new_name(e) : old_name(e);
      {
        fixture<T> fx;
        set_value(fx, in_new, 2, 3, nan_value);
        expect_error<troll::domain_error>(e, fx, 2, {operand, "NaN", "token 3"});
      }
      {
        fixture<T> fx;
        set_value(fx, in_new, 2, 4, inf_value);
        expect_error<troll::domain_error>(e, fx, 2, {operand, "+inf", "token 4"});
      }
      {  // a NaN after a legal -inf in the same row
        fixture<T> fx;
        set_value(fx, in_new, 1, 0, -inf_value);
        set_value(fx, in_new, 1, 5, nan_value);
        expect_error<troll::domain_error>(e, fx, 1, {operand, "NaN", "token 5"});
      }
    }
  }
}

TEST_CASE("the message reads as documented") {
  fixture<double> fx(5, 20);
  fx.zn[3 * 20 + 17] = nan_value;
  fx.fill_outputs();
  try {
    fx.call(entry::project);
    FAIL("no exception");
  } catch (const troll::domain_error& error) {
    CHECK(std::string(error.what()) == "troll::project: row 3: new_logits is NaN at token 17");
  }
  CHECK(fx.outputs_intact());
}

TEST_CASE_TEMPLATE("a row with every logit -inf", T, float, double) {
  for (entry e : all_entries) {
    for (bool in_new : {true, false}) {
      if (!in_new && !has_old(e)) continue;
      fixture<T> fx;
      for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, in_new, 2, j, -inf_value);
      expect_error<troll::domain_error>(e, fx, 2, {in_new ? new_name(e) : old_name(e), "-inf"});
    }
  }
}

TEST_CASE("the lowest bad row is reported, whatever the thread count") {
  for (entry e : all_entries) {
    for (unsigned threads : {1u, 4u}) {
      fixture<double> fx(300, 64);
      set_value(fx, true, 211, 5, nan_value);
      set_value(fx, true, 37, 9, inf_value);
      set_value(fx, true, 250, 1, nan_value);
      expect_error<troll::domain_error>(e, fx, 37, {"+inf", "token 9"}, troll::cpu.with_threads(threads));
    }
  }
}

TEST_CASE("eps <= 0, NaN or infinite: project rejects it") {
  for (double eps : {0.0, -0.0, -1e-3, -inf_value, nan_value, inf_value}) {
    INFO("eps = " << eps);
    fixture<double> fx;
    fx.a.eps = eps;
    expect_error<troll::domain_error>(entry::project, fx, npos, {"eps"});
    fixture<float> ff;
    ff.a.eps = eps;
    expect_error<troll::domain_error>(entry::project, ff, npos, {"eps"});
  }
  // A subnormal bound is refused (its KL cannot be resolved: detail::check_eps); the smallest
  // normal double is a legal (if extreme) bound.
  for (double eps : {std::numeric_limits<double>::denorm_min(), 1e-320, 1e-310}) {
    fixture<double> fx;
    fx.a.eps = eps;
    expect_error<troll::domain_error>(entry::project, fx, npos, {"eps", "subnormal"});
  }
  fixture<double> fx;
  fx.a.eps = std::numeric_limits<double>::min();
  CHECK_NOTHROW(fx.call(entry::project));
}

TEST_CASE("bad projection options are rejected before anything is written") {
  fixture<double> fx;
  for (int variant = 0; variant < 4; ++variant) {
    troll::projection_options o;
    if (variant == 0) o.rtol = -1e-3;
    if (variant == 1) o.rtol = 0.0, o.atol = 0.0;
    if (variant == 2) o.max_iterations = 0;
    if (variant == 3) o.atol = nan_value;
    INFO("variant " << variant);
    fx.fill_outputs();
    CHECK_THROWS_AS(troll::project(troll::cpu, fx.a.zn, fx.a.zo, 0.05, fx.a.out, fx.a.stats_out, o),
                    troll::domain_error);
    CHECK(fx.outputs_intact());
  }
}

TEST_CASE("non-finite tangent_eps: project_jvp rejects it") {
  for (double teps : {nan_value, inf_value, -inf_value}) {
    fixture<double> fx;
    fx.a.teps = teps;
    expect_error<troll::domain_error>(entry::project_jvp, fx, npos, {"tangent_eps"});
  }
}

TEST_CASE_TEMPLATE("non-finite upstream gradients and tangents at row 2", T, float, double) {
  // The message names the value as it is (an infinity is not called NaN).
  for (double bad : {nan_value, inf_value, -inf_value}) {
    INFO("value " << bad);
    const std::string word = bad != bad ? "NaN" : bad > 0 ? "+inf" : "-inf";
    {
      fixture<T> fx;
      fx.up[2 * fx.v + 1] = T(bad);
      expect_error<troll::domain_error>(entry::project_backward, fx, 2,
                                        {"grad_log_probs is " + word + " at token 1"});
    }
    {
      fixture<T> fx;
      fx.tn[2 * fx.v + 3] = T(bad);
      expect_error<troll::domain_error>(entry::project_jvp, fx, 2, {"tangent_new is " + word + " at token 3"});
    }
    {
      fixture<T> fx;
      fx.to[2 * fx.v + 0] = T(bad);
      expect_error<troll::domain_error>(entry::project_jvp, fx, 2, {"tangent_old is " + word + " at token 0"});
    }
    {
      fixture<T> fx;
      fx.grad_kl[2] = T(bad);
      fx.fill_outputs();
      try {
        fx.call(entry::kl_backward);
        FAIL("no exception");
      } catch (const troll::domain_error& error) {  // one value per row: no token
        CHECK(std::string(error.what()) == "troll::kl_backward: row 2: grad_kl is " + word);
      }
      CHECK(fx.outputs_intact());
    }
  }
}

TEST_CASE_TEMPLATE("corrupted forward statistics at row 2", T, float, double) {
  struct corruption {
    const char* what;
    const char* word;
    void (*apply)(projection_stats&);
  };
  const corruption corruptions[] = {
      {"t = 0", "t of", [](projection_stats& s) { s.t = 0.0; }},
      {"t < 0", "t of", [](projection_stats& s) { s.t = -0.25; }},
      {"t > 1", "t of", [](projection_stats& s) { s.t = 1.5; }},
      {"t NaN", "t of", [](projection_stats& s) { s.t = nan_value; }},
      {"sigma2 = 0", "sigma2", [](projection_stats& s) { s.sigma2 = 0.0; }},
      {"sigma2 < 0", "sigma2", [](projection_stats& s) { s.sigma2 = -1.0; }},
      {"sigma2 NaN", "sigma2", [](projection_stats& s) { s.sigma2 = nan_value; }},
      {"sigma2 inf", "sigma2", [](projection_stats& s) { s.sigma2 = inf_value; }},
      {"mu NaN", "mu", [](projection_stats& s) { s.mu = nan_value; }},
      {"mu inf", "mu", [](projection_stats& s) { s.mu = -inf_value; }},
      {"status 7", "status", [](projection_stats& s) { s.status = static_cast<troll::row_status>(7); }},
      {"status -1", "status", [](projection_stats& s) { s.status = static_cast<troll::row_status>(-1); }},
      {"status infeasible", "status", [](projection_stats& s) { s.status = troll::row_status::infeasible; }},
  };
  for (const corruption& c : corruptions) {
    for (entry e : {entry::project_backward, entry::project_jvp, entry::project_jacobian}) {
      INFO(c.what);
      fixture<T> fx;
      c.apply(fx.stats[2]);
      expect_error<troll::domain_error>(e, fx, 2, {"statistics", c.word});
    }
  }
}

TEST_CASE("mismatched shapes, V = 0, null pointers, strides below V") {
  for (entry e : all_entries) {
    INFO(name_of(e));
    // the second logit input (or log_softmax's output) has the wrong number of columns or rows
    for (int which : {0, 1}) {
      fixture<double> fx;
      if (has_old(e)) {
        (which == 0 ? fx.a.zo.cols : fx.a.zo.rows) -= 1;
        expect_error<troll::shape_error>(e, fx, npos, {old_name(e)});
      } else {
        (which == 0 ? fx.a.out.cols : fx.a.out.rows) -= 1;
        expect_error<troll::shape_error>(e, fx, npos, {"out"});
      }
    }
    {  // V = 0 everywhere
      fixture<double> fx;
      for (auto* view : {&fx.a.zn, &fx.a.zo, &fx.a.lp, &fx.a.up, &fx.a.tn, &fx.a.to}) view->cols = 0;
      for (auto* view : {&fx.a.out, &fx.a.grad_a, &fx.a.grad_b}) view->cols = 0;
      expect_error<troll::shape_error>(e, fx, npos, {"V = 0"});
    }
    {  // null logits
      fixture<double> fx;
      fx.a.zn.data = nullptr;
      expect_error<troll::shape_error>(e, fx, npos, {new_name(e), "null"});
    }
    if (has_old(e)) {
      fixture<double> fx;
      fx.a.zo.data = nullptr;
      expect_error<troll::shape_error>(e, fx, npos, {old_name(e), "null"});
    }
    {  // row stride below V
      fixture<double> fx;
      fx.a.zn.stride = fx.v - 1;
      expect_error<troll::shape_error>(e, fx, npos, {new_name(e), "stride"});
    }
    if (takes_stats(e)) {
      fixture<double> fx;
      fx.a.stats = nullptr;
      expect_error<troll::shape_error>(e, fx, npos, {"stats", "null"});
      fixture<double> fl;
      fl.a.lp.data = nullptr;
      expect_error<troll::shape_error>(e, fl, npos, {"log_probs", "null"});
      fixture<double> fs;
      fs.a.lp.cols -= 1;
      expect_error<troll::shape_error>(e, fs, npos, {"log_probs"});
    }
  }
  // outputs and per-entry pointers
  {
    fixture<double> fx;
    fx.a.out.data = nullptr;
    expect_error<troll::shape_error>(entry::log_softmax, fx, npos, {"out", "null"});
  }
  {
    fixture<double> fx;
    fx.a.out.stride = 2;
    expect_error<troll::shape_error>(entry::project, fx, npos, {"out_log_probs", "stride"});
  }
  {
    fixture<double> fx;
    fx.a.out.cols += 1;
    expect_error<troll::shape_error>(entry::project, fx, npos, {"out_log_probs"});
  }
  {
    fixture<double> fx;
    fx.a.stats_out = nullptr;
    expect_error<troll::shape_error>(entry::project, fx, npos, {"stats", "null"});
  }
  {
    fixture<double> fx;
    fx.a.kl_out = nullptr;
    expect_error<troll::shape_error>(entry::kl, fx, npos, {"kl_out", "null"});
  }
  {
    fixture<double> fx;
    fx.a.grad_kl = nullptr;
    expect_error<troll::shape_error>(entry::kl_backward, fx, npos, {"grad_kl", "null"});
  }
  {
    fixture<double> fx;
    fx.a.grad_a.rows -= 1;
    expect_error<troll::shape_error>(entry::kl_backward, fx, npos, {"grad_p"});
  }
  {
    fixture<double> fx;
    fx.a.grad_b.cols += 2;
    expect_error<troll::shape_error>(entry::kl_backward, fx, npos, {"grad_q"});
  }
  {
    fixture<double> fx;
    fx.a.up.data = nullptr;
    expect_error<troll::shape_error>(entry::project_backward, fx, npos, {"grad_log_probs", "null"});
  }
  {
    fixture<double> fx;
    fx.a.up.cols -= 1;
    expect_error<troll::shape_error>(entry::project_backward, fx, npos, {"grad_log_probs"});
  }
  {
    fixture<double> fx;
    fx.a.grad_a.data = nullptr;
    expect_error<troll::shape_error>(entry::project_backward, fx, npos, {"grad_new", "null"});
  }
  {
    fixture<double> fx;
    fx.a.grad_b.stride = 1;
    expect_error<troll::shape_error>(entry::project_backward, fx, npos, {"grad_old", "stride"});
  }
  {
    fixture<double> fx;
    fx.a.tn.data = nullptr;
    expect_error<troll::shape_error>(entry::project_jvp, fx, npos, {"tangent_new", "null"});
  }
  {
    fixture<double> fx;
    fx.a.to.rows -= 1;
    expect_error<troll::shape_error>(entry::project_jvp, fx, npos, {"tangent_old"});
  }
  {
    fixture<double> fx;
    fx.a.out.cols -= 1;
    expect_error<troll::shape_error>(entry::project_jvp, fx, npos, {"tangent_out"});
  }
  {
    fixture<double> fx;
    fx.a.jac_new = nullptr;
    expect_error<troll::shape_error>(entry::project_jacobian, fx, npos, {"jac_new", "null"});
  }
}

TEST_CASE("project_jacobian: rows * V^2 entries past the address space are a shape_error, nothing read") {
  // Views that claim 2^20 rows of 2^22 tokens over a single element: only the sizes are looked at.
  double one = 0.0;
  const std::size_t rows = std::size_t(1) << 20, vocab = std::size_t(1) << 22;
  const troll::batch_view<const double> huge{&one, rows, vocab, vocab};
  troll::projection_stats stats;
  CHECK_THROWS_WITH_AS(troll::project_jacobian(troll::cpu, huge, huge, huge, &stats, &one),
                       doctest::Contains("overflow"), troll::shape_error);
  // 2^21 rows of V = 2^21: 2^63 entries fit a size_t, their 2^66 bytes do not.
  const std::size_t wide = std::size_t(1) << 21;
  const troll::batch_view<const double> bytes_only{&one, wide, wide, wide};
  CHECK_THROWS_WITH_AS(troll::project_jacobian(troll::cpu, bytes_only, bytes_only, bytes_only, &stats, &one),
                       doctest::Contains("overflow"), troll::shape_error);
}

TEST_CASE("project_jacobian: an entry whose true value overflows float is a domain_error, not inf") {
  // A finite −3e38 mask in the old row only: ∂log π*/∂ε of that token is ~6.7e39 (the audit's
  // row). Before, jac_eps held +inf with no error, while project_backward and project_jvp threw.
  // Row 0 is ordinary; row 1 carries the mask, and is named.
  const std::size_t rows = 2, v = 3;
  const std::vector<float> zn = {0.5f, 1.0f, -0.25f, 0.0f, 2.0f, 0.0f}, zo = {0.0f, 0.2f, 0.1f, 0.0f, 0.0f, -3e38f};
  std::vector<float> out(rows * v);
  std::vector<troll::projection_stats> st(rows);
  const auto n = troll::make_batch(zn.data(), rows, v), o = troll::make_batch(zo.data(), rows, v);
  troll::project(troll::cpu, n, o, 1e-3, troll::make_batch(out.data(), rows, v), st.data());
  REQUIRE(st[1].status == troll::row_status::projected);
  std::vector<float> jn(rows * v * v), jo(rows * v * v), je(rows * v);
  const auto lp = troll::make_batch<const float>(out.data(), rows, v);
  std::string what = "no error";
  std::size_t row = 99;
  try {
    troll::project_jacobian(troll::cpu, n, o, lp, st.data(), jn.data(), jo.data(), je.data());
  } catch (const troll::domain_error& e) {
    what = e.what();
    row = e.row();
  }
  CHECK(row == 1);
  CHECK_MESSAGE(what.find("does not fit float") != std::string::npos, what);
  // The same call without jac_eps fits (jac_old's entries are ~7e36), and in double everything fits.
  CHECK_NOTHROW(troll::project_jacobian(troll::cpu, n, o, lp, st.data(), jn.data(), jo.data()));
  const std::vector<double> zn2(zn.begin(), zn.end()), zo2(zo.begin(), zo.end());
  std::vector<double> out2(rows * v), jn2(rows * v * v), je2(rows * v);
  std::vector<troll::projection_stats> st2(rows);
  const auto n2 = troll::make_batch(zn2.data(), rows, v), o2 = troll::make_batch(zo2.data(), rows, v);
  troll::project(troll::cpu, n2, o2, 1e-3, troll::make_batch(out2.data(), rows, v), st2.data());
  troll::project_jacobian(troll::cpu, n2, o2, troll::make_batch<const double>(out2.data(), rows, v), st2.data(),
                          jn2.data(), static_cast<double*>(nullptr), je2.data());
  CHECK(std::fabs(je2[v + 2]) > 1e39);
  CHECK(std::isfinite(je2[v + 2]));
}

TEST_CASE_TEMPLATE("kl_backward: the lowest bad row, whatever its problem", T, float, double) {
  // Row by row (logits, then grad_kl, then the KL): a NaN grad_kl in row 1 is reported before a NaN
  // logit in row 2 (the checks ran in two stages before and named row 2), and an infinite KL in
  // row 0 before both.
  for (unsigned threads : {1u, 3u}) {
    fixture<T> fx;
    fx.grad_kl[1] = T(nan_value);
    set_value(fx, true, 2, 3, nan_value);
    expect_error<troll::domain_error>(entry::kl_backward, fx, 1, {"grad_kl is NaN"}, troll::cpu.with_threads(threads));
    set_value(fx, false, 0, 1, -inf_value);  // p has mass where q is -inf
    expect_error<troll::domain_error>(entry::kl_backward, fx, 0, {"+inf"}, troll::cpu.with_threads(threads));
  }
}

TEST_CASE_TEMPLATE("kl_backward of an infinite KL (p has mass where q is -inf)", T, float, double) {
  fixture<T> fx;
  set_value(fx, false, 2, 1, -inf_value);
  expect_error<troll::domain_error>(entry::kl_backward, fx, 2, {"+inf"});
  // kl itself returns +inf there (no error), and writes nothing else odd
  CHECK_NOTHROW(fx.call(entry::kl));
  CHECK(std::isinf(fx.kl_out[2]));
  CHECK(std::isfinite(fx.kl_out[0]));
}

TEST_CASE_TEMPLATE("disjoint supports: infeasible_error from project and the backward passes", T, float,
                   double) {
  for (entry e : {entry::project, entry::project_backward, entry::project_jvp, entry::project_jacobian}) {
    fixture<T> fx;
    for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, j % 2 == 0, 2, j, -inf_value);
    expect_error<troll::infeasible_error>(e, fx, 2, {"disjoint"});
  }
}

TEST_CASE_TEMPLATE("new-side masks: infeasible iff -log q(J) >= eps", T, float, double) {
  // Row 2: old logits 0 everywhere (q uniform over V = 6); the new row masks k tokens, leaving
  // q(J) = (6 - k)/6 on the joint support. With eps = 0.05: k = 1 gives -log(5/6) = 0.18 ≥ eps.
  {
    fixture<T> fx;
    for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, false, 2, j, 0.0);
    set_value(fx, true, 2, 4, -inf_value);
    expect_error<troll::infeasible_error>(entry::project, fx, 2, {"KL(pi||q) >="});
  }
  {  // the same mask with eps = 0.2 > 0.182: feasible, projected onto the boundary
    fixture<T> fx;
    for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, false, 2, j, 0.0);
    for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, true, 2, j, double(j));
    set_value(fx, true, 2, 4, -inf_value);
    fx.a.eps = 0.2;
    REQUIRE_NOTHROW(fx.call(entry::project));
    CHECK(fx.stats_out[2].status == troll::row_status::projected);
    CHECK(fx.stats_out[2].kl_after == doctest::Approx(0.2).epsilon(1e-6));
    CHECK(fx.out[2 * fx.v + 4] == -std::numeric_limits<T>::infinity());
  }
  {  // exactly at the threshold: -log q(J) = eps is infeasible (KL(pi||q) >= eps for all pi)
    fixture<double> fx;
    for (std::size_t j = 0; j < fx.v; ++j) set_value(fx, false, 2, j, 0.0);
    set_value(fx, true, 2, 4, -inf_value);
    fx.a.eps = -std::log(5.0 / 6.0) * (1 - 1e-12);
    expect_error<troll::infeasible_error>(entry::project, fx, 2, {"eps"});
  }
}

TEST_CASE_TEMPLATE("an empty batch (rows = 0) is a no-op at every entry point", T, float, double) {
  for (entry e : all_entries) {
    INFO(name_of(e));
    fixture<T> fx;
    for (auto* view : {&fx.a.zn, &fx.a.zo, &fx.a.lp, &fx.a.up, &fx.a.tn, &fx.a.to}) *view = {nullptr, 0, 0, 0};
    for (auto* view : {&fx.a.out, &fx.a.grad_a, &fx.a.grad_b}) *view = {nullptr, 0, 0, 0};
    fx.a.stats = nullptr, fx.a.grad_kl = nullptr, fx.a.kl_out = nullptr, fx.a.grad_eps = nullptr;
    fx.a.jac_new = fx.a.jac_old = fx.a.jac_eps = nullptr, fx.a.stats_out = nullptr;
    fx.fill_outputs();
    CHECK_NOTHROW(fx.call(e));
    CHECK(fx.outputs_intact());
    // rows = 0 with V > 0 and real pointers: still nothing to do
    fixture<T> fy;
    for (auto* view : {&fy.a.zn, &fy.a.zo, &fy.a.lp, &fy.a.up, &fy.a.tn, &fy.a.to}) view->rows = 0;
    for (auto* view : {&fy.a.out, &fy.a.grad_a, &fy.a.grad_b}) view->rows = 0;
    fy.fill_outputs();
    CHECK_NOTHROW(fy.call(e));
    CHECK(fy.outputs_intact());
  }
}

TEST_CASE("every troll error is a std::invalid_argument and an invalid_input") {
  fixture<double> fx;
  fx.zn[0] = nan_value;
  CHECK_THROWS_AS(fx.call(entry::project), std::invalid_argument);
  CHECK_THROWS_AS(fx.call(entry::project), troll::invalid_input);
  fixture<double> fy;
  fy.a.zo.cols = 3;
  CHECK_THROWS_AS(fy.call(entry::kl), std::invalid_argument);
}

TEST_CASE("the sentinel check itself: a valid call does write its outputs") {
  for (entry e : all_entries) {
    INFO(name_of(e));
    fixture<double> fx;
    fx.fill_outputs();
    CHECK_NOTHROW(fx.call(e));
    CHECK_FALSE(fx.outputs_intact());
  }
}
