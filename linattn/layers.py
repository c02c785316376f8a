"""Multi-head attention layers and a small Transformer language model.

:class:`LinearAttention` (Katharopoulos et al., 2020) and :class:`SoftmaxAttention`
(Vaswani et al., 2017) are drop-in replacements for each other: same constructor, same
``forward(x, *, attention_mask, state, return_state)`` (batch first, self-attention, not
causal unless ``causal=True``). Both share key-value heads between groups of query heads
through ``n_kv_heads`` (multi-query attention, Shazeer 2019, when ``n_kv_heads=1``;
grouped-query attention, Ainslie et al. 2023, in between). Both decode one token at a time
from a ``state``: for linear attention the fixed-size :class:`~linattn.LinearAttentionState`,
for softmax attention a :class:`KVCache` that grows by one key and one value per token.
:class:`LinearMultiheadAttention` is linear attention behind ``nn.MultiheadAttention``'s
call instead: ``(query, key, value) -> (output, None)``.

:class:`TransformerBlock` (pre-norm, MLP) and :class:`TransformerLM` (token embedding,
positions learned, rotary or none, tied output layer, ``generate``) follow nanoGPT's GPT.
A model may mix token mixers layer by layer (a hybrid): φ-linear attention, softmax
attention and the gated family of :class:`~linattn.LinearMixer` (retention, GLA, the delta
rule, the gated delta rule, Kimi Delta Attention). Tensors are ``(batch, seq, d_model)``
between layers and ``(batch, heads, seq, head_dim)`` inside attention. Every module works on
any device and floating dtype its parameters are on.
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._checks import describe, shape_str
from ._numerics import guarded_normaliser
from .attention import linear_attention, linear_attention_step
from .feature_maps import PARAMETRIC_FEATURE_MAPS, FeatureMap, get_feature_map, resolve_feature_map
from .mixers import DELTA_RULES, RULES, LinearMixer
from .positions import DEFAULT_POSITIONS, ROPE_BASE, apply_rope, check_positions, check_positions_name, token_positions
from .state import DecodingState, KVCache, LinearAttentionState, MixerState

__all__ = [
    "KVCache",
    "LinearAttention",
    "LinearMultiheadAttention",
    "SoftmaxAttention",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLM",
    "DecodingState",
    "ATTENTIONS",
]

ATTENTIONS = ("linear", "softmax") + RULES       # the token mixers a TransformerLM layer may use


# ---------------------------------------------------------------------------------------
# Attention layers
# ---------------------------------------------------------------------------------------


class _MultiHeadProjections(nn.Module):
    """Query, key, value and output projections with grouped key-value heads, rotary positions, and input checks."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: Optional[int], causal: bool, bias: bool,
                 rope: bool = False, rope_base: float = ROPE_BASE) -> None:
        super().__init__()
        d_model = _checks.check_positive_int(d_model, "d_model")
        n_heads = _checks.check_positive_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else _checks.check_positive_int(n_kv_heads, "n_kv_heads")
        if d_model % n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={d_model} and n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads must be divisible by n_kv_heads, got n_heads={n_heads} and "
                             f"n_kv_heads={n_kv_heads}")
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

    def _positions(self, positions, x: Tensor, attention_mask: Optional[Tensor], state) -> Optional[Tensor]:
        """The ``(B, T)`` positions RoPE rotates by (None without RoPE), checked or counted.

        Counted (when not given) as real tokens from 0, after the real tokens of a KVCache;
        a LinearAttentionState does not record its length, so continuing one needs them."""
        B, T, _ = x.shape
        if not self.rope:
            if positions is not None:
                raise ValueError(f"positions is only used by a layer built with rope=True; this "
                                 f"{type(self).__name__} has rope=False (pass positions=None)")
            return None
        if positions is not None:
            check_positions(positions, B, T, x.device)
            return positions
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

    def _heads(self, t: Tensor) -> Tensor:
        """(B, T, n·head_dim) -> (B, n, T, head_dim)."""
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)                         # (B, H or H_kv, T, D)

    def _merge(self, y: Tensor) -> Tensor:
        B, _, T, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.d_model))           # (B, T, d_model)

    def _repeat_kv(self, t: Tensor) -> Tensor:
        """(B, H_kv, T, ...) -> (B, H, T, ...): query head ``h`` uses key-value head ``h // group_size``."""
        return t if self.group_size == 1 else t.repeat_interleave(self.group_size, dim=1)

    def _check_inputs(self, x, attention_mask, return_state) -> tuple[Optional[Tensor], bool]:
        """Check the arguments of ``forward``; returns the attention mask as bool (or None) and
        ``return_state`` as a Python bool."""
        _checks.check_layer_input(x, "x", self.d_model, "d_model", self.q_proj.weight)
        return_state = _checks.check_bool(return_state, "return_state")
        return _check_attention_mask(attention_mask, x.shape[0], x.shape[1], x.device), return_state


class LinearAttention(_MultiHeadProjections):
    """Multi-head causal or non-causal linear attention (Katharopoulos et al., 2020).

    Read this first (three defaults that surprise users of ``nn.MultiheadAttention``):

    - **Not causal by default.** ``causal=False`` lets every token attend to every other,
      later ones included. A language model, or anything that decodes token by token,
      needs ``causal=True`` (:class:`TransformerLM` sets it).
    - **Self-attention only.** ``forward(x)`` projects ``q``, ``k`` and ``v`` from the same
      ``x`` and returns the output alone. It is not a drop-in for
      ``nn.MultiheadAttention``, which takes ``(query, key, value)`` and returns
      ``(output, weights)``: use :class:`LinearMultiheadAttention` for that call.
    - **Batch first only.** ``x`` is ``(batch, seq, d_model)``; ``nn.MultiheadAttention``
      defaults to ``(seq, batch, embed_dim)``. A 2-D (unbatched) ``x`` is refused.

    Per head, with ``q, k, v`` the projections of ``x`` and φ the feature map (eq. 5; eq. 9
    when causal, ``j <= i``)::

        y_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)

    computed by :func:`linattn.linear_attention` (the reordering of chapter 3 when not
    causal, the chunkwise form of chapter 5 when causal) and, for one new token, by
    :func:`linattn.linear_attention_step` (the recurrence of chapter 4, eqs. 18-20).
    ``n_kv_heads < n_heads`` shares each key-value head between ``n_heads // n_kv_heads``
    query heads (GQA, Ainslie et al., 2023; MQA, Shazeer, 2019, for ``n_kv_heads=1``).
    Because ``S = Σ φ(k_j) v_jᵀ`` depends on keys and values only, the state is stored
    once per key-value head: GQA shrinks the recurrent state as it shrinks a KV cache.

    With ``rope=True`` the positions enter as RoFormer puts them into linear attention (Su et
    al., 2021, arXiv:2104.09864, sec. 3.3, eq. 19): the features are rotated in the numerator
    only, with :func:`linattn.positions.apply_rope` (``R_i`` the rotation of position ``i``)::

        y_i = Σ_j (R_i φ(q_i))ᵀ(R_j φ(k_j)) v_j / Σ_j φ(q_i)ᵀφ(k_j)

    so the weights depend on relative positions while the normaliser stays positive. The
    numerator is :func:`linattn.linear_attention` with ``normalize=False`` on the rotated
    features, the normaliser the same with ``v = 1`` on the plain ones; the state carries
    ``S = Σ_j R_j φ(k_j) v_jᵀ`` and ``z = Σ_j φ(k_j)`` (the usual sizes). ``M`` must be even.

    Parameters
    ----------
    d_model : int
        Width of the input and output, divisible by ``n_heads``; ``head_dim = d_model // n_heads``.
    n_heads : int
        Query heads ``H``.
    n_kv_heads : int, optional
        Key-value heads ``H_kv`` dividing ``n_heads``; default ``n_heads`` (ordinary multi-head).
    feature_map : str or callable or None
        φ, as in :func:`linattn.linear_attention`: a name (default ``"elu+1"``), a callable
        ``(..., head_dim) -> (..., M)`` (an ``nn.Module`` is registered, so learnable maps
        train), or None (q and k used as features). A name of a map that needs the head
        dimension (``"hedgehog"``, ``"performer"``) is built with this layer's ``head_dim``;
        for other options build the map yourself (:func:`linattn.get_feature_map`).
    causal : bool
        Token ``i`` attends to tokens ``j <= i`` only. Needed for decoding.
    normalize : bool
        Divide by the normaliser ``φ(q_i)ᵀz_i`` (True) or not.
    eps : float
        Replaces the normaliser where it is zero, negative or not finite (a positive one is used as
        it is, see :func:`linattn.linear_attention`). It must be a normal float32 number
        (``1.18e-38 <= eps <= 3.4e38``): the layer computes in float32 for every dtype but
        float64 (as :func:`linattn.linear_attention` does), and checks it once, here.
    chunk_size : int
        Chunk length of the causal chunkwise algorithm.
    bias : bool
        Biases in the four projections.
    rope : bool
        Rotary positions in the numerator (above; default False).
    rope_base : float
        RoPE's base (RoFormer: 10000), ``> 1``.

    Sizes may be Python or NumPy integers and flags Python or NumPy bools; they are stored
    as Python ``int`` and ``bool``.

    Raises
    ------
    TypeError
        A non-int size, a non-bool flag, a non-number ``eps`` or ``rope_base``, a feature map
        that is neither a name, a callable nor None.
    ValueError
        A size < 1, ``d_model`` not divisible by ``n_heads``, ``n_heads`` not divisible by
        ``n_kv_heads``, ``eps`` not a normal positive float32 number, ``rope_base <= 1``, an
        unknown feature map name.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None,
                 feature_map: Union[str, FeatureMap, None] = "elu+1", causal: bool = False,
                 normalize: bool = True, eps: float = 1e-6, chunk_size: int = 64, bias: bool = False,
                 rope: bool = False, rope_base: float = ROPE_BASE) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, causal, bias, rope, rope_base)
        _set_linear_options(self, feature_map, normalize, eps, chunk_size)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", feature_map={self.feature_map_name or self.feature_map!r}"

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[LinearAttentionState] = None, return_state: bool = False,
                positions: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
        """Attend over ``x`` (and the tokens summarised by ``state``).

        Parameters
        ----------
        x : Tensor
            ``(B, T, d_model)``, in the parameters' dtype and on their device.
        attention_mask : Tensor, optional
            ``(B, T)`` bool or 0/1 integers, True (1) for real tokens (Hugging Face's
            convention; PyTorch's ``key_padding_mask`` is the opposite and refused by name).
            Padded tokens add nothing to any output or to the returned state (their own
            outputs are meaningless).
        state : LinearAttentionState, optional
            The state after earlier tokens: ``S`` ``(B, H_kv, M, head_dim)``, ``z``
            ``(B, H_kv, M)``, in the dtype this layer returns states in (float32, float64 for
            float64 ``x``) and on the device of ``x``; checked at every call. The tokens of
            ``x`` come after them. Not with a feature map marked ``position_dependent``
            (cosFormer): the state does not record the position.
        return_state : bool
            Also return the state after the last token of ``x``.
        positions : Tensor, optional
            ``(B, T)`` int64 ``>= 0``, the position of each token of ``x``; only with
            ``rope=True``, where it defaults to counting real tokens from 0 (and is required
            with a ``state``, which does not record its length).

        Returns
        -------
        y : Tensor
            ``(B, T, d_model)``, dtype of ``x``.
        state : LinearAttentionState
            Only if ``return_state``: float32 (float64 for float64 inputs), its size
            independent of how many tokens it summarises. A new object whose tensors share
            no memory with ``x``, the mask or the ``state`` passed in.

        Raises
        ------
        TypeError
            ``x`` not a floating tensor or not in the parameters' dtype; a non-bool mask or
            flag; a ``state`` that is not a ``LinearAttentionState``, or whose ``S`` or ``z`` is
            not a floating tensor or not in the state dtype above.
        ValueError
            ``x`` not ``(B, T, d_model)`` or with an empty batch or sequence (``B`` or
            ``T`` = 0); ``x`` not on the parameters' device; a mask that is not ``(B, T)``;
            a state whose shapes do not match ``(B, H_kv, M, head_dim)`` or that is not on the
            device of ``x``; a state with a position-dependent feature map; ``positions``
            without ``rope=True``, of the wrong shape or negative, or missing with a state and
            ``rope=True``; an odd number of features ``M`` with ``rope=True``.
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        phi = self.feature_map
        if state is not None and getattr(phi, "position_dependent", False):
            raise ValueError(
                f"state cannot be continued with the position-dependent feature_map {type(phi).__name__}: "
                "a LinearAttentionState does not record how many tokens it has seen, so the new tokens "
                "would get the features of positions 0, 1, ...; use a position-independent map to decode")
        _checks.check_position_dependent(phi, causal=self.causal, resumed=False, same_length=True,
                                         caller=type(self).__name__)
        q, k, v = self._project(x)                                        # (B, H, T, D), (B, H_kv, T, D) x2
        phi_q, phi_k = _features(phi, q, k)                               # (B, H, T, M), (B, H_kv, T, M)
        v = v.to(phi_k.dtype)                                             # float32 with the features of half x
        self._check_state(state, x, phi_k.shape[-1])
        positions = self._positions(positions, x, attention_mask, state)  # (B, T) or None
        state = self._expand_state(state)                                 # per query head: (B, H, M, D)
        phi_k, v = self._repeat_kv(phi_k), self._repeat_kv(v)             # (B, H, T, M), (B, H, T, D)
        if self.rope:
            y, state = self._rotary(phi_q, phi_k, v, positions, attention_mask, state)
        elif self.causal and x.shape[1] == 1 and attention_mask is None:  # one new token: the recurrence
            y, state = linear_attention_step(
                phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], state,
                feature_map=None, normalize=self.normalize, eps=self.eps)  # (B, H, D)
            y = y.unsqueeze(2)                                            # (B, H, 1, D)
        else:
            y = linear_attention(
                phi_q, phi_k, v, feature_map=None, causal=self.causal, normalize=self.normalize,
                eps=self.eps, chunk_size=self.chunk_size, attention_mask=attention_mask,
                initial_state=state, return_state=return_state)           # (B, H, T, D)
            if return_state:
                y, state = y
        y = self._merge(y.to(x.dtype))                                    # (B, T, d_model)
        return (y, self._shrink_state(state)) if return_state else y

    def _rotary(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, attention_mask: Optional[Tensor],
                state: Optional[LinearAttentionState]) -> tuple[Tensor, LinearAttentionState]:
        """RoFormer's eq. 19: the rotated numerator over the plain normaliser; ``(B, H, T, D)`` and the state."""
        M = phi_k.shape[-1]
        if M % 2:
            raise ValueError(f"rope=True rotates pairs of features, so the feature map must give an even number "
                             f"of features, got M={M}")
        acc = _checks.accumulation_dtype(v.dtype)                        # divide in float32, not in half
        phi_q, phi_k, v_acc = phi_q.to(acc), phi_k.to(acc), v.to(acc)
        rot_q = apply_rope(phi_q, positions, base=self.rope_base)          # (B, H, T, M)
        rot_k = apply_rope(phi_k, positions, base=self.rope_base)
        options = dict(feature_map=None, causal=self.causal, normalize=False, chunk_size=self.chunk_size,
                       attention_mask=attention_mask, return_state=True)
        num, num_state = linear_attention(
            rot_q, rot_k, v_acc, initial_state=state, **options)          # (B, H, T, D): Σ (R_i φq)ᵀ(R_j φk) v_j
        den_state0 = None if state is None else LinearAttentionState(state.z.unsqueeze(-1), state.z)
        den, den_state = linear_attention(
            phi_q, phi_k, v_acc.new_ones(*v.shape[:3], 1), initial_state=den_state0, **options)  # Σ φqᵀφk
        y = num / guarded_normaliser(den, self.eps)[0] if self.normalize else num
        return y.to(v.dtype), LinearAttentionState(num_state.S, den_state.z)

    def decoding_state_nbytes(self, seq_len: int = 0, batch: int = 1) -> int:
        """Bytes of the :class:`~linattn.LinearAttentionState` after any number of tokens (``seq_len``
        is not used: the size is fixed), for inputs in the parameters' dtype: ``B·H_kv·M·(head_dim + 1)``
        numbers, ``M`` the number of features of φ."""
        weight = self.q_proj.weight
        if self.feature_map is None:
            M = self.head_dim
        else:
            with torch.no_grad():
                M = self.feature_map(weight.new_zeros(1, 1, 1, self.head_dim)).shape[-1]
        acc = _checks.accumulation_dtype(weight.dtype)
        return batch * self.n_kv_heads * M * (self.head_dim + 1) * torch.empty((), dtype=acc).element_size()

    def _check_state(self, state, x: Tensor, feature_dim: int) -> None:
        """Checked at every use (not only when the state was built: its attributes may have been replaced)."""
        if state is None:
            return
        if not isinstance(state, LinearAttentionState):
            raise TypeError(f"state must be a LinearAttentionState (or None) for LinearAttention, "
                            f"got {type(state).__name__}")
        _checks.check_tensor(state.S, "state.S", 4, "(batch, n_kv_heads, M, head_dim)")
        _checks.check_tensor(state.z, "state.z", 3, "(batch, n_kv_heads, M)")
        expected = (x.shape[0], self.n_kv_heads, feature_dim, self.head_dim)
        if tuple(state.S.shape) != expected or tuple(state.z.shape) != expected[:3]:
            raise ValueError(
                f"state must have S of shape (batch, n_kv_heads, M, head_dim) = {shape_str(expected)} and "
                f"z of shape {shape_str(expected[:3])}, got S {shape_str(state.S.shape)} and z "
                f"{shape_str(state.z.shape)}")
        acc = _checks.accumulation_dtype(x.dtype)
        for name, t in (("state.S", state.S), ("state.z", state.z)):
            if t.dtype != acc:
                raise TypeError(f"{name} is {t.dtype} but a layer fed {x.dtype} keeps its state in {acc} "
                                "(the dtype of the states it returns)")
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but x is on {x.device}")

    def _expand_state(self, state: Optional[LinearAttentionState]) -> Optional[LinearAttentionState]:
        if state is None or self.group_size == 1:
            return state
        G = self.group_size
        return LinearAttentionState(state.S.repeat_interleave(G, dim=1), state.z.repeat_interleave(G, dim=1))

    def _shrink_state(self, state: LinearAttentionState) -> LinearAttentionState:
        """The query heads of a group share S and z (same keys and values): keep one copy."""
        if self.group_size == 1:
            return state
        G = self.group_size
        return LinearAttentionState(state.S[:, ::G].contiguous(), state.z[:, ::G].contiguous())


class SoftmaxAttention(_MultiHeadProjections):
    """Multi-head softmax attention with a KV cache: the baseline for :class:`LinearAttention`.

    ``softmax(q kᵀ / sqrt(head_dim)) v`` per head (Vaswani et al., 2017, eq. 1), computed by
    ``torch.nn.functional.scaled_dot_product_attention``. Same constructor and ``forward``
    as :class:`LinearAttention`; the decoding state is a :class:`KVCache` holding every
    earlier key and value, so its size and the cost of a step grow with the position.

    As :class:`LinearAttention`: **not causal by default** (``causal=False`` sees the
    future; pass ``causal=True`` for a language model), **self-attention only**
    (``forward(x)`` returns the output alone; not a drop-in for ``nn.MultiheadAttention``,
    which takes ``(query, key, value)`` and returns ``(output, weights)``), and **batch
    first only** (``x`` is ``(batch, seq, d_model)``).

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
        :func:`linattn.positions.apply_rope`), so that a score depends on the relative position
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
                positions: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, KVCache]]:
        """Attend over the cached tokens and ``x``.

        Parameters
        ----------
        x : Tensor
            ``(B, T, d_model)``, in the parameters' dtype and on their device.
        attention_mask : Tensor, optional
            ``(B, T)`` bool or 0/1 integers, True (1) for real tokens (Hugging Face's
            convention; PyTorch's ``key_padding_mask`` is the opposite and refused by name).
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
            without ``rope=True``, of the wrong shape or negative.
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        self._check_state(state, x)
        positions = self._positions(positions, x, attention_mask, state)  # (B, T) or None
        B, T, _ = x.shape
        q, k, v = self._project(x)                                        # (B, H, T, D), (B, H_kv, T, D) x2
        self._check_state(state, x, k.dtype)
        if self.rope:                                                     # the cache keeps rotated keys
            q, k = apply_rope(q, positions, base=self.rope_base), apply_rope(k, positions, base=self.rope_base)
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
        if state is None and attention_mask is None:                    # plain (causal) attention
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
        """Checked at every use (not only when the cache was built: its attributes may have been replaced).

        ``key_dtype`` is the dtype of this call's keys (the parameters' dtype, or autocast's): the
        cache must hold keys of that dtype; None skips that check.
        """
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


class LinearMultiheadAttention(_MultiHeadProjections):
    """Linear attention behind ``nn.MultiheadAttention``'s call (Katharopoulos et al., 2020).

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    is_causal=False) -> (output, None)``, with PyTorch's meanings: ``key_padding_mask`` True
    marks *padding*, ``is_causal=True`` (or ``attn_mask`` holding the causal mask) lets query
    ``i`` see keys ``j <= i``. Per head it computes what :class:`LinearAttention` computes,
    with ``q``, ``k``, ``v`` projected from ``query``, ``key`` and ``value`` (so it also does
    cross-attention, ``Tq != Tk``, when not causal), through
    :func:`linattn.linear_attention`.

    What differs from ``nn.MultiheadAttention``, all refused loudly rather than ignored:

    - **Batch first only**: ``batch_first=True`` must be passed (PyTorch's default,
      ``False``, would read ``(seq, batch, embed)`` tensors the other way round), and the
      inputs must be 3-D.
    - **No attention weights**: linear attention never forms the ``Tq×Tk`` matrix (that is
      what makes it linear), so ``need_weights`` defaults to False and True is refused; the
      second output is always None.
    - **No arbitrary attn_mask**: only the causal mask can be applied (as a bool mask, True =
      masked, or a float mask, ``-inf`` above the diagonal and 0 elsewhere, such as
      ``nn.Transformer.generate_square_subsequent_mask``); ``is_causal=True`` needs no mask.
    - **No dropout, add_bias_kv, add_zero_attn, kdim, vdim**, and a bool
      ``key_padding_mask`` only (a float, additive one has no linear-attention form).
    - Different parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (as
      :class:`LinearAttention`, whose ``state_dict`` it can load), not the packed
      ``in_proj_weight``: PyTorch's saved weights do not load into it.

    Parameters
    ----------
    embed_dim : int
        Width of the inputs and the output, divisible by ``num_heads``.
    num_heads : int
        Heads; ``head_dim = embed_dim // num_heads``.
    batch_first : bool
        Required, and must be True.
    bias : bool
        Biases in the four projections (default True, as in ``nn.MultiheadAttention``).
    feature_map, normalize, eps, chunk_size
        As in :class:`LinearAttention`.

    Raises
    ------
    TypeError
        A non-int size, a non-bool flag, a non-number ``eps``, a bad feature map.
    ValueError
        ``batch_first=False``; a size < 1; ``embed_dim`` not divisible by ``num_heads``;
        ``eps`` not a normal positive float32 number; an unknown feature map name.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, batch_first: bool, bias: bool = True,
                 feature_map: Union[str, FeatureMap, None] = "elu+1", normalize: bool = True, eps: float = 1e-6,
                 chunk_size: int = 64) -> None:
        if not _checks.check_bool(batch_first, "batch_first"):
            raise ValueError("LinearMultiheadAttention is batch first only: pass batch_first=True and "
                             "(batch, seq, embed_dim) tensors")
        super().__init__(embed_dim, num_heads, None, False, bias)
        _set_linear_options(self, feature_map, normalize, eps, chunk_size)
        self.embed_dim, self.num_heads, self.batch_first = self.d_model, self.n_heads, True

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"batch_first=True, feature_map={self.feature_map_name or self.feature_map!r}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> tuple[Tensor, None]:
        """Attend from ``query`` over ``key`` and ``value``; PyTorch's arguments and meanings.

        Parameters
        ----------
        query : Tensor
            ``(B, Tq, embed_dim)``, in the parameters' dtype and on their device.
        key, value : Tensor
            ``(B, Tk, embed_dim)`` each, same dtype and device.
        key_padding_mask : Tensor, optional
            ``(B, Tk)`` bool, True for **padding** (PyTorch's meaning, the opposite of
            ``attention_mask`` elsewhere in linattn): padded keys add nothing.
        need_weights : bool
            Must be False (the weights are never formed).
        attn_mask : Tensor, optional
            None, or the ``(T, T)`` causal mask (bool, True above the diagonal; or float,
            ``-inf`` above the diagonal and 0 elsewhere): it makes the attention causal. It
            is checked by value, which ``torch.compile(fullgraph=True)`` cannot trace: there
            pass ``is_causal=True`` without a mask.
        is_causal : bool
            Query ``i`` sees keys ``j <= i`` only; needs ``Tq == Tk``.

        Returns
        -------
        output : Tensor
            ``(B, Tq, embed_dim)``, dtype of ``query``.
        weights : None
            Always None.

        Raises
        ------
        TypeError
            Non-floating inputs or inputs not in the parameters' dtype; a non-bool
            ``key_padding_mask``; a non-bool flag; an ``attn_mask`` that is not a tensor.
        ValueError
            Inputs that are not 3-D ``(B, T, embed_dim)``, empty, of different batch, or
            ``key`` and ``value`` of different lengths; inputs not on the parameters' device;
            a ``key_padding_mask`` that is not ``(B, Tk)``; ``need_weights=True``; an
            ``attn_mask`` other than the causal mask; causal attention with ``Tq != Tk``.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            self._check_sequence(t, name)
        B, Tq, _ = query.shape
        Tk = key.shape[1]
        if key.shape[0] != B or value.shape[0] != B or value.shape[1] != Tk:
            raise ValueError(f"query (B, Tq, E), key and value (B, Tk, E) must share B, and key and value Tk; got "
                             f"query {shape_str(query.shape)}, key {shape_str(key.shape)}, value "
                             f"{shape_str(value.shape)}")
        if _checks.check_bool(need_weights, "need_weights"):
            raise ValueError("need_weights=True: linear attention never forms the (Tq, Tk) attention weights "
                             "(that is what makes it linear); pass need_weights=False (the weights returned are None)")
        causal = _checks.check_bool(is_causal, "is_causal")
        if attn_mask is not None:
            if not _is_causal_mask(attn_mask, Tq, Tk):
                raise ValueError(
                    f"attn_mask must be None or the ({Tq}, {Tq}) causal mask (bool: True above the diagonal; float: "
                    f"-inf above the diagonal, 0 elsewhere), got {describe(attn_mask)}: linear attention "
                    "cannot apply an arbitrary (Tq, Tk) mask, since it never forms the attention matrix")
            causal = True
        if causal and Tq != Tk:
            raise ValueError(f"causal attention (is_causal=True or a causal attn_mask) needs as many queries as keys, "
                             f"got Tq={Tq} and Tk={Tk}")
        attention_mask = None
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError(f"key_padding_mask must be a bool tensor (True = padding, PyTorch's meaning); a "
                                "float (additive) mask has no linear-attention form; got "
                                f"{describe(key_padding_mask)}")
            attention_mask = ~_checks.attention_mask_as_bool(key_padding_mask, B, Tk, query.device,
                                                             name="key_padding_mask")  # True = real token
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        phi = self.feature_map
        _checks.check_position_dependent(phi, causal=causal, resumed=False, same_length=Tq == Tk,
                                         caller="LinearMultiheadAttention")
        phi_q, phi_k = _features(phi, q, k)                                # (B, H, Tq, M), (B, H, Tk, M)
        y = linear_attention(phi_q, phi_k, v.to(phi_k.dtype), feature_map=None, causal=causal,
                             normalize=self.normalize, eps=self.eps, chunk_size=self.chunk_size,
                             attention_mask=attention_mask)                # (B, H, Tq, D)
        return self._merge(y.to(query.dtype)), None                        # (B, Tq, embed_dim)

    def _check_sequence(self, t, name: str) -> None:
        _checks.check_layer_input(t, name, self.embed_dim, "embed_dim", self.q_proj.weight,
                                  hint=" (batch first; unbatched inputs are not supported)")


# ---------------------------------------------------------------------------------------
# Transformer block and language model
# ---------------------------------------------------------------------------------------


def _make_attention(attention: str, d_model: int, n_heads: int, *, n_kv_heads, feature_map, causal,
                    chunk_size, bias, rope, mixer_options) -> nn.Module:
    """The token mixer named ``attention``; ``rope`` reaches the softmax and φ-linear layers only."""
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a str, got {type(attention).__name__}")
    if attention == "linear":
        return LinearAttention(d_model, n_heads, n_kv_heads=n_kv_heads, feature_map=feature_map, causal=causal,
                               chunk_size=chunk_size, bias=bias, rope=rope)
    if attention == "softmax":
        return SoftmaxAttention(d_model, n_heads, n_kv_heads=n_kv_heads, causal=causal, bias=bias, rope=rope)
    if attention in RULES:
        if not _checks.check_bool(causal, "causal"):
            raise ValueError(f"attention={attention!r} (a LinearMixer) is causal only: pass causal=True")
        options = dict(mixer_options)
        options["negative_eigenvalues"] = options.get("negative_eigenvalues", False) and attention in DELTA_RULES
        return LinearMixer(d_model, n_heads, rule=attention, n_kv_heads=n_kv_heads, chunk_size=chunk_size,
                           bias=bias, **options)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


def _state_type(attn: nn.Module) -> type:
    """The decoding state a token mixer keeps."""
    if isinstance(attn, LinearAttention):
        return LinearAttentionState
    return MixerState if isinstance(attn, LinearMixer) else KVCache


class TransformerBlock(nn.Module):
    """A pre-norm Transformer block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``.

    The token mixer is :class:`LinearAttention`, :class:`SoftmaxAttention` or a
    :class:`~linattn.LinearMixer`; the MLP is ``Linear(d_model, mlp_ratio·d_model)``, GELU,
    ``Linear(mlp_ratio·d_model, d_model)`` (Vaswani et al., 2017, with the layer norm moved
    before each sublayer as in GPT-2 and Xiong et al., 2020).

    Parameters
    ----------
    d_model, n_heads : int
        Width and query heads (``d_model`` divisible by ``n_heads``).
    n_kv_heads : int, optional
        Key-value heads (default ``n_heads``).
    attention : str
        One of :data:`ATTENTIONS`: ``"linear"``, ``"softmax"``, or a rule of
        :class:`~linattn.LinearMixer` (``"retention"``, ``"gla"``, ``"delta"``,
        ``"gated_delta"``, ``"kda"``; these need ``causal=True``).
    feature_map : str or callable
        φ of linear attention (used by ``"linear"`` only).
    causal : bool
        Causal attention (needed for language modelling and decoding).
    mlp_ratio : int
        Hidden width of the MLP in multiples of ``d_model``.
    chunk_size : int
        Chunk length of the causal chunkwise algorithms.
    bias : bool
        Biases in the attention projections (the MLP and layer norms always have them).
    rope : bool
        Rotary positions in ``"softmax"`` and ``"linear"`` layers (see their docstrings); the
        mixers of :class:`~linattn.LinearMixer` take no positions and ignore it.
    short_conv, conv_size, qk_norm, negative_eigenvalues, output_norm, output_gate
        Options of :class:`~linattn.LinearMixer` (used by its rules only;
        ``negative_eigenvalues`` by the delta rules only).

    Raises
    ------
    TypeError
        As the attention layers, plus a non-str ``attention`` or a non-integer ``mlp_ratio``.
    ValueError
        As the attention layers, plus an unknown ``attention``, ``mlp_ratio < 1``, or a
        :class:`~linattn.LinearMixer` rule with ``causal=False``.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None, attention: str = "linear",
                 feature_map: Union[str, FeatureMap, None] = "elu+1", causal: bool = False, mlp_ratio: int = 4,
                 chunk_size: int = 64, bias: bool = False, rope: bool = False, short_conv: bool = True,
                 conv_size: int = 4, qk_norm: bool = True, negative_eigenvalues: bool = False,
                 output_norm: bool = True, output_gate: bool = True) -> None:
        super().__init__()
        mlp_ratio = _checks.check_positive_int(mlp_ratio, "mlp_ratio")
        mixer_options = dict(short_conv=short_conv, conv_size=conv_size, qk_norm=qk_norm,
                             negative_eigenvalues=negative_eigenvalues, output_norm=output_norm,
                             output_gate=output_gate)
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = _make_attention(attention, d_model, n_heads, n_kv_heads=n_kv_heads, feature_map=feature_map,
                                    causal=causal, chunk_size=chunk_size, bias=bias, rope=rope,
                                    mixer_options=mixer_options)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None, state=None,
                return_state: bool = False, positions: Optional[Tensor] = None):
        """``(B, T, d_model) -> (B, T, d_model)``; ``attention_mask``, ``state`` and
        ``return_state`` are passed to the token mixer (see :meth:`LinearAttention.forward`,
        :meth:`SoftmaxAttention.forward` and :meth:`linattn.LinearMixer.forward`, whose errors
        it raises), and ``positions`` (``(B, T)`` int64) to a mixer built with ``rope=True``
        (the others have no use for it and do not get it).

        Returns
        -------
        y : Tensor
            ``(B, T, d_model)``.
        state : LinearAttentionState, MixerState or KVCache
            Only if ``return_state``.
        """
        extra = {"positions": positions} if getattr(self.attn, "rope", False) else {}
        a = self.attn(self.ln_1(x), attention_mask=attention_mask, state=state,
                      return_state=return_state, **extra)                # (B, T, d_model)
        if return_state:
            a, state = a
        x = x + a
        x = x + self.mlp(self.ln_2(x))                                    # (B, T, d_model)
        return (x, state) if return_state else x


@dataclass
class TransformerConfig:
    """The hyper-parameters of :class:`TransformerLM` (``TransformerLM(**asdict(config))``
    rebuilds the model); see :class:`TransformerLM` for their meaning."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    attention: Union[str, list] = "linear"          # one name for every layer, or a list: one per layer
    feature_map: Union[str, FeatureMap, None] = "elu+1"
    max_len: Optional[int] = None
    mlp_ratio: int = 4
    chunk_size: int = 64
    bias: bool = False
    positions: str = DEFAULT_POSITIONS
    short_conv: bool = True                         # the LinearMixer options
    conv_size: int = 4
    qk_norm: bool = True
    negative_eigenvalues: bool = False
    output_norm: bool = True
    output_gate: bool = True

    def mixers(self) -> list:
        """The token mixer of each layer: a list of ``n_layers`` names."""
        return [self.attention] * self.n_layers if isinstance(self.attention, str) else list(self.attention)


class TransformerLM(nn.Module):
    """A decoder-only Transformer language model with linear, softmax or hybrid token mixing.

    Token embedding, ``n_layers`` causal :class:`TransformerBlock`\\ s, a final layer norm and
    an output layer tied to the token embedding (Press & Wolf, 2017), as in GPT-2 and
    nanoGPT. With ``attention="linear"`` it is the linear Transformer of Katharopoulos et
    al. (2020): trained in parallel (chunkwise), it generates as an RNN from a fixed-size
    state; with ``"softmax"`` it generates from a KV cache; with a rule of
    :class:`~linattn.LinearMixer` (``"gated_delta"``, ...) from that mixer's fixed-size state.
    A list names one mixer per layer, a hybrid such as ``["gated_delta"] * 3 + ["softmax"]``
    (the pattern of Qwen3-Next and Kimi Linear: mostly linear layers, a few softmax ones);
    its decoding state holds a fixed-size state for each linear layer and a KV cache for
    each softmax layer (:meth:`decoding_state_nbytes`).

    Positions (``positions=``, see :mod:`linattn.positions`):

    - ``"learned"``: a learned absolute embedding of ``max_len`` rows added to the token
      embedding (GPT-2); a sequence then holds at most ``max_len`` real tokens. This is the
      model of chapter 8 (``positions="learned", max_len=128``).
    - ``"rope"``: rotary embeddings in every softmax and φ-linear layer (RoFormer; for
      linear attention in the numerator only, see :class:`LinearAttention`); nothing is
      learned and nothing bounds the length.
    - ``"none"``: no position signal besides causality (and the short convolutions).

    The :class:`~linattn.LinearMixer` layers take no positions in any scheme: their short
    convolutions and decays give them order. The default is
    :data:`linattn.positions.DEFAULT_POSITIONS` (``"rope"``), which does not bound how long a
    linear model generates. Positions count real tokens, so a left-padded prompt is processed
    exactly as the same prompt alone.

    Parameters
    ----------
    vocab_size : int
        Number of token ids.
    d_model : int
        Model width (divisible by ``n_heads``).
    n_layers : int
        Number of blocks.
    n_heads : int
        Query heads per block.
    n_kv_heads : int, optional
        Key-value heads per block (GQA/MQA); default ``n_heads``.
    attention : str or list of str
        The token mixer, one of :data:`ATTENTIONS` (``"linear"``, ``"softmax"``,
        ``"retention"``, ``"gla"``, ``"delta"``, ``"gated_delta"``, ``"kda"``): one name for
        every layer, or a list (or tuple, stored as a list) of ``n_layers`` names.
    feature_map : str or callable
        φ of linear attention (default ``"elu+1"``). One callable object is shared by all
        blocks; a name builds one map per block (with the blocks' ``head_dim`` for
        ``"hedgehog"`` and ``"performer"``).
    max_len : int, optional
        The longest sequence (real tokens, earlier calls included). Required with
        ``positions="learned"`` (the number of learned positions); with ``"rope"`` and
        ``"none"`` optional, a limit of your choosing, None (the default) for none.
    mlp_ratio : int
        MLP hidden width in multiples of ``d_model``.
    chunk_size : int
        Chunk length of the causal chunkwise algorithms.
    bias : bool
        Biases in the attention projections.
    positions : str
        ``"learned"``, ``"rope"`` or ``"none"`` (above).
    short_conv, conv_size, qk_norm, negative_eigenvalues, output_norm, output_gate
        Options of the :class:`~linattn.LinearMixer` layers (defaults: all on, kernel 4,
        ``β`` in (0, 1)); ``negative_eigenvalues`` reaches the delta rules only. Other layers
        do not use them.

    Attributes
    ----------
    config : TransformerConfig

    Sizes may be Python or NumPy integers (stored in ``config`` as Python ints).

    Raises
    ------
    TypeError
        A size that is not an integer, a flag that is not a bool, an ``attention`` that is
        neither a str nor a list or tuple of str, a ``positions`` that is not a str, a
        ``feature_map`` that is neither a name, a callable nor None.
    ValueError
        A size < 1, ``d_model`` not divisible by ``n_heads``, ``n_heads`` not divisible by
        ``n_kv_heads``, an unknown mixer name, a list of mixers whose length is not
        ``n_layers``, an unknown ``positions``, ``positions="learned"`` without ``max_len``,
        ``positions="rope"`` with an odd ``head_dim`` and softmax layers, ``conv_size < 2``,
        an unknown feature map name.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *,
                 n_kv_heads: Optional[int] = None, attention: Union[str, list] = "linear",
                 feature_map: Union[str, FeatureMap, None] = "elu+1", max_len: Optional[int] = None,
                 mlp_ratio: int = 4, chunk_size: int = 64, bias: bool = False, positions: str = DEFAULT_POSITIONS,
                 short_conv: bool = True, conv_size: int = 4, qk_norm: bool = True,
                 negative_eigenvalues: bool = False, output_norm: bool = True, output_gate: bool = True) -> None:
        super().__init__()
        vocab_size, d_model, n_layers, n_heads, mlp_ratio, chunk_size, conv_size = (
            _checks.check_positive_int(value, name) for value, name in (
                (vocab_size, "vocab_size"), (d_model, "d_model"), (n_layers, "n_layers"), (n_heads, "n_heads"),
                (mlp_ratio, "mlp_ratio"), (chunk_size, "chunk_size"), (conv_size, "conv_size")))
        if n_kv_heads is not None:
            n_kv_heads = _checks.check_positive_int(n_kv_heads, "n_kv_heads")
        positions = check_positions_name(positions)
        if max_len is not None:
            max_len = _checks.check_positive_int(max_len, "max_len")
        elif positions == "learned":
            raise ValueError("positions='learned' needs max_len, the number of learned positions (an int), got "
                             "None; positions='rope' or 'none' need no max_len")
        names = _mixer_names(attention, n_layers)
        bias, short_conv, qk_norm, negative_eigenvalues, output_norm, output_gate = (
            _checks.check_bool(value, name) for value, name in (
                (bias, "bias"), (short_conv, "short_conv"), (qk_norm, "qk_norm"),
                (negative_eigenvalues, "negative_eigenvalues"), (output_norm, "output_norm"),
                (output_gate, "output_gate")))                             # the config holds Python values
        if conv_size < 2:
            raise ValueError(f"conv_size must be >= 2 (a kernel of 1 mixes no tokens), got {conv_size}")
        self.config = TransformerConfig(
            vocab_size, d_model, n_layers, n_heads, n_kv_heads, attention if isinstance(attention, str) else names,
            feature_map, max_len, mlp_ratio, chunk_size, bias, positions, short_conv, conv_size, qk_norm,
            negative_eigenvalues, output_norm, output_gate)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model) if positions == "learned" else None
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, n_kv_heads=n_kv_heads, attention=name, feature_map=feature_map,
                             causal=True, mlp_ratio=mlp_ratio, chunk_size=chunk_size, bias=bias,
                             rope=positions == "rope", short_conv=short_conv, conv_size=conv_size, qk_norm=qk_norm,
                             negative_eigenvalues=negative_eigenvalues, output_norm=output_norm,
                             output_gate=output_gate)
            for name in names)
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight                        # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():                           # GPT-2's scaled residual init
            if name.endswith("out_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @_checks.reject_key_padding_mask
    def forward(self, idx: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[DecodingState] = None, return_state: bool = False
                ) -> Union[Tensor, tuple[Tensor, DecodingState]]:
        """Next-token logits for every position of ``idx`` (continuing from ``state``).

        Parameters
        ----------
        idx : Tensor
            ``(B, T)`` int64 token ids in ``[0, vocab_size)``.
        attention_mask : Tensor, optional
            ``(B, T)`` bool or 0/1 integers, True (1) for real tokens (Hugging Face's
            convention; PyTorch's ``key_padding_mask`` is the opposite and refused by name).
            Positions count real tokens only, so a left-padded prompt is processed exactly
            as the same prompt alone.
        state : DecodingState, optional
            From an earlier call with ``return_state=True``: ``idx`` continues those sequences.
            Checked at every call, and each layer's state again by its token mixer.
        return_state : bool
            Also return the state after ``idx``.

        Returns
        -------
        logits : Tensor
            ``(B, T, vocab_size)`` in the parameters' dtype (meaningless at padded positions).
        state : DecodingState
            Only if ``return_state``: a new state sharing no memory with the inputs.

        Raises
        ------
        TypeError
            ``idx`` not an int64 tensor; a non-bool mask; a ``state`` that is not a
            ``DecodingState``, holds the wrong kind of layer state for a block (or None), or
            has positions that are not an int64 tensor.
        ValueError
            ``idx`` not 2-D, empty (``B`` or ``T`` = 0) or with ids out of range; a mask not
            ``(B, T)``; a state for a different batch or number of layers, with negative
            positions or positions on another device; a position ``>= max_len`` (when the
            model has a ``max_len``).
        RuntimeError
            Under ``torch.compile`` (which traces ``forward`` into one graph, no breaks), ids
            out of range, positions ``>= max_len`` and non-0/1 integer masks are checked inside
            the graph (``torch._assert_async``) and raise this instead of the ValueError.
        """
        cfg = self.config
        self._check_idx(idx)
        B, T = idx.shape
        attention_mask = _check_attention_mask(attention_mask, B, T, idx.device)
        return_state = _checks.check_bool(return_state, "return_state")
        start = self._check_state(state, B, idx.device)                   # (B,)
        pos = token_positions(start, attention_mask, T)                   # (B, T) padding before a prompt: 0
        if cfg.max_len is not None:
            why = ("the model's learned positions" if cfg.positions == "learned"
                   else "the limit the model was built with; max_len=None sets none")
            _checks.check_values(pos < cfg.max_len, "the position of every token",
                                 f"< max_len={cfg.max_len} ({why}: a sequence holds at most {cfg.max_len} real "
                                 "tokens, earlier ones in state included)", pos)
        x = self.tok_emb(idx)                                             # (B, T, d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(pos)
        rope_positions = pos if cfg.positions == "rope" else None
        layer_states = []
        for i, block in enumerate(self.blocks):
            out = block(x, attention_mask=attention_mask, state=None if state is None else state.layers[i],
                        return_state=return_state, positions=rope_positions)
            x, s = out if return_state else (out, None)
            layer_states.append(s)
        logits = self.lm_head(self.ln_f(x))                               # (B, T, vocab_size)
        if not return_state:
            return logits
        n_real = torch.full_like(start, T) if attention_mask is None else attention_mask.sum(dim=1)
        return logits, DecodingState(layer_states, start + n_real)

    def _check_idx(self, idx) -> None:
        """``idx`` is a ``(B, T)`` int64 tensor of ids on the model's device (as a graph-safe value check)."""
        V = self.config.vocab_size
        if not isinstance(idx, Tensor) or idx.dtype != torch.long:
            raise TypeError(f"idx must be an int64 (torch.long) tensor of token ids, got {describe(idx)}")
        if idx.dim() != 2 or idx.shape[0] == 0 or idx.shape[1] == 0:
            raise ValueError(f"idx must have shape (batch, seq) with batch, seq >= 1, got {shape_str(idx.shape)}")
        device = self.tok_emb.weight.device
        if idx.device != device:
            raise ValueError(f"idx is on {idx.device} but the model's parameters are on {device}")
        _checks.check_values((idx >= 0) & (idx < V), "idx", f"a tensor of token ids in [0, {V})", idx)

    def _check_state(self, state, batch: int, device) -> Tensor:
        """The positions where the sequences continue: (B,) int64 (zeros without a state).

        Checked at every use; each layer state is checked again by its attention layer."""
        if state is None:
            return torch.zeros(batch, dtype=torch.long, device=device)
        if not isinstance(state, DecodingState):
            raise TypeError(f"state must be a DecodingState (or None), got {type(state).__name__}")
        state.validate()
        if len(state.layers) != self.config.n_layers:
            raise ValueError(f"state must hold one layer state per block ({self.config.n_layers}), got "
                             f"{len(state.layers)}")
        for i, (s, block) in enumerate(zip(state.layers, self.blocks)):
            kind = _state_type(block.attn)
            if not isinstance(s, kind):
                raise TypeError(f"state.layers[{i}] must be a {kind.__name__} for block {i} "
                                f"({type(block.attn).__name__}), got {type(s).__name__}")
        p = state.positions
        if tuple(p.shape) != (batch,):
            raise ValueError(f"state.positions must be an int64 tensor of shape (batch,) = ({batch},), "
                             f"got {describe(p)}")
        if p.device != device:
            raise ValueError(f"state.positions is on {p.device} but idx is on {device}")
        _checks.check_values(p >= 0, "state.positions", "a count of tokens seen, >= 0", p)
        return p

    def decoding_state_nbytes(self, position: int, batch: int = 1) -> int:
        """Bytes of the :class:`DecodingState` after ``position`` tokens (no padding), computed from the sizes.

        Equal to ``state.nbytes`` of the state :meth:`forward` returns after ``position``
        tokens of ``batch`` sequences in the parameters' dtype: a fixed size for each
        linear layer (:class:`~linattn.LinearAttentionState`, :class:`~linattn.MixerState`),
        a cache growing by one key and one value per token for each softmax layer, and the
        ``(batch,)`` int64 positions. For plots of memory against position.

        Parameters
        ----------
        position : int
            Tokens seen, ``>= 0`` (at most ``max_len`` when the model has one).
        batch : int
            Sequences, ``>= 1``.

        Raises
        ------
        TypeError
            A non-integer ``position`` or ``batch``.
        ValueError
            ``position < 0`` or past ``max_len``; ``batch < 1``.
        """
        position = _check_count(position, "position")
        batch = _checks.check_positive_int(batch, "batch")
        if self.config.max_len is not None and position > self.config.max_len:
            raise ValueError(f"position must be <= max_len={self.config.max_len}, got {position}")
        layers = sum(block.attn.decoding_state_nbytes(position, batch) for block in self.blocks)
        return layers + batch * torch.empty((), dtype=torch.long).element_size()

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in nats: ``idx``, ``targets`` ``(B, T)`` int64 -> scalar.

        ``targets`` holds token ids in ``[0, vocab_size)``, or ``-100`` for positions that are not
        scored (``F.cross_entropy``'s ``ignore_index``).

        Raises
        ------
        TypeError
            ``targets`` not an int64 tensor (and as :meth:`forward`, which checks ``idx`` first).
        ValueError
            ``targets`` not of the shape of ``idx``, or with values outside ``[0, vocab_size)``
            other than ``-100``.
        """
        logits = self(idx)                                                # (B, T, V); checks idx
        if not isinstance(targets, Tensor) or targets.dtype != torch.long:
            raise TypeError(f"targets must be an int64 (torch.long) tensor of token ids, got {describe(targets)}")
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {shape_str(idx.shape)}, got {shape_str(targets.shape)}")
        V = self.config.vocab_size
        _checks.check_values(((targets >= 0) & (targets < V)) | (targets == -100), "targets",
                             f"token ids in [0, {V}) or -100 (not scored)", targets)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    @_checks.reject_key_padding_mask
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 *, attention_mask: Optional[Tensor] = None, generator: Optional[torch.Generator] = None) -> Tensor:
        """Continue each prompt by ``max_new_tokens`` tokens, one at a time, from the decoding state.

        The prompt is processed in one parallel pass that returns the state (the recurrent
        state of each linear layer, the KV cache of each softmax layer); each new token then
        costs one step from that state. Sampling follows nanoGPT: the logits optionally cut
        to the ``top_k`` largest, divided by ``temperature``, then a draw from their softmax.
        Every argument is checked before anything runs, whatever ``max_new_tokens`` is.

        A model with a ``max_len`` holds at most ``max_len`` real tokens per sequence, the
        prompt's and the generated ones together (``longest prompt + max_new_tokens <=
        max_len``), so the returned sequences are valid inputs of :meth:`forward` (with the mask
        extended by True). Without one (``positions="rope"`` or ``"none"`` and ``max_len=None``)
        any number of tokens can be generated; with only linear layers each costs the same.

        Parameters
        ----------
        idx : Tensor
            ``(B, T)`` int64 prompts, as in :meth:`forward`. Prompts of different lengths are
            left-padded: pad ids (any valid id) first, marked False in ``attention_mask``.
        max_new_tokens : int
            Tokens to generate, ``>= 0``.
        temperature : float
            ``> 0`` to sample, any positive float: the draw is from
            ``softmax((logits - max) / temperature)``, so as ``temperature`` goes to 0 it
            becomes the most likely token (a uniform draw among exact ties) and never
            overflows; ``0`` for greedy decoding (the first most likely token every step).
        top_k : int, optional
            Sample among the ``top_k`` most likely tokens only (tokens tied with the
            ``top_k``-th are kept; a ``top_k`` of at least ``vocab_size`` cuts nothing).
        attention_mask : Tensor, optional
            ``(B, T)`` bool or 0/1 integers, True (1) for real tokens (Hugging Face's
            convention; PyTorch's ``key_padding_mask`` is the opposite and refused by name).
            Each row must be False then True (left padding), ending in a real token.
        generator : torch.Generator, optional
            Random source of the draws, on the model's device type.

        Returns
        -------
        Tensor
            ``(B, T + max_new_tokens)`` int64: the prompts as given (a copy), then the new
            tokens. Each row equals what its prompt generates alone (greedy; up to float
            rounding).

        Raises
        ------
        TypeError
            ``idx`` not an int64 tensor; a non-integer ``max_new_tokens`` or ``top_k``; a
            non-number ``temperature``; a ``generator`` that is not a ``torch.Generator``; a
            non-bool mask.
        ValueError
            ``idx`` not ``(B, T)`` with ``B, T >= 1``, not on the model's device or with ids
            out of range; negative ``max_new_tokens``; a negative or non-finite
            ``temperature``; ``top_k < 1``; a generator on another device type; a mask that is
            not ``(B, T)`` or not left padding; a prompt plus ``max_new_tokens`` longer than
            ``max_len`` (when the model has one).
        """
        self._check_idx(idx)
        B, T = idx.shape
        max_new_tokens = _check_count(max_new_tokens, "max_new_tokens")
        temperature = _check_temperature(temperature)
        if top_k is not None:
            top_k = _checks.check_positive_int(top_k, "top_k")
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator must be a torch.Generator (or None), got {_checks.type_name(generator)}")
            if generator.device.type != idx.device.type:
                raise ValueError(f"generator is on {generator.device} but the model is on {idx.device}")
        attention_mask = _check_attention_mask(attention_mask, B, T, idx.device)
        if attention_mask is not None:
            left_padded = (attention_mask[:, 1:] >= attention_mask[:, :-1]).all() & attention_mask[:, -1].all()
            if not bool(left_padded):
                raise ValueError("attention_mask must describe left padding (each row False... then True..., "
                                 "ending in a real token) for generate")
        longest = T if attention_mask is None else int(attention_mask.sum(dim=1).max())
        if self.config.max_len is not None and longest + max_new_tokens > self.config.max_len:
            raise ValueError(f"a prompt of {longest} real tokens plus max_new_tokens={max_new_tokens} makes "
                             f"{longest + max_new_tokens} tokens but the model has max_len={self.config.max_len} "
                             "positions")
        if max_new_tokens > 1:                    # tokens after the first are decoded from the state
            for i, block in enumerate(self.blocks):
                phi = getattr(block.attn, "feature_map", None)
                if _checks.position_dependent(phi):
                    raise ValueError(
                        f"generate cannot decode with the position-dependent feature_map {type(phi).__name__} of "
                        f"block {i}: a decoding state does not record positions, so the new tokens would get the "
                        "features of position 0; use a position-independent feature map to generate")
        if max_new_tokens == 0:
            return idx.clone()
        logits, state = self(idx, attention_mask=attention_mask, return_state=True)  # (B, T, V)
        new = []
        for i in range(max_new_tokens):
            nxt = self._pick(logits[:, -1], temperature, top_k, generator)                # (B, 1)
            new.append(nxt)
            if i + 1 < max_new_tokens:                                                   # the last is not fed back
                logits, state = self(nxt, state=state, return_state=True)                 # (B, 1, V)
        return torch.cat([idx, *new], dim=1)                                              # (B, T + new)

    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: Optional[int], generator) -> Tensor:
        """One token per row of ``logits`` (B, V): argmax when ``temperature == 0``, else a draw."""
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)                   # (B, 1)
        logits = logits.float()
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]       # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        # Shift first: (logits - max) <= 0, exactly 0 at the maximum, so dividing by a tiny temperature
        # gives 0 and -inf (never inf - inf = NaN). The temperature rounds to float32 here: to 0 (for
        # 0 < temperature < 1.4e-45) or inf (above 3.4e38); 0/0 and -inf/inf are then fixed to 0 and -inf.
        shifted = logits - logits.amax(dim=-1, keepdim=True)             # (B, V)
        scaled = torch.where(shifted == 0, 0.0, torch.where(shifted == float("-inf"), float("-inf"),
                                                            shifted / temperature))
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)  # (B, 1)


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def _features(phi, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """φ(q), φ(k) computed in the accumulation dtype (float32 for half inputs, as the functions do).

    In float16 a feature map such as Performer's exponential underflows or overflows long before
    float32 does; the features stay in float32 and the attention functions round only the output.
    """
    if phi is None:
        return q, k
    acc = _checks.accumulation_dtype(q.dtype)
    return phi(q.to(acc)), phi(k.to(acc))


def _set_linear_options(layer: nn.Module, feature_map, normalize, eps, chunk_size) -> None:
    """Check and store the options of linear attention on ``layer`` (after its sizes are set)."""
    layer.normalize = _checks.check_bool(normalize, "normalize")
    layer.chunk_size = _checks.check_chunk_size(chunk_size)
    layer.eps = _checks.check_eps(eps, torch.float32)                    # linear_attention's rule for float32
    layer.feature_map = _build_feature_map(feature_map, layer.head_dim)  # a module is registered
    layer.feature_map_name = feature_map if isinstance(feature_map, str) else None


def _is_causal_mask(mask, Tq: int, Tk: int) -> bool:
    """``mask`` is PyTorch's causal attn_mask: (T, T) bool True above the diagonal, or float -inf there and 0 below."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {_checks.type_name(mask)}")
    if Tq != Tk or tuple(mask.shape) != (Tq, Tk):
        return False
    future = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).triu(1)  # (T, T) keys after the query
    if mask.dtype == torch.bool:
        return torch.equal(mask, future)
    if mask.is_floating_point():
        return torch.equal(mask == float("-inf"), future) and bool((mask[~future] == 0).all())
    return False


def _check_temperature(value) -> float:
    """A finite real number >= 0 (Python or NumPy), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a float, got {_checks.type_name(value)}")
    try:
        t = float(value)
    except OverflowError:                                                 # an int beyond float's range
        t = math.inf
    if not (t >= 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {value}")
    return t


def _check_count(value, name: str) -> int:
    """``value`` is a Python or NumPy integer >= 0; returns it as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_checks.type_name(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _build_feature_map(feature_map, head_dim: int):
    """φ for a layer: a name of a map that takes ``head_dim`` (Hedgehog, Performer) is built for
    this layer's ``head_dim``; anything else as :func:`linattn.linear_attention` resolves it."""
    if isinstance(feature_map, str):
        cls = PARAMETRIC_FEATURE_MAPS.get(feature_map.strip().lower())
        if cls is not None and "head_dim" in inspect.signature(cls).parameters:
            return get_feature_map(feature_map, head_dim=head_dim)
    return resolve_feature_map(feature_map)


def _mixer_names(attention, n_layers: int) -> list:
    """``attention`` (one name, or one per layer) as a list of ``n_layers`` checked names."""
    if isinstance(attention, str):
        names = [attention] * n_layers
    elif isinstance(attention, (list, tuple)):
        if len(attention) != n_layers:
            raise ValueError(f"attention must name one token mixer per layer, n_layers={n_layers} names, got a "
                             f"{type(attention).__name__} of {len(attention)}: {list(attention)!r}")
        names = list(attention)
    else:
        raise TypeError(f"attention must be a str or a list of str (one per layer), got "
                        f"{_checks.type_name(attention)}")
    for i, name in enumerate(names):
        where = "attention" if isinstance(attention, str) else f"attention[{i}]"
        if not isinstance(name, str):
            raise TypeError(f"{where} must be a str, one of {ATTENTIONS}, got {_checks.type_name(name)}")
        if name not in ATTENTIONS:
            raise ValueError(f"{where} must be one of {ATTENTIONS}, got {name!r}")
    return names


def _check_attention_mask(mask, batch: int, seq: int, device) -> Optional[Tensor]:
    """A ``(batch, seq)`` bool or 0/1 integer mask (True/1 = real token) as bool, or None."""
    return _checks.attention_mask_as_bool(mask, batch, seq, device)
