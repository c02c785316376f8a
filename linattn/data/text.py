"""The character-level tiny-Shakespeare corpus that ships with linattn (Karpathy's char-rnn, 2015)."""
from __future__ import annotations

import torch

from .._checks import check_count_in_range

__all__ = ["TINY_SHAKESPEARE_SHA256", "load_tiny_shakespeare", "CharCorpus", "tiny_shakespeare"]

TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
"""sha256 of the 1,115,394 bytes of ``tinyshakespeare.txt`` (checked on every load)."""


def load_tiny_shakespeare(path=None) -> str:
    """The tiny-Shakespeare text, checked against its sha256.

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
        check_count_in_range(batch_size, "batch_size", 1)
        check_count_in_range(block_size, "block_size", 1)
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
        check_count_in_range(block_size, "block_size", 1)
        n = (len(data) - 1) // block_size
        if n < 1:
            raise ValueError(f"block_size={block_size} is longer than the {split} split ({len(data)} tokens)")
        x = data[: n * block_size].view(n, block_size)                # (N, T)
        y = data[1: n * block_size + 1].view(n, block_size)           # (N, T)
        return x, y


def tiny_shakespeare(*, val_fraction: float = 0.1) -> CharCorpus:
    """The tiny-Shakespeare corpus (65 characters), split for training and validation.

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
