"""Gated linear attention (GLA): a data-dependent decay for every key dimension and token."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ... import _checks, backends
from ..._numerics import LOG_G_FLOOR, no_autocast
from ...feature_maps import FeatureMap
from .._common import Result, check_like_q, output_and_state, prepare, run, zeros_state
from .chunk import chunk_gated_linear_attention
from .naive import recurrent_gated_linear_attention

__all__ = ["gated_linear_attention", "recurrent_gated_linear_attention", "chunk_gated_linear_attention"]


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
) -> Result:
    """Gated linear attention: a data-dependent decay for every key dimension and token.

    The recurrent form of GLA (Yang, Wang, Shen, Panda & Kim, 2024, arXiv:2312.06635),
    without the output gate and normalisation of the full layer::

        S_t = diag(g_t) S_{t-1} + φ(k_t) v_tᵀ,      o_t = S_tᵀ φ(q_t),      g_t = exp(log_g_t)

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, HV, T, Dv)`` values; ``HV`` a multiple of ``H`` (grouped value heads: value
        head ``j`` reads q/k head ``j // (HV // H)``; no repeated copy of ``q`` or ``k`` is made).
    log_g : Tensor
        ``(B, HV, T, Dk)`` log of the gates, finite and ``<= 0``, on ``q``'s device, in ``q``'s
        dtype or float32 (float32 with half ``q``, ``k``, ``v`` is computed in float32). ``Dk``
        is the key dimension after the feature map (``D`` when ``feature_map`` is None).
    method, chunk_size, feature_map
        As in :func:`retention`.
    scale : float, optional
        Multiplies ``q`` before anything else; None (the default) means 1, unlike SDPA and
        flash-linear-attention (default ``D ** -0.5``). As in :func:`retention`.
    initial_state : Tensor, optional
        ``(B, HV, Dk, Dv)``, the state before the first token (``(N, HV, Dk, Dv)`` with
        ``cu_seqlens``).
    return_state : bool
        Also return the state after the last token.
    cu_seqlens : Tensor, optional
        A packed batch of ``N`` sequences (``B = 1``, ``N + 1`` int32/int64 offsets,
        flash-linear-attention's meaning), one state per sequence; as in :func:`retention`.
    attention_mask : Tensor, optional
        ``(B, T)``, True (1) for real tokens: a padded position neither writes nor decays the
        state, and its output is 0; as in :func:`retention`.

    Returns
    -------
    out : Tensor
        ``(B, HV, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs).
    state : Tensor
        Only if ``return_state``: ``(B, HV, Dk, Dv)`` (``(N, HV, Dk, Dv)`` with ``cu_seqlens``),
        float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError
        As :func:`retention`; a ``log_g`` that is not a tensor or whose dtype is neither ``q``'s
        nor the computation's (float32 for half inputs).
    ValueError
        As :func:`retention`; ``log_g`` of the wrong shape, on another device, with a
        positive, NaN or infinite entry.
    RuntimeError
        Under ``torch.jit.trace``, as :func:`retention`.
    """
    p = prepare("gated_linear_attention", q, k, v, method, chunk_size, feature_map, initial_state, return_state,
                scale, cu_seqlens, attention_mask)
    B, _, T, Dk = p.k.shape
    mapped = "" if feature_map is None else f" (k has {k.shape[-1]} dims, {Dk} features after feature_map)"
    check_like_q(log_g, "log_g", (B, v.shape[1], T, Dk), "(batch, heads, seq, key features)", q, extra=mapped)
    _checks.check_log_gate(log_g, "log_g", "finite and <= 0 (g = exp(log_g) in (0, 1])")
    with no_autocast(q.device):
        out, S = run(p, recurrent_gated_linear_attention,
                     lambda q, k, v, log_g, S0: _chunk(q, k, v, log_g, S0, p.chunk_size), p.per_token(log_g))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, log_g, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("gated_linear_attention", q, k, v, log_g, S0) == "cpu":
        from ...kernels.cpu import decay_cpu

        alpha = log_g.clamp(min=LOG_G_FLOOR).exp_()                   # in place: clamp's output is our own
        return decay_cpu(q, k, v, alpha, zeros_state(k, v, S0), chunk_size)
    return chunk_gated_linear_attention(q, k, v, log_g, S0, chunk_size)
