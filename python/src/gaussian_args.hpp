// python/src/gaussian_args.hpp — the arguments of the Gaussian entry points (gaussian_project,
// _backward, _jvp, gaussian_kl), checked and turned into troll views once for both extension
// modules: troll._troll (gaussian.cpp, host arrays) and troll._troll_cuda (cuda_module.cpp, device
// arrays — views.hpp's device rule differs, the checks here do not). Each throws the same
// ShapeError / TypeError text on both, before anything is written. The statistics stay packed
// views (values (rows, 8) float64, counters (rows, 2) int32); each module reads / writes them
// where they live.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <troll/gaussian_types.hpp>
#include <troll/projection_types.hpp>

#include "views.hpp"

namespace troll_py {

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

/// gaussian_project: operands, outputs, packed stats, options and the optional saved factorisation.
template <class T>
struct gaussian_project_args {
  gaussian_operands<T> in;
  troll::batch_view<T> out_mean, out_cov;
  troll::batch_view<double> values;
  troll::batch_view<std::int32_t> counters;
  troll::projection_options options;
  troll::gaussian::saved_factorisation<double> saved;

  gaussian_project_args(const char* fn, bool full, const in_array& mean, const in_array& cov,
                        const in_array& old_mean, const in_array& old_cov, const out_array& om, const out_array& oc,
                        const out_array& stats_values, const out_array& stats_counters, double rtol, double atol,
                        int max_iterations, const std::optional<out_array>& saved_array)
      : in(fn, full, mean, cov, old_mean, old_cov) {
    require_same_shape(fn, "out_mean", om, "mean", mean);
    require_same_shape(fn, "out_cov", oc, "cov", cov);
    out_mean = as_batch<T>(fn, "out_mean", om);
    out_cov = as_cov<T>(fn, "out_cov", oc, mean, full);
    in.require_disjoint_from(fn, "out_mean", out_mean);
    in.require_disjoint_from(fn, "out_cov", out_cov);
    require_disjoint(fn, "out_mean", out_mean, "out_cov", out_cov);
    values = as_batch<double>(fn, "stats.values", stats_values);
    counters = as_batch<std::int32_t>(fn, "stats.counters", stats_counters);
    if (values.rows != in.mean.rows || values.cols != gs_values || counters.rows != in.mean.rows ||
        counters.cols != gs_counters)
      fail(fn, "the stats buffers must be (rows, 8) float64 and (rows, 2) int32 for " +
                   std::to_string(in.mean.rows) + " rows");
    require_rows_apart(fn, "stats.values", values);
    require_rows_apart(fn, "stats.counters", counters);
    // The stats are written after the outputs: a buffer overlapping an input or an output would
    // overwrite it silently.
    require_disjoint(fn, "stats.values", values, "stats.counters", counters);
    in.require_disjoint_from(fn, "stats.values", values);
    in.require_disjoint_from(fn, "stats.counters", counters);
    require_disjoint(fn, "stats.values", values, "out_mean", out_mean);
    require_disjoint(fn, "stats.values", values, "out_cov", out_cov);
    require_disjoint(fn, "stats.counters", counters, "out_mean", out_mean);
    require_disjoint(fn, "stats.counters", counters, "out_cov", out_cov);
    options.rtol = rtol;
    options.atol = atol;
    options.max_iterations = max_iterations;
    saved = as_saved<double>(fn, saved_array, in.mean.rows, in.mean.cols, full);
  }
};

/// The forward's packed stats of a derivative, checked against the batch.
inline void check_packed_stats(const char* fn, const troll::batch_view<const double>& v,
                               const troll::batch_view<const std::int32_t>& c, std::size_t rows) {
  if (v.rows != rows || v.cols != gs_values || c.rows != rows || c.cols != gs_counters)
    fail(fn, "stats do not match the batch (" + std::to_string(rows) +
                 " rows): pass the stats the forward projection returned for these inputs");
}

/// gaussian_project_backward: operands, forward outputs and stats, upstream gradients, the wanted
/// gradients (empty views / null pointers: not wanted), the optional saved factorisation.
template <class T>
struct gaussian_backward_args {
  gaussian_operands<T> in;
  troll::batch_view<const T> out_mean, out_cov, grad_out_mean, grad_out_cov;
  troll::batch_view<const double> values;
  troll::batch_view<const std::int32_t> counters;
  troll::gaussian::gaussian_grads<T> grads;
  troll::gaussian::saved_factorisation<const double> saved;

  gaussian_backward_args(const char* fn, bool full, bool split, const in_array& mean, const in_array& cov,
                         const in_array& old_mean, const in_array& old_cov, const in_array& om, const in_array& oc,
                         const in_array& stats_values, const in_array& stats_counters, const in_array& gom,
                         const in_array& goc, const std::optional<out_array>& grad_mean,
                         const std::optional<out_array>& grad_cov, const std::optional<out_array>& grad_old_mean,
                         const std::optional<out_array>& grad_old_cov, const std::optional<out_array>& grad_eps,
                         const std::optional<out_array>& grad_eps_mean, const std::optional<in_array>& saved_array)
      : in(fn, full, mean, cov, old_mean, old_cov) {
    require_same_shape(fn, "out_mean", om, "mean", mean);
    require_same_shape(fn, "grad_out_mean", gom, "mean", mean);
    require_same_shape(fn, "out_cov", oc, "cov", cov);
    require_same_shape(fn, "grad_out_cov", goc, "cov", cov);
    out_mean = as_batch<const T>(fn, "out_mean", om);
    out_cov = as_cov<const T>(fn, "out_cov", oc, mean, full);
    grad_out_mean = as_batch<const T>(fn, "grad_out_mean", gom);
    grad_out_cov = as_cov<const T>(fn, "grad_out_cov", goc, mean, full);
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
    if (grad_eps) grads.eps = as_rows<double>(fn, "grad_eps", *grad_eps, rows_of("mean", mean));
    if (grad_eps_mean) {
      if (!split) fail(fn, "grad_eps_mean is for the split projections only");
      grads.eps_mean = as_rows<double>(fn, "grad_eps_mean", *grad_eps_mean, rows_of("mean", mean));
    }
    for (std::size_t i = 0; i < written.size(); ++i) {
      const troll::batch_view<T>& w = *written[i];
      in.require_disjoint_from(fn, "a gradient", w);
      require_disjoint(fn, "a gradient", w, "out_mean", out_mean);
      require_disjoint(fn, "a gradient", w, "out_cov", out_cov);
      require_disjoint(fn, "a gradient", w, "grad_out_mean", grad_out_mean);
      require_disjoint(fn, "a gradient", w, "grad_out_cov", grad_out_cov);
      for (std::size_t j = 0; j < i; ++j) require_disjoint(fn, "a gradient", w, "another gradient", *written[j]);
    }
    values = as_batch<const double>(fn, "stats.values", stats_values);
    counters = as_batch<const std::int32_t>(fn, "stats.counters", stats_counters);
    check_packed_stats(fn, values, counters, in.mean.rows);
    saved = as_saved<const double>(fn, saved_array, in.mean.rows, in.mean.cols, full);
  }
};

/// gaussian_project_jvp: operands, forward outputs and stats, input tangents (None: 0), outputs.
template <class T>
struct gaussian_jvp_args {
  gaussian_operands<T> in;
  troll::batch_view<const T> out_mean, out_cov;
  troll::batch_view<const double> values;
  troll::batch_view<const std::int32_t> counters;
  troll::gaussian::gaussian_tangents<T> tangents;
  troll::batch_view<T> tangent_out_mean, tangent_out_cov;
  troll::gaussian::saved_factorisation<const double> saved;

  gaussian_jvp_args(const char* fn, bool full, const in_array& mean, const in_array& cov, const in_array& old_mean,
                    const in_array& old_cov, const in_array& om, const in_array& oc, const in_array& stats_values,
                    const in_array& stats_counters, const std::optional<in_array>& tangent_mean,
                    const std::optional<in_array>& tangent_cov, const std::optional<in_array>& tangent_old_mean,
                    const std::optional<in_array>& tangent_old_cov, double tangent_eps, double tangent_eps_mean,
                    const out_array& tom, const out_array& toc, const std::optional<in_array>& saved_array)
      : in(fn, full, mean, cov, old_mean, old_cov) {
    require_same_shape(fn, "out_mean", om, "mean", mean);
    require_same_shape(fn, "out_cov", oc, "cov", cov);
    out_mean = as_batch<const T>(fn, "out_mean", om);
    out_cov = as_cov<const T>(fn, "out_cov", oc, mean, full);
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
    require_same_shape(fn, "tangent_out_mean", tom, "mean", mean);
    require_same_shape(fn, "tangent_out_cov", toc, "cov", cov);
    tangent_out_mean = as_batch<T>(fn, "tangent_out_mean", tom);
    tangent_out_cov = as_cov<T>(fn, "tangent_out_cov", toc, mean, full);
    for (const troll::batch_view<T>* w : {&tangent_out_mean, &tangent_out_cov}) {
      in.require_disjoint_from(fn, "a tangent output", *w);
      require_disjoint(fn, "a tangent output", *w, "out_mean", out_mean);
      require_disjoint(fn, "a tangent output", *w, "out_cov", out_cov);
      for (const troll::batch_view<const T>* t : {&tangents.mean, &tangents.cov, &tangents.old_mean, &tangents.old_cov})
        require_disjoint(fn, "a tangent output", *w, "a tangent", *t);
    }
    require_disjoint(fn, "tangent_out_mean", tangent_out_mean, "tangent_out_cov", tangent_out_cov);
    values = as_batch<const double>(fn, "stats.values", stats_values);
    counters = as_batch<const std::int32_t>(fn, "stats.counters", stats_counters);
    check_packed_stats(fn, values, counters, in.mean.rows);
    saved = as_saved<const double>(fn, saved_array, in.mean.rows, in.mean.cols, full);
  }
};

/// gaussian_kl: operands and one float64 output a row.
template <class T>
struct gaussian_kl_args {
  gaussian_operands<T> in;
  double* out;
  gaussian_kl_args(const char* fn, bool full, const in_array& mean, const in_array& cov, const in_array& old_mean,
                   const in_array& old_cov, const out_array& y)
      : in(fn, full, mean, cov, old_mean, old_cov), out(as_rows<double>(fn, "out", y, rows_of("mean", mean))) {}
};

inline const char* gaussian_project_name(bool full, bool split) {
  if (full) return split ? "gaussian.project_split" : "gaussian.project_joint";
  return split ? "gaussian.project_split_diag" : "gaussian.project_joint_diag";
}

}  // namespace troll_py
