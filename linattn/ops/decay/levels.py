"""Per-channel decay inside a chunk, range by range: products of gates and the decayed scores."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["padded_chunk", "decay_factors", "LevelProducts", "level_products_backward", "scores_fast",
           "scores_fast_backward", "scores_by_cat"]


def padded_chunk(C: int) -> int:
    """Tokens per chunk of the per-channel gated chunk forms (GLA, gated delta): ``C`` rounded up to a power of two."""
    return 1 << (C - 1).bit_length()


def _halves(x: Tensor, w: int) -> tuple[Tensor, Tensor]:
    """``x`` ``(…, Cp, D)`` as the earlier and later halves of its blocks of ``2w`` tokens, views ``(…, m, w, D)``."""
    *lead, Cp, D = x.shape
    first, second = x.view(*lead, Cp // (2 * w), 2, w, D).unbind(-3)
    return first, second


def decay_factors(g: Tensor) -> tuple[Tensor, Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """``(from_start, to_end, total, levels)`` of log-gates ``g`` ``(…, Cp, Dg)``, op by op (differentiable)."""
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
    """The products of the gates ``exp(g)`` (``g`` ``(…, Cp, Dk)``) built level by level, in place (no autograd)."""

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
    """The gradient of ``g`` from ``d factor ⊙ factor`` of every factor of :class:`LevelProducts`."""
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
    """``(dx, dy, a_levels, b_levels, products)`` of :func:`scores_fast` (see :func:`level_products_backward`)."""
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
