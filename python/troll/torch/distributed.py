"""Vocabulary-parallel sparse rows over ``torch.distributed``: each tensor-parallel rank holds the
logits of its slice of the vocabulary (a Megatron-style sharded LM head) and gets the exact sparse
rows of the whole vocabulary, without anyone gathering the full logits.

    rank r: sparsify_shard(its logits)  ->  states (rows x sparsify_state_bytes(k) bytes)
    all ranks: all_gather(states) over the group  ->  merge in rank order, finalize (supports)
    rank r: sparsify_tail_sums(its logits)  ->  exact tail sums (16 bytes a row)
    all ranks: all_gather(tail sums)  ->  finalize again: the values, bit for bit the unsharded ones
    backward: the gradient w.r.t. each rank's own shard, computed locally (no communication)

The exchanged states are fixed-size (``troll.sparsify_state_bytes(k)`` bytes a row: 1,328 for
k = 64) whatever the vocabulary; the collective is the process group's own ``all_gather`` (gloo
for CPU tensors, NCCL for CUDA). Every rank ends with identical rows. CUDA logits stay on their
GPU when troll's CUDA extension is built: the shard states, tail sums, merge, finalize and the
backward run there (with NCCL the collectives too; with gloo only the fixed-size states and tail
sums cross to the host and back). CUDA logits may be float16 / bfloat16 (float32 rows). See
docs/python.md."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .. import _core
from .._core import SparseRows
from ._autograd import guard

__all__ = ["sparsify", "sparsify_state_bytes"]

sparsify_state_bytes = _core.sparsify_state_bytes


def _comm_device(group: Any, like: torch.Tensor) -> torch.device:
    """Where the states travel: NCCL moves CUDA tensors only; gloo and others take host ones."""
    if dist.get_backend(group) == "nccl":
        return like.device if like.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _work_device(local_logits: torch.Tensor) -> torch.device:
    """Where troll runs: on the logits' GPU when the CUDA extension is built (states, tail sums,
    rows and the backward stay on the device); on the host otherwise."""
    if local_logits.is_cuda and _core._troll_cuda is not None:
        return local_logits.device
    return torch.device("cpu")


def _gather(tensor: torch.Tensor, group: Any, comm: torch.device) -> torch.Tensor:
    """The ranks' tensors stacked in rank order (all_gather on the collective's device), on
    ``tensor``'s device."""
    mine = tensor.to(comm)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).to(tensor.device)


class _ShardedSparsify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, sampled, params, info):  # type: ignore[override]
        device = local_logits.device
        work = _work_device(local_logits)
        x = local_logits.detach().to(work)
        k, delta, vocab, offset, group, threads = (params[n] for n in
                                                   ("k", "delta", "vocab", "offset", "group", "threads"))
        if sampled is not None:
            sampled = sampled.to(work)
        states = _core.sparsify_shard(x, offset, vocab, k, delta, sampled, threads=threads)
        comm = _comm_device(group, local_logits)
        stacked = _gather(states, group, comm)
        # 16-bit logits (CUDA) give float32 rows.
        dtype = "float32" if x.dtype in (torch.float16, torch.bfloat16) else str(x.dtype).replace("torch.", "")
        has_sampled = sampled is not None
        # Stage 1: the exact supports and each row's largest logit outside its support.
        rows, _, tail_max = _core.sparsify_finalize(stacked, vocab, k, delta, sampled=has_sampled, dtype=dtype,
                                                    return_tail_max=True, threads=threads)
        # Stage 2: every rank's exact share of the tail sums, gathered; the canonical values (the
        # bits of troll.torch.sparsify on the whole rows on the same backend, and the
        # normalisers of its backward).
        parts = _gather(_core.sparsify_tail_sums(x, offset, rows, tail_max, threads=threads), group, comm)
        rows, log_sums = _core.sparsify_finalize(stacked, vocab, k, delta, sampled=has_sampled, dtype=dtype,
                                                 tail_sums=parts, threads=threads)
        ctx.save_for_backward(x, rows.indices, rows.log_probs, rows.counts, rows.log_remainder, log_sums,
                              local_logits)
        ctx.offset, ctx.vocab, ctx.threads, ctx.device = offset, vocab, threads, device
        out = tuple(t.to(device) for t in rows[:4])
        ctx.mark_non_differentiable(out[0], out[2])
        info["log_sums"] = log_sums.to(device)
        return out

    @staticmethod
    def backward(ctx, _g_indices, g_log_probs, _g_counts, g_log_remainder):  # type: ignore[override]
        x, indices, log_probs, counts, log_remainder, log_sums, given = ctx.saved_tensors
        support = SparseRows(indices, log_probs, counts, log_remainder, ctx.vocab)
        work = x.device
        g = (g_log_probs.to(work, log_probs.dtype).contiguous(), g_log_remainder.to(work, log_probs.dtype).contiguous())
        # 16-bit logits: the gradient of their exact float32 values, rounded back.
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        grad = _core.sparsify_shard_backward(xs, ctx.offset, support, g, log_sums, threads=ctx.threads)
        (grad,) = guard("distributed.sparsify", (grad.to(ctx.device, x.dtype),), (given, g_log_probs, g_log_remainder))
        return grad, None, None, None


def sparsify(local_logits: torch.Tensor, vocab_offset: int, vocab_size: int, k: int = 64, delta: float = 1e-5,
             sampled: Optional[torch.Tensor] = None, group: Any = None, *, threads: int = 0,
             return_log_sums: bool = False):
    """``troll.torch.sparsify`` of rows whose vocabulary is split over the ranks of ``group``.

    ``local_logits`` (..., V_r) are this rank's tokens [vocab_offset, vocab_offset + V_r) of rows
    of ``vocab_size`` tokens; the ranks' slices must be disjoint and cover the vocabulary (any
    widths, any order of offsets over ranks), and every rank passes the same leading shape, ``k``,
    ``delta`` and ``sampled`` (global token ids, one a row, or None). Collective: every rank of
    ``group`` must call it. Returns the same ``SparseRows`` on every rank — the rows
    ``troll.torch.sparsify`` gives for the gathered logits (supports and values identical, bit for
    bit: both use troll's canonical exact sums) — differentiable w.r.t.
    ``local_logits``: the backward returns this rank's columns of the whole-row gradient,
    computed locally. With ``return_log_sums=True`` also returns the rows' (..., 4) float64
    {ref, log sum_j e^(z_j - ref), tail_ref, log sum_{j not in S} e^(z_j - tail_ref)} (ref the
    row's and tail_ref the tail's largest logit)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("troll.torch.distributed.sparsify: torch.distributed is not initialised")
    from . import _tensor

    local_logits = _tensor(local_logits, "local_logits", "distributed.sparsify")
    rows = tuple(local_logits.shape[:-1])
    sampled_i32 = None
    if sampled is not None:
        from . import _index_rows  # the checks of troll.torch.sparsify's sampled (dtype, shape, int32 range)

        sampled_i32 = _index_rows(sampled, rows, "sampled", "distributed.sparsify", torch.as_tensor(sampled).device,
                                  torch.int32)
    params = dict(k=_core._integer(k, "k"), delta=float(delta), vocab=_core._integer(vocab_size, "vocab_size"),
                  offset=_core._integer(vocab_offset, "vocab_offset"), group=group, threads=threads)
    info: Dict[str, Any] = {}
    out = _ShardedSparsify.apply(local_logits, sampled_i32, params, info)
    result = SparseRows(*out, params["vocab"])
    return (result, info["log_sums"]) if return_log_sums else result
