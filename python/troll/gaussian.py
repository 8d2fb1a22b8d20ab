"""Gaussian trust regions (docs/gaussian.md): the projection of new Gaussian policies
N(mean, cov) onto a KL ball around old ones, for any DLPack array. Means are (..., d) arrays;
covariances are lower Cholesky factors (..., d, d) or, in the ``_diag`` variants, standard
deviations (..., d). Every function returns arrays of the caller's framework and raises
troll.InvalidInput subclasses (naming the row of the flattened leading dimensions) before writing
anything. CUDA arrays go to troll._troll_cuda on the caller's current stream (troll/cuda_gaussian.cuh;
full covariances up to d = 256, diagonal up to d = 2048; ``troll._core.CUDA_CHECKED`` as for the
categorical functions). Differentiable versions for PyTorch: ``troll.torch.gaussian``. No maths here: the
extension calls troll/gaussian.hpp."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _core
from ._cpu import kernels as _troll
from ._arrays import Framework, accepts_capsules, arg, require_shape, writable
from ._core import INACTIVE, PROJECTED, STATUS_NAMES, _threads
from ._errors import ShapeError

__all__ = [
    "GaussianStats", "INACTIVE", "PROJECTED", "STATUS_NAMES",
    "project_joint", "project_split", "project_joint_diag", "project_split_diag",
    "project_backward", "project_jvp", "kl", "kl_diag", "empty_saved",
]


class GaussianStats:
    """Per-row statistics of a Gaussian projection, each an array of the rows' leading shape:
    ``t`` (interpolation weight of the new natural parameters), ``eta`` = (1 - t)/t, ``omega``
    (split: the mean step, mu* = (mu + omega mu_old)/(1 + omega)), ``kl_before`` / ``kl_after``
    (joint: KL(. || old); split: its covariance part), ``mean_kl_before`` / ``mean_kl_after``
    (split: the mean part), ``fisher`` (float64), ``iterations`` and ``status`` (int32: INACTIVE,
    PROJECTED). Views of two packed buffers, ``values`` (..., 8) float64 and ``counters`` (..., 2)
    int32, which the backward passes read."""

    __slots__ = ("values", "counters")

    def __init__(self, values: Any, counters: Any) -> None:
        self.values = values
        self.counters = counters

    @classmethod
    def empty(cls, frame: Framework, rows_shape: tuple) -> "GaussianStats":
        return cls(frame.empty(rows_shape + (8,), "float64"), frame.empty(rows_shape + (2,), "int32"))

    t = property(lambda self: self.values[..., 0])
    eta = property(lambda self: self.values[..., 1])
    omega = property(lambda self: self.values[..., 2])
    kl_before = property(lambda self: self.values[..., 3])
    kl_after = property(lambda self: self.values[..., 4])
    mean_kl_before = property(lambda self: self.values[..., 5])
    mean_kl_after = property(lambda self: self.values[..., 6])
    fisher = property(lambda self: self.values[..., 7])
    iterations = property(lambda self: self.counters[..., 0])
    status = property(lambda self: self.counters[..., 1])

    def __repr__(self) -> str:
        return f"GaussianStats(rows={tuple(self.values.shape[:-1])})"


def _rows(mean: Any) -> tuple:
    shape = tuple(mean.shape)
    if len(shape) == 0:
        raise ShapeError("troll: mean is a scalar; a (..., d) array is needed")
    return shape[:-1]


def _dtype(frame: Framework, x: Any) -> str:
    dtype = frame.dtype_name(x)
    if dtype not in ("float32", "float64"):
        raise TypeError(f"troll: mean has dtype {dtype}; troll computes on float32 and float64")
    return dtype


def empty_saved(mean: Any) -> Any:
    """An uninitialised float64 array of shape (rows, d*d + 2*d) for the ``saved`` argument of
    project_joint / project_split (which fill it with each full row's factorisation) and of
    project_backward / project_jvp (which then read it instead of refactorising; bit-for-bit the
    same results, 1.3-1.4x faster forward + backward). Pass it only to the derivatives of exactly
    the inputs whose forward filled it."""
    frame = Framework(mean)
    rows = 1
    for s in _rows(mean):
        rows *= int(s)
    d = int(tuple(mean.shape)[-1])
    return frame.empty((rows, d * d + 2 * d), "float64")


def _project(mean: Any, cov: Any, old_mean: Any, old_cov: Any, eps_mean: float, eps_cov: float,
             full: bool, split: bool, out: Optional[Tuple[Any, Any]], stats: Optional[GaussianStats],
             rtol: float, atol: float, max_iterations: int, threads: int,
             saved: Optional[Any] = None) -> Tuple[Any, Any, GaussianStats]:
    frame = Framework(mean)
    dtype = _dtype(frame, mean)
    rows = _rows(mean)
    if out is None:
        out_mean, out_cov = frame.empty(tuple(mean.shape), dtype), frame.empty(tuple(cov.shape), dtype)
    else:
        out_mean, out_cov = writable(out[0], "out[0]"), writable(out[1], "out[1]")
        require_shape(out_mean, tuple(mean.shape), "out[0]", "mean")
        require_shape(out_cov, tuple(cov.shape), "out[1]", "the covariance")
    if stats is None:
        stats = GaussianStats.empty(frame, rows)
    else:
        _core.check_stats_rows(stats, rows, "gaussian.project")
        writable(stats.values, "stats.values")
        writable(stats.counters, "stats.counters")
    if saved is not None:
        writable(saved, "saved")
    eps_mean, eps_cov = _core._bound(eps_mean, "eps_mean"), _core._bound(eps_cov, "eps_cov")
    rtol, atol, max_iterations = _core._solver(rtol, atol, max_iterations)
    if _core._on_cuda(mean):
        cuda, stream = _core._cuda_call(frame, mean, "gaussian.project")
        cuda.gaussian_project(arg(mean), arg(cov), arg(old_mean), arg(old_cov), eps_mean, eps_cov,
                              full, split, out_mean, out_cov, stats.values, stats.counters, rtol, atol,
                              max_iterations, stream, _core.CUDA_CHECKED, saved=saved)
    else:
        _troll.gaussian_project(arg(mean), arg(cov), arg(old_mean), arg(old_cov), eps_mean, eps_cov,
                                full, split, out_mean, out_cov, stats.values, stats.counters, rtol, atol,
                                max_iterations, _threads(threads), saved=saved)
    return frame.result(out_mean), frame.result(out_cov), stats


@accepts_capsules
def project_joint(mean: Any, cov_chol: Any, old_mean: Any, old_cov_chol: Any, eps: float, *,
                  out: Optional[Tuple[Any, Any]] = None, stats: Optional[GaussianStats] = None,
                  rtol: float = 1e-11, atol: float = 0.0, max_iterations: int = 100,
                  threads: int = 0, saved: Optional[Any] = None) -> Tuple[Any, Any, GaussianStats]:
    """The projection of N(mean, LLᵀ) onto KL(pi || N(old_mean, L°L°ᵀ)) <= eps (natural-parameter
    interpolation, one t per row). ``cov_chol``: (..., d, d) lower-triangular factors with a
    positive diagonal, each matrix row-major and contiguous. Returns ``(mean*, cov_chol*,
    stats)``; rows already inside the ball are copied bit for bit. ``saved``: an array from
    empty_saved(mean) to receive each row's factorisation for project_backward / project_jvp."""
    return _project(mean, cov_chol, old_mean, old_cov_chol, eps, eps, True, False, out, stats, rtol, atol,
                    max_iterations, _threads(threads), saved)


@accepts_capsules
def project_split(mean: Any, cov_chol: Any, old_mean: Any, old_cov_chol: Any, eps_mean: float, eps_cov: float,
                  *, out: Optional[Tuple[Any, Any]] = None, stats: Optional[GaussianStats] = None,
                  rtol: float = 1e-11, atol: float = 0.0, max_iterations: int = 100,
                  threads: int = 0, saved: Optional[Any] = None) -> Tuple[Any, Any, GaussianStats]:
    """The split projection of the trust-region layers: the mean against ``eps_mean`` (closed
    form in the old covariance's metric), the covariance against ``eps_cov``. Shapes and returns
    as project_joint."""
    return _project(mean, cov_chol, old_mean, old_cov_chol, eps_mean, eps_cov, True, True, out, stats, rtol,
                    atol, max_iterations, _threads(threads), saved)


@accepts_capsules
def project_joint_diag(mean: Any, std: Any, old_mean: Any, old_std: Any, eps: float, *,
                       out: Optional[Tuple[Any, Any]] = None, stats: Optional[GaussianStats] = None,
                       rtol: float = 1e-11, atol: float = 0.0, max_iterations: int = 100,
                       threads: int = 0) -> Tuple[Any, Any, GaussianStats]:
    """project_joint for diagonal covariances given as standard deviations (..., d), all > 0.
    Returns ``(mean*, std*, stats)``."""
    return _project(mean, std, old_mean, old_std, eps, eps, False, False, out, stats, rtol, atol,
                    max_iterations, _threads(threads))


@accepts_capsules
def project_split_diag(mean: Any, std: Any, old_mean: Any, old_std: Any, eps_mean: float, eps_cov: float, *,
                       out: Optional[Tuple[Any, Any]] = None, stats: Optional[GaussianStats] = None,
                       rtol: float = 1e-11, atol: float = 0.0, max_iterations: int = 100,
                       threads: int = 0) -> Tuple[Any, Any, GaussianStats]:
    """project_split for diagonal covariances given as standard deviations."""
    return _project(mean, std, old_mean, old_std, eps_mean, eps_cov, False, True, out, stats, rtol, atol,
                    max_iterations, _threads(threads))


@accepts_capsules
def project_backward(mean: Any, cov: Any, old_mean: Any, old_cov: Any, eps_mean: float, eps_cov: float,
                     out_mean: Any, out_cov: Any, stats: GaussianStats, grad_out_mean: Any, grad_out_cov: Any,
                     *, full: bool, split: bool, old: bool = False, eps: bool = False,
                     threads: int = 0, saved: Optional[Any] = None
                     ) -> Tuple[Any, Any, Optional[Any], Optional[Any], Optional[Any], Optional[Any]]:
    """The vector-Jacobian product of a Gaussian projection (``full``: Cholesky factors, else
    standard deviations; ``split``: split bounds, else joint with ``eps_mean`` = ``eps_cov`` = eps).
    Given dL/dmean* and dL/dcov* (factor gradients: lower triangle read), returns
    ``(grad_mean, grad_cov, grad_old_mean, grad_old_cov, grad_eps, grad_eps_mean)``: the old-side
    gradients when ``old``, the per-row float64 bound gradients when ``eps`` (grad_eps: joint eps
    or eps_cov; grad_eps_mean: split only), else None. Factor gradients are lower-triangular.
    ``saved`` (full only): the array the forward filled (empty_saved), read instead of refactorising."""
    frame = Framework(mean)
    dtype = _dtype(frame, mean)
    rows = _rows(mean)
    gm, gc = frame.empty(tuple(mean.shape), dtype), frame.empty(tuple(cov.shape), dtype)
    gom = frame.empty(tuple(mean.shape), dtype) if old else None
    goc = frame.empty(tuple(cov.shape), dtype) if old else None
    ge = frame.empty(rows, "float64") if eps else None
    gem = frame.empty(rows, "float64") if eps and split else None
    _core.check_stats_rows(stats, rows, "gaussian.project_backward")
    eps_mean, eps_cov = _core._bound(eps_mean, "eps_mean"), _core._bound(eps_cov, "eps_cov")
    args = (arg(mean), arg(cov), arg(old_mean), arg(old_cov), eps_mean, eps_cov, full, split,
            arg(out_mean), arg(out_cov), arg(stats.values), arg(stats.counters), arg(grad_out_mean),
            arg(grad_out_cov), gm, gc, gom, goc, ge, gem)
    sv = None if saved is None else arg(saved)
    if _core._on_cuda(mean):
        cuda, stream = _core._cuda_call(frame, mean, "gaussian.project_backward")
        cuda.gaussian_project_backward(*args, stream, _core.CUDA_CHECKED, saved=sv)
    else:
        _troll.gaussian_project_backward(*args, _threads(threads), saved=sv)
    res = frame.result
    return (res(gm), res(gc), None if gom is None else res(gom), None if goc is None else res(goc),
            None if ge is None else res(ge), None if gem is None else res(gem))


@accepts_capsules
def project_jvp(mean: Any, cov: Any, old_mean: Any, old_cov: Any, eps_mean: float, eps_cov: float,
                out_mean: Any, out_cov: Any, stats: GaussianStats, tangent_mean: Any = None,
                tangent_cov: Any = None, tangent_old_mean: Any = None, tangent_old_cov: Any = None,
                tangent_eps: float = 0.0, tangent_eps_mean: float = 0.0, *, full: bool, split: bool,
                threads: int = 0, saved: Optional[Any] = None) -> Tuple[Any, Any]:
    """The Jacobian-vector product (forward-mode derivative) of a Gaussian projection: the tangents
    of (mean*, cov*) along tangents of the inputs (None: zero; factor tangents: lower triangle
    read) and of the bounds (``tangent_eps``: joint eps or eps_cov; ``tangent_eps_mean``: split
    only; one number for all rows). Factor tangents come back lower-triangular. ``saved`` as for
    project_backward."""
    frame = Framework(mean)
    dtype = _dtype(frame, mean)
    tm, tc = frame.empty(tuple(mean.shape), dtype), frame.empty(tuple(cov.shape), dtype)
    _core.check_stats_rows(stats, _rows(mean), "gaussian.project_jvp")
    opt = [None if x is None else arg(x) for x in (tangent_mean, tangent_cov, tangent_old_mean, tangent_old_cov)]
    eps_mean, eps_cov = _core._bound(eps_mean, "eps_mean"), _core._bound(eps_cov, "eps_cov")
    args = (arg(mean), arg(cov), arg(old_mean), arg(old_cov), eps_mean, eps_cov, full, split,
            arg(out_mean), arg(out_cov), arg(stats.values), arg(stats.counters), *opt, float(tangent_eps),
            float(tangent_eps_mean), tm, tc)
    sv = None if saved is None else arg(saved)
    if _core._on_cuda(mean):
        cuda, stream = _core._cuda_call(frame, mean, "gaussian.project_jvp")
        cuda.gaussian_project_jvp(*args, stream, _core.CUDA_CHECKED, saved=sv)
    else:
        _troll.gaussian_project_jvp(*args, _threads(threads), saved=sv)
    return frame.result(tm), frame.result(tc)


def _kl(mean: Any, cov: Any, old_mean: Any, old_cov: Any, full: bool, threads: int) -> Any:
    frame = Framework(mean)
    _dtype(frame, mean)
    out = frame.empty(_rows(mean), "float64")
    if _core._on_cuda(mean):
        cuda, stream = _core._cuda_call(frame, mean, "gaussian.kl")
        cuda.gaussian_kl(arg(mean), arg(cov), arg(old_mean), arg(old_cov), full, out, stream, _core.CUDA_CHECKED)
    else:
        _troll.gaussian_kl(arg(mean), arg(cov), arg(old_mean), arg(old_cov), full, out, _threads(threads))
    return frame.result(out)


@accepts_capsules
def kl(mean: Any, cov_chol: Any, old_mean: Any, old_cov_chol: Any, *, threads: int = 0) -> Any:
    """KL(N(mean, LLᵀ) || N(old_mean, L°L°ᵀ)) per row (float64, the rows' leading shape)."""
    return _kl(mean, cov_chol, old_mean, old_cov_chol, True, threads)


@accepts_capsules
def kl_diag(mean: Any, std: Any, old_mean: Any, old_std: Any, *, threads: int = 0) -> Any:
    """kl for diagonal covariances given as standard deviations."""
    return _kl(mean, std, old_mean, old_std, False, threads)
