"""The delta rule token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import read, zeros_state

__all__ = ["recurrent_delta_rule"]


def recurrent_delta_rule(q, k, v, beta, S0):
    """``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ`` token by token."""
    S = zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        k_t = k[:, :, t]                                                 # (B, H, Dk)
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - read(k_t, S))  # (B, H, Dv)
        S = torch.addcmul(S, k_t.unsqueeze(-1), u.unsqueeze(-2))
        outs.append(read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
