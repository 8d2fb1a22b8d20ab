"""What a generic consumer runs into (the Python audit, issue 12's follow-up): double backward,
integer id arrays, SparseRows as plain tuples, raw DLPack capsules, non-torch arrays given to
troll.torch, empty batches and V = 1. Each case failed (silently or with an untyped error) before
its fix; all run in well under a second."""

import os
import tempfile

import numpy as np
import pytest
import torch

import troll
import troll.torch as tt
import troll.torch.gaussian as tg

import oracle

D = torch.float64


def logits(gen, *shape):
    return oracle.make_logits(gen, *shape)


# ---- double backward: an error, never a silent zero ----


def _first_order(fn, x):
    """The gradient of fn at x with create_graph=True, and the plain one."""
    xa = x.clone().requires_grad_()
    (g_graph,) = torch.autograd.grad(fn(xa), xa, create_graph=True)
    xb = x.clone().requires_grad_()
    (g_plain,) = torch.autograd.grad(fn(xb), xb)
    return xa, g_graph, g_plain


def _losses(gen):
    old = logits(gen, 2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3), generator=gen)
    adv = torch.randn(2, 3, generator=gen, dtype=D)
    w = torch.randn(2, 3, 7, generator=gen, dtype=D)
    sparse_old = tt.sparsify(old, 3, sampled=tokens)
    return {
        "project": lambda x: (tt.project(x, old, 0.05) * w).sum(),
        "project_sparse": lambda x: tt.project_sparse(x, sparse_old, 0.05, new_k=2).log_remainder.sum(),
        "trust_region_loss": lambda x: tt.trust_region_loss(x, old, tokens, adv),
        "trust_region_loss_sparse": lambda x: tt.trust_region_loss(x, sparse_old, tokens, adv),
        "ppo_clip_loss": lambda x: tt.ppo_clip_loss(x, old, tokens, adv),
        "dppo_loss": lambda x: tt.dppo_loss(x, old, tokens, adv),
    }


@pytest.mark.parametrize("name", ["project", "project_sparse", "trust_region_loss", "trust_region_loss_sparse",
                                  "ppo_clip_loss", "dppo_loss"])
def test_double_backward_raises_and_create_graph_keeps_the_first_order(gen, name):
    fn = _losses(gen)[name]
    x, g_graph, g_plain = _first_order(fn, logits(gen, 2, 3, 7))
    torch.testing.assert_close(g_graph, g_plain, rtol=0, atol=0)
    assert g_graph.requires_grad  # tied to x: differentiating it again must not give 0 silently
    with pytest.raises(RuntimeError, match="double backward is not implemented"):
        torch.autograd.grad((g_graph * torch.randn_like(g_graph)).sum(), x)


def test_double_backward_raises_through_eps_and_old_logits(gen):
    new, old = logits(gen, 3, 6).requires_grad_(), logits(gen, 3, 6).requires_grad_()
    eps = torch.tensor(0.05, dtype=D, requires_grad=True)
    g = torch.autograd.grad((tt.project(new, old, eps) ** 2).sum(), (new, old, eps), create_graph=True)
    for gi, xi in zip(g, (new, old, eps)):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(gi.sum(), xi)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda a: tt.project(a, old.detach(), 0.05), (new,))


def test_gaussian_double_backward_raises_and_forward_mode_still_works(gen):
    m, om = torch.randn(3, 2, generator=gen, dtype=D), torch.randn(3, 2, generator=gen, dtype=D)
    s, os_ = torch.rand(3, 2, generator=gen, dtype=D) + 0.5, torch.rand(3, 2, generator=gen, dtype=D) + 0.5
    mr = m.clone().requires_grad_()
    out = tg.project_joint_diag(mr, s, om, os_, 0.01)
    (g,) = torch.autograd.grad((out[0] ** 2).sum() + out[1].sum(), mr, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), mr)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        tangent = torch.randn_like(m)
        mean_p, _ = tg.project_joint_diag(fwAD.make_dual(m, tangent), s, om, os_, 0.01)
        jvp = fwAD.unpack_dual(mean_p).tangent
    assert jvp is not None and torch.isfinite(jvp).all()


# ---- integer id arrays ----


def test_sampled_ids_outside_int32_raise_instead_of_wrapping(gen):
    x = logits(gen, 2, 5)
    bad = torch.tensor([1, 2 ** 32 + 1])  # wrapped to int32 this would be token 1
    with pytest.raises(troll.DomainError) as info:
        tt.sparsify(x, 2, sampled=bad)
    assert info.value.row == 1
    with pytest.raises(troll.DomainError):
        tt.project_sparse(x, tt.sparsify(x, 2), 0.05, sampled=bad)
    ok = tt.sparsify(x, 2, sampled=torch.tensor([1, 4]))  # int64 in range: fine
    assert ok.counts.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_non_integer_ids_raise_type_error(gen, dtype):
    x = logits(gen, 2, 5).requires_grad_()
    ids = torch.tensor([1, 0]).to(dtype)
    adv = torch.ones(2, dtype=D)
    with pytest.raises(TypeError, match="integer ids"):
        tt.sparsify(x, 2, sampled=ids)
    with pytest.raises(TypeError, match="integer ids"):
        tt.trust_region_loss(x, x.detach(), ids, adv)
    with pytest.raises(TypeError, match="integer ids"):
        tt.ppo_clip_loss(x, x.detach(), torch.tensor([1, 0]), adv, sequence_ids=ids, aggregation="sequence_mean")


def test_distributed_sampled_outside_int32_raises(gen):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs an uninitialised torch.distributed")
    path = os.path.join(tempfile.mkdtemp(), "pg")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        x = logits(gen, 2, 6)
        with pytest.raises(troll.DomainError):
            tt.distributed.sparsify(x, 0, 6, 2, sampled=torch.tensor([0, 2 ** 32 + 3]))
        rows = tt.distributed.sparsify(x.numpy(), 0, 6, 2, sampled=[0, 3])  # NumPy logits, list ids
        ref = tt.sparsify(x, 2, sampled=torch.tensor([0, 3]))
        for a, b in zip(rows[:4], ref[:4]):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


# ---- SparseRows as plain tuples ----


def test_plain_tuples_are_sparse_rows(gen):
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    tokens = torch.tensor([0, 1, 2])
    rows = tt.sparsify(old, 3, sampled=tokens)
    for as_seq in (tuple, list):
        plain = as_seq(rows)
        got = tt.project_sparse(new, plain, 0.05)
        want = tt.project_sparse(new, rows, 0.05)
        assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
        assert tt.trust_region_loss(new, plain, tokens, torch.ones(3, dtype=D)).item() == pytest.approx(
            tt.trust_region_loss(new, rows, tokens, torch.ones(3, dtype=D)).item(), rel=0, abs=0)
        aligned = troll.align(new, plain, new_support=as_seq(rows))
        assert torch.equal(aligned.counts, troll.align(new, rows, new_support=rows).counts)


# ---- raw DLPack capsules and non-torch arrays ----


def test_dlpack_capsules_are_arrays(gen):
    p, q = logits(gen, 2, 3, 6), logits(gen, 2, 3, 6)
    got = troll.kl(p.__dlpack__(), torch.utils.dlpack.to_dlpack(q))  # versioned / legacy capsules
    assert isinstance(got, np.ndarray) and got.shape == (2, 3)
    np.testing.assert_allclose(got, oracle.kl(p, q).numpy(), rtol=1e-12, atol=1e-14)
    lp, stats = troll.project(p.__dlpack__(), q.__dlpack__(), 0.05)
    np.testing.assert_array_equal(lp, troll.project(p, q, 0.05)[0].numpy())  # the same call on the tensors
    assert isinstance(stats.t, np.ndarray)
    g = troll.sparsify_backward(p.__dlpack__(), troll.sparsify(p, 2),
                                (torch.ones(2, 3, 2, dtype=D).__dlpack__(), torch.ones(2, 3, dtype=D).__dlpack__()))
    assert g.shape == (2, 3, 6)
    m = torch.randn(4, 2, generator=gen, dtype=D)
    s = torch.ones(4, 2, dtype=D)
    np.testing.assert_allclose(troll.gaussian.kl_diag(m.__dlpack__(), s.__dlpack__(), m, s), 0.0, atol=1e-15)


def test_bad_capsules_raise_type_error(gen):
    p = logits(gen, 2, 6)
    cap = p.__dlpack__()
    troll.kl(cap, p)
    with pytest.raises(TypeError, match="consumed"):
        troll.kl(cap, p)
    with pytest.raises(TypeError):
        troll.kl(p.float().bfloat16().__dlpack__(), p)


def test_troll_torch_takes_numpy_and_capsules_and_rejects_lists(gen):
    new, old = logits(gen, 3, 6), logits(gen, 3, 6)
    want = tt.project(new, old, 0.05)
    assert torch.equal(tt.project(new.numpy(), old.numpy(), 0.05), want)
    assert torch.equal(tt.project(new.__dlpack__(), old.__dlpack__(), 0.05), want)
    read_only = old.numpy().copy()
    read_only.setflags(write=False)
    x = new.clone().requires_grad_()
    tt.project(x, read_only, 0.05).sum().backward()  # the tensor input still gets its gradient
    assert x.grad is not None and torch.isfinite(x.grad).all()
    tokens, adv = np.array([0, 1, 2]), np.ones(3)
    assert torch.isfinite(tt.ppo_clip_loss(new, old.numpy(), tokens, adv))
    assert torch.isfinite(tt.trust_region_loss(new, old.numpy(), tokens, adv))
    with pytest.raises(TypeError, match="torch tensor"):
        tt.project(new.tolist(), old, 0.05)


# ---- empty batches, V = 1, dtypes ----


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5), (3, 1), (1,), (4, 1, 1)])
def test_empty_batches_and_one_token_rows(gen, shape):
    new = logits(gen, *shape).requires_grad_()
    old = logits(gen, *shape)
    lp = tt.project(new, old, 0.05)
    assert lp.shape == new.shape and lp.dtype == D
    if shape[-1] == 1 and lp.numel():
        assert torch.equal(lp, torch.zeros_like(lp))  # one token: probability 1
    lp.sum().backward()
    assert new.grad.shape == new.shape and not new.grad.abs().sum()
    rows = shape[:-1]
    tokens = torch.zeros(rows, dtype=torch.long)
    adv = torch.ones(rows, dtype=D)
    for loss in (tt.trust_region_loss(new, old, tokens, adv), tt.ppo_clip_loss(new, old, tokens, adv),
                 tt.trust_region_loss(new, tt.sparsify(old, 3, sampled=tokens), tokens, adv)):
        assert loss.shape == () and loss.dtype == D and torch.isfinite(loss)
    assert troll.kl(new.detach(), old).shape == rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_unsupported_dtypes_raise_type_error(gen, dtype):
    x = logits(gen, 2, 5).to(dtype)
    for call in (lambda: troll.kl(x, x), lambda: tt.project(x, x, 0.05), lambda: tt.sparsify(x, 2)):
        with pytest.raises(TypeError):
            call()


# ---- bounds: a number or a one-element array, else ShapeError ----


def test_bounds_take_one_element_arrays_and_reject_per_row_ones(gen):
    new, old = logits(gen, 3, 6), logits(gen, 3, 6)
    want = troll.project(new, old, 0.05)[0]
    for eps in (np.float32(0.05), np.array([0.05]), torch.tensor(0.05), torch.tensor([[0.05]], dtype=D)):
        torch.testing.assert_close(troll.project(new, old, eps)[0], want, rtol=1e-6, atol=1e-7)
    tokens, adv = torch.tensor([0, 1, 2]), torch.ones(3, dtype=D)
    for per_row in (torch.full((3,), 0.05), np.full(3, 0.05)):
        with pytest.raises(troll.ShapeError, match="one bound"):
            troll.project(new, old, per_row)
        with pytest.raises(troll.ShapeError, match="one bound"):
            troll.project_sparse(troll.align(new, troll.sparsify(old, 2)), per_row)
        with pytest.raises(troll.ShapeError, match="one bound"):
            tt.trust_region_loss(new, old, tokens, adv, eps=per_row)
        m, s = torch.zeros(3, 2, dtype=D), torch.ones(3, 2, dtype=D)
        with pytest.raises(troll.ShapeError, match="one bound"):
            troll.gaussian.project_joint_diag(m, s, m, s, per_row)


# ---- torch tensors DLPack cannot carry: a typed error, not garbage or nanobind's TypeError ----


def test_tensors_dlpack_cannot_carry_raise_shape_error(gen):
    x = logits(gen, 3, 6)
    cases = {
        "meta": torch.empty(3, 6, dtype=D, device="meta"),
        "sparse": x.to_sparse(),
        "negated view": torch._neg_view(x),  # DLPack would export the stored, un-negated values
    }
    for name, bad in cases.items():
        with pytest.raises(troll.ShapeError):
            troll.kl(bad, x)
        with pytest.raises(troll.ShapeError):
            troll.kl(x, bad)
        with pytest.raises(troll.ShapeError):
            tt.project(bad, x, 0.05)
    np.testing.assert_allclose(troll.kl(torch._neg_view(x).resolve_neg(), x), oracle.kl(-x, x), rtol=1e-12)


# ---- no reference cycles: a call's graph (new logits included) dies with its outputs ----


def _dies(make_output, x):
    import gc
    import weakref

    leaf = x.clone().requires_grad_()
    out = make_output(leaf)
    refs = [weakref.ref(leaf)] + [weakref.ref(t) for t in (out if isinstance(out, tuple) else (out,))
                                  if isinstance(t, torch.Tensor)]
    del leaf, out
    gc.collect()
    return all(r() is None for r in refs)


def test_outputs_hold_no_reference_cycles(gen):
    x, old = logits(gen, 4, 30), logits(gen, 4, 30)
    tokens, adv = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=D)
    sparse_old = tt.sparsify(old, 3, sampled=tokens)
    m, s = torch.randn(4, 3, generator=gen, dtype=D), torch.ones(4, 3, dtype=D)
    factor = torch.eye(3, dtype=D).expand(4, 3, 3).contiguous()
    calls = {
        "project": lambda n: tt.project(n, old, 0.05),
        # held its outputs on ctx: every call leaked its whole graph
        "project_sparse": lambda n: tuple(tt.project_sparse(n, sparse_old, 0.05, new_k=3)[:4]),
        "trust_region_loss": lambda n: tt.trust_region_loss(n, sparse_old, tokens, adv),
        "ppo_clip_loss": lambda n: tt.ppo_clip_loss(n, old, tokens, adv),
        "gaussian": lambda n: tg.project_joint(n[:, :3], factor, m, 2 * factor, 0.01),
        "gaussian_diag": lambda n: tg.project_joint_diag(n[:, :3], s, m, 2 * s, 0.01),
    }
    leaking = [name for name, call in calls.items() if not _dies(call, x)]
    assert not leaking


def test_in_place_edits_of_sparse_outputs_are_detected(gen):
    x, old = logits(gen, 3, 20).requires_grad_(), logits(gen, 3, 20)
    rows = tt.project_sparse(x, tt.sparsify(old, 3), 0.05, new_k=3)
    rows.log_probs.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        rows.log_probs.sum().backward()


# ---- the keyword names docs/python.md's tables give ----


def test_documented_keyword_arguments(gen):
    new, old = logits(gen, 2, 8), logits(gen, 2, 8)
    tokens = torch.tensor([1, 2])
    adv = torch.ones(2, dtype=D)
    troll.kl(p_logits=new, q_logits=old, out=torch.empty(2, dtype=D))
    troll.log_softmax(logits=new, out=torch.empty(2, 8, dtype=D))
    troll.kl_backward(p_logits=new, q_logits=old, grad_kl=adv)
    lp, st = troll.project(new_logits=new, old_logits=old, eps=0.05, out=None, stats=None, rtol=1e-12, atol=1e-15,
                           max_iterations=50)
    troll.project_backward(new_logits=new, old_logits=old, log_probs=lp, stats=st, grad_log_probs=torch.ones_like(lp),
                           old=True, eps=True)
    rows = troll.sparsify(logits=old, k=3, delta=1e-5, sampled=tokens.int())
    aligned = troll.align(new_logits=new, old=rows, new_support=None)
    out, st2 = troll.project_sparse(rows=aligned, eps=0.05)
    troll.kl_sparse(rows=aligned)
    grad = (torch.ones_like(out.log_probs), torch.ones_like(out.log_remainder))
    g_new, _, _ = troll.project_sparse_backward(rows=aligned, log_probs=out, stats=st2, grad=grad, old=True, eps=True)
    troll.sparsify_backward(logits=new, support=aligned.new_side(), grad=g_new)
    states = np.stack([troll.sparsify_shard(shard_logits=old[:, :5].numpy(), vocab_offset=0, vocab=8, k=3, delta=1e-5,
                                            sampled=tokens.int().numpy()),
                       troll.sparsify_shard(shard_logits=old[:, 5:].numpy(), vocab_offset=5, vocab=8, k=3, delta=1e-5,
                                            sampled=tokens.int().numpy())])
    rows1, _, tail_max = troll.sparsify_finalize(states=states, vocab=8, k=3, delta=1e-5, sampled=True,
                                                 dtype="float64", return_tail_max=True)
    sums = np.stack([troll.sparsify_tail_sums(shard_logits=old[:, :5].numpy(), vocab_offset=0, rows=rows1,
                                              tail_max=tail_max),
                     troll.sparsify_tail_sums(shard_logits=old[:, 5:].numpy(), vocab_offset=5, rows=rows1,
                                              tail_max=tail_max)])
    rows2, log_sums = troll.sparsify_finalize(states=states, vocab=8, k=3, delta=1e-5, sampled=True, dtype="float64",
                                              tail_sums=sums)
    for a, b in zip(rows2[:4], rows[:4]):
        np.testing.assert_array_equal(a, b.numpy())
    troll.sparsify_shard_backward(shard_logits=old[:, 5:].numpy(), vocab_offset=5, support=rows2,
                                  grad=(np.ones(rows2.log_probs.shape), np.ones(2)), log_sums=log_sums)
    x = new.clone().requires_grad_()
    tt.project(new_logits=x, old_logits=old, eps=0.05, return_stats=True)
    tt.sparsify(logits=old, k=3, delta=1e-5, sampled=tokens)
    tt.project_sparse(new_logits=x, old_sparse=rows, eps=0.05, sampled=tokens, new_k=2, new_delta=1e-5)
    tt.trust_region_loss(new_logits=x, old=rows, tokens=tokens, advantages=adv, eps=0.05, alpha=1.0, mask=None,
                         sequence_ids=torch.tensor([0, 1]), aggregation="sequence_mean", new_k=2, new_delta=1e-5,
                         return_metrics=True)
    tt.ppo_clip_loss(new_logits=x, old_logits=old, tokens=tokens, advantages=adv, clip_low=0.2, clip_high=0.2,
                     dual_clip=3.0, mask=torch.ones(2), return_metrics=True)
    tt.dppo_loss(new_logits=x, old_logits=old, tokens=tokens, advantages=adv, divergence="topk_kl", delta_low=0.05,
                 delta_high=0.05, top_k=3, mask=None, return_metrics=True)
    m, s = torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D)
    factor = torch.eye(3, dtype=D).expand(2, 3, 3).contiguous()
    troll.gaussian.project_joint(mean=m, cov_chol=factor, old_mean=m + 1, old_cov_chol=factor, eps=0.05)
    troll.gaussian.project_split(mean=m, cov_chol=factor, old_mean=m + 1, old_cov_chol=factor, eps_mean=0.05,
                                 eps_cov=0.05)
    troll.gaussian.project_joint_diag(mean=m, std=s, old_mean=m + 1, old_std=s, eps=0.05)
    troll.gaussian.project_split_diag(mean=m, std=s, old_mean=m + 1, old_std=s, eps_mean=0.05, eps_cov=0.05)
    troll.gaussian.kl(mean=m, cov_chol=factor, old_mean=m, old_cov_chol=factor)
    troll.gaussian.kl_diag(mean=m, std=s, old_mean=m, old_std=s)
    tg.project_split_diag(mean=m, std=s, old_mean=m + 1, old_std=s, eps_mean=0.05, eps_cov=0.05, return_stats=True)


def test_numpy_masked_arrays_raise_type_error(gen):
    x = logits(gen, 2, 5).numpy()
    with pytest.raises(TypeError, match="masked"):
        troll.kl(np.ma.masked_array(x, mask=x > 0), x)
    np.testing.assert_allclose(troll.kl(np.ma.filled(np.ma.masked_array(x, mask=x > 3), -np.inf), x),
                               troll.kl(np.where(x > 3, -np.inf, x), x))


# ---- out= / stats= buffers troll must not write ----


def test_out_buffers_troll_must_not_write_raise_type_error(gen):
    p, q = logits(gen, 3, 6), logits(gen, 3, 6)
    read_only = np.zeros(3)
    read_only.setflags(write=False)
    for bad in (read_only, torch.zeros(3, dtype=D, requires_grad=True)):
        with pytest.raises(TypeError):
            troll.kl(p, q, out=bad)
        assert not np.asarray(bad.detach() if isinstance(bad, torch.Tensor) else bad).any()  # untouched
    stats = troll.ProjectionStats(torch.zeros(3, 6, dtype=D, requires_grad=True), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(TypeError):
        troll.project(p, q, 0.05, stats=stats)
    m, s = torch.zeros(3, 2, dtype=D), torch.ones(3, 2, dtype=D)
    with pytest.raises(TypeError):
        troll.gaussian.project_joint_diag(m, s, m + 1, s, 0.05, out=(np.broadcast_to(read_only[:, None], (3, 2)),
                                                                   s.numpy().copy()))


def test_jax_arrays_are_not_written():
    jnp = pytest.importorskip("jax.numpy")
    p = jnp.asarray(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(2, 6))
    q = jnp.asarray(np.linspace(1.0, -1.0, 12, dtype=np.float32).reshape(2, 6))
    buffer = jnp.zeros(2, dtype=jnp.float32)
    with pytest.raises(TypeError, match="immutable"):
        troll.kl(p, q, out=buffer)
    assert not np.asarray(buffer).any()


# ---- CUDA arrays of other frameworks (JAX on a GPU, ...): outputs on their device ----


def test_other_frameworks_cuda_arrays_get_device_outputs(monkeypatch):
    """Outputs of a CUDA array from a framework troll does not allocate in (here the fake of
    test_cuda_host_errors) were host NumPy buffers, which the CUDA module rejected ("out ... is not
    in CUDA device memory" for an out= nobody passed). Now they are device buffers: with a
    stand-in allocator making fake device arrays, every check passes and the call reaches the
    CUDA runtime, which (without a GPU) fails as BackendError."""
    from test_cuda_host_errors import _FLOAT, _INT, FakeCudaArray, cuda

    if cuda is None or cuda.device_count() > 0:
        pytest.skip("needs the CUDA extension and no GPU (the fake arrays hold host memory)")
    kinds = {"float32": (_FLOAT, 32), "float64": (_FLOAT, 64), "int32": (_INT, 32)}
    made = []

    def fake_empty(shape, dtype, device, framework):
        assert device == 0 and framework == "test_cuda_host_errors"
        made.append(FakeCudaArray(shape, *kinds[dtype]))
        return made[-1]

    monkeypatch.setattr(troll._arrays, "_cuda_empty", fake_empty)
    with pytest.raises(troll.BackendError):
        troll.kl(FakeCudaArray((3, 10)), FakeCudaArray((3, 10)))
    with pytest.raises(troll.BackendError):
        troll.project(FakeCudaArray((3, 10)), FakeCudaArray((3, 10)), 0.05)
    assert len(made) == 1 + 3  # kl's out; project's log-probs and two stats buffers


# ---- a mismatched element type is both a ShapeError (as documented) and a TypeError ----


def test_mismatched_dtypes_raise_dtype_error(gen):
    p = logits(gen, 3, 6)
    calls = [lambda: troll.kl(p, p.float()),
             lambda: troll.project(p, p.float(), 0.05),
             lambda: tt.project(p.float(), p, 0.05),
             lambda: troll.kl(p, p, out=torch.empty(3)),
             lambda: troll.sparsify(p, 2, sampled=torch.zeros(3, dtype=torch.int64)),
             lambda: tt.trust_region_loss(p, tt.sparsify(p.float(), 2, sampled=torch.zeros(3, dtype=torch.long)),
                                          torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=D))]
    for call in calls:
        with pytest.raises(troll.DTypeError) as info:
            call()
        assert isinstance(info.value, troll.ShapeError) and isinstance(info.value, TypeError)
        assert "dtype" in str(info.value)


def test_stats_buffers_overlapping_the_call_raise_shape_error(gen):
    p, q = logits(gen, 4, 12), logits(gen, 4, 12)
    counters = torch.zeros(4, 2, dtype=torch.int32)
    for values, name in ((p[:, :6], "new_logits"), (q[:, 6:], "old_logits")):
        before = (p.clone(), q.clone())
        with pytest.raises(troll.ShapeError, match=f"stats.values overlaps {name}"):
            troll.project(p, q, 0.05, stats=troll.ProjectionStats(values, counters))
        assert torch.equal(before[0], p) and torch.equal(before[1], q)
    out = torch.empty(4, 12, dtype=D)
    with pytest.raises(troll.ShapeError, match="overlaps out"):
        troll.project(p, q, 0.05, out=out, stats=troll.ProjectionStats(out[:, 6:], counters))
    shared = torch.zeros(4 * 7, dtype=D)
    with pytest.raises(troll.ShapeError, match="stats.values overlaps stats.counters"):
        troll.project(p, q, 0.05, stats=troll.ProjectionStats(shared[:24].view(4, 6),
                                                              shared[20:].view(torch.int32).view(4, 4)[:, :2]))


def test_gaussian_stats_buffers_overlapping_the_call_raise_shape_error():
    import troll.gaussian as gauss
    rows, d = 3, 8
    mean, old_mean = torch.randn(rows, d, dtype=D), torch.randn(rows, d, dtype=D)
    std, old_std = torch.rand(rows, d, dtype=D) + 0.5, torch.rand(rows, d, dtype=D) + 0.5
    counters = torch.zeros(rows, 2, dtype=torch.int32)
    before = (mean.clone(), std.clone())
    for values, name in ((mean, "mean"), (std, "std|cov")):
        with pytest.raises(troll.ShapeError, match=f"stats.values overlaps ({name})"):
            gauss.project_joint_diag(mean, std, old_mean, old_std, 0.01,
                                     stats=gauss.GaussianStats(values, counters))
    assert torch.equal(before[0], mean) and torch.equal(before[1], std)
    out_mean, out_std = torch.empty(rows, d, dtype=D), torch.empty(rows, d, dtype=D)
    with pytest.raises(troll.ShapeError, match="stats.values overlaps out_mean"):
        gauss.project_joint_diag(mean, std, old_mean, old_std, 0.01, out=(out_mean, out_std),
                                 stats=gauss.GaussianStats(out_mean, counters))


# ---- counts given as non-integers: an error, not a silent int() ----


@pytest.mark.parametrize("bad", [10.5, 8.0, True, "8"])
def test_non_integer_vocab_and_k_raise_shape_error(gen, bad):
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    rows = troll.sparsify(old, 3)
    broken = troll.SparseRows(*rows[:4], bad)
    with pytest.raises(troll.ShapeError, match="vocab must be an integer"):
        troll.align(new, broken)
    with pytest.raises(troll.ShapeError, match="vocab must be an integer"):
        tt.project_sparse(new, broken, 0.05)
    with pytest.raises(troll.ShapeError, match="k must be an integer"):
        troll.sparsify(old, bad)
    states = troll.sparsify_shard(old, 0, 8, k=3)
    with pytest.raises(troll.ShapeError, match="vocab must be an integer"):
        troll.sparsify_finalize(states[None], bad, k=3)


def test_integer_like_vocab_and_k_are_accepted(gen):
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    rows = troll.sparsify(old, np.int64(3))
    want = troll.align(new, rows)
    for vocab in (np.int32(8), torch.tensor(8)):
        got = troll.align(new, troll.SparseRows(*rows[:4], vocab))
        assert torch.equal(got.counts, want.counts) and torch.equal(got.new_log_probs, want.new_log_probs)


# ---- bounds as one-element arrays of any framework; stats edited before the backward ----


@pytest.mark.parametrize("make", [lambda v: np.array([v]), lambda v: np.array(v), lambda v: torch.tensor([v], dtype=D),
                                  lambda v: v])
def test_bounds_as_one_element_arrays_everywhere(gen, make):
    # docs/python.md: eps is "a number or a one-element array of any framework"; troll.torch's
    # projections took NumPy's shape-(1,) arrays through float(), which NumPy 2 refuses.
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    want = troll.project(new, old, 0.05)[0]
    assert torch.equal(tt.project(new, old, make(0.05)), want)
    rows = tt.sparsify(old, k=3)
    assert torch.equal(tt.project_sparse(new, rows, make(0.05)).log_probs,
                       tt.project_sparse(new, rows, 0.05).log_probs)
    mean, std = torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D)
    got = tg.project_joint_diag(mean + 1, std * 2, mean, std, make(0.01))
    ref = tg.project_joint_diag(mean + 1, std * 2, mean, std, 0.01)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_bounds_with_more_elements_raise_shape_error(gen):
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    for bad in (np.array([0.05, 0.05]), torch.tensor([0.05, 0.05])):
        with pytest.raises(troll.ShapeError, match="eps"):
            tt.project(new, old, bad)
        with pytest.raises(troll.ShapeError, match="eps"):
            tt.project_sparse(new, tt.sparsify(old, k=3), bad)


def test_sparse_stats_edited_in_place_before_backward_raise(gen):
    # The sparse projection kept its stats on ctx: scaling the returned t by 0.9 changed the
    # gradient by 10% without an error. They are saved tensors now, as the dense projection's.
    new, old = logits(gen, 3, 8), logits(gen, 3, 8)
    for project in (lambda x: tt.project_sparse(x, tt.sparsify(old, k=3), 0.05, return_stats=True),
                    lambda x: tt.project(x, old, 0.05, return_stats=True)):
        x = new.clone().requires_grad_()
        out, stats = project(x)
        log_probs = out.log_probs if isinstance(out, troll.SparseRows) else out
        loss = (log_probs.nan_to_num(neginf=0.0) * torch.arange(log_probs.shape[-1], dtype=D)).sum()
        stats.t.mul_(0.9)
        with pytest.raises(RuntimeError, match="inplace"):
            loss.backward()


# ---- integer options: the same error everywhere (the twenty-seventh session's Python audit) ----


def test_loss_integer_options_raise_instead_of_truncating(gen):
    """new_k / top_k of 2.9 or True ran as 2 / 1 in the losses, where sparsify and project_sparse
    raise ShapeError for the same values."""
    old = logits(gen, 4, 9)
    new = logits(gen, 4, 9)
    tokens = torch.randint(0, 9, (4,), generator=gen)
    adv = torch.randn(4, generator=gen, dtype=D)
    sparse_old = tt.sparsify(old, 4, sampled=tokens)
    for bad in (2.9, True, 2.0):
        with pytest.raises(troll.ShapeError, match="new_k must be an integer"):
            tt.trust_region_loss(new, sparse_old, tokens, adv, new_k=bad)
        with pytest.raises(troll.ShapeError, match="top_k must be an integer"):
            tt.dppo_loss(new, old, tokens, adv, "topk_kl", top_k=bad)
    # NumPy and 0-d tensor integers are integers.
    a = tt.trust_region_loss(new, sparse_old, tokens, adv, new_k=np.int64(3))
    b = tt.trust_region_loss(new, sparse_old, tokens, adv, new_k=torch.tensor(3))
    assert torch.equal(a, b)


def test_threads_must_be_a_non_negative_integer(gen):
    """threads=-1 raised nanobind's TypeError with the whole signature; now a troll error naming it."""
    z, o = logits(gen, 3, 6), logits(gen, 3, 6)
    tokens = torch.randint(0, 6, (3,), generator=gen)
    adv = torch.randn(3, generator=gen, dtype=D)
    for call in (lambda t: troll.project(z.numpy(), o.numpy(), 0.05, threads=t),
                 lambda t: tt.project(z, o, 0.05, threads=t),
                 lambda t: tt.ppo_clip_loss(z, o, tokens, adv, threads=t),
                 lambda t: troll.kl(z.numpy(), o.numpy(), threads=t)):
        with pytest.raises(troll.DomainError, match="threads must be >= 0"):
            call(-1)
        with pytest.raises(troll.DomainError, match="threads must be >= 0"):
            call(2**40)
        with pytest.raises(troll.ShapeError, match="threads must be an integer"):
            call(1.5)
        call(1)
        call(np.int32(2))


def test_negative_or_huge_sizes_and_counts_are_troll_errors():
    """A negative vocab_offset / vocab raised nanobind's TypeError (sparsify_finalize: C++'s
    std::bad_cast as a RuntimeError), a k beyond the C int a TypeError; now troll's classes."""
    x = np.zeros((2, 10), np.float32)
    for kw in (dict(vocab_offset=-1, vocab=10), dict(vocab_offset=0, vocab=-10), dict(vocab_offset=2**70, vocab=10)):
        with pytest.raises(troll.ShapeError, match="must be an integer in"):
            troll.sparsify_shard(x, k=4, **kw)
    states = troll.sparsify_shard(x, 0, 10, k=4)
    with pytest.raises(troll.ShapeError, match="vocab must be an integer in"):
        troll.sparsify_finalize(states[None], -3, 4)
    for k in (2**40, -2**40):
        with pytest.raises(troll.DomainError, match=r"k must be in \[1, 256\]"):
            troll.sparsify(x, k=k)
        with pytest.raises(troll.DomainError, match=r"k must be in \[1, 256\]"):
            troll.sparsify_shard(x, 0, 10, k=k)
    with pytest.raises(troll.DomainError, match=r"k must be in \[1, 256\]"):
        troll.sparsify(x, k=-4)  # in the int range: troll's own check, as before


# ---- the thirty-first session's Python audit ----


def test_stats_buffers_whose_rows_overlap_raise_shape_error(gen):
    """An expanded (row stride 0) or as_strided stats= buffer was accepted: every row's stats
    landed in the same memory (the last row's winning) and a backward from them was wrong."""
    import troll.gaussian as gauss
    n, o = logits(gen, 4, 8), logits(gen, 4, 8)
    expanded = troll.ProjectionStats(torch.zeros(6, dtype=D).expand(4, 6),
                                     torch.zeros(2, dtype=torch.int32).expand(4, 2))
    with pytest.raises(troll.ShapeError, match="stats.values has row stride 0"):
        troll.project(n, o, 0.05, stats=expanded)
    strided = troll.ProjectionStats(torch.zeros(30, dtype=D).as_strided((4, 6), (3, 1)),
                                    torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(troll.ShapeError, match="stats.values has row stride 3"):
        troll.project(n, o, 0.05, stats=strided)
    counters = troll.ProjectionStats(torch.zeros(4, 6, dtype=D), torch.zeros(2, dtype=torch.int32).expand(4, 2))
    with pytest.raises(troll.ShapeError, match="stats.counters has row stride 0"):
        troll.project(n, o, 0.05, stats=counters)
    # Padded rows are fine (stride above the width).
    padded = troll.ProjectionStats(torch.zeros(4, 9, dtype=D)[:, :6], torch.zeros(4, 3, dtype=torch.int32)[:, :2])
    _, st = troll.project(n, o, 0.05, stats=padded)
    _, want = troll.project(n, o, 0.05)
    assert np.array_equal(np.asarray(st.t), np.asarray(want.t))
    rows, d = 3, 4
    mean, old_mean = torch.randn(rows, d, dtype=D), torch.randn(rows, d, dtype=D)
    std, old_std = torch.rand(rows, d, dtype=D) + 0.5, torch.rand(rows, d, dtype=D) + 0.5
    values = torch.zeros(8, dtype=D).expand(rows, 8)
    with pytest.raises(troll.ShapeError, match="stats.values has row stride 0"):
        gauss.project_joint_diag(mean, std, old_mean, old_std, 0.01,
                                 stats=gauss.GaussianStats(values, torch.zeros(rows, 2, dtype=torch.int32)))


def test_negative_new_k_is_a_domain_error(gen):
    """new_k = -5 reached torch as a negative buffer dimension (RuntimeError) in the sparse loss,
    and project_sparse ran it as 0 silently."""
    old, new = logits(gen, 2, 3, 10), logits(gen, 2, 3, 10)
    tokens = torch.randint(0, 10, (2, 3), generator=gen)
    adv = torch.randn(2, 3, generator=gen, dtype=D)
    sparse_old = tt.sparsify(old, 1, sampled=tokens)
    for bad in (-1, -5):
        with pytest.raises(troll.DomainError, match=r"new_k must be in \[0, 256\]"):
            tt.trust_region_loss(new, sparse_old, tokens, adv, new_k=bad)
        with pytest.raises(troll.DomainError, match=r"new_k must be in \[0, 256\]"):
            tt.project_sparse(new, sparse_old, 0.05, new_k=bad)
    tt.project_sparse(new, sparse_old, 0.05, new_k=0)  # U = S_old: valid


def test_out_buffers_written_by_troll_are_seen_by_autograd(gen):
    """troll writing into a tensor autograd saved (through a .detach() view) changed the saved
    values behind its back: x.grad came out wrong without an error. troll now bumps the buffer's
    version as an in-place op would, so that backward raises."""
    n, o = logits(gen, 3, 6), logits(gen, 3, 6)
    x = torch.randn(3, 6, dtype=D, requires_grad=True)
    y = x.exp()  # exp saves its output for the backward
    troll.project(n, o, 0.05, out=y.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with torch.inference_mode():  # inference tensors have no version counter: still written
        buf = torch.empty(3, 6, dtype=D)
        troll.project(n, o, 0.05, out=buf)
    assert torch.isfinite(buf).all()


def test_bounds_must_be_real_numbers(gen):
    """eps=True ran as 1.0 and eps='0.05' as 0.05 (float() of anything); a bound is a real number
    (a Python, NumPy or one-element array's) or a tensor for its gradient."""
    n, o = logits(gen, 2, 5), logits(gen, 2, 5)
    for bad in (True, "0.05", b"0.05", 0.05j, np.bool_(True), torch.tensor(True)):
        with pytest.raises(troll.ShapeError, match="eps must be a real number"):
            troll.project(n, o, bad)
    want = troll.project(n, o, 0.05)[0]
    for good in (0.05, np.float32(0.05), np.float64(0.05), torch.tensor(0.05, dtype=D), np.array([0.05])):
        got = troll.project(n, o, good)[0]
        assert torch.allclose(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want)), rtol=1e-6, atol=0)
    assert troll.project(n, o, 1)[0] is not None  # an integer bound is a real number


# ---- the thirty-second session: the rest of the thirty-first session's Python audit ----


def test_per_row_arrays_must_have_the_rows_shape(gen):
    """Per-row arrays pair with the rows in flattened order; they were checked by count alone, so a
    (3, 2) grad_kl for rows of shape (2, 3), or flattened sampled tokens, ran paired wrongly."""
    p, q = logits(gen, 2, 3, 7), logits(gen, 2, 3, 7)
    g = torch.randn(2, 3, generator=gen, dtype=D)
    for bad in (g.reshape(3, 2), g.reshape(6), g.reshape(2, 3, 1)):
        with pytest.raises(troll.ShapeError, match=r"grad_kl has shape .* one entry per row of p_logits"):
            troll.kl_backward(p, q, bad)
    troll.kl_backward(p, q, g)  # the rows' own shape
    ids = torch.randint(0, 7, (2, 3), generator=gen, dtype=torch.int32)
    with pytest.raises(troll.ShapeError, match="sampled has shape"):
        troll.sparsify(p, 2, sampled=ids.reshape(6))
    rows = troll.sparsify(p, 2, sampled=ids)
    flat_counts = troll.SparseRows(rows.indices, rows.log_probs, rows.counts.reshape(3, 2), rows.log_remainder,
                                   rows.vocab)
    with pytest.raises(troll.ShapeError, match=r"old.counts has shape \(3, 2\)"):
        troll.align(q, flat_counts)
    aligned = troll.align(q, rows)
    with pytest.raises(troll.ShapeError, match="rows.new_log_remainder has shape"):
        troll.kl_sparse(aligned._replace(new_log_remainder=aligned.new_log_remainder.reshape(6)))
    # One row: a 0-d per-row array, as the rows' shape () says.
    one = troll.kl_backward(p[0, 0], q[0, 0], torch.tensor(1.0, dtype=D))
    assert one[0].shape == (7,)
    with pytest.raises(troll.ShapeError, match="grad_kl has shape"):
        troll.kl_backward(p[0, 0], q[0, 0], torch.ones(1, dtype=D))


def test_solver_settings_must_be_numbers_of_their_kind(gen):
    """max_iterations=True ran as 1 iteration and rtol=True as 1.0 (nanobind converts bools), and
    max_iterations=2.5 was a TypeError listing the whole signature."""
    import troll.gaussian as gauss
    n, o = logits(gen, 2, 5), logits(gen, 2, 5)
    for kwargs, name in (({"max_iterations": True}, "max_iterations"), ({"max_iterations": 2.5}, "max_iterations"),
                         ({"rtol": True}, "rtol"), ({"atol": "0"}, "atol"), ({"rtol": np.bool_(False)}, "rtol")):
        with pytest.raises(troll.ShapeError, match=name):
            troll.project(n, o, 0.05, **kwargs)
        with pytest.raises(troll.ShapeError, match=name):
            tt.project(n, o, 0.05, **kwargs)
    with pytest.raises(troll.DomainError, match="max_iterations"):
        troll.project(n, o, 0.05, max_iterations=2**40)
    with pytest.raises(troll.DomainError, match="max_iterations >= 1"):
        troll.project(n, o, 0.05, max_iterations=0)  # troll's own range check, as before
    got = troll.project(n, o, 0.05, max_iterations=np.int64(50), rtol=np.float64(1e-11), atol=0)[0]
    assert torch.equal(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(troll.project(n, o, 0.05)[0])))
    with pytest.raises(troll.ShapeError, match="delta"):
        troll.sparsify(n, 2, delta=True)
    mean, std = torch.randn(2, 3, dtype=D), torch.rand(2, 3, dtype=D) + 0.5
    with pytest.raises(troll.ShapeError, match="max_iterations"):
        gauss.project_joint_diag(mean, std, mean, std, 0.01, max_iterations=True)


def test_project_sparse_checks_new_delta_without_a_new_prefix(gen):
    """new_k = 0 skipped the sparsify of the new row, and with it the only check of new_delta:
    new_delta = 1.5 (or True) ran without a word, where the sparse losses refuse it."""
    old, new = logits(gen, 2, 10), logits(gen, 2, 10)
    sparse_old = tt.sparsify(old, 3)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(troll.DomainError, match=r"new_delta must be in \[0, 1\)"):
            tt.project_sparse(new, sparse_old, 0.05, new_k=0, new_delta=bad)
    with pytest.raises(troll.ShapeError, match="new_delta"):
        tt.project_sparse(new, sparse_old, 0.05, new_k=0, new_delta=True)
    tt.project_sparse(new, sparse_old, 0.05, new_k=0, new_delta=0.0)


def test_loss_inputs_that_do_not_fit_the_logits_dtype_are_named(gen):
    """A float64 advantage of 1e39 with float32 logits became inf in the cast to the logits' dtype
    and was then refused as an infinite input, or ran; the cast is now checked and named."""
    new, old = logits(gen, 2, 3, 8).float(), logits(gen, 2, 3, 8).float()
    tokens = torch.randint(0, 8, (2, 3), generator=gen)
    adv = torch.randn(2, 3, generator=gen, dtype=D)
    adv[1, 2] = 1e39
    with pytest.raises(troll.DomainError, match=r"advantages entry 5 \(= 1e\+39\) does not fit"):
        tt.ppo_clip_loss(new, old, tokens, adv)
    with pytest.raises(troll.DomainError, match="advantages entry 5"):
        tt.trust_region_loss(new, tt.sparsify(old, 4, sampled=tokens), tokens, adv)
    with pytest.raises(TypeError, match="a real dtype"):
        tt.ppo_clip_loss(new, old, tokens, adv.to(torch.complex128))
    adv[1, 2] = 1.0
    tt.ppo_clip_loss(new, old, tokens, adv)  # float64 advantages that fit: converted, as before


def test_out_may_interleave_with_an_input_that_it_does_not_share_elements_with(gen):
    """out= and the logits as the two halves of one (rows, 2V) buffer share no element, but their
    byte spans interleave: the overlap check compared spans and refused them."""
    V = 9
    big = torch.empty(4, 2 * V, dtype=D)
    big[:, V:] = logits(gen, 4, V)
    old = logits(gen, 4, V)
    x = big[:, V:]
    want = troll.project(x.clone(), old, 0.05)[0]
    got = troll.project(x, old, 0.05, out=big[:, :V])[0]
    assert torch.equal(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want)))
    troll.log_softmax(x, out=big[:, :V])
    assert torch.allclose(big[:, :V], torch.log_softmax(x, -1), rtol=1e-14, atol=1e-15)
    # A real overlap is still refused, however it interleaves.
    with pytest.raises(troll.ShapeError, match="overlaps"):
        troll.project(x, old, 0.05, out=big[:, 1:V + 1])
    with pytest.raises(troll.ShapeError, match="overlaps"):
        troll.log_softmax(x, out=big.view(-1)[:4 * V].view(4, V))  # packed rows across x's strided ones


def test_sparse_rows_must_have_the_dense_rows_shape(gen):
    """Sparse old rows of shape (3, 2) against new logits of shape (2, 3, V) paired in flattened
    order without an error (trust_region_loss gave another loss, project_sparse other rows); the
    binding now compares the sparse rows' leading shape with the dense rows' everywhere they pair."""
    V = 10
    new, old = logits(gen, 2, 3, V), logits(gen, 2, 3, V)
    tokens = torch.randint(0, V, (2, 3), generator=gen)
    adv = torch.randn(2, 3, generator=gen, dtype=D)
    time_major = tt.sparsify(old.transpose(0, 1).contiguous(), 4, sampled=tokens.t().contiguous())
    flat = tt.sparsify(old.reshape(6, V), 4, sampled=tokens.reshape(6))
    for bad in (time_major, flat):
        with pytest.raises(troll.ShapeError, match="leading shapes must agree"):
            tt.trust_region_loss(new, bad, tokens, adv)
        with pytest.raises(troll.ShapeError, match="leading shapes must agree"):
            tt.project_sparse(new, bad, 0.05)
    good = tt.sparsify(old, 4, sampled=tokens)
    tt.trust_region_loss(new, good, tokens, adv)
    tt.project_sparse(new, good, 0.05)
    with pytest.raises(troll.ShapeError, match="leading shapes must agree"):  # the module level too
        troll.sparsify_backward(new.reshape(6, V).numpy(), troll.sparsify(new.numpy(), 2),
                                (np.zeros((2, 3, 2)), np.zeros((2, 3))))


def test_a_mask_that_underflows_in_the_logits_dtype_is_named(gen):
    """A float64 mask of 1e-50 with float32 logits became 0 in the cast and silently dropped its
    tokens (a whole sequence under sequence_mean); only the mask's ratios matter, so it is refused
    with that advice rather than changed."""
    new, old = logits(gen, 2, 3, 8).float(), logits(gen, 2, 3, 8).float()
    tokens = torch.randint(0, 8, (2, 3), generator=gen)
    adv = torch.randn(2, 3, generator=gen, dtype=D)
    mask = torch.ones(2, 3, dtype=D)
    mask[1] = 1e-50
    with pytest.raises(troll.DomainError, match=r"mask entry 3 \(= 1e-50\) does not fit.*scale the mask"):
        tt.ppo_clip_loss(new, old, tokens, adv, mask=mask)
    with pytest.raises(troll.DomainError, match="mask entry 3"):
        tt.trust_region_loss(new, old, tokens, adv, mask=mask)
    tt.ppo_clip_loss(new, old, tokens, adv, mask=mask * 1e30)  # scaled: 1e30 and 1e-20 fit float32
    tt.ppo_clip_loss(new.double(), old.double(), tokens, adv, mask=mask)  # float64 logits: as given


# ---- a forked child (a DataLoader worker, a process pool) ----


_FORK_SCRIPT = r"""
import os, sys, time
import numpy as np
import troll

z = np.sin(0.37 * np.arange(64 * 4096, dtype=np.float64)).reshape(64, 4096)
want = np.asarray(troll.log_softmax(z, threads=2))  # starts the worker threads
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: compute on one thread, report, leave through the interpreter's exit
    os.close(read)
    same = np.array_equal(np.asarray(troll.log_softmax(z, threads=2)), want)
    os.write(write, b"1" if same else b"0")
    os.close(write)
    sys.exit(0)
os.close(write)
deadline = time.monotonic() + 20.0
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == pid:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("child hung")
    sys.exit(2)
print("answer", os.read(read, 1).decode(), "status", os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_forked_after_troll_started_its_threads_computes_and_exits(tmp_path):
    """The CPU backend's worker threads are started once per process; a child forked afterwards
    (a DataLoader worker, a process pool) has none of them. It must still compute (on one thread,
    the same values) and exit through the interpreter's shutdown, which runs the extension's static
    destructors (before the thirty-fifth session the pool's waited for the parent's threads for
    ever). In a fresh interpreter with troll and NumPy only, so that no other library's threads
    are forked."""
    import subprocess
    import sys

    # cwd away from python/, whose troll/ is the source tree, not the installed package
    run = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "answer 1 status 0" in run.stdout, run.stdout + run.stderr


def test_sliced_sparse_rows_are_refused_by_name_and_read_once_packed(gen):
    """Dense rows may be sliced (x[::2], x[:, :V]); the arrays of SparseRows are read through
    troll's packed sparse layout, so a slice of them raises ShapeError naming the array and its
    row stride (docs/python.md "No copies"), never reads the skipped rows; packed copies of the
    same slices give the rows' own results."""
    z, new = logits(gen, 8, 9), logits(gen, 4, 9)
    old = tt.sparsify(z, 4)
    every_other = troll.SparseRows(old.indices[::2], old.log_probs[::2], old.counts[::2], old.log_remainder[::2],
                                   old.vocab)
    with pytest.raises(troll.ShapeError, match=r"old\.indices must be packed \(row stride 8 != 4\)"):
        troll.align(new, every_other)
    with pytest.raises(troll.ShapeError, match=r"indices must be packed"):
        tt.project_sparse(new, every_other, 0.05)
    narrower = troll.SparseRows(old.indices[:4, :3], old.log_probs[:4, :3], old.counts[:4].clamp(max=3),
                                old.log_remainder[:4], old.vocab)
    with pytest.raises(troll.ShapeError, match=r"old\.indices must be packed \(row stride 4 != 3\)"):
        troll.align(new, narrower)
    packed = troll.SparseRows(*(a.contiguous() for a in every_other[:4]), old.vocab)
    got = troll.align(new, packed)
    want = troll.align(new, troll.SparseRows(*(a[::2].contiguous() for a in tt.sparsify(z, 4)[:4]), old.vocab))
    assert got.vocab == want.vocab
    for a, b in zip(got[:6], want[:6]):  # every array of the aligned rows, bit for bit
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_align_reads_only_the_ids_and_counts_of_new_support(gen, dtype):
    """align(new_logits, old, new_support): the support gives U's ids; its values are never read
    (docs/sparse.md), so NaN or positive values give the same aligned rows bit for bit, while a
    repeated id is still refused."""
    z, zo = logits(gen, 3, 11).to(dtype), logits(gen, 3, 11).to(dtype)
    old, support = troll.sparsify(zo, 3), troll.sparsify(z, 4)
    want = troll.align(z, old, new_support=support)
    for value in (float("nan"), 0.5, float("inf")):
        odd = troll.SparseRows(support.indices, torch.full_like(support.log_probs, value), support.counts,
                               torch.full_like(support.log_remainder, value), support.vocab)
        got = troll.align(z, old, new_support=odd)
        for a, b in zip(got[:6], want[:6]):
            assert torch.equal(a, b)
    repeated = support.indices.clone()
    repeated[1, 1] = repeated[1, 0]
    with pytest.raises(troll.ShapeError, match="row 1"):
        troll.align(z, old, new_support=troll.SparseRows(repeated, support.log_probs, support.counts,
                                                         support.log_remainder, support.vocab))
