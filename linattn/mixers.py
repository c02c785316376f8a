"""Deprecated: :class:`~linattn.LinearMixer` lives in :mod:`linattn.layers.mixer`, its state in :mod:`linattn.state`."""
from ._deprecated import moved

__getattr__ = moved(__name__, {
    **{name: f"linattn.layers.mixer:{name}" for name in (
        "RULES", "DELTA_RULES", "GLA_GATE_RANK", "GLA_GATE_NORMALIZER", "NORM_EPS", "L2_EPS", "LinearMixer",
        "retnet_log_gammas")},
    "MixerState": "linattn.state:MixerState",
    "ShortConvolution": "linattn.layers.short_conv:ShortConvolution",
})
