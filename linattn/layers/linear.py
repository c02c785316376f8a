"""Multi-head linear attention, causal or not, with grouped key-value heads and rotary positions
(Katharopoulos et al., 2020; RoFormer, Su et al., 2021)."""
from __future__ import annotations

import inspect
from typing import Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from .. import _checks
from .._checks import shape_str
from .._numerics import guarded_normaliser
from ..attention import linear_attention, linear_attention_step
from ..feature_maps import PARAMETRIC_FEATURE_MAPS, FeatureMap, get_feature_map, resolve_feature_map
from ..state import LinearAttentionState
from .positions import ROPE_BASE, apply_rope
from .projections import MultiHeadProjections

__all__ = ["LinearAttention"]


class LinearAttention(MultiHeadProjections):
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

    With ``rope=True`` the positions enter as RoFormer puts them into linear attention (Su et
    al., 2021, arXiv:2104.09864, sec. 3.3, eq. 19): the features are rotated in the numerator
    only, with :func:`linattn.layers.positions.apply_rope` (``R_i`` the rotation of position ``i``)::

        y_i = Σ_j (R_i φ(q_i))ᵀ(R_j φ(k_j)) v_j / Σ_j φ(q_i)ᵀφ(k_j)

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
        unknown feature map name, ``rope=True`` with a feature map that gives an odd number of
        features (Taylor's whenever ``head_dim % 4 == 0``).
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None,
                 feature_map: Union[str, FeatureMap, None] = "elu+1", causal: bool = False,
                 normalize: bool = True, eps: float = 1e-6, chunk_size: int = 64, bias: bool = False,
                 rope: bool = False, rope_base: float = ROPE_BASE) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, causal, bias, rope, rope_base)
        _set_linear_options(self, feature_map, normalize, eps, chunk_size)
        M = self._n_features() if self.rope else 0
        if M % 2:
            raise ValueError(
                f"rope=True rotates pairs of features, but feature_map={self.feature_map_name or self.feature_map!r} "
                f"gives an odd number of features, M={M}, for head_dim={self.head_dim} (Taylor's 1 + D + D(D+1)/2 "
                "is odd whenever D % 4 == 0): pass rope=False (in TransformerLM, positions='none' or 'learned'), "
                "or a feature map with an even number of features")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", feature_map={self.feature_map_name or self.feature_map!r}"

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[LinearAttentionState] = None, return_state: bool = False,
                positions: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None
                ) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
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
        cu_seqlens : Tensor, optional
            A packed batch for training (flash-linear-attention's meaning): ``x`` is
            ``(1, T, d_model)``, ``N`` sequences end to end, ``cu_seqlens`` their ``N + 1``
            offsets (1-D int32 or int64 from 0 to ``T``); each sequence is attended alone and its
            positions start at 0. Needs ``causal=True``; not with ``attention_mask``, ``state``,
            ``return_state=True`` or a position-dependent feature map.

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
            ``rope=True``; an odd number of features ``M`` with ``rope=True``; ``cu_seqlens``
            that is not a valid packing of ``x`` or is combined with what it cannot be (above).
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        self._check_packing(cu_seqlens, x, attention_mask, state, return_state)
        phi = self.feature_map
        if cu_seqlens is not None and getattr(phi, "position_dependent", False):
            raise ValueError(f"cu_seqlens cannot be used with the position-dependent feature_map {type(phi).__name__}: "
                             "it would give the tokens the positions of the packed row, not of their sequences")
        if state is not None and getattr(phi, "position_dependent", False):
            raise ValueError(
                f"state cannot be continued with the position-dependent feature_map {type(phi).__name__}: "
                "a LinearAttentionState does not record how many tokens it has seen, so the new tokens "
                "would get the features of positions 0, 1, ...; use a position-independent map to decode")
        _checks.check_position_dependent(phi, causal=self.causal, resumed=False, same_length=True,
                                         caller=type(self).__name__)
        q, k, v = self._project(x)                                        # (B, H, T, D), (B, H_kv, T, D) x2
        phi_q, phi_k = _head_features(phi, q, k)                               # (B, H, T, M), (B, H_kv, T, M)
        v = v.to(phi_k.dtype)                                             # float32 with the features of half x
        self._check_state(state, x, phi_k.shape[-1])
        positions = self._positions(positions, x, attention_mask, state, cu_seqlens)  # (B, T) or None
        state = self._expand_state(state)                                 # per query head: (B, H, M, D)
        phi_k, v = self._repeat_kv(phi_k), self._repeat_kv(v)             # (B, H, T, M), (B, H, T, D)
        if self.rope:
            y, state = self._rotary(phi_q, phi_k, v, positions, attention_mask, state, cu_seqlens)
        elif self.causal and x.shape[1] == 1 and attention_mask is None and cu_seqlens is None:  # the recurrence
            y, state = linear_attention_step(
                phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], state,
                feature_map=None, normalize=self.normalize, eps=self.eps)  # (B, H, D)
            y = y.unsqueeze(2)                                            # (B, H, 1, D)
        else:
            y = linear_attention(
                phi_q, phi_k, v, feature_map=None, causal=self.causal, normalize=self.normalize,
                eps=self.eps, chunk_size=self.chunk_size, attention_mask=attention_mask,
                initial_state=state, return_state=return_state, cu_seqlens=cu_seqlens)   # (B, H, T, D)
            if return_state:
                y, state = y
        y = self._merge(y.to(x.dtype))                                    # (B, T, d_model)
        return (y, self._shrink_state(state)) if return_state else y

    def _rotary(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, attention_mask: Optional[Tensor],
                state: Optional[LinearAttentionState], cu_seqlens: Optional[Tensor] = None
                ) -> tuple[Tensor, LinearAttentionState]:
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
                       attention_mask=attention_mask, return_state=True, cu_seqlens=cu_seqlens)
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
        acc = _checks.accumulation_dtype(self.q_proj.weight.dtype)
        return (batch * self.n_kv_heads * self._n_features() * (self.head_dim + 1)
                * torch.empty((), dtype=acc).element_size())

    def _n_features(self) -> int:
        """``M``, the number of features φ gives for one head of ``head_dim``."""
        if self.feature_map is None:
            return self.head_dim
        with torch.no_grad():
            return self.feature_map(self.q_proj.weight.new_zeros(1, 1, 1, self.head_dim)).shape[-1]

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


def _head_features(phi, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """φ(q), φ(k) computed in the accumulation dtype (float32 for half inputs, as the functions do)."""
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


def _build_feature_map(feature_map, head_dim: int):
    """φ for a layer: a name of a map that takes ``head_dim`` (Hedgehog, Performer) is built for
    this layer's ``head_dim``; anything else as :func:`linattn.linear_attention` resolves it."""
    if isinstance(feature_map, str):
        cls = PARAMETRIC_FEATURE_MAPS.get(feature_map.strip().lower())
        if cls is not None and "head_dim" in inspect.signature(cls).parameters:
            return get_feature_map(feature_map, head_dim=head_dim)
    return resolve_feature_map(feature_map)
