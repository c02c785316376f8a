"""The learning-rate sweep of :mod:`linattn.experiments.modern_lm` (seed 0, three rates per model)."""
from __future__ import annotations

from .modern_lm import run_cell, sweep_grid

__all__ = ["NAME", "DESCRIPTION", "grid", "run_cell"]

NAME = "modern_lm_sweep"
DESCRIPTION = "learning-rate sweep of modern_lm: each model at three learning rates, seed 0"


def grid() -> list[dict]:
    return sweep_grid()
