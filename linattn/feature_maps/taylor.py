"""The second-order Taylor features of softmax's kernel (Based; Arora et al., 2024)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .._checks import check_floating, check_positive_finite

__all__ = ['TaylorFeatures']


class TaylorFeatures(nn.Module):
    """Second-order Taylor features of the softmax kernel, as in Based (Arora et al., 2024).

    ``exp(s) ≈ 1 + s + s²/2`` with ``s = qᵀk · scale``. With ``x̃ = x · √scale``::

        φ(x) = [1, x̃, (x̃_i x̃_j · c_ij)_{i <= j}],   c_ii = 1/√2,  c_ij = 1 (i < j)

    Parameters
    ----------
    scale : float, optional
        The factor on ``qᵀk``; default ``1/√D`` (softmax's).

    Raises
    ------
    TypeError
        Non-numeric ``scale``; (at call) a non-floating ``x``.
    ValueError
        ``scale <= 0`` or not finite.
    """

    def __init__(self, scale: Optional[float] = None) -> None:
        super().__init__()
        if scale is not None:
            scale = check_positive_finite(scale, "scale")
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 1 + D + D(D+1)/2)``, same dtype as ``x`` (computed in float32 for half)."""
        check_floating(x, "x")
        D = x.shape[-1]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D)
        xs = x.to(acc) * math.sqrt(scale)                                         # (..., D)
        i, j = torch.triu_indices(D, D, device=x.device)                          # i <= j
        coef = torch.ones(i.shape[0], dtype=acc, device=x.device)                 # (D(D+1)/2,)
        coef[i == j] = math.sqrt(0.5)
        second = xs[..., i] * xs[..., j] * coef                                   # (..., D(D+1)/2)
        ones = torch.ones_like(xs[..., :1])
        return torch.cat([ones, xs, second], dim=-1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
