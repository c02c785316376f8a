"""Calibrating the compiled CPU loops against the PyTorch chunk forms on this machine (``python -m linattn.calibrate``);
the verdicts are cached beside the built library (:mod:`linattn.kernels.cpu.calibration`) and the default
(``LINATTN_CPU_KERNEL=1``) follows them (``force``: the loops run regardless; ``0``: never)."""
from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Optional

import torch
import torch.nn.functional as F

from . import backends
from .attention import linear_attention
from .kernels.cpu import build_info, calibration, cpu_kernel_available
from .ops.delta import delta_rule
from .ops.gated_delta import gated_delta_rule
from .ops.gla import gated_linear_attention
from .ops.retention import retention

__all__ = ["PROBLEM", "calibrate_cpu_kernels"]

PROBLEM = dict(batch=1, heads=8, seq_len=512, head_dim=64, dtype="float32", rounds=5, seed=0)
_lock = threading.Lock()


def _fresh_lock() -> None:
    """In a forked child: a fork while another thread held the lock (building, calibrating) must not hang it."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock)


def _calls(p: dict) -> dict:
    """Each op on one seeded problem: a function of ``backward`` that runs it once."""
    g = torch.Generator().manual_seed(p["seed"])
    B, H, T, D = p["batch"], p["heads"], p["seq_len"], p["head_dim"]
    q, k, v, w = (torch.randn(B, H, T, D, generator=g, dtype=torch.float32) for _ in range(4))  # (B, H, T, D)
    unit_k = F.normalize(k, dim=-1)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float32)                               # (B, H, T)
    log_a = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float32) + 4)           # (B, H, T)
    log_g = F.logsigmoid(torch.randn(B, H, T, D, generator=g, dtype=torch.float32)) / 16       # (B, H, T, D)
    gamma = 1 - 2.0 ** -(5 + torch.arange(H, dtype=torch.float32))                 # (H,)
    ops = {
        "linear_attention": lambda q_, k_, v_: linear_attention(q_, k_, v_, causal=True, method="chunk"),
        "retention": lambda q_, k_, v_: retention(q_, k_, v_, gamma),
        "gated_linear_attention": lambda q_, k_, v_: gated_linear_attention(q_, k_, v_, log_g),
        "delta_rule": lambda q_, k_, v_: delta_rule(q_, k_, v_, beta),
        "gated_delta_rule": lambda q_, k_, v_: gated_delta_rule(q_ / 8, k_, v_, log_a, beta),
    }
    unit = {"delta_rule", "gated_delta_rule"}

    def make(op):
        def run(backward: bool) -> None:
            xs = [x.requires_grad_(backward) for x in (q.clone(), (unit_k if op in unit else k).clone(), v.clone())]
            with torch.set_grad_enabled(backward):
                out = ops[op](*xs)
                if backward:
                    (out * w).sum().backward()
        return run

    return {op: make(op) for op in ops}


def _time_pair(run, backward: bool, rounds: int, clock) -> dict:
    """Median seconds of the compiled and the PyTorch call, interleaved round by round, and their ratio."""
    times = {"cpu": [], "torch": []}
    for _ in range(rounds + 1):                          # the first round warms up and is dropped
        for name in ("cpu", "torch"):
            with backends.use_backends(name):
                start = clock()
                run(backward)
                times[name].append(clock() - start)
    compiled, pytorch = times["cpu"][1:], times["torch"][1:]
    ratio = statistics.median(t / c for t, c in zip(pytorch, compiled))
    compiled_s, torch_s = statistics.median(compiled), statistics.median(pytorch)
    return {"compiled_s": compiled_s, "torch_s": torch_s, "torch_over_compiled": round(ratio, 3),
            "compiled_faster": ratio > 1.0 and compiled_s < torch_s}   # both ways of reading the rounds agree


def calibrate_cpu_kernels(threads: Optional[int] = None, *, force: bool = False) -> dict:
    """Time every op's compiled loop against its PyTorch chunk form and cache the verdicts beside the library.

    ``threads`` (default ``torch.get_num_threads()``); ``force`` measures again even if verdicts exist. Returns the
    file's content: ``problem``, ``build``, and under ``threads[str(threads)][op][pass]`` (``"forward"``,
    ``"forward+backward"``) ``compiled_s``, ``torch_s``, ``torch_over_compiled`` and ``compiled_faster``.
    Raises RuntimeError where the compiled CPU kernel is not available, ValueError for ``threads`` not a positive int.
    """
    if not cpu_kernel_available():
        raise RuntimeError(f"the CPU kernel is not available here ({build_info().get('error')})")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    threads = torch.get_num_threads() if threads is None else threads
    with _lock:
        have = calibration.load_calibration()
        if not force and all(calibration.verdict(op, backward, threads) is not None
                             for op in backends.OPS for backward in (False, True)):
            return have                                  # every verdict there (a malformed entry: measure again)
        results = _in_own_thread(lambda: _measure(threads))
        about = {"problem": PROBLEM, "build": {k: v for k, v in build_info().items() if k != "path"},
                 "torch": torch.__version__}
        return calibration.save_calibration(threads, results, about)


def _measure(threads: int) -> dict:
    """Every op's verdicts with ``threads`` threads: ``{op: {pass: record}}``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            clock = time.thread_time if threads == 1 else time.perf_counter
            return {op: {name: _time_pair(run, backward, PROBLEM["rounds"], clock)
                         for name, backward in zip(calibration.PASSES, (False, True))}
                    for op, run in _calls(PROBLEM).items()}
    finally:
        torch.set_num_threads(previous)


def _in_own_thread(fn):
    """``fn()`` on a thread of its own, the caller waiting: a first call may calibrate inside the caller's
    ``torch.utils.checkpoint`` or ``saved_tensors_hooks``, grad mode or autocast, which are thread-local and must
    neither see nor shape the calibration's own passes."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=run, name="linattn-calibrate")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def main(argv=None) -> int:
    """``python -m linattn.calibrate [--threads N ...] [--force]``: calibrate and print the verdicts."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m linattn.calibrate", description=main.__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="thread counts to calibrate for (default: torch's current count)")
    parser.add_argument("--force", action="store_true", help="measure again even if verdicts are cached")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.threads):
        parser.error(f"--threads must be positive, got {args.threads}")
    args.threads = list(dict.fromkeys(args.threads))
    if not cpu_kernel_available():
        parser.exit(1, f"python -m linattn.calibrate: the CPU kernel is not available here "
                       f"({build_info().get('error')})\n")
    doc = {}
    for n in args.threads:
        doc = calibrate_cpu_kernels(n, force=args.force)
    print(f"calibration: {calibration.calibration_path()}")
    print(f"{'threads':>7}  {'op':<24}{'pass':<18}{'PyTorch/compiled':>17}  runs")
    for n in args.threads:
        for op, passes in doc["threads"][str(n)].items():
            for name, r in passes.items():
                print(f"{n:>7}  {op:<24}{name:<18}{r['torch_over_compiled']:>17.2f}  "
                      f"{'compiled' if r['compiled_faster'] else 'PyTorch'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
