// tests/bodies/gaussian_backward_fd.hpp — the VJP and JVP of the Gaussian projections (joint and
// split, full and diagonal) against central finite differences of the independent long-double
// oracle (support/gaussian_oracle.hpp: bisection for t*, explicit inverses) in random directions of
// every input and of the bounds, at larger d (up to 256) against differences of the backend's own
// forward, and the two adjoint (⟨u, J v⟩ = ⟨Jᵀu, v⟩). Forward and derivatives run on the backend
// (full rows above d = 32 with the workspace troll::workspace_bytes asks for); inputs are uploaded
// and outputs downloaded per call.
//
// One body compiled per backend (as bodies/gaussian_diag_derivatives.hpp):
// tests/test_gaussian_backward.cpp includes it with troll_test::oracle_backend =
// backend<cpu_policy>, tests/cuda/test_cuda_gaussian_full_derivatives.cu with
// backend<cuda_policy> (checked policy) inside its "device" suite. Its names live in namespace
// gaussian_fd. Include after "gaussian_oracle.hpp", <troll/gaussian.hpp>, <troll/workspace.hpp>,
// "backend.hpp" and the definition of troll_test::oracle_backend.

namespace gaussian_fd {

namespace gauss = troll_test::gauss;
using gauss::real;
using backend = troll_test::oracle_backend;
using buffer = typename backend::template buffer<double>;

/// One problem: inputs (means, factors or std devs), bounds, layout.
struct problem {
  std::size_t d = 0;
  bool full = true;
  bool split = false;
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0.1, eps_cov = 0.1;
  std::size_t cov_size() const { return full ? d * d : d; }
};

/// The forward output flattened (mean then factor / std devs) by the long-double oracle.
std::vector<real> oracle_output(const problem& p) {
  const gauss::normal target = p.full ? gauss::normal::from_factor(p.mean.data(), p.cov.data(), p.d)
                                      : gauss::normal::from_std(p.mean.data(), p.cov.data(), p.d);
  const gauss::normal old =
      p.full ? gauss::normal::from_factor(p.old_mean.data(), p.old_cov.data(), p.d)
             : gauss::normal::from_std(p.old_mean.data(), p.old_cov.data(), p.d);
  const real t = gauss::solve_t(target, old, p.split ? p.eps_cov : p.eps, !p.split);
  gauss::normal out = gauss::member(target, old, t, !p.split);
  if (p.split) {
    const gauss::vec diff = target.mean - old.mean;
    const real m = diff.dot(gauss::inverse(old.cov) * diff) / 2;
    const real kappa = m > p.eps ? std::sqrt(static_cast<real>(p.eps) / m) : 1;
    out.mean = old.mean + kappa * diff;
  }
  std::vector<real> flat(out.mean.data(), out.mean.data() + p.d);
  const auto n = static_cast<Eigen::Index>(p.d);
  if (p.full) {
    const gauss::mat l = Eigen::LLT<gauss::mat>(out.cov).matrixL();
    for (Eigen::Index i = 0; i < n; ++i)
      for (Eigen::Index j = 0; j < n; ++j) flat.push_back(j <= i ? l(i, j) : 0);
  } else {
    for (Eigen::Index i = 0; i < n; ++i) flat.push_back(std::sqrt(out.cov(i, i)));
  }
  return flat;
}

struct forward {
  std::vector<double> mean, cov;
  troll::gaussian::gaussian_stats stats;
};

/// The backend's policy with the workspace Op needs for one row of dimension d (none for the
/// CPU; above d = 32 for CUDA's full rows).
template <class Op>
using scratch_policy = troll_test::workspace_policy<backend, Op>;

/// Host values on the backend as one row (zeros where `size` asks for a new output).
struct row_buffer {
  std::size_t size;
  buffer data;
  explicit row_buffer(const std::vector<double>& v) : size(v.size()), data(v) {}
  explicit row_buffer(std::size_t n) : size(n), data(std::vector<double>(n, 0.0)) {}
  troll::batch_view<const double> in() {
    return troll::make_batch(static_cast<const double*>(data.get()), 1, size);
  }
  troll::batch_view<double> out() { return troll::make_batch(data.get(), 1, size); }
};

/// A problem's inputs staged on the backend.
struct staged_problem {
  row_buffer mean, cov, old_mean, old_cov;
  explicit staged_problem(const problem& p)
      : mean(p.mean), cov(p.cov), old_mean(p.old_mean), old_cov(p.old_cov) {}
};

/// The backend's forward of one problem, downloaded.
forward troll_forward(const problem& p) {
  namespace g = troll::gaussian;
  namespace op = troll::op;
  staged_problem s(p);
  row_buffer ym(p.d), yc(p.cov_size());
  typename backend::template buffer<g::gaussian_stats> st(1);
  if (p.full && !p.split)
    g::project_joint(scratch_policy<op::gaussian_project_joint>(1, p.d).get(), s.mean.in(),
                     s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps, ym.out(), yc.out(),
                     st.get());
  if (p.full && p.split)
    g::project_split(scratch_policy<op::gaussian_project_split>(1, p.d).get(), s.mean.in(),
                     s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps, p.eps_cov, ym.out(),
                     yc.out(), st.get());
  if (!p.full && !p.split)
    g::project_joint_diag(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                          s.old_cov.in(), p.eps, ym.out(), yc.out(), st.get());
  if (!p.full && p.split)
    g::project_split_diag(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                          s.old_cov.in(), p.eps, p.eps_cov, ym.out(), yc.out(), st.get());
  return forward{ym.data.download(), yc.data.download(), st.download()[0]};
}

std::vector<real> troll_output(const problem& p) {
  const forward f = troll_forward(p);
  std::vector<real> flat(f.mean.begin(), f.mean.end());
  flat.insert(flat.end(), f.cov.begin(), f.cov.end());
  return flat;
}

struct gradients {
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0, eps_mean = 0;
};

/// The backend's VJP of one problem (its forward run there first), downloaded.
gradients troll_backward(const problem& p, const std::vector<double>& upstream) {
  namespace g = troll::gaussian;
  namespace op = troll::op;
  forward f = troll_forward(p);
  staged_problem s(p);
  row_buffer ym(f.mean), yc(f.cov), gm(p.d), gc(p.cov_size()), gom(p.d), goc(p.cov_size());
  row_buffer up_mean(std::vector<double>(upstream.begin(), upstream.begin() + long(p.d)));
  row_buffer up_cov(std::vector<double>(upstream.begin() + long(p.d), upstream.end()));
  typename backend::template buffer<g::gaussian_stats> st(std::vector<g::gaussian_stats>{f.stats});
  buffer eps_bar(std::vector<double>{0.0}), eps_mean_bar(std::vector<double>{0.0});
  const g::gaussian_grads<double> grads{gm.out(),  gc.out(),      gom.out(),
                                        goc.out(), eps_bar.get(), eps_mean_bar.get()};
  if (p.full && !p.split)
    g::project_joint_backward(scratch_policy<op::gaussian_project_joint_backward>(1, p.d).get(),
                              s.mean.in(), s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps,
                              ym.in(), yc.in(), st.get(), up_mean.in(), up_cov.in(), grads);
  if (p.full && p.split)
    g::project_split_backward(scratch_policy<op::gaussian_project_split_backward>(1, p.d).get(),
                              s.mean.in(), s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps,
                              p.eps_cov, ym.in(), yc.in(), st.get(), up_mean.in(), up_cov.in(),
                              grads);
  if (!p.full && !p.split)
    g::project_joint_diag_backward(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                                   s.old_cov.in(), p.eps, ym.in(), yc.in(), st.get(), up_mean.in(),
                                   up_cov.in(), grads);
  if (!p.full && p.split)
    g::project_split_diag_backward(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                                   s.old_cov.in(), p.eps, p.eps_cov, ym.in(), yc.in(), st.get(),
                                   up_mean.in(), up_cov.in(), grads);
  gradients out;
  out.mean = gm.data.download();
  out.cov = gc.data.download();
  out.old_mean = gom.data.download();
  out.old_cov = goc.data.download();
  const double e = eps_bar.download()[0], em = eps_mean_bar.download()[0];
  if (p.split) {
    out.eps = em;      // ε of the problem is ε_μ for split
    out.eps_mean = e;  // and eps_cov is ε_Σ
  } else {
    out.eps = e;
  }
  return out;
}

/// Checks ⟨∇, v⟩ against the central difference of ⟨upstream, output⟩ along v, for v a random
/// direction of each input in turn (factor directions lower-triangular) and of each bound.
void check_vjp(const problem& p, const std::function<std::vector<real>(const problem&)>& output,
               double h, double rtol, gauss::generator& gen, const std::string& what) {
  INFO(what, " d=", p.d, " full=", p.full, " split=", p.split, " eps=", p.eps);
  std::vector<double> upstream(p.d + p.cov_size());
  for (std::size_t i = 0; i < upstream.size(); ++i) {
    const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
    upstream[i] = above ? 0.0 : gen.normal01();
  }
  const gradients g = troll_backward(p, upstream);
  auto loss = [&](const problem& q) {
    const std::vector<real> out = output(q);
    real s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<real>(upstream[i]) * out[i];
    return s;
  };
  auto check_direction = [&](const char* name, std::vector<double> problem::*field,
                             const std::vector<double>& grad, bool is_cov) {
    std::vector<double> dir((p.*field).size());
    double analytic = 0;
    for (std::size_t i = 0; i < dir.size(); ++i) {
      const bool above = is_cov && p.full && i % p.d > i / p.d;
      // relative directions for the scales (they stay positive), absolute for the means
      dir[i] = above ? 0.0 : gen.normal01() * (is_cov ? std::fabs((p.*field)[i]) + 0.1 : 1.0);
      analytic += grad[i] * dir[i];
    }
    problem plus = p, minus = p;
    for (std::size_t i = 0; i < dir.size(); ++i) {
      (plus.*field)[i] += h * dir[i];
      (minus.*field)[i] -= h * dir[i];
    }
    const double numeric = double((loss(plus) - loss(minus)) / (2 * static_cast<real>(h)));
    INFO(std::string(name), ": analytic ", analytic, " numeric ", numeric);
    CHECK(std::fabs(analytic - numeric) <= rtol * (1.0 + std::fabs(numeric)));
  };
  check_direction("mean", &problem::mean, g.mean, false);
  check_direction("cov", &problem::cov, g.cov, true);
  check_direction("old_mean", &problem::old_mean, g.old_mean, false);
  check_direction("old_cov", &problem::old_cov, g.old_cov, true);
  auto check_bound = [&](const char* name, double problem::*field, double grad) {
    problem plus = p, minus = p;
    const double step = h * p.*field;
    plus.*field += step;
    minus.*field -= step;
    const double numeric = double((loss(plus) - loss(minus)) / (2 * static_cast<real>(step)));
    INFO(std::string(name), ": analytic ", grad, " numeric ", numeric);
    CHECK(std::fabs(grad - numeric) * p.*field <= rtol * (1.0 + std::fabs(numeric) * p.*field));
  };
  check_bound("eps", &problem::eps, g.eps);
  if (p.split) check_bound("eps_cov", &problem::eps_cov, g.eps_mean);
}

problem random_problem(gauss::generator& gen, std::size_t d, bool full, bool split, double eps) {
  problem p;
  p.d = d;
  p.full = full;
  p.split = split;
  p.mean = gen.mean(d, 1.0);
  p.old_mean = gen.mean(d, 1.0);
  p.cov = full ? gen.factor(d, 0.4) : gen.std_dev(d, 0.4);
  p.old_cov = full ? gen.factor(d, 0.4) : gen.std_dev(d, 0.4);
  p.eps = eps;
  p.eps_cov = eps * 0.7;
  return p;
}

TEST_CASE("VJP against finite differences of the long-double oracle") {
  gauss::generator gen(41);
  for (const bool full : {true, false}) {
    for (const bool split : {false, true}) {
      for (const std::size_t d : {std::size_t(1), std::size_t(3)}) {
        for (const double eps : {1e-3, 0.1, 1e4}) {  // 1e4: inactive
          const problem p = random_problem(gen, d, full, split, eps);
          check_vjp(p, oracle_output, 1e-6, 1e-6, gen, "oracle");
        }
      }
    }
  }
}

TEST_CASE("VJP against finite differences of troll's forward at larger d") {
  gauss::generator gen(43);
  for (const bool full : {true, false}) {
    for (const bool split : {false, true}) {
      for (const std::size_t d : {std::size_t(12), std::size_t(48)}) {
        const problem p = random_problem(gen, d, full, split, 0.2);
        check_vjp(p, troll_output, 1e-6, 1e-5, gen, "troll forward");
      }
    }
  }
}

// ---- JVP (forward mode) ----

/// A direction in the space of every input: one entry per input value, and the bounds'.
struct direction {
  std::vector<double> mean, cov, old_mean, old_cov;
  double eps = 0, eps_cov = 0;
};

direction random_direction(const problem& p, gauss::generator& gen) {
  direction v;
  auto fill = [&](const std::vector<double>& like, bool is_cov) {
    std::vector<double> out(like.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const bool above = is_cov && p.full && i % p.d > i / p.d;
      out[i] = above ? 0.0 : gen.normal01() * (is_cov ? std::fabs(like[i]) + 0.1 : 1.0);
    }
    return out;
  };
  v.mean = fill(p.mean, false);
  v.cov = fill(p.cov, true);
  v.old_mean = fill(p.old_mean, false);
  v.old_cov = fill(p.old_cov, true);
  v.eps = gen.normal01() * p.eps;
  v.eps_cov = gen.normal01() * p.eps_cov;
  return v;
}

problem moved(const problem& p, const direction& v, double h) {
  problem q = p;
  for (std::size_t i = 0; i < p.d; ++i) {
    q.mean[i] += h * v.mean[i];
    q.old_mean[i] += h * v.old_mean[i];
  }
  for (std::size_t i = 0; i < p.cov_size(); ++i) {
    q.cov[i] += h * v.cov[i];
    q.old_cov[i] += h * v.old_cov[i];
  }
  q.eps += h * v.eps;
  q.eps_cov += h * v.eps_cov;
  return q;
}

/// The backend's JVP along v (its forward run there first), flattened like the output (mean
/// then factor / std devs).
std::vector<double> troll_jvp(const problem& p, const direction& v) {
  namespace g = troll::gaussian;
  namespace op = troll::op;
  forward f = troll_forward(p);
  staged_problem s(p);
  row_buffer ym(f.mean), yc(f.cov), tm(p.d), tc(p.cov_size());
  row_buffer vm(v.mean), vc(v.cov), vom(v.old_mean), voc(v.old_cov);
  typename backend::template buffer<g::gaussian_stats> st(std::vector<g::gaussian_stats>{f.stats});
  g::gaussian_tangents<double> tan{vm.in(), vc.in(), vom.in(), voc.in(), 0.0, 0.0};
  // The problem's eps is the joint bound or ε_μ (split); eps_cov is ε_Σ.
  tan.eps = p.split ? v.eps_cov : v.eps;
  tan.eps_mean = p.split ? v.eps : 0.0;
  if (p.full && !p.split)
    g::project_joint_jvp(scratch_policy<op::gaussian_project_joint_jvp>(1, p.d).get(), s.mean.in(),
                         s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps, ym.in(), yc.in(),
                         st.get(), tan, tm.out(), tc.out());
  if (p.full && p.split)
    g::project_split_jvp(scratch_policy<op::gaussian_project_split_jvp>(1, p.d).get(), s.mean.in(),
                         s.cov.in(), s.old_mean.in(), s.old_cov.in(), p.eps, p.eps_cov, ym.in(),
                         yc.in(), st.get(), tan, tm.out(), tc.out());
  if (!p.full && !p.split)
    g::project_joint_diag_jvp(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                              s.old_cov.in(), p.eps, ym.in(), yc.in(), st.get(), tan, tm.out(),
                              tc.out());
  if (!p.full && p.split)
    g::project_split_diag_jvp(backend::policy(), s.mean.in(), s.cov.in(), s.old_mean.in(),
                              s.old_cov.in(), p.eps, p.eps_cov, ym.in(), yc.in(), st.get(), tan,
                              tm.out(), tc.out());
  std::vector<double> flat = tm.data.download();
  const std::vector<double> cov = tc.data.download();
  flat.insert(flat.end(), cov.begin(), cov.end());
  return flat;
}

/// J v against the central difference of the output along v, entry by entry (atol + rtol·scale,
/// scale the largest entry of the difference).
void check_jvp_fd(const problem& p, const std::function<std::vector<real>(const problem&)>& output,
                  double h, double rtol, gauss::generator& gen, const std::string& what) {
  INFO(what, " d=", p.d, " full=", p.full, " split=", p.split, " eps=", p.eps);
  const direction v = random_direction(p, gen);
  const std::vector<double> jv = troll_jvp(p, v);
  const std::vector<real> plus = output(moved(p, v, h)), minus = output(moved(p, v, -h));
  double scale = 0;
  std::vector<double> numeric(jv.size());
  for (std::size_t i = 0; i < jv.size(); ++i) {
    numeric[i] = double((plus[i] - minus[i]) / (2 * static_cast<real>(h)));
    scale = std::max(scale, std::fabs(numeric[i]));
  }
  for (std::size_t i = 0; i < jv.size(); ++i) {
    INFO("entry ", i, ": jvp ", jv[i], " numeric ", numeric[i]);
    CHECK(std::fabs(jv[i] - numeric[i]) <= rtol * (1.0 + scale));
  }
}

TEST_CASE("JVP against finite differences of the long-double oracle") {
  gauss::generator gen(47);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(1), std::size_t(3)})
        for (const double eps : {1e-3, 0.1, 1e4})
          check_jvp_fd(random_problem(gen, d, full, split, eps), oracle_output, 1e-6, 1e-6, gen,
                       "oracle");
}

TEST_CASE("JVP against finite differences of troll's forward at larger d") {
  gauss::generator gen(53);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(12), std::size_t(48)})
        check_jvp_fd(random_problem(gen, d, full, split, 0.2), troll_output, 1e-6, 1e-5, gen,
                     "troll forward");
}

TEST_CASE("JVP and VJP are adjoint: <u, J v> = <J^T u, v>") {
  gauss::generator gen(59);
  for (const bool full : {true, false})
    for (const bool split : {false, true})
      for (const std::size_t d : {std::size_t(1), std::size_t(5), std::size_t(32)})
        for (const double eps : {1e-3, 0.3, 1e4}) {
          const problem p = random_problem(gen, d, full, split, eps);
          INFO("d=", d, " full=", full, " split=", split, " eps=", eps);
          const direction v = random_direction(p, gen);
          std::vector<double> u(p.d + p.cov_size());
          for (std::size_t i = 0; i < u.size(); ++i) {
            const bool above = p.full && i >= p.d && (i - p.d) % p.d > (i - p.d) / p.d;
            u[i] = above ? 0.0 : gen.normal01();
          }
          const std::vector<double> jv = troll_jvp(p, v);
          const gradients g = troll_backward(p, u);
          double left = 0, right = 0, magnitude = 0;
          for (std::size_t i = 0; i < u.size(); ++i) {
            left += u[i] * jv[i];
            magnitude += std::fabs(u[i] * jv[i]);
          }
          auto dot = [&](const std::vector<double>& a, const std::vector<double>& b) {
            for (std::size_t i = 0; i < a.size(); ++i) {
              right += a[i] * b[i];
              magnitude += std::fabs(a[i] * b[i]);
            }
          };
          dot(g.mean, v.mean);
          dot(g.cov, v.cov);
          dot(g.old_mean, v.old_mean);
          dot(g.old_cov, v.old_cov);
          right += g.eps * v.eps + (p.split ? g.eps_mean * v.eps_cov : 0.0);
          INFO("<u, Jv> = ", left, ", <J^T u, v> = ", right);
          CHECK(std::fabs(left - right) <= 1e-10 * (1.0 + magnitude));
        }
}

// ---- larger d ----

TEST_CASE("VJP and JVP at d = 256") {
  gauss::generator gen(61);
  for (const bool full : {true, false})
    for (const bool split : {false, true}) {
      const problem p = random_problem(gen, 256, full, split, 0.5);
      check_vjp(p, troll_output, 1e-6, 1e-5, gen, "troll forward, d = 256");
      check_jvp_fd(p, troll_output, 1e-6, 1e-5, gen, "troll forward, d = 256");
    }
}

}  // namespace gaussian_fd
