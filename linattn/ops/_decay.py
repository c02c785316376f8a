"""Deprecated: the decay factors live in :mod:`linattn.ops.decay`, GLA's chunk form in :mod:`linattn.ops.gla.chunk`."""
from .._deprecated import moved

__getattr__ = moved(__name__, {
    **{name: f"linattn.ops.decay:{name}" for name in (
        "padded_chunk", "decay_factors", "LevelProducts", "level_products_backward", "scores_fast",
        "scores_fast_backward", "MILD_DECAY", "MILD_GATE", "mild_groups", "prefix_factors", "prefix_factors_backward",
        "scores_by_cat")},
    "GROUP_NUMBERS": "linattn.ops._common:GROUP_NUMBERS",
    "groups": "linattn.ops._common:groups",
    "autograd_must_see_every_op": "linattn._autograd:autograd_must_see_every_op",
    "gla_chunk_ops": "linattn.ops.gla.chunk:gla_chunk_ops",
    "gla_chunk": "linattn.ops.gla.chunk:gla_chunk",
})
