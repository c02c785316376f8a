"""Which implementation runs an op's ``method="chunk"``: a choice the caller can see and pin."""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator, Optional

import torch

from ._autograd import autograd_must_see_every_op

__all__ = ["BACKENDS", "OPS", "CALIBRATED_STATE", "default_backends", "enabled_backends", "use_backends",
           "last_backend", "select", "set_cpu_calibrator"]

BACKENDS = ("torch", "cpu", "triton")
OPS = {                                   # the backends that implement each op's chunk method
    "linear_attention": ("triton", "cpu", "torch"),
    "retention": ("cpu", "torch"),
    "gated_linear_attention": ("cpu", "torch"),
    "delta_rule": ("cpu", "torch"),
    "gated_delta_rule": ("cpu", "torch"),
}



class _PerThread(threading.local):
    """The (order, calibrated) pairs of the enclosing use_backends blocks and the last backend that ran, per thread."""
    pinned: tuple = ()
    last: Optional[str] = None


_state = _PerThread()
_PLAIN = (torch.Tensor, torch.nn.Parameter)   # tensors whose memory the compiled loops may read
_calibrator: list = [None]                # measures the compiled loops (linattn.calibrate, set on import)
_triton_failure: list[str] = []           # why the Triton kernel failed in this process (then never again)


CALIBRATED_STATE = 64 * 64
"""The largest state per head (key features × value width) the calibration's verdicts are applied to: its problem's
(``D = Dv = 64``, float32). Wider states, and float64, take the PyTorch chunk form by default (the loops' state
no longer fits their tiles); ``LINATTN_CPU_KERNEL=force`` or ``use_backends("cpu")`` still runs them."""

_ENV_CHOICES = {"LINATTN_DISABLE_TRITON": ("0", "1"), "LINATTN_CPU_KERNEL": ("0", "1", "force")}
_env_warned: set = set()


_ENV_DEFAULTS = {"LINATTN_DISABLE_TRITON": "0", "LINATTN_CPU_KERNEL": "1"}


def _env(name: str) -> str:
    """The variable's value (unset or empty: its default); an unrecognised one warns once and counts as ``0``."""
    value = os.environ.get(name, "").strip() or _ENV_DEFAULTS[name]
    if value in _ENV_CHOICES[name]:
        return value
    if (name, value) not in _env_warned:
        _env_warned.add((name, value))
        warnings.warn(f"{name}={value!r} is not one of {', '.join(_ENV_CHOICES[name])}; treated as 0",
                      RuntimeWarning, stacklevel=3)
    return "0"


def default_backends() -> tuple[str, ...]:
    """The order outside :func:`use_backends`, from ``LINATTN_DISABLE_TRITON`` and ``LINATTN_CPU_KERNEL``
    (``1``, the default: the compiled CPU loops where the calibration found them faster; ``force``: wherever
    they run; ``0``: never)."""
    names = [] if _env("LINATTN_DISABLE_TRITON") == "1" else ["triton"]
    if _env("LINATTN_CPU_KERNEL") in ("1", "force"):
        names.append("cpu")
    return (*names, "torch")


def _default_calibrated() -> bool:
    return _env("LINATTN_CPU_KERNEL") != "force"


def enabled_backends() -> tuple[str, ...]:
    """The order in force: the innermost :func:`use_backends` block's, else :func:`default_backends`."""
    pinned = _state.pinned
    return pinned[-1][0] if pinned else default_backends()


def set_cpu_calibrator(fn) -> None:
    """The function that measures the compiled CPU loops for a thread count (``fn(threads)``); set by linattn."""
    _calibrator[0] = fn


@contextlib.contextmanager
def use_backends(*backends: str, calibrated: bool = False) -> Iterator[tuple[str, ...]]:
    """Run the chunk methods inside the block on the first of ``backends`` that can run each call.

    With ``calibrated=True`` ``"cpu"`` runs an op only where :func:`linattn.calibrate.calibrate_cpu_kernels`
    found it faster than the PyTorch chunk form, as ``LINATTN_CPU_KERNEL=1`` does.

    Raises
    ------
    TypeError
        A backend name that is not a str.
    ValueError
        No name, or a name not in :data:`BACKENDS`.
    """
    if not backends:
        raise ValueError(f"use_backends needs at least one backend out of {BACKENDS}")
    for name in backends:
        if not isinstance(name, str):
            raise TypeError(f"a backend name must be a str, one of {BACKENDS}, got {type(name).__name__}")
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    if not isinstance(calibrated, bool):
        raise TypeError(f"calibrated must be a bool, got {type(calibrated).__name__}")
    order = tuple(dict.fromkeys(backends))
    outer = _state.pinned
    _state.pinned = outer + ((order, calibrated),)
    try:
        yield order
    finally:
        _state.pinned = outer


def last_backend() -> Optional[str]:
    """The backend that ran the most recent chunk method in this process (None before the first)."""
    return _state.last


def select(op: str, *tensors: Optional[torch.Tensor], chunk_size: Optional[int] = None) -> str:
    """The backend that runs ``op``'s chunk method on ``tensors`` (``q``, ``k``, ``v``, then the op's
    other tensors; None allowed), recorded for :func:`last_backend`. Called by the ops.

    Raises
    ------
    RuntimeError
        Inside :func:`use_backends` without ``"torch"``, when no listed backend can run the call.
    """
    stack = _state.pinned
    pinned = bool(stack)
    calibrated = stack[-1][1] if pinned else _default_calibrated()
    refused = []
    for name in enabled_backends():
        why = (f"does not implement {op}" if name not in OPS[op]
               else _why_not(name, op, tensors, chunk_size, pinned, calibrated))
        if why is None:
            _record(name)
            return name
        refused.append(f"{name}: {why}")
    raise RuntimeError(f"no enabled backend can run {op} here ({'; '.join(refused)}); add 'torch' to "
                       "linattn.backends.use_backends(...) to fall back to PyTorch")


def _record(name: str) -> None:
    if not torch.compiler.is_compiling():
        _state.last = name


def _why_not(name: str, op: str, tensors, chunk_size: Optional[int], pinned: bool, calibrated: bool) -> Optional[str]:
    if name == "torch":
        return None
    if name == "cpu":
        why = _why_not_cpu(op, tensors, pinned)
        return why if why is not None or not calibrated else _slower_here(op, tensors)
    return _why_not_triton(tensors, chunk_size)


def _slower_here(op: str, tensors) -> Optional[str]:
    """Why the compiled loop of ``op`` does not run under the calibration, or None when it was the faster."""
    from .kernels.cpu import calibration

    anyway = "LINATTN_CPU_KERNEL=force or use_backends('cpu') runs it anyway"
    dtype, (k, v) = tensors[0].dtype, tensors[1:3]          # the computation's dtype: q's (half inputs: float32)
    if dtype != torch.float32 or k.shape[-1] * v.shape[-1] > CALIBRATED_STATE:
        return (f"outside what the calibration measured (float32, a state of at most {CALIBRATED_STATE} numbers "
                f"per head), got {dtype} and {k.shape[-1]}x{v.shape[-1]}; {anyway}")
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    threads = torch.get_num_threads()
    faster = calibration.verdict(op, backward, threads)
    if faster is None and _calibrator[0] is not None:
        _calibrator[0](threads)                      # once per library and thread count, then cached
        faster = calibration.verdict(op, backward, threads)
    if faster is None:
        return f"not calibrated for {threads} thread(s) ({calibration.calibration_path()}); {anyway}"
    if faster is False:
        return (f"slower than the PyTorch chunk form on this machine ({calibration.PASSES[backward]}, "
                f"{threads} thread(s); calibrated in {calibration.calibration_path()}; {anyway})")
    return None


def _why_not_cpu(op: str, tensors, pinned: bool) -> Optional[str]:
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return f"needs CPU float32/float64 tensors, got {x.dtype} on {x.device}"
    if tensors[2].shape[1] != tensors[1].shape[1]:
        return "grouped value heads (v has more heads than q and k)"
    if autograd_must_see_every_op(*tensors):
        return "autograd must see every op (torch.compile, torch.func transforms, forward-mode AD)"
    if torch._C._len_torch_dispatch_stack() or any(t is not None and type(t) not in _PLAIN for t in tensors):
        return "a dispatch mode or tensor subclass must see every op (FakeTensorMode, FlopCounterMode, ...)"
    from .kernels import cpu

    if op != "linear_attention" and not cpu.token_loop_supports(tensors[2]):
        return "values wider than the token loop's rows (1 KiB: Dv <= 256 float32, <= 128 float64)"
    if not cpu.cpu_kernel_available():
        if not pinned and os.environ.get("LINATTN_CPU_KERNEL", "").strip() in ("1", "force"):
            cpu.warn_unavailable_once()              # asked for by name; the default falls back quietly
        return f"not available here ({cpu.build_info().get('error')})"
    return None


def _why_not_triton(tensors, chunk_size: Optional[int]) -> Optional[str]:
    x = tensors[0]
    if _triton_failure:
        return f"failed earlier in this process ({_triton_failure[0]})"
    if not x.is_cuda or x.dtype != torch.float32:
        return "needs CUDA float32 features"
    if chunk_size is None or chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"needs a power-of-two chunk_size >= 16, got {chunk_size}"
    from .kernels import triton_available

    return None if triton_available() else "Triton cannot run here (not installed, or no CUDA)"


def _triton_failed(err: BaseException) -> None:
    """The Triton kernel failed to compile or launch: warn once, and never try it again in this process."""
    _triton_failure.append(repr(err))
    warnings.warn(f"linattn: the fused Triton kernel failed ({err!r}); using the PyTorch chunk path from now "
                  "on in this process (set LINATTN_DISABLE_TRITON=1 to skip the kernel)", RuntimeWarning, stacklevel=4)
