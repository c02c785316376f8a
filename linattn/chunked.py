"""Chunkwise-parallel causal linear attention.

Split the sequence into chunks of ``C`` tokens. Inside a chunk, attention is the
small masked quadratic form; across chunks, a query reads the state ``S`` that
summarises every earlier chunk (Hua et al., 2022, sec. 3.3; Yang et al., 2024,
sec. 2.2)::

    Y_c = φ(Q_c) S_{c-1} + tril(φ(Q_c) φ(K_c)ᵀ) V_c,     S_c = S_{c-1} + φ(K_c)ᵀ V_c

Cost per head: ``O(T·C·(M + Dv) + T·M·Dv)`` time; memory beyond the inputs is one
``C×C`` block and one ``M×Dv`` state per head.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["chunk_linear_attention"]


def chunk_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor],
                           chunk_size: int) -> tuple[Tensor, Tensor]:
    """Causal linear attention on features, chunk by chunk (the clear reference version).

    Parameters
    ----------
    phi_q, phi_k : Tensor
        ``(B, H, T, M)`` features of the queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values. (``linear_attention`` passes values with an extra
        column of ones, whose output column is the normaliser.)
    S0 : Tensor or None
        ``(B, H, M, Dv)`` state before the first token; None means zeros.
    chunk_size : int
        Tokens per chunk ``C >= 1``; the last chunk holds the remaining ``T mod C`` tokens.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)``, the unnormalised causal outputs ``Σ_{j<=i} φ(q_i)ᵀφ(k_j) v_j``
        (plus ``φ(q_i)ᵀS0``).
    S : Tensor
        ``(B, H, M, Dv)``, the state after the last token.
    """
    B, H, T, M = phi_k.shape
    S = S0 if S0 is not None else phi_k.new_zeros(B, H, M, v.shape[-1])
    outs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        q_c, k_c, v_c = phi_q[:, :, start:stop], phi_k[:, :, start:stop], v[:, :, start:stop]
        scores = (q_c @ k_c.transpose(-1, -2)).tril()         # (B, H, C, C) within the chunk
        outs.append(q_c @ S + scores @ v_c)                    # (B, H, C, Dv) earlier chunks + this one
        S = S + k_c.transpose(-1, -2) @ v_c                    # (B, H, M, Dv)
    return torch.cat(outs, dim=2), S
