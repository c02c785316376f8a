"""Recall capacity on MQAR: feature maps and update rules at several state sizes (chapters 7 and 9).

The task is a *simplified* multi-query associative recall (Arora et al., 2023, Zoology): the
head's key at position ``t`` is computed from token ``t − 1``, hard-wired (see
:mod:`linattn.experiments.recall`). The vocabulary has 256 keys and 256 values, four times the
largest number of pairs ``N = 64``, so that ``N > M`` can be tested for every feature map. Each
model is a one-head :class:`~linattn.experiments.recall.RecallModel` with values of
``Dv = 16``; the key size ``D`` and the feature map set ``M`` and so the state,
``M·(Dv + 1)`` numbers (normalised linear attention) or ``M·Dv`` (the unnormalised update
rules). Training: 2000 Adam steps on batches of 64 fresh sequences cycling through
``N = 4, 8, 16, 32, 64`` (constant learning rate after 100 warm-up steps; accuracy is also
recorded after 500 and 1000 steps), then 256 test sequences per ``N``. Every model at three
learning rates for seed 0; the models at ``D = 16`` (and the smaller Taylor and DPFP maps)
also for seeds 1 and 2 at all three, so their points carry error bars. Chapter 7's feature-map
heads whose best rate was an edge of that grid get one more rate beyond it (:data:`EXTRA_LRS`:
``3e-2`` above ``1e-2``, ``3e-4`` below ``1e-3`` for cosFormer), for the same seeds; these cells
come after the others in the grid, so the earlier cells keep their indices.

The grid was extended after its first run: :data:`REUSE_FROM` names this study's own results
file, so a rerun copies every cell already in ``chapters/results/mqar.json`` (each row marked
``reused_from`` with the commit it was computed at) and trains only the new ones. Delete the file
first to retrain every cell.
"""
from __future__ import annotations

from . import recall

NAME = "mqar"
DESCRIPTION = "recall capacity: feature maps and update rules against state size (simplified MQAR)"

VOCAB = 513                   # padding, 256 keys, 256 values
SIZES = [4, 8, 16, 32, 64]
STEPS, CHECKPOINTS = 2000, (500, 1000)
LRS = (1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)

# name -> model options; "family" groups the points of one curve in the chapter's figure.
MODELS = {
    "softmax": dict(family="softmax", mixer="softmax", key_dim=16),
    "elu+1 D=8": dict(family="elu+1", mixer="linear", feature_map="elu+1", key_dim=8),
    "elu+1 D=16": dict(family="elu+1", mixer="linear", feature_map="elu+1", key_dim=16),
    "elu+1 D=32": dict(family="elu+1", mixer="linear", feature_map="elu+1", key_dim=32),
    "DPFP ν=1 D=8": dict(family="DPFP", mixer="linear", feature_map="dpfp1", key_dim=8),
    "DPFP ν=2 D=8": dict(family="DPFP", mixer="linear", feature_map="dpfp2", key_dim=8),
    "Taylor D=4": dict(family="Taylor", mixer="linear", feature_map="taylor", key_dim=4),
    "Taylor D=8": dict(family="Taylor", mixer="linear", feature_map="taylor", key_dim=8),
    "Performer M=32": dict(family="Performer", mixer="linear", feature_map="performer32", key_dim=16),
    "Hedgehog D=16": dict(family="Hedgehog", mixer="linear", feature_map="hedgehog", key_dim=16),
    "cosFormer D=16": dict(family="cosFormer", mixer="linear", feature_map="cosformer", key_dim=16),
    "linear D=8": dict(family="linear", mixer="retention", gamma=1.0, key_dim=8),
    "linear D=16": dict(family="linear", mixer="retention", gamma=1.0, key_dim=16),
    "linear D=32": dict(family="linear", mixer="retention", gamma=1.0, key_dim=32),
    "retention D=16": dict(family="retention", mixer="retention", key_dim=16),
    "GLA D=16": dict(family="GLA", mixer="gla", key_dim=16),
    "delta D=8": dict(family="delta", mixer="delta", key_dim=8),
    "delta D=16": dict(family="delta", mixer="delta", key_dim=16),
    "delta D=32": dict(family="delta", mixer="delta", key_dim=32),
    "identity + norm D=16": dict(family="ablation", mixer="linear", feature_map=None, normalize=False,
                                 output_norm=True, key_dim=16),
    "elu+1 + norm D=16": dict(family="ablation", mixer="linear", feature_map="elu+1", normalize=False,
                              output_norm=True, key_dim=16),
}
SEEDED = [name for name, m in MODELS.items() if m["key_dim"] == 16 or name in ("Taylor D=8", "DPFP ν=2 D=8")]
# Chapter 7's heads whose best rate in LRS was the grid's edge, and the rate added beyond it.
EXTRA_LRS = {**{name: (3e-2,) for name in ("elu+1 D=8", "elu+1 D=16", "elu+1 D=32", "DPFP ν=1 D=8",
                                            "DPFP ν=2 D=8", "Taylor D=4", "Taylor D=8", "Hedgehog D=16")},
             "cosFormer D=16": (3e-4,)}
REUSE_FROM = "mqar"           # the cells already run are copied from the results file, not retrained


def cell(name: str, lr: float, seed: int, steps: int = STEPS, checkpoints=CHECKPOINTS) -> dict:
    """The grid cell of model ``name`` (a key of :data:`MODELS`)."""
    options = {k: v for k, v in MODELS[name].items() if k != "family"}
    return dict(name=name, **options, vocab_size=VOCAB, task="mqar", train_sizes=SIZES, test_sizes=SIZES,
                steps=steps, checkpoints=list(checkpoints), lr=lr, batch=64, seed=seed)


def grid() -> list[dict]:
    cells = [cell(name, lr, 0) for name in MODELS for lr in LRS]
    cells += [cell(name, lr, seed) for seed in SEEDS[1:] for name in SEEDED for lr in LRS]
    cells += [cell(name, lr, seed) for seed in SEEDS for name, lrs in EXTRA_LRS.items() for lr in lrs
              if seed == 0 or name in SEEDED]
    return cells


def run_cell(c: dict) -> dict:
    c = dict(c)
    checkpoints = tuple(c.pop("checkpoints", ()))
    c.pop("name", None)
    return recall.train_and_evaluate(c, checkpoints=checkpoints)


def best(rows: list[dict]) -> dict:
    """Per model: the learning rate with the best mean accuracy (over test sizes, then seeds), and its runs."""
    by_model: dict = {}
    for row in rows:
        c = row["cell"]
        by_model.setdefault(c["name"], {}).setdefault(c["lr"], []).append(row["result"])
    out = {}
    for name, by_lr in by_model.items():
        def score(results):
            return sum(sum(r["accuracy"]) / len(r["accuracy"]) for r in results) / len(results)
        lr, results = max(by_lr.items(), key=lambda kv: score(kv[1]))
        accs = list(zip(*[r["accuracy"] for r in results]))                     # per test size, over seeds
        out[name] = dict(best_lr=lr, n_seeds=len(results), state_floats=results[0]["state_floats"],
                         mean=[round(sum(a) / len(a), 4) for a in accs], min=[min(a) for a in accs],
                         max=[max(a) for a in accs],
                         by_lr={str(k): round(score(v), 4) for k, v in sorted(by_lr.items())})
    return out


def summarise(rows: list[dict]) -> dict:
    return {"sizes": SIZES, "best": best(rows)}
