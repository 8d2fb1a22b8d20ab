"""Double backward through troll's analytic backward passes is not implemented: their gradients
are computed by the extension, outside autograd. Under ``create_graph=True`` a plain custom
Function would hand back gradients that silently do not depend on the inputs (a second
derivative of 0, or "not used in the graph"); ``guard`` instead ties them to the inputs through
a node whose backward raises a clear error."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch


class _NotTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name: str, grad: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return grad.clone()

    @staticmethod
    def backward(ctx, *_grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(f"troll.torch.{ctx.name}: double backward is not implemented (the gradient is troll's "
                           "analytic backward, which autograd cannot differentiate again; create_graph=True is fine "
                           "only when nothing differentiates this gradient)")


def guard(name: str, grads: Sequence[Optional[torch.Tensor]], sources: Sequence[Any]) -> Tuple[Any, ...]:
    """``grads`` as they are outside create_graph; under it, each tied to the tensors of
    ``sources`` (the function's inputs and its upstream gradients) that require grad."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    linked = [s for s in sources if isinstance(s, torch.Tensor) and s.requires_grad]
    if not linked:
        return tuple(grads)
    return tuple(g if not isinstance(g, torch.Tensor) else _NotTwice.apply(name, g, *linked) for g in grads)


def not_batched(*grads: Optional[torch.Tensor]) -> None:
    """Raises a clear error for an upstream gradient without storage: a batched one (torch.func /
    vmap over a backward: ``torch.autograd.grad(is_grads_batched=True)``,
    ``jacobian(vectorize=True)``), which reaches a Function's backward as a plain-looking tensor,
    or a fake one. troll's backward reads rows of memory; the binding would otherwise fail with
    its signature dump."""
    for g in grads:
        if not isinstance(g, torch.Tensor):
            continue
        try:
            g.data_ptr()
        except RuntimeError:
            raise RuntimeError("troll.torch: the upstream gradient has no storage: batched gradients "
                               "(torch.autograd.grad(is_grads_batched=True), "
                               "torch.autograd.functional.jacobian(vectorize=True), vmap) and fake tensors are not "
                               "supported by troll's analytic backward; use jacobian(vectorize=False) or a loop over "
                               "the cotangents") from None
