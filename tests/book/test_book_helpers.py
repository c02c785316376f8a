"""linattn.utils: seeding, device choice and the book's figure helpers."""
from __future__ import annotations

import pytest
import torch

from linattn import book as utils
from linattn.book.figures import _smallest_font

mpl = pytest.importorskip("matplotlib", reason='matplotlib is not installed (pip install "linattn[plot]")')
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
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32 - 1\]"):
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


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("2",), {}, TypeError, r"nrows must be an int, got str '2'"),
        ((None,), {}, TypeError, r"nrows must be an int, got NoneType None"),
        ((True,), {}, TypeError, r"nrows must be an int, got bool True"),  # a bool is not a count
        ((1, 1.0), {}, TypeError, r"ncols must be an int, got float 1.0"),
        ((0,), {}, ValueError, r"nrows must be >= 1, got 0"),
        ((1, -2), {}, ValueError, r"ncols must be >= 1, got -2"),
        ((), {"height": "3"}, TypeError, r"height must be a number of inches, got str '3'"),
        ((), {"height": True}, TypeError, r"height must be a number of inches, got bool True"),
        ((), {"height": float("inf")}, ValueError, r"height must be a finite positive number of inches, got inf"),
        ((), {"height": float("nan")}, ValueError, r"height must be .* got nan"),
        ((), {"height": -1.0}, ValueError, r"height must be .* got -1.0"),
    ],
)
def test_book_figure_errors_name_the_argument_and_the_value(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        utils.book_figure(*args, **kwargs)
    assert not plt.get_fignums()  # nothing half-made is left open


def test_book_figure_accepts_integer_and_real_like_sizes():
    np = pytest.importorskip("numpy")
    fig, axes = utils.book_figure(np.int64(2), height=np.float32(3.0))
    assert len(axes) == 2 and fig.get_size_inches() == pytest.approx((utils.COLUMN_WIDTH_IN, 3.0))


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
    assert _smallest_font(fig) >= utils.MIN_FONT_PT


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


def test_finish_figure_accepts_a_twinx_axis_without_its_own_x_label_or_title():
    fig, ax = utils.book_figure()
    _plot(ax)
    right = ax.twinx()
    right.plot([1, 2, 4], [3, 2, 1], color="C1")
    ax.set(xlabel="T (tokens)", ylabel="time (ms)", title="Time grows, memory falls")
    with pytest.raises(ValueError, match="axes 1: no y label"):  # the twin's own y axis still needs one
        utils.finish_figure(fig)
    right.set_ylabel("memory (MB)")
    assert utils.finish_figure(fig) is fig
    # twiny: the mirror image, its own x label, the y label and title of its sibling
    fig, ax = utils.book_figure()
    _plot(ax)
    top = ax.twiny()
    top.plot([10, 20, 40], [1, 4, 16])
    ax.set(xlabel="T (tokens)", ylabel="time (ms)", title="Two scales")
    with pytest.raises(ValueError, match="axes 1: no x label"):
        utils.finish_figure(fig)
    top.set_xlabel("T (thousands of tokens)")
    utils.finish_figure(fig)


def test_finish_figure_shared_x_needs_the_label_only_on_the_bottom_panel():
    fig, (top, bottom) = utils.book_figure(2, 1, sharex=True)
    _plot(top)
    _plot(bottom)
    top.set(ylabel="time (ms)", title="Time grows as T²")
    bottom.set(ylabel="memory (MB)", title="Memory grows as T")
    with pytest.raises(ValueError, match="axes 1: no x label") as info:
        utils.finish_figure(fig)
    assert "axes 0" not in str(info.value)  # the top panel's x tick labels are hidden
    bottom.set_xlabel("T (tokens)")
    assert utils.finish_figure(fig) is fig
    top.tick_params(labelbottom=True)  # once the top panel shows its own x ticks, it needs its own label
    with pytest.raises(ValueError, match="axes 0: no x label"):
        utils.finish_figure(fig)


def test_finish_figure_without_shared_axes_needs_every_label():
    fig, (top, bottom) = utils.book_figure(2, 1)  # not shared: the top panel has its own x axis
    _plot(top)
    _plot(bottom)
    bottom.set_xlabel("T (tokens)")
    with pytest.raises(ValueError, match="axes 0: no x label"):
        utils.finish_figure(fig, title="t", ylabel="time (ms)")


def test_finish_figure_figure_level_labels_and_title_serve_every_panel():
    fig, axes = utils.book_figure(2, 2)
    for ax in axes.flat:
        _plot(ax)
    with pytest.raises(ValueError, match="no title"):
        utils.finish_figure(fig, xlabel="T (tokens)", ylabel="time (ms)")
    axes[0, 0].set_title("one panel's title is not enough")
    with pytest.raises(ValueError, match="no title"):
        utils.finish_figure(fig)
    fig.suptitle("All four grow as T²")
    assert utils.finish_figure(fig) is fig
    assert fig._supxlabel.get_text() == "T (tokens)" and fig._supylabel.get_text() == "time (ms)"


def test_finish_figure_refuses_text_too_small_at_column_width():
    fig, ax = plt.subplots(figsize=(2 * utils.COLUMN_WIDTH_IN, 3.6))  # shown at half size
    _plot(ax)
    with pytest.raises(ValueError, match="column width") as info:
        utils.finish_figure(ax, title="t", xlabel="x (s)", ylabel="y (s)")
    assert "column-wide" in str(info.value)
    with pytest.raises(ValueError, match="no axes"):
        utils.finish_figure(plt.figure(), title="t")
    with pytest.raises(TypeError, match="Figure or Axes"):
        utils.finish_figure("not a figure")


def test_finish_figure_small_text_on_a_column_wide_figure_asks_for_a_larger_font():
    fig, ax = utils.book_figure()
    _plot(ax)
    ax.legend(["cost"], fontsize=6)
    with pytest.raises(ValueError, match="raise the font size of the text 'cost'") as info:
        utils.finish_figure(ax, title="t", xlabel="x (s)", ylabel="y (s)")
    assert "narrower" not in str(info.value) and "6.0 pt" in str(info.value)
    ax.legend(["cost"])
    ax.tick_params(labelsize=7)
    with pytest.raises(ValueError, match="raise the font size of the x tick labels of axes 0"):
        utils.finish_figure(ax)
    ax.tick_params(labelsize=9)
    utils.finish_figure(ax)
