"""Provenance: what identifies the code, software and machine a stored result came from."""
from __future__ import annotations

import os
import pathlib
import platform
import subprocess
from typing import Optional

import torch

__all__ = ["repo_root", "results_path", "git_commit", "cpu_name", "provenance"]


def repo_root() -> Optional[pathlib.Path]:
    """The repository this package runs from (a folder with ``chapters/``), or None for an installed copy."""
    here = pathlib.Path(__file__).resolve().parents[2]
    return here if (here / "chapters").is_dir() else None


def results_path(name: str) -> pathlib.Path:
    """Where study ``name`` keeps its results: ``chapters/results/<name>.json`` of the repository."""
    root = repo_root() or pathlib.Path.cwd()
    return root / "chapters" / "results" / f"{name}.json"


def git_commit() -> Optional[str]:
    """The checkout's commit, ``+uncommitted changes in linattn/`` when the package differs from it; None outside one."""
    root = repo_root()
    if root is None:
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "linattn"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+uncommitted changes in linattn/" if dirty else "")


def cpu_name() -> str:
    """The CPU model, as /proc/cpuinfo names it (or what platform knows)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(threads: int) -> dict:
    """What identifies the software and machine a result came from."""
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads_per_worker": threads,
            "commit": git_commit()}
