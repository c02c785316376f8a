"""Data for the book's experiments: synthetic recall tasks (:mod:`.recall`) and the tiny-Shakespeare
corpus that ships in this folder (:mod:`.text`)."""
from .recall import IGNORE_INDEX, multi_query_associative_recall, needle_in_a_haystack, recall_accuracy, recall_vocab
from .text import TINY_SHAKESPEARE_SHA256, CharCorpus, load_tiny_shakespeare, tiny_shakespeare

__all__ = ["IGNORE_INDEX", "recall_vocab", "multi_query_associative_recall", "needle_in_a_haystack", "recall_accuracy",
           "TINY_SHAKESPEARE_SHA256", "load_tiny_shakespeare", "CharCorpus", "tiny_shakespeare"]
