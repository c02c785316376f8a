"""Starting ``P`` CPU processes (gloo on 127.0.0.1) and running one module-level function on each rank."""
from __future__ import annotations

import datetime
import math
import numbers
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import _checks

__all__ = ['RankError', 'run_on_ranks']


# ---------------------------------------------------------------------------------------
# Running a function on P local processes
# ---------------------------------------------------------------------------------------


class RankError(RuntimeError):
    """A function run by :func:`run_on_ranks` raised on one or more ranks.

    Attributes
    ----------
    failures : dict
        ``rank -> (exception type name, message, formatted traceback)``. A rank whose process
        exited without reporting has the type name ``"ProcessExit"``, a message with its exit
        code and an empty traceback.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        lines = [f"rank {r}: {message}" if name == "ProcessExit" else f"rank {r} raised {name}: {message}"
                 for r, (name, message, _) in sorted(failures.items())]
        text = "\n".join(lines)
        with_tb = [r for r in sorted(failures) if failures[r][2]]
        if with_tb:
            text += f"\n\ntraceback on rank {with_tb[0]}:\n{failures[with_tb[0]][2]}"
        super().__init__(text)


def _loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return names[0] if names else "lo"


def _child(rank: int, world_size: int, port: int, result_dir: str, fn: Callable, args: tuple,
           timeout: float, threads: int, backend: str) -> None:
    """Entry point of one spawned rank: join the process group, run ``fn``, write the result to a file."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(threads)
    delta = datetime.timedelta(seconds=timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=delta)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
        try:
            record = ("ok", fn(*args))
        finally:
            dist.destroy_process_group()
        payload = pickle.dumps(record)
    except BaseException as err:  # reported to the parent, which raises RankError
        payload = pickle.dumps(("error", (type(err).__name__, str(err), traceback.format_exc())))
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        f.write(payload)
    os.replace(path + ".part", path)   # the parent only ever sees complete files


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, threads: int = 1,
                 backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``world_size`` new processes that form one process group; return their results.

    Parameters
    ----------
    fn : callable
        A module-level function of an importable module (spawned processes import it by
        name: functions defined in a notebook or a lambda cannot be used). Inside it,
        ``torch.distributed.get_rank()`` tells the rank. Its result must be picklable.
    world_size : int
        Number of processes ``P >= 1``.
    *args
        Passed to ``fn`` on every rank (picklable).
    timeout : float
        Seconds for the whole run, start-up included, and for each collective.
    threads : int
        ``torch.set_num_threads`` in each rank.
    backend : str
        ``"gloo"`` (CPU) or ``"nccl"`` (case-insensitive). NCCL needs at least ``world_size``
        visible CUDA GPUs (checked here) and ``fn`` choosing its device.

    Returns
    -------
    list
        ``[result of rank 0, ..., result of rank P-1]``.

    Raises
    ------
    TypeError
        ``fn`` not an importable module-level function; non-int ``world_size`` or
        ``threads``; a non-number ``timeout``; a non-str ``backend``.
    ValueError
        ``world_size < 1``, ``threads < 1``, a non-positive or infinite ``timeout``, a
        ``backend`` other than gloo or nccl, nccl with fewer GPUs than ranks, or the
        backend not built into this torch. All checked before any process starts.
    RankError
        ``fn`` raised on some rank (message, type name and traceback of every failed rank),
        or a rank's process exited before reporting a result (the message gives the exit
        code and the usual causes: a script without an ``if __name__ == "__main__":``
        guard, which every spawned process re-runs; ``fn`` not importable in a fresh
        process; the process killed, e.g. for memory).
    TimeoutError
        Some rank did not finish within ``timeout`` seconds.
    """
    qualname = getattr(fn, "__qualname__", "")
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if not callable(fn) or "<" in qualname or module is None or (
            module.__name__ == "__main__" and not getattr(module, "__file__", None)):
        raise TypeError(
            f"fn must be a module-level function of an importable module (the spawned ranks import it "
            f"by name), got {fn!r}; move it into a .py file"
        )
    world_size = _checks.check_positive_int(world_size, "world_size")
    threads = _checks.check_positive_int(threads, "threads")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    backend = _check_backend(backend, world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="linattn_ranks_") as result_dir:
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(r, world_size, store.port, result_dir, fn, args, float(timeout), threads, backend))
                 for r in range(world_size)]
        results: dict[int, tuple] = {}
        stopped: set[int] = set()   # ranks this function had to terminate
        started = []
        try:
            for p in procs:
                p.start()
                started.append(p)
            _collect(procs, result_dir, results, time.monotonic() + timeout)
        finally:
            for r, p in enumerate(started):
                if p.is_alive():
                    stopped.add(r)
                    p.terminate()
            for p in started:
                p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
        _read_results(result_dir, len(procs), results)     # any file written after the last look
    del store
    failures = {r: payload for r, (status, payload) in results.items() if status == "error"}
    for r, p in enumerate(procs):
        if r not in results and r not in stopped:
            failures[r] = ("ProcessExit", _exit_message(p.exitcode), "")
    if failures:
        raise RankError(failures)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(f"run_on_ranks: rank(s) {missing} of {world_size} did not finish within {timeout} s")
    return [results[r][1] for r in range(world_size)]


_BACKENDS = ("gloo", "nccl")


def _check_backend(backend, world_size: int) -> str:
    """``backend`` as "gloo" or "nccl", usable here with ``world_size`` ranks."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, 'gloo' or 'nccl', got {type(backend).__name__}")
    key = backend.strip().lower()
    if key not in _BACKENDS:
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if not dist.is_available() or not (dist.is_gloo_available() if key == "gloo" else dist.is_nccl_available()):
        raise ValueError(f"backend={backend!r}: this build of torch has no {key} support")
    if key == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    return key


def _exit_message(code: Optional[int]) -> str:
    """Why a rank has no result although its process ended."""
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return (f"the spawned process exited ({how}) before reporting a result; its own error, if any, went to "
            "its stderr. Common causes: the script that calls run_on_ranks has no "
            "`if __name__ == \"__main__\":` guard, so every spawned process re-runs it; fn cannot be "
            "imported in a fresh process; the process was killed (e.g. out of memory)")


def _read_results(result_dir: str, n: int, results: dict) -> list[int]:
    """Load the result files not yet in ``results``; return the ranks just loaded."""
    new = []
    for r in range(n):
        path = os.path.join(result_dir, f"rank{r}.pkl")
        if r not in results and os.path.exists(path):
            with open(path, "rb") as f:
                results[r] = pickle.loads(f.read())
            new.append(r)
    return new


def _collect(procs: list, result_dir: str, results: dict, deadline: float, grace: float = 3.0) -> None:
    """Read the ranks' result files until every rank has reported or exited, the deadline
    passes, or ``grace`` s after a failure (peers may be waiting on the failed rank)."""
    stop_at = deadline
    while time.monotonic() < stop_at:
        exited = [p.exitcode is not None for p in procs]   # before reading: a rank writes, then exits
        for r in _read_results(result_dir, len(procs), results):
            if results[r][0] == "error":
                stop_at = min(stop_at, time.monotonic() + grace)
        silent = [r for r in range(len(procs)) if exited[r] and r not in results]   # exited without a result
        if silent:
            stop_at = min(stop_at, time.monotonic() + grace)
        if all(r in results or exited[r] for r in range(len(procs))):
            return
        time.sleep(0.01)
