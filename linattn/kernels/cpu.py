"""An optional compiled CPU path for causal linear attention (forward and backward).

The twin of :func:`linattn.ops.linear.chunkwise_linear_attention` (same arguments, same results
up to rounding), for float32 and float64 CPU tensors. It is built on first use from the C++
file next to this one (``cpu_causal.cpp``: plain C++, no PyTorch headers) with the system's C++
compiler and loaded with :mod:`ctypes`; where no compiler exists or the build fails, it is
simply not available and :func:`linattn.linear_attention` keeps its PyTorch path. Installing
``linattn`` never compiles anything.

Why a compiled path on the CPU. The chunkwise form (chapter 5) does about twice the FLOPs of
the token recurrence (``4·M·Dv`` per token: update the state, read it), in batched matrix
products of ``64×64`` blocks that PyTorch's BLAS runs well below its large-matrix rate, plus
the passes over memory between them. A loop over tokens in C++ with the ``M×Dv`` state in the
cache does half the FLOPs (this one, with its two-level sums, about 0.6), but a naive one
(fast-transformers' CPU kernel) runs far below the machine's rate too: every token loads and
stores the whole state. Here each tile of the state (a few rows × 32 float32 columns) stays in
vector registers while a block of tokens streams through it, so the inner loop is two fused
multiply-adds per loaded number.

One pass computes, per head, ``out_t = a_tᵀ X_t`` with ``X_t = X_init + Σ_{s<=t} b_s c_sᵀ``
(``s >= t`` for a reverse pass) and returns the final ``X``; the state is summed in two levels,
within blocks of ``chunk_size`` tokens and across blocks, as in the chunkwise form. With
``g`` the upstream gradient, ``d_t`` the normaliser used and ``y`` the output::

    forward      a, b, c = φ(q), φ(k), v          (+ d_t = φ(q_t)ᵀ z_t, y_t = num_t / d_t)
    dφ(q)        a, b, c = [g/d, g_d], [v, 1], φ(k)        causal,  X_init = [S0ᵀ; z0]
    dφ(k)        a, b, c = [v, 1], [g/d, g_d], φ(q)        reverse, X_init = [g_Sᵀ; g_z] -> [·; dz0]
    dv           a, b, c = φ(k), φ(q), g/d                 reverse, X_init = g_S -> dS0

with ``g_d = −(g·y)/d`` (0 where ``eps`` replaced ``d``). Causality with non-finite values holds
by construction: a token enters the state only at its own position, and no masked product
multiplies a later token by zero.

The same library holds a token loop of the delta rule and the gated delta rule
(``cpu_delta.cpp``, :func:`delta_rule_cpu`): there the chunk form's extra work (the triangular
solve, the ``C × C`` decays, a dozen passes over memory per chunk) is what a loop with the
``Dk × Dv`` state in the L1 cache avoids; two passes over the state per token forward, four
backward, from states kept every ``chunk_size`` tokens. Without the delta correction the same
loop runs retention and GLA (:func:`decay_cpu`): one pass per token forward, two backward.

Threads: the heads are shared among ``torch.get_num_threads()`` threads, those of the OpenMP
runtime PyTorch loaded where it is found (:func:`_torch_openmp`, ``cpu_parallel.h``): after a
parallel PyTorch operation its threads spin for milliseconds, and threads of our own started
meanwhile ran no faster on two cores than one.

Environment: ``LINATTN_CPU_KERNEL=1`` makes :func:`linattn.linear_attention`,
:func:`linattn.delta_rule`, :func:`linattn.gated_delta_rule`, :func:`linattn.retention` and
:func:`linattn.gated_linear_attention` (``method="chunk"``, CPU,
float32/float64, and half inputs, which compute in float32) use this library; ``CXX`` names the compiler (default ``c++``);
``LINATTN_CACHE_DIR`` the folder for the built library (default ``~/.cache/linattn``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_bool, check_eps, check_tensor, shape_str
from .._numerics import no_autocast
from ..ops._common import differentiable_backward
from ..ops.linear import _NO_SECOND_DERIVATIVE

__all__ = ["causal_linear_attention_cpu", "cpu_kernel_available", "cpu_kernel_enabled", "build_info"]

_SOURCE = pathlib.Path(__file__).with_name("cpu_causal.cpp")
_SOURCES = (_SOURCE, _SOURCE.with_name("cpu_delta.cpp"))     # one library: linear attention, the delta rule
_HEADERS = (_SOURCE.with_name("cpu_vector.h"), _SOURCE.with_name("cpu_parallel.h"))   # included by both: in the key
_BASE_FLAGS = ["-O3", "-ffp-contract=fast", "-std=gnu++17", "-shared", "-fPIC", "-pthread"]
_NATIVE = ["-march=native"]
_VECTOR_BYTES = 64
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()
_state: dict = {}          # "lib": the loaded library, "info": how it was built, "error": why not


def cpu_kernel_enabled() -> bool:
    """Whether ``LINATTN_CPU_KERNEL=1`` asks :func:`linattn.linear_attention` to use this path."""
    return os.environ.get("LINATTN_CPU_KERNEL", "0") == "1"


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


def _compiler() -> Optional[str]:
    name = os.environ.get("CXX")
    if name:
        return shutil.which(name) or (name if os.path.isfile(name) else None)
    for candidate in ("c++", "g++", "clang++"):
        path = shutil.which(candidate)
        if path:
            return path
    return None


def _machine_key() -> str:
    """What a ``-march=native`` build depends on: the CPU model and its feature flags."""
    text = platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return text


def _cache_dir() -> pathlib.Path:
    folder = os.environ.get("LINATTN_CACHE_DIR")
    if folder:
        return pathlib.Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "linattn"


def _build(compiler: str, flags: list[str]) -> pathlib.Path:
    """Compile the source with ``flags`` into the cache (once per source, flags, compiler, CPU)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in _SOURCES + _HEADERS), " ".join(flags), version,
                                    _machine_key()]).encode())
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"linattn_cpu_{key.hexdigest()[:16]}.so"
    if not _intact(target):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        digest = tmp + ".sha256"
        try:
            proc = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip()[-2000:] or f"{compiler} exited with {proc.returncode}")
            pathlib.Path(digest).write_text(_sha256(pathlib.Path(tmp)))
            os.replace(tmp, target)          # atomic: another process may be building the same file
            os.replace(digest, _digest_path(target))
        finally:
            for leftover in (tmp, digest):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    _state["info"] = {"compiler": version.splitlines()[0] if version else compiler, "flags": flags,
                      "path": str(target)}
    return target


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: pathlib.Path) -> bool:
    """Whether ``target`` is the file its build wrote: a truncated or altered library must never be
    loaded, since mapping a file shorter than its ELF headers say kills the process (SIGBUS)."""
    try:
        return target.is_file() and _digest_path(target).read_text().strip() == _sha256(target)
    except OSError:
        return False


def _declare(lib) -> None:
    """Give the library's functions their C signatures (AttributeError: a symbol is missing)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        signatures = {                   # name: (result, arguments); the last two ints: a flag and the threads
            "causal_pass": (c_int, [p] * 8 + [real] + [p] * 3 + [i64] * 5 + [c_int, c_int]),
            "elu_grad": (None, [p, p, i64]),
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
        path = _build(compiler, flags)
        try:
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib
        except (OSError, AttributeError):
            if attempt:
                raise
            for stale in (path, _digest_path(path)):    # never written over: another process may have it mapped
                stale.unlink(missing_ok=True)


def _library():
    """The loaded library, or None (why: ``_state["error"]``). Built at most once per process."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, errors = None, []
        compiler = _compiler()
        if compiler is None:
            cxx = os.environ.get("CXX")
            errors.append(f"CXX={cxx!r} names no C++ compiler executable (one program, without flags)" if cxx
                          else "no C++ compiler found (set CXX)")
        else:
            for flags in (_BASE_FLAGS + _NATIVE, _BASE_FLAGS):
                try:
                    lib = _open(compiler, flags)
                    break
                except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
                    errors.append(f"{' '.join(flags)}: {err}")
        if lib is not None:
            if lib.linattn_vector_bytes() != _VECTOR_BYTES:
                lib, errors = None, ["library and module disagree on the vector length"]
            else:
                from . import _forked                   # a forked child: threads of our own
                runtime = None if _forked else _torch_openmp()
                lib.linattn_set_openmp(*(runtime or (None, None, None)))
                _state["openmp"] = runtime is not None
        _state["error"] = "; ".join(errors) if lib is None else None
        _state["lib"] = lib
        return lib


def _torch_openmp() -> Optional[tuple[int, int, int]]:
    """``GOMP_parallel``, ``omp_get_thread_num``, ``omp_get_num_threads`` of the OpenMP runtime PyTorch loaded.

    The kernels run their heads on that runtime's threads (see ``cpu_parallel.h``): after each
    parallel PyTorch operation they spin for milliseconds, and threads of our own started meanwhile
    shared their cores with them. Found in ``/proc/self/maps`` (Linux; libgomp, or Intel's and
    LLVM's runtimes, which export the same entry points); None elsewhere, or if no such library is
    loaded: the kernels then start threads of their own.
    """
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


def _pad_to_vector(x: Tensor) -> Tensor:
    """Contiguous ``x`` with its last dimension zero-padded to a whole number of 64-byte vectors."""
    lanes = _VECTOR_BYTES // x.element_size()
    extra = -x.shape[-1] % lanes
    return (F.pad(x, (0, extra)) if extra else x).contiguous()


def _pass(a: Tensor, b: Tensor, c: Tensor, X: Tensor, chunk_size: int, *, reverse: bool,
          z: Optional[Tensor] = None, den: Optional[Tensor] = None, ok: Optional[Tensor] = None,
          eps: float = 1.0, extra: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> Tensor:
    """One pass over (B, H, T, ·) tensors: ``out_t = a_tᵀ X_t``; ``X`` (B, H, Da, Dc) is updated in place.

    ``c`` and ``X`` must already be padded to whole vectors (:func:`_pad_to_vector`); ``a`` and
    ``b`` are contiguous ``(B, H, T, Da)``. ``extra = (ea, eb, Xe)`` adds one state row ``Xe``
    (B, H, Dc) with per-token numbers ``ea``, ``eb`` (B, H, T): ``out_t += ea_t (Xe + Σ eb_s c_s)``,
    the normaliser's row. Returns ``out`` ``(B, H, T, Dc)``.
    """
    B, H, T, Da = a.shape
    Dc = c.shape[-1]
    chunk_size = max(1, min(chunk_size, T))     # a block longer than T holds T tokens (C near 2⁶³ overflowed)
    out = torch.empty(B, H, T, Dc, dtype=a.dtype)
    ea, eb, Xe = extra if extra is not None else (None, None, None)
    fn = getattr(_library(), f"linattn_causal_pass_{_DTYPES[a.dtype]}")
    status = fn(_ptr(a), _ptr(b), _ptr(c), _ptr(out), _ptr(X), _ptr(z), _ptr(den), _ptr(ok), eps, _ptr(ea),
                _ptr(eb), _ptr(Xe), B * H, T, Da, Dc, chunk_size, int(reverse), torch.get_num_threads())
    _check_status(status)
    return out


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor], z0: Optional[Tensor], normalize: bool,
             eps: float, chunk_size: int):
    """The forward pass: output, final state, and the normaliser used (with where it was used as computed)."""
    B, H, T, M = phi_q.shape
    Dv = v.shape[-1]
    vp = _pad_to_vector(v)
    X = (torch.zeros(B, H, M, vp.shape[-1], dtype=v.dtype) if S0 is None
         else _pad_to_vector(S0.to(v.dtype)).clone())
    z = torch.zeros(B, H, M, dtype=v.dtype) if z0 is None else z0.to(v.dtype).clone()
    den = torch.empty(B, H, T, dtype=v.dtype) if normalize else None
    ok = torch.empty(B, H, T, dtype=torch.uint8) if normalize else None
    out = _pass(phi_q, phi_k, vp, X, chunk_size, reverse=False, z=z, den=den, ok=ok, eps=eps)
    y = out if vp.shape[-1] == Dv else out[..., :Dv].contiguous()
    S = X if vp.shape[-1] == Dv else X[..., :Dv].contiguous()
    return y, S, z, den, ok


def _backward(g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs):
    """Gradients of φ(q), φ(k), v, S0, z0 (None where not needed): three passes of the kernel.

    With ``g`` the upstream gradient of the output and ``d`` the normaliser used:
    ``g_num = g / d`` and ``g_d = −(g·y)/d`` (0 where eps replaced d); then (module docstring)
    dφ(q) is the causal pass (g_num, v, φ(k)) with the normaliser row (g_d, 1) from ``[S0ᵀ; z0]``,
    dφ(k) the reverse pass (v, g_num, φ(q)) with the row (1, g_d) from ``[g_Sᵀ; g_z]``, ending at
    ``[·; dz0]``, and dv the reverse pass (φ(k), φ(q), g_num) from ``g_S``, ending at ``dS0``.
    """
    normalize, C, has_S0, has_z0 = config
    B, H, T, M = phi_q.shape
    Dv = v.shape[-1]
    need_q, need_k, need_v, need_S0, need_z0 = needs
    dtype = v.dtype
    g = torch.zeros_like(y) if g_out is None else g_out.to(dtype).contiguous()
    g_den = None
    if normalize:
        g_den = (g * y).sum(-1).div_(den).neg_().masked_fill_(ok == 0, 0.0)     # (B, H, T)
        g = g / den.unsqueeze(-1)                                               # (B, H, T, Dv)
    with_row = normalize or g_z is not None          # z enters the gradients of φ(k) and of z0
    ones = torch.ones(B, H, T, dtype=dtype) if with_row else None
    Mp = M + (-M % (_VECTOR_BYTES // v.element_size()))
    dq = dk = dv = dS0 = dz0 = None
    if need_q:
        X = torch.zeros(B, H, Dv, Mp, dtype=dtype)
        if S0 is not None:
            X[..., :M] = S0.transpose(-1, -2)
        extra = None
        if normalize:
            Xe = torch.zeros(B, H, Mp, dtype=dtype)
            if z0 is not None:
                Xe[..., :M] = z0
            extra = (g_den, ones, Xe)
        dq = _pass(g, v, _pad_to_vector(phi_k), X, C, reverse=False, extra=extra)[..., :M]
    if need_k or (has_z0 and need_z0):
        X = torch.zeros(B, H, Dv, Mp, dtype=dtype)
        if g_S is not None:
            X[..., :M] = g_S.transpose(-1, -2)
        extra = None
        if with_row:
            Xe = torch.zeros(B, H, Mp, dtype=dtype)
            if g_z is not None:
                Xe[..., :M] = g_z
            extra = (ones, g_den if g_den is not None else torch.zeros_like(ones), Xe)
        dk = _pass(v, g, _pad_to_vector(phi_q), X, C, reverse=True, extra=extra)[..., :M]
        if with_row:
            dz0 = extra[2][..., :M]
    if need_v or (has_S0 and need_S0):
        gp = _pad_to_vector(g)
        X = (torch.zeros(B, H, M, gp.shape[-1], dtype=dtype) if g_S is None
             else _pad_to_vector(g_S.to(dtype)).clone())
        dv = _pass(phi_k, phi_q, gp, X, C, reverse=True)[..., :Dv]
        dS0 = X[..., :Dv]

    def own(t: Optional[Tensor], wanted: bool) -> Optional[Tensor]:
        return t.contiguous() if wanted and t is not None else None

    if has_z0 and need_z0 and dz0 is None:
        dz0 = torch.zeros_like(z0)
    return (own(dq, need_q), own(dk, need_k), own(dv, need_v),
            None if dS0 is None or not (has_S0 and need_S0) else dS0.to(S0.dtype).contiguous(),
            None if dz0 is None or not (has_z0 and need_z0) else dz0.to(z0.dtype).contiguous())


class _CpuCausalLinearAttention(torch.autograd.Function):
    """Forward: one pass and the normaliser; backward: three passes (see the module docstring)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, normalize: bool, eps: float, chunk_size: int):
        y, S, z, den, ok = _forward(phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)
        ctx.config = (normalize, chunk_size, S0 is not None, z0 is not None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(phi_q, phi_k, v, y, den, ok, S0, z0)
        return y, S, z

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        grads = _CpuCausalLinearAttentionBackward.apply(g_out, g_S, g_z, *ctx.saved_tensors, ctx.config,
                                                        tuple(ctx.needs_input_grad[:5]), False)
        return (*grads, None, None, None)


class _CpuEluCausalLinearAttention(torch.autograd.Function):
    """As :class:`_CpuCausalLinearAttention`, with φ = elu+1 applied inside: ``q``, ``k`` are raw.

    Only the features are saved; the chain rule through φ uses ``φ'(x) = min(φ(x), 1)``
    (``e^x`` for ``x <= 0``, 1 above), one pass in the kernel's library instead of three tensor
    operations and a saved copy of the raw inputs.
    """

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, normalize: bool, eps: float, chunk_size: int):
        from ..feature_maps import elu_plus_one

        with torch.no_grad():
            phi_q, phi_k = elu_plus_one(q).contiguous(), elu_plus_one(k).contiguous()
        y, S, z, den, ok = _forward(phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)
        ctx.config = (normalize, chunk_size, S0 is not None, z0 is not None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(phi_q, phi_k, v, y, den, ok, S0, z0)
        return y, S, z

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        grads = _CpuCausalLinearAttentionBackward.apply(g_out, g_S, g_z, *ctx.saved_tensors, ctx.config,
                                                        tuple(ctx.needs_input_grad[:5]), True)
        return (*grads, None, None, None)


class _CpuCausalLinearAttentionBackward(torch.autograd.Function):
    """The three backward passes, as a Function whose own backward refuses second derivatives."""

    @staticmethod
    def forward(ctx, g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs, through_elu):
        dq, dk, dv, dS0, dz0 = _backward(g_out, g_S, g_z, phi_q, phi_k, v, y, den, ok, S0, z0, config, needs)
        if through_elu:                        # dL/dx = dL/dφ · min(φ, 1), in place
            lib = _library()
            for d, phi in ((dq, phi_q), (dk, phi_k)):
                if d is not None:
                    getattr(lib, f"linattn_elu_grad_{_DTYPES[d.dtype]}")(d.data_ptr(), phi.data_ptr(), d.numel())
        return dq, dk, dv, dS0, dz0

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_SECOND_DERIVATIVE)


def causal_linear_attention_cpu(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor] = None,
                                z0: Optional[Tensor] = None, *, normalize: bool = True, eps: float = 1e-6,
                                chunk_size: int = 64, feature_map: Optional[str] = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention on features with the compiled CPU kernel (forward and backward).

    Computes what :func:`linattn.ops.linear.chunkwise_linear_attention` computes, with the same
    arguments, and is differentiable with respect to ``phi_q``, ``phi_k``, ``v``, ``S0`` and
    ``z0`` (no double backward). Autocast is switched off inside.

    Parameters
    ----------
    phi_q, phi_k : Tensor
        ``(B, H, T, M)`` features, float32 or float64, on the CPU; with ``feature_map="elu+1"``
        the raw queries and keys, to which :func:`linattn.elu_plus_one` is applied inside.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype.
    S0, z0 : Tensor, optional
        ``(B, H, M, Dv)`` and ``(B, H, M)``: the state before the first token (zeros if None).
    normalize : bool
        Divide by the normaliser ``φ(q_i)ᵀz_i`` (replaced by ``eps`` where it is zero, negative
        or not finite, as :func:`linattn._numerics.guarded_normaliser` does).
    eps : float
        What a zero, negative or non-finite normaliser is replaced by.
    chunk_size : int
        Tokens per block of the two-level sums (``>= 1``).
    feature_map : None or "elu+1"
        None: ``phi_q``, ``phi_k`` are features. ``"elu+1"``: apply elu+1 inside, saving only
        the features for the backward pass (whose chain rule through φ is then one pass).

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)``.
    S, z : Tensor
        ``(B, H, M, Dv)`` and ``(B, H, M)``, the state after the last token (tensors of their own).

    Raises
    ------
    RuntimeError
        If the kernel is not available here (:func:`cpu_kernel_available`; :func:`build_info` says why).
    TypeError, ValueError
        Inputs that are not CPU float32/float64 tensors of matching shapes (``S0``, ``z0``:
        floating-point CPU tensors of the shapes above); ``normalize`` not a bool; ``eps`` not a
        positive number representable in the inputs' dtype; ``chunk_size`` not an int ``>= 1``.
    """
    layout = "(batch, heads, seq, dim)"
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_tensor(x, name, 4, layout)
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {x.device}")
    if phi_q.dtype not in _DTYPES or phi_k.dtype != phi_q.dtype or v.dtype != phi_q.dtype:
        raise TypeError(f"phi_q, phi_k and v must share one dtype out of float32, float64; got {phi_q.dtype}, "
                        f"{phi_k.dtype}, {v.dtype}")
    if phi_q.shape != phi_k.shape or v.shape[:3] != phi_k.shape[:3]:
        raise ValueError(f"expected phi_q, phi_k (B, H, T, M) and v (B, H, T, Dv), got {shape_str(phi_q.shape)}, "
                         f"{shape_str(phi_k.shape)} and {shape_str(v.shape)}")
    B, H, _, M = phi_k.shape
    for name, x, shape in (("S0", S0, (B, H, M, v.shape[-1])), ("z0", z0, (B, H, M))):
        if x is None:
            continue
        check_tensor(x, name, len(shape), "(batch, heads, M, Dv)" if name == "S0" else "(batch, heads, M)")
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {x.device}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape_str(shape)}, got {shape_str(x.shape)}")
    normalize = check_bool(normalize, "normalize")
    eps = check_eps(eps, phi_q.dtype)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if feature_map not in (None, "elu+1"):
        raise ValueError(f"feature_map must be None or 'elu+1', got {feature_map!r}")
    if _library() is None:
        raise RuntimeError(f"the linattn CPU kernel is not available: {_state.get('error')}")
    fn = _CpuCausalLinearAttention if feature_map is None else _CpuEluCausalLinearAttention
    with no_autocast(phi_q.device):
        return fn.apply(phi_q.contiguous(), phi_k.contiguous(), v.contiguous(), S0, z0, bool(normalize), float(eps),
                        chunk_size)


def warn_unavailable_once() -> None:
    """A RuntimeWarning, once per process, when ``LINATTN_CPU_KERNEL=1`` asks for an unavailable kernel."""
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(f"LINATTN_CPU_KERNEL=1 but the linattn CPU kernel is not available "
                      f"({_state.get('error')}); using the PyTorch path", RuntimeWarning, stacklevel=4)


# --------------------------------------------------------------------------- the delta rule, token by token

_GATES = {None: 0, "head": 1, "channel": 2}
_MAX_VECTORS = 16            # MAXV of cpu_delta.cpp


def delta_kernel_usable(*tensors: Optional[Tensor]) -> bool:
    """Whether a decay-family ``method="chunk"`` should take this library's token loop here.

    Used by :func:`linattn.delta_rule`, :func:`linattn.gated_delta_rule`, :func:`linattn.retention`
    and :func:`linattn.gated_linear_attention`; ``tensors`` are ``(q, k, v, ...)``, their other
    tensor arguments after (None allowed).

    ``LINATTN_CPU_KERNEL=1``, CPU float32/float64 tensors, plain autograd (not under
    ``torch.compile``, ``torch.func`` transforms or forward-mode AD, which see every op of the
    PyTorch forms instead), and a built library (else a RuntimeWarning, once, and the PyTorch path).
    """
    from ..ops._decay import autograd_must_see_every_op

    first, v = tensors[0], tensors[2]
    if not cpu_kernel_enabled() or first.device.type != "cpu" or first.dtype not in _DTYPES:
        return False
    if v.shape[-1] > _MAX_VECTORS * (_VECTOR_BYTES // v.element_size()):    # the kernel's rows: 16 vectors at most
        return False
    if autograd_must_see_every_op(*tensors):
        return False
    if not cpu_kernel_available():
        warn_unavailable_once()
        return False
    return True


def delta_rule_cpu(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_g: Optional[Tensor], S0: Tensor,
                   chunk_size: int) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule token by token in this library: ``(out (B, H, T, Dv), S_final (B, H, Dk, Dv))``.

    The compiled twin of :func:`linattn.delta_rule` and :func:`linattn.gated_delta_rule`
    (``S_t = diag(α_t) S_{t−1} + β_t k_t (v_t − (diag(α_t) S_{t−1})ᵀ k_t)ᵀ``, ``o_t = S_tᵀ q_t``;
    Schlag et al., 2021; Yang, Kautz & Hatamizadeh, 2025, arXiv:2412.06464, eq. 10), called by
    their ``method="chunk"`` when :func:`delta_kernel_usable` says so; private, its inputs are
    checked by those functions. ``q``, ``k`` ``(B, H, T, Dk)``, ``v`` ``(B, H, T, Dv)``, ``beta``
    ``(B, H, T)``, ``log_g`` None (no gates), ``(B, H, T, 1)`` (one per head) or ``(B, H, T, Dk)``
    (one per key channel), ``S0`` ``(B, H, Dk, Dv)``, all CPU float32 or all float64. The state
    stays in the L1 cache: per token two passes over it forward, four backward (the block's states
    recomputed from a copy kept every ``chunk_size`` tokens: ``(B, H, ⌈T/C⌉, Dk, Dv)`` kept for the
    backward pass). Differentiable (hand-written backward, every input's gradient); a backward pass
    that must itself be differentiable recomputes the recurrence op by op.
    """
    gate = None if log_g is None else ("head" if log_g.shape[-1] == 1 else "channel")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, log_g, S0))
    return _CpuDeltaRule.apply(q, k, v, beta, log_g, S0, int(chunk_size), gate, keep)


def _delta_recurrent_ops(q, k, v, beta, log_g, S0):
    """The same recurrence op by op (for second derivatives): ``(out, S)``."""
    from ..ops.delta import _delta_recurrent
    from ..ops.gated_delta import _gated_delta_recurrent

    if log_g is None:
        return _delta_recurrent(q, k, v, beta, S0)
    return _gated_delta_recurrent(q, k, v, log_g, beta, S0)


def _check_status(status: int) -> None:
    """A MemoryError for a kernel's status 3 (its threads or buffers could not be allocated), else a RuntimeError."""
    if status == 3:
        raise MemoryError("linattn CPU kernel: its threads or work buffers could not be allocated")
    if status != 0:
        raise RuntimeError(f"linattn CPU kernel refused its arguments (status {status})")


class _CpuDeltaRule(torch.autograd.Function):
    """Forward: one pass of the token loop (keeping the state every ``chunk_size`` tokens); backward: one."""

    @staticmethod
    def forward(ctx, q, k, v, beta, log_g, S0, chunk_size: int, gate: Optional[str], keep: bool):
        ctx.save_for_backward(q, k, v, beta, log_g, S0)          # the inputs themselves (second derivatives)
        B, H, T, Dk = k.shape
        Dv = v.shape[-1]
        C = max(1, min(chunk_size, T))           # a block longer than T holds T tokens (the backward's buffer)
        N = -(-T // C)
        q, k, beta = (x.contiguous() for x in (q, k, beta))
        v = _pad_to_vector(v)                    # Dv in whole vectors: zero columns, which stay zero
        Dp = v.shape[-1]
        alpha = None if log_g is None else log_g.exp().contiguous()
        S = _pad_to_vector(S0).clone() if Dp != Dv else S0.clone(memory_format=torch.contiguous_format)
        out = v.new_empty(B, H, T, Dp)
        ck = v.new_empty(B, H, N, Dk, Dp) if keep else None     # the states the backward pass starts from
        fn = getattr(_library(), f"linattn_delta_forward_{_DTYPES[v.dtype]}")
        status = fn(_ptr(q), _ptr(k), _ptr(v), _ptr(beta), _ptr(alpha), _ptr(S), _ptr(out), _ptr(ck), B * H, T, Dk,
                    Dp, C, _GATES[gate], torch.get_num_threads())
        _check_status(status)
        ctx.config, ctx.kept = (C, gate, Dv), (alpha, ck)
        if Dp != Dv:
            out, S = out[..., :Dv].contiguous(), S[..., :Dv].contiguous()
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, beta, log_g, S0 = ctx.saved_tensors
        (C, gate, Dv), (alpha, ck) = ctx.config, ctx.kept
        if torch.is_grad_enabled():          # create_graph=True: autograd differentiates the recurrence op by op
            return (*differentiable_backward(_delta_recurrent_ops, (q, k, v, beta, log_g, S0), d_out, d_S),
                    None, None, None)
        q, k, beta = (x.contiguous() for x in (q, k, beta))
        v = _pad_to_vector(v)
        B, H, T, Dk = k.shape
        Dp = v.shape[-1]
        d_out = _pad_to_vector(d_out.to(v.dtype))
        dS = _pad_to_vector(d_S.to(v.dtype))                                 # in: dS_final; out: dS0
        dS = dS.clone() if dS is d_S else dS
        dq, dk, dv, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
        dlog = None if log_g is None else torch.empty_like(alpha)
        fn = getattr(_library(), f"linattn_delta_backward_{_DTYPES[v.dtype]}")
        status = fn(_ptr(q), _ptr(k), _ptr(v), _ptr(beta), _ptr(alpha), _ptr(ck), _ptr(d_out), _ptr(dS), _ptr(dq),
                    _ptr(dk), _ptr(dv), _ptr(dbeta), _ptr(dlog), B * H, T, Dk, Dp, C, _GATES[gate],
                    torch.get_num_threads())
        _check_status(status)
        if Dp != Dv:
            dv, dS = dv[..., :Dv].contiguous(), dS[..., :Dv].contiguous()
        return dq, dk, dv, dbeta, dlog, dS, None, None, None


# --------------------------------------------------------------------------- retention and GLA, token by token


def decay_cpu(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, S0: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Causal linear attention with a decaying state, token by token in this library: ``(out, S_final)``.

    ``S_t = diag(α_t) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``: retention (Sun et al., 2023,
    arXiv:2307.08621, sec. 2.1) with ``α_t = γ`` (one gate per head) and gated linear attention
    (Yang et al., 2024, arXiv:2312.06635, sec. 4) with ``α_t = exp(log_g_t)`` (one per key
    channel). The compiled twin of their ``method="chunk"``, called when
    :func:`delta_kernel_usable` says so; private, its inputs are checked by those functions.
    ``q``, ``k`` ``(B, H, T, Dk)``, ``v`` ``(B, H, T, Dv)``, ``alpha`` ``(B, H, T)`` (one gate
    per head) or ``(B, H, T, Dk)`` (per key channel) in ``[0, 1]``, ``S0`` ``(B, H, Dk, Dv)``, all
    CPU float32 or all float64. ``alpha`` is differentiable: compute it from ``γ`` or ``log_g``
    with PyTorch ops and autograd carries the gradient back. The state stays in the L1 cache: one
    pass over it per token forward, two backward (the block's states recomputed from a copy kept
    every ``chunk_size`` tokens: ``(B, H, ⌈T/C⌉, Dk, Dv)`` kept for the backward pass). A backward
    pass that must itself be differentiable recomputes the recurrence op by op.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if alpha.shape not in (k.shape[:3], k.shape):
        raise ValueError(f"alpha must have shape {shape_str(k.shape[:3])} or {shape_str(k.shape)}, "
                         f"got {shape_str(alpha.shape)}")
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, alpha, S0))
    return _CpuDecay.apply(q, k, v, alpha, S0, int(chunk_size), keep)


def _decay_recurrent_ops(q, k, v, alpha, S0):
    """``S_t = diag(α_t) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t`` op by op (for second derivatives)."""
    a = alpha if alpha.dim() == 4 else alpha.unsqueeze(-1)
    S, outs = S0, []
    for t in range(k.shape[2]):
        S = torch.addcmul(a[:, :, t].unsqueeze(-1) * S, k[:, :, t].unsqueeze(-1), v[:, :, t].unsqueeze(-2))
        outs.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outs, dim=2), S


class _CpuDecay(torch.autograd.Function):
    """Forward: one pass of the token loop (keeping the state every ``chunk_size`` tokens); backward: one."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, S0, chunk_size: int, keep: bool):
        ctx.save_for_backward(q, k, v, alpha, S0)
        B, H, T, Dk = k.shape
        Dv = v.shape[-1]
        C = max(1, min(chunk_size, T))
        N = -(-T // C)
        q, k, alpha = (x.contiguous() for x in (q, k, alpha))
        v = _pad_to_vector(v)
        Dp = v.shape[-1]
        S = _pad_to_vector(S0).clone() if Dp != Dv else S0.clone(memory_format=torch.contiguous_format)
        out = v.new_empty(B, H, T, Dp)
        ck = v.new_empty(B, H, N, Dk, Dp) if keep else None     # the states the backward pass starts from
        gate = 1 if alpha.dim() == 3 else 2
        fn = getattr(_library(), f"linattn_decay_forward_{_DTYPES[v.dtype]}")
        _check_status(fn(_ptr(q), _ptr(k), _ptr(v), _ptr(alpha), _ptr(S), _ptr(out), _ptr(ck), B * H, T, Dk, Dp, C,
                         gate, torch.get_num_threads()))
        ctx.config, ctx.kept = (C, gate, Dv), ck
        if Dp != Dv:
            out, S = out[..., :Dv].contiguous(), S[..., :Dv].contiguous()
        return out, S

    @staticmethod
    def backward(ctx, d_out, d_S):
        q, k, v, alpha, S0 = ctx.saved_tensors
        (C, gate, Dv), ck = ctx.config, ctx.kept
        if torch.is_grad_enabled():          # create_graph=True: autograd differentiates the recurrence op by op
            return (*differentiable_backward(_decay_recurrent_ops, (q, k, v, alpha, S0), d_out, d_S), None, None)
        q, k, alpha = (x.contiguous() for x in (q, k, alpha))
        v = _pad_to_vector(v)
        B, H, T, Dk = k.shape
        Dp = v.shape[-1]
        d_out = _pad_to_vector(d_out.to(v.dtype))
        dS = _pad_to_vector(d_S.to(v.dtype))                                 # in: dS_final; out: dS0
        dS = dS.clone() if dS is d_S else dS
        dq, dk, dv, dalpha = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(alpha)
        fn = getattr(_library(), f"linattn_decay_backward_{_DTYPES[v.dtype]}")
        _check_status(fn(_ptr(q), _ptr(k), _ptr(v), _ptr(alpha), _ptr(ck), _ptr(d_out), _ptr(dS), _ptr(dq), _ptr(dk),
                         _ptr(dv), _ptr(dalpha), B * H, T, Dk, Dp, C, gate, torch.get_num_threads()))
        if Dp != Dv:
            dv, dS = dv[..., :Dv].contiguous(), dS[..., :Dv].contiguous()
        return dq, dk, dv, dalpha, dS, None, None
