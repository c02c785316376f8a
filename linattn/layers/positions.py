"""Where a token is: position schemes of :class:`~linattn.TransformerLM` and rotary embeddings."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks
from .._numerics import no_autocast

__all__ = ["POSITIONS", "DEFAULT_POSITIONS", "ROPE_BASE", "apply_rope", "packed_positions", "token_positions"]

POSITIONS = ("learned", "rope", "none")

#: The default ``positions`` of TransformerLM: one that does not bound how long a linear model
#: generates (``"learned"`` would: it has ``max_len`` rows).
DEFAULT_POSITIONS = "rope"

#: RoFormer's base: the pair ``i`` of a ``D``-dimensional vector turns by ``p · ROPE_BASE^(−2i/D)``.
ROPE_BASE = 10000.0


def check_positions_name(positions) -> str:
    """``positions`` is one of :data:`POSITIONS`; returns it (TypeError for a non-str, ValueError otherwise)."""
    if not isinstance(positions, str):
        raise TypeError(f"positions must be a str, one of {POSITIONS}, got {_checks.type_name(positions)}")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    return positions


def apply_rope(x: Tensor, positions: Tensor, *, base: float = ROPE_BASE) -> Tensor:
    """Rotate the pairs of channels of ``x`` by angles proportional to the token positions.

    RoFormer (Su et al., 2021, arXiv:2104.09864, eqs. 13-15), with GPT-NeoX's pairing of
    channel ``i`` with channel ``i + D/2`` (the "half rotation")::

        θ_i = base^(−2i/D),   i = 0 .. D/2 − 1
        out[..., i]       = x[..., i] cos(p θ_i) − x[..., i + D/2] sin(p θ_i)
        out[..., i + D/2] = x[..., i + D/2] cos(p θ_i) + x[..., i] sin(p θ_i)

    Parameters
    ----------
    x : Tensor
        ``(B, H, T, D)`` floating point, ``D`` even.
    positions : Tensor
        ``(B, T)`` int64, ``>= 0``, on the device of ``x``: the position of each token.
    base : float
        The base of the angles (RoFormer: 10000).

    Returns
    -------
    Tensor
        ``(B, H, T, D)``, dtype of ``x``, new memory.

    Raises
    ------
    TypeError
        ``x`` not a floating tensor, ``positions`` not an int64 tensor, ``base`` not a number.
    ValueError
        ``x`` not 4-D or with an odd last dimension; ``positions`` not ``(B, T)``, on another
        device or negative (RuntimeError under ``torch.compile``); ``base`` not ``> 1``.
    """
    _checks.check_tensor(x, "x", 4, "(batch, heads, seq, dim)")
    B, _, T, D = x.shape
    if D % 2:
        raise ValueError(f"rotary embedding turns pairs of channels: the last dimension of x must be even, got "
                         f"{_checks.shape_str(x.shape)}")
    check_positions(positions, B, T, x.device)
    base = _checks.check_positive_float(base, "base", torch.float32)
    if not base > 1:
        raise ValueError(f"base must be > 1 (the angles θ_i = base^(-2i/D) must decrease), got {base}")
    acc = _checks.accumulation_dtype(x.dtype)
    with no_autocast(x.device):
        half = torch.arange(D // 2, device=x.device, dtype=acc)
        theta = base ** (-2.0 * half / D)                                     # (D/2,)
        angle = positions.to(acc)[:, None, :, None] * theta                  # (B, 1, T, D/2)
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x.to(acc).chunk(2, dim=-1)                                   # (B, H, T, D/2) each
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, H, T, D)
    return out.to(x.dtype)


def check_positions(positions, batch: int, seq: int, device, name: str = "positions") -> None:
    """``positions`` is a ``(batch, seq)`` int64 tensor of values ``>= 0`` on ``device``."""
    if not isinstance(positions, Tensor) or positions.dtype != torch.long:
        got = (f"a {positions.dtype} tensor" if isinstance(positions, Tensor) else _checks.type_name(positions))
        raise TypeError(f"{name} must be an int64 tensor of shape (batch, seq) = ({batch}, {seq}), got {got}")
    if tuple(positions.shape) != (batch, seq):
        raise ValueError(f"{name} must have shape (batch, seq) = ({batch}, {seq}), got "
                         f"{_checks.shape_str(positions.shape)}")
    if positions.device != device:
        raise ValueError(f"{name} is on {positions.device} but the inputs are on {device}")
    _checks.check_values(positions >= 0, name, "a tensor of positions >= 0", positions)


def token_positions(start: Tensor, attention_mask: Optional[Tensor], seq: int) -> Tensor:
    """The position of every token: ``start`` plus the real tokens before it in ``x``.

    Parameters
    ----------
    start : Tensor
        ``(B,)`` int64: real tokens seen before this call (0 for a fresh sequence).
    attention_mask : Tensor or None
        ``(B, T)`` bool, True for real tokens (None: all real).
    seq : int
        ``T``.

    Used by :class:`~linattn.TransformerLM` (``start`` from its :class:`~linattn.DecodingState`)
    and by the RoPE layers. Checks nothing: the caller has checked its arguments.

    Returns
    -------
    Tensor
        ``(B, T)`` int64. A real token ``t`` gets ``start + (real tokens before t)``; padding
        gets the position of the real token before it (0 if there is none; padding is never
        attended to, and so never exceeds the positions of the real tokens).
    """
    B = start.shape[0]
    steps = (torch.arange(1, seq + 1, device=start.device).expand(B, seq) if attention_mask is None
             else attention_mask.long().cumsum(dim=1))                  # (B, T) real tokens so far
    return (start[:, None] + steps - 1).clamp_min(0)


def packed_positions(cu_seqlens: Tensor, seq: int) -> Tensor:
    """The position of every token of a packed batch: its index within its own sequence.

    Parameters
    ----------
    cu_seqlens : Tensor
        ``(N + 1,)`` int32 or int64 offsets from 0 to ``seq`` (checked by the caller).
    seq : int
        ``T``, the tokens of the packed batch.

    Returns
    -------
    Tensor
        ``(1, T)`` int64 on the device of ``cu_seqlens``: ``t − cu_seqlens[i]`` for a token ``t``
        of sequence ``i`` (positions restart at 0 at every sequence boundary).
    """
    offsets = cu_seqlens.long()
    owner = torch.repeat_interleave(torch.arange(offsets.shape[0] - 1, device=offsets.device),
                                    offsets[1:] - offsets[:-1], output_size=seq)   # (T,)
    return (torch.arange(seq, device=offsets.device) - offsets[owner])[None]
