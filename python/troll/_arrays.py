"""How troll meets the caller's arrays: which framework an input comes from, how outputs are
allocated there (same device), and how torch tensors are handed to the extension (detached: a
tensor that requires grad cannot be exported through DLPack). No maths here."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any, Callable, Sequence, Tuple, TypeVar

import numpy as np

from ._errors import ShapeError


def _module_of(x: Any) -> str:
    """The framework of an array: "torch" for every torch.Tensor (subclasses a user defines
    included, whose module is their own), "numpy" for every ndarray, else the top-level module of
    its type ("jax", "cupy", ...)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
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
        #: The CUDA device of another framework's array (JAX on a GPU, ...), else None.
        self.cuda_device = None
        if self.name not in ("torch", "numpy", "cupy") and hasattr(like, "__dlpack_device__"):
            kind, index = like.__dlpack_device__()
            if int(kind) == 2:  # kDLCUDA
                self.cuda_device = int(index)

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
        if self.cuda_device is not None:
            return _cuda_empty(shape, dtype, self.cuda_device, self.name)
        # NumPy, and host memory for any other framework's host arrays (wrapped back by `result`).
        return np.empty(shape, dtype=dtype)

    def result(self, x: Any) -> Any:
        """An output allocated by `empty`, as an array of the caller's framework."""
        if self.name in ("torch", "numpy", "cupy"):
            return x
        if self.name in ("jax", "jaxlib"):
            import jax
            import jax.numpy as jnp

            if str(x.dtype) in ("float64", "int64") and not jax.config.jax_enable_x64:
                # JAX without 64-bit types would round a float64 output (the stats, Gaussian
                # KLs, shard tail maxima) to float32 silently, and the next troll call refuses
                # it: such outputs stay troll's own arrays (NumPy on the host), as documented.
                return x
            return jnp.from_dlpack(x)
        return x


def _cuda_empty(shape: tuple, dtype: str, device: int, framework: str) -> Any:
    """Device memory for the outputs of another framework's CUDA arrays (JAX on a GPU, ...): a
    torch tensor, else a CuPy array; `Framework.result` hands it back through DLPack."""
    try:
        import torch
    except ImportError:
        try:
            import cupy
        except ImportError:
            raise ShapeError(f"troll: the {framework} array is in CUDA memory; troll allocates the outputs of "
                             "such arrays with torch or CuPy, and neither is installed") from None
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)
    return torch.empty(shape, dtype=getattr(torch, dtype), device=torch.device("cuda", device))


def arg(x: Any) -> Any:
    """An array as the extension takes it: torch tensors detached (no copy)."""
    if _module_of(x) == "torch" and x.requires_grad:
        return x.detach()
    return x


def writable(x: Any, name: str) -> Any:
    """``x`` if troll may write into it (an ``out=`` / ``stats=`` buffer), else TypeError: JAX
    arrays are immutable (writing would change every array sharing the buffer), read-only NumPy
    arrays say so, and a torch tensor that requires grad would change behind autograd's back."""
    module = _module_of(x)
    if module in ("jax", "jaxlib"):
        raise TypeError(f"troll: {name} is a JAX array; JAX arrays are immutable (pass no {name}=, troll allocates "
                        "the result)")
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise TypeError(f"troll: {name} is a read-only NumPy array")
    if module == "torch" and getattr(x, "requires_grad", False):
        raise TypeError(f"troll: {name} requires grad; troll writes it outside autograd (pass a tensor that "
                        "does not, or detach it)")
    if module == "torch":
        _mark_written(x)
    return x


def _mark_written(x: Any) -> None:
    """Tells autograd that troll writes into the torch tensor ``x`` (as an in-place op would): a
    buffer that autograd saved for a backward (``y = a.exp(); troll.project(..., out=y.detach())``)
    then raises at that backward instead of giving a wrong gradient silently."""
    import torch  # loaded already: x is a torch tensor
    if x.is_inference():
        return  # no version counter (and no autograd) in inference mode
    bump = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    if bump is not None:
        bump(x)


def leading_shape(x: Any, name: str) -> tuple:
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ShapeError(f"troll: {name} is a scalar; a (..., V) array is needed")
    return shape[:-1]


def require_shape(x: Any, shape: tuple, name: str, ref: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ShapeError(f"troll: {name} has shape {tuple(x.shape)} but {ref} needs {tuple(shape)}")


# ---- Raw DLPack capsules ----
#
# A PyCapsule named "dltensor" (or "dltensor_versioned") is a DLPack array without its framework:
# it has no shape or dtype attributes and no __dlpack__. troll takes one as an array of the
# capsule's device: a host capsule becomes a NumPy array (so the results are NumPy arrays), a CUDA
# capsule a torch tensor (or a CuPy array without torch). No copy either way; the capsule is
# consumed, as DLPack requires.

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# Where DLTensor.device sits: DLManagedTensor starts with the DLTensor {void* data; DLDevice
# device; ...}; DLManagedTensorVersioned has {DLPackVersion (8 bytes), manager_ctx, deleter,
# uint64 flags} before it.
_DEVICE_OFFSET = {b"dltensor": 8, b"dltensor_versioned": 40}


def is_capsule(x: Any) -> bool:
    return type(x).__name__ == "PyCapsule"


def _capsule_device(cap: Any) -> Tuple[int, int]:
    name = _capsule_name(cap)
    if name not in _DEVICE_OFFSET:
        used = name is not None and name.startswith(b"used_")
        raise TypeError(f"troll: a PyCapsule named {name!r} is not a DLPack array"
                        + (" (it was consumed already: a DLPack capsule can be read only once)" if used else ""))
    pointer = _capsule_pointer(cap, name)
    device = (ctypes.c_int32 * 2).from_address(pointer + _DEVICE_OFFSET[name])
    return int(device[0]), int(device[1])


class _Capsule:
    """A capsule with the DLPack protocol around it, for np.from_dlpack."""

    def __init__(self, cap: Any, device: Tuple[int, int]) -> None:
        self._cap, self._device = cap, device

    def __dlpack__(self, **_kwargs: Any) -> Any:
        return self._cap

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device


def from_capsule(cap: Any) -> Any:
    """The array a DLPack capsule holds (see above)."""
    device = _capsule_device(cap)
    if device[0] in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        try:
            return np.from_dlpack(_Capsule(cap, (_DLPACK_CPU, 0)))
        except (BufferError, RuntimeError, ValueError) as e:  # e.g. bfloat16, which NumPy lacks
            raise TypeError(f"troll: cannot read the DLPack capsule's array ({e}); troll computes on float32 "
                            "and float64 (int32 for token ids)") from e
    if device[0] == _DLPACK_CUDA:
        try:
            import torch
        except ImportError:  # pragma: no cover - CuPy without torch
            import cupy

            return cupy.from_dlpack(_Capsule(cap, device))
        return torch.utils.dlpack.from_dlpack(cap)
    raise TypeError(f"troll: the DLPack capsule's device type {device[0]} is neither host nor CUDA memory")


def _check_torch(x: Any) -> None:
    """What DLPack would carry wrongly or not at all: a torch tensor must be dense (strided), in
    host or CUDA memory, and hold its values as stored (a lazily negated / conjugated view would
    be read without its sign: silently wrong)."""
    if str(x.layout) != "torch.strided":
        raise ShapeError(f"troll: a {x.layout} tensor was given; troll takes dense (strided) arrays (.to_dense() it)")
    if x.device.type not in ("cpu", "cuda"):
        raise ShapeError(f"troll: a tensor on device {x.device} was given; troll takes host (CPU) and CUDA arrays")
    if x.is_neg() or x.is_conj():
        raise ShapeError("troll: a tensor with torch's lazy negation / conjugation bit was given; its memory does "
                         "not hold its values (call .resolve_neg() / .resolve_conj() first)")


def _ingest(x: Any) -> Any:
    if is_capsule(x):
        return from_capsule(x)
    if isinstance(x, np.ma.MaskedArray):  # DLPack carries its data, not its mask
        raise TypeError("troll: a NumPy masked array was given; its mask would be ignored (pass "
                        "np.ma.filled(x, -np.inf) for masked logits, or x.data)")
    if _module_of(x) == "torch" and hasattr(x, "layout"):
        _check_torch(x)
        return x
    if type(x) is tuple:  # e.g. a gradient pair (g_lp, g_lr)
        return tuple(_ingest(a) for a in x)
    return x


F = TypeVar("F", bound=Callable[..., Any])


def accepts_capsules(fn: F) -> F:
    """Lets ``fn`` take raw DLPack capsules wherever it takes arrays (and inside plain tuples), and
    checks torch tensors for what DLPack cannot carry (``_check_torch``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*(_ingest(a) for a in args), **{k: _ingest(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]
