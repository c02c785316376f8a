"""Per-channel decay inside a chunk: products of gates, the decayed scores, and GLA's chunk form (private).

With log-gates ``g`` of a chunk of ``Cp`` tokens (a power of two, :func:`padded_chunk`) and
gates ``α_r = exp(g_r) <= 1``, every decay factor is the product of the gates over its own
range, never a quotient ``exp(b_t) / exp(b_s)`` of cumulative decays (whose exponents are
positive and overflow: a chunk form that writes ``e^{b_t} · e^{−b_s}`` overflows for per-token
decays of ``e^-3`` at ``C = 64``):

- ``from_start[t] = Π_{r<=t} α_r``, ``to_end[s] = Π_{r>s} α_r``, ``total = Π_r α_r``;
- the scores ``A[t, s] = Σ_d x_td y_sd Π_{s<r<=t} α_rd`` (``s <= t``) by halving the chunk:
  at the level of blocks of ``2w`` tokens the keys ``s`` of a block's earlier half meet the
  queries ``t`` of its later half (first token ``h``), and the range ``s < r <= t`` splits at
  ``h`` into ``Π_{h<=r<=t} α_r`` (``later``, from the later half's start) and ``Π_{s<r<h} α_r``
  (``earlier``, to the earlier half's end). Those ``w × w`` scores are one matmul,
  ``(x ⊙ later) (y ⊙ earlier)ᵀ``, batched over the level's blocks; every score below the
  diagonal lies in exactly one such block, and the diagonal is ``x_t · y_t``: ``log2(Cp)``
  levels of matmuls, ``~Cp·Dk/2`` multiply-adds per token.

Each level's products come from the previous level's by multiplying by the product over the
adjacent half-block, a disjoint range (:class:`LevelProducts`): every factor is a product of
numbers ``<= 1`` (a decay strong enough to underflow gives 0, never ``inf`` or NaN), a factor
over an empty range is the constant 1, and the gradient of a log-gate, the sum over the
factors whose range holds it of ``d factor ⊙ factor``, is a sum of terms that each carry their
own decay, with no cancellation of large terms (a difference of cumulative sums makes the
gradient of a gate of ``1e-12`` rounding noise in float32). This is the "segsum" of Mamba-2
(Dao & Gu, 2024) organised like the secondary chunking of GLA (Yang, Wang, Shen, Panda & Kim,
2024, arXiv:2312.06635), applied at every scale.

For chunks of mild total decay the scores are also one matmul of the queries and keys rescaled
by the cumulative decays (:func:`prefix_factors`, see below); each group of chunks takes one
form or the other (:func:`mild_groups`).

GLA's chunk form (:class:`_GLAChunk`) has a hand-written backward pass; under ``torch.func``
transforms, ``torch.compile`` and forward-mode AD, and for second derivatives, autograd
differentiates the same equations op by op (:func:`decay_factors`, :func:`scores_by_cat`,
:func:`gla_chunk_ops`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._numerics import compiling
from ._common import differentiable_backward


def padded_chunk(C: int) -> int:
    """Tokens per chunk of the per-channel gated chunk forms (GLA, gated delta): ``C`` rounded up to a power of two.

    The scores halve each chunk down to single tokens, so a chunk holds a power of two
    tokens; the padding has ``q = k = v = 0`` and ``log_g = 0`` and changes nothing.
    """
    return 1 << (C - 1).bit_length()


# --------------------------------------------------------------------------- the products, op by op


def _halves(x: Tensor, w: int) -> tuple[Tensor, Tensor]:
    """``x`` ``(…, Cp, D)`` as the earlier and later halves of its blocks of ``2w`` tokens, views ``(…, m, w, D)``."""
    *lead, Cp, D = x.shape
    first, second = x.view(*lead, Cp // (2 * w), 2, w, D).unbind(-3)
    return first, second


def decay_factors(g: Tensor) -> tuple[Tensor, Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """``(from_start, to_end, total, levels)`` of log-gates ``g`` ``(…, Cp, Dg)``, op by op (differentiable).

    ``from_start``, ``to_end`` ``(…, Cp, Dg)``, ``total`` ``(…, 1, Dg)``; ``levels[i]`` is the pair
    ``(later, earlier)`` ``(…, Cp / 2^(i+1), 2^i, Dg)`` of blocks of ``2^(i+1)`` tokens (see the
    module docstring). The same products as :class:`LevelProducts`, built by concatenation.
    """
    *lead, Cp, Dg = g.shape
    if Cp & (Cp - 1):
        raise ValueError(f"the decayed scores need a power-of-two chunk, got {Cp} tokens")
    incl = g.exp()                                  # products from a block's start (inclusive)
    excl = None                                     # products to a block's end (exclusive); None: 1
    tot = incl.unsqueeze(-2)                        # (…, m, 1, Dg): products over blocks
    levels = []
    w = 1
    while w < Cp:
        m = Cp // (2 * w)
        i_first, i_second = _halves(incl, w)
        t_first, t_second = tot.reshape(*lead, m, 2, 1, Dg).unbind(-3)
        if excl is None:
            levels.append((i_second, torch.ones_like(i_second)))
            excl = torch.cat([t_second.expand_as(i_first), torch.ones_like(i_first)], dim=-2)
        else:
            e_first, e_second = _halves(excl, w)
            levels.append((i_second, e_first))
            excl = torch.cat([e_first * t_second, e_second], dim=-2)
        incl = torch.cat([i_first, i_second * t_first], dim=-2).reshape(*lead, Cp, Dg)
        excl = excl.reshape(*lead, Cp, Dg)
        tot = t_first * t_second
        w *= 2
    to_end = torch.ones_like(incl) if excl is None else excl
    return incl, to_end, tot.reshape(*lead, 1, Dg), levels


# --------------------------------------------------------------------------- the fast path (no autograd)
#
# Autograd keeps every intermediate of a forward pass alive until the backward pass, and on
# the CPU a freshly allocated tensor that stays alive costs its first-touch page faults: 0.76 ms
# for a 4 MB product that is kept against 0.04 ms for one whose memory is reused (measured,
# 1 thread). So the hand-written passes below keep only what they must (the scores and the
# chunk start states) and recompute each level's factors where they are used, level by level,
# in temporaries that are freed at once.


class LevelProducts:
    """The products of the gates ``exp(g)`` (``g`` ``(…, Cp, Dk)``) built level by level, in place (no autograd).

    Iterating yields ``(w, later, earlier)`` for ``w = 1, 2, …, Cp/2`` (``earlier`` is None, i.e.
    1, for ``w = 1``); they are views that the next step overwrites, so use them at once. Each
    level's products come from the previous level's by multiplying by the product over the
    adjacent half-block (a disjoint range): products from a block's start ``incl`` (inclusive),
    to its end ``excl`` (exclusive) and over it ``tot``. After the iteration they cover whole
    chunks: :meth:`ends` gives ``(from_start, to_end, total)``.
    """

    def __init__(self, g: Tensor) -> None:
        *self.lead, self.Cp, self.Dk = g.shape
        self.incl, self.tot = g.exp(), None
        self.excl = torch.ones_like(self.incl)

    def __iter__(self):
        w, tot = 1, self.incl.unsqueeze(-2)                                  # (…, m, 1, Dk)
        while w < self.Cp:
            (_, incl_later), (excl_earlier, _) = _halves(self.incl, w), _halves(self.excl, w)
            tot_first, tot_second = tot.reshape(*self.lead, self.Cp // (2 * w), 2, 1, self.Dk).unbind(-3)
            yield w, incl_later, (None if w == 1 else excl_earlier)
            tot = tot_first * tot_second
            excl_earlier *= tot_second                                       # now to the 2w-block's end
            incl_later *= tot_first                                          # now from the 2w-block's start
            w *= 2
        self.tot = tot

    def ends(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(from_start, to_end, total (…, 1, Dk))`` of whole chunks (after the iteration)."""
        return self.incl, self.excl, self.tot.reshape(*self.lead, 1, self.Dk)


def level_products_backward(a_from_start: Tensor, b_to_end: Tensor, c_total: Tensor, a_levels, b_levels) -> Tensor:
    """The gradient of ``g`` from ``d factor ⊙ factor`` of every factor of :class:`LevelProducts`.

    ``a_from_start``, ``b_to_end`` ``(…, Cp, Dk)``, ``c_total`` ``(…, 1, Dk)``; ``a_levels[i]``,
    ``b_levels[i]`` ``(…, m, w, Dk)`` for ``later`` and ``earlier`` of level ``w = 2^i`` (``b`` None
    for ``w = 1``). In log space the products are sums; this is the transpose of those additions, from the top
    level down: a block's total receives the sums of the gradients of the sums it was added to. Every
    gradient is a sum of terms that each carry their own decay factor (no cancellation).
    """
    *lead, Cp, Dk = a_from_start.shape
    G_incl, G_excl, G_tot = a_from_start, b_to_end, c_total.unsqueeze(-2)            # G_tot: (…, m, 1, Dk)
    w = Cp // 2
    for a, b in zip(reversed(a_levels), reversed(b_levels)):
        m = Cp // (2 * w)
        (_, gi_later), (ge_earlier, _) = _halves(G_incl, w), _halves(G_excl, w)
        G_tot = torch.stack([G_tot + gi_later.sum(-2, keepdim=True), G_tot + ge_earlier.sum(-2, keepdim=True)],
                            dim=-3).reshape(*lead, 2 * m, 1, Dk)
        gi_later += a
        if b is not None:
            ge_earlier += b
        w //= 2
    return G_incl + G_tot.reshape(*lead, Cp, Dk)


def scores_fast(x: Tensor, y: Tensor, strict: bool, g: Tensor) -> tuple[Tensor, LevelProducts]:
    """``(A, products)``: the scores ``(…, Cp, Cp)`` ``Σ_d x_td y_sd Π_{s<r<=t} α_rd`` for ``s <= t``
    (``s < t`` if ``strict``, 0 above the diagonal) from the log-gates ``g`` ``(…, Cp, Dk)``.

    ``x``, ``y`` ``(…, Cp, Dk)`` finite. Each level's blocks are written into one buffer as its
    factors are built; the entries above the diagonal are exact zeros, never products with
    later tokens' values (which could overflow). Also returns the finished
    :class:`LevelProducts` (for its :meth:`~LevelProducts.ends`).
    """
    *lead, Cp, Dk = x.shape
    A = x.new_zeros(*lead, Cp, Cp)
    if not strict:
        A.diagonal(dim1=-2, dim2=-1).copy_((x * y).sum(-1))
    products = LevelProducts(g)
    for w, later, earlier in products:
        (_, x2), (y1, _) = _halves(x, w), _halves(y, w)
        xl = x2 * later
        ye = y1 if earlier is None else y1 * earlier
        below = (xl * ye).sum(-1, keepdim=True) if w == 1 else xl @ ye.transpose(-1, -2)   # (…, m, w, w)
        _block_below(A, w).copy_(below)
    return A, products


def scores_fast_backward(dA: Tensor, x: Tensor, y: Tensor, strict: bool, g: Tensor):
    """``(dx, dy, a_levels, b_levels, products)`` of :func:`scores_fast` (see :func:`level_products_backward`).

    Per level, from the block ``dB`` of ``dA``: ``d(x ⊙ later) = dB (y ⊙ earlier)`` and
    ``d(y ⊙ earlier) = dBᵀ (x ⊙ later)``; then ``d later ⊙ later = d(x ⊙ later) ⊙ (x ⊙ later)``
    (likewise ``earlier``). Only the lower blocks and the diagonal of ``dA`` are read.
    """
    if strict:
        dx, dy = torch.zeros_like(x), torch.zeros_like(y)
    else:
        diag = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)                    # (…, Cp, 1)
        dx, dy = diag * y, diag * x
    a_levels, b_levels = [], []
    products = LevelProducts(g)
    for w, later, earlier in products:
        (_, x2), (y1, _) = _halves(x, w), _halves(y, w)
        (_, dx2), (dy1, _) = _halves(dx, w), _halves(dy, w)
        xl = x2 * later
        ye = y1 if earlier is None else y1 * earlier
        dB = _block_below(dA, w)                                              # (…, m, w, w)
        if w == 1:
            d_xl, d_ye = dB * ye, dB * xl
        else:
            d_xl, d_ye = dB @ ye, dB.transpose(-1, -2) @ xl
        dx2.addcmul_(d_xl, later)
        a_levels.append(d_xl.mul_(xl))
        if earlier is None:
            dy1 += d_ye
            b_levels.append(None)
        else:
            dy1.addcmul_(d_ye, earlier)
            b_levels.append(d_ye.mul_(ye))
    return dx, dy, a_levels, b_levels, products


GROUP_NUMBERS = 1 << 17


def groups(n: int, per_item: int) -> list[slice]:
    """Slices of ``range(n)`` holding about ``GROUP_NUMBERS`` numbers of ``per_item`` each.

    The level-by-level passes make several element-wise sweeps over tensors of the batch's size;
    run on groups of chunks whose temporaries stay in the CPU's cache, each sweep costs a
    fraction of one through main memory.
    """
    size = max(1, GROUP_NUMBERS // per_item)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# --------------------------------------------------------------------------- mild decays: prefix factors

# Where a chunk's total decay is mild, the products over ranges need not be built range by
# range: with ``b_t = Σ_{r<=t} g_r`` the decayed scores are ``(x ⊙ e^{b}) (y ⊙ e^{−b})ᵀ``, one
# matmul (the chunk form of Katharopoulos et al. with the gates folded into the features, as
# in the chunkwise form of Yang et al., 2024, arXiv:2312.06635, before its secondary chunking). Its factors
# stay in ``[e^{−R}, e^{R}]`` for a chunk whose total log-decay is ``−R``, so for ``R <=
# MILD_DECAY`` nothing overflows, and a factor ``e^{b_t − b_s}`` carries a rounding error of
# about ``2R`` units (the cumulative sum's and the exponentials'): at ``R = 16`` float32's
# ``~2e-6`` relative, the size of a 64-term dot product's rounding. Chunks whose decay is
# stronger take the range-by-range products above, whose every factor is ``<= 1``.

MILD_DECAY = 16.0
MILD_GATE = 1.0
# A single strong gate inside a chunk is the other limit: the gradient of its log-gate, a sum over
# the pairs of tokens on either side of it, each carrying its factor e^{g_r}, comes out of the
# prefix form as a difference of sums over all pairs, so its relative error grows like e^{|g_r|}
# (measured, float32, one gate of e^{-1} among gates of e^{-0.01}: 2e-4 of that gradient against
# 9e-6 for the ranges; e^{-10}: 0.3). So every log-gate of a prefix chunk is ``>= −MILD_GATE``.


def mild_groups(parts: list[slice], g: Tensor, x: Tensor, y: Tensor) -> list[bool]:
    """Per group of chunks: may it use :func:`prefix_factors`? (every chunk's total log-decay
    ``−Σ g >= −MILD_DECAY`` in every channel, every log-gate ``>= −MILD_GATE``, and ``Dk · max|x|
    · max|y| · e^{MILD_DECAY}`` far below the dtype's largest number, so no score overflows;
    a gradient overflows only where the true one is within ``e^{MILD_DECAY}`` of overflowing).

    The choice is per group of chunks (:func:`groups`), so the last bits of a chunk's results
    can depend on the other chunks of its group.

    ``g`` ``(n, C, 1 or Dk)``, ``x``, ``y`` ``(n, C, Dk)``; one host synchronisation. Non-finite
    entries of ``x`` and ``y`` do not count: the choice stays that of the finite inputs, so the
    outputs before a NaN are bit for bit those without it (:func:`linattn.ops._common.run`).
    """
    depth = g.sum(1).amin(-1).neg()                                         # (n,): −(Σ_r g_r), worst channel
    strongest = g.reshape(g.shape[0], -1).amin(1).neg()                      # (n,): the largest −g_r
    size = _finite_max(x) * _finite_max(y) * x.shape[-1]
    limit = torch.finfo(x.dtype).max * math.exp(-3 * MILD_DECAY)
    ok = ((depth <= MILD_DECAY) & (strongest <= MILD_GATE) & (size <= limit)).tolist()
    return [all(ok[grp]) for grp in parts]


def _finite_max(x: Tensor) -> Tensor:
    """``max |x|`` over the finite entries of each chunk of ``x`` ``(n, C, D)``: ``(n,)``.

    Two reductions without a temporary; only a chunk with a non-finite entry takes a second pass.
    """
    flat = x.reshape(x.shape[0], -1)
    m = torch.maximum(flat.amax(1), flat.amin(1).neg())                  # (aminmax is 20x slower on the CPU)
    bad = ~torch.isfinite(m)
    if bad.any():
        m[bad] = x[bad].abs().nan_to_num_(nan=0.0, posinf=0.0).amax((1, 2))
    return m


def prefix_factors(g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(from_start, inverse, to_end, total)`` of chunks of log-gates ``g`` ``(n, C, Dg)`` with mild decay (no autograd).

    With ``b_t = Σ_{r<=t} g_r``: ``e^{b_t}``, ``e^{−b_t}``, ``e^{b_C − b_t}`` ``(n, C, Dg)`` and
    ``e^{b_C}`` ``(n, 1, Dg)``; the decay between tokens is ``from_start[t] · inverse[s]``.
    Only for the groups :func:`mild_groups` allows.
    """
    b = g.cumsum(1)
    last = b[:, -1:]
    return b.exp(), b.neg().exp(), (last - b).exp_(), last.exp()


def prefix_factors_backward(a_from_start: Tensor, b_inverse: Tensor, b_to_end: Tensor, c_total: Tensor) -> Tensor:
    """The gradient of ``g`` from ``d factor ⊙ factor`` of :func:`prefix_factors`' outputs (same shapes).

    ``∂/∂b_t`` is ``a_t − b_inverse_t − b_to_end_t``, and ``b_C`` also receives ``Σ_t b_to_end_t +
    c_total``; ``g_r`` gets the sum of ``∂/∂b_t`` over ``t >= r`` (a reversed cumulative sum).
    """
    db = a_from_start - b_inverse - b_to_end
    db[:, -1:] += b_to_end.sum(1, keepdim=True) + c_total
    return db.flip(1).cumsum(1).flip(1)


# --------------------------------------------------------------------------- the decayed scores


def _block_below(A: Tensor, w: int) -> Tensor:
    """The view ``(…, m, w, w)`` of ``A`` ``(…, Cp, Cp)``: in each block of ``2w`` tokens, the later half's rows and the earlier half's columns."""
    *lead, Cp, _ = A.shape
    m, nd = Cp // (2 * w), len(lead)
    blocks = A.view(*lead, m, 2, w, m, 2, w).diagonal(dim1=nd, dim2=nd + 3)   # (…, 2, w, 2, w, m)
    return blocks[..., 1, :, 0, :, :].movedim(-1, -3)


def scores_by_cat(x: Tensor, y: Tensor, strict: bool, levels) -> Tensor:
    """The scores of :func:`scores_fast` from :func:`decay_factors`' levels, built by concatenation (differentiable op by op)."""
    *lead, Cp, Dk = x.shape
    A = x.new_zeros(*lead, Cp, 1, 1) if strict else (x * y).sum(-1).reshape(*lead, Cp, 1, 1)
    w = 1
    for later, earlier in levels:
        (_, x2), (y1, _) = _halves(x, w), _halves(y, w)
        below = (x2 * later) @ (y1 * earlier).transpose(-1, -2)               # (…, m, w, w)
        upper, lower = A.reshape(*lead, Cp // (2 * w), 2, w, w).unbind(-3)
        A = torch.cat([torch.cat([upper, torch.zeros_like(below)], dim=-1),
                       torch.cat([below, lower], dim=-1)], dim=-2)            # (…, m, 2w, 2w)
        w *= 2
    return A.reshape(*lead, Cp, Cp)


def autograd_must_see_every_op(*tensors: Optional[Tensor]) -> bool:
    """Autograd must see every operation: ``torch.func`` transforms, ``torch.compile``, or a forward-mode dual."""
    return (compiling() or torch._C._are_functorch_transforms_active()
            or any(t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors))


# --------------------------------------------------------------------------- GLA's chunk form


def gla_chunk_ops(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """GLA's chunk form op by op (differentiable by autograd): ``(out (B, H, N, Cp, Dv), S_final)``.

    ``q, k, g`` ``(B, H, N, Cp, Dk)``, ``v`` ``(…, Cp, Dv)``, ``S0`` ``(B, H, Dk, Dv)``. Per chunk:
    ``O = A V + (Q ⊙ from_start) S``, ``S' = diag(total) S + (K ⊙ to_end)ᵀ V``.
    """
    from_start, to_end, total, levels = decay_factors(g)
    A = scores_by_cat(q, k, False, levels)
    U = (k * to_end).transpose(-1, -2) @ v                                    # (B, H, N, Dk, Dv)
    S, before = S0, []
    for d, u in zip(total.transpose(-1, -2).unbind(2), U.unbind(2)):          # d: (B, H, Dk, 1)
        before.append(S)
        S = d * S + u
    return A @ v + (q * from_start) @ torch.stack(before, dim=2), S


class _GLAChunk(torch.autograd.Function):
    """GLA's chunk form (:func:`gla_chunk_ops`) with a hand-written backward.

    Saved: the inputs, the scores ``A`` (``Cp`` numbers per token) and the chunk start states;
    the decay factors are recomputed (element-wise, see the fast path above). It runs on
    ``(B·H·N, Cp, ·)`` views; only the passage of the state (forward) and of its gradient
    (backward) is a loop over chunks. A backward pass that must itself be differentiable
    (``create_graph=True``) differentiates :func:`gla_chunk_ops` instead.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, S0):
        B, H, N, Cp, Dk = q.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        q3, k3, g3, v3 = (x.reshape(BHN, Cp, x.shape[-1]) for x in (q, k, g, v))
        A = q3.new_empty(BHN, Cp, Cp)
        fs, te, tot = torch.empty_like(q3), torch.empty_like(q3), q3.new_empty(BHN, 1, Dk)
        U = q3.new_empty(BHN, Dk, Dv)
        parts = groups(BHN, Cp * max(Cp, Dk, Dv))
        mild = mild_groups(parts, g3, q3, k3)
        inv = torch.empty_like(q3) if any(mild) else None
        for grp, prefix in zip(parts, mild):
            if prefix:
                fs[grp], inv[grp], te[grp], tot[grp] = prefix_factors(g3[grp])
                torch.bmm(q3[grp] * fs[grp], (k3[grp] * inv[grp]).transpose(1, 2), out=A[grp]).tril_()
            else:
                A[grp], products = scores_fast(q3[grp], k3[grp], False, g3[grp])
                fs[grp], te[grp], tot[grp] = products.ends()
            torch.bmm((k3[grp] * te[grp]).transpose(1, 2), v3[grp], out=U[grp])
        U4, tot4 = U.view(BH, N, Dk, Dv), tot.view(BH, N, Dk, 1)
        S_before = U.new_empty(BH, N, Dk, Dv)
        S = S0.reshape(BH, Dk, Dv)
        for n in range(N):
            S_before[:, n] = S
            S = torch.addcmul(U4[:, n], tot4[:, n], S)
        del U, U4
        Sb3 = S_before.view(BHN, Dk, Dv)
        out = q3.new_empty(BHN, Cp, Dv)
        for grp in parts:
            torch.baddbmm(torch.bmm(A[grp], v3[grp]), q3[grp] * fs[grp], Sb3[grp], out=out[grp])
        ctx.mild, ctx.parts = mild, parts        # the backward takes the same groups
        ctx.save_for_backward(q, k, v, g, S0, A, S_before, fs, te, tot, inv)
        return out.view(B, H, N, Cp, Dv), S.view(B, H, Dk, Dv)

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, g, S0, A, S_before, fs, te, tot, inv = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the stored intermediates are constants to autograd, so
            # differentiate the same equations op by op instead, from the inputs.
            return differentiable_backward(gla_chunk_ops, (q, k, v, g, S0), d_out, d_S)
        B, H, N, Cp, Dk = q.shape
        Dv = v.shape[-1]
        BH, BHN = B * H, B * H * N
        q3, k3, g3, v3 = (x.reshape(BHN, Cp, x.shape[-1]) for x in (q, k, g, v))
        dO = v3.new_zeros(BHN, Cp, Dv) if d_out is None else d_out.reshape(BHN, Cp, Dv)
        dS = S_before.new_zeros(BH, Dk, Dv) if d_S is None else d_S.reshape(BH, Dk, Dv)
        parts = ctx.parts                    # the forward's groups, whatever GROUP_NUMBERS is now
        QdO = q3.new_empty(BHN, Dk, Dv)
        for grp in parts:
            torch.bmm((q3[grp] * fs[grp]).transpose(1, 2), dO[grp], out=QdO[grp])
        QdO4, tot4 = QdO.view(BH, N, Dk, Dv), tot.view(BH, N, Dk, 1)
        dS_after = S_before.new_empty(BH, N, Dk, Dv)                          # d loss / d (state after chunk n)
        for n in range(N - 1, -1, -1):
            dS_after[:, n] = dS
            dS = torch.addcmul(QdO4[:, n], tot4[:, n], dS)
        del QdO, QdO4
        Sb3, dSa3 = S_before.view(BHN, Dk, Dv), dS_after.view(BHN, Dk, Dv)
        dq, dk, dg, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(g3), torch.empty_like(v3)
        for grp, prefix in zip(parts, ctx.mild):
            q_g, k_g, v_g, dO_g, Sb_g, dSa_g = q3[grp], k3[grp], v3[grp], dO[grp], Sb3[grp], dSa3[grp]
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
                dq[grp] = dqf * fs_g
                dk[grp] = torch.addcmul(dkh * inv_g, dke, te_g)
                dg[grp] = prefix_factors_backward(dqf.mul_(qf), dkh.mul_(kh), dke.mul_(ke), c_tot)
                continue
            dq_g, dk_g, a_levels, b_levels, _ = scores_fast_backward(dA, q_g, k_g, False, g3[grp])
            dq[grp] = dq_g.addcmul_(dqf, fs_g)
            dk[grp] = dk_g.addcmul_(dke, te_g)
            dg[grp] = level_products_backward(dqf.mul_(q_g).mul_(fs_g), dke.mul_(ke), c_tot, a_levels, b_levels)
        shape = (B, H, N, Cp)
        return (dq.view(*shape, Dk), dk.view(*shape, Dk), dv.view(*shape, Dv), dg.view(*shape, Dk),
                dS.view(B, H, Dk, Dv))


def gla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, S_final)`` of GLA's chunk form (see :func:`gla_chunk_ops`): :class:`_GLAChunk`, or op by op."""
    if autograd_must_see_every_op(q, k, v, g, S0):
        return gla_chunk_ops(q, k, v, g, S0)
    return _GLAChunk.apply(q, k, v, g, S0)
