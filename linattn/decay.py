"""Linear attention with decay, gates and the delta rule: one family of state updates.

Causal linear attention keeps a state ``S_t = S_{t-1} + k_t v_tᵀ`` and reads it with
``o_t = S_tᵀ q_t``. Three changes to the *update* give three well-known models:

=============================  ===============================================  ==========================
function                       state update                                     paper
=============================  ===============================================  ==========================
:func:`retention`              ``S_t = γ S_{t-1} + k_t v_tᵀ`` (γ fixed per head)  RetNet, Sun et al. (2023)
:func:`gated_linear_attention` ``S_t = diag(g_t) S_{t-1} + k_t v_tᵀ``              GLA, Yang et al. (2024a)
:func:`delta_rule`             ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀk_t)ᵀ``    DeltaNet, Schlag et al.
                                                                                (2021); Yang et al. (2024b)
=============================  ===============================================  ==========================

Every function has two algorithms that compute the same numbers up to rounding:
``method="recurrent"``, the token loop above (slow in Python; the test oracle), and
``method="chunk"`` (the default), the chunkwise-parallel form. All three are
unnormalised (no ``z``): with ``γ = 1``, ``g_t = 1`` they are
``linear_attention(..., causal=True, normalize=False)``.

The chunkwise forms split the sequence into chunks of ``C`` tokens; everything inside a
chunk is computed for all chunks at once with batched matmuls, and only the passage of
the ``(Dk, Dv)`` state from one chunk to the next is a loop (``T/C`` steps), as in
:mod:`linattn.chunked`. Decays enter only as ``exp`` of *non-positive* numbers (or as
non-negative integer powers ``γ^m``, or products of such factors): with ``b_t`` the
cumulative log-decay inside a chunk, the factors are ``exp(b_t − b_s)`` for ``s <= t``,
``exp(b_t)`` and ``exp(b_C − b_s)``, each computed from the terms of its own range (never
as a difference). A decay strong enough to underflow gives zeros, never ``inf`` or NaN
(a chunkwise form that writes ``exp(b_t) · exp(−b_s)`` overflows for per-token decays of
``e^-3`` at ``C = 64``).

References: Sun et al. 2023, "Retentive Network", arXiv:2307.08621; Yang, Wang, Shen,
Panda & Kim 2024a, "Gated Linear Attention Transformers with Hardware-Efficient
Training", arXiv:2312.06635; Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are
Secretly Fast Weight Programmers", arXiv:2102.11174; Yang, Wang, Zhang, Shen & Kim
2024b, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length",
arXiv:2406.06484.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._numerics import all_finite, compiling, masked_matmul, no_autocast
from .feature_maps import FeatureMap, resolve_feature_map

__all__ = ["retention", "gated_linear_attention", "delta_rule", "METHODS"]

METHODS = ("auto", "chunk", "recurrent")


def _gla_subchunk(C: int) -> int:
    """Sub-chunk length ``L`` of the GLA chunk form: ``min(C, 16)``.

    Each sub-chunk builds its ``(L, L)`` scores row by row (``~L/2 · Dk`` products per
    token), pairs of sub-chunks of a chunk a ``(C/L, C, Dk)`` tensor per chunk (``(C/L) · Dk``
    per token). Measured on CPU (1 thread, T = 4096, H = 4, D = 64) at ``C = 64``: ``L = 16``
    forward 40 ms, ``8`` 45 ms, ``32`` 50 ms, ``4`` 98 ms; forward+backward 155, 196, 206
    and 274 ms.
    """
    return min(C, 16)

_Result = Union[Tensor, tuple[Tensor, Tensor]]

# The chunk form of GLA clamps log_g from below at this value before summing it over ranges.
# Without the clamp, float32 sums of accepted log-gates such as -1e38 overflow to -inf, and
# the 0/1 range-sum matmuls (_SegmentSums) then form -inf · 0 = NaN. Why -1000:
# - exp(-1000) is exactly 0 in float32 (exp underflows to 0 below about -103.97, subnormals
#   included) and in float64 (below about -745.13), the two dtypes the chunk form computes in.
#   Every exponent is a sum of non-positive log-gates, and rounding is monotone, so a range
#   that holds a clamped entry sums to <= -1000 with or without the clamp: its factor is
#   exactly 0 either way. The result is bit-identical to the unclamped computation whenever
#   that one did not overflow, i.e. for every realistic input.
# - A sum of C entries >= -1000 is >= -1000·C, finite in float32 for any C < 3.4e35: no
#   chunk length can overflow it.
# - Below the clamp the gradient of log_g is exactly 0 (clamp passes none), as it is in the
#   recurrent form, where d exp(log_g)/d log_g = exp(log_g) underflows to 0 as well.
_LOG_G_FLOOR = -1000.0


# --------------------------------------------------------------------------- public API


def retention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Union[float, Tensor],
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> _Result:
    """Retention: causal linear attention whose state decays by a fixed ``γ`` per head.

    The recurrent representation of retention (Sun et al., 2023, arXiv:2307.08621,
    sec. 2.1), without RetNet's rotation, normalisation and group norm::

        S_t = γ S_{t-1} + φ(k_t) v_tᵀ,      o_t = S_tᵀ φ(q_t)

    equivalently ``o_t = Σ_{s<=t} γ^{t-s} φ(q_t)ᵀφ(k_s) v_s`` (+ ``γ^t φ(q_t)ᵀ S0``). With
    ``γ = 1`` this is ``linear_attention(q, k, v, feature_map=..., causal=True,
    normalize=False)``. RetNet itself uses ``φ = identity`` (``feature_map=None``, the
    default) and a different ``γ`` in each head.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, H, T, Dv)`` values.
    gamma : float or Tensor
        The decay ``γ`` in ``(0, 1]``: one Python float for every head, or a tensor of
        shape ``(H,)`` (one per head, any floating dtype, on the inputs' device; it is
        differentiable). A 0-d tensor is refused: pass ``float(gamma)``.
    method : str
        ``"auto"`` (= ``"chunk"``), ``"chunk"`` or ``"recurrent"``; case-insensitive.
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it.
    feature_map : str, callable or None
        φ applied to ``q`` and ``k`` first, as in :func:`linattn.linear_attention`; None
        (the default) uses them as given.
    initial_state : Tensor, optional
        ``(B, H, Dk, Dv)``, the state ``S0`` before the first token (``Dk = D``, or the
        feature dimension of φ), for instance the state returned by an earlier call.
    return_state : bool
        Also return the state after the last token.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q``. Computed in float32 for float16/bfloat16
        inputs (float64 for float64).
    state : Tensor
        Only if ``return_state``: ``(B, H, Dk, Dv)`` in float32 (float64 for float64
        inputs). Resuming from it with the rest of a sequence equals one run.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a ``gamma`` that is neither a real
        number nor a floating tensor; a non-str method; a non-int chunk size; a non-bool
        flag; an ``initial_state`` that is not a floating tensor.
    ValueError
        Wrong ranks or shapes, an empty dimension; ``gamma`` outside ``(0, 1]``, not finite,
        or a tensor not of shape ``(H,)`` or on another device; an unknown method;
        ``chunk_size < 1``; an ``initial_state`` of the wrong shape or device; features of
        another shape or device than their inputs; a position-dependent feature map
        (cosFormer) with ``initial_state`` or without a fixed ``max_len``. Under
        ``torch.compile`` the checks of tensor values (``gamma``, ``log_g``, ``beta``) run
        inside the graph and raise RuntimeError with the same message.

    Notes
    -----
    Causality holds whatever the values: a NaN or infinity at position ``t`` never changes
    an output before ``t`` (in both methods). Autocast is switched off inside: the
    computation keeps the dtypes above under ``torch.autocast``.
    """
    p = _prepare("retention", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
    with no_autocast(q.device):
        gamma_t = _check_gamma(gamma, q, p.acc)
        out, S = _run(p, lambda: _retention_recurrent(p.q, p.k, p.v, gamma_t, p.S0),
                      lambda safe: _retention_chunk(p.q, p.k, p.v, gamma_t, p.S0, p.chunk_size, safe))
    return _finish(out, S, q.dtype, p.return_state)


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> _Result:
    """Gated linear attention: a data-dependent decay for every key dimension and token.

    The recurrent form of GLA (Yang, Wang, Shen, Panda & Kim, 2024, arXiv:2312.06635),
    without the output gate and normalisation of the full layer::

        S_t = diag(g_t) S_{t-1} + φ(k_t) v_tᵀ,      o_t = S_tᵀ φ(q_t),      g_t = exp(log_g_t)

    equivalently ``o_t = Σ_{s<=t} Σ_d φ(q_t)_d φ(k_s)_d exp(b_{t,d} − b_{s,d}) v_s`` with
    ``b_t = Σ_{r<=t} log_g_r``. The gate is passed in log space (in the paper
    ``g_t = sigmoid(·)^{1/τ}``, i.e. ``log_g = logsigmoid(·)/τ``), so that strong decays stay
    exact: ``log_g = -27.6`` (``g = 1e-12``) is fine. ``log_g = 0`` everywhere gives
    unnormalised causal linear attention.

    The chunk form splits each chunk into sub-chunks of ``L = min(C, 16)`` tokens. Inside a
    sub-chunk the decay between key ``s`` and query ``t`` is the product of the gates
    ``g_r = exp(log_g_r)`` for ``s < r <= t``, built row by row. Across sub-chunks and chunks
    it is a product of exps of range sums over disjoint ranges, ``exp(b_t − b_s) =
    exp(Σ_{r_i<r<=t}) · exp(Σ of the sub-chunks in between) · exp(Σ_{s<r<=e_j})``, every
    exponent ``<= 0``. Every range sum is computed from its own terms, never as a difference
    of cumulative sums, so the gradient of a strongly decaying gate keeps its relative
    accuracy. Memory of the forward pass is about ``B·H·T·Dk·(L/2 + C/L + 4)`` numbers besides
    the inputs (and ``B·H·(T/C)·Dk·Dv`` for the chunk states).

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, H, T, Dv)`` values.
    log_g : Tensor
        ``(B, H, T, Dk)`` log of the gates, finite and ``<= 0``, same dtype and device as
        ``q``. ``Dk`` is the key dimension after the feature map (``D`` when
        ``feature_map`` is None).
    method, chunk_size, feature_map, initial_state, return_state
        As in :func:`retention`.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs).
    state : Tensor
        Only if ``return_state``: ``(B, H, Dk, Dv)``, float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError
        As :func:`retention`; a ``log_g`` that is not a tensor or has another dtype than ``q``.
    ValueError
        As :func:`retention`; ``log_g`` of the wrong shape, on another device, with a
        positive, NaN or infinite entry.
    """
    p = _prepare("gated_linear_attention", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
    B, H, T, Dk = p.k.shape
    mapped = "" if feature_map is None else f" (k has {k.shape[-1]} dims, {Dk} features after feature_map)"
    _check_like_q(log_g, "log_g", (B, H, T, Dk), "(batch, heads, seq, key features)", q, extra=mapped)
    _checks.check_values(torch.isfinite(log_g) & (log_g <= 0), "log_g", "finite and <= 0 (g = exp(log_g) in (0, 1])",
                         log_g)
    with no_autocast(q.device):
        log_g = log_g.to(p.acc)
        out, S = _run(p, lambda: _gla_recurrent(p.q, p.k, p.v, log_g, p.S0),
                      lambda safe: _gla_chunk(p.q, p.k, p.v, log_g, p.S0, p.chunk_size, safe))
    return _finish(out, S, q.dtype, p.return_state)


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> _Result:
    """The delta rule (DeltaNet): each token corrects what the state recalls for its key.

    The delta-rule update of Schlag, Irie & Schmidhuber (2021, arXiv:2102.11174), trained
    chunkwise as in Yang, Wang, Zhang, Shen & Kim (2024, arXiv:2406.06484, sec. 3)::

        S_t = S_{t-1} + β_t φ(k_t) (v_t − S_{t-1}ᵀ φ(k_t))ᵀ,      o_t = S_tᵀ φ(q_t)

    i.e. ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``: the value stored under ``k_t``
    moves a fraction ``β_t`` of the way to ``v_t``. With ``β_t = 0`` the state is unchanged.

    **Keys are usually L2-normalised** (``torch.nn.functional.normalize(k, dim=-1)``):
    then ``I − β_t k_t k_tᵀ`` has norm ``<= 1`` for ``β_t`` in ``[0, 2]`` and the recurrence
    is stable. This function does *not* normalise: with large keys the state can grow
    without bound (and the chunk and recurrent forms then disagree by rounding that has
    grown too). A ``feature_map`` is applied to ``q`` and ``k`` before anything else, so a
    map that should end with a normalisation must include it.

    Chunk form (the WY / UT-transform representation of Yang et al. 2024b, sec. 3):
    inside a chunk with start state ``S``, write ``S_t = S + Σ_{s<=t} k_s u_sᵀ``; the
    pseudo-values ``u`` solve the unit lower-triangular system
    ``(I + tril(diag(β) K Kᵀ, −1)) U = diag(β) (V − K S)``, so ``U = Ũ − W S`` with
    ``[W, Ũ] = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β) [K, V]`` (one
    ``torch.linalg.solve_triangular`` per chunk, all chunks at once, differentiable).
    Then ``O = (Q − A W) S + A Ũ`` with ``A = tril(Q Kᵀ)``, and the next chunk starts
    from ``(I − Kᵀ W) S + Kᵀ Ũ``.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys (see the note on normalising keys).
    v : Tensor
        ``(B, H, T, Dv)`` values.
    beta : Tensor
        ``(B, H, T)`` writing strengths in ``[0, 2]``, same dtype and device as ``q``.
    method, chunk_size, feature_map, initial_state, return_state
        As in :func:`retention`.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs).
    state : Tensor
        Only if ``return_state``: ``(B, H, Dk, Dv)``, float32 (float64 for float64 inputs).

    Raises
    ------
    TypeError
        As :func:`retention`; a ``beta`` that is not a tensor or has another dtype than ``q``.
    ValueError
        As :func:`retention`; ``beta`` of the wrong shape, on another device, or with an
        entry outside ``[0, 2]`` (NaN included).
    """
    p = _prepare("delta_rule", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
    B, H, T, _ = p.k.shape
    _check_like_q(beta, "beta", (B, H, T), "(batch, heads, seq)", q)
    _checks.check_values((beta >= 0) & (beta <= 2), "beta", "in [0, 2]", beta)
    with no_autocast(q.device):
        beta = beta.to(p.acc)
        out, S = _run(p, lambda: _delta_recurrent(p.q, p.k, p.v, beta, p.S0),
                      lambda safe: _delta_chunk(p.q, p.k, p.v, beta, p.S0, p.chunk_size, safe))
    return _finish(out, S, q.dtype, p.return_state)


# --------------------------------------------------------------------------- validation


class _Prepared:
    """Checked arguments: features φ(q), φ(k) and v in the accumulation dtype, and the rest."""

    __slots__ = ("q", "k", "v", "S0", "acc", "method", "chunk_size", "return_state")


def _prepare(name, q, k, v, method, chunk_size, feature_map, initial_state, return_state) -> _Prepared:
    _checks.check_qkv(q, k, v, causal=True, causal_only=name)
    p = _Prepared()
    p.return_state = _checks.check_bool(return_state, "return_state")
    p.chunk_size = _checks.check_chunk_size(chunk_size)
    p.method = _resolve_method(method)
    p.acc = _checks.accumulation_dtype(q.dtype)
    phi = resolve_feature_map(feature_map)
    _checks.check_position_dependent(phi, causal=True, resumed=initial_state is not None, same_length=True,
                                     caller=name)
    with no_autocast(q.device):
        p.q, p.k = _checks.apply_feature_map(phi, q.to(p.acc), k.to(p.acc))  # (B, H, T, Dk)
    p.v = v.to(p.acc)                                                       # (B, H, T, Dv)
    B, H, _, Dk = p.k.shape
    p.S0 = _check_state(initial_state, (B, H, Dk, v.shape[-1]), p.acc, q.device)
    return p


def _resolve_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {_checks.type_name(method)}")
    name = method.strip().lower()
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(map(repr, METHODS))}")
    return "chunk" if name == "auto" else name


def _check_state(state, expected: tuple[int, ...], acc: torch.dtype, device) -> Optional[Tensor]:
    """``initial_state`` is None or a floating (B, H, Dk, Dv) tensor on the inputs' device."""
    if state is None:
        return None
    if not isinstance(state, Tensor):
        raise TypeError(
            f"initial_state must be a torch.Tensor S of shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"or None, got {_checks.type_name(state)} (a LinearAttentionState belongs to linear_attention)"
        )
    if not state.is_floating_point():
        raise TypeError(f"initial_state must be a floating-point tensor, got dtype {state.dtype}")
    if tuple(state.shape) != expected:
        raise ValueError(
            f"initial_state must have shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"(Dk: key features after feature_map), got {_checks.shape_str(state.shape)}"
        )
    if state.device != device:
        raise ValueError(f"initial_state is on {state.device} but the inputs are on {device}")
    return state.to(acc)


def _check_gamma(gamma, q: Tensor, acc: torch.dtype) -> Tensor:
    """``γ`` as an (H,) tensor in ``acc`` on q's device (differentiable if ``gamma`` is)."""
    H = q.shape[1]
    if isinstance(gamma, Tensor):
        if not gamma.is_floating_point():
            raise TypeError(f"gamma must be a float or a floating-point tensor, got dtype {gamma.dtype}")
        if tuple(gamma.shape) != (H,):
            raise ValueError(
                f"gamma must be a float or a tensor of shape (heads,) = ({H},), got shape "
                f"{_checks.shape_str(gamma.shape)}"
                + (" (for one value for all heads pass float(gamma))" if gamma.dim() == 0 else "")
            )
        if gamma.device != q.device:
            raise ValueError(f"gamma is on {gamma.device} but q is on {q.device}")
        _checks.check_values((gamma > 0) & (gamma <= 1), "gamma", "in (0, 1]", gamma)
        gamma_t = gamma.to(acc)
    elif isinstance(gamma, numbers.Real) and not isinstance(gamma, bool):
        value = float(gamma)
        if not (0 < value <= 1):
            raise ValueError(f"gamma must be in (0, 1], got {value:g}")
        gamma_t = torch.full((H,), value, dtype=acc, device=q.device)
    else:
        raise TypeError(f"gamma must be a float or a tensor of shape (heads,), got {_checks.type_name(gamma)}")
    # a positive float64 γ below float32's range
    _checks.check_values(gamma_t != 0, "gamma", f"a number that does not underflow to 0 in {acc} "
                         f"(use a gamma >= {torch.finfo(acc).tiny:.3g})", gamma)
    return gamma_t


def _check_like_q(x, name: str, expected: tuple[int, ...], layout: str, q: Tensor, extra: str = "") -> None:
    """``x`` is a tensor of shape ``expected`` with q's dtype and device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout} = {_checks.shape_str(expected)}, "
                        f"got {_checks.type_name(x)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}; they must match")
    if tuple(x.shape) != expected:
        raise ValueError(
            f"{name} must have shape {layout} = {_checks.shape_str(expected)}{extra}, "
            f"got {_checks.shape_str(x.shape)}"
        )
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")


def _run(p: "_Prepared", recurrent: Callable[[], tuple[Tensor, Tensor]],
         chunk: Callable[[bool], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The chosen algorithm; the chunk form keeps non-finite values causal.

    A NaN or infinity in a later value or key of a chunk would reach the earlier rows
    through the chunk's masked products (``0 · NaN = NaN``); it also makes the final state
    non-finite. So the chunk form runs as usual, and only if its final state is not finite
    again with its masked products done by :func:`linattn._numerics.masked_matmul` (always
    so under ``torch.compile`` and ``torch.func``, where the check cannot branch).
    """
    if p.method == "recurrent":
        return recurrent()
    always_safe = compiling()
    out, S = chunk(always_safe)
    if not always_safe and not all_finite(S):
        out, S = chunk(True)
    return out, S


def _finish(out: Tensor, S: Tensor, dtype: torch.dtype, return_state: bool) -> _Result:
    out = out.to(dtype)
    return (out, S) if return_state else out


# --------------------------------------------------------------------------- recurrent forms (the oracles)


def _zeros_state(k: Tensor, v: Tensor, S0: Optional[Tensor]) -> Tensor:
    B, H, _, Dk = k.shape
    return S0 if S0 is not None else k.new_zeros(B, H, Dk, v.shape[-1])


def _read(q_t: Tensor, S: Tensor) -> Tensor:
    """``S_tᵀ q_t``: (B, H, Dk) and (B, H, Dk, Dv) -> (B, H, Dv)."""
    return (q_t.unsqueeze(-2) @ S).squeeze(-2)


def _retention_recurrent(q, k, v, gamma, S0):
    """``S_t = γ S_{t-1} + k_t v_tᵀ`` token by token; gamma (H,)."""
    S = _zeros_state(k, v, S0)
    g = gamma.view(1, -1, 1, 1)
    outs = []
    for t in range(k.shape[2]):
        S = torch.addcmul(g * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append(_read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def _gla_recurrent(q, k, v, log_g, S0):
    """``S_t = diag(exp(log_g_t)) S_{t-1} + k_t v_tᵀ`` token by token."""
    S = _zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        S = torch.addcmul(log_g[:, :, t].exp().unsqueeze(-1) * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append(_read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def _delta_recurrent(q, k, v, beta, S0):
    """``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ`` token by token."""
    S = _zeros_state(k, v, S0)
    outs = []
    for t in range(k.shape[2]):
        k_t = k[:, :, t]                                                 # (B, H, Dk)
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - _read(k_t, S))  # (B, H, Dv)
        S = torch.addcmul(S, k_t.unsqueeze(-1), u.unsqueeze(-2))
        outs.append(_read(q[:, :, t], S))
    return torch.stack(outs, dim=2), S


# --------------------------------------------------------------------------- chunkwise forms


def _to_chunks(x: Tensor, N: int, C: int) -> Tensor:
    """(B, H, T, ·) -> (B, H, N, C, ·), zero-padding the tail of a ragged last chunk."""
    T = x.shape[2]
    if N * C != T:
        x = F.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(*x.shape[:2], N, C, x.shape[-1])


def _from_chunks(x: Tensor, T: int) -> Tensor:
    """(B, H, N, C, ·) -> (B, H, T, ·), dropping the padding."""
    x = x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    return x if x.shape[2] == T else x[:, :, :T]


def _scan(S0: Tensor, step: Callable[..., Tensor], *per_chunk: Tensor) -> tuple[Tensor, Tensor]:
    """States before each chunk (B, H, N, Dk, Dv) and after the last, by ``S <- step(S, *x[:, :, n])``.

    The per-chunk tensors ``(B, H, N, ...)`` are split with ``unbind`` once: indexing
    ``x[:, :, n]`` inside the loop would make autograd write a zero tensor of ``x``'s full
    size for every chunk in the backward pass (``T/C`` times the size of ``x``).
    """
    S, before = S0, []
    for xs in zip(*(x.unbind(2) for x in per_chunk)):
        before.append(S)
        S = step(S, *xs)
    return torch.stack(before, dim=2), S


def _num_chunks(T: int, chunk_size: int) -> tuple[int, int]:
    C = min(chunk_size, T)           # a chunk longer than the sequence would only add padding
    return C, -(-T // C)


def _retention_chunk(q, k, v, gamma, S0, chunk_size, safe=False):
    """Chunkwise retention; gamma (H,) in (0, 1].

    Per chunk with ``n`` real tokens (``n = C`` except maybe the last) and ``t, s`` counted
    from 0 inside it: intra ``D_ts = γ^(t−s)`` for ``s <= t``; a query reads the state with
    ``γ^(t+1)``; a key enters the next state with ``γ^(n−1−s)``; the state decays by ``γ^n``.
    Every factor is ``γ`` to a non-negative integer power, computed by ``torch.pow``, whose
    gradient ``m γ^(m−1)`` is formed directly: no ``exp`` of a positive number, and no
    ``(1/γ)`` factor that would overflow (``1/γ`` is ``inf`` in float32 for a subnormal
    ``γ = 1e-45``) or amplify the rounding of ``γ^m`` (as the chain rule through ``log γ``
    would: ``∂γ^m/∂γ = m γ^m · (1/γ)``).
    """
    B, H, T, Dk = k.shape
    C, N = _num_chunks(T, chunk_size)
    qc, kc, vc = (_to_chunks(x, N, C) for x in (q, k, v))               # (B, H, N, C, ·)
    dev, acc = q.device, q.dtype
    t = torch.arange(C, device=dev)
    g3 = gamma.view(H, 1, 1)
    causal = torch.ones(C, C, dtype=acc, device=dev).tril()            # 0/1, (C, C)
    intra = g3 ** (t[:, None] - t[None, :]).clamp(min=0).to(acc) * causal   # (H, C, C): γ^(t−s), s <= t
    scores = (qc @ kc.transpose(-1, -2)) * intra.unsqueeze(1)          # (B, H, N, C, C)
    if safe:   # keep a NaN/inf of a later token out of earlier rows (see _run)
        scores = scores.masked_fill(causal == 0, 0.0)
        out = masked_matmul(scores, vc, causal)                        # (B, H, N, C, Dv)
    else:
        out = scores @ vc                                              # (B, H, N, C, Dv)

    n_real = (T - torch.arange(N, device=dev) * C).clamp(max=C)        # (N,) real tokens per chunk
    pos = torch.minimum(t[None, :] + 1, n_real[:, None])               # (N, C): 1..n, then n on padding
    q_decay = g3 ** pos.to(acc)                                        # (H, N, C): γ^(t+1)
    k_decay = g3 ** (n_real[:, None] - pos).to(acc)                    # (H, N, C): γ^(n−1−s), exponent >= 0
    chunk_decay = gamma.view(H, 1) ** n_real.to(acc)                   # (H, N): γ^n
    U = (kc * k_decay.unsqueeze(-1)).transpose(-1, -2) @ vc            # (B, H, N, Dk, Dv)
    S_before, S = _scan(_zeros_state(k, v, S0), lambda S, d, u: d * S + u,
                        chunk_decay.view(1, H, N, 1, 1), U)
    out = out + (qc * q_decay.unsqueeze(-1)) @ S_before                # (B, H, N, C, Dv)
    return _from_chunks(out, T), S


def _gla_chunk(q, k, v, log_g, S0, chunk_size, safe=False):
    """Chunkwise GLA with sub-chunks (see :func:`gated_linear_attention`).

    Each chunk is zero-padded to a multiple ``Cp`` of the sub-chunk length ``L``: padded
    tokens have ``k = v = q = 0`` and ``log_g = 0`` (no decay), so they change nothing.

    Every decay factor is a product of the gates ``g_r`` between two tokens (inside a
    sub-chunk), or of exps of *sums* of the log-gates over disjoint ranges, each computed
    directly as such (by matmul with a 0/1 matrix, see :class:`_SegmentSums`), never as the
    difference ``b_t − b_s`` of two cumulative sums. So every exponent is ``<= 0``; a
    factor of exactly 1 (``s = t``, or the token just before a boundary) does not depend
    on ``log_g`` at all; and the gradient of ``log_g`` is a sum of terms that each carry
    their decay factor, with no cancellation of large terms (a difference of cumulative
    sums makes the gradient of a gate of ``1e-12`` pure rounding noise in float32). A
    product of such factors may underflow to 0 where the exact value is below float32's
    range; so would the exact factor.

    Rough cost per token and head: ``Dk`` exps for the gates and a few more for the range
    sums; ``~L/2 · Dk`` products for the sub-chunk scores; ``(C/L) · Dk`` products for the
    pairs of sub-chunks; matmuls of plain chunked linear attention for the rest. Python
    loops: ``L`` rows and ``T/C`` chunk states (split with ``unbind``, see :func:`_scan`).
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    log_g = log_g.clamp(min=_LOG_G_FLOOR)                              # see _LOG_G_FLOOR
    C, N = _num_chunks(T, chunk_size)
    L = _gla_subchunk(C)
    n_sub = -(-C // L)
    Cp = n_sub * L

    def chunks(x: Tensor) -> Tensor:                                   # (B, H, N, Cp, ·)
        x = _to_chunks(x, N, C)
        return x if Cp == C else F.pad(x, (0, 0, 0, Cp - C))

    qc, kc, vc, gc = (chunks(x) for x in (q, k, v, log_g))
    sums = _SegmentSums(L, n_sub, q.dtype, q.device)
    sub = (B, H, N, n_sub, L)
    q_s, k_s, v_s, g_s = qc.view(*sub, Dk), kc.view(*sub, Dk), vc.view(*sub, Dv), gc.view(*sub, Dk)

    # Diagonal sub-chunk blocks, row by row: W_t = [W_{t-1} ⊙ g_t ; k_t] holds the keys s <= t
    # of the sub-chunk decayed to t, k_s ⊙ Π_{s<r<=t} g_r (a product of the gates in the range,
    # each g_r = exp(log_g_r) <= 1: no exp of a positive number, no difference of sums, and
    # autograd differentiates it by multiplications only). Row t of the scores is W_t q_t.
    # (The tokens are split with unbind once: slicing inside the loop would make autograd
    # write a zero tensor of the full size for every slice in the backward pass.)
    gates, k_t, q_t = (x.unsqueeze(-2).unbind(-3) for x in (g_s.exp(), k_s, q_s))  # L × (B, H, N, n_sub, 1, Dk)
    W = k_t[0]                                                         # (B, H, N, n_sub, 1, Dk)
    rows = [F.pad((W * q_t[0]).sum(-1), (0, L - 1))]                   # row 0: (B, H, N, n_sub, L)
    for t in range(1, L):
        W = torch.cat([W * gates[t], k_t[t]], dim=-2)                  # (B, H, N, n_sub, t+1, Dk)
        rows.append(F.pad((W * q_t[t]).sum(-1), (0, L - 1 - t)))       # (B, H, N, n_sub, L)
    A_diag = torch.stack(rows, dim=-2)                                 # (B, H, N, n_sub, L(t), L(s))
    if safe:   # keep a NaN/inf of a later token out of earlier rows (see _run)
        out = masked_matmul(A_diag, v_s, sums.inclusive).view(B, H, N, Cp, Dv)
    else:
        out = (A_diag @ v_s).view(B, H, N, Cp, Dv)

    # Every other factor exp(Σ_{s<r<=t} log_g_r) (s before the sub-chunk of t) is a product
    # of exps of non-positive range sums over disjoint ranges: exp(Σ_{s<r<=e}) to the end e of
    # the key's sub-chunk (one per token), exp(Σ of the totals of the sub-chunks strictly in
    # between) (one per pair of sub-chunks, or per sub-chunk and chunk boundary) and
    # exp(Σ_{r_i<r<=t}) from the start of the query's sub-chunk (one per token). So only
    # T·Dk exps are per token, besides the gates, and no exponent is ever positive.
    q_rel = q_s * (sums.inclusive @ g_s).exp()                         # (B, H, N, n_sub, L, Dk)
    k_end = k_s * (sums.after @ g_s).exp()                             # (B, H, N, n_sub, L, Dk)
    totals = g_s.sum(-2)                                               # (B, H, N, n_sub, Dk)

    # Blocks between sub-chunks of a chunk: key s in sub-chunk j < i, query t in sub-chunk i.
    # The pair factor is multiplied by 0 for j >= i (an empty sum there: a finite factor 1).
    if n_sub > 1:
        between = (sums.between @ totals).view(B, H, N, n_sub, n_sub, 1, Dk)  # [i, j]: Σ_{j<m<i} totals
        pair = between.exp() * sums.earlier                            # (B, H, N, n_sub(i), n_sub(j), 1, Dk)
        k_rel = (k_end.unsqueeze(3) * pair).view(B, H, N, n_sub, Cp, Dk)   # (B, H, N, n_sub(i), Cp, Dk)
        A_off = (q_rel @ k_rel.transpose(-1, -2)).view(B, H, N, Cp, Cp)  # (B, H, N, Cp(t), Cp(s))
        if safe:
            A_off = A_off.masked_fill(sums.earlier_tokens == 0, 0.0)
            out = out + masked_matmul(A_off, vc, sums.earlier_tokens)
        else:
            out = out + A_off @ vc

    # Between chunks: a query reads the state with exp(Σ_{r<=t}) (from the chunk's start), a
    # key enters it with exp(Σ_{s<r<=Cp}) (to the chunk's end), the state decays by the total.
    q_chunk = (q_rel * (sums.earlier_total @ totals).exp().unsqueeze(-2)).view(B, H, N, Cp, Dk)
    k_chunk = (k_end * (sums.later_total @ totals).exp().unsqueeze(-2)).view(B, H, N, Cp, Dk)
    U = k_chunk.transpose(-1, -2) @ vc                                 # (B, H, N, Dk, Dv)
    chunk_decay = totals.sum(-2).exp().unsqueeze(-1)                   # (B, H, N, Dk, 1)
    S_before, S = _scan(_zeros_state(k, v, S0), lambda S, d, u: d * S + u, chunk_decay, U)
    out = out + q_chunk @ S_before                                     # (B, H, N, Cp, Dv)
    return _from_chunks(out[:, :, :, :C], T), S


class _SegmentSums:
    """0/1 matrices that sum log-gates over index ranges, by matmul along the token axis.

    A matmul with a 0/1 matrix adds exactly the terms of each range (the zeros add
    nothing), so every range sum is computed from its own terms: exact to rounding, with
    no difference of two cumulative sums, and an empty range is a constant 0 that does
    not depend on the gates (so no gradient flows through a factor of exactly 1). This is
    the "segsum" of Mamba-2 (Dao & Gu, 2024), written as matmuls, which on the CPU run
    several times faster than a cumulative sum along a strided axis.

    With ``L`` tokens per sub-chunk, ``n`` sub-chunks and ``Cp = n·L`` tokens per chunk:

    - ``inclusive`` ``(L, L)``: ``r <= t``; ``after`` ``(L, L)``: ``r > s`` (to the sub-chunk's end);
    - ``between`` ``(n·n, n)``: row ``(i, j)`` sums the sub-chunks ``m`` with ``j < m < i``;
    - ``earlier`` ``(n, n, 1, 1)`` 0/1: ``j < i``;
    - ``earlier_total`` ``(n, n)``: sub-chunks ``m < i``; ``later_total`` ``(n, n)``: ``m > j``;
    - ``earlier_tokens`` ``(n·L, n·L)`` 0/1: the sub-chunk of ``s`` is before that of ``t``.
    """

    def __init__(self, L: int, n: int, dtype: torch.dtype, device) -> None:
        def tri(size: int, diagonal: int, upper: bool = False) -> Tensor:
            ones = torch.ones(size, size, dtype=dtype, device=device)
            return ones.triu(diagonal) if upper else ones.tril(diagonal)

        self.inclusive = tri(L, 0)
        self.after = tri(L, 1, upper=True)
        i, j, m = (torch.arange(n, device=device).view(*shape) for shape in ((n, 1, 1), (1, n, 1), (1, 1, n)))
        self.between = ((j < m) & (m < i)).to(dtype).view(n * n, n)
        self.earlier = (j < i).to(dtype).view(n, n, 1, 1)
        self.earlier_total = tri(n, -1)
        self.later_total = tri(n, 1, upper=True)
        # (n·L, n·L) 0/1: token s lies in an earlier sub-chunk than token t (the off-diagonal blocks)
        self.earlier_tokens = self.earlier.view(n, n).repeat_interleave(L, 0).repeat_interleave(L, 1)


def _delta_chunk(q, k, v, beta, S0, chunk_size, safe=False):
    """Chunkwise delta rule through the WY / UT representation (see :func:`delta_rule`).

    Padded tokens have ``k = v = q = 0`` and ``β = 0``: they leave the state unchanged.
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    C, N = _num_chunks(T, chunk_size)
    qc, kc, vc = (_to_chunks(x, N, C) for x in (q, k, v))               # (B, H, N, C, ·)
    bc = _to_chunks(beta.unsqueeze(-1), N, C)                          # (B, H, N, C, 1)
    eye_C = torch.eye(C, dtype=q.dtype, device=q.device)
    kb = kc * bc                                                       # diag(β) K
    T_mat = eye_C + (kb @ kc.transpose(-1, -2)).tril(-1)               # I + tril(diag(β) K Kᵀ, −1)
    rhs = torch.cat([kb, vc * bc], dim=-1)                             # diag(β) [K, V]
    sol = torch.linalg.solve_triangular(T_mat, rhs, upper=False, unitriangular=True)
    W, U_tilde = sol[..., :Dk], sol[..., Dk:]                          # (B, H, N, C, Dk), (..., Dv)
    A = (qc @ kc.transpose(-1, -2)).tril()                             # (B, H, N, C, C)
    if safe:   # keep a NaN/inf of a later token out of earlier rows (see _run)
        causal = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()
        AW, AU = masked_matmul(A, W, causal), masked_matmul(A, U_tilde, causal)
    else:
        AW, AU = A @ W, A @ U_tilde
    q_eff = qc - AW                                                    # O = q_eff S + A Ũ
    kt = kc.transpose(-1, -2)
    transition = torch.eye(Dk, dtype=q.dtype, device=q.device) - kt @ W   # (B, H, N, Dk, Dk)
    G = kt @ U_tilde                                                   # (B, H, N, Dk, Dv)
    S_before, S = _scan(_zeros_state(k, v, S0), lambda S, tr, g: tr @ S + g, transition, G)
    out = AU + q_eff @ S_before                                        # (B, H, N, C, Dv)
    return _from_chunks(out, T), S
