"""Running the benchmarks: every (method, T) cell on the same seeded inputs, repetitions interleaved."""
from __future__ import annotations

import math
import numbers
import os
import sys
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ..book import default_device
from .baselines import DEFAULT_CHUNK_SIZE, DEFAULT_METHODS, METHODS, method_fn, unavailable
from .costs import forward_flops, predict_memory
from .peers import PEER_VARIANT, gated_delta_peer_call, transformers_gated_delta
from .timing import cpu_name, interleaved_times, paired_ratios, peak_memory, pinned_threads, summarise

__all__ = ["DTYPES", "DEFAULT_SEQ_LENS", "run_benchmark", "DECAY_VARIANTS", "DEFAULT_DECAY_SEQ_LENS",
           "run_decay_benchmark"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_SEQ_LENS = (256, 512, 1024)


def run_benchmark(
    methods: Sequence[str] = DEFAULT_METHODS,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    *,
    device: Union[torch.device, str, None] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    backward: bool = True,
    max_memory_gb: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
    matmul_size: int = 2048,
    threads: Optional[int] = None,
    peers: Optional[dict] = None,
    progress: bool = False,
) -> list[dict]:
    """Time and measure every (method, T) cell of causal attention on random inputs.

    Parameters
    ----------
    methods : sequence of str
        Names from :data:`linattn.bench.METHODS` (duplicates dropped), in this order.
    seq_lens : sequence of int
        Sequence lengths ``T`` (duplicates dropped).
    device : torch.device or str, optional
        Default: CUDA when available, else CPU.
    dtype : torch.dtype or str
        float32, float16 or bfloat16 (the linear forms compute in float32 for half types).
    batch, heads, head_dim : int
        ``B``, ``H`` and ``D = Dv``.
    repeats, warmup : int
        Timed rounds and untimed calls per method.
    backward : bool
        Also time forward+backward; the memory pass is then forward+backward, else forward.
    max_memory_gb : float, optional
        Memory guard in GB (10⁹ bytes); None means half of the device's memory (CPU: the
        machine's RAM), ``math.inf`` means no guard.
    chunk_size : int
        ``C`` of the chunkwise methods; their FLOP count and memory estimate use ``min(C, T)``,
        the longest block they run.
    seed : int
        Seed of the inputs.
    matmul_size : int
        Size of the float32 matmul timed as the yardstick.
    threads : int, optional
        ``torch.set_num_threads(threads)`` for the run (restored afterwards); None keeps the
        current setting. Every row records the number used.
    peers : dict of str to callable, optional
        Further methods ``(q, k, v) -> out`` to time alongside (other libraries' kernels, for
        instance); their FLOP count and memory estimate are those of the chunkwise form.
    progress : bool
        Show a tqdm progress bar (on stderr) over the sequence lengths.

    Returns
    -------
    list of dict
        One dict per cell, T-major, with keys ``method``, ``seq_len``, ``batch``, ``heads``,
        ``head_dim``, ``chunk_size``, ``dtype``, ``device``, ``device_name`` (GPU or CPU model),
        ``threads``, ``status`` (``"ok"``, ``"skipped"``, ``"unavailable"``, ``"failed"``),
        ``note`` (why, if not ok), ``fwd_s`` and ``fwd_bwd_s`` (medians, seconds),
        ``fwd_times`` and ``fwd_bwd_times`` (every repetition), ``fwd_spread`` and
        ``fwd_bwd_spread`` (``(max − min) / median``), ``peak_memory_bytes``, ``memory_pass``,
        ``predicted_memory_bytes``, ``max_memory_bytes`` (None: no guard), ``fwd_flops``,
        ``fwd_gflops``, ``matmul_gflops`` (median of this T's rounds), ``matmul_spread`` and
        ``matmul_fraction``, ``backends`` (for ``chunk``, ``chunk_torch`` and ``chunk_cpu``: the backend that
        ran each pass, ``{"fwd": ..., "fwd+bwd": ...}``, e.g. ``"cpu"`` for the compiled loop; None for the
        others). Numbers that were not measured are None.

    Raises
    ------
    TypeError, ValueError
        Unknown methods or dtypes (``methods`` a single string); non-positive sizes;
        ``repeats < 1``; ``warmup < 0``; a ``seed`` outside ``[0, 2**63)``; a non-positive
        ``max_memory_gb``; CUDA requested but not available; a peer that is not callable or
        reuses a method's name.
    """
    if isinstance(methods, str):
        raise TypeError(f"methods must be a sequence of method names, got the string {methods!r} (use [{methods!r}])")
    device = _resolve_device(device)
    dtype = _resolve_dtype(dtype)
    methods = list(dict.fromkeys(methods))
    for method in methods:
        _check_method(method)
    peers = dict(peers or {})
    for name, fn in peers.items():
        if not isinstance(name, str) or name in METHODS or not callable(fn):
            raise ValueError(f"peers must map new names to callables (q, k, v) -> out, got {name!r}: {fn!r}")
    if not methods and not peers:
        raise ValueError("methods must name at least one method")
    seq_lens = list(dict.fromkeys(_check_positive_int(T, "seq_lens entries") for T in seq_lens))  # duplicates dropped
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence length")
    for value, name in ((batch, "batch"), (heads, "heads"), (head_dim, "head_dim"),
                        (repeats, "repeats"), (chunk_size, "chunk_size"), (matmul_size, "matmul_size")):
        _check_positive_int(value, name)
    _check_warmup(warmup)
    _check_seed(seed)
    if threads is not None:
        _check_positive_int(threads, "threads")
    max_bytes = _memory_limit(max_memory_gb, device)
    with pinned_threads(threads):
        return _run(methods, peers, seq_lens, device, dtype, batch, heads, head_dim, repeats, warmup, backward,
                    max_bytes, chunk_size, seed, matmul_size, progress)


def _run(methods, peers, seq_lens, device, dtype, batch, heads, head_dim, repeats, warmup, backward, max_bytes,
         chunk_size, seed, matmul_size, progress) -> list[dict]:
    shape = dict(batch=batch, heads=heads, head_dim=head_dim, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(matmul_size, matmul_size, generator=gen).to(device) for _ in range(2))
    results = []
    names = methods + list(peers)
    for T in tqdm(seq_lens, disable=not progress, unit="T", desc="linattn.bench", file=sys.stderr):
        q, k, v, grad_out = _inputs(batch, heads, T, head_dim, dtype, device, seed)
        rows, fwd, fwd_bwd = {}, {}, {}
        for name in names:
            counted = name if name in METHODS else "chunk"
            costed = {**shape, "chunk_size": min(chunk_size, T)}   # what the chunk forms run: a block holds T at most
            row = dict(method=name, seq_len=T, **shape, dtype=_dtype_name(dtype), device=str(device),
                       device_name=_device_name(device), threads=torch.get_num_threads(), status="ok", note="",
                       fwd_s=None, fwd_bwd_s=None, fwd_times=[], fwd_bwd_times=[], fwd_spread=None,
                       fwd_bwd_spread=None, peak_memory_bytes=None, memory_pass="fwd+bwd" if backward else "fwd",
                       predicted_memory_bytes=predict_memory(counted, T, dtype=dtype, **costed),
                       max_memory_bytes=None if math.isinf(max_bytes) else int(max_bytes),
                       fwd_flops=forward_flops(counted, T, **costed), fwd_gflops=None, matmul_gflops=None,
                       matmul_spread=None, matmul_fraction=None, backends=None)
            rows[name] = row
            why_not = None if name in peers else unavailable(name, device, chunk_size, dtype)
            if why_not is not None:
                row.update(status="unavailable", note=why_not)
                continue
            if row["predicted_memory_bytes"] > max_bytes:
                row.update(status="skipped", note=f"predicted {row['predicted_memory_bytes'] / 1e9:.3g} GB "
                                                  f"> limit {max_bytes / 1e9:.3g} GB")
                continue
            fn = peers[name] if name in peers else method_fn(name, chunk_size)
            fwd[name], fwd_bwd[name] = _passes(fn, (q, k, v), grad_out)
            if name in ("chunk", "chunk_torch", "chunk_cpu"):
                try:
                    row["backends"] = _what_ran(fwd[name], fwd_bwd[name] if backward else None)
                except Exception:  # noqa: BLE001 - the timed rounds below report the failure
                    row["backends"] = {}
                slower = [label for label, ran in row["backends"].items() if ran != "cpu"]
                if name == "chunk_cpu" and slower:
                    row["note"] = (f"the compiled loop was calibrated slower here for {' and '.join(slower)}: "
                                   "these times are the PyTorch chunk form's")

        def failed(name: str, err: BaseException) -> None:
            message = str(err).strip().splitlines()
            rows[name].update(status="failed", note=message[0][:200] if message else type(err).__name__)
            fwd.pop(name, None)
            fwd_bwd.pop(name, None)

        if warmup == 0 and "compiled_baseline" in fwd:     # its first calls compile: never time those
            for fns in (fwd, fwd_bwd) if backward else (fwd,):
                if "compiled_baseline" in fns:
                    interleaved_times({"compiled_baseline": fns["compiled_baseline"]}, repeats=1, warmup=0,
                                      device=device, on_error=failed)
        times = interleaved_times({"__matmul__": lambda: a @ b, **fwd}, repeats=repeats, warmup=warmup,
                                  device=device, on_error=failed)
        mm = [2 * matmul_size ** 3 / s / 1e9 for s in times.pop("__matmul__")]
        if backward and fwd_bwd:
            for name, seconds in interleaved_times(fwd_bwd, repeats=repeats, warmup=warmup, device=device,
                                                   on_error=failed).items():
                if rows[name]["status"] == "ok":
                    rows[name]["fwd_bwd_times"] = seconds
        for name, seconds in times.items():
            if rows[name]["status"] == "ok":
                rows[name]["fwd_times"] = seconds
        for name in list(fwd):
            row = rows[name]
            if row["status"] != "ok":
                continue
            try:
                row["peak_memory_bytes"] = peak_memory(fwd_bwd[name] if backward else fwd[name], device=device)
            except Exception as err:  # noqa: BLE001
                failed(name, err)
        mm_summary = summarise(mm)
        for name in names:
            row = rows[name]
            row.update(matmul_gflops=mm_summary["median"], matmul_spread=mm_summary["spread"])
            if row["status"] != "ok":
                continue
            for key in ("fwd", "fwd_bwd"):
                s = summarise(row[f"{key}_times"])
                row[f"{key}_s"], row[f"{key}_spread"] = s["median"], s["spread"]
            row["fwd_gflops"] = row["fwd_flops"] / row["fwd_s"] / 1e9
            row["matmul_fraction"] = row["fwd_gflops"] / row["matmul_gflops"]
            results.append(row)
        results.extend(rows[name] for name in names if rows[name]["status"] != "ok")
        results.sort(key=lambda r: (r["seq_len"], names.index(r["method"])))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        del q, k, v, grad_out
    return results


def _what_ran(forward: Callable, forward_backward: Optional[Callable]) -> dict:
    """The backend (:func:`linattn.backends.last_backend`) that ran each pass, ``{"fwd": ..., "fwd+bwd": ...}``;
    the calls double as warm-up."""
    from ..backends import last_backend

    ran = {}
    for label, call in (("fwd", forward), ("fwd+bwd", forward_backward)):
        if call is not None:
            call()
            ran[label] = last_backend()
    return ran


def _pinned(fn: Callable, order: tuple[str, ...]) -> Callable:
    """``fn`` run under ``use_backends(*order)`` (no calibration veto)."""
    from ..backends import use_backends

    def call(*args):
        with use_backends(*order):
            return fn(*args)
    return call


def _passes(fn: Callable, qkv: tuple[Tensor, Tensor, Tensor], grad_out: Tensor):
    """The forward (under no_grad) and forward+backward calls of one method, as closures."""
    def forward() -> None:
        with torch.no_grad():
            fn(*qkv)

    def forward_backward() -> None:
        torch.autograd.grad(fn(*qkv), qkv, grad_out)

    return forward, forward_backward


def _inputs(B: int, H: int, T: int, D: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded standard-normal q, k, v (leaves that require grad) and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=dtype)
                         for _ in range(4))                                # (B, H, T, D)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def ratio(results: Sequence[dict], method: str, reference: str, seq_len: int, key: str = "fwd_s") -> dict:
    """Round-by-round ``time(method) / time(reference)`` at one ``T``: median, min and max (None if missing)."""
    cells = {(r["method"], r["seq_len"]): r for r in results if r["status"] == "ok"}
    a, b = cells.get((method, seq_len)), cells.get((reference, seq_len))
    if a is None or b is None:
        return {"median": None, "min": None, "max": None}
    series = key.replace("_s", "_times")
    return paired_ratios(a[series], b[series])


# --------------------------------------------------------------------------- checks


def _check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def _check_warmup(warmup) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"warmup must be an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _resolve_device(device) -> torch.device:
    device = default_device() if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available")
    return device


def _resolve_dtype(dtype) -> torch.dtype:
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _memory_limit(max_memory_gb: Optional[float], device: torch.device) -> float:
    """The guard in bytes: the given GB, or half the device's memory (inf when unknown)."""
    if max_memory_gb is not None:
        if isinstance(max_memory_gb, bool) or not isinstance(max_memory_gb, (int, float)):
            raise TypeError(f"max_memory_gb must be a number or None, got {type(max_memory_gb).__name__}")
        if not max_memory_gb > 0:
            raise ValueError(f"max_memory_gb must be > 0, got {max_memory_gb}")
        return max_memory_gb * 1e9
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return math.inf


# --------------------------------------------------------------------------- decay, gates, delta rule

DECAY_VARIANTS = ("retention", "gla", "delta", "gated_delta", "gated_delta_channel")
DEFAULT_DECAY_SEQ_LENS = (4096,)
DEFAULT_GATE_TEMPERATURE = 16.0           # GLA's
MIN_GATE_TEMPERATURE = 1e-6


def _decay_inputs(variant: str, B: int, H: int, T: int, D: int, dtype: torch.dtype, device: torch.device,
                  seed: int, gate_temperature: float = DEFAULT_GATE_TEMPERATURE) -> tuple[Tensor, ...]:
    """Seeded q, k, v (leaves that require grad) and the variant's decay argument."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, x = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))     # (B, H, T, D)
    if variant == "retention":
        extra = (1 - 2.0 ** -(5 + torch.arange(H, dtype=torch.float64)),)         # (H,)
    elif variant == "gla":
        extra = (F.logsigmoid(x) / gate_temperature,)                            # (B, H, T, D)
    else:
        k = F.normalize(k, dim=-1)
        beta = torch.sigmoid(x[..., 0])                                          # (B, H, T)
        log_g = F.logsigmoid(x.flip(-1)) / gate_temperature                      # (B, H, T, D)
        extra = {"delta": (beta,), "gated_delta": (log_g[..., 0], beta),
                 "gated_delta_channel": (log_g, beta)}[variant]
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    extra = tuple(e.to(device=device, dtype=torch.float32 if variant == "retention" else dtype) for e in extra)
    return q, k, v, extra


def run_decay_benchmark(
    seq_lens: Sequence[int] = DEFAULT_DECAY_SEQ_LENS,
    *,
    variants: Sequence[str] = DECAY_VARIANTS,
    device: Union[torch.device, str, None] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    chunk_size: Union[int, Sequence[int]] = DEFAULT_CHUNK_SIZE,
    repeats: int = 3,
    warmup: int = 1,
    backward: bool = True,
    seed: int = 0,
    progress: bool = False,
    threads: Optional[int] = None,
    gate_temperature: float = DEFAULT_GATE_TEMPERATURE,
    recurrent: bool = True,
    peers: bool = True,
) -> list[dict]:
    """Time the decay family: chunk and recurrent forms, and the ungated update as the yardstick.

    Parameters
    ----------
    seq_lens : sequence of int
        Sequence lengths ``T``.
    variants : sequence of str
        Names from :data:`DECAY_VARIANTS`.
    device, dtype, batch, heads, head_dim, repeats, warmup, seed, progress
        As in :func:`run_benchmark`.
    chunk_size : int or sequence of int
        Chunk size ``C`` of the chunk forms (the ungated update's too), or several, timed in the
        same rounds (duplicates dropped, order kept: the first is the one the other sizes are
        compared with by :func:`linattn.bench.format_decay_table`).
    backward : bool
        Also time forward+backward.
    threads : int, optional
        ``torch.set_num_threads(threads)`` for the run (restored afterwards); None keeps the
        current setting.
    gate_temperature : float
        ``τ`` of the gates ``log_g = logsigmoid(x)/τ`` (GLA, gated delta), finite and at least
        ``1e-6``.
        GLA's 16 gives a chunk of 64 tokens a total log-decay of about −3 (the chunk forms' prefix
        form for mild decays); 1 gives about −50 (their range-by-range products).
    recurrent : bool
        Also time ``method="recurrent"`` (the per-token loop, most of a run's time at large ``T``).
    peers : bool
        With the ``"gated_delta"`` variant, also time transformers' ``torch_chunk_gated_delta_rule``
        (:func:`linattn.bench.peers.transformers_gated_delta`; variant ``"transformers_gdn"``) on its
        inputs, in the same rounds, at every chunk size, when transformers is importable.

    Returns
    -------
    list of dict
        One dict per (T, variant, method, chunk size), for each ``T`` the chunk forms first, chunk
        size by chunk size (the ungated row first), then the recurrent forms (timed once, with the
        first chunk size recorded), with keys ``variant``,
        ``method``, ``seq_len``, ``batch``, ``heads``, ``head_dim``, ``chunk_size``,
        ``effective_chunk_size`` (``min(chunk_size, T)``), ``dtype``, ``device``, ``device_name``,
        ``threads``, ``gate_temperature``, ``fwd_s`` and ``fwd_bwd_s`` (medians), ``fwd_times`` and ``fwd_bwd_times``,
        ``fwd_spread`` and ``fwd_bwd_spread`` (``(max − min) / median``; None when not measured),
        ``fwd_minor_faults`` and ``fwd_bwd_minor_faults`` (the minor page faults of each timed
        call, :func:`linattn.bench.timing.interleaved_times`; None on CUDA or without ``resource``),
        ``cpu_kernel`` (True when ``LINATTN_CPU_KERNEL=force`` had the chunk forms run the compiled loops of
        :mod:`linattn.kernels.cpu` wherever they can; otherwise they run the PyTorch chunk forms, whatever the
        calibration says),
        ``peer`` (what a peer's row times, None for linattn's).

    Raises
    ------
    TypeError, ValueError
        Unknown variants or dtypes, non-positive sizes, ``repeats < 1``, ``warmup < 0``, a
        ``gate_temperature`` that is not a finite number of at least ``1e-6`` (a TypeError if it is
        not a real number), CUDA requested but not available, an empty ``chunk_size`` sequence,
        ``recurrent`` or ``peers`` not a bool.
    """
    if isinstance(gate_temperature, bool) or not isinstance(gate_temperature, numbers.Real):
        raise TypeError(f"gate_temperature must be a real number, got {type(gate_temperature).__name__}")
    if not (math.isfinite(gate_temperature) and gate_temperature >= MIN_GATE_TEMPERATURE):
        raise ValueError(f"gate_temperature must be finite and at least {MIN_GATE_TEMPERATURE:g} (smaller ones make "
                         f"float32 log-gates -inf), got {gate_temperature!r}")
    device = _resolve_device(device)
    dtype = _resolve_dtype(dtype)
    variants = list(dict.fromkeys(variants))
    if not variants:
        raise ValueError("variants must name at least one variant")
    for variant in variants:
        if variant not in DECAY_VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(DECAY_VARIANTS)}")
    seq_lens = list(dict.fromkeys(_check_positive_int(T, "seq_lens entries") for T in seq_lens))  # duplicates dropped
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence length")
    for value, name in ((batch, "batch"), (heads, "heads"), (head_dim, "head_dim"), (repeats, "repeats")):
        _check_positive_int(value, name)
    if isinstance(chunk_size, Sequence) and not isinstance(chunk_size, (str, bytes)):
        chunk_sizes = list(dict.fromkeys(_check_positive_int(C, "chunk_size entries") for C in chunk_size))
        if not chunk_sizes:
            raise ValueError("chunk_size must be a positive int or a non-empty sequence of them, got an empty "
                             f"{type(chunk_size).__name__}")
    elif isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool):
        chunk_sizes = [_check_positive_int(chunk_size, "chunk_size")]
    else:
        raise TypeError(f"chunk_size must be a positive int or a non-empty list or tuple of them, got "
                        f"{type(chunk_size).__name__}")
    for flag, name in ((recurrent, "recurrent"), (peers, "peers")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    _check_warmup(warmup)
    _check_seed(seed)
    if threads is not None:
        _check_positive_int(threads, "threads")
    with pinned_threads(threads):
        return _time_decay(seq_lens, variants, device, dtype, batch, heads, head_dim, chunk_sizes, repeats, warmup,
                           backward, seed, progress, float(gate_temperature), recurrent, peers)


def _time_decay(seq_lens, variants, device, dtype, batch, heads, head_dim, chunk_sizes, repeats, warmup,
                backward, seed, progress, gate_temperature, recurrent, peers) -> list[dict]:
    """The timing loop of :func:`run_decay_benchmark` (arguments already checked)."""
    from ..attention import linear_attention
    from ..ops import delta, gated_delta, gla, retention

    functions = {"retention": retention.retention, "gla": gla.gated_linear_attention, "delta": delta.delta_rule,
                 "gated_delta": gated_delta.gated_delta_rule,
                 "gated_delta_channel": gated_delta.gated_delta_rule}
    from ..kernels import cpu

    # the PyTorch chunk forms (what the study compares), or with LINATTN_CPU_KERNEL=force the compiled loops
    compiled = (device.type == "cpu" and os.environ.get("LINATTN_CPU_KERNEL", "").strip() == "force"
                and cpu.cpu_kernel_available())
    peer = transformers_gated_delta() if peers and "gated_delta" in variants else None
    results = []
    for T in tqdm(seq_lens, disable=not progress, unit="T", desc="linattn.bench --decay", file=sys.stderr):
        cells, fwd, fwd_bwd = [], {}, {}
        grad_out = torch.randn(batch, heads, T, head_dim,
                               generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
        q0, k0, v0, _ = _decay_inputs("retention", batch, heads, T, head_dim, dtype, device, seed)
        inputs = {variant: _decay_inputs(variant, batch, heads, T, head_dim, dtype, device, seed, gate_temperature)
                  for variant in variants}
        calls = []                  # (variant, method, C, q k v, fn): every chunk size, then the loops
        for C in chunk_sizes:
            calls.append(("ungated", "chunk", C, (q0, k0, v0),
                          lambda q, k, v, C=C: linear_attention(q, k, v, feature_map=None, normalize=False,
                                                                causal=True, chunk_size=C)))
            for variant, (q, k, v, extra) in inputs.items():
                calls.append((variant, "chunk", C, (q, k, v), lambda q, k, v, f=functions[variant], e=extra, C=C: f(
                    q, k, v, *e, method="chunk", chunk_size=C)))
            if peer is not None:                   # the gated delta rule's inputs, through transformers
                q, k, v, (log_g, beta) = inputs["gated_delta"]
                calls.append((PEER_VARIANT, "chunk", C, (q, k, v), gated_delta_peer_call(peer[0], log_g, beta, C)))
        for variant, (q, k, v, extra) in inputs.items() if recurrent else ():
            calls.append((variant, "recurrent", chunk_sizes[0], (q, k, v),
                          lambda q, k, v, f=functions[variant], e=extra: f(q, k, v, *e, method="recurrent")))
        for variant, method, C, qkv, fn in calls:
            key = f"{variant}/{method}/{C}"
            fn = _pinned(fn, ("cpu", "torch") if compiled else ("torch",))
            fwd[key], fwd_bwd[key] = _passes(fn, qkv, grad_out)
            cells.append(dict(variant=variant, method=method, seq_len=T, batch=batch, heads=heads,
                              head_dim=head_dim, chunk_size=C, effective_chunk_size=min(C, T),
                              dtype=_dtype_name(dtype), device=str(device), device_name=_device_name(device),
                              threads=torch.get_num_threads(), gate_temperature=gate_temperature,
                              fwd_s=None, fwd_bwd_s=None, fwd_times=[],
                              fwd_bwd_times=[], fwd_spread=None, fwd_bwd_spread=None,
                              fwd_minor_faults=None, fwd_bwd_minor_faults=None, cpu_kernel=compiled,
                              peer=peer[1] if variant == PEER_VARIANT else None))
        passes = [("fwd", fwd)] + ([("fwd_bwd", fwd_bwd)] if backward else [])
        for name, fns in passes:
            faults: dict = {}
            times = interleaved_times(fns, repeats=repeats, warmup=warmup, device=device, faults=faults)
            for cell in cells:
                key = f"{cell['variant']}/{cell['method']}/{cell['chunk_size']}"
                s = summarise(times[key])
                cell.update({f"{name}_times": times[key], f"{name}_s": s["median"], f"{name}_spread": s["spread"],
                             f"{name}_minor_faults": faults[key] or None})
        results.extend(cells)
    return results
