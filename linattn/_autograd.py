"""Autograd plumbing shared by the hand-written backward passes (private)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._numerics import compiling

__all__ = ["autograd_must_see_every_op", "differentiable_backward", "has_forward_tangent", "NO_SECOND_DERIVATIVE"]

NO_SECOND_DERIVATIVE = (
    "second derivatives (double backward with create_graph=True, torch.func.hessian, forward mode over a "
    "gradient, ...) through the chunkwise linear attention are not supported; use method='quadratic' or "
    "method='recurrent' for higher-order gradients")


def has_forward_tangent(*tensors: Optional[Tensor]) -> bool:
    """Whether any of ``tensors`` is a forward-mode dual (``torch.autograd.forward_ad``) with a tangent."""
    return any(t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def autograd_must_see_every_op(*tensors: Optional[Tensor]) -> bool:
    """Autograd must see every operation: ``torch.func`` transforms, ``torch.compile``, or a forward-mode dual."""
    return compiling() or torch._C._are_functorch_transforms_active() or has_forward_tangent(*tensors)


def differentiable_backward(forward, inputs, d_out, d_S):
    """The backward pass of ``forward(*inputs) -> (out, S)`` as autograd's graph, so that it can be differentiated again."""
    leaves = [None if x is None else (x if x.requires_grad else x.detach().requires_grad_()) for x in inputs]
    with torch.enable_grad():
        out, S = forward(*leaves)
    present = [i for i, x in enumerate(leaves) if x is not None]
    grads_out = [g for g in (d_out, d_S) if g is not None]
    outs = [o for o, g in zip((out, S), (d_out, d_S)) if g is not None]
    grads = torch.autograd.grad(outs, [leaves[i] for i in present], grads_out, create_graph=True, allow_unused=True)
    result = [None] * len(leaves)
    for i, grad in zip(present, grads):
        result[i] = torch.zeros_like(leaves[i]) if grad is None else grad
    return tuple(result)
