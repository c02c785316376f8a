"""Synthetic recall tasks of linattn.tasks: multi-query associative recall and needle in a haystack."""
from __future__ import annotations

import pytest
import torch

from linattn.data import (
    IGNORE_INDEX,
    multi_query_associative_recall,
    needle_in_a_haystack,
    recall_accuracy,
    recall_vocab,
)


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_recall_vocab_split():
    keys, values = recall_vocab(129)
    assert keys == range(1, 65) and values == range(65, 129)
    keys, values = recall_vocab(10)                 # even size: the last token is unused
    assert keys == range(1, 5) and values == range(5, 9)


@pytest.mark.parametrize("num_pairs,num_queries", [(1, None), (5, 3), (16, None), (64, 64)])
def test_mqar_structure(num_pairs, num_queries):
    n, V = 50, 129
    x, y = multi_query_associative_recall(n, num_pairs, vocab_size=V, num_queries=num_queries, generator=_g())
    Q = num_pairs if num_queries is None else num_queries
    N = num_pairs
    assert x.shape == y.shape == (n, 2 * N + Q) and x.dtype == y.dtype == torch.int64
    keys_range, values_range = recall_vocab(V)
    keys, values, queries = x[:, 0:2 * N:2], x[:, 1:2 * N:2], x[:, 2 * N:]
    assert ((keys >= keys_range.start) & (keys < keys_range.stop)).all()
    assert ((values >= values_range.start) & (values < values_range.stop)).all()
    assert (y[:, :2 * N] == IGNORE_INDEX).all()
    for i in range(n):
        assert len(set(keys[i].tolist())) == N                      # distinct keys
        assert len(set(queries[i].tolist())) == Q                   # distinct queries
        table = dict(zip(keys[i].tolist(), values[i].tolist()))
        assert [table[q] for q in queries[i].tolist()] == y[i, 2 * N:].tolist()


def test_mqar_is_seeded_and_covers_the_vocabulary():
    a = multi_query_associative_recall(8, 6, generator=_g(3))
    b = multi_query_associative_recall(8, 6, generator=_g(3))
    c = multi_query_associative_recall(8, 6, generator=_g(4))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    x, _ = multi_query_associative_recall(2000, 4, vocab_size=21, generator=_g())
    keys_range, values_range = recall_vocab(21)
    assert set(x[:, 0:8:2].flatten().tolist()) == set(keys_range)
    assert set(x[:, 1:8:2].flatten().tolist()) == set(values_range)
    torch.manual_seed(0)
    d = multi_query_associative_recall(8, 6)                         # global generator
    torch.manual_seed(0)
    assert torch.equal(d[0], multi_query_associative_recall(8, 6)[0])


def test_mqar_all_pairs_of_the_vocabulary():
    """N equal to the number of keys: every key appears once per sequence."""
    x, y = multi_query_associative_recall(3, 10, vocab_size=21, generator=_g())
    assert all(sorted(row[0:20:2].tolist()) == list(range(1, 11)) for row in x)


@pytest.mark.parametrize("seq_len,depth", [(3, 0.0), (10, 0.0), (10, 0.5), (10, 1.0), (257, 0.3)])
def test_needle_structure(seq_len, depth):
    x, y = needle_in_a_haystack(40, seq_len, depth=depth, vocab_size=33, generator=_g())
    keys_range, values_range = recall_vocab(33)
    p = round(depth * (seq_len - 3))
    assert x.shape == y.shape == (40, seq_len)
    assert (x[:, p] == x[:, -1]).all()                                   # the needle's key is asked at the end
    assert ((x[:, -1] >= keys_range.start) & (x[:, -1] < keys_range.stop)).all()
    assert (y[:, -1] == x[:, p + 1]).all()                               # ... and its value is the target
    assert (y[:, :-1] == IGNORE_INDEX).all()
    filler = torch.cat([x[:, :p], x[:, p + 2:-1]], dim=1)
    assert ((filler >= values_range.start) & (filler < values_range.stop)).all()   # no other key


def test_recall_accuracy():
    targets = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX, 1], [0, IGNORE_INDEX, IGNORE_INDEX, 2]])
    logits = torch.zeros(2, 4, 3)
    logits[0, 1, 2] = logits[0, 3, 0] = logits[1, 0, 0] = logits[1, 3, 2] = 1.0
    assert recall_accuracy(logits, targets) == 0.75
    x, y = multi_query_associative_recall(4, 5, vocab_size=21, generator=_g())
    perfect = torch.nn.functional.one_hot(y.clamp(min=0), 21).float()
    assert recall_accuracy(perfect, y) == 1.0


@pytest.mark.parametrize("call,err,pattern", [
    (lambda: recall_vocab(2), ValueError, r"vocab_size must be >= 3, got 2"),
    (lambda: recall_vocab(12.0), TypeError, r"vocab_size must be an int, got float"),
    (lambda: multi_query_associative_recall(0, 4), ValueError, r"num_examples must be >= 1, got 0"),
    (lambda: multi_query_associative_recall(2, 65), ValueError,
     r"num_pairs must be >= 1 and <= 64 \(the number of keys of vocab_size=129\), got 65"),
    (lambda: multi_query_associative_recall(2, 4, num_queries=5), ValueError,
     r"num_queries must be >= 1 and <= 4 \(num_pairs\), got 5"),
    (lambda: multi_query_associative_recall(2, True), TypeError, r"num_pairs must be an int, got bool"),
    (lambda: multi_query_associative_recall(2, 4, generator=0), TypeError,
     r"generator must be a torch.Generator or None, got int"),
    (lambda: needle_in_a_haystack(2, 2), ValueError, r"seq_len must be >= 3, got 2"),
    (lambda: needle_in_a_haystack(2, 10, depth=1.5), ValueError, r"depth must be in \[0, 1\], got 1.5"),
    (lambda: needle_in_a_haystack(2, 10, depth="mid"), TypeError, r"depth must be a float in \[0, 1\], got str"),
    (lambda: recall_accuracy(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.int64)), ValueError,
     r"logits must be \(B, T, V\) and targets \(B, T\), got logits \(2, 3, 4\) and targets \(2, 4\)"),
    (lambda: recall_accuracy(torch.zeros(2, 3, 4), torch.zeros(2, 3)), TypeError,
     r"targets must be an int64 tensor, got torch.float32"),
    (lambda: recall_accuracy(torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64)),
     TypeError, r"logits must be a floating-point tensor, got torch.int64"),
    (lambda: recall_accuracy(torch.zeros(1, 2, 4), torch.full((1, 2), IGNORE_INDEX)), ValueError,
     r"score no position"),
])
def test_errors(call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()
