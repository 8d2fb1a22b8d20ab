"""troll.torch.distributed.sparsify over real process groups: 2 and 4 CPU processes (spawned,
gloo, localhost), each holding an uneven slice of the vocabulary. Every rank must get the rows of
the unsharded troll.torch.sparsify — identical supports and counts, values within one ulp — and,
in the backward, its own columns of the whole-row gradient (troll's sparsify_backward on the
gathered logits, itself checked against full Jacobians in tests/test_sparse_gradients.cpp). Values
and gradients are within one ulp (torch.nextafter) in float32 and float64."""

from __future__ import annotations

import datetime
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
    """|a - b| in units in the last place of b (torch.nextafter's step away from b; 0 where equal,
    infinite where only one side is infinite)."""
    b = b.detach()
    step = (torch.nextafter(b, torch.full_like(b, float("inf"))) - b).abs()
    d = (a.detach() - b).abs() / step
    return torch.where(a.detach() == b, torch.zeros_like(d), d)


def _most_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(_ulps(a, b).max()) if a.numel() else 0.0


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
        # Both paths sum the same canonical terms (troll's exact_log_sums): within one ulp in
        # float32 and float64 (bit-identical but for a tie in the last rounding).
        worst = {"log_probs": _most_ulps(rows.log_probs, whole.log_probs),
                 "log_remainder": _most_ulps(rows.log_remainder, whole.log_remainder)}
        assert max(worst.values()) <= 1, (rank, world, dtype, worst)

        valid = rows.counts[..., None] > torch.arange(K + 1)
        loss = (torch.where(valid, rows.log_probs, 0) * grad_lp).sum() + (rows.log_remainder * grad_lr).sum()
        loss.backward()
        expected = torch.empty_like(z)
        troll._core._troll.sparsify_backward(z.reshape(-1, VOCAB), troll._core._sparse_arg(
            troll.SparseRows(*(t.reshape((-1,) + tuple(t.shape[2:])) for t in whole[:4]), VOCAB)),
            ((grad_lp * valid).reshape(-1, K + 1).contiguous(), grad_lr.reshape(-1).contiguous()),
            expected.reshape(-1, VOCAB), 0)
        mine = expected[..., begin:end]
        # The backward's normalisers are the forward's (log_sums) and sparsify_backward's own
        # (log_sums_outside): the same canonical sums, so each rank's columns are those of the
        # whole row's gradient within one ulp (masked tokens: exact zeros on both sides).
        worst["grad"] = _most_ulps(local.grad, mine)
        assert worst["grad"] <= 1, (rank, world, dtype, worst)
        if os.environ.get("TROLL_TEST_REPORT_ULPS") and rank == 0:
            print(f"ulps world={world} {dtype}: {worst}", flush=True)
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


def _reject_worker(rank: int, world: int, init_file: str) -> None:
    import troll
    import troll.torch

    # A short timeout: were a rank left waiting in a collective, the test fails instead of hanging.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        begin, end = _cuts(world)[rank]
        z, sampled, _, _ = _case(torch.float64)
        local = z[..., begin:end].clone()
        sparsify = troll.torch.distributed.sparsify
        # A NaN in rank 1's slice only: every rank raises DomainError; the others quote rank 1's.
        bad = local.clone()
        if rank == 1:
            bad[1, 2, 3] = float("nan")
        with pytest.raises(troll.DomainError) as info:
            sparsify(bad, begin, VOCAB, k=K, sampled=sampled)
        if rank != 1:
            assert "rank 1" in str(info.value) and "NaN" in str(info.value), str(info.value)
        # A check before troll's own (sampled's shape) failing on rank 0 only.
        with pytest.raises(troll.ShapeError):
            sparsify(local, begin, VOCAB, k=K, sampled=sampled[:1] if rank == 0 else sampled)
        # A negative offset on the last rank only: ShapeError everywhere (not nanobind's TypeError).
        with pytest.raises(troll.ShapeError):
            sparsify(local, -1 if rank == world - 1 else begin, VOCAB, k=K, sampled=sampled)
        # Parameters that differ between ranks: the same error on every rank, before any exchange
        # (a different delta gave every rank different, wrong rows; a different k or row count
        # aborted a process in gloo).
        with pytest.raises(troll.InvalidInput, match="different delta"):
            sparsify(local, begin, VOCAB, k=K, delta=1e-4 if rank == 0 else 0.5, sampled=sampled)
        with pytest.raises(troll.InvalidInput, match="different k"):
            sparsify(local, begin, VOCAB, k=K if rank == 0 else K // 2, sampled=sampled)
        with pytest.raises(troll.ShapeError, match="different rows"):
            sparsify(local[:2] if rank == 1 else local, begin, VOCAB, k=K, sampled=sampled[:2] if rank == 1 else sampled)
        with pytest.raises(troll.InvalidInput, match="different sampled"):
            sparsify(local, begin, VOCAB, k=K, sampled=sampled if rank == 0 else None)
        # The same row count in another leading shape, or another dtype, on one rank: both ran, the
        # first pairing the ranks' rows wrongly, the second giving each rank other values.
        with pytest.raises(troll.ShapeError, match=r"different leading shape \(rank 0: \(3, 5\), rank 1: \(5, 3\)"):
            sparsify(local.reshape(5, 3, -1) if rank == 1 else local, begin, VOCAB, k=K,
                     sampled=sampled.reshape(5, 3) if rank == 1 else sampled)
        with pytest.raises(troll.DTypeError, match="different dtype"):
            sparsify(local.float() if rank == 0 else local, begin, VOCAB, k=K, sampled=sampled)
        # The ranks stayed in step: the next call gives the unsharded rows.
        rows = sparsify(local, begin, VOCAB, k=K, delta=1e-4, sampled=sampled)
        whole = troll.torch.sparsify(z, k=K, delta=1e-4, sampled=sampled)
        assert torch.equal(rows.indices, whole.indices)
        assert torch.equal(rows.counts, whole.counts)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_rejects_its_input_makes_every_rank_raise():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_reject_worker, args=(3, os.path.join(tmp, "init")), nprocs=3, join=True)
