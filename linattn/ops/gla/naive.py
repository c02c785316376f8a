"""Gated linear attention token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import read, zeros_state

__all__ = ["recurrent_gated_linear_attention"]


def recurrent_gated_linear_attention(q, k, v, log_g, S0):
    """``S_t = diag(exp(log_g_t)) S_{t-1} + k_t v_tᵀ`` token by token."""
    S = zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        S = torch.addcmul(log_g[:, :, t].exp().unsqueeze(-1) * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append(read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
