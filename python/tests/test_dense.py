"""troll.kl, troll.project and troll.torch.project against the float64 PyTorch oracle; layouts
(leading dimensions, padded rows, NumPy), out= buffers, zero copy, gradients, the GIL."""

import threading
import time

import numpy as np
import pytest
import torch

import troll
import troll.torch as tt
from oracle import kl as kl_oracle
from oracle import make_logits
from oracle import project as project_oracle


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_matches_oracle(gen, dtype):
    p, q = make_logits(gen, 3, 4, 50, dtype=dtype), make_logits(gen, 3, 4, 50, dtype=dtype)
    got = troll.kl(p, q)
    assert got.shape == (3, 4) and got.dtype == dtype
    torch.testing.assert_close(got.double(), kl_oracle(p, q), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_project_matches_bisection(gen, dtype):
    new, old = make_logits(gen, 2, 5, 64, dtype=dtype), make_logits(gen, 2, 5, 64, dtype=dtype)
    new[0, 0] = old[0, 0] + 1e-3  # one row inside the ball
    eps = 0.05
    log_probs, stats = troll.project(new, old, eps)
    want, t = project_oracle(new, old, eps)
    assert log_probs.shape == new.shape and log_probs.dtype == dtype
    torch.testing.assert_close(log_probs.double(), want, **tol(dtype))
    torch.testing.assert_close(stats.t, t, **tol(dtype))
    assert stats.status[0, 0] == troll.INACTIVE and stats.t[0, 0] == 1.0
    projected = stats.status == troll.PROJECTED
    assert projected.sum() == 9
    torch.testing.assert_close(stats.kl_after[projected], torch.full((9,), eps, dtype=torch.float64),
                               rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(stats.kl_before, kl_oracle(new, old), **tol(dtype))
    torch.testing.assert_close(stats.eta[projected], ((1 - t) / t)[projected], rtol=1e-8, atol=1e-10)
    assert (stats.iterations[projected] > 0).all() and stats.iterations.dtype == torch.int32


def test_numpy_in_numpy_out(gen):
    new, old = make_logits(gen, 4, 33).numpy(), make_logits(gen, 4, 33).numpy()
    log_probs, stats = troll.project(new, old, 0.1)
    assert isinstance(log_probs, np.ndarray) and isinstance(stats.t, np.ndarray)
    want, _ = project_oracle(torch.from_numpy(new), torch.from_numpy(old), 0.1)
    np.testing.assert_allclose(log_probs, want.numpy(), rtol=1e-10, atol=1e-12)
    assert isinstance(troll.kl(new, old), np.ndarray)
    # Read-only NumPy inputs are fine (troll never writes its inputs).
    new.flags.writeable = False
    troll.project(new, old, 0.1)


def test_out_buffers_are_written_in_place(gen):
    new, old = make_logits(gen, 3, 40), make_logits(gen, 3, 40)
    new_before, old_before = new.clone(), old.clone()
    out = torch.empty_like(new)
    stats = troll.ProjectionStats.empty(troll._core.Framework(new), (3,))
    log_probs, st = troll.project(new, old, 0.05, out=out, stats=stats)
    assert log_probs.data_ptr() == out.data_ptr()
    assert st.values.data_ptr() == stats.values.data_ptr()
    assert torch.equal(new, new_before) and torch.equal(old, old_before)  # inputs untouched
    kl_out = torch.empty(3, dtype=torch.float64)
    assert troll.kl(new, old, out=kl_out).data_ptr() == kl_out.data_ptr()
    torch.testing.assert_close(kl_out, kl_oracle(new, old))


def test_padded_rows_and_leading_dimensions(gen):
    base_new, base_old = make_logits(gen, 2, 3, 70), make_logits(gen, 2, 3, 70)
    new, old = base_new[..., 3:53], base_old[..., 5:55]  # row stride 70, V = 50
    assert not new.is_contiguous()
    got, _ = troll.project(new, old, 0.05)
    want, _ = troll.project(new.contiguous(), old.contiguous(), 0.05)
    assert torch.equal(got, want)
    # A row view of one matrix, sliced every other row: row stride 2 * 70.
    got2, _ = troll.project(base_new[0, ::2, :50], base_old[0, ::2, :50], 0.05)
    want2, _ = troll.project(base_new[0, ::2, :50].contiguous(), base_old[0, ::2, :50].contiguous(), 0.05)
    assert torch.equal(got2, want2)


def test_layouts_troll_cannot_view_raise_shape_error(gen):
    x = make_logits(gen, 8, 6)
    with pytest.raises(troll.ShapeError, match="contiguous"):
        troll.kl(x.t(), x.t())  # strided along the vocabulary
    y = make_logits(gen, 4, 3, 5).transpose(0, 1)  # leading dimensions do not flatten
    with pytest.raises(troll.ShapeError, match="flatten"):
        troll.kl(y, y)


def test_errors_are_typed_and_name_the_row(gen):
    new, old = make_logits(gen, 4, 10), make_logits(gen, 4, 10)
    with pytest.raises(troll.ShapeError) as e:
        troll.project(new, old[:, :9], 0.05)
    assert e.value.row is None and isinstance(e.value, ValueError)
    bad = new.clone()
    bad[2, 7] = float("nan")
    out = torch.full_like(new, 7.0)
    with pytest.raises(troll.DomainError) as e:
        troll.project(bad, old, 0.05, out=out)
    assert e.value.row == 2 and "row 2" in str(e.value) and "token 7" in str(e.value)
    assert (out == 7.0).all()  # nothing written
    with pytest.raises(troll.DomainError):
        troll.project(new, old, -1.0)
    infeasible = new.clone()
    infeasible[1, :] = float("-inf")
    infeasible[1, 0] = 0.0  # the new row keeps one token the old row barely weighs
    old2 = old.clone()
    old2[1, 0] = -30.0
    with pytest.raises(troll.InfeasibleError) as e:
        troll.project(infeasible, old2, 0.05)
    assert e.value.row == 1 and isinstance(e.value, troll.InvalidInput)
    with pytest.raises(TypeError):
        troll.kl(new.to(torch.int64), old.to(torch.int64))
    with pytest.raises(troll.ShapeError, match="dtype"):
        troll.kl(new, old.float())


def test_torch_project_gradcheck():
    gen = torch.Generator().manual_seed(7)
    new = make_logits(gen, 3, 12).requires_grad_()
    old = make_logits(gen, 3, 12).requires_grad_()
    eps = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    assert (troll.project(new.detach(), old.detach(), 0.05)[1].status == troll.PROJECTED).all()
    weights = make_logits(gen, 3, 12)  # a loss that weighs every output differently
    assert torch.autograd.gradcheck(lambda n, o, e: tt.project(n, o, e) * weights, (new, old, eps))


def test_torch_project_saves_inputs_without_copies(gen):
    new = make_logits(gen, 2, 30).requires_grad_()
    old = make_logits(gen, 2, 30)
    log_probs = tt.project(new, old, 0.05)
    saved = log_probs.grad_fn.saved_tensors
    assert saved[0].data_ptr() == new.data_ptr() and saved[1].data_ptr() == old.data_ptr()
    log_probs, stats = tt.project(new, old, 0.05, return_stats=True)
    assert stats.t.shape == (2,)


def test_threads_run_with_the_gil_released():
    gen = torch.Generator().manual_seed(3)
    new, old = make_logits(gen, 64, 40000), make_logits(gen, 64, 40000)
    serial, _ = troll.project(new, old, 0.05, threads=1)
    results, ticks = [None] * 3, [0]

    def work(i):
        results[i] = troll.project(new, old, 0.05, threads=1)[0]

    workers = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        ticks[0] += 1  # Python keeps running here only while troll has let go of the GIL
        time.sleep(0.001)
    for w in workers:
        w.join()
    assert all(torch.equal(r, serial) for r in results)
    assert ticks[0] > 5
