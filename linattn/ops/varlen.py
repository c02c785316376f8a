"""Packed variable-length batches (``cu_seqlens``, flash-linear-attention's meaning): ``N`` sequences
laid end to end in one batch row, ``cu_seqlens`` their ``N + 1`` offsets, one state per sequence.

The sequences run as a few padded batches ("buckets"): sorted by length, a bucket takes the next
sequences while its padded size stays within twice their tokens, so the padding never more than
doubles the work and a bucket is one ordinary batched call (on whichever backend can run it). The
padding is zeros, which every causal op reads as a token that neither writes nor decays the state
(``k = v = 0``, ``β = 0``, ``log α = 0``), so each sequence's outputs and final state are those of a
call on that sequence alone. Gathering and scattering are ``index_select``: autograd carries every
gradient back to the packed tensors.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .._checks import shape_str, type_name
from .._numerics import has_values

__all__ = ["Packing", "check_cu_seqlens"]

PADDING_FACTOR = 2          # a bucket's padded tokens <= PADDING_FACTOR x its real tokens


def check_cu_seqlens(cu_seqlens, batch: int, seq: int, attention_mask=None) -> Optional["Packing"]:
    """``cu_seqlens`` checked against a packed batch of ``batch`` rows of ``seq`` tokens: a :class:`Packing`,
    or None when it is None.

    Raises
    ------
    TypeError
        Not a tensor, or not int32/int64.
    ValueError
        Not 1-D with at least 2 entries; not starting at 0, ending at ``seq`` and non-decreasing;
        ``batch != 1``; combined with an ``attention_mask``; a meta or fake tensor (its values are needed).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D int32 or int64 torch.Tensor of N + 1 offsets, got "
                        f"{type_name(cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor (N + 1 offsets), got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape {shape_str(cu_seqlens.shape)}")
    if attention_mask is not None:
        raise ValueError("cu_seqlens and attention_mask cannot be combined: a packed batch has no padding "
                         "(pass one or the other)")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of one row (B = 1, flash-linear-attention's layout: "
                         f"the sequences end to end along seq), got B = {batch}")
    if not has_values(cu_seqlens):
        raise ValueError("cu_seqlens must hold its offsets (a meta or fake tensor has none to read): the "
                         "layout of a packed batch depends on them")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    steps_ok = all(a <= b for a, b in zip(offsets, offsets[1:]))
    if offsets[0] != 0 or offsets[-1] != seq or not steps_ok:
        shown = offsets if len(offsets) <= 12 else offsets[:6] + ["..."] + offsets[-3:]
        raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to seq = {seq} (the tokens of the "
                         f"packed batch), got {shown}")
    return Packing(offsets, cu_seqlens.device if cu_seqlens.device.type != "meta" else None)


class Packing:
    """The sequences of a packed batch grouped into padded buckets (see the module's docstring).

    Attributes
    ----------
    offsets : list of int
        The ``N + 1`` offsets.
    buckets : list of (list of int, int)
        Each bucket's sequences (longest first) and its padded length.
    empty : list of int
        The sequences without a token (their final state is their initial state).
    """

    def __init__(self, offsets: Sequence[int], device=None) -> None:
        self.offsets = list(offsets)
        self.N = len(offsets) - 1
        self.T = offsets[-1]
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        order = sorted((i for i in range(self.N) if lengths[i] > 0), key=lambda i: -lengths[i])
        self.empty = [i for i in range(self.N) if lengths[i] == 0]
        self.buckets: list[tuple[list[int], int]] = []
        i = 0
        while i < len(order):
            L, members, tokens = lengths[order[i]], [order[i]], lengths[order[i]]
            i += 1
            while i < len(order) and (len(members) + 1) * L <= PADDING_FACTOR * (tokens + lengths[order[i]]):
                tokens += lengths[order[i]]
                members.append(order[i])
                i += 1
            self.buckets.append((members, L))
        self._lengths, self._device = lengths, device

    def _indices(self, device) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Per bucket: the packed position of every padded slot (``T`` for padding) and the slots that are
        real; and the inverse permutation that puts the buckets' real tokens back in packed order."""
        gathers, reals, placed = [], [], []
        for members, L in self.buckets:
            start = torch.tensor([self.offsets[s] for s in members], device=device)
            length = torch.tensor([self._lengths[s] for s in members], device=device)
            t = torch.arange(L, device=device)
            real = t[None, :] < length[:, None]                                # (n, L)
            pos = torch.where(real, start[:, None] + t[None, :], self.T).flatten()   # (n·L,)
            real_slots = real.flatten().nonzero().squeeze(1)
            gathers.append(pos)
            reals.append(real_slots)
            placed.append(pos[real_slots])
        order = torch.cat(placed)                                             # packed position of each token
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=device)
        return gathers, reals, inverse

    def run(self, fn: Callable, per_token: Sequence[Tensor], states: Optional[Sequence[Tensor]],
            zero_states: Callable[[int], Sequence[Tensor]]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``fn(*bucket_tensors, states) -> (out, states)`` on every bucket, put back together.

        Parameters
        ----------
        per_token : sequence of Tensor
            ``(1, h, T, …)`` tensors (q, k, v, then the gates; ``h`` their own heads).
        states : sequence of Tensor or None
            Initial states ``(N, …)`` (one tensor or several, e.g. ``S`` and ``z``), or None.
        zero_states : callable
            ``zero_states(n)`` -> the empty states of ``n`` sequences (the final state of an empty
            sequence without initial state).

        Returns
        -------
        ``(out (1, h, T, …), states (N, …))``: ``fn``'s output in packed order and each sequence's states.
        """
        device = per_token[0].device
        gathers, reals, inverse = self._indices(device)
        outs, finals = [], []
        for (members, L), pos in zip(self.buckets, gathers):
            n = len(members)
            xs = [_gather(x, pos, n, L) for x in per_token]
            s0 = None if states is None else tuple(s.index_select(0, _index(members, device)) for s in states)
            out, s = fn(*xs, s0)
            outs.append(out)
            finals.append(s)
        flat = [o.transpose(0, 1).flatten(1, 2).index_select(1, real) for o, real in zip(outs, reals)]
        out = torch.cat(flat, dim=1).index_select(1, inverse).unsqueeze(0)       # (1, h, T, …)
        if self.empty:
            finals.append(tuple(s.index_select(0, _index(self.empty, device)) for s in states)
                          if states is not None else tuple(zero_states(len(self.empty))))
        order = [s for members, _ in self.buckets for s in members] + self.empty
        where = torch.empty(self.N, dtype=torch.long)
        where[torch.tensor(order)] = torch.arange(self.N)
        where = where.to(device)
        joined = tuple(torch.cat(parts, dim=0).index_select(0, where) for parts in zip(*finals))
        return out, joined


def _index(members: list[int], device) -> Tensor:
    return torch.tensor(members, dtype=torch.long, device=device)


def _gather(x: Tensor, pos: Tensor, n: int, L: int) -> Tensor:
    """``(1, h, T, …) -> (n, h, L, …)``: the slots ``pos`` of the packed ``x`` (``T``: a zero)."""
    x0 = x[0]                                                                 # (h, T, …)
    zero = x0.new_zeros(x0.shape[0], 1, *x0.shape[2:])
    slots = torch.cat([x0, zero], dim=1).index_select(1, pos)                 # (h, n·L, …)
    return slots.unflatten(1, (n, L)).transpose(0, 1).contiguous()           # (n, h, L, …)
