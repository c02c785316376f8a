"""Retention (RetNet): causal linear attention whose state decays by a fixed ``γ`` per head."""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
from torch import Tensor

from ... import _checks
from ... import backends
from ..._numerics import no_autocast
from ...feature_maps import FeatureMap
from .._common import Result, output_and_state, prepare, run, zeros_state
from ..gla import chunk_gated_linear_attention, recurrent_gated_linear_attention
from .chunk import chunk_retention
from .naive import recurrent_retention

__all__ = ["retention", "recurrent_retention", "chunk_retention"]


def retention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Union[float, Tensor],
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
) -> Result:
    """Retention: causal linear attention whose state decays by a fixed ``γ`` per head.

    The recurrent representation of retention (Sun et al., 2023, arXiv:2307.08621,
    sec. 2.1), without RetNet's rotation, normalisation and group norm::

        S_t = γ S_{t-1} + φ(k_t) v_tᵀ,      o_t = S_tᵀ φ(q_t)

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, HV, T, Dv)`` values; ``HV`` a multiple of ``H`` (grouped value heads: value
        head ``j`` reads q/k head ``j // (HV // H)``, as in flash-linear-attention and
        transformers; no repeated copy of ``q`` or ``k`` is made).
    gamma : float or Tensor
        The decay ``γ`` in ``(0, 1]``: one Python float for every head, or a tensor of
        shape ``(HV,)`` (one per value head, any floating dtype, on the inputs' device; it is
        differentiable). A 0-d tensor is refused: pass ``float(gamma)``.
    method : str
        ``"auto"`` (= ``"chunk"``), ``"chunk"`` or ``"recurrent"``; case-insensitive.
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it.
    feature_map : str, callable or None
        φ applied to ``q`` and ``k`` first, as in :func:`linattn.linear_attention`; None
        (the default) uses them as given.
    scale : float, optional
        Multiplies ``q`` before anything else (before ``feature_map``). None (the default)
        means 1: linattn scales nothing unless asked, unlike PyTorch's SDPA and
        flash-linear-attention, whose default is ``D ** -0.5`` (pass that for theirs).
    initial_state : Tensor, optional
        ``(B, HV, Dk, Dv)``, the state ``S0`` before the first token (``Dk = D``, or the
        feature dimension of φ), for instance the state returned by an earlier call;
        ``(N, HV, Dk, Dv)`` with ``cu_seqlens``.
    return_state : bool
        Also return the state after the last token.
    cu_seqlens : Tensor, optional
        A packed batch (flash-linear-attention's meaning): ``B = 1``, ``N`` sequences end to
        end along ``T``, and ``cu_seqlens`` their ``N + 1`` offsets, a 1-D int32 or int64
        tensor non-decreasing from 0 to ``T`` (empty sequences allowed). Every sequence has
        its own state: ``initial_state`` and the returned state are ``(N, HV, Dk, Dv)`` (an
        empty sequence returns its initial state, or zeros). Outputs, states and gradients
        equal one call per sequence.
    attention_mask : Tensor, optional
        ``(B, T)`` bool, or integer 0/1: True (1) for real tokens, as Hugging Face's (and
        :func:`linattn.linear_attention`'s). A padded position, wherever it is, neither writes
        nor decays the state, and its output is 0: the returned state is that of the real
        tokens alone (right padding does not decay it by ``γ`` per padded token).

    Returns
    -------
    out : Tensor
        ``(B, HV, T, Dv)`` in the dtype of ``q``. Computed in float32 for float16/bfloat16
        inputs (float64 for float64).
    state : Tensor
        Only if ``return_state``: ``(B, HV, Dk, Dv)`` (``(N, HV, Dk, Dv)`` with ``cu_seqlens``)
        in float32 (float64 for float64 inputs). Resuming from it with the rest of a sequence
        equals one run.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a ``gamma`` that is neither a real
        number nor a floating tensor; a non-str method; a non-int chunk size; a non-numeric
        scale; a non-bool flag; an ``initial_state`` that is not a floating tensor; a mask
        that is not a bool or integer tensor; ``cu_seqlens`` that is not an int32/int64 tensor.
    ValueError
        Wrong ranks or shapes (``v``'s heads not a multiple of ``q``'s), an empty dimension;
        ``gamma`` outside ``(0, 1]``, not finite, or a tensor not of shape ``(HV,)`` or on
        another device; an unknown method; ``chunk_size < 1``; ``scale`` not a positive
        normal number; an ``initial_state`` of the wrong shape or device; features of another
        shape or device than their inputs; a position-dependent feature map (cosFormer) with
        ``initial_state``, with ``cu_seqlens`` or without a fixed ``max_len``; a mask of the
        wrong shape or device; ``cu_seqlens`` not 1-D, not non-decreasing from 0 to ``T``,
        with ``B != 1`` or with ``attention_mask``. Under ``torch.compile`` the checks of
        tensor values (``gamma``, ``log_g``, ``beta``) run inside the graph and raise
        RuntimeError with the same message.
    RuntimeError
        Under ``torch.jit.trace`` (the decay ops choose their algorithm per call: use
        ``torch.compile`` or ``torch.export``).

    Notes
    -----
    Causality holds whatever the values: a NaN or infinity at position ``t`` never changes
    an output before ``t`` (in both methods). Autocast is switched off inside: the
    computation keeps the dtypes above under ``torch.autocast``. With ``attention_mask`` or
    ``cu_seqlens`` the decay becomes a gate per token (``log γ`` on real tokens, 0 on
    padding), computed by GLA's chunk form (:func:`gated_linear_attention`).
    """
    p = prepare("retention", q, k, v, method, chunk_size, feature_map, initial_state, return_state, scale,
                cu_seqlens, attention_mask)
    with no_autocast(q.device):
        gamma_t = _check_gamma(gamma, q, v.shape[1], p.acc)
        if p.mask is None and p.packing is None:
            out, S = run(p, lambda q, k, v, S0: recurrent_retention(q, k, v, gamma_t, S0),
                         lambda q, k, v, S0: _chunk(q, k, v, gamma_t, S0, p.chunk_size))
        else:                                                   # a gate per token: 0 (no decay) on padding
            B, HV, T, _ = p.v.shape
            log_g = p.per_token(gamma_t.log().view(1, HV, 1).expand(B, HV, T))   # (B, HV, T)
            out, S = run(p, lambda q, k, v, g, S0: recurrent_gated_linear_attention(q, k, v, g.unsqueeze(-1), S0),
                         lambda q, k, v, g, S0: _chunk_per_token(q, k, v, g, S0, p.chunk_size), log_g)
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, gamma, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("retention", q, k, v, gamma, S0) == "cpu":
        from ...kernels.cpu import decay_cpu

        B, H, T, _ = k.shape                                          # (the CPU kernel has H = HV)
        alpha = gamma.view(1, H, 1).expand(B, H, T)                   # autograd sums its gradient into gamma
        return decay_cpu(q, k, v, alpha, zeros_state(k, v, S0), chunk_size)
    return chunk_retention(q, k, v, gamma, S0, chunk_size)


def _chunk_per_token(q, k, v, log_g, S0, chunk_size):
    """Retention with a gate per token ``log_g`` ``(B, HV, T)`` (masked or packed): on the CPU kernel, or GLA's
    chunk form with the gate in every key channel."""
    if backends.select("retention", q, k, v, log_g, S0) == "cpu":
        from ...kernels.cpu import decay_cpu

        return decay_cpu(q, k, v, log_g.exp(), zeros_state(k, v, S0), chunk_size)
    return chunk_gated_linear_attention(q, k, v, log_g.unsqueeze(-1).expand(*log_g.shape, k.shape[-1]), S0,
                                        chunk_size)


# --------------------------------------------------------------------------- checks


def _check_gamma(gamma, q: Tensor, v_heads: int, acc: torch.dtype) -> Tensor:
    """``γ`` as an (H,) tensor in ``acc`` on q's device (differentiable if ``gamma`` is); ``H`` the heads of v."""
    H = v_heads
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
                         f"(use a gamma >= {torch.finfo(acc).tiny:.3g})",
                         gamma if isinstance(gamma, Tensor) else None)
    return gamma_t
