"""Retention and GLA across ranks: a slice's transition is diagonal, a decay per head or per key channel."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .._numerics import LOG_G_FLOOR
from ..feature_maps import FeatureMap
from ..ops.gla import gated_linear_attention
from ..ops.retention import retention
from .rules import Features, Local, Result, same_dtype_as_q, sequence_parallel_rule, tensor_hash

__all__ = ['sequence_parallel_retention', 'sequence_parallel_gated_linear_attention']


def _decayed(x: Tensor, cum_log: Tensor) -> tuple[Tensor, Tensor]:
    """``q̃_t = x_t ⊙ exp(Σ_{s≤t} log g_s)`` and the slice's decay ``exp(Σ_s log g_s)``, from cumulative logs."""
    return x * cum_log.exp(), cum_log[:, :, -1].exp()


def _per_value_head(q: Tensor, HV: int) -> Tensor:
    """``q`` ``(B, H, T, Dk)`` read by each of ``HV`` value heads: value head ``j`` reads head ``j // (HV // H)``."""
    return q if q.shape[1] == HV else q.repeat_interleave(HV // q.shape[1], dim=1)


def sequence_parallel_retention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Union[float, Tensor],
    *,
    group=None,
    state_exchange: str = "auto",
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """Retention over a sequence split across the ranks of a process group.

    Rank ``r`` holds the contiguous slice ``T_r`` of the sequence (ranks in sequence order,
    slices of any lengths ``>= 1``). Its slice maps the state ``S ↦ γ^{T_r} S + B_r``; the
    ranks compose these maps in order (the affine scan of chapter 12), and each rank adds what
    its incoming state contributes to its outputs, ``γ^{t+1} φ(q_t)ᵀ S_in``.

    Parameters
    ----------
    q, k, v, gamma, method, chunk_size, feature_map
        As in :func:`linattn.retention`, for this rank's slice (``method`` and ``chunk_size``
        choose the local algorithm and may differ between ranks). ``gamma`` is held whole by
        every rank; the ranks must pass the same values. A position-dependent feature map
        (cosFormer) is refused: pass its features with ``feature_map=None``.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the sequence, in sequence order; the default group if None.
    state_exchange : str
        How the maps travel, as in :func:`sequence_parallel_linear_attention`: ``"chain"`` (or
        ``"ring"``, the same: each rank passes one state, ``B·HV·Dk·Dv`` numbers, to the next), ``"allgather"``
        (every rank gathers every map, decay and state: ``(P-1)·B·HV·(1 + Dk·Dv)`` numbers sent
        per rank) or ``"scan"`` (``⌈log2 P⌉`` rounds of one map); ``"auto"`` is
        :data:`AUTO_STATE_EXCHANGE`. The backward sends the same with the transposed maps
        (the all-gather: states only). The three agree up to rounding.
    initial_state : Tensor, optional
        ``(B, HV, Dk, Dv)``, the state before the sequence's first token: on rank 0 only
        (the other ranks pass None).
    return_state : bool
        Also return the state after this rank's last token (on the last rank, the state of
        the whole sequence).

    Returns
    -------
    out : Tensor
        ``(B, HV, T_r, Dv)`` in the dtype of ``q``, equal to the slice of one process's output
        (``HV``: the value heads, a multiple of the ``H`` heads of ``q`` and ``k``).
    state : Tensor
        Only if ``return_state``: ``(B, HV, Dk, Dv)``, float32 (float64 for float64 inputs),
        contiguous. States are exchanged in this dtype, so half inputs send float32 states.

    Gradients flow to every rank's inputs, ``initial_state`` included; each rank's
    ``gamma.grad`` is its partial gradient (their sum over the ranks is one process's).
    With gradients, every rank must call ``backward``.

    Raises
    ------
    RuntimeError
        If torch.distributed is not initialised.
    TypeError, ValueError
        As :func:`linattn.retention` (raised on the rank whose inputs are wrong; the others
        raise a ValueError naming it); a ``group`` that is not a ProcessGroup; an unknown
        ``state_exchange``; ``initial_state`` on a rank other than 0; a position-dependent
        feature map; ranks that disagree on batch, heads, dims, dtype, feature map, ``gamma``,
        ``state_exchange`` or whether they need gradients (on every rank, after one all-gather
        of a short row of integers).
    """
    def local(f: Features) -> Local:
        out, B = retention(f.q, f.k, f.v, same_dtype_as_q(gamma, q, f.acc), method=method, chunk_size=chunk_size,
                           initial_state=initial_state, return_state=True)       # checks gamma first
        (Bsz, HV, T, _), device = f.v.shape, f.v.device
        whole = gamma if isinstance(gamma, Tensor) else torch.full((HV,), float(gamma), dtype=torch.float64)
        if f.first:
            return Local(out, B, B.new_zeros(Bsz, HV, 1), None, "fixed gamma per head", tensor_hash(whole))
        log_gamma = gamma.to(f.acc).log() if isinstance(gamma, Tensor) else whole.to(device, f.acc).log()  # (HV,)
        steps = torch.arange(1, T + 1, dtype=f.acc, device=device)                  # γ^(t+1) at token t
        q_tilde, decay = _decayed(_per_value_head(f.q, HV), (log_gamma[:, None] * steps).view(1, HV, T, 1))
        return Local(out, B, decay.expand(Bsz, HV, 1), q_tilde, "fixed gamma per head", tensor_hash(whole))

    return sequence_parallel_rule("sequence_parallel_retention", q, k, v, local, group=group,
                                  state_exchange=state_exchange, feature_map=feature_map,
                                  initial_state=initial_state, return_state=return_state)


def sequence_parallel_gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    *,
    group=None,
    state_exchange: str = "auto",
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """Gated linear attention over a sequence split across the ranks of a process group.

    The slice's map is ``S ↦ diag(exp Σ_t log g_t) S + B_r``; the incoming state adds
    ``(φ(q_t) ⊙ exp Σ_{s≤t} log g_s)ᵀ S_in`` to output ``t``.

    Parameters
    ----------
    q, k, v, log_g, method, chunk_size, feature_map
        As in :func:`linattn.gated_linear_attention`, for this rank's slice.
    group, state_exchange, initial_state, return_state
        As in :func:`sequence_parallel_retention`; a map is a decay vector of ``Dk`` numbers
        per batch and head plus a state.

    Returns
    -------
    out, state
        As in :func:`sequence_parallel_retention`.

    Raises
    ------
    RuntimeError, TypeError, ValueError
        As :func:`sequence_parallel_retention`, with the checks of
        :func:`linattn.gated_linear_attention`.
    """
    def local(f: Features) -> Local:
        gates = same_dtype_as_q(log_g, q, f.acc)
        out, B = gated_linear_attention(f.q, f.k, f.v, gates, method=method, chunk_size=chunk_size,
                                        initial_state=initial_state, return_state=True)
        if f.first:
            return Local(out, B, B.new_zeros(B.shape[:3]), None, "one per key channel and token")
        cum_log = gates.clamp(min=LOG_G_FLOOR).cumsum(dim=2)                  # (B, H, T, Dk), as the chunk form
        q_tilde, A = _decayed(_per_value_head(f.q, gates.shape[1]), cum_log)   # (B, HV, T, Dk), (B, HV, Dk)
        return Local(out, B, A, q_tilde, "one per key channel and token")

    return sequence_parallel_rule("sequence_parallel_gated_linear_attention", q, k, v, local, group=group,
                                  state_exchange=state_exchange, feature_map=feature_map,
                                  initial_state=initial_state, return_state=return_state)
