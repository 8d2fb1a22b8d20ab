"""A plain-PyTorch float64 reference for troll's Gaussian projections, written independently of
troll (no factorised solve, no shared code): explicit covariances and precisions through
eigendecompositions (torch.linalg.eigh), the textbook Gaussian KL, and t* by bisection on [0, 1].
It is differentiable: after the bisection one Newton step from the (detached) root is taken inside
the autograd graph, whose derivative at the root is the implicit-function-theorem one, so
autograd through this oracle gives reference gradients for troll's analytic backward."""

from __future__ import annotations

from typing import Tuple

import torch


def _spd_inverse_logdet(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    w, v = torch.linalg.eigh(0.5 * (a + a.transpose(-1, -2)))
    return (v / w.unsqueeze(-2)) @ v.transpose(-1, -2), torch.log(w).sum(-1)


def gaussian_kl(m: torch.Tensor, s: torch.Tensor, mo: torch.Tensor, so: torch.Tensor,
                mean_part: bool = True) -> torch.Tensor:
    """KL(N(m, s) || N(mo, so)) per row (covariances, not factors); mean_part=False drops the
    Mahalanobis term (the covariance part of the split bound)."""
    so_inv, so_logdet = _spd_inverse_logdet(so)
    _, s_logdet = _spd_inverse_logdet(s)
    d = m.shape[-1]
    kl = 0.5 * ((so_inv * s.transpose(-1, -2)).sum((-1, -2)) - d + so_logdet - s_logdet)
    if mean_part:
        delta = (mo - m).unsqueeze(-1)
        kl = kl + 0.5 * (delta.transpose(-1, -2) @ so_inv @ delta).squeeze(-1).squeeze(-1)
    return kl


def _member(t, lam_new, lam_old, h_new, h_old):
    tt = t.unsqueeze(-1).unsqueeze(-1)
    lam = tt * lam_new + (1 - tt) * lam_old
    cov, _ = _spd_inverse_logdet(lam)
    h = t.unsqueeze(-1) * h_new + (1 - t.unsqueeze(-1)) * h_old
    return (cov @ h.unsqueeze(-1)).squeeze(-1), cov


def project(mean, chol, old_mean, old_chol, eps_mean, eps_cov=None, split=False, iterations=200):
    """(mean*, chol*, t) of the joint (split=False, bound eps_mean) or split projection of
    N(mean, chol cholᵀ) against N(old_mean, old_chol old_cholᵀ), float64. Bounds may be tensors."""
    cov_new = chol @ chol.transpose(-1, -2)
    cov_old = old_chol @ old_chol.transpose(-1, -2)
    lam_new, _ = _spd_inverse_logdet(cov_new)
    lam_old, _ = _spd_inverse_logdet(cov_old)
    h_new = (lam_new @ mean.unsqueeze(-1)).squeeze(-1)
    h_old = (lam_old @ old_mean.unsqueeze(-1)).squeeze(-1)
    eps = eps_cov if split else eps_mean

    def excess(t):
        m, s = _member(t, lam_new, lam_old, h_new, h_old)
        if split:
            return gaussian_kl(old_mean, s, old_mean, cov_old, mean_part=False) - eps
        return gaussian_kl(m, s, old_mean, cov_old) - eps

    rows = mean.shape[:-1]
    with torch.no_grad():
        active = excess(torch.ones(rows, dtype=torch.float64)) > 0
        lo = torch.zeros(rows, dtype=torch.float64)
        hi = torch.ones(rows, dtype=torch.float64)
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            over = excess(mid) > 0
            hi = torch.where(over, mid, hi)
            lo = torch.where(over, lo, mid)
        t0 = torch.where(active, 0.5 * (lo + hi), torch.ones_like(lo))
    t_leaf = t0.clone().requires_grad_(True)
    f = excess(t_leaf)
    (df,) = torch.autograd.grad(f.sum(), t_leaf, create_graph=True)
    newton = t0 - f / df
    t = torch.where(active, newton, torch.ones_like(newton))
    m_t, s_t = _member(t, lam_new, lam_old, h_new, h_old)
    if split:
        delta = mean - old_mean
        so_inv, _ = _spd_inverse_logdet(cov_old)
        mk = 0.5 * (delta.unsqueeze(-2) @ so_inv @ delta.unsqueeze(-1)).squeeze(-1).squeeze(-1)
        kappa = torch.where(mk > eps_mean, torch.sqrt(eps_mean / torch.clamp(mk, min=1e-300)),
                            torch.ones_like(mk))
        m_t = old_mean + kappa.unsqueeze(-1) * delta
    return m_t, torch.linalg.cholesky(s_t), t


def random_factor(n: int, d: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Lower Cholesky factors with a positive diagonal, well conditioned."""
    a = torch.randn(n, d, d, dtype=torch.float64, generator=gen) * (scale / d ** 0.5)
    diag = torch.exp(0.3 * torch.randn(n, d, dtype=torch.float64, generator=gen))
    return torch.tril(a, -1) + torch.diag_embed(diag)
