"""The head plumbing every token mixer shares: sizes, grouped key-value heads, input checks, and the
query/key/value/output projections of the attention layers (with rotary positions)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .. import _checks
from ..state import KVCache
from ..ops.varlen import check_cu_seqlens
from .positions import ROPE_BASE, check_positions, packed_positions, token_positions

__all__ = ["check_head_sizes", "GroupedHeads", "MultiHeadProjections"]


def check_head_sizes(d_model, n_heads, n_kv_heads) -> tuple[int, int, int]:
    """``d_model``, ``n_heads`` and ``n_kv_heads`` (default ``n_heads``) as ints that divide as heads need."""
    d_model = _checks.check_positive_int(d_model, "d_model")
    n_heads = _checks.check_positive_int(n_heads, "n_heads")
    n_kv_heads = n_heads if n_kv_heads is None else _checks.check_positive_int(n_kv_heads, "n_kv_heads")
    if d_model % n_heads:
        raise ValueError(f"d_model must be divisible by n_heads, got d_model={d_model} and n_heads={n_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads must be divisible by n_kv_heads, got n_heads={n_heads} and "
                         f"n_kv_heads={n_kv_heads}")
    return d_model, n_heads, n_kv_heads


class GroupedHeads:
    """Reshaping to heads, grouped key-value heads and the check of ``forward``'s common arguments
    (for a module with ``d_model``, ``head_dim``, ``group_size`` and a ``q_proj``)."""

    def _heads(self, t: Tensor) -> Tensor:
        """(B, T, n·head_dim) -> (B, n, T, head_dim)."""
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)                         # (B, H or H_kv, T, D)

    def _repeat_kv(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """(B, H_kv, T, ...) -> (B, H, T, ...): query head ``h`` uses key-value head ``h // group_size``."""
        return t if t is None or self.group_size == 1 else t.repeat_interleave(self.group_size, dim=1)

    def _check_inputs(self, x, attention_mask, return_state) -> tuple[Optional[Tensor], bool]:
        """Check the arguments of ``forward``; returns the attention mask as bool (or None) and
        ``return_state`` as a Python bool."""
        _checks.check_layer_input(x, "x", self.d_model, "d_model", self.q_proj.weight)
        return_state = _checks.check_bool(return_state, "return_state")
        return _checks.attention_mask_as_bool(attention_mask, x.shape[0], x.shape[1], x.device), return_state


class MultiHeadProjections(GroupedHeads, nn.Module):
    """Query, key, value and output projections with grouped key-value heads, rotary positions, and input checks."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: Optional[int], causal: bool, bias: bool,
                 rope: bool = False, rope_base: float = ROPE_BASE) -> None:
        super().__init__()
        d_model, n_heads, n_kv_heads = check_head_sizes(d_model, n_heads, n_kv_heads)
        causal = _checks.check_bool(causal, "causal")
        bias = _checks.check_bool(bias, "bias")
        self.rope = _checks.check_bool(rope, "rope")
        self.rope_base = _checks.check_positive_float(rope_base, "rope_base", torch.float32)
        if not self.rope_base > 1:
            raise ValueError(f"rope_base must be > 1 (RoFormer uses 10000), got {rope_base}")
        self.d_model, self.n_heads, self.n_kv_heads, self.causal = d_model, n_heads, n_kv_heads, causal
        self.head_dim = d_model // n_heads
        self.group_size = n_heads // n_kv_heads                   # query heads per key-value head
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}" + (", rope=True" if self.rope else ""))

    def _check_packing(self, cu_seqlens, x: Tensor, attention_mask, state, return_state: bool) -> None:
        """``cu_seqlens`` (None, or a packed batch this layer can run: causal, no state in or out)."""
        if cu_seqlens is None:
            return
        if not self.causal:
            raise ValueError(f"cu_seqlens (a packed batch of sequences) needs a causal {type(self).__name__} "
                             "(causal=True)")
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], attention_mask)
        if state is not None or return_state:
            raise ValueError(f"{type(self).__name__} takes cu_seqlens for training only: no state and "
                             "return_state=False (decode the sequences as a padded batch, or use LinearMixer, whose "
                             "states a packed batch carries)")

    def _positions(self, positions, x: Tensor, attention_mask: Optional[Tensor], state,
                   cu_seqlens: Optional[Tensor] = None) -> Optional[Tensor]:
        """The ``(B, T)`` positions RoPE rotates by (None without RoPE), checked or counted (from 0 at
        each sequence of a packed batch)."""
        B, T, _ = x.shape
        if not self.rope:
            if positions is not None:
                raise ValueError(f"positions is only used by a layer built with rope=True; this "
                                 f"{type(self).__name__} has rope=False (pass positions=None)")
            return None
        if positions is not None:
            check_positions(positions, B, T, x.device)
            return positions
        if cu_seqlens is not None:
            return packed_positions(cu_seqlens, T).to(x.device)
        if state is None:
            start = torch.zeros(B, dtype=torch.long, device=x.device)
        elif isinstance(state, KVCache):
            start = state.attention_mask.sum(dim=1)                          # real tokens cached
        else:
            raise ValueError("positions (B, T) must be given to continue a state with rope=True: a "
                             "LinearAttentionState does not record how many tokens it has seen")
        return token_positions(start, attention_mask, T)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def _merge(self, y: Tensor) -> Tensor:
        B, _, T, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.d_model))           # (B, T, d_model)
