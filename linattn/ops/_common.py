"""The pieces the operator families share (private): validation, chunking, the scan, range sums."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, backends
from .._numerics import CausalPoison, all_finite, compiling, no_autocast
from ..feature_maps import resolve_feature_map
from .varlen import check_cu_seqlens

DECAY_METHODS = ("auto", "chunk", "recurrent")

Result = Union[Tensor, tuple[Tensor, Tensor]]


# --------------------------------------------------------------------------- validation


class Prepared:
    """Checked arguments: features φ(q), φ(k) and v in the accumulation dtype (padding zeroed), and the rest."""

    __slots__ = ("q", "k", "v", "S0", "acc", "method", "chunk_size", "return_state", "mask", "packing")

    def per_token(self, x: Tensor) -> Tensor:
        """A checked gate or ``β`` ``(B, HV, T[, Dk])`` in the accumulation dtype, 0 at padded positions
        (no decay, no write)."""
        x = x.to(self.acc)
        if self.mask is None:
            return x
        real = self.mask[:, None, :] if x.dim() == 3 else self.mask[:, None, :, None]
        return torch.where(real, x, 0.0)


def prepare(name, q, k, v, method, chunk_size, feature_map, initial_state, return_state, scale=None,
            cu_seqlens=None, attention_mask=None) -> Prepared:
    """The arguments every decay op shares, checked; ``q`` scaled (before φ), padding zeroed after φ."""
    refuse_tracing(name)
    _checks.check_qkv(q, k, v, causal=True, causal_only=name, grouped_values=True)
    p = Prepared()
    p.return_state = _checks.check_bool(return_state, "return_state")
    p.chunk_size = _checks.check_chunk_size(chunk_size)
    p.method = resolve_decay_method(method)
    p.acc = _checks.accumulation_dtype(q.dtype)
    scale = _checks.check_scale(scale, p.acc)
    p.mask = _checks.check_attention_mask(attention_mask, k)                 # (B, T) bool, True = real token
    p.packing = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], attention_mask)
    phi = resolve_feature_map(feature_map)
    _checks.check_position_dependent(phi, causal=True, resumed=initial_state is not None, same_length=True,
                                     caller=name)
    if p.packing is not None and _checks.position_dependent(phi):
        raise ValueError(f"{name}: the position-dependent feature_map {type(phi).__name__} cannot see where the "
                         "sequences of a packed batch (cu_seqlens) start; compute the features per sequence and "
                         "pass feature_map=None")
    with no_autocast(q.device):
        q = q.to(p.acc) if scale is None else q.to(p.acc) * scale
        p.q, p.k = _checks.apply_feature_map(phi, q, k.to(p.acc))            # (B, H, T, Dk)
        p.v = v.to(p.acc)                                                     # (B, HV, T, Dv)
        if p.mask is not None:                    # after φ: a padded query reads 0, a padded key writes 0
            real = p.mask[:, None, :, None]
            p.q, p.k, p.v = (torch.where(real, x, 0.0) for x in (p.q, p.k, p.v))
    B, _, _, Dk = p.k.shape
    rows = B if p.packing is None else p.packing.N
    p.S0 = check_state(initial_state, (rows, v.shape[1], Dk, v.shape[-1]), p.acc, q.device,
                       "N (sequences in cu_seqlens)" if p.packing is not None else "B")
    return p


def refuse_tracing(name: str) -> None:
    """``torch.jit.trace`` would freeze the chunk form's choices (shapes, groups, the values it checks)."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{name} cannot be recorded by torch.jit.trace: its chunk form chooses its algorithm from the "
            "shapes and values of each call (chunk sizes, groups of chunks, mild or strong decay, finite or "
            "not), which a trace would freeze for every later input; use torch.compile or torch.export")


def resolve_decay_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {_checks.type_name(method)}")
    name = method.strip().lower()
    if name not in DECAY_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(map(repr, DECAY_METHODS))}")
    return "chunk" if name == "auto" else name


def check_state(state, expected: tuple[int, ...], acc: torch.dtype, device, rows: str = "B") -> Optional[Tensor]:
    """``initial_state`` is None or a floating (B, HV, Dk, Dv) tensor on the inputs' device (``(N, HV, Dk, Dv)``
    for a packed batch: ``rows`` names the first dimension)."""
    if state is None:
        return None
    if not isinstance(state, Tensor):
        raise TypeError(
            f"initial_state must be a torch.Tensor S of shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"or None, got {_checks.type_name(state)} (a LinearAttentionState belongs to linear_attention)"
        )
    if not state.is_floating_point():
        raise TypeError(f"initial_state must be a floating-point tensor, got dtype {state.dtype}")
    if tuple(state.shape) != expected:
        raise ValueError(
            f"initial_state must have shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"(B: {rows}; H: the heads of v; Dk: key features after feature_map), "
            f"got {_checks.shape_str(state.shape)}"
        )
    if state.device != device:
        raise ValueError(f"initial_state is on {state.device} but the inputs are on {device}")
    return state.to(acc)


def check_like_q(x, name: str, expected: tuple[int, ...], layout: str, q: Tensor, extra: str = "") -> None:
    """``x`` is a tensor of shape ``expected`` on q's device, in q's dtype or the accumulation dtype
    (float32 gates with half q, k, v)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout} = {_checks.shape_str(expected)}, "
                        f"got {_checks.type_name(x)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    acc = _checks.accumulation_dtype(q.dtype)
    if x.dtype not in (q.dtype, acc):
        also = f" or {acc} (the dtype the computation runs in)" if acc != q.dtype else ""
        raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}; it must be q's dtype{also}")
    if tuple(x.shape) != expected:
        raise ValueError(
            f"{name} must have shape {layout} = {_checks.shape_str(expected)}{extra}, "
            f"got {_checks.shape_str(x.shape)}"
        )
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")


def run(p: "Prepared", recurrent: Callable[..., tuple[Tensor, Tensor]],
        chunk: Callable[..., tuple[Tensor, Tensor]], *per_token: Tensor) -> tuple[Tensor, Tensor]:
    """``recurrent(q, k, v, *per_token, S0)`` or ``chunk(q, k, v, *per_token, S0)`` (per method) on the
    prepared inputs, bucket by bucket for a packed batch (:mod:`linattn.ops.varlen`)."""
    if p.packing is None:
        return _run_one(p.method, recurrent, chunk, p.q, p.k, p.v, *per_token, p.S0)

    def bucket(q, k, v, *rest):
        *gates, S0 = rest
        out, S = _run_one(p.method, recurrent, chunk, q, k, v, *gates, None if S0 is None else S0[0])
        return out, (S,)

    def zeros(n: int):
        return (p.k.new_zeros(n, p.v.shape[1], p.k.shape[-1], p.v.shape[-1]),)

    out, (S,) = p.packing.run(bucket, (p.q, p.k, p.v, *per_token), None if p.S0 is None else (p.S0,), zeros)
    return out, S


def _run_one(method, recurrent, chunk, q, k, v, *rest) -> tuple[Tensor, Tensor]:
    """The chosen algorithm; the chunk form keeps non-finite values causal."""
    *gates, S0 = rest
    if method == "recurrent":
        backends._record("torch")
        return _own_state(*recurrent(q, k, v, *gates, S0))
    if not compiling():
        out, S = chunk(q, k, v, *gates, S0)
        if all_finite(S):
            return out, S
    poison = CausalPoison(q, k, v)
    out, S = chunk(poison.q, poison.k, poison.v, *gates, S0)
    if not compiling() and not all_finite(S):
        # Finite inputs whose chunk form overflowed (a diverging recurrence, e.g. the delta rule
        # with unnormalised keys): an infinity in a later row would reach earlier rows through the
        # zeros of the causal masks, so the token loop, causal by construction, gives the answer.
        backends._record("torch")
        return _own_state(*recurrent(q, k, v, *gates, S0))
    return poison.outputs(out), poison.state(S)


def _own_state(out: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """The token loop's last state is also what its last output read (saved for the backward pass):
    a copy lets the caller write into the returned state (``S[0] = 0``) and still call backward."""
    return out, (S.clone() if S.requires_grad else S)


def output_and_state(out: Tensor, S: Tensor, dtype: torch.dtype, return_state: bool) -> Result:
    """The output in the input dtype, and the state (contiguous, memory of its own) if asked for."""
    out = out.to(dtype)
    return (out, S.contiguous()) if return_state else out



# --------------------------------------------------------------------------- recurrent forms


def zeros_state(k: Tensor, v: Tensor, S0: Optional[Tensor]) -> Tensor:
    """``S0``, or the empty state ``(B, HV, Dk, Dv)`` (one per value head)."""
    return S0 if S0 is not None else k.new_zeros(*v.shape[:2], k.shape[-1], v.shape[-1])


# --------------------------------------------------------------------------- chunking


def to_chunks(x: Tensor, N: int, C: int) -> Tensor:
    """(B, H, T, ·) -> (B, H, N, C, ·), zero-padding the tail of a ragged last chunk."""
    T = x.shape[2]
    if N * C != T:
        x = F.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(*x.shape[:2], N, C, x.shape[-1])


def from_chunks(x: Tensor, T: int) -> Tensor:
    """(B, H, N, C, ·) -> (B, H, T, ·), dropping the padding."""
    x = x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    return x if x.shape[2] == T else x[:, :, :T]


def scan(S0: Tensor, step: Callable[..., Tensor], *per_chunk: Tensor) -> tuple[Tensor, Tensor]:
    """States before each chunk (B, H, N, Dk, Dv) and after the last, by ``S <- step(S, *x[:, :, n])``."""
    S, before = S0, []
    for xs in zip(*(x.unbind(2) for x in per_chunk)):
        before.append(S)
        S = step(S, *xs)
    return torch.stack(before, dim=2), S


def num_chunks(T: int, chunk_size: int) -> tuple[int, int]:
    C = min(chunk_size, T)           # a chunk longer than the sequence would only add padding
    return C, -(-T // C)


GROUP_NUMBERS = 1 << 17


def groups(n: int, per_item: int) -> list[slice]:
    """Slices of ``range(n)`` holding about ``GROUP_NUMBERS`` numbers of ``per_item`` each."""
    size = max(1, GROUP_NUMBERS // per_item)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
