"""troll.gaussian and troll.torch.gaussian on CUDA tensors against the host path (a GPU is needed;
skips without one and without the extension): the four projections at d = 5 (one warp per row)
and d = 40 (one block per row with a workspace), their KL, gradients through troll.torch.gaussian
and the JVP with a saved factorisation; a bad row raises the host's error naming it."""

from __future__ import annotations

import pytest
import torch

import troll
import troll.gaussian as tg
import troll.torch.gaussian as ttg
from troll import _core

needs_gpu = pytest.mark.skipif(_core._troll_cuda is None or not (_core.cuda_available() and torch.cuda.is_available()),
                               reason="no CUDA extension or no GPU")


def _rows(d, rows=6, seed=0, full=True):
    g = torch.Generator().manual_seed(seed)

    def factor():
        l = torch.tril(0.3 * torch.randn(rows, d, d, generator=g, dtype=torch.float64) / d ** 0.5, -1)
        return l + torch.diag_embed(torch.exp(0.3 * torch.randn(rows, d, generator=g, dtype=torch.float64)))

    mean, old_mean = torch.randn(rows, d, generator=g, dtype=torch.float64), torch.randn(rows, d, generator=g,
                                                                                        dtype=torch.float64)
    cov, old_cov = factor(), factor()
    if not full:
        cov, old_cov = torch.diagonal(cov, dim1=-2, dim2=-1).clone(), torch.diagonal(old_cov, dim1=-2, dim2=-1).clone()
    return mean, cov, old_mean, old_cov


def _close(a, b, rtol=1e-9):
    a, b = a.cpu(), b.cpu()
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max() <= 1e-12 + rtol * scale


@needs_gpu
@pytest.mark.parametrize("d", [5, 40])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_gaussian_on_cuda_matches_the_host(d, full, split):
    host = _rows(d, full=full)
    dev = [x.cuda() for x in host]
    bounds = (0.03, 0.05) if split else (0.05,)
    if full:
        fn = ttg.project_split if split else ttg.project_joint
    else:
        fn = ttg.project_split_diag if split else ttg.project_joint_diag
    w = [torch.randn_like(host[0]), torch.randn_like(host[1])]

    def run(xs, ws):
        xs = [x.clone().requires_grad_(True) for x in xs]
        m, c = fn(*xs, *bounds)
        ((m * ws[0]).sum() + (c * ws[1]).sum()).backward()
        return [m.detach(), c.detach(), *[x.grad for x in xs]]

    for a, b in zip(run(dev, [x.cuda() for x in w]), run(host, w)):
        _close(a, b)
    kl_fn = tg.kl if full else tg.kl_diag
    _close(kl_fn(*dev), kl_fn(*host))


@needs_gpu
def test_gaussian_jvp_on_cuda_with_a_saved_factorisation():
    host = _rows(40, rows=4, seed=3)
    dev = [x.cuda() for x in host]
    t = [torch.randn_like(host[0]), torch.tril(torch.randn_like(host[1]))]

    def run(xs, ts):
        saved = tg.empty_saved(xs[0])
        m, c, st = tg.project_joint(*xs, 0.05, saved=saved)
        return tg.project_jvp(*xs, 0.05, 0.05, m, c, st, ts[0], ts[1], full=True, split=False, saved=saved)

    for a, b in zip(run(dev, [x.cuda() for x in t]), run(host, t)):
        _close(a, b)


@needs_gpu
def test_a_bad_row_on_cuda_raises_the_host_error_naming_it():
    mean, cov, old_mean, old_cov = [x.cuda() for x in _rows(40, rows=5)]
    cov[3, 2, 2] = -1.0
    with pytest.raises(troll.DomainError) as info:
        tg.project_joint(mean, cov, old_mean, old_cov, 0.05)
    assert info.value.row == 3
