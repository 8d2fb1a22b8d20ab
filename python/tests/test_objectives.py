"""troll.torch.trust_region_loss (dense and sparse old rows), ppo_clip_loss and dppo_loss:
values against the PyTorch oracle, gradients by gradcheck and against autograd of the oracle."""

import pytest
import torch

import troll
import troll.torch as tt
import oracle
from oracle import make_logits


def batch(gen, rows=6, vocab=24, scale=1.5):
    new = make_logits(gen, rows, vocab, scale=scale)
    old = new + make_logits(gen, rows, vocab, scale=0.8)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    return new, old, tokens, adv


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_trust_region_loss_value(gen, alpha):
    new, old, tokens, adv = batch(gen)
    mask = torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    loss, metrics = tt.trust_region_loss(new, old, tokens, adv, eps=0.05, alpha=alpha, mask=mask,
                                         return_metrics=True)
    want = oracle.trust_region_loss(new, old, tokens, adv, 0.05, alpha, mask)
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    assert metrics["tokens"] == 5 and 0 < metrics["projected_fraction"] <= 1
    assert metrics["kl_after_max"] <= 0.05 + 1e-12


def test_trust_region_loss_gradcheck_ratio_term():
    gen = torch.Generator().manual_seed(5)
    new, old, tokens, adv = batch(gen)
    new.requires_grad_()
    assert torch.autograd.gradcheck(lambda n: tt.trust_region_loss(n, old, tokens, adv, 0.05, alpha=0.0), (new,))


def test_trust_region_loss_regression_term_holds_pi_star_constant(gen):
    new, old, tokens, adv = batch(gen)
    new.requires_grad_()
    g_ratio, = torch.autograd.grad(tt.trust_region_loss(new, old, tokens, adv, 0.05, alpha=0.0), new)
    g_full, = torch.autograd.grad(tt.trust_region_loss(new, old, tokens, adv, 0.05, alpha=0.7), new)
    log_pi, _ = oracle.project(new.detach(), old, 0.05)
    lp = torch.log_softmax(new, -1)
    reg = 0.7 * (lp.exp() * (lp - log_pi)).sum(-1).mean()
    g_reg, = torch.autograd.grad(reg, new)
    torch.testing.assert_close(g_full, g_ratio + g_reg, rtol=1e-8, atol=1e-11)


def test_trust_region_loss_sparse_old_rows():
    gen = torch.Generator().manual_seed(9)
    vocab = 20
    base = torch.arange(vocab, dtype=torch.float64) * -0.6
    new = torch.stack([base[torch.randperm(vocab, generator=gen)] for _ in range(4)])
    old = new + 0.3 * torch.randn(4, vocab, generator=gen, dtype=torch.float64)
    tokens = new.argmax(-1)  # sampled tokens are in the old top-k below
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    old_rows = tt.sparsify(old, k=6, delta=0.0, sampled=tokens)
    new.requires_grad_()
    loss, metrics = tt.trust_region_loss(new, old_rows, tokens, adv, eps=0.02, alpha=0.0, new_k=5,
                                         new_delta=0.0, return_metrics=True)
    assert metrics["projected_fraction"] > 0
    assert torch.autograd.gradcheck(
        lambda n: tt.trust_region_loss(n, old_rows, tokens, adv, 0.02, alpha=0.0, new_k=5, new_delta=0.0), (new,))
    g = torch.autograd.grad(tt.trust_region_loss(new, old_rows, tokens, adv, 0.02, alpha=1.0, new_k=5,
                                                 new_delta=0.0), new)[0]
    assert torch.isfinite(g).all() and abs(float(g.sum())) < 1e-12  # shift invariance per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ppo_clip_loss_matches_autograd_of_the_oracle(gen, dtype):
    new, old, tokens, adv = batch(gen, rows=16, scale=0.5)
    new, old = new.to(dtype), old.to(dtype)
    mask = (torch.rand(16, generator=gen) > 0.2).to(dtype)
    x = new.clone().requires_grad_()
    y = new.double().clone().requires_grad_()
    loss = tt.ppo_clip_loss(x, old, tokens, adv, clip_low=0.2, clip_high=0.28, mask=mask)
    want = oracle.ppo_clip_loss(y, old, tokens, adv, 0.2, 0.28, mask)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss.double(), want, **tol)
    loss.backward()
    want.backward()
    torch.testing.assert_close(x.grad.double(), y.grad, **tol)


def test_dppo_binary_tv_matches_autograd_of_the_oracle(gen):
    new, old, tokens, adv = batch(gen, rows=32, scale=1.0)
    x = new.clone().requires_grad_()
    y = new.clone().requires_grad_()
    loss, metrics = tt.dppo_loss(x, old, tokens, adv, divergence="binary_tv", return_metrics=True)
    want = oracle.dppo_binary_tv_loss(y, old, tokens, adv, 0.15)
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    loss.backward()
    want.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert "divergence_mean" in metrics


@pytest.mark.parametrize("divergence", ["binary_kl", "topk_tv", "topk_kl"])
def test_dppo_gradcheck(divergence):
    gen = torch.Generator().manual_seed(2)
    new, old, tokens, adv = batch(gen, rows=5, vocab=12)
    new.requires_grad_()
    assert torch.autograd.gradcheck(lambda n: tt.dppo_loss(n, old, tokens, adv, divergence, top_k=4), (new,))


def test_sequence_mean(gen):
    new, old, tokens, adv = batch(gen)
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    per_token = tt.ppo_clip_loss(new, old, tokens, adv, mask=torch.tensor([1.0, 1, 1, 0, 0, 0], dtype=torch.float64))
    seq = tt.ppo_clip_loss(new, old, tokens, adv, sequence_ids=ids, aggregation="sequence_mean")
    parts = [tt.ppo_clip_loss(new[s], old[s], tokens[s], adv[s]) for s in (slice(0, 3), slice(3, 5), slice(5, 6))]
    torch.testing.assert_close(seq, sum(parts) / 3)
    torch.testing.assert_close(per_token, parts[0])


def test_loss_errors_name_the_row(gen):
    new, old, tokens, adv = batch(gen)
    tokens[3] = 99
    with pytest.raises(troll.DomainError) as e:
        tt.trust_region_loss(new, old, tokens, adv)
    assert e.value.row == 3
    with pytest.raises(troll.ShapeError):
        tt.ppo_clip_loss(new, old, tokens[:4], adv)
    adv[1] = float("nan")
    tokens[3] = 0
    with pytest.raises(troll.DomainError) as e:
        tt.dppo_loss(new, old, tokens, adv)
    assert e.value.row == 1
    with pytest.raises(troll.DomainError):
        tt.ppo_clip_loss(new, old, tokens, adv.nan_to_num(), clip_low=1.5)
