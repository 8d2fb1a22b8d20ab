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
