"""The book's figure style: matplotlib settings, the column width and the smallest font."""
from __future__ import annotations

import importlib

__all__ = ["COLUMN_WIDTH_IN", "MIN_FONT_PT", "use_book_style"]

# The book's text column, in inches: a figure this wide is shown at its natural size.
COLUMN_WIDTH_IN = 6.4
# The smallest text (points) a figure may show once scaled to the column width.
MIN_FONT_PT = 8.0


def _matplotlib(module: str, caller: str):
    """``importlib.import_module(module)`` for a matplotlib module, or an ImportError that says
    how to install matplotlib (an optional dependency: the ``plot`` extra of ``linattn``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "matplotlib":
            raise  # matplotlib is there but something it needs is not: its own message says what
        raise ImportError(
            f"linattn.{caller}() needs matplotlib, an optional dependency of linattn: "
            f'pip install "linattn[plot]" (or pip install matplotlib)', name="matplotlib") from err


def use_book_style() -> None:
    """Apply the book's matplotlib style (one look for every figure in every chapter).

    Raises
    ------
    ImportError
        If matplotlib is not installed (it is an optional dependency of ``linattn``: install it
        with ``pip install "linattn[plot]"``); the message says so.
    """
    _matplotlib("matplotlib", "use_book_style").rcParams.update(
        {
            "figure.figsize": (6.4, 3.6),
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "font.size": 10,
            "axes.titlesize": 10.5,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "lines.linewidth": 1.8,
            "lines.markersize": 5,
            "figure.constrained_layout.use": True,
        }
    )
