"""One gate per head: the decay factors of a chunk as range sums of log-gates (Mamba-2's "segsum")."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["scalar_decay", "scalar_decay_backward"]


def scalar_decay(g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One gate per head: the decay factors of chunks of log-gates ``g`` ``(…, C, 1)``, every exponent a range sum."""
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
    """The gradient of ``g`` from ``d factor ⊙ factor`` of :func:`scalar_decay`'s outputs (no autograd)."""
    C = e_D.shape[-1]
    e = e_D.tril(-1)
    down = e.flip(-2).cumsum(-2).flip(-2).tril_(-1)                      # [r, s] = Σ_{t>=r} e[t, s], s < r
    ones = torch.ones(C, C, dtype=e.dtype, device=e.device)
    dg = down.sum(-1, keepdim=True)
    dg += ones.triu() @ a_from_start                                     # Σ_{t>=r}
    dg += ones.tril(-1) @ b_to_end                                       # Σ_{s<r}
    return dg.add_(c_total)
