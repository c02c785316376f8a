"""The gated delta rule (Gated DeltaNet; Kimi Delta Attention with one gate per key channel)."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ... import _checks, backends
from ..._numerics import LOG_G_FLOOR, no_autocast
from ...feature_maps import FeatureMap
from .._common import Result, check_like_q, output_and_state, prepare, run, zeros_state
from .chunk import chunk_gated_delta_rule
from .naive import recurrent_gated_delta_rule

__all__ = ["gated_delta_rule", "recurrent_gated_delta_rule", "chunk_gated_delta_rule"]


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    beta: Tensor,
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
    """The gated delta rule: a decaying state that each token corrects toward its value.

    Per head, with ``α_t = exp(log_g_t)`` (a scalar, or one value per key channel)::

        S'_t = diag(α_t) S_{t-1}
        S_t  = S'_t + β_t φ(k_t) (v_t − S'_tᵀ φ(k_t))ᵀ           # = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
        o_t  = S_tᵀ φ(q_t)

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, HV, T, Dv)`` values; ``HV`` a multiple of ``H`` (grouped value heads: value
        head ``j`` reads q/k head ``j // (HV // H)``, as in Qwen3-Next's 16 q/k and 32 value
        heads; no repeated copy of ``q`` or ``k`` is made).
    log_g : Tensor
        ``log α``, finite and ``<= 0``: ``(B, HV, T)`` (one gate per value head and token) or
        ``(B, HV, T, Dk)`` (one per key channel; ``Dk`` is the key dimension after
        ``feature_map``); on ``q``'s device, in ``q``'s dtype or float32 (float32 with half
        ``q``, ``k``, ``v`` is computed in float32).
    beta : Tensor
        ``(B, HV, T)`` writing strengths in ``[0, 2]``, dtype and device as ``log_g``.
    method : str
        ``"auto"`` (= ``"chunk"``), ``"chunk"`` or ``"recurrent"``; case-insensitive.
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it. On a CPU,
        measure ``chunk_size=32`` against it (see :func:`linattn.delta_rule`).
    feature_map : str, callable or None
        φ applied to ``q`` and ``k`` first, as in :func:`linattn.linear_attention`; None
        (the default) uses them as given.
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
        ``(B, HV, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs, float64
        for float64).
    state : Tensor
        Only if ``return_state``: ``(B, HV, Dk, Dv)`` (``(N, HV, Dk, Dv)`` with ``cu_seqlens``),
        float32 (float64 for float64 inputs). Resuming from it with the rest of a sequence
        equals one run.

    Raises
    ------
    TypeError
        As :func:`retention`; a ``log_g`` or ``beta`` that is not a tensor or whose dtype is
        neither ``q``'s nor the computation's (float32 for half inputs).
    ValueError
        As :func:`retention`; ``log_g`` not ``(B, HV, T)`` or ``(B, HV, T, Dk)``, on another
        device, with a positive, NaN or infinite entry; ``beta`` of the wrong shape or device,
        or with an entry outside ``[0, 2]``.
    RuntimeError
        Under ``torch.jit.trace``, as :func:`retention`.

    Notes
    -----
    Causality holds whatever the values: a NaN or infinity at position ``t`` never changes
    an output before ``t`` (in both methods). Autocast is switched off inside.
    """
    p = prepare("gated_delta_rule", q, k, v, method, chunk_size, feature_map, initial_state, return_state, scale,
                cu_seqlens, attention_mask)
    B, _, T, Dk = p.k.shape
    HV = v.shape[1]
    if isinstance(log_g, Tensor) and log_g.dim() == 3:
        check_like_q(log_g, "log_g", (B, HV, T), "(batch, heads, seq)", q)
    else:
        mapped = "" if feature_map is None else f" (k has {k.shape[-1]} dims, {Dk} features after feature_map)"
        check_like_q(log_g, "log_g", (B, HV, T, Dk),
                     "(batch, heads, seq) or (batch, heads, seq, key features)", q, extra=mapped)
    check_like_q(beta, "beta", (B, HV, T), "(batch, heads, seq)", q)
    _checks.check_log_gate(log_g, "log_g", "finite and <= 0 (α = exp(log_g) in (0, 1])")
    _checks.check_values((beta >= 0) & (beta <= 2), "beta", "in [0, 2]", beta)
    with no_autocast(q.device):
        out, S = run(p, recurrent_gated_delta_rule,
                     lambda q, k, v, log_g, beta, S0: _chunk(q, k, v, log_g, beta, S0, p.chunk_size),
                     p.per_token(log_g), p.per_token(beta))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, log_g, beta, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("gated_delta_rule", q, k, v, log_g, beta, S0) == "cpu":
        from ...kernels.cpu import delta_rule_cpu

        g = (log_g if log_g.dim() == 4 else log_g.unsqueeze(-1)).clamp(min=LOG_G_FLOOR)   # see LOG_G_FLOOR
        return delta_rule_cpu(q, k, v, beta, g, zeros_state(k, v, S0), chunk_size)
    return chunk_gated_delta_rule(q, k, v, log_g, beta, S0, chunk_size)
