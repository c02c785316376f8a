"""The compiled token loop of the decay family: the delta rule, the gated delta rule, retention and GLA."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._autograd import differentiable_backward
from ..._checks import shape_str
from .runtime import _DTYPES, _check_status, _library, _pad_to_vector, _ptr

__all__ = ["delta_rule_cpu", "decay_cpu", "token_loop_ops"]

_GATES = {None: 0, "head": 1, "channel": 2}


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return int(chunk_size)


def delta_rule_cpu(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_g: Optional[Tensor], S0: Tensor,
                   chunk_size: int) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule token by token: ``(out (B, H, T, Dv), S_final (B, H, Dk, Dv))``."""
    chunk_size = _check_chunk_size(chunk_size)
    gate = None if log_g is None else ("head" if log_g.shape[-1] == 1 else "channel")
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, log_g, S0))
    return _CpuTokenLoop.apply(q, k, v, beta, log_g, S0, chunk_size, gate, keep)


def decay_cpu(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, S0: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Retention (``α_t = γ``) and GLA (``α_t = exp(log_g_t)``) token by token: ``(out, S_final)``."""
    chunk_size = _check_chunk_size(chunk_size)
    if alpha.shape not in (k.shape[:3], k.shape):
        raise ValueError(f"alpha must have shape {shape_str(k.shape[:3])} or {shape_str(k.shape)}, "
                         f"got {shape_str(alpha.shape)}")
    gate = "head" if alpha.dim() == 3 else "channel"
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, alpha, S0))
    return _CpuTokenLoop.apply(q, k, v, None, alpha, S0, chunk_size, gate, keep)


def token_loop_ops(q, k, v, beta, alpha, S0):
    """The loop of this module op by op in PyTorch (for second derivatives): ``(out, S)``."""
    a = None if alpha is None else (alpha if alpha.dim() == 4 else alpha.unsqueeze(-1))
    S, outs = S0, []
    for t in range(k.shape[2]):
        if a is not None:
            S = a[:, :, t].unsqueeze(-1) * S                                  # diag(α_t) S_{t-1}
        k_t = k[:, :, t]                                                      # (B, H, Dk)
        u = v[:, :, t]
        if beta is not None:
            u = beta[:, :, t].unsqueeze(-1) * (u - (k_t.unsqueeze(-2) @ S).squeeze(-2))
        S = torch.addcmul(S, k_t.unsqueeze(-1), u.unsqueeze(-2))
        outs.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outs, dim=2), S


def _delta_ops(q, k, v, beta, log_g, S0):
    return token_loop_ops(q, k, v, beta, None if log_g is None else log_g.exp(), S0)


class _CpuTokenLoop(torch.autograd.Function):
    """Forward: one pass of the loop (keeping the state every ``chunk_size`` tokens); backward: one."""

    @staticmethod
    def forward(ctx, q, k, v, beta, gate_input, S0, chunk_size: int, gate: Optional[str], keep: bool):
        ctx.save_for_backward(q, k, v, beta, gate_input, S0)    # the inputs themselves (second derivatives)
        delta = beta is not None
        B, H, T, Dk = k.shape
        Dv = v.shape[-1]
        C = max(1, min(chunk_size, T))           # a block longer than T holds T tokens (the backward's buffer)
        N = -(-T // C)
        q, k = q.contiguous(), k.contiguous()
        v = _pad_to_vector(v)                    # Dv in whole vectors: zero columns, which stay zero
        Dp = v.shape[-1]
        if delta:
            beta = beta.contiguous()
            alpha = None if gate_input is None else gate_input.exp().contiguous()
        else:
            alpha = gate_input.contiguous()
        S = _pad_to_vector(S0).clone() if Dp != Dv else S0.clone(memory_format=torch.contiguous_format)
        out = v.new_empty(B, H, T, Dp)
        ck = v.new_empty(B, H, N, Dk, Dp) if keep else None     # the states the backward pass starts from
        lib, suffix, threads = _library(), _DTYPES[v.dtype], torch.get_num_threads()
        if delta:
            status = getattr(lib, f"linattn_delta_forward_{suffix}")(
                _ptr(q), _ptr(k), _ptr(v), _ptr(beta), _ptr(alpha), _ptr(S), _ptr(out), _ptr(ck), B * H, T, Dk, Dp, C,
                _GATES[gate], threads)
        else:
            status = getattr(lib, f"linattn_decay_forward_{suffix}")(
                _ptr(q), _ptr(k), _ptr(v), _ptr(alpha), _ptr(S), _ptr(out), _ptr(ck), B * H, T, Dk, Dp, C,
                _GATES[gate], threads)
        _check_status(status)
        ctx.config, ctx.kept = (C, gate, Dv), (alpha, ck)
        if Dp != Dv:
            out, S = out[..., :Dv].contiguous(), S[..., :Dv].contiguous()
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, gate_input, S0 = ctx.saved_tensors
        (C, gate, Dv), (alpha, ck) = ctx.config, ctx.kept
        delta = beta is not None
        if torch.is_grad_enabled():          # create_graph=True: autograd differentiates the loop op by op
            if delta:
                grads = differentiable_backward(_delta_ops, (q, k, v, beta, gate_input, S0), d_out, d_S)
            else:
                q_, k_, v_, alpha_, S0_ = differentiable_backward(
                    lambda q, k, v, a, S: token_loop_ops(q, k, v, None, a, S), (q, k, v, gate_input, S0), d_out, d_S)
                grads = (q_, k_, v_, None, alpha_, S0_)
            return (*grads, None, None, None)
        q, k = q.contiguous(), k.contiguous()
        v = _pad_to_vector(v)
        B, H, T, Dk = k.shape
        Dp = v.shape[-1]
        d_out = _pad_to_vector(d_out.to(v.dtype))
        dS = _pad_to_vector(d_S.to(v.dtype))                                 # in: dS_final; out: dS0
        dS = dS.clone() if dS is d_S else dS
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lib, suffix, threads = _library(), _DTYPES[v.dtype], torch.get_num_threads()
        if delta:
            beta = beta.contiguous()
            dbeta = torch.empty_like(beta)
            dgate = None if gate_input is None else torch.empty_like(alpha)
            status = getattr(lib, f"linattn_delta_backward_{suffix}")(
                _ptr(q), _ptr(k), _ptr(v), _ptr(beta), _ptr(alpha), _ptr(ck), _ptr(d_out), _ptr(dS), _ptr(dq),
                _ptr(dk), _ptr(dv), _ptr(dbeta), _ptr(dgate), B * H, T, Dk, Dp, C, _GATES[gate], threads)
        else:
            dbeta, dgate = None, torch.empty_like(alpha)
            status = getattr(lib, f"linattn_decay_backward_{suffix}")(
                _ptr(q), _ptr(k), _ptr(v), _ptr(alpha), _ptr(ck), _ptr(d_out), _ptr(dS), _ptr(dq), _ptr(dk),
                _ptr(dv), _ptr(dgate), B * H, T, Dk, Dp, C, _GATES[gate], threads)
        _check_status(status)
        if Dp != Dv:
            dv, dS = dv[..., :Dv].contiguous(), dS[..., :Dv].contiguous()
        return dq, dk, dv, dbeta, dgate, dS, None, None, None
