"""Old module paths that still import, with a DeprecationWarning (private)."""
from __future__ import annotations

import importlib
import warnings

__all__ = ["moved"]


def moved(old_module: str, names: dict[str, str]):
    """A module ``__getattr__`` for ``old_module`` whose ``names`` map to ``"module:name"`` targets."""

    def __getattr__(name: str):
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        module, _, attr = target.partition(":")
        warnings.warn(f"{old_module}.{name} is deprecated and will be removed after linattn 0.2; "
                      f"use {module}.{attr}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attr)

    return __getattr__
