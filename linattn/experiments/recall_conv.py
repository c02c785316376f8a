"""Does a short convolution let a linear model find the key itself? Recall with and without it."""
from __future__ import annotations

from . import _recall, load_results

NAME = "recall_conv"
DESCRIPTION = "recall whose key the model must find: gated delta with / without short conv, softmax (RoPE)"

MODELS = {
    "gated delta + conv": dict(attention="gated_delta", positions="none", short_conv=True),
    "gated delta, no conv": dict(attention="gated_delta", positions="none", short_conv=False),
    "softmax (RoPE)": dict(attention="softmax", positions="rope"),
}
BASE = dict(d_model=64, n_layers=2, n_heads=4, chunk_size=32)
LRS = (1e-3, 3e-3, 1e-2)
STEPS = 1000
SEEDS = (0, 1, 2)
LONG_MODELS = tuple(MODELS)          # every model once at 5x the budget
REUSE_FROM = "recall_conv_sweep"   # its seed-0 cell at the best rate is a sweep cell
CHECK_STEPS = 40        # a short cell for the chapter to re-run under nbval


def sweep_grid() -> list[dict]:
    return [dict(model=m, lr=lr, seed=0, steps=STEPS) for m in MODELS for lr in LRS]


def best_lrs(sweep: dict) -> dict:
    """Per model, the learning rate with the highest mean accuracy over the evaluated N."""
    best = {}
    for row in sweep["rows"]:
        c, acc = row["cell"], row["result"]["accuracy"]
        score = sum(acc.values()) / len(acc)
        if c["model"] not in best or score > best[c["model"]][1]:
            best[c["model"]] = (c["lr"], score)
    return {m: lr for m, (lr, _) in best.items()}


def grid() -> list[dict]:
    lrs = best_lrs(load_results("recall_conv_sweep"))
    cells = [dict(model=m, lr=lrs[m], seed=s, steps=STEPS) for m in MODELS for s in SEEDS]
    cells += [dict(model=m, lr=lrs[m], seed=0, steps=5 * STEPS) for m in LONG_MODELS]
    cells.append(dict(model="gated delta + conv", lr=lrs["gated delta + conv"], seed=0, steps=CHECK_STEPS))
    return cells


def run_cell(cell: dict) -> dict:
    return _recall.run(dict(BASE, **MODELS[cell["model"]]), steps=cell["steps"], lr=cell["lr"], seed=cell["seed"])
