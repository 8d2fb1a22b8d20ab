// python/src/gaussian.cpp — troll's Gaussian trust regions (troll/gaussian.hpp, docs/gaussian.md)
// for Python: the four projections (joint / split bound, Cholesky factors / standard deviations),
// their backward passes (VJP) and JVPs, and the Gaussian KL. Means are (..., d) arrays, Cholesky factors
// (..., d, d) (each d × d matrix row-major and contiguous), standard deviations (..., d). The
// statistics travel packed, as for the categorical projection: values (..., 8) float64 and
// counters (..., 2) int32 (troll/gaussian.py names the columns); the argument checks are
// gaussian_args.hpp's, shared with troll._troll_cuda. No maths here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <troll/gaussian.hpp>

#include "gaussian_args.hpp"
#include "views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

std::vector<troll::gaussian::gaussian_stats> read_gaussian_stats(const troll::batch_view<const double>& v,
                                                                 const troll::batch_view<const std::int32_t>& c) {
  std::vector<troll::gaussian::gaussian_stats> s(v.rows);
  for (std::size_t r = 0; r < v.rows; ++r) {
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

void project(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov,
             double eps_mean, double eps_cov, bool full, bool split, const out_array& out_mean,
             const out_array& out_cov, const out_array& stats_values, const out_array& stats_counters,
             double rtol, double atol, int max_iterations, unsigned threads, const std::optional<out_array>& saved) {
  const char* fn = gaussian_project_name(full, split);
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_project_args<T> a(fn, full, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                     stats_counters, rtol, atol, max_iterations, saved);
    const gaussian_operands<T>& in = a.in;
    std::vector<troll::gaussian::gaussian_stats> stats(in.mean.rows);
    {
      nb::gil_scoped_release release;
      namespace g = troll::gaussian;
      const auto p = policy(threads);
      if (full && split) {
        g::project_split(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean, a.out_cov,
                         stats.data(), a.options, a.saved);
      } else if (full) {
        g::project_joint(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov, stats.data(),
                         a.options, a.saved);
      } else if (split) {
        g::project_split_diag(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean,
                              a.out_cov, stats.data(), a.options);
      } else {
        g::project_joint_diag(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov,
                              stats.data(), a.options);
      }
    }
    for (std::size_t r = 0; r < stats.size(); ++r) {
      double* x = a.values.row(r);
      x[gs_t] = stats[r].t;
      x[gs_eta] = stats[r].eta;
      x[gs_omega] = stats[r].omega;
      x[gs_kl_before] = stats[r].kl_before;
      x[gs_kl_after] = stats[r].kl_after;
      x[gs_mean_kl_before] = stats[r].mean_kl_before;
      x[gs_mean_kl_after] = stats[r].mean_kl_after;
      x[gs_fisher] = stats[r].fisher;
      a.counters.row(r)[gs_iterations] = stats[r].iterations;
      a.counters.row(r)[gs_status] = static_cast<std::int32_t>(stats[r].status);
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
  const char* fn = "gaussian.project_backward";  // the entry point the caller named
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_backward_args<T> a(fn, full, split, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                      stats_counters, grad_out_mean, grad_out_cov, grad_mean, grad_cov,
                                      grad_old_mean, grad_old_cov, grad_eps, grad_eps_mean, saved);
    const gaussian_operands<T>& in = a.in;
    const auto stats = read_gaussian_stats(a.values, a.counters);
    nb::gil_scoped_release release;
    namespace g = troll::gaussian;
    const auto p = policy(threads);
    if (full && split) {
      g::project_split_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean,
                                a.out_cov, stats.data(), a.grad_out_mean, a.grad_out_cov, a.grads, a.saved);
    } else if (full) {
      g::project_joint_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov,
                                stats.data(), a.grad_out_mean, a.grad_out_cov, a.grads, a.saved);
    } else if (split) {
      g::project_split_diag_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean,
                                     a.out_cov, stats.data(), a.grad_out_mean, a.grad_out_cov, a.grads);
    } else {
      g::project_joint_diag_backward(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov,
                                     stats.data(), a.grad_out_mean, a.grad_out_cov, a.grads);
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
  const char* fn = "gaussian.project_jvp";
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_jvp_args<T> a(fn, full, mean, cov, old_mean, old_cov, out_mean, out_cov, stats_values,
                                 stats_counters, tangent_mean, tangent_cov, tangent_old_mean, tangent_old_cov,
                                 tangent_eps, tangent_eps_mean, tangent_out_mean, tangent_out_cov, saved);
    const gaussian_operands<T>& in = a.in;
    const auto stats = read_gaussian_stats(a.values, a.counters);
    nb::gil_scoped_release release;
    namespace g = troll::gaussian;
    const auto p = policy(threads);
    const auto tm = a.tangent_out_mean;
    const auto tc = a.tangent_out_cov;
    if (full && split) {
      g::project_split_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean, a.out_cov,
                           stats.data(), a.tangents, tm, tc, a.saved);
    } else if (full) {
      g::project_joint_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov,
                           stats.data(), a.tangents, tm, tc, a.saved);
    } else if (split) {
      g::project_split_diag_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, eps_cov, a.out_mean,
                                a.out_cov, stats.data(), a.tangents, tm, tc);
    } else {
      g::project_joint_diag_jvp(p, in.mean, in.cov, in.old_mean, in.old_cov, eps_mean, a.out_mean, a.out_cov,
                                stats.data(), a.tangents, tm, tc);
    }
  });
}

void kl(const in_array& mean, const in_array& cov, const in_array& old_mean, const in_array& old_cov, bool full,
        const out_array& out, unsigned threads) {
  const char* fn = full ? "gaussian.kl" : "gaussian.kl_diag";
  dispatch_float(fn, "mean", mean, [&](auto tag) {
    using T = decltype(tag);
    const gaussian_kl_args<T> a(fn, full, mean, cov, old_mean, old_cov, out);
    const gaussian_operands<T>& in = a.in;
    nb::gil_scoped_release release;
    if (full) {
      troll::gaussian::kl(policy(threads), in.mean, in.cov, in.old_mean, in.old_cov, a.out);
    } else {
      troll::gaussian::kl_diag(policy(threads), in.mean, in.cov, in.old_mean, in.old_cov, a.out);
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
