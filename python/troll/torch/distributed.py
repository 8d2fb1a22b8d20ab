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

import math
import struct
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .. import _core, _errors
from .._core import SparseRows
from ._autograd import guard, not_batched

__all__ = ["sparsify", "sparsify_state_bytes"]

sparsify_state_bytes = _core.sparsify_state_bytes


def _comm_device(group: Any, like: Optional[torch.Tensor]) -> torch.device:
    """Where the states travel: NCCL moves CUDA tensors only; gloo and others take host ones."""
    if dist.get_backend(group) == "nccl":
        return like.device if like is not None and like.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# What a rank that rejects its input reports to the others (_agree): the exception's class, most
# specific first (a DTypeError is also a ShapeError).
_CLASSES = (_errors.DTypeError, _errors.ShapeError, _errors.InfeasibleError, _errors.DomainError,
            _errors.InvalidInput, _errors.BackendError, TypeError, ValueError, RuntimeError)
# The call's parameters every rank must pass alike (_agree), with the class a disagreement raises.
_FIELDS = (("k", _errors.InvalidInput), ("delta", _errors.InvalidInput), ("vocab_size", _errors.ShapeError),
           ("rows", _errors.ShapeError), ("sampled", _errors.InvalidInput), ("dtype", _errors.DTypeError),
           ("leading shape", _errors.ShapeError))
# The logits' dtypes as a field code (others are refused by each rank's own checks).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _shape_code(shape: tuple) -> int:
    """The leading shape as one int64 field (a polynomial hash below 2**61; the shapes themselves
    are gathered only to word an error). Same row count but another shape, (2, 3) against (3, 2),
    would pair the rows of the ranks wrongly."""
    h = len(shape)
    for d in shape:
        h = (h * 1_000_003 + int(d) + 1) % (2**61 - 1)
    return h


def _class_code(error: BaseException) -> int:
    return next((i + 1 for i, c in enumerate(_CLASSES) if isinstance(error, c)), len(_CLASSES) + 1)


def _agree(group: Any, comm: torch.device, failure: Optional[BaseException], fields: tuple,
           offset: int = 0, shown: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """The collective check that precedes every exchange of data: each rank's outcome of its own
    checks (0, or its exception's class), the parameters that must match (``fields``: k, delta's
    bits, vocab_size, the row count, whether sampled is given, the logits' dtype and leading shape;
    ``shown``: how this rank words the last two in an error) and its ``offset``, gathered as one
    fixed-size tensor; returns the ranks' offsets (int64, rank order). If any rank rejected its input, every rank raises — the rejecting rank its own
    exception, the others one of the same class quoting it (one more collective, of the
    messages) — instead of the others waiting in the next collective for a rank that left it (a
    hang until the group's timeout, or a mismatched exchange). If the parameters differ, every
    rank raises the same error naming them. So the ranks stay in step: a caller that catches the
    error on every rank can go on to the next batch."""
    header = torch.tensor([0 if failure is None else _class_code(failure), *fields, offset], dtype=torch.int64,
                          device="cpu")
    headers = _gather(header, group, comm).cpu()
    world = headers.shape[0]
    failed = [r for r in range(world) if int(headers[r, 0]) != 0]
    if failed:
        texts = [None] * world
        dist.all_gather_object(texts, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
        if failure is not None:
            raise failure
        r = failed[0]
        code = int(headers[r, 0])
        cls = _CLASSES[code - 1] if code <= len(_CLASSES) else RuntimeError
        raise cls(f"troll.torch.distributed.sparsify: rank {r} of the group rejected its input "
                  f"({texts[r]}); every rank raises")
    for j, (name, cls) in enumerate(_FIELDS):
        values = [int(v) for v in headers[:, j + 1]]
        if len(set(values)) > 1:
            if shown is not None and name in shown:  # every rank sees the same headers: all gather
                words: list = [None] * len(values)
                dist.all_gather_object(words, shown[name], group=group)
            else:
                words = [_delta_of(v) if name == "delta" else bool(v) if name == "sampled" else v for v in values]
            raise cls(f"troll.torch.distributed.sparsify: the ranks pass different {name} ("
                      + ", ".join(f"rank {r}: {v}" for r, v in enumerate(words))
                      + "); every rank must pass the same k, delta, vocab_size, rows (the same leading shape), "
                        "logits dtype and sampled (given or not)")
    return headers[:, -1]


def _delta_bits(delta: float) -> int:
    return struct.unpack("<q", struct.pack("<d", delta))[0]


def _delta_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


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
        comm = _comm_device(group, local_logits)
        failure: Optional[BaseException] = None
        try:
            states = _core.sparsify_shard(x, offset, vocab, k, delta, sampled, threads=threads)
        except Exception as error:  # reported to every rank by _agree, which raises it here
            failure = error
        offsets = _agree(group, comm, failure, params["fields"], offset, params["shown"])
        # The states merge in offset order, whatever the ranks' order: each merge then extends one
        # contiguous token range (a merge keeps at most 32 disjoint ranges a row, so 33 or more
        # ranks holding interleaved slices failed in rank order). The values do not depend on
        # the order (exact, canonical sums); the tail sums below are stacked the same way.
        order = torch.argsort(offsets, stable=True).tolist()
        stacked = _gather(states, group, comm)[order]
        # 16-bit logits (CUDA) give float32 rows.
        dtype = "float32" if x.dtype in (torch.float16, torch.bfloat16) else str(x.dtype).replace("torch.", "")
        has_sampled = sampled is not None
        # Stage 1: the exact supports and each row's largest logit outside its support.
        rows, _, tail_max = _core.sparsify_finalize(stacked, vocab, k, delta, sampled=has_sampled, dtype=dtype,
                                                    return_tail_max=True, threads=threads)
        # Stage 2: every rank's exact share of the tail sums, gathered; the canonical values (the
        # bits of troll.torch.sparsify on the whole rows on the same backend, and the
        # normalisers of its backward).
        parts = _gather(_core.sparsify_tail_sums(x, offset, rows, tail_max, threads=threads), group, comm)[order]
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
        not_batched(g_log_probs, g_log_remainder)
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
    widths of at least one token, any order of offsets over ranks), and every rank passes the same
    leading shape, ``k``, ``delta`` and ``sampled`` (global token ids, one a row, or None). Collective: every rank of
    ``group`` must call it. Returns the same ``SparseRows`` on every rank — the rows
    ``troll.torch.sparsify`` gives for the gathered logits (supports and values identical, bit for
    bit: both use troll's canonical exact sums) — differentiable w.r.t.
    ``local_logits``: the backward returns this rank's columns of the whole-row gradient,
    computed locally. With ``return_log_sums=True`` also returns the rows' (..., 4) float64
    {ref, log sum_j e^(z_j - ref), tail_ref, log sum_{j not in S} e^(z_j - tail_ref)} (ref the
    row's and tail_ref the tail's largest logit)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("troll.torch.distributed.sparsify: torch.distributed is not initialised")
    from . import _index_rows, _tensor

    # This rank's own checks. A rank whose input they reject still takes part in the collective
    # check (_agree) that every rank runs before any data moves, so that all ranks raise.
    try:
        local_logits = _tensor(local_logits, "local_logits", "distributed.sparsify")
        rows = tuple(local_logits.shape[:-1])
        sampled_i32 = None
        if sampled is not None:  # the checks of troll.torch.sparsify's sampled (dtype, shape, int32 range)
            sampled_i32 = _index_rows(sampled, rows, "sampled", "distributed.sparsify",
                                      sampled.device if isinstance(sampled, torch.Tensor) else torch.device("cpu"),
                                      torch.int32)
        params = dict(k=_core._k(k), delta=_core._real(delta, "delta"), vocab=_core._size(vocab_size, "vocab_size"),
                      offset=_core._size(vocab_offset, "vocab_offset"), group=group, threads=threads)
    except Exception as error:
        like = local_logits if isinstance(local_logits, torch.Tensor) else None
        _agree(group, _comm_device(group, like), error, (0,) * len(_FIELDS))
        raise  # not reached: _agree raises error itself
    params["fields"] = (params["k"], _delta_bits(params["delta"]), min(params["vocab"], 2**63 - 1),
                        math.prod(rows), int(sampled is not None), _dtype_code(local_logits.dtype),
                        _shape_code(rows))
    params["shown"] = {"dtype": str(local_logits.dtype), "leading shape": rows}
    info: Dict[str, Any] = {}
    out = _ShardedSparsify.apply(local_logits, sampled_i32, params, info)
    result = SparseRows(*out, params["vocab"])
    return (result, info["log_sums"]) if return_log_sums else result
