"""Token mixers, one per file: :class:`LinearAttention` (:mod:`.linear`), :class:`SoftmaxAttention`
(:mod:`.softmax`), :class:`LinearMultiheadAttention` (:mod:`.multihead`), :class:`LinearMixer`
(:mod:`.mixer`) with :class:`ShortConvolution` (:mod:`.short_conv`); their shared head plumbing
(:mod:`.projections`) and rotary positions (:mod:`.positions`). Tensors are ``(batch, seq, d_model)``."""
from .._deprecated import moved as _moved
from .linear import LinearAttention
from .mixer import DELTA_RULES, RULES, LinearMixer, retnet_log_gammas
from .multihead import LinearMultiheadAttention
from .positions import apply_rope
from .short_conv import ShortConvolution
from .softmax import SoftmaxAttention

__all__ = ["LinearAttention", "SoftmaxAttention", "LinearMultiheadAttention", "LinearMixer", "ShortConvolution",
           "apply_rope", "RULES", "DELTA_RULES", "retnet_log_gammas"]

__getattr__ = _moved(__name__, {
    "KVCache": "linattn.state:KVCache",
    "DecodingState": "linattn.state:DecodingState",
    "ATTENTIONS": "linattn.models:ATTENTIONS",
    "TransformerBlock": "linattn.models:TransformerBlock",
    "TransformerConfig": "linattn.models:TransformerConfig",
    "TransformerLM": "linattn.models:TransformerLM",
})
