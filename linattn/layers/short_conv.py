"""A causal depthwise convolution over the sequence, with a decoding state (H3, Fu et al., 2023)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import _checks

__all__ = ["ShortConvolution"]

# Up to these many outputs, K shifted multiply-adds beat F.conv1d, whose depthwise float64 CPU path
# has a large fixed cost (a decoding step is one output).
SHIFTED_SUM_MAX_T = {torch.float64: 256}
SHIFTED_SUM_MAX_T_DEFAULT = 16


class ShortConvolution(nn.Module):
    """A causal depthwise convolution over the sequence, with a decoding state.

    Parameters
    ----------
    channels : int
        ``C``.
    kernel_size : int
        ``K >= 2`` (4 in Mamba, Gated DeltaNet and Kimi Linear).

    Raises
    ------
    TypeError
        A size that is not an int.
    ValueError
        ``channels < 1`` or ``kernel_size < 2``.
    """

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.channels = _checks.check_positive_int(channels, "channels")
        self.kernel_size = _checks.check_positive_int(kernel_size, "kernel_size")
        if self.kernel_size < 2:
            raise ValueError(f"kernel_size must be >= 2 (kernel_size 1 mixes no tokens), got {kernel_size}")
        self.weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel_size))   # as nn.Conv1d, groups=C
        bound = 1.0 / math.sqrt(self.kernel_size)                         # nn.Conv1d's default init
        nn.init.uniform_(self.weight, -bound, bound)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"

    def forward(self, u: Tensor, attention_mask: Optional[Tensor] = None,
                state: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Convolve ``u`` causally, continuing from ``state``.

        Parameters
        ----------
        u : Tensor
            ``(B, T, C)`` floating point.
        attention_mask : Tensor, optional
            ``(B, T)`` bool, True for real tokens (already checked by the caller).
        state : Tensor, optional
            ``(B, C, K − 1)``: the inputs before ``u`` (oldest first); zeros if None.
            ``(N, C, K − 1)`` with ``cu_seqlens``: one per sequence.
        cu_seqlens : Tensor, optional
            A packed batch (``B = 1``): the ``N + 1`` offsets of its sequences along ``T``,
            int32 or int64, already checked by the caller (not with ``attention_mask``). Each
            sequence is convolved alone: the convolution restarts at every boundary.

        Returns
        -------
        y : Tensor
            ``(B, T, C)``, dtype of ``u`` (meaningless at padded positions).
        state : Tensor
            ``(B, C, K − 1)`` (``(N, C, K − 1)`` with ``cu_seqlens``), the last ``K − 1`` real
            inputs (with the old state before them when there are fewer), dtype of ``u``, new memory.
        """
        if cu_seqlens is not None:
            return self._packed(u, cu_seqlens, state)
        B, T, C = u.shape
        K = self.kernel_size
        prefix = u.new_zeros(B, C, K - 1) if state is None else state.to(u.dtype)
        if attention_mask is None:
            ext = torch.cat([prefix, u.transpose(1, 2)], dim=2)           # (B, C, K − 1 + T)
            y = _depthwise(ext, self.weight.to(u.dtype))                  # (B, C, T)
            return y.transpose(1, 2), ext[:, :, T:].clone(memory_format=torch.contiguous_format)
        # Move each row's real tokens to the front, in order; convolve; put them back.
        order = torch.sort((~attention_mask).to(torch.int32), dim=1, stable=True).indices  # (B, T)
        compact = u.masked_fill(~attention_mask[..., None], 0.0).gather(1, order[..., None].expand(B, T, C))
        ext = torch.cat([prefix, compact.transpose(1, 2)], dim=2)         # (B, C, K − 1 + T)
        y = _depthwise(ext, self.weight.to(u.dtype))                      # (B, C, T), real tokens first
        y = y.gather(2, order.argsort(dim=1)[:, None, :].expand(B, C, T))  # back to the input order
        n_real = attention_mask.sum(dim=1)                                # (B,)
        last = n_real[:, None] + torch.arange(K - 1, device=u.device)     # (B, K − 1): ext columns
        return y.transpose(1, 2), ext.gather(2, last[:, None, :].expand(B, C, K - 1))

    def _packed(self, u: Tensor, cu_seqlens: Tensor, state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """The packed batch ``u`` (1, T, C) as ``N`` sequences, each after its own ``K − 1`` inputs of ``state``."""
        _, T, C = u.shape
        K, device = self.kernel_size, u.device
        offsets = cu_seqlens.to(device=device, dtype=torch.long)          # (N + 1,)
        N = offsets.shape[0] - 1
        seq = torch.arange(N, device=device)
        owner = torch.repeat_interleave(seq, offsets[1:] - offsets[:-1], output_size=T)   # (T,) sequence of a token
        prefix = u.new_zeros(N, C, K - 1) if state is None else state.to(u.dtype)
        # One row with every sequence after its prefix: sequence i fills the columns
        # [offsets[i] + i(K − 1), offsets[i + 1] + (i + 1)(K − 1)), its K − 1 prefix columns first.
        lag = torch.arange(K - 1, device=device)
        prefix_cols = (offsets[:-1] + seq * (K - 1))[:, None] + lag       # (N, K − 1)
        token_cols = torch.arange(T, device=device) + (owner + 1) * (K - 1)   # (T,)
        source = torch.cat([prefix.transpose(0, 1).reshape(C, N * (K - 1)), u[0].transpose(0, 1)], dim=1)
        ext = source[:, torch.cat([prefix_cols.reshape(-1), token_cols]).argsort()]   # (C, T + N(K − 1))
        y = _depthwise(ext[None], self.weight.to(u.dtype))[0]            # (C, T + (N − 1)(K − 1))
        y = y[:, token_cols - (K - 1)]                                    # (C, T): the window ending at each token
        last = (offsets[1:] + seq * (K - 1))[:, None] + lag               # (N, K − 1): each sequence's last columns
        return y.t()[None], ext[:, last].transpose(0, 1).contiguous()     # (1, T, C), (N, C, K − 1)


def _depthwise(ext: Tensor, weight: Tensor) -> Tensor:
    """``y[:, c, t] = Σ_j weight[c, 0, j] · ext[:, c, t + j]``: ``ext`` (B, C, K − 1 + T) -> (B, C, T)."""
    K = weight.shape[-1]
    T = ext.shape[2] - K + 1
    if T > SHIFTED_SUM_MAX_T.get(ext.dtype, SHIFTED_SUM_MAX_T_DEFAULT):
        return F.conv1d(ext, weight, groups=ext.shape[1])
    y = ext[:, :, :T] * weight[:, 0, 0, None]                            # (B, C, T)
    for j in range(1, K):
        y = y + ext[:, :, j:j + T] * weight[:, 0, j, None]
    return y
