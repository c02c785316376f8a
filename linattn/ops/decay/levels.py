"""Per-channel decay inside a chunk, range by range: products of gates and the decayed scores.

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

import torch
from torch import Tensor

__all__ = ["padded_chunk", "decay_factors", "LevelProducts", "level_products_backward", "scores_fast",
           "scores_fast_backward", "scores_by_cat"]


def padded_chunk(C: int) -> int:
    """Tokens per chunk of the per-channel gated chunk forms (GLA, gated delta): ``C`` rounded up to a power of two.

    The scores halve each chunk down to single tokens, so a chunk holds a power of two
    tokens; the padding has ``q = k = v = 0`` and ``log_g = 0`` and changes nothing.
    """
    return 1 << (C - 1).bit_length()


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
