"""The optional compiled CPU kernels: causal linear attention (:mod:`.linear`) and the token loop of
the decay family (:mod:`.recurrent`), built on first use (:mod:`.build`) and called through
:mod:`ctypes` (:mod:`.runtime`). Which op uses them is :mod:`linattn.backends`' choice."""
from . import calibration
from .linear import causal_linear_attention_cpu
from .recurrent import decay_cpu, delta_rule_cpu, token_loop_ops
from .runtime import (build_info, cpu_kernel_available, cpu_kernel_enabled, target_flags, token_loop_supports,
                      vector_bytes, warn_unavailable_once)

__all__ = ["calibration", "causal_linear_attention_cpu", "delta_rule_cpu", "decay_cpu", "token_loop_ops", "cpu_kernel_available",
           "cpu_kernel_enabled", "build_info", "token_loop_supports", "warn_unavailable_once",
           "target_flags", "vector_bytes"]
