"""The chunk form of the delta rule and of the gated delta rule with one gate per head (private).

Both families share one chunk form, the WY / UT representation of Yang, Wang, Zhang, Shen &
Kim (2024, arXiv:2406.06484, sec. 3; with the gates of Yang, Kautz & Hatamizadeh, 2025,
arXiv:2412.06464, sec. 3), written here as an autograd Function with a hand-written backward
(chapter 5's store-versus-recompute reasoning applied to it). Per chunk of ``C`` tokens with
start state ``S`` (all chunks at once, except the scan over chunk states)::

    Pqk = tril(Q Kᵀ) ⊙ D,   Akk = tril(K Kᵀ, −1) ⊙ D,   M = I + diag(β) Akk      (unit lower)
    [W, Ũ] = M⁻¹ diag(β) [K ⊙ from_start, V]                                    (triangular solve)
    U = Ũ − W S                        (the pseudo-values: what each token writes)
    O = (Q ⊙ from_start) S + Pqk U,    S' = total · S + (K ⊙ to_end)ᵀ U

``D[t, s] = exp(Σ_{s<r<=t} log α_r)`` is the decay between two tokens of the chunk,
``from_start``, ``to_end`` and ``total`` the decays from the chunk's start, to its end and over
it; without gates (the delta rule) all are 1 and are skipped. Only the ``T/C`` matmuls of the
scan are sequential: ``W S`` and ``(K ⊙ to_end)ᵀ U`` forward, ``(K ⊙ to_end) dS'`` and ``Wᵀ dU``
backward. The decay factors enter as inputs, so autograd differentiates their (elementwise)
construction from the log-gates; everything with a matmul is differentiated here.

Saved for the backward pass (per chunk): the inputs, ``Q Kᵀ`` and ``K Kᵀ`` (``C²`` each), ``M``,
``[W, Ũ]``, ``U`` and the chunk start states (``Dk·Dv``): the matmuls of the forward pass are not
repeated. A backward pass that must itself be differentiable (``create_graph=True``) recomputes
the forward op by op from the inputs and lets autograd differentiate it; ``torch.func``
transforms, ``torch.compile`` and forward-mode AD use that op-by-op form from the start
(:func:`wy_chunk` picks).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._numerics import compiling


def _forward(q, k, v, beta, S0, D, from_start, to_end, total):
    """The chunk form's forward pass, op by op (differentiable by autograd): ``(out, S_final)``.

    ``q, k`` ``(B, H, N, C, Dk)``, ``v`` ``(…, C, Dv)``, ``beta`` ``(…, C, 1)``, ``S0`` ``(B, H, Dk, Dv)``;
    the decays ``D`` ``(…, C, C)``, ``from_start``, ``to_end`` ``(…, C, 1)``, ``total`` ``(B, H, N, 1, 1)``
    or all None (no gates).
    """
    gated = D is not None
    kt = k.transpose(-1, -2)
    QK = (q @ kt).tril()                                # tril first: an overflowing later score times 0 is NaN
    KK = (k @ kt).tril(-1)
    P, A = (QK * D, KK * D) if gated else (QK, KK)
    M = beta * A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)   # I + diag(β) A (A's diagonal is 0)
    kf = k * from_start if gated else k
    X = torch.linalg.solve_triangular(M, torch.cat([beta * kf, beta * v], dim=-1), upper=False, unitriangular=True)
    Dk = k.shape[-1]
    W, Ut = X[..., :Dk], X[..., Dk:]
    k_end = (k * to_end if gated else k).transpose(-1, -2)                   # (…, Dk, C)
    S, before, Us = S0, [], []
    totals = total.unbind(2) if gated else [None] * k.shape[2]
    for W_n, Ut_n, ke_n, tot_n in zip(W.unbind(2), Ut.unbind(2), k_end.unbind(2), totals):
        before.append(S)
        U_n = Ut_n - W_n @ S                                                  # U = Ũ − W S
        Us.append(U_n)
        S = (S if tot_n is None else tot_n * S) + ke_n @ U_n
    S_before, U = torch.stack(before, dim=2), torch.stack(Us, dim=2)        # (B, H, N, Dk, Dv), (…, C, Dv)
    out = (q * from_start if gated else q) @ S_before + P @ U
    return out, S


def _unit_lower_inverse(M: Tensor) -> Tensor:
    """``M⁻¹`` of unit lower-triangular ``M`` ``(n, C, C)``, by blocks: ``[[A, 0], [B, D]]⁻¹ =
    [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]`` down to blocks of 16, solved directly.

    On the CPU this is several times faster than ``solve_triangular`` with ``C`` right-hand
    sides, and lets the solve with both ``[K, V]`` and, backward, with ``Mᵀ`` be plain matmuls.
    """
    C = M.shape[-1]
    if C <= 16:
        eye = torch.eye(C, dtype=M.dtype, device=M.device).expand_as(M)
        return torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    h = C // 2
    top, bottom = _unit_lower_inverse(M[:, :h, :h]), _unit_lower_inverse(M[:, h:, h:])
    out = M.new_zeros(M.shape)
    out[:, :h, :h] = top
    out[:, h:, h:] = bottom
    out[:, h:, :h] = -(bottom @ (M[:, h:, :h] @ top))
    return out


class _WYChunk(torch.autograd.Function):
    """The WY chunk form with a hand-written backward (see the module docstring).

    Works on ``(B·H·N, C, ·)`` views for the batched matmuls and ``(B·H, N, ·)`` ones for the scan.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, D, from_start, to_end, total):
        B, H, N, C, Dk = k.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        gated = D is not None
        q3, k3, v3, b3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta))
        QK = torch.bmm(q3, k3.transpose(1, 2)).tril_()         # tril_ first: an overflowing later score times 0 is NaN
        KK = torch.bmm(k3, k3.transpose(1, 2)).tril_(-1)
        if gated:
            D3 = D.reshape(BHN, C, C)
            fs3, te3 = from_start.reshape(BHN, C, 1), to_end.reshape(BHN, C, 1)
            P, A, qf, kf, ke = QK * D3, KK * D3, q3 * fs3, k3 * fs3, k3 * te3
        else:
            P, A, qf, kf, ke = QK, KK, q3, k3, k3
        M = b3 * A
        M.diagonal(dim1=-2, dim2=-1).fill_(1.0)                 # I + diag(β) A (A's diagonal is 0)
        Minv = _unit_lower_inverse(M)
        W = torch.bmm(Minv, b3 * kf)                            # (BHN, C, Dk)
        Ut = torch.bmm(Minv, b3 * v3)                           # (BHN, C, Dv)
        W4, Ut4, ke4 = W.view(BH, N, C, Dk), Ut.view(BH, N, C, Dv), ke.view(BH, N, C, Dk)
        tot = total.reshape(BH, N, 1, 1) if gated else None
        U = W.new_empty(BH, N, C, Dv)
        S_before = W.new_empty(BH, N, Dk, Dv)
        S = S0.reshape(BH, Dk, Dv)
        for n in range(N):
            S_before[:, n] = S
            U_n = torch.baddbmm(Ut4[:, n], W4[:, n], S, alpha=-1.0)   # U = Ũ − W S
            U[:, n] = U_n
            S = torch.baddbmm(tot[:, n] * S if gated else S, ke4[:, n].transpose(1, 2), U_n)
        U3, Sb3 = U.view(BHN, C, Dv), S_before.view(BHN, Dk, Dv)
        out = torch.baddbmm(torch.bmm(qf, Sb3), P, U3)
        ctx.gated, ctx.shape = gated, (B, H, N, C, Dk, Dv)
        ctx.save_for_backward(q, k, v, beta, S0, D, from_start, to_end, total, QK, KK, Minv, W, Ut, U, S_before)
        return out.view(B, H, N, C, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, D, fs, te, total, QK, KK, Minv, W, Ut, U, S_before = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a second derivative): the stored intermediates are constants to
            # autograd, so differentiate the same equations op by op instead, from the inputs.
            return _differentiable_backward((q, k, v, beta, S0, D, fs, te, total), d_out, d_S)
        B, H, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta))
        gated = ctx.gated
        dO = U.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = S_before.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        if gated:
            D3 = D.reshape(BHN, C, C)
            fs3, te3 = fs.reshape(BHN, C, 1), te.reshape(BHN, C, 1)
            P, qf, ke = QK * D3, q3 * fs3, k3 * te3
            tot = total.reshape(BH, N, 1, 1)
        else:
            P, qf, ke = QK, q3, k3
        U3, Sb3 = U.view(BHN, C, Dv), S_before.view(BHN, Dk, Dv)
        PdO = torch.bmm(P.transpose(1, 2), dO).view(BH, N, C, Dv)
        QdO = torch.bmm(qf.transpose(1, 2), dO).view(BH, N, Dk, Dv)
        ke4, W4 = ke.view(BH, N, C, Dk), W.view(BH, N, C, Dk)
        # Reverse scan: dU_n = Pᵀ dO + K̂ dS_{n+1},  dS_n = total dS_{n+1} + Q̃ᵀ dO − Wᵀ dU_n
        dU = U.new_empty(BH, N, C, Dv)
        dS_after = S_before.new_empty(BH, N, Dk, Dv)
        for n in range(N - 1, -1, -1):
            dS_after[:, n] = dS
            dU_n = torch.baddbmm(PdO[:, n], ke4[:, n], dS)
            dU[:, n] = dU_n
            carried = (tot[:, n] * dS if gated else dS) + QdO[:, n]
            dS = torch.baddbmm(carried, W4[:, n].transpose(1, 2), dU_n, alpha=-1.0)
        dS0 = dS.view(B, H, Dk, Dv)
        dU3, dSa3 = dU.view(BHN, C, Dv), dS_after.view(BHN, Dk, Dv)
        # out = Q̃ S_n + P U
        dP = torch.bmm(dO, U3.transpose(1, 2)).tril_()
        dQK = dP * D3 if gated else dP
        dqf = torch.bmm(dO, Sb3.transpose(1, 2))                   # (BHN, C, Dk)
        # S' = total S + K̂ᵀ U
        dke = torch.bmm(U3, dSa3.transpose(1, 2))                  # (BHN, C, Dk)
        # U = Ũ − W S:  dW = −dU Sᵀ, dŨ = dU;  [W, Ũ] = M⁻¹ R:  dR = M⁻ᵀ [dW, dŨ],  dM = −dR [W, Ũ]ᵀ
        MinvT = Minv.transpose(1, 2)
        dR_k = torch.bmm(MinvT, torch.bmm(dU3, Sb3.transpose(1, 2))).neg_()
        dR_v = torch.bmm(MinvT, dU3)
        dM = torch.baddbmm(torch.bmm(dR_k, W.transpose(1, 2)), dR_v, Ut.transpose(1, 2)).tril_(-1).neg_()
        A = KK * D3 if gated else KK
        kf = k3 * fs3 if gated else k3
        d_beta = (dM * A).sum(-1, keepdim=True) + (dR_k * kf).sum(-1, keepdim=True) + (dR_v * v3).sum(-1, keepdim=True)
        dKK = b3 * dM                                                # M = I + diag(β) A
        if gated:
            dD = dP * QK + dKK * KK
            dKK = dKK * D3
        dkf = b3 * dR_k
        dv = b3 * dR_v
        dk = torch.bmm(dQK.transpose(1, 2), q3)
        dk = torch.baddbmm(dk, dKK, k3)
        dk = torch.baddbmm(dk, dKK.transpose(1, 2), k3)
        dD_out = d_fs = d_te = d_tot = None
        if gated:
            dq = torch.baddbmm(dqf * fs3, dQK, k3)
            dk = dk + dke * te3 + dkf * fs3
            dD_out = dD.view(D.shape)
            d_fs = ((dqf * q3).sum(-1, keepdim=True) + (dkf * k3).sum(-1, keepdim=True)).view(fs.shape)
            d_te = (dke * k3).sum(-1, keepdim=True).view(te.shape)
            d_tot = (S_before * dS_after).sum((-1, -2)).view(total.shape)
        else:
            dq = torch.baddbmm(dqf, dQK, k3)
            dk = dk + dke + dkf
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), d_beta.view(*shape, 1), dS0,
                dD_out, d_fs, d_te, d_tot)


def _differentiable_backward(inputs, d_out, d_S):
    """The backward pass as autograd's graph of :func:`_forward`, so that it can be differentiated again."""
    leaves = [None if x is None else (x if x.requires_grad else x.detach().requires_grad_()) for x in inputs]
    with torch.enable_grad():
        out, S = _forward(*leaves)
    present = [i for i, x in enumerate(leaves) if x is not None]
    grads_out = [g for g in (d_out, d_S) if g is not None]
    outs = [o for o, g in zip((out, S), (d_out, d_S)) if g is not None]
    grads = torch.autograd.grad(outs, [leaves[i] for i in present], grads_out, create_graph=True, allow_unused=True)
    result = [None] * len(leaves)
    for i, g in zip(present, grads):
        result[i] = torch.zeros_like(leaves[i]) if g is None else g
    return tuple(result)


def _dual(t: Optional[Tensor]) -> bool:
    return t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def wy_chunk(q, k, v, beta, S0, D=None, from_start=None, to_end=None, total=None) -> tuple[Tensor, Tensor]:
    """``(out (B, H, N, C, Dv), S_final)`` of the WY chunk form (see the module docstring).

    With gradients needed (and outside ``torch.func`` transforms, ``torch.compile`` and forward-mode
    AD, where autograd differentiates the same equations op by op) through :class:`_WYChunk`.
    """
    inputs = (q, k, v, beta, S0, D, from_start, to_end, total)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if (not needs_grad or compiling() or torch._C._are_functorch_transforms_active()
            or any(_dual(t) for t in inputs)):
        return _forward(*inputs)
    return _WYChunk.apply(*inputs)
