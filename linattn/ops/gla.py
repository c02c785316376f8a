"""Gated linear attention (GLA): a data-dependent decay for every key dimension and token.

``S_t = diag(g_t) S_{t-1} + φ(k_t) v_tᵀ``, ``o_t = S_tᵀ φ(q_t)`` (Yang, Wang, Shen, Panda & Kim,
2024, arXiv:2312.06635). The recurrent form is the oracle; the chunk form uses sub-chunks and
range sums of the log-gates (every exponent <= 0).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from ._common import (LOG_G_FLOOR, ChunkDecay, Result, check_like_q, finish, from_chunks, num_chunks, prepare,
                      read, run, scan, subchunk_length, to_chunks, zeros_state)
from .._numerics import no_autocast
from ..feature_maps import FeatureMap

__all__ = ['gated_linear_attention']


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """Gated linear attention: a data-dependent decay for every key dimension and token.

    The recurrent form of GLA (Yang, Wang, Shen, Panda & Kim, 2024, arXiv:2312.06635),
    without the output gate and normalisation of the full layer::

        S_t = diag(g_t) S_{t-1} + φ(k_t) v_tᵀ,      o_t = S_tᵀ φ(q_t),      g_t = exp(log_g_t)

    equivalently ``o_t = Σ_{s<=t} Σ_d φ(q_t)_d φ(k_s)_d exp(b_{t,d} − b_{s,d}) v_s`` with
    ``b_t = Σ_{r<=t} log_g_r``. The gate is passed in log space (in the paper
    ``g_t = sigmoid(·)^{1/τ}``, i.e. ``log_g = logsigmoid(·)/τ``), so that strong decays stay
    exact: ``log_g = -27.6`` (``g = 1e-12``) is fine. ``log_g = 0`` everywhere gives
    unnormalised causal linear attention.

    The chunk form splits each chunk into sub-chunks of ``L = min(C, 16)`` tokens. Inside a
    sub-chunk the decay between key ``s`` and query ``t`` is the product of the gates
    ``g_r = exp(log_g_r)`` for ``s < r <= t``, built row by row. Across sub-chunks and chunks
    it is a product of exps of range sums over disjoint ranges, ``exp(b_t − b_s) =
    exp(Σ_{r_i<r<=t}) · exp(Σ of the sub-chunks in between) · exp(Σ_{s<r<=e_j})``, every
    exponent ``<= 0``. Every range sum is computed from its own terms, never as a difference
    of cumulative sums, so the gradient of a strongly decaying gate keeps its relative
    accuracy. Memory of the forward pass is about ``B·H·T·Dk·(L/2 + C/L + 4)`` numbers besides
    the inputs (and ``B·H·(T/C)·Dk·Dv`` for the chunk states).

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, H, T, Dv)`` values.
    log_g : Tensor
        ``(B, H, T, Dk)`` log of the gates, finite and ``<= 0``, same dtype and device as
        ``q``. ``Dk`` is the key dimension after the feature map (``D`` when
        ``feature_map`` is None).
    method, chunk_size, feature_map, initial_state, return_state
        As in :func:`retention`.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs).
    state : Tensor
        Only if ``return_state``: ``(B, H, Dk, Dv)``, float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError
        As :func:`retention`; a ``log_g`` that is not a tensor or has another dtype than ``q``.
    ValueError
        As :func:`retention`; ``log_g`` of the wrong shape, on another device, with a
        positive, NaN or infinite entry.
    """
    p = prepare("gated_linear_attention", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
    B, H, T, Dk = p.k.shape
    mapped = "" if feature_map is None else f" (k has {k.shape[-1]} dims, {Dk} features after feature_map)"
    check_like_q(log_g, "log_g", (B, H, T, Dk), "(batch, heads, seq, key features)", q, extra=mapped)
    _checks.check_values(torch.isfinite(log_g) & (log_g <= 0), "log_g", "finite and <= 0 (g = exp(log_g) in (0, 1])",
                         log_g)
    with no_autocast(q.device):
        log_g = log_g.to(p.acc)
        out, S = run(p, lambda: _gla_recurrent(p.q, p.k, p.v, log_g, p.S0),
                      lambda q, k, v: _gla_chunk(q, k, v, log_g, p.S0, p.chunk_size))
    return finish(out, S, q.dtype, p.return_state)


# --------------------------------------------------------------------------- the two forms


def _gla_recurrent(q, k, v, log_g, S0):
    """``S_t = diag(exp(log_g_t)) S_{t-1} + k_t v_tᵀ`` token by token."""
    S = zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        S = torch.addcmul(log_g[:, :, t].exp().unsqueeze(-1) * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append(read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def _gla_chunk(q, k, v, log_g, S0, chunk_size):
    """Chunkwise GLA with sub-chunks (see :func:`gated_linear_attention`).

    Each chunk is zero-padded to a multiple ``Cp`` of the sub-chunk length ``L``: padded
    tokens have ``k = v = q = 0`` and ``log_g = 0`` (no decay), so they change nothing.

    Every decay factor is a product of the gates ``g_r`` between two tokens (inside a
    sub-chunk), or of exps of *sums* of the log-gates over disjoint ranges, each computed
    directly as such (:class:`linattn.ops._common.ChunkDecay`), never as the difference
    ``b_t − b_s`` of two cumulative sums. So every exponent is ``<= 0``; a factor of exactly
    1 (``s = t``, or the token just before a boundary) does not depend on ``log_g`` at all;
    and the gradient of ``log_g`` is a sum of terms that each carry their decay factor, with
    no cancellation of large terms (a difference of cumulative sums makes the gradient of a
    gate of ``1e-12`` pure rounding noise in float32). A product of such factors may
    underflow to 0 where the exact value is below float32's range; so would the exact factor.

    Per chunk: ``O = A V + (Q ⊙ from_start) S``, ``S' = diag(total) S + (K ⊙ to_end)ᵀ V``,
    with ``A`` the decayed causal scores. Python loops: ``L`` rows and ``T/C`` chunk states
    (split with ``unbind``, see :func:`linattn.ops._common.scan`).
    """
    B, H, T, Dk = k.shape
    log_g = log_g.clamp(min=LOG_G_FLOOR)                               # see LOG_G_FLOOR
    C, N = num_chunks(T, chunk_size)
    L = subchunk_length(C)
    Cp = -(-C // L) * L

    def chunks(x: Tensor) -> Tensor:                                   # (B, H, N, Cp, ·)
        x = to_chunks(x, N, C)
        return x if Cp == C else F.pad(x, (0, 0, 0, Cp - C))

    qc, kc, vc, gc = (chunks(x) for x in (q, k, v, log_g))
    decay = ChunkDecay(gc, L)
    A = decay.scores(qc, kc)                                           # (B, H, N, Cp, Cp)
    out = A @ vc                                                       # (B, H, N, Cp, Dv)
    U = (kc * decay.to_end).transpose(-1, -2) @ vc                     # (B, H, N, Dk, Dv)
    S_before, S = scan(zeros_state(k, v, S0), lambda S, d, u: d * S + u, decay.total.unsqueeze(-1), U)
    out = out + (qc * decay.from_start) @ S_before                     # (B, H, N, Cp, Dv)
    return from_chunks(out[:, :, :, :C], T), S
