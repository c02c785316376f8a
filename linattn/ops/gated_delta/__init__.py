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
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
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
        head ``j`` reads q/k head ``j // (HV // H)``, as in flash-linear-attention and
        transformers; no repeated copy of ``q`` or ``k`` is made).
    log_g : Tensor
        ``log α``, finite and ``<= 0``, same dtype and device as ``q``: ``(B, HV, T)`` (one gate
        per value head and token) or ``(B, HV, T, Dk)`` (one per key channel; ``Dk`` is the key
        dimension after ``feature_map``).
    beta : Tensor
        ``(B, HV, T)`` writing strengths in ``[0, 2]``, same dtype and device as ``q``.
    method : str
        ``"auto"`` (= ``"chunk"``), ``"chunk"`` or ``"recurrent"``; case-insensitive.
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it. On a CPU,
        measure ``chunk_size=32`` against it (see :func:`linattn.delta_rule`).
    feature_map : str, callable or None
        φ applied to ``q`` and ``k`` first, as in :func:`linattn.linear_attention`; None
        (the default) uses them as given.
    initial_state : Tensor, optional
        ``(B, HV, Dk, Dv)``, the state before the first token.
    return_state : bool
        Also return the state after the last token.

    Returns
    -------
    out : Tensor
        ``(B, HV, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs, float64
        for float64).
    state : Tensor
        Only if ``return_state``: ``(B, HV, Dk, Dv)``, float32 (float64 for float64 inputs).
        Resuming from it with the rest of a sequence equals one run.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a ``log_g`` or ``beta`` that is not a
        tensor or has another dtype than ``q``; a non-str method; a non-int chunk size; a
        non-bool flag; an ``initial_state`` that is not a floating tensor.
    ValueError
        Wrong ranks or shapes, an empty dimension; ``log_g`` not ``(B, HV, T)`` or
        ``(B, HV, T, Dk)``, on another device, with a positive, NaN or infinite entry; ``beta``
        of the wrong shape or device, or with an entry outside ``[0, 2]``; an unknown method;
        ``chunk_size < 1``; an ``initial_state`` of the wrong shape or device; a
        position-dependent feature map with ``initial_state`` or without a fixed ``max_len``.
        Under ``torch.compile`` the checks of tensor values run inside the graph and raise
        RuntimeError with the same message.

    Notes
    -----
    Causality holds whatever the values: a NaN or infinity at position ``t`` never changes
    an output before ``t`` (in both methods). Autocast is switched off inside.
    """
    p = prepare("gated_delta_rule", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
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
        log_g = log_g.to(p.acc)                                       # (B, HV, T) or (B, HV, T, Dk)
        beta = beta.to(p.acc)
        out, S = run(p, lambda: recurrent_gated_delta_rule(p.q, p.k, p.v, log_g, beta, p.S0),
                     lambda q, k, v: _chunk(q, k, v, log_g, beta, p.S0, p.chunk_size))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, log_g, beta, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("gated_delta_rule", q, k, v, log_g, beta, S0) == "cpu":
        from ...kernels.cpu import delta_rule_cpu

        g = (log_g if log_g.dim() == 4 else log_g.unsqueeze(-1)).clamp(min=LOG_G_FLOOR)   # see LOG_G_FLOOR
        return delta_rule_cpu(q, k, v, beta, g, zeros_state(k, v, S0), chunk_size)
    return chunk_gated_delta_rule(q, k, v, log_g, beta, S0, chunk_size)
