"""The gated delta rule token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import read, zeros_state

__all__ = ["recurrent_gated_delta_rule"]


def recurrent_gated_delta_rule(q, k, v, log_g, beta, S0):
    """Token by token: decay ``S`` by ``α_t`` (per head or per key channel), then the delta step."""
    log_g = log_g if log_g.dim() == 4 else log_g.unsqueeze(-1)
    S = zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        S = log_g[:, :, t].exp().unsqueeze(-1) * S                      # diag(α_t) S_{t-1}
        k_t = k[:, :, t]                                                # (B, H, Dk)
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - read(k_t, S))  # (B, H, Dv)
        S = torch.addcmul(S, k_t.unsqueeze(-1), u.unsqueeze(-2))
        outs.append(read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
