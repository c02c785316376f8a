"""Shared by the book's tests: the project's execute script, loaded as a module.

``.ci/execute_notebooks.py`` is the one place that reads ``_toc.yml`` and writes the Colab
install cell; the tests use its functions rather than parsing the same files again.
"""
from __future__ import annotations

import functools
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def execute_script():
    """``.ci/execute_notebooks.py`` as a module (loaded once)."""
    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / ".ci" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toc_entries() -> list[str]:
    """Every document named in ``_toc.yml``, in book order, as written there."""
    return execute_script().toc_entries(ROOT)
