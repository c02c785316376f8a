"""Deprecated: the fused Triton kernel lives in :mod:`linattn.kernels.triton.chunk`."""
from .._deprecated import moved

__getattr__ = moved(__name__, {"chunk_linear_attention_triton": "linattn.kernels.triton.chunk:chunk_linear_attention_triton"})
