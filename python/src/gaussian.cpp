// python/src/gaussian.cpp — troll's Gaussian trust regions (troll/gaussian.hpp, docs/gaussian.md)
// for Python: the four projections (joint / split bound, Cholesky factors / standard deviations),
// their backward passes (VJP) and JVPs, and the Gaussian KL. Means are (..., d) arrays, Cholesky factors
// (..., d, d) (each d × d matrix row-major and contiguous), standard deviations (..., d). The
// statistics travel packed, as for the categorical projection: values (..., 8) float64 and
// counters (..., 2) int32 (troll/gaussian.py names the columns). No maths here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <troll/gaussian.hpp>

#include "views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

/// The columns of the packed Gaussian statistics.
enum gaussian_column { gs_t, gs_eta, gs_omega, gs_kl_before, gs_kl_after, gs_mean_kl_before,
                       gs_mean_kl_after, gs_fisher, gs_values };
enum gaussian_counter { gs_iterations, gs_status, gs_counters };

/// The covariance operand as a rows × (d·d) view (full: a (..., d, d) array whose matrices are
/// row-major and contiguous) or a rows × d view (standard deviations, (..., d)). The leading
/// shape must be the mean's.
template <class T, class A, class M>
troll::batch_view<T> as_cov(const char* fn, const char* name, const A& a, const M& mean, bool full) {
  const std::size_t lead = mean.ndim() == 0 ? 0 : mean.ndim() - 1;
  const std::size_t d = mean.ndim() == 0 ? 0 : mean.shape(lead);
  const std::size_t want_ndim = full ? lead + 2 : lead + 1;
  bool ok = a.ndim() == want_ndim;
  for (std::size_t i = 0; ok && i < lead; ++i) ok = a.shape(i) == mean.shape(i);
  for (std::size_t i = lead; ok && i < a.ndim(); ++i) ok = a.shape(i) == d;
  if (!ok) {
    std::string want = "(";
    for (std::size_t i = 0; i < lead; ++i) want += std::to_string(mean.shape(i)) + ", ";
    want += std::to_string(d) + (full ? ", " + std::to_string(d) + ")" : std::string(")"));
    fail(fn, std::string(name) + " has shape " + shape_text(a) + " but the mean " + shape_text(mean) +
                 " needs " + want + (full ? " (one d x d lower Cholesky factor a row)" : ""));
  }
  if (!full) return as_batch<T>(fn, name, a);
  require_host_dtype<std::remove_const_t<T>>(fn, name, a);
  std::size_t rows = 1;
  for (std::size_t i = 0; i < lead; ++i) rows *= a.shape(i);
  if (rows > 0 && d > 1 && (element_stride(a, lead + 1) != 1 || element_stride(a, lead) != std::int64_t(d)))
    fail(fn, std::string(name) + " of shape " + shape_text(a) +
                 ": each d x d factor must be row-major and contiguous (make it .contiguous())");
  const std::size_t stride = rows == 0 ? d * d : flat_stride(fn, name, a, lead, d * d);
  return troll::batch_view<T>{static_cast<T*>(a.data()), rows, d * d, stride};
}

std::vector<troll::gaussian::gaussian_stats> read_gaussian_stats(const char* fn, const in_array& values,
                                                                 const in_array& counters, std::size_t rows) {
  const auto v = as_batch<const double>(fn, "stats.values", values);
  const auto c = as_batch<const std::int32_t>(fn, "stats.counters", counters);
  if (v.rows != rows || v.cols != gs_values || c.rows != rows || c.cols != gs_counters)
    fail(fn, "stats do not match the batch (" + std::to_string(rows) +
                 " rows): pass the stats the forward projection returned for these inputs");
  std::vector<troll::gaussian::gaussian_stats> s(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const double* x = v.row(r);
    s[r].t = x[gs_t];
    s[r].eta = x[gs_eta];
    s[r].omega = x[gs_omega];
    s[r].kl_before = x[gs_kl_before];
    s[r].kl_after = x[gs_kl_after];
    s[r].mean_kl_before = x[gs_mean_kl_before];
    s[r].mean_kl_after = x[gs_mean_kl_after];
    s[r].fisher = x[gs_fisher];
    s[r].iterations = c.row(r)[gs_iterations];
    s[r].status = static_cast<troll::row_status>(c.row(r)[gs_status]);
  }
  return s;
}

/// The four operands of a Gaussian call as views, with their shapes checked against the mean.
template <class T>
struct gaussian_operands {
  troll::batch_view<const T> mean, cov, old_mean, old_cov;

  gaussian_operands(const char* fn, bool full, const in_array& m, const in_array& c, const in_array& om,
                    const in_array& oc)
      : mean(as_batch<const T>(fn, "mean", m)),
        cov(as_cov<const T>(fn, full ? "cov_chol" : "std_dev", c, m, full)),
        old_mean(as_batch<const T>(fn, "old_mean", om)),
        old_cov(as_cov<const T>(fn, full ? "old_cov_chol" : "old_std_dev", oc, m, full)) {
    require_same_shape(fn, "old_mean", om, "mean", m);
  }

  template <class U>
  void require_disjoint_from(const char* fn, const char* name, const troll::batch_view<U>& out) const {
    require_disjoint(fn, name, out, "mean", mean);
    require_disjoint(fn, name, out, "cov", cov);
    require_disjoint(fn, name, out, "old_mean", old_mean);
    require_disjoint(fn, name, out, "old_cov", old_cov);
  }
};

/// The optional saved factorisation of full rows (troll::gaussian::saved_factorisation): a
/// contiguous (rows, d*d + 2*d) float64 array, filled by the forward and read by its derivatives.
template <class D, class A>
troll::gaussian::saved_factorisation<D> as_saved(const char* fn, const std::optional<A>& a, std::size_t rows,
                                                 std::size_t d, bool full) {
  if (!a) return {};
  if (!full) fail(fn, "saved is for full covariances (Cholesky factors) only");
  const auto v = as_batch<D>(fn, "saved", *a);
  const std::size_t k = troll::gaussian::saved_factorisation<D>::saved_doubles(d);
  if (v.rows != rows || v.cols != k || (rows > 1 && v.stride != k))
    fail(fn, "saved must be a contiguous (" + std::to_string(rows) + ", " + std::to_string(k) +
                 ") float64 array (rows, d*d + 2*d)");
  return troll::gaussian::saved_factorisation<D>{v.data, rows, d};
}

const char* project_name(bool full, bool split) {
  if (full) return split ? "gaussian.project_split" : "gaussian.project_joint";
  return split ? "gaussian.project_split_diag" : "gaussian.project_joint_diag";
}

void project(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
             double eps_mean, double eps_cov, bool full, bool split, const out_array& out_mean,
             const out_array& out_cov, const out_array& stats_values, const out_array& stats_counters,
             double rtol, double atol, int max_iterations, unsigned threads, const std::optional<out_array>& saved) {
  const char* fn = project_name(full, split);
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_operands<T> in(fn, full, mean, cov, old_mean, old_cov);
    require_same_shape(fn, "out_mean", out_mean, "mean", mean);
    require_same_shape(fn, "out_cov", out_cov, "cov", cov);
    const auto ym = as_batch<T>(fn, "out_mean", out_mean);
    const auto yc = as_cov<T>(fn, "out_cov", out_cov, mean, full);
    in.require_disjoint_from(fn, "out_mean", ym);
    in.require_disjoint_from(fn, "out_cov", yc);
    require_disjoint(fn, "out_mean", ym, "out_cov", yc);
    const auto sv = as_batch<double>(fn, "stats.values", stats_values);
    const auto sc = as_batch<std::int32_t>(fn, "stats.counters", stats_counters);
    if (sv.rows != in.mean.rows || sv.cols != gs_values || sc.rows != in.mean.rows || sc.cols != gs_counters)
      fail(fn, "the stats buffers must be (rows, 8) float64 and (rows, 2) int32 for " +
                   std::to_string(in.mean.rows) + " rows");
    troll::projection_options options;
    options.rtol = rtol;
    options.atol = atol;
    options.max_iterations = max_iterations;
    const auto sf = as_saved<double>(fn, saved, in.mean.rows, in.mean.cols, full);
    std::vector<troll::gaussian::gaussian_stats> stats(in.mean.rows);
    {
      nb::gil_scoped_release release;
      namespace g = troll::gaussian;
      const auto p = policy(threads);
      if (full && split) {
        g::project_split(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc, stats.data(),
                         options, sf);
      } else if (full) {
        g::project_joint(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc, stats.data(), options, sf);
      } else if (split) {
        g::project_split_diag(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc,
                              stats.data(), options);
      } else {
        g::project_joint_diag(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc, stats.data(),
                              options);
      }
    }
    for (std::size_t r = 0; r < stats.size(); ++r) {
      double* x = sv.row(r);
      x[gs_t] = stats[r].t;
      x[gs_eta] = stats[r].eta;
      x[gs_omega] = stats[r].omega;
      x[gs_kl_before] = stats[r].kl_before;
      x[gs_kl_after] = stats[r].kl_after;
      x[gs_mean_kl_before] = stats[r].mean_kl_before;
      x[gs_mean_kl_after] = stats[r].mean_kl_after;
      x[gs_fisher] = stats[r].fisher;
      sc.row(r)[gs_iterations] = stats[r].iterations;
      sc.row(r)[gs_status] = static_cast<std::int32_t>(stats[r].status);
    }
  });
}

void project_backward(const in_array& mean, const in_array& cov, const in_array& old_mean,
                      const in_array& old_cov, double eps_mean, double eps_cov, bool full, bool split,
                      const in_array& out_mean, const in_array& out_cov, const in_array& stats_values,
                      const in_array& stats_counters, const in_array& grad_out_mean, const in_array& grad_out_cov,
                      const std::optional<out_array>& grad_mean, const std::optional<out_array>& grad_cov,
                      const std::optional<out_array>& grad_old_mean, const std::optional<out_array>& grad_old_cov,
                      const std::optional<out_array>& grad_eps, const std::optional<out_array>& grad_eps_mean,
                      unsigned threads, const std::optional<in_array>& saved) {
  const char* fn = project_name(full, split);
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_operands<T> in(fn, full, mean, cov, old_mean, old_cov);
    for (const in_array* a : {&out_mean, &grad_out_mean}) require_same_shape(fn, "an output", *a, "mean", mean);
    for (const in_array* a : {&out_cov, &grad_out_cov}) require_same_shape(fn, "an output", *a, "cov", cov);
    const auto ym = as_batch<const T>(fn, "out_mean", out_mean);
    const auto yc = as_cov<const T>(fn, "out_cov", out_cov, mean, full);
    const auto gym = as_batch<const T>(fn, "grad_out_mean", grad_out_mean);
    const auto gyc = as_cov<const T>(fn, "grad_out_cov", grad_out_cov, mean, full);
    troll::gaussian::gaussian_grads<T> grads;
    std::vector<troll::batch_view<T>*> written;
    if (grad_mean) {
      require_same_shape(fn, "grad_mean", *grad_mean, "mean", mean);
      grads.mean = as_batch<T>(fn, "grad_mean", *grad_mean);
      written.push_back(&grads.mean);
    }
    if (grad_old_mean) {
      require_same_shape(fn, "grad_old_mean", *grad_old_mean, "mean", mean);
      grads.old_mean = as_batch<T>(fn, "grad_old_mean", *grad_old_mean);
      written.push_back(&grads.old_mean);
    }
    if (grad_cov) {
      require_same_shape(fn, "grad_cov", *grad_cov, "cov", cov);
      grads.cov = as_cov<T>(fn, "grad_cov", *grad_cov, mean, full);
      written.push_back(&grads.cov);
    }
    if (grad_old_cov) {
      require_same_shape(fn, "grad_old_cov", *grad_old_cov, "cov", cov);
      grads.old_cov = as_cov<T>(fn, "grad_old_cov", *grad_old_cov, mean, full);
      written.push_back(&grads.old_cov);
    }
    if (grad_eps) grads.eps = as_rows<double>(fn, "grad_eps", *grad_eps, in.mean.rows);
    if (grad_eps_mean) {
      if (!split) fail(fn, "grad_eps_mean is for the split projections only");
      grads.eps_mean = as_rows<double>(fn, "grad_eps_mean", *grad_eps_mean, in.mean.rows);
    }
    for (std::size_t i = 0; i < written.size(); ++i) {
      const troll::batch_view<T>& w = *written[i];
      in.require_disjoint_from(fn, "a gradient", w);
      require_disjoint(fn, "a gradient", w, "out_mean", ym);
      require_disjoint(fn, "a gradient", w, "out_cov", yc);
      require_disjoint(fn, "a gradient", w, "grad_out_mean", gym);
      require_disjoint(fn, "a gradient", w, "grad_out_cov", gyc);
      for (std::size_t j = 0; j < i; ++j) require_disjoint(fn, "a gradient", w, "another gradient", *written[j]);
    }
    const auto stats = read_gaussian_stats(fn, stats_values, stats_counters, in.mean.rows);
    const auto sf = as_saved<const double>(fn, saved, in.mean.rows, in.mean.cols, full);
    nb::gil_scoped_release release;
    namespace g = troll::gaussian;
    const auto p = policy(threads);
    if (full && split) {
      g::project_split_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc,
                                stats.data(), gym, gyc, grads, sf);
    } else if (full) {
      g::project_joint_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc, stats.data(), gym,
                                gyc, grads, sf);
    } else if (split) {
      g::project_split_diag_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc,
                                     stats.data(), gym, gyc, grads);
    } else {
      g::project_joint_diag_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc,
                                     stats.data(), gym, gyc, grads);
    }
  });
}

void project_jvp(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
                 double eps_mean, double eps_cov, bool full, bool split, const in_array& out_mean,
                 const in_array& out_cov, const in_array& stats_values, const in_array& stats_counters,
                 const std::optional<in_array>& tangent_mean, const std::optional<in_array>& tangent_cov,
                 const std::optional<in_array>& tangent_old_mean, const std::optional<in_array>& tangent_old_cov,
                 double tangent_eps, double tangent_eps_mean, const out_array& tangent_out_mean,
                 const out_array& tangent_out_cov, unsigned threads, const std::optional<in_array>& saved) {
  const char* fn = project_name(full, split);
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_operands<T> in(fn, full, mean, cov, old_mean, old_cov);
    require_same_shape(fn, "out_mean", out_mean, "mean", mean);
    require_same_shape(fn, "out_cov", out_cov, "cov", cov);
    const auto ym = as_batch<const T>(fn, "out_mean", out_mean);
    const auto yc = as_cov<const T>(fn, "out_cov", out_cov, mean, full);
    troll::gaussian::gaussian_tangents<T> tangents;
    tangents.eps = tangent_eps;
    tangents.eps_mean = tangent_eps_mean;
    if (tangent_mean) {
      require_same_shape(fn, "tangent_mean", *tangent_mean, "mean", mean);
      tangents.mean = as_batch<const T>(fn, "tangent_mean", *tangent_mean);
    }
    if (tangent_old_mean) {
      require_same_shape(fn, "tangent_old_mean", *tangent_old_mean, "mean", mean);
      tangents.old_mean = as_batch<const T>(fn, "tangent_old_mean", *tangent_old_mean);
    }
    if (tangent_cov) {
      require_same_shape(fn, "tangent_cov", *tangent_cov, "cov", cov);
      tangents.cov = as_cov<const T>(fn, "tangent_cov", *tangent_cov, mean, full);
    }
    if (tangent_old_cov) {
      require_same_shape(fn, "tangent_old_cov", *tangent_old_cov, "cov", cov);
      tangents.old_cov = as_cov<const T>(fn, "tangent_old_cov", *tangent_old_cov, mean, full);
    }
    require_same_shape(fn, "tangent_out_mean", tangent_out_mean, "mean", mean);
    require_same_shape(fn, "tangent_out_cov", tangent_out_cov, "cov", cov);
    const auto tm = as_batch<T>(fn, "tangent_out_mean", tangent_out_mean);
    const auto tc = as_cov<T>(fn, "tangent_out_cov", tangent_out_cov, mean, full);
    for (const troll::batch_view<T>* w : {&tm, &tc}) {
      in.require_disjoint_from(fn, "a tangent output", *w);
      require_disjoint(fn, "a tangent output", *w, "out_mean", ym);
      require_disjoint(fn, "a tangent output", *w, "out_cov", yc);
      for (const troll::batch_view<const T>* t : {&tangents.mean, &tangents.cov, &tangents.old_mean, &tangents.old_cov})
        require_disjoint(fn, "a tangent output", *w, "a tangent", *t);
    }
    require_disjoint(fn, "tangent_out_mean", tm, "tangent_out_cov", tc);
    const auto stats = read_gaussian_stats(fn, stats_values, stats_counters, in.mean.rows);
    const auto sf = as_saved<const double>(fn, saved, in.mean.rows, in.mean.cols, full);
    nb::gil_scoped_release release;
    namespace g = troll::gaussian;
    const auto p = policy(threads);
    if (full && split) {
      g::project_split_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc, stats.data(),
                           tangents, tm, tc, sf);
    } else if (full) {
      g::project_joint_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc, stats.data(), tangents,
                           tm, tc, sf);
    } else if (split) {
      g::project_split_diag_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, ym, yc,
                                stats.data(), tangents, tm, tc);
    } else {
      g::project_joint_diag_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, ym, yc, stats.data(),
                                tangents, tm, tc);
    }
  });
}

void kl(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov, bool full,
        const out_array& out, unsigned threads) {
  const char* fn = full ? "gaussian.kl" : "gaussian.kl_diag";
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_operands<T> in(fn, full, mean, cov, old_mean, old_cov);
    double* y = as_rows<double>(fn, "out", out, in.mean.rows);
    nb::gil_scoped_release release;
    if (full) {
      troll::gaussian::kl(policy(threads), in.mean, in.cov, in.old_mean, in.old_cov, y);
    } else {
      troll::gaussian::kl_diag(policy(threads), in.mean, in.cov, in.old_mean, in.old_cov, y);
    }
  });
}

}  // namespace

void bind_gaussian(nb::module_& m) {
  using namespace nb::literals;
  m.def("gaussian_project", &project, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "eps_mean"_a, "eps_cov"_a,
        "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a, "stats_counters"_a, "rtol"_a = 1e-11,
        "atol"_a = 0.0, "max_iterations"_a = 100, "threads"_a = 0, "saved"_a.none() = nb::none(),
        "The Gaussian trust-region projection (joint: eps_mean is the bound; full: Cholesky factors, "
        "else standard deviations) into caller-allocated outputs and packed statistics; saved (full only): "
        "a (rows, d*d + 2*d) float64 array receiving the factorisation for the derivatives.");
  m.def("gaussian_project_backward", &project_backward, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a,
        "eps_mean"_a, "eps_cov"_a, "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a,
        "stats_counters"_a, "grad_out_mean"_a, "grad_out_cov"_a, "grad_mean"_a.none(), "grad_cov"_a.none(),
        "grad_old_mean"_a.none(), "grad_old_cov"_a.none(), "grad_eps"_a.none(), "grad_eps_mean"_a.none(),
        "threads"_a = 0, "saved"_a.none() = nb::none(),
        "The vector-Jacobian product of gaussian_project w.r.t. the inputs named by non-None outputs "
        "(grad_eps: the joint bound or eps_cov; per-row float64).");
  m.def("gaussian_project_jvp", &project_jvp, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "eps_mean"_a,
        "eps_cov"_a, "full"_a, "split"_a, "out_mean"_a, "out_cov"_a, "stats_values"_a, "stats_counters"_a,
        "tangent_mean"_a.none(), "tangent_cov"_a.none(), "tangent_old_mean"_a.none(), "tangent_old_cov"_a.none(),
        "tangent_eps"_a, "tangent_eps_mean"_a, "tangent_out_mean"_a, "tangent_out_cov"_a, "threads"_a = 0,
        "saved"_a.none() = nb::none(),
        "The Jacobian-vector product of gaussian_project along the given input tangents (None: 0) and bound "
        "tangents (tangent_eps: the joint bound or eps_cov; tangent_eps_mean: split only).");
  m.def("gaussian_kl", &kl, "mean"_a, "cov"_a, "old_mean"_a, "old_cov"_a, "full"_a, "out"_a, "threads"_a = 0,
        "out[r] = KL(N(mean, cov) || N(old_mean, old_cov)) per row, float64.");
}

}  // namespace troll_py
