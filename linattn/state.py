"""The states linattn carries between calls: one class per kind, each checking itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import _checks
from ._checks import describe, shape_str

__all__ = ["LinearAttentionState", "MixerState", "KVCache", "DecodingState", "check_initial_state"]


@dataclass(eq=False)
class LinearAttentionState:
    """The running state of causal linear attention after some prefix of a sequence.

    Attributes
    ----------
    S : Tensor
        ``(B, H, M, Dv)``, the sum of outer products ``Σ_j φ(k_j) v_jᵀ``.
    z : Tensor
        ``(B, H, M)``, the normaliser ``Σ_j φ(k_j)``.

    Both are kept in float32 (float64 when the inputs are float64), whatever the input
    dtype, so that half-precision inputs do not lose the small increments of a long sum.
    Its size, ``B·H·M·(Dv + 1)`` numbers, does not depend on how many tokens it has seen.

    ``==`` compares values (see :meth:`__eq__`). States returned by linattn own their memory
    (contiguous tensors that share no storage with any input).

    Raises
    ------
    TypeError
        If ``S`` or ``z`` is not a floating tensor.
    ValueError
        If ``S`` is not 4-D, ``z`` not 3-D, a dimension is empty, or their (B, H, M),
        dtypes or devices disagree.
    """

    S: Tensor
    z: Tensor

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, name: str = "state") -> None:
        """Check ``S`` and ``z`` (run on construction and again by every function that uses the
        state, so that a state whose attributes were reassigned is caught).

        Raises
        ------
        TypeError
            If ``S`` or ``z`` is not a floating tensor.
        ValueError
            If ``S`` is not 4-D, ``z`` not 3-D, a dimension is empty, they disagree on
            (B, H, M), or on dtype or device.
        """
        _checks.check_tensor(self.S, f"{name}.S", 4, "(batch, heads, M, Dv)")
        _checks.check_tensor(self.z, f"{name}.z", 3, "(batch, heads, M)")
        if self.S.dtype != self.z.dtype or self.S.device != self.z.device:
            raise ValueError(
                f"{name}.S and {name}.z must share dtype and device, got S {self.S.dtype} on "
                f"{self.S.device} and z {self.z.dtype} on {self.z.device}"
            )
        if self.S.shape[:3] != self.z.shape:
            raise ValueError(
                f"{name}.S (B, H, M, Dv) and {name}.z (B, H, M) disagree: got S "
                f"{_checks.shape_str(self.S.shape)} and z {_checks.shape_str(self.z.shape)}"
            )

    def __eq__(self, other) -> bool:
        """Two states are equal when their ``S`` and their ``z`` have the same shape, dtype,
        device and values (``torch.equal``); anything that is not a state is not equal."""
        if not isinstance(other, LinearAttentionState):
            return NotImplemented
        return all(a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
                   for a, b in ((self.S, other.S), (self.z, other.z)))

    __hash__ = None   # mutable, compared by value

    @classmethod
    def zeros(cls, batch: int, heads: int, feature_dim: int, value_dim: int, *,
              dtype: torch.dtype = torch.float32, device=None) -> "LinearAttentionState":
        """An empty state (no tokens seen): ``S`` of shape (batch, heads, feature_dim, value_dim), ``z`` zeros.

        Raises
        ------
        TypeError
            If a size is not an int.
        ValueError
            If a size is < 1.
        """
        for name, n in (("batch", batch), ("heads", heads), ("feature_dim", feature_dim), ("value_dim", value_dim)):
            _checks.check_positive_int(n, name)
        S = torch.zeros(batch, heads, feature_dim, value_dim, dtype=dtype, device=device)
        z = torch.zeros(batch, heads, feature_dim, dtype=dtype, device=device)
        return cls(S, z)

    def detach(self) -> "LinearAttentionState":
        """The same state cut from the autograd graph (for truncated back-propagation)."""
        return LinearAttentionState(self.S.detach(), self.z.detach())

    def to(self, *args, **kwargs) -> "LinearAttentionState":
        """Move or cast both tensors, with the arguments of ``Tensor.to``."""
        return LinearAttentionState(self.S.to(*args, **kwargs), self.z.to(*args, **kwargs))

    @property
    def nbytes(self) -> int:
        """Memory held by the state, in bytes (constant in the number of tokens seen)."""
        return self.S.numel() * self.S.element_size() + self.z.numel() * self.z.element_size()

    # The algorithms carry S and z as one tensor (B, H, M, Dv + 1): z is the last column,
    # the sum of φ(k_j) times a value of 1. One matmul then yields numerator and normaliser.
    def augmented(self) -> Tensor:
        return torch.cat([self.S, self.z.unsqueeze(-1)], dim=-1)

    def _matches(self, batch: int, heads: int, feature_dim: int, value_dim: int, dtype: torch.dtype, device) -> bool:
        """Whether this state passes every check of :func:`check_initial_state` for these sizes (one test)."""
        S, z = self.S, self.z
        return (type(self) is LinearAttentionState and isinstance(S, Tensor) and isinstance(z, Tensor)
                and S.shape == (batch, heads, feature_dim, value_dim) and z.shape == (batch, heads, feature_dim)
                and S.dtype == dtype and z.dtype == dtype and S.device == device and z.device == device)

    @classmethod
    def _unchecked(cls, S: Tensor, z: Tensor) -> "LinearAttentionState":
        """A state of tensors linattn made itself (already consistent): built without the checks."""
        state = object.__new__(cls)
        state.S, state.z = S, z
        return state

    @classmethod
    def from_augmented(cls, S_aug: Tensor) -> "LinearAttentionState":
        """Split ``(B, H, M, Dv + 1)`` into ``S`` and ``z``, each a contiguous tensor of its own."""
        return cls(S_aug[..., :-1].contiguous(), S_aug[..., -1].contiguous())


def check_initial_state(state, batch: int, heads: int, feature_dim: int, value_dim: int,
                        dtype: torch.dtype, device, name: str = "initial_state"
                        ) -> Optional[LinearAttentionState]:
    """Validate a user-supplied state and return it in ``dtype`` (or None)."""
    if state is None:
        return None
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"{name} must be a LinearAttentionState or None, got {type(state).__name__}")
    state.validate(name)
    expected = (batch, heads, feature_dim, value_dim)
    if tuple(state.S.shape) != expected or tuple(state.z.shape) != expected[:3]:
        raise ValueError(
            f"{name} must have S of shape (B, H, M, Dv) = {_checks.shape_str(expected)} and z of "
            f"shape {_checks.shape_str(expected[:3])}, got S {_checks.shape_str(state.S.shape)} "
            f"and z {_checks.shape_str(state.z.shape)}"
        )
    if state.S.device != device:
        raise ValueError(f"{name} is on {state.S.device} but the inputs are on {device}")
    return state if state.S.dtype == dtype else state.to(dtype)


@dataclass(eq=False)
class MixerState:
    """What :class:`LinearMixer` carries from one call to the next (one layer).

    Attributes
    ----------
    S : Tensor
        ``(B, H_kv, head_dim, head_dim)``, the matrix-valued state of the update rule (one
        per key-value head), float32 (float64 for float64 inputs).
    conv : Tensor or None
        ``(B, C, kernel_size − 1)``, the last ``kernel_size − 1`` inputs of the short
        convolution (its channels ``C = (H + 2 H_kv) · head_dim`` are ``q``, ``k``, ``v``
        side by side), zeros before the first token; same dtype and device as ``S``. None
        for a layer without short convolution.

    Its size does not depend on how many tokens it summarises. The checks run when the
    state is built and again every time a layer uses it. ``a == b`` is a bool: True when both
    are states whose ``S`` and ``conv`` have the same shapes, dtypes, devices and values
    (``torch.equal``; both ``conv`` None counts as equal). States returned by
    :class:`LinearMixer` own their memory (they share none with any input).

    Raises
    ------
    TypeError
        ``S`` or ``conv`` not a floating tensor (``conv`` may be None).
    ValueError
        ``S`` not 4-D, ``conv`` not 3-D, an empty dimension, a batch that differs between
        them, or ``conv`` of another dtype or device than ``S``.
    """

    S: Tensor
    conv: Optional[Tensor] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, name: str = "state") -> None:
        """Check the tensors (on construction and again at every use).

        Raises
        ------
        TypeError, ValueError
            As the class.
        """
        _checks.check_tensor(self.S, f"{name}.S", 4, "(batch, n_kv_heads, head_dim, head_dim)")
        c = self.conv
        if c is None:
            return
        _checks.check_tensor(c, f"{name}.conv", 3, "(batch, channels, kernel_size - 1)")
        if c.dtype != self.S.dtype or c.device != self.S.device:
            raise ValueError(f"{name}.conv and {name}.S must share dtype and device, got conv {c.dtype} on "
                             f"{c.device} and S {self.S.dtype} on {self.S.device}")
        if c.shape[0] != self.S.shape[0]:
            raise ValueError(f"{name}.conv and {name}.S must have one batch size, got conv {shape_str(c.shape)} "
                             f"and S {shape_str(self.S.shape)}")

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        if (self.conv is None) != (other.conv is None):
            return False
        pairs = [(self.S, other.S)] + ([] if self.conv is None else [(self.conv, other.conv)])
        return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
                   for a, b in pairs)

    __hash__ = None                                                       # mutable, compared by value

    @property
    def nbytes(self) -> int:
        """Memory held by the state, in bytes (constant in the number of tokens seen)."""
        return sum(t.numel() * t.element_size() for t in (self.S, self.conv) if t is not None)

    def detach(self) -> "MixerState":
        """The same state cut from the autograd graph (for truncated back-propagation)."""
        return MixerState(self.S.detach(), None if self.conv is None else self.conv.detach())


@dataclass(eq=False)
class KVCache:
    """The keys and values softmax attention keeps for decoding (one layer).

    Attributes
    ----------
    k, v : Tensor
        ``(B, H_kv, T, head_dim)``, the keys and values of every token seen so far, per
        key-value head (grouped heads are cached once, not once per query head); one
        floating dtype and one device.
    attention_mask : Tensor
        ``(B, T)`` bool, True for real tokens, on the device of ``k``; cached padding is
        never attended to.

    Its size, ``2·B·H_kv·T·head_dim`` numbers, grows by one key and one value per token:
    decoding token ``t`` reads all ``t`` of them (Vaswani et al., 2017; the cache of
    Pope et al., 2023). Compare :class:`~linattn.LinearAttentionState`, whose size is fixed.
    The checks run when the cache is built and again every time a layer uses it, so a cache
    whose attributes were replaced afterwards is refused as well. ``a == b`` is a bool: True
    when both are caches whose ``k``, ``v`` and masks have the same shapes, dtypes, devices and
    values (``torch.equal``, so a NaN makes a cache unequal even to itself).

    Raises
    ------
    TypeError
        If ``k`` or ``v`` is not a floating tensor, ``k`` and ``v`` differ in dtype, or the
        mask is not a bool tensor.
    ValueError
        If ``k`` and ``v`` are not 4-D of one shape, the mask is not ``(B, T)``, or the three
        are not on one device.
    """

    k: Tensor
    v: Tensor
    attention_mask: Tensor

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, name: str = "state") -> None:
        """Run the checks again (every layer that uses the cache calls this)."""
        _check_kv_cache(self, name)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same_tensor(a, b) for a, b in zip((self.k, self.v, self.attention_mask),
                                                       (other.k, other.v, other.attention_mask)))

    __hash__ = None                                                       # mutable, compared by value

    @property
    def seq_len(self) -> int:
        """Number of cached tokens (padding included)."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Memory held by the cache, in bytes (keys, values and mask); grows linearly with ``seq_len``."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.attention_mask))


def _check_kv_cache(cache: KVCache, name: str = "state") -> None:
    """``cache`` holds k, v ``(B, H_kv, T, D)`` of one floating dtype and a ``(B, T)`` bool mask, on one device."""
    for part in ("k", "v"):
        t = getattr(cache, part)
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}.{part} must be a floating-point torch.Tensor, got {describe(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name}.{part} must be 4-D (batch, kv_heads, seq, head_dim), got {shape_str(t.shape)}")
    k, v, m = cache.k, cache.v, cache.attention_mask
    if k.shape != v.shape:
        raise ValueError(f"{name}.k and {name}.v must have one shape, got {shape_str(k.shape)} and "
                         f"{shape_str(v.shape)}")
    if k.dtype != v.dtype:
        raise TypeError(f"{name}.k and {name}.v must have one dtype, got {k.dtype} and {v.dtype}")
    if not isinstance(m, Tensor) or m.dtype != torch.bool:
        raise TypeError(f"{name}.attention_mask must be a bool torch.Tensor, got {describe(m)}")
    expected = (k.shape[0], k.shape[2])
    if tuple(m.shape) != expected:
        raise ValueError(f"{name}.attention_mask must have shape (batch, seq) = {shape_str(expected)}, "
                         f"got {shape_str(m.shape)}")
    for part, t in (("v", v), ("attention_mask", m)):
        if t.device != k.device:
            raise ValueError(f"{name}.{part} is on {t.device} but {name}.k is on {k.device}; a KVCache "
                             "lives on one device")


@dataclass(eq=False)
class DecodingState:
    """Everything :class:`TransformerLM` needs to continue a batch of sequences.

    Attributes
    ----------
    layers : list
        One entry per block: a :class:`~linattn.LinearAttentionState` (φ-linear attention),
        a :class:`~linattn.MixerState` (a :class:`~linattn.LinearMixer`: retention, GLA, the
        delta rules) or a :class:`KVCache` (softmax attention). The first two have a fixed
        size; a cache grows with every token.
    positions : Tensor
        ``(B,)`` int64, the number of real (unpadded) tokens each sequence has seen, which
        is the position of its next token.

    The checks run when the state is built and again every time the model uses it. ``a == b``
    is a bool: True when both hold as many layer states, each equal to its partner by that
    state's own ``==``, and equal positions (same shape, dtype, device and values).

    Raises
    ------
    TypeError
        If ``layers`` is not a list or tuple of layer states, or ``positions`` is not an
        int64 tensor.
    ValueError
        If ``positions`` is not 1-D.
    """

    layers: list
    positions: Tensor

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, name: str = "state") -> None:
        """Run the checks again (the model calls this at every use)."""
        _check_decoding_state(self, name)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        if len(self.layers) != len(other.layers) or not _same_tensor(self.positions, other.positions):
            return False
        return all(type(a) is type(b) and bool(a == b) for a, b in zip(self.layers, other.layers))

    __hash__ = None

    @property
    def nbytes(self) -> int:
        """Memory held by all layers' states and the positions, in bytes."""
        return sum(s.nbytes for s in self.layers) + self.positions.numel() * self.positions.element_size()


def _same_tensor(a, b) -> bool:
    """Same shape, dtype, device and values (False for anything that is not a pair of tensors)."""
    return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and torch.equal(a, b))


def _check_decoding_state(state: DecodingState, name: str = "state") -> None:
    layers = state.layers
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"{name}.layers must be a list of layer states (one per block), got {describe(layers)}")
    for i, s in enumerate(layers):
        if not isinstance(s, (LinearAttentionState, MixerState, KVCache)):
            raise TypeError(f"{name}.layers[{i}] must be a LinearAttentionState, a MixerState or a KVCache, "
                            f"got {describe(s)}")
    p = state.positions
    if not isinstance(p, Tensor) or p.dtype != torch.long:
        raise TypeError(f"{name}.positions must be an int64 tensor of shape (batch,), got {describe(p)}")
    if p.dim() != 1:
        raise ValueError(f"{name}.positions must have shape (batch,), got {shape_str(p.shape)}")


# torch.load's default weights_only=True unpickles only the classes it is told are safe: these hold
# tensors, lists and ints and run no code when rebuilt (their checks run when a layer uses them).
torch.serialization.add_safe_globals([LinearAttentionState, MixerState, KVCache, DecodingState])
