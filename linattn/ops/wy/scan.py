"""The pass over chunks of the WY chunk form, forward and backward, on chunk-major buffers."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["scan_chunks", "scan_chunks_backward", "rows", "set_rows"]


def _per_value_head(x: Tensor, BH: int) -> Tensor:
    """A chunk's ``(B·H, …)`` rows of the keys for the ``BH = B·HV`` value heads (a copy of one chunk when
    ``HV > H``: the ungated delta rule's ``K̂ = K`` with grouped value heads)."""
    r = BH // x.shape[0]
    return x if r == 1 else x.unsqueeze(1).expand(x.shape[0], r, *x.shape[1:]).reshape(BH, *x.shape[1:])


def scan_chunks(W, Ut, ke, tot, S0, BH, N):
    """The pass over chunks: ``U_n = Ũ_n − W_n S``, ``S <- total_n S + K̂_nᵀ U_n``; ``(U, S_before, S_final)``,
    ``S_final`` of ``S0``'s shape.
    ``ke`` has the rows of the value heads, or those of the q/k heads (ungated, grouped value heads)."""
    BHN, C, Dk = W.shape
    Dv = Ut.shape[-1]
    keT4 = ke.view(-1, N, C, Dk).transpose(-1, -2).unbind(1)
    W4 = W.view(BH, N, C, Dk).unbind(1)
    tot4 = [None] * N if tot is None else tot.view(BH, N, tot.shape[-2], 1).unbind(1)
    S_before = W.new_empty(N, BH, Dk, Dv)
    U_n, S_n = Ut.unbind(0), S_before.unbind(0)
    S = S_n[0].copy_(S0.reshape(BH, Dk, Dv))
    final = W.new_empty(S0.shape)                   # S0's shape, not a view: a state the caller may write into
    for n in range(N):
        U_n[n].baddbmm_(W4[n], S, alpha=-1.0)                                     # U = Ũ − W S
        nxt = S_n[n + 1] if n + 1 < N else final.view(BH, Dk, Dv)
        if tot4[n] is None:
            nxt.copy_(S)
        else:
            torch.mul(S, tot4[n], out=nxt)
        S = nxt.baddbmm_(_per_value_head(keT4[n], BH), U_n[n])                    # written in place: no copy
    return Ut, S_before, final


def scan_chunks_backward(PdO, QdO, W, ke, tot, dS, BH, N):
    """The reverse pass: ``dU_n = Pᵀ dO + K̂ dS_{n+1}``, ``dS_n = total dS_{n+1} + Q̃ᵀ dO − Wᵀ dU_n``; ``(dU, dS_after, dS0)``."""
    BHN, C, Dk = W.shape
    Dv = PdO.shape[-1]
    Q4 = QdO.view(BH, N, Dk, Dv).unbind(1)
    WT4, ke4 = W.view(BH, N, C, Dk).transpose(-1, -2).unbind(1), ke.view(-1, N, C, Dk).unbind(1)
    tot4 = [None] * N if tot is None else tot.view(BH, N, tot.shape[-2], 1).unbind(1)
    dS_after = W.new_empty(N, BH, Dk, Dv)
    dU_n, dS_n = PdO.unbind(0), dS_after.unbind(0)
    dS = dS_n[N - 1].copy_(dS)
    for n in range(N - 1, -1, -1):
        dU_n[n].baddbmm_(_per_value_head(ke4[n], BH), dS)
        nxt = dS_n[n - 1] if n > 0 else torch.empty_like(dS)
        if tot4[n] is None:
            torch.add(Q4[n], dS, out=nxt)
        else:
            torch.mul(dS, tot4[n], out=nxt).add_(Q4[n])
        dS = nxt.baddbmm_(WT4[n], dU_n[n], alpha=-1.0)                           # written in place: no copy
    return PdO, dS_after, dS


def _rows_key(grp: slice, N: int, device) -> tuple:
    """The index of rows ``grp`` (a slice of the head-major ``B·H·N`` chunks) in a tensor stored
    chunk-major ``(N, B·H, …)``: two slices where the group lies within one head (every group
    does when ``N`` is at least a group's size and a multiple of it), else two index tensors."""
    h0, n0 = divmod(grp.start, N)
    if (grp.stop - 1) // N == h0:
        return slice(n0, n0 + grp.stop - grp.start), h0
    i = torch.arange(grp.start, grp.stop, device=device)
    return i % N, i // N


def rows(x: Tensor, grp: slice, N: int) -> Tensor:
    """Rows ``grp`` of the chunk-major ``x`` (:func:`_rows_key`): a view within one head, else a copy."""
    return x[_rows_key(grp, N, x.device)]


def set_rows(x: Tensor, grp: slice, N: int, value: Tensor) -> None:
    """Write ``value`` into rows ``grp`` of the chunk-major ``x`` (:func:`_rows_key`)."""
    x[_rows_key(grp, N, x.device)] = value
