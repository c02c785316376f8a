"""Does a short convolution let a linear model find the key itself? Recall with and without it.

Two-layer models (d_model 64, 4 heads) trained on multi-query associative recall in which
nothing hands the model the previous token (see :mod:`linattn.experiments._recall`): the gated
delta rule with its short causal convolution (kernel 4), the same without it, and softmax
attention with RoPE. Phase ``recall_conv_sweep``: each model at five learning rates (seed 0), a
grid wide enough that each model's best rate lies inside it. Phase ``recall_conv``: each at its
best learning rate, three seeds at the budget and three seeds at five times the budget (is the
ranking a budget artefact?). The second reads the first's results file.
"""
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
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
STEPS = 1000
SEEDS = (0, 1, 2)
LONG_MODELS = tuple(MODELS)          # every model at 5x the budget, three seeds
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
    cells += [dict(model=m, lr=lrs[m], seed=s, steps=5 * STEPS) for m in LONG_MODELS for s in SEEDS]
    cells.append(dict(model="gated delta + conv", lr=lrs["gated delta + conv"], seed=0, steps=CHECK_STEPS))
    return cells


def run_cell(cell: dict) -> dict:
    return _recall.run(dict(BASE, **MODELS[cell["model"]]), steps=cell["steps"], lr=cell["lr"], seed=cell["seed"])
