"""Chunkwise causal linear attention as fused Triton kernels (forward and backward)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._checks import check_tensor, shape_str

__all__ = ["chunk_linear_attention_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _state_scan_kernel(a_ptr, b_ptr, init_ptr, states_ptr, final_ptr, T, M, DV, NT,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                       REVERSE: tl.constexpr, PREC: tl.constexpr):
    """S ← S + A_cᵀ B_c over the chunks; states[c] = S before chunk c is added."""
    i_bh = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)            # (BK,) rows of the state
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)            # (BV,) columns of the state
    offs_c = tl.arange(0, C)                                     # (C,) rows of a chunk
    mask_k, mask_v = offs_k < M, offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]                # (BK, BV) offsets in (M, DV)
    mask_tile = mask_k[:, None] & mask_v[None, :]
    S = tl.full((BK, BV), 0.0, dtype=tl.float32)
    if HAS_INIT:
        S += tl.load(init_ptr + i_bh * M * DV + tile, mask=mask_tile, other=0.0).to(tl.float32)
    for i in range(NT):
        if REVERSE:
            c = NT - 1 - i
        else:
            c = i
        tl.store(states_ptr + (i_bh * NT + c) * M * DV + tile, S, mask=mask_tile)
        row0 = i_bh * T + c * C                                  # first token of the chunk
        mask_t = c * C + offs_c < T                              # (C,) ragged last chunk
        a = tl.load(a_ptr + row0 * M + offs_c[:, None] * M + offs_k[None, :],
                    mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)   # (C, BK)
        b = tl.load(b_ptr + row0 * DV + offs_c[:, None] * DV + offs_v[None, :],
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # (C, BV)
        S += tl.dot(tl.trans(a), b, input_precision=PREC)        # (BK, BV)
    if STORE_FINAL:
        tl.store(final_ptr + i_bh * M * DV + tile, S, mask=mask_tile)


@triton.jit
def _output_kernel(q_ptr, k_ptr, v_ptr, states_ptr, out_ptr, T, M, DV, NT,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """O_c = Q_c S_{c-1} + tril(Q_c K_cᵀ) V_c for one chunk c and one tile of Dv."""
    i_bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)            # (BV,)
    offs_c = tl.arange(0, C)                                     # (C,)
    mask_v, mask_t = offs_v < DV, c * C + offs_c < T
    row0 = i_bh * T + c * C
    state0 = (i_bh * NT + c) * M * DV
    acc = tl.full((C, BV), 0.0, dtype=tl.float32)                 # Q_c S_{c-1}, then + intra-chunk
    scores = tl.full((C, C), 0.0, dtype=tl.float32)               # Q_c K_cᵀ
    for k0 in range(0, M, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < M
        mask_ck = mask_t[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + row0 * M + offs_c[:, None] * M + offs_k[None, :],
                    mask=mask_ck, other=0.0).to(tl.float32)                             # (C, BK)
        k = tl.load(k_ptr + row0 * M + offs_c[:, None] * M + offs_k[None, :],
                    mask=mask_ck, other=0.0).to(tl.float32)                             # (C, BK)
        s = tl.load(states_ptr + state0 + offs_k[:, None] * DV + offs_v[None, :],
                    mask=mask_k[:, None] & mask_v[None, :], other=0.0)                  # (BK, BV)
        acc += tl.dot(q, s, input_precision=PREC)
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
    scores = tl.where(offs_c[:, None] >= offs_c[None, :], scores, 0.0)                 # causal
    mask_cv = mask_t[:, None] & mask_v[None, :]
    v = tl.load(v_ptr + row0 * DV + offs_c[:, None] * DV + offs_v[None, :],
                mask=mask_cv, other=0.0).to(tl.float32)                                 # (C, BV)
    acc += tl.dot(scores, v, input_precision=PREC)
    tl.store(out_ptr + row0 * DV + offs_c[:, None] * DV + offs_v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_cv)


@triton.jit
def _dqk_kernel(q_ptr, k_ptr, v_ptr, do_ptr, states_ptr, grads_ptr, dq_ptr, dk_ptr, T, M, DV, NT,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dQ_c = tril(dO_c V_cᵀ) K_c + dO_c S_{c-1}ᵀ and dK_c = tril(dO_c V_cᵀ)ᵀ Q_c + V_c G_cᵀ,
    for one chunk c and one tile of M."""
    i_bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_k = tl.program_id(2) * BK + tl.arange(0, BK)            # (BK,)
    offs_c = tl.arange(0, C)                                     # (C,)
    mask_k, mask_t = offs_k < M, c * C + offs_c < T
    row0 = i_bh * T + c * C
    state0 = (i_bh * NT + c) * M * DV
    dq = tl.full((C, BK), 0.0, dtype=tl.float32)
    dk = tl.full((C, BK), 0.0, dtype=tl.float32)
    dscores = tl.full((C, C), 0.0, dtype=tl.float32)              # dO_c V_cᵀ
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < DV
        mask_cv = mask_t[:, None] & mask_v[None, :]
        mask_kv = mask_k[:, None] & mask_v[None, :]
        do = tl.load(do_ptr + row0 * DV + offs_c[:, None] * DV + offs_v[None, :],
                     mask=mask_cv, other=0.0).to(tl.float32)                           # (C, BV)
        v = tl.load(v_ptr + row0 * DV + offs_c[:, None] * DV + offs_v[None, :],
                    mask=mask_cv, other=0.0).to(tl.float32)                            # (C, BV)
        tile = state0 + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(states_ptr + tile, mask=mask_kv, other=0.0)                        # (BK, BV) S_{c-1}
        g = tl.load(grads_ptr + tile, mask=mask_kv, other=0.0)                         # (BK, BV) G_c
        dscores += tl.dot(do, tl.trans(v), input_precision=PREC)
        dq += tl.dot(do, tl.trans(s), input_precision=PREC)
        dk += tl.dot(v, tl.trans(g), input_precision=PREC)
    dscores = tl.where(offs_c[:, None] >= offs_c[None, :], dscores, 0.0)
    mask_ck = mask_t[:, None] & mask_k[None, :]
    offs_ck = row0 * M + offs_c[:, None] * M + offs_k[None, :]
    q = tl.load(q_ptr + offs_ck, mask=mask_ck, other=0.0).to(tl.float32)               # (C, BK)
    k = tl.load(k_ptr + offs_ck, mask=mask_ck, other=0.0).to(tl.float32)               # (C, BK)
    dq += tl.dot(dscores, k, input_precision=PREC)
    dk += tl.dot(tl.trans(dscores), q, input_precision=PREC)
    tl.store(dq_ptr + offs_ck, dq.to(dq_ptr.dtype.element_ty), mask=mask_ck)
    tl.store(dk_ptr + offs_ck, dk.to(dk_ptr.dtype.element_ty), mask=mask_ck)


@triton.jit
def _dv_kernel(q_ptr, k_ptr, do_ptr, grads_ptr, dv_ptr, T, M, DV, NT,
               C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dV_c = tril(Q_c K_cᵀ)ᵀ dO_c + K_c G_c for one chunk c and one tile of Dv."""
    i_bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)            # (BV,)
    offs_c = tl.arange(0, C)                                     # (C,)
    mask_v, mask_t = offs_v < DV, c * C + offs_c < T
    row0 = i_bh * T + c * C
    state0 = (i_bh * NT + c) * M * DV
    dv = tl.full((C, BV), 0.0, dtype=tl.float32)
    scores = tl.full((C, C), 0.0, dtype=tl.float32)               # Q_c K_cᵀ
    for k0 in range(0, M, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < M
        mask_ck = mask_t[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + row0 * M + offs_c[:, None] * M + offs_k[None, :],
                    mask=mask_ck, other=0.0).to(tl.float32)                             # (C, BK)
        k = tl.load(k_ptr + row0 * M + offs_c[:, None] * M + offs_k[None, :],
                    mask=mask_ck, other=0.0).to(tl.float32)                             # (C, BK)
        g = tl.load(grads_ptr + state0 + offs_k[:, None] * DV + offs_v[None, :],
                    mask=mask_k[:, None] & mask_v[None, :], other=0.0)                  # (BK, BV) G_c
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
        dv += tl.dot(k, g, input_precision=PREC)
    scores = tl.where(offs_c[:, None] >= offs_c[None, :], scores, 0.0)
    mask_cv = mask_t[:, None] & mask_v[None, :]
    offs_cv = row0 * DV + offs_c[:, None] * DV + offs_v[None, :]
    do = tl.load(do_ptr + offs_cv, mask=mask_cv, other=0.0).to(tl.float32)              # (C, BV)
    dv += tl.dot(tl.trans(scores), do, input_precision=PREC)
    tl.store(dv_ptr + offs_cv, dv.to(dv_ptr.dtype.element_ty), mask=mask_cv)


_INTERPRETED = type(_state_scan_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import


class _Config:
    """Sizes shared by the launches of one call: ``B·H``, ``T``, ``M``, ``Dv``, chunks, tiles."""

    def __init__(self, phi_k: Tensor, v: Tensor, chunk_size: int):
        B, H, self.T, self.M = phi_k.shape
        self.BH, self.DV, self.C = B * H, v.shape[-1], chunk_size
        self.NT = triton.cdiv(self.T, chunk_size)
        self.BK = _tile(self.M)
        self.BV = _tile(self.DV)
        self.NK, self.NV = triton.cdiv(self.M, self.BK), triton.cdiv(self.DV, self.BV)
        self.prec = _dot_precision(v.dtype)

    def sizes(self) -> dict:
        return dict(T=self.T, M=self.M, DV=self.DV, NT=self.NT, C=self.C, BK=self.BK, BV=self.BV,
                    PREC=self.prec)

    def new_states(self, like: Tensor) -> Tensor:
        return like.new_empty(self.BH, self.NT, self.M, self.DV, dtype=torch.float32)


def _dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for float32 operands, following PyTorch's matmul setting."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _tile(n: int) -> int:
    """Power-of-two tile covering ``n`` (16 ≤ tile ≤ 64: tl.dot needs ≥ 16, registers cap it)."""
    return max(16, min(64, triton.next_power_of_2(n)))


def _scan(cfg: _Config, a: Tensor, b: Tensor, init: Optional[Tensor], final: Optional[Tensor],
          *, reverse: bool) -> Tensor:
    """Per-chunk states of ``S ← S + A_cᵀ B_c`` (``(B·H, N, M, Dv)`` float32); fills ``final``."""
    states = cfg.new_states(a)
    _state_scan_kernel[(cfg.BH, cfg.NK, cfg.NV)](
        a, b, init if init is not None else states, states, final if final is not None else states,
        cfg.T, cfg.M, cfg.DV, cfg.NT, C=cfg.C, BK=cfg.BK, BV=cfg.BV,
        HAS_INIT=init is not None, STORE_FINAL=final is not None, REVERSE=reverse, PREC=cfg.prec,
    )
    return states


def _on(device: torch.device):
    """Launch on the tensors' GPU (Triton launches on the current one), not e.g. cuda:0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor],
             chunk_size: int, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    cfg = _Config(phi_k, v, chunk_size)
    B, H = v.shape[:2]
    S = v.new_empty(B, H, cfg.M, cfg.DV, dtype=torch.float32)              # (B, H, M, Dv)
    states = _scan(cfg, phi_k, v, S0, S, reverse=False)                    # (B·H, N, M, Dv)
    out = torch.empty_like(v, dtype=out_dtype or v.dtype)                  # (B, H, T, Dv)
    _output_kernel[(cfg.BH, cfg.NT, cfg.NV)](phi_q, phi_k, v, states, out, **cfg.sizes())
    return out, S


class _ChunkLinearAttention(torch.autograd.Function):
    """Autograd wrapper: Triton kernels forward and backward (inputs already contiguous)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, chunk_size, out_dtype=None):
        ctx.set_materialize_grads(False)
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(phi_q, phi_k, v, S0)
        with _on(v.device):
            return _forward(phi_q, phi_k, v, S0, chunk_size, out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_S):
        phi_q, phi_k, v, S0 = ctx.saved_tensors
        with _on(v.device):
            return _backward(ctx, phi_q, phi_k, v, S0, d_out, d_S)


def _backward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor],
              d_out: Optional[Tensor], d_S: Optional[Tensor]) -> tuple:
    """Gradients for the inputs that need them: the reverse scan, then dQ, dK and dV by chunk."""
    need_q, need_k, need_v, need_S0 = ctx.needs_input_grad[:4]
    cfg = _Config(phi_k, v, ctx.chunk_size)
    # The upstream gradient keeps its dtype (a float32 one for a float32 output): the kernels
    # read every operand as float32.
    d_out = torch.zeros_like(v) if d_out is None else d_out.contiguous()
    d_S = None if d_S is None else d_S.float().contiguous()
    dS0 = torch.empty_like(S0, dtype=torch.float32) if need_S0 else None
    grads = _scan(cfg, phi_q, d_out, d_S, dS0, reverse=True)          # G_c, (B·H, N, M, Dv)
    dq = dk = dv = None
    if need_q or need_k:
        states = _scan(cfg, phi_k, v, S0, None, reverse=False)         # S_{c-1}, recomputed
        dq, dk = torch.empty_like(phi_q), torch.empty_like(phi_k)
        _dqk_kernel[(cfg.BH, cfg.NT, cfg.NK)](phi_q, phi_k, v, d_out, states, grads, dq, dk,
                                              **cfg.sizes())
    if need_v:
        dv = torch.empty_like(v)
        _dv_kernel[(cfg.BH, cfg.NT, cfg.NV)](phi_q, phi_k, d_out, grads, dv, **cfg.sizes())
    return (dq if need_q else None, dk if need_k else None, dv,
            dS0.to(S0.dtype) if need_S0 else None, None, None)


def chunk_linear_attention_triton(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor],
                                  chunk_size: int, *, out_dtype: Optional[torch.dtype] = None
                                  ) -> tuple[Tensor, Tensor]:
    """Causal linear attention on features, chunk by chunk, as fused Triton kernels.

    Parameters
    ----------
    phi_q, phi_k : Tensor
        ``(B, H, T, M)`` features of the queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values (any ``Dv``; ``linear_attention`` appends a ones column).
        ``phi_q``, ``phi_k`` and ``v`` share one dtype: float32, float16 or bfloat16.
    S0 : Tensor or None
        ``(B, H, M, Dv)`` state before the first token (any floating dtype, read as
        float32); None means zeros.
    chunk_size : int
        Tokens per chunk ``C``, a power of two ``>= 16``; ``T`` need not be a multiple of it.
    out_dtype : torch.dtype, optional
        The dtype of ``out``: the inputs' (the default) or ``torch.float32``. Half inputs with
        a float32 output keep the accumulated sums unrounded: ``linear_attention`` asks for it,
        since the normaliser column passes float16's largest value (65504) after about a
        thousand tokens. The backward pass takes the upstream gradient in that dtype.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in ``out_dtype``: ``Σ_{j<=i} φ(q_i)ᵀφ(k_j) v_j + φ(q_i)ᵀS0``,
        accumulated in float32.
    S : Tensor
        ``(B, H, M, Dv)`` float32, the state after the last token.

    Raises
    ------
    TypeError
        Non-tensor or non-floating inputs; ``phi_q``, ``phi_k``, ``v`` not sharing one of
        float32/float16/bfloat16; a non-int ``chunk_size``.
    ValueError
        Wrong ranks or shapes; empty dimensions; tensors on different devices, or not on
        CUDA (unless ``TRITON_INTERPRET=1`` was set when this module was imported); a
        ``chunk_size`` that is not a power of two ``>= 16``.
    """
    _check_inputs(phi_q, phi_k, v, S0, chunk_size)
    phi_q, phi_k, v = phi_q.contiguous(), phi_k.contiguous(), v.contiguous()
    S0 = S0.contiguous() if S0 is not None else None
    if out_dtype not in (None, torch.float32, phi_q.dtype):
        raise TypeError(f"out_dtype must be None, torch.float32 or the inputs' dtype, got {out_dtype}")
    return _ChunkLinearAttention.apply(phi_q, phi_k, v, S0, chunk_size, out_dtype)


def _check_inputs(phi_q, phi_k, v, S0, chunk_size) -> None:
    layout = "(batch, heads, seq, dim)"
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_tensor(x, name, 4, layout)
    if phi_q.shape != phi_k.shape:
        raise ValueError(f"phi_q and phi_k must have the same shape (B, H, T, M), got "
                         f"phi_q {shape_str(phi_q.shape)} and phi_k {shape_str(phi_k.shape)}")
    if v.shape[:3] != phi_k.shape[:3]:
        raise ValueError(f"v must be (B, H, T, Dv) with B, H, T of phi_k {shape_str(phi_k.shape)}, "
                         f"got v {shape_str(v.shape)}")
    if phi_q.dtype not in _DTYPES or phi_k.dtype != phi_q.dtype or v.dtype != phi_q.dtype:
        raise TypeError("phi_q, phi_k and v must share one dtype out of float32, float16, bfloat16; "
                        f"got {phi_q.dtype}, {phi_k.dtype}, {v.dtype}")
    B, H, _, M = phi_k.shape
    if S0 is not None:
        check_tensor(S0, "S0", 4, "(batch, heads, M, Dv)")
        expected = (B, H, M, v.shape[-1])
        if tuple(S0.shape) != expected:
            raise ValueError(f"S0 must have shape (B, H, M, Dv) = {shape_str(expected)}, "
                             f"got {shape_str(S0.shape)}")
    for name, x in (("phi_k", phi_k), ("v", v), ("S0", S0)):
        if x is not None and x.device != phi_q.device:
            raise ValueError(f"{name} is on {x.device} but phi_q is on {phi_q.device}; "
                             "all inputs must be on one device")
    if phi_q.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"the Triton kernels need CUDA tensors, got tensors on {phi_q.device} "
                         "(set TRITON_INTERPRET=1 before importing this module to run them on CPU)")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for the Triton kernel, got {chunk_size}")
