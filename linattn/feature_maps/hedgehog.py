"""Hedgehog: learned features fitted to softmax's weights (Zhang et al., 2024)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_floating, check_int_at_least, check_strict_bool, shape_str
from .performer import seeded_normal

__all__ = ['HedgehogFeatures']


class HedgehogFeatures(nn.Module):
    """Hedgehog's learnable feature map (Zhang et al., 2024).

    Parameters
    ----------
    head_dim : int
        ``D``, the size of the inputs.
    num_features : int, optional
        ``F``, the rows of ``W``; default ``D``. The output has ``M = 2F`` features.
    bias : bool
        Learn ``b`` (True) or not.
    init : str
        ``"identity"`` or ``"random"``, see above.
    seed : int
        Seed of the random rows (a non-negative int).

    Raises
    ------
    TypeError
        Non-int sizes or seed, non-bool ``bias``, non-str ``init``; (at call) a non-floating ``x``.
    ValueError
        Sizes ``< 1``, a negative seed, an unknown ``init``; (at call) an input whose last
        dimension is not ``head_dim``.
    """

    INITS = ("identity", "random")

    def __init__(self, head_dim: int, num_features: Optional[int] = None, *, bias: bool = True,
                 init: str = "identity", seed: int = 0) -> None:
        super().__init__()
        head_dim = check_int_at_least(head_dim, "head_dim", minimum=1)
        if num_features is not None:
            num_features = check_int_at_least(num_features, "num_features", minimum=1)
        check_strict_bool(bias, "bias")
        if not isinstance(init, str):
            raise TypeError(f"init must be a str, one of {self.INITS}, got {type(init).__name__}")
        if init not in self.INITS:
            raise ValueError(f"init must be one of {self.INITS}, got {init!r}")
        check_int_at_least(seed, "seed", minimum=0)
        self.head_dim, self.init, self.seed = head_dim, init, seed
        self.num_features = num_features if num_features is not None else head_dim
        W = seeded_normal((self.num_features, head_dim), seed, stream=3) / math.sqrt(head_dim)   # (F, D)
        if init == "identity":
            n = min(self.num_features, head_dim)
            W[:n] = torch.eye(n, head_dim, dtype=W.dtype)
        self.weight = nn.Parameter(W.float())                                     # (F, D)
        self.bias = nn.Parameter(torch.zeros(self.num_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 2F)`` features in ``(0, 1)`` summing to 1, same dtype as ``x``."""
        check_floating(x, "x")
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"HedgehogFeatures expects x of shape (..., {self.head_dim}), got {shape_str(x.shape)}"
            )
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        b = None if self.bias is None else self.bias.to(acc)
        y = F.linear(x.to(acc), self.weight.to(acc), b)                           # (..., F)
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1).to(x.dtype)      # (..., 2F)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, bias={self.bias is not None}, "
                f"init={self.init!r}, seed={self.seed}")
