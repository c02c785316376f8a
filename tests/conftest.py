"""Shared pytest configuration for the linattn tests: paths, hypothesis, threads, and the markers.

The tests mirror the package (``tests/ops`` for ``linattn/ops``, ...). Markers (registered in
pyproject.toml) select what needs more than the CPU and the README's install: ``gpu``, ``triton``,
``transformers``, ``browser``, ``book`` (the book's files, notebooks, site and Colab cell) and ``slow`` (processes,
compilation, notebooks); ``.ci/run`` selects by them.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

# Make the float64 reference module (tests/refimpl.py) importable however pytest is invoked.
_TESTS = pathlib.Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

try:
    from hypothesis import settings

    # Deterministic property tests (same examples every run) without per-example deadlines.
    settings.register_profile("linattn", deadline=None, derandomize=True, print_blob=True)
    settings.load_profile("linattn")
except ImportError:  # hypothesis is a test dependency; tests that need it import it themselves
    pass

# The unit tests use small tensors: one intra-op thread is faster than a pool that spins
# (especially on a busy 2-core CI runner, where it was 5x faster). Override with LINATTN_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("LINATTN_TEST_THREADS", "1")))


# The marks of every item of a test file (others mark single tests themselves).
_FILE_MARKS = {
    "test_site.py": ("browser", "book", "slow"),
    "test_book.py": ("book",),
    "test_colab.py": ("book", "slow"),
    "test_local_mathjax.py": ("book",),
    "test_tiny_example.py": ("book",),
    "test_triton.py": ("triton",),
    "test_gpu.py": ("gpu",),
    "test_interop.py": ("transformers",),
    "test_sequence_parallel.py": ("slow",),
    "test_sequence_parallel_rules.py": ("slow",),
    "test_sequence_parallel_layers.py": ("slow",),
    "test_prefill.py": ("slow",),
    "test_sp_exchange.py": ("slow",),
    "test_studies.py": ("slow",),
    "test_transforms.py": ("slow",),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = ("book", "slow") if item.path.suffix == ".ipynb" else _FILE_MARKS.get(item.path.name, ())
        for mark in marks:
            item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture
def triton_backend(monkeypatch):
    """``force(why_not)``: decide with ``why_not(tensors, chunk_size) -> None or a reason`` where the
    Triton backend runs (a rehearsal in Triton's CPU interpreter has no CUDA tensors), with no kernel
    failure remembered from an earlier test."""
    from linattn import backends

    monkeypatch.setattr(backends, "_triton_failure", [])

    def force(why_not):
        monkeypatch.setattr(backends, "_why_not_triton", why_not)

    return force
