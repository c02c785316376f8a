"""Measuring time and memory, and ``python -m linattn.bench``: causal attention benchmarks.

``median_time`` and ``peak_memory`` are what every chapter's timing and memory cells use.
The rest benchmarks causal attention methods against each other, from the command line::

    python -m linattn.bench                                   # small defaults: about a minute on 2 CPU cores
    python -m linattn.bench --device cpu --threads 1 --seq-lens 1024 4096 16384 --heads 8 \\
        --methods baseline_chunk compiled_baseline chunk chunk_cpu --json bench.json --plot bench.png
    python -m linattn.bench --decay --threads 1               # the decay family against the ungated update
    python -m linattn.bench --decode --threads 1              # one decoding step against the bare update

or from Python, with :func:`run_benchmark` and :func:`format_table` (and
:func:`run_decay_benchmark`, :func:`format_decay_table`). Every cell is the median of
repetitions interleaved with those of the other methods, reported with its spread; ratios are
round-by-round ratios, the float32 matmul yardstick is timed in the same rounds, and the
threads and the CPU model are printed with the table. ``--threads N`` pins
``torch.set_num_threads(N)``: on a shared machine, unpinned threads make the ratios
meaningless.

One file per concern:

- :mod:`linattn.bench.timing`: timers (medians, interleaved repetitions, spreads, paired
  ratios), peak memory, the matmul yardstick, thread pinning;
- :mod:`linattn.bench.baselines`: the methods (linattn's paths, plain and compiled PyTorch
  baselines) and their availability;
- :mod:`linattn.bench.costs`: FLOP counts and the memory estimate;
- :mod:`linattn.bench.run`: the benchmark loops;
- :mod:`linattn.bench.report`: tables, the plot, machine facts;
- :mod:`linattn.bench.cli`: the command line.
"""
from .baselines import (DEFAULT_CHUNK_SIZE, DEFAULT_METHODS, LINEAR_METHODS, METHODS, baseline_chunk_linear_attention,
                        compiled_baseline_linear_attention, cumsum_linear_attention, method_fn, unavailable)
from .cli import build_parser, main
from .decode import bare_linear_attention_step, bare_mixer_step, format_decode_table, run_decode_benchmark
from .costs import forward_flops, predict_memory
from .report import NOISY, format_decay_table, format_table, machine_info, plot_results
from .run import (DECAY_VARIANTS, DEFAULT_DECAY_SEQ_LENS, DEFAULT_SEQ_LENS, DTYPES, ratio, run_benchmark,
                  run_decay_benchmark)
from .timing import (cpu_name, interleaved_times, matmul_gflops, median_time, paired_ratios, peak_memory,
                     pinned_threads, summarise)

__all__ = [
    "median_time", "peak_memory", "interleaved_times", "summarise", "paired_ratios", "pinned_threads", "cpu_name",
    "METHODS", "DEFAULT_METHODS", "LINEAR_METHODS", "cumsum_linear_attention", "baseline_chunk_linear_attention",
    "compiled_baseline_linear_attention", "forward_flops", "predict_memory", "matmul_gflops", "run_benchmark",
    "ratio", "format_table", "plot_results", "machine_info", "main", "DECAY_VARIANTS", "run_decay_benchmark",
    "format_decay_table", "run_decode_benchmark", "format_decode_table", "bare_linear_attention_step", "bare_mixer_step",
]
