"""Retention's chunk form: integer powers of ``γ`` inside a chunk, a scan between chunks."""
from __future__ import annotations

import torch

from .._common import from_chunks, num_chunks, scan, to_chunks, zeros_state
from ..value_heads import by_group

__all__ = ["chunk_retention"]


def chunk_retention(q, k, v, gamma, S0, chunk_size):
    """Chunkwise retention; gamma ``(HV,)`` in (0, 1]; value head ``j`` reads q/k head ``j // r``."""
    B, H, T, Dk = k.shape
    HV, Dv = v.shape[1], v.shape[-1]
    r = HV // H
    C, N = num_chunks(T, chunk_size)
    qc, kc = (to_chunks(x, N, C).unsqueeze(2) for x in (q, k))         # (B, H, 1, N, C, Dk): shared by a group
    vc = by_group(to_chunks(v, N, C), H)                               # (B, H, r, N, C, Dv)
    dev, acc = q.device, q.dtype
    t = torch.arange(C, device=dev)
    g4 = gamma.view(H, r, 1, 1)
    causal = torch.ones(C, C, dtype=acc, device=dev).tril()            # 0/1, (C, C)
    intra = g4 ** (t[:, None] - t[None, :]).clamp(min=0).to(acc) * causal   # (H, r, C, C): γ^(t−s), s <= t
    # tril_ first: the products with later keys may overflow, and inf · 0 would be NaN
    scores = (qc @ kc.transpose(-1, -2)).tril_() * intra.unsqueeze(2)  # (B, H, r, N, C, C)
    out = scores @ vc                                                  # (B, H, r, N, C, Dv)

    n_real = (T - torch.arange(N, device=dev) * C).clamp(max=C)        # (N,) real tokens per chunk
    pos = torch.minimum(t[None, :] + 1, n_real[:, None])               # (N, C): 1..n, then n on padding
    q_decay = g4 ** pos.to(acc)                                        # (H, r, N, C): γ^(t+1)
    k_decay = g4 ** (n_real[:, None] - pos).to(acc)                    # (H, r, N, C): γ^(n−1−s), exponent >= 0
    chunk_decay = gamma.view(HV, 1) ** n_real.to(acc)                  # (HV, N): γ^n
    U = (kc * k_decay.unsqueeze(-1)).transpose(-1, -2) @ vc            # (B, H, r, N, Dk, Dv)
    S_before, S = scan(zeros_state(k, v, S0), lambda S, d, u: d * S + u,
                       chunk_decay.view(1, HV, N, 1, 1), U.reshape(B, HV, N, Dk, Dv))
    out = out + (qc * q_decay.unsqueeze(-1)) @ by_group(S_before, H)   # (B, H, r, N, C, Dv)
    return from_chunks(out.reshape(B, HV, N, C, Dv), T), S
