"""The delta rule (DeltaNet): each token corrects what the state recalls for its key."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ... import _checks, backends
from ..._numerics import no_autocast
from ...feature_maps import FeatureMap
from .._common import Result, check_like_q, output_and_state, prepare, run, zeros_state
from .chunk import chunk_delta_rule
from .naive import recurrent_delta_rule

__all__ = ["delta_rule", "recurrent_delta_rule", "chunk_delta_rule"]


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    """The delta rule (DeltaNet): each token corrects what the state recalls for its key.

    The delta-rule update of Schlag, Irie & Schmidhuber (2021, arXiv:2102.11174), trained
    chunkwise as in Yang, Wang, Zhang, Shen & Kim (2024, arXiv:2406.06484, sec. 3)::

        S_t = S_{t-1} + β_t φ(k_t) (v_t − S_{t-1}ᵀ φ(k_t))ᵀ,      o_t = S_tᵀ φ(q_t)

    **Keys are usually L2-normalised** (``torch.nn.functional.normalize(k, dim=-1)``):
    then ``I − β_t k_t k_tᵀ`` has norm ``<= 1`` for ``β_t`` in ``[0, 2]`` and the recurrence
    is stable. This function does *not* normalise: with large keys the state can grow
    without bound (and the chunk and recurrent forms then disagree by rounding that has
    grown too). A ``feature_map`` is applied to ``q`` and ``k`` before anything else, so a
    map that should end with a normalisation must include it.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys (see the note on normalising keys).
    v : Tensor
        ``(B, HV, T, Dv)`` values; ``HV`` a multiple of ``H`` (grouped value heads: value
        head ``j`` reads q/k head ``j // (HV // H)``; no repeated copy of ``q`` or ``k`` is made).
    beta : Tensor
        ``(B, HV, T)`` writing strengths in ``[0, 2]``, on ``q``'s device, in ``q``'s dtype or
        float32 (float32 with half ``q``, ``k``, ``v`` is computed in float32).
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it. A smaller
        chunk shrinks the products with a ``C × C`` factor, not those with the ``Dk × Dv`` state
        (appendix A, §A.2, counts them); measure ``chunk_size=32`` against 64 on your machine.
    method, feature_map
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
        As :func:`retention`; a ``beta`` that is not a tensor or whose dtype is neither ``q``'s
        nor the computation's (float32 for half inputs).
    ValueError
        As :func:`retention`; ``beta`` of the wrong shape, on another device, or with an
        entry outside ``[0, 2]`` (NaN included).
    RuntimeError
        Under ``torch.jit.trace``, as :func:`retention`.
    """
    p = prepare("delta_rule", q, k, v, method, chunk_size, feature_map, initial_state, return_state, scale,
                cu_seqlens, attention_mask)
    B, _, T, _ = p.k.shape
    check_like_q(beta, "beta", (B, v.shape[1], T), "(batch, heads, seq)", q)
    _checks.check_values((beta >= 0) & (beta <= 2), "beta", "in [0, 2]", beta)
    with no_autocast(q.device):
        out, S = run(p, recurrent_delta_rule, lambda q, k, v, beta, S0: _chunk(q, k, v, beta, S0, p.chunk_size),
                     p.per_token(beta))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, beta, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    S0 = zeros_state(k, v, S0)
    if backends.select("delta_rule", q, k, v, beta, S0) == "cpu":
        from ...kernels.cpu import delta_rule_cpu

        return delta_rule_cpu(q, k, v, beta, None, S0, chunk_size)
    return chunk_delta_rule(q, k, v, beta, S0, chunk_size)
