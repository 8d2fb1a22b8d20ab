"""troll._troll_cuda's error path without a GPU: the real CUDA extension (not test_cuda_dispatch.py's
stand-in) is called with arrays that claim, through DLPack, to live in CUDA memory (made up here
with ctypes: no GPU and no CUDA framework needed). What can run on the host runs: the module's
shape checks (plain C++), and the exceptions that cuda_entry.cu (compiled by nvcc) throws when the
CUDA runtime has no device. Both must arrive as troll's typed Python exceptions with a plain
message; a crash here is a broken translation of C++ exceptions across the two translation units
or the two nanobind modules. Skipped where the extension was not built; the device-only checks
skip where a GPU is visible (the runtime then succeeds and real device work would follow)."""

from __future__ import annotations

import ctypes

import pytest

import troll
from troll import _core

cuda = _core._troll_cuda
needs_extension = pytest.mark.skipif(cuda is None, reason="troll built without the CUDA extension")
no_device = pytest.mark.skipif(cuda is None or cuda.device_count() > 0,
                               reason="a CUDA device is visible (test_cuda.py covers the device path)")

_KDL_CUDA = 2
_FLOAT, _INT = 2, 0  # DLDataTypeCode kDLFloat, kDLInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaArray:
    """A C-contiguous array that DLPack reports on CUDA device 0. Its data pointer is host memory
    that nothing on the device ever reads: only host-side checks may run on it."""

    def __init__(self, shape, code=_FLOAT, bits=32):
        self.shape = tuple(shape)
        self.dtype = {(_FLOAT, 32): "float32", (_FLOAT, 64): "float64", (_INT, 32): "int32"}[(code, bits)]
        n = len(self.shape)
        strides, size = [], 1
        for d in reversed(self.shape):
            strides.append(size)
            size *= d
        self._shape = (ctypes.c_int64 * n)(*self.shape)
        self._strides = (ctypes.c_int64 * n)(*reversed(strides))
        self._data = ctypes.create_string_buffer(max(1, size * bits // 8))
        self._managed = _DLManagedTensor()  # no deleter: this object owns everything
        t = self._managed.dl_tensor
        t.data = ctypes.addressof(self._data)
        t.device = _DLDevice(_KDL_CUDA, 0)
        t.ndim = n
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = self._shape
        t.strides = self._strides

    def __dlpack_device__(self):
        return (_KDL_CUDA, 0)

    def __dlpack__(self, stream=None, **kwargs):
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)


def _project_args(rows=12, vocab=100, stats_rows=None):
    stats_rows = rows if stats_rows is None else stats_rows
    return (FakeCudaArray((rows, vocab)), FakeCudaArray((rows, vocab)), 0.05, FakeCudaArray((rows, vocab)),
            FakeCudaArray((stats_rows, 6), bits=64), FakeCudaArray((stats_rows, 2), code=_INT, bits=32))


@needs_extension
def test_module_shape_checks_raise_shape_error_on_fake_cuda_arrays():
    args = _project_args(stats_rows=11)
    with pytest.raises(troll.ShapeError, match="stats buffers") as info:
        cuda.project(*args, 1e-12, 1e-15, 50, 0, True)
    assert info.value.row is None
    x = FakeCudaArray((3, 10))
    with pytest.raises(troll.ShapeError, match="not in CUDA"):
        import numpy as np

        cuda.kl(x, np.zeros((3, 10), np.float32), FakeCudaArray((3,)), 0, True)


@no_device
def test_runtime_errors_thrown_in_the_nvcc_unit_arrive_as_backend_error():
    # device_name: cudaGetDeviceProperties fails in cuda_entry.cu (nvcc); the module translates.
    with pytest.raises(troll.BackendError) as info:
        cuda.device_name(0)
    message = str(info.value)
    assert message.startswith("troll._troll_cuda: cudaGetDeviceProperties"), message
    assert info.value.args == (message,)
    # project on well-formed arrays: the checks pass, then cudaSetDevice (nvcc unit) throws.
    for _ in range(3):  # repeatedly: the translation leaves nothing behind
        with pytest.raises(troll.BackendError, match="cudaSetDevice"):
            cuda.project(*_project_args(), 1e-12, 1e-15, 50, 0, True)


@no_device
def test_the_python_api_raises_backend_error_for_fake_cuda_arrays_without_a_device():
    # troll.project routes a CUDA array to the extension (stream 0 outside torch / cupy).
    with pytest.raises(troll.BackendError, match="cudaSetDevice"):
        troll.project(*_project_args()[:3], out=FakeCudaArray((12, 100)),
                      stats=_core.ProjectionStats(FakeCudaArray((12, 6), bits=64),
                                                  FakeCudaArray((12, 2), code=_INT, bits=32)))
