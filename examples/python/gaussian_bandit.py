"""A contextual point-reaching bandit with a Gaussian policy, trained with PPO clip and with
troll's Gaussian trust-region projection (the differentiable trust-region layer of Otto et al.,
ICLR 2021, with troll.torch.gaussian doing the projection), from the same seeds, on CPU. Writes
build/gaussian_bandit/metrics.csv and build/gaussian_bandit/gaussian_bandit.png (reward and
KL-to-the-old-policy curves) and prints whether the projected policies stayed inside the bound.

    python examples/python/gaussian_bandit.py            # the full run (~35 s on 2 shared cores)
    python examples/python/gaussian_bandit.py --quick    # CI's smoke run (well under 30 s)

The task: a context c ~ U[-1, 1]² names a goal g(c) in the plane; the policy N(μ(c), diag σ(c)²)
(an MLP) picks a point a and gets the reward −‖a − g(c)‖². Each iteration samples G actions for
each of B contexts from the current (old) policy, takes group-normalised rewards as advantages,
and runs K epochs of Adam on
  * PPO clip:  −mean(min(r A, clip(r, 1 ± 0.2) A)), r = π(a)/π_old(a);
  * projection: π̃ = project_split_diag(π, π_old, ε_μ, ε_Σ) (or project_joint_diag, --bound joint)
    and −mean(π̃(a)/π_old(a) A) + α KL(π ‖ stopgrad π̃), the layer's surrogate and its
    trust-region regression term. Gradients flow through the projection (troll's analytic backward).
PPO bounds nothing: its KL to the old policy after the K epochs is whatever the clipped surrogate
allows. The projected policy π̃ is inside the trust region by construction (KL ≤ ε_μ + ε_Σ for
split bounds), and the regression term pulls the network itself towards it. Needs torch, troll
and matplotlib (python/requirements-trl.txt)."""

from __future__ import annotations

import argparse
import csv
import math
import os
import time

import torch
import torch.nn as nn

import troll
import troll.torch.gaussian as tg


def goal(c: torch.Tensor) -> torch.Tensor:
    """The point to reach for context c: a rotation of c, bent by a sine."""
    return torch.stack([0.8 * c[:, 1] + 0.3 * torch.sin(3 * c[:, 0]), -0.8 * c[:, 0] + 0.3 * torch.sin(3 * c[:, 1])], -1)


class Policy(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                  nn.Linear(hidden, 4))
        with torch.no_grad():
            self.body[-1].weight.mul_(0.01)
            self.body[-1].bias.copy_(torch.tensor([0.0, 0.0, math.log(0.5), math.log(0.5)]))

    def forward(self, c: torch.Tensor):
        out = self.body(c)
        return out[:, :2], torch.exp(out[:, 2:].clamp(-5.0, 2.0))


def log_prob(a, mean, std):
    return (-0.5 * ((a - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)


def kl_diag(mean, std, old_mean, old_std):
    """KL(N(mean, std²) || N(old_mean, old_std²)) per row, in torch (differentiable)."""
    var, old_var = std**2, old_std**2
    return 0.5 * ((var + (mean - old_mean) ** 2) / old_var - 1.0 + torch.log(old_var / var)).sum(-1)


def train(method: str, opts, seed: int):
    torch.manual_seed(seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=opts.lr)
    eval_c = torch.rand(1024, 2, generator=torch.Generator().manual_seed(99)) * 2 - 1
    rows = []
    for it in range(opts.iterations):
        c = (torch.rand(opts.contexts, 2) * 2 - 1).repeat_interleave(opts.group, 0)
        with torch.no_grad():
            old_mean, old_std = policy(c)
            a = old_mean + old_std * torch.randn_like(old_mean)
            reward = -((a - goal(c)) ** 2).sum(-1)
            grouped = reward.view(opts.contexts, opts.group)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
            old_logp = log_prob(a, old_mean, old_std)
        active = 0.0
        for _ in range(opts.epochs):
            mean, std = policy(c)
            if method == "ppo":
                ratio = torch.exp(log_prob(a, mean, std) - old_logp)
                loss = -torch.min(ratio * adv, ratio.clamp(1 - opts.clip, 1 + opts.clip) * adv).mean()
            else:
                if opts.bound == "split":
                    pm, ps, stats = tg.project_split_diag(mean, std, old_mean, old_std, opts.eps_mean, opts.eps_cov,
                                                          return_stats=True)
                else:
                    pm, ps, stats = tg.project_joint_diag(mean, std, old_mean, old_std, opts.eps, return_stats=True)
                active = float((stats.status == troll.gaussian.PROJECTED).double().mean())
                ratio = torch.exp(log_prob(a, pm, ps) - old_logp)
                regression = kl_diag(mean, std, pm.detach(), ps.detach()).mean()
                loss = -(ratio * adv).mean() + opts.alpha * regression
            optim.zero_grad()
            loss.backward()
            optim.step()
        with torch.no_grad():
            mean, std = policy(c)
            # The KL of the update, by troll (float64 per row): the network's own policy and, for
            # the projection, the projected policy that the surrogate used.
            kl_net = troll.gaussian.kl_diag(mean.double(), std.double(), old_mean.double(), old_std.double())
            if method == "projection":  # in float64, so the check below is not float32 rounding
                args = (mean.double(), std.double(), old_mean.double(), old_std.double())
                if opts.bound == "split":
                    pm, ps, _ = troll.gaussian.project_split_diag(*args, opts.eps_mean, opts.eps_cov)
                else:
                    pm, ps, _ = troll.gaussian.project_joint_diag(*args, opts.eps)
                kl_proj = troll.gaussian.kl_diag(pm, ps, args[2], args[3])
            else:
                kl_proj = kl_net
            em, _ = policy(eval_c)
            eval_reward = float(-((em - goal(eval_c)) ** 2).sum(-1).mean())
        rows.append(dict(method=method, iteration=it, reward=float(reward.mean()), eval_reward=eval_reward,
                         kl_mean=float(kl_net.mean()), kl_max=float(kl_net.max()),
                         kl_policy_max=float(kl_proj.max()), std_mean=float(std.mean()), projected=active))
    return rows


def plot(rows, opts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"ppo": "tab:orange", "projection": "tab:blue"}
    labels = {"ppo": "PPO clip", "projection": f"troll projection ({opts.bound})"}
    bound = opts.eps_mean + opts.eps_cov if opts.bound == "split" else opts.eps
    for method in ("ppo", "projection"):
        r = [x for x in rows if x["method"] == method]
        it = [x["iteration"] for x in r]
        axes[0].plot(it, [x["eval_reward"] for x in r], color=colors[method], label=labels[method])
        axes[1].plot(it, [x["kl_mean"] for x in r], color=colors[method], label=labels[method] + ", mean")
        axes[1].plot(it, [x["kl_max"] for x in r], color=colors[method], ls="--", label=labels[method] + ", max")
        axes[2].plot(it, [x["kl_policy_max"] for x in r], color=colors[method], label=labels[method])
    axes[0].set(title="reward of the mean action (1024 fixed contexts)", xlabel="iteration", ylabel="−‖μ(c) − g(c)‖²")
    axes[1].set(title="KL(network ‖ old policy) after an update", xlabel="iteration", yscale="log")
    axes[2].set(title="max KL(policy used by the loss ‖ old)", xlabel="iteration", yscale="log")
    for ax in axes[1:]:
        ax.axhline(bound, color="gray", ls=":", label=f"bound {bound:g}")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for CI (well under 30 s)")
    parser.add_argument("--out", default="build/gaussian_bandit")
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--contexts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--bound", choices=("split", "joint"), default="split")
    parser.add_argument("--eps", type=float, default=0.03, help="joint bound")
    parser.add_argument("--eps-mean", type=float, default=0.03)
    parser.add_argument("--eps-cov", type=float, default=0.005)
    parser.add_argument("--alpha", type=float, default=1.0, help="weight of the trust-region regression term")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    if opts.quick:
        opts.iterations = 30
    torch.set_num_threads(1)
    os.makedirs(opts.out, exist_ok=True)
    start = time.time()
    rows = train("ppo", opts, opts.seed) + train("projection", opts, opts.seed)
    with open(os.path.join(opts.out, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, opts, os.path.join(opts.out, "gaussian_bandit.png"))
    bound = opts.eps_mean + opts.eps_cov if opts.bound == "split" else opts.eps
    for method in ("ppo", "projection"):
        r = [x for x in rows if x["method"] == method]
        print(f"{method:10s}: eval reward {r[0]['eval_reward']:.3f} -> {r[-1]['eval_reward']:.3f}, "
              f"max KL(network || old) {max(x['kl_max'] for x in r):.4f}, "
              f"max KL(policy in the loss || old) {max(x['kl_policy_max'] for x in r):.4f} (bound {bound:g})")
    worst = max(x["kl_policy_max"] for x in rows if x["method"] == "projection")
    inside = worst <= bound * (1 + 1e-6)
    print(f"projected policies inside the bound: {'yes' if inside else 'NO'}; "
          f"wrote {opts.out}/metrics.csv and gaussian_bandit.png in {time.time() - start:.1f} s")
    if not inside:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
