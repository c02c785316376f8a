"""What the sequence-parallel decay and delta rules share: checks, the handshake, the affine scan, the correction.

Each rank runs its slice once from the zero state and returns what the incoming state ``S_in``
changes: the output gains ``q̃_tᵀ S_in`` (``q̃_t = A_{≤t}ᵀ φ(q_t)``, ``A_{≤t}`` the product of the
slice's transitions up to ``t``) and the state after the slice is ``A_r S_in + B_r``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from .. import _checks
from .._checks import position_dependent
from .._numerics import no_autocast
from ..feature_maps import resolve_feature_map
from .affine import anchored, apply_transition, exchange_states
from .agreement import (_GATES, _RULE_FIELDS, _RULES, STATE_EXCHANGES, _check_state_exchange, _dtype_code,
                        _feature_map_name, _float_bits, _handshake, _name_hash)
from .comm import _ranks

__all__: list[str] = []

Result = Union[Tensor, tuple[Tensor, Tensor]]


@dataclass
class Features:
    """A rank's inputs in the accumulation dtype, φ applied (what the single-process op is called with)."""

    q: Tensor               # (B, H, T, Dk)
    k: Tensor               # (B, H, T, Dk)
    v: Tensor               # (B, HV, T, Dv)
    acc: torch.dtype
    first: bool             # rank 0 of the group: starts from initial_state, needs no transition


@dataclass
class Local:
    """One rank's slice run alone (rank 0: from ``initial_state``; the others: from the zero state)."""

    out: Tensor                      # (B, HV, T, Dv), accumulation dtype
    B: Tensor                        # (B, HV, Dk, Dv): the state after the slice
    A: Tensor                        # the slice's transition: (B, HV, 1), (B, HV, Dk) or (B, HV, Dk, Dk); 0 on rank 0
    q_tilde: Optional[Tensor]        # (B, HV, T, Dk): out_t += q̃_tᵀ S_in (None on rank 0)
    gate: str                        # one of agreement._GATES
    gamma: int = 0                   # retention: a hash of γ's values (the ranks must agree on them)


def same_dtype_as_q(x, q: Tensor, acc: torch.dtype):
    """A gate in q's dtype is moved to the accumulation dtype with q; any other is left for the op to judge."""
    return x.to(acc) if isinstance(x, Tensor) and x.dtype == q.dtype else x


def tensor_hash(x: Tensor) -> int:
    """A 64-bit hash of a tensor's float64 values, the same in every process."""
    return _name_hash(x.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy().tobytes().hex())


def sequence_parallel_rule(caller: str, q: Tensor, k: Tensor, v: Tensor, local: Callable[[Features], Local], *,
                           group, state_exchange, feature_map, initial_state, return_state) -> Result:
    """Run ``local`` on this rank's slice, agree with the other ranks, exchange the maps, correct.

    ``local(features)`` calls the single-process op (which checks the gates and options) and returns
    the :class:`Local` of the slice. Errors raised here or in ``local`` reach every rank through the
    handshake, so no rank waits in a collective that another never enters.
    """
    ranks = _ranks(group, caller)
    fields, error, loc, name = None, None, None, ""
    try:
        exchange = _check_state_exchange(state_exchange, ranks)
        return_state = _checks.check_bool(return_state, "return_state")
        _checks.check_qkv(q, k, v, causal=True, causal_only=caller, grouped_values=True)
        dtype_code = _dtype_code(q.dtype)
        phi = resolve_feature_map(feature_map)
        name = _feature_map_name(phi)
        if position_dependent(phi):
            raise ValueError(
                f"{caller}: the position-dependent feature_map {type(phi).__name__} is not supported across "
                "ranks; compute the features yourself with phi(x, offset=<tokens on earlier ranks>) and pass "
                "feature_map=None")
        if initial_state is not None and ranks.rank > 0:
            raise ValueError(
                f"{caller}: initial_state is the state before the sequence's first token, which rank 0 holds; "
                f"rank {ranks.rank} must pass None (its incoming state comes from the earlier ranks)")
        acc = _checks.accumulation_dtype(q.dtype)
        with no_autocast(q.device):
            phi_q, phi_k = _checks.apply_feature_map(phi, q.to(acc), k.to(acc))
            loc = local(Features(phi_q, phi_k, v.to(acc), acc, ranks.rank == 0))
        needs_grad = torch.is_grad_enabled() and (loc.out.requires_grad or loc.B.requires_grad)
        fields = {"rule": _RULES.index(caller.removeprefix("sequence_parallel_")), "batch": q.shape[0],
                  "heads": q.shape[1], "value_heads": v.shape[1], "key_dim": phi_k.shape[-1],
                  "value_dim": v.shape[-1], "gate": _GATES.index(loc.gate), "feature_map": _name_hash(name),
                  "gamma": loc.gamma, "scale": _float_bits(1.0), "state_exchange": STATE_EXCHANGES.index(exchange),
                  "dtype": dtype_code, "grad": int(needs_grad), "seq": q.shape[2]}
    except Exception as err:  # reported to the other ranks by the handshake, raised here after it
        error = err
    _handshake(ranks, fields, error, caller, _RULE_FIELDS[1:-1], name, names=_RULE_FIELDS)
    with no_autocast(q.device):
        incoming = exchange_states(loc.A, loc.B, ranks, exchange, fields["grad"])     # (B, HV, Dk, Dv)
        if ranks.rank == 0:                      # the slice already started from initial_state
            out, S = anchored(loc.out, incoming), anchored(loc.B, incoming)
        else:
            out = loc.out + loc.q_tilde @ incoming                                 # (B, HV, T, Dv)
            S = apply_transition(loc.A, incoming) + loc.B
    out = out.to(q.dtype)
    return (out, S.contiguous()) if return_state else out
