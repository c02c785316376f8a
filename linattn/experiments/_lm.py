"""Training and evaluating the small character-level language models of the book's studies (private)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..models import TransformerLM
from ..data import CharCorpus, tiny_shakespeare

_CORPUS: Optional[CharCorpus] = None


def corpus() -> CharCorpus:
    """Tiny Shakespeare, loaded once per process."""
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = tiny_shakespeare()
    return _CORPUS


def build(model_kwargs: dict, seed: int) -> TransformerLM:
    """A TransformerLM for the corpus, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return TransformerLM(corpus().vocab_size, **model_kwargs)


def adamw_cosine(model: TransformerLM, *, lr: float, steps: int, warmup: int):
    """The studies' optimiser: AdamW (betas 0.9, 0.99, weight decay 0.1), linear warm-up, cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return opt, schedule


def train_steps(model: TransformerLM, batch: Callable[[int], tuple], loss: Callable, *, steps: int, lr: float,
                warmup: int = 20, log_every: int = 50) -> list[float]:
    """The studies' training loop, in place: ``batch(step) -> (x, y)``, ``loss(model, x, y)``; AdamW with
    warm-up and cosine decay, gradients clipped at 1. Returns the mean loss of every ``log_every`` steps."""
    opt, schedule = adamw_cosine(model, lr=lr, steps=steps, warmup=warmup)
    curve, window = [], []
    model.train()
    for step in range(steps):
        x, y = batch(step)
        value = loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        window.append(value.item())
        if len(window) == log_every:
            curve.append(sum(window) / len(window))
            window = []
    model.eval()
    return curve


def train(model: TransformerLM, *, steps: int, lr: float, seed: int, batch_size: int = 32,
          block_size: int = 128, warmup: int = 20, log_every: int = 50) -> list[float]:
    """Train on tiny Shakespeare in place; returns the mean training loss of every ``log_every`` steps (nats)."""
    data = corpus()
    batches = torch.Generator().manual_seed(seed)
    return train_steps(model, lambda step: data.get_batch("train", batch_size, block_size, generator=batches),
                       lambda m, x, y: m.loss(x, y), steps=steps, lr=lr, warmup=warmup, log_every=log_every)


@torch.no_grad()
def evaluate(model: TransformerLM, block_size: int = 128, batch_size: int = 64) -> dict:
    """Validation loss (nats per character) overall and at each position of the window."""
    x, y = corpus().blocks("val", block_size)                       # (n_windows, T)
    total = torch.zeros(block_size, dtype=torch.float64)
    for i in range(0, len(x), batch_size):
        logits = model(x[i:i + batch_size])                          # (b, T, V)
        total += F.cross_entropy(logits.transpose(1, 2).float(), y[i:i + batch_size],
                                 reduction="none").double().sum(0)
    per_position = total / len(x)
    return {"val_loss": float(per_position.mean()), "per_position": [round(float(v), 5) for v in per_position],
            "n_windows": len(x)}


def run(model_kwargs: dict, *, steps: int, lr: float, seed: int, batch_size: int = 32, block_size: int = 128) -> dict:
    """Build, train and evaluate one model: the result of one study cell."""
    model = build(model_kwargs, seed)
    curve = train(model, steps=steps, lr=lr, seed=seed, batch_size=batch_size, block_size=block_size)
    result = evaluate(model, block_size=block_size)
    result["val_loss"] = round(result["val_loss"], 5)
    result["train_curve"] = [round(v, 4) for v in curve]
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["diverged"] = not math.isfinite(result["val_loss"])
    return result
