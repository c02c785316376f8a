"""linattn: linear attention, derived step by step and made fast."""
from .attention import linear_attention, linear_attention_step, softmax_attention
from .feature_maps import elu_plus_one, get_feature_map, relu
from .feature_maps import (CosFormerFeatures, DPFPFeatures, HedgehogFeatures, PerformerFeatures, TaylorFeatures,
                           distill_feature_map, squared_relu)
from .state import DecodingState, KVCache, LinearAttentionState, MixerState
from .ops.retention import retention
from .ops.gla import gated_linear_attention
from .ops.delta import delta_rule
from .ops.gated_delta import gated_delta_rule
from .distributed import ring_softmax_attention, sequence_parallel_linear_attention
from .layers import LinearAttention, LinearMixer, LinearMultiheadAttention, ShortConvolution, SoftmaxAttention, apply_rope
from .models import TransformerBlock, TransformerConfig, TransformerLM
from .book import book_figure, default_device, finish_figure, set_seed, use_book_style
from . import interop
from . import kernels as _kernels  # noqa: F401 (marks forked children for the CPU kernels)
from . import backends as _backends


def _calibrate_cpu_kernels(threads):       # imported on first use: `python -m linattn.calibrate` runs it as __main__
    from .calibrate import calibrate_cpu_kernels
    return calibrate_cpu_kernels(threads)


_backends.set_cpu_calibrator(_calibrate_cpu_kernels)   # backends may not import the ops it dispatches

__version__ = "0.2.0"

__all__ = [
    "softmax_attention",
    "linear_attention",
    "linear_attention_step",
    "retention",
    "gated_linear_attention",
    "delta_rule",
    "gated_delta_rule",
    "sequence_parallel_linear_attention",
    "ring_softmax_attention",
    "LinearAttentionState",
    "elu_plus_one",
    "relu",
    "get_feature_map",
    "squared_relu",
    "DPFPFeatures",
    "PerformerFeatures",
    "TaylorFeatures",
    "HedgehogFeatures",
    "CosFormerFeatures",
    "distill_feature_map",
    "set_seed",
    "default_device",
    "use_book_style",
    "book_figure",
    "finish_figure",
    "LinearAttention",
    "LinearMultiheadAttention",
    "LinearMixer",
    "MixerState",
    "ShortConvolution",
    "apply_rope",
    "SoftmaxAttention",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLM",
    "KVCache",
    "DecodingState",
    "interop",
]
