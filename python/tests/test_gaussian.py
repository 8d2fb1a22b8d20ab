"""troll.gaussian and troll.torch.gaussian against the plain-PyTorch oracle (gaussian_oracle.py):
forward values, the KL, gradients (torch.autograd.gradcheck in float64 and the oracle's autograd
gradients), NumPy arrays, float32, and typed errors for bad input."""

import numpy as np
import pytest
import torch

import troll
import troll.torch.gaussian as tg
from gaussian_oracle import gaussian_kl, project as oracle_project, random_factor

VARIANTS = [("joint", False), ("split", True)]


def problem(n, d, gen, spread=1.0):
    mean = torch.randn(n, d, dtype=torch.float64, generator=gen) * spread
    old_mean = torch.randn(n, d, dtype=torch.float64, generator=gen) * spread
    chol = random_factor(n, d, 0.5, gen)
    old_chol = random_factor(n, d, 0.5, gen)
    return mean, chol, old_mean, old_chol


def diag_problem(n, d, gen):
    mean = torch.randn(n, d, dtype=torch.float64, generator=gen)
    old_mean = torch.randn(n, d, dtype=torch.float64, generator=gen)
    std = torch.exp(0.4 * torch.randn(n, d, dtype=torch.float64, generator=gen))
    old_std = torch.exp(0.4 * torch.randn(n, d, dtype=torch.float64, generator=gen))
    return mean, std, old_mean, old_std


def run(split, full, args, eps_mean, eps_cov):
    fn = {(False, True): troll.gaussian.project_joint, (True, True): troll.gaussian.project_split,
          (False, False): troll.gaussian.project_joint_diag, (True, False): troll.gaussian.project_split_diag}
    f = fn[(split, full)]
    return f(*args, eps_mean, eps_cov) if split else f(*args, eps_mean)


@pytest.mark.parametrize("name,split", VARIANTS)
@pytest.mark.parametrize("d", [1, 3, 8])
def test_full_matches_oracle(name, split, d, gen):
    args = problem(24, d, gen)
    eps_mean, eps_cov = 0.05, 0.03
    m, l, stats = run(split, True, args, eps_mean, eps_cov)
    om, ol, ot = oracle_project(*args, eps_mean, eps_cov, split=split)
    assert (stats.status == troll.gaussian.PROJECTED).sum() > 12
    torch.testing.assert_close(m, om, atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(l, ol, atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(stats.t, ot.detach(), atol=1e-9, rtol=1e-8)
    assert torch.equal(torch.triu(l, 1), torch.zeros_like(l))
    # The projected rows sit on the boundary of the bound they were projected against.
    active = stats.status == troll.gaussian.PROJECTED
    s = l @ l.transpose(-1, -2)
    so = args[3] @ args[3].transpose(-1, -2)
    kl_after = gaussian_kl(args[2] if split else m, s, args[2], so, mean_part=not split)
    eps = eps_cov if split else eps_mean
    torch.testing.assert_close(kl_after[active], torch.full_like(kl_after[active], eps), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(stats.kl_after, kl_after, atol=1e-12, rtol=1e-9)
    # Inactive rows are copied bit for bit.
    inactive = stats.status == troll.gaussian.INACTIVE
    if split:
        assert torch.equal(l[inactive], args[1][inactive])
    else:
        assert torch.equal(m[inactive], args[0][inactive]) and torch.equal(l[inactive], args[1][inactive])


@pytest.mark.parametrize("name,split", VARIANTS)
def test_diag_matches_oracle(name, split, gen):
    mean, std, old_mean, old_std = diag_problem(32, 6, gen)
    m, s, stats = run(split, False, (mean, std, old_mean, old_std), 0.1, 0.05)
    om, ol, ot = oracle_project(mean, torch.diag_embed(std), old_mean, torch.diag_embed(old_std), 0.1, 0.05,
                                split=split)
    torch.testing.assert_close(m, om, atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(s, torch.diagonal(ol, dim1=-2, dim2=-1), atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(stats.t, ot.detach(), atol=1e-9, rtol=1e-8)


def test_kl_and_leading_shape(gen):
    mean, chol, old_mean, old_chol = problem(12, 4, gen)
    shaped = [x.reshape((3, 4) + tuple(x.shape[1:])) for x in (mean, chol, old_mean, old_chol)]
    kl = troll.gaussian.kl(*shaped)
    assert kl.shape == (3, 4) and kl.dtype == torch.float64
    want = gaussian_kl(mean, chol @ chol.transpose(-1, -2), old_mean, old_chol @ old_chol.transpose(-1, -2))
    torch.testing.assert_close(kl.reshape(-1), want, atol=1e-12, rtol=1e-10)
    m, l, stats = troll.gaussian.project_joint(*shaped, 0.1)
    assert m.shape == (3, 4, 4) and l.shape == (3, 4, 4, 4) and stats.t.shape == (3, 4)
    m1, l1, _ = troll.gaussian.project_joint(mean, chol, old_mean, old_chol, 0.1)
    assert torch.equal(m.reshape(12, 4), m1) and torch.equal(l.reshape(12, 4, 4), l1)
    mean, std, old_mean, old_std = diag_problem(5, 3, gen)
    want = gaussian_kl(mean, torch.diag_embed(std**2), old_mean, torch.diag_embed(old_std**2))
    torch.testing.assert_close(troll.gaussian.kl_diag(mean, std, old_mean, old_std), want, atol=1e-12, rtol=1e-10)


def test_numpy_and_float32(gen):
    args = problem(16, 5, gen)
    m64, l64, _ = troll.gaussian.project_split(*args, 0.05, 0.05)
    m, l, stats = troll.gaussian.project_split(*(x.numpy() for x in args), 0.05, 0.05)
    assert isinstance(m, np.ndarray) and isinstance(stats.t, np.ndarray)
    np.testing.assert_array_equal(m, m64.numpy())
    np.testing.assert_array_equal(l, l64.numpy())
    m32, l32, _ = troll.gaussian.project_split(*(x.float() for x in args), 0.05, 0.05)
    assert m32.dtype == torch.float32
    torch.testing.assert_close(m32.double(), m64, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(l32.double(), l64, atol=1e-5, rtol=1e-4)


# ---- gradients ----


def lower(a):
    """An unconstrained matrix as a factor: its lower triangle (entries above do not matter)."""
    return torch.tril(a)


@pytest.mark.parametrize("name,split", VARIANTS)
def test_gradcheck_full(name, split, gen):
    mean, chol, old_mean, old_chol = problem(3, 3, gen)
    eps_mean = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    eps_cov = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
    inputs = [x.clone().requires_grad_(True) for x in (mean, chol, old_mean, old_chol)]
    w_m = torch.randn(mean.shape, dtype=torch.float64, generator=gen)
    w_l = torch.randn(chol.shape, dtype=torch.float64, generator=gen)

    def f(m, a, om, oa, em, ec):
        if split:
            pm, pl = tg.project_split(m, lower(a), om, lower(oa), em, ec)
        else:
            pm, pl = tg.project_joint(m, lower(a), om, lower(oa), em)
        return (pm * w_m).sum() + (pl * w_l).sum()

    _, _, stats = run(split, True, (mean, chol, old_mean, old_chol), 0.05, 0.02)
    assert (stats.status == troll.gaussian.PROJECTED).all()
    assert torch.autograd.gradcheck(f, (*inputs, eps_mean, eps_cov), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name,split", VARIANTS)
def test_gradcheck_diag(name, split, gen):
    args = diag_problem(4, 3, gen)
    inputs = [x.clone().requires_grad_(True) for x in args]
    eps_mean = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    eps_cov = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
    if split:
        fn = lambda m, s, om, os, em, ec: tg.project_split_diag(m, s, om, os, em, ec)  # noqa: E731
    else:
        fn = lambda m, s, om, os, em, ec: tg.project_joint_diag(m, s, om, os, em)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (*inputs, eps_mean, eps_cov), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name,split", VARIANTS)
def test_gradients_match_oracle(name, split, gen):
    args = problem(10, 4, gen)
    w_m = torch.randn(args[0].shape, dtype=torch.float64, generator=gen)
    w_l = torch.randn(args[1].shape, dtype=torch.float64, generator=gen)

    def grads(project):
        xs = [x.clone().requires_grad_(True) for x in args]
        em = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        ec = torch.tensor(0.03, dtype=torch.float64, requires_grad=True)
        m, l = project(*xs, em, ec)
        ((m * w_m).sum() + (torch.tril(l) * w_l).sum()).backward()
        g = [x.grad for x in xs]
        g[1], g[3] = torch.tril(g[1]), torch.tril(g[3])  # the factor's free entries
        return g + ([em.grad, ec.grad] if split else [em.grad])

    if split:
        got = grads(lambda *a: tg.project_split(*a))
    else:
        got = grads(lambda m, l, om, ol, em, ec: tg.project_joint(m, l, om, ol, em))
    want = grads(lambda m, l, om, ol, em, ec: oracle_project(m, l, om, ol, em, ec, split=split)[:2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-6)


def test_gradient_float32_matches_double(gen):
    args = diag_problem(8, 5, gen)

    def grads(dtype):
        xs = [x.to(dtype).requires_grad_(True) for x in args]
        m, s = tg.project_joint_diag(*xs, 0.05)
        (m.sum() + (s * s).sum()).backward()
        return [x.grad.double() for x in xs]

    for g32, g64 in zip(grads(torch.float32), grads(torch.float64)):
        torch.testing.assert_close(g32, g64, atol=1e-3, rtol=1e-3)


def test_return_stats_and_no_grad_inputs(gen):
    mean, std, old_mean, old_std = diag_problem(6, 2, gen)
    m = mean.clone().requires_grad_(True)
    pm, ps, stats = tg.project_split_diag(m, std, old_mean, old_std, 0.01, 0.01, return_stats=True)
    assert isinstance(stats, troll.gaussian.GaussianStats) and stats.omega.shape == (6,)
    assert (stats.mean_kl_after <= 0.01 * (1 + 1e-9)).all()
    pm.sum().backward()
    assert m.grad is not None and m.grad.shape == mean.shape


# ---- bad input ----


def sentinel_out(mean, cov):
    return torch.full_like(mean, 7.0), torch.full_like(cov, 7.0)


@pytest.mark.parametrize(
    "where,value,error",
    [("mean", float("nan"), troll.DomainError), ("old_mean", float("inf"), troll.DomainError),
     ("chol_upper", 0.5, troll.DomainError), ("chol_diag", -1.0, troll.DomainError),
     ("old_chol_diag", 0.0, troll.DomainError)],
)
def test_bad_values_name_the_row(where, value, error, gen):
    mean, chol, old_mean, old_chol = problem(5, 3, gen)
    if where == "mean":
        mean[3, 1] = value
    elif where == "old_mean":
        old_mean[3, 0] = value
    elif where == "chol_upper":
        chol[3, 0, 2] = value
    elif where == "chol_diag":
        chol[3, 1, 1] = value
    else:
        old_chol[3, 2, 2] = value
    out = sentinel_out(mean, chol)
    with pytest.raises(error) as info:
        troll.gaussian.project_joint(mean, chol, old_mean, old_chol, 0.1, out=out)
    assert isinstance(info.value, troll.InvalidInput) and info.value.row == 3
    assert (out[0] == 7.0).all() and (out[1] == 7.0).all()


def test_bad_std_eps_and_shapes(gen):
    mean, std, old_mean, old_std = diag_problem(4, 3, gen)
    bad = std.clone()
    bad[2, 0] = -0.1
    with pytest.raises(troll.DomainError) as info:
        troll.gaussian.project_joint_diag(mean, bad, old_mean, old_std, 0.1)
    assert info.value.row == 2
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(troll.DomainError):
            troll.gaussian.project_joint_diag(mean, std, old_mean, old_std, eps)
        with pytest.raises(troll.DomainError):
            troll.gaussian.project_split_diag(mean, std, old_mean, old_std, 0.1, eps)
    with pytest.raises(troll.ShapeError):
        troll.gaussian.project_joint_diag(mean, std[:, :2], old_mean, old_std, 0.1)
    with pytest.raises(troll.ShapeError):
        troll.gaussian.project_joint(mean, std, old_mean, old_std, 0.1)  # std devs where factors are needed
    chol = torch.diag_embed(std)
    with pytest.raises(troll.ShapeError):
        troll.gaussian.project_joint(mean, chol.transpose(-1, -2).contiguous().transpose(-1, -2), old_mean,
                                     torch.diag_embed(old_std), 0.1)  # column-major factors
    with pytest.raises(TypeError):
        troll.gaussian.project_joint_diag(mean.long(), std, old_mean, old_std, 0.1)


# ---- forward mode ----


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("name,split", VARIANTS)
def test_forward_mode_matches_reverse_mode(full, name, split, gen):
    """<u, J v> by forward-mode AD (troll's JVP) equals <J^T u, v> by reverse mode (troll's VJP),
    and J v matches a central difference."""
    import torch.autograd.forward_ad as fwAD

    args = problem(6, 3, gen) if full else diag_problem(6, 3, gen)
    tangents = [torch.randn(x.shape, dtype=torch.float64, generator=gen) for x in args]
    if full:
        tangents[1], tangents[3] = torch.tril(tangents[1]), torch.tril(tangents[3])
    eps_mean = torch.tensor(0.05, dtype=torch.float64)
    eps_cov = torch.tensor(0.02, dtype=torch.float64)
    t_eps = [torch.tensor(0.01, dtype=torch.float64), torch.tensor(-0.004, dtype=torch.float64)]
    fn = {(True, False): tg.project_joint, (True, True): tg.project_split,
          (False, False): tg.project_joint_diag, (False, True): tg.project_split_diag}[(full, split)]

    def f(xs, em, ec):
        return fn(*xs, em, ec) if split else fn(*xs, em)

    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip(args, tangents)]
        dem, dec = fwAD.make_dual(eps_mean, t_eps[0]), fwAD.make_dual(eps_cov, t_eps[1])
        outs = f(duals, dem, dec)
        jv = [fwAD.unpack_dual(o).tangent for o in outs]
    h = 1e-6

    def moved(s):
        xs = [x + s * t for x, t in zip(args, tangents)]
        return f(xs, eps_mean + s * t_eps[0], eps_cov + s * t_eps[1])

    plus, minus = moved(h), moved(-h)
    for j, p_, m_ in zip(jv, plus, minus):
        torch.testing.assert_close(j, (p_ - m_) / (2 * h), atol=1e-6, rtol=1e-5)
    u = [torch.randn(o.shape, dtype=torch.float64, generator=gen) for o in outs]
    if full:
        u[1] = torch.tril(u[1])
    xs = [x.clone().requires_grad_(True) for x in args]
    em, ec = eps_mean.clone().requires_grad_(True), eps_cov.clone().requires_grad_(True)
    outs = f(xs, em, ec)
    sum((o * w).sum() for o, w in zip(outs, u)).backward()
    left = sum((j * w).sum() for j, w in zip(jv, u))
    right = sum((x.grad * t).sum() for x, t in zip(xs, tangents)) + em.grad * t_eps[0]
    if split:
        right = right + ec.grad * t_eps[1]
    torch.testing.assert_close(left, right, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name,split", VARIANTS)
def test_saved_factorisation_gives_the_same_derivatives(name, split, gen):
    # The forward fills `saved`; the backward and JVP given it agree bit for bit with refactorising.
    mean, chol, old_mean, old_chol = problem(4, 5, gen)
    g = troll.gaussian
    saved = g.empty_saved(mean)
    assert tuple(saved.shape) == (4, 5 * 5 + 2 * 5) and saved.dtype == torch.float64
    f = g.project_split if split else g.project_joint
    bounds = (0.05, 0.02) if split else (0.05,)
    m1, l1, stats = f(mean, chol, old_mean, old_chol, *bounds, saved=saved)
    m2, l2, _ = f(mean, chol, old_mean, old_chol, *bounds)
    assert torch.equal(m1, m2) and torch.equal(l1, l2)
    em, ec = (0.05, 0.02) if split else (0.05, 0.05)
    up_m, up_l = torch.randn(m1.shape, dtype=torch.float64, generator=gen), torch.randn(l1.shape, dtype=torch.float64,
                                                                                       generator=gen)
    common = dict(full=True, split=split, old=True, eps=True)
    a = g.project_backward(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, up_l, saved=saved, **common)
    b = g.project_backward(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, up_l, **common)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)
    ja = g.project_jvp(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, torch.tril(up_l), None, None,
                       0.01, 0.0, full=True, split=split, saved=saved)
    jb = g.project_jvp(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, torch.tril(up_l), None, None,
                       0.01, 0.0, full=True, split=split)
    assert torch.equal(ja[0], jb[0]) and torch.equal(ja[1], jb[1])
    # A wrong shape is a ShapeError naming the entry point called; diagonal projections take none.
    with pytest.raises(troll.ShapeError, match="gaussian.project_backward"):
        g.project_backward(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, up_l, saved=saved[:3],
                           **common)
    with pytest.raises(troll.ShapeError, match="gaussian.project_backward: out_mean"):
        g.project_backward(mean, chol, old_mean, old_chol, em, ec, m1[:, :-1], l1, stats, up_m, up_l, **common)
    with pytest.raises(troll.ShapeError, match="gaussian.project_backward: grad_out_cov"):
        g.project_backward(mean, chol, old_mean, old_chol, em, ec, m1, l1, stats, up_m, up_l[:, :-1], **common)
    with pytest.raises(troll.ShapeError, match="gaussian.project_jvp: out_mean"):
        g.project_jvp(mean, chol, old_mean, old_chol, em, ec, m1[:, :-1], l1, stats, up_m, None, None, None,
                      0.0, 0.0, full=True, split=split)
    with pytest.raises(troll.ShapeError):
        g._project(mean, torch.ones_like(mean), old_mean, torch.ones_like(mean), 0.05, 0.05, False, False, None, None,
                   1e-11, 0.0, 100, 0, saved)
