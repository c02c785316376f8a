"""The learning-rate sweep of :mod:`linattn.experiments.recall_conv` (seed 0, five rates per model)."""
from __future__ import annotations

from .recall_conv import run_cell, sweep_grid

__all__ = ["NAME", "DESCRIPTION", "grid", "run_cell"]

NAME = "recall_conv_sweep"
DESCRIPTION = "learning-rate sweep of recall_conv: each model at five learning rates, seed 0"


def grid() -> list[dict]:
    return sweep_grid()
