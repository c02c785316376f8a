"""The chunk form of the delta rule and of the gated delta rule (private).

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
it; without gates (the delta rule) all are 1 and are skipped. With one gate per key channel
(Kimi Delta Attention) the decay sits inside the sum over channels, ``Pqk[t, s] = Σ_d q_td k_sd
Π_{s<r<=t} α_rd``, and the scores come from :mod:`linattn.ops._decay`'s halving; ``total`` is
then one factor per key channel. Only the ``T/C`` matmuls of the scan are sequential: ``W S``
and ``(K ⊙ to_end)ᵀ U`` forward, ``(K ⊙ to_end) dS'`` and ``Wᵀ dU`` backward. With one gate per
head the decay factors enter as inputs, and autograd differentiates their (elementwise)
construction from the log-gates; per key channel the log-gates are the input and the whole
backward pass is written here.

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
from ._common import differentiable_backward
from ._decay import decay_factors, groups, level_products_backward, scores_by_cat, scores_fast, scores_fast_backward


def _solve_and_scan(P, A, qf, kf, ke, v, beta, S0, total):
    """The chunk form from its decayed scores, op by op (differentiable by autograd): ``(out, S_final)``.

    ``P``, ``A`` ``(B, H, N, C, C)`` (``A`` strictly lower), ``qf = Q ⊙ from_start``, ``kf = K ⊙
    from_start``, ``ke = K ⊙ to_end`` ``(…, C, Dk)``, ``v`` ``(…, C, Dv)``, ``beta`` ``(…, C, 1)``,
    ``S0`` ``(B, H, Dk, Dv)``, ``total`` ``(B, H, N, 1 or Dk, 1)`` or None (no gates).
    """
    M = beta * A + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)   # I + diag(β) A (A's diagonal is 0)
    X = torch.linalg.solve_triangular(M, torch.cat([beta * kf, beta * v], dim=-1), upper=False, unitriangular=True)
    Dk = kf.shape[-1]
    W, Ut = X[..., :Dk], X[..., Dk:]
    S, before, Us = S0, [], []
    totals = [None] * W.shape[2] if total is None else total.unbind(2)
    for W_n, Ut_n, ke_n, tot_n in zip(W.unbind(2), Ut.unbind(2), ke.transpose(-1, -2).unbind(2), totals):
        before.append(S)
        U_n = Ut_n - W_n @ S                                                  # U = Ũ − W S
        Us.append(U_n)
        S = (S if tot_n is None else tot_n * S) + ke_n @ U_n
    S_before, U = torch.stack(before, dim=2), torch.stack(Us, dim=2)        # (B, H, N, Dk, Dv), (…, C, Dv)
    return qf @ S_before + P @ U, S


def _forward(q, k, v, beta, S0, D, from_start, to_end, total):
    """The chunk form with one gate per head (or none), op by op: ``(out, S_final)``.

    ``q, k`` ``(B, H, N, C, Dk)``, ``v`` ``(…, C, Dv)``, ``beta`` ``(…, C, 1)``, ``S0`` ``(B, H, Dk, Dv)``;
    the decays ``D`` ``(…, C, C)``, ``from_start``, ``to_end`` ``(…, C, 1)``, ``total`` ``(B, H, N, 1, 1)``
    or all None (no gates).
    """
    kt = k.transpose(-1, -2)
    QK = (q @ kt).tril()                                # tril first: an overflowing later score times 0 is NaN
    KK = (k @ kt).tril(-1)
    if D is None:
        return _solve_and_scan(QK, KK, q, k, k, v, beta, S0, None)
    return _solve_and_scan(QK * D, KK * D, q * from_start, k * from_start, k * to_end, v, beta, S0, total)


def _forward_channel(q, k, v, beta, S0, g):
    """The chunk form with one gate per key channel (log-gates ``g`` ``(B, H, N, C, Dk)``, ``C`` a power of two), op by op."""
    fs, te, total, levels = decay_factors(g)
    P, A = scores_by_cat(q, k, False, levels), scores_by_cat(k, k, True, levels)
    return _solve_and_scan(P, A, q * fs, k * fs, k * te, v, beta, S0, total.transpose(-1, -2))


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


class _Core:
    """The part of the chunk form the two Functions share: from the decayed scores to the outputs, and back.

    Works on ``(B·H·N, C, ·)`` views for the batched matmuls and ``(B·H, N, ·)`` ones for the scan;
    ``tot`` is None or ``(B·H, N, 1 or Dk, 1)``.
    """

    @staticmethod
    def forward(P, A, qf, kf, ke, v3, b3, S0, tot, BH, N):
        """``(out (B·H·N, C, Dv), S_final (B·H, Dk, Dv), saved)``."""
        BHN, C, Dk = kf.shape
        Dv = v3.shape[-1]
        M = b3 * A
        M.diagonal(dim1=-2, dim2=-1).fill_(1.0)                 # I + diag(β) A (A's diagonal is 0)
        Minv = _unit_lower_inverse(M)
        del M
        W = torch.bmm(Minv, b3 * kf)                            # (BHN, C, Dk)
        Ut = torch.bmm(Minv, b3 * v3)                           # (BHN, C, Dv)
        W4, Ut4, ke4 = W.view(BH, N, C, Dk), Ut.view(BH, N, C, Dv), ke.view(BH, N, C, Dk)
        U = W.new_empty(BH, N, C, Dv)
        S_before = W.new_empty(BH, N, Dk, Dv)
        S = S0.reshape(BH, Dk, Dv)
        for n in range(N):
            S_before[:, n] = S
            U_n = torch.baddbmm(Ut4[:, n], W4[:, n], S, alpha=-1.0)   # U = Ũ − W S
            U[:, n] = U_n
            S = torch.baddbmm(S if tot is None else tot[:, n] * S, ke4[:, n].transpose(1, 2), U_n)
        U3, Sb3 = U.view(BHN, C, Dv), S_before.view(BHN, Dk, Dv)
        out = torch.baddbmm(torch.bmm(qf, Sb3), P, U3)
        return out, S, (Minv, W, Ut, U, S_before)

    @staticmethod
    def backward(dO, dS, P, A, qf, kf, ke, v3, b3, tot, saved, BH, N):
        """``(dP, dA, dqf, dkf, dke, d_beta, dv, dS0, S_before, dS_after)``; ``dP``, ``dA`` lower (strictly for ``dA``)."""
        Minv, W, Ut, U, S_before = saved
        BHN, C, Dk = kf.shape
        Dv = v3.shape[-1]
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
            carried = (dS if tot is None else tot[:, n] * dS) + QdO[:, n]
            dS = torch.baddbmm(carried, W4[:, n].transpose(1, 2), dU_n, alpha=-1.0)
        del PdO, QdO
        dU3, dSa3 = dU.view(BHN, C, Dv), dS_after.view(BHN, Dk, Dv)
        # out = Q̃ S_n + P U
        dP = torch.bmm(dO, U3.transpose(1, 2)).tril_()
        dqf = torch.bmm(dO, Sb3.transpose(1, 2))                   # (BHN, C, Dk)
        # S' = total S + K̂ᵀ U
        dke = torch.bmm(U3, dSa3.transpose(1, 2))                  # (BHN, C, Dk)
        # U = Ũ − W S:  dW = −dU Sᵀ, dŨ = dU;  [W, Ũ] = M⁻¹ R:  dR = M⁻ᵀ [dW, dŨ],  dM = −dR [W, Ũ]ᵀ
        MinvT = Minv.transpose(1, 2)
        dR_k = torch.bmm(MinvT, torch.bmm(dU3, Sb3.transpose(1, 2))).neg_()
        dR_v = torch.bmm(MinvT, dU3)
        dM = torch.baddbmm(torch.bmm(dR_k, W.transpose(1, 2)), dR_v, Ut.transpose(1, 2)).tril_(-1).neg_()
        d_beta = (dM * A).sum(-1, keepdim=True) + (dR_k * kf).sum(-1, keepdim=True) + (dR_v * v3).sum(-1, keepdim=True)
        dA = dM.mul_(b3)                                             # M = I + diag(β) A
        return dP, dA, dqf, dR_k.mul_(b3), dke, d_beta, dR_v.mul_(b3), dS, S_before, dS_after


class _WYChunk(torch.autograd.Function):
    """The WY chunk form with one gate per head (or none) and a hand-written backward (see the module docstring)."""

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
        tot = total.reshape(BH, N, 1, 1) if gated else None
        out, S, saved = _Core.forward(P, A, qf, kf, ke, v3, b3, S0, tot, BH, N)
        ctx.gated, ctx.shape = gated, (B, H, N, C, Dk, Dv)
        ctx.save_for_backward(q, k, v, beta, S0, D, from_start, to_end, total, QK, KK, *saved)
        return out.view(B, H, N, C, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, D, fs, te, total, QK, KK, *saved = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a second derivative): the stored intermediates are constants to
            # autograd, so differentiate the same equations op by op instead, from the inputs.
            return differentiable_backward(_forward, (q, k, v, beta, S0, D, fs, te, total), d_out, d_S)
        B, H, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta))
        gated = ctx.gated
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        if gated:
            D3 = D.reshape(BHN, C, C)
            fs3, te3 = fs.reshape(BHN, C, 1), te.reshape(BHN, C, 1)
            P, A, qf, kf, ke = QK * D3, KK * D3, q3 * fs3, k3 * fs3, k3 * te3
            tot = total.reshape(BH, N, 1, 1)
        else:
            P, A, qf, kf, ke, tot = QK, KK, q3, k3, k3, None
        dP, dKK, dqf, dkf, dke, d_beta, dv, dS0, S_before, dS_after = _Core.backward(
            dO, dS, P, A, qf, kf, ke, v3, b3, tot, saved, BH, N)
        dD_out = d_fs = d_te = d_tot = None
        if gated:
            dD_out = (dP * QK + dKK * KK).view(D.shape)
            dQK, dKK = dP * D3, dKK * D3
        else:
            dQK = dP
        dk = torch.bmm(dQK.transpose(1, 2), q3)
        dk = torch.baddbmm(dk, dKK, k3)
        dk = torch.baddbmm(dk, dKK.transpose(1, 2), k3)
        if gated:
            dq = torch.baddbmm(dqf * fs3, dQK, k3)
            dk = dk + dke * te3 + dkf * fs3
            d_fs = ((dqf * q3).sum(-1, keepdim=True) + (dkf * k3).sum(-1, keepdim=True)).view(fs.shape)
            d_te = (dke * k3).sum(-1, keepdim=True).view(te.shape)
            d_tot = (S_before * dS_after).sum((-1, -2)).view(total.shape)
        else:
            dq = torch.baddbmm(dqf, dQK, k3)
            dk = dk + dke + dkf
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), d_beta.view(*shape, 1),
                dS0.view(B, H, Dk, Dv), dD_out, d_fs, d_te, d_tot)


class _WYChannelChunk(torch.autograd.Function):
    """The WY chunk form with one gate per key channel and a hand-written backward.

    The scores ``P`` and ``A`` are built and differentiated by :mod:`linattn.ops._decay`'s fast
    path (groups of chunks, each level's products recomputed where used); saved: the inputs, the
    scores, the decays from and to the chunk's ends and :class:`_Core`'s intermediates.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, g):
        B, H, N, C, Dk = k.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3, g3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta, g))
        P, A = q3.new_empty(BHN, C, C), q3.new_empty(BHN, C, C)
        fs, te, tot = torch.empty_like(k3), torch.empty_like(k3), k3.new_empty(BHN, 1, Dk)
        for grp in groups(BHN, C * max(C, Dk)):
            P[grp], products = scores_fast(q3[grp], k3[grp], False, g3[grp])
            A[grp], _ = scores_fast(k3[grp], k3[grp], True, g3[grp])
            fs[grp], te[grp], tot[grp] = products.ends()
        tot4 = tot.view(BH, N, Dk, 1)
        out, S, saved = _Core.forward(P, A, q3 * fs, k3 * fs, k3 * te, v3, b3, S0, tot4, BH, N)
        ctx.shape = (B, H, N, C, Dk, Dv)
        ctx.save_for_backward(q, k, v, beta, S0, g, P, A, fs, te, tot, *saved)
        return out.view(B, H, N, C, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, g, P, A, fs, te, tot, *saved = ctx.saved_tensors
        if torch.is_grad_enabled():
            return differentiable_backward(_forward_channel, (q, k, v, beta, S0, g), d_out, d_S)
        B, H, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3, g3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta, g))
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        qf, kf, ke = q3 * fs, k3 * fs, k3 * te
        dP, dA, dqf, dkf, dke, d_beta, dv, dS0, S_before, dS_after = _Core.backward(
            dO, dS, P, A, qf, kf, ke, v3, b3, tot.view(BH, N, Dk, 1), saved, BH, N)
        c_tot = (S_before * dS_after).sum(-1).view(BHN, 1, Dk).mul_(tot)    # d total ⊙ total
        dq, dk, dg = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(g3)
        for grp in groups(BHN, C * max(C, Dk)):
            k_g, fs_g, te_g = k3[grp], fs[grp], te[grp]
            dq_g, dk_p, a_p, b_p, _ = scores_fast_backward(dP[grp], q3[grp], k_g, False, g3[grp])
            dk_x, dk_y, a_a, b_a, _ = scores_fast_backward(dA[grp], k_g, k_g, True, g3[grp])
            dq[grp] = dq_g.addcmul_(dqf[grp], fs_g)
            dk[grp] = dk_p.add_(dk_x).add_(dk_y).addcmul_(dke[grp], te_g).addcmul_(dkf[grp], fs_g)
            a_levels = [x + y for x, y in zip(a_p, a_a)]
            b_levels = [None if x is None else x + y for x, y in zip(b_p, b_a)]
            a_fs = dqf[grp].mul_(qf[grp]).addcmul_(dkf[grp], kf[grp])         # d from_start ⊙ from_start
            dg[grp] = level_products_backward(a_fs, dke[grp].mul_(ke[grp]), c_tot[grp], a_levels, b_levels)
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), d_beta.view(*shape, 1),
                dS0.view(B, H, Dk, Dv), dg.view(*shape, Dk))


def _dual(t: Optional[Tensor]) -> bool:
    return t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def _op_by_op(inputs) -> bool:
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return (not needs_grad or compiling() or torch._C._are_functorch_transforms_active()
            or any(_dual(t) for t in inputs))


def wy_chunk(q, k, v, beta, S0, D=None, from_start=None, to_end=None, total=None) -> tuple[Tensor, Tensor]:
    """``(out (B, H, N, C, Dv), S_final)`` of the WY chunk form with one gate per head or none.

    With gradients needed (and outside ``torch.func`` transforms, ``torch.compile`` and forward-mode
    AD, where autograd differentiates the same equations op by op) through :class:`_WYChunk`.
    """
    inputs = (q, k, v, beta, S0, D, from_start, to_end, total)
    return _forward(*inputs) if _op_by_op(inputs) else _WYChunk.apply(*inputs)


def wy_chunk_channel(q, k, v, beta, S0, g) -> tuple[Tensor, Tensor]:
    """``(out, S_final)`` of the WY chunk form with per-channel log-gates ``g`` ``(B, H, N, C, Dk)`` (``C`` a power of two).

    Through :class:`_WYChannelChunk`, or op by op (:func:`_forward_channel`) as in :func:`wy_chunk`.
    """
    inputs = (q, k, v, beta, S0, g)
    return _forward_channel(*inputs) if _op_by_op(inputs) else _WYChannelChunk.apply(*inputs)
