"""Elementwise feature maps with no target kernel: elu+1, ReLU, squared ReLU."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from .._autograd import autograd_must_see_every_op
from .._checks import check_floating

__all__ = ['elu_plus_one', 'relu', 'squared_relu', 'elu_plus_one_arithmetic']


def elu_plus_one(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, the feature map of "Transformers are RNNs".

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``(0, inf)`` until
        ``exp(x)`` underflows (``x < -103`` in float32): ``exp(x)`` is computed directly,
        never as ``elu(x) + 1``, whose ``-1 + 1`` cancels to exactly 0 from ``x ≈ -17``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    check_floating(x, "x")
    if torch._C._are_functorch_transforms_active():
        return _EluPlusOneWithJvp.apply(x)
    if not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling():
        return _EluPlusOne.forward(x)                 # nothing to differentiate: the same arithmetic, no Function
    return _EluPlusOne.apply(x)


ELU_BLOCK = 1 << 16
"""Elements per block of :func:`elu_plus_one_arithmetic` on a large CPU tensor (three blocks: 768 KiB in float32)."""


def elu_plus_one_arithmetic(x: Tensor) -> Tensor:
    """:func:`elu_plus_one`'s arithmetic on a floating tensor, without its checks and autograd Function:
    for callers that checked ``x`` and need no gradient (a decoding step).

    A contiguous CPU tensor of at least ``4 * ELU_BLOCK`` elements is done block by block: each block's four
    passes run while it is in cache, and only the result is allocated (the same elementwise arithmetic, so the
    same bits).
    """
    if (type(x) is not Tensor or x.device.type != "cpu" or not x.is_contiguous() or x.numel() < 4 * ELU_BLOCK
            or autograd_must_see_every_op(x)):                  # cheap checks first: a decoding step's x is small
        return x.clamp(max=0.0).exp_().add_(x.clamp(min=0.0))    # e^x for x <= 0, 1 + x for x > 0
    n = x.numel()
    out = torch.empty_like(x)
    flat_x, flat_out = x.view(-1), out.view(-1)
    relu = x.new_empty(ELU_BLOCK)
    for start in range(0, n, ELU_BLOCK):
        xb, ob = flat_x[start : start + ELU_BLOCK], flat_out[start : start + ELU_BLOCK]
        torch.clamp(xb, max=0.0, out=ob).exp_()
        ob.add_(torch.clamp(xb, min=0.0, out=relu[: xb.numel()]))
    return out


class _EluPlusOne(torch.autograd.Function):
    """``exp(min(x, 0)) + max(x, 0)``: elu(x) + 1 without the cancellation, in four passes."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return elu_plus_one_arithmetic(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        (x,) = inputs
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, y = ctx.saved_tensors
        # dφ/dx = 1 for x > 0 and e^x = φ(x) <= 1 for x <= 0: min(φ(x), 1), since φ(x) = 1 + x >= 1
        # for x > 0 (two passes). A second derivative (create_graph) takes the branch on x instead,
        # whose derivative in y is right also where 1 + x rounds to 1.
        if torch.is_grad_enabled():
            return torch.where(x > 0, grad, grad * y)
        return grad * y.clamp(max=1.0)



class _EluPlusOneWithJvp(_EluPlusOne):
    """:class:`_EluPlusOne` with its forward-mode rule: used only under ``torch.func`` transforms
    (``torch.compile`` cannot trace a Function with ``jvp`` when gradients are needed)."""

    @staticmethod
    def jvp(ctx, tangent: Tensor) -> Tensor:
        x, y = ctx.saved_tensors
        return torch.where(x > 0, tangent, tangent * y)


def relu(x: Tensor) -> Tensor:
    """φ(x) = max(x, 0), the ReLU feature map (used e.g. by cosFormer, Qin et al. 2022, eq. 7).

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``[0, inf)``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    check_floating(x, "x")
    return F.relu(x)


def squared_relu(x: Tensor) -> Tensor:
    """φ(x) = max(x, 0)², elementwise.

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``[0, inf)``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    check_floating(x, "x")
    return F.relu(x).square()


# linattn's own elementwise maps keep shape, dtype and device: the attention functions skip checking their output.
elu_plus_one.keeps_shape = relu.keeps_shape = squared_relu.keeps_shape = True
