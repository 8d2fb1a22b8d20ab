"""How troll meets the caller's arrays: which framework an input comes from, how outputs are
allocated there (same device), and how torch tensors are handed to the extension (detached: a
tensor that requires grad cannot be exported through DLPack). No maths here."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._errors import ShapeError


def _module_of(x: Any) -> str:
    return type(x).__module__.split(".")[0]


class Framework:
    """Allocates outputs in the framework (and on the device) of a reference array."""

    def __init__(self, like: Any) -> None:
        self.name = _module_of(like)
        self.like = like
        if self.name == "torch":
            import torch

            self._torch = torch
        elif self.name == "numpy":
            pass
        elif self.name == "cupy":
            import cupy

            self._cupy = cupy
        elif not hasattr(like, "__dlpack__"):
            raise TypeError(
                f"troll: {type(like).__name__} is not an array (it has no __dlpack__); "
                "pass a torch tensor, a NumPy array or any DLPack-exporting array"
            )

    def dtype_name(self, x: Any) -> str:
        """'float32', 'float64', ... of an array of this framework."""
        return str(x.dtype).replace("torch.", "")

    def empty(self, shape: Sequence[int], dtype: str) -> Any:
        shape = tuple(int(s) for s in shape)
        if self.name == "torch":
            return self._torch.empty(shape, dtype=getattr(self._torch, dtype), device=self.like.device)
        if self.name == "cupy":
            with self._cupy.cuda.Device(self.like.device.id):
                return self._cupy.empty(shape, dtype=dtype)
        # NumPy, and host memory for any other framework (wrapped back by `result`).
        return np.empty(shape, dtype=dtype)

    def result(self, x: Any) -> Any:
        """An output allocated by `empty`, as an array of the caller's framework."""
        if self.name in ("torch", "numpy", "cupy"):
            return x
        if self.name in ("jax", "jaxlib"):
            import jax.numpy as jnp

            return jnp.from_dlpack(x)
        return x


def arg(x: Any) -> Any:
    """An array as the extension takes it: torch tensors detached (no copy)."""
    if _module_of(x) == "torch" and x.requires_grad:
        return x.detach()
    return x


def leading_shape(x: Any, name: str) -> tuple:
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ShapeError(f"troll: {name} is a scalar; a (..., V) array is needed")
    return shape[:-1]


def require_shape(x: Any, shape: tuple, name: str, ref: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ShapeError(f"troll: {name} has shape {tuple(x.shape)} but {ref} needs {tuple(shape)}")
