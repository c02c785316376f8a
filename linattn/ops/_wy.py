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
it; without gates (the delta rule) all are 1 and are skipped. In chunks of mild total decay
(:func:`linattn.ops._decay.mild_groups`) ``Pqk`` and ``Akk`` are instead the products
``(Q ⊙ from_start)(K ⊙ e^{−b})ᵀ`` and ``(K ⊙ from_start)(K ⊙ e^{−b})ᵀ``, and no ``C × C``
decay matrix is formed; the gradient of the log-gates then flows through the cumulative
sum ``b`` (:func:`linattn.ops._decay.prefix_factors_backward`). With one gate per key channel
(Kimi Delta Attention) the decay sits inside the sum over channels, ``Pqk[t, s] = Σ_d q_td k_sd
Π_{s<r<=t} α_rd``, and the scores come from :mod:`linattn.ops._decay`'s halving; ``total`` is
then one factor per key channel. Only the ``T/C`` matmuls of the scan are sequential: ``W S``
and ``(K ⊙ to_end)ᵀ U`` forward, ``(K ⊙ to_end) dS'`` and ``Wᵀ dU`` backward. The log-gates are
the input and the whole backward pass, the gradient of the log-gates included, is written here;
everything inside chunks runs on groups of chunks whose temporaries stay in the CPU's cache.

Saved for the backward pass (per chunk): the inputs, ``Q Kᵀ`` and ``K Kᵀ`` (the decayed scores
in chunks of mild decay and per key channel; ``C²`` each), the decay factors, ``M⁻¹``, ``W``,
``U`` and the chunk start states (``Dk·Dv``): the matmuls of the forward pass are not repeated
(``Ũ`` is not needed: ``dM = −dR_v Uᵀ``, :func:`_solve_backward`). A backward pass that must
itself be differentiable (``create_graph=True``) recomputes the forward op by op from the inputs
and lets autograd differentiate it; ``torch.func``
transforms, ``torch.compile`` and forward-mode AD use that op-by-op form from the start
(:func:`wy_chunk` picks).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import differentiable_backward
from ._decay import (autograd_must_see_every_op, decay_factors, groups, level_products_backward, mild_groups,
                     prefix_factors, prefix_factors_backward, scores_by_cat, scores_fast, scores_fast_backward)


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


def scalar_decay(g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One gate per head: the decay factors of chunks of log-gates ``g`` ``(…, C, 1)``, every exponent a range sum.

    Returns ``D`` ``(…, C, C)`` with ``D[t, s] = exp(Σ_{s<r<=t} g_r)`` for ``s <= t`` and 0 above the
    diagonal, ``from_start`` and ``to_end`` ``(…, C, 1)`` (``exp(Σ_{r<=t})`` and ``exp(Σ_{s<r})``) and
    the chunk's total decay ``(…, 1, 1)``. The range sums are Mamba-2's "segsum" (Dao & Gu, 2024):
    column ``s`` holds ``g_r`` for ``r > s`` only and is accumulated down the rows, so each
    ``Σ_{s<r<=t}`` is summed from its own terms (never a difference of two prefix sums), ``C²``
    additions per chunk. Differentiable op by op; :func:`scalar_decay_backward` is its gradient.
    """
    C = g.shape[-2]
    r = torch.arange(C, device=g.device)
    later = r.view(C, 1) > r.view(1, C)                                 # [r, s]: r > s
    R = g.expand(*g.shape[:-1], C).masked_fill(~later, 0.0).cumsum(dim=-2)   # [t, s] = Σ_{s<r<=t} g_r
    D = R.exp().masked_fill(~torch.ones(C, C, dtype=torch.bool, device=g.device).tril(), 0.0)
    ones = torch.ones(C, C, dtype=g.dtype, device=g.device)
    from_start = (ones.tril() @ g).exp()                                # Σ_{r<=t}
    to_end = (ones.triu(1) @ g).exp()                                   # Σ_{r>s}
    return D, from_start, to_end, g.sum(-2, keepdim=True).exp()


def scalar_decay_backward(e_D: Tensor, a_from_start: Tensor, b_to_end: Tensor, c_total: Tensor) -> Tensor:
    """The gradient of ``g`` from ``d factor ⊙ factor`` of :func:`scalar_decay`'s outputs (no autograd).

    ``e_D`` ``(…, C, C)`` (only the entries below the diagonal are read: ``D``'s diagonal is the
    constant 1), ``a_from_start``, ``b_to_end`` ``(…, C, 1)``, ``c_total`` ``(…, 1, 1)``. A factor
    ``exp(Σ_range g)`` passes ``d factor ⊙ factor`` to every ``g_r`` of its range, so ``D[t, s]``'s
    go to ``s < r <= t``: a suffix sum down the rows, then the sum over ``s < r`` of each row.
    """
    C = e_D.shape[-1]
    e = e_D.tril(-1)
    down = e.flip(-2).cumsum(-2).flip(-2).tril_(-1)                      # [r, s] = Σ_{t>=r} e[t, s], s < r
    ones = torch.ones(C, C, dtype=e.dtype, device=e.device)
    dg = down.sum(-1, keepdim=True)
    dg += ones.triu() @ a_from_start                                     # Σ_{t>=r}
    dg += ones.tril(-1) @ b_to_end                                       # Σ_{s<r}
    return dg.add_(c_total)


def _forward(q, k, v, beta, S0, g=None):
    """The chunk form with one gate per head (log-gates ``g`` ``(B, H, N, C, 1)``) or none, op by op.

    ``q, k`` ``(B, H, N, C, Dk)``, ``v`` ``(…, C, Dv)``, ``beta`` ``(…, C, 1)``, ``S0`` ``(B, H, Dk, Dv)``.
    """
    kt = k.transpose(-1, -2)
    QK = (q @ kt).tril()                                # tril first: an overflowing later score times 0 is NaN
    KK = (k @ kt).tril(-1)
    if g is None:
        return _solve_and_scan(QK, KK, q, k, k, v, beta, S0, None)
    D, from_start, to_end, total = scalar_decay(g)
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


def _scan(W, Ut, ke, tot, S0, BH, N):
    """The pass over chunks: ``U_n = Ũ_n − W_n S``, ``S <- total_n S + K̂_nᵀ U_n``; ``(U, S_before, S_final)``.

    ``W``, ``ke`` ``(B·H·N, C, Dk)`` and ``tot`` (None or ``(B·H·N, 1 or Dk, 1)``) head-major (chunk
    ``n`` of head ``h`` at row ``h·N + n``); ``Ut`` ``(N, B·H, C, Dv)`` chunk-major, a buffer of the
    caller's that ``U`` is written over; ``S_before`` ``(N, B·H, Dk, Dv)`` comes out chunk-major too.
    So every product of the scan writes one contiguous block: on the CPU a batched product into
    a strided output runs its batch one matrix at a time. :func:`_rows` and :func:`_set_rows`
    read and write the chunk-major tensors by groups of chunks.
    """
    BHN, C, Dk = W.shape
    Dv = Ut.shape[-1]
    W4, keT4 = W.view(BH, N, C, Dk).unbind(1), ke.view(BH, N, C, Dk).transpose(-1, -2).unbind(1)
    tot4 = [None] * N if tot is None else tot.view(BH, N, tot.shape[-2], 1).unbind(1)
    S_before = W.new_empty(N, BH, Dk, Dv)
    U_n, S_n = Ut.unbind(0), S_before.unbind(0)
    S = S_n[0].copy_(S0.reshape(BH, Dk, Dv))
    for n in range(N):
        U_n[n].baddbmm_(W4[n], S, alpha=-1.0)                                     # U = Ũ − W S
        nxt = S_n[n + 1] if n + 1 < N else torch.empty_like(S)
        if tot4[n] is None:
            nxt.copy_(S)
        else:
            torch.mul(S, tot4[n], out=nxt)
        S = nxt.baddbmm_(keT4[n], U_n[n])                                         # written in place: no copy
    return Ut, S_before, S


def _scan_backward(PdO, QdO, W, ke, tot, dS, BH, N):
    """The reverse pass: ``dU_n = Pᵀ dO + K̂ dS_{n+1}``, ``dS_n = total dS_{n+1} + Q̃ᵀ dO − Wᵀ dU_n``; ``(dU, dS_after, dS0)``.

    ``PdO`` ``(N, B·H, C, Dv)`` chunk-major (a buffer of the caller's, overwritten by ``dU``), the
    others head-major as in :func:`_scan`; ``dS_after`` ``(N, B·H, Dk, Dv)`` (the gradient of the
    state after each chunk) comes out chunk-major.
    """
    BHN, C, Dk = W.shape
    Dv = PdO.shape[-1]
    Q4 = QdO.view(BH, N, Dk, Dv).unbind(1)
    WT4, ke4 = W.view(BH, N, C, Dk).transpose(-1, -2).unbind(1), ke.view(BH, N, C, Dk).unbind(1)
    tot4 = [None] * N if tot is None else tot.view(BH, N, tot.shape[-2], 1).unbind(1)
    dS_after = W.new_empty(N, BH, Dk, Dv)
    dU_n, dS_n = PdO.unbind(0), dS_after.unbind(0)
    dS = dS_n[N - 1].copy_(dS)
    for n in range(N - 1, -1, -1):
        dU_n[n].baddbmm_(ke4[n], dS)
        nxt = dS_n[n - 1] if n > 0 else torch.empty_like(dS)
        if tot4[n] is None:
            torch.add(Q4[n], dS, out=nxt)
        else:
            torch.mul(dS, tot4[n], out=nxt).add_(Q4[n])
        dS = nxt.baddbmm_(WT4[n], dU_n[n], alpha=-1.0)                           # written in place: no copy
    return PdO, dS_after, dS


def _rows_key(grp: slice, N: int, device) -> tuple:
    """The index of rows ``grp`` (a slice of the head-major ``B·H·N`` chunks) in a tensor stored
    chunk-major ``(N, B·H, …)``: two slices where the group lies within one head (every group
    does when ``N`` is at least a group's size and a multiple of it), else two index tensors."""
    h0, n0 = divmod(grp.start, N)
    if (grp.stop - 1) // N == h0:
        return slice(n0, n0 + grp.stop - grp.start), h0
    i = torch.arange(grp.start, grp.stop, device=device)
    return i % N, i // N


def _rows(x: Tensor, grp: slice, N: int) -> Tensor:
    """Rows ``grp`` of the chunk-major ``x`` (:func:`_rows_key`): a view within one head, else a copy."""
    return x[_rows_key(grp, N, x.device)]


def _set_rows(x: Tensor, grp: slice, N: int, value: Tensor) -> None:
    """Write ``value`` into rows ``grp`` of the chunk-major ``x`` (:func:`_rows_key`)."""
    x[_rows_key(grp, N, x.device)] = value


def _solve(A, kf, v, b):
    """One group of chunks: ``(M⁻¹, W, Ũ)`` with ``M = I + diag(β) A`` and ``[W, Ũ] = M⁻¹ diag(β) [kf, v]``."""
    M = A * b
    M.diagonal(dim1=-2, dim2=-1).fill_(1.0)                     # A's diagonal is 0
    Minv = _unit_lower_inverse(M)
    return Minv, torch.bmm(Minv, b * kf), torch.bmm(Minv, b * v)


def _solve_backward(dO, U, S_before, dS_after, dU, Minv, A, kf, v, b, dv):
    """One group of chunks: ``(dP, dqf, dke, dA, dkf, d_beta)`` from the scan's ``dU`` and ``dS_after``; the
    gradient of ``v`` is written into ``dv``.

    ``out = Q̃ S_n + P U`` gives ``dP`` (lower) and ``dqf``; ``S' = total S + K̂ᵀ U`` gives ``dke``;
    ``U = Ũ − W S`` and ``[W, Ũ] = M⁻¹ R`` give ``dR = M⁻ᵀ [−dU Sᵀ, dU] = [−dR_v Sᵀ, dR_v]`` and
    ``dM = −dR [W, Ũ]ᵀ = −dR_v (Ũ − W S)ᵀ = −dR_v Uᵀ`` (strictly lower): four matmuls of the
    chunk's size where the literal order takes six. ``M = I + diag(β) A`` and ``R = diag(β) [kf, v]``
    give the rest.
    """
    dP = torch.bmm(dO, U.transpose(1, 2)).tril_()
    dqf = torch.bmm(dO, S_before.transpose(1, 2))
    dke = torch.bmm(U, dS_after.transpose(1, 2))
    dR_v = torch.bmm(Minv.transpose(1, 2), dU)
    dR_k = torch.bmm(dR_v, S_before.transpose(1, 2)).neg_()
    dM = torch.bmm(dR_v, U.transpose(1, 2)).tril_(-1).neg_()
    d_beta = (dM * A).sum(-1, keepdim=True) + (dR_k * kf).sum(-1, keepdim=True) + (dR_v * v).sum(-1, keepdim=True)
    torch.mul(dR_v, b, out=dv)
    return dP, dqf, dke, dM.mul_(b), dR_k.mul_(b), d_beta


def _prefix_scores(q, k, fs, inv, P, A):
    """One group of mild chunks: writes ``P = tril((Q ⊙ fs)(K ⊙ inv)ᵀ)`` and ``A = tril((K ⊙ fs)(K ⊙ inv)ᵀ, −1)``
    (:func:`linattn.ops._decay.prefix_factors`) into ``P`` and ``A``; returns ``K ⊙ fs``."""
    kf, kh = k * fs, k * inv
    torch.bmm(q * fs, kh.transpose(1, 2), out=P).tril_()
    torch.bmm(kf, kh.transpose(1, 2), out=A).tril_(-1)
    return kf


def _prefix_backward(dP, dA, dqf, dkf, dke, c_tot, q, k, kf, ke, fs, inv, te, dq, dk):
    """One group of mild chunks with one gate per key channel: writes ``dq`` and ``dk`` and returns ``dg``
    when ``P = (Q ⊙ fs)(K ⊙ inv)ᵀ`` and ``A = (K ⊙ fs)(K ⊙ inv)ᵀ`` (masked;
    :func:`linattn.ops._decay.prefix_factors`), from :func:`_solve_backward`'s outputs.

    ``dP``, ``dA`` are masked already; ``dqf``, ``dkf`` and ``dke`` are overwritten.
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
    """One group of mild chunks with one gate per head: writes ``dq`` and ``dk``, returns ``dg``.

    As :func:`_prefix_backward`, but a per-head decay ``fs_t · inv_s`` is one number per pair of
    tokens, so ``P = (Q Kᵀ) ⊙ F`` and ``A = (K Kᵀ) ⊙ F`` with ``F = fs invᵀ`` (masked), and ``K Kᵀ``
    is symmetric: ``dK`` takes ``(dA ⊙ F + (dA ⊙ F)ᵀ) K`` (one matmul where the rescaled form takes
    two). The gates' share: ``d fs ⊙ fs`` sums ``dP ⊙ P + dA ⊙ A`` along rows, ``d inv ⊙ inv``
    along columns. ``P``, ``A`` are the saved decayed scores; ``dP``, ``dA`` (masked) are overwritten.
    """
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
    """The WY chunk form with one gate per head (log-gates ``g``) or none, and a hand-written backward.

    The work inside chunks runs on groups of chunks (:func:`linattn.ops._decay.groups`) whose
    temporaries stay in the CPU's cache; kept are ``Q Kᵀ``, ``K Kᵀ`` (decayed in groups of mild
    decay), the decay factors, ``M⁻¹``, ``W``, ``U`` and the chunk start states. Between the groups, the scan over chunks
    (``B·H`` at a time).
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, g):
        B, H, N, C, Dk = k.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        gated = g is not None
        q3, k3, v3, b3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta))
        g3 = g.reshape(BHN, C, 1) if gated else None
        QK, KK, Minv = (q3.new_empty(BHN, C, C) for _ in range(3))
        W, Ut = q3.new_empty(BHN, C, Dk), q3.new_empty(N, BH, C, Dv)     # Ũ (then U) chunk-major
        ke, tot = (q3.new_empty(BHN, C, Dk), q3.new_empty(BHN, 1, 1)) if gated else (k3, None)
        fs, te = (q3.new_empty(BHN, C, 1), q3.new_empty(BHN, C, 1)) if gated else (None, None)
        parts = groups(BHN, C * max(C, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3) if gated else [False] * len(parts)
        D = q3.new_empty(BHN, C, C) if gated and not all(mild) else None     # only the range groups use them
        inv = q3.new_empty(BHN, C, 1) if any(mild) else None                 # only the prefix groups
        for grp, prefix in zip(parts, mild):
            k_g = k3[grp]
            if prefix:      # mild decay: QK and KK hold the decayed scores (q ⊙ fs)(k ⊙ inv)ᵀ, (k ⊙ fs)(k ⊙ inv)ᵀ
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                kf = _prefix_scores(q3[grp], k_g, fs[grp], inv[grp], QK[grp], KK[grp])
                A = KK[grp]
            else:
                torch.bmm(q3[grp], k_g.transpose(1, 2), out=QK[grp]).tril_()   # tril_ first: an overflowing
                torch.bmm(k_g, k_g.transpose(1, 2), out=KK[grp]).tril_(-1)      # later score times 0 is NaN
                if gated:
                    D[grp], fs[grp], te[grp], tot[grp] = scalar_decay(g3[grp])
                    A, kf = KK[grp] * D[grp], k_g * fs[grp]
                else:
                    A, kf = KK[grp], k_g
            if gated:
                torch.mul(k_g, te[grp], out=ke[grp])
            Minv[grp], W[grp], Ut_g = _solve(A, kf, v3[grp], b3[grp])
            _set_rows(Ut, grp, N, Ut_g)
        U, S_before, S = _scan(W, Ut, ke, tot, S0, BH, N)
        out = q3.new_empty(BHN, C, Dv)
        for grp, prefix in zip(parts, mild):
            if gated:
                P, qf = QK[grp] if prefix else QK[grp] * D[grp], q3[grp] * fs[grp]
            else:
                P, qf = QK[grp], q3[grp]
            torch.baddbmm(torch.bmm(qf, _rows(S_before, grp, N)), P, _rows(U, grp, N), out=out[grp])
        ctx.shape, ctx.mild, ctx.parts = (B, H, N, C, Dk, Dv), mild, parts   # the backward takes the same groups
        ctx.save_for_backward(q, k, v, beta, S0, g, QK, KK, Minv, W, U, S_before, D, fs, te, tot, inv,
                              ke if gated else None)
        return out.view(B, H, N, C, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, g, QK, KK, Minv, W, U, S_before, D, fs, te, tot, inv, ke = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a second derivative): the stored intermediates are constants to
            # autograd, so differentiate the same equations op by op instead, from the inputs.
            return differentiable_backward(_forward, (q, k, v, beta, S0, g), d_out, d_S)
        B, H, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * H, B * H * N
        gated = g is not None
        q3, k3, v3, b3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta))
        g3 = g.reshape(BHN, C, 1) if gated else None
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        PdO, QdO = q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, Dk, Dv)   # Pᵀ dO chunk-major
        ke = ke if gated else k3                                             # K ⊙ to_end, kept from the forward pass
        for grp, prefix in zip(parts, ctx.mild):
            if gated:
                P, qf = QK[grp] if prefix else QK[grp] * D[grp], q3[grp] * fs[grp]
            else:
                P, qf = QK[grp], q3[grp]
            _set_rows(PdO, grp, N, torch.bmm(P.transpose(1, 2), dO[grp]))
            torch.bmm(qf.transpose(1, 2), dO[grp], out=QdO[grp])
        dU, dS_after, dS0 = _scan_backward(PdO, QdO, W, ke, tot, dS, BH, N)
        del QdO
        dq, dk, dv, d_beta = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3), torch.empty_like(b3)
        dg = torch.empty_like(g3) if gated else None
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g = q3[grp], k3[grp]
            U_g, Sb_g, dU_g, dSa_g = (_rows(x, grp, N) for x in (U, S_before, dU, dS_after))
            if gated:
                D_g, fs_g, te_g = None if prefix else D[grp], fs[grp], te[grp]
                kf, A = k_g * fs_g, KK[grp] if prefix else KK[grp] * D_g
            else:
                kf, A = k_g, KK[grp]
            dP, dqf, dke, dA, dkf, d_beta[grp] = _solve_backward(
                dO[grp], U_g, Sb_g, dSa_g, dU_g, Minv[grp], A, kf, v3[grp], b3[grp], dv[grp])
            c_tot = (Sb_g * dSa_g).sum((-1, -2)).view(-1, 1, 1).mul_(tot[grp]) if gated else None
            if prefix:
                dg[grp] = _prefix_backward_head(dP, dA, dqf, dkf, dke, c_tot, q_g, k_g, QK[grp], KK[grp], fs_g,
                                                inv[grp], te_g, ke[grp], dq[grp], dk[grp])
                continue
            dKK = dA
            if gated:
                e_D = (dP * QK[grp]).add_(dKK * KK[grp]).mul_(D_g)           # d D ⊙ D
                dQK, dKK = dP.mul_(D_g), dKK.mul_(D_g)
            else:
                dQK = dP
            dk_g = torch.bmm(dQK.transpose(1, 2), q_g).baddbmm_(dKK + dKK.transpose(1, 2), k_g)   # both sides of K Kᵀ
            if gated:
                torch.baddbmm(dqf * fs_g, dQK, k_g, out=dq[grp])
                dk[grp] = dk_g.addcmul_(dke, te_g).addcmul_(dkf, fs_g)
                a_fs = ((dqf * q_g).sum(-1, keepdim=True) + (dkf * k_g).sum(-1, keepdim=True)).mul_(fs_g)
                b_te = (dke * k_g).sum(-1, keepdim=True).mul_(te_g)
                dg[grp] = scalar_decay_backward(e_D, a_fs, b_te, c_tot)
            else:
                torch.baddbmm(dqf, dQK, k_g, out=dq[grp])
                dk[grp] = dk_g.add_(dke).add_(dkf)
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), d_beta.view(*shape, 1),
                dS0.view(B, H, Dk, Dv), None if dg is None else dg.view(*shape, 1))


class _WYChannelChunk(torch.autograd.Function):
    """The WY chunk form with one gate per key channel and a hand-written backward.

    The scores ``P`` and ``A`` are built and differentiated by :mod:`linattn.ops._decay`'s fast
    path, or in groups of mild decay as two matmuls of rescaled queries and keys, on groups of
    chunks as in :class:`_WYChunk`; saved: the inputs, the scores, the decays from and to the
    chunk's ends (and ``e^{−b}`` for mild groups), ``M⁻¹``, ``W``, ``U`` and the chunk start states.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, g):
        B, H, N, C, Dk = k.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3, g3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta, g))
        P, A, Minv = (q3.new_empty(BHN, C, C) for _ in range(3))
        W, Ut, ke = q3.new_empty(BHN, C, Dk), q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, C, Dk)
        fs, te, tot = torch.empty_like(k3), torch.empty_like(k3), k3.new_empty(BHN, 1, Dk)
        parts = groups(BHN, C * max(C, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3)
        inv = torch.empty_like(k3) if any(mild) else None
        for grp, prefix in zip(parts, mild):
            k_g = k3[grp]
            if prefix:
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                kf = _prefix_scores(q3[grp], k_g, fs[grp], inv[grp], P[grp], A[grp])
            else:
                P[grp], products = scores_fast(q3[grp], k_g, False, g3[grp])
                A[grp], _ = scores_fast(k_g, k_g, True, g3[grp])
                fs[grp], te[grp], tot[grp] = products.ends()
                kf = k_g * fs[grp]
            torch.mul(k_g, te[grp], out=ke[grp])
            Minv[grp], W[grp], Ut_g = _solve(A[grp], kf, v3[grp], b3[grp])
            _set_rows(Ut, grp, N, Ut_g)
        tot_t = tot.transpose(1, 2)                                       # (BHN, Dk, 1): per key channel
        U, S_before, S = _scan(W, Ut, ke, tot_t, S0, BH, N)
        out = q3.new_empty(BHN, C, Dv)
        for grp in parts:
            torch.baddbmm(torch.bmm(q3[grp] * fs[grp], _rows(S_before, grp, N)), P[grp], _rows(U, grp, N),
                          out=out[grp])
        ctx.shape, ctx.mild, ctx.parts = (B, H, N, C, Dk, Dv), mild, parts   # the backward takes the same groups
        ctx.save_for_backward(q, k, v, beta, S0, g, P, A, fs, te, tot, inv, ke, Minv, W, U, S_before)
        return out.view(B, H, N, C, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, S0, g, P, A, fs, te, tot, inv, ke, Minv, W, U, S_before = ctx.saved_tensors
        if torch.is_grad_enabled():
            return differentiable_backward(_forward_channel, (q, k, v, beta, S0, g), d_out, d_S)
        B, H, N, C, Dk, Dv = ctx.shape
        BH, BHN = B * H, B * H * N
        q3, k3, v3, b3, g3 = (x.reshape(BHN, C, x.shape[-1]) for x in (q, k, v, beta, g))
        dO = v3.new_zeros(BHN, C, Dv) if d_out is None else d_out.reshape(BHN, C, Dv)
        dS = q3.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        PdO, QdO = q3.new_empty(N, BH, C, Dv), q3.new_empty(BHN, Dk, Dv)   # Pᵀ dO chunk-major
        for grp in parts:
            _set_rows(PdO, grp, N, torch.bmm(P[grp].transpose(1, 2), dO[grp]))
            torch.bmm((q3[grp] * fs[grp]).transpose(1, 2), dO[grp], out=QdO[grp])
        dU, dS_after, dS0 = _scan_backward(PdO, QdO, W, ke, tot.transpose(1, 2), dS, BH, N)
        del QdO
        dq, dk, dv, d_beta, dg = (torch.empty_like(x) for x in (q3, k3, v3, b3, g3))
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g, fs_g, te_g = q3[grp], k3[grp], fs[grp], te[grp]
            U_g, Sb_g, dU_g, dSa_g = (_rows(x, grp, N) for x in (U, S_before, dU, dS_after))
            kf = k_g * fs_g
            dP, dqf, dke, dA, dkf, d_beta[grp] = _solve_backward(
                dO[grp], U_g, Sb_g, dSa_g, dU_g, Minv[grp], A[grp], kf, v3[grp], b3[grp], dv[grp])
            c_tot = (Sb_g * dSa_g).sum(-1).unsqueeze(-2).mul_(tot[grp])   # d total ⊙ total
            if prefix:
                dg[grp] = _prefix_backward(dP, dA, dqf, dkf, dke, c_tot, q_g, k_g, kf, ke[grp], fs_g, inv[grp], te_g,
                                           dq[grp], dk[grp])
                continue
            dq_g, dk_p, a_p, b_p, _ = scores_fast_backward(dP, q_g, k_g, False, g3[grp])
            dk_x, dk_y, a_a, b_a, _ = scores_fast_backward(dA, k_g, k_g, True, g3[grp])
            dq[grp] = dq_g.addcmul_(dqf, fs_g)
            dk[grp] = dk_p.add_(dk_x).add_(dk_y).addcmul_(dke, te_g).addcmul_(dkf, fs_g)
            a_levels = [x.add_(y) for x, y in zip(a_p, a_a)]
            b_levels = [None if x is None else x.add_(y) for x, y in zip(b_p, b_a)]
            a_fs = dqf.mul_(q_g).mul_(fs_g).addcmul_(dkf, kf)                 # d from_start ⊙ from_start
            dg[grp] = level_products_backward(a_fs, dke.mul_(ke[grp]), c_tot, a_levels, b_levels)
        shape = (B, H, N, C)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), d_beta.view(*shape, 1),
                dS0.view(B, H, Dk, Dv), dg.view(*shape, Dk))


def _use_op_by_op(inputs) -> bool:
    """The op-by-op form: only where autograd must see every operation.

    Without a gradient to compute (``torch.no_grad``, inference) the Functions run too: their
    forward pass is the fast one (blocked inverse, groups in cache, the prefix form), and
    nothing is kept once the call returns.
    """
    return autograd_must_see_every_op(*inputs)


def wy_chunk(q, k, v, beta, S0, g=None) -> tuple[Tensor, Tensor]:
    """``(out (B, H, N, C, Dv), S_final)`` of the WY chunk form with one gate per head (log-gates ``g`` ``(B, H, N, C, 1)``) or none.

    Through :class:`_WYChunk`, with or without gradients, except under ``torch.func`` transforms,
    ``torch.compile`` and forward-mode AD, where autograd differentiates the same equations op by op.
    """
    inputs = (q, k, v, beta, S0, g)
    return _forward(*inputs) if _use_op_by_op(inputs) else _WYChunk.apply(*inputs)


def wy_chunk_channel(q, k, v, beta, S0, g) -> tuple[Tensor, Tensor]:
    """``(out, S_final)`` of the WY chunk form with per-channel log-gates ``g`` ``(B, H, N, C, Dk)`` (``C`` a power of two).

    Through :class:`_WYChannelChunk`, or op by op (:func:`_forward_channel`) as in :func:`wy_chunk`.
    """
    inputs = (q, k, v, beta, S0, g)
    return _forward_channel(*inputs) if _use_op_by_op(inputs) else _WYChannelChunk.apply(*inputs)
