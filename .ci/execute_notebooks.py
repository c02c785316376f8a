"""Re-execute the book's notebooks on CPU, top to bottom, and write the outputs in place.

Usage (from the repository root)::

    python .ci/execute_notebooks.py                      # every notebook in _toc.yml
    python .ci/execute_notebooks.py chapters/02_kernel_trick.ipynb

Before executing, the first cell of each notebook is (re)written from the
template below with the repository URL and branch read from ``_config.yml``
(the one place the URL is written). The cell installs ``linattn`` on Google
Colab and does nothing anywhere else.

Every notebook runs in a fresh kernel of the current Python environment, on
CPU (CUDA hidden), from the ``chapters/`` folder; it seeds itself. The
execution time of each notebook is printed.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbformat
import yaml
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]

COLAB_TAG = "colab-install"
REMOVE_TAG = "remove-cell"  # jupyter-book: not shown in the HTML
COLAB_CELL = '''\
# Runs only on Google Colab: installs linattn from the book's repository
# (Colab's own torch is kept). Locally, `pip install -r requirements.txt` does this.
import sys

if "google.colab" in sys.modules:
    !pip install -q "linattn @ git+{url}@{branch}"'''


def colab_cell_source(root: pathlib.Path = ROOT) -> str:
    """The Colab install cell, with the repository URL and branch from ``_config.yml``."""
    config = yaml.safe_load((root / "_config.yml").read_text())
    repo = config["repository"]
    return COLAB_CELL.format(url=repo["url"].rstrip("/"), branch=repo.get("branch", "main"))


def toc_entries(root: pathlib.Path = ROOT) -> list[str]:
    """Every document named in ``_toc.yml`` (the root, then each ``file``, nested sections
    included), in book order, as written there (no suffix)."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    files: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key in ("root", "file"):
                if isinstance(node.get(key), str):
                    files.append(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc)
    return files


def toc_notebooks(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every notebook listed in ``_toc.yml``, in book order."""
    return [root / f"{f}.ipynb" for f in toc_entries(root) if (root / f"{f}.ipynb").exists()]


def set_colab_cell(nb: nbformat.NotebookNode) -> None:
    """Make the notebook's first cell the Colab install cell (insert it or refresh it)."""
    source = colab_cell_source()
    first = nb.cells[0] if nb.cells else None
    if first is not None and COLAB_TAG in first.get("metadata", {}).get("tags", []):
        first.source = source
        cell = first
    else:
        cell = nbformat.v4.new_code_cell(source)
        nb.cells.insert(0, cell)
    # The cell matters only on Colab, where the notebook comes straight from the repository;
    # "remove-cell" keeps it off the rendered page (it would sit above the chapter's title).
    cell.metadata["tags"] = [COLAB_TAG, REMOVE_TAG]
    # Colab's runtime type is the notebook's own choice, kept as it is: a notebook whose code
    # never touches CUDA (chapters 1-5) carries "colab" metadata without an accelerator, and
    # Colab opens it on a CPU runtime. A notebook that has no Colab metadata yet asks for a GPU.
    if "colab" not in nb.metadata:
        nb.metadata["accelerator"] = "GPU"
        nb.metadata["colab"] = {"provenance": [], "gpuType": "T4"}


def execute(path: pathlib.Path, timeout: int = 900) -> float:
    """Execute one notebook in place; returns the wall time in seconds."""
    nb = nbformat.read(path, as_version=4)
    set_colab_cell(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    start = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        allow_errors=False,
    )
    client.execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: all notebooks in _toc.yml")
    parser.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only: the committed outputs are CPU outputs
    os.environ.setdefault("PYTHONHASHSEED", "0")
    paths = [p.resolve() for p in args.notebooks] or toc_notebooks()
    total = 0.0
    for path in paths:
        print(f"executing {path.relative_to(ROOT)} ...", flush=True)
        elapsed = execute(path, timeout=args.timeout)
        total += elapsed
        print(f"  {elapsed:6.1f} s", flush=True)
    print(f"total {total:.1f} s for {len(paths)} notebook(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
