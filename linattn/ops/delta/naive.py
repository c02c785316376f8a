"""The delta rule token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import zeros_state
from ..value_heads import add_outer, read_grouped

__all__ = ["recurrent_delta_rule"]


def recurrent_delta_rule(q, k, v, beta, S0):
    """``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ`` token by token (value head ``j`` reads q/k head ``j // r``)."""
    S = zeros_state(k, v, S0)                                                # (B, HV, Dk, Dv)
    outs = []
    for t in range(k.shape[2]):
        k_t = k[:, :, t]                                                     # (B, H, Dk)
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - read_grouped(k_t, S))   # (B, HV, Dv)
        S = add_outer(S, k_t, u)
        outs.append(read_grouped(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
