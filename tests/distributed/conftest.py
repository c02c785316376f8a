"""One process group per world size for every test of this folder (starting processes costs seconds)."""
from __future__ import annotations

import importlib

import pytest

from linattn.distributed import run_on_ranks


@pytest.fixture(scope="session")
def spawned():
    """``spawned(P)``: per rank, what ``test_sequence_parallel_rules.every_case(P)`` returned there."""
    cache = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            every_case = importlib.import_module("test_sequence_parallel_rules").every_case
            cache[world_size] = run_on_ranks(every_case, world_size, world_size, timeout=60.0)
        return cache[world_size]

    return get
