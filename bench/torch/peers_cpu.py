"""Plain-PyTorch CPU peers of troll's CPU benchmarks, single-threaded, on the shapes of
bench/bench_sparse.cpp and bench/bench_dense.cpp, so that troll's rates can be set beside them.

    python3 bench/torch/peers_cpu.py [--threads 1] [--quick] [--json out.json]

Workloads (medians of repetitions after a warm-up, in process CPU time on one thread, wall-clock
time on more; the peers' temporaries are kept in the heap between calls, so page faults of fresh
allocations are not timed):

* read          — x.sum() over 64 x 151,936 float32: the single-core read bandwidth of torch;
* sparsify      — top-64 of 64 x 151,936 float32 logits plus the log of the tail mass
                  (torch.logsumexp + torch.topk, in calls of 16 rows), the peer of troll::sparsify;
* log_softmax   — forward + backward of 64 x 151,936 float32 (the two aten kernels autograd runs,
                  into preallocated outputs): the floor of the dense projection; and the same on
                  16 rows (log_softmax_fwd_bwd_16), the shape of bench_dense's rows:16 cases;
* dense_bisect  — the prime-rl-style dense projection of 64 x 151,936 float32 rows (in calls of
                  16 rows), half of them active: 24 bisection steps on t under no_grad, then
                  log_softmax(log q + t (log p - log q)) with autograd to the new logits (t held
                  fixed: the peer drops the dt/dz term that troll's backward keeps);
* sparse_bisect — the same bisection on 16,384 aligned sparse rows of 77 entries + the remainder
                  bucket (78 lumped categories, the mean |U| + 1 of bench_sparse), every row
                  active, forward + backward: the peer of troll's sparse projection.

Rates are rows/s (and GB/s of logits read for read and sparsify). Compare with the C++ rates of
bench_sparse / bench_dense run on the same machine in the same session (docs/performance.md).
"""
import argparse
import json
import os
import statistics
import sys
import time

# Keep freed tensors in the heap, so that the peers' temporaries are not page-faulted in anew on
# every call: glibc serves blocks up to M_MMAP_THRESHOLD (at most 32 MiB) from the heap, and
# returns heap memory to the system only above M_TRIM_THRESHOLD. Set before torch loads.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import torch  # noqa: E402

CHUNK = 16  # rows per call of the dense peers: 9.7 MB temporaries, below the mmap threshold

VOCAB = 151936


def timed(fn, reps):
    """Median seconds per call: process CPU time with one thread (robust on a shared machine, and
    what Google Benchmark reports for troll's serial benchmarks), else wall-clock time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up: allocations, lazy initialisation
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def zipf_rows(rows, vocab, gen, scale=1.1, noise=0.5):
    """LLM-like logits: -scale * log(1 + rank) + noise, ranks shuffled per row."""
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]).float()
    return -scale * torch.log1p(ranks) + noise * torch.randn(rows, vocab, generator=gen)


def bisect_t(log_new, log_old, eps, steps=24):
    """t in [0, 1] with KL(pi_t || q) = eps by bisection (rows with KL(p || q) <= eps get t = 1)."""
    with torch.no_grad():
        lo = torch.zeros(log_new.shape[:-1] + (1,), dtype=log_new.dtype)
        hi = torch.ones_like(lo)
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 9
    gen = torch.Generator().manual_seed(0)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    # --- read and sparsify: 64 x 151,936 float32 (39 MB: beyond the L2 caches)
    rows, k = 64, 64
    logits = zipf_rows(rows, VOCAB, gen)
    nbytes = logits.numel() * logits.element_size()
    s = timed(lambda: logits.sum(), reps)
    results["read"] = {"rows": rows, "ms": s * 1e3, "GB/s": nbytes / s * 1e-9}

    def sparsify():
        for c in logits.split(CHUNK):
            lse = torch.logsumexp(c, dim=-1, keepdim=True)
            top, idx = torch.topk(c, k, dim=-1)
            lp = top - lse
            remainder = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-7))
        return idx, lp, remainder

    s = timed(sparsify, reps)
    results["sparsify_top64"] = {"rows": rows, "ms": s * 1e3, "rows/s": rows / s, "GB/s": nbytes / s * 1e-9}

    # --- dense: log_softmax and the bisection projection, 64 x 151,936 float32, half active
    old = logits
    new = old.clone()
    active = torch.arange(rows) % 2 == 0
    new[active] += 0.5 * torch.randn(int(active.sum()), VOCAB, generator=gen)
    new[~active] += 0.02 * torch.randn(int((~active).sum()), VOCAB, generator=gen)
    g = torch.randn(rows, VOCAB, generator=gen)
    y = torch.empty_like(new)
    dx = torch.empty_like(new)

    def lsm():  # the forward and backward kernels autograd runs, into preallocated outputs
        torch.ops.aten._log_softmax.out(new, -1, False, out=y)
        torch.ops.aten._log_softmax_backward_data.out(g, y, -1, torch.float32, out=dx)

    s = timed(lsm, reps)
    results["log_softmax_fwd_bwd"] = {"rows": rows, "ms": s * 1e3, "rows/s": rows / s}

    # The same on 16 rows, the shape of bench_dense's project_vjp/.../rows:16 (its working set,
    # ~39 MB, partly held by a large L3 where the 64 rows' 155 MB are not: compare like with like)
    n16, g16, y16, dx16 = new[:16].clone(), g[:16].clone(), y[:16].clone(), dx[:16].clone()

    def lsm16():
        torch.ops.aten._log_softmax.out(n16, -1, False, out=y16)
        torch.ops.aten._log_softmax_backward_data.out(g16, y16, -1, torch.float32, out=dx16)

    s = timed(lsm16, reps * 2)
    results["log_softmax_fwd_bwd_16"] = {"rows": 16, "ms": s * 1e3, "rows/s": 16 / s}
    del n16, g16, y16, dx16

    def dense():
        for n, o, u in zip(new.split(CHUNK), old.split(CHUNK), g.split(CHUNK)):
            projection_fwd_bwd(n, o, u, 0.05)

    s = timed(dense, max(3, reps // 3))
    with torch.no_grad():
        t = bisect_t(torch.log_softmax(new, -1), torch.log_softmax(old, -1), 0.05)
    results["dense_bisect_fwd_bwd"] = {"rows": rows, "ms": s * 1e3, "rows/s": rows / s,
                                       "active_fraction": float((t < 1).float().mean())}
    del logits, old, new, g, y, dx

    # --- sparse: 16,384 aligned rows of 77 entries + the bucket (78 lumped categories)
    rows, cats = 16384, 78
    base = zipf_rows(rows, cats, gen, scale=1.5, noise=0.3)
    ln = torch.log_softmax(base, dim=-1)
    lo = torch.log_softmax(base + 0.6 * torch.randn(rows, cats, generator=gen), dim=-1)
    g = torch.randn(rows, cats, generator=gen)
    s = timed(lambda: projection_fwd_bwd(ln, lo, g, 0.05), max(3, reps // 3))
    with torch.no_grad():
        t = bisect_t(ln, lo, 0.05)
    results["sparse_bisect_fwd_bwd"] = {"rows": rows, "categories": cats, "ms": s * 1e3,
                                        "rows/s": rows / s, "active_fraction": float((t < 1).float().mean())}

    for name, r in results.items():
        print(name, r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
