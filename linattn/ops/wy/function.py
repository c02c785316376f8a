"""The WY / UT chunk form shared by the delta rule and the gated delta rule."""
from __future__ import annotations

import torch
from torch import Tensor

from ..._autograd import autograd_must_see_every_op, differentiable_backward
from .._common import groups
from ..decay import (level_products_backward, mild_groups, prefix_factors, prefix_factors_backward, scalar_decay,
                     scalar_decay_backward, scores_fast, scores_fast_backward)
from .linalg import solve, solve_backward
from .naive import wy_chunk_channel_ops, wy_chunk_ops
from .scan import rows, scan_chunks, scan_chunks_backward, set_rows
from ..value_heads import SharedRows

__all__ = ["wy_chunk", "wy_chunk_channel"]


def _prefix_scores(q, k, fs, inv, P, A):
    """One group of mild chunks: writes ``P = tril((Q ⊙ fs)(K ⊙ inv)ᵀ)`` and ``A = tril((K ⊙ fs)(K ⊙ inv)ᵀ, −1)``
    (:func:`linattn.ops.decay.prefix_factors`) into ``P`` and ``A``; returns ``K ⊙ fs``."""
    kf, kh = k * fs, k * inv
    torch.bmm(q * fs, kh.transpose(1, 2), out=P).tril_()
    torch.bmm(kf, kh.transpose(1, 2), out=A).tril_(-1)
    return kf


def _prefix_backward(dP, dA, dqf, dkf, dke, c_tot, q, k, kf, ke, fs, inv, te, dq, dk):
    """One group of mild chunks with one gate per key channel: writes ``dq`` and ``dk`` and returns ``dg``
    when ``P = (Q ⊙ fs)(K ⊙ inv)ᵀ`` and ``A = (K ⊙ fs)(K ⊙ inv)ᵀ`` (masked;
    :func:`linattn.ops.decay.prefix_factors`), from :func:`_solve_backward`'s outputs.
    """
    qf, kh = q * fs, k * inv
    dqf.baddbmm_(dP, kh)                                                   # all of d (q ⊙ fs)
    dkf.baddbmm_(dA, kh)                                                   # all of d (k ⊙ fs)
    dkh = torch.bmm(dP.transpose(1, 2), qf).baddbmm_(dA.transpose(1, 2), kf)
    torch.mul(dqf, fs, out=dq)
    torch.mul(dkf, fs, out=dk).addcmul_(dkh, inv).addcmul_(dke, te)
    a_fs = dqf.mul_(qf).addcmul_(dkf, kf)                                  # d fs ⊙ fs, and so on
    return prefix_factors_backward(a_fs, dkh.mul_(kh), dke.mul_(ke), c_tot)


def _prefix_backward_head(dP, dA, dqf, dkf, dke, c_tot, q, k, P, A, fs, inv, te, ke, dq, dk):
    """One group of mild chunks with one gate per head: writes ``dq`` and ``dk``, returns ``dg``."""
    F = fs * inv.transpose(1, 2)                                               # [t, s] = e^{b_t − b_s}
    E = (dP * P).add_(dA * A)                                                  # d F ⊙ F, masked
    dPF, dAF = dP.mul_(F), dA.mul_(F)
    torch.baddbmm(dqf * fs, dPF, k, out=dq)
    torch.bmm(dPF.transpose(1, 2), q, out=dk).baddbmm_(dAF + dAF.transpose(1, 2), k)
    dk.addcmul_(dkf, fs).addcmul_(dke, te)
    a_fs = E.sum(-1, keepdim=True).add_((dqf * q).sum(-1, keepdim=True).add_((dkf * k).sum(-1, keepdim=True)).mul_(fs))
    b_inv = E.sum(-2).unsqueeze(-1)
    b_te = (dke * ke).sum(-1, keepdim=True)
    return prefix_factors_backward(a_fs, b_inv, b_te, c_tot)


class _WYChunk(torch.autograd.Function):
    """The WY chunk form with one gate per head (log-gates ``g``) or none, and a hand-written backward."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, g):
        B, H, N, C, Dk = k.shape
        HV, Dv = v.shape[1], v.shape[-1]
        BH, BHN = B * HV, B * HV * N                                       # rows of the value heads
        gated = g is not None
        shared = SharedRows(B, H, HV, N, q.device)                         # grouped value heads
        q3, k3 = q.reshape(B * H * N, C, Dk), k.reshape(B * H * N, C, Dk)
        v3, b3 = v.reshape(BHN, C, Dv), beta.reshape(BHN, C, 1)
        g3 = g.reshape(BHN, C, 1) if gated else None
        QK, KK, Minv = (q3.new_empty(BHN, C, C) for _ in range(3))
        W, Ut = q3.new_empty(BHN, C, Dk), q3.new_empty(N, BH, C, Dv)     # Ũ (then U) chunk-major
        ke, tot = (q3.new_empty(BHN, C, Dk), q3.new_empty(BHN, 1, 1)) if gated else (k3, None)
        fs, te = (q3.new_empty(BHN, C, 1), q3.new_empty(BHN, C, 1)) if gated else (None, None)
        parts = groups(BHN, C * max(C, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3, shared.per_row) if gated else [False] * len(parts)
        D = q3.new_empty(BHN, C, C) if gated and not all(mild) else None     # only the range groups use them
        inv = q3.new_empty(BHN, C, 1) if any(mild) else None                 # only the prefix groups
        for grp, prefix in zip(parts, mild):
            q_g, k_g = shared.read(q3, grp), shared.read(k3, grp)
            if prefix:      # mild decay: QK and KK hold the decayed scores (q ⊙ fs)(k ⊙ inv)ᵀ, (k ⊙ fs)(k ⊙ inv)ᵀ
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                kf = _prefix_scores(q_g, k_g, fs[grp], inv[grp], QK[grp], KK[grp])
                A = KK[grp]
            else:
                torch.bmm(q_g, k_g.transpose(1, 2), out=QK[grp]).tril_()       # tril_ first: an overflowing
                torch.bmm(k_g, k_g.transpose(1, 2), out=KK[grp]).tril_(-1)      # later score times 0 is NaN
                if gated:
                    D[grp], fs[grp], te[grp], tot[grp] = scalar_decay(g3[grp])
                    A, kf = KK[grp] * D[grp], k_g * fs[grp]
                else:
                    A, kf = KK[grp], k_g
            if gated:
                torch.mul(k_g, te[grp], out=ke[grp])
            Minv[grp], W[grp], Ut_g = solve(A, kf, v3[grp], b3[grp])
            set_rows(Ut, grp, N, Ut_g)
        U, S_before, S = scan_chunks(W, Ut, ke, tot, S0, BH, N)
        out = q3.new_empty(B, HV, N, C, Dv)                                 # returned as it is: not a view
        out3 = out.view(BHN, C, Dv)
        for grp, prefix in zip(parts, mild):
            q_g = shared.read(q3, grp)
            if gated:
                P, qf = QK[grp] if prefix else QK[grp] * D[grp], q_g * fs[grp]
            else:
                P, qf = QK[grp], q_g
            torch.baddbmm(torch.bmm(qf, rows(S_before, grp, N)), P, rows(U, grp, N), out=out3[grp])
        ctx.shape, ctx.mild, ctx.parts = (B, H, HV, N, C, Dk, Dv), mild, parts   # the backward takes the same groups
        ctx.save_for_backward(q, k, v, beta, S0, g, QK, KK, Minv, W, U, S_before, D, fs, te, tot, inv,
                              ke if gated else None)
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, g, QK, KK, Minv, W, U, S_before, D, fs, te, tot, inv, ke = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a second derivative): the stored intermediates are constants to
            # autograd, so differentiate the same equations op by op instead, from the inputs.
            return differentiable_backward(wy_chunk_ops, (q, k, v, beta, S0, g), d_out, d_S)
        B, H, HV, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * HV, B * HV * N
        gated = g is not None
        shared = SharedRows(B, H, HV, N, q.device)
        q3, k3 = q.reshape(B * H * N, C, Dk), k.reshape(B * H * N, C, Dk)
        v3, b3 = v.reshape(BHN, C, Dv), beta.reshape(BHN, C, 1)
        g3 = g.reshape(BHN, C, 1) if gated else None
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        PdO, QdO = q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, Dk, Dv)   # Pᵀ dO chunk-major
        ke = k3 if ke is None else ke                                        # K ⊙ to_end, kept from the forward pass
        for grp, prefix in zip(parts, ctx.mild):
            q_g = shared.read(q3, grp)
            if gated:
                P, qf = QK[grp] if prefix else QK[grp] * D[grp], q_g * fs[grp]
            else:
                P, qf = QK[grp], q_g
            set_rows(PdO, grp, N, torch.bmm(P.transpose(1, 2), dO[grp]))
            torch.bmm(qf.transpose(1, 2), dO[grp], out=QdO[grp])
        dU, dS_after, dS0 = scan_chunks_backward(PdO, QdO, W, ke, tot, dS, BH, N)
        del QdO
        dq, dk, dv, d_beta = shared.gradient(q3), shared.gradient(k3), torch.empty_like(v3), torch.empty_like(b3)
        dg = torch.empty_like(g3) if gated else None
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g = shared.read(q3, grp), shared.read(k3, grp)
            dq_g, dk_g = shared.target(dq, grp), shared.target(dk, grp)
            U_g, Sb_g, dU_g, dSa_g = (rows(x, grp, N) for x in (U, S_before, dU, dS_after))
            if gated:
                D_g, fs_g, te_g = None if prefix else D[grp], fs[grp], te[grp]
                kf, A = k_g * fs_g, KK[grp] if prefix else KK[grp] * D_g
            else:
                kf, A = k_g, KK[grp]
            dP, dqf, dke, dA, dkf, d_beta[grp] = solve_backward(
                dO[grp], U_g, Sb_g, dSa_g, dU_g, Minv[grp], A, kf, v3[grp], b3[grp], dv[grp])
            c_tot = (Sb_g * dSa_g).sum((-1, -2)).view(-1, 1, 1).mul_(tot[grp]) if gated else None
            if prefix:
                dg[grp] = _prefix_backward_head(dP, dA, dqf, dkf, dke, c_tot, q_g, k_g, QK[grp], KK[grp], fs_g,
                                                inv[grp], te_g, ke[grp], dq_g, dk_g)
            else:
                dKK = dA
                if gated:
                    e_D = (dP * QK[grp]).add_(dKK * KK[grp]).mul_(D_g)           # d D ⊙ D
                    dQK, dKK = dP.mul_(D_g), dKK.mul_(D_g)
                else:
                    dQK = dP
                torch.bmm(dQK.transpose(1, 2), q_g, out=dk_g).baddbmm_(dKK + dKK.transpose(1, 2), k_g)   # K Kᵀ: both sides
                if gated:
                    torch.baddbmm(dqf * fs_g, dQK, k_g, out=dq_g)
                    dk_g.addcmul_(dke, te_g).addcmul_(dkf, fs_g)
                    a_fs = ((dqf * q_g).sum(-1, keepdim=True) + (dkf * k_g).sum(-1, keepdim=True)).mul_(fs_g)
                    b_te = (dke * k_g).sum(-1, keepdim=True).mul_(te_g)
                    dg[grp] = scalar_decay_backward(e_D, a_fs, b_te, c_tot)
                else:
                    torch.baddbmm(dqf, dQK, k_g, out=dq_g)
                    dk_g.add_(dke).add_(dkf)
            shared.commit(dq, grp, dq_g)
            shared.commit(dk, grp, dk_g)
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(B, HV, N, C, Dv), d_beta.view(B, HV, N, C, 1),
                dS0.view(B, HV, Dk, Dv), None if dg is None else dg.view(B, HV, N, C, 1))


class _WYChannelChunk(torch.autograd.Function):
    """The WY chunk form with one gate per key channel and a hand-written backward."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, g):
        B, H, N, C, Dk = k.shape
        HV, Dv = v.shape[1], v.shape[-1]
        BH, BHN = B * HV, B * HV * N                                       # rows of the value heads
        shared = SharedRows(B, H, HV, N, q.device)                         # grouped value heads
        q3, k3 = q.reshape(B * H * N, C, Dk), k.reshape(B * H * N, C, Dk)
        v3, b3, g3 = v.reshape(BHN, C, Dv), beta.reshape(BHN, C, 1), g.reshape(BHN, C, Dk)
        P, A, Minv = (q3.new_empty(BHN, C, C) for _ in range(3))
        W, Ut, ke = q3.new_empty(BHN, C, Dk), q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, C, Dk)
        fs, te, tot = torch.empty_like(g3), torch.empty_like(g3), g3.new_empty(BHN, 1, Dk)
        parts = groups(BHN, C * max(C, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3, shared.per_row)
        inv = torch.empty_like(g3) if any(mild) else None
        for grp, prefix in zip(parts, mild):
            q_g, k_g = shared.read(q3, grp), shared.read(k3, grp)
            if prefix:
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                kf = _prefix_scores(q_g, k_g, fs[grp], inv[grp], P[grp], A[grp])
            else:
                P[grp], products = scores_fast(q_g, k_g, False, g3[grp])
                A[grp], _ = scores_fast(k_g, k_g, True, g3[grp])
                fs[grp], te[grp], tot[grp] = products.ends()
                kf = k_g * fs[grp]
            torch.mul(k_g, te[grp], out=ke[grp])
            Minv[grp], W[grp], Ut_g = solve(A[grp], kf, v3[grp], b3[grp])
            set_rows(Ut, grp, N, Ut_g)
        tot_t = tot.transpose(1, 2)                                       # (BHN, Dk, 1): per key channel
        U, S_before, S = scan_chunks(W, Ut, ke, tot_t, S0, BH, N)
        out = q3.new_empty(B, HV, N, C, Dv)                                 # returned as it is: not a view
        out3 = out.view(BHN, C, Dv)
        for grp in parts:
            torch.baddbmm(torch.bmm(shared.read(q3, grp) * fs[grp], rows(S_before, grp, N)), P[grp],
                          rows(U, grp, N), out=out3[grp])
        ctx.shape, ctx.mild, ctx.parts = (B, H, HV, N, C, Dk, Dv), mild, parts   # the backward takes the same groups
        ctx.save_for_backward(q, k, v, beta, S0, g, P, A, fs, te, tot, inv, ke, Minv, W, U, S_before)
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, g, P, A, fs, te, tot, inv, ke, Minv, W, U, S_before = ctx.saved_tensors
        if torch.is_grad_enabled():
            return differentiable_backward(wy_chunk_channel_ops, (q, k, v, beta, S0, g), d_out, d_S)
        B, H, HV, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * HV, B * HV * N
        shared = SharedRows(B, H, HV, N, q.device)
        q3, k3 = q.reshape(B * H * N, C, Dk), k.reshape(B * H * N, C, Dk)
        v3, b3, g3 = v.reshape(BHN, C, Dv), beta.reshape(BHN, C, 1), g.reshape(BHN, C, Dk)
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        PdO, QdO = q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, Dk, Dv)   # Pᵀ dO chunk-major
        for grp in parts:
            set_rows(PdO, grp, N, torch.bmm(P[grp].transpose(1, 2), dO[grp]))
            torch.bmm((shared.read(q3, grp) * fs[grp]).transpose(1, 2), dO[grp], out=QdO[grp])
        dU, dS_after, dS0 = scan_chunks_backward(PdO, QdO, W, ke, tot.transpose(1, 2), dS, BH, N)
        del QdO
        dq, dk = shared.gradient(q3), shared.gradient(k3)
        dv, d_beta, dg = (torch.empty_like(x) for x in (v3, b3, g3))
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g, fs_g, te_g = shared.read(q3, grp), shared.read(k3, grp), fs[grp], te[grp]
            dq_g, dk_g = shared.target(dq, grp), shared.target(dk, grp)
            U_g, Sb_g, dU_g, dSa_g = (rows(x, grp, N) for x in (U, S_before, dU, dS_after))
            kf = k_g * fs_g
            dP, dqf, dke, dA, dkf, d_beta[grp] = solve_backward(
                dO[grp], U_g, Sb_g, dSa_g, dU_g, Minv[grp], A[grp], kf, v3[grp], b3[grp], dv[grp])
            c_tot = (Sb_g * dSa_g).sum(-1).unsqueeze(-2).mul_(tot[grp])   # d total ⊙ total
            if prefix:
                dg[grp] = _prefix_backward(dP, dA, dqf, dkf, dke, c_tot, q_g, k_g, kf, ke[grp], fs_g, inv[grp], te_g,
                                           dq_g, dk_g)
            else:
                dq_p, dk_p, a_p, b_p, _ = scores_fast_backward(dP, q_g, k_g, False, g3[grp])
                dk_x, dk_y, a_a, b_a, _ = scores_fast_backward(dA, k_g, k_g, True, g3[grp])
                torch.addcmul(dq_p, dqf, fs_g, out=dq_g)
                torch.add(dk_p, dk_x, out=dk_g).add_(dk_y).addcmul_(dke, te_g).addcmul_(dkf, fs_g)
                a_levels = [x.add_(y) for x, y in zip(a_p, a_a)]
                b_levels = [None if x is None else x.add_(y) for x, y in zip(b_p, b_a)]
                a_fs = dqf.mul_(q_g).mul_(fs_g).addcmul_(dkf, kf)                 # d from_start ⊙ from_start
                dg[grp] = level_products_backward(a_fs, dke.mul_(ke[grp]), c_tot, a_levels, b_levels)
            shared.commit(dq, grp, dq_g)
            shared.commit(dk, grp, dk_g)
        return (dq.view(B, H, N, C, Dk), dk.view(B, H, N, C, Dk), dv.view(B, HV, N, C, Dv),
                d_beta.view(B, HV, N, C, 1), dS0.view(B, HV, Dk, Dv), dg.view(B, HV, N, C, Dk))


def _use_op_by_op(inputs) -> bool:
    """The op-by-op form: only where autograd must see every operation."""
    return autograd_must_see_every_op(*inputs)


def wy_chunk(q, k, v, beta, S0, g=None) -> tuple[Tensor, Tensor]:
    """``(out (B, H, N, C, Dv), S_final)`` of the WY chunk form with one gate per head (log-gates ``g`` ``(B, H, N, C, 1)``) or none."""
    inputs = (q, k, v, beta, S0, g)
    return wy_chunk_ops(*inputs) if _use_op_by_op(inputs) else _WYChunk.apply(*inputs)


def wy_chunk_channel(q, k, v, beta, S0, g) -> tuple[Tensor, Tensor]:
    """``(out, S_final)`` of the WY chunk form with per-channel log-gates ``g`` ``(B, H, N, C, Dk)`` (``C`` a power of two)."""
    inputs = (q, k, v, beta, S0, g)
    return wy_chunk_channel_ops(*inputs) if _use_op_by_op(inputs) else _WYChannelChunk.apply(*inputs)
