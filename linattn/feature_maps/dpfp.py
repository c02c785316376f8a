"""DPFP: deterministic parameter-free projection features (Schlag, Irie & Schmidhuber, 2021)."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_floating, check_int_at_least

__all__ = ['DPFPFeatures']


class DPFPFeatures(nn.Module):
    """Deterministic parameter-free projection (DPFP) of Schlag et al. (2021).

    With ``r = relu([x, -x])`` (size ``2D``), DPFP of order ``ν`` takes the products of
    each feature with its neighbours at distances ``1..ν`` (cyclically)::

        φ_{(i, n)}(x) = r_i · r_{(i + n) mod 2D},   n = 1..ν,   M = 2·D·ν

    Parameters
    ----------
    nu : int
        The order ``ν >= 1`` (the paper uses 1 to 3); ``M = 2·D·ν``.

    Raises
    ------
    TypeError
        If ``nu`` is not an int (at construction) or ``x`` is not floating (at call).
    ValueError
        If ``nu < 1``, or (at call) ``nu >= D``: the products at distance ``D`` pair
        ``relu(x_i)`` with ``relu(-x_i)`` and are always zero.
    """

    def __init__(self, nu: int = 1) -> None:
        super().__init__()
        nu = check_int_at_least(nu, "nu", minimum=1)
        self.nu = nu

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 2·D·ν)``, same dtype as ``x``."""
        check_floating(x, "x")
        D = x.shape[-1]
        if self.nu >= D:
            raise ValueError(
                f"DPFP needs nu < D for inputs with D = {D}, got nu = {self.nu}: the products at distance D are "
                "relu(x_i)·relu(-x_i) = 0 for every input, features that are always zero")
        r = F.relu(torch.cat([x, -x], dim=-1))                                    # (..., 2D)
        return torch.cat([r * r.roll(n, dims=-1) for n in range(1, self.nu + 1)], dim=-1)

    def extra_repr(self) -> str:
        return f"nu={self.nu}"
