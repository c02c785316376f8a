"""Running one function on ``P`` local processes with PyTorch's own launcher (what ``torchrun`` runs)."""
from __future__ import annotations

import datetime
import glob
import json
import math
import numbers
import os
import signal
import tempfile
import threading
import traceback
import uuid
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .. import _checks

__all__ = ['RankError', 'run_on_ranks']


class RankError(RuntimeError):
    """``fn`` raised on one or more ranks of :func:`run_on_ranks`.

    Attributes
    ----------
    failures : dict
        ``rank -> (exception type name, message, formatted traceback)`` for every rank that
        raised before the launcher stopped the others (a peer's failure usually makes the ranks
        waiting for it raise too); ``("ProcessExit", "exit code N", "")`` for a process that
        died without raising.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        lines = [f"rank {r} raised {name}: {message}" for r, (name, message, _) in sorted(failures.items())]
        shown = [r for r in sorted(failures) if failures[r][2]]
        trace = f"\n\ntraceback on rank {shown[0]}:\n{failures[shown[0]][2]}" if shown else ""
        super().__init__("\n".join(lines) + trace)


def _in_process_group(fn: Callable, args: tuple, timeout: float, threads: int, backend: str):
    """One rank: join the process group that the launcher's environment describes, run ``fn``, leave."""
    torch.set_num_threads(threads)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


_HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, name))


def _signal_handlers() -> dict:
    """This process's handlers of the signals the elastic launcher takes over (only the main thread has any)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}


def _every_failure(logs: str, failed: ChildFailedError) -> RankError:
    """Every rank's error, from the error files the launcher's ranks wrote into ``logs`` (the launcher itself
    names only the first process it saw exit, often a peer that lost its connection to the one that raised)."""
    failures = {}
    for path in glob.glob(os.path.join(logs, "*", "attempt_*", "*", "error.json")):
        with open(path) as f:
            error = json.load(f)["message"]
        name, _, message = error["message"].partition(": ")
        failures[int(os.path.basename(os.path.dirname(path)))] = (name, message, error["extraInfo"]["py_callstack"])
    exits = {r: ("ProcessExit", f"exit code {f.exitcode}", "") for r, f in failed.failures.items()}
    return RankError(failures or exits)


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, threads: int = 1,
                 backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``world_size`` new local processes that form one process group; return their results.

    The processes are started by ``torch.distributed.launcher.api.elastic_launch``, the launcher
    behind ``torchrun``: it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (a free port on 127.0.0.1), so each rank joins with ``init_process_group(backend)`` as under
    ``torchrun``, and returns each rank's result. The handlers of SIGTERM, SIGINT, SIGHUP and
    SIGQUIT that the launcher installs in this process are replaced by the caller's again when it
    returns (a notebook's kernel keeps its own).

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
    RankError
        ``fn`` raised on some rank (the type, message and traceback of every rank that raised;
        a rank's process that died without raising, e.g. killed for memory, as ``ProcessExit``).
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
        handlers = _signal_handlers()          # the launcher installs its own and leaves them: restore ours
        try:
            results = elastic_launch(config, _in_process_group)(fn, args, float(timeout), threads, backend)
        except ChildFailedError as failed:
            raise _every_failure(logs, failed) from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    return [results[r] for r in range(world_size)]
