"""Recall capacity on MQAR: feature maps and update rules at several state sizes (chapters 7 and 9)."""
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


# Chapter 9's delta-rule heads, whose best rate in LRS was 1e-2, the grid's top edge: one rate above it.
EXTRA_LRS.update({name: (3e-2,) for name in ("delta D=8", "delta D=16", "delta D=32")})


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
