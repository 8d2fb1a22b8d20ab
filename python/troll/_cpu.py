"""Which build of the CPU extension this process runs.

``pip install ./python`` builds the CPU extension twice on x86-64: ``troll._troll`` for AVX2 + FMA
(the baseline every call can run) and ``troll._troll_avx512`` for x86-64-v4 (AVX-512 F, BW, CD,
DQ, VL), whose kernels are 1.5-1.9x faster on the benchmarks of docs/performance.md. The two are
the same sources and the same API; their results agree to the documented tolerances, not bit for
bit (the kernels' sums are taken in different packet widths).

``kernels`` is the module every CPU call goes through: the AVX-512 build where this CPU (and its
OS) can run it and it was built, else the baseline. The environment variable ``TROLL_CPU_ISA``,
read once at import, overrides the choice: ``auto`` (the default), ``baseline`` (always
``troll._troll``) or ``avx512`` (fail at import where it cannot run).

``troll._troll_avx512`` is imported only after the CPU check: the module's own initialisation is
compiled for x86-64-v4 as well, so importing it on a CPU without AVX-512 stops the process with
SIGILL rather than raising ImportError."""

from __future__ import annotations

import os
from types import ModuleType

from . import _troll as _baseline

ENV = "TROLL_CPU_ISA"
CHOICES = ("auto", "baseline", "avx512")


def _select() -> ModuleType:
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want not in CHOICES:
        raise ImportError(f"troll: {ENV}={want!r} is not one of {', '.join(CHOICES)}")
    if want == "baseline":
        return _baseline
    if not _baseline.cpu_supports_avx512():
        if want == "avx512":
            raise ImportError(f"troll: {ENV}=avx512, but this CPU lacks x86-64-v4 (AVX-512 F, BW, CD, DQ, VL)")
        return _baseline
    try:
        from . import _troll_avx512
    except ImportError:
        if want == "avx512":
            raise
        return _baseline  # a build without the AVX-512 module (TROLL_PYTHON_AVX512=OFF, not x86-64)
    return _troll_avx512


#: The CPU extension module in use (``troll._troll`` or ``troll._troll_avx512``).
kernels: ModuleType = _select()


def isa() -> str:
    """The instruction set of the CPU kernels in use: ``"avx512"`` (x86-64-v4), ``"avx2"`` (AVX2 +
    FMA, the x86-64 baseline build), ``"native"`` (built with ``-march=native``) or ``"generic"``."""
    return str(kernels.ISA)
