"""The CUDA extension (troll._troll_cuda): the same Python API on torch CUDA tensors, enqueued on
the caller's current stream, checked against troll's CPU results. Every test that needs a GPU
skips without one (and without the extension); the import and the device checks run everywhere
the extension was built."""

from __future__ import annotations

import pytest
import torch

import troll
import troll.torch
from troll import _core

needs_extension = pytest.mark.skipif(_core._troll_cuda is None, reason="troll built without the CUDA extension")
needs_gpu = pytest.mark.skipif(not (_core.cuda_available() and torch.cuda.is_available()),
                               reason="no CUDA device (or no CUDA extension)")


@needs_extension
def test_extension_imports_without_a_gpu_and_rejects_host_arrays():
    cuda = _core._troll_cuda
    assert cuda.cuda is True
    assert cuda.device_count() >= 0
    x = torch.randn(3, 10)
    with pytest.raises(troll.ShapeError, match="not in CUDA device memory"):
        cuda.log_softmax(x, torch.empty_like(x), 0)


def _case(dtype, rows=(4, 3), vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(rows + (vocab,), generator=g, dtype=torch.float64) * 2
    old = new + 0.7 * torch.randn(rows + (vocab,), generator=g, dtype=torch.float64)
    return new.to(dtype), old.to(dtype)


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-11)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_calls_match_the_cpu_on_the_current_stream(dtype):
    new, old = _case(dtype)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # troll enqueues on torch.cuda.current_stream()
        d_new, d_old = new.cuda(), old.cuda()
        lp = troll.log_softmax(d_new)
        kl = troll.kl(d_new, d_old)
        proj, stats = troll.project(d_new, d_old, 0.05)
    stream.synchronize()
    assert lp.is_cuda and kl.is_cuda and proj.is_cuda and stats.t.is_cuda
    torch.testing.assert_close(lp.cpu(), troll.log_softmax(new), **_tol(dtype))
    torch.testing.assert_close(kl.cpu(), troll.kl(new, old), **_tol(dtype))
    cpu_proj, cpu_stats = troll.project(new, old, 0.05)
    torch.testing.assert_close(proj.cpu(), cpu_proj, **_tol(dtype))
    assert torch.equal(stats.status.cpu(), cpu_stats.status)
    torch.testing.assert_close(stats.kl_after.cpu(), cpu_stats.kl_after, **_tol(torch.float32))


@needs_gpu
def test_autograd_through_project_on_cuda_matches_the_cpu():
    new, old = _case(torch.float64, rows=(3,), vocab=50, seed=1)
    eps = torch.tensor(0.05, dtype=torch.float64)
    grads = []
    for device in ("cpu", "cuda"):
        a = new.to(device).requires_grad_(True)
        b = old.to(device).requires_grad_(True)
        e = eps.to(device).requires_grad_(True)
        w = torch.linspace(-1, 1, 50, dtype=torch.float64, device=device)
        (troll.torch.project(a, b, e) * w).sum().backward()
        grads.append((a.grad.cpu(), b.grad.cpu(), e.grad.cpu()))
    for g_cpu, g_cuda in zip(*grads):
        torch.testing.assert_close(g_cuda, g_cpu, rtol=1e-8, atol=1e-10)


@needs_gpu
def test_gradcheck_on_cuda():
    new, old = _case(torch.float64, rows=(2,), vocab=12, seed=2)
    a = new.cuda().requires_grad_(True)
    b = old.cuda().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: troll.torch.project(x, y, 0.05), (a, b), atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sparsify_reads_16_bit_logits(dtype):
    new, _ = _case(torch.float32, vocab=3000, seed=3)
    logits = new.to(dtype)
    sampled = torch.randint(0, 3000, new.shape[:-1], dtype=torch.int32)
    rows = troll.torch.sparsify(logits.cuda(), k=16, delta=1e-4, sampled=sampled.cuda())
    torch.cuda.synchronize()
    # The CPU reference ranks the same values (16-bit logits widened exactly to float).
    ref_in = logits.to(torch.float64 if dtype == torch.float64 else torch.float32)
    ref = troll.torch.sparsify(ref_in, k=16, delta=1e-4, sampled=sampled)
    assert rows.log_probs.dtype == ref.log_probs.dtype
    assert torch.equal(rows.counts.cpu(), ref.counts)
    assert torch.equal(rows.indices.cpu(), ref.indices)
    valid = ref.counts[..., None] > torch.arange(ref.indices.shape[-1])
    tol = _tol(ref.log_probs.dtype)
    torch.testing.assert_close(torch.where(valid, rows.log_probs.cpu(), 0), torch.where(valid, ref.log_probs, 0), **tol)
    torch.testing.assert_close(rows.log_remainder.cpu(), ref.log_remainder, **tol)


@needs_gpu
def test_bad_rows_raise_the_cpu_exceptions_in_checked_mode():
    new, old = _case(torch.float32)
    new[2, 1, 7] = float("nan")
    with pytest.raises(troll.DomainError) as info:
        troll.project(new.cuda(), old.cuda(), 0.05)
    assert info.value.row == 7
    with pytest.raises(troll.ShapeError, match="different CUDA devices|not in CUDA"):
        troll.kl(new.cuda(), old)  # one operand on the host
