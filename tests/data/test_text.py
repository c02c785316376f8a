"""Tests of the character-level tiny-Shakespeare corpus in linattn.tasks."""
from __future__ import annotations

import gzip
import hashlib
import pathlib

import pytest
import torch

from linattn import data as tasks

PACKAGED = pathlib.Path(tasks.__file__).parent / "tinyshakespeare.txt.gz"


@pytest.fixture(scope="module")
def corpus():
    return tasks.tiny_shakespeare()


def test_packaged_text_is_tiny_shakespeare():
    text = tasks.load_tiny_shakespeare()
    raw = text.encode("utf-8")
    assert len(raw) == 1_115_394
    assert hashlib.sha256(raw).hexdigest() == tasks.TINY_SHAKESPEARE_SHA256
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")


def test_checksum_is_verified(tmp_path):
    text = gzip.decompress(PACKAGED.read_bytes())
    plain = tmp_path / "plain.txt"
    plain.write_bytes(text)
    assert tasks.load_tiny_shakespeare(plain) == text.decode()          # plain text is accepted too
    corrupted = tmp_path / "corrupted.txt.gz"
    corrupted.write_bytes(gzip.compress(text[:-1] + b"?"))
    with pytest.raises(ValueError, match=r"corrupted.txt.gz is not the tiny-Shakespeare text: sha256"):
        tasks.load_tiny_shakespeare(corrupted)
    with pytest.raises(TypeError, match="path"):
        tasks.load_tiny_shakespeare(3)


def test_vocabulary_and_split(corpus):
    assert corpus.vocab_size == 65
    assert corpus.chars[:3] == ["\n", " ", "!"]
    assert len(corpus.train) + len(corpus.val) == 1_115_394
    assert len(corpus.val) == round(0.1 * 1_115_394)
    assert corpus.train.dtype == torch.long and corpus.val.dtype == torch.long
    head = corpus.decode(corpus.train[:14])
    assert head == "First Citizen:"
    assert corpus.decode(corpus.encode("To be, or not")) == "To be, or not"


def test_get_batch_shapes_targets_and_seed(corpus):
    g = torch.Generator().manual_seed(0)
    x, y = corpus.get_batch("train", 4, 16, generator=g)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])                             # y is x shifted by one
    x2, _ = corpus.get_batch("train", 4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    xv, yv = corpus.get_batch("val", 2, 8, generator=g)
    text = corpus.decode(corpus.val)
    for row in xv:
        assert corpus.decode(row) in text


def test_blocks_cover_the_split_in_order(corpus):
    x, y = corpus.blocks("val", 128)
    assert x.shape == ((len(corpus.val) - 1) // 128, 128)
    assert torch.equal(x.flatten(), corpus.val[: x.numel()])
    assert torch.equal(y.flatten(), corpus.val[1: x.numel() + 1])


def test_small_corpus_and_bad_input():
    c = tasks.CharCorpus("abcabcabca", val_fraction=0.3)
    assert c.vocab_size == 3 and len(c.train) == 7 and len(c.val) == 3
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        c.get_batch("test", 1, 2)
    with pytest.raises(ValueError, match="block_size=3 needs a val split of more than 3 tokens"):
        c.get_batch("val", 1, 3)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        c.get_batch("train", 1.0, 2)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        c.get_batch("train", 1, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.encode("abd")
    with pytest.raises(ValueError, match=r"ids must be in \[0, 3\)"):
        c.decode([0, 3])
    with pytest.raises(TypeError, match="ids must be a 1-D integer tensor"):
        c.decode(torch.zeros(2))
    with pytest.raises(ValueError, match="val_fraction must be in"):
        tasks.CharCorpus("abc", val_fraction=1.0)
    with pytest.raises(TypeError, match="text must be a str"):
        tasks.CharCorpus(b"abc")
