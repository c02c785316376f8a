"""GLA's chunk form: decayed scores per chunk (:mod:`linattn.ops.decay`), a scan of the state between
chunks, and a Function with a hand-written backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._autograd import autograd_must_see_every_op, differentiable_backward
from ..._numerics import LOG_G_FLOOR
from .._common import from_chunks, groups, num_chunks, to_chunks, zeros_state
from ..value_heads import SharedRows, repeat_heads
from ..decay import (decay_factors, level_products_backward, mild_groups, padded_chunk, prefix_factors,
                     prefix_factors_backward, scores_by_cat, scores_fast, scores_fast_backward)

__all__ = ["chunk_gated_linear_attention", "gla_chunk", "gla_chunk_ops"]


def gla_chunk_ops(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """GLA's chunk form op by op (differentiable by autograd): ``(out (B, HV, N, Cp, Dv), S_final)``
    (grouped value heads: ``q``, ``k`` with ``H`` heads are repeated to ``HV``)."""
    q, k = (repeat_heads(x, v.shape[1] // k.shape[1]) for x in (q, k))
    from_start, to_end, total, levels = decay_factors(g)
    A = scores_by_cat(q, k, False, levels)
    U = (k * to_end).transpose(-1, -2) @ v                                    # (B, H, N, Dk, Dv)
    S, before = S0, []
    for d, u in zip(total.transpose(-1, -2).unbind(2), U.unbind(2)):          # d: (B, H, Dk, 1)
        before.append(S)
        S = d * S + u
    return A @ v + (q * from_start) @ torch.stack(before, dim=2), S


class _GLAChunk(torch.autograd.Function):
    """GLA's chunk form (:func:`gla_chunk_ops`) with a hand-written backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, S0):
        B, H, N, Cp, Dk = q.shape
        HV, Dv = v.shape[1], v.shape[-1]
        BH, BHN = B * HV, B * HV * N                                       # rows of the value heads
        shared = SharedRows(B, H, HV, N, q.device)                         # grouped value heads
        q3, k3 = q.reshape(B * H * N, Cp, Dk), k.reshape(B * H * N, Cp, Dk)
        g3, v3 = g.reshape(BHN, Cp, Dk), v.reshape(BHN, Cp, Dv)
        A = q3.new_empty(BHN, Cp, Cp)
        fs, te, tot = torch.empty_like(g3), torch.empty_like(g3), g3.new_empty(BHN, 1, Dk)
        U = q3.new_empty(BHN, Dk, Dv)
        parts = groups(BHN, Cp * max(Cp, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3, shared.per_row)
        inv = torch.empty_like(g3) if any(mild) else None
        for grp, prefix in zip(parts, mild):
            q_g, k_g = shared.read(q3, grp), shared.read(k3, grp)
            if prefix:
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                torch.bmm(q_g * fs[grp], (k_g * inv[grp]).transpose(1, 2), out=A[grp]).tril_()
            else:
                A[grp], products = scores_fast(q_g, k_g, False, g3[grp])
                fs[grp], te[grp], tot[grp] = products.ends()
            torch.bmm((k_g * te[grp]).transpose(1, 2), v3[grp], out=U[grp])
        U4, tot4 = U.view(BH, N, Dk, Dv), tot.view(BH, N, Dk, 1)
        S_before = U.new_empty(BH, N, Dk, Dv)
        S = S0.reshape(BH, Dk, Dv)
        final = U.new_empty(S0.shape)                   # S0's shape, not a view: a state the caller may write into
        for n in range(N):
            S_before[:, n] = S
            if n < N - 1:
                S = torch.addcmul(U4[:, n], tot4[:, n], S)
            else:
                torch.addcmul(U4[:, n], tot4[:, n], S, out=final.view(BH, Dk, Dv))
        del U, U4
        Sb3 = S_before.view(BHN, Dk, Dv)
        out = q3.new_empty(B, HV, N, Cp, Dv)                                # returned as it is: not a view
        out3 = out.view(BHN, Cp, Dv)
        for grp in parts:
            torch.baddbmm(torch.bmm(A[grp], v3[grp]), shared.read(q3, grp) * fs[grp], Sb3[grp], out=out3[grp])
        ctx.mild, ctx.parts = mild, parts        # the backward takes the same groups
        ctx.save_for_backward(q, k, v, g, S0, A, S_before, fs, te, tot, inv)
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, g, S0, A, S_before, fs, te, tot, inv = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the stored intermediates are constants to autograd, so
            # differentiate the same equations op by op instead, from the inputs.
            return differentiable_backward(gla_chunk_ops, (q, k, v, g, S0), d_out, d_S)
        B, H, N, Cp, Dk = q.shape
        HV, Dv = v.shape[1], v.shape[-1]
        BH, BHN = B * HV, B * HV * N
        shared = SharedRows(B, H, HV, N, q.device)
        q3, k3 = q.reshape(B * H * N, Cp, Dk), k.reshape(B * H * N, Cp, Dk)
        g3, v3 = g.reshape(BHN, Cp, Dk), v.reshape(BHN, Cp, Dv)
        dO = v3.new_zeros(BHN, Cp, Dv) if d_out is None else d_out.reshape(BHN, Cp, Dv)
        dS = S_before.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        QdO = q3.new_empty(BHN, Dk, Dv)
        for grp in parts:
            torch.bmm((shared.read(q3, grp) * fs[grp]).transpose(1, 2), dO[grp], out=QdO[grp])
        QdO4, tot4 = QdO.view(BH, N, Dk, Dv), tot.view(BH, N, Dk, 1)
        dS_after = S_before.new_empty(BH, N, Dk, Dv)                          # d loss / d (state after chunk n)
        for n in range(N - 1, -1, -1):
            dS_after[:, n] = dS
            dS = torch.addcmul(QdO4[:, n], tot4[:, n], dS)
        del QdO, QdO4
        Sb3, dSa3 = S_before.view(BHN, Dk, Dv), dS_after.view(BHN, Dk, Dv)
        dq, dk = shared.gradient(q3), shared.gradient(k3)
        dg, dv = torch.empty_like(g3), torch.empty_like(v3)
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g, v_g, dO_g, Sb_g, dSa_g = shared.read(q3, grp), shared.read(k3, grp), v3[grp], dO[grp], Sb3[grp], dSa3[grp]
            dq_g, dk_g = shared.target(dq, grp), shared.target(dk, grp)
            fs_g, te_g = fs[grp], te[grp]
            ke = k_g * te_g
            torch.baddbmm(torch.bmm(A[grp].transpose(1, 2), dO_g), ke, dSa_g, out=dv[grp])
            c_tot = (Sb_g * dSa_g).sum(-1).unsqueeze(-2).mul_(tot[grp])      # d total ⊙ total, (G, 1, Dk)
            dqf = torch.bmm(dO_g, Sb_g.transpose(1, 2))                       # d (q ⊙ from_start)
            dke = torch.bmm(v_g, dSa_g.transpose(1, 2))                       # d (k ⊙ to_end)
            dA = torch.bmm(dO_g, v_g.transpose(1, 2))
            if prefix:                                                        # A = (q ⊙ fs)(k ⊙ inv)ᵀ, lower
                inv_g = inv[grp]
                qf, kh = q_g * fs_g, k_g * inv_g
                dA.tril_()
                dqf.baddbmm_(dA, kh)
                dkh = torch.bmm(dA.transpose(1, 2), qf)
                torch.mul(dqf, fs_g, out=dq_g)
                torch.mul(dkh, inv_g, out=dk_g).addcmul_(dke, te_g)
                dg[grp] = prefix_factors_backward(dqf.mul_(qf), dkh.mul_(kh), dke.mul_(ke), c_tot)
            else:
                dq_p, dk_p, a_levels, b_levels, _ = scores_fast_backward(dA, q_g, k_g, False, g3[grp])
                torch.addcmul(dq_p, dqf, fs_g, out=dq_g)
                torch.addcmul(dk_p, dke, te_g, out=dk_g)
                dg[grp] = level_products_backward(dqf.mul_(q_g).mul_(fs_g), dke.mul_(ke), c_tot, a_levels, b_levels)
            shared.commit(dq, grp, dq_g)
            shared.commit(dk, grp, dk_g)
        return (dq.view(B, H, N, Cp, Dk), dk.view(B, H, N, Cp, Dk), dv.view(B, HV, N, Cp, Dv),
                dg.view(B, HV, N, Cp, Dk), dS.view(B, HV, Dk, Dv))


def gla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, S_final)`` of GLA's chunk form (see :func:`gla_chunk_ops`): :class:`_GLAChunk`, or op by op."""
    if autograd_must_see_every_op(q, k, v, g, S0):
        return gla_chunk_ops(q, k, v, g, S0)
    return _GLAChunk.apply(q, k, v, g, S0)


def chunk_gated_linear_attention(q, k, v, log_g, S0, chunk_size):
    """Chunkwise GLA (see :func:`gated_linear_attention` and :mod:`linattn.ops.decay`)."""
    B, H, T, Dk = k.shape
    log_g = log_g.clamp(min=LOG_G_FLOOR)                               # see LOG_G_FLOOR
    C, N = num_chunks(T, chunk_size)
    Cp = padded_chunk(C)

    def chunks(x: Tensor) -> Tensor:                                   # (B, H, N, Cp, ·)
        x = to_chunks(x, N, C)
        return x if Cp == C else F.pad(x, (0, 0, 0, Cp - C))

    qc, kc, vc, gc = (chunks(x) for x in (q, k, v, log_g))
    out, S = gla_chunk(qc, kc, vc, gc, zeros_state(k, v, S0))
    return from_chunks(out[:, :, :, :C], T), S
