"""The framework-agnostic API: any DLPack array in, arrays of the same framework out. Outputs are
allocated here (or passed as ``out=``) and filled by the extension, which calls troll's C++ entry
points with the GIL released. No maths here: see include/troll/ and docs/python.md."""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from ._cpu import kernels as _troll  # troll._troll, or troll._troll_avx512 where the CPU has it
from ._arrays import Framework, accepts_capsules, arg, leading_shape, require_shape, writable
from ._errors import DomainError, ShapeError

try:  # the CUDA extension, built where nvcc was present (docs/python.md, CUDA)
    from . import _troll_cuda
except ImportError:  # pragma: no cover - a CPU-only build
    _troll_cuda = None

#: The solver's defaults, those of troll::projection_options (troll/projection_types.hpp): the
#: tolerance |KL(pi* || q) - eps| <= atol + rtol * eps is relative down to the smallest eps, which
#: is what docs/api.md's accuracy (KL within 1e-10 eps) rests on. (An absolute 1e-15 had let a row
#: at eps = 1e-12 land 2.3e-5 eps above its bound while reported projected.)
DEFAULT_RTOL = 1e-11
DEFAULT_ATOL = 0.0
DEFAULT_MAX_ITERATIONS = 100

#: Whether CUDA calls run in troll's checked mode: bad rows raise the CPU's exceptions (naming
#: the row) at the cost of a synchronisation. False: bad rows get NaN outputs and nothing
#: synchronises (docs/cuda.md, validation without a host synchronisation).
CUDA_CHECKED = True

_DLPACK_CUDA = 2  # DLDeviceType kDLCUDA


def cuda_available() -> bool:
    """Whether this build has the CUDA extension and a CUDA device is visible."""
    return _troll_cuda is not None and _troll_cuda.device_count() > 0


def _on_cuda(x: Any) -> bool:
    """Whether an array lives in CUDA device memory (DLPack's device type; a torch tensor's own
    device, which torch.compile can trace where it cannot trace __dlpack_device__)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.device.type == "cuda"
    device = getattr(x, "__dlpack_device__", None)
    return device is not None and int(device()[0]) == _DLPACK_CUDA


def _cuda_call(frame: Framework, x: Any, name: str) -> Tuple[Any, int]:
    """The CUDA module and the caller's current stream for an array in device memory."""
    if _troll_cuda is None:
        raise ShapeError(f"troll.{name}: the array is in CUDA memory but this troll was built without the "
                         "CUDA extension (pip install ./python -Ccmake.define.TROLL_ENABLE_CUDA=ON; docs/python.md)")
    if frame.name == "torch":
        stream = frame._torch.cuda.current_stream(x.device).cuda_stream
    elif frame.name == "cupy":
        stream = frame._cupy.cuda.get_current_stream().ptr
    else:
        stream = 0  # the legacy default stream
    return _troll_cuda, int(stream)

#: Row status values of ``ProjectionStats.status`` (troll::row_status).
INACTIVE, PROJECTED, RESTRICTED = 0, 1, 2
STATUS_NAMES = {0: "inactive", 1: "projected", 2: "restricted", 3: "infeasible", 4: "rejected", 5: "not_converged"}


class ProjectionStats:
    """Per-row statistics of a projection, each an array of the rows' leading shape:
    ``t``, ``eta``, ``kl_before`` (KL(p_new || q)), ``kl_after`` (KL(pi* || q)), ``mu``,
    ``sigma2`` (float64), ``iterations`` and ``status`` (int32; INACTIVE, PROJECTED, RESTRICTED).
    They are views of two packed buffers, ``values`` (..., 6) float64 and ``counters`` (..., 2)
    int32, which is what the backward passes read."""

    __slots__ = ("values", "counters")

    def __init__(self, values: Any, counters: Any) -> None:
        self.values = values
        self.counters = counters

    @classmethod
    def empty(cls, frame: Framework, rows_shape: tuple) -> "ProjectionStats":
        return cls(frame.empty(rows_shape + (6,), "float64"), frame.empty(rows_shape + (2,), "int32"))

    t = property(lambda self: self.values[..., 0])
    eta = property(lambda self: self.values[..., 1])
    kl_before = property(lambda self: self.values[..., 2])
    kl_after = property(lambda self: self.values[..., 3])
    mu = property(lambda self: self.values[..., 4])
    sigma2 = property(lambda self: self.values[..., 5])
    iterations = property(lambda self: self.counters[..., 0])
    status = property(lambda self: self.counters[..., 1])

    def __repr__(self) -> str:
        return f"ProjectionStats(rows={tuple(self.values.shape[:-1])})"


def check_stats_rows(stats: Any, rows: tuple, fn: str) -> None:
    """ShapeError unless stats.values and stats.counters have the leading shape ``rows``
    (ProjectionStats and troll.gaussian.GaussianStats alike): stats pair with rows by shape, as
    every per-row array does (docs/python.md), not by count."""
    for name in ("values", "counters"):
        got = tuple(getattr(getattr(stats, name), "shape", ()))[:-1]
        if got != tuple(rows):
            raise ShapeError(f"troll.{fn}: stats.{name} has rows of shape {got} but the rows are {tuple(rows)}")


class SparseRows(NamedTuple):
    """Sparse rows (docs/sparse.md): ``indices`` (..., k_max) int32 token ids, ``log_probs``
    (..., k_max) their log-probabilities over the whole vocabulary, ``counts`` (...) int32 entries
    used per row, ``log_remainder`` (...) the log-mass of the other tokens, ``vocab`` = V.
    Entries past a row's count are index -1 and log-prob -inf."""

    indices: Any
    log_probs: Any
    counts: Any
    log_remainder: Any
    vocab: int


class AlignedRows(NamedTuple):
    """A new and an old row on one support U (docs/sparse.md, Alignment)."""

    indices: Any
    counts: Any
    new_log_probs: Any
    old_log_probs: Any
    new_log_remainder: Any
    old_log_remainder: Any
    vocab: int

    def new_side(self) -> SparseRows:
        return SparseRows(self.indices, self.new_log_probs, self.counts, self.new_log_remainder, self.vocab)

    def old_side(self) -> SparseRows:
        return SparseRows(self.indices, self.old_log_probs, self.counts, self.old_log_remainder, self.vocab)


def _out(frame: Framework, out: Any, shape: tuple, dtype: str, name: str) -> Any:
    if out is None:
        return frame.empty(shape, dtype)
    require_shape(writable(out, name), shape, name, "this call")
    return out


def _real(value: Any, name: str, shape_note: str = "") -> float:
    """A real setting (``eps``, ``delta``, ``rtol``, ``alpha``, ...) given as a number or a
    one-element array (torch, NumPy, ...). float() would take True as 1.0 and the string '0.05' as
    0.05, and nanobind converts a bool too: anything but a real number is a ShapeError naming it.
    Its range is troll's to check (the extension names the entry point). ``shape_note`` is added
    to the error for an array of more than one element."""
    shape = getattr(value, "shape", None)
    item = value
    if shape is not None:
        size = 1
        for extent in tuple(shape):
            size *= int(extent)
        if size != 1:
            raise ShapeError(f"troll: {name} must be a number or a one-element array{shape_note}, "
                             f"got shape {tuple(shape)}")
        item = value.item()
    if isinstance(item, (bool, np.bool_, str, bytes)) or not isinstance(item, (numbers.Real, np.floating, np.integer)):
        raise ShapeError(f"troll: {name} must be a real number or a one-element array of one, got {value!r}")
    return float(item)


def _bound(eps: Any, name: str = "eps") -> float:
    """A bound: one for every row (per-row bounds are not supported), as ``_real`` takes it."""
    return _real(eps, name, " (one bound for all rows)")


def _solver(rtol: Any, atol: Any, max_iterations: Any) -> Tuple[float, float, int]:
    """The solver settings as the extension takes them (real, real, C int), each checked for its
    type here (``max_iterations=True`` had run as 1, ``rtol=True`` as 1.0); their ranges are
    troll's check (a DomainError naming the entry point)."""
    n = _integer(max_iterations, "max_iterations")
    if not -2**31 <= n < 2**31:
        raise DomainError(f"max_iterations must be >= 1 and fit a C int, got {n}")
    return _real(rtol, "rtol"), _real(atol, "atol"), n


def _float_dtype(frame: Framework, x: Any) -> str:
    dtype = frame.dtype_name(x)
    if dtype not in ("float32", "float64"):
        raise TypeError(f"troll: logits have dtype {dtype}; troll computes on float32 and float64")
    return dtype


@accepts_capsules
def log_softmax(logits: Any, *, out: Any = None, threads: int = 0) -> Any:
    """log_softmax over the last dimension, into ``out`` when given."""
    frame = Framework(logits)
    dtype = _float_dtype(frame, logits)
    y = _out(frame, out, tuple(logits.shape), dtype, "out")
    if _on_cuda(logits):
        cuda, stream = _cuda_call(frame, logits, "log_softmax")
        cuda.log_softmax(arg(logits), y, stream, CUDA_CHECKED)
    else:
        _troll.log_softmax(arg(logits), y, _threads(threads))
    return frame.result(y)


@accepts_capsules
def kl(p_logits: Any, q_logits: Any, *, out: Any = None, threads: int = 0) -> Any:
    """Per-row KL(softmax(p) || softmax(q)) over the last dimension: an array of shape
    ``p_logits.shape[:-1]`` (+inf where p has mass that q masks with -inf)."""
    frame = Framework(p_logits)
    dtype = _float_dtype(frame, p_logits)
    y = _out(frame, out, leading_shape(p_logits, "p_logits"), dtype, "out")
    if _on_cuda(p_logits):
        cuda, stream = _cuda_call(frame, p_logits, "kl")
        cuda.kl(arg(p_logits), arg(q_logits), y, stream, CUDA_CHECKED)
    else:
        _troll.kl(arg(p_logits), arg(q_logits), y, _threads(threads))
    return frame.result(y)


@accepts_capsules
def kl_backward(p_logits: Any, q_logits: Any, grad_kl: Any, *, threads: int = 0) -> Tuple[Any, Any]:
    """Gradients of sum(grad_kl * kl(p, q)) w.r.t. p_logits and q_logits."""
    frame = Framework(p_logits)
    dtype = _float_dtype(frame, p_logits)
    gp = frame.empty(tuple(p_logits.shape), dtype)
    gq = frame.empty(tuple(p_logits.shape), dtype)
    if _on_cuda(p_logits):
        cuda, stream = _cuda_call(frame, p_logits, "kl_backward")
        cuda.kl_backward(arg(p_logits), arg(q_logits), arg(grad_kl), gp, gq, stream, CUDA_CHECKED)
    else:
        _troll.kl_backward(arg(p_logits), arg(q_logits), arg(grad_kl), gp, gq, _threads(threads))
    return frame.result(gp), frame.result(gq)


@accepts_capsules
def project(
    new_logits: Any,
    old_logits: Any,
    eps: float,
    *,
    out: Any = None,
    stats: Optional[ProjectionStats] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    threads: int = 0,
) -> Tuple[Any, ProjectionStats]:
    """The KL trust-region projection of each row of ``new_logits`` (shape (..., V)) onto the
    ball KL(pi || q) <= eps around the row of ``old_logits``. Returns ``(log_probs, stats)``:
    log pi* of the new logits' shape and dtype, and the per-row ProjectionStats. ``out`` and
    ``stats`` may be given to write in place. Raises troll.InvalidInput subclasses (naming the
    row) before writing anything."""
    frame = Framework(new_logits)
    dtype = _float_dtype(frame, new_logits)
    rows = leading_shape(new_logits, "new_logits")
    y = _out(frame, out, tuple(new_logits.shape), dtype, "out")
    st = stats if stats is not None else ProjectionStats.empty(frame, rows)
    if stats is not None:
        check_stats_rows(st, rows, "project")
        writable(st.values, "stats.values")
        writable(st.counters, "stats.counters")
    if _on_cuda(new_logits):
        cuda, stream = _cuda_call(frame, new_logits, "project")
        cuda.project(arg(new_logits), arg(old_logits), _bound(eps), y, st.values, st.counters,
                     *_solver(rtol, atol, max_iterations), stream, CUDA_CHECKED)
    else:
        _troll.project(arg(new_logits), arg(old_logits), _bound(eps), y, st.values, st.counters,
                       *_solver(rtol, atol, max_iterations), _threads(threads))
    return frame.result(y), ProjectionStats(frame.result(st.values), frame.result(st.counters))


@accepts_capsules
def project_backward(
    new_logits: Any,
    old_logits: Any,
    log_probs: Any,
    stats: ProjectionStats,
    grad_log_probs: Any,
    *,
    old: bool = False,
    eps: bool = False,
    threads: int = 0,
) -> Tuple[Any, Optional[Any], Optional[Any]]:
    """The projection's vector-Jacobian product: given grad_log_probs = dL/dlog pi*, returns
    (dL/dnew_logits, dL/dold_logits or None, per-row dL/deps or None)."""
    frame = Framework(new_logits)
    dtype = _float_dtype(frame, new_logits)
    shape = tuple(new_logits.shape)
    grad_new = frame.empty(shape, dtype)
    grad_old = frame.empty(shape, dtype) if old else None
    grad_eps = frame.empty(shape[:-1], dtype) if eps else None
    check_stats_rows(stats, shape[:-1], "project_backward")
    args = (arg(new_logits), arg(old_logits), arg(log_probs), arg(stats.values), arg(stats.counters),
            arg(grad_log_probs), grad_new, grad_old, grad_eps)
    if _on_cuda(new_logits):
        cuda, stream = _cuda_call(frame, new_logits, "project_backward")
        cuda.project_backward(*args, stream, CUDA_CHECKED)
    else:
        _troll.project_backward(*args, _threads(threads))
    return (frame.result(grad_new),
            None if grad_old is None else frame.result(grad_old),
            None if grad_eps is None else frame.result(grad_eps))


# ---- Sparse rows ----


def sparse_empty(frame: Framework, rows: tuple, k_max: int, vocab: int, dtype: str) -> SparseRows:
    return SparseRows(frame.empty(rows + (k_max,), "int32"), frame.empty(rows + (k_max,), dtype),
                      frame.empty(rows, "int32"), frame.empty(rows, dtype), _size(vocab, "vocab"))


@accepts_capsules
def sparsify(logits: Any, k: int = 64, delta: float = 1e-5, sampled: Any = None, *,
             threads: int = 0) -> SparseRows:
    """Top-k + remainder rows of dense logits (..., V): per row the shortest prefix of tokens
    by logit whose mass reaches 1 - delta, at most k, then the ``sampled`` token (int32, one a
    row) if missing. Capacity k_max = min(k + 1 with sampled, V). CUDA logits may also be
    float16 / bfloat16 (ranked in float, rows in float32)."""
    frame = Framework(logits)
    on_cuda = _on_cuda(logits)
    dtype = _rows_dtype(frame, logits)
    rows = leading_shape(logits, "logits")
    vocab = int(logits.shape[-1])
    top = _k(k)
    if not 1 <= top <= _troll.SPARSIFY_MAX_K:
        # troll's own words, before the rows are allocated: a mistyped huge k must not first
        # reserve rows · k entries (on a GPU, an out-of-memory error instead of this one)
        raise DomainError(f"troll::sparsify: sparsify_options.k must be in [1, {_troll.SPARSIFY_MAX_K}], got {top}")
    k_max = max(1, min(top + (sampled is not None), vocab))
    out = sparse_empty(frame, rows, k_max, vocab, dtype)
    if isinstance(sampled, numbers.Integral) and not hasattr(sampled, "dtype"):
        # a Python int: the one row of 1-D logits (typed arrays keep the int32 rule)
        if not -2**31 <= int(sampled) < 2**31:
            raise DomainError(f"troll::sparsify: row 0: sampled token {int(sampled)} is outside the vocabulary",
                              row=0, code=17)
        sampled = np.asarray(int(sampled), dtype=np.int32)
    sampled_arg = None if sampled is None else arg(sampled)
    if on_cuda:
        cuda, stream = _cuda_call(frame, logits, "sparsify")
        cuda.sparsify(arg(logits), sampled_arg, _k(k), _real(delta, "delta"), out, stream, CUDA_CHECKED)
    else:
        _troll.sparsify(arg(logits), sampled_arg, _k(k), _real(delta, "delta"), out, _threads(threads))
    return SparseRows(*(frame.result(a) for a in out[:4]), vocab)


@accepts_capsules
def align(new_logits: Any, old: SparseRows, new_support: Optional[SparseRows] = None, *,
          threads: int = 0) -> AlignedRows:
    """Aligns dense new logits with sparse old rows on U = S_new | S_old (S_new: the support of
    ``new_support``, none when None). ``old`` and ``new_support`` may be plain 5-tuples."""
    old = check_sparse_rows(old, "old")
    if new_support is not None:
        new_support = check_sparse_rows(new_support, "new_support")
    frame = Framework(new_logits)
    dtype = _float_dtype(frame, new_logits)
    rows = leading_shape(new_logits, "new_logits")
    vocab = int(new_logits.shape[-1])
    extra = 0 if new_support is None else int(new_support.indices.shape[-1])
    k_max = max(1, min(int(old.indices.shape[-1]) + extra, vocab, _troll.SPARSE_MAX_ENTRIES))
    out = AlignedRows(frame.empty(rows + (k_max,), "int32"), frame.empty(rows, "int32"),
                      frame.empty(rows + (k_max,), dtype), frame.empty(rows + (k_max,), dtype),
                      frame.empty(rows, dtype), frame.empty(rows, dtype), vocab)
    args = (arg(new_logits), None if new_support is None else _sparse_arg(new_support), _sparse_arg(old), out)
    if _on_cuda(new_logits):
        cuda, stream = _cuda_call(frame, new_logits, "align")
        cuda.align(*args, stream, CUDA_CHECKED)
    else:
        _troll.align(*args, _threads(threads))
    return AlignedRows(*(frame.result(a) for a in out[:6]), vocab)


def _integer(value: Any, name: str) -> int:
    """``value`` as a Python int where it is one (an int, a NumPy integer, a 0-d integer tensor):
    a count or a token id such as ``vocab``, ``k`` or ``vocab_offset``. Anything else (10.5, but
    also 10.0 and True) is a ShapeError naming ``name``, where ``int()`` would truncate silently."""
    if isinstance(value, (bool, np.bool_)):
        raise ShapeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ShapeError(f"{name} must be an integer, got {value!r}") from None


def _size(value: Any, name: str) -> int:
    """A vocabulary size or token offset (``vocab``, ``vocab_offset``) as the extension takes it:
    an integer in [0, 2**63). A negative or huge one is a ShapeError naming it (troll's class for
    an offset outside the vocabulary), where nanobind raised its own TypeError (or, inside a
    SparseRows, C++'s bad_cast)."""
    n = _integer(value, name)
    if not 0 <= n < 2**63:
        raise ShapeError(f"{name} must be an integer in [0, 2**63), got {n}")
    return n


def _k(value: Any, name: str = "k") -> int:
    """A top-k count (``k``, ``new_k``, ``top_k``) as the extension takes it (a C int): one outside
    the int range is a DomainError here, as troll's own check says of any k outside [1, 256]
    (the extension's check names the entry point for the others)."""
    n = _integer(value, name)
    if not -2**31 <= n < 2**31:
        raise DomainError(f"{name} must be in [1, 256], got {n}")
    return n


def _new_k(value: Any, name: str = "new_k") -> int:
    """The losses' and project_sparse's ``new_k``: a top-k count that may be 0 (no prefix of the
    new row's own). A negative one is a DomainError here, before any buffer is sized from it
    (a negative capacity had reached torch as a negative dimension)."""
    n = _k(value, name)
    if n < 0:
        raise DomainError(f"{name} must be in [0, 256], got {n}")
    return n


def _threads(value: Any) -> int:
    """``threads`` as the extension takes it: an integer in [0, 2**32) (0: every core of the pool,
    1: serial). A negative or huge count is a DomainError naming it, a non-integer (1.5, True) a
    ShapeError, where nanobind raised its own TypeError listing the whole signature."""
    n = _integer(value, "threads")
    if not 0 <= n < 2**32:
        raise DomainError(f"threads must be >= 0 (0: every core, 1: serial), got {n}")
    return n


def _sparse_arg(rows: Any) -> tuple:
    return tuple(arg(a) for a in rows[:-1]) + (_size(rows[-1], "vocab"),)


@accepts_capsules
def project_sparse(rows: AlignedRows, eps: float, *, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL,
                   max_iterations: int = DEFAULT_MAX_ITERATIONS, threads: int = 0) -> Tuple[SparseRows, ProjectionStats]:
    """The projection of aligned rows (the |U| + 1 lumped categories): log pi* on U and the
    bucket as SparseRows, with the per-row ProjectionStats."""
    frame = Framework(rows.new_log_probs)
    dtype = _float_dtype(frame, rows.new_log_probs)
    lead = tuple(rows.counts.shape)
    out = sparse_empty(frame, lead, int(rows.indices.shape[-1]), rows.vocab, dtype)
    st = ProjectionStats.empty(frame, lead)
    args = (_sparse_arg(rows), _bound(eps), out, st.values, st.counters, *_solver(rtol, atol, max_iterations))
    if _on_cuda(rows.new_log_probs):
        cuda, stream = _cuda_call(frame, rows.new_log_probs, "project_sparse")
        cuda.project_sparse(*args, stream, CUDA_CHECKED)
    else:
        _troll.project_sparse(*args, _threads(threads))
    return (SparseRows(*(frame.result(a) for a in out[:4]), rows.vocab),
            ProjectionStats(frame.result(st.values), frame.result(st.counters)))


@accepts_capsules
def kl_sparse(rows: AlignedRows, *, threads: int = 0) -> Any:
    """Per-row KL(new || old) of aligned rows (their lumped categories)."""
    frame = Framework(rows.new_log_probs)
    dtype = _float_dtype(frame, rows.new_log_probs)
    y = frame.empty(tuple(rows.counts.shape), dtype)
    if _on_cuda(rows.new_log_probs):
        cuda, stream = _cuda_call(frame, rows.new_log_probs, "kl_sparse")
        cuda.kl_sparse(_sparse_arg(rows), y, stream, CUDA_CHECKED)
    else:
        _troll.kl_sparse(_sparse_arg(rows), y, _threads(threads))
    return frame.result(y)


@accepts_capsules
def project_sparse_backward(rows: AlignedRows, log_probs: SparseRows, stats: ProjectionStats,
                            grad: Tuple[Any, Any], *, old: bool = False, eps: bool = False,
                            threads: int = 0) -> Tuple[Tuple[Any, Any], Optional[Tuple[Any, Any]], Optional[Any]]:
    """The VJP of ``project_sparse``: given grad = (dL/dlog_probs (..., k_max), dL/dlog_remainder
    (...)) on its output, returns the gradient on the aligned new side (the same pair of arrays),
    on the old side (or None) and per-row dL/deps (or None)."""
    frame = Framework(rows.new_log_probs)
    dtype = _float_dtype(frame, rows.new_log_probs)
    lead, k_max = tuple(rows.counts.shape), int(rows.indices.shape[-1])

    def pair() -> Tuple[Any, Any]:
        return frame.empty(lead + (k_max,), dtype), frame.empty(lead, dtype)

    grad_new = pair()
    grad_old = pair() if old else None
    grad_eps = frame.empty(lead, dtype) if eps else None
    check_stats_rows(stats, lead, "project_sparse_backward")
    args = (_sparse_arg(rows), _sparse_arg(log_probs), arg(stats.values), arg(stats.counters),
            (arg(grad[0]), arg(grad[1])), grad_new, grad_old, grad_eps)
    if _on_cuda(rows.new_log_probs):
        cuda, stream = _cuda_call(frame, rows.new_log_probs, "project_sparse_backward")
        cuda.project_sparse_backward(*args, stream, CUDA_CHECKED)
    else:
        _troll.project_sparse_backward(*args, _threads(threads))
    return (tuple(frame.result(a) for a in grad_new),
            None if grad_old is None else tuple(frame.result(a) for a in grad_old),
            None if grad_eps is None else frame.result(grad_eps))


@accepts_capsules
def sparsify_backward(logits: Any, support: SparseRows, grad: Tuple[Any, Any], *, threads: int = 0) -> Any:
    """The gradient w.r.t. dense ``logits`` (..., V) of a loss whose gradient on sparse rows
    gathered from them (the support of ``support``, its bucket the rest) is ``grad`` =
    (dL/dlog_probs, dL/dlog_remainder): the scatter of docs/sparse.md."""
    frame = Framework(logits)
    dtype = _float_dtype(frame, logits)
    out = frame.empty(tuple(logits.shape), dtype)
    args = (arg(logits), _sparse_arg(support), (arg(grad[0]), arg(grad[1])), out)
    if _on_cuda(logits):
        cuda, stream = _cuda_call(frame, logits, "sparsify_backward")
        cuda.sparsify_backward(*args, stream, CUDA_CHECKED)
    else:
        _troll.sparsify_backward(*args, _threads(threads))
    return frame.result(out)


# ---- Objectives (the extension's forward / backward pairs; troll.torch wraps them) ----

#: The fields of troll::objective_metrics, in order: the CUDA forward writes them to a float64
#: device array (``tokens`` and ``sequences`` are 64-bit integers in their slots).
METRIC_FIELDS = ("loss", "tokens", "sequences", "ratio_mean", "kl_before_mean", "kl_before_max", "kl_after_mean",
                 "kl_after_max", "regression_kl_mean", "projected_fraction", "eta_mean", "limited_fraction",
                 "divergence_mean")


def objective_forward(name: str, new_logits: Any, args: tuple, *, threads: int = 0) -> Any:
    """Runs the extension's objective forward ``name`` (trust_region_forward, ...) with ``args``
    on the logits' device. Returns the metrics: a dict from the host extension, or the CUDA
    extension's float64 device array of METRIC_FIELDS (read it with ``metrics_dict``; entry 0,
    the loss, needs no synchronisation)."""
    if _on_cuda(new_logits):
        frame = Framework(new_logits)
        cuda, stream = _cuda_call(frame, new_logits, name)
        metrics = frame.empty((len(METRIC_FIELDS),), "float64")
        getattr(cuda, name)(*args, None, metrics, stream, CUDA_CHECKED)
        return metrics
    return getattr(_troll, name)(*args, None, _threads(threads))


def objective_backward(name: str, new_logits: Any, args: tuple, *, threads: int = 0) -> None:
    """Runs the extension's fused objective backward ``name`` with ``args`` (grad_new, grad_loss
    last) on the logits' device."""
    if _on_cuda(new_logits):
        cuda, stream = _cuda_call(Framework(new_logits), new_logits, name)
        getattr(cuda, name)(*args, stream, CUDA_CHECKED)
    else:
        getattr(_troll, name)(*args, _threads(threads))


def metrics_dict(metrics: Any) -> dict:
    """objective_forward's metrics as a dict of Python numbers (a device array is copied to the
    host: one synchronisation)."""
    if isinstance(metrics, dict):
        return metrics
    host = np.from_dlpack(metrics.cpu()) if hasattr(metrics, "cpu") else np.asarray(metrics.get())
    values = host.astype(np.float64, copy=False)
    counts = values.view(np.int64)
    return {f: int(counts[i]) if f in ("tokens", "sequences") else float(values[i])
            for i, f in enumerate(METRIC_FIELDS)}


def check_sparse_rows(rows: Any, name: str) -> SparseRows:
    """``rows`` as SparseRows: a SparseRows, or any 5-sequence (indices, log_probs, counts,
    log_remainder, vocab) such as a plain tuple; ShapeError otherwise."""
    if isinstance(rows, SparseRows):
        return rows
    if not isinstance(rows, (tuple, list)) or len(rows) != 5:
        raise ShapeError(f"troll: {name} must be SparseRows (indices, log_probs, counts, log_remainder, vocab)")
    return SparseRows(*rows)


# ---- Vocabulary shards ----


def sparsify_state_bytes(k: int) -> int:
    """Bytes of one packed sparsify state (one row of one vocabulary shard) for top-``k``."""
    return int(_troll.sparsify_state_bytes(_k(k)))


def _rows_dtype(frame: Framework, logits: Any) -> str:
    """The element type of sparse rows made from ``logits``: theirs, float32 for CUDA 16-bit ones."""
    if _on_cuda(logits) and frame.dtype_name(logits) in ("float16", "bfloat16"):
        return "float32"  # the CUDA sparse functions read 16-bit logits; the rows are float32
    return _float_dtype(frame, logits)


@accepts_capsules
def sparsify_shard(shard_logits: Any, vocab_offset: int, vocab: int, k: int = 64, delta: float = 1e-5,
                   sampled: Any = None, *, threads: int = 0) -> Any:
    """The partial sparsify states of one vocabulary shard: ``shard_logits`` (..., V_shard) are
    the tokens [vocab_offset, vocab_offset + V_shard) of rows of ``vocab`` tokens; ``sampled``
    holds global token ids (int32, one a row). Returns uint8 (..., sparsify_state_bytes(k)):
    fixed-size, to be exchanged between processes and merged by ``sparsify_finalize``. CUDA
    logits (float16 / bfloat16 too) give device states; the packed bytes are the same on both."""
    frame = Framework(shard_logits)
    _rows_dtype(frame, shard_logits)
    rows = leading_shape(shard_logits, "shard_logits")
    states = frame.empty(rows + (sparsify_state_bytes(k),), "uint8")
    args = (arg(shard_logits), _size(vocab_offset, "vocab_offset"), _size(vocab, "vocab"),
            None if sampled is None else arg(sampled), _k(k), _real(delta, "delta"), states)
    if _on_cuda(shard_logits):
        cuda, stream = _cuda_call(frame, shard_logits, "sparsify_shard")
        cuda.sparsify_shard(*args, stream, CUDA_CHECKED)
    else:
        _troll.sparsify_shard(*args, _threads(threads))
    return frame.result(states)


@accepts_capsules
def sparsify_finalize(states: Any, vocab: int, k: int = 64, delta: float = 1e-5, *, sampled: bool = False,
                      dtype: str = "float32", tail_sums: Any = None, return_tail_max: bool = False,
                      threads: int = 0) -> Tuple[Any, ...]:
    """The sparse rows of a stack of shard states (shards, ..., bytes) that together cover the
    vocabulary: merged in stack order (exact, order-independent supports), then finalised as
    ``sparsify`` would finalise the whole rows. ``sampled`` says whether the states were made with
    sampled tokens (capacity k + 1). Returns ``(SparseRows, log_sums)``, log_sums (..., 4)
    float64 = {ref, log sum_j e^(z_j - ref), tail_ref, log sum_{j not in S} e^(z_j - tail_ref)}
    per row, ref the row's and tail_ref the tail's largest logit (-inf: no tail mass), for the
    shards' backward,
    and with ``return_tail_max=True`` also tail_max (...) float64, the largest logit outside each
    row's support. Device states are merged and finalised on their device.

    Two stages give ``sparsify``'s rows bit for bit (on the CPU: the CPU's; on CUDA: the CUDA
    sparsify's): without ``tail_sums`` the supports are exact and the values come from the merged
    running sums (a few ulps off); every shard then computes ``sparsify_tail_sums(its logits,
    offset, rows, tail_max)``, and a second call given those sums stacked (shards, ..., 2) writes
    the canonical values."""
    frame = Framework(states)
    rows = tuple(states.shape[1:-1])
    k_max = max(1, min(_k(k) + bool(sampled), _size(vocab, "vocab")))
    out = sparse_empty(frame, rows, k_max, vocab, dtype)
    log_sums = frame.empty(rows + (4,), "float64")
    tail_max = frame.empty(rows, "float64") if return_tail_max else None
    args = (arg(states), _k(k), _real(delta, "delta"), out, log_sums, tail_max,
            None if tail_sums is None else arg(tail_sums))
    if _on_cuda(states):
        cuda, stream = _cuda_call(frame, states, "sparsify_finalize")
        cuda.sparsify_finalize(*args, stream, CUDA_CHECKED)
    else:
        _troll.sparsify_finalize(*args, _threads(threads))
    result = (SparseRows(*(frame.result(a) for a in out[:4]), _size(vocab, "vocab")), frame.result(log_sums))
    return result + (frame.result(tail_max),) if return_tail_max else result


@accepts_capsules
def sparsify_tail_sums(shard_logits: Any, vocab_offset: int, rows: SparseRows, tail_max: Any, *,
                       threads: int = 0) -> Any:
    """One shard's share of the exact tail sums (sparsify_finalize's second stage): (..., 2)
    float64, the unevaluated pair hi + lo of sum exp(z_j - tail_max) over the shard's tokens j
    outside each row's support."""
    frame = Framework(shard_logits)
    _rows_dtype(frame, shard_logits)
    out = frame.empty(leading_shape(shard_logits, "shard_logits") + (2,), "float64")
    args = (arg(shard_logits), _size(vocab_offset, "vocab_offset"), _sparse_arg(rows), arg(tail_max), out)
    if _on_cuda(shard_logits):
        cuda, stream = _cuda_call(frame, shard_logits, "sparsify_tail_sums")
        cuda.sparsify_tail_sums(*args, stream, CUDA_CHECKED)
    else:
        _troll.sparsify_tail_sums(*args, _threads(threads))
    return frame.result(out)


@accepts_capsules
def sparsify_shard_backward(shard_logits: Any, vocab_offset: int, support: SparseRows, grad: Tuple[Any, Any],
                            log_sums: Any, *, threads: int = 0) -> Any:
    """The gradient w.r.t. one shard's logits of a loss whose gradient on the sparse rows
    (finalised from every shard) is ``grad`` = (d/dlog_probs, d/dlog_remainder)."""
    frame = Framework(shard_logits)
    dtype = _float_dtype(frame, shard_logits)
    out = frame.empty(tuple(shard_logits.shape), dtype)
    args = (arg(shard_logits), _size(vocab_offset, "vocab_offset"), _sparse_arg(support),
            (arg(grad[0]), arg(grad[1])), arg(log_sums), out)
    if _on_cuda(shard_logits):
        cuda, stream = _cuda_call(frame, shard_logits, "sparsify_shard_backward")
        cuda.sparsify_shard_backward(*args, stream, CUDA_CHECKED)
    else:
        _troll.sparsify_shard_backward(*args, _threads(threads))
    return frame.result(out)
