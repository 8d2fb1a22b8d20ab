"""The losses' per-row inputs and the solver's defaults, from the second Python audit: in-place
edits of tokens / advantages / mask / sequence_ids between forward and backward (the backward had
read the caller's edited tensors: gradients 0.05 to 0.6 off, no error), the default aggregation
when sequence_ids are given (they were ignored), unsigned id dtypes (a torch-internal error), and
Python solver defaults that differed from the C++ ones (rtol 1e-12, atol 1e-15: a row at
eps = 1e-12 landed 2.3e-5 eps above its bound while reported projected)."""

import inspect

import pytest
import torch

import troll
import troll.torch as tt

D = torch.float64


def _batch(seed=8):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(6, 8, dtype=D, generator=g)
    new = old + torch.randn(6, 8, dtype=D, generator=g)
    tokens = torch.randint(0, 8, (6,), generator=g)
    advantages = torch.randn(6, dtype=D, generator=g)
    mask = torch.ones(6, dtype=D)
    mask[1] = 0.5
    sequence_ids = torch.tensor([0, 0, 1, 2, 2, 2])
    return new, old, tokens, advantages, mask, sequence_ids


LOSSES = {
    "troll_dense": lambda z, old, t, a, **kw: tt.trust_region_loss(z, old, t, a, eps=0.05, **kw),
    "troll_sparse": lambda z, old, t, a, **kw: tt.trust_region_loss(z, tt.sparsify(old, k=4, sampled=t.clone()), t,
                                                                     a, eps=0.05, **kw),
    "ppo": lambda z, old, t, a, **kw: tt.ppo_clip_loss(z, old, t, a, **kw),
    "dppo": lambda z, old, t, a, **kw: tt.dppo_loss(z, old, t, a, divergence="topk_kl", top_k=3, **kw),
}

EDITS = {
    "advantages": lambda t, a, m, s: a.mul_(-2.0),
    "mask": lambda t, a, m, s: m.mul_(3.0).add_(1.0),
    "tokens": lambda t, a, m, s: t.add_(1).remainder_(8),
    "sequence_ids": lambda t, a, m, s: s.zero_(),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_in_place_edits_after_the_forward_do_not_change_the_gradient(loss, edit):
    new, old, tokens, advantages, mask, sequence_ids = _batch()

    def run(mutate):
        t, a, m, s = tokens.clone(), advantages.clone(), mask.clone(), sequence_ids.clone()
        z = new.clone().requires_grad_()
        value = LOSSES[loss](z, old, t, a, mask=m, sequence_ids=s)
        if mutate:
            EDITS[edit](t, a, m, s)
        value.backward()
        return value.detach(), z.grad

    value, grad = run(False)
    edited_value, edited_grad = run(True)
    assert torch.equal(value, edited_value)
    assert torch.equal(grad, edited_grad)
    assert grad.abs().max() > 0


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_sequence_ids_select_the_sequence_mean_by_default(loss):
    new, old, tokens, advantages, mask, sequence_ids = _batch()
    implied = LOSSES[loss](new, old, tokens, advantages, mask=mask, sequence_ids=sequence_ids)
    explicit = LOSSES[loss](new, old, tokens, advantages, mask=mask, sequence_ids=sequence_ids,
                            aggregation="sequence_mean")
    token = LOSSES[loss](new, old, tokens, advantages, mask=mask, sequence_ids=sequence_ids, aggregation="token_mean")
    plain = LOSSES[loss](new, old, tokens, advantages, mask=mask)
    assert torch.equal(implied, explicit)
    assert torch.equal(token, plain)
    assert not torch.allclose(implied, token)  # uneven sequences: the two means differ


def test_solver_defaults_are_the_cpp_ones_and_keep_the_bound_relative():
    for fn in (troll.project, troll.project_sparse, tt.project, tt.project_sparse, tt.trust_region_loss):
        params = inspect.signature(fn).parameters
        assert params["rtol"].default == 1e-11
        assert params["atol"].default == 0.0
        assert params["max_iterations"].default == 100
    g = torch.Generator().manual_seed(0)
    new = 2.0 * torch.randn(6, 7, dtype=D, generator=g)
    old = torch.randn(6, 7, dtype=D, generator=g)
    old[3, 0] = 30.0  # a nearly one-hot old row
    for eps in (1e-12, 1e-9):
        _, stats = tt.project(new, old, eps, return_stats=True)
        for r in range(6):
            assert abs(float(stats.kl_after[r]) / eps - 1.0) <= 1e-10


UNSIGNED = [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", UNSIGNED, ids=str)
def test_unsigned_ids_are_widened(dtype):
    new, old, tokens, advantages, mask, sequence_ids = _batch()
    want = tt.sparsify(old, k=2, sampled=tokens)
    got = tt.sparsify(old, k=2, sampled=tokens.to(dtype))
    for a, b in zip(got[:4], want[:4]):
        assert torch.equal(a, b)
    assert torch.equal(tt.ppo_clip_loss(new, old, tokens.to(dtype), advantages, sequence_ids=sequence_ids.to(dtype)),
                       tt.ppo_clip_loss(new, old, tokens, advantages, sequence_ids=sequence_ids))


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="no torch.uint64")
def test_uint64_ids_beyond_int64_are_refused_naming_the_row():
    new, old, tokens, advantages, mask, sequence_ids = _batch()
    ids = tokens.to(torch.uint64)
    ids[4] = 2 ** 63 + 5
    with pytest.raises(troll.DomainError) as info:
        tt.ppo_clip_loss(new, old, ids, advantages)
    assert info.value.row == 4
