"""Small helpers shared by the package and the book: seeding, device choice, figure style."""
from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed", "default_device", "use_book_style", "book_figure", "finish_figure",
           "COLUMN_WIDTH_IN", "MIN_FONT_PT"]

# The book's text column, in inches: a figure this wide is shown at its natural size.
COLUMN_WIDTH_IN = 6.4
# The smallest text (points) a figure may show once scaled to the column width.
MIN_FONT_PT = 8.0


def set_seed(seed: int = 0) -> torch.Generator:
    """Seed Python's, NumPy's (when installed) and PyTorch's random number generators.

    Parameters
    ----------
    seed : int
        A non-negative integer.

    Returns
    -------
    torch.Generator
        The default CPU generator, already seeded (handy for ``torch.randn(..., generator=g)``).

    Raises
    ------
    TypeError
        If ``seed`` is not an ``int``.
    ValueError
        If ``seed`` is negative.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    random.seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # NumPy is optional for the package
        pass
    return torch.manual_seed(seed)  # also seeds every CUDA device


def default_device() -> torch.device:
    """The device the book and the benchmarks use by default: CUDA when present, CPU otherwise.

    Returns
    -------
    torch.device
        ``cuda`` if ``torch.cuda.is_available()``, else ``cpu``.
    """
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_book_style() -> None:
    """Apply the book's matplotlib style (one look for every figure in every chapter).

    Sized for the book's column width: 6.4 x 3.6 inches at 110 dpi, 10-pt text,
    a light grid, no top/right spines. Call once per notebook after importing matplotlib.

    Raises
    ------
    ImportError
        If matplotlib is not installed (it is an optional dependency of ``linattn``).
    """
    import matplotlib as mpl

    mpl.rcParams.update(
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


def book_figure(nrows: int = 1, ncols: int = 1, *, height: float | None = None, **subplots_kw):
    """A new figure in the book's style, exactly as wide as the book's text column.

    Applies :func:`use_book_style`, then calls ``plt.subplots`` with
    ``figsize=(COLUMN_WIDTH_IN, height)``. Finish the figure with :func:`finish_figure`.

    Parameters
    ----------
    nrows, ncols : int
        Grid of axes, as for ``plt.subplots``.
    height : float, optional
        Height in inches; default 3.6 for one row of axes, 2.6 per row otherwise.
    **subplots_kw
        Passed to ``plt.subplots`` (``sharex``, ``sharey``, ``gridspec_kw``, ...); ``figsize``
        is not accepted: the width is the column's.

    Returns
    -------
    (matplotlib.figure.Figure, Axes or array of Axes)
        What ``plt.subplots`` returns.

    Raises
    ------
    TypeError
        If ``figsize`` is passed.
    ValueError
        If ``nrows``, ``ncols`` or ``height`` is not positive.
    """
    import matplotlib.pyplot as plt

    if "figsize" in subplots_kw:
        raise TypeError("book_figure() sets figsize itself (the column width); pass height= instead")
    if nrows < 1 or ncols < 1:
        raise ValueError(f"nrows and ncols must be >= 1, got nrows={nrows}, ncols={ncols}")
    if height is None:
        height = 3.6 if nrows == 1 else 2.6 * nrows
    if not height > 0:
        raise ValueError(f"height must be positive (inches), got {height}")
    use_book_style()
    return plt.subplots(nrows, ncols, figsize=(COLUMN_WIDTH_IN, height), **subplots_kw)


def _data_axes(fig) -> list:
    """The axes of ``fig`` that show data (colorbars and empty, hidden axes excluded)."""
    axes = []
    for ax in fig.axes:
        if getattr(ax, "_colorbar", None) is not None or not ax.get_visible() or not ax.axison:
            continue
        if ax.lines or ax.collections or ax.images or ax.patches or ax.containers:
            axes.append(ax)
    return axes


def _smallest_font(fig) -> float:
    """The smallest font size (points) among the figure's visible texts and tick labels."""
    sizes = [t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize"))
             if getattr(t, "get_text", lambda: "")() and t.get_visible()]
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            sizes.extend(label.get_fontsize() for label in axis.get_ticklabels() if label.get_visible())
    return min(sizes) if sizes else float("inf")


def finish_figure(fig_or_ax, *, title: str | None = None, xlabel: str | None = None,
                  ylabel: str | None = None):
    """Label a figure and check that a reader can read it at the book's column width.

    Sets what is given, then checks the whole figure: every axes that shows data has an
    x label and a y label (its own, or the figure's ``supxlabel``/``supylabel``); the figure
    has a title (``suptitle``, or a title on every such axes); and its smallest text is at
    least ``MIN_FONT_PT`` points once the figure is scaled to ``COLUMN_WIDTH_IN`` inches.
    Write units in the labels (``"sequence length T (tokens)"``, ``"time (ms)"``) and make
    the title state the finding (``"Softmax time grows as T², linear attention's as T"``);
    neither can be checked here.

    Parameters
    ----------
    fig_or_ax : matplotlib.figure.Figure or matplotlib.axes.Axes
        The figure, or one axes (whose figure is then checked).
    title : str, optional
        The axes' title (given an axes) or the figure's ``suptitle`` (given a figure).
    xlabel, ylabel : str, optional
        The axes' labels (given an axes) or the figure's ``supxlabel``/``supylabel``.

    Returns
    -------
    matplotlib.figure.Figure
        The figure, ready for ``plt.show()``.

    Raises
    ------
    TypeError
        If ``fig_or_ax`` is neither a Figure nor an Axes.
    ValueError
        Naming what is missing: an axes without an x or y label, a figure without a title,
        or text smaller than ``MIN_FONT_PT`` at the column width.
    """
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    if isinstance(fig_or_ax, Axes):
        ax, fig = fig_or_ax, fig_or_ax.figure
        if title is not None:
            ax.set_title(title)
        if xlabel is not None:
            ax.set_xlabel(xlabel)
        if ylabel is not None:
            ax.set_ylabel(ylabel)
    elif isinstance(fig_or_ax, Figure):
        fig = fig_or_ax
        if title is not None:
            fig.suptitle(title)
        if xlabel is not None:
            fig.supxlabel(xlabel)
        if ylabel is not None:
            fig.supylabel(ylabel)
    else:
        raise TypeError(f"fig_or_ax must be a matplotlib Figure or Axes, got {type(fig_or_ax).__name__}")

    def text(artist) -> str:
        return artist.get_text().strip() if artist is not None else ""

    fig_x, fig_y, fig_title = (text(getattr(fig, name, None)) for name in ("_supxlabel", "_supylabel", "_suptitle"))
    axes = _data_axes(fig)
    if not axes:
        raise ValueError("the figure has no axes with data to finish")
    missing = []
    for i, ax in enumerate(axes):
        if not (ax.get_xlabel().strip() or fig_x):
            missing.append(f"axes {i}: no x label")
        if not (ax.get_ylabel().strip() or fig_y):
            missing.append(f"axes {i}: no y label")
    if not fig_title and not all(ax.get_title().strip() for ax in axes):
        missing.append("no title (a suptitle, or a title on every axes) stating the finding")
    if missing:
        raise ValueError("figure is not finished: " + "; ".join(missing))
    width = fig.get_figwidth()
    smallest = _smallest_font(fig) * min(1.0, COLUMN_WIDTH_IN / width)
    if smallest < MIN_FONT_PT:
        raise ValueError(
            f"text of {smallest:.1f} pt at the column width ({width:.1f} in figure shown at "
            f"{COLUMN_WIDTH_IN} in); the minimum is {MIN_FONT_PT} pt: make the figure narrower or the text larger"
        )
    return fig
