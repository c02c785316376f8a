"""Softmax attention (the reference), linear attention (one entry point, several algorithms) and its decoding step."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from . import _checks, backends
from ._deprecated import moved
from ._numerics import (CausalPoison, all_finite, compiling, divide_by_normaliser, masked_matmul, no_autocast,
                        safe_normaliser)
from .ops.varlen import check_cu_seqlens
from .ops.linear import chunkwise_linear_attention, parallel_linear_attention, quadratic_linear_attention, recurrent_linear_attention
from .feature_maps import FeatureMap, elu_plus_one, resolve_feature_map
from .feature_maps.elementwise import elu_plus_one_arithmetic
from .state import LinearAttentionState, check_initial_state

__all__ = ["softmax_attention", "linear_attention", "linear_attention_step", "LINEAR_ATTENTION_METHODS",
           "resolve_linear_attention_method"]

LINEAR_ATTENTION_METHODS = ("auto", "parallel", "quadratic", "recurrent", "chunk")


@_checks.reject_key_padding_mask
def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """Scaled dot-product (softmax) attention, written out with its full T×T matrix.

    Parameters
    ----------
    q : Tensor
        ``(B, H, Tq, D)`` queries.
    k : Tensor
        ``(B, H, Tk, D)`` keys.
    v : Tensor
        ``(B, H, Tk, Dv)`` values.
    causal : bool
        Query ``i`` sees keys ``j <= i`` only (needs ``Tq == Tk``).
    scale : float, optional
        Multiplies the scores; default ``1/sqrt(D)``.
    attention_mask : Tensor, optional
        ``(B, Tk)`` bool, or integer holding 0/1: True (1) for real tokens, False (0) for
        padding, as Hugging Face's ``attention_mask`` (PyTorch's ``key_padding_mask`` means the
        opposite and is refused by name). Padded keys get zero weight.

    Returns
    -------
    Tensor
        ``(B, H, Tq, Dv)`` in the input dtype (scores and softmax in float32 for half
        inputs, also under ``torch.autocast``). A query that sees no key at all (only
        padding) gets a zero output. A non-finite key or value reaches only the queries that
        see it: with ``causal=True`` later tokens never change earlier outputs, and padded
        slots change nothing, whatever they hold.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a non-bool mask; a non-numeric scale.
    ValueError
        Wrong ranks, an empty dimension, mismatched batch/heads/dims, causal with
        ``Tq != Tk``, a mask of the wrong shape or device or an integer mask with values
        other than 0 and 1, a non-positive or non-finite scale.
    """
    _checks.check_qkv(q, k, v, causal=causal)
    causal = _checks.check_bool(causal, "causal")
    attention_mask = _checks.check_attention_mask(attention_mask, k)
    acc = _checks.accumulation_dtype(q.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        scale = _checks.check_positive_float(scale, "scale", acc)
    with no_autocast(q.device):
        q_, k_, v_ = q.to(acc), k.to(acc), v.to(acc)
        scores = (q_ @ k_.transpose(-1, -2)) * scale                    # (B, H, Tq, Tk)
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal:
            visible = visible.tril()                                    # (Tq, Tk)
        if attention_mask is not None:
            visible = visible & attention_mask[:, None, None, :]        # (B, 1, Tq, Tk)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)  # rows with no key
        if compiling() or not all_finite(v_):
            # A NaN/inf value must reach only the queries that see it: not earlier queries
            # (causal), not any query when it sits in a padded slot (zero weight).
            out = masked_matmul(weights, v_, visible)
        else:
            out = weights @ v_
    return out.to(q.dtype)                                              # (B, H, Tq, Dv)


@_checks.reject_key_padding_mask
def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap, None] = "elu+1",
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
    method: str = "auto",
    chunk_size: int = 64,
    attention_mask: Optional[Tensor] = None,
    initial_state: Optional[LinearAttentionState] = None,
    return_state: bool = False,
    scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Linear attention: softmax's similarity replaced by ``φ(q)ᵀφ(k)``.

    Katharopoulos et al. (2020), eq. 5 (non-causal) and eq. 9 (causal)::

        y_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)

    Parameters
    ----------
    q : Tensor
        ``(B, H, Tq, D)`` queries, floating point.
    k : Tensor
        ``(B, H, Tk, D)`` keys, same dtype and device as ``q``.
    v : Tensor
        ``(B, H, Tk, Dv)`` values; ``Dv`` may differ from ``D``.
    feature_map : str, callable or None
        φ: a name for :func:`linattn.get_feature_map`, a callable ``(..., D) -> (..., M)``
        (any ``M``), or None when ``q`` and ``k`` already are features.
    causal : bool
        Query ``i`` sees keys ``j <= i`` only (needs ``Tq == Tk``).
    normalize : bool
        Divide by the normaliser (True) or return the numerator ``Σ φ(q_i)ᵀφ(k_j) v_j``.
    eps : float
        Replaces the normaliser only where it is zero, negative or not finite; a positive
        normaliser is used as it is, however small (so ``eps`` never changes a valid output).
        Zero happens with non-negative maps that are not strictly positive (ReLU: a query
        orthogonal to every key), and then the numerator is zero too: the output is 0.
        Negative happens only with feature maps that take negative values: the output
        ``num / eps`` is then meaningless (chapter 2 shows why). Use a non-negative φ.
    method : str
        ``"parallel"`` (non-causal ``φ(Q)(φ(K)ᵀV)``), ``"quadratic"`` (the masked ``Tq×Tk`` matrix),
        ``"recurrent"`` (causal; the token loop of :func:`linear_attention_step`), ``"chunk"``
        (causal; chunkwise, on the backend :mod:`linattn.backends` picks), or ``"auto"``:
        ``"chunk"`` when causal, else ``"parallel"``. All give the same numbers up to rounding and
        stay causal whatever the values (a NaN at position ``t`` changes no earlier output).
    chunk_size : int
        Tokens per chunk for ``method="chunk"``; ``T`` need not be a multiple of it.
    attention_mask : Tensor, optional
        ``(B, Tk)`` bool, or integer holding 0/1: True (1) for real tokens, False (0) for
        padding, as Hugging Face's ``attention_mask`` (PyTorch's ``key_padding_mask`` means the
        opposite and is refused by name). Padded keys contribute nothing: the mask
        zeroes ``φ(k)`` after the feature map (zeroing ``k`` first would not do, since
        ``elu(0) + 1 = 1``).
    initial_state : LinearAttentionState, optional
        State to start from: ``S`` ``(B, H, M, Dv)`` and ``z`` ``(B, H, M)`` (``N`` in place of
        ``B`` with ``cu_seqlens``).
    return_state : bool
        Also return the state after the last key (``initial_state`` included).
    scale : float, optional
        Multiplies ``q`` before φ (after φ it would cancel in the normalised output). None (the
        default) means 1: linattn scales nothing unless asked, unlike PyTorch's SDPA and
        flash-linear-attention, whose default is ``D ** -0.5``.
    cu_seqlens : Tensor, optional
        Causal only: a packed batch (flash-linear-attention's meaning): ``B = 1``, ``N``
        sequences end to end along ``T``, ``cu_seqlens`` their ``N + 1`` offsets (1-D int32 or
        int64, non-decreasing from 0 to ``T``; empty sequences allowed). Each sequence has its
        own state (``S`` ``(N, H, M, Dv)``, ``z`` ``(N, H, M)``; an empty sequence returns its
        initial state, or zeros); outputs, states and gradients equal one call per sequence.

    Returns
    -------
    out : Tensor
        ``(B, H, Tq, Dv)`` in the dtype of ``q``. Half and bfloat16 inputs are computed
        with float32 accumulation and only the output is rounded; under ``torch.autocast``
        the computation keeps these dtypes (autocast is switched off inside). With ``normalize=False``
        the numerator grows with the number of keys and can exceed float16's range (65504)
        when rounded back: prefer ``normalize=True`` or float32/bfloat16 inputs there.
        The output of ``method="chunk"`` may be the very tensor its backward pass uses (float32
        or float64 inputs and ``T`` a multiple of the chunk length): modifying it in place
        before calling backward then raises autograd's usual in-place error; otherwise it is a
        copy. Either way the gradients are never wrong.
    state : LinearAttentionState
        Only if ``return_state``: float32 (float64 for float64 inputs), contiguous tensors
        that share no memory with the inputs.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a mask that is not a bool or integer
        tensor; a non-bool flag; a feature map that is neither a name, a callable nor None,
        or that returns no floating tensor; a bad state type; a non-numeric ``scale``;
        ``cu_seqlens`` that is not an int32/int64 tensor; ``key_padding_mask`` (renamed
        ``attention_mask``, with the opposite meaning of PyTorch's).
    ValueError
        Wrong ranks; an empty dimension; batch, heads or dims that disagree; causal with
        ``Tq != Tk``; an unknown method or feature map name; a method that does not fit
        ``causal``; a mask or state of the wrong shape or device, an integer mask holding
        values other than 0 and 1; features of another shape or device than their inputs;
        ``chunk_size < 1``; ``eps <= 0`` or ``eps`` outside the normal range of the
        computation dtype (float32 for half inputs); a position-dependent feature map
        (cosFormer) with ``initial_state``, or without a fixed ``max_len`` in a causal call
        or with ``Tq != Tk``; ``scale`` not a positive normal number; ``cu_seqlens`` not 1-D
        int32/int64 offsets non-decreasing from 0 to ``T``, with ``causal=False``, ``B != 1``,
        ``attention_mask`` or a position-dependent feature map. Under ``torch.compile`` the
        value checks on tensor data (an integer mask's values) run inside the graph and raise
        RuntimeError.
    """
    _checks.check_qkv(q, k, v, causal=causal)
    causal = _checks.check_bool(causal, "causal")
    normalize = _checks.check_bool(normalize, "normalize")
    return_state = _checks.check_bool(return_state, "return_state")
    acc = _checks.accumulation_dtype(q.dtype)
    eps = _checks.check_eps(eps, acc)
    chunk_size = _checks.check_chunk_size(chunk_size)
    scale = _checks.check_scale(scale, acc)
    packing = None
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens (a packed batch of sequences) needs causal=True: non-causal attention "
                             "over a packed batch would mix its sequences")
        packing = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], attention_mask, q.device)
    attention_mask = _checks.check_attention_mask(attention_mask, k)
    method = resolve_linear_attention_method(method, causal)
    phi = resolve_feature_map(feature_map)
    _checks.check_position_dependent(phi, causal=causal, resumed=initial_state is not None,
                                     same_length=q.shape[2] == k.shape[2], caller="linear_attention")
    if packing is not None and _checks.position_dependent(phi):
        raise ValueError(f"linear_attention: the position-dependent feature_map {type(phi).__name__} cannot see "
                         "where the sequences of a packed batch (cu_seqlens) start; pass their features yourself")
    with no_autocast(q.device):
        if packing is None:
            out, state = _linear_attention(q, k, v, phi, causal, normalize, eps, method, chunk_size, attention_mask,
                                           initial_state, return_state, acc, scale)
        else:
            out, state = _packed(packing, q, k, v, phi, normalize, eps, method, chunk_size, initial_state, acc, scale)
    out = out.to(q.dtype)
    return (out, state) if return_state else out


def _state_tensors(state) -> tuple:
    """``(S, z)`` of a state (``(None, None)`` without one): a gradient through them needs a backward pass too."""
    items = state if isinstance(state, (tuple, list)) else (getattr(state, "S", None), getattr(state, "z", None))
    return tuple(t if isinstance(t, torch.Tensor) else None for t in items)


def _linear_attention(q, k, v, phi, causal, normalize, eps, method, chunk_size, attention_mask, initial_state,
                      return_state, acc, scale=None):
    """The computation of :func:`linear_attention` on checked arguments: (output in ``acc``, state or None)."""
    q_acc = q.to(acc) if scale is None else q.to(acc) * scale             # scaled before φ
    if (method == "chunk" and phi is elu_plus_one and attention_mask is None and q.device.type == "cpu"
            and backends.select("linear_attention", q_acc, k, v, *_state_tensors(initial_state),
                                chunk_size=chunk_size) == "cpu"):
        return _cpu_chunk(q_acc, k.to(acc), v.to(acc), None, normalize, eps, chunk_size, initial_state,
                          return_state, acc, feature_map="elu+1")
    phi_q, phi_k = _checks.apply_feature_map(phi, q_acc, k.to(acc))       # (B, H, T, M)
    v32 = v.to(acc)
    if attention_mask is not None:                                         # mask after φ; padded keys
        keep = attention_mask[:, None, :, None]                            # and values contribute 0,
        phi_k = torch.where(keep, phi_k, 0.0)                              # even if they hold inf/NaN
        v32 = torch.where(keep, v32, 0.0)
    B, H, _, M = phi_k.shape
    Dv = v.shape[-1]
    state0 = check_initial_state(initial_state, B, H, M, Dv, acc, q.device)
    if method == "chunk":
        backend = backends.select("linear_attention", phi_q, phi_k, v32, *_state_tensors(state0),
                                  chunk_size=chunk_size)
        if backend == "triton":
            fused = _fused_chunk(phi_q, phi_k, v32, state0, chunk_size, q.dtype)
            # A NaN/inf anywhere makes the state non-finite: then the PyTorch path below keeps it causal.
            if fused is not None and (compiling() or all_finite(fused[1])):
                out_aug, S = fused
                out = divide_by_normaliser(out_aug, normalize, eps)
                return out, (LinearAttentionState.from_augmented(S) if return_state else None)
            backends._record("torch")
        elif backend == "cpu":
            return _cpu_chunk(phi_q, phi_k, v32, state0, normalize, eps, chunk_size, None, return_state, acc)
        out, S, z = chunkwise_linear_attention(
            phi_q, phi_k, v32, None if state0 is None else state0.S, None if state0 is None else state0.z,
            normalize=normalize, eps=eps, chunk_size=chunk_size)
        return out, (LinearAttentionState(S, z) if return_state else None)

    # The reference algorithms carry the normaliser as an extra value column of ones.
    backends._record("torch")
    S0 = None if state0 is None else state0.augmented()                   # (B, H, M, Dv + 1)
    v_aug = torch.cat([v32, torch.ones_like(v32[..., :1])], dim=-1)       # (B, H, Tk, Dv + 1)
    if method == "parallel":
        out_aug, S = parallel_linear_attention(phi_q, phi_k, v_aug, S0)
    elif method == "quadratic":
        out_aug, S = quadratic_linear_attention(phi_q, phi_k, v_aug, S0, causal, need_state=return_state)
    else:
        out_aug, S = recurrent_linear_attention(phi_q, phi_k, v_aug, S0)
    out = divide_by_normaliser(out_aug, normalize, eps)                                  # (B, H, Tq, Dv)
    return out, (LinearAttentionState.from_augmented(S) if return_state else None)


def _packed(packing, q, k, v, phi, normalize, eps, method, chunk_size, initial_state, acc, scale):
    """Causal linear attention on a packed batch (:mod:`linattn.ops.varlen`), bucket by bucket: (out, state)."""
    q_acc = q.to(acc) if scale is None else q.to(acc) * scale
    phi_q, phi_k = _checks.apply_feature_map(phi, q_acc, k.to(acc))          # (1, H, T, M)
    v32 = v.to(acc)
    _, H, _, M = phi_k.shape
    Dv = v.shape[-1]
    state0 = check_initial_state(initial_state, packing.N, H, M, Dv, acc, q.device)

    def bucket(q_b, k_b, v_b, s0):
        start = None if s0 is None else LinearAttentionState._unchecked(*s0)
        out, st = _linear_attention(q_b, k_b, v_b, None, True, normalize, eps, method, chunk_size, None, start, True,
                                    acc)
        return out, (st.S, st.z)

    def zeros(n: int):
        return phi_k.new_zeros(n, H, M, Dv), phi_k.new_zeros(n, H, M)

    out, (S, z) = packing.run(bucket, (phi_q, phi_k, v32), None if state0 is None else (state0.S, state0.z), zeros)
    return out, LinearAttentionState(S.contiguous(), z.contiguous())


def _cpu_chunk(q, k, v, state0, normalize, eps, chunk_size, initial_state, return_state, acc, feature_map=None):
    """The compiled CPU path (:mod:`linattn.kernels.cpu`): (output, state or None). A NaN/inf key or value
    (a non-finite last state) is run again with zeros in its place and NaN where it reaches, as the PyTorch
    path does: earlier outputs keep their bits, and no gradient of an earlier token sees the NaN."""
    from .kernels.cpu import causal_linear_attention_cpu

    if initial_state is not None:
        B, H, _, M = k.shape
        state0 = check_initial_state(initial_state, B, H, M, v.shape[-1], acc, q.device)
    def run(q, k, v):
        return causal_linear_attention_cpu(
            q, k, v, None if state0 is None else state0.S, None if state0 is None else state0.z,
            normalize=normalize, eps=eps, chunk_size=chunk_size, feature_map=feature_map)

    out, S, z = run(q, k, v)
    if not all_finite(S, z):                 # a NaN/inf key or value reached the last state
        poison = CausalPoison(q, k, v)
        out, S, z = run(poison.q, poison.k, poison.v)
        out, S, z = poison.outputs(out), poison.state(S), poison.normaliser(z)
    return out, (LinearAttentionState(S, z) if return_state else None)


def _fused_chunk(phi_q: Tensor, phi_k: Tensor, v32: Tensor, state0: Optional[LinearAttentionState],
                 chunk_size: int, input_dtype: torch.dtype = torch.float32) -> Optional[tuple[Tensor, Tensor]]:
    """The Triton path, or None (with a warning, once) if the kernel cannot run on this GPU."""
    from . import kernels

    S0 = None if state0 is None else state0.augmented()
    v_aug = torch.cat([v32, torch.ones_like(v32[..., :1])], dim=-1)   # (B, H, T, Dv + 1)
    half = input_dtype in (torch.float16, torch.bfloat16)
    if half:
        phi_q, phi_k, v_aug = (x.to(input_dtype) for x in (phi_q, phi_k, v_aug))
    try:
        return kernels.chunk_linear_attention_triton(phi_q, phi_k, v_aug, S0, chunk_size,
                                                     out_dtype=torch.float32 if half else None)
    except Exception as err:  # e.g. a compile or launch failure (out of shared memory) on this GPU
        backends._triton_failed(err)
        return None


def resolve_linear_attention_method(method, causal: bool) -> str:
    """``method`` of :func:`linear_attention` checked against ``causal``; ``"auto"`` resolved."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    method = method.strip().lower()
    if method not in LINEAR_ATTENTION_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(map(repr, LINEAR_ATTENTION_METHODS))}")
    if method == "auto":
        return "chunk" if causal else "parallel"
    if causal and method == "parallel":
        raise ValueError("method='parallel' is non-causal; with causal=True use 'chunk', 'recurrent' or 'quadratic'")
    if not causal and method in ("recurrent", "chunk"):
        raise ValueError(
            f"method={method!r} computes causal attention; pass causal=True, or use 'parallel' "
            "or 'quadratic' for non-causal attention"
        )
    return method


def linear_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Optional[LinearAttentionState] = None,
    *,
    feature_map: "str | FeatureMap | None" = "elu+1",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: Optional[float] = None,
) -> tuple[Tensor, LinearAttentionState]:
    """Causal linear attention for one new token: update the state, then read it with the query.

    Implements Katharopoulos et al. (2020), eqs. 18-20::

        S_t = S_{t-1} + φ(k_t) v_tᵀ,   z_t = z_{t-1} + φ(k_t),
        y_t = S_tᵀ φ(q_t) / z_tᵀ φ(q_t)

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
    scale : float, optional
        Multiplies ``q`` before φ, as in :func:`linattn.linear_attention` (None: 1).

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
        ``S``/``z`` are not floating tensors; a non-numeric ``scale``.
    ValueError
        Wrong ranks, an empty dimension, mismatched (B, H, D), a state whose shapes, dtypes or
        device do not match, ``eps`` or ``scale`` not a positive normal number of the
        computation dtype, a position-dependent feature map (cosFormer), a feature map whose output has other
        leading dimensions or lives on another device.
    """
    if not _checks.step_inputs_ok(q, k, v):             # one cheap test; the full checks say what is wrong
        _check_step_inputs(q, k, v)
    plain = type(feature_map) is str and type(normalize) is bool and type(eps) is float
    key = (feature_map, normalize, eps, q.dtype)
    options = _STEP_OPTIONS.get(key) if plain else None
    if options is None:                                  # checked once per set of plain options, then remembered
        options = _step_options(feature_map, normalize, eps, q.dtype)
        if plain and len(_STEP_OPTIONS) < 64:
            _STEP_OPTIONS[key] = options
    phi, normalize, eps, acc = options
    dtype = q.dtype
    if scale is not None and _checks.check_scale(scale, acc) is not None:
        q = q.to(acc) * scale                                            # before φ
    if q.is_cpu and not torch.is_autocast_enabled("cpu") and not compiling():
        out, S, z = _step(q, k, v, state, phi, normalize, eps, acc)      # nothing to switch off
    else:
        with no_autocast(q.device):
            out, S, z = _step(q, k, v, state, phi, normalize, eps, acc)
    return (out if out.dtype == dtype else out.to(dtype)), LinearAttentionState._unchecked(S, z)


_STEP_OPTIONS: dict = {}


def _step(q, k, v, state, phi, normalize, eps, acc):
    """The arithmetic of :func:`linear_attention_step` on checked inputs: ``(out, S, z)`` in ``acc``."""
    q32, k32 = (q if q.dtype == acc else q.to(acc)), (k if k.dtype == acc else k.to(acc))
    v32 = v if v.dtype == acc else v.to(acc)
    if phi is elu_plus_one and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        phi_q, phi_k = elu_plus_one_arithmetic(torch.stack((q32, k32)))   # (2, B, H, D): one call for both
    else:
        phi_q, phi_k = _checks.apply_feature_map(phi, q32, k32)          # (B, H, M)
    B, H, M = phi_k.shape
    Dv = v.shape[-1]
    if state is not None and not state._matches(B, H, M, Dv, acc, q.device):
        state = check_initial_state(state, B, H, M, Dv, acc, q.device, name="state")
    if state is None:
        S = phi_k.unsqueeze(-1) * v32.unsqueeze(-2)                      # (B, H, M, Dv)
        z = phi_k.clone(memory_format=torch.contiguous_format)           # (B, H, M), never the caller's k
    else:
        S = torch.addcmul(state.S, phi_k.unsqueeze(-1), v32.unsqueeze(-2))
        z = state.z + phi_k
    out = (phi_q.unsqueeze(-2) @ S).squeeze(-2)                          # (B, H, Dv)
    if normalize:
        den = (phi_q * z).sum(-1, keepdim=True)                          # (B, H, 1)
        out = out.div_(safe_normaliser(den, eps))                         # out is a fresh tensor
    return out, S.contiguous(), z.contiguous()


def _step_options(feature_map, normalize, eps, dtype) -> tuple:
    """:func:`linear_attention_step`'s options checked: ``(phi, normalize, eps, accumulation dtype)``."""
    normalize = _checks.check_bool(normalize, "normalize")
    acc = _checks.accumulation_dtype(dtype)
    eps = _checks.check_eps(eps, acc)
    phi = resolve_feature_map(feature_map)
    if _checks.position_dependent(phi):
        raise ValueError(
            f"linear_attention_step cannot apply the position-dependent feature_map {type(phi).__name__}: "
            "it sees one token without its position; compute the features yourself, e.g. "
            "phi(x[:, :, None], offset=t)[:, :, 0], and pass feature_map=None")
    return phi, normalize, eps, acc


def _check_step_inputs(q, k, v) -> None:
    """The checks of :func:`linear_attention_step`'s ``q``, ``k``, ``v``, raising the error that names the problem."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(x, name, 3, "(batch, heads, dim)")
    _checks.check_same_kind({"q": q, "k": k, "v": v})
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            "q, k (B, H, D) and v (B, H, Dv) must share B and H, got "
            f"q {_checks.shape_str(q.shape)}, k {_checks.shape_str(k.shape)}, v {_checks.shape_str(v.shape)}"
        )
    raise ValueError(
        f"q and k must have the same head_dim D (dim 2), got q {_checks.shape_str(q.shape)} "
        f"and k {_checks.shape_str(k.shape)}"
    )


__getattr__ = moved(__name__, {"METHODS": "linattn.attention:LINEAR_ATTENTION_METHODS"})
