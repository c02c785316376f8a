"""The delta rule and the gated delta rule across ranks: a slice's transition is a dense ``Dk × Dk`` matrix."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from ..feature_maps import FeatureMap
from ..ops.delta import delta_rule
from ..ops.gated_delta import gated_delta_rule
from .rules import Features, Local, Result, same_dtype_as_q, sequence_parallel_rule

__all__ = ['sequence_parallel_delta_rule', 'sequence_parallel_gated_delta_rule']


def _with_transition(f: Features, op: Callable[..., tuple[Tensor, Tensor]], initial_state: Optional[Tensor],
                     gate: str) -> Local:
    """The slice's map ``(A_r, B_r)`` and ``q̃`` from one run of the op's own chunk form (WY).

    Every column of the state evolves alone under the same transitions, so ``Dk`` more value columns
    of zeros, started from the identity, carry ``A_{≤t}`` beside the state: the state after the slice
    is ``[B_r | A_r]`` and the output of those columns is ``q̃_t = A_{≤t}ᵀ φ(q_t)``.
    """
    if f.first:
        out, B = op(f.v, initial_state)
        return Local(out, B, B.new_zeros(*B.shape[:3], B.shape[2]), None, gate)
    Bsz, HV, T, Dv = f.v.shape
    Dk = f.k.shape[-1]
    eye = torch.eye(Dk, dtype=f.acc, device=f.v.device).expand(Bsz, HV, Dk, Dk)
    start = torch.cat([f.v.new_zeros(Bsz, HV, Dk, Dv), eye], dim=-1)                    # [0 | I]
    out, S = op(torch.cat([f.v, f.v.new_zeros(Bsz, HV, T, Dk)], dim=-1), start)        # (B, HV, T, Dv + Dk)
    return Local(out[..., :Dv], S[..., :Dv], S[..., Dv:], out[..., Dv:], gate)


def sequence_parallel_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    group=None,
    state_exchange: str = "auto",
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """The delta rule over a sequence split across the ranks of a process group.

    The slice's map is ``S ↦ A_r S + B_r`` with ``A_r = Π_t (I − β_t k_t k_tᵀ)``, a
    ``Dk × Dk`` matrix that the op's chunk form (the WY representation) computes beside the
    state, never as a product of ``T_r`` dense matrices; the incoming state adds
    ``(A_{≤t}ᵀ φ(q_t))ᵀ S_in`` to output ``t``.

    Parameters
    ----------
    q, k, v, beta, method, chunk_size, feature_map
        As in :func:`linattn.delta_rule`, for this rank's slice.
    group, state_exchange, initial_state, return_state
        As in :func:`sequence_parallel_retention`; a map is a ``Dk × Dk`` transition plus a
        ``Dk × Dv`` state per batch and head (the chain sends states only).

    Returns
    -------
    out, state
        As in :func:`sequence_parallel_retention`.

    Raises
    ------
    RuntimeError, TypeError, ValueError
        As :func:`sequence_parallel_retention`, with the checks of :func:`linattn.delta_rule`.

    Notes
    -----
    Ranks after the first run their slice once with ``Dv + Dk`` value columns.
    """
    def local(f: Features) -> Local:
        b = same_dtype_as_q(beta, q, f.acc)
        return _with_transition(f, lambda values, start: delta_rule(
            f.q, f.k, values, b, method=method, chunk_size=chunk_size, initial_state=start, return_state=True),
            initial_state, "none")

    return sequence_parallel_rule("sequence_parallel_delta_rule", q, k, v, local, group=group,
                                  state_exchange=state_exchange, feature_map=feature_map,
                                  initial_state=initial_state, return_state=return_state)


def sequence_parallel_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    beta: Tensor,
    *,
    group=None,
    state_exchange: str = "auto",
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """The gated delta rule (one gate per head, or per key channel) over a sequence split across ranks.

    As :func:`sequence_parallel_delta_rule` with ``A_r = Π_t diag(α_t) (I − β_t k_t k_tᵀ)``.

    Parameters
    ----------
    q, k, v, log_g, beta, method, chunk_size, feature_map
        As in :func:`linattn.gated_delta_rule`, for this rank's slice.
    group, state_exchange, initial_state, return_state
        As in :func:`sequence_parallel_delta_rule`.

    Returns
    -------
    out, state
        As in :func:`sequence_parallel_retention`.

    Raises
    ------
    RuntimeError, TypeError, ValueError
        As :func:`sequence_parallel_retention`, with the checks of :func:`linattn.gated_delta_rule`.
    """
    def local(f: Features) -> Local:
        g, b = same_dtype_as_q(log_g, q, f.acc), same_dtype_as_q(beta, q, f.acc)
        gate = "one per key channel and token" if isinstance(log_g, Tensor) and log_g.dim() == 4 else \
            "one per head and token"
        return _with_transition(f, lambda values, start: gated_delta_rule(
            f.q, f.k, values, g, b, method=method, chunk_size=chunk_size, initial_state=start, return_state=True),
            initial_state, gate)

    return sequence_parallel_rule("sequence_parallel_gated_delta_rule", q, k, v, local, group=group,
                                  state_exchange=state_exchange, feature_map=feature_map,
                                  initial_state=initial_state, return_state=return_state)
