"""Plain-PyTorch float64 implementations of the maths troll computes (math.md), written
independently of troll for the tests to compare against: KL, the projection by bisection on
log eta (t = 1 / (1 + eta)), and the three training losses."""

from __future__ import annotations

import torch


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def project(new_logits: torch.Tensor, old_logits: torch.Tensor, eps: float, iterations: int = 200):
    """(log pi*, t) per row: log_softmax(z_old + t (z_new - z_old)) with KL(pi_t || q) = eps,
    or the new row itself when it is inside the ball. Bisection on log eta in [-40, 40]."""
    zn, zo = new_logits.double(), old_logits.double()
    lq = torch.log_softmax(zo, -1)

    def kl_at(t):
        lpt = torch.log_softmax(zo + t.unsqueeze(-1) * (zn - zo), -1)
        return (lpt.exp() * (lpt - lq)).sum(-1), lpt

    shape = zn.shape[:-1]
    lo = torch.full(shape, -40.0, dtype=torch.float64)  # small eta: t near 1, KL large
    hi = torch.full(shape, 40.0, dtype=torch.float64)   # large eta: t near 0, KL near 0
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        k, _ = kl_at(1.0 / (1.0 + mid.exp()))
        too_far = k > eps
        lo = torch.where(too_far, mid, lo)
        hi = torch.where(too_far, hi, mid)
    t = 1.0 / (1.0 + hi.exp())
    inside = kl(zn, zo) <= eps
    t = torch.where(inside, torch.ones_like(t), t)
    return kl_at(t)[1], t


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    w = torch.ones_like(token_loss) if mask is None else mask.double()
    return (w * token_loss).sum() / w.sum()


def trust_region_loss(new_logits, old_logits, tokens, advantages, eps, alpha, mask=None):
    """-(pi*_a / q_a) A + alpha KL(p_new || stopgrad(pi*)), pi* through the bisection (so the
    ratio term is differentiable by autograd through the interpolation at fixed t... see the test
    for how the gradient is compared)."""
    log_pi, _ = project(new_logits, old_logits, eps)
    lq = torch.log_softmax(old_logits.double(), -1)
    lp = torch.log_softmax(new_logits.double(), -1)
    a = tokens.unsqueeze(-1)
    ratio = (log_pi.gather(-1, a) - lq.gather(-1, a)).squeeze(-1).exp()
    reg = (lp.exp() * (lp - log_pi.detach())).sum(-1)
    return aggregate(-ratio * advantages.double() + alpha * reg, mask)


def ppo_clip_loss(new_logits, old_logits, tokens, advantages, clip_low=0.2, clip_high=0.2, mask=None):
    a = tokens.unsqueeze(-1)
    lp = torch.log_softmax(new_logits.double(), -1).gather(-1, a).squeeze(-1)
    lq = torch.log_softmax(old_logits.double(), -1).gather(-1, a).squeeze(-1)
    r = (lp - lq).exp()
    adv = advantages.double()
    loss = -torch.minimum(r * adv, r.clamp(1 - clip_low, 1 + clip_high) * adv)
    return aggregate(loss, mask)


def dppo_binary_tv_loss(new_logits, old_logits, tokens, advantages, delta=0.15, mask=None):
    a = tokens.unsqueeze(-1)
    p = torch.softmax(new_logits.double(), -1).gather(-1, a).squeeze(-1)
    q = torch.softmax(old_logits.double(), -1).gather(-1, a).squeeze(-1)
    adv = advantages.double()
    drop = ((adv > 0) & (p > q) & ((p - q).abs() > delta)) | ((adv < 0) & (p < q) & ((p - q).abs() > delta))
    loss = -(~drop).double() * (p / q) * adv
    return aggregate(loss, mask)


def make_logits(gen: torch.Generator, *shape, scale: float = 2.0, dtype=torch.float64) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)
