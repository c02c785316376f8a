"""One-layer recall models, their training loop and evaluation: what the recall studies share."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import feature_maps as fm
from ..attention import linear_attention, softmax_attention
from ..ops.delta import delta_rule
from ..ops.gla import gated_linear_attention
from ..ops.retention import retention
from ..layers.positions import apply_rope
from ..data import IGNORE_INDEX, multi_query_associative_recall, recall_accuracy, recall_vocab

__all__ = ["MIXERS", "RecallModel", "make_feature_map", "state_floats", "train_and_evaluate",
           "reassigned_key_recall", "TAU"]

MIXERS = ("softmax", "softmax_rope", "linear", "retention", "gla", "delta")
WARMUP = 100                  # steps of linear learning-rate warm-up, whatever the budget
TAU = 16.0                    # GLA's gate temperature: log g = logsigmoid(·) / 16 (Yang et al., 2024)


def make_feature_map(name: Optional[str], key_dim: int, seed: int = 0):
    """The feature map ``name`` for keys of size ``key_dim`` (None: q, k used as they are)."""
    if name is None or name == "identity":
        return None
    if name == "elu+1":
        return fm.elu_plus_one
    if name.startswith("dpfp"):                       # "dpfp1", "dpfp2", "dpfp4": ν
        return fm.DPFPFeatures(nu=int(name[4:]))
    if name == "taylor":
        return fm.TaylorFeatures()
    if name.startswith("performer"):                  # "performer64": M random features
        return fm.PerformerFeatures(key_dim, int(name[9:]), seed=seed)
    if name == "hedgehog":                            # M = 2 key_dim
        return fm.HedgehogFeatures(key_dim)
    if name == "cosformer":
        return fm.CosFormerFeatures(max_len=1024)             # the longest sequence of chapter 7
    raise ValueError(f"unknown feature map {name!r}")


def feature_count(name: Optional[str], key_dim: int) -> int:
    """``M``, the number of features the map gives a key of size ``key_dim``."""
    phi = make_feature_map(name, key_dim)
    if phi is None:
        return key_dim
    return phi(torch.zeros(1, 1, 1, key_dim)).shape[-1]


def state_floats(mixer: str, key_dim: int, value_dim: int, feature_map: Optional[str] = None,
                 normalize: bool = True, seq_len: int = 0) -> int:
    """Numbers the head keeps to decode the next token: ``M·(Dv+1)`` (normalised linear
    attention: ``S`` and ``z``), ``M·Dv`` (unnormalised rules), ``2·T·D``-ish for softmax's
    KV cache (``seq_len·(key_dim + value_dim)``, growing with the sequence)."""
    if mixer.startswith("softmax"):
        return seq_len * (key_dim + value_dim)
    M = feature_count(feature_map, key_dim)
    return M * (value_dim + 1) if (mixer == "linear" and normalize) else M * value_dim


class RecallModel(nn.Module):
    """Embedding → one attention head whose keys read the previous token → logits.

    Parameters
    ----------
    mixer : str
        One of :data:`MIXERS`.
    vocab_size : int
        Tokens (padding, keys, values).
    key_dim, value_dim : int
        ``D`` (queries and keys) and ``Dv`` (values) of the head.
    d_model : int
        Embedding size.
    feature_map : str, optional
        For ``mixer="linear"``: see :func:`make_feature_map`.
    normalize : bool
        For ``mixer="linear"``: divide by ``φ(q)ᵀz`` (True) or not.
    output_norm : bool
        A per-head RMS norm (no weight) on the head's output, before the read-out.
    gamma : float
        Retention's decay.
    seed : int
        Seed of a random feature map's draw (Performer).
    """

    def __init__(self, mixer: str, vocab_size: int, *, key_dim: int = 16, value_dim: int = 16, d_model: int = 64,
                 feature_map: Optional[str] = None, normalize: bool = True, output_norm: bool = False,
                 gamma: float = 1 - 2 ** -5, seed: int = 0) -> None:
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
        if mixer != "linear" and feature_map not in (None, "identity"):
            raise ValueError(f"feature_map is for mixer='linear' only, got {feature_map!r} with {mixer!r}")
        self.mixer, self.normalize, self.output_norm, self.gamma = mixer, normalize, output_norm, gamma
        self.embed = nn.Embedding(vocab_size, d_model)
        self.W_q, self.W_k = (nn.Linear(d_model, key_dim, bias=False) for _ in range(2))
        self.W_v = nn.Linear(d_model, value_dim, bias=False)
        self.readout = nn.Linear(value_dim, vocab_size)
        self.phi = make_feature_map(feature_map, key_dim, seed=seed) if mixer == "linear" else None
        if mixer == "gla":
            self.W_g = nn.Linear(d_model, key_dim)                    # a gate per key channel
        if mixer == "delta":
            self.W_beta = nn.Linear(d_model, 1)                       # writing strength β_t

    def qkv(self, tokens: torch.Tensor):
        """``q`` from token ``t``, ``k`` from token ``t − 1``, ``v`` from token ``t``: each (B, 1, T, ·)."""
        x = self.embed(tokens)                                        # (B, T, d_model)
        x_prev = F.pad(x[:, :-1], (0, 0, 1, 0))                       # position t sees token t − 1
        return self.W_q(x)[:, None], self.W_k(x_prev)[:, None], self.W_v(x)[:, None], x_prev

    def log_gates(self, x_prev: torch.Tensor) -> torch.Tensor:
        """GLA's log-gates ``(B, 1, T, D)``, ``<= 0``."""
        return F.logsigmoid(self.W_g(x_prev))[:, None] / TAU

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` tokens → ``(B, T, vocab_size)`` logits."""
        return self.readout(self.head_output(tokens))

    def head_output(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` tokens → ``(B, T, Dv)``: what the head returns (after the output norm, if any)."""
        q, k, v, x_prev = self.qkv(tokens)
        if self.mixer in ("softmax", "softmax_rope"):
            if self.mixer == "softmax_rope":
                pos = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
                q, k = apply_rope(q, pos), apply_rope(k, (pos - 1).clamp_min(0))   # k belongs to t − 1
            out = softmax_attention(q, k, v, causal=True)
        elif self.mixer == "linear":
            out = linear_attention(q, k, v, feature_map=self.phi, causal=True, normalize=self.normalize)
        elif self.mixer == "retention":
            out = retention(q, k, v, self.gamma)
        elif self.mixer == "gla":
            out = gated_linear_attention(q, k, v, self.log_gates(x_prev))
        else:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)     # as in Yang et al., 2024
            beta = torch.sigmoid(self.W_beta(x_prev))[:, None, :, 0]  # (B, 1, T) in (0, 1)
            out = delta_rule(q, k, v, beta)
        if self.output_norm:
            out = F.rms_norm(out, out.shape[-1:], eps=1e-5)
        return out[:, 0]                                              # (B, T, Dv)


def reassigned_key_recall(n: int, num_writes: int, *, num_keys: int = 8, vocab_size: int = 129,
                          generator: Optional[torch.Generator] = None):
    """Writes ``k v`` with only ``num_keys`` distinct keys, then each key asked: the answer is its latest value."""
    keys_range, values_range = recall_vocab(vocab_size)
    if num_writes < num_keys:
        raise ValueError(f"num_writes must be >= num_keys={num_keys}, got {num_writes}")
    pool = torch.rand(n, len(keys_range), generator=generator).argsort(-1)[:, :num_keys] + keys_range.start
    first = torch.rand(n, num_keys, generator=generator).argsort(-1)                     # every key once
    which = torch.cat([first, torch.randint(0, num_keys, (n, num_writes - num_keys), generator=generator)], 1)
    values = torch.randint(values_range.start, values_range.stop, (n, num_writes), generator=generator)
    latest = torch.zeros(n, num_keys, dtype=torch.long)
    for w in range(num_writes):                                                          # later writes win
        latest.scatter_(1, which[:, w:w + 1], values[:, w:w + 1])
    asked = torch.rand(n, num_keys, generator=generator).argsort(-1)
    writes = torch.stack([pool.gather(1, which), values], -1).reshape(n, 2 * num_writes)
    x = torch.cat([writes, pool.gather(1, asked)], 1)
    y = torch.cat([torch.full((n, 2 * num_writes), IGNORE_INDEX), latest.gather(1, asked)], 1)
    return x, y


def _task(name: str, vocab_size: int):
    if name == "mqar":
        return lambda n, size, g: multi_query_associative_recall(n, size, vocab_size=vocab_size, generator=g)
    if name == "reassign":
        return lambda n, size, g: reassigned_key_recall(n, size, vocab_size=vocab_size, generator=g)
    raise ValueError(f"unknown task {name!r}")


def build_model(cell: dict) -> RecallModel:
    """The model of a grid cell, initialised from ``cell['seed']``."""
    torch.manual_seed(cell["seed"])
    return RecallModel(cell["mixer"], cell["vocab_size"], key_dim=cell.get("key_dim", 16),
                       value_dim=cell.get("value_dim", 16), d_model=cell.get("d_model", 64),
                       feature_map=cell.get("feature_map"), normalize=cell.get("normalize", True),
                       output_norm=cell.get("output_norm", False), gamma=cell.get("gamma", 1 - 2 ** -5),
                       seed=cell["seed"])


def train_model(cell: dict, *, checkpoints=()):
    """Train the model of ``cell``; returns ``(model, losses, snapshots)``."""
    model = build_model(cell)
    make = _task(cell["task"], cell["vocab_size"])
    steps, sizes = cell["steps"], cell["train_sizes"]
    opt = torch.optim.Adam(model.parameters(), lr=cell["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    g = torch.Generator().manual_seed(cell["seed"])
    losses, snapshots = [], {}
    for step in range(steps):
        x, y = make(cell["batch"], sizes[step % len(sizes)], g)
        scored = y != IGNORE_INDEX                                    # read out the queries only
        loss = F.cross_entropy(model.readout(model.head_output(x)[scored]), y[scored])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step + 1 in checkpoints:
            snapshots[step + 1] = evaluate(model, cell)
    return model, losses, snapshots


@torch.no_grad()
def evaluate(model: RecallModel, cell: dict) -> list[float]:
    """Accuracy on ``cell['eval_examples']`` (default 256) fresh sequences per test size (seed 1)."""
    make = _task(cell["task"], cell["vocab_size"])
    g = torch.Generator().manual_seed(10_000 + 1)
    n = cell.get("eval_examples", 256)
    model.eval()
    accs = []
    for size in cell["test_sizes"]:
        x, y = make(n, size, g)
        scored = y != IGNORE_INDEX
        pred = model.readout(model.head_output(x)[scored]).argmax(-1)
        accs.append((pred == y[scored]).double().mean().item())
    model.train()
    return accs


def train_and_evaluate(cell: dict, checkpoints=()) -> dict:
    """Train and evaluate one grid cell; a JSON-serialisable result."""
    model, losses, snapshots = train_model(cell, checkpoints=checkpoints)
    tail = losses[-max(1, len(losses) // 20):]
    finite = all(math.isfinite(x) for x in losses)
    acc = evaluate(model, cell) if finite else [0.0] * len(cell["test_sizes"])
    T_max = _seq_len(cell, max(cell["test_sizes"]))
    out = {"accuracy": [round(a, 4) for a in acc],
           "final_loss": round(sum(tail) / len(tail), 4) if finite else None,
           "diverged": not finite,
           "state_floats": state_floats(cell["mixer"], cell.get("key_dim", 16), cell.get("value_dim", 16),
                                        cell.get("feature_map"), cell.get("normalize", True), T_max)}
    if checkpoints:
        out["at_step"] = {str(s): [round(a, 4) for a in accs] for s, accs in snapshots.items()}
    if cell["mixer"] == "gla" and finite:
        out["gate"] = gate_summary(model, cell)
    return out


def _seq_len(cell: dict, size: int) -> int:
    return 3 * size if cell["task"] == "mqar" else 2 * size + 8


@torch.no_grad()
def gate_summary(model: RecallModel, cell: dict) -> dict:
    """GLA's gates on test sequences of the largest size: quantiles of ``g`` and the half-life they imply."""
    make = _task(cell["task"], cell["vocab_size"])
    x, _ = make(64, max(cell["test_sizes"]), torch.Generator().manual_seed(10_002))
    _, _, _, x_prev = model.qkv(x)
    gates = model.log_gates(x_prev).exp().flatten().double()
    qs = torch.quantile(gates, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    mean_log = model.log_gates(x_prev).double().mean().item()
    return {"q10": round(qs[0], 4), "median": round(qs[1], 4), "q90": round(qs[2], 4),
            "mean_half_life": round(math.log(0.5) / mean_log, 1) if mean_log < 0 else None}
