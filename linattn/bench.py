"""Measuring time and memory, and ``python -m linattn.bench``: causal attention benchmarks.

``median_time`` and ``peak_memory`` are what every chapter's timing and memory cells use.
The rest of this module benchmarks causal attention methods against each other, from
the command line::

    python -m linattn.bench                                   # small defaults: under a minute on 2 CPU cores
    python -m linattn.bench --device cpu --seq-lens 1024 4096 16384 --heads 8 \\
        --json bench.json --plot bench.png

or from Python, with :func:`run_benchmark` and :func:`format_table`. The decay family
(:func:`linattn.retention`, :func:`linattn.gated_linear_attention`,
:func:`linattn.delta_rule`) has its own table, chunk form
against recurrent form (:func:`run_decay_benchmark`, :func:`format_decay_table`)::

    python -m linattn.bench --decay --threads 1               # T = 4096, B = 1, H = 4, D = 64

``--threads N`` pins ``torch.set_num_threads(N)`` for the run (either table); on a shared
machine, unpinned threads make the ratios meaningless.

Methods (every one computes causal, normalised linear attention with elu+1 features,
except ``sdpa``, which is the softmax reference):

``sdpa``
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)``.
``quadratic``
    ``linattn.linear_attention(..., causal=True, method="quadratic")``: the masked T×T form.
``cumsum``
    :func:`cumsum_linear_attention`: prefix sums of outer products, ``(B, H, T, M, Dv)``.
``baseline_chunk``
    :func:`baseline_chunk_linear_attention`: a straightforward PyTorch chunkwise form;
    the baseline that ``chunk`` and ``fused`` are measured against.
``chunk``
    ``linattn.linear_attention(..., causal=True, method="chunk")``: the package's path
    (on CUDA with Triton it dispatches to the fused kernel itself).
``fused``
    :func:`linattn.kernels.chunk_linear_attention_triton` called directly (CUDA with
    Triton only; ``"unavailable"`` elsewhere).

Each (method, T) cell reports the median forward time (under ``torch.no_grad``), the
median forward+backward time (``torch.autograd.grad`` of the output against a random
upstream gradient, w.r.t. q, k and v), the peak memory of forward+backward
(:func:`peak_memory`), the forward GFLOP/s of a fixed useful-work count
(:func:`forward_flops`) and its fraction of the float32 matmul GFLOP/s measured in the
same run (:func:`matmul_gflops`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from tqdm import tqdm

from . import _checks
from .attention import linear_attention
from .feature_maps import elu_plus_one
from .utils import default_device

__all__ = [
    "median_time",
    "peak_memory",
    "METHODS",
    "cumsum_linear_attention",
    "baseline_chunk_linear_attention",
    "forward_flops",
    "predict_memory",
    "matmul_gflops",
    "run_benchmark",
    "format_table",
    "plot_results",
    "machine_info",
    "main",
    "DECAY_VARIANTS",
    "run_decay_benchmark",
    "format_decay_table",
]

METHODS = ("sdpa", "quadratic", "cumsum", "baseline_chunk", "chunk", "fused")
LINEAR_METHODS = ("cumsum", "baseline_chunk", "chunk", "fused")   # same useful-work FLOP count
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_SEQ_LENS = (256, 512, 1024)
DEFAULT_CHUNK_SIZE = 64


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1,
                device: torch.device | str | None = None) -> float:
    """Median wall-clock time of ``fn()`` over ``repeats`` calls, in seconds.

    Parameters
    ----------
    fn : callable
        Called with no arguments; its result is discarded.
    repeats : int
        Timed calls (>= 1); the median is robust to a noisy neighbour on a shared machine.
    warmup : int
        Untimed calls first (>= 0): first calls pay for allocation and kernel selection.
    device : torch.device or str, optional
        When CUDA, the device is synchronised around each call so the time covers the work.

    Returns
    -------
    float
        Median seconds per call.

    Raises
    ------
    TypeError
        If ``fn`` is not callable.
    ValueError
        If ``repeats < 1`` or ``warmup < 0``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device) if device is not None else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active, and when each is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()  # frees since the last op count before this op allocates
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.live and not _existed_before(storage, args, kwargs):
                    self.live[ref.cdata] = (ref, storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _existed_before(storage, args, kwargs) -> bool:
    """An output that shares storage with an input (a view or an in-place op) is not new memory."""
    for t in tree_flatten((args, kwargs or {}))[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage.data_ptr():
            return True
    return False


def peak_memory(fn: Callable[[], object], *, device: torch.device | str = "cpu") -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs.

    On CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated
    before. On CPU, where PyTorch keeps no allocator statistics, every tensor that an
    operator creates is counted (through a ``TorchDispatchMode``) until it is freed, and
    the maximum of the running total is returned. The CPU figure is deterministic (the
    same on every machine for the same code and shapes); it includes tensors saved for
    the backward pass and the result of ``fn`` while they are alive, and excludes scratch
    memory that a kernel allocates and frees internally.

    Parameters
    ----------
    fn : callable
        Called once with no arguments.
    device : torch.device or str
        ``"cpu"`` or a CUDA device: where ``fn`` allocates.

    Returns
    -------
    int
        Peak bytes.

    Raises
    ------
    TypeError
        If ``fn`` is not callable.
    ValueError
        If ``device`` is neither CPU nor CUDA.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    if device.type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")
    tracker = _TensorMemoryTracker()
    with tracker:
        fn()
    return int(tracker.peak)


# --------------------------------------------------------------------------- baselines


def _features(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """elu+1 features of q and k, and v, in the accumulation dtype (float32 for half inputs)."""
    acc = _checks.accumulation_dtype(q.dtype)
    return elu_plus_one(q.to(acc)), elu_plus_one(k.to(acc)), v.to(acc)   # (B, H, T, M), (B, H, T, Dv)


def cumsum_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, eps: float = 1e-6) -> Tensor:
    """Causal linear attention by prefix sums of outer products: a memory-hungry baseline.

    Katharopoulos et al. (2020), eq. 9 taken literally: every state
    ``S_t = Σ_{j<=t} φ(k_j) v_jᵀ`` is built at once by ``torch.cumsum`` over the
    ``(B, H, T, M, Dv)`` outer products, the normaliser ``z_t = Σ_{j<=t} φ(k_j)`` likewise,
    and ``y_t = φ(q_t)ᵀS_t / max(φ(q_t)ᵀz_t, eps)``, with φ = elu+1. Linear in ``T``, but it
    stores ``T`` states of ``M×Dv`` numbers (several copies, kept for the backward pass):
    the benchmark shows what materialising the states costs.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype and device.
    eps : float
        Positive lower bound on the normaliser.

    Returns
    -------
    Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q``; computed in float32 for half and bfloat16
        inputs (float64 for float64), as :func:`linattn.linear_attention` does.

    Raises
    ------
    TypeError, ValueError
        Bad inputs, as for :func:`linattn.linear_attention` with ``causal=True``.
    """
    _checks.check_qkv(q, k, v, causal=True, causal_only="cumsum_linear_attention")
    _checks.check_eps(eps)
    phi_q, phi_k, v = _features(q, k, v)
    S = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)      # (B, H, T, M, Dv)
    z = torch.cumsum(phi_k, dim=2)                                      # (B, H, T, M)
    num = (phi_q.unsqueeze(-2) @ S).squeeze(-2)                         # (B, H, T, Dv)
    den = (phi_q * z).sum(-1, keepdim=True)                             # (B, H, T, 1)
    return (num / den.clamp_min(eps)).to(q.dtype)


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Sum of the entries before each index along ``dim`` (zero at index 0), without cancellation."""
    head = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([head, torch.cumsum(x.narrow(dim, 0, x.shape[dim] - 1), dim)], dim)


def baseline_chunk_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                    eps: float = 1e-6) -> Tensor:
    """A straightforward PyTorch chunkwise form: the baseline the fast paths are measured against.

    The chunkwise-parallel algorithm (Hua et al., 2022, sec. 3.3; Yang et al., 2024,
    sec. 2.2) written with batched tensor operations and no loop, as one would first write
    it: pad ``T`` to a multiple of ``C = chunk_size`` (zero rows: a zero φ(k) adds nothing,
    padded queries are cut off), view the sequence as ``N`` chunks, and per chunk ``c``::

        A_c = tril(φ(Q_c) φ(K_c)ᵀ)                              intra-chunk scores (C×C)
        S_c = φ(K_c)ᵀ V_c,   z_c = φ(K_c)ᵀ 1                     per-chunk states
        S_<c = Σ_{c'<c} S_c',  z_<c = Σ_{c'<c} z_c'              exclusive cumulative sums
        Y_c = (φ(Q_c) S_<c + A_c V_c) / max(φ(Q_c) z_<c + A_c 1, eps)

    with φ = elu+1. Numerator and normaliser are carried separately (no ones column), and
    autograd provides the backward pass, which keeps every ``A_c`` and ``S_<c``.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype and device.
    chunk_size : int
        Tokens per chunk ``C >= 1``.
    eps : float
        Positive lower bound on the normaliser.

    Returns
    -------
    Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q``; computed in float32 for half and bfloat16
        inputs (float64 for float64), as :func:`linattn.linear_attention` does.

    Raises
    ------
    TypeError, ValueError
        Bad inputs, as for :func:`linattn.linear_attention` with ``causal=True``.
    """
    _checks.check_qkv(q, k, v, causal=True, causal_only="baseline_chunk_linear_attention")
    _checks.check_chunk_size(chunk_size)
    _checks.check_eps(eps)
    phi_q, phi_k, v = _features(q, k, v)
    B, H, T, M = phi_k.shape
    Dv, C = v.shape[-1], chunk_size
    pad = -T % C
    if pad:
        phi_q, phi_k, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v))
    N = (T + pad) // C
    q_c = phi_q.reshape(B, H, N, C, M)                                  # (B, H, N, C, M)
    k_c = phi_k.reshape(B, H, N, C, M)                                  # (B, H, N, C, M)
    v_c = v.reshape(B, H, N, C, Dv)                                     # (B, H, N, C, Dv)
    scores = (q_c @ k_c.transpose(-1, -2)).tril()                       # (B, H, N, C, C)
    S = _exclusive_cumsum(k_c.transpose(-1, -2) @ v_c, dim=2)           # (B, H, N, M, Dv) before chunk c
    z = _exclusive_cumsum(k_c.sum(-2), dim=2)                           # (B, H, N, M)
    num = q_c @ S + scores @ v_c                                        # (B, H, N, C, Dv)
    den = q_c @ z.unsqueeze(-1) + scores.sum(-1, keepdim=True)          # (B, H, N, C, 1)
    out = (num / den.clamp_min(eps)).reshape(B, H, N * C, Dv)           # (B, H, N·C, Dv)
    return out[:, :, :T].to(q.dtype)


def _fused_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int, eps: float = 1e-6) -> Tensor:
    """elu+1 features, then :func:`linattn.kernels.chunk_linear_attention_triton` with a ones column."""
    from .kernels import chunk_linear_attention_triton

    phi_q, phi_k, v = _features(q, k, v)
    v_aug = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)        # (B, H, T, Dv + 1)
    out_aug, _ = chunk_linear_attention_triton(phi_q, phi_k, v_aug, None, chunk_size)
    return (out_aug[..., :-1] / out_aug[..., -1:].clamp_min(eps)).to(q.dtype)


def _method_fn(method: str, chunk_size: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The function ``(q, k, v) -> out`` that a method name stands for (see the module docstring)."""
    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method in ("quadratic", "chunk"):
        return lambda q, k, v: linear_attention(q, k, v, causal=True, method=method, chunk_size=chunk_size)
    if method == "cumsum":
        return cumsum_linear_attention
    if method == "baseline_chunk":
        return lambda q, k, v: baseline_chunk_linear_attention(q, k, v, chunk_size=chunk_size)
    return lambda q, k, v: _fused_linear_attention(q, k, v, chunk_size=chunk_size)


def _unavailable(method: str, device: torch.device, chunk_size: int) -> Optional[str]:
    """Why ``method`` cannot run here, or None when it can. Only ``fused`` has conditions."""
    if method != "fused":
        return None
    if device.type != "cuda":
        return "the Triton kernel runs on CUDA only"
    try:
        from . import kernels
    except ImportError as err:
        return f"linattn.kernels does not import ({err})"
    available = getattr(kernels, "triton_available", None)
    if not callable(available) or not available():
        return "Triton is not available"
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"the Triton kernel needs a power-of-two chunk size >= 16, got {chunk_size}"
    return None


# --------------------------------------------------------------------------- cost models


def forward_flops(method: str, seq_len: int, *, batch: int, heads: int, head_dim: int,
                  chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Useful floating-point operations of one causal forward pass (a multiply-add counts 2).

    One yardstick per problem, so that GFLOP/s compare the way speeds do (``M = D = Dv``
    for elu+1 and this benchmark's shapes):

    - ``sdpa`` and ``quadratic`` (the T² forms): the visible query-key pairs,
      ``T(T+1)/2`` per head, each costing ``2D`` for its score and ``2Dv`` for its weighted
      value: ``B·H·T(T+1)(D + Dv)``. Not counted: softmax's exponentials, the normaliser
      column of ``quadratic``, and the masked half that dense kernels compute anyway.
    - ``cumsum``, ``baseline_chunk``, ``chunk``, ``fused`` (the linear forms): the matmuls
      of the chunkwise algorithm with ``C = chunk_size`` and the normaliser as one extra
      value column, per token: ``2C·M`` (``φ(Q_c)φ(K_c)ᵀ``, full ``C×C`` blocks) +
      ``2C·(Dv+1)`` (scores times ``[V_c, 1]``) + ``2M·(Dv+1)`` (``φ(Q_c)S``) +
      ``2M·(Dv+1)`` (state update ``φ(K_c)ᵀ[V_c, 1]``), so
      ``B·H·T·(2C(M + Dv + 1) + 4M(Dv + 1))``. All four are credited with this same count,
      whatever they execute (``cumsum`` multiplies less but moves ``T·M·Dv`` numbers).

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
        fused           (2N + 8)·B·H·D(D + 1) + 4·Lc·(2D + 1)

    The coefficients were fitted to :func:`peak_memory` on CPU (T = 1…4096, D = 8…64,
    C = 4…64) and rounded up, so the estimate bounds the measured peak there, by up to
    about 1.6× at large T; it also bounds a forward pass alone.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    seq_len, batch, heads, head_dim : int
        ``T``, ``B``, ``H`` and ``D = Dv``.
    dtype : torch.dtype
        Input dtype.
    chunk_size : int
        ``C`` of the chunkwise forms.

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    ValueError
        If ``method`` is unknown.
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
        "fused": states + chunk_features,
    }[method]
    return int(inputs_and_grads + extra)


def matmul_gflops(device: Union[torch.device, str] = "cpu", *, size: int = 2048, repeats: int = 5,
                  warmup: int = 1) -> float:
    """This machine's float32 matmul throughput: ``2·size³`` FLOPs over the median time, in GFLOP/s.

    The ceiling that the attention methods' GFLOP/s are read against (no TF32 on CUDA
    unless the caller enabled it).

    Parameters
    ----------
    device : torch.device or str
        Where to multiply.
    size : int
        The product is of two random ``size×size`` float32 matrices.
    repeats, warmup : int
        As for :func:`median_time`.

    Returns
    -------
    float
        GFLOP/s (10⁹ FLOPs per second).
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device) for _ in range(2))
    seconds = median_time(lambda: a @ b, repeats=repeats, warmup=warmup, device=device)
    return 2 * size ** 3 / seconds / 1e9


# --------------------------------------------------------------------------- running


def run_benchmark(
    methods: Sequence[str] = METHODS,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    *,
    device: Union[torch.device, str, None] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    backward: bool = True,
    max_memory_gb: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
    matmul_size: int = 2048,
    progress: bool = False,
) -> list[dict]:
    """Time and measure every (method, T) cell of causal attention on random inputs.

    For each ``T`` in ``seq_lens``, q, k, v (``(B, H, T, D)``, ``D = Dv = head_dim``) and
    an upstream gradient are drawn from a standard normal with a generator seeded by
    ``seed`` (the global RNG is left alone); every method then gets the same tensors.
    A cell whose :func:`predict_memory` exceeds ``max_memory_gb`` is not run and marked
    ``"skipped"``; ``fused`` without CUDA and Triton is ``"unavailable"``; a cell that
    raises a ``RuntimeError`` (out of memory, an unsupported dtype) is ``"failed"``, and
    the run goes on.

    Parameters
    ----------
    methods : sequence of str
        Names from :data:`METHODS`, run in this order (duplicates dropped).
    seq_lens : sequence of int
        Sequence lengths ``T``.
    device : torch.device or str, optional
        Default: CUDA when available, else CPU.
    dtype : torch.dtype or str
        float32, float16 or bfloat16 (the linear forms compute in float32 for half types).
    batch, heads, head_dim : int
        ``B``, ``H`` and ``D = Dv``.
    repeats, warmup : int
        Timed and untimed calls per measurement (:func:`median_time`).
    backward : bool
        Also time forward+backward; the memory pass is then forward+backward, else forward.
    max_memory_gb : float, optional
        Memory guard in GB (10⁹ bytes); None means half of the device's memory (CPU: the
        machine's RAM), ``math.inf`` means no guard.
    chunk_size : int
        ``C`` for ``baseline_chunk``, ``chunk``, ``fused`` and their FLOP count.
    seed : int
        Seed of the inputs.
    matmul_size : int
        Size of the float32 matmul that :func:`matmul_gflops` times for the ceiling.
    progress : bool
        Show a tqdm progress bar (on stderr) over the cells.

    Returns
    -------
    list of dict
        One dict per cell, T-major, with keys ``method``, ``seq_len``, ``batch``, ``heads``,
        ``head_dim``, ``chunk_size``, ``dtype``, ``device``, ``status`` (``"ok"``,
        ``"skipped"``, ``"unavailable"``, ``"failed"``), ``note`` (why, if not ok),
        ``fwd_s`` and ``fwd_bwd_s`` (median seconds), ``peak_memory_bytes``, ``memory_pass``
        (``"fwd+bwd"`` or ``"fwd"``), ``predicted_memory_bytes``, ``max_memory_bytes``
        (None: no guard), ``fwd_flops``, ``fwd_gflops``, ``matmul_gflops`` (float32,
        ``matmul_size``², this run) and ``matmul_fraction`` (``fwd_gflops / matmul_gflops``).
        Numbers that were not measured are None.

    Raises
    ------
    TypeError, ValueError
        Unknown methods or dtypes; non-positive sizes; ``repeats < 1``; ``warmup < 0``;
        a non-positive ``max_memory_gb``; CUDA requested but not available.
    """
    device = _resolve_device(device)
    dtype = _resolve_dtype(dtype)
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("methods must name at least one method")
    for method in methods:
        _check_method(method)
    seq_lens = [_check_positive_int(T, "seq_lens entries") for T in seq_lens]
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence length")
    for value, name in ((batch, "batch"), (heads, "heads"), (head_dim, "head_dim"),
                        (repeats, "repeats"), (chunk_size, "chunk_size"), (matmul_size, "matmul_size")):
        _check_positive_int(value, name)
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup must be an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    max_bytes = _memory_limit(max_memory_gb, device)

    matmul = matmul_gflops(device, size=matmul_size, repeats=repeats, warmup=max(warmup, 1))
    shape = dict(batch=batch, heads=heads, head_dim=head_dim, chunk_size=chunk_size)
    results = []
    with tqdm(total=len(methods) * len(seq_lens), disable=not progress, unit="cell",
              desc="linattn.bench", file=sys.stderr) as bar:
        for T in seq_lens:
            q, k, v, grad_out = _inputs(batch, heads, T, head_dim, dtype, device, seed)
            for method in methods:
                bar.set_postfix_str(f"{method} T={T}")
                row = dict(method=method, seq_len=T, **shape, dtype=_dtype_name(dtype), device=str(device),
                           status="ok", note="", fwd_s=None, fwd_bwd_s=None, peak_memory_bytes=None,
                           memory_pass="fwd+bwd" if backward else "fwd",
                           predicted_memory_bytes=predict_memory(method, T, dtype=dtype, **shape),
                           max_memory_bytes=None if math.isinf(max_bytes) else int(max_bytes),
                           fwd_flops=forward_flops(method, T, **shape), fwd_gflops=None,
                           matmul_gflops=matmul, matmul_fraction=None)
                _run_cell(row, _method_fn(method, chunk_size), (q, k, v), grad_out, device=device,
                          repeats=repeats, warmup=warmup, backward=backward, max_bytes=max_bytes)
                results.append(row)
                bar.update()
            del q, k, v, grad_out
    return results


def _run_cell(row: dict, fn: Callable, qkv: tuple[Tensor, Tensor, Tensor], grad_out: Tensor, *,
              device: torch.device, repeats: int, warmup: int, backward: bool, max_bytes: float) -> None:
    """Fill ``row`` with one cell's measurements (or its status and the reason)."""
    why_not = _unavailable(row["method"], device, row["chunk_size"])
    if why_not is not None:
        row.update(status="unavailable", note=why_not)
        return
    if row["predicted_memory_bytes"] > max_bytes:
        row.update(status="skipped", note=f"predicted {row['predicted_memory_bytes'] / 1e9:.3g} GB "
                                          f"> limit {max_bytes / 1e9:.3g} GB")
        return

    def forward() -> None:
        with torch.no_grad():
            fn(*qkv)

    def forward_backward() -> None:
        torch.autograd.grad(fn(*qkv), qkv, grad_out)

    try:
        row["fwd_s"] = median_time(forward, repeats=repeats, warmup=warmup, device=device)
        row["peak_memory_bytes"] = peak_memory(forward_backward if backward else forward, device=device)
        if backward:
            row["fwd_bwd_s"] = median_time(forward_backward, repeats=repeats, warmup=warmup, device=device)
    except Exception as err:  # out of memory, a kernel that fails to compile (Triton), ...
        message = str(err).strip().splitlines()
        row.update(status="failed", note=message[0][:200] if message else type(err).__name__,
                   fwd_s=None, fwd_bwd_s=None, peak_memory_bytes=None)
        return
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["fwd_gflops"] = row["fwd_flops"] / row["fwd_s"] / 1e9
    row["matmul_fraction"] = row["fwd_gflops"] / row["matmul_gflops"]


def _inputs(B: int, H: int, T: int, D: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded standard-normal q, k, v (leaves that require grad) and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=dtype)
                         for _ in range(4))                                # (B, H, T, D)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


# --------------------------------------------------------------------------- reporting


def format_table(results: Sequence[dict]) -> str:
    """An aligned plain-text table of :func:`run_benchmark`'s results, one block per ``T``.

    Columns: median forward and forward+backward times (ms), peak memory (MB, 10⁶ bytes),
    forward GFLOP/s and its percentage of the float32 matmul, and speed-ups of forward and
    forward+backward over ``baseline_chunk`` and over ``sdpa`` at the same ``T``
    (reference time / method time: above 1 is faster). Cells that did not run show their
    status and why.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`run_benchmark` (or read back from its JSON).

    Returns
    -------
    str
        The table, with a header line and a legend; no trailing newline.
    """
    if not results:
        return "(no results)"
    first = results[0]
    header = ["T", "method", "fwd ms", "fwd+bwd ms",
              "peak MB" if first["memory_pass"] == "fwd+bwd" else "fwd peak MB",
              "GFLOP/s", "% matmul", "fwd/base", "f+b/base", "fwd/sdpa", "f+b/sdpa"]
    times = {(r["method"], r["seq_len"]): r for r in results if r["status"] == "ok"}
    lines, blocks = [], {}
    for r in results:
        blocks.setdefault(r["seq_len"], []).append(r)
    rows = [header]
    for T, block in blocks.items():
        for r in block:
            if r["status"] != "ok":
                rows.append([str(T), r["method"], f"{r['status']}: {r['note']}"])
                continue
            speedups = []
            for ref in ("baseline_chunk", "sdpa"):
                ref_row = times.get((ref, T))
                for key in ("fwd_s", "fwd_bwd_s"):
                    ok = ref_row is not None and r[key] is not None and ref_row[key] is not None
                    speedups.append(_num(ref_row[key] / r[key]) + "x" if ok else "-")
            rows.append([str(T), r["method"], _num(r["fwd_s"], 1e3), _num(r["fwd_bwd_s"], 1e3),
                         _num(r["peak_memory_bytes"], 1e-6), _num(r["fwd_gflops"]),
                         _num(r["matmul_fraction"], 100), *speedups])
        rows.append([])
    rows.pop()
    widths = [max(len(row[i]) for row in rows if len(row) > 3) for i in range(len(header))]
    for row in rows:
        if not row:
            lines.append("")
        elif len(row) == 3:   # a cell that did not run: status and reason
            lines.append(f"{row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}")
        else:
            cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
            cells += [c.rjust(w) for c, w in zip(row[2:], widths[2:])]
            lines.append("  ".join(cells).rstrip())
    title = (f"causal attention on {first['device']}, {first['dtype']}, B={first['batch']} H={first['heads']} "
             f"D=Dv={first['head_dim']}, C={first['chunk_size']}; "
             f"float32 matmul: {_num(first['matmul_gflops'])} GFLOP/s")
    legend = ("fwd: median under torch.no_grad; fwd+bwd: autograd.grad w.r.t. q, k, v; "
              f"peak: {first['memory_pass']}.\n"
              "GFLOP/s: useful forward FLOPs (sdpa, quadratic: causal T² terms; linear methods: chunkwise "
              "matmuls) / fwd time;\n% matmul: of the float32 matmul; x/base, x/sdpa: speed-up over "
              "baseline_chunk, sdpa (> 1 is faster).")
    return "\n".join([title, "", *lines, "", legend])


def _num(x: Optional[float], scale: float = 1.0) -> str:
    """Three significant figures or so, without exponents for the usual ranges; '-' for None."""
    if x is None:
        return "-"
    x *= scale
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def plot_results(results: Sequence[dict], path: Union[str, os.PathLike]) -> None:
    """Save a two-panel PNG (time and peak memory against ``T``, log-log) of the results.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`run_benchmark`; cells that did not run are left out.
    path : str or path-like
        Where to write the figure (its format follows the suffix).

    Raises
    ------
    ImportError
        If matplotlib is not installed (it is imported here, not with the module).
    """
    from matplotlib.figure import Figure

    first = results[0]
    key = "fwd_bwd_s" if first["memory_pass"] == "fwd+bwd" else "fwd_s"
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2)
    for method in dict.fromkeys(r["method"] for r in results):
        ok = [r for r in results if r["method"] == method and r["status"] == "ok"]
        if ok:
            T = [r["seq_len"] for r in ok]
            ax_time.plot(T, [r[key] for r in ok], marker="o", label=method)
            ax_mem.plot(T, [r["peak_memory_bytes"] / 1e6 for r in ok], marker="o", label=method)
    pass_name = "forward+backward" if key == "fwd_bwd_s" else "forward"
    for ax, ylabel in ((ax_time, f"median {pass_name} time (s)"), (ax_mem, f"peak {pass_name} memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Causal attention cost against T ({first['device']}, {first['dtype']}, "
                 f"B={first['batch']}, H={first['heads']}, D={first['head_dim']})")
    fig.savefig(path, dpi=110)


def machine_info(device: Union[torch.device, str]) -> dict:
    """Versions, device and CPU facts to store next to the numbers."""
    from . import __version__

    device = torch.device(device)
    return {
        "linattn_version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- checks


def _check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _resolve_device(device) -> torch.device:
    device = default_device() if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available")
    return device


def _resolve_dtype(dtype) -> torch.dtype:
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _memory_limit(max_memory_gb: Optional[float], device: torch.device) -> float:
    """The guard in bytes: the given GB, or half the device's memory (inf when unknown)."""
    if max_memory_gb is not None:
        if isinstance(max_memory_gb, bool) or not isinstance(max_memory_gb, (int, float)):
            raise TypeError(f"max_memory_gb must be a number or None, got {type(max_memory_gb).__name__}")
        if not max_memory_gb > 0:
            raise ValueError(f"max_memory_gb must be > 0, got {max_memory_gb}")
        return max_memory_gb * 1e9
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return math.inf


# --------------------------------------------------------------------------- decay, gates, delta rule

DECAY_VARIANTS = ("retention", "gla", "delta", "gated_delta", "gated_delta_channel")
DEFAULT_DECAY_SEQ_LENS = (4096,)


def _decay_inputs(variant: str, B: int, H: int, T: int, D: int, dtype: torch.dtype, device: torch.device,
                  seed: int) -> tuple[Tensor, ...]:
    """Seeded q, k, v (leaves that require grad) and the variant's decay argument.

    retention: γ = 1 − 2^-(5+h) for head h (RetNet's schedule); gla: ``log_g = logsigmoid(x)/16``
    (GLA's gate with temperature 16); delta: L2-normalised keys and ``β = sigmoid(x)``;
    gated_delta (one gate per head) and gated_delta_channel (one per key channel): as delta, with
    ``log_g = logsigmoid(x)/16``. The decay arguments are returned as a tuple.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v, x = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))     # (B, H, T, D)
    if variant == "retention":
        extra = (1 - 2.0 ** -(5 + torch.arange(H, dtype=torch.float64)),)         # (H,)
    elif variant == "gla":
        extra = (F.logsigmoid(x) / 16,)                                          # (B, H, T, D)
    else:
        k = F.normalize(k, dim=-1)
        beta = torch.sigmoid(x[..., 0])                                          # (B, H, T)
        log_g = F.logsigmoid(x.flip(-1)) / 16                                    # (B, H, T, D)
        extra = {"delta": (beta,), "gated_delta": (log_g[..., 0], beta),
                 "gated_delta_channel": (log_g, beta)}[variant]
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    extra = tuple(e.to(device=device, dtype=torch.float32 if variant == "retention" else dtype) for e in extra)
    return q, k, v, extra


def run_decay_benchmark(
    seq_lens: Sequence[int] = DEFAULT_DECAY_SEQ_LENS,
    *,
    variants: Sequence[str] = DECAY_VARIANTS,
    device: Union[torch.device, str, None] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    repeats: int = 3,
    warmup: int = 1,
    backward: bool = True,
    seed: int = 0,
    progress: bool = False,
    threads: Optional[int] = None,
) -> list[dict]:
    """Time the chunkwise and the recurrent forms of the decay family against each other.

    For each variant (``retention``: :func:`linattn.retention`, ``gla``:
    :func:`~linattn.gated_linear_attention`, ``delta``: :func:`~linattn.delta_rule`,
    ``gated_delta`` and ``gated_delta_channel``: :func:`~linattn.gated_delta_rule` with one gate
    per head or per key channel)
    and each ``T``, both ``method="chunk"`` and ``method="recurrent"`` run on the same
    seeded inputs (``D = Dv = head_dim``): the median forward time under ``torch.no_grad``
    and, with ``backward``, the median forward+backward time (``autograd.grad`` w.r.t.
    q, k, v of the output against a seeded upstream gradient).

    Parameters
    ----------
    seq_lens : sequence of int
        Sequence lengths ``T``.
    variants : sequence of str
        Names from :data:`DECAY_VARIANTS`.
    device, dtype, batch, heads, head_dim, chunk_size, repeats, warmup, seed, progress
        As in :func:`run_benchmark`.
    backward : bool
        Also time forward+backward.
    threads : int, optional
        ``torch.set_num_threads(threads)`` for the run (restored afterwards); None (the
        default) keeps the current setting. On a shared machine pin it: the ratios depend
        strongly on it.

    Returns
    -------
    list of dict
        One dict per (T, variant, method) with keys ``variant``, ``method``, ``seq_len``,
        ``batch``, ``heads``, ``head_dim``, ``chunk_size``, ``effective_chunk_size`` (the
        chunk length the functions use, ``min(chunk_size, T)``), ``dtype``, ``device``,
        ``threads`` (``torch.get_num_threads()`` during the run), ``fwd_s`` and ``fwd_bwd_s``
        (median seconds; None when not measured).

    Raises
    ------
    TypeError, ValueError
        Unknown variants or dtypes, non-positive sizes, ``repeats < 1``, ``warmup < 0``,
        CUDA requested but not available.
    """
    from .ops import delta, gated_delta, gla, retention
    decay = {"retention": retention.retention, "gla": gla.gated_linear_attention, "delta": delta.delta_rule,
             "gated_delta": gated_delta.gated_delta_rule, "gated_delta_channel": gated_delta.gated_delta_rule}

    device = _resolve_device(device)
    dtype = _resolve_dtype(dtype)
    variants = list(dict.fromkeys(variants))
    if not variants:
        raise ValueError("variants must name at least one variant")
    for variant in variants:
        if variant not in DECAY_VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(DECAY_VARIANTS)}")
    seq_lens = [_check_positive_int(T, "seq_lens entries") for T in seq_lens]
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence length")
    for value, name in ((batch, "batch"), (heads, "heads"), (head_dim, "head_dim"), (repeats, "repeats"),
                        (chunk_size, "chunk_size")):
        _check_positive_int(value, name)
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup must be an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if threads is not None:
        _check_positive_int(threads, "threads")
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_decay(decay, seq_lens, variants, device, dtype, batch, heads, head_dim, chunk_size,
                           repeats, warmup, backward, seed, progress)
    finally:
        torch.set_num_threads(threads_before)


def _time_decay(decay, seq_lens, variants, device, dtype, batch, heads, head_dim, chunk_size, repeats, warmup,
                backward, seed, progress) -> list[dict]:
    """The timing loop of :func:`run_decay_benchmark` (arguments already checked)."""
    functions = decay
    results = []
    with tqdm(total=len(seq_lens) * len(variants) * 2, disable=not progress, unit="cell",
              desc="linattn.bench --decay", file=sys.stderr) as bar:
        for T in seq_lens:
            for variant in variants:
                q, k, v, extra = _decay_inputs(variant, batch, heads, T, head_dim, dtype, device, seed)
                grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
                for method in ("chunk", "recurrent"):
                    bar.set_postfix_str(f"{variant} {method} T={T}")

                    def call(method=method, variant=variant, q=q, k=k, v=v, extra=extra):
                        return functions[variant](q, k, v, *extra, method=method, chunk_size=chunk_size)

                    def forward(call=call) -> None:
                        with torch.no_grad():
                            call()

                    def forward_backward(call=call, q=q, k=k, v=v, grad_out=grad_out) -> None:
                        torch.autograd.grad(call(), (q, k, v), grad_out)

                    row = dict(variant=variant, method=method, seq_len=T, batch=batch, heads=heads,
                               head_dim=head_dim, chunk_size=chunk_size,
                               effective_chunk_size=min(chunk_size, T), dtype=_dtype_name(dtype),
                               device=str(device), threads=torch.get_num_threads(), fwd_s=None, fwd_bwd_s=None)
                    row["fwd_s"] = median_time(forward, repeats=repeats, warmup=warmup, device=device)
                    if backward:
                        row["fwd_bwd_s"] = median_time(forward_backward, repeats=repeats, warmup=warmup,
                                                       device=device)
                    results.append(row)
                    bar.update()
    return results


def format_decay_table(results: Sequence[dict]) -> str:
    """An aligned plain-text table of :func:`run_decay_benchmark`'s results.

    One line per (T, variant): median forward and forward+backward times (ms) of the
    chunk and recurrent forms, and the ratios recurrent / chunk (above 1: the chunk
    form is faster). The title gives the chunk length the functions actually use,
    ``C = min(chunk_size, T)`` (a column ``C`` when it differs between rows), and the number
    of torch threads.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`run_decay_benchmark`.

    Returns
    -------
    str
        The table with a title and a legend; no trailing newline.
    """
    if not results:
        return "(no results)"
    first = results[0]
    cells = {(r["seq_len"], r["variant"], r["method"]): r for r in results}
    keys = list(dict.fromkeys((r["seq_len"], r["variant"]) for r in results))
    def effective_chunk(r: dict) -> int:
        return r.get("effective_chunk_size", min(r["chunk_size"], r["seq_len"]))

    chunks = sorted({effective_chunk(r) for r in results})
    per_row_chunk = len(chunks) > 1      # several T, some shorter than chunk_size: C differs by row
    header = ["T", "variant", *(["C"] if per_row_chunk else []), "chunk fwd ms", "rec fwd ms", "fwd rec/chunk",
              "chunk f+b ms", "rec f+b ms", "f+b rec/chunk"]
    rows = [header]
    for T, variant in keys:
        chunk, rec = cells.get((T, variant, "chunk")), cells.get((T, variant, "recurrent"))
        row = [str(T), variant]
        if per_row_chunk:
            row.append(str(effective_chunk(chunk or rec)))
        for key in ("fwd_s", "fwd_bwd_s"):
            a = None if chunk is None else chunk[key]
            b = None if rec is None else rec[key]
            row += [_num(a, 1e3), _num(b, 1e3), _num(b / a) + "x" if a and b else "-"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join([row[0].rjust(widths[0]), row[1].ljust(widths[1])]
                       + [c.rjust(w) for c, w in zip(row[2:], widths[2:])]).rstrip() for row in rows]
    # C is the chunk length actually used, min(chunk_size, T)
    chunk_text = f"C={chunks[0]}" if not per_row_chunk else f"C=min({first['chunk_size']}, T)"
    threads = sorted({r["threads"] for r in results if r.get("threads") is not None})
    threads_text = f", {'/'.join(map(str, threads))} thread{'s' if threads != [1] else ''}" if threads else ""
    title = (f"linattn decay family on {first['device']}{threads_text}, {first['dtype']}, B={first['batch']} "
             f"H={first['heads']} D=Dv={first['head_dim']}, {chunk_text}: chunk vs recurrent")
    legend = ("fwd: median under torch.no_grad; f+b: autograd.grad w.r.t. q, k, v; "
              "rec/chunk: recurrent time / chunk time (> 1: the chunk form is faster).")
    return "\n".join([title, "", *lines, "", legend])


# --------------------------------------------------------------------------- command line


def _arg_number(convert: type, minimum: float, strict: bool, what: str) -> Callable[[str], float]:
    """An argparse ``type``: ``convert(text)``, which must be above (or at) ``minimum``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _arg_number(int, 0, True, "a positive integer")
_non_negative_int = _arg_number(int, 0, False, "a non-negative integer")
_positive_float = _arg_number(float, 0.0, True, "a positive number")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m linattn.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m linattn.bench",
        description="Benchmark causal attention: softmax (SDPA) against linear attention's forms "
                    "(quadratic, cumsum, baseline_chunk, chunk, fused). Prints a table; optionally "
                    "writes JSON and a PNG.",
        epilog="Example: python -m linattn.bench --device cpu --seq-lens 1024 4096 --heads 8 --json out.json",
    )
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default=None,
        help="where to run (default: cuda if available, else cpu)")
    add("--dtype", choices=tuple(DTYPES), default="float32", help="input dtype (default: %(default)s)")
    add("--seq-lens", type=_positive_int, nargs="+", default=None, metavar="T",
        help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_SEQ_LENS))})")
    add("--batch", type=_positive_int, default=1, help="batch size B (default: %(default)s)")
    add("--heads", type=_positive_int, default=4, help="heads H (default: %(default)s)")
    add("--head-dim", type=_positive_int, default=64, help="head dimension D = Dv (default: %(default)s)")
    add("--methods", nargs="+", choices=METHODS, default=None, metavar="METHOD",
        help=f"methods to run, out of: {', '.join(METHODS)} (default: all)")
    add("--chunk-size", type=_positive_int, default=DEFAULT_CHUNK_SIZE,
        help="chunk size C of the chunkwise methods (default: %(default)s)")
    add("--repeats", type=_positive_int, default=5, help="timed calls per measurement (default: %(default)s)")
    add("--warmup", type=_non_negative_int, default=1, help="untimed calls first (default: %(default)s)")
    add("--no-backward", action="store_true", help="time the forward pass only")
    add("--max-memory-gb", type=_positive_float, default=None, metavar="GB",
        help="skip a cell whose predicted peak memory exceeds this; inf: no limit (default: half the "
             "device's memory)")
    add("--seed", type=_non_negative_int, default=0, help="seed of the random inputs (default: %(default)s)")
    add("--json", metavar="PATH", help="write metadata and raw results as JSON")
    add("--plot", metavar="PATH", help="save a PNG of time and memory against T (matplotlib)")
    add("--threads", type=_positive_int, default=None, metavar="N",
        help="torch.set_num_threads(N) for the run (default: torch's own default); pin it on a "
             "shared machine, where unpinned threads make the ratios meaningless")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--decay", action="store_true",
        help="instead: time the chunk and recurrent forms of retention, GLA and the delta rule "
             f"(the decay family); --seq-lens defaults to {' '.join(map(str, DEFAULT_DECAY_SEQ_LENS))} here, "
             "--methods, --max-memory-gb and --plot do not apply (and are refused)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m linattn.bench`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    0 when every cell that could run ran (skipped and unavailable cells are fine), 1 when
    a cell failed (the table, JSON and plot are written all the same). Bad flags exit with
    argparse's usage message and status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.decay:
        for flag, value in (("--methods", args.methods), ("--max-memory-gb", args.max_memory_gb),
                            ("--plot", args.plot)):
            if value is not None:
                parser.error(f"{flag} does not apply to --decay")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag}: the folder of {path!r} does not exist")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (only checked here: imported when plotting)
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")

    device = _resolve_device(args.device)
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.decay:
            return _main_decay(args, device, argv)
        return _main_attention(args, device, argv)
    finally:
        torch.set_num_threads(threads_before)


def _main_attention(args: argparse.Namespace, device: torch.device, argv: Optional[Sequence[str]]) -> int:
    """``python -m linattn.bench``: the table of :func:`run_benchmark` (and JSON, PNG)."""
    if args.methods is None:
        args.methods = list(METHODS)
    if args.seq_lens is None:
        args.seq_lens = list(DEFAULT_SEQ_LENS)
    settings = dict(device=device, dtype=args.dtype, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                    repeats=args.repeats, warmup=args.warmup, backward=not args.no_backward,
                    max_memory_gb=args.max_memory_gb, chunk_size=args.chunk_size, seed=args.seed)
    results = run_benchmark(args.methods, args.seq_lens, **settings, progress=not args.no_progress)
    print(format_table(results))

    if args.json is not None:
        metadata = machine_info(device)
        metadata.update({name: (str(value) if name == "device" else value) for name, value in settings.items()},
                        seq_lens=args.seq_lens, methods=list(dict.fromkeys(args.methods)), threads=args.threads,
                        matmul_size=2048, matmul_gflops=results[0]["matmul_gflops"],
                        max_memory_bytes=results[0]["max_memory_bytes"],
                        command=["python", "-m", "linattn.bench", *(sys.argv[1:] if argv is None else argv)])
        with open(args.json, "w") as f:
            json.dump({"metadata": metadata, "results": results}, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
    if args.plot is not None:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r["status"] == "failed" for r in results) else 0


def _main_decay(args: argparse.Namespace, device: torch.device, argv: Optional[Sequence[str]]) -> int:
    """``python -m linattn.bench --decay``: the table of :func:`run_decay_benchmark` (and JSON)."""
    seq_lens = args.seq_lens if args.seq_lens is not None else list(DEFAULT_DECAY_SEQ_LENS)
    settings = dict(device=device, dtype=args.dtype, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                    chunk_size=args.chunk_size, repeats=args.repeats, warmup=args.warmup,
                    backward=not args.no_backward, seed=args.seed)
    results = run_decay_benchmark(seq_lens, **settings, progress=not args.no_progress, threads=args.threads)
    print(format_decay_table(results))
    if args.json is not None:
        metadata = machine_info(device)
        metadata.update({name: (str(value) if name == "device" else value) for name, value in settings.items()},
                        seq_lens=seq_lens, variants=list(DECAY_VARIANTS), threads=args.threads,
                        command=["python", "-m", "linattn.bench", *(sys.argv[1:] if argv is None else argv)])
        with open(args.json, "w") as f:
            json.dump({"metadata": metadata, "results": results}, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
