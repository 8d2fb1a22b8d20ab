"""Ordinary but less common ways of calling troll.torch (the thirty-sixth session's audit):
torch.compile around a call, a user's torch.Tensor subclass, batched (vectorised) gradients and
torch.set_default_device. Each case failed before its fix: compile with an AssertionError from
Dynamo tracing __dlpack_device__, a subclass with NumPy outputs and a TypeError at backward,
batched gradients with the binding's signature dump, a meta default device with "Cannot copy out of
meta tensor"."""

import pytest
import torch

import troll.torch as tt
import troll.torch.gaussian as tg

import oracle

D = torch.float64


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(3)
    new, old = oracle.make_logits(gen, 6, 40), oracle.make_logits(gen, 6, 40)
    tokens = torch.randint(0, 40, (6,), generator=gen)
    advantages = torch.randn(6, generator=gen, dtype=D)
    return new, old, tokens, advantages


def _calls(old, tokens, advantages):
    sparse_old = tt.sparsify(old, 8, 1e-5, tokens)
    return {
        "project": lambda x: tt.project(x, old, 0.05) * 2,
        "sparsify": lambda x: tt.sparsify(x.detach(), 8).log_probs.sum() * 2 + x,
        "project_sparse": lambda x: tt.project_sparse(x, sparse_old, 0.05, tokens).log_probs * 2,
        "trust_region_loss": lambda x: tt.trust_region_loss(x, old, tokens, advantages) * 2,
        "trust_region_loss_sparse": lambda x: tt.trust_region_loss(x, sparse_old, tokens, advantages) * 2,
        "ppo_clip_loss": lambda x: tt.ppo_clip_loss(x, old, tokens, advantages) * 2,
        "dppo_loss": lambda x: tt.dppo_loss(x, old, tokens, advantages) * 2,
    }


@pytest.mark.parametrize("name", ["project", "sparsify", "project_sparse", "trust_region_loss",
                                  "trust_region_loss_sparse", "ppo_clip_loss", "dppo_loss"])
def test_torch_compile_gives_eager_values_and_gradients(batch, name):
    new, old, tokens, advantages = batch
    fn = _calls(old, tokens, advantages)[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager")  # Dynamo's tracing is what failed; no C++ compile
    x_eager, x_compiled = new.clone().requires_grad_(), new.clone().requires_grad_()
    want, got = fn(x_eager), compiled(x_compiled)
    assert torch.equal(want, got)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=D)
    want.backward(up)
    got.backward(up)
    assert torch.equal(x_eager.grad, x_compiled.grad)


def test_torch_compile_gaussian():
    gen = torch.Generator().manual_seed(4)
    mean, old_mean = torch.randn(5, 3, generator=gen, dtype=D), torch.randn(5, 3, generator=gen, dtype=D)
    std, old_std = torch.rand(5, 3, generator=gen, dtype=D) + 0.5, torch.rand(5, 3, generator=gen, dtype=D) + 0.5

    def fn(m):
        return tg.project_joint_diag(m, std, old_mean, old_std, 0.01)[0] * 2

    torch._dynamo.reset()
    x_eager, x_compiled = mean.clone().requires_grad_(), mean.clone().requires_grad_()
    want, got = fn(x_eager), torch.compile(fn, backend="eager")(x_compiled)
    assert torch.equal(want, got)
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(x_eager.grad, x_compiled.grad)


class Logits(torch.Tensor):
    """A user's own tensor type (its module is not torch's)."""


def test_tensor_subclass_is_a_torch_tensor(batch):
    new, old, tokens, _ = batch
    out = tt.project(new.as_subclass(Logits), old, 0.05)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out.as_subclass(torch.Tensor), tt.project(new, old, 0.05))
    rows = tt.sparsify(new.as_subclass(Logits), 4, 1e-5, tokens)
    assert isinstance(rows.log_probs, torch.Tensor)
    x = new.clone().as_subclass(Logits).requires_grad_()
    tt.project(x, old, 0.05).sum().backward()
    y = new.clone().requires_grad_()
    tt.project(y, old, 0.05).sum().backward()
    assert torch.equal(x.grad.as_subclass(torch.Tensor), y.grad)


def test_batched_gradients_are_refused_clearly(batch):
    new, old, _, _ = batch
    x = new[:2, :5].clone().requires_grad_()
    o = old[:2, :5]
    with pytest.raises(RuntimeError, match="batched gradients"):
        torch.autograd.functional.jacobian(lambda z: tt.project(z, o, 0.05), x, vectorize=True)
    # the plain form works, and agrees with rows of vector-Jacobian products
    jac = torch.autograd.functional.jacobian(lambda z: tt.project(z, o, 0.05), x)
    assert jac.shape == (2, 5, 2, 5)
    mean = torch.randn(3, 2, dtype=D, requires_grad=True)
    std = torch.ones(3, 2, dtype=D)
    with pytest.raises(RuntimeError, match="batched gradients"):
        torch.autograd.functional.jacobian(
            lambda m: tg.project_joint_diag(m, std, mean.detach() + 0.3, std * 1.2, 0.01)[0], mean, vectorize=True)


def test_losses_under_a_meta_default_device(batch):
    new, old, tokens, advantages = batch
    want = tt.trust_region_loss(new, old, tokens, advantages)
    want_ppo = tt.ppo_clip_loss(new, old, tokens, advantages)
    x = new.clone().requires_grad_()
    torch.set_default_device("meta")
    try:
        got = tt.trust_region_loss(x, old, tokens.tolist(), advantages)
        got_ppo = tt.ppo_clip_loss(new, old, tokens, advantages.tolist())
        got.backward()
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu" and got_ppo.device.type == "cpu"
    assert torch.equal(got.detach(), want) and torch.equal(got_ppo, want_ppo)
    assert x.grad is not None and x.grad.device.type == "cpu"


def test_expanded_inputs_are_refused_with_the_fix():
    # A state-independent std broadcast over the batch (log_std.exp().expand_as(mean)) has row
    # stride 0: troll's views need rows apart, and the message says what to do.
    mean = torch.randn(4, 3, dtype=D)
    std = torch.rand(1, 3, dtype=D).add(0.5).expand(4, 3)
    import troll
    with pytest.raises(troll.ShapeError, match=r"row stride 0.*\.contiguous\(\)"):
        tg.project_joint_diag(mean, std, mean + 0.1, std.contiguous(), 0.01)
    old = torch.randn(1, 6, dtype=D).expand(4, 6)
    with pytest.raises(troll.ShapeError, match=r"row stride 0.*\.contiguous\(\)"):
        tt.project(torch.randn(4, 6, dtype=D), old, 0.05)
    out, _ = tg.project_joint_diag(mean, std.contiguous(), mean + 0.1, std.contiguous(), 0.01)
    assert out.shape == mean.shape


def test_loss_input_narrowing_names_row_and_code():
    gen = torch.Generator().manual_seed(9)
    new, old = oracle.make_logits(gen, 2, 3, 10, dtype=torch.float32), oracle.make_logits(gen, 2, 3, 10,
                                                                                         dtype=torch.float32)
    tokens = torch.randint(0, 10, (2, 3), generator=gen)
    adv = torch.randn(2, 3, dtype=D)
    adv[1, 1] = 1e300
    import troll
    with pytest.raises(troll.DomainError) as info:
        tt.trust_region_loss(new, old, tokens, adv)
    assert info.value.row == 4 and info.value.code == 19  # as troll's own check of an inf advantage
    mask = torch.ones(2, 3, dtype=D)
    mask[0, 2] = 1e-50
    with pytest.raises(troll.DomainError) as info:
        tt.ppo_clip_loss(new, old, tokens, torch.zeros(2, 3), mask=mask)
    assert info.value.row == 2 and info.value.code == 18


def test_stats_pair_with_rows_by_shape():
    import numpy as np
    import troll
    gen = np.random.default_rng(2)
    n, o = gen.normal(size=(2, 3, 6)), gen.normal(size=(2, 3, 6))
    wrong = troll.ProjectionStats(np.empty((3, 2, 6)), np.empty((3, 2, 2), np.int32))
    with pytest.raises(troll.ShapeError, match="stats.values has rows of shape"):
        troll.project(n, o, 0.05, stats=wrong)
    lp, st = troll.project(n, o, 0.05)
    flat = troll.ProjectionStats(st.values.reshape(6, 6), st.counters.reshape(6, 2))
    with pytest.raises(troll.ShapeError, match="stats.values has rows of shape"):
        troll.project_backward(n, o, lp, flat, np.ones_like(n))
    troll.project_backward(n, o, lp, st, np.ones_like(n))


def test_jax_without_x64_keeps_64_bit_outputs(tmp_path):
    # jax_enable_x64 is process-wide (test_frameworks.py turns it on): a fresh interpreter
    pytest.importorskip("jax")
    import subprocess
    import sys
    script = tmp_path / "nox64.py"
    script.write_text(
        "import numpy as np, jax, jax.numpy as jnp, troll\n"
        "assert not jax.config.jax_enable_x64\n"
        "n = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32) * 3)\n"
        "o = jnp.zeros((2, 3, 8), jnp.float32)\n"
        "lp, st = troll.project(n, o, 0.05)\n"
        "assert str(st.values.dtype) == 'float64', st.values.dtype\n"
        "g, _, _ = troll.project_backward(n, o, lp, st, jnp.ones_like(n))\n"
        "assert isinstance(g, jax.Array) and str(g.dtype) == 'float32'\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_sparsify_takes_a_python_int_sampled_token():
    import numpy as np
    import troll
    x = np.random.default_rng(4).normal(size=10)
    low = int(np.argsort(x)[0])  # never in the top 4
    rows = troll.sparsify(x, 4, sampled=low)
    assert low in rows.indices.tolist()
    assert rows.indices.tolist() == troll.sparsify(x, 4, sampled=np.int32(low)).indices.tolist()
    with pytest.raises(troll.DomainError) as info:
        troll.sparsify(x, 4, sampled=2**40)
    assert info.value.row == 0 and info.value.code == 17
