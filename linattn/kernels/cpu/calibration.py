"""The compiled loops' calibration file: per thread count, op and pass, whether the loop beat the PyTorch chunk form;
one JSON beside the ``.so`` (a build is fixed to one machine). :mod:`linattn.calibrate` measures, this module reads and writes."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
import threading
import warnings
from typing import Optional

from . import runtime

__all__ = ["PASSES", "calibration_path", "load_calibration", "verdict", "save_calibration"]

PASSES = ("forward", "forward+backward")

_lock = threading.Lock()


def _fresh_lock() -> None:
    """In a forked child: a fork while another thread held the lock (building, calibrating) must not hang it."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock)
_cache: dict = {}          # path -> the file's content, read once per process
_unwritable: set = set()   # paths already warned about


def calibration_path() -> Optional[pathlib.Path]:
    """The calibration file of the loaded library (None when the library is not available)."""
    if not runtime.cpu_kernel_available():
        return None
    return pathlib.Path(runtime.build_info()["path"] + ".calibration.json")


def load_calibration() -> dict:
    """The cached calibration of the loaded library: ``{"threads": {"1": {op: {pass: {...}}}}, ...}``,
    or ``{}`` when there is none (or the file cannot be read)."""
    path = calibration_path()
    if path is None:
        return {}
    key = str(path)
    if key not in _cache:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        _cache[key] = doc if isinstance(doc, dict) else {}
    return _cache[key]


def verdict(op: str, backward: bool, threads: int) -> Optional[bool]:
    """Whether the compiled loop of ``op`` was the faster with ``threads`` threads (None: not calibrated, or a
    file whose content is not a calibration)."""
    doc = load_calibration()
    try:
        faster = doc["threads"][str(threads)][op][PASSES[bool(backward)]]["compiled_faster"]
    except (KeyError, TypeError, IndexError):
        return None
    return faster if isinstance(faster, bool) else None


def save_calibration(threads: int, results: dict, about: dict) -> dict:
    """Merge ``results`` (``{op: {pass: record}}``) for ``threads`` into the file, atomically; returns it all."""
    path = calibration_path()
    if path is None:
        raise RuntimeError(f"the CPU kernel is not available here ({runtime.build_info().get('error')})")
    with _lock:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        if not isinstance(doc, dict) or not isinstance(doc.get("threads", {}), dict):
            doc = {}
        doc.update(about)
        doc.setdefault("threads", {})[str(threads)] = results
        _cache[str(path)] = doc            # this process keeps the verdicts even if the file cannot be written
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.chmod(tmp, 0o644)               # readable by every user of a shared cache, as the library is
            os.replace(tmp, path)          # atomic: another process may read it meanwhile
        except OSError as err:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if str(path) not in _unwritable:
                _unwritable.add(str(path))
                warnings.warn(f"linattn: the CPU kernels' calibration could not be saved to {path} ({err}); "
                              "this process keeps its verdicts, the next one calibrates again", RuntimeWarning,
                              stacklevel=2)
    return doc
