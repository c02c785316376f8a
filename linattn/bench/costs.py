"""Cost models: the useful-work FLOP count of a causal forward pass, and a memory estimate."""
from __future__ import annotations

import math

import torch

from .. import _checks
from .baselines import DEFAULT_CHUNK_SIZE, METHODS

__all__ = ["forward_flops", "predict_memory"]


def _check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def forward_flops(method: str, seq_len: int, *, batch: int, heads: int, head_dim: int,
                  chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Useful floating-point operations of one causal forward pass (a multiply-add counts 2).

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    seq_len, batch, heads, head_dim : int
        ``T``, ``B``, ``H`` and ``D = Dv``.
    chunk_size : int
        ``C`` of the linear forms' count.

    Returns
    -------
    int
        FLOPs.

    Raises
    ------
    ValueError
        If ``method`` is unknown.
    """
    _check_method(method)
    B, H, T, D = batch, heads, seq_len, head_dim
    if method in ("sdpa", "quadratic"):
        return B * H * T * (T + 1) * (D + D)
    M, Dv, C = D, D, chunk_size
    return B * H * T * (2 * C * (M + Dv + 1) + 4 * M * (Dv + 1))


def predict_memory(method: str, seq_len: int, *, batch: int, heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float32, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """A rough, generous estimate of the peak bytes of one forward+backward pass.

    The memory guard of :func:`run_benchmark` uses it to skip cells before they run.
    Beyond the gradients of q, k, v and the output (``B·H·T·4D`` elements of ``dtype``),
    with ``L = B·H·T``, ``N = ceil(T / C)`` chunks, ``Lc = B·H·N·C`` (``L`` padded to
    whole chunks), and elements in the accumulation dtype (float32 for half inputs)::

        sdpa            L·2D                                   (flash-style kernels: no T×T)
        quadratic       2.5·B·H·T² + 3·L·(2D + 1)              (scores, their tril, gradients)
        cumsum          4.25·L·D²  + 3·L·(2D + 1)              ((B, H, T, M, Dv) sums, gradients)
        baseline_chunk  2·Lc·C + (2N + 8)·B·H·D(D + 1) + 4·Lc·(2D + 1)
        chunk           as baseline_chunk + L·D                (and the feature map's temporary)
        chunk_torch     as chunk
        compiled_baseline  as baseline_chunk
        chunk_cpu       (2N + 8)·B·H·D(D + 1) + 4·Lc·(2D + 1) + L·D
        fused           (2N + 8)·B·H·D(D + 1) + 4·Lc·(2D + 1)

    Parameters
    ----------
    method, seq_len, batch, heads, head_dim, chunk_size
        As in :func:`forward_flops`, which also names the errors.
    dtype : torch.dtype
        Input dtype.

    Returns
    -------
    int
        Bytes.
    """
    _check_method(method)
    D, C = head_dim, chunk_size
    L = batch * heads * seq_len
    size_in = torch.empty((), dtype=dtype).element_size()
    size_acc = torch.empty((), dtype=_checks.accumulation_dtype(dtype)).element_size()
    inputs_and_grads = L * 4 * D * size_in
    features = 3 * L * (2 * D + 1) * size_acc
    n_chunks = math.ceil(seq_len / C)
    L_chunks = batch * heads * n_chunks * C
    chunk_features = 4 * L_chunks * (2 * D + 1) * size_acc
    states = (2 * n_chunks + 8) * batch * heads * D * (D + 1) * size_acc
    extra = {
        "sdpa": L * 2 * D * size_in,
        "quadratic": 2.5 * batch * heads * seq_len ** 2 * size_acc + features,
        "cumsum": 4.25 * L * D * D * size_acc + features,
        "baseline_chunk": 2 * L_chunks * C * size_acc + states + chunk_features,
        "chunk": 2 * L_chunks * C * size_acc + states + chunk_features + L * D * size_acc,
        "chunk_torch": 2 * L_chunks * C * size_acc + states + chunk_features + L * D * size_acc,
        "compiled_baseline": 2 * L_chunks * C * size_acc + states + chunk_features,
        "chunk_cpu": states + chunk_features + L * D * size_acc,
        "fused": states + chunk_features,
    }[method]
    return int(inputs_and_grads + extra)
