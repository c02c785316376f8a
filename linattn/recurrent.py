"""Deprecated: :class:`~linattn.LinearAttentionState` lives in :mod:`linattn.state`,
:func:`~linattn.linear_attention_step` in :mod:`linattn.attention`."""
from ._deprecated import moved

__getattr__ = moved(__name__, {
    "LinearAttentionState": "linattn.state:LinearAttentionState",
    "check_initial_state": "linattn.state:check_initial_state",
    "linear_attention_step": "linattn.attention:linear_attention_step",
    "finish": "linattn._numerics:divide_by_normaliser",
    "step_features": "linattn.ops.linear:step_features",
})
