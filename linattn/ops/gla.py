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
from ._common import (Result, SegmentSums, check_like_q, finish, from_chunks, num_chunks, prepare, read, run, scan,
                        to_chunks, zeros_state)
from .._numerics import masked_matmul, no_autocast
from ..feature_maps import FeatureMap

__all__ = ['gated_linear_attention']


def gla_subchunk(C: int) -> int:
    """Sub-chunk length ``L`` of the GLA chunk form: ``min(C, 16)``.

    Each sub-chunk builds its ``(L, L)`` scores row by row (``~L/2 · Dk`` products per
    token), pairs of sub-chunks of a chunk a ``(C/L, C, Dk)`` tensor per chunk (``(C/L) · Dk``
    per token). Measured on CPU (1 thread, T = 4096, H = 4, D = 64) at ``C = 64``: ``L = 16``
    forward 40 ms, ``8`` 45 ms, ``32`` 50 ms, ``4`` 98 ms; forward+backward 155, 196, 206
    and 274 ms.
    """
    return min(C, 16)


# The chunk form of GLA clamps log_g from below at this value before summing it over ranges.
# Without the clamp, float32 sums of accepted log-gates such as -1e38 overflow to -inf, and
# the 0/1 range-sum matmuls (SegmentSums) then form -inf · 0 = NaN. Why -1000:
# - exp(-1000) is exactly 0 in float32 (exp underflows to 0 below about -103.97, subnormals
#   included) and in float64 (below about -745.13), the two dtypes the chunk form computes in.
#   Every exponent is a sum of non-positive log-gates, and rounding is monotone, so a range
#   that holds a clamped entry sums to <= -1000 with or without the clamp: its factor is
#   exactly 0 either way. The result is bit-identical to the unclamped computation whenever
#   that one did not overflow, i.e. for every realistic input.
# - A sum of C entries >= -1000 is >= -1000·C, finite in float32 for any C < 3.4e35: no
#   chunk length can overflow it.
# - Below the clamp the gradient of log_g is exactly 0 (clamp passes none), as it is in the
#   recurrent form, where d exp(log_g)/d log_g = exp(log_g) underflows to 0 as well.
_LOG_G_FLOOR = -1000.0



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
                      lambda safe: _gla_chunk(p.q, p.k, p.v, log_g, p.S0, p.chunk_size, safe))
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


def _gla_chunk(q, k, v, log_g, S0, chunk_size, safe=False):
    """Chunkwise GLA with sub-chunks (see :func:`gated_linear_attention`).

    Each chunk is zero-padded to a multiple ``Cp`` of the sub-chunk length ``L``: padded
    tokens have ``k = v = q = 0`` and ``log_g = 0`` (no decay), so they change nothing.

    Every decay factor is a product of the gates ``g_r`` between two tokens (inside a
    sub-chunk), or of exps of *sums* of the log-gates over disjoint ranges, each computed
    directly as such (by matmul with a 0/1 matrix, see :class:`linattn.ops._common.SegmentSums`), never as the
    difference ``b_t − b_s`` of two cumulative sums. So every exponent is ``<= 0``; a
    factor of exactly 1 (``s = t``, or the token just before a boundary) does not depend
    on ``log_g`` at all; and the gradient of ``log_g`` is a sum of terms that each carry
    their decay factor, with no cancellation of large terms (a difference of cumulative
    sums makes the gradient of a gate of ``1e-12`` pure rounding noise in float32). A
    product of such factors may underflow to 0 where the exact value is below float32's
    range; so would the exact factor.

    Rough cost per token and head: ``Dk`` exps for the gates and a few more for the range
    sums; ``~L/2 · Dk`` products for the sub-chunk scores; ``(C/L) · Dk`` products for the
    pairs of sub-chunks; matmuls of plain chunked linear attention for the rest. Python
    loops: ``L`` rows and ``T/C`` chunk states (split with ``unbind``, see :func:`scan`).
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    log_g = log_g.clamp(min=_LOG_G_FLOOR)                              # see _LOG_G_FLOOR
    C, N = num_chunks(T, chunk_size)
    L = gla_subchunk(C)
    n_sub = -(-C // L)
    Cp = n_sub * L

    def chunks(x: Tensor) -> Tensor:                                   # (B, H, N, Cp, ·)
        x = to_chunks(x, N, C)
        return x if Cp == C else F.pad(x, (0, 0, 0, Cp - C))

    qc, kc, vc, gc = (chunks(x) for x in (q, k, v, log_g))
    sums = SegmentSums(L, n_sub, q.dtype, q.device)
    sub = (B, H, N, n_sub, L)
    q_s, k_s, v_s, g_s = qc.view(*sub, Dk), kc.view(*sub, Dk), vc.view(*sub, Dv), gc.view(*sub, Dk)

    # Diagonal sub-chunk blocks, row by row: W_t = [W_{t-1} ⊙ g_t ; k_t] holds the keys s <= t
    # of the sub-chunk decayed to t, k_s ⊙ Π_{s<r<=t} g_r (a product of the gates in the range,
    # each g_r = exp(log_g_r) <= 1: no exp of a positive number, no difference of sums, and
    # autograd differentiates it by multiplications only). Row t of the scores is W_t q_t.
    # (The tokens are split with unbind once: slicing inside the loop would make autograd
    # write a zero tensor of the full size for every slice in the backward pass.)
    gates, k_t, q_t = (x.unsqueeze(-2).unbind(-3) for x in (g_s.exp(), k_s, q_s))  # L × (B, H, N, n_sub, 1, Dk)
    W = k_t[0]                                                         # (B, H, N, n_sub, 1, Dk)
    rows = [F.pad((W * q_t[0]).sum(-1), (0, L - 1))]                   # row 0: (B, H, N, n_sub, L)
    for t in range(1, L):
        W = torch.cat([W * gates[t], k_t[t]], dim=-2)                  # (B, H, N, n_sub, t+1, Dk)
        rows.append(F.pad((W * q_t[t]).sum(-1), (0, L - 1 - t)))       # (B, H, N, n_sub, L)
    A_diag = torch.stack(rows, dim=-2)                                 # (B, H, N, n_sub, L(t), L(s))
    if safe:   # keep a NaN/inf of a later token out of earlier rows (see _run)
        out = masked_matmul(A_diag, v_s, sums.inclusive).view(B, H, N, Cp, Dv)
    else:
        out = (A_diag @ v_s).view(B, H, N, Cp, Dv)

    # Every other factor exp(Σ_{s<r<=t} log_g_r) (s before the sub-chunk of t) is a product
    # of exps of non-positive range sums over disjoint ranges: exp(Σ_{s<r<=e}) to the end e of
    # the key's sub-chunk (one per token), exp(Σ of the totals of the sub-chunks strictly in
    # between) (one per pair of sub-chunks, or per sub-chunk and chunk boundary) and
    # exp(Σ_{r_i<r<=t}) from the start of the query's sub-chunk (one per token). So only
    # T·Dk exps are per token, besides the gates, and no exponent is ever positive.
    q_rel = q_s * (sums.inclusive @ g_s).exp()                         # (B, H, N, n_sub, L, Dk)
    k_end = k_s * (sums.after @ g_s).exp()                             # (B, H, N, n_sub, L, Dk)
    totals = g_s.sum(-2)                                               # (B, H, N, n_sub, Dk)

    # Blocks between sub-chunks of a chunk: key s in sub-chunk j < i, query t in sub-chunk i.
    # The pair factor is multiplied by 0 for j >= i (an empty sum there: a finite factor 1).
    if n_sub > 1:
        between = (sums.between @ totals).view(B, H, N, n_sub, n_sub, 1, Dk)  # [i, j]: Σ_{j<m<i} totals
        pair = between.exp() * sums.earlier                            # (B, H, N, n_sub(i), n_sub(j), 1, Dk)
        k_rel = (k_end.unsqueeze(3) * pair).view(B, H, N, n_sub, Cp, Dk)   # (B, H, N, n_sub(i), Cp, Dk)
        A_off = (q_rel @ k_rel.transpose(-1, -2)).view(B, H, N, Cp, Cp)  # (B, H, N, Cp(t), Cp(s))
        if safe:
            A_off = A_off.masked_fill(sums.earlier_tokens == 0, 0.0)
            out = out + masked_matmul(A_off, vc, sums.earlier_tokens)
        else:
            out = out + A_off @ vc

    # Between chunks: a query reads the state with exp(Σ_{r<=t}) (from the chunk's start), a
    # key enters it with exp(Σ_{s<r<=Cp}) (to the chunk's end), the state decays by the total.
    q_chunk = (q_rel * (sums.earlier_total @ totals).exp().unsqueeze(-2)).view(B, H, N, Cp, Dk)
    k_chunk = (k_end * (sums.later_total @ totals).exp().unsqueeze(-2)).view(B, H, N, Cp, Dk)
    U = k_chunk.transpose(-1, -2) @ vc                                 # (B, H, N, Dk, Dv)
    chunk_decay = totals.sum(-2).exp().unsqueeze(-1)                   # (B, H, N, Dk, 1)
    S_before, S = scan(zeros_state(k, v, S0), lambda S, d, u: d * S + u, chunk_decay, U)
    out = out + q_chunk @ S_before                                     # (B, H, N, Cp, Dv)
    return from_chunks(out[:, :, :, :C], T), S
