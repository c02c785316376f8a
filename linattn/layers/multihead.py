"""Linear attention behind ``nn.MultiheadAttention``'s call: ``(query, key, value) -> (output, None)``."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import _checks
from .._checks import describe, shape_str
from ..attention import linear_attention
from ..feature_maps import FeatureMap
from .linear import _head_features, _set_linear_options
from .projections import MultiHeadProjections

__all__ = ["LinearMultiheadAttention"]


class LinearMultiheadAttention(MultiHeadProjections):
    """Linear attention behind ``nn.MultiheadAttention``'s call (Katharopoulos et al., 2020).

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

    Inside ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` (set ``layer.self_attn`` to
    it) it runs in train and eval mode, with or without grad: ``in_proj_bias`` is None and
    ``_qkv_same_embed_dim`` False, which is what tells PyTorch's fused inference path (softmax
    attention on ``nn.MultiheadAttention``'s packed weights) not to run in its place, and the
    float (0 / −inf) ``src_key_padding_mask`` PyTorch passes on is accepted.

    Raises
    ------
    TypeError
        A non-int size, a non-bool flag, a non-number ``eps``, a bad feature map.
    ValueError
        ``batch_first=False``; a size < 1; ``embed_dim`` not divisible by ``num_heads``;
        ``eps`` not a normal positive float32 number; an unknown feature map name.
    """

    # What nn.TransformerEncoderLayer and nn.TransformerEncoder read before their fused fast path:
    # no packed input projection, so the fast path (softmax attention) is never taken.
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

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
            ``attention_mask`` elsewhere in linattn): padded keys add nothing. Or the float mask
            ``nn.TransformerEncoderLayer`` makes of it: ``−inf`` for padding, 0 elsewhere.
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
            Non-floating inputs or inputs not in the parameters' dtype; a ``key_padding_mask``
            neither bool nor floating; a non-bool flag; an ``attn_mask`` that is not a tensor.
        ValueError
            Inputs that are not 3-D ``(B, T, embed_dim)``, empty, of different batch, or
            ``key`` and ``value`` of different lengths; inputs not on the parameters' device;
            a ``key_padding_mask`` that is not ``(B, Tk)``, or a float one with values other than
            0 and ``−inf`` (an additive bias has no linear-attention form); ``need_weights=True``; an
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
            key_padding_mask = _padding_as_bool(key_padding_mask)
            attention_mask = ~_checks.attention_mask_as_bool(key_padding_mask, B, Tk, query.device,
                                                             name="key_padding_mask")  # True = real token
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        phi = self.feature_map
        _checks.check_position_dependent(phi, causal=causal, resumed=False, same_length=Tq == Tk,
                                         caller="LinearMultiheadAttention")
        phi_q, phi_k = _head_features(phi, q, k)                                # (B, H, Tq, M), (B, H, Tk, M)
        y = linear_attention(phi_q, phi_k, v.to(phi_k.dtype), feature_map=None, causal=causal,
                             normalize=self.normalize, eps=self.eps, chunk_size=self.chunk_size,
                             attention_mask=attention_mask)                # (B, H, Tq, D)
        return self._merge(y.to(query.dtype)), None                        # (B, Tq, embed_dim)

    def _check_sequence(self, t, name: str) -> None:
        _checks.check_layer_input(t, name, self.embed_dim, "embed_dim", self.q_proj.weight,
                                  hint=" (batch first; unbatched inputs are not supported)")


def _padding_as_bool(mask) -> Tensor:
    """PyTorch's key padding mask as bool, True = padding: a bool mask as it is, a float one (what
    ``F._canonical_mask`` makes of a bool mask) where it is ``-inf``."""
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding, PyTorch's meaning) or a float "
                        f"one (-inf = padding, 0 elsewhere), got {describe(mask)}")
    if mask.dtype == torch.bool:
        return mask
    padding = mask == float("-inf")
    _checks.check_values(padding | (mask == 0), "key_padding_mask",
                         "0 or -inf where it is a float mask (an additive bias has no linear-attention form)", mask)
    return padding


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
