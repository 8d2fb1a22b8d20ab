"""A plain-PyTorch peer of troll's Gaussian projections, timed in the same run as troll.gaussian
(forward) and troll.torch.gaussian (forward + backward), single-threaded, on the shapes of
bench/bench_gaussian.cpp: d in {8, 32, 128}, N = 4096 rows (256 for full covariances at d = 128),
diagonal and full covariances, joint and split bounds, float64, eps = 0.05.

    python3 bench/torch/peer_gaussian.py [--quick] [--json out.json]

The peer is the natural batched PyTorch implementation: one batched eigendecomposition per call
(torch.linalg.eigh of the whitened new covariance L°⁻¹Σ̃L°⁻ᵀ; none for diagonal covariances), 50
bisection steps on t in that eigenbasis (O(d) per step and row, to ~1e-15 in t), then the member's
mean and Cholesky factor. Its backward is autograd through all of that with t made differentiable
by one Newton step from the detached root (which gives the implicit-function derivative), so
both sides compute the same exact gradients. Rates are rows/s (medians of process CPU time).
"""
import argparse
import json
import os
import statistics
import sys
import time

# As bench/torch/peers_cpu.py: keep freed tensors in the heap, so that the peer's temporaries
# (4 MB at d = 128) are not page-faulted in anew on every call. Set before torch loads.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import torch  # noqa: E402

import troll  # noqa: E402
import troll.torch.gaussian as tg  # noqa: E402

EPS = 0.05


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def make_rows(n, d, full, gen):
    mean = torch.randn(n, d, dtype=torch.float64, generator=gen)
    old_mean = torch.randn(n, d, dtype=torch.float64, generator=gen)

    def cov():
        diag = torch.exp(0.3 * torch.randn(n, d, dtype=torch.float64, generator=gen))
        if not full:
            return diag
        low = torch.tril(torch.randn(n, d, d, dtype=torch.float64, generator=gen), -1) * (0.3 / d**0.5)
        return low + torch.diag_embed(diag)

    return mean, cov(), old_mean, cov()


def peer(mean, cov, old_mean, old_cov, full, split, steps=50):
    """(mean*, cov*) of the projection, differentiable when the inputs require grad."""
    if full:
        e = torch.linalg.solve_triangular(old_cov, cov, upper=False)
        lam, v = torch.linalg.eigh(e @ e.mT)
        delta = torch.linalg.solve_triangular(old_cov, (mean - old_mean).unsqueeze(-1), upper=False)
        b = (v.mT @ delta).squeeze(-1)
    else:
        lam = (cov / old_cov) ** 2
        b = (mean - old_mean) / old_cov
    gamma = 1.0 / lam
    g = gamma - 1.0
    with_mean = not split

    def kl(t, g, gamma, b):
        a = 1.0 + t.unsqueeze(-1) * g
        k = 0.5 * (1.0 / a - 1.0 + torch.log(a)).sum(-1)
        if with_mean:
            m = t.unsqueeze(-1) * gamma * b / a
            k = k + 0.5 * (m * m).sum(-1)
        return k

    def fisher(t, g, gamma, b):
        a = 1.0 + t.unsqueeze(-1) * g
        f = 0.5 * (g * g / (a * a)).sum(-1)
        if with_mean:
            f = f + (gamma * gamma * b * b / (a * a * a)).sum(-1)
        return f

    rows = mean.shape[:-1]
    with torch.no_grad():
        gd, gammad, bd = g.detach(), gamma.detach(), b.detach()
        active = kl(torch.ones(rows, dtype=mean.dtype), gd, gammad, bd) > EPS
        lo = torch.zeros(rows, dtype=mean.dtype)
        hi = torch.ones(rows, dtype=mean.dtype)
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            over = kl(mid, gd, gammad, bd) > EPS
            hi = torch.where(over, mid, hi)
            lo = torch.where(over, lo, mid)
        t0 = torch.where(active, 0.5 * (lo + hi), torch.ones_like(lo))
    if mean.requires_grad or cov.requires_grad:
        # One Newton step inside the graph: dt/dinputs is the implicit-function derivative.
        t = t0 - (kl(t0, g, gamma, b) - EPS) / (t0 * fisher(t0, g, gamma, b))
        t = torch.where(active, t, torch.ones_like(t))
    else:
        t = t0
    a = 1.0 + t.unsqueeze(-1) * g
    if split:
        m2 = 0.5 * (b * b).sum(-1)
        kappa = torch.where(m2 > EPS, torch.sqrt(EPS / torch.clamp(m2, min=1e-300)), torch.ones_like(m2))
        out_mean = old_mean + kappa.unsqueeze(-1) * (mean - old_mean)
    else:
        y = t.unsqueeze(-1) * gamma * b / a
    if full:
        if not split:
            out_mean = old_mean + (old_cov @ (v @ y.unsqueeze(-1))).squeeze(-1)
        inner = (v / a.unsqueeze(-2)) @ v.mT
        out_cov = old_cov @ torch.linalg.cholesky(inner)
    else:
        if not split:
            out_mean = old_mean + old_cov * y
        out_cov = old_cov / torch.sqrt(a)
    return out_mean, out_cov


def troll_forward(args, full, split):
    fn = {(True, False): troll.gaussian.project_joint, (True, True): troll.gaussian.project_split,
          (False, False): troll.gaussian.project_joint_diag, (False, True): troll.gaussian.project_split_diag}
    f = fn[(full, split)]
    return f(*args, EPS, EPS, threads=1) if split else f(*args, EPS, threads=1)


def troll_autograd(args, full, split):
    fn = {(True, False): tg.project_joint, (True, True): tg.project_split,
          (False, False): tg.project_joint_diag, (False, True): tg.project_split_diag}
    f = fn[(full, split)]
    return f(*args, EPS, EPS, threads=1) if split else f(*args, EPS, threads=1)


def fwd_bwd(project, args, w):
    xs = [x.detach().requires_grad_(True) for x in args]
    m, c = project(xs)
    ((m * w[0]).sum() + (c * w[1]).sum()).backward()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="d = 8 and 32 only, fewer repetitions")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(7)
    results = []
    dims = (8, 32) if opts.quick else (8, 32, 128)
    print(f"{'workload':40s} {'rows':>5s} {'troll rows/s':>13s} {'torch rows/s':>13s} {'ratio':>7s}")
    for op in ("fwd", "fwd+bwd"):
        for full in (False, True):
            for split in (False, True):
                for d in dims:
                    n = 256 if full and d == 128 else 4096
                    args = make_rows(n, d, full, gen)
                    reps = 3 if (full and d >= 32) or opts.quick else 7
                    if op == "fwd":
                        t_troll = timed(lambda: troll_forward(args, full, split), reps)
                        t_peer = timed(lambda: peer(*args, full, split), reps)
                        # Both compute the same projection.
                        m0, c0, _ = troll_forward(args, full, split)
                        m1, c1 = peer(*args, full, split)
                        assert torch.allclose(m0, m1, atol=1e-8, rtol=1e-6)
                        assert torch.allclose(c0, c1, atol=1e-8, rtol=1e-6)
                    else:
                        w = (torch.randn(args[0].shape, dtype=torch.float64, generator=gen),
                             torch.tril(torch.randn(args[1].shape, dtype=torch.float64, generator=gen)))
                        t_troll = timed(lambda: fwd_bwd(lambda xs: troll_autograd(xs, full, split), args, w), reps)
                        t_peer = timed(lambda: fwd_bwd(lambda xs: peer(*xs, full, split), args, w), reps)
                    name = f"gaussian/{op}/{'full' if full else 'diag'}/{'split' if split else 'joint'}/d:{d}"
                    row = dict(name=name, rows=n, troll_rows_per_s=n / t_troll, torch_rows_per_s=n / t_peer)
                    results.append(row)
                    print(f"{name:40s} {n:5d} {n / t_troll:13.4g} {n / t_peer:13.4g} {t_peer / t_troll:7.2f}",
                          flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=1, results=results), f, indent=1)


if __name__ == "__main__":
    main()
