"""The gated delta rule token by token: the test oracle of its chunk form."""
from __future__ import annotations

import torch

from .._common import zeros_state
from ..value_heads import add_outer, read_grouped

__all__ = ["recurrent_gated_delta_rule"]


def recurrent_gated_delta_rule(q, k, v, log_g, beta, S0):
    """Token by token: decay ``S`` by ``α_t`` (per head or per key channel), then the delta step (value
    head ``j`` reads q/k head ``j // r``)."""
    log_g = log_g if log_g.dim() == 4 else log_g.unsqueeze(-1)
    S = zeros_state(k, v, S0)                                                # (B, HV, Dk, Dv)
    outs = []
    for t in range(k.shape[2]):
        S = log_g[:, :, t].exp().unsqueeze(-1) * S                          # diag(α_t) S_{t-1}
        k_t = k[:, :, t]                                                     # (B, H, Dk)
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - read_grouped(k_t, S))   # (B, HV, Dv)
        S = add_outer(S, k_t, u)
        outs.append(read_grouped(q[:, :, t], S))
    return torch.stack(outs, dim=2), S
