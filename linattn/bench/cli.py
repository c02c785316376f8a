"""``python -m linattn.bench``: the command line of the benchmarks."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Optional, Sequence

import torch

from .baselines import DEFAULT_CHUNK_SIZE, DEFAULT_METHODS, METHODS
from .decode import format_decode_table, run_decode_benchmark
from .report import format_decay_table, format_table, machine_info, plot_results
from .run import (DECAY_VARIANTS, DEFAULT_DECAY_SEQ_LENS, DEFAULT_GATE_TEMPERATURE, DEFAULT_SEQ_LENS, DTYPES,
                  MIN_GATE_TEMPERATURE, _resolve_device,
                  run_benchmark, run_decay_benchmark)
from .timing import pinned_threads

__all__ = ["build_parser", "main"]


def _arg_number(convert: type, minimum: float, strict: bool, what: str) -> Callable[[str], float]:
    """An argparse ``type``: ``convert(text)``, which must be above (or at) ``minimum``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _arg_number(int, 0, True, "a positive integer")
_non_negative_int = _arg_number(int, 0, False, "a non-negative integer")
_positive_float = _arg_number(float, 0.0, True, "a positive number")


def _seed(text: str) -> int:
    """An argparse ``type``: a seed torch.Generator takes, 0 <= seed < 2⁶³."""
    value = _non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**63, got {text!r}")
    return value


def _gate_temperature(text: str) -> float:
    """An argparse ``type``: a finite number of at least ``MIN_GATE_TEMPERATURE``."""
    value = _positive_float(text)
    if not (math.isfinite(value) and value >= MIN_GATE_TEMPERATURE):
        raise argparse.ArgumentTypeError(f"expected a finite number of at least {MIN_GATE_TEMPERATURE:g}, "
                                         f"got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m linattn.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m linattn.bench",
        description="Benchmark causal attention: softmax (SDPA) against linear attention's forms and "
                    f"baselines ({', '.join(METHODS[1:])}), repetitions interleaved, medians and spreads. "
                    "Prints a table; optionally writes JSON and a PNG.",
        epilog="Example: python -m linattn.bench --device cpu --threads 1 --seq-lens 1024 4096 --heads 8 "
               "--methods baseline_chunk compiled_baseline chunk chunk_cpu --json out.json",
    )
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default=None,
        help="where to run (default: cuda if available, else cpu)")
    add("--dtype", choices=tuple(DTYPES), default="float32", help="input dtype (default: %(default)s)")
    add("--seq-lens", type=_positive_int, nargs="+", default=None, metavar="T",
        help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_SEQ_LENS))})")
    add("--batch", type=_positive_int, default=1, help="batch size B (default: %(default)s)")
    add("--heads", type=_positive_int, default=None, help="heads H (default: 4; 8 with --decode)")
    add("--head-dim", type=_positive_int, default=64, help="head dimension D = Dv (default: %(default)s)")
    add("--methods", nargs="+", choices=METHODS, default=None, metavar="METHOD",
        help=f"methods to run, out of: {', '.join(METHODS)} (default: all but compiled_baseline)")
    add("--reference", choices=METHODS, default=None,
        help="the method the ratio columns divide by (default: chunk); it is timed too, added to --methods "
             "if they leave it out")
    add("--chunk-size", type=_positive_int, nargs="+", default=[DEFAULT_CHUNK_SIZE], metavar="C",
        help=f"chunk size C of the chunkwise methods (default: {DEFAULT_CHUNK_SIZE}); with --decay, several are "
             "timed in the same rounds and compared with the first")
    add("--repeats", type=_positive_int, default=5, help="timed rounds per measurement (default: %(default)s)")
    add("--warmup", type=_non_negative_int, default=1, help="untimed calls first (default: %(default)s)")
    add("--no-backward", action="store_true", help="time the forward pass only")
    add("--max-memory-gb", type=_positive_float, default=None, metavar="GB",
        help="skip a cell whose predicted peak memory exceeds this; inf: no limit (default: half the "
             "device's memory)")
    add("--seed", type=_seed, default=0, help="seed of the random inputs (default: %(default)s)")
    add("--json", metavar="PATH", help="write metadata and raw results (every repetition) as JSON")
    add("--plot", metavar="PATH", help="save a PNG of time and memory against T (matplotlib)")
    add("--threads", type=_positive_int, default=None, metavar="N",
        help="torch.set_num_threads(N) for the run (default: torch's own default); pin it on a "
             "shared machine, where unpinned threads make the ratios meaningless")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--decay", action="store_true",
        help="instead: time the chunk and recurrent forms of the decay family (retention, GLA, the delta rule, "
             "the gated delta rule) against the ungated update; --seq-lens defaults to "
             f"{' '.join(map(str, DEFAULT_DECAY_SEQ_LENS))} here, --methods, --reference, --max-memory-gb and "
             "--plot do not apply (and are refused)")
    add("--decode", action="store_true",
        help="instead: time one decoding step (linear_attention_step, the compiled CPU loop on one token, LinearMixer) against its bare update, "
             "B=--batch, H=--heads (default 8), D=--head-dim, --dtype, no grad, on the CPU; pin --threads 1")
    add("--variants", nargs="+", choices=DECAY_VARIANTS, default=None, metavar="VARIANT",
        help=f"with --decay: the variants to run, out of {', '.join(DECAY_VARIANTS)} (default: all)")
    add("--no-peers", action="store_true",
        help="with --decay: do not time transformers' torch_chunk_gated_delta_rule beside the gated delta rule "
             "(timed by default when transformers is importable)")
    add("--no-recurrent", action="store_true",
        help="with --decay: time the chunk forms only, not the per-token loops (which take most of a run)")
    add("--gate-temperature", type=_gate_temperature, default=None, metavar="TAU",
        help="with --decay: gates log_g = logsigmoid(x)/TAU for GLA and the gated delta rule (default: "
             f"{DEFAULT_GATE_TEMPERATURE:g}, GLA's; 1 gives chunks of strong decay)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m linattn.bench`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.decode:
        if args.decay or args.methods is not None or args.device == "cuda" or args.plot is not None:
            parser.error("--decode times CPU decoding steps: --decay, --methods, --device cuda and --plot do not apply")
        with pinned_threads(args.threads):
            return _main_decode(args, argv)
    if args.decay:
        for flag, value in (("--methods", args.methods), ("--max-memory-gb", args.max_memory_gb),
                            ("--plot", args.plot),
                            ("--reference", args.reference)):
            if value is not None:
                parser.error(f"{flag} does not apply to --decay")
    else:
        for flag, value in (("--variants", args.variants), ("--gate-temperature", args.gate_temperature),
                            ("--no-recurrent", args.no_recurrent or None), ("--no-peers", args.no_peers or None)):
            if value is not None:
                parser.error(f"{flag} applies to --decay only")
        if len(args.chunk_size) > 1:
            parser.error(f"--chunk-size takes one value without --decay, got {len(args.chunk_size)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        if not path or path.endswith(os.sep) or os.path.isdir(path):
            parser.error(f"{flag} needs a file name, got {path!r}")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag}: the folder of {path!r} does not exist")
        if not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            parser.error(f"{flag}: the folder of {path!r} is not writable")
    if args.plot is not None and os.path.splitext(args.plot)[1].lower() not in ("", ".png"):
        parser.error(f"--plot saves a PNG: give a name ending in .png (or none), got {args.plot!r}")
    if args.plot is not None and not os.path.splitext(args.plot)[1]:
        args.plot += ".png"                          # what matplotlib writes: say so, and write it
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (only checked here: imported when plotting)
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")

    device = _resolve_device(args.device)
    with pinned_threads(args.threads):
        if args.decay:
            return _main_decay(args, device, argv)
        return _main_attention(args, device, argv)


def _write_json(path: str, metadata: dict, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"metadata": metadata, "results": results}, f, indent=1)
        f.write("\n")
    print(f"\nwrote {path}")


def _main_attention(args: argparse.Namespace, device: torch.device, argv: Optional[Sequence[str]]) -> int:
    """``python -m linattn.bench``: the table of :func:`run_benchmark` (and JSON, PNG)."""
    reference = args.reference or "chunk"
    methods = list(DEFAULT_METHODS) if args.methods is None else list(args.methods)
    if reference not in methods:                         # the ratio columns divide by its times
        methods.append(reference)
    seq_lens = list(DEFAULT_SEQ_LENS) if args.seq_lens is None else args.seq_lens
    settings = dict(device=device, dtype=args.dtype, batch=args.batch, heads=args.heads or 4, head_dim=args.head_dim,
                    repeats=args.repeats, warmup=args.warmup, backward=not args.no_backward,
                    max_memory_gb=args.max_memory_gb, chunk_size=args.chunk_size[0], seed=args.seed)
    results = run_benchmark(methods, seq_lens, **settings, progress=not args.no_progress)
    print(format_table(results, reference=reference))
    if args.json is not None:
        metadata = machine_info(device)
        metadata.update({name: (str(value) if name == "device" else value) for name, value in settings.items()},
                        seq_lens=seq_lens, methods=list(dict.fromkeys(methods)), threads=args.threads,
                        reference=reference, matmul_size=2048,
                        matmul_gflops=results[0]["matmul_gflops"], max_memory_bytes=results[0]["max_memory_bytes"],
                        command=["python", "-m", "linattn.bench", *(sys.argv[1:] if argv is None else argv)])
        _write_json(args.json, metadata, results)
    if args.plot is not None:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r["status"] == "failed" for r in results) else 0


def _main_decode(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """``python -m linattn.bench --decode``: the table of :func:`run_decode_benchmark` (and JSON)."""
    settings = dict(batch=args.batch, heads=args.heads or 8, head_dim=args.head_dim, repeats=args.repeats,
                    seed=args.seed)
    rows = run_decode_benchmark(**settings, dtype=DTYPES[args.dtype])
    settings["dtype"] = args.dtype
    print(format_decode_table(rows))
    if args.json is not None:
        metadata = machine_info(torch.device("cpu"))
        metadata.update(settings, threads=args.threads,
                        command=["python", "-m", "linattn.bench", *(sys.argv[1:] if argv is None else argv)])
        _write_json(args.json, metadata, rows)
    return 0


def _main_decay(args: argparse.Namespace, device: torch.device, argv: Optional[Sequence[str]]) -> int:
    """``python -m linattn.bench --decay``: the table of :func:`run_decay_benchmark` (and JSON)."""
    seq_lens = args.seq_lens if args.seq_lens is not None else list(DEFAULT_DECAY_SEQ_LENS)
    variants = list(DECAY_VARIANTS) if args.variants is None else args.variants
    settings = dict(device=device, dtype=args.dtype, batch=args.batch, heads=args.heads or 4, head_dim=args.head_dim,
                    chunk_size=(lambda sizes: sizes[0] if len(sizes) == 1 else sizes)(list(dict.fromkeys(args.chunk_size))),
                    repeats=args.repeats, warmup=args.warmup, backward=not args.no_backward, seed=args.seed,
                    recurrent=not args.no_recurrent, peers=not args.no_peers,
                    gate_temperature=(DEFAULT_GATE_TEMPERATURE if args.gate_temperature is None
                                      else args.gate_temperature))
    results = run_decay_benchmark(seq_lens, variants=variants, **settings, progress=not args.no_progress)
    print(format_decay_table(results))
    if settings["peers"] and "gated_delta" in variants and not any(r.get("peer") for r in results):
        print("(no peer: transformers is not importable here; pip install transformers to time its "
              "torch_chunk_gated_delta_rule beside the gated delta rule)")
    if args.json is not None:
        metadata = machine_info(device)
        metadata.update({name: (str(value) if name == "device" else value) for name, value in settings.items()},
                        seq_lens=seq_lens, variants=variants, threads=args.threads,
                        command=["python", "-m", "linattn.bench", *(sys.argv[1:] if argv is None else argv)])
        _write_json(args.json, metadata, results)
    return 0
