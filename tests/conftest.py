"""Shared pytest configuration for the linattn unit tests."""
from __future__ import annotations

import os
import pathlib
import sys

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
