"""Building the CPU kernels' library: the compiler, the cache folder, and a build that is never half-written."""
from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

__all__ = ["SOURCES", "HEADERS", "compiler", "build", "digest_path"]

SOURCES = (pathlib.Path(__file__).with_name("cpu_causal.cpp"), pathlib.Path(__file__).with_name("cpu_delta.cpp"))
HEADERS = (pathlib.Path(__file__).with_name("cpu_vector.h"), pathlib.Path(__file__).with_name("cpu_parallel.h"))


def compiler() -> Optional[str]:
    name = os.environ.get("CXX")
    if name:
        return shutil.which(name) or (name if os.path.isfile(name) else None)
    for candidate in ("c++", "g++", "clang++"):
        path = shutil.which(candidate)
        if path:
            return path
    return None


def _machine_key() -> str:
    """What a ``-march=native`` build depends on: the CPU model and its feature flags."""
    text = platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                text += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return text


def _cache_dir() -> pathlib.Path:
    folder = os.environ.get("LINATTN_CACHE_DIR")
    if folder:
        return pathlib.Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "linattn"


def build(compiler: str, flags: list[str], info: dict) -> pathlib.Path:
    """Compile the source with ``flags`` into the cache (once per source, flags, compiler, CPU)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(flags), version,
                                    _machine_key()]).encode())
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"linattn_cpu_{key.hexdigest()[:16]}.so"
    if not _intact(target):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        digest = tmp + ".sha256"
        try:
            proc = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip()[-2000:] or f"{compiler} exited with {proc.returncode}")
            os.chmod(tmp, 0o755)             # mkstemp's 0600 would hide a shared cache from other users
            pathlib.Path(digest).write_text(_sha256(pathlib.Path(tmp)))
            os.replace(tmp, target)          # atomic: another process may be building the same file
            os.replace(digest, digest_path(target))
        finally:
            for leftover in (tmp, digest):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    info["info"] = {"compiler": version.splitlines()[0] if version else compiler, "flags": flags,
                      "path": str(target)}
    return target


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: pathlib.Path) -> bool:
    """Whether ``target`` is the file its build wrote: a truncated or altered library must never be
    loaded, since mapping a file shorter than its ELF headers say kills the process (SIGBUS)."""
    try:
        return target.is_file() and digest_path(target).read_text().strip() == _sha256(target)
    except OSError:
        return False
