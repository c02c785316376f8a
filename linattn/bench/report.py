"""Reporting: plain-text tables with medians, spreads and paired ratios, a plot, machine facts."""
from __future__ import annotations

import datetime
import os
import platform
from typing import Optional, Sequence, Union

import torch

from .run import ratio
from ..kernels import cpu
from .timing import cpu_name

__all__ = ["format_table", "format_decay_table", "plot_results", "machine_info", "NOISY"]

NOISY = 0.25
"""A cell whose repetitions spread over more than this fraction of their median is marked ``!``."""


def _num(x: Optional[float], scale: float = 1.0) -> str:
    """Three significant figures or so, without exponents for the usual ranges; '-' for None."""
    if x is None:
        return "-"
    x *= scale
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _time_cell(median: Optional[float], spread: Optional[float]) -> str:
    """``"12.3 ±4%"``: milliseconds and half the relative range of the repetitions (``!`` if noisy)."""
    if median is None:
        return "-"
    if spread is None:
        return _num(median, 1e3)
    mark = "!" if spread > NOISY else ""
    return f"{_num(median, 1e3)} ±{50 * spread:.0f}%{mark}"


def _ratio_cell(r: dict) -> str:
    """``"1.52 (1.41-1.60)"``: median of the round-by-round ratios and their range."""
    if r["median"] is None:
        return "-"
    if r["min"] == r["max"]:
        return _num(r["median"])
    return f"{_num(r['median'])} ({_num(r['min'])}-{_num(r['max'])})"


def _threads_text(results: Sequence[dict]) -> str:
    threads = sorted({r["threads"] for r in results if r.get("threads") is not None})
    if not threads:
        return ""
    return f"{'/'.join(map(str, threads))} thread{'s' if threads != [1] else ''}"


def _align(rows: list[list[str]], left: int = 2) -> list[str]:
    widths = [max(len(row[i]) for row in rows if len(row) > i) for i in range(max(map(len, rows)))]
    lines = []
    for row in rows:
        cells = [c.ljust(w) if i < left and i > 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_table(results: Sequence[dict], reference: Optional[str] = "chunk") -> str:
    """An aligned plain-text table of :func:`linattn.bench.run_benchmark`'s results, one block per ``T``.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`linattn.bench.run_benchmark` (or read back from its JSON).
    reference : str, optional
        The method the ratio columns divide by (default ``"chunk"``); None: no ratio columns.

    Returns
    -------
    str
        The table, with a title line and a legend; no trailing newline.
    """
    if not results:
        return "(no results)"
    shown = [r for r in results if r["status"] != "unavailable"]
    left_out = {r["method"]: r["note"] for r in results if r["status"] == "unavailable"}
    first = results[0]
    has_ref = reference is not None and any(r["method"] == reference and r["status"] == "ok" for r in results)
    header = ["T", "method", "fwd ms", "fwd+bwd ms", "peak MB" if first["memory_pass"] == "fwd+bwd" else "fwd peak MB",
              "% matmul"] + ([f"fwd / {reference}", f"f+b / {reference}"] if has_ref else [])
    rows, blocks = [header], {}
    for r in shown:
        blocks.setdefault(r["seq_len"], []).append(r)
    notes = []
    for T, block in blocks.items():
        for r in block:
            if r["status"] != "ok" or r["note"]:
                notes.append(f"{T:>6}  {r['method']}  {r['status']}: {r['note']}")
            if r["status"] != "ok":
                continue
            row = [str(T), r["method"], _time_cell(r["fwd_s"], r["fwd_spread"]),
                   _time_cell(r["fwd_bwd_s"], r["fwd_bwd_spread"]), _num(r["peak_memory_bytes"], 1e-6),
                   _num(r["matmul_fraction"], 100)]
            if has_ref:
                row += [_ratio_cell(ratio(results, r["method"], reference, T, key)) for key in ("fwd_s", "fwd_bwd_s")]
            rows.append(row)
    lines = _align(rows)
    mm = [r["matmul_gflops"] for r in results if r.get("matmul_gflops")]
    spread = max((r.get("matmul_spread") or 0.0) for r in results)
    where = first.get("device_name") or first["device"]
    title = (f"causal attention on {first['device']} ({where}), {_threads_text(results)}, {first['dtype']}, "
             f"B={first['batch']} H={first['heads']} D=Dv={first['head_dim']}, C={first['chunk_size']}; "
             f"float32 matmul: {_num(sorted(mm)[len(mm) // 2]) if mm else '-'} GFLOP/s (±{50 * spread:.0f}%)")
    legend = ["fwd: median under torch.no_grad; fwd+bwd: autograd.grad w.r.t. q, k, v; ±: half the range of the "
              f"repetitions over the median (!: the whole range passes {100 * NOISY:.0f}% of it, noisy); "
              f"peak: {first['memory_pass']}.",
              "% matmul: useful forward FLOPs (sdpa, quadratic: causal T² terms; linear methods: chunkwise "
              "matmuls) / fwd time, of the float32 matmul timed in the same rounds."]
    if has_ref:
        legend.append(f"x / {reference}: time / {reference}'s time, per round, median (range); above 1: "
                      f"{reference} is faster.")
    out = [title, "", *lines]
    if notes:
        out += ["", *notes]
    if left_out:
        out += ["", "left out (cannot run here): " + "; ".join(f"{m}: {why}" for m, why in left_out.items())]
    if reference is not None and not has_ref:
        why = next((f"{r['status']}: {r['note']}" for r in results if r["method"] == reference), "not among the methods")
        out += ["", f"no ratio columns: the reference {reference} did not run ({why})"]
    return "\n".join(out + ["", *legend])


def format_decay_table(results: Sequence[dict]) -> str:
    """An aligned plain-text table of :func:`linattn.bench.run_decay_benchmark`'s results.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`linattn.bench.run_decay_benchmark`.

    Returns
    -------
    str
        The table with a title and a legend; no trailing newline.
    """
    if not results:
        return "(no results)"
    from .timing import paired_ratios

    first = results[0]
    chunk_rows = {(r["seq_len"], r["variant"], r["chunk_size"]): r for r in results if r["method"] == "chunk"}
    loops = {(r["seq_len"], r["variant"]): r for r in results if r["method"] == "recurrent"}
    keys = list(chunk_rows) + [(T, v, None) for T, v in loops if not any(k[:2] == (T, v) for k in chunk_rows)]
    sizes = list(dict.fromkeys(r["chunk_size"] for r in results if r["method"] == "chunk"))

    def effective_chunk(r: dict) -> int:
        return r.get("effective_chunk_size", min(r["chunk_size"], r["seq_len"]))

    chunks = sorted({effective_chunk(r) for r in results})
    per_row_chunk = len(chunks) > 1 or len(sizes) > 1     # several T shorter than chunk_size, or sizes
    has_ungated = any(r["variant"] == "ungated" for r in results)
    peers = {r["peer"] for r in results if r.get("peer")}
    rec_names = ("rec fwd ms", "fwd rec/chunk", "rec f+b ms", "f+b rec/chunk") if loops else ()
    header = ["T", "variant", *(["C"] if per_row_chunk else []), "chunk fwd ms", *rec_names[:2],
              "chunk f+b ms", *rec_names[2:], *(["f+b / ungated"] if has_ungated else []),
              *([f"f+b / C={sizes[0]}"] if len(sizes) > 1 else []),
              *(["fwd peer/linattn", "f+b peer/linattn"] if peers else [])]
    rows = [header]

    def paired(a: Optional[dict], b: Optional[dict], key: str = "fwd_bwd_times") -> str:
        if a is None or b is None or not a.get(key) or not b.get(key):
            return "-"
        r = paired_ratios(a[key], b[key])
        return _ratio_cell(r) if r["median"] is not None else "-"

    for T, variant, C in keys:
        chunk, rec = chunk_rows.get((T, variant, C)), loops.get((T, variant))
        row = [str(T), variant]
        if per_row_chunk:                # the chunk size used, and the one asked for where it differs
            r = chunk or rec
            row.append(str(effective_chunk(r)) + ("" if effective_chunk(r) == r["chunk_size"] or len(sizes) < 2
                                                  else f" of {r['chunk_size']}"))
        for key in ("fwd", "fwd_bwd"):
            a = None if chunk is None else chunk[f"{key}_s"]
            b = None if rec is None else rec[f"{key}_s"]
            row.append(_time_cell(a, None if chunk is None else chunk.get(f"{key}_spread")))
            if loops:
                row += [_time_cell(b, None if rec is None else rec.get(f"{key}_spread")),
                        _num(b / a) + "x" if a and b else "-"]
        if has_ungated:
            row.append(paired(chunk, chunk_rows.get((T, "ungated", C))))
        if len(sizes) > 1:
            first = chunk_rows.get((T, variant, sizes[0]))
            row.append(paired(chunk, first) if C != sizes[0] or paired(chunk, first) == "-" else "1")
        if peers:                        # a peer's time over linattn's on the same inputs, round by round
            ours = chunk_rows.get((T, "gated_delta", C)) if chunk is not None and chunk.get("peer") else None
            row += [paired(chunk, ours, "fwd_times"), paired(chunk, ours)] if ours else ["", ""]
        rows.append(row)
    lines = _align(rows)
    if len(sizes) > 1:
        chunk_text = "C=min(chunk_size, T), chunk_size in " + "/".join(map(str, sizes))
    else:
        chunk_text = f"C={chunks[0]}" if not per_row_chunk else f"C=min({first['chunk_size']}, T)"
    threads = _threads_text(results)
    where = first.get("device_name") or first["device"]
    title = (f"linattn decay family on {first['device']} ({where}){', ' + threads if threads else ''}, "
             f"{first['dtype']}, B={first['batch']} H={first['heads']} D=Dv={first['head_dim']}{_gates_text(results)}, "
             f"{chunk_text}: chunk{' vs recurrent' if loops else ' forms'}"
             f"{' (LINATTN_CPU_KERNEL=force: compiled CPU loops)' if any(r.get('cpu_kernel') for r in results) else ''}")
    legend = ("fwd: median under torch.no_grad; f+b: autograd.grad w.r.t. q, k, v; ±: half the range of the "
              "repetitions over the median")
    if loops:
        legend += "; rec/chunk: recurrent time / chunk time (> 1: the chunk form is faster)"
    if has_ungated:
        legend += ("; f+b / ungated: chunk f+b time / that of linear_attention(q, k, v, feature_map=None, "
                   "normalize=False, causal=True) at the same C, per round, median (range)")
    if len(sizes) > 1:
        legend += (f"; f+b / C={sizes[0]}: chunk f+b time / the same variant's at chunk_size={sizes[0]}, per round, "
                   "median (range)" + ("; the recurrent form has no chunks and is timed once" if loops else ""))
    if peers:
        legend += (f"; {', '.join(sorted({r['variant'] for r in results if r.get('peer')}))}: "
                   f"{'; '.join(sorted(peers))}, on the gated_delta rows' inputs (it scales q by D^-1/2 itself), "
                   "timed in the same rounds; peer/linattn: its time / gated_delta's at the same C, per round, "
                   "median (range); above 1: linattn is faster")
    legend += "."
    return "\n".join([title, "", *lines, "", legend])


def _gates_text(results: Sequence[dict]) -> str:
    """``", gates logsigmoid(x)/16"`` when the rows record a gate temperature, else ``""``."""
    taus = {r["gate_temperature"] for r in results if r.get("gate_temperature") is not None
            and r["variant"] in ("gla", "gated_delta", "gated_delta_channel")}   # the variants with these gates
    return f", gates logsigmoid(x)/{taus.pop():g}" if len(taus) == 1 else ""


def plot_results(results: Sequence[dict], path: Union[str, os.PathLike]) -> None:
    """Save a two-panel PNG (time and peak memory against ``T``, log-log) of the results.

    Parameters
    ----------
    results : sequence of dict
        As returned by :func:`run_benchmark`; cells that did not run are left out.
    path : str or path-like
        Where to write the figure (its format follows the suffix).

    Raises
    ------
    ImportError
        If matplotlib is not installed (it is imported here, not with the module).
    """
    from matplotlib.figure import Figure

    first = results[0]
    key = "fwd_bwd_s" if first["memory_pass"] == "fwd+bwd" else "fwd_s"
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2)
    for method in dict.fromkeys(r["method"] for r in results):
        ok = [r for r in results if r["method"] == method and r["status"] == "ok"]
        if ok:
            T = [r["seq_len"] for r in ok]
            ax_time.plot(T, [r[key] for r in ok], marker="o", label=method)
            ax_mem.plot(T, [r["peak_memory_bytes"] / 1e6 for r in ok], marker="o", label=method)
    pass_name = "forward+backward" if key == "fwd_bwd_s" else "forward"
    for ax, ylabel in ((ax_time, f"median {pass_name} time (s)"), (ax_mem, f"peak {pass_name} memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Causal attention cost against T ({first['device']}, {first['dtype']}, "
                 f"B={first['batch']}, H={first['heads']}, D={first['head_dim']})")
    fig.savefig(path, dpi=110)


def machine_info(device: Union[torch.device, str]) -> dict:
    """Versions, device and CPU facts to store next to the numbers."""
    from .. import __version__

    device = torch.device(device)
    return {
        "linattn_version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu": cpu_name(),
        "cpu_capability": _cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernel": cpu.cpu_kernel_enabled(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
    }


def _cpu_capability() -> Optional[str]:
    """The vector instructions ATen's CPU kernels use here (``"AVX512"``, ``"AVX2"``, ...; None if
    torch cannot say): two CPUs of one model name can differ in this, and their timings with it."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return None if get is None else str(get())


def _commit():
    """The git commit of the checkout the package runs from (None outside one), as the studies record it."""
    from ..experiments.origin import git_commit
    return git_commit()
