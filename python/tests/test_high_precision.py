"""troll's categorical projection against references in more precision than troll computes in:
the family member at troll's t in numpy long double (64-bit mantissa on x86), the KL at that t
with a formula free of cancellation for small KL, and the VJP in 50-digit mpmath. Random and
adversarial rows (masks on either side, ties, offsets, near one-hot rows, tiny and large eps),
dense and sparse (aligned rows of V up to 262,144), float64 and float32.

The bounds are docs/math.md §4's: the output within a few ulps of max(1, max|z|, |log pi*_i|)
entry by entry, KL(pi_t*||q) within 1e-10 eps of eps (asserted at 2e-10, room for the
reference's own rounding), and the VJP within the t* tolerance's
reach (normwise)."""

from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest

import troll

LD = np.longdouble
if np.finfo(LD).nmant < 60:  # pragma: no cover - platforms whose long double is a double
    pytest.skip("numpy long double is not extended precision here", allow_module_level=True)

GL_X, GL_W = np.polynomial.legendre.leggauss(24)


def _log_softmax(z):
    z = z.astype(LD)
    fin = np.isfinite(z)
    m = z[fin].max()
    return z - m - np.log(np.where(fin, np.exp(z - m), LD(0)).sum())


def _member(zn, zo, t):
    """log pi_t: log_softmax(zo + t (zn - zo)) on the tokens both rows keep (t < 1)."""
    both = np.isfinite(zn) & np.isfinite(zo)
    with np.errstate(invalid="ignore"):  # inf - inf at the masked tokens, dropped by the where
        z = np.where(both, zo.astype(LD) + LD(t) * (zn.astype(LD) - zo.astype(LD)), LD(-np.inf))
    return _log_softmax(z)


def _kl_direct(lp, lq):
    p = np.exp(lp)
    on = p > 0
    return np.sum(p[on] * (lp[on] - lq[on]))


def _kl_at(zn, zo, t):
    """KL(pi_t || q). Below 1e-3 the direct sum cancels (terms of size |log pi - log q| sum to
    ~KL), so there it is KL(pi_0+ || q) + the integral of s sigma^2(s) over [0, t] (non-negative
    terms), by 8 panels of 24-point Gauss-Legendre."""
    lq = _log_softmax(zo)
    direct = _kl_direct(_member(zn, zo, t), lq)
    if direct >= 1e-3:
        return direct
    both = np.isfinite(zn) & np.isfinite(zo)
    with np.errstate(invalid="ignore"):
        d = np.where(both, zn.astype(LD) - zo.astype(LD), LD(0))
    total = _kl_direct(_member(zn, zo, LD(0)), lq)
    edges = [LD(t) * LD(k) / 8 for k in range(9)]
    for a, b in zip(edges[:-1], edges[1:]):
        for x, w in zip(GL_X, GL_W):
            s = (a + b) / 2 + (b - a) / 2 * LD(x)
            p = np.exp(_member(zn, zo, s))
            mu = (p * d).sum()
            total += LD(w) * (b - a) / 2 * s * (p * (d - mu) ** 2).sum()
    return total


@mp.workdps(50)  # the other tests' mpmath precision is left alone
def _vjp_mp(zn, zo, t, g, status):
    """dL/dz~ at troll's t, in 50 digits: t [g - pi G - pi (d - mu) c / sigma^2] on a projected
    row, g - pi G on an inactive or restricted one (math.md §3); 0 where pi is 0."""
    both = [bool(np.isfinite(a) and np.isfinite(b)) for a, b in zip(zn, zo)]
    projected = status == troll.PROJECTED
    tm = mp.mpf(float(t))
    if projected:
        z = [mp.mpf(float(b)) + tm * (mp.mpf(float(a)) - mp.mpf(float(b))) if ok else None
             for a, b, ok in zip(zn, zo, both)]
    else:  # p~, on the old row's support when restricted
        keep = both if status == troll.RESTRICTED else [bool(np.isfinite(a)) for a in zn]
        z = [mp.mpf(float(a)) if ok else None for a, ok in zip(zn, keep)]
    top = max(v for v in z if v is not None)
    e = [mp.exp(v - top) if v is not None else mp.mpf(0) for v in z]
    total = mp.fsum(e)
    p = [x / total for x in e]
    gg = [mp.mpf(float(x)) if pi > 0 else mp.mpf(0) for x, pi in zip(g, p)]
    big_g = mp.fsum(gg)
    if not projected:
        return np.array([float(gi - pi * big_g) if pi > 0 else 0.0 for gi, pi in zip(gg, p)])
    d = [mp.mpf(float(a)) - mp.mpf(float(b)) if ok else mp.mpf(0) for a, b, ok in zip(zn, zo, both)]
    mu = mp.fsum(pi * di for pi, di in zip(p, d))
    s2 = mp.fsum(pi * (di - mu) ** 2 for pi, di in zip(p, d))
    c = mp.fsum(gi * (di - mu) for gi, di in zip(gg, d))
    return np.array([float(tm * (gi - pi * big_g - pi * (di - mu) * c / s2)) if pi > 0 else 0.0
                     for gi, pi, di in zip(gg, p, d)])


def _row_pair(rng, v):
    """A new and an old row of V logits: plain (kinds 0 and 6) or one of five hard kinds. Masks
    never take token 0, so every row keeps a token."""
    kind = int(rng.integers(0, 7))
    s = float(rng.choice([0.1, 1.0, 5.0, 30.0, 300.0]))
    zo = rng.standard_normal(v) * s
    zn = zo + rng.standard_normal(v) * s * float(rng.choice([0.01, 0.3, 1.0, 3.0]))

    def some(fraction):
        m = rng.random(v) < fraction
        m[0] = False
        return m

    if kind == 1:  # near one-hot, at different tokens
        zn[rng.integers(v)] += 60.0
        zo[rng.integers(v)] += 40.0
    elif kind == 2:  # masked in both
        m = some(0.2)
        zn[m] = zo[m] = -np.inf
    elif kind == 3:  # masked in the old row only (pi* = 0 there, or restricted)
        zo[some(0.15)] = -np.inf
    elif kind == 4:  # a large common offset
        off = float(rng.choice([1e4, -1e5, 3e6]))
        zn += off
        zo += 0.5 * off
    elif kind == 5:  # ties
        zn, zo = np.round(zn), np.round(zo)
    return zn, zo, float(rng.choice([1e-12, 1e-8, 1e-4, 0.05, 0.5, 5.0]))


def _check_row(zn, zo, eps, y, t, status, gn, g, dtype):
    """Asserts the output, the KL and the VJP of one row against the references."""
    ulp = float(np.finfo(dtype).eps)
    zn_l, zo_l = zn.astype(LD), zo.astype(LD)
    if status == troll.PROJECTED:
        ref = _member(zn_l, zo_l, t)
        kl = _kl_at(zn_l, zo_l, t)
        assert abs(float(kl) - eps) <= 2e-10 * eps, (float(kl), eps)
    elif status == troll.RESTRICTED:  # p~ on the old row's support
        ref = _log_softmax(np.where(np.isfinite(zo_l), zn_l, LD(-np.inf)))
    else:
        ref = _log_softmax(zn_l)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(y), fin)
    scale = max(1.0, float(np.abs(zn[np.isfinite(zn)]).max()), float(np.abs(zo[np.isfinite(zo)]).max()))
    err = np.abs(y[fin].astype(LD) - ref[fin]) / np.maximum(LD(scale), np.abs(ref[fin]))
    assert float(err.max()) <= 4 * ulp, float(err.max()) / ulp
    r = _vjp_mp(zn, zo, t, g, status)
    size = max(float(np.abs(r).max()), (t if status == troll.PROJECTED else 1.0) * float(np.abs(g).max()))
    # double: the t* tolerance (1e-10 relative) bounds it; float: the rounding of the inputs read back
    bound = 1e-9 if dtype == np.float64 else 2e-5
    assert float(np.abs(gn.astype(np.float64) - r).max()) <= bound * size * scale


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dense_rows_against_extended_precision(seed, dtype):
    rng = np.random.default_rng(100 + seed)
    checked = 0
    for _ in range(12):
        v = int(rng.choice([2, 3, 17, 100, 257]))
        zn, zo, eps = _row_pair(rng, v)
        zn, zo = zn.astype(dtype), zo.astype(dtype)
        try:
            y, st = troll.project(zn[None], zo[None], eps, threads=1)
        except troll.InfeasibleError:
            continue  # masked in the new row only, with old mass beyond eps: refused, typed
        g = rng.standard_normal(v).astype(dtype)
        gn, _, _ = troll.project_backward(zn[None], zo[None], y, st, g[None], threads=1)
        _check_row(zn, zo, eps, np.asarray(y[0]), float(st.t[0]), int(st.status[0]), np.asarray(gn[0]), g, dtype)
        checked += 1
    assert checked >= 6


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sparse_rows_against_extended_precision(seed, dtype):
    """Aligned rows of |U| entries + bucket: the projection is the dense one of the |U| + 1
    lumped categories (math.md §4), checked as such; V up to 262,144."""
    rng = np.random.default_rng(200 + seed)
    k_max, checked = 130, 0
    for _ in range(10):
        vocab = int(rng.choice([70, 151936, 262144]))
        n = min(vocab, int(rng.choice([1, 10, 64, 77, 129])))
        zn, zo, eps = _row_pair(rng, n + 1)
        if vocab == n:  # no tail: the bucket holds nothing on either side
            zn[n] = zo[n] = -np.inf
        ln, lo = _log_softmax(zn).astype(dtype), _log_softmax(zo).astype(dtype)
        idx = np.full((1, k_max), -1, np.int32)
        idx[0, :n] = rng.choice(vocab, size=n, replace=False)
        side = []
        for lp in (ln, lo):
            row = np.full((1, k_max), -np.inf, dtype)
            row[0, :n] = lp[:n]
            side += [row, np.array([lp[n]], dtype)]
        rows = troll.AlignedRows(idx, np.array([n], np.int32), side[0], side[2], side[1], side[3], vocab)
        try:
            out, st = troll.project_sparse(rows, eps, threads=1)
        except troll.InfeasibleError:
            continue
        g = rng.standard_normal(n + 1).astype(dtype)
        grad = np.zeros((1, k_max), dtype)
        grad[0, :n] = g[:n]
        (gn, gnr), _, _ = troll.project_sparse_backward(rows, out, st, (grad, np.array([g[n]], dtype)), threads=1)
        y = np.concatenate([np.asarray(out.log_probs)[0, :n], np.asarray(out.log_remainder)[:1]])
        lumped_grad = np.concatenate([np.asarray(gn)[0, :n], np.asarray(gnr)[:1]])
        _check_row(ln, lo, eps, y, float(st.t[0]), int(st.status[0]), lumped_grad, g, dtype)
        checked += 1
    assert checked >= 5
