"""Timers: medians of interleaved repetitions with their spread, peak memory, the matmul yardstick."""
from __future__ import annotations

import contextlib
import statistics
import random
import time
from typing import Callable, Optional, Sequence, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..experiments.origin import cpu_name

try:
    import resource                 # POSIX only: the page-fault counts of interleaved_times
except ImportError:                 # pragma: no cover (Windows)
    resource = None

__all__ = ["median_time", "peak_memory", "interleaved_times", "summarise", "paired_ratios", "matmul_gflops",
           "pinned_threads", "cpu_name"]


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

def matmul_gflops(device: Union[torch.device, str] = "cpu", *, size: int = 2048, repeats: int = 5,
                  warmup: int = 1) -> float:
    """This machine's float32 matmul throughput: ``2·size³`` FLOPs over the median time, in GFLOP/s.

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


def interleaved_times(fns: dict, *, repeats: int, warmup: int = 1,
                      device: Union[torch.device, str, None] = None,
                      on_error: Optional[Callable[[str, BaseException], None]] = None,
                      faults: Optional[dict] = None) -> dict:
    """Seconds of each call of each function, repetitions interleaved: ``{name: [s, ...]}``.

    Parameters
    ----------
    fns : dict of str to callable
        Called with no arguments; results are discarded.
    repeats : int
        Timed rounds (>= 1).
    warmup : int
        Untimed calls of each function first (>= 0).
    device : torch.device or str, optional
        When CUDA, the device is synchronised around each call.
    on_error : callable, optional
        ``on_error(name, error)`` for a function that raises (else the error propagates).
    faults : dict, optional
        Filled with ``{name: [minor page faults of each timed call, ...]}`` (see above).

    Returns
    -------
    dict of str to list of float

    Raises
    ------
    ValueError
        ``repeats < 1`` or ``warmup < 0``.
    TypeError
        ``faults`` is given but is not a dict.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if faults is not None and not isinstance(faults, dict):
        raise TypeError(f"faults must be a dict (filled in place) or None, got {type(faults).__name__}")
    device = torch.device(device) if device is not None else None
    times: dict = {name: [] for name in fns}
    count = faults is not None and resource is not None and (device is None or device.type == "cpu")
    if faults is not None:
        faults.update({name: [] for name in fns})
    alive = list(fns)

    def call(name: str, timed: bool = False) -> Optional[float]:
        try:
            _sync(device)
            counted = count and timed
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if counted else 0
            start = time.perf_counter()
            fns[name]()
            _sync(device)
            seconds = time.perf_counter() - start
            if counted:
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            return seconds
        except Exception as err:  # noqa: BLE001  (reported to the caller, who marks the cell failed)
            alive.remove(name)
            if on_error is None:
                raise
            on_error(name, err)
            return None

    for name in list(alive):
        for _ in range(warmup):
            if name in alive:
                call(name)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        order = list(alive)
        shuffle(order)
        for name in order:
            if name in alive:
                seconds = call(name, timed=True)
                if seconds is not None:
                    times[name].append(seconds)
    return times


def summarise(samples: Sequence[float]) -> dict:
    """Median, min, max and the relative spread ``(max - min) / median`` of a list of times."""
    if not samples:
        return {"median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med > 0 else None}


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> dict:
    """Round-by-round ratios ``a_r / b_r`` of two interleaved series: median, min and max."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    if not ratios:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


@contextlib.contextmanager
def pinned_threads(threads: Optional[int]):
    """``torch.set_num_threads(threads)`` inside the block (None: leave torch's setting), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
