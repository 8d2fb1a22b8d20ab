"""troll for PyTorch: the projection, the sparse path and the training losses as
``torch.autograd.Function``s whose backward passes are troll's analytic ones (C++), on CPU
tensors — and CUDA tensors where troll._troll_cuda was built — of dtype float32 or float64 with
shape (..., V). Nothing is copied on the way in; the GIL is released while troll runs; CUDA work
is enqueued on the current stream."""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import numpy as np
import torch

from .. import _core
from .._core import AlignedRows, ProjectionStats, SparseRows
from .._arrays import is_capsule
from .._errors import DomainError
from ._autograd import guard, not_batched

__all__ = [
    "project",
    "sparsify",
    "project_sparse",
    "trust_region_loss",
    "ppo_clip_loss",
    "dppo_loss",
    "SparseRows",
    "ProjectionStats",
]


def _eps_value(eps: Any) -> float:
    """The bound as troll.project takes it (_core._bound): a number or a one-element array of any
    framework (a torch tensor, a NumPy array of shape (1,), ...); more elements: ShapeError."""
    return _core._bound(eps.detach() if isinstance(eps, torch.Tensor) else eps)


def _tensor(x: Any, name: str, fn: str) -> torch.Tensor:
    """A torch tensor, as given; any other DLPack array (NumPy, a raw DLPack capsule, ...) as the
    tensor torch.from_dlpack makes of it (no copy); anything else: TypeError."""
    if isinstance(x, torch.Tensor):
        return x
    if is_capsule(x):
        return torch.utils.dlpack.from_dlpack(x)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError):
            if isinstance(x, np.ndarray):  # e.g. a read-only array, which NumPy does not export
                return torch.as_tensor(x)
            raise
    raise TypeError(f"troll.torch.{fn}: {name} is a {type(x).__name__}; a torch tensor (or a DLPack array) is needed")


def _as_tensor(x: Any, device: torch.device) -> torch.Tensor:
    """A tensor as given; anything else (a list, a NumPy array) as a tensor on ``device``, through
    NumPy so that Python floats stay double (torch.as_tensor of a list takes the default dtype,
    float32). Not torch.as_tensor of a tensor: under torch.set_default_device that copies it to the
    default device (a meta default even fails)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), device=device)


def _grad_in(g: torch.Tensor) -> torch.Tensor:
    not_batched(g)
    # Upstream gradients often arrive expanded (stride 0, e.g. from .sum()); troll reads rows.
    return g.contiguous()


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_logits, old_logits, eps, options, info):  # type: ignore[override]
        # The inputs themselves are saved (troll reads them detached): under create_graph the
        # backward ties its gradients to them (guard: double backward raises, never silently 0).
        log_probs, stats = _core.project(new_logits.detach(), old_logits.detach(), _eps_value(eps), **options)
        ctx.save_for_backward(new_logits, old_logits, log_probs, stats.values, stats.counters)
        ctx.eps = eps if isinstance(eps, torch.Tensor) else None
        ctx.eps_shape = eps.shape if isinstance(eps, torch.Tensor) else None
        ctx.threads = options.get("threads", 0)
        info["stats"] = stats
        return log_probs

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        new_logits, old_logits, log_probs, values, counters = ctx.saved_tensors
        want_old = ctx.needs_input_grad[1]
        want_eps = ctx.eps_shape is not None and ctx.needs_input_grad[2]
        grad_new, grad_old, grad_eps = _core.project_backward(
            new_logits, old_logits, log_probs, ProjectionStats(values, counters), _grad_in(grad),
            old=want_old, eps=want_eps, threads=ctx.threads)
        if grad_eps is not None:
            grad_eps = grad_eps.sum().reshape(ctx.eps_shape)
        grad_new, grad_old, grad_eps = guard("project", (grad_new, grad_old, grad_eps),
                                             (new_logits, old_logits, ctx.eps, grad))
        return grad_new, grad_old, grad_eps, None, None


def project(new_logits: torch.Tensor, old_logits: torch.Tensor, eps: Union[float, torch.Tensor],
            *, return_stats: bool = False, rtol: float = _core.DEFAULT_RTOL, atol: float = _core.DEFAULT_ATOL,
            max_iterations: int = _core.DEFAULT_MAX_ITERATIONS, threads: int = 0):
    """log pi* of the KL trust-region projection (see troll.project), differentiable w.r.t.
    ``new_logits``, ``old_logits`` and ``eps`` when it is a one-element tensor. With
    ``return_stats=True`` returns ``(log_probs, ProjectionStats)``."""
    new_logits, old_logits = _tensor(new_logits, "new_logits", "project"), _tensor(old_logits, "old_logits", "project")
    options = dict(rtol=rtol, atol=atol, max_iterations=max_iterations, threads=threads)
    info: Dict[str, Any] = {}
    log_probs = _Project.apply(new_logits, old_logits, eps, options, info)
    return (log_probs, info["stats"]) if return_stats else log_probs


#: The range of troll's int32 token ids (sparsify's ``sampled``).
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1
#: Unsigned id dtypes wider than uint8 that this torch has (uint64 last when present).
_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _index_rows(x: Any, rows: tuple, name: str, fn: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A per-row integer array (token ids, sequence ids) as a contiguous tensor of ``dtype`` on
    ``device``: its shape must be the logits' rows (ShapeError), its dtype an integer one
    (TypeError: a float or bool id would be truncated silently), and narrowing to int32 must not
    wrap a value around (DomainError naming the row: 2**32 + 1 would become token 1)."""
    x = _as_tensor(x, device).detach()
    if tuple(x.shape) != rows:
        raise _core.ShapeError(f"troll: {name} has shape {tuple(x.shape)} but the logits' rows are {rows}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"troll.{fn}: {name} has dtype {str(x.dtype).replace('torch.', '')}; "
                        "integer ids are needed (int32 or int64)")
    if x.dtype in _WIDE_UNSIGNED:
        # torch compares uint16/32/64 on few devices: widen to int64 first (lossless below 2**63;
        # a uint64 id at or above it is outside every vocabulary).
        if x.dtype == _WIDE_UNSIGNED[-1] and x.numel() > 0:
            big = (x.cpu().numpy().reshape(-1) > np.uint64(2 ** 63 - 1)).nonzero()[0]
            if big.size:
                row = int(big[0])
                code = 17 if dtype == torch.int32 else (38 if name == "tokens" else 0)  # bad_sampled, token_range
                raise DomainError(f"troll.{fn}: row {row}: {name} {int(x.reshape(-1)[row].item())} is outside the "
                                  "range of int64 ids", row=row, code=code)
        x = x.to(torch.int64)
    if dtype == torch.int32 and x.numel() > 0 and x.dtype not in (torch.int32, torch.int16, torch.int8, torch.uint8):
        bad = ((x < _INT32_MIN) | (x > _INT32_MAX)).reshape(-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            value = int(x.reshape(-1)[row])
            raise DomainError(f"troll.{fn}: row {row}: {name} token {value} is outside the vocabulary (and int32)",
                              row=row, code=17)  # troll::row_error::bad_sampled
    return x.to(device=device, dtype=dtype).contiguous()


def _sampled_index(sampled: Optional[torch.Tensor], logits: torch.Tensor,
                   fn: str = "sparsify") -> Optional[torch.Tensor]:
    if sampled is None:
        return None
    return _index_rows(sampled, tuple(logits.shape[:-1]), "sampled", fn, logits.device, torch.int32)


def sparsify(logits: torch.Tensor, k: int = 64, delta: float = 1e-5,
             sampled: Optional[torch.Tensor] = None, *, threads: int = 0) -> SparseRows:
    """Sparse rows (top-k tokens by logit whose mass reaches 1 - delta, plus the ``sampled``
    token of each row, and the exact log-mass of the rest) for storing the old policy compactly
    at rollout time. Not differentiable (the old policy is a constant)."""
    logits = _tensor(logits, "logits", "sparsify").detach()
    return _core.sparsify(logits, k, delta, _sampled_index(sampled, logits),
                          threads=threads)


class _ProjectSparse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_logits, eps, old, support, options, info):  # type: ignore[override]
        threads = options["threads"]
        aligned = _core.align(new_logits.detach(), old, support, threads=threads)
        out, stats = _core.project_sparse(aligned, _eps_value(eps), **options)
        # The outputs go through save_for_backward, never onto ctx: an output held by ctx is a
        # reference cycle through the autograd graph that Python's collector cannot see (every
        # call leaked its graph, new logits included), and in-place edits would go unnoticed.
        # The stats too (as the dense projection's): a caller who edits the returned stats in
        # place between forward and backward gets torch's in-place error, not another gradient.
        ctx.save_for_backward(new_logits, *out[:4], stats.values, stats.counters)
        ctx.vocab = out.vocab
        ctx.aligned, ctx.threads = aligned, threads
        ctx.eps_shape = eps.shape if isinstance(eps, torch.Tensor) else None
        ctx.eps = eps if isinstance(eps, torch.Tensor) else None
        ctx.mark_non_differentiable(out.indices, out.counts)
        info["stats"] = stats
        return out.indices, out.log_probs, out.counts, out.log_remainder

    @staticmethod
    def backward(ctx, _g_indices, g_log_probs, _g_counts, g_log_remainder):  # type: ignore[override]
        new_logits, *out, values, counters = ctx.saved_tensors
        out = SparseRows(*out, ctx.vocab)
        aligned: AlignedRows = ctx.aligned
        want_eps = ctx.eps_shape is not None and ctx.needs_input_grad[1]
        grad_aligned, _, grad_eps = _core.project_sparse_backward(
            aligned, out, ProjectionStats(values, counters), (_grad_in(g_log_probs), _grad_in(g_log_remainder)), eps=want_eps,
            threads=ctx.threads)
        grad_new = _core.sparsify_backward(new_logits, aligned.new_side(), grad_aligned, threads=ctx.threads)
        if grad_eps is not None:
            grad_eps = grad_eps.sum().reshape(ctx.eps_shape)
        grad_new, grad_eps = guard("project_sparse", (grad_new, grad_eps),
                                   (new_logits, ctx.eps, g_log_probs, g_log_remainder))
        return grad_new, grad_eps, None, None, None, None


def project_sparse(new_logits: torch.Tensor, old_sparse: SparseRows, eps: Union[float, torch.Tensor],
                   sampled: Optional[torch.Tensor] = None, *, new_k: int = 64, new_delta: float = 1e-5,
                   return_stats: bool = False, rtol: float = _core.DEFAULT_RTOL, atol: float = _core.DEFAULT_ATOL,
                   max_iterations: int = _core.DEFAULT_MAX_ITERATIONS, threads: int = 0):
    """The projection of dense new logits (..., V) against sparse old rows (from
    troll.torch.sparsify): on U = S_new | S_old, S_new the new row's own top-``new_k`` prefix
    (mass 1 - ``new_delta``, plus ``sampled``; ``new_k=0``: U = S_old), with the rest of the
    vocabulary lumped into one bucket. Returns SparseRows of log pi* (U and the bucket),
    differentiable w.r.t. ``new_logits`` (the scatter of docs/sparse.md) and ``eps`` (tensor)."""
    old_sparse = _core.check_sparse_rows(old_sparse, "old_sparse")
    new_logits = _tensor(new_logits, "new_logits", "project_sparse")
    support = None
    new_k = _core._new_k(new_k)
    new_delta = _core._real(new_delta, "new_delta")
    if not 0.0 <= new_delta < 1.0:  # checked for new_k = 0 too, as the sparse losses check it
        raise DomainError(f"troll.project_sparse: new_delta must be in [0, 1), got {new_delta!r}")
    if new_k > 0:
        support = _core.sparsify(new_logits.detach(), new_k, new_delta,
                                 _sampled_index(sampled, new_logits, "project_sparse"), threads=threads)
    options = dict(rtol=rtol, atol=atol, max_iterations=max_iterations, threads=threads)
    info: Dict[str, Any] = {}
    result = _ProjectSparse.apply(new_logits, eps, old_sparse, support, options, info)
    rows = SparseRows(*result, int(old_sparse.vocab))
    return (rows, info["stats"]) if return_stats else rows


# ---- Losses ----


def _token_batch(new_logits: torch.Tensor, tokens, advantages, mask, sequence_ids, aggregation, fn: str) -> tuple:
    """The per-row inputs of a loss as the backend reads them. Each is a private copy: the
    backward reads them again, and a caller that edits its advantages, mask or ids in place
    between forward and backward must still get the gradient of the loss it was given
    (``.to(...).contiguous()`` returns the caller's own tensor when nothing needs converting).
    ``aggregation`` None: 'sequence_mean' when ``sequence_ids`` are given, else 'token_mean'."""
    rows = tuple(new_logits.shape[:-1])
    dtype, device = new_logits.dtype, new_logits.device

    def private(converted, given):
        return converted.clone() if converted.data_ptr() == _as_tensor(given, device).data_ptr() else converted

    def per_row(x, name, kind):
        x = _as_tensor(x, device)
        if tuple(x.shape) != rows:
            raise _core.ShapeError(f"troll: {name} has shape {tuple(x.shape)} but the logits' rows are {rows}")
        if x.is_complex():
            raise TypeError(f"troll.{fn}: {name} has dtype {x.dtype}; a real dtype is needed")
        converted = x.detach().to(device=device, dtype=kind).contiguous()
        if x.is_floating_point() and torch.finfo(x.dtype).max > torch.finfo(kind).max:
            # A narrowing cast (float64 advantages, float32 logits) turns a finite value beyond the
            # logits' dtype into inf: name it here rather than as an infinite input. (Checked where
            # it costs no device synchronisation; troll's own check still refuses the inf on CUDA.)
            # A mask entry that underflows to 0 would drop its token (or a whole sequence) from the
            # loss's weights: only the mask's ratios matter, so the caller can scale it instead.
            if converted.device.type == "cpu":
                given = x.detach().cpu()
                lost = torch.isinf(converted) & torch.isfinite(given)
                if name == "mask":
                    lost = lost | ((converted == 0) & (given != 0))
                if bool(lost.any()):
                    i = int(lost.reshape(-1).nonzero()[0])
                    # the row and code troll's own check gives an infinite entry (bad_mask 18,
                    # bad_advantage 19), with the row flattened as everywhere
                    raise DomainError(f"troll.{fn}: row {i}: {name} entry {i} (= {float(given.reshape(-1)[i])!r}) "
                                      f"does not fit the logits' dtype {kind}"
                                      + (" (it would become 0; scale the mask: only its ratios matter)"
                                         if name == "mask" and float(converted.reshape(-1)[i]) == 0.0 else ""),
                                      row=i, code=18 if name == "mask" else 19)
        return private(converted, x)

    if aggregation is None:
        aggregation = "token_mean" if sequence_ids is None else "sequence_mean"
    return (private(_index_rows(tokens, rows, "tokens", fn, device, torch.int64), tokens),
            per_row(advantages, "advantages", dtype),
            None if mask is None else per_row(mask, "mask", dtype),
            None if sequence_ids is None else
            private(_index_rows(sequence_ids, rows, "sequence_ids", fn, device, torch.int64), sequence_ids),
            str(aggregation))


def _loss_value(metrics: Any, like: torch.Tensor) -> torch.Tensor:
    """The aggregated loss as a 0-d tensor on the logits' device (no synchronisation on CUDA)."""
    if isinstance(metrics, dict):
        return torch.tensor(metrics["loss"], dtype=like.dtype, device=like.device)
    return metrics[0].to(like.dtype, copy=True)


def _empty_like_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _TrustRegionLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_logits, old, batch, params, info):  # type: ignore[override]
        given = new_logits  # saved for the backward (guard); troll reads it detached
        new_logits = new_logits.detach()
        frame = _core.Framework(new_logits)
        lead = tuple(new_logits.shape[:-1])
        stats = ProjectionStats.empty(frame, lead)
        common = (params["eps"], params["alpha"], params["rtol"], params["atol"], params["max_iterations"])
        threads = params["threads"]
        if isinstance(old, torch.Tensor):
            log_probs = _empty_like_rows(new_logits)
            metrics = _core.objective_forward(
                "trust_region_forward", new_logits,
                (new_logits, old.detach(), batch, *common, log_probs, stats.values, stats.counters), threads=threads)
            ctx.save_for_backward(given, old.detach(), log_probs)
        else:
            vocab = int(new_logits.shape[-1])
            k_max = min(int(old.indices.shape[-1]) + params["new_k"], vocab, _core._troll.SPARSE_MAX_ENTRIES)
            dtype = _core._float_dtype(frame, new_logits)
            aligned = AlignedRows(frame.empty(lead + (k_max,), "int32"), frame.empty(lead, "int32"),
                                  frame.empty(lead + (k_max,), dtype), frame.empty(lead + (k_max,), dtype),
                                  frame.empty(lead, dtype), frame.empty(lead, dtype), vocab)
            log_probs = _core.sparse_empty(frame, lead, k_max, vocab, dtype)
            metrics = _core.objective_forward(
                "sparse_trust_region_forward", new_logits,
                (new_logits, _core._sparse_arg(old), batch, *common, params["new_k"], params["new_delta"], aligned,
                 log_probs, stats.values, stats.counters), threads=threads)
            ctx.save_for_backward(given)
            ctx.aligned, ctx.sparse_log_probs = aligned, log_probs
        ctx.dense = isinstance(old, torch.Tensor)
        ctx.batch, ctx.params, ctx.stats = batch, params, stats
        info["metrics"], info["stats"] = metrics, stats
        return _loss_value(metrics, new_logits)

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        p = ctx.params
        common = (p["eps"], p["alpha"], p["rtol"], p["atol"], p["max_iterations"])
        given = ctx.saved_tensors[0]
        new_logits = given.detach()
        grad_new = _empty_like_rows(new_logits)
        if ctx.dense:
            _, old, log_probs = ctx.saved_tensors
            args = (new_logits, old, ctx.batch, *common, log_probs, ctx.stats.values, ctx.stats.counters, grad_new,
                    float(grad_loss))
            _core.objective_backward("trust_region_backward", new_logits, args, threads=p["threads"])
        else:
            args = (new_logits, _core._sparse_arg(ctx.aligned), ctx.batch, *common, p["new_k"], p["new_delta"],
                    _core._sparse_arg(ctx.sparse_log_probs), ctx.stats.values, ctx.stats.counters, grad_new,
                    float(grad_loss))
            _core.objective_backward("sparse_trust_region_backward", new_logits, args, threads=p["threads"])
        (grad_new,) = guard("trust_region_loss", (grad_new,), (given, grad_loss))
        return grad_new, None, None, None, None


def trust_region_loss(new_logits: torch.Tensor, old: Union[torch.Tensor, SparseRows], tokens: torch.Tensor,
                      advantages: torch.Tensor, eps: float = 0.05, alpha: float = 1.0,
                      mask: Optional[torch.Tensor] = None, *, sequence_ids: Optional[torch.Tensor] = None,
                      aggregation: Optional[str] = None, new_k: int = 64, new_delta: float = 1e-5,
                      return_metrics: bool = False, rtol: float = _core.DEFAULT_RTOL, atol: float = _core.DEFAULT_ATOL,
                      max_iterations: int = _core.DEFAULT_MAX_ITERATIONS, threads: int = 0):
    """TROLL's objective (docs/objectives.md): per token ``-(pi*_a / q_a) A + alpha KL(p_new ||
    stopgrad(pi*))`` with pi* the projection of the new logits onto KL(pi || q) <= eps,
    aggregated by ``aggregation`` ('token_mean', or 'sequence_mean' with ``sequence_ids``; the
    default is 'sequence_mean' exactly when ``sequence_ids`` are given) over
    the rows weighted by ``mask``. ``old`` is the old policy's dense logits or its SparseRows
    (troll.torch.sparsify with the sampled tokens). Returns the scalar loss (and the metrics dict
    with ``return_metrics=True``); its gradient w.r.t. ``new_logits`` is troll's fused backward."""
    new_logits = _tensor(new_logits, "new_logits", "trust_region_loss")
    if isinstance(old, (tuple, list)):
        old = _core.check_sparse_rows(old, "old")
    else:
        old = _tensor(old, "old", "trust_region_loss")
    batch = _token_batch(new_logits, tokens, advantages, mask, sequence_ids, aggregation, "trust_region_loss")
    rtol, atol, max_iterations = _core._solver(rtol, atol, max_iterations)
    params = dict(eps=_core._bound(eps), alpha=_core._real(alpha, "alpha"), rtol=rtol, atol=atol,
                  max_iterations=max_iterations, new_k=_core._new_k(new_k), new_delta=_core._real(new_delta, "new_delta"),
                  threads=threads)
    info: Dict[str, Any] = {}
    loss = _TrustRegionLoss.apply(new_logits, old, batch, params, info)
    return (loss, _core.metrics_dict(info["metrics"])) if return_metrics else loss


class _RatioLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, new_logits, old_logits, batch, name, args, threads, info):  # type: ignore[override]
        given = new_logits  # saved for the backward (guard); troll reads it detached
        new_logits, old_logits = new_logits.detach(), old_logits.detach()
        metrics = _core.objective_forward(f"{name}_forward", new_logits,
                                          (new_logits, old_logits, batch, *args, True), threads=threads)
        ctx.save_for_backward(given, old_logits)
        ctx.batch, ctx.name, ctx.args, ctx.threads = batch, name, args, threads
        info["metrics"] = metrics
        return _loss_value(metrics, new_logits)

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        given, old_logits = ctx.saved_tensors
        new_logits = given.detach()
        grad_new = _empty_like_rows(new_logits)
        _core.objective_backward(f"{ctx.name}_backward", new_logits,
                                 (new_logits, old_logits, ctx.batch, *ctx.args, grad_new, float(grad_loss)),
                                 threads=ctx.threads)
        (grad_new,) = guard(f"{ctx.name}_loss", (grad_new,), (given, grad_loss))
        return grad_new, None, None, None, None, None, None


def ppo_clip_loss(new_logits: torch.Tensor, old_logits: torch.Tensor, tokens: torch.Tensor,
                  advantages: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  dual_clip: float = 0.0, mask: Optional[torch.Tensor] = None, *,
                  sequence_ids: Optional[torch.Tensor] = None, aggregation: Optional[str] = None,
                  return_metrics: bool = False, threads: int = 0):
    """PPO's clipped surrogate loss ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with
    r = p_new(a) / q(a) (and the dual clip when ``dual_clip`` > 1), troll's forward and backward."""
    new_logits = _tensor(new_logits, "new_logits", "ppo_clip_loss")
    old_logits = _tensor(old_logits, "old_logits", "ppo_clip_loss")
    batch = _token_batch(new_logits, tokens, advantages, mask, sequence_ids, aggregation, "ppo_clip_loss")
    args = (_core._real(clip_low, "clip_low"), _core._real(clip_high, "clip_high"), _core._real(dual_clip, "dual_clip"))
    info: Dict[str, Any] = {}
    loss = _RatioLoss.apply(new_logits, old_logits, batch, "ppo_clip", args, threads, info)
    return (loss, _core.metrics_dict(info["metrics"])) if return_metrics else loss


def dppo_loss(new_logits: torch.Tensor, old_logits: torch.Tensor, tokens: torch.Tensor,
              advantages: torch.Tensor, divergence: str = "binary_tv", delta_low: Optional[float] = None,
              delta_high: Optional[float] = None, top_k: int = 20, mask: Optional[torch.Tensor] = None, *,
              sequence_ids: Optional[torch.Tensor] = None, aggregation: Optional[str] = None,
              return_metrics: bool = False, threads: int = 0):
    """DPPO's masked surrogate ``-M r A`` (docs/objectives.md): a token is dropped when its
    ``divergence`` ('binary_tv', 'binary_kl', 'topk_tv', 'topk_kl') exceeds ``delta_high``
    (A > 0, moved up) or ``delta_low`` (A < 0, moved down); the bounds default to 0.15 for TV
    and 0.05 for KL."""
    default = 0.15 if divergence.endswith("tv") else 0.05
    new_logits = _tensor(new_logits, "new_logits", "dppo_loss")
    old_logits = _tensor(old_logits, "old_logits", "dppo_loss")
    batch = _token_batch(new_logits, tokens, advantages, mask, sequence_ids, aggregation, "dppo_loss")
    args = (str(divergence), _core._real(default if delta_low is None else delta_low, "delta_low"),
            _core._real(default if delta_high is None else delta_high, "delta_high"), _core._k(top_k, "top_k"))
    info: Dict[str, Any] = {}
    loss = _RatioLoss.apply(new_logits, old_logits, batch, "dppo", args, threads, info)
    return (loss, _core.metrics_dict(info["metrics"])) if return_metrics else loss


from . import distributed  # noqa: E402  (troll.torch.distributed: vocabulary-parallel sparsify)
from . import gaussian  # noqa: E402  (troll.torch.gaussian: differentiable Gaussian trust regions)
