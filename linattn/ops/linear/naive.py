"""The readable forms of linear attention on features, the test oracles of the fast paths."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._numerics import all_finite, compiling, masked_matmul

__all__ = ["naive_chunk_linear_attention", "parallel_linear_attention", "quadratic_linear_attention",
           "recurrent_linear_attention", "step_features"]


def naive_chunk_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor],
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


def step_features(phi_q: Tensor, phi_k: Tensor, v_aug: Tensor, S_aug: Tensor) -> tuple[Tensor, Tensor]:
    """One recurrence step on features: ``S_t = S_{t-1} + φ(k_t)[v_t, 1]ᵀ``, output ``φ(q_t)ᵀS_t``."""
    S_aug = S_aug + phi_k.unsqueeze(-1) * v_aug.unsqueeze(-2)     # (B, H, M, Dv + 1)
    out_aug = (phi_q.unsqueeze(-2) @ S_aug).squeeze(-2)          # (B, H, Dv + 1)
    return out_aug, S_aug


def parallel_linear_attention(phi_q: Tensor, phi_k: Tensor, v_aug: Tensor, S0: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Non-causal ``φ(Q)(φ(K)ᵀ[V, 1])``: the summary first, then every query reads it."""
    S = phi_k.transpose(-1, -2) @ v_aug                  # (B, H, M, Dv + 1)
    if S0 is not None:
        S = S0 + S
    return phi_q @ S, S                                  # (B, H, Tq, Dv + 1)


def quadratic_linear_attention(phi_q: Tensor, phi_k: Tensor, v_aug: Tensor, S0: Optional[Tensor], causal: bool,
               need_state: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``(φ(Q)φ(K)ᵀ ⊙ mask)[V, 1]``: the Tq×Tk matrix first, as softmax attention does."""
    scores = phi_q @ phi_k.transpose(-1, -2)             # (B, H, Tq, Tk)
    if causal:
        scores = scores.tril()
        if compiling() or not all_finite(v_aug):         # a NaN/inf value must not reach earlier rows
            causal_ones = torch.ones(scores.shape[-2:], dtype=scores.dtype, device=scores.device).tril()
            out_aug = masked_matmul(scores, v_aug, causal_ones)
        else:
            out_aug = scores @ v_aug                     # (B, H, Tq, Dv + 1)
    else:
        out_aug = scores @ v_aug                         # (B, H, Tq, Dv + 1)
    if S0 is not None:
        out_aug = out_aug + phi_q @ S0
    S = None
    if need_state:
        S = phi_k.transpose(-1, -2) @ v_aug
        S = S if S0 is None else S0 + S
    return out_aug, S


def recurrent_linear_attention(phi_q: Tensor, phi_k: Tensor, v_aug: Tensor, S0: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The RNN view: one :func:`step_features` per token (slow in Python; the test oracle)."""
    B, H, T, M = phi_k.shape
    S = S0 if S0 is not None else phi_k.new_zeros(B, H, M, v_aug.shape[-1])
    outs = []
    for t in range(T):
        out_t, S = step_features(phi_q[:, :, t], phi_k[:, :, t], v_aug[:, :, t], S)
        outs.append(out_t)
    return torch.stack(outs, dim=2), S                   # (B, H, T, Dv + 1)
