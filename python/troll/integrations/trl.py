"""TRL's GRPO with troll's losses: a ``GRPOTrainer`` subclass that, at generation time, stores the
old policy's sparse top-K rows instead of only the sampled token's log-prob, and computes the
policy loss with ``troll.torch.trust_region_loss`` (or troll's PPO clip / DPPO, for comparison).

Tested against trl 1.16.0 / transformers 5.23.0 (python/requirements-trl.txt). It overrides two
GRPOTrainer methods and nothing else:

* ``_generate_and_score_completions(inputs)``: TRL's own (generation, rewards, group advantages),
  then one no-grad forward of the current model — the policy that sampled — over prompt +
  completion, in chunks of ``per_device_train_batch_size`` sequences, whose completion logits
  (divided by ``temperature``) are turned into the stored old policy right away:
    objective="troll":    troll.torch.sparsify(logits, k, delta, sampled=completion tokens) —
                          (k + 1) x (4 + 4) + 4 + 4 bytes per token (indices int32, log-probs
                          float32, count, log remainder): 528 bytes for k = 64, whatever V;
    objective="ppo_clip" / "dppo": the dense logits, 4 V bytes per token (comparison runs).
  The dense logits of the whole generation batch are never held at once.
* ``_compute_loss(model, inputs)``: the model's logits on the completion tokens (one forward with
  grad, ``logits_to_keep``), divided by ``temperature``, then
    troll:    troll.torch.trust_region_loss(logits, old_sparse, tokens, advantages, eps, alpha, mask)
    ppo_clip: troll.torch.ppo_clip_loss(..., clip_low=args.epsilon, clip_high=args.epsilon_high)
    dppo:     troll.torch.dppo_loss(..., divergence, delta_low, delta_high)
  averaged over the micro-batch's completion tokens (TRL's "bnpo" normalisation) and divided by the
  gradient-accumulation steps as TRL does; TRL's k3 KL to the reference model is added when
  ``beta`` != 0, weighted by TRL's importance ratio when ``use_bias_correction_kl`` is set (TRL's
  default), as TRL weights it. troll's metrics (kl_before_max, kl_after_max, projected_fraction, ...) are logged
  under ``troll/``.

Turning it on in a GRPO script::

    from troll.integrations.trl import TrollConfig, TrollGRPOTrainer
    trainer = TrollGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                               train_dataset=..., troll=TrollConfig(eps=0.05))

Where the tensors live: troll computes on the logits' own device when that is a CUDA device and
troll's CUDA extension is available (``troll.cuda_available()``): the logits, the stored old
policy, the tokens, mask and advantages stay there, and nothing is copied to the host but the
metrics. Otherwise (a CPU model, a build without the CUDA extension, another accelerator) the
adapter moves what troll reads to the host, as ``troll_device`` says."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from trl import GRPOTrainer

from .. import _core
from .. import torch as troll_torch
from .._core import SparseRows

__all__ = ["TrollConfig", "TrollGRPOTrainer", "ignored_grpo_settings", "troll_device"]

_OLD_SPARSE = ("troll_old_indices", "troll_old_log_probs", "troll_old_counts", "troll_old_log_remainder")
_OLD_DENSE = "troll_old_logits"
_HOST = torch.device("cpu")


def troll_device(device: Any) -> torch.device:
    """The device troll computes on for logits on ``device``: that CUDA device when troll's CUDA
    extension is available (troll.cuda_available()), else the host."""
    device = torch.device(device)
    if device.type == "cuda" and _core.cuda_available():
        return device
    return _HOST


def _on(x: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x`` on ``device`` (and in ``dtype`` when given): ``x`` itself when it already is; a cast
    without a copy between devices when only the dtype differs."""
    if x.device != device:
        return x.to(device, dtype) if dtype is not None else x.to(device)
    if dtype is not None and x.dtype != dtype:
        return x.to(dtype)
    return x


def ignored_grpo_settings(args: Any, aux_loss_enabled: bool = False) -> List[str]:
    """The settings of ``args`` (a GRPOConfig) that shape TRL's own policy loss, set away from
    their defaults, which TrollGRPOTrainer's loss does not apply (``loss_type`` is documented as
    replaced by the bnpo mean and not listed)."""
    found = []
    if getattr(args, "importance_sampling_level", "token") != "token":
        found.append(f"importance_sampling_level={args.importance_sampling_level!r} (the policy term)")
    if getattr(args, "delta", None) is not None:
        found.append(f"delta={args.delta!r}")
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        found.append(f"top_entropy_quantile={args.top_entropy_quantile!r}")
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        found.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold!r}")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        found.append("vllm_importance_sampling_correction=True")
    if aux_loss_enabled:
        found.append("the MoE router's auxiliary loss")
    return found


@dataclass
class TrollConfig:
    """What the adapter computes. ``objective``: "troll" (the trust-region loss on the stored
    sparse rows), "ppo_clip" or "dppo" (troll's implementations on stored dense logits, for
    comparison; PPO's clip range is GRPOConfig's ``epsilon`` / ``epsilon_high``)."""

    objective: str = "troll"
    eps: float = 0.05  #: the KL bound of every token's next-token distribution
    alpha: float = 1.0  #: weight of TROLL's regression term KL(p_new || stopgrad(pi*))
    k: int = 64  #: old rows: at most k tokens by probability ...
    delta: float = 1e-5  #: ... whose mass reaches 1 - delta, plus the sampled token
    new_k: int = 64  #: the new row's own top tokens added to the support U
    new_delta: float = 1e-5
    dppo_divergence: str = "binary_tv"
    dppo_delta_low: Optional[float] = None
    dppo_delta_high: Optional[float] = None
    threads: int = 0

    def __post_init__(self) -> None:
        if self.objective not in ("troll", "ppo_clip", "dppo"):
            raise ValueError(f"TrollConfig.objective must be 'troll', 'ppo_clip' or 'dppo', not {self.objective!r}")

    def bytes_per_token(self, vocab: int) -> int:
        """Bytes the old policy costs per completion token (besides TRL's own tensors)."""
        if self.objective == "troll":
            return (self.k + 1) * 8 + 8
        return 4 * int(vocab)


class TrollGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose policy loss is troll's (see the module docstring). Takes GRPOTrainer's
    arguments plus ``troll``, a TrollConfig (default: TROLL with eps = 0.05)."""

    def __init__(self, *args: Any, troll: Optional[TrollConfig] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.troll = troll if troll is not None else TrollConfig()
        ignored = ignored_grpo_settings(self.args, getattr(self, "aux_loss_enabled", False))
        if ignored:
            warnings.warn("TrollGRPOTrainer computes its own policy loss and does not apply these GRPOConfig "
                          "settings of TRL's: " + ", ".join(ignored) + " (docs/python.md)", UserWarning, stacklevel=2)

    # ---- the model's completion logits ----

    def _completion_logits(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        keep = completion_ids.size(1)
        # logits[:, t] predicts token t + 1: the last keep + 1 positions, less the final one.
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep + 1).logits
        logits = logits[:, -keep - 1:-1, :].float() / self.temperature
        return _on(logits, troll_device(logits.device))

    # ---- override 1: store the old policy at generation time ----

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        chunk = max(1, int(self.args.per_device_train_batch_size))
        parts = []
        with torch.no_grad():
            for start in range(0, completion_ids.size(0), chunk):
                end = start + chunk
                logits = self._completion_logits(self.model, prompt_ids[start:end], prompt_mask[start:end],
                                                 completion_ids[start:end], completion_mask[start:end])
                if self.troll.objective == "troll":
                    parts.append(troll_torch.sparsify(logits, self.troll.k, self.troll.delta,
                                                      sampled=_on(completion_ids[start:end], logits.device),
                                                      threads=self.troll.threads))
                else:
                    parts.append(logits)
        device = completion_ids.device
        if self.troll.objective == "troll":
            for j, name in enumerate(_OLD_SPARSE):
                output[name] = _on(torch.cat([p[j] for p in parts]), device)
        else:
            output[_OLD_DENSE] = _on(torch.cat(parts), device)
        return output

    # ---- override 2: troll's loss ----

    def _compute_loss(self, model, inputs):
        cfg = self.troll
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logits = self._completion_logits(model, inputs["prompt_ids"], inputs["prompt_mask"], completion_ids,
                                         inputs["completion_mask"])
        # logits are on troll's device (troll_device): the model's own, or the host.
        dev = logits.device
        tokens = _on(completion_ids, dev)
        mask_f = _on(mask, dev, torch.float32)
        advantages = _on(inputs["advantages"], dev, torch.float32)
        if advantages.dim() == 1:
            advantages = advantages[:, None]
        advantages = advantages.expand(tokens.shape)
        if cfg.objective == "troll":
            old = SparseRows(*(_on(inputs[n], dev) for n in _OLD_SPARSE), int(logits.size(-1)))
            loss, metrics = troll_torch.trust_region_loss(
                logits, old, tokens, advantages, eps=cfg.eps, alpha=cfg.alpha, mask=mask_f, new_k=cfg.new_k,
                new_delta=cfg.new_delta, return_metrics=True, threads=cfg.threads)
        elif cfg.objective == "ppo_clip":
            loss, metrics = troll_torch.ppo_clip_loss(
                logits, _on(inputs[_OLD_DENSE], dev), tokens, advantages, clip_low=self.epsilon_low,
                clip_high=self.epsilon_high, mask=mask_f, return_metrics=True, threads=cfg.threads)
        else:
            loss, metrics = troll_torch.dppo_loss(
                logits, _on(inputs[_OLD_DENSE], dev), tokens, advantages, divergence=cfg.dppo_divergence,
                delta_low=cfg.dppo_delta_low, delta_high=cfg.dppo_delta_high, mask=mask_f,
                return_metrics=True, threads=cfg.threads)
        if self.beta != 0.0:
            # TRL's k3 estimator of KL(pi_theta || pi_ref) on the sampled tokens, same mean.
            logps = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
            ref = _on(inputs["ref_per_token_logps"], dev, logps.dtype)
            per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
            if getattr(self.args, "use_bias_correction_kl", False):
                per_token_kl = per_token_kl * self._kl_importance_weights(inputs, logps, mask_f)
            kl = (per_token_kl * mask_f).sum() / mask_f.sum().clamp(min=1.0)
            loss = loss + self.beta * kl
            self._metrics[mode]["kl"].append(float(kl.detach()))
        loss = _on(loss, completion_ids.device)
        self._log_troll_metrics(mode, metrics)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return loss / normalizer

    def _kl_importance_weights(self, inputs, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """TRL's importance weights of the k3 KL term (GRPOConfig.use_bias_correction_kl): pi_theta /
        pi_old of the sampled tokens, per token or, with importance_sampling_level="sequence", the
        exponential of the sequence's masked mean log-ratio; pi_old is TRL's stored
        old_per_token_logps, or logps.detach() where TRL stores none (weight 1, gradient that of
        log pi_theta), as TRL computes it."""
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else _on(old, logps.device, logps.dtype)
        log_ratio = logps - old
        if getattr(self, "importance_sampling_level", "token") == "sequence":
            log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return torch.exp(log_ratio)

    def _log_troll_metrics(self, mode: str, metrics: Dict[str, float]) -> None:
        for name in ("kl_before_mean", "kl_before_max", "kl_after_mean", "kl_after_max", "projected_fraction",
                     "limited_fraction", "ratio_mean"):
            if name in metrics:
                self._metrics[mode][f"troll/{name}"].append(float(metrics[name]))
