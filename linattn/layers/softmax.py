"""Multi-head softmax attention with a KV cache: the baseline of the linear layers (Vaswani et al., 2017)."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._checks import shape_str
from ..state import KVCache
from .positions import ROPE_BASE, apply_rope, packed_positions
from .projections import MultiHeadProjections

__all__ = ["SoftmaxAttention"]


class SoftmaxAttention(MultiHeadProjections):
    """Multi-head softmax attention with a KV cache: the baseline for :class:`LinearAttention`.

    Parameters
    ----------
    d_model : int
        Width of the input and output, divisible by ``n_heads``.
    n_heads : int
        Query heads ``H``.
    n_kv_heads : int, optional
        Key-value heads dividing ``n_heads`` (GQA, Ainslie et al., 2023; MQA, Shazeer, 2019);
        default ``n_heads``. The cache holds ``n_kv_heads`` heads.
    causal : bool
        Token ``i`` attends to tokens ``j <= i`` only.
    bias : bool
        Biases in the four projections.
    rope : bool
        Rotate ``q`` and ``k`` by their positions before the scores (RoFormer, Su et al.,
        2021, arXiv:2104.09864, eq. 16; GPT-NeoX's half rotation,
        :func:`linattn.layers.positions.apply_rope`), so that a score depends on the relative position
        only. The cache holds the rotated keys. Needs an even ``head_dim``.
    rope_base : float
        RoPE's base (RoFormer: 10000), ``> 1``.

    Raises
    ------
    TypeError
        A non-int size, a non-bool flag or a non-number ``rope_base``.
    ValueError
        A size < 1, ``d_model`` not divisible by ``n_heads``, ``n_heads`` not divisible by
        ``n_kv_heads``, ``rope=True`` with an odd ``head_dim``, ``rope_base <= 1``.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None,
                 causal: bool = False, bias: bool = False, rope: bool = False, rope_base: float = ROPE_BASE) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, causal, bias, rope, rope_base)
        if self.rope and self.head_dim % 2:
            raise ValueError(f"rope=True rotates pairs of channels and needs an even head_dim, got "
                             f"head_dim={self.head_dim} (d_model={self.d_model}, n_heads={self.n_heads})")

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[KVCache] = None, return_state: bool = False,
                positions: Optional[Tensor] = None,
                attention_fn: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None,
                cu_seqlens: Optional[Tensor] = None
                ) -> Union[Tensor, tuple[Tensor, KVCache]]:
        """Attend over the cached tokens and ``x``.

        Parameters
        ----------
        x, attention_mask : Tensor
            As in :meth:`linattn.LinearAttention.forward`.
            Padded keys get zero weight, and a query that sees no real key (left padding)
            outputs zeros.
        state : KVCache, optional
            Keys and values of earlier tokens, ``(B, H_kv, T_cache, head_dim)`` in the dtype
            of ``x`` and on its device; checked at every call. When causal the tokens of
            ``x`` sit at positions ``T_cache, ..., T_cache + T - 1``.
        return_state : bool
            Also return the cache extended by the tokens of ``x``.
        positions : Tensor, optional
            ``(B, T)`` int64 ``>= 0``, the position of each token of ``x``; only with
            ``rope=True``, where it defaults to counting real tokens from 0, after the real
            tokens of the cache.
        attention_fn : callable, optional
            The hook of :mod:`linattn.distributed` (sequence parallelism): ``attention_fn(q, k,
            v)`` on ``(B, H, T, head_dim)`` (keys and values repeated to ``H`` heads) computes
            the attention in place of SDPA, e.g. ring attention over ranks; only without a
            cache, a mask or ``return_state``.
        cu_seqlens : Tensor, optional
            A packed batch, as in :meth:`linattn.LinearAttention.forward`: each token attends
            to the earlier tokens of its own sequence only.

        Returns
        -------
        y : Tensor
            ``(B, T, d_model)``, dtype of ``x``.
        state : KVCache
            Only if ``return_state``: ``T_cache + T`` tokens, in the dtype of ``x``; a new
            cache whose tensors share no memory with ``x``, the mask or the cache passed in.

        Raises
        ------
        TypeError
            ``x`` not a floating tensor or not in the parameters' dtype; a non-bool mask or
            flag; a ``state`` that is not a ``KVCache``, or one that no longer passes the
            checks of :class:`KVCache`, or holds keys of another dtype than ``x``.
        ValueError
            ``x`` not ``(B, T, d_model)`` or with an empty batch or sequence (``B`` or
            ``T`` = 0); ``x`` not on the parameters' device; a mask that is not ``(B, T)``;
            a cache whose shapes do not match the layer or each other, or whose ``k``, ``v``
            or mask is not on the device of ``x`` (the message names which); ``positions``
            without ``rope=True``, of the wrong shape or negative; ``cu_seqlens`` as in
            :meth:`linattn.LinearAttention.forward`.
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        self._check_packing(cu_seqlens, x, attention_mask, state, return_state)
        self._check_state(state, x)
        positions = self._positions(positions, x, attention_mask, state, cu_seqlens)  # (B, T) or None
        B, T, _ = x.shape
        q, k, v = self._project(x)                                        # (B, H, T, D), (B, H_kv, T, D) x2
        self._check_state(state, x, k.dtype)
        if self.rope:                                                     # the cache keeps rotated keys
            q, k = apply_rope(q, positions, base=self.rope_base), apply_rope(k, positions, base=self.rope_base)
        if attention_fn is not None:
            if state is not None or attention_mask is not None or return_state or cu_seqlens is not None:
                raise ValueError("attention_fn replaces the attention of one whole call: it takes no state, "
                                 "attention_mask, return_state or cu_seqlens")
            return self._merge(attention_fn(q, self._repeat_kv(k), self._repeat_kv(v)))   # (B, T, d_model)
        # the returned cache owns its memory: never the caller's mask itself
        mask = attention_mask.clone() if attention_mask is not None else x.new_ones(B, T, dtype=torch.bool)
        if state is not None:
            k = torch.cat([state.k, k], dim=2)                            # (B, H_kv, P + T, D)
            v = torch.cat([state.v, v], dim=2)
            mask = torch.cat([state.attention_mask, mask], dim=1)       # (B, P + T)
        # SDPA multiplies the zero weights of future and padded keys with their values: a NaN or
        # infinity there would reach every query (0 · NaN = NaN). So non-finite keys and values are
        # zeroed for SDPA, and each output entry that does see one is set to NaN afterwards.
        bad_k = ~torch.isfinite(k).all(dim=-1, keepdim=True)              # (B, H_kv, P + T, 1)
        bad_v = ~torch.isfinite(v)                                        # (B, H_kv, P + T, D)
        k_sdpa, v_sdpa = self._repeat_kv(k.masked_fill(bad_k, 0.0)), self._repeat_kv(v.masked_fill(bad_v, 0.0))
        bad = (bad_k | bad_v).float()                                     # (B, H_kv, P + T, D)
        if cu_seqlens is not None:                                       # each token sees its own sequence
            owner = packed_positions(cu_seqlens, T).to(x.device)[0]      # (T,) index within the sequence
            t = torch.arange(T, device=x.device)
            start = t - owner                                             # (T,) first token of its sequence
            allowed = ((t[None, :] <= t[:, None]) & (t[None, :] >= start[:, None]))[None, None]   # (1, 1, T, T)
            y = F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, attn_mask=allowed)
            seen = allowed.float() @ bad                                  # (1, H_kv, T, D)
        elif state is None and attention_mask is None:                  # plain (causal) attention
            y = F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, is_causal=self.causal)
            seen = bad.cumsum(dim=2) if self.causal else bad.sum(dim=2, keepdim=True)
        else:
            allowed, empty = self._allowed(mask, T)                       # (B, 1, T, P + T), (B, 1, T, 1)
            y = F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, attn_mask=allowed)
            y = y.masked_fill(empty, 0.0)                                 # (B, H, T, D)
            seen = (allowed & ~empty).float() @ bad                       # (B, H_kv, T, D)
        y = y.masked_fill(self._repeat_kv(seen) > 0, float("nan"))        # depends on a non-finite key/value
        y = self._merge(y)                                                # (B, T, d_model)
        return (y, KVCache(k, v, mask)) if return_state else y

    def _allowed(self, mask: Tensor, T: int) -> tuple[Tensor, Tensor]:
        """Which keys each query may see; queries that see none attend everywhere, then output 0."""
        B, Tk = mask.shape
        allowed = mask[:, None, None, :].expand(B, 1, T, Tk)              # (B, 1, T, Tk)
        if self.causal:
            q_pos = torch.arange(Tk - T, Tk, device=mask.device)[:, None]  # the new tokens come last
            allowed = allowed & (torch.arange(Tk, device=mask.device) <= q_pos)
        empty = ~allowed.any(dim=-1, keepdim=True)                        # (B, 1, T, 1)
        return allowed | empty, empty                                     # no -inf-only rows: no NaN

    def decoding_state_nbytes(self, seq_len: int, batch: int = 1) -> int:
        """Bytes of the :class:`KVCache` after ``seq_len`` tokens (padding included), for inputs in the
        parameters' dtype: ``2·B·H_kv·seq_len·head_dim`` numbers and the ``(B, seq_len)`` bool mask."""
        element = self.q_proj.weight.element_size()
        return batch * seq_len * (2 * self.n_kv_heads * self.head_dim * element + 1)

    def _check_state(self, state, x: Tensor, key_dtype: Optional[torch.dtype] = None) -> None:
        """Checked at every use (not only when the cache was built: its attributes may have been replaced)."""
        if state is None:
            return
        if not isinstance(state, KVCache):
            raise TypeError(f"state must be a KVCache (or None) for SoftmaxAttention, got {type(state).__name__}")
        state.validate()
        B, Hkv, _, D = state.k.shape
        if (B, Hkv, D) != (x.shape[0], self.n_kv_heads, self.head_dim):
            raise ValueError(
                f"state.k and state.v must have shape (batch={x.shape[0]}, n_kv_heads={self.n_kv_heads}, seq, "
                f"head_dim={self.head_dim}), got {shape_str(state.k.shape)}")
        if key_dtype is not None and state.k.dtype != key_dtype:
            raise TypeError(f"state holds {state.k.dtype} keys but this call's keys are {key_dtype} (x is {x.dtype}; "
                            "under torch.autocast the keys have autocast's dtype): decode with the dtype and "
                            "autocast setting the cache was built with")
        for name, t in (("state.k", state.k), ("state.v", state.v), ("state.attention_mask", state.attention_mask)):
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
