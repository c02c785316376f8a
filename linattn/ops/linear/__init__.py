"""Plain (normalised) causal and non-causal linear attention: its algorithms side by side."""
from ..._deprecated import moved as _moved
from .chunk import chunkwise_linear_attention
from .naive import (naive_chunk_linear_attention, parallel_linear_attention, quadratic_linear_attention,
                    recurrent_linear_attention, step_features)

__all__ = ["chunkwise_linear_attention", "naive_chunk_linear_attention", "parallel_linear_attention",
           "quadratic_linear_attention", "recurrent_linear_attention", "step_features"]

__getattr__ = _moved(__name__, {"chunk_linear_attention": "linattn.ops.linear.naive:naive_chunk_linear_attention"})
