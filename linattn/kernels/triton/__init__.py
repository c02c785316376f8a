"""The fused Triton kernel of causal linear attention (:mod:`.chunk`); importing this package does not
import Triton, :func:`chunk_linear_attention_triton` does on first use."""

__all__ = ["chunk_linear_attention_triton"]


def __getattr__(name: str):
    if name == "chunk_linear_attention_triton":
        from .chunk import chunk_linear_attention_triton

        return chunk_linear_attention_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
