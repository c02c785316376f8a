"""An optional compiled CPU path for causal linear attention (forward and backward)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._autograd import NO_SECOND_DERIVATIVE
from ..._checks import check_bool, check_eps, check_tensor, shape_str
from ..._numerics import no_autocast
from .runtime import _DTYPES, _check_status, _lanes, _library, _pad_to_vector, _ptr, build_info

__all__ = ["causal_linear_attention_cpu"]


def _pass(a: Tensor, b: Tensor, c: Tensor, X: Tensor, chunk_size: int, *, reverse: bool,
          z: Optional[Tensor] = None, den: Optional[Tensor] = None, ok: Optional[Tensor] = None,
          eps: float = 1.0, extra: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> Tensor:
    """One pass over (B, H, T, ·) tensors: ``out_t = a_tᵀ X_t``; ``X`` (B, H, Da, Dc) is updated in place."""
    B, H, T, Da = a.shape
    Dc = c.shape[-1]
    chunk_size = max(1, min(chunk_size, T))     # a block longer than T holds T tokens (C near 2⁶³ overflowed)
    out = torch.empty(B, H, T, Dc, dtype=a.dtype)
    ea, eb, Xe = extra if extra is not None else (None, None, None)
    fn = getattr(_library(), f"linattn_causal_pass_{_DTYPES[a.dtype]}")
    status = fn(_ptr(a), _ptr(b), _ptr(c), _ptr(out), _ptr(X), _ptr(z), _ptr(den), _ptr(ok), eps, _ptr(ea),
                _ptr(eb), _ptr(Xe), B * H, T, Da, Dc, chunk_size, int(reverse), torch.get_num_threads())
    _check_status(status)
    return out


def _elu_plus_one(x: Tensor) -> Tensor:
    """:func:`linattn.elu_plus_one` of a contiguous ``x``, the same arithmetic: ``exp(min(x, 0))`` by PyTorch,
    then ``+ max(x, 0)`` in place by the library (one pass and one temporary fewer)."""
    phi = x.clamp(max=0.0).exp_()
    _check_status(getattr(_library(), f"linattn_add_relu_{_DTYPES[x.dtype]}")(
        _ptr(phi), _ptr(x), x.numel(), torch.get_num_threads()))
    return phi


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor], z0: Optional[Tensor], normalize: bool,
             eps: float, chunk_size: int):
    """The forward pass: output, final state, and the normaliser used (with where it was used as computed)."""
    B, H, T, M = phi_q.shape
    Dv = v.shape[-1]
    vp = _pad_to_vector(v)
    X = (torch.zeros(B, H, M, vp.shape[-1], dtype=v.dtype) if S0 is None
         else _pad_to_vector(S0.to(v.dtype)).clone())
    z = torch.zeros(B, H, M, dtype=v.dtype) if z0 is None else z0.to(v.dtype).clone()
    den = torch.empty(B, H, T, dtype=v.dtype) if normalize else None
    ok = torch.empty(B, H, T, dtype=torch.uint8) if normalize else None
    out = _pass(phi_q, phi_k, vp, X, chunk_size, reverse=False, z=z, den=den, ok=ok, eps=eps)
    y = out if vp.shape[-1] == Dv else out[..., :Dv].contiguous()
    S = X if vp.shape[-1] == Dv else X[..., :Dv].contiguous()
    return y, S, z, den, ok


def _backward(g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs):
    """Gradients of φ(q), φ(k), v, S0, z0 (None where not needed): three passes of the kernel."""
    normalize, C, has_S0, has_z0 = config
    B, H, T, M = phi_q.shape
    Dv = v.shape[-1]
    need_q, need_k, need_v, need_S0, need_z0 = needs
    dtype = v.dtype
    g = torch.zeros_like(y) if g_out is None else g_out.to(dtype).contiguous()
    g_den = None
    if normalize:             # g_den = -(g·y)/den where the normaliser was used as computed, else 0; g /= den
        g_den = torch.empty(B, H, T, dtype=dtype)
        g_scaled = torch.empty_like(g)
        status = getattr(_library(), f"linattn_normaliser_grad_{_DTYPES[dtype]}")(
            _ptr(g), _ptr(y), _ptr(den), _ptr(ok), _ptr(g_scaled), _ptr(g_den), B * H * T, Dv,
            torch.get_num_threads())
        _check_status(status)
        g = g_scaled                                                            # (B, H, T, Dv)
    with_row = normalize or g_z is not None          # z enters the gradients of φ(k) and of z0
    ones = torch.ones(B, H, T, dtype=dtype) if with_row else None
    Mp = M + (-M % _lanes(v))
    dq = dk = dv = dS0 = dz0 = None
    if need_q:
        X = torch.zeros(B, H, Dv, Mp, dtype=dtype)
        if S0 is not None:
            X[..., :M] = S0.transpose(-1, -2)
        extra = None
        if normalize:
            Xe = torch.zeros(B, H, Mp, dtype=dtype)
            if z0 is not None:
                Xe[..., :M] = z0
            extra = (g_den, ones, Xe)
        dq = _pass(g, v, _pad_to_vector(phi_k), X, C, reverse=False, extra=extra)[..., :M]
    if need_k or (has_z0 and need_z0):
        X = torch.zeros(B, H, Dv, Mp, dtype=dtype)
        if g_S is not None:
            X[..., :M] = g_S.transpose(-1, -2)
        extra = None
        if with_row:
            Xe = torch.zeros(B, H, Mp, dtype=dtype)
            if g_z is not None:
                Xe[..., :M] = g_z
            extra = (ones, g_den if g_den is not None else torch.zeros_like(ones), Xe)
        dk = _pass(v, g, _pad_to_vector(phi_q), X, C, reverse=True, extra=extra)[..., :M]
        if with_row:
            dz0 = extra[2][..., :M]
    if need_v or (has_S0 and need_S0):
        gp = _pad_to_vector(g)
        X = (torch.zeros(B, H, M, gp.shape[-1], dtype=dtype) if g_S is None
             else _pad_to_vector(g_S.to(dtype)).clone())
        dv = _pass(phi_k, phi_q, gp, X, C, reverse=True)[..., :Dv]
        dS0 = X[..., :Dv]

    def own(t: Optional[Tensor], wanted: bool) -> Optional[Tensor]:
        return t.contiguous() if wanted and t is not None else None

    if has_z0 and need_z0 and dz0 is None:
        dz0 = torch.zeros_like(z0)
    return (own(dq, need_q), own(dk, need_k), own(dv, need_v),
            None if dS0 is None or not (has_S0 and need_S0) else dS0.to(S0.dtype).contiguous(),
            None if dz0 is None or not (has_z0 and need_z0) else dz0.to(z0.dtype).contiguous())


def _forward_and_save(ctx, phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size):
    y, S, z, den, ok = _forward(phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)
    ctx.config = (normalize, chunk_size, S0 is not None, z0 is not None)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(phi_q, phi_k, v, y, den, ok, S0, z0)
    return y, S, z


def _saved_backward(ctx, g_out, g_S, g_z, through_elu: bool):
    grads = _CpuCausalLinearAttentionBackward.apply(g_out, g_S, g_z, *ctx.saved_tensors, ctx.config,
                                                    tuple(ctx.needs_input_grad[:5]), through_elu)
    return (*grads, None, None, None)


class _CpuCausalLinearAttention(torch.autograd.Function):
    """Forward: one pass and the normaliser; backward: three passes (see the module docstring)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, normalize: bool, eps: float, chunk_size: int):
        return _forward_and_save(ctx, phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        return _saved_backward(ctx, g_out, g_S, g_z, False)


class _CpuEluCausalLinearAttention(torch.autograd.Function):
    """As :class:`_CpuCausalLinearAttention`, with φ = elu+1 applied inside: ``q``, ``k`` are raw."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, normalize: bool, eps: float, chunk_size: int):
        with torch.no_grad():
            phi_q, phi_k = _elu_plus_one(q), _elu_plus_one(k)
        return _forward_and_save(ctx, phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        return _saved_backward(ctx, g_out, g_S, g_z, True)


class _CpuCausalLinearAttentionBackward(torch.autograd.Function):
    """The three backward passes, as a Function whose own backward refuses second derivatives."""

    @staticmethod
    def forward(ctx, g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs, through_elu):
        dq, dk, dv, dS0, dz0 = _backward(g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs)
        if through_elu:                        # dL/dx = dL/dφ · min(φ, 1), in place
            lib = _library()
            for d, phi in ((dq, phi_q), (dk, phi_k)):
                if d is not None:
                    getattr(lib, f"linattn_elu_grad_{_DTYPES[d.dtype]}")(d.data_ptr(), phi.data_ptr(), d.numel())
        return dq, dk, dv, dS0, dz0

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NO_SECOND_DERIVATIVE)


def causal_linear_attention_cpu(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor] = None,
                                z0: Optional[Tensor] = None, *, normalize: bool = True, eps: float = 1e-6,
                                chunk_size: int = 64, feature_map: Optional[str] = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention on features with the compiled CPU kernel (forward and backward).

    Parameters
    ----------
    phi_q, phi_k : Tensor
        ``(B, H, T, M)`` features, float32 or float64, on the CPU; with ``feature_map="elu+1"``
        the raw queries and keys, to which :func:`linattn.elu_plus_one` is applied inside.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype.
    S0, z0 : Tensor, optional
        ``(B, H, M, Dv)`` and ``(B, H, M)``: the state before the first token (zeros if None).
    normalize : bool
        Divide by the normaliser ``φ(q_i)ᵀz_i`` (replaced by ``eps`` where it is zero, negative
        or not finite, as :func:`linattn._numerics.guarded_normaliser` does).
    eps : float
        What a zero, negative or non-finite normaliser is replaced by.
    chunk_size : int
        Tokens per block of the two-level sums (``>= 1``).
    feature_map : None or "elu+1"
        None: ``phi_q``, ``phi_k`` are features. ``"elu+1"``: apply elu+1 inside, saving only
        the features for the backward pass (whose chain rule through φ is then one pass).

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)``.
    S, z : Tensor
        ``(B, H, M, Dv)`` and ``(B, H, M)``, the state after the last token (tensors of their own).

    Raises
    ------
    RuntimeError
        If the kernel is not available here (:func:`cpu_kernel_available`; :func:`build_info` says why).
    TypeError, ValueError
        Inputs that are not CPU float32/float64 tensors of matching shapes (``S0``, ``z0``:
        floating-point CPU tensors of the shapes above); ``normalize`` not a bool; ``eps`` not a
        positive number representable in the inputs' dtype; ``chunk_size`` not an int ``>= 1``.
    """
    layout = "(batch, heads, seq, dim)"
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_tensor(x, name, 4, layout)
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {x.device}")
    if phi_q.dtype not in _DTYPES or phi_k.dtype != phi_q.dtype or v.dtype != phi_q.dtype:
        raise TypeError(f"phi_q, phi_k and v must share one dtype out of float32, float64; got {phi_q.dtype}, "
                        f"{phi_k.dtype}, {v.dtype}")
    if phi_q.shape != phi_k.shape or v.shape[:3] != phi_k.shape[:3]:
        raise ValueError(f"expected phi_q, phi_k (B, H, T, M) and v (B, H, T, Dv), got {shape_str(phi_q.shape)}, "
                         f"{shape_str(phi_k.shape)} and {shape_str(v.shape)}")
    B, H, _, M = phi_k.shape
    for name, x, shape in (("S0", S0, (B, H, M, v.shape[-1])), ("z0", z0, (B, H, M))):
        if x is None:
            continue
        check_tensor(x, name, len(shape), "(batch, heads, M, Dv)" if name == "S0" else "(batch, heads, M)")
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {x.device}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape_str(shape)}, got {shape_str(x.shape)}")
    normalize = check_bool(normalize, "normalize")
    eps = check_eps(eps, phi_q.dtype)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if feature_map not in (None, "elu+1"):
        raise ValueError(f"feature_map must be None or 'elu+1', got {feature_map!r}")
    if _library() is None:
        raise RuntimeError(f"the linattn CPU kernel is not available: {build_info().get('error')}")
    fn = _CpuCausalLinearAttention if feature_map is None else _CpuEluCausalLinearAttention
    with no_autocast(phi_q.device):
        return fn.apply(phi_q.contiguous(), phi_k.contiguous(), v.contiguous(), S0, z0, bool(normalize), float(eps),
                        chunk_size)
