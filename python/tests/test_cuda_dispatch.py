"""The Python side of the CUDA path, run without a GPU: every troll / troll.torch function routes
device arrays to troll._troll_cuda with its argument lists. A stand-in module takes the CUDA
extension's place; it checks each call's parameter names against the real _troll_cuda (when it
was built) and computes with the host extension, so the routed results must equal the host
path's bit for bit. What it cannot check — the kernels, streams, device memory — is
test_cuda.py's, on a GPU."""

from __future__ import annotations

import re

import pytest
import torch

import troll
import troll.torch as tt
from troll import _core
from troll._cpu import kernels as _troll  # the CPU build the host path runs

_FORWARDS = {"trust_region_forward", "sparse_trust_region_forward", "ppo_clip_forward", "dppo_forward"}


def _parameters(fn) -> list:
    head = fn.__doc__.splitlines()[0]
    return re.findall(r"(\w+):", head[head.index("(") + 1:head.rindex(")")])


def _cuda_parameters(name: str) -> list:
    """What _troll_cuda.<name> takes: the host function's parameters, `threads` replaced by the
    stream and the checked flag (and the forwards' device metrics before them)."""
    host = [p for p in _parameters(getattr(_troll, name)) if p != "threads"]
    return host + (["metrics"] if name in _FORWARDS else []) + ["stream", "checked"]


class _StandIn:
    """The CUDA extension's calls, computed by the host extension."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        host = getattr(_troll, name)

        def call(*args):
            self.calls.append(name)
            assert len(args) == len(_cuda_parameters(name)), name
            stream, checked = args[-2:]
            assert stream == 12345 and checked is True
            if name in _FORWARDS:
                metrics = args[-3]
                values = host(*args[:-3], 0)
                as_int = metrics.view(torch.int64)
                for i, field in enumerate(_core.METRIC_FIELDS):
                    if field in ("tokens", "sequences"):
                        as_int[i] = values[field]
                    else:
                        metrics[i] = values[field]
                return None
            return host(*args[:-2], 0)

        return call


@pytest.mark.skipif(_core._troll_cuda is None, reason="troll built without the CUDA extension")
@pytest.mark.parametrize("name", sorted(["log_softmax", "kl", "kl_backward", "project", "project_backward", "sparsify",
                                         "sparsify_backward", "align", "kl_sparse", "project_sparse",
                                         "project_sparse_backward", *_FORWARDS, "trust_region_backward",
                                         "sparse_trust_region_backward", "ppo_clip_backward", "dppo_backward",
                                         "sparsify_shard", "sparsify_finalize", "sparsify_tail_sums",
                                         "sparsify_shard_backward"]))
def test_the_cuda_extension_takes_the_host_arguments_with_a_stream(name):
    assert _parameters(getattr(_core._troll_cuda, name)) == _cuda_parameters(name)


def _route(monkeypatch) -> _StandIn:
    """From here on every array counts as a CUDA array, served by the stand-in."""
    stand_in = _StandIn()
    monkeypatch.setattr(_core, "_on_cuda", lambda x: True)
    monkeypatch.setattr(_core, "_cuda_call", lambda frame, x, name: (stand_in, 12345))
    return stand_in


def _batch(seed=3, rows=6, vocab=40):
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 1.5
    old = new + 0.8 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    return new, old, tokens, adv, mask


_LOSSES = {
    "troll_dense": lambda n, o, t, a, m: tt.trust_region_loss(n, o, t, a, 0.05, mask=m, return_metrics=True),
    "troll_sparse": lambda n, o, t, a, m: tt.trust_region_loss(
        n, tt.sparsify(o, k=6, sampled=t), t, a, 0.05, mask=m, new_k=5, return_metrics=True),
    "ppo_clip": lambda n, o, t, a, m: tt.ppo_clip_loss(n, o, t, a, mask=m, return_metrics=True),
    "dppo": lambda n, o, t, a, m: tt.dppo_loss(n, o, t, a, "topk_kl", top_k=4, mask=m, return_metrics=True),
}


def _run_loss(name, new, rest):
    x = new.clone().requires_grad_(True)
    loss, metrics = _LOSSES[name](x, *rest)
    (2.5 * loss).backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_losses_through_the_cuda_route_equal_the_host_path(name, monkeypatch):
    new, *rest = _batch()
    want = _run_loss(name, new, rest)
    stand_in = _route(monkeypatch)
    got = _run_loss(name, new, rest)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] == want[2]
    assert any(c.endswith("_forward") for c in stand_in.calls) and any(c.endswith("_backward") for c in stand_in.calls)


def test_sparse_projection_through_the_cuda_route_equals_the_host_path(monkeypatch):
    new, old, tokens, *_ = _batch(seed=4)
    old_rows = tt.sparsify(old, k=6, delta=1e-4)
    eps = torch.tensor(0.02, dtype=torch.float64)
    w = torch.randn(6, 6 + 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run():
        x, e = new.clone().requires_grad_(True), eps.clone().requires_grad_(True)
        rows = tt.project_sparse(x, old_rows, e, sampled=tokens, new_k=7)
        lp = torch.where(torch.isfinite(rows.log_probs), rows.log_probs, torch.zeros_like(rows.log_probs))
        ((lp * w[:, : lp.shape[-1]]).sum() + 0.3 * rows.log_remainder.sum()).backward()
        kl = troll.kl_sparse(troll.align(new, old_rows))
        return rows.log_probs.detach(), x.grad, e.grad, kl, troll.kl_backward(new, old, torch.ones(6).double())

    want = run()
    stand_in = _route(monkeypatch)
    got = run()
    for a, b in zip(got[:4], want[:4]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(got[4], want[4]))
    assert {"sparsify", "align", "project_sparse", "project_sparse_backward", "sparsify_backward",
            "kl_sparse", "kl_backward"} <= set(stand_in.calls)


def _sharded(logits, cuts, tokens, k=5, delta=1e-4):
    """The two-stage sharded sparsify of ``logits`` cut at ``cuts`` and its shard backward."""
    vocab = logits.shape[-1]
    shards = [logits[:, a:b].contiguous() for a, b in zip(cuts[:-1], cuts[1:])]
    states = torch.stack([troll.sparsify_shard(z, a, vocab, k, delta, tokens) for z, a in zip(shards, cuts)])
    rows, _, tail_max = troll.sparsify_finalize(states, vocab, k, delta, sampled=True, dtype="float64",
                                                return_tail_max=True)
    sums = torch.stack([troll.sparsify_tail_sums(z, a, rows, tail_max) for z, a in zip(shards, cuts)])
    rows, log_sums = troll.sparsify_finalize(states, vocab, k, delta, sampled=True, dtype="float64", tail_sums=sums)
    g = torch.linspace(-1.0, 1.0, rows.log_probs.numel(), dtype=torch.float64).reshape(rows.log_probs.shape)
    g_r = torch.linspace(0.5, -0.5, rows.log_remainder.numel(), dtype=torch.float64)
    grads = [troll.sparsify_shard_backward(z, a, rows, (g, g_r), log_sums) for z, a in zip(shards, cuts)]
    return states, rows, log_sums, torch.cat(grads, dim=-1)


def test_shard_functions_through_the_cuda_route_equal_the_host_path(monkeypatch):
    new, _, tokens, *_ = _batch(seed=5, vocab=40)
    tokens = tokens.to(torch.int32)
    cuts = [0, 9, 23, 40]
    want = _sharded(new, cuts, tokens)
    whole = troll.sparsify(new, k=5, delta=1e-4, sampled=tokens)
    for a, b in zip(want[1][:4], whole[:4]):  # the host's two stages: the whole row's bits
        assert torch.equal(a, b)
    stand_in = _route(monkeypatch)
    got = _sharded(new, cuts, tokens)
    # (states are compared through what they finalise to: their padding bytes are unspecified)
    assert got[0].shape == want[0].shape and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert all(torch.equal(a, b) for a, b in zip(got[1][:4], want[1][:4]))
    assert {"sparsify_shard", "sparsify_finalize", "sparsify_tail_sums", "sparsify_shard_backward"} <= set(
        stand_in.calls)


def test_distributed_sparsify_through_the_cuda_route_equals_the_host_path(monkeypatch, tmp_path):
    """troll.torch.distributed on one gloo rank: its forward and backward take the CUDA route."""
    import torch.distributed as dist

    from troll.torch import distributed as td

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    new, _, tokens, *_ = _batch(seed=6, vocab=40)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def run():
            x = new.clone().requires_grad_(True)
            rows = td.sparsify(x, 0, 40, k=5, delta=1e-4, sampled=tokens)
            lp = torch.where(torch.isfinite(rows.log_probs), rows.log_probs, torch.zeros_like(rows.log_probs))
            (lp.sum() + 0.5 * rows.log_remainder.sum()).backward()
            return rows, x.grad

        want = run()
        stand_in = _route(monkeypatch)
        got = run()
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(got[0][:4], want[0][:4])) and torch.equal(got[1], want[1])
    assert {"sparsify_shard", "sparsify_finalize", "sparsify_tail_sums", "sparsify_shard_backward"} <= set(
        stand_in.calls)


def test_metrics_dict_reads_the_device_layout():
    buf = torch.zeros(len(_core.METRIC_FIELDS), dtype=torch.float64)
    buf[0] = -0.25
    buf.view(torch.int64)[1] = 7
    buf[6] = 0.5
    m = _core.metrics_dict(buf)
    assert m["loss"] == -0.25 and m["tokens"] == 7 and m["sequences"] == 0 and m["kl_after_mean"] == 0.5
    assert isinstance(m["tokens"], int) and list(m) == list(_core.METRIC_FIELDS)
