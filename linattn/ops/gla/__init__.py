"""Gated linear attention (GLA): a data-dependent decay for every key dimension and token.

``S_t = diag(g_t) S_{t-1} + φ(k_t) v_tᵀ``, ``o_t = S_tᵀ φ(q_t)`` (Yang, Wang, Shen, Panda & Kim,
2024, arXiv:2312.06635). The recurrent form is the oracle; the chunk form halves each chunk
into blocks whose decays are products of gates (never a quotient of cumulative decays), or,
for chunks of mild decay, folds the cumulative decays into the queries and keys.
"""
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

    The chunk form (``method="chunk"``) works on chunks of ``C`` tokens rounded up to a power
    of two (the padding changes nothing). Inside a chunk the decay between key ``s`` and query
    ``t`` is the product of the gates ``g_r`` for ``s < r <= t``; the chunk is halved down to
    single tokens, and the queries of each block's later half meet the keys of its earlier half
    in one matmul, ``(q ⊙ Π_{h<=r<=t} g_r)(k ⊙ Π_{s<r<h} g_r)ᵀ`` with ``h`` the later half's
    first token (:mod:`linattn.ops._decay`). Every factor is a product of gates ``<= 1`` over
    its own range, never a quotient of cumulative decays, so a strong decay underflows to 0
    instead of overflowing, and the gradient of a strongly decaying gate keeps its relative
    accuracy. A chunk whose decay is mild (``Σ log_g >= −16`` in every channel, every ``log_g >=
    −1``, and inputs far from overflow) takes one matmul instead, ``(q ⊙ e^{b})(k ⊙ e^{−b})ᵀ``
    with ``b`` the cumulative log-gate from the chunk's start (GLA's chunkwise form before its
    secondary chunking): its factors lie in ``[e^{-16}, e^{16}]``, and its rounding is float32's
    (measured at the bound: at most 6e-7 of the largest output or gradient; the gradient of one
    gate of ``e^{-1}`` among slow ones loses about a factor 20 of relative accuracy, see
    :data:`linattn.ops._decay.MILD_GATE`). The backward pass is written by hand; it stores the scores (``C`` numbers per
    token), the decays from and to the chunk's ends and the chunk start states
    (``B·H·(T/C)·Dk·Dv``) and recomputes each level's products. For second derivatives
    (``create_graph=True``), ``torch.func`` transforms, forward-mode AD and ``torch.compile``,
    autograd differentiates the same equations op by op. With ``LINATTN_CPU_KERNEL=1`` on the CPU
    (float32/float64), ``method="chunk"`` runs the recurrence as a compiled loop instead
    (:func:`linattn.kernels.cpu.decay_cpu`; see :func:`retention`): in the run described in
    :func:`linattn.delta_rule`, forward+backward took 28.1 ms where the chunk form took 47.7 ms.

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
    _checks.check_log_gate(log_g, "log_g", "finite and <= 0 (g = exp(log_g) in (0, 1])")
    with no_autocast(q.device):
        log_g = log_g.to(p.acc)
        out, S = run(p, lambda: recurrent_gated_linear_attention(p.q, p.k, p.v, log_g, p.S0),
                     lambda q, k, v: _chunk(q, k, v, log_g, p.S0, p.chunk_size))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, log_g, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("gated_linear_attention", q, k, v, log_g, S0) == "cpu":
        from ...kernels.cpu import decay_cpu

        alpha = log_g.clamp(min=LOG_G_FLOOR).exp_()                   # in place: clamp's output is our own
        return decay_cpu(q, k, v, alpha, zeros_state(k, v, S0), chunk_size)
    return chunk_gated_linear_attention(q, k, v, log_g, S0, chunk_size)
