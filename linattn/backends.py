"""Which implementation runs an op's ``method="chunk"``: a choice the caller can see and pin."""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator, Optional

import torch

from ._autograd import autograd_must_see_every_op

__all__ = ["BACKENDS", "OPS", "default_backends", "enabled_backends", "use_backends", "last_backend", "select"]

BACKENDS = ("torch", "cpu", "triton")
OPS = {                                   # the backends that implement each op's chunk method
    "linear_attention": ("triton", "cpu", "torch"),
    "retention": ("cpu", "torch"),
    "gated_linear_attention": ("cpu", "torch"),
    "delta_rule": ("cpu", "torch"),
    "gated_delta_rule": ("cpu", "torch"),
}

_pinned: list[tuple[str, ...]] = []       # the orders of the enclosing use_backends blocks
_last: list[Optional[str]] = [None]
_triton_failure: list[str] = []           # why the Triton kernel failed in this process (then never again)


def default_backends() -> tuple[str, ...]:
    """The order outside :func:`use_backends`, from ``LINATTN_DISABLE_TRITON`` and ``LINATTN_CPU_KERNEL``."""
    names = [] if os.environ.get("LINATTN_DISABLE_TRITON", "0") == "1" else ["triton"]
    if os.environ.get("LINATTN_CPU_KERNEL", "0") == "1":
        names.append("cpu")
    return (*names, "torch")


def enabled_backends() -> tuple[str, ...]:
    """The order in force: the innermost :func:`use_backends` block's, else :func:`default_backends`."""
    return _pinned[-1] if _pinned else default_backends()


@contextlib.contextmanager
def use_backends(*backends: str) -> Iterator[tuple[str, ...]]:
    """Run the chunk methods inside the block on the first of ``backends`` that can run each call.

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
    _pinned.append(tuple(dict.fromkeys(backends)))
    try:
        yield _pinned[-1]
    finally:
        _pinned.pop()


def last_backend() -> Optional[str]:
    """The backend that ran the most recent chunk method in this process (None before the first)."""
    return _last[0]


def select(op: str, *tensors: Optional[torch.Tensor], chunk_size: Optional[int] = None) -> str:
    """The backend that runs ``op``'s chunk method on ``tensors`` (``q``, ``k``, ``v``, then the op's
    other tensors; None allowed), recorded for :func:`last_backend`. Called by the ops.

    Raises
    ------
    RuntimeError
        Inside :func:`use_backends` without ``"torch"``, when no listed backend can run the call.
    """
    pinned = bool(_pinned)
    refused = []
    for name in enabled_backends():
        why = f"does not implement {op}" if name not in OPS[op] else _why_not(name, op, tensors, chunk_size, pinned)
        if why is None:
            _record(name)
            return name
        refused.append(f"{name}: {why}")
    raise RuntimeError(f"no enabled backend can run {op} here ({'; '.join(refused)}); add 'torch' to "
                       "linattn.backends.use_backends(...) to fall back to PyTorch")


def _record(name: str) -> None:
    if not torch.compiler.is_compiling():
        _last[0] = name


def _why_not(name: str, op: str, tensors, chunk_size: Optional[int], pinned: bool) -> Optional[str]:
    if name == "torch":
        return None
    if name == "cpu":
        return _why_not_cpu(op, tensors, pinned)
    return _why_not_triton(tensors, chunk_size)


def _why_not_cpu(op: str, tensors, pinned: bool) -> Optional[str]:
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return f"needs CPU float32/float64 tensors, got {x.dtype} on {x.device}"
    if tensors[2].shape[1] != tensors[1].shape[1]:
        return "grouped value heads (v has more heads than q and k)"
    if autograd_must_see_every_op(*tensors):
        return "autograd must see every op (torch.compile, torch.func transforms, forward-mode AD)"
    from .kernels import cpu

    if op != "linear_attention" and not cpu.token_loop_supports(tensors[2]):
        return "values wider than the token loop's rows (16 vectors)"
    if not cpu.cpu_kernel_available():
        if not pinned:
            cpu.warn_unavailable_once()
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
