"""Small helpers shared by the package and the book: seeding, device choice, figure style."""
from __future__ import annotations

import os
import random

import torch

__all__ = ["set_seed", "default_device", "use_book_style"]


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
