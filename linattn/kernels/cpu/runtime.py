"""Loading the CPU kernels' library and calling it: its C signatures, OpenMP threads, buffers."""
from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import threading
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _fork
from . import build

__all__ = ["cpu_kernel_enabled", "cpu_kernel_available", "build_info", "warn_unavailable_once", "token_loop_supports",
           "target_flags", "vector_bytes"]

_BASE_FLAGS = ["-O3", "-ffp-contract=fast", "-std=gnu++17", "-shared", "-fPIC", "-pthread"]
_ROW_BYTES = 1024          # the token loops' widest row of the state: MAXV vectors of cpu_delta.cpp
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()


def _fresh_lock() -> None:
    """In a forked child: a fork while another thread held the lock (building, calibrating) must not hang it."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock)
_state: dict = {}          # "lib": the loaded library, "info": how it was built, "error": why not

def cpu_kernel_enabled() -> bool:
    """Whether ``LINATTN_CPU_KERNEL`` (``1``, the default when unset or empty, or ``force``) lets the chunk
    methods use this path."""
    return (os.environ.get("LINATTN_CPU_KERNEL", "").strip() or "1") in ("1", "force")


def cpu_kernel_available() -> bool:
    """Whether the compiled CPU path can run here (building it now if it was not built yet).

    Returns
    -------
    bool
        False when no C++ compiler is found or the build fails (:func:`build_info` says why).
    """
    return _library() is not None


def build_info() -> dict:
    """How the library was built: ``compiler``, ``flags``, ``path``, or ``error`` (after a build attempt)."""
    _library()
    return dict(_state.get("info") or {"error": _state.get("error")})


def target_flags() -> list[str]:
    """The instruction-set flag of the build: ``-march=$LINATTN_CPU_MARCH`` (unset or empty: ``native``, this CPU).

    Raises
    ------
    ValueError
        ``LINATTN_CPU_MARCH`` set to something that is not one compiler word (letters, digits, ``-._``).
    """
    march = os.environ.get("LINATTN_CPU_MARCH", "").strip() or "native"
    if not all(ch.isalnum() or ch in "-._" for ch in march):
        raise ValueError(f"LINATTN_CPU_MARCH must name one target of the compiler's -march= (e.g. native, "
                         f"haswell, x86-64-v3), got {march!r}")
    return [f"-march={march}"]


def vector_bytes() -> int:
    """Bytes per vector of the loaded library (64 with AVX-512, 32 with AVX2, 16 otherwise); 0 when none loaded."""
    lib = _library()
    return 0 if lib is None else int(_state["vector_bytes"])


def _declare(lib) -> None:
    """Give the library's functions their C signatures (AttributeError: a symbol is missing)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        signatures = {                   # name: (result, arguments); the last two ints: a flag and the threads
            "causal_pass": (c_int, [p] * 8 + [real] + [p] * 3 + [i64] * 5 + [c_int, c_int]),
            "elu_grad": (None, [p, p, i64]),
            "add_relu": (c_int, [p, p, i64, c_int]),
            "normaliser_grad": (c_int, [p] * 6 + [i64, i64, c_int]),
            "delta_forward": (c_int, [p] * 8 + [i64] * 5 + [c_int, c_int]),
            "delta_backward": (c_int, [p] * 13 + [i64] * 5 + [c_int, c_int]),
            "decay_forward": (c_int, [p] * 7 + [i64] * 5 + [c_int, c_int]),
            "decay_backward": (c_int, [p] * 11 + [i64] * 5 + [c_int, c_int]),
        }
        for name, (result, arguments) in signatures.items():
            fn = getattr(lib, f"linattn_{name}_{suffix}")
            fn.restype, fn.argtypes = result, arguments
    lib.linattn_vector_bytes.restype = c_int
    lib.linattn_set_openmp.restype = None
    lib.linattn_set_openmp.argtypes = [p, p, p]


def _open(compiler: str, flags: list[str]):
    """Build (or find in the cache) and load the library; a cached file that does not load is rebuilt once."""
    for attempt in (0, 1):
        path = build.build(compiler, flags, _state)
        try:
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib
        except (OSError, AttributeError):
            if attempt:
                raise
            for stale in (path, build.digest_path(path)):    # never written over: another process may have it mapped
                stale.unlink(missing_ok=True)


def _library():
    """The loaded library, or None (why: ``_state["error"]``). Built at most once per process."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, errors = None, []
        compiler = build.compiler()
        if compiler is None:
            cxx = os.environ.get("CXX")
            errors.append(f"CXX={cxx!r} names no C++ compiler executable (one program, without flags)" if cxx
                          else "no C++ compiler found (set CXX)")
        else:
            try:
                candidates = (_BASE_FLAGS + target_flags(), _BASE_FLAGS)
            except ValueError as err:
                candidates = ()
                errors.append(str(err))
            for flags in candidates:
                try:
                    lib = _open(compiler, flags)
                    break
                except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
                    errors.append(f"{' '.join(flags)}: {err}")
        if lib is not None and errors and compiler is not None:      # the targeted build failed, the plain one ran
            warnings.warn(f"linattn: the CPU kernels could not be built for the target asked for "
                          f"({errors[0]}); built without -march instead (generic vectors, slower)",
                          RuntimeWarning, stacklevel=2)
        if lib is not None:
            _state["vector_bytes"] = lib.linattn_vector_bytes()          # chosen by the compiler's target
            _state["info"]["vector_bytes"] = _state["vector_bytes"]
            runtime = None if _fork.forked else _torch_openmp()         # a forked child: threads of our own
            lib.linattn_set_openmp(*(runtime or (None, None, None)))
            _state["openmp"] = runtime is not None
        _state["error"] = "; ".join(errors) if lib is None else None
        _state["lib"] = lib
        return lib


def _torch_openmp() -> Optional[tuple[int, int, int]]:
    """``GOMP_parallel``, ``omp_get_thread_num``, ``omp_get_num_threads`` of the OpenMP runtime PyTorch loaded."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return None
    own = os.path.dirname(torch.__file__)
    paths = sorted({line.split(None, 5)[-1].strip() for line in maps.splitlines() if len(line.split(None, 5)) == 6},
                   key=lambda path: (not path.startswith(own), path))          # torch's own runtime first
    for path in paths:
        name = os.path.basename(path)
        if not name.startswith(("libgomp", "libiomp5", "libomp")) or ".so" not in name:
            continue
        try:
            omp = ctypes.CDLL(path)          # already loaded: the same handle, the same threads
            fns = (omp.GOMP_parallel, omp.omp_get_thread_num, omp.omp_get_num_threads)
        except (OSError, AttributeError):
            continue
        return tuple(ctypes.cast(fn, ctypes.c_void_p).value for fn in fns)
    return None


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _lanes(x: Tensor) -> int:
    """Numbers of ``x``'s dtype per vector of the loaded library."""
    return _state["vector_bytes"] // x.element_size()


def _pad_to_vector(x: Tensor) -> Tensor:
    """Contiguous ``x`` with its last dimension zero-padded to a whole number of the library's vectors."""
    lanes = _lanes(x)
    extra = -x.shape[-1] % lanes
    return (F.pad(x, (0, extra)) if extra else x).contiguous()


def warn_unavailable_once() -> None:
    """A RuntimeWarning, once per process, when ``LINATTN_CPU_KERNEL`` (``1`` or ``force``) names an unavailable
    kernel."""
    if not _state.get("warned"):
        _state["warned"] = True
        value = os.environ.get("LINATTN_CPU_KERNEL", "").strip()
        warnings.warn(f"LINATTN_CPU_KERNEL={value} but the linattn CPU kernel is not available "
                      f"({_state.get('error')}); using the PyTorch path", RuntimeWarning, stacklevel=5)


def _check_status(status: int) -> None:
    """A MemoryError for a kernel's status 3 (its threads or buffers could not be allocated), else a RuntimeError."""
    if status == 3:
        raise MemoryError("linattn CPU kernel: its threads or work buffers could not be allocated")
    if status != 0:
        raise RuntimeError(f"linattn CPU kernel refused its arguments (status {status})")


def token_loop_supports(v: Tensor) -> bool:
    """Whether the token loops of :mod:`.recurrent` take values of ``v``'s width (rows of 1 KiB at most:
    ``Dv <= 256`` in float32, ``<= 128`` in float64)."""
    return v.shape[-1] * v.element_size() <= _ROW_BYTES
