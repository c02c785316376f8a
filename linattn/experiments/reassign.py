"""Recall of the latest value when keys are reassigned (chapter 9): which update rules can overwrite."""
from __future__ import annotations

from . import mqar, recall

NAME = "reassign"
DESCRIPTION = "recall the latest value of reassigned keys: softmax (with and without RoPE) and the update rules"

VOCAB = mqar.VOCAB
SIZES = [8, 16, 32, 64]
STEPS, CHECKPOINTS = mqar.STEPS, mqar.CHECKPOINTS
LRS, SEEDS = mqar.LRS, mqar.SEEDS

MODELS = {
    "softmax": dict(mixer="softmax"),
    "softmax + RoPE": dict(mixer="softmax_rope"),
    "linear": dict(mixer="retention", gamma=1.0),
    "retention": dict(mixer="retention"),
    "GLA": dict(mixer="gla"),
    "delta rule": dict(mixer="delta"),
}


def cell(name: str, lr: float, seed: int, steps: int = STEPS, checkpoints=CHECKPOINTS) -> dict:
    return dict(name=name, **MODELS[name], key_dim=16, vocab_size=VOCAB, task="reassign", train_sizes=SIZES,
                test_sizes=SIZES, steps=steps, checkpoints=list(checkpoints), lr=lr, batch=64, seed=seed)


def grid() -> list[dict]:
    return [cell(name, lr, seed) for seed in SEEDS for name in MODELS for lr in LRS]


def run_cell(c: dict) -> dict:
    return mqar.run_cell(c)


def summarise(rows: list[dict]) -> dict:
    return {"sizes": SIZES, "best": mqar.best(rows)}
