"""linattn.utils: seeding, device choice and the book's figure helpers."""
from __future__ import annotations

import pytest
import torch

from linattn import utils

mpl = pytest.importorskip("matplotlib")
mpl.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    with mpl.rc_context():
        yield
    plt.close("all")


def _plot(ax):
    ax.plot([1, 2, 4], [1, 4, 16])


def test_set_seed_repeats_draws_and_rejects_bad_seeds():
    utils.set_seed(3)
    a = torch.randn(4)
    utils.set_seed(3)
    assert torch.equal(a, torch.randn(4))
    with pytest.raises(TypeError, match="seed"):
        utils.set_seed(1.5)
    with pytest.raises(ValueError, match="non-negative"):
        utils.set_seed(-1)


def test_default_device_follows_cuda_availability():
    assert utils.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_book_figure_is_column_wide_in_the_book_style():
    fig, ax = utils.book_figure()
    assert fig.get_figwidth() == pytest.approx(utils.COLUMN_WIDTH_IN)
    assert fig.get_figheight() == pytest.approx(3.6)
    assert mpl.rcParams["font.size"] == 10 and not mpl.rcParams["axes.spines.top"]
    fig, axes = utils.book_figure(2, 2, sharex=True)
    assert axes.shape == (2, 2)
    assert fig.get_size_inches() == pytest.approx((utils.COLUMN_WIDTH_IN, 5.2))
    with pytest.raises(TypeError, match="figsize"):
        utils.book_figure(figsize=(10, 3))
    with pytest.raises(ValueError, match="height"):
        utils.book_figure(height=0)
    with pytest.raises(ValueError, match="nrows"):
        utils.book_figure(0, 1)


def test_finish_figure_sets_labels_and_returns_the_figure():
    fig, ax = utils.book_figure()
    _plot(ax)
    out = utils.finish_figure(ax, title="Cost grows as T²", xlabel="T (tokens)", ylabel="time (ms)")
    assert out is fig
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("Cost grows as T²", "T (tokens)", "time (ms)")


def test_book_style_text_is_readable_at_column_width():
    fig, ax = utils.book_figure()
    _plot(ax)
    ax.legend(["cost"])
    utils.finish_figure(ax, title="t", xlabel="x (s)", ylabel="y (s)")
    assert utils._smallest_font(fig) >= utils.MIN_FONT_PT


@pytest.mark.parametrize("missing", ["title", "xlabel", "ylabel"])
def test_finish_figure_refuses_a_missing_label_or_title(missing):
    fig, ax = utils.book_figure()
    _plot(ax)
    labels = {"title": "Cost grows as T²", "xlabel": "T (tokens)", "ylabel": "time (ms)"}
    del labels[missing]
    expected = {"title": "no title", "xlabel": "no x label", "ylabel": "no y label"}[missing]
    with pytest.raises(ValueError, match=expected):
        utils.finish_figure(ax, **labels)


def test_finish_figure_checks_every_panel_and_accepts_figure_level_labels():
    fig, (left, right) = utils.book_figure(1, 2)
    _plot(left)
    _plot(right)
    left.set(xlabel="T (tokens)", ylabel="time (ms)")
    with pytest.raises(ValueError, match="axes 1: no x label"):
        utils.finish_figure(fig, title="Both grow")
    right.set_xlabel("T (tokens)")
    utils.finish_figure(fig, title="Both grow", ylabel="time (ms)")  # a supylabel serves both panels
    assert fig.get_suptitle() == "Both grow"


def test_finish_figure_refuses_text_too_small_at_column_width():
    fig, ax = plt.subplots(figsize=(2 * utils.COLUMN_WIDTH_IN, 3.6))  # shown at half size
    _plot(ax)
    with pytest.raises(ValueError, match="column width"):
        utils.finish_figure(ax, title="t", xlabel="x (s)", ylabel="y (s)")
    with pytest.raises(ValueError, match="no axes"):
        utils.finish_figure(plt.figure(), title="t")
    with pytest.raises(TypeError, match="Figure or Axes"):
        utils.finish_figure("not a figure")
