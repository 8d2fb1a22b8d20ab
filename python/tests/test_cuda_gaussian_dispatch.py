"""The Python side of the CUDA Gaussian path, run without a GPU: troll.gaussian and
troll.torch.gaussian route device arrays to troll._troll_cuda's gaussian_* functions with the host
functions' argument lists, ``threads`` replaced by the stream and the checked flag (``saved`` stays
a keyword). A stand-in takes the CUDA extension's place and computes with the host extension, so
the routed results must equal the host path's bit for bit; where _troll_cuda was built, its
parameter names are checked too. The kernels themselves are tests/cuda's and test_cuda.py's."""

from __future__ import annotations

import re

import pytest
import torch

import troll.gaussian as tg
import troll.torch.gaussian as ttg
from troll import _core
from troll._cpu import kernels as _troll  # the CPU build the host path runs

_NAMES = ["gaussian_project", "gaussian_project_backward", "gaussian_project_jvp", "gaussian_kl"]


def _parameters(fn) -> list:
    head = fn.__doc__.splitlines()[0]
    return re.findall(r"(\w+):", head[head.index("(") + 1:head.rindex(")")])


def _cuda_parameters(name: str) -> list:
    host = _parameters(getattr(_troll, name))
    cut = host.index("threads")
    return host[:cut] + ["stream", "checked"] + host[cut + 1:]


@pytest.mark.skipif(_core._troll_cuda is None, reason="troll built without the CUDA extension")
@pytest.mark.parametrize("name", _NAMES)
def test_the_cuda_extension_takes_the_host_arguments_with_a_stream(name):
    assert _parameters(getattr(_core._troll_cuda, name)) == _cuda_parameters(name)


class _StandIn:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        host = getattr(_troll, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            params = _cuda_parameters(name)
            assert len(args) + len(kwargs) <= len(params), name
            assert set(kwargs) <= {"saved"}, name
            assert len(args) == params.index("checked") + 1, name
            stream, checked = args[-2:]
            assert stream == 12345 and checked is True
            return host(*args[:-2], 0, **kwargs)

        return call


def _route(monkeypatch) -> _StandIn:
    stand_in = _StandIn()
    monkeypatch.setattr(_core, "_on_cuda", lambda x: True)
    monkeypatch.setattr(_core, "_cuda_call", lambda frame, x, name: (stand_in, 12345))
    return stand_in


def _full(d=5, rows=4, seed=2):
    g = torch.Generator().manual_seed(seed)

    def factor():
        l = torch.tril(0.3 * torch.randn(rows, d, d, generator=g, dtype=torch.float64), -1)
        return l + torch.diag_embed(torch.exp(0.3 * torch.randn(rows, d, generator=g, dtype=torch.float64)))

    return (torch.randn(rows, d, generator=g, dtype=torch.float64), factor(),
            torch.randn(rows, d, generator=g, dtype=torch.float64), factor())


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("full", [True, False])
def test_gaussian_through_the_cuda_route_equals_the_host_path(split, full, monkeypatch):
    mean, chol, old_mean, old_chol = _full()
    cov = chol if full else torch.diagonal(chol, dim1=-2, dim2=-1).clone()
    old_cov = old_chol if full else torch.diagonal(old_chol, dim1=-2, dim2=-1).clone()
    w_mean, w_cov = torch.randn_like(mean), torch.randn_like(cov)

    def run():
        xs = [t.clone().requires_grad_(True) for t in (mean, cov, old_mean, old_cov)]
        if full:
            fn = ttg.project_split if split else ttg.project_joint
        else:
            fn = ttg.project_split_diag if split else ttg.project_joint_diag
        bounds = (0.03, 0.05) if split else (0.05,)
        m, c = fn(*xs, *bounds)
        ((m * w_mean).sum() + (c * w_cov).sum()).backward()
        kl = (tg.kl if full else tg.kl_diag)(mean, cov, old_mean, old_cov)
        # the JVP directly, with a saved factorisation for full rows
        saved = tg.empty_saved(mean) if full else None
        proj = (tg.project_split if split else tg.project_joint) if full else (
            tg.project_split_diag if split else tg.project_joint_diag)
        kwargs = {"saved": saved} if full else {}
        om, oc, st = proj(mean, cov, old_mean, old_cov, *bounds, **kwargs)
        e = bounds[-1]
        jm, jc = tg.project_jvp(mean, cov, old_mean, old_cov, bounds[0], e, om, oc, st, w_mean, w_cov,
                                tangent_eps=0.01, full=full, split=split, saved=saved)
        return [m.detach(), c.detach(), *[x.grad for x in xs], kl, om, oc, st.values, st.counters, jm, jc]

    want = run()
    stand_in = _route(monkeypatch)
    got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert set(_NAMES) <= set(stand_in.calls)
