"""Chapter 8's language model, four layers deep, with the mixers of today's models."""
from __future__ import annotations

from . import _lm, load_results

NAME = "modern_lm"
DESCRIPTION = "4-layer char LMs: linear, softmax (RoPE), gated delta, 3:1 hybrid; best lr, 3 seeds, 5x budget"

BASE = dict(d_model=64, n_layers=4, n_heads=4, chunk_size=32)
MODELS = {
    "linear": dict(attention="linear", positions="rope"),
    "softmax (RoPE)": dict(attention="softmax", positions="rope"),
    "gated delta": dict(attention="gated_delta", positions="none"),
    "hybrid 3:1": dict(attention=["gated_delta"] * 3 + ["softmax"], positions="rope"),
}
LRS = (3e-3, 1e-2, 3e-2)
STEPS = 500
SEEDS = (0, 1, 2)
REUSE_FROM = "modern_lm_sweep"     # its seed-0 cell at the best rate is a sweep cell
CHECK_STEPS = 40


def sweep_grid() -> list[dict]:
    return [dict(model=m, lr=lr, seed=0, steps=STEPS) for m in MODELS for lr in LRS]


def best_lrs(sweep: dict) -> dict:
    """Per model, the learning rate with the lowest validation loss in the sweep."""
    best = {}
    for row in sweep["rows"]:
        c, loss = row["cell"], row["result"]["val_loss"]
        if c["model"] not in best or loss < best[c["model"]][1]:
            best[c["model"]] = (c["lr"], loss)
    return {m: lr for m, (lr, _) in best.items()}


def grid() -> list[dict]:
    lrs = best_lrs(load_results("modern_lm_sweep"))
    cells = [dict(model=m, lr=lrs[m], seed=s, steps=STEPS) for m in MODELS for s in SEEDS]
    cells += [dict(model=m, lr=lrs[m], seed=0, steps=5 * STEPS) for m in ("softmax (RoPE)", "gated delta")]
    cells.append(dict(model="gated delta", lr=lrs["gated delta"], seed=0, steps=CHECK_STEPS))
    return cells


def run_cell(cell: dict) -> dict:
    return _lm.run(dict(BASE, **MODELS[cell["model"]]), steps=cell["steps"], lr=cell["lr"], seed=cell["seed"])
