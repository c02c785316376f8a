"""The WY chunk form op by op (differentiable by autograd): the readable twin of :mod:`.function`."""
from __future__ import annotations

import torch

from ..decay import decay_factors, scalar_decay, scores_by_cat
from ..value_heads import repeat_heads

__all__ = ["solve_and_scan", "wy_chunk_ops", "wy_chunk_channel_ops"]


def solve_and_scan(P, A, qf, kf, ke, v, beta, S0, total):
    """The chunk form from its decayed scores, op by op (differentiable by autograd): ``(out, S_final)``."""
    M = beta * A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)   # I + diag(β) A (A's diagonal is 0)
    X = torch.linalg.solve_triangular(M, torch.cat([beta * kf, beta * v], dim=-1), upper=False, unitriangular=True)
    Dk = kf.shape[-1]
    W, Ut = X[..., :Dk], X[..., Dk:]
    S, before, Us = S0, [], []
    totals = [None] * W.shape[2] if total is None else total.unbind(2)
    for W_n, Ut_n, ke_n, tot_n in zip(W.unbind(2), Ut.unbind(2), ke.transpose(-1, -2).unbind(2), totals):
        before.append(S)
        U_n = Ut_n - W_n @ S                                                  # U = Ũ − W S
        Us.append(U_n)
        S = (S if tot_n is None else tot_n * S) + ke_n @ U_n
    S_before, U = torch.stack(before, dim=2), torch.stack(Us, dim=2)        # (B, H, N, Dk, Dv), (…, C, Dv)
    return qf @ S_before + P @ U, S


def wy_chunk_ops(q, k, v, beta, S0, g=None):
    """The chunk form with one gate per head (log-gates ``g`` ``(B, HV, N, C, 1)``) or none, op by op
    (grouped value heads: ``q``, ``k`` with ``H`` heads are repeated to ``HV``)."""
    q, k = (repeat_heads(x, v.shape[1] // k.shape[1]) for x in (q, k))
    kt = k.transpose(-1, -2)
    QK = (q @ kt).tril()                                # tril first: an overflowing later score times 0 is NaN
    KK = (k @ kt).tril(-1)
    if g is None:
        return solve_and_scan(QK, KK, q, k, k, v, beta, S0, None)
    D, from_start, to_end, total = scalar_decay(g)
    return solve_and_scan(QK * D, KK * D, q * from_start, k * from_start, k * to_end, v, beta, S0, total)


def wy_chunk_channel_ops(q, k, v, beta, S0, g):
    """The chunk form with one gate per key channel (log-gates ``g`` ``(B, HV, N, C, Dk)``, ``C`` a power of two),
    op by op (``q``, ``k`` repeated to ``HV`` heads)."""
    q, k = (repeat_heads(x, v.shape[1] // k.shape[1]) for x in (q, k))
    fs, te, total, levels = decay_factors(g)
    P, A = scores_by_cat(q, k, False, levels), scores_by_cat(k, k, True, levels)
    return solve_and_scan(P, A, q * fs, k * fs, k * te, v, beta, S0, total.transpose(-1, -2))
