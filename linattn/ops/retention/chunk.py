"""Retention's chunk form: integer powers of ``γ`` inside a chunk, a scan between chunks."""
from __future__ import annotations

import torch

from .._common import from_chunks, num_chunks, scan, to_chunks, zeros_state

__all__ = ["chunk_retention"]


def chunk_retention(q, k, v, gamma, S0, chunk_size):
    """Chunkwise retention; gamma (H,) in (0, 1]."""
    B, H, T, Dk = k.shape
    C, N = num_chunks(T, chunk_size)
    qc, kc, vc = (to_chunks(x, N, C) for x in (q, k, v))               # (B, H, N, C, ·)
    dev, acc = q.device, q.dtype
    t = torch.arange(C, device=dev)
    g3 = gamma.view(H, 1, 1)
    causal = torch.ones(C, C, dtype=acc, device=dev).tril()            # 0/1, (C, C)
    intra = g3 ** (t[:, None] - t[None, :]).clamp(min=0).to(acc) * causal   # (H, C, C): γ^(t−s), s <= t
    # tril_ first: the products with later keys may overflow, and inf · 0 would be NaN
    scores = (qc @ kc.transpose(-1, -2)).tril_() * intra.unsqueeze(1)  # (B, H, N, C, C)
    out = scores @ vc                                                  # (B, H, N, C, Dv)

    n_real = (T - torch.arange(N, device=dev) * C).clamp(max=C)        # (N,) real tokens per chunk
    pos = torch.minimum(t[None, :] + 1, n_real[:, None])               # (N, C): 1..n, then n on padding
    q_decay = g3 ** pos.to(acc)                                        # (H, N, C): γ^(t+1)
    k_decay = g3 ** (n_real[:, None] - pos).to(acc)                    # (H, N, C): γ^(n−1−s), exponent >= 0
    chunk_decay = gamma.view(H, 1) ** n_real.to(acc)                   # (H, N): γ^n
    U = (kc * k_decay.unsqueeze(-1)).transpose(-1, -2) @ vc            # (B, H, N, Dk, Dv)
    S_before, S = scan(zeros_state(k, v, S0), lambda S, d, u: d * S + u,
                        chunk_decay.view(1, H, N, 1, 1), U)
    out = out + (qc * q_decay.unsqueeze(-1)) @ S_before                # (B, H, N, C, Dv)
    return from_chunks(out, T), S
