"""Optional fused GPU kernels (Triton), each with a pure-PyTorch twin that is its test oracle.

=================================  ==============================================
fast path                          twin (reference)
=================================  ==============================================
``chunk_linear_attention_triton``  :func:`linattn.ops.linear.chunk_linear_attention`
=================================  ==============================================

Importing this package never imports Triton: ``import linattn`` works without it.
Triton is imported on first use of a kernel, or by :func:`triton_available`.
"""
from __future__ import annotations

import importlib
import os

import torch

__all__ = ["triton_available", "chunk_linear_attention_triton"]


def triton_available() -> bool:
    """Whether the Triton kernels can run here.

    True when Triton imports and either CUDA is present or ``TRITON_INTERPRET=1`` is set
    (Triton's interpreter runs the kernels on the CPU with NumPy: exact but slow, meant
    for tests).

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
        from .triton_chunk import chunk_linear_attention_triton

        return chunk_linear_attention_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
