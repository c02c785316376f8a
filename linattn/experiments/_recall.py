"""Training and evaluating the small recall models of the studies (private)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import TransformerLM
from ..data import multi_query_associative_recall, recall_accuracy
from ._lm import train_steps

TRAIN_PAIRS = (4, 8, 16)
EVAL_PAIRS = (4, 8, 16, 32)
KEYS = 64
VOCAB = 1 + 2 * KEYS                          # padding, 64 keys, 64 values
BATCH_SIZE = 64
EVAL_EXAMPLES = 256


def build(model_kwargs: dict, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, **model_kwargs)


def train(model: TransformerLM, *, steps: int, lr: float, seed: int, batch_size: int = BATCH_SIZE,
          warmup: int = 20) -> list:
    """AdamW with warm-up and cosine decay; the number of pairs cycles through TRAIN_PAIRS."""
    g = torch.Generator().manual_seed(seed)

    def batch(step: int):
        return multi_query_associative_recall(batch_size, TRAIN_PAIRS[step % len(TRAIN_PAIRS)], vocab_size=VOCAB,
                                              generator=g)

    def loss(m, x, y):
        return F.cross_entropy(m(x).transpose(1, 2).float(), y)          # unscored positions are -100

    curve = train_steps(model, batch, loss, steps=steps, lr=lr, warmup=warmup)
    return [round(v, 4) for v in curve]


@torch.no_grad()
def evaluate(model: TransformerLM, seed: int = 12345) -> dict:
    """Accuracy (%) on fresh sequences for each number of pairs in EVAL_PAIRS."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for N in EVAL_PAIRS:
        x, y = multi_query_associative_recall(EVAL_EXAMPLES, N, vocab_size=VOCAB, generator=g)
        out[str(N)] = round(100 * recall_accuracy(model(x).float(), y), 2)
    return out


def run(model_kwargs: dict, *, steps: int, lr: float, seed: int) -> dict:
    model = build(model_kwargs, seed)
    curve = train(model, steps=steps, lr=lr, seed=seed)
    acc = evaluate(model)
    T = 3 * max(EVAL_PAIRS)
    return {"accuracy": acc, "train_curve": curve, "parameters": sum(p.numel() for p in model.parameters()),
            "state_bytes": model.decoding_state_nbytes(T), "state_bytes_at_tokens": T}
