"""Running one function on ``P`` local processes with PyTorch's own launcher (what ``torchrun`` runs)."""
from __future__ import annotations

import datetime
import math
import numbers
import tempfile
import uuid
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .. import _checks

__all__ = ['RankError', 'run_on_ranks']

#: What :func:`run_on_ranks` raises when a rank fails: PyTorch's own error, with every failed rank's
#: traceback (the name is kept from linattn 0.2, whose launcher had an exception of its own).
RankError = ChildFailedError


def _in_process_group(fn: Callable, args: tuple, timeout: float, threads: int, backend: str):
    """One rank: join the process group that the launcher's environment describes, run ``fn``, leave."""
    torch.set_num_threads(threads)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, threads: int = 1,
                 backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``world_size`` new local processes that form one process group; return their results.

    The processes are started by ``torch.distributed.launcher.api.elastic_launch``, the launcher
    behind ``torchrun``: it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (a free port on 127.0.0.1), so each rank joins with ``init_process_group(backend)`` as under
    ``torchrun``, and returns each rank's result.

    Parameters
    ----------
    fn : callable
        A module-level function of an importable module (the processes are spawned and import
        it by name: not a lambda, nor a function defined in a notebook). Inside it,
        ``torch.distributed.get_rank()`` tells the rank. Its result must be picklable.
    world_size : int
        Number of processes ``P >= 1``.
    *args
        Passed to ``fn`` on every rank (picklable).
    timeout : float
        Seconds a collective may wait (``init_process_group``'s timeout): a rank left waiting
        for a peer that failed or hangs raises after it, and the launcher stops the others.
    threads : int
        ``torch.set_num_threads`` in each rank.
    backend : str
        ``"gloo"`` (CPU) or ``"nccl"`` (``fn`` chooses its GPU, e.g. by
        ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``).

    Returns
    -------
    list
        ``[result of rank 0, ..., result of rank P-1]``.

    Raises
    ------
    TypeError
        ``fn`` not a module-level function; non-int ``world_size`` or ``threads``; a
        non-number ``timeout``; a non-str ``backend``.
    ValueError
        ``world_size < 1``, ``threads < 1``, a non-positive or infinite ``timeout``, a
        ``backend`` other than gloo or nccl or not built into this torch; checked before any
        process starts.
    torch.distributed.elastic.multiprocessing.errors.ChildFailedError
        (also named :data:`RankError`) ``fn`` raised, or a process died, on some rank: its
        ``failures`` map each failed rank to its exit code and traceback.
    """
    if not callable(fn) or "<" in getattr(fn, "__qualname__", "<"):
        raise TypeError(f"fn must be a module-level function of an importable module (the spawned ranks import "
                        f"it by name), got {fn!r}; move it into a .py file")
    world_size = _checks.check_positive_int(world_size, "world_size")
    threads = _checks.check_positive_int(threads, "threads")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, 'gloo' or 'nccl', got {type(backend).__name__}")
    backend = backend.strip().lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if not dist.is_available() or not (dist.is_gloo_available() if backend == "gloo" else dist.is_nccl_available()):
        raise ValueError(f"backend={backend!r}: this build of torch has no {backend} support")
    with tempfile.TemporaryDirectory(prefix="linattn_ranks_") as logs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              monitor_interval=0.05, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs))
        results = elastic_launch(config, _in_process_group)(fn, args, float(timeout), threads, backend)
    return [results[r] for r in range(world_size)]
