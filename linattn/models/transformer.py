"""A decoder-only Transformer language model with linear, softmax or hybrid token mixing (nanoGPT's GPT)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._checks import describe, shape_str
from ..feature_maps import FeatureMap
from ..layers.linear import LinearAttention
from ..layers.mixer import DELTA_RULES, RULES, LinearMixer
from ..layers.positions import DEFAULT_POSITIONS, check_positions_name, packed_positions, token_positions
from ..ops.varlen import check_cu_seqlens
from ..layers.softmax import SoftmaxAttention
from ..state import DecodingState, KVCache, LinearAttentionState, MixerState
from .generation import generate

__all__ = ["ATTENTIONS", "TransformerBlock", "TransformerConfig", "TransformerLM"]

ATTENTIONS = ("linear", "softmax") + RULES       # the token mixers a TransformerLM layer may use


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
                return_state: bool = False, positions: Optional[Tensor] = None,
                cu_seqlens: Optional[Tensor] = None):
        """``(B, T, d_model) -> (B, T, d_model)``; ``attention_mask``, ``state``,
        ``return_state`` and ``cu_seqlens`` (a packed batch) are passed to the token mixer (see
        :meth:`LinearAttention.forward`,
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
        if cu_seqlens is not None:
            extra["cu_seqlens"] = cu_seqlens
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
        ``positions="rope"`` with an odd ``head_dim`` and softmax layers or with a feature map
        of an odd number of features and ``"linear"`` layers (Taylor's whenever
        ``head_dim % 4 == 0``), ``conv_size < 2``,
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
                state: Optional[DecodingState] = None, return_state: bool = False,
                cu_seqlens: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, DecodingState]]:
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
        cu_seqlens : Tensor, optional
            A packed batch for training (flash-linear-attention's meaning): ``idx`` is
            ``(1, T)``, ``N`` sequences end to end, ``cu_seqlens`` their ``N + 1`` offsets (1-D
            int32 or int64 from 0 to ``T``, empty sequences allowed). Each sequence is
            modelled alone: its positions start at 0, and every layer's mixing (the short
            convolutions included) restarts at its first token. Not with ``attention_mask``,
            ``state`` or ``return_state=True``.

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
            model has a ``max_len``); ``cu_seqlens`` with ``B != 1``, with ``attention_mask``,
            ``state`` or ``return_state=True``, not 1-D, or not offsets from 0 to ``T`` that
            never decrease (TypeError if not an int32/int64 tensor).
        RuntimeError
            Under ``torch.compile`` (which traces ``forward`` into one graph, no breaks), ids
            out of range, positions ``>= max_len`` and non-0/1 integer masks are checked inside
            the graph (``torch._assert_async``) and raise this instead of the ValueError.
        """
        cfg = self.config
        self._check_idx(idx)
        B, T = idx.shape
        attention_mask = _checks.attention_mask_as_bool(attention_mask, B, T, idx.device)
        return_state = _checks.check_bool(return_state, "return_state")
        start = self._check_state(state, B, idx.device)                   # (B,)
        if cu_seqlens is not None:
            if state is not None or return_state:
                raise ValueError("TransformerLM takes cu_seqlens for training only: no state and return_state=False "
                                 "(decode the sequences as a padded batch)")
            check_cu_seqlens(cu_seqlens, B, T, attention_mask)
            pos = packed_positions(cu_seqlens, T).to(idx.device)          # (1, T) from 0 in every sequence
        else:
            pos = token_positions(start, attention_mask, T)               # (B, T) padding before a prompt: 0
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
                        return_state=return_state, positions=rope_positions, cu_seqlens=cu_seqlens)
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
        """The positions where the sequences continue: (B,) int64 (zeros without a state)."""
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
        position = _checks.check_non_negative_int(position, "position")
        batch = _checks.check_positive_int(batch, "batch")
        if self.config.max_len is not None and position > self.config.max_len:
            raise ValueError(f"position must be <= max_len={self.config.max_len}, got {position}")
        layers = sum(block.attn.decoding_state_nbytes(position, batch) for block in self.blocks)
        return layers + batch * torch.empty((), dtype=torch.long).element_size()

    def loss(self, idx: Tensor, targets: Tensor, *, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """Mean next-token cross-entropy in nats: ``idx``, ``targets`` ``(B, T)`` int64 -> scalar.

        ``cu_seqlens`` (a packed batch, as in :meth:`forward`) reaches the forward pass; the
        targets of each sequence's last token are the caller's (``-100`` skips them).

        Raises
        ------
        TypeError
            ``targets`` not an int64 tensor (and as :meth:`forward`, which checks ``idx`` first).
        ValueError
            ``targets`` not of the shape of ``idx``, or with values outside ``[0, vocab_size)``
            other than ``-100``.
        """
        logits = self(idx, cu_seqlens=cu_seqlens)                         # (B, T, V); checks idx
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
        return generate(self, idx, max_new_tokens, temperature, top_k, attention_mask=attention_mask,
                        generator=generator)


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
