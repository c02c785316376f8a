"""The delta rule's chunk form, through the WY / UT representation (:mod:`linattn.ops.wy`)."""
from __future__ import annotations

from .._common import from_chunks, num_chunks, to_chunks, zeros_state
from ..wy import wy_chunk

__all__ = ["chunk_delta_rule"]


def chunk_delta_rule(q, k, v, beta, S0, chunk_size):
    """Chunkwise delta rule through the WY / UT representation (see :func:`delta_rule`)."""
    S0 = zeros_state(k, v, S0)
    B, H, T, Dk = k.shape
    C, N = num_chunks(T, chunk_size)
    qc, kc, vc = (to_chunks(x, N, C) for x in (q, k, v))               # (B, H, N, C, ·)
    bc = to_chunks(beta.unsqueeze(-1), N, C)                          # (B, H, N, C, 1)
    out, S = wy_chunk(qc, kc, vc, bc, S0)                             # see linattn.ops.wy
    return from_chunks(out, T), S
