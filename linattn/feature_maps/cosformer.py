"""cosFormer's ReLU features with a cosine re-weighting by position (Qin et al., 2022)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_floating, check_int_at_least, shape_str

__all__ = ['CosFormerFeatures']


class CosFormerFeatures(nn.Module):
    """cosFormer: ReLU features with the cos-based re-weighting of Qin et al. (2022).

    The similarity of query ``i`` and key ``j`` is
    ``relu(q_i)ᵀrelu(k_j) · cos(π/2 · (i - j)/L)``, which favours nearby tokens. Since
    ``cos(a - b) = cos a cos b + sin a sin b``, it is the dot product of::

        φ(x_i) = [relu(x_i) cos(π i / 2L), relu(x_i) sin(π i / 2L)],   M = 2D

    Parameters
    ----------
    max_len : int, optional
        ``L``, the largest number of positions; None uses each input's ``offset + T``.

    Raises
    ------
    TypeError
        Non-int ``max_len`` or ``offset``; (at call) a non-floating ``x``.
    ValueError
        ``max_len < 1``; (at call) an input that is not 4-D, a negative ``offset``, or
        ``offset + T > max_len``.
    """

    position_dependent = True
    """Marks a map whose features depend on the position: callers that feed a sequence in
    pieces (decoding) must pass ``offset=`` the number of tokens already seen."""

    def __init__(self, max_len: Optional[int] = None) -> None:
        super().__init__()
        if max_len is not None:
            max_len = check_int_at_least(max_len, "max_len", minimum=1)
        self.max_len = max_len

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """``(B, H, T, D) -> (B, H, T, 2D)``, same dtype as ``x`` (angles in float32 or float64)."""
        check_floating(x, "x")
        offset = check_int_at_least(offset, "offset", minimum=0)
        if x.dim() != 4:
            raise ValueError(
                "CosFormerFeatures needs x of shape (batch, heads, seq, dim): its features depend on "
                f"the position along dim 2; got {shape_str(x.shape)}"
            )
        T = x.shape[-2]
        L = self.max_len if self.max_len is not None else offset + T
        if offset + T > L:
            raise ValueError(f"positions offset + T = {offset} + {T} exceed max_len = {L}")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.arange(offset, offset + T, device=x.device, dtype=acc)        # (T,)
        angle = (math.pi / 2) * pos / L
        r = F.relu(x.to(acc))                                                     # (B, H, T, D)
        feats = torch.cat([r * angle.cos()[:, None], r * angle.sin()[:, None]], dim=-1)
        return feats.to(x.dtype)                                                  # (B, H, T, 2D)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}"
