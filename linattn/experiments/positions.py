"""Which positions should a model with linear layers use? Chapter 8's model with each scheme.

Chapter 8's character model (2 layers, d_model 64, 4 heads, tiny Shakespeare, windows of 128,
batches of 32) with linear attention (elu+1) and positions ``"learned"`` (a table of 128),
``"rope"`` (as RoFormer applies it to linear attention: rotated in the numerator only) or
``"none"``. Every scheme at four learning rates and three seeds for chapter 8's budget of 400
steps, and, as a check that the ranking holds, five times that budget with three seeds at the
scheme's best 400-step rate (:data:`LONG_LRS`; the summary says whether it still is the best).
(Softmax layers take RoPE, the standard choice; the grid is sized for a 2-core machine.) The
result of a cell is the validation loss (overall and per position).
"""
from __future__ import annotations

from . import _lm

NAME = "positions"
DESCRIPTION = "chapter 8's linear-attention model with learned, RoPE or no positions"

MODEL = dict(d_model=64, n_layers=2, n_heads=4)
SCHEMES = ("learned", "rope", "none")
LRS = (3e-3, 1e-2, 3e-2, 1e-1)
SEEDS = (0, 1, 2)
STEPS = 400
LONG_STEPS = 5 * STEPS
LONG_LRS = {"learned": 1e-2, "rope": 3e-2, "none": 1e-2}   # each scheme's best rate at STEPS (mean of SEEDS)
CHECK_STEPS = 40         # a short cell for the chapter to re-run under nbval


def grid() -> list[dict]:
    cells = [dict(attention=a, positions=p, lr=lr, seed=s, steps=STEPS)
             for a in ("linear",) for p in SCHEMES for lr in LRS for s in SEEDS]
    cells += [dict(attention="linear", positions=p, lr=LONG_LRS[p], seed=s, steps=LONG_STEPS)
              for p in SCHEMES for s in SEEDS]
    cells.append(dict(attention="linear", positions="rope", lr=1e-2, seed=0, steps=CHECK_STEPS))
    return cells


def run_cell(cell: dict) -> dict:
    kwargs = dict(MODEL, attention=cell["attention"], positions=cell["positions"])
    if cell["positions"] == "learned":
        kwargs["max_len"] = 128
    result = _lm.run(kwargs, steps=cell["steps"], lr=cell["lr"], seed=cell["seed"])
    del result["train_curve"]
    return result


def summarise(rows: list[dict]) -> dict:
    """Per (attention, positions, steps): the best learning rate by mean loss over seeds, and that mean and spread.

    ``long_lr_is_best`` says, per scheme, whether the long cells ran at the best rate of the
    ``STEPS`` cells (if not, :data:`LONG_LRS` must follow the sweep and the study be run again).
    """
    table: dict = {}
    for row in rows:
        c = row["cell"]
        table.setdefault((c["attention"], c["positions"], c["steps"]), {}).setdefault(c["lr"], []).append(
            row["result"]["val_loss"])
    out = []
    for (attention, positions, steps), by_lr in sorted(table.items()):
        lr, losses = min(by_lr.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
        out.append(dict(attention=attention, positions=positions, steps=steps, best_lr=lr, n_seeds=len(losses),
                        mean=round(sum(losses) / len(losses), 4), min=min(losses), max=max(losses)))
    short = {b["positions"]: b["best_lr"] for b in out if b["steps"] == STEPS}
    return {"best": out, "long_lr_is_best": {p: LONG_LRS[p] == short.get(p) for p in SCHEMES}}
