"""Figures for the chapters: a figure the column's width (:func:`book_figure`) and the checks a finished
figure must pass (:func:`finish_figure`: labelled axes, a title, no text smaller than the book allows)."""
from __future__ import annotations

import math
import numbers

from .style import COLUMN_WIDTH_IN, MIN_FONT_PT, _matplotlib, use_book_style

__all__ = ["book_figure", "finish_figure"]


def book_figure(nrows: int = 1, ncols: int = 1, *, height: float | None = None, **subplots_kw):
    """A new figure in the book's style, exactly as wide as the book's text column.

    Parameters
    ----------
    nrows, ncols : int
        Grid of axes, as for ``plt.subplots``: positive integers (``bool`` is not accepted).
    height : float, optional
        Height in inches, a finite positive number; default 3.6 for one row of axes,
        2.6 per row otherwise.
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
        If ``figsize`` is passed, if ``nrows`` or ``ncols`` is not an integer, or if ``height``
        is not a real number (the message names the argument and what it got).
    ValueError
        If ``nrows`` or ``ncols`` is below 1, or ``height`` is not finite and positive.
    ImportError
        If matplotlib is not installed (``pip install "linattn[plot]"``).
    """
    plt = _matplotlib("matplotlib.pyplot", "book_figure")

    if "figsize" in subplots_kw:
        raise TypeError("book_figure() sets figsize itself (the column width); pass height= instead")
    for name, value in (("nrows", nrows), ("ncols", ncols)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"book_figure(): {name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"book_figure(): {name} must be >= 1, got {value!r}")
    if height is None:
        height = 3.6 if nrows == 1 else 2.6 * int(nrows)
    elif isinstance(height, bool) or not isinstance(height, numbers.Real):
        raise TypeError(f"book_figure(): height must be a number of inches, got {type(height).__name__} {height!r}")
    elif not (math.isfinite(height) and height > 0):
        raise ValueError(f"book_figure(): height must be a finite positive number of inches, got {height!r}")
    use_book_style()
    return plt.subplots(int(nrows), int(ncols), figsize=(COLUMN_WIDTH_IN, float(height)), **subplots_kw)


def _data_axes(fig) -> list:
    """The axes of ``fig`` that show data (colorbars and empty, hidden axes excluded)."""
    axes = []
    for ax in fig.axes:
        if getattr(ax, "_colorbar", None) is not None or not ax.get_visible() or not ax.axison:
            continue
        if ax.lines or ax.collections or ax.images or ax.patches or ax.containers:
            axes.append(ax)
    return axes


def _smallest_text(fig) -> tuple[float, str]:
    """The smallest font size (points) among the figure's visible texts and tick labels, and what it is."""
    found, ticks = [], set()
    for i, ax in enumerate(fig.axes):
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            for label in axis.get_ticklabels(which="both"):
                ticks.add(id(label))
                if label.get_visible():
                    found.append((label.get_fontsize(), f"the {name} tick labels of axes {i}"))
    found.extend((t.get_fontsize(), f"the text {t.get_text()!r}")
                 for t in fig.findobj(lambda a: hasattr(a, "get_fontsize"))
                 if id(t) not in ticks and getattr(t, "get_text", lambda: "")() and t.get_visible())
    return min(found, key=lambda item: item[0]) if found else (float("inf"), "")


def _smallest_font(fig) -> float:
    """The smallest font size (points) among the figure's visible texts and tick labels."""
    return _smallest_text(fig)[0]


def _twins(ax) -> list:
    """The axes made with ``twinx``/``twiny`` from ``ax`` or from which ``ax`` was made (``ax`` excluded)."""
    group = getattr(ax, "_twinned_axes", None)
    return [other for other in group.get_siblings(ax) if other is not ax] if group is not None else []


def _tick_labels_shown(axis) -> bool:
    """Whether ``axis`` (an XAxis or YAxis) draws tick labels at all."""
    try:
        params = axis.get_tick_params()
    except AttributeError:  # matplotlib < 3.7
        return any(label.get_visible() for label in axis.get_ticklabels())
    return any(params.get(key, False) for key in ("labelbottom", "labeltop", "labelleft", "labelright"))


def _has_label(ax, which: str, data_axes: list) -> bool:
    """Whether ``ax`` is labelled along ``which`` ("x" or "y") by itself or by an axes it shares that axis with."""
    def label(a) -> str:
        return (a.get_xlabel() if which == "x" else a.get_ylabel()).strip()

    def axis(a):
        return a.xaxis if which == "x" else a.yaxis

    if label(ax):
        return True
    shared = ax.get_shared_x_axes() if which == "x" else ax.get_shared_y_axes()
    siblings = [a for a in shared.get_siblings(ax) if a is not ax]
    twins = _twins(ax)
    if any(label(a) for a in siblings if a in twins):
        return True
    if _tick_labels_shown(axis(ax)):
        return False
    # Tick labels hidden: the label belongs on a panel of the group that shows them (a data
    # panel is checked in its own right), or anywhere in the group if none does.
    return any(label(a) or (a in data_axes and _tick_labels_shown(axis(a))) for a in siblings)


def finish_figure(fig_or_ax, *, title: str | None = None, xlabel: str | None = None,
                  ylabel: str | None = None):
    """Label a figure and check that a reader can read it at the book's column width.

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
        or text smaller than ``MIN_FONT_PT`` at the column width (naming the smallest text,
        and saying whether to narrow the figure or to raise the font size).
    ImportError
        If matplotlib is not installed (``pip install "linattn[plot]"``).
    """
    Axes = _matplotlib("matplotlib.axes", "finish_figure").Axes
    Figure = _matplotlib("matplotlib.figure", "finish_figure").Figure

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
        if not (fig_x or _has_label(ax, "x", axes)):
            missing.append(f"axes {i}: no x label")
        if not (fig_y or _has_label(ax, "y", axes)):
            missing.append(f"axes {i}: no y label")
    # One title per panel: a twin is drawn on top of its sibling and shares its title.
    untitled = [ax for ax in axes if not any(a.get_title().strip() for a in [ax, *_twins(ax)])]
    if not fig_title and untitled:
        missing.append("no title (a suptitle, or a title on every axes) stating the finding")
    if missing:
        raise ValueError("figure is not finished: " + "; ".join(missing))
    width = fig.get_figwidth()
    font, what = _smallest_text(fig)
    smallest = font * min(1.0, COLUMN_WIDTH_IN / width)
    if smallest < MIN_FONT_PT:
        if width > COLUMN_WIDTH_IN:
            advice = (f"the figure is {width:.1f} in wide and shown at {COLUMN_WIDTH_IN} in, which shrinks "
                      f"its text: make it column-wide (linattn.book_figure) or raise the font size")
        else:
            advice = (f"the figure is already no wider than the column, so raise the font size of {what} "
                      f"(fontsize=..., or ax.tick_params(labelsize=...) for tick labels) to at least {MIN_FONT_PT:g} pt")
        raise ValueError(
            f"text of {smallest:.1f} pt at the column width ({what}); the minimum is {MIN_FONT_PT:g} pt: {advice}"
        )
    return fig
