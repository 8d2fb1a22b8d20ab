"""Differentiable Gaussian trust regions for PyTorch: troll.gaussian's four projections as
``torch.autograd.Function``s whose backward is troll's analytic one (implicit function theorem,
C++), w.r.t. the new and old means, the new and old covariance factors (or standard deviations)
and the bounds when they are given as one-element tensors. CPU tensors, float32 or float64.
Factor gradients are lower-triangular (entries above the diagonal do not enter the maths).
Forward-mode AD (torch.autograd.forward_ad) uses troll's analytic JVP."""

from __future__ import annotations

from typing import Any, Dict, Union

import torch

from .. import _core
from .. import gaussian as _g
from ..gaussian import GaussianStats
from ._autograd import guard, not_batched

__all__ = ["project_joint", "project_split", "project_joint_diag", "project_split_diag", "GaussianStats"]

Bound = Union[float, torch.Tensor]


def _bound_value(eps: Bound, name: str) -> float:
    """A bound as troll.gaussian takes it (_core._bound): a number or a one-element array of any
    framework; more elements: ShapeError."""
    return _core._bound(eps.detach() if isinstance(eps, torch.Tensor) else eps, name)


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mean, cov, old_mean, old_cov, eps_mean, eps_cov, cfg, info):  # type: ignore[override]
        given = (mean, cov, old_mean, old_cov)  # saved as given (guard); troll reads them detached
        inputs = [x.detach() for x in given]
        em, ec = _bound_value(eps_mean, "eps"), _bound_value(eps_cov, "eps_cov")
        # Full rows: the forward's factorisation is kept for the backward / JVP (no second one).
        saved = _g.empty_saved(inputs[0]) if cfg["full"] else None
        out_mean, out_cov, stats = _g._project(*inputs, em, ec, cfg["full"], cfg["split"], None, None,
                                               cfg["rtol"], cfg["atol"], cfg["max_iterations"], cfg["threads"],
                                               saved)
        if saved is None:
            saved = stats.values.new_empty((0,))
        ctx.save_for_backward(*given, out_mean, out_cov, stats.values, stats.counters, saved)
        ctx.save_for_forward(*inputs, out_mean, out_cov, stats.values, stats.counters, saved)
        ctx.cfg, ctx.eps = cfg, (em, ec)
        ctx.eps_shapes = tuple(e.shape if isinstance(e, torch.Tensor) else None for e in (eps_mean, eps_cov))
        ctx.bounds = tuple(e for e in (eps_mean, eps_cov) if isinstance(e, torch.Tensor))
        info["stats"] = stats
        return out_mean, out_cov

    @staticmethod
    def backward(ctx, grad_mean, grad_cov):  # type: ignore[override]
        mean, cov, old_mean, old_cov, out_mean, out_cov, values, counters, saved = ctx.saved_tensors
        cfg, needs = ctx.cfg, ctx.needs_input_grad
        want_old = needs[2] or needs[3]
        want_eps = (ctx.eps_shapes[0] is not None and needs[4]) or (ctx.eps_shapes[1] is not None and needs[5])
        not_batched(grad_mean, grad_cov)
        gm = torch.zeros_like(out_mean) if grad_mean is None else grad_mean.contiguous()
        gc = torch.zeros_like(out_cov) if grad_cov is None else grad_cov.contiguous()
        g = _g.project_backward(mean, cov, old_mean, old_cov, ctx.eps[0], ctx.eps[1], out_mean, out_cov,
                                GaussianStats(values, counters), gm, gc, full=cfg["full"], split=cfg["split"],
                                old=want_old, eps=want_eps, threads=cfg["threads"],
                                saved=saved if cfg["full"] else None)
        grad_in = [g[0], g[1], g[2] if needs[2] else None, g[3] if needs[3] else None]
        grad_eps_mean = grad_eps_cov = None
        if want_eps:
            # Joint: one bound (eps_mean and eps_cov are the same object); split: g[5] is d/d eps_mean.
            bound_grads = (g[4], g[4]) if not cfg["split"] else (g[5], g[4])
            shapes = ctx.eps_shapes
            if shapes[0] is not None and needs[4]:
                grad_eps_mean = bound_grads[0].sum().to(mean.dtype).reshape(shapes[0])
            if cfg["split"] and shapes[1] is not None and needs[5]:
                grad_eps_cov = bound_grads[1].sum().to(mean.dtype).reshape(shapes[1])
        out = guard("gaussian", (*grad_in, grad_eps_mean, grad_eps_cov),
                    (mean, cov, old_mean, old_cov, *ctx.bounds, grad_mean, grad_cov))
        return (*out, None, None)


    @staticmethod
    def jvp(ctx, t_mean, t_cov, t_old_mean, t_old_cov, t_eps_mean, t_eps_cov, _cfg, _info):  # type: ignore[override]
        mean, cov, old_mean, old_cov, out_mean, out_cov, values, counters, saved = ctx.saved_tensors
        cfg = ctx.cfg

        def bound(t):
            return 0.0 if t is None else float(t.detach().reshape(()).item())

        def tangent(t):
            return None if t is None else t.detach().contiguous()

        # Joint: the one bound sits in the eps_mean slot; split: eps_cov is ε_Σ, eps_mean is ε_μ.
        t_eps = bound(t_eps_cov) if cfg["split"] else bound(t_eps_mean)
        t_eps_mean = bound(t_eps_mean) if cfg["split"] else 0.0
        return _g.project_jvp(mean, cov, old_mean, old_cov, ctx.eps[0], ctx.eps[1], out_mean, out_cov,
                              GaussianStats(values, counters), tangent(t_mean), tangent(t_cov), tangent(t_old_mean),
                              tangent(t_old_cov), t_eps, t_eps_mean, full=cfg["full"], split=cfg["split"],
                              threads=cfg["threads"], saved=saved if cfg["full"] else None)


def _apply(mean, cov, old_mean, old_cov, eps_mean, eps_cov, full, split, return_stats, rtol, atol,
           max_iterations, threads):
    from . import _tensor

    mean, cov, old_mean, old_cov = (_tensor(x, n, "gaussian") for x, n in
                                    zip((mean, cov, old_mean, old_cov), ("mean", "cov", "old_mean", "old_cov")))
    cfg = dict(full=full, split=split, rtol=rtol, atol=atol, max_iterations=max_iterations, threads=threads)
    info: Dict[str, Any] = {}
    # Joint bounds pass one eps in both slots and return its gradient once (in the first).
    out_mean, out_cov = _Project.apply(mean, cov, old_mean, old_cov, eps_mean, eps_cov if split else 0.0, cfg,
                                       info)
    return (out_mean, out_cov, info["stats"]) if return_stats else (out_mean, out_cov)


def project_joint(mean: torch.Tensor, cov_chol: torch.Tensor, old_mean: torch.Tensor, old_cov_chol: torch.Tensor,
                  eps: Bound, *, return_stats: bool = False, rtol: float = 1e-11, atol: float = 0.0,
                  max_iterations: int = 100, threads: int = 0):
    """troll.gaussian.project_joint, differentiable: returns ``(mean*, cov_chol*)`` (and the
    GaussianStats with ``return_stats=True``)."""
    return _apply(mean, cov_chol, old_mean, old_cov_chol, eps, None, True, False, return_stats, rtol, atol,
                  max_iterations, threads)


def project_split(mean: torch.Tensor, cov_chol: torch.Tensor, old_mean: torch.Tensor, old_cov_chol: torch.Tensor,
                  eps_mean: Bound, eps_cov: Bound, *, return_stats: bool = False, rtol: float = 1e-11,
                  atol: float = 0.0, max_iterations: int = 100, threads: int = 0):
    """troll.gaussian.project_split, differentiable (also w.r.t. tensor bounds)."""
    return _apply(mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, True, True, return_stats, rtol,
                  atol, max_iterations, threads)


def project_joint_diag(mean: torch.Tensor, std: torch.Tensor, old_mean: torch.Tensor, old_std: torch.Tensor,
                       eps: Bound, *, return_stats: bool = False, rtol: float = 1e-11, atol: float = 0.0,
                       max_iterations: int = 100, threads: int = 0):
    """troll.gaussian.project_joint_diag, differentiable: returns ``(mean*, std*)``."""
    return _apply(mean, std, old_mean, old_std, eps, None, False, False, return_stats, rtol, atol,
                  max_iterations, threads)


def project_split_diag(mean: torch.Tensor, std: torch.Tensor, old_mean: torch.Tensor, old_std: torch.Tensor,
                       eps_mean: Bound, eps_cov: Bound, *, return_stats: bool = False, rtol: float = 1e-11,
                       atol: float = 0.0, max_iterations: int = 100, threads: int = 0):
    """troll.gaussian.project_split_diag, differentiable."""
    return _apply(mean, std, old_mean, old_std, eps_mean, eps_cov, False, True, return_stats, rtol, atol,
                  max_iterations, threads)
