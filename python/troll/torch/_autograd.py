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
