"""Helpers for the chapters: seeds and device (:mod:`.runtime`), the figure style (:mod:`.style`) and
figures the width of the book's column (:mod:`.figures`)."""
from .figures import book_figure, finish_figure
from .runtime import default_device, set_seed
from .style import COLUMN_WIDTH_IN, MIN_FONT_PT, use_book_style

__all__ = ["set_seed", "default_device", "use_book_style", "book_figure", "finish_figure", "COLUMN_WIDTH_IN",
           "MIN_FONT_PT"]
