"""Models built from the token mixers: :class:`TransformerLM` with its block and config
(:mod:`.transformer`) and generation (:mod:`.generation`)."""
from .transformer import ATTENTIONS, TransformerBlock, TransformerConfig, TransformerLM

__all__ = ["ATTENTIONS", "TransformerBlock", "TransformerConfig", "TransformerLM"]
