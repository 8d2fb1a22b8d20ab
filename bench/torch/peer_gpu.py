"""Plain-PyTorch peers of troll's CUDA benchmarks, on the same GPU and the same shapes.

    python3 bench/torch/peer_gpu.py [--json out.json]

Workloads (each timed with CUDA events; median of repeated runs after a warm-up):

* copy        — a device-to-device copy of 8,192 x 151,936 bf16 (bytes read + written / time):
                the bandwidth ceiling sparsify is measured against;
* sparsify    — top-64 of the same bf16 logits plus the log of the remainder mass
                (torch.topk + logsumexp over the row), the peer of troll's sparsify;
* log_softmax — forward + backward of float32 rows x 151,936 (rows 64, 1,024, 4,096): the floor
                of the dense projection;
* dense_bisect  — the prime-rl-style dense projection: 24 bisection steps on t under no_grad,
                  then log_softmax(z_old + t (z_new - z_old)) with autograd to z_new (t held
                  fixed: the peer drops the dt/dz term that troll's backward keeps);
* sparse_bisect — the same bisection on 2^20 aligned sparse rows (96 entries + remainder
                  bucket), float32, forward + backward: the peer of troll's sparse projection.

The shapes and data mirror bench/cuda/bench_cuda_sparse.cu and bench_cuda_projection.cu.
"""
import argparse
import json
import math

import torch


def timed(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def bisect_t(log_new, log_old, eps, steps=24):
    """t in [0, 1] with KL(pi_t || q) = eps by bisection (rows where KL(p || q) <= eps get t = 1)."""
    with torch.no_grad():
        lo = torch.zeros(log_new.shape[:-1] + (1,), device=log_new.device, dtype=log_new.dtype)
        hi = torch.ones_like(lo)
        q = log_old.exp()
        d = log_new - log_old

        def kl(t):
            lp = torch.log_softmax(log_old + t * d, dim=-1)
            return (lp.exp() * (lp - log_old)).sum(-1, keepdim=True)

        inactive = kl(hi) <= eps
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            above = kl(mid) > eps
            hi = torch.where(above, mid, hi)
            lo = torch.where(above, lo, mid)
        del q
        return torch.where(inactive, torch.ones_like(lo), lo)


def projection_fwd_bwd(new_logits, old_logits, upstream, eps):
    new_logits = new_logits.detach().requires_grad_(True)
    log_new = torch.log_softmax(new_logits, dim=-1)
    log_old = torch.log_softmax(old_logits, dim=-1)
    t = bisect_t(log_new.detach(), log_old, eps)
    out = torch.log_softmax(log_old + t * (log_new - log_old), dim=-1)
    out.backward(upstream)
    return new_logits.grad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    # --- copy and sparsify: 8,192 x 151,936 bf16
    n, vocab, k = 8192, 151936, 64
    ranks = torch.randperm(vocab, device=dev).float()
    logits = (-2.0 * torch.log1p(ranks)).repeat(n, 1) + 0.5 * torch.randn(n, vocab, device=dev)
    logits = logits.to(torch.bfloat16)
    other = torch.empty_like(logits)
    nbytes = logits.numel() * logits.element_size()
    ms = timed(lambda: other.copy_(logits))
    results["copy_bf16"] = {"ms": ms, "GB/s_read+write": 2 * nbytes / ms * 1e-6}

    def sparsify():
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        top, idx = torch.topk(x, k, dim=-1)
        lp = top - lse
        rem = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-7))
        return idx, lp, rem

    ms = timed(sparsify, reps=10)
    results["sparsify_topk64_bf16"] = {"ms": ms, "GB/s_read": nbytes / ms * 1e-6, "rows/s": n / ms * 1e3}
    del logits, other

    # --- dense: log_softmax and the bisection projection at V = 151,936, float32
    for rows in (64, 1024, 4096):
        old = (-1.1 * torch.log1p(torch.randperm(vocab, device=dev).float())).repeat(rows, 1)
        old = old + 0.5 * torch.randn(rows, vocab, device=dev)
        new = old + 0.3 * torch.randn(rows, vocab, device=dev)
        g = torch.randn(rows, vocab, device=dev)

        def lsm():
            x = new.detach().requires_grad_(True)
            torch.log_softmax(x, dim=-1).backward(g)

        ms = timed(lsm)
        results[f"log_softmax_fwd_bwd/rows:{rows}"] = {"ms": ms, "rows/s": rows / ms * 1e3}
        ms = timed(lambda: projection_fwd_bwd(new, old, g, 0.05), warmup=1, reps=5)
        results[f"dense_bisect_fwd_bwd/rows:{rows}"] = {"ms": ms, "rows/s": rows / ms * 1e3}
        del old, new, g

    # --- sparse: 2^20 aligned rows, 96 entries + remainder bucket, float32
    rows, u = 1 << 20, 96
    i = torch.arange(u, device=dev, dtype=torch.float32)
    ln = torch.where(i < 64, -0.05 * i - 3.0, torch.full_like(i, -20.0))
    lo = torch.where(i >= 32, -0.05 * (95 - i) - 3.0, torch.full_like(i, -20.0))
    bucket = torch.tensor([-6.0], device=dev)
    ln = torch.cat([ln, bucket]).repeat(rows, 1).contiguous()
    lo = torch.cat([lo, bucket]).repeat(rows, 1).contiguous()
    g = torch.zeros_like(ln)
    ms = timed(lambda: projection_fwd_bwd(ln, lo, g, 0.05), warmup=1, reps=5)
    results["sparse_bisect_fwd_bwd/rows:1048576"] = {"ms": ms, "rows/s": rows / ms * 1e3}

    for name, r in results.items():
        print(name, r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
