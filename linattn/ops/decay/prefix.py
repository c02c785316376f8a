"""Mild decays: the decay factors of a chunk from its cumulative log-gates, one matmul per score block."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._numerics import has_values

__all__ = ["MILD_DECAY", "MILD_GATE", "mild_groups", "prefix_factors", "prefix_factors_backward"]


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


def mild_groups(parts: list[slice], g: Tensor, x: Tensor, y: Tensor, per_row=None) -> list[bool]:
    """Per group of chunks: may it use :func:`prefix_factors`? (every chunk's total log-decay
    ``−Σ g >= −MILD_DECAY`` in every channel, every log-gate ``>= −MILD_GATE``, and ``Dk · max|x|
    · max|y| · e^{MILD_DECAY}`` far below the dtype's largest number, so no score overflows;
    a gradient overflows only where the true one is within ``e^{MILD_DECAY}`` of overflowing).
    ``per_row`` maps a quantity per row of ``x`` and ``y`` to the rows of ``g`` (grouped value heads:
    :meth:`linattn.ops.value_heads.SharedRows.per_row`). Tensors without values (meta, fake) take
    the range-by-range products: every group False.
    """
    if not has_values(g):
        return [False] * len(parts)
    depth = g.sum(1).amin(-1).neg()                                         # (n,): −(Σ_r g_r), worst channel
    strongest = g.reshape(g.shape[0], -1).amin(1).neg()                      # (n,): the largest −g_r
    size = _finite_max(x) * _finite_max(y) * x.shape[-1]
    if per_row is not None:
        size = per_row(size)
    limit = torch.finfo(x.dtype).max * math.exp(-3 * MILD_DECAY)
    ok = ((depth <= MILD_DECAY) & (strongest <= MILD_GATE) & (size <= limit)).tolist()
    return [all(ok[grp]) for grp in parts]


def _finite_max(x: Tensor) -> Tensor:
    """``max |x|`` over the finite entries of each chunk of ``x`` ``(n, C, D)``: ``(n,)``."""
    flat = x.reshape(x.shape[0], -1)
    m = torch.maximum(flat.amax(1), flat.amin(1).neg())                  # (aminmax is 20x slower on the CPU)
    bad = ~torch.isfinite(m)
    if bad.any():
        m[bad] = x[bad].abs().nan_to_num_(nan=0.0, posinf=0.0).amax((1, 2))
    return m


def prefix_factors(g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(from_start, inverse, to_end, total)`` of chunks of log-gates ``g`` ``(n, C, Dg)`` with mild decay (no autograd)."""
    b = g.cumsum(1)
    last = b[:, -1:]
    return b.exp(), b.neg().exp(), (last - b).exp_(), last.exp()


def prefix_factors_backward(a_from_start: Tensor, b_inverse: Tensor, b_to_end: Tensor, c_total: Tensor) -> Tensor:
    """The gradient of ``g`` from ``d factor ⊙ factor`` of :func:`prefix_factors`' outputs (same shapes)."""
    db = a_from_start - b_inverse - b_to_end
    db[:, -1:] += b_to_end.sum(1, keepdim=True) + c_total
    return db.flip(1).cumsum(1).flip(1)
