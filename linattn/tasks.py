"""Synthetic tasks and small datasets for the book's experiments.

Two sections, kept apart: synthetic recall tasks (associative recall, needle in a
haystack) and the character-level tiny-Shakespeare corpus.
"""
from __future__ import annotations

import torch

__all__: list[str] = []

# ---------------------------------------------------------------------------------------
# Synthetic recall tasks
# ---------------------------------------------------------------------------------------
__all__ += ["IGNORE_INDEX", "recall_vocab", "multi_query_associative_recall", "needle_in_a_haystack",
            "recall_accuracy"]

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
    _check_count(vocab_size, "vocab_size", minimum=3)
    K = (vocab_size - 1) // 2
    return range(1, 1 + K), range(1 + K, 1 + 2 * K)


def multi_query_associative_recall(num_examples: int, num_pairs: int, *, vocab_size: int = 129,
                                   num_queries: int | None = None,
                                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall (MQAR; Arora et al., 2023, Zoology).

    Each sequence lists ``N = num_pairs`` key-value pairs, then asks for some of the keys
    again; the model must answer each with its value::

        k_1 v_1 k_2 v_2 ... k_N v_N  q_1 q_2 ... q_Q        (q_i one of the keys)

    The keys of a sequence are distinct (drawn without replacement), the values are drawn
    with replacement, the queried keys are distinct and in random order. The target at the
    position of ``q_i`` is its value (a next-token prediction); every other target is
    :data:`IGNORE_INDEX`. A model with a state of ``M×Dv`` numbers (linear attention) can
    hold only about ``M`` pairs without interference (chapter 7).

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
    _check_count(num_examples, "num_examples", minimum=1)
    _check_count(num_pairs, "num_pairs", minimum=1, maximum=len(keys_range),
                 why=f"the number of keys of vocab_size={vocab_size}")
    num_queries = num_pairs if num_queries is None else num_queries
    _check_count(num_queries, "num_queries", minimum=1, maximum=num_pairs, why="num_pairs")
    _check_generator(generator)
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

    The sequence is ``seq_len`` tokens of filler (values of :func:`recall_vocab`, drawn at
    random) with one key ``k`` followed by its value ``v`` at relative depth ``depth``
    (0: the start, 1: just before the end); the last token is ``k`` again, and its target is
    ``v``. No other key appears, so the only difficulty is to find one token among
    ``seq_len``: softmax attention can weight it alone, linear attention spreads weight
    over the filler (chapter 7).

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
    _check_count(num_examples, "num_examples", minimum=1)
    _check_count(seq_len, "seq_len", minimum=3)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"depth must be a float in [0, 1], got {type(depth).__name__}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    _check_generator(generator)
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


def _check_count(value, name: str, minimum: int, maximum: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum} ({why})" if maximum is not None else ""
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


# ---------------------------------------------------------------------------------------
# Character-level text: tiny Shakespeare
# ---------------------------------------------------------------------------------------
__all__ += ["TINY_SHAKESPEARE_SHA256", "load_tiny_shakespeare", "CharCorpus", "tiny_shakespeare"]

TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
"""sha256 of the 1,115,394 bytes of ``tinyshakespeare.txt`` (checked on every load)."""


def load_tiny_shakespeare(path=None) -> str:
    """The tiny-Shakespeare text, checked against its sha256.

    1,115,394 characters of Shakespeare's plays (public domain), the corpus of Karpathy's
    char-rnn (2015). It ships with ``linattn`` as ``linattn/data/tinyshakespeare.txt.gz``,
    so no download is needed.

    Parameters
    ----------
    path : str or os.PathLike, optional
        Read this plain-text (or ``.gz``) file instead of the packaged copy; it must be
        the same text.

    Returns
    -------
    str
        The whole text (decoded as UTF-8; it is plain ASCII).

    Raises
    ------
    TypeError
        If ``path`` is not None, a str or an ``os.PathLike``.
    ValueError
        If the bytes do not have sha256 :data:`TINY_SHAKESPEARE_SHA256` (a corrupted or
        different file).
    """
    import gzip
    import hashlib
    import os
    from importlib import resources

    if path is None:
        where = "linattn/data/tinyshakespeare.txt.gz"
        raw = resources.files("linattn").joinpath("data").joinpath("tinyshakespeare.txt.gz").read_bytes()
    elif isinstance(path, (str, os.PathLike)):
        where = os.fspath(path)
        with open(where, "rb") as f:
            raw = f.read()
    else:
        raise TypeError(f"path must be a str, an os.PathLike or None, got {type(path).__name__}")
    if raw[:2] == b"\x1f\x8b":  # gzip magic number
        raw = gzip.decompress(raw)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise ValueError(
            f"{where} is not the tiny-Shakespeare text: sha256 {digest} ({len(raw):,} bytes), "
            f"expected {TINY_SHAKESPEARE_SHA256} (1,115,394 bytes)"
        )
    return raw.decode("utf-8")


class CharCorpus:
    """A character-level corpus: vocabulary, encoding, a train/validation split and batches.

    Every distinct character of ``text`` is one token; ids follow the sorted characters.
    The first ``1 - val_fraction`` of the text is the training split and the rest the
    validation split (a contiguous tail, so no validation text leaks into training
    windows).

    Parameters
    ----------
    text : str
        The whole corpus, at least two characters.
    val_fraction : float
        Fraction of the characters held out for validation, in ``(0, 1)``.

    Attributes
    ----------
    chars : list of str
        The vocabulary, sorted; ``chars[i]`` is the character of id ``i``.
    train, val : Tensor
        ``(N_train,)`` and ``(N_val,)`` int64 token ids.

    Raises
    ------
    TypeError
        If ``text`` is not a str or ``val_fraction`` is not a float.
    ValueError
        If ``text`` has fewer than two characters or ``val_fraction`` is outside ``(0, 1)``
        or leaves a split empty.
    """

    def __init__(self, text: str, *, val_fraction: float = 0.1) -> None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if len(text) < 2:
            raise ValueError(f"text must have at least 2 characters, got {len(text)}")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
            raise TypeError(f"val_fraction must be a float, got {type(val_fraction).__name__}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n_val = int(round(len(text) * val_fraction))
        if n_val < 1 or n_val >= len(text):
            raise ValueError(f"val_fraction={val_fraction} leaves an empty split of {len(text)} characters")
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}
        data = self.encode(text)                              # (N,)
        self.train, self.val = data[: len(text) - n_val], data[len(text) - n_val:]

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters (the language model's vocabulary size)."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``: ``(len(text),)`` int64.

        Raises
        ------
        TypeError
            If ``text`` is not a str.
        ValueError
            If ``text`` contains a character outside the vocabulary.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(f"text contains characters outside the vocabulary: {unknown[:10]!r}")
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """The text of token ids: a 1-D integer tensor or a sequence of ints.

        Raises
        ------
        TypeError
            If ``ids`` is not a 1-D integer tensor or a sequence of ints.
        ValueError
            If an id is outside ``[0, vocab_size)``.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise TypeError(f"ids must be a 1-D integer tensor, got dtype {ids.dtype} and shape {tuple(ids.shape)}")
            ids = ids.tolist()
        elif not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("ids must be a 1-D integer tensor or a sequence of ints")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:10]}")
        return "".join(self.chars[i] for i in ids)

    def _split(self, split: str) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def get_batch(self, split: str, batch_size: int, block_size: int, *,
                  generator: torch.Generator | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of windows for next-character prediction.

        Parameters
        ----------
        split : str
            ``"train"`` or ``"val"``.
        batch_size : int
            Number of windows ``B >= 1``.
        block_size : int
            Tokens per window ``T >= 1``; the split must hold more than ``T`` tokens.
        generator : torch.Generator, optional
            Source of the random window starts (uniform over the split).
        device : torch.device or str, optional
            Where to put the batch (default CPU).

        Returns
        -------
        x, y : Tensor
            ``(B, T)`` int64 each; ``y`` is ``x`` shifted by one character (the targets).

        Raises
        ------
        TypeError
            If ``batch_size`` or ``block_size`` is not an int.
        ValueError
            An unknown split, ``batch_size`` or ``block_size`` < 1, or a split too short.
        """
        data = self._split(split)
        _check_positive_count(batch_size, "batch_size")
        _check_positive_count(block_size, "block_size")
        if len(data) <= block_size:
            raise ValueError(f"block_size={block_size} needs a {split} split of more than {block_size} tokens, "
                             f"it has {len(data)}")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
        idx = starts[:, None] + torch.arange(block_size)                                   # (B, T)
        return data[idx].to(device), data[idx + 1].to(device)

    def blocks(self, split: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every non-overlapping window of a split, in order (for a deterministic evaluation).

        Parameters
        ----------
        split : str
            ``"train"`` or ``"val"``.
        block_size : int
            Tokens per window ``T >= 1``.

        Returns
        -------
        x, y : Tensor
            ``(N, T)`` int64 with ``N = (len(split) - 1) // T``; ``y`` is ``x`` shifted by one.

        Raises
        ------
        TypeError
            If ``block_size`` is not an int.
        ValueError
            An unknown split, ``block_size`` < 1, or a split too short for one window.
        """
        data = self._split(split)
        _check_positive_count(block_size, "block_size")
        n = (len(data) - 1) // block_size
        if n < 1:
            raise ValueError(f"block_size={block_size} is longer than the {split} split ({len(data)} tokens)")
        x = data[: n * block_size].view(n, block_size)                # (N, T)
        y = data[1: n * block_size + 1].view(n, block_size)           # (N, T)
        return x, y


def tiny_shakespeare(*, val_fraction: float = 0.1) -> CharCorpus:
    """The tiny-Shakespeare corpus (65 characters), split for training and validation.

    Loads the packaged text with :func:`load_tiny_shakespeare` (sha256 checked) and wraps
    it in a :class:`CharCorpus`: the first 90 % (by default) for training, the last 10 %
    for validation, as in Karpathy's char-rnn and nanoGPT's ``shakespeare_char``.

    Parameters
    ----------
    val_fraction : float
        Fraction of the text held out for validation, in ``(0, 1)``.

    Returns
    -------
    CharCorpus

    Raises
    ------
    ValueError
        If the packaged file is corrupted (sha256 mismatch) or ``val_fraction`` is invalid.
    """
    return CharCorpus(load_tiny_shakespeare(), val_fraction=val_fraction)


def _check_positive_count(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
