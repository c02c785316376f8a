"""Measuring time and memory: the helpers behind the book's measurements.

``median_time`` and ``peak_memory`` are what every chapter's timing and memory cells use.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["median_time", "peak_memory"]


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
