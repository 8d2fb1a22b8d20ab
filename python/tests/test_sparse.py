"""troll.torch.sparsify and troll.torch.project_sparse: the stored rows against a PyTorch
reference, agreement with the dense projection when tails are uniform, gradcheck through the
scatter to dense logits, and bad sparse input."""

import math

import pytest
import torch

import troll
import troll.torch as tt
from oracle import make_logits
from oracle import project as project_oracle


def separated_logits(gen, rows, vocab, spacing=0.7):
    """Logits whose order never changes under finite-difference steps (supports stay fixed)."""
    base = torch.arange(vocab, dtype=torch.float64) * -spacing
    return torch.stack([base[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def test_sparsify_keeps_the_top_tokens_and_the_exact_tail(gen):
    logits = make_logits(gen, 2, 3, 100)
    sampled = torch.randint(0, 100, (2, 3), generator=gen)
    rows = tt.sparsify(logits, k=8, delta=0.0, sampled=sampled)
    assert rows.indices.shape == (2, 3, 9) and rows.indices.dtype == torch.int32 and rows.vocab == 100
    lsm = torch.log_softmax(logits, -1)
    top = logits.topk(8, -1).indices
    for i in range(2):
        for j in range(3):
            n = int(rows.counts[i, j])
            idx = rows.indices[i, j, :n].long()
            assert set(top[i, j].tolist()) <= set(idx.tolist())
            assert int(sampled[i, j]) in idx.tolist()
            torch.testing.assert_close(rows.log_probs[i, j, :n], lsm[i, j, idx], rtol=1e-12, atol=1e-12)
            rest = torch.ones(100, dtype=torch.bool)
            rest[idx] = False
            torch.testing.assert_close(rows.log_remainder[i, j], torch.logsumexp(lsm[i, j, rest], 0),
                                       rtol=1e-12, atol=1e-12)
            assert (rows.indices[i, j, n:] == -1).all()


def test_sparse_projection_equals_dense_when_tails_are_uniform(gen):
    vocab, keep = 40, 6
    # The same 6 tokens on top in both rows, every other token one shared value per row side.
    new = make_logits(gen, 3, vocab, scale=1.0).clamp(min=-2.0)
    old = make_logits(gen, 3, vocab, scale=1.0).clamp(min=-3.0)
    new[:, keep:], old[:, keep:] = -3.0, -4.0
    old_rows = tt.sparsify(old, k=keep, delta=0.0)
    out, stats = tt.project_sparse(new, old_rows, 0.05, new_k=keep, new_delta=0.0, return_stats=True)
    assert (stats.status == troll.PROJECTED).all()
    dense, _ = project_oracle(new, old, 0.05)
    for r in range(3):
        n = int(out.counts[r])
        assert n == keep
        idx = out.indices[r, :n].long()
        torch.testing.assert_close(out.log_probs[r, :n], dense[r, idx], rtol=1e-9, atol=1e-11)
        tail = torch.logsumexp(dense[r, keep:], 0)
        torch.testing.assert_close(out.log_remainder[r], tail, rtol=1e-9, atol=1e-11)


def test_project_sparse_gradcheck():
    gen = torch.Generator().manual_seed(11)
    new = (separated_logits(gen, 3, 16) + 0.05 * torch.randn(3, 16, generator=gen, dtype=torch.float64))
    old = separated_logits(gen, 3, 16)
    old_rows = tt.sparsify(old, k=5, delta=0.0)
    new.requires_grad_()
    eps = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
    _, stats = tt.project_sparse(new, old_rows, eps, new_k=4, new_delta=0.0, return_stats=True)
    assert (stats.status == troll.PROJECTED).any()
    w = torch.randn(3, old_rows.indices.shape[-1] + 4, generator=gen, dtype=torch.float64)

    def loss(n, e):
        rows = tt.project_sparse(n, old_rows, e, new_k=4, new_delta=0.0)
        lp = torch.where(torch.isfinite(rows.log_probs), rows.log_probs, torch.zeros_like(rows.log_probs))
        return (lp * w[:, : lp.shape[-1]]).sum() + (rows.log_remainder * 0.3).sum()

    assert torch.autograd.gradcheck(loss, (new, eps))


def test_sparse_rows_numpy(gen):
    logits = make_logits(gen, 4, 30).numpy()
    rows = troll.sparsify(logits, k=4, delta=0.0)
    assert rows.indices.shape == (4, 4) and type(rows.log_probs).__module__ == "numpy"


def test_bad_sparse_input_raises_before_writing(gen):
    logits = make_logits(gen, 3, 20)
    rows = tt.sparsify(logits, k=4, delta=0.0)
    with pytest.raises(troll.DomainError):
        tt.sparsify(logits, k=0)
    with pytest.raises(troll.DomainError) as e:
        tt.sparsify(logits, k=4, sampled=torch.tensor([0, 25, 1]))
    assert e.value.row == 1
    assert e.value.code == 17  # troll::row_error::bad_sampled, as in C++
    broken = troll.SparseRows(rows.indices.clone(), rows.log_probs, rows.counts, rows.log_remainder, 20)
    broken.indices[2, 1] = broken.indices[2, 0]  # a duplicate token
    with pytest.raises(troll.ShapeError) as e:
        tt.project_sparse(logits, broken, 0.05)
    assert e.value.row == 2
    assert e.value.code == 10  # troll::row_error::sparse_duplicate
    with pytest.raises(troll.ShapeError):
        tt.project_sparse(logits[:2], rows, 0.05)
