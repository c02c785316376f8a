"""Optional fused kernels, each with a pure-PyTorch twin that is its test oracle."""
from __future__ import annotations

import importlib
import os

import torch

__all__ = ["triton_available", "chunk_linear_attention_triton", "causal_linear_attention_cpu"]

from . import _fork  # noqa: F401 (marks forked children for the CPU kernels)


def triton_available() -> bool:
    """Whether the Triton kernels can run here.

    Returns
    -------
    bool
    """
    try:
        importlib.import_module("triton")
    except Exception:  # not installed, or an install that fails to import
        return False
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()


def __getattr__(name: str):
    # Lazy re-export: ``linattn.kernels.chunk_linear_attention_triton`` imports Triton only here.
    if name == "chunk_linear_attention_triton":
        from .triton.chunk import chunk_linear_attention_triton

        return chunk_linear_attention_triton
    if name == "causal_linear_attention_cpu":
        from .cpu import causal_linear_attention_cpu

        return causal_linear_attention_cpu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
