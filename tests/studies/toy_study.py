"""A tiny deterministic study for the tests of linattn.experiments."""
import torch

NAME = "toy"
DESCRIPTION = "sum of seeded normal numbers"


def grid():
    return [{"seed": s, "n": n} for s in (0, 1) for n in (3, 5)]


def run_cell(cell):
    g = torch.Generator().manual_seed(cell["seed"])
    return {"total": round(float(torch.randn(cell["n"], generator=g).sum()), 6), "threads": torch.get_num_threads()}


def summarise(rows):
    return {"cells": len(rows)}
