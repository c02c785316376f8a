"""Retention token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import zeros_state
from ..value_heads import add_outer, read_grouped

__all__ = ["recurrent_retention"]


def recurrent_retention(q, k, v, gamma, S0):
    """``S_t = γ S_{t-1} + k_t v_tᵀ`` token by token; gamma ``(HV,)`` (value head ``j`` reads q/k head ``j // r``)."""
    S = zeros_state(k, v, S0)                                                # (B, HV, Dk, Dv)
    g = gamma.view(1, -1, 1, 1)
    outs = []
    for t in range(k.shape[2]):
        S = add_outer(g * S, k[:, :, t], v[:, :, t])
        outs.append(read_grouped(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
