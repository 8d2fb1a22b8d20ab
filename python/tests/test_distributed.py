"""troll.torch.distributed.sparsify over real process groups: 2 and 4 CPU processes (spawned,
gloo, localhost), each holding an uneven slice of the vocabulary. Every rank must get the rows of
the unsharded troll.torch.sparsify — identical supports and counts, values within one float32 ulp (64 double ulps: sum order) — and,
in the backward, its own columns of the whole-row gradient (troll's sparsify_backward on the
gathered logits, itself checked against full Jacobians in tests/test_sparse_gradients.cpp)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, ROWS, K = 3001, (3, 5), 24


def _cuts(world: int) -> list:
    # Uneven slices, and ranks whose offsets are not in rank order (the last rank holds the front).
    widths = [VOCAB * (r + 1) // sum(range(1, world + 1)) for r in range(world)]
    widths[-1] = VOCAB - sum(widths[:-1])
    starts = [sum(widths[:r]) for r in range(world)]
    order = list(range(1, world)) + [0]  # rank r holds slice order[r]
    return [(starts[s], starts[s] + widths[s]) for s in order]


def _case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(ROWS + (VOCAB,), generator=g, dtype=torch.float64) * 3.0
    z[0, 1, ::4] = float("-inf")  # masked tokens
    z[1, 2, 100:110] = z[1, 2, 2000]  # ties across slices
    sampled = torch.randint(0, VOCAB, ROWS, generator=g, dtype=torch.int32)
    sampled[0, 1] = 4  # a masked token's neighbour
    grad_lp = torch.randn(ROWS + (K + 1,), generator=g, dtype=torch.float64)
    grad_lr = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return z.to(dtype), sampled, grad_lp.to(dtype), grad_lr.to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between equal-signed finite values (0 where equal)."""
    same = a == b
    bits = torch.int32 if a.dtype == torch.float32 else torch.int64
    d = (a.view(bits).to(torch.int64) - b.view(bits).to(torch.int64)).abs()
    return torch.where(same, torch.zeros_like(d), d)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])  # a 2-process group inside the 4 (one spawn for both sizes)
        for group, size in ((pair, 2), (None, world)):
            if rank < size:
                _check_group(rank, size, group)
    finally:
        dist.destroy_process_group()


def _check_group(rank: int, world: int, group) -> None:
    import troll
    import troll.torch

    begin, end = _cuts(world)[rank]
    for dtype in (torch.float32, torch.float64):
        z, sampled, grad_lp, grad_lr = _case(dtype)
        local = z[..., begin:end].clone().requires_grad_(True)
        rows = troll.torch.distributed.sparsify(local, begin, VOCAB, k=K, delta=1e-4, sampled=sampled,
                                                group=group)
        whole = troll.torch.sparsify(z, k=K, delta=1e-4, sampled=sampled)
        assert torch.equal(rows.counts, whole.counts), (rank, dtype)
        assert torch.equal(rows.indices, whole.indices), (rank, dtype)
        assert rows.log_probs.dtype == dtype
        # float32: within one ulp. float64: the tail's thousands of terms are summed in another
        # order (merged shard sums vs one pass): tens of double ulps on log r (16 seen).
        most = 1 if dtype == torch.float32 else 64
        assert int(_ulps(rows.log_probs, whole.log_probs).max()) <= most, (rank, dtype)
        assert int(_ulps(rows.log_remainder, whole.log_remainder).max()) <= most, (rank, dtype)

        valid = rows.counts[..., None] > torch.arange(K + 1)
        loss = (torch.where(valid, rows.log_probs, 0) * grad_lp).sum() + (rows.log_remainder * grad_lr).sum()
        loss.backward()
        expected = torch.empty_like(z)
        troll._troll.sparsify_backward(z.reshape(-1, VOCAB), troll._core._sparse_arg(
            troll.SparseRows(*(t.reshape((-1,) + tuple(t.shape[2:])) for t in whole[:4]), VOCAB)),
            ((grad_lp * valid).reshape(-1, K + 1).contiguous(), grad_lr.reshape(-1).contiguous()),
            expected.reshape(-1, VOCAB), 0)
        mine = expected[..., begin:end]
        ulps = _ulps(local.grad, mine)
        if dtype == torch.float32:
            assert int(ulps.max()) <= 1, (rank, int(ulps.max()))
        else:
            # The row's log-normaliser is summed in another order (heap + merged outside sums
            # vs one pass over the row): a few double ulps of log Z move each p_k by
            # |log Z| ulps. Bound: 64 eps relative, or 4 eps of the row's largest gradient.
            eps, diff = torch.finfo(dtype).eps, (local.grad - mine).abs()
            ok = (diff <= 64 * eps * mine.abs()) | (diff <= 4 * eps * float(expected.abs().max()))
            assert bool(ok.all()), (rank, float(diff.max()))
        # every rank holds the same rows
        gathered = [torch.empty_like(rows.log_probs) for _ in range(world)]
        dist.all_gather(gathered, rows.log_probs.detach().contiguous(), group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_vocabulary_parallel_sparsify_matches_unsharded_on_2_and_4_processes():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, os.path.join(tmp, "init")), nprocs=4, join=True)


def test_single_process_group_and_bad_slices(tmp_path):
    import troll
    import troll.torch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        z, sampled, _, _ = _case(torch.float64)
        rows = troll.torch.distributed.sparsify(z, 0, VOCAB, k=K, delta=1e-4, sampled=sampled)
        whole = troll.torch.sparsify(z, k=K, delta=1e-4, sampled=sampled)
        assert torch.equal(rows.indices, whole.indices)
        with pytest.raises(troll.InvalidInput, match="not all of them"):  # a slice alone is not the row
            troll.torch.distributed.sparsify(z[..., :100], 0, VOCAB, k=K, sampled=sampled)
        with pytest.raises(troll.ShapeError, match="does not fit"):
            troll.torch.distributed.sparsify(z, 5, VOCAB, k=K, sampled=sampled)
    finally:
        dist.destroy_process_group()
