"""Deprecated: seeding, device choice and the figure helpers live in :mod:`linattn.book`."""
from ._deprecated import moved

__getattr__ = moved(__name__, {name: f"linattn.book:{name}" for name in (
    "set_seed", "default_device", "use_book_style", "book_figure", "finish_figure", "COLUMN_WIDTH_IN", "MIN_FONT_PT")})
