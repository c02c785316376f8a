"""Layers and language models across ranks: LinearMixer, softmax layers (ring attention) and TransformerLM."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict
from typing import Optional

import torch
from torch import Tensor

from .. import _checks
from ..layers import LinearMixer, SoftmaxAttention
from ..models import TransformerLM
from .agreement import _check_state_exchange, _handshake
from .comm import _all_gather, _ranks, _Ranks
from .decay_rules import sequence_parallel_gated_linear_attention, sequence_parallel_retention
from .delta_rules import sequence_parallel_delta_rule, sequence_parallel_gated_delta_rule
from .ring import ring_softmax_attention

__all__ = ['sequence_parallel_mixer', 'sequence_parallel_lm']

_TWINS = {"retention": sequence_parallel_retention, "gated_linear_attention": sequence_parallel_gated_linear_attention,
          "delta_rule": sequence_parallel_delta_rule, "gated_delta_rule": sequence_parallel_gated_delta_rule}
_LAYOUT = ("failed", "model", "batch", "seq")       # the handshake of a layer or model call


def _history_sources(lengths: list[int], rank: int, width: int) -> list[Optional[tuple[int, int]]]:
    """For each of the ``width`` tokens before rank ``rank``'s first: ``(rank s, row in s's last width tokens)``,
    or None before the sequence's start."""
    start = sum(lengths[:rank])
    sources = []
    for position in range(start - width, start):
        if position < 0:
            sources.append(None)
            continue
        s = next(s for s in range(rank) if position < sum(lengths[:s + 1]))
        sources.append((s, position - (sum(lengths[:s + 1]) - width)))
    return sources


class _ConvHistory(torch.autograd.Function):
    """Forward: the ``width`` convolution inputs before this rank's slice, from the earlier ranks' last rows (one
    all-gather; a slice shorter than ``width`` draws on several ranks). Backward: the same, gradients going home."""

    @staticmethod
    def forward(ctx, tail: Tensor, ranks: _Ranks, lengths: list[int]) -> Tensor:
        width = tail.shape[1]                                                # tail: (B, width, C)
        tails = _all_gather(tail, ranks, "conv")
        rows = [tail.new_zeros(tail.shape[0], tail.shape[2]) if src is None else tails[src[0]][:, src[1]]
                for src in _history_sources(lengths, ranks.rank, width)]
        ctx.ranks, ctx.lengths = ranks, lengths
        return torch.stack(rows, dim=2)                                      # (B, C, width)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ranks, lengths = ctx.ranks, ctx.lengths
        grads = _all_gather(grad.contiguous(), ranks, "conv_grad")          # every rank's (B, C, width)
        width = grad.shape[2]
        mine = grad.new_zeros(grad.shape[0], width, grad.shape[1])          # (B, width, C)
        for later in range(ranks.rank + 1, ranks.world):
            for j, src in enumerate(_history_sources(lengths, later, width)):
                if src is not None and src[0] == ranks.rank:
                    mine[:, src[1]] += grads[later][:, :, j]
        return mine, None, None


def _padded_tail(u: Tensor, width: int) -> Tensor:
    """The last ``width`` rows of ``u`` ``(B, T, C)``, zero rows in front when ``T < width``."""
    tail = u[:, -width:]
    return torch.cat([tail.new_zeros(u.shape[0], width - tail.shape[1], u.shape[2]), tail], dim=1)


def _agree(ranks: _Ranks, what: str, batch: int, seq: int, caller: str, error=None) -> list[int]:
    """The handshake of a layer or model call: the same module (by its configuration) and batch; the lengths."""
    fields = None if error else {"model": int.from_bytes(hashlib.blake2b(what.encode(), digest_size=8).digest(),
                                                           "little", signed=True), "batch": batch, "seq": seq}
    table = _handshake(ranks, fields, error, caller, ("model", "batch"), names=_LAYOUT)
    return [row[_LAYOUT.index("seq")] for row in table]


def _mixer_call(mixer: LinearMixer, x: Tensor, ranks: _Ranks, lengths: list[int], exchange: str,
                return_state: bool):
    history = None
    if mixer.conv is not None:
        width = mixer.conv_size - 1
        history = _ConvHistory.apply(_padded_tail(mixer.conv_inputs(x[:, -width:]), width), ranks, lengths)
    ops = {name: functools.partial(fn, group=ranks.group, state_exchange=exchange) for name, fn in _TWINS.items()}
    return mixer(x, conv_history=history, rule_ops=ops, return_state=return_state)


def sequence_parallel_mixer(mixer: LinearMixer, x: Tensor, *, group=None, state_exchange: str = "auto",
                            return_state: bool = False):
    """A :class:`linattn.LinearMixer` over a sequence split across the ranks of a process group.

    Each rank holds the same layer (the same parameters) and a contiguous slice of the
    sequence. The short convolution reads the last ``conv_size − 1`` inputs of the earlier
    slices (one all-gather of ``B·(conv_size − 1)·C`` numbers per rank), and the rule runs
    through its sequence-parallel twin (:func:`sequence_parallel_gated_delta_rule`, ...).

    Parameters
    ----------
    mixer : LinearMixer
        The layer (its configuration must be the same on every rank).
    x : Tensor
        ``(B, T_r, d_model)``, this rank's slice (no padding: the call takes no mask).
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the sequence, in sequence order; the default group if None.
    state_exchange : str
        As in :func:`sequence_parallel_retention`.
    return_state : bool
        Also return the :class:`linattn.MixerState` after this rank's last token (on the last
        rank, the state after the whole sequence, from which one process can decode on).

    Returns
    -------
    y : Tensor
        ``(B, T_r, d_model)``: this rank's slice of the layer's output on the whole sequence.
    state : MixerState
        Only if ``return_state``.

    Raises
    ------
    TypeError
        ``mixer`` not a LinearMixer; as :meth:`linattn.LinearMixer.forward`.
    ValueError
        Ranks whose layers are configured differently or whose batches differ (on every
        rank); as :meth:`linattn.LinearMixer.forward` and the rules' twins.
    """
    caller = "sequence_parallel_mixer"
    ranks = _ranks(group, caller)
    error = None
    try:
        if not isinstance(mixer, LinearMixer):
            raise TypeError(f"mixer must be a linattn.LinearMixer, got {_checks.type_name(mixer)}")
        exchange = _check_state_exchange(state_exchange, ranks)
        _checks.check_tensor(x, "x", 3, "(batch, seq, d_model)")
    except (TypeError, ValueError) as err:
        error = err
    lengths = _agree(ranks, repr(mixer), *(x.shape[:2] if error is None else (0, 0)), caller, error)
    return _mixer_call(mixer, x, ranks, lengths, exchange, return_state)


def sequence_parallel_lm(model: TransformerLM, idx: Tensor, *, group=None, state_exchange: str = "auto") -> Tensor:
    """A :class:`linattn.TransformerLM` over a sequence split across the ranks of a process group.

    Rank ``r`` holds the tokens ``idx`` at positions ``Σ_{s<r} T_s, ...`` (learned and rotary
    positions count from there). :class:`linattn.LinearMixer` layers run as
    :func:`sequence_parallel_mixer`; softmax layers through :func:`ring_softmax_attention`;
    embeddings, norms, MLPs and the head are per token. The gradients of a loss on every
    rank's logits flow to every rank's parameters: each rank holds its partial gradient
    (all-reduce them, as data parallelism does, for one process's).

    Parameters
    ----------
    model : TransformerLM
        The model (the same configuration on every rank), with causal mixers.
    idx : Tensor
        ``(B, T_r)`` int64 token ids of this rank's slice (no padding).
    group, state_exchange
        As in :func:`sequence_parallel_mixer`.

    Returns
    -------
    Tensor
        ``(B, T_r, vocab_size)`` logits: this rank's slice of one process's.

    Raises
    ------
    TypeError, ValueError
        ``model`` not a TransformerLM, or with a layer other than a LinearMixer or a causal
        softmax layer (``attention="linear"`` has no sequence-parallel layer here: use
        :func:`sequence_parallel_linear_attention` on its features); ranks whose models are
        configured differently or whose batches differ; positions past ``max_len``; as
        :meth:`linattn.TransformerLM.forward`.
    """
    caller = "sequence_parallel_lm"
    ranks = _ranks(group, caller)
    error, config = None, ""
    try:
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model must be a linattn.TransformerLM, got {_checks.type_name(model)}")
        exchange = _check_state_exchange(state_exchange, ranks)
        for i, block in enumerate(model.blocks):
            if not (isinstance(block.attn, LinearMixer) or (isinstance(block.attn, SoftmaxAttention)
                                                           and block.attn.causal)):
                raise ValueError(f"{caller}: block {i} has a {type(block.attn).__name__}; across ranks a model "
                                 "may have LinearMixer layers and causal softmax layers")
        if not isinstance(idx, Tensor) or idx.dtype != torch.long or idx.dim() != 2 or 0 in idx.shape:
            raise TypeError(f"idx must be a non-empty (B, T) int64 tensor of token ids, got {_checks.describe(idx)}")
        config = repr(asdict(model.config))
    except (TypeError, ValueError) as err:
        error = err
    lengths = _agree(ranks, config, *(idx.shape if error is None else (0, 0)), caller, error)
    start = sum(lengths[:ranks.rank])
    pos = torch.arange(start, start + idx.shape[1], device=idx.device).expand(idx.shape)   # (B, T_r)
    if model.config.max_len is not None:
        _checks.check_values(pos < model.config.max_len, "the position of every token", f"< max_len="
                             f"{model.config.max_len}", pos)
    x = model.tok_emb(idx)                                                  # (B, T_r, d_model)
    if model.pos_emb is not None:
        x = x + model.pos_emb(pos)
    attention = functools.partial(ring_softmax_attention, group=ranks.group, causal=True)
    for block in model.blocks:
        h = block.ln_1(x)
        if isinstance(block.attn, LinearMixer):
            a = _mixer_call(block.attn, h, ranks, lengths, exchange, False)
        else:
            a = block.attn(h, positions=pos if block.attn.rope else None, attention_fn=attention)
        x = x + a
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))                                     # (B, T_r, vocab_size)
