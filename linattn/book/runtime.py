"""How a chapter starts: every random generator seeded, and the device chosen once."""
from __future__ import annotations

import numbers
import os
import random

import torch

__all__ = ["set_seed", "default_device"]


def set_seed(seed: int = 0) -> torch.Generator:
    """Seed Python's, NumPy's (when installed) and PyTorch's random number generators.

    Parameters
    ----------
    seed : int
        An integer in ``[0, 2**32 - 1]`` (NumPy's range), Python's or NumPy's.

    Returns
    -------
    torch.Generator
        The default CPU generator, already seeded (handy for ``torch.randn(..., generator=g)``).

    Raises
    ------
    TypeError
        If ``seed`` is not an integer.
    ValueError
        If ``seed`` is negative or above ``2**32 - 1`` (checked before any generator is seeded).
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"seed must be in [0, 2**32 - 1] (NumPy's seeds), got {seed}")
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
