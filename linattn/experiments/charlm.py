"""Chapter 8's language models at tuned learning rates, three seeds and several budgets."""
from __future__ import annotations

from . import _lm

NAME = "charlm"
DESCRIPTION = "chapter 8's linear and softmax character models: lr sweep, 3 seeds, budgets 100-400 and 2000 steps"

MODEL = dict(d_model=64, n_layers=2, n_heads=4, positions="learned", max_len=128)
LRS = (3e-3, 1e-2, 3e-2)
SEEDS = (0, 1, 2)
BUDGETS = (100, 200, 300, 400)
LONG_STEPS, LONG_LRS = 2000, (3e-3, 1e-2)
HIGH_LONG_LRS = (2e-2, 3e-2)  # added: 1e-2 was the best of LONG_LRS for both models
REUSE_FROM = "charlm"         # the cells already run are copied from the results file, not retrained


def grid() -> list[dict]:
    cells = [dict(attention=a, lr=lr, seed=s, steps=n)
             for s in SEEDS for n in BUDGETS for a in ("linear", "softmax") for lr in LRS]
    cells += [dict(attention=a, lr=lr, seed=s, steps=LONG_STEPS)
              for s in SEEDS for a in ("linear", "softmax") for lr in LONG_LRS]
    cells += [dict(attention=a, lr=lr, seed=s, steps=LONG_STEPS)
              for s in SEEDS for a in ("linear", "softmax") for lr in HIGH_LONG_LRS]
    return cells


def run_cell(cell: dict) -> dict:
    return _lm.run(dict(MODEL, attention=cell["attention"]), steps=cell["steps"], lr=cell["lr"], seed=cell["seed"])


def summarise(rows: list[dict]) -> dict:
    """Per (attention, steps): the learning rate with the best mean validation loss over seeds, and its spread."""
    table: dict = {}
    for row in rows:
        c = row["cell"]
        table.setdefault((c["attention"], c["steps"]), {}).setdefault(c["lr"], []).append(row["result"]["val_loss"])
    out = []
    for (attention, steps), by_lr in sorted(table.items()):
        lr, losses = min(by_lr.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
        out.append(dict(attention=attention, steps=steps, best_lr=lr, n_seeds=len(losses),
                        mean=round(sum(losses) / len(losses), 4), min=min(losses), max=max(losses),
                        by_lr={str(k): round(sum(v) / len(v), 4) for k, v in sorted(by_lr.items())}))
    return {"best": out}
