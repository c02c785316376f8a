"""The affine scan over ranks: each slice maps the state ``S ↦ A_r S + B_r``; the ranks compose the maps in order."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .comm import _all_gather, _isend, _Ranks, _recv, _send

__all__ = ['apply_transition']

Map = tuple[Tensor, Tensor]          # (A, B): S ↦ A S + B


def apply_transition(A: Tensor, S: Tensor) -> Tensor:
    """``A S`` for a state ``S`` ``(B, H, Dk, Dv)``.

    Parameters
    ----------
    A : Tensor
        A dense transition ``(B, H, Dk, Dk)`` (the delta rules), or the diagonal of one:
        ``(B, H, Dk)`` (GLA) or ``(B, H, 1)`` (one decay per head, retention).
    S : Tensor
        ``(B, H, Dk, Dv)``.

    Returns
    -------
    Tensor
        ``(B, H, Dk, Dv)``.
    """
    return A @ S if A.dim() == S.dim() else A.unsqueeze(-1) * S


def _compose(later: Optional[Map], earlier: Optional[Map]) -> Optional[Map]:
    """``(A2, B2) ∘ (A1, B1) = (A2 A1, A2 B1 + B2)``: first ``earlier``, then ``later`` (None: the identity)."""
    if later is None or earlier is None:
        return earlier if later is None else later
    (A2, B2), (A1, B1) = later, earlier
    return (A2 @ A1 if A2.dim() == B2.dim() else A2 * A1), apply_transition(A2, B1) + B2


def _transpose(A: Tensor, B: Tensor) -> Tensor:
    return A.transpose(-1, -2) if A.dim() == B.dim() else A


def _pack(A: Tensor, B: Tensor) -> Tensor:
    """One flat buffer: a map travels as one message."""
    return torch.cat([A.reshape(-1), B.reshape(-1)])


def _unpack(buf: Tensor, A: Tensor, B: Tensor) -> Map:
    return buf[:A.numel()].view_as(A), buf[A.numel():].view_as(B)


def _exclusive(A: Tensor, B: Tensor, ranks: _Ranks, exchange: str, op: str, *, reverse: bool,
               gathered_A: Optional[list] = None) -> tuple[Tensor, list]:
    """The maps of the ranks before this one (after it when ``reverse``), composed in order and applied
    to the zero state; and, for the all-gather, every rank's ``A`` (to be reused by the backward)."""
    P = ranks.world
    pos = P - 1 - ranks.rank if reverse else ranks.rank                # position along the scan

    def rank_at(i: int) -> int:
        return P - 1 - i if reverse else i

    if exchange == "ring":                                             # the chain: one state a hop
        incoming = torch.zeros_like(B) if pos == 0 else _recv(B, rank_at(pos - 1), ranks)
        if pos < P - 1:
            _send(apply_transition(A, incoming) + B, rank_at(pos + 1), ranks, op)
        return incoming, []
    if exchange == "allgather":
        if gathered_A is None:                                         # A and B, as one buffer each
            maps = [_unpack(buf, A, B) for buf in _all_gather(_pack(A, B), ranks, op)]
        else:                                                          # the A are known: B alone
            maps = list(zip(gathered_A, _all_gather(B, ranks, op)))
        incoming = torch.zeros_like(B)
        for i in range(pos):
            A_i, B_i = maps[rank_at(i)]
            incoming = apply_transition(A_i, incoming) + B_i
        return incoming, [a for a, _ in maps]
    # the scan (Hillis & Steele): after the round of distance d, `inclusive` is the map of the positions
    # (pos - 2d, pos] and `exclusive` that of (pos - 2d, pos)
    inclusive, exclusive, d = (A, B), None, 1
    while d < P:
        buf = _pack(*inclusive)
        request = _isend(buf, rank_at(pos + d), ranks, op) if pos + d < P else None
        got = _unpack(_recv(buf, rank_at(pos - d), ranks), A, B) if pos - d >= 0 else None
        if request is not None:
            request.wait()                                             # buf may be replaced now
        if got is not None:
            exclusive, inclusive = _compose(exclusive, got), _compose(inclusive, got)
        d *= 2
    return (torch.zeros_like(B) if exclusive is None else exclusive[1]), []


def _transition_grad(G: Tensor, incoming: Tensor, A: Tensor) -> Tensor:
    """``∂L/∂A`` of ``S_out = A S_in + B`` from ``G = ∂L/∂S_out``: ``G S_inᵀ`` (its diagonal when ``A`` is one)."""
    if A.dim() == G.dim():
        return G @ incoming.transpose(-1, -2)
    return (G * incoming).sum(-1).sum_to_size(A.shape)


class _AffineScan(torch.autograd.Function):
    """Forward: ``S_in`` of this rank, the maps of the earlier ranks applied in order to the zero state.
    Backward: the reverse scan of the transposed maps ``G ↦ A_sᵀ G + g_s`` gives ``G = ∂L/∂S_out`` of
    this rank's slice; then ``∂L/∂B = G`` and ``∂L/∂A = G S_inᵀ``."""

    @staticmethod
    def forward(ctx, A: Tensor, B: Tensor, leaf: Optional[Tensor], ranks: _Ranks, exchange: str) -> Tensor:
        incoming, gathered = _exclusive(A, B, ranks, exchange, "state", reverse=False)
        ctx.save_for_backward(A, incoming)
        ctx.ranks, ctx.exchange, ctx.gathered = ranks, exchange, gathered
        return incoming

    @staticmethod
    def backward(ctx, g: Tensor):
        A, incoming = ctx.saved_tensors
        transposed = [_transpose(a, incoming) for a in ctx.gathered] or None      # the all-gather's
        G, _ = _exclusive(_transpose(A, incoming), g.contiguous(), ctx.ranks, ctx.exchange, "state_grad",
                          reverse=True, gathered_A=transposed)
        dA = _transition_grad(G, incoming, A) if ctx.needs_input_grad[0] else None
        return dA, G, None, None, None


class _Anchor(torch.autograd.Function):
    """``x`` itself, with ``anchor`` as an input: the backward of ``anchor``'s exchange then runs on this
    rank too (with a zero gradient) whenever ``x`` gets one, as every rank's collectives must."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def exchange_states(A: Tensor, B: Tensor, ranks: _Ranks, exchange: str, differentiable: bool) -> Tensor:
    """``S_in`` of this rank, differentiable with respect to every rank's ``A`` and ``B`` (see :class:`_AffineScan`).
    With ``differentiable`` (some rank needs gradients) it requires grad on every rank, so that every rank's
    backward joins the reverse scan, also where this rank's own ``A`` and ``B`` need no gradient."""
    leaf = None
    if differentiable and torch.is_grad_enabled():
        leaf = torch.zeros((), dtype=B.dtype, requires_grad=True)
    return _AffineScan.apply(A, B, leaf, ranks, exchange)


def anchored(x: Tensor, incoming: Tensor) -> Tensor:
    """``x``, tied to ``incoming`` in the autograd graph (see :class:`_Anchor`)."""
    return _Anchor.apply(x, incoming) if torch.is_grad_enabled() and incoming.requires_grad else x
