"""The CPU extension's two builds (troll/_cpu.py): which one runs, the TROLL_CPU_ISA override, and
that the AVX-512 build (troll._troll_avx512) and the baseline (troll._troll) agree — the same
API, the same errors, results within the documented tolerances (not bit for bit: their sums run
in different packet widths) — on the dense and sparse projections, their backward passes,
sparsify and a Gaussian projection. Without the AVX-512 build or an AVX-512 CPU the comparisons
skip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import troll
from troll import _core, _cpu, _troll
from troll import gaussian as tg

# Whether the package has the AVX-512 build, asked without importing it: its module initialisation
# is compiled for x86-64-v4 too, so importing it on a CPU without AVX-512 dies of SIGILL (an AVX2
# Zen 3 core did). It is imported only where it can run, as troll/_cpu.py does.
avx512_built = importlib.util.find_spec("troll._troll_avx512") is not None
_troll_avx512 = None
if avx512_built and _troll.cpu_supports_avx512():
    from troll import _troll_avx512

both = pytest.mark.skipif(_troll_avx512 is None or not _troll.cpu_supports_avx512(),
                          reason="needs troll._troll_avx512 and a CPU with AVX-512")


def _isa_in_child(value: str) -> subprocess.CompletedProcess:
    # Run from the installed package's parent, so that `import troll` finds the package this
    # process imported (not a source tree in the working directory).
    env = dict(os.environ, TROLL_CPU_ISA=value)
    where = os.path.dirname(os.path.dirname(os.path.abspath(troll.__file__)))
    return subprocess.run([sys.executable, "-c", "import troll; print(troll.cpu_isa())"], env=env, cwd=where,
                          capture_output=True, text=True, check=False)


def test_the_module_in_use_follows_the_cpu_and_the_override():
    want = os.environ.get("TROLL_CPU_ISA", "auto").strip().lower() or "auto"
    fast = _troll_avx512 is not None and _troll.cpu_supports_avx512()
    expected = _troll_avx512 if (want != "baseline" and fast) else _troll
    assert _cpu.kernels is expected and _core._troll is expected
    assert troll.cpu_isa() == expected.ISA
    assert _troll.ISA in ("avx2", "native", "generic")
    if _troll_avx512 is not None:
        assert _troll_avx512.ISA == "avx512" and _troll_avx512.__version__ == _troll.__version__


def test_the_override_is_checked_in_a_fresh_process():
    baseline = _isa_in_child("baseline")
    assert baseline.returncode == 0 and baseline.stdout.strip() == _troll.ISA
    bad = _isa_in_child("sse9")
    assert bad.returncode != 0 and "TROLL_CPU_ISA='sse9' is not one of auto, baseline, avx512" in bad.stderr
    forced = _isa_in_child("avx512")
    if _troll_avx512 is not None and _troll.cpu_supports_avx512():
        assert forced.returncode == 0 and forced.stdout.strip() == "avx512"
    else:
        assert forced.returncode != 0 and "ImportError" in forced.stderr


def _with(monkeypatch, module):
    monkeypatch.setattr(_core, "_troll", module)
    monkeypatch.setattr(tg, "_troll", module)


def _run_both(monkeypatch, fn):
    out = []
    for module in (_troll, _troll_avx512):
        _with(monkeypatch, module)
        out.append(fn())
    return out


def _llm_pair(rng, rows, vocab, dtype):
    z = -1.1 * np.log(rng.permuted(np.tile(np.arange(1, vocab + 1, dtype=np.float64), (rows, 1)), axis=1))
    z += 0.3 * rng.standard_normal((rows, vocab))
    old = z + 0.6 * rng.standard_normal((rows, vocab))
    return z.astype(dtype), old.astype(dtype)


def _close(a, b, dtype, scale=1.0):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    tol = (2e-5 if dtype == np.float32 else 1e-9) * scale
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@both
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_dense_projection_and_its_backward_agree(monkeypatch, dtype):
    rng = np.random.default_rng(7)
    new, old = _llm_pair(rng, 12, 3001, dtype)
    old[:4] = new[:4] + (0.01 * rng.standard_normal((4, 3001))).astype(dtype)  # inside the ball
    g = rng.standard_normal(new.shape).astype(dtype)

    def run():
        lp, st = troll.project(new, old, 0.05)
        gn, go, ge = troll.project_backward(new, old, lp, st, g, old=True, eps=True)
        return lp, np.asarray(st.values), np.asarray(st.counters), gn, go, ge, troll.kl(new, old)

    base, fast = _run_both(monkeypatch, run)
    assert (base[2][:, 1] == fast[2][:, 1]).all()  # the same status on every row
    assert (base[2][:, 1] == troll.PROJECTED).any() and (base[2][:, 1] == troll.INACTIVE).any()
    _close(base[0], fast[0], dtype, scale=20.0)  # log pi*: t to ~1e-10 times |d| ~ 20
    _close(base[1][:, 0], fast[1][:, 0], dtype)  # t
    for a, b in zip(base[3:], fast[3:]):
        _close(a, b, dtype, scale=max(1.0, float(np.abs(np.asarray(a, np.float64)).max())))


@both
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparsify_and_the_sparse_projection_agree(monkeypatch, dtype):
    rng = np.random.default_rng(11)
    new, old = _llm_pair(rng, 9, 20000, dtype)

    def run():
        old_rows = troll.sparsify(old, k=16)
        new_rows = troll.sparsify(new, k=16)
        aligned = troll.align(new, old_rows, new_support=new_rows)
        out, st = troll.project_sparse(aligned, 0.05)
        grad = (np.full(np.asarray(out.log_probs).shape, 0.5, dtype), np.full(np.asarray(out.log_remainder).shape, -0.25, dtype))
        gn, go, ge = troll.project_sparse_backward(aligned, out, st, grad, old=True, eps=True)
        return old_rows, out, np.asarray(st.counters), gn, go, ge

    base, fast = _run_both(monkeypatch, run)
    for b, f in ((base[0], fast[0]), (base[1], fast[1])):
        assert (np.asarray(b.counts) == np.asarray(f.counts)).all()
        assert (np.asarray(b.indices) == np.asarray(f.indices)).all()
        live = np.asarray(b.indices) >= 0
        _close(np.asarray(b.log_probs)[live], np.asarray(f.log_probs)[live], dtype, scale=20.0)
        _close(b.log_remainder, f.log_remainder, dtype, scale=20.0)
    assert (base[2] == fast[2])[:, 1].all()
    for a, b in ((base[3][0], fast[3][0]), (base[3][1], fast[3][1]), (base[4][0], fast[4][0]), (base[5], fast[5])):
        _close(a, b, dtype, scale=max(1.0, float(np.abs(np.asarray(a, np.float64)).max())))


@both
def test_a_gaussian_projection_agrees(monkeypatch):
    rng = np.random.default_rng(5)
    rows, d = 6, 5
    mean, old_mean = rng.standard_normal((rows, d)), rng.standard_normal((rows, d))
    a = rng.standard_normal((rows, d, d)) / np.sqrt(d) + 1.5 * np.eye(d)
    chol = np.linalg.cholesky(a @ a.transpose(0, 2, 1))
    b = rng.standard_normal((rows, d, d)) / np.sqrt(d) + 1.5 * np.eye(d)
    old_chol = np.linalg.cholesky(b @ b.transpose(0, 2, 1))

    def run():
        return troll.gaussian.project_joint(mean, np.ascontiguousarray(chol), old_mean, np.ascontiguousarray(old_chol), 0.1)

    base, fast = _run_both(monkeypatch, run)
    _close(base[0], fast[0], np.float64, scale=10.0)
    _close(base[1], fast[1], np.float64, scale=10.0)


@both
def test_bad_input_raises_the_same_error_in_both(monkeypatch):
    new = np.zeros((3, 50))
    new[2, 17] = np.nan

    def run():
        with pytest.raises(troll.DomainError) as err:
            troll.project(new, np.zeros((3, 50)), 0.1)
        return str(err.value), err.value.row

    base, fast = _run_both(monkeypatch, run)
    assert base == fast and base[1] == 2
