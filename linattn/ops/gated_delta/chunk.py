"""The gated delta rule's chunk form: the WY / UT representation with gates inside the chunk
(:mod:`linattn.ops.wy`, decays from :mod:`linattn.ops.decay`)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..._numerics import LOG_G_FLOOR
from .._common import from_chunks, num_chunks, to_chunks, zeros_state
from ..decay import padded_chunk
from ..wy import wy_chunk, wy_chunk_channel

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(q, k, v, log_g, beta, S0, chunk_size):
    """Chunkwise gated delta rule through the WY / UT representation (see :func:`linattn.gated_delta_rule`)."""
    B, H, T, Dk = k.shape
    per_channel = log_g.dim() == 4
    log_g = (log_g if per_channel else log_g.unsqueeze(-1)).clamp(min=LOG_G_FLOOR)   # see LOG_G_FLOOR
    S0 = zeros_state(k, v, S0)
    C, N = num_chunks(T, chunk_size)
    Cp = padded_chunk(C) if per_channel else C

    def chunks(x: Tensor) -> Tensor:                                    # (B, H, N, Cp, ·)
        x = to_chunks(x, N, C)
        return x if Cp == C else F.pad(x, (0, 0, 0, Cp - C))

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, log_g, beta.unsqueeze(-1)))
    if per_channel:                                                     # linattn.ops.wy with linattn.ops.decay
        out, S = wy_chunk_channel(qc, kc, vc, bc, S0, gc)
        return from_chunks(out[:, :, :, :C], T), S
    out, S = wy_chunk(qc, kc, vc, bc, S0, gc)        # one gate per head: linattn.ops.wy
    return from_chunks(out, T), S
