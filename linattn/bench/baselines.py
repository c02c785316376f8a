"""The methods a benchmark can time: linattn's paths, plain PyTorch baselines and peers."""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from ..attention import linear_attention
from ..backends import use_backends
from ..feature_maps import elu_plus_one

__all__ = ["METHODS", "DEFAULT_METHODS", "LINEAR_METHODS", "cumsum_linear_attention",
           "baseline_chunk_linear_attention", "compiled_baseline_linear_attention", "method_fn", "unavailable"]

METHODS = ("sdpa", "quadratic", "cumsum", "baseline_chunk", "compiled_baseline", "chunk", "chunk_torch", "chunk_cpu",
           "fused")
DEFAULT_METHODS = ("sdpa", "quadratic", "cumsum", "baseline_chunk", "chunk", "chunk_torch", "chunk_cpu", "fused")
"""What ``python -m linattn.bench`` runs without ``--methods``: all but ``compiled_baseline``,
whose compilation takes tens of seconds per sequence length."""
LINEAR_METHODS = ("cumsum", "baseline_chunk", "compiled_baseline", "chunk", "chunk_torch", "chunk_cpu", "fused")
"""The methods credited with the chunkwise form's useful-work FLOP count (see ``forward_flops``)."""
DEFAULT_CHUNK_SIZE = 64


def _elu_features(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """elu+1 features of q and k, and v, in the accumulation dtype (float32 for half inputs)."""
    acc = _checks.accumulation_dtype(q.dtype)
    return elu_plus_one(q.to(acc)), elu_plus_one(k.to(acc)), v.to(acc)   # (B, H, T, M), (B, H, T, Dv)


def cumsum_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Causal linear attention by prefix sums of outer products: a memory-hungry baseline.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype and device.
    eps : float
        Positive lower bound on the normaliser.

    Returns
    -------
    Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q``; computed in float32 for half and bfloat16
        inputs (float64 for float64), as :func:`linattn.linear_attention` does.

    Raises
    ------
    TypeError, ValueError
        Bad inputs, as for :func:`linattn.linear_attention` with ``causal=True``.
    """
    _checks.check_qkv(q, k, v, causal=True, causal_only="cumsum_linear_attention")
    _checks.check_eps(eps)
    phi_q, phi_k, v = _elu_features(q, k, v)
    S = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)      # (B, H, T, M, Dv)
    z = torch.cumsum(phi_k, dim=2)                                      # (B, H, T, M)
    num = (phi_q.unsqueeze(-2) @ S).squeeze(-2)                         # (B, H, T, Dv)
    den = (phi_q * z).sum(-1, keepdim=True)                             # (B, H, T, 1)
    return (num / den.clamp_min(eps)).to(q.dtype)


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Sum of the entries before each index along ``dim`` (zero at index 0), without cancellation."""
    head = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([head, torch.cumsum(x.narrow(dim, 0, x.shape[dim] - 1), dim)], dim)


def baseline_chunk_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                    eps: float = 1e-6) -> Tensor:
    """A straightforward PyTorch chunkwise form: the baseline the fast paths are measured against.

    The chunkwise-parallel algorithm (Hua et al., 2022, sec. 3.3; Yang et al., 2024,
    sec. 2.2) written with batched tensor operations and no loop, as one would first write
    it: pad ``T`` to a multiple of ``C = chunk_size`` (zero rows: a zero φ(k) adds nothing,
    padded queries are cut off), view the sequence as ``N`` chunks, and per chunk ``c``::

        A_c = tril(φ(Q_c) φ(K_c)ᵀ)                              intra-chunk scores (C×C)
        S_c = φ(K_c)ᵀ V_c,   z_c = φ(K_c)ᵀ 1                     per-chunk states
        S_<c = Σ_{c'<c} S_c',  z_<c = Σ_{c'<c} z_c'              exclusive cumulative sums
        Y_c = (φ(Q_c) S_<c + A_c V_c) / max(φ(Q_c) z_<c + A_c 1, eps)

    Parameters
    ----------
    q, k, v, eps
        As in :func:`cumsum_linear_attention`, which also gives the result and the errors.
    chunk_size : int
        Tokens per chunk ``C >= 1``.
    """
    _checks.check_qkv(q, k, v, causal=True, causal_only="baseline_chunk_linear_attention")
    _checks.check_chunk_size(chunk_size)
    _checks.check_eps(eps)
    phi_q, phi_k, v = _elu_features(q, k, v)
    B, H, T, M = phi_k.shape
    Dv, C = v.shape[-1], chunk_size
    pad = -T % C
    if pad:
        phi_q, phi_k, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v))
    N = (T + pad) // C
    q_c = phi_q.reshape(B, H, N, C, M)                                  # (B, H, N, C, M)
    k_c = phi_k.reshape(B, H, N, C, M)                                  # (B, H, N, C, M)
    v_c = v.reshape(B, H, N, C, Dv)                                     # (B, H, N, C, Dv)
    scores = (q_c @ k_c.transpose(-1, -2)).tril()                       # (B, H, N, C, C)
    S = _exclusive_cumsum(k_c.transpose(-1, -2) @ v_c, dim=2)           # (B, H, N, M, Dv) before chunk c
    z = _exclusive_cumsum(k_c.sum(-2), dim=2)                           # (B, H, N, M)
    num = q_c @ S + scores @ v_c                                        # (B, H, N, C, Dv)
    den = q_c @ z.unsqueeze(-1) + scores.sum(-1, keepdim=True)          # (B, H, N, C, 1)
    out = (num / den.clamp_min(eps)).reshape(B, H, N * C, Dv)           # (B, H, N·C, Dv)
    return out[:, :, :T].to(q.dtype)


def _fused_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int, eps: float = 1e-6) -> Tensor:
    """elu+1 features, then :func:`linattn.kernels.chunk_linear_attention_triton` with a ones column."""
    from ..kernels import chunk_linear_attention_triton

    phi_q, phi_k, v = _elu_features(q, k, v)
    v_aug = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)        # (B, H, T, Dv + 1)
    if q.dtype in (torch.float16, torch.bfloat16):                      # half in, float32 sums out
        out_aug, _ = chunk_linear_attention_triton(phi_q.to(q.dtype), phi_k.to(q.dtype), v_aug.to(q.dtype), None,
                                                   chunk_size, out_dtype=torch.float32)
    else:
        out_aug, _ = chunk_linear_attention_triton(phi_q, phi_k, v_aug, None, chunk_size)
    return (out_aug[..., :-1] / out_aug[..., -1:].clamp_min(eps)).to(q.dtype)



_COMPILED: dict = {}


def compiled_baseline_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                       eps: float = 1e-6) -> Tensor:
    """``torch.compile`` (inductor) of :func:`baseline_chunk_linear_attention`, compiled once per process."""
    fn = _COMPILED.get("fn")
    if fn is None:
        fn = _COMPILED["fn"] = torch.compile(baseline_chunk_linear_attention, dynamic=False)
    return fn(q, k, v, chunk_size=chunk_size, eps=eps)


_PINNED = {"chunk_torch": (("torch",), False), "chunk_cpu": (("cpu", "torch"), True)}
"""The order and calibration each pinned method runs linattn's chunk method under (:func:`_pinned_chunk`)."""


def _pinned_chunk(q: Tensor, k: Tensor, v: Tensor, *, method: str, chunk_size: int, eps: float = 1e-6) -> Tensor:
    """linattn's chunk method under ``use_backends``: ``chunk_torch`` pins the PyTorch chunk form; ``chunk_cpu``
    runs the compiled CPU kernel (elu+1 inside it) where its calibration found it faster, else that form, as the
    default (``LINATTN_CPU_KERNEL=1``) does (:func:`linattn.backends.last_backend` says which ran)."""
    order, calibrated = _PINNED[method]
    with use_backends(*order, calibrated=calibrated):
        return linear_attention(q, k, v, causal=True, method="chunk", chunk_size=chunk_size, eps=eps)


def method_fn(method: str, chunk_size: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The function ``(q, k, v) -> out`` that a method name stands for (see the module docstring)."""
    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method in ("quadratic", "chunk"):
        return lambda q, k, v: linear_attention(q, k, v, causal=True, method=method, chunk_size=chunk_size)
    if method == "cumsum":
        return cumsum_linear_attention
    if method == "baseline_chunk":
        return lambda q, k, v: baseline_chunk_linear_attention(q, k, v, chunk_size=chunk_size)
    if method == "compiled_baseline":
        return lambda q, k, v: compiled_baseline_linear_attention(q, k, v, chunk_size=chunk_size)
    if method in _PINNED:
        return lambda q, k, v: _pinned_chunk(q, k, v, method=method, chunk_size=chunk_size)
    if method == "fused":
        return lambda q, k, v: _fused_linear_attention(q, k, v, chunk_size=chunk_size)
    raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def unavailable(method: str, device: torch.device, chunk_size: int, dtype: torch.dtype = torch.float32) -> Optional[str]:
    """Why ``method`` cannot run here, or None when it can."""
    if method == "chunk_cpu":
        if device.type != "cpu":
            return "the compiled CPU kernel runs on the CPU only"
        from ..kernels import cpu

        if not cpu.cpu_kernel_available():
            return f"the compiled CPU kernel is not available ({cpu.build_info().get('error')})"
        return None
    if method != "fused":
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernel runs on CUDA only"
    try:
        from .. import kernels
    except ImportError as err:
        return f"linattn.kernels does not import ({err})"
    available = getattr(kernels, "triton_available", None)
    if not callable(available) or not available():
        return "Triton is not available"
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"the Triton kernel needs a power-of-two chunk size >= 16, got {chunk_size}"
    return None
