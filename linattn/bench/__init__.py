"""Measuring time and memory, and ``python -m linattn.bench``: causal attention benchmarks."""
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
