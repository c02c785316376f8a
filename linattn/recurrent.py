"""The RNN view of causal linear attention: a fixed-size state updated one token at a time.

Katharopoulos et al. (2020), eqs. 18-20: with ``S_t = S_{t-1} + φ(k_t) v_tᵀ`` and
``z_t = z_{t-1} + φ(k_t)``, the causal output is ``y_t = S_tᵀφ(q_t) / (z_tᵀφ(q_t))``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import _checks
from ._numerics import guarded_normaliser, no_autocast
from .feature_maps import FeatureMap, resolve_feature_map

__all__ = ["LinearAttentionState", "linear_attention_step"]


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
    return state.to(dtype)


def finish(out_aug: Tensor, normalize: bool, eps: float) -> Tensor:
    """Split ``(..., Dv + 1)`` into numerator and normaliser and divide (or not).

    The normaliser is used as computed unless it is zero, negative or not finite
    (:func:`linattn._numerics.guarded_normaliser`).
    """
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    if not normalize:
        return num
    return num / guarded_normaliser(den, eps)[0]


def step_features(phi_q: Tensor, phi_k: Tensor, v_aug: Tensor, S_aug: Tensor) -> tuple[Tensor, Tensor]:
    """One recurrence step on features: ``S_t = S_{t-1} + φ(k_t)[v_t, 1]ᵀ``, output ``φ(q_t)ᵀS_t``.

    phi_q, phi_k (B, H, M); v_aug (B, H, Dv + 1); S_aug (B, H, M, Dv + 1).
    Returns the augmented output (B, H, Dv + 1) and the new state.
    """
    S_aug = S_aug + phi_k.unsqueeze(-1) * v_aug.unsqueeze(-2)     # (B, H, M, Dv + 1)
    out_aug = (phi_q.unsqueeze(-2) @ S_aug).squeeze(-2)          # (B, H, Dv + 1)
    return out_aug, S_aug


def linear_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Optional[LinearAttentionState] = None,
    *,
    feature_map: "str | FeatureMap | None" = "elu+1",
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, LinearAttentionState]:
    """Causal linear attention for one new token: update the state, then read it with the query.

    Implements Katharopoulos et al. (2020), eqs. 18-20::

        S_t = S_{t-1} + φ(k_t) v_tᵀ,   z_t = z_{t-1} + φ(k_t),
        y_t = S_tᵀ φ(q_t) / z_tᵀ φ(q_t)

    The new token attends to itself and to every earlier token. Running it over
    ``t = 1..T`` gives ``linear_attention(q, k, v, causal=True)`` (up to rounding); the cost per
    token is ``O(M·Dv)`` time and the state's memory is constant in ``t``.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, D)``, the current token's query and key (floating, same dtype and device).
    v : Tensor
        ``(B, H, Dv)``, the current token's value.
    state : LinearAttentionState, optional
        The state after the previous tokens; ``None`` starts from an empty state.
        ``S`` must be ``(B, H, M, Dv)`` and ``z`` ``(B, H, M)``.
    feature_map : str, callable or None
        φ, as in :func:`linattn.linear_attention`.
    normalize : bool
        Divide by the normaliser ``φ(q_t)ᵀz_t`` (True) or return the numerator only.
    eps : float
        Used in place of a normaliser that is zero, negative or not finite, as in
        :func:`linattn.linear_attention`; a positive normaliser is used as it is.

    Returns
    -------
    out : Tensor
        ``(B, H, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs).
    state : LinearAttentionState
        The updated state, in float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a state of the wrong type or whose
        ``S``/``z`` are not floating tensors.
    ValueError
        Wrong ranks, an empty dimension, mismatched (B, H, D), a state whose shapes, dtypes or
        device do not match, ``eps`` not a positive normal number of the computation dtype, a
        position-dependent feature map (cosFormer), a feature map whose output has other
        leading dimensions or lives on another device.
    """
    layout = "(batch, heads, dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(x, name, 3, layout)
    _checks.check_same_kind({"q": q, "k": k, "v": v})
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            "q, k (B, H, D) and v (B, H, Dv) must share B and H, got "
            f"q {_checks.shape_str(q.shape)}, k {_checks.shape_str(k.shape)}, v {_checks.shape_str(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same head_dim D (dim 2), got q {_checks.shape_str(q.shape)} "
            f"and k {_checks.shape_str(k.shape)}"
        )
    normalize = _checks.check_bool(normalize, "normalize")
    acc = _checks.accumulation_dtype(q.dtype)
    eps = _checks.check_eps(eps, acc)
    phi = resolve_feature_map(feature_map)
    if _checks.position_dependent(phi):
        raise ValueError(
            f"linear_attention_step cannot apply the position-dependent feature_map {type(phi).__name__}: "
            "it sees one token without its position; compute the features yourself, e.g. "
            "phi(x[:, :, None], offset=t)[:, :, 0], and pass feature_map=None")
    with no_autocast(q.device):
        q32, k32, v32 = q.to(acc), k.to(acc), v.to(acc)
        phi_q, phi_k = _checks.apply_feature_map(phi, q32, k32)  # (B, H, M)
        B, H, M = phi_k.shape
        Dv = v.shape[-1]
        state = check_initial_state(state, B, H, M, Dv, acc, q.device, name="state")
        if state is None:
            S = phi_k.unsqueeze(-1) * v32.unsqueeze(-2)                  # (B, H, M, Dv)
            z = phi_k.clone(memory_format=torch.contiguous_format)       # (B, H, M), never the caller's k
        else:
            S = torch.addcmul(state.S, phi_k.unsqueeze(-1), v32.unsqueeze(-2))
            z = state.z + phi_k
        out = (phi_q.unsqueeze(-2) @ S).squeeze(-2)                      # (B, H, Dv)
        if normalize:
            den = (phi_q * z).sum(-1, keepdim=True)                      # (B, H, 1)
            out = out / guarded_normaliser(den, eps)[0]
    return out.to(q.dtype), LinearAttentionState(S.contiguous(), z.contiguous())
