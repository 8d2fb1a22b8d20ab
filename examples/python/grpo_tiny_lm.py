"""A tiny causal LM trained with GRPO-style group advantages under three objectives — TROLL
(troll.torch.trust_region_loss on the old policy's sparse rows), PPO clip and DPPO — from the same
seeds, on CPU. Writes build/grpo_tiny_lm/metrics.csv and PNG plots (reward, max / mean per-token
KL to the old policy against eps, entropy, fraction of tokens projected / clipped / masked), and
prints whether TROLL kept every token's KL(pi* || old) <= eps.

    python examples/python/grpo_tiny_lm.py            # the full run (a few minutes on 2 cores)
    python examples/python/grpo_tiny_lm.py --quick    # CI's smoke run (well under 2 minutes)

The task is verifiable: the prompt "a+b=" (digits), the completion the decimal sum and ";". A short
supervised warm-up on mostly *wrong* sums teaches the format (a number, then ";") and little
arithmetic; the RL phase must then find the right sums from the reward (1 for the exact answer,
0.1 for a well-formed wrong one). Needs torch, troll and matplotlib (python/requirements-trl.txt).
What this shows and cannot show at this size: docs/objectives.md."""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import time

import torch
import torch.nn as nn

import troll
import troll.torch

TOKENS = list("0123456789+=;") + ["<bos>", "<pad>"]
ID = {t: i for i, t in enumerate(TOKENS)}
V, BOS, PAD, EOS = len(TOKENS), ID["<bos>"], ID["<pad>"], ID[";"]
PROMPT_LEN, MAX_NEW = 5, 3  # <bos> a + b =  |  up to two digits and ";"


class TinyLM(nn.Module):
    """A 2-layer causal transformer (d = 64): enough to learn one-digit sums, fast on a CPU."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, length: int = PROMPT_LEN + MAX_NEW):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.pos = nn.Parameter(torch.zeros(length, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.size(1)
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.head(self.body(self.embed(ids) + self.pos[:n], mask=causal, is_causal=True))


def prompts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.full_like(a, BOS), a, torch.full_like(a, ID["+"]), b, torch.full_like(a, ID["="])], 1)


def answer_tokens(values: torch.Tensor) -> torch.Tensor:
    """Completions (n, MAX_NEW) spelling each value then ";" (padded)."""
    out = torch.full((values.numel(), MAX_NEW), PAD)
    for i, v in enumerate(values.tolist()):
        digits = [ID[c] for c in str(v)] + [EOS]
        out[i, :len(digits)] = torch.tensor(digits)
    return out


def reward(a: torch.Tensor, b: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    r = torch.zeros(a.numel())
    for i, row in enumerate(completion.tolist()):
        text = "".join(TOKENS[t] for t in row)
        if ";" not in text:
            continue
        body = text.split(";")[0]
        if body.isdigit() and len(body) <= 2:
            r[i] = 1.0 if int(body) == int(a[i] + b[i]) else 0.1
    return r


def completion_mask(completion: torch.Tensor) -> torch.Tensor:
    """1 up to and including the first ";" (tokens after it are padding)."""
    ended = torch.cumsum((completion == EOS).int(), 1)
    return ((ended - (completion == EOS).int()) == 0).float()


@torch.no_grad()
def sample(model: TinyLM, prompt: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    ids = prompt
    for _ in range(MAX_NEW):
        logits = model(ids)[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], 1)
    completion = ids[:, PROMPT_LEN:]
    return torch.where(completion_mask(completion) > 0, completion, torch.full_like(completion, PAD))


def completion_logits(model: TinyLM, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([prompt, completion], 1)
    return model(ids)[:, PROMPT_LEN - 1:-1]  # logits[:, t] predicts completion token t


def warm_up(model: TinyLM, steps: int, seed: int) -> None:
    """Supervised format teaching: 80% of the targets are a random wrong-or-right number."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        a, b = torch.randint(0, 10, (128,), generator=gen), torch.randint(0, 10, (128,), generator=gen)
        noise = torch.randint(0, 19, (128,), generator=gen)
        target = torch.where(torch.rand(128, generator=gen) < 0.2, a + b, noise)
        completion = answer_tokens(target)
        logits = completion_logits(model, prompts(a, b), torch.where(completion == PAD, EOS, completion))
        mask = completion_mask(completion)
        nll = nn.functional.cross_entropy(logits.reshape(-1, V), completion.clamp(max=V - 1).reshape(-1),
                                          reduction="none").reshape(mask.shape)
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def policy_loss(objective: str, logits, old_logits, old_sparse, tokens, adv, mask, eps, threads):
    if objective == "troll":
        return troll.torch.trust_region_loss(logits, old_sparse, tokens, adv, eps=eps, mask=mask,
                                             return_metrics=True, threads=threads)
    if objective == "ppo_clip":
        return troll.torch.ppo_clip_loss(logits, old_logits, tokens, adv, clip_low=0.2, clip_high=0.2, mask=mask,
                                         return_metrics=True, threads=threads)
    return troll.torch.dppo_loss(logits, old_logits, tokens, adv, divergence="binary_tv", mask=mask,
                                 return_metrics=True, threads=threads)


def grpo(objective: str, base: TinyLM, args, writer) -> dict:
    torch.manual_seed(args.seed)
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same prompts for every objective
    worst_surrogate_kl = 0.0
    for it in range(args.iterations):
        a = torch.randint(0, 10, (args.prompts,), generator=gen).repeat_interleave(args.group)
        b = torch.randint(0, 10, (args.prompts,), generator=gen).repeat_interleave(args.group)
        prompt = prompts(a, b)
        completion = sample(model, prompt, gen)
        r = reward(a, b, completion)
        grouped = r.view(args.prompts, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        mask = completion_mask(completion)
        tokens = torch.where(mask > 0, completion, torch.full_like(completion, EOS))
        adv_tok = adv[:, None].expand(tokens.shape).contiguous()
        with torch.no_grad():
            old_logits = completion_logits(model, prompt, tokens).contiguous()
        old_sparse = troll.torch.sparsify(old_logits, k=64, sampled=tokens, threads=args.threads)  # what a rollout would store
        for epoch in range(args.epochs):
            logits = completion_logits(model, prompt, tokens).contiguous()
            loss, m = policy_loss(objective, logits, old_logits, old_sparse, tokens, adv_tok, mask, args.eps,
                                  args.threads)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # the network's own distance to the old policy, after the step
                new_logits = completion_logits(model, prompt, tokens)
                kl = troll.kl(new_logits.contiguous(), old_logits, threads=args.threads)[mask > 0]
                logp = torch.log_softmax(new_logits, -1)
                entropy = -(logp.exp() * logp).sum(-1)[mask > 0].mean()
            surrogate_kl = m["kl_after_max"] if objective == "troll" else float("nan")
            if objective == "troll":
                worst_surrogate_kl = max(worst_surrogate_kl, surrogate_kl)
            limited = m["projected_fraction"] if objective == "troll" else m["limited_fraction"]
            writer.writerow([objective, it, epoch, float(r.mean()), float((r == 1.0).float().mean()),
                             float(kl.max()), float(kl.mean()), m["kl_before_max"], surrogate_kl,
                             float(entropy), limited])
        if it % max(1, args.iterations // 5) == 0 or it == args.iterations - 1:
            print(f"  {objective:8s} iteration {it:3d}: reward {float(r.mean()):.3f}, exact {float((r == 1).float().mean()):.3f}, "
                  f"max token KL(net || old) {float(kl.max()):.4f}", flush=True)
    return {"worst_surrogate_kl": worst_surrogate_kl}


def plot(path_csv: str, out_dir: str, eps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(path_csv)))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for objective, colour in (("troll", "C0"), ("ppo_clip", "C1"), ("dppo", "C2")):
        sel = [r for r in rows if r["objective"] == objective]
        last = [r for r in sel if int(r["epoch"]) == max(int(x["epoch"]) for x in sel)]
        it = [int(r["iteration"]) for r in last]
        axes[0, 0].plot(it, [float(r["reward"]) for r in last], colour, label=objective)
        step = range(len(sel))

        def per_iteration(key, reduce):  # over the epochs of each iteration's batch
            return [reduce(float(r[key]) for r in sel if int(r["iteration"]) == i) for i in it]

        axes[0, 1].plot(it, per_iteration("kl_max", max), colour, label=f"{objective} max (network)")
        means = [sum(v) / len(v) for v in ([float(r["kl_mean"]) for r in sel if int(r["iteration"]) == i] for i in it)]
        axes[0, 1].plot(it, means, colour, ls=":", label=f"{objective} mean (network)")
        if objective == "troll":
            axes[0, 1].plot(it, per_iteration("kl_surrogate_max", max), "k", ls="--", lw=1.2,
                            label="troll max KL(pi* || old)")
        axes[1, 0].plot(it, [float(r["entropy"]) for r in last], colour, label=objective)
        axes[1, 1].plot(step, [float(r["limited_fraction"]) for r in sel], colour,
                        label={"troll": "troll: projected", "ppo_clip": "ppo: clipped", "dppo": "dppo: masked"}[objective])
    axes[0, 1].axhline(eps, color="r", lw=0.8, label="eps")
    axes[0, 1].set_yscale("log")
    axes[0, 1].set_ylim(bottom=1e-4)
    for ax, title, xl in ((axes[0, 0], "mean reward", "iteration"),
                          (axes[0, 1], "per-token KL to the old policy (max over a batch's epochs)", "iteration"),
                          (axes[1, 0], "mean entropy (completion tokens)", "iteration"),
                          (axes[1, 1], "fraction of tokens projected / clipped / masked", "update")):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "grpo_tiny_lm.png"), dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    p.add_argument("--out", default="build/grpo_tiny_lm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=4, help="updates per batch (off-policy drift the bound must hold)")
    p.add_argument("--threads", type=int, default=1, help="torch and troll threads")
    args = p.parse_args()
    args.warmup, args.iterations, args.prompts, args.group = (60, 12, 16, 8) if args.quick else (400, 100, 32, 8)
    # One thread: on a small shared machine a second one costs far more in contention than it gives.
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    torch.manual_seed(args.seed)
    base = TinyLM()
    warm_up(base, args.warmup, args.seed)
    print(f"warm-up: {args.warmup} supervised steps in {time.time() - started:.0f} s", flush=True)
    path_csv = os.path.join(args.out, "metrics.csv")
    results = {}
    with open(path_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["objective", "iteration", "epoch", "reward", "exact", "kl_max", "kl_mean", "kl_before_max",
                         "kl_surrogate_max", "entropy", "limited_fraction"])
        for objective in ("troll", "ppo_clip", "dppo"):
            results[objective] = grpo(objective, base, args, writer)
    plot(path_csv, args.out, args.eps)
    worst = results["troll"]["worst_surrogate_kl"]
    kept = worst <= args.eps * (1 + 1e-9)
    print(f"wrote {path_csv} and {os.path.join(args.out, 'grpo_tiny_lm.png')} in {time.time() - started:.0f} s")
    print(f"TROLL kept every token's KL(pi* || old) <= eps = {args.eps}: {kept} (max {worst:.6f})")
    if not kept or not math.isfinite(worst):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
