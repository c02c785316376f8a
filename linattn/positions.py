"""Deprecated: rotary and learned positions live in :mod:`linattn.layers.positions`."""
from ._deprecated import moved

__getattr__ = moved(__name__, {name: f"linattn.layers.positions:{name}" for name in (
    "POSITIONS", "DEFAULT_POSITIONS", "ROPE_BASE", "check_positions_name", "apply_rope", "check_positions",
    "token_positions")})
