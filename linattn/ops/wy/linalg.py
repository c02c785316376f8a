"""The triangular algebra of the WY chunk form: the blocked unit-lower inverse and the solve, forward and backward."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["unit_lower_inverse", "solve", "solve_backward"]


def unit_lower_inverse(M: Tensor) -> Tensor:
    """``M⁻¹`` of unit lower-triangular ``M`` ``(n, C, C)``, by blocks: ``[[A, 0], [B, D]]⁻¹ =
    [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]`` down to blocks of 16, solved directly.
    """
    C = M.shape[-1]
    if C <= 16:
        eye = torch.eye(C, dtype=M.dtype, device=M.device).expand_as(M)
        return torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    h = C // 2
    top, bottom = unit_lower_inverse(M[:, :h, :h]), unit_lower_inverse(M[:, h:, h:])
    out = M.new_zeros(M.shape)
    out[:, :h, :h] = top
    out[:, h:, h:] = bottom
    out[:, h:, :h] = -(bottom @ (M[:, h:, :h] @ top))
    return out


def solve(A, kf, v, b):
    """One group of chunks: ``(M⁻¹, W, Ũ)`` with ``M = I + diag(β) A`` and ``[W, Ũ] = M⁻¹ diag(β) [kf, v]``."""
    M = A * b
    M.diagonal(dim1=-2, dim2=-1).fill_(1.0)                     # A's diagonal is 0
    Minv = unit_lower_inverse(M)
    return Minv, torch.bmm(Minv, b * kf), torch.bmm(Minv, b * v)


def solve_backward(dO, U, S_before, dS_after, dU, Minv, A, kf, v, b, dv):
    """One group of chunks: ``(dP, dqf, dke, dA, dkf, d_beta)`` from the scan's ``dU`` and ``dS_after``; the
    gradient of ``v`` is written into ``dv``.
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
