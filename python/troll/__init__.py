"""troll: TROLL's exact KL trust-region projection of LLM next-token distributions.

Arrays in (any DLPack array: torch, NumPy, ...), arrays of the same framework out, no copies.
``troll.torch`` holds the autograd functions and training losses for PyTorch. See
docs/python.md."""

from __future__ import annotations

from typing import Any

from ._errors import BackendError, DomainError, DTypeError, InfeasibleError, InvalidInput, ShapeError
from . import _troll
from ._cpu import isa as cpu_isa
from ._core import (
    INACTIVE,
    PROJECTED,
    RESTRICTED,
    STATUS_NAMES,
    AlignedRows,
    ProjectionStats,
    SparseRows,
    align,
    cuda_available,
    kl,
    kl_backward,
    kl_sparse,
    log_softmax,
    project,
    project_backward,
    project_sparse,
    project_sparse_backward,
    sparsify,
    sparsify_backward,
    sparsify_finalize,
    sparsify_shard,
    sparsify_shard_backward,
    sparsify_tail_sums,
    sparsify_state_bytes,
)

from . import gaussian  # troll.gaussian: Gaussian trust regions (docs/gaussian.md)

__version__: str = _troll.__version__

__all__ = [
    "InvalidInput", "ShapeError", "DTypeError", "DomainError", "InfeasibleError", "BackendError",
    "INACTIVE", "PROJECTED", "RESTRICTED", "STATUS_NAMES",
    "ProjectionStats", "SparseRows", "AlignedRows",
    "log_softmax", "kl", "kl_backward", "project", "project_backward", "cuda_available", "cpu_isa",
    "sparsify", "sparsify_backward", "align", "project_sparse", "project_sparse_backward", "kl_sparse",
    "sparsify_shard", "sparsify_finalize", "sparsify_tail_sums", "sparsify_shard_backward", "sparsify_state_bytes",
    "gaussian",
]


def __getattr__(name: str) -> Any:
    # troll.torch imports torch: loaded on first use, so troll works without torch installed.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'troll' has no attribute {name!r}")
