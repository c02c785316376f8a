"""Gated linear attention token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import zeros_state
from ..value_heads import add_outer, read_grouped

__all__ = ["recurrent_gated_linear_attention"]


def recurrent_gated_linear_attention(q, k, v, log_g, S0):
    """``S_t = diag(exp(log_g_t)) S_{t-1} + k_t v_tᵀ`` token by token (value head ``j`` reads q/k head ``j // r``)."""
    S = zeros_state(k, v, S0)                                                # (B, HV, Dk, Dv)
    outs = []
    for t in range(k.shape[2]):
        S = add_outer(log_g[:, :, t].exp().unsqueeze(-1) * S, k[:, :, t], v[:, :, t])
        outs.append(read_grouped(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
