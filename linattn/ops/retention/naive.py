"""Retention token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import read, zeros_state

__all__ = ["recurrent_retention"]


def recurrent_retention(q, k, v, gamma, S0):
    """``S_t = γ S_{t-1} + k_t v_tᵀ`` token by token; gamma (H,)."""
    S = zeros_state(k, v, S0)
    g = gamma.view(1, -1, 1, 1)
    outs = []
    for t in range(k.shape[2]):
        S = torch.addcmul(g * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append(read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
