"""troll.torch against plain-PyTorch implementations of the same projection, in one process, on
the same tensors: forward + backward of the dense projection and of the sparse one (old policy
stored as troll's top-k rows). On CPU tensors by default; `--device cuda` runs the same script on
CUDA tensors where a GPU exists (troll's dense projection through troll._troll_cuda; the sparse
path of troll.torch is CPU-only, so that row reports the host path on host copies).

    python3 bench/torch/troll_vs_peers.py [--device cpu|cuda] [--threads 1] [--quick] [--json out.json]

Implementations (each: forward, then backward of a fixed random upstream gradient to the new
logits; the peers hold their multiplier fixed in the backward, dropping the d(multiplier)/dz term
troll's analytic backward keeps):

* troll       — troll.torch.project / troll.torch.project_sparse (exact root, analytic VJP);
* bisection   — prime-rl style: 24 batched bisection steps on t in [0, 1] under no_grad, then
                log_softmax(log q + t (log p - log q)) with autograd;
* bracketing  — TROLL-reference style: per row, a bracket on log eta grown by doubling, then
                Illinois false position (12 steps) on KL(pi_eta || q) = eps with
                pi_eta ∝ exp((log p + eta log q) / (1 + eta)), then the same autograd output.

Sparse: the old rows are troll.torch.sparsify(old, k=64); troll projects on the union of the old
support and the new top-64 with the remainder bucket; the peers gather the new log-probs at the
old support and lump the rest into one bucket (|S_old| + 1 categories, a smaller problem).
Times are medians after a warm-up: process CPU time on one CPU thread, wall-clock with CUDA
synchronisation on a GPU. Rates are rows/s.
"""
import argparse
import json
import os
import statistics
import sys
import time

# Keep freed tensors in the heap (as bench/torch/peers_cpu.py): set before torch loads.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import torch  # noqa: E402

import troll  # noqa: E402
import troll.torch  # noqa: E402

EPS = 0.05


def timed(fn, reps, device):
    cuda = device.type == "cuda"
    clock = time.perf_counter if (cuda or torch.get_num_threads() != 1) else time.process_time
    fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def kl_rows(lp, log_old):
    return (lp.exp() * (lp - log_old)).sum(-1, keepdim=True)


def bisection_t(log_new, log_old, eps, steps=24):
    """prime-rl style: t with KL(pi_t || q) = eps, pi_t ∝ p^t q^(1-t); t = 1 where p is inside."""
    with torch.no_grad():
        d = log_new - log_old
        lo = torch.zeros(log_new.shape[:-1] + (1,), dtype=log_new.dtype, device=log_new.device)
        hi = torch.ones_like(lo)
        inactive = kl_rows(log_new, log_old) <= eps
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            above = kl_rows(torch.log_softmax(log_old + mid * d, -1), log_old) > eps
            hi = torch.where(above, mid, hi)
            lo = torch.where(above, lo, mid)
        return torch.where(inactive, torch.ones_like(lo), lo)


def bracketing_t(log_new, log_old, eps, grow=8, steps=12):
    """TROLL-reference style: a bracket on u = log eta, then Illinois false position on
    f(u) = KL(pi_eta || q) - eps (decreasing in u); returned as t = 1 / (1 + eta)."""
    with torch.no_grad():
        shape = log_new.shape[:-1] + (1,)

        def f(u):
            eta = u.exp()
            lp = torch.log_softmax((log_new + eta * log_old) / (1 + eta), -1)
            return kl_rows(lp, log_old) - eps

        inactive = kl_rows(log_new, log_old) <= eps
        lo = torch.full(shape, -6.0, dtype=log_new.dtype, device=log_new.device)
        hi = torch.full_like(lo, 2.0)
        f_lo, f_hi = f(lo), f(hi)
        for _ in range(grow):  # grow each side until the root is inside
            need_lo, need_hi = f_lo < 0, f_hi > 0
            if not bool((need_lo | need_hi).any()):
                break
            lo = torch.where(need_lo, lo - 4.0, lo)
            hi = torch.where(need_hi, hi + 4.0, hi)
            f_lo, f_hi = f(lo), f(hi)
        side = torch.zeros_like(lo)
        for _ in range(steps):
            u = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            u = torch.where(torch.isfinite(u), u, 0.5 * (lo + hi))
            fu = f(u)
            right = fu < 0  # root left of u: u becomes hi
            f_lo = torch.where(right & (side > 0), 0.5 * f_lo, f_lo)  # Illinois: halve the stale end
            f_hi = torch.where(~right & (side < 0), 0.5 * f_hi, f_hi)
            hi, f_hi = torch.where(right, u, hi), torch.where(right, fu, f_hi)
            lo, f_lo = torch.where(right, lo, u), torch.where(right, f_lo, fu)
            side = torch.where(right, torch.ones_like(side), -torch.ones_like(side))
        t = 1.0 / (1.0 + (0.5 * (lo + hi)).exp())
        return torch.where(inactive, torch.ones_like(t), t)


def peer_dense(solver):
    def run(new_logits, old_logits, upstream):
        z = new_logits.detach().requires_grad_(True)
        log_new = torch.log_softmax(z, -1)
        log_old = torch.log_softmax(old_logits, -1)
        t = solver(log_new.detach(), log_old, EPS)
        out = torch.log_softmax(log_old + t * (log_new - log_old), -1)
        out.backward(upstream)
        return z.grad
    return run


def troll_dense(threads):
    def run(new_logits, old_logits, upstream):
        z = new_logits.detach().requires_grad_(True)
        troll.torch.project(z, old_logits, EPS, threads=threads).backward(upstream)
        return z.grad
    return run


def peer_sparse(solver):
    """The old policy as sparse rows: new log-probs gathered at the old support, one bucket."""
    def run(new_logits, old_rows, upstream):
        z = new_logits.detach().requires_grad_(True)
        valid = old_rows.counts[:, None] > torch.arange(old_rows.indices.shape[-1], device=z.device)
        idx = torch.where(valid, old_rows.indices, 0).long()
        neg = torch.finfo(z.dtype).min
        log_new_all = torch.log_softmax(z, -1)
        ln_s = torch.where(valid, log_new_all.gather(-1, idx), neg)
        ln_bucket = torch.log1p(-ln_s.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-6))
        lo_s = torch.where(valid, old_rows.log_probs, neg)
        log_new = torch.cat([ln_s, ln_bucket], -1)
        log_old = torch.cat([lo_s, old_rows.log_remainder[:, None]], -1)
        t = solver(log_new.detach(), log_old, EPS)
        out = torch.log_softmax(log_old + t * (log_new - log_old), -1)
        out.backward(torch.cat([upstream[:, : ln_s.shape[-1]] * valid, upstream[:, -1:]], -1))
        return z.grad
    return run


def troll_sparse(threads):
    def run(new_logits, old_rows, upstream):
        z = new_logits.detach().requires_grad_(True)
        out = troll.torch.project_sparse(z, old_rows, EPS, threads=threads)
        k = out.log_probs.shape[-1]
        valid = out.counts[:, None] > torch.arange(k, device=z.device)
        loss = (torch.where(valid, out.log_probs, 0) * upstream[:, :k]).sum() + (out.log_remainder * upstream[:, -1]).sum()
        loss.backward()
        return z.grad
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 7
    gen = torch.Generator().manual_seed(0)
    rows, vocab = args.rows, args.vocab

    # LLM-like logits (Zipf ranks + noise); half the rows move enough to be projected.
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]).float()
    old = -1.1 * torch.log1p(ranks) + 0.5 * torch.randn(rows, vocab, generator=gen)
    new = old + torch.where(torch.arange(rows)[:, None] % 2 == 0, 0.5, 0.02) * torch.randn(rows, vocab, generator=gen)
    upstream = torch.randn(rows, vocab, generator=gen)
    new, old, upstream = new.to(device), old.to(device), upstream.to(device)
    results = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "rows": rows, "vocab": vocab, "dtype": "float32", "eps": EPS}

    with torch.no_grad():
        lp_new, lp_old = torch.log_softmax(new, -1), torch.log_softmax(old, -1)
        results["active_fraction"] = float((kl_rows(lp_new, lp_old) > EPS).float().mean())
    dense = {"troll": troll_dense(args.threads), "bisection": peer_dense(bisection_t),
             "bracketing": peer_dense(bracketing_t)}
    with torch.no_grad():
        ref_lp = troll.torch.project(new, old, EPS)
    for name, fn in dense.items():
        s = timed(lambda: fn(new, old, upstream), reps, device)
        with torch.no_grad():
            lp = torch.log_softmax(new, -1)
            if name == "troll":
                lp_star = troll.torch.project(new, old, EPS)
            else:
                solver = bisection_t if name == "bisection" else bracketing_t
                t = solver(lp, lp_old, EPS)
                lp_star = torch.log_softmax(lp_old + t * (lp - lp_old), -1)
            kl_max = float(kl_rows(lp_star, lp_old).max())
            gap = float((lp_star - ref_lp).abs().max())
        results[f"dense/{name}"] = {"ms": s * 1e3, "rows/s": rows / s, "kl_after_max": kl_max,
                                    "log_probs_max_abs_diff_vs_troll": gap}

    # Sparse: the stored old policy (top-64 rows); troll's sparse path runs on the host.
    host = torch.device("cpu")
    s_new, s_old, s_up = new.to(host), old.to(host), upstream.to(host)
    old_rows = troll.torch.sparsify(s_old, k=64)
    up = s_up[:, : 64 + 64 + 1].contiguous()
    sparse = {"troll": (troll_sparse(args.threads), host), "bisection": (peer_sparse(bisection_t), device),
              "bracketing": (peer_sparse(bracketing_t), device)}
    for name, (fn, dev) in sparse.items():
        rows_dev = troll.SparseRows(*(a.to(dev) for a in old_rows[:4]), old_rows.vocab)
        z, u = s_new.to(dev), up.to(dev)
        s = timed(lambda: fn(z, rows_dev, u), reps, dev)
        results[f"sparse/{name}"] = {"ms": s * 1e3, "rows/s": rows / s, "device": str(dev)}

    for name, r in results.items():
        print(name, r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
