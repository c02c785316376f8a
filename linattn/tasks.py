"""Deprecated: the recall tasks live in :mod:`linattn.data.recall`, the corpus in :mod:`linattn.data.text`."""
from ._deprecated import moved

__getattr__ = moved(__name__, {
    **{name: f"linattn.data.recall:{name}" for name in (
        "IGNORE_INDEX", "recall_vocab", "multi_query_associative_recall", "needle_in_a_haystack", "recall_accuracy")},
    **{name: f"linattn.data.text:{name}" for name in (
        "TINY_SHAKESPEARE_SHA256", "load_tiny_shakespeare", "CharCorpus", "tiny_shakespeare")},
})
