"""troll.integrations.trl: a few GRPO steps on CPU with a tiny randomly initialised causal LM (a
transformers Llama built from a config) and a tokenizer built locally with `tokenizers` — no hub
access (HF_HUB_OFFLINE=1). Skipped when trl is not installed (python/requirements-trl.txt)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest
import torch

trl = pytest.importorskip("trl")

import troll  # noqa: E402
from troll.integrations.trl import TrollConfig, TrollGRPOTrainer  # noqa: E402

CHARS = list("0123456789+=;")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_model(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def reward_digits(prompts, completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def run_steps(tmp_path, objective: str, steps: int = 2, **troll_kwargs):
    from datasets import Dataset
    from trl import GRPOConfig

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    args = GRPOConfig(output_dir=str(tmp_path / objective), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=steps, learning_rate=1e-2,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, num_iterations=2,
                      bf16=False, fp16=False, dataloader_num_workers=0)
    trainer = TrollGRPOTrainer(model=model, reward_funcs=reward_digits, args=args, train_dataset=data,
                               processing_class=tokenizer, troll=TrollConfig(objective=objective, k=4,
                                                                             **troll_kwargs))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return trainer, moved


def test_troll_objective_trains_and_keeps_every_token_inside_the_ball(tmp_path):
    trainer, moved = run_steps(tmp_path, "troll", steps=2, eps=0.02)
    assert moved
    logs = [h for h in trainer.state.log_history if "troll/kl_after_max" in h]
    assert logs, trainer.state.log_history
    # the second pass over the batch moved the policy past the bound: the projection was active
    assert max(h["troll/kl_before_max"] for h in logs) > 0.02
    assert max(h["troll/projected_fraction"] for h in logs) > 0
    # KL(pi* || old) <= eps on every token (the bound is the point of TROLL); solver tolerance
    assert max(h["troll/kl_after_max"] for h in logs) <= 0.02 * (1 + 1e-6)
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)  # no NaN


@pytest.mark.parametrize("objective", ["ppo_clip", "dppo"])
def test_comparison_objectives_run(tmp_path, objective):
    trainer, moved = run_steps(tmp_path, objective, steps=1)
    assert moved


def test_stored_old_policy_is_troll_sparsify_of_the_generating_model(tmp_path):
    """The rows stored at generation are sparsify of the model's completion logits / temperature."""
    from datasets import Dataset
    from trl import GRPOConfig

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer), seed=3)
    data = Dataset.from_dict({"prompt": ["1+2=", "3+3=", "2+0=", "0+1="]})
    args = GRPOConfig(output_dir=str(tmp_path / "x"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=5, max_steps=1, report_to="none",
                      save_strategy="no", temperature=0.7)
    trainer = TrollGRPOTrainer(model=model, reward_funcs=reward_digits, args=args, train_dataset=data,
                               processing_class=tokenizer, troll=TrollConfig(k=3, delta=0.0))
    batch = trainer._generate_and_score_completions([{"prompt": "1+2="}] * 4)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
    keep = batch["completion_ids"].size(1)
    logits = full[:, -keep - 1:-1].float() / 0.7
    expected = troll.torch.sparsify(logits, 3, 0.0, sampled=batch["completion_ids"])
    assert torch.equal(batch["troll_old_indices"], expected.indices)
    assert torch.equal(batch["troll_old_counts"], expected.counts)
    torch.testing.assert_close(batch["troll_old_log_probs"], expected.log_probs, rtol=1e-5, atol=1e-5)
    assert TrollConfig(k=64).bytes_per_token(32000) == 528


# ---- the device route: troll on the logits' own (CUDA) device ----


def test_troll_device_is_the_logits_cuda_device_only_where_troll_cuda_runs(monkeypatch):
    from troll import _core
    from troll.integrations import trl as adapter

    cpu = torch.device("cpu")
    for available in (False, True):
        monkeypatch.setattr(_core, "cuda_available", lambda: available)
        assert adapter.troll_device("cpu") == cpu
        assert adapter.troll_device(torch.device("meta")) == cpu
        assert adapter.troll_device("cuda:1") == (torch.device("cuda:1") if available else cpu)


def _spy_adapter_moves(monkeypatch) -> list:
    """Every Tensor.to / Tensor.cpu the adapter's module makes that names a device (a move, or
    a no-op only because the test's tensors are on the host), as (shape, name, args, kwargs);
    dtype casts are not moves."""
    import sys

    from troll.integrations import trl as adapter

    moves = []
    real_to, real_cpu = torch.Tensor.to, torch.Tensor.cpu

    def spy(real):
        def call(self, *args, **kwargs):
            names_device = real is real_cpu or "device" in kwargs or any(
                isinstance(a, (str, torch.device, torch.Tensor)) for a in args)
            if names_device and sys._getframe(1).f_code.co_filename == adapter.__file__:
                moves.append((tuple(self.shape), real.__name__, args, kwargs))
            return real(self, *args, **kwargs)
        return call

    monkeypatch.setattr(torch.Tensor, "to", spy(real_to))
    monkeypatch.setattr(torch.Tensor, "cpu", spy(real_cpu))
    return moves


@pytest.mark.parametrize("objective", ["troll", "ppo_clip", "dppo"])
def test_device_route_keeps_the_logits_in_place_and_equals_the_host_path(tmp_path, monkeypatch, objective):
    """With troll's CUDA extension available for the logits' device, the adapter hands troll the
    model's tensors where they are. Without a GPU, test_cuda_dispatch's stand-in serves troll's CUDA
    calls with the host extension, so the stored old policy, the loss, its gradient and the logged
    metrics must equal the host path's bit for bit, and the adapter moves nothing."""
    from datasets import Dataset
    from test_cuda_dispatch import _route
    from trl import GRPOConfig

    from troll.integrations import trl as adapter

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer), seed=5)
    data = Dataset.from_dict({"prompt": ["1+2=", "3+3=", "2+0=", "0+1="]})
    args = GRPOConfig(output_dir=str(tmp_path / "x"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=5, max_steps=1, report_to="none",
                      save_strategy="no", temperature=0.9)
    trainer = TrollGRPOTrainer(model=model, reward_funcs=reward_digits, args=args, train_dataset=data,
                               processing_class=tokenizer, troll=TrollConfig(objective=objective, k=3, new_k=3,
                                                                             eps=0.01))
    trainer.current_gradient_accumulation_steps = 2
    prompts = [{"prompt": "1+2="}] * 2 + [{"prompt": "3+3="}] * 2

    def step():
        torch.manual_seed(7)
        batch = trainer._generate_and_score_completions(prompts)
        ids = batch["completion_ids"]
        batch["ref_per_token_logps"] = -1.0 - 0.1 * (ids % 5).float()
        model.zero_grad()
        trainer.beta = 0.04  # TRL's k3 term too, against the made-up reference log-probs
        loss = trainer._compute_loss(model, batch)
        trainer.beta = 0.0
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        logged = {k: list(v) for k, v in trainer._metrics["train"].items() if k.startswith("troll/") or k == "kl"}
        trainer._metrics["train"].clear()
        stored = [batch[n] for n in (*adapter._OLD_SPARSE, adapter._OLD_DENSE) if n in batch]
        return stored, loss.detach(), grads, logged

    with torch.no_grad():  # the trained policy: off the generating one, so the loss is not at the centre
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    want = step()
    stand_in = _route(monkeypatch)
    monkeypatch.setattr(adapter, "troll_device", lambda device: torch.device(device))
    moves = _spy_adapter_moves(monkeypatch)
    got = step()
    assert moves == []
    assert len(got[0]) == (4 if objective == "troll" else 1)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert torch.equal(got[1], want[1]) and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert got[3] == want[3] and "kl" in got[3] and any(k.startswith("troll/") for k in got[3])
    forward = {"troll": "sparse_trust_region_forward", "ppo_clip": "ppo_clip_forward", "dppo": "dppo_forward"}
    assert forward[objective] in stand_in.calls and forward[objective].replace("forward", "backward") in stand_in.calls
    if objective == "troll":
        assert "sparsify" in stand_in.calls


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_reference_kl_term_equals_trls_own(tmp_path, bias_correction, num_iterations):
    """With beta != 0 the adapter's loss is TRL's: the policy term through objective="ppo_clip"
    (TRL's bnpo loss, the same clip) and the k3 KL to the reference model, weighted by the
    importance ratio exactly when GRPOConfig.use_bias_correction_kl is set. Value and every
    parameter gradient, with the policy moved away from the one that sampled."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer), seed=3)
    args = GRPOConfig(output_dir=str(tmp_path / "kl"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=5, max_steps=1, report_to="none",
                      save_strategy="no", seed=0, num_iterations=num_iterations, loss_type="bnpo", beta=0.0,
                      temperature=0.7, use_bias_correction_kl=bias_correction, bf16=False, fp16=False)
    trainer = TrollGRPOTrainer(model=model, reward_funcs=reward_digits, args=args,
                               train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3+3="]}),
                               processing_class=tokenizer, troll=TrollConfig(objective="ppo_clip"))
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "1+2="}, {"prompt": "3+3="}] * 2)
    # beta is set after generation: with beta != 0 at construction TRL would load a reference model.
    trainer.beta = 0.1
    keep = batch["completion_ids"].size(1)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        sampled = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():  # the reference policy: a perturbed copy
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        ref = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, -keep - 1:-1] / 0.7, -1)
        batch["ref_per_token_logps"] = ref.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
        for p, s in zip(model.parameters(), sampled):
            p.copy_(s)
            # With num_iterations = 1 TRL takes the policy that sampled as the current one (its old
            # log-probs are the current ones, detached); otherwise move it away.
            if num_iterations > 1:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))

    def loss_and_grads(compute):
        model.zero_grad()
        loss = compute(model, batch)
        loss.backward()
        return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters()]

    ours, our_grads = loss_and_grads(trainer._compute_loss)
    theirs, their_grads = loss_and_grads(lambda m, b: GRPOTrainer._compute_loss(trainer, m, b))
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    scale = max(float(g.abs().max()) for g in their_grads)
    assert scale > 0
    for a, b in zip(our_grads, their_grads):
        assert float((a - b).abs().max()) <= 1e-5 * scale


def test_settings_of_trls_policy_loss_that_the_adapter_does_not_apply_are_named():
    from types import SimpleNamespace

    from troll.integrations.trl import ignored_grpo_settings

    defaults = SimpleNamespace(importance_sampling_level="token", delta=None, top_entropy_quantile=1.0,
                               off_policy_mask_threshold=None, use_vllm=False,
                               vllm_importance_sampling_correction=True)
    assert ignored_grpo_settings(defaults) == []
    changed = SimpleNamespace(importance_sampling_level="sequence", delta=2.0, top_entropy_quantile=0.2,
                              off_policy_mask_threshold=0.5, use_vllm=True,
                              vllm_importance_sampling_correction=True)
    named = " ".join(ignored_grpo_settings(changed, aux_loss_enabled=True))
    for setting in ("importance_sampling_level", "delta", "top_entropy_quantile", "off_policy_mask_threshold",
                    "vllm_importance_sampling_correction", "auxiliary loss"):
        assert setting in named


def test_the_trainer_warns_about_settings_it_does_not_apply(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "warn"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, max_steps=1, report_to="none",
                      save_strategy="no", importance_sampling_level="sequence", bf16=False, fp16=False)
    with pytest.warns(UserWarning, match="importance_sampling_level"):
        TrollGRPOTrainer(model=tiny_model(len(tokenizer)), reward_funcs=reward_digits, args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["1+2="]}), processing_class=tokenizer)
