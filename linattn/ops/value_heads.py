"""Grouped value heads: ``HV = r·H`` value heads over ``H`` query/key heads, value head ``j`` reading
q/k head ``j // r`` (the convention of flash-linear-attention and transformers' Qwen3-Next).

The fast chunk forms never hold a repeated copy of ``q`` or ``k``: :class:`SharedRows` reads the
rows a group of value-head chunks needs, a group at a time, and adds their gradients back."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["group_ratio", "repeat_heads", "by_group", "read_grouped", "add_outer", "SharedRows"]


def group_ratio(qk_heads: int, value_heads: int) -> int:
    """``r = HV // H`` (the caller has checked that ``H`` divides ``HV``)."""
    return value_heads // qk_heads


def repeat_heads(x: Tensor, r: int) -> Tensor:
    """``(B, H, …) -> (B, r·H, …)``, head ``j`` a copy of head ``j // r`` (the op-by-op twins only)."""
    return x if r == 1 else x.repeat_interleave(r, dim=1)


def by_group(x: Tensor, qk_heads: int) -> Tensor:
    """``(B, HV, …) -> (B, H, r, …)``: the value heads of each q/k head side by side (a view)."""
    return x.view(x.shape[0], qk_heads, x.shape[1] // qk_heads, *x.shape[2:])


def read_grouped(q_t: Tensor, S: Tensor) -> Tensor:
    """``S_jᵀ q_{j // r}`` for every value head ``j``: ``q_t`` ``(B, H, Dk)``, ``S`` ``(B, HV, Dk, Dv)`` ->
    ``(B, HV, Dv)``."""
    B, H, _ = q_t.shape
    if S.shape[1] == H:
        return (q_t.unsqueeze(-2) @ S).squeeze(-2)
    return (q_t[:, :, None, None] @ by_group(S, H)).view(B, S.shape[1], S.shape[-1])


def add_outer(S: Tensor, k_t: Tensor, u: Tensor) -> Tensor:
    """``S_j + k_{j // r} u_jᵀ`` for every value head ``j``: ``S`` ``(B, HV, Dk, Dv)``, ``k_t`` ``(B, H, Dk)``,
    ``u`` ``(B, HV, Dv)`` -> ``(B, HV, Dk, Dv)``."""
    B, H, Dk = k_t.shape
    if u.shape[1] == H:
        return torch.addcmul(S, k_t.unsqueeze(-1), u.unsqueeze(-2))
    return torch.addcmul(by_group(S, H), k_t[:, :, None, :, None], by_group(u, H).unsqueeze(-2)).view(S.shape)


class SharedRows:
    """The rows of the q/k chunks ``(B·H·N, C, D)`` that the rows ``(B·HV·N, …)`` of the value-head
    chunks read: row ``(b, j, n)`` reads ``(b, j // r, n)``.

    With ``r = 1`` every method is the plain slice it replaces (views, no copy). With ``r > 1`` a
    group's rows are gathered into a temporary of the group's size, and gradients are added back
    with ``index_add_``, so no tensor of ``B·HV·N`` rows of ``q`` or ``k`` ever exists.
    """

    def __init__(self, B: int, H: int, HV: int, N: int, device) -> None:
        self.r = group_ratio(H, HV)
        self.index: Optional[Tensor] = None
        if self.r > 1:
            i = torch.arange(B * HV * N, device=device)
            b, j, n = i // (HV * N), (i // N) % HV, i % N
            self.index = (b * H + j // self.r) * N + n                   # (B·HV·N,)

    def read(self, x3: Tensor, grp: slice) -> Tensor:
        """Rows ``grp`` (of the value-head chunks) of ``x3`` ``(B·H·N, C, D)``."""
        return x3[grp] if self.index is None else x3.index_select(0, self.index[grp])

    def per_row(self, x: Tensor) -> Tensor:
        """A per-row quantity ``(B·H·N, …)`` of the q/k chunks, for every value-head row."""
        return x if self.index is None else x.index_select(0, self.index)

    def gradient(self, x3: Tensor) -> Tensor:
        """The gradient buffer of ``x3`` (zeros where groups add into it)."""
        return torch.empty_like(x3) if self.index is None else torch.zeros_like(x3)

    def target(self, dx3: Tensor, grp: slice) -> Tensor:
        """Where a group writes its gradient: rows ``grp`` of ``dx3``, or a temporary when ``r > 1``."""
        if self.index is None:
            return dx3[grp]
        return dx3.new_empty(grp.stop - grp.start, *dx3.shape[1:])

    def commit(self, dx3: Tensor, grp: slice, written: Tensor) -> None:
        """Add a group's gradient (written into :meth:`target`'s tensor) into ``dx3``."""
        if self.index is not None:
            dx3.index_add_(0, self.index[grp], written)
