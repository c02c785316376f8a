"""Deprecated: the WY chunk form lives in :mod:`linattn.ops.wy`, the per-head decays in :mod:`linattn.ops.decay`."""
from .._deprecated import moved

__getattr__ = moved(__name__, {
    "scalar_decay": "linattn.ops.decay:scalar_decay",
    "scalar_decay_backward": "linattn.ops.decay:scalar_decay_backward",
    "wy_chunk": "linattn.ops.wy:wy_chunk",
    "wy_chunk_channel": "linattn.ops.wy:wy_chunk_channel",
})
