"""The CUDA extension (troll._troll_cuda): the same Python API on torch CUDA tensors, enqueued on
the caller's current stream, checked against troll's CPU results. Every test that needs a GPU
skips without one (and without the extension); the import and the device checks run everywhere
the extension was built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
        # Fresh leaves on each device: .to("cpu") of a CPU tensor is the tensor itself, so
        # requires_grad_ on it would make the CUDA copies non-leaves (their .grad stays None).
        a = new.detach().to(device).requires_grad_(True)
        b = old.detach().to(device).requires_grad_(True)
        e = eps.detach().to(device).requires_grad_(True)
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


# Checked-mode throws on the device, each in a child process: a crash there (the first H100 run
# died with SIGSEGV inside troll.project on a NaN row) fails one case with its output (and a gdb
# backtrace where gdb is installed) instead of killing the whole pytest run. The cases tell the
# possible causes apart: a host check thrown in the nvcc unit with the GIL released before any
# kernel (eps), the device report of a bad row on the legacy default stream and on a side stream,
# with and without the module's stats buffer (project / kl).
_CHECKED_PRELUDE = """
import torch, troll
g = torch.Generator().manual_seed(0)
new = torch.randn(4, 3, 1000, generator=g, dtype=torch.float64) * 2
old = new + 0.7 * torch.randn(4, 3, 1000, generator=g, dtype=torch.float64)
def expect(cls, row, call, match):
    try:
        call()
    except cls as e:
        assert e.row == row, (e.row, str(e))
        assert match in str(e), str(e)
        print("raised", cls.__name__, e.row, str(e), flush=True)
        return
    raise AssertionError("no " + cls.__name__)
"""

_CHECKED_CASES = {
    "eps_host_check": """
expect(troll.DomainError, None, lambda: troll.project(new.float().cuda(), old.float().cuda(), -1.0), "eps")
""",
    "nan_project_default_stream_float32": """
new[2, 1, 7] = float("nan")
expect(troll.DomainError, 7, lambda: troll.project(new.float().cuda(), old.float().cuda(), 0.05), "NaN at token 7")
""",
    "nan_project_side_stream_float64": """
new[2, 1, 7] = float("nan")
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    expect(troll.DomainError, 7, lambda: troll.project(new.cuda(), old.cuda(), 0.05), "NaN at token 7")
""",
    "nan_kl_default_stream_float32": """
new[2, 1, 7] = float("nan")
expect(troll.DomainError, 7, lambda: troll.kl(new.float().cuda(), old.float().cuda()), "NaN at token 7")
""",
    "one_operand_on_the_host": """
expect(troll.ShapeError, None, lambda: troll.kl(new.float().cuda(), old.float()), "CUDA")
""",
}


def _run_child(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    argv = [sys.executable, "-X", "faulthandler", "-c", code]
    child = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    report = f"exit status {child.returncode}\n{child.stdout}\n{child.stderr}"
    if child.returncode < 0 and shutil.which("gdb"):  # killed by a signal: where, in C
        trace = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *argv], env=env,
                               capture_output=True, text=True, timeout=300)
        start = max(0, trace.stdout.find("received signal"))
        report += "\ngdb:\n" + trace.stdout[start:start + 8000]
    return child.returncode, report


@needs_gpu
@pytest.mark.parametrize("case", sorted(_CHECKED_CASES))
def test_bad_rows_raise_the_cpu_exceptions_in_checked_mode(case):
    status, report = _run_child(_CHECKED_PRELUDE + _CHECKED_CASES[case])
    assert status == 0, report
    assert "raised" in report, report


# ---- The rest of the API on CUDA tensors: kl_backward, the sparse projection, the losses ----
# Each runs the same troll.torch call on CPU and CUDA tensors (the CUDA one on a side stream) and
# compares values and gradients; gradcheck in float64 runs on the CUDA tensors themselves.


def _loss_case(seed, rows=6, vocab=24, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 1.5
    old = new + 0.8 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.arange(rows) % 3 != 1).to(torch.float64)
    return new.to(dtype), old.to(dtype), tokens, adv.to(dtype), mask.to(dtype)


def _on_both(fn, *tensors):
    """fn(*tensors) on the host and on the GPU (on a side stream): (value, gradient of the first
    tensor) for each, the CUDA ones moved to the host."""
    out = []
    for device in ("cpu", "cuda"):
        stream = torch.cuda.Stream() if device == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            args = [t.to(device) for t in tensors]
            x = args[0].clone().requires_grad_(True)
            value = fn(x, *args[1:])
            value.backward()
        if stream is not None:
            stream.synchronize()
            assert value.is_cuda and x.grad.is_cuda
        out.append((value.detach().cpu(), x.grad.cpu()))
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_backward_on_cuda_matches_the_cpu(dtype):
    p, q = _case(dtype, rows=(5,), vocab=300, seed=4)
    g = torch.linspace(-1, 2, 5, dtype=dtype)
    want = troll.kl_backward(p, q, g)
    got = troll.kl_backward(p.cuda(), q.cuda(), g.cuda())
    for a, b in zip(got, want):
        assert a.is_cuda
        torch.testing.assert_close(a.cpu(), b, **_tol(dtype))


def _separated(seed, rows, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_project_sparse_on_cuda_matches_the_cpu(dtype):
    new = _separated(20, 5, 400).to(dtype)
    old = (new + 0.5 * _separated(21, 5, 400)).to(dtype)
    old_rows = troll.torch.sparsify(old, k=12, delta=1e-4)
    d_old_rows = troll.SparseRows(*(a.cuda() for a in old_rows[:4]), old_rows.vocab)
    w = torch.randn(5, old_rows.indices.shape[-1] + 8, dtype=dtype)

    def loss(n, rows_, weights):
        out = troll.torch.project_sparse(n, rows_, 0.02, new_k=8, new_delta=1e-4)
        lp = torch.where(torch.isfinite(out.log_probs), out.log_probs, torch.zeros_like(out.log_probs))
        return (lp * weights[:, : lp.shape[-1]]).sum() + 0.3 * out.log_remainder.sum()

    (v_cpu, g_cpu), (v_cuda, g_cuda) = [
        pair for pair in _on_both(lambda n, weights: loss(n, old_rows if not n.is_cuda else d_old_rows, weights),
                                  new, w)]
    tol = _tol(dtype)
    torch.testing.assert_close(v_cuda, v_cpu, **tol)
    torch.testing.assert_close(g_cuda, g_cpu, **tol)
    # The forward's rows themselves: the same supports, values within the type's tolerance.
    rows_cpu, st_cpu = troll.torch.project_sparse(new, old_rows, 0.02, new_k=8, new_delta=1e-4, return_stats=True)
    rows_cuda, st_cuda = troll.torch.project_sparse(new.cuda(), d_old_rows, 0.02, new_k=8, new_delta=1e-4,
                                                    return_stats=True)
    assert torch.equal(rows_cuda.indices.cpu(), rows_cpu.indices)
    assert torch.equal(rows_cuda.counts.cpu(), rows_cpu.counts)
    assert torch.equal(st_cuda.status.cpu(), st_cpu.status)
    torch.testing.assert_close(rows_cuda.log_remainder.cpu(), rows_cpu.log_remainder, **tol)
    aligned = troll.align(new.cuda(), d_old_rows)
    torch.testing.assert_close(troll.kl_sparse(aligned).cpu(), troll.kl_sparse(troll.align(new, old_rows)), **tol)


@needs_gpu
def test_project_sparse_gradcheck_on_cuda():
    new = (_separated(11, 3, 16) + 0.05 * _separated(12, 3, 16)).cuda().requires_grad_(True)
    old_rows = troll.torch.sparsify(_separated(13, 3, 16).cuda(), k=5, delta=0.0)
    eps = torch.tensor(0.02, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(3, old_rows.indices.shape[-1] + 4, dtype=torch.float64, device="cuda")

    def loss(n, e):
        rows = troll.torch.project_sparse(n, old_rows, e, new_k=4, new_delta=0.0)
        lp = torch.where(torch.isfinite(rows.log_probs), rows.log_probs, torch.zeros_like(rows.log_probs))
        return (lp * w[:, : lp.shape[-1]]).sum() + (rows.log_remainder * 0.3).sum()

    assert torch.autograd.gradcheck(loss, (new, eps))


_LOSSES = {
    "troll_dense": lambda n, o, t, a, m: troll.torch.trust_region_loss(n, o, t, a, eps=0.05, mask=m),
    "troll_sparse": lambda n, o, t, a, m: troll.torch.trust_region_loss(
        n, troll.torch.sparsify(o, k=8, delta=1e-6, sampled=t), t, a, eps=0.05, mask=m, new_k=6),
    "ppo_clip": lambda n, o, t, a, m: troll.torch.ppo_clip_loss(n, o, t, a, mask=m, dual_clip=3.0),
    "dppo_binary_tv": lambda n, o, t, a, m: troll.torch.dppo_loss(n, o, t, a, "binary_tv", mask=m),
    "dppo_topk_kl": lambda n, o, t, a, m: troll.torch.dppo_loss(n, o, t, a, "topk_kl", top_k=4, mask=m),
}


@needs_gpu
@pytest.mark.parametrize("name", sorted(_LOSSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_losses_on_cuda_match_the_cpu(name, dtype):
    new, old, tokens, adv, mask = _loss_case(30, dtype=dtype)
    (v_cpu, g_cpu), (v_cuda, g_cuda) = _on_both(_LOSSES[name], new, old, tokens, adv, mask)
    tol = _tol(dtype)
    torch.testing.assert_close(v_cuda, v_cpu, **tol)
    torch.testing.assert_close(g_cuda, g_cpu, **tol)


@needs_gpu
@pytest.mark.parametrize("name", ["troll_dense", "troll_sparse", "ppo_clip"])
def test_loss_metrics_on_cuda_match_the_cpu(name):
    new, old, tokens, adv, mask = _loss_case(31)
    kwargs = dict(mask=mask, return_metrics=True)
    if name == "troll_dense":
        call = lambda n, o, t, a: troll.torch.trust_region_loss(n, o, t, a, **kwargs)  # noqa: E731
    elif name == "troll_sparse":
        call = lambda n, o, t, a: troll.torch.trust_region_loss(  # noqa: E731
            n, troll.torch.sparsify(o, k=8, sampled=t), t, a, **kwargs)
    else:
        call = lambda n, o, t, a: troll.torch.ppo_clip_loss(n, o, t, a, **kwargs)  # noqa: E731
    loss_cpu, m_cpu = call(new, old, tokens, adv)
    loss_cuda, m_cuda = call(new.cuda(), old.cuda(), tokens.cuda(), adv.cuda())
    assert loss_cuda.is_cuda and loss_cuda.dtype == new.dtype and loss_cuda.dim() == 0
    assert set(m_cuda) == set(m_cpu)
    assert m_cuda["tokens"] == m_cpu["tokens"] and m_cuda["sequences"] == m_cpu["sequences"]
    for key, value in m_cpu.items():
        assert m_cuda[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@needs_gpu
@pytest.mark.parametrize("name", ["troll_dense", "troll_sparse", "ppo_clip", "dppo_topk_kl"])
def test_loss_gradcheck_on_cuda(name):
    new, old, tokens, adv, mask = (t.cuda() for t in _loss_case(32, rows=5, vocab=12))
    if name.startswith("troll"):  # TROLL's ratio term (alpha = 0): the regression term holds pi* constant
        sparse = name.endswith("sparse")
        o = troll.torch.sparsify(old, k=5, delta=0.0, sampled=tokens) if sparse else old

        def loss(n):
            return troll.torch.trust_region_loss(n, o, tokens, adv, 0.05, alpha=0.0, mask=mask, new_k=4,
                                                 new_delta=0.0)
    else:
        def loss(n):
            return _LOSSES[name](n, old, tokens, adv, mask)
    assert torch.autograd.gradcheck(loss, (new.requires_grad_(True),))


@needs_gpu
def test_losses_on_cuda_copy_nothing_and_leave_inputs_untouched():
    new, old, tokens, adv, mask = (t.cuda() for t in _loss_case(33, rows=64, vocab=2048))
    before = (new.clone(), old.clone())
    x = new.requires_grad_(True)
    loss = troll.torch.trust_region_loss(x, old, tokens, adv, mask=mask)
    saved = loss.grad_fn.saved_tensors
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == old.data_ptr()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(x.detach(), before[0]) and torch.equal(old, before[1])
    # Padded rows are read where they are (a view, not a copy), and the gradient lands on them.
    wide = torch.randn(64, 2048 + 16, dtype=torch.float64, device="cuda", requires_grad=True)
    loss = troll.torch.ppo_clip_loss(wide[:, :2048], old, tokens, adv)
    assert loss.grad_fn.saved_tensors[0].data_ptr() == wide.data_ptr()
    loss.backward()
    assert torch.count_nonzero(wide.grad[:, 2048:]) == 0 and torch.count_nonzero(wide.grad[:, :2048]) > 0


@needs_gpu
def test_loss_errors_on_cuda_name_the_row():
    new, old, tokens, adv, mask = (t.cuda() for t in _loss_case(34))
    tokens[3] = 99
    for call in (lambda: troll.torch.trust_region_loss(new, old, tokens, adv),
                 lambda: troll.torch.ppo_clip_loss(new, old, tokens, adv),
                 lambda: troll.torch.trust_region_loss(
                     new, troll.torch.sparsify(old, k=4, sampled=tokens.clamp(max=23)), tokens, adv)):
        with pytest.raises(troll.DomainError) as info:
            call()
        assert info.value.row == 3
    bad = new.clone()
    bad[4, 2] = float("nan")
    with pytest.raises(troll.DomainError) as info:
        troll.torch.project_sparse(bad, troll.torch.sparsify(old, k=4), 0.05)
    assert info.value.row == 4


@needs_extension
def test_the_cuda_extension_binds_the_whole_array_api():
    cuda = _core._troll_cuda
    for name in ("kl_backward", "sparsify_backward", "align", "kl_sparse", "project_sparse",
                 "project_sparse_backward", "trust_region_forward", "trust_region_backward",
                 "sparse_trust_region_forward", "sparse_trust_region_backward", "ppo_clip_forward",
                 "ppo_clip_backward", "dppo_forward", "dppo_backward", "sparsify_shard", "sparsify_finalize",
                 "sparsify_tail_sums", "sparsify_shard_backward"):
        assert callable(getattr(cuda, name)), name
    assert cuda.METRICS_ENTRIES == len(_core.METRIC_FIELDS)


# ---- CUDA sparsify: the canonical tail sums (detail::exact_log_sums), as the CPU's ----


def _ulps(a, b):
    """|a - b| in units of b's last place (inf entries must match exactly)."""
    same = a == b
    step = (torch.nextafter(b, torch.full_like(b, float("inf"))) - b).abs()
    return torch.where(same, torch.zeros_like(b), (a - b).abs() / step)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_sparsify_values_are_canonical(dtype):
    g = torch.Generator().manual_seed(40)
    rows, vocab = 6, 40_000  # several tiles a row, candidates evicted by the block select
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    logits[1, ::7] = float("-inf")  # masked tokens
    logits[2, 100:200] = logits[2, 5]  # ties at the support's edge
    sampled = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int32)
    d = logits.cuda()
    whole = troll.torch.sparsify(d, k=32, delta=1e-3, sampled=sampled.cuda())
    # The same rows read through another layout (rows one element off 16-byte alignment: scalar
    # loads instead of vector loads) and one at a time: the same bits.
    padded = torch.empty(rows, vocab + 1, dtype=dtype, device="cuda")
    padded[:, 1:] = d
    shifted = troll.torch.sparsify(padded[:, 1:], k=32, delta=1e-3, sampled=sampled.cuda())
    for r in range(rows):
        one = troll.torch.sparsify(d[r:r + 1], k=32, delta=1e-3, sampled=sampled[r:r + 1].cuda())
        for a, b in zip(one[:4], whole[:4]):
            assert torch.equal(a.cpu(), b[r:r + 1].cpu())
    for a, b in zip(shifted[:4], whole[:4]):
        assert torch.equal(a.cpu(), b.cpu())
    # Against the CPU's canonical values: the same supports, values within one ulp (the two
    # backends' exponentials may differ in the last bit of a term; the sums are otherwise the same).
    ref = troll.torch.sparsify(logits, k=32, delta=1e-3, sampled=sampled)
    assert torch.equal(whole.counts.cpu(), ref.counts) and torch.equal(whole.indices.cpu(), ref.indices)
    valid = ref.counts[:, None] > torch.arange(ref.indices.shape[-1])
    lp = _ulps(torch.where(valid, whole.log_probs.cpu(), 0), torch.where(valid, ref.log_probs, 0))
    lr = _ulps(whole.log_remainder.cpu(), ref.log_remainder)
    if os.environ.get("TROLL_TEST_REPORT_ULPS"):
        print(f"cuda sparsify vs cpu ({dtype}): log_probs max {lp.max().item()} ulps, "
              f"log_remainder max {lr.max().item()} ulps, exact {(lp == 0).float().mean().item():.4f}")
    assert lp.max() <= 1 and lr.max() <= 1


# ---- Vocabulary shards on the device: the two-stage finalize, bit for bit the CUDA sparsify ----


def _device_shards(d, cuts, sampled, k, delta):
    """troll's two-stage sharded sparsify of device logits ``d`` cut at ``cuts`` (all on the GPU)."""
    vocab = d.shape[-1]
    shards = [d[:, a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # strided views: no copy
    states = torch.stack([troll.sparsify_shard(z, a, vocab, k, delta, sampled) for z, a in zip(shards, cuts)])
    assert states.is_cuda
    dtype = "float32" if d.dtype in (torch.float16, torch.bfloat16) else str(d.dtype).replace("torch.", "")
    rows, _, tail_max = troll.sparsify_finalize(states, vocab, k, delta, sampled=True, dtype=dtype,
                                                return_tail_max=True)
    sums = torch.stack([troll.sparsify_tail_sums(z, a, rows, tail_max) for z, a in zip(shards, cuts)])
    return states, sums, troll.sparsify_finalize(states, vocab, k, delta, sampled=True, dtype=dtype, tail_sums=sums)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cuda_shards_equal_the_cuda_sparsify_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(41)
    rows, vocab, k, delta = 5, 30_000, 32, 1e-3
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    logits[1, ::11] = float("-inf")
    sampled = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int32)
    d, ds = logits.cuda(), sampled.cuda()
    whole = troll.sparsify(d, k, delta, ds)
    for cuts in ([0, vocab], [0, 12_345, vocab], [0, 7, 9_000, 9_001, 21_000, vocab]):
        states, sums, (rows_, log_sums) = _device_shards(d, cuts, ds, k, delta)
        assert sums.is_cuda and log_sums.is_cuda and rows_.log_probs.is_cuda
        for a, b in zip(rows_[:4], whole[:4]):
            assert torch.equal(a.cpu(), b.cpu()), cuts
        if dtype != torch.bfloat16:  # device states merge with the host's: the packed bytes are the same
            host_states = torch.stack([troll.sparsify_shard(logits[:, a:b].contiguous(), a, vocab, k, delta, sampled)
                                       for a, b in zip(cuts[:-1], cuts[1:])])
            mixed = troll.sparsify_finalize(host_states.cuda(), vocab, k, delta, sampled=True,
                                            dtype=str(dtype).replace("torch.", ""), tail_sums=sums)
            for a, b in zip(mixed[0][:4], whole[:4]):
                assert torch.equal(a.cpu(), b.cpu())


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_shard_backward_equals_the_cuda_sparsify_backward(dtype):
    g = torch.Generator().manual_seed(42)
    rows, vocab, k, delta = 4, 5_000, 16, 1e-4
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2).to(dtype).cuda()
    sampled = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int32).cuda()
    cuts = [0, 1_700, vocab]
    _, _, (sparse, log_sums) = _device_shards(logits, cuts, sampled, k, delta)
    grad = (torch.randn(sparse.log_probs.shape, generator=g, dtype=torch.float64).to(dtype).cuda(),
            torch.randn(rows, generator=g, dtype=torch.float64).to(dtype).cuda())
    whole = troll.sparsify_backward(logits, sparse, grad)
    parts = torch.cat([troll.sparsify_shard_backward(logits[:, a:b], a, sparse, grad, log_sums)
                       for a, b in zip(cuts[:-1], cuts[1:])], dim=-1)
    torch.testing.assert_close(parts, whole, **_tol(dtype))


@needs_gpu
def test_cuda_shard_errors_name_the_row():
    d = torch.randn(3, 100, dtype=torch.float64, device="cuda")
    d[1, 17] = float("nan")
    with pytest.raises(troll.DomainError, match="row 1"):
        troll.sparsify_shard(d, 0, 100, 8, 1e-4)
    states = torch.stack([troll.sparsify_shard(d[:, :50].nan_to_num(), 0, 100, 8, 1e-4)])
    with pytest.raises(troll.InvalidInput, match="row 0"):  # half of the vocabulary never merged
        troll.sparsify_finalize(states, 100, 8, 1e-4, dtype="float64")


@needs_gpu
def test_distributed_sparsify_keeps_cuda_tensors_on_the_device(tmp_path):
    """One NCCL rank (or gloo when NCCL is missing): the rows, log-sums and gradient are device
    tensors equal to troll.torch.sparsify's and its backward's."""
    import torch.distributed as dist

    from troll.torch import distributed as td

    backend = "nccl" if dist.is_nccl_available() else "gloo"
    g = torch.Generator().manual_seed(43)
    logits = torch.randn(4, 3_000, generator=g, dtype=torch.float64).cuda()
    sampled = torch.randint(0, 3_000, (4,), generator=g, dtype=torch.int32).cuda()
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = logits.clone().requires_grad_(True)
        rows, log_sums = td.sparsify(x, 0, 3_000, k=16, delta=1e-4, sampled=sampled, return_log_sums=True)
        (rows.log_probs.nan_to_num(neginf=0.0).sum() + rows.log_remainder.sum()).backward()
    finally:
        dist.destroy_process_group()
    y = logits.clone().requires_grad_(True)
    want = troll.torch.sparsify(y, k=16, delta=1e-4, sampled=sampled)
    (want.log_probs.nan_to_num(neginf=0.0).sum() + want.log_remainder.sum()).backward()
    assert rows.log_probs.is_cuda and log_sums.is_cuda and x.grad.is_cuda
    for a, b in zip(rows[:4], want[:4]):
        assert torch.equal(a, b)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)
