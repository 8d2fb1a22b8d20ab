"""JAX and CuPy arrays through the array-level API (troll.kl, troll.project, troll.sparsify, ...):
inputs read through DLPack, results returned in the caller's framework. JAX (CPU jaxlib, pinned
in requirements-test.txt) runs everywhere; CuPy needs a GPU and the CUDA extension and skips
otherwise. Values are checked against the NumPy path, itself checked against the float64 oracle
in test_dense.py."""

from __future__ import annotations

import numpy as np
import pytest

import troll
from troll import _core


def _logits(rows, vocab, dtype, seed):
    rng = np.random.default_rng(seed)
    new = (rng.standard_normal((rows, vocab)) * 2).astype(dtype)
    old = (new + 0.5 * rng.standard_normal((rows, vocab))).astype(dtype)
    return new, old


@pytest.fixture(scope="module")
def jnp():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
    import jax.numpy as jnp

    return jnp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_jax_in_jax_out(jnp, dtype):
    import jax

    new, old = _logits(5, 40, dtype, 0)
    jn, jo = jnp.asarray(new), jnp.asarray(old)
    assert jn.dtype == dtype
    kl = troll.kl(jn, jo)
    lp = troll.log_softmax(jn)
    proj, stats = troll.project(jn, jo, 0.05)
    for a in (kl, lp, proj, stats.t, stats.status):
        assert isinstance(a, jax.Array)
    assert proj.dtype == dtype and kl.shape == (5,)
    np.testing.assert_array_equal(np.asarray(kl), troll.kl(new, old))
    np.testing.assert_array_equal(np.asarray(lp), troll.log_softmax(new))
    want, want_stats = troll.project(new, old, 0.05)
    np.testing.assert_array_equal(np.asarray(proj), want)
    np.testing.assert_array_equal(np.asarray(stats.status), want_stats.status)


def test_jax_sparse_rows_and_backward(jnp):
    import jax

    new, old = _logits(3, 200, np.float64, 1)
    sampled = np.array([5, 199, 0], dtype=np.int32)
    rows = troll.sparsify(jnp.asarray(new), k=8, delta=1e-3, sampled=jnp.asarray(sampled))
    assert all(isinstance(a, jax.Array) for a in rows[:4])
    want = troll.sparsify(new, k=8, delta=1e-3, sampled=sampled)
    for got, ref in zip(rows[:4], want[:4]):
        np.testing.assert_array_equal(np.asarray(got), ref)
    # project_backward: the gradient arrays come back as JAX arrays too.
    jn, jo = jnp.asarray(new), jnp.asarray(old)
    lp, stats = troll.project(jn, jo, 0.05)
    g = jnp.asarray(np.linspace(-1, 1, 200)[None, :].repeat(3, 0))
    gn, go, ge = troll.project_backward(jn, jo, lp, stats, g, old=True, eps=True)
    assert isinstance(gn, jax.Array) and isinstance(go, jax.Array) and isinstance(ge, jax.Array)
    ref = troll.project_backward(new, old, *troll.project(new, old, 0.05), np.asarray(g), old=True, eps=True)
    for got, r in zip((gn, go, ge), ref):
        np.testing.assert_allclose(np.asarray(got), r, rtol=1e-12, atol=1e-14)


def test_jax_errors_name_the_row(jnp):
    new, old = _logits(4, 16, np.float32, 2)
    new[2, 3] = np.nan
    with pytest.raises(troll.DomainError) as info:
        troll.project(jnp.asarray(new), jnp.asarray(old), 0.05)
    assert info.value.row == 2


@pytest.fixture(scope="module")
def cupy():
    cp = pytest.importorskip("cupy")
    if not _core.cuda_available():
        pytest.skip("no CUDA device or no CUDA extension")
    return cp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_in_cupy_out_on_the_current_stream(cupy, dtype):
    new, old = _logits(6, 300, dtype, 3)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cn, co = cupy.asarray(new), cupy.asarray(old)
        kl = troll.kl(cn, co)
        proj, stats = troll.project(cn, co, 0.05)
        rows = troll.sparsify(cn, k=8, delta=1e-3)
    stream.synchronize()
    assert isinstance(kl, cupy.ndarray) and isinstance(proj, cupy.ndarray) and isinstance(rows.indices, cupy.ndarray)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(cupy.asnumpy(kl), troll.kl(new, old), **tol)
    np.testing.assert_allclose(cupy.asnumpy(proj), troll.project(new, old, 0.05)[0], **tol)
    np.testing.assert_array_equal(cupy.asnumpy(rows.indices), troll.sparsify(new, k=8, delta=1e-3).indices)
