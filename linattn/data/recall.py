"""Synthetic recall tasks: multi-query associative recall (Arora et al., 2023) and needle in a haystack."""
from __future__ import annotations

import torch

from .._checks import check_count_in_range, check_generator

__all__ = ["IGNORE_INDEX", "recall_vocab", "multi_query_associative_recall", "needle_in_a_haystack", "recall_accuracy"]

IGNORE_INDEX = -100
"""Target of the positions that are not scored (the default ``ignore_index`` of ``F.cross_entropy``)."""


def recall_vocab(vocab_size: int) -> tuple[range, range]:
    """How the recall tasks split a vocabulary: token 0 is padding, then keys, then values.

    Parameters
    ----------
    vocab_size : int
        Total number of tokens, at least 3.

    Returns
    -------
    keys, values : range
        ``range(1, 1 + K)`` and ``range(1 + K, 1 + 2K)`` with ``K = (vocab_size - 1) // 2``
        (an even ``vocab_size`` leaves its last token unused).

    Raises
    ------
    TypeError
        If ``vocab_size`` is not an int.
    ValueError
        If ``vocab_size < 3``.
    """
    check_count_in_range(vocab_size, "vocab_size", minimum=3)
    K = (vocab_size - 1) // 2
    return range(1, 1 + K), range(1 + K, 1 + 2 * K)


def multi_query_associative_recall(num_examples: int, num_pairs: int, *, vocab_size: int = 129,
                                   num_queries: int | None = None,
                                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall (MQAR; Arora et al., 2023, Zoology).

    Each sequence lists ``N = num_pairs`` key-value pairs, then asks for some of the keys
    again; the model must answer each with its value::

        k_1 v_1 k_2 v_2 ... k_N v_N  q_1 q_2 ... q_Q        (q_i one of the keys)

    Parameters
    ----------
    num_examples : int
        Number of sequences, ``>= 1``.
    num_pairs : int
        ``N``, key-value pairs per sequence: ``1 <= N <=`` the number of keys of
        :func:`recall_vocab`.
    vocab_size : int
        Size of the vocabulary (padding, keys, values), see :func:`recall_vocab`.
    num_queries : int, optional
        ``Q``, keys asked per sequence, ``1 <= Q <= N``; default ``N`` (every key once).
    generator : torch.Generator, optional
        Source of randomness (CPU); default torch's global generator.

    Returns
    -------
    inputs : Tensor
        ``(num_examples, 2N + Q)`` int64 tokens.
    targets : Tensor
        ``(num_examples, 2N + Q)`` int64: the value at the ``Q`` query positions, else
        :data:`IGNORE_INDEX`.

    Raises
    ------
    TypeError
        Non-int counts; a ``generator`` that is not a ``torch.Generator``.
    ValueError
        Counts out of range (the message gives the allowed range).
    """
    keys_range, values_range = recall_vocab(vocab_size)
    check_count_in_range(num_examples, "num_examples", minimum=1)
    check_count_in_range(num_pairs, "num_pairs", minimum=1, maximum=len(keys_range),
                 why=f"the number of keys of vocab_size={vocab_size}")
    num_queries = num_pairs if num_queries is None else num_queries
    check_count_in_range(num_queries, "num_queries", minimum=1, maximum=num_pairs, why="num_pairs")
    check_generator(generator)
    n, N, Q = num_examples, num_pairs, num_queries
    keys = torch.rand(n, len(keys_range), generator=generator).argsort(dim=-1)[:, :N] + keys_range.start
    values = torch.randint(values_range.start, values_range.stop, (n, N), generator=generator)
    asked = torch.rand(n, N, generator=generator).argsort(dim=-1)[:, :Q]          # (n, Q) pair indices
    context = torch.stack([keys, values], dim=-1).reshape(n, 2 * N)              # k1 v1 k2 v2 ...
    inputs = torch.cat([context, keys.gather(1, asked)], dim=1)                   # (n, 2N + Q)
    targets = torch.cat([torch.full((n, 2 * N), IGNORE_INDEX), values.gather(1, asked)], dim=1)
    return inputs, targets


def needle_in_a_haystack(num_examples: int, seq_len: int, *, depth: float = 0.5, vocab_size: int = 129,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One key-value pair hidden in filler, asked for at the end (a needle-in-a-haystack probe).

    Parameters
    ----------
    num_examples : int
        Number of sequences, ``>= 1``.
    seq_len : int
        Tokens per sequence, ``>= 3``.
    depth : float
        Where the needle sits, in ``[0, 1]``: the key is at position
        ``round(depth · (seq_len - 3))``.
    vocab_size : int
        Size of the vocabulary, see :func:`recall_vocab`.
    generator : torch.Generator, optional
        Source of randomness (CPU); default torch's global generator.

    Returns
    -------
    inputs : Tensor
        ``(num_examples, seq_len)`` int64 tokens.
    targets : Tensor
        ``(num_examples, seq_len)`` int64: ``v`` at the last position, else :data:`IGNORE_INDEX`.

    Raises
    ------
    TypeError
        Non-int counts, a non-numeric ``depth``, a bad ``generator``.
    ValueError
        ``num_examples < 1``, ``seq_len < 3``, ``depth`` outside ``[0, 1]``.
    """
    keys_range, values_range = recall_vocab(vocab_size)
    check_count_in_range(num_examples, "num_examples", minimum=1)
    check_count_in_range(seq_len, "seq_len", minimum=3)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"depth must be a float in [0, 1], got {type(depth).__name__}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    check_generator(generator)
    n = num_examples
    inputs = torch.randint(values_range.start, values_range.stop, (n, seq_len), generator=generator)
    key = torch.randint(keys_range.start, keys_range.stop, (n,), generator=generator)
    value = torch.randint(values_range.start, values_range.stop, (n,), generator=generator)
    p = round(depth * (seq_len - 3))
    inputs[:, p], inputs[:, p + 1], inputs[:, -1] = key, value, key
    targets = torch.full((n, seq_len), IGNORE_INDEX)
    targets[:, -1] = value
    return inputs, targets


def recall_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored positions (target not :data:`IGNORE_INDEX`) whose arg-max is the target.

    Parameters
    ----------
    logits : Tensor
        ``(B, T, V)`` floating scores over the vocabulary.
    targets : Tensor
        ``(B, T)`` int64, as returned by the task generators.

    Returns
    -------
    float
        In ``[0, 1]``.

    Raises
    ------
    TypeError
        If ``logits`` is not floating or ``targets`` not int64.
    ValueError
        If the shapes do not match or no position is scored.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits).__name__)}")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        raise TypeError(f"targets must be an int64 tensor, got {getattr(targets, 'dtype', type(targets).__name__)}")
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(
            f"logits must be (B, T, V) and targets (B, T), got logits {tuple(logits.shape)} and "
            f"targets {tuple(targets.shape)}"
        )
    scored = targets != IGNORE_INDEX
    if not scored.any():
        raise ValueError("targets score no position (all are IGNORE_INDEX)")
    return (logits.argmax(-1)[scored] == targets[scored]).double().mean().item()
