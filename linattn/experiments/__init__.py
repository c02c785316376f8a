"""Studies too heavy for a notebook: one command each, results written with their provenance."""
from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import pathlib
import platform
import subprocess
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from . import origin
from .origin import git_commit, provenance, results_path

__all__ = ["STUDIES", "study", "provenance", "run_study", "load_results", "check_cell", "check_out", "results_path",
           "git_commit", "train_char_lm"]

STUDIES: dict[str, str] = {}
"""Study name -> module: a module of this package (``"recall"``) or a full dotted path."""


def register(name: str, module: str) -> None:
    """Make study ``name`` runnable: ``module`` names a module of this package or a dotted path."""
    STUDIES[name] = module


def study(name: str):
    """The module of study ``name``.

    Raises
    ------
    ValueError
        If no study has that name (the message lists the known ones).
    """
    if not isinstance(name, str) or name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; known studies: {', '.join(sorted(STUDIES)) or 'none'}")
    return importlib.import_module(_module_path(name))


def _module_path(name: str) -> str:
    module = STUDIES[name]
    return module if "." in module else f"{__name__}.{module}"


def _run_cells(module: str, cells: list[dict], threads: int) -> list[dict]:
    """Run cells of the study in ``module`` (a dotted path) in this process: one thread, each cell timed."""
    torch.set_num_threads(threads)
    mod = importlib.import_module(module)
    rows = []
    for cell in cells:
        start = time.perf_counter()
        result = mod.run_cell(dict(cell))
        rows.append({"cell": cell, "result": result, "seconds": round(time.perf_counter() - start, 3)})
    return rows


def run_study(name: str, *, workers: int = 1, cells: Optional[Sequence[int]] = None, out=None,
              progress: Optional[Callable[[str], None]] = print) -> dict:
    """Run study ``name`` and write its results file; returns what was written.

    Parameters
    ----------
    name : str
        A key of :data:`STUDIES`.
    workers : int
        Processes that run cells in parallel, each with one intra-op thread.
    cells : sequence of int, optional
        Indices into the study's grid (all cells if None): for a partial rerun.
    out : path, optional
        The results file; default :func:`results_path` of ``name``. With ``cells`` given and no
        ``out``, nothing is written (a partial run must not replace the full results). Checked
        before any cell runs.
    progress : callable or None
        Called with one line per finished cell.

    Returns
    -------
    dict
        The results document (``study``, ``description``, ``command``, ``grid_size``,
        ``provenance``, ``started``, ``elapsed_s``, ``rows``, and ``summary`` if the study has one).
        ``provenance`` is taken when the cells start (``commit_at_end`` is added if the checkout
        moved while they ran). A study with a ``REUSE_FROM`` attribute (a study name or a
        results path) copies the rows of that results file whose cell is identical to one of its
        own, marked ``reused_from``, instead of running them again.

    Raises
    ------
    ValueError
        An unknown study, ``workers < 1``, ``workers > 1`` for a study whose cells start
        processes of their own (``SERIAL = True``, e.g. ``sp_exchange``: a pool's worker may not
        start processes, and its timings would share the cores), a cell index out of range, an
        ``out`` that is a folder or lies under a file.
    """
    mod = study(name)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if workers > 1 and getattr(mod, "SERIAL", False):
        raise ValueError(f"study {name!r} runs its cells one at a time (each starts and times processes of its "
                         f"own): pass workers=1 (--workers 1), got {workers}")
    grid = mod.grid()
    chosen = list(range(len(grid))) if cells is None else list(cells)
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < len(grid)):
            raise ValueError(f"cell index {i!r} is out of range for study {name!r} with {len(grid)} cells")
    if out is not None:
        check_out(out)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    prov = provenance(threads=1)                 # the code as it was when the cells started
    t0 = time.perf_counter()
    todo = [grid[i] for i in chosen]
    reused = _reusable_rows(mod, todo)
    run = [c for c in todo if _cell_key(c) not in reused]
    fresh: dict[str, dict] = {}
    if workers == 1 or len(run) <= 1:
        for row in _iter_rows(name, run, progress):
            fresh[_cell_key(row["cell"])] = row
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Pool(workers) as pool:
            for batch in pool.imap(_worker, [(_module_path(name), [c]) for c in run]):
                for row in batch:
                    fresh[_cell_key(row["cell"])] = row
                    if progress is not None:
                        progress(_progress_line(len(fresh), len(run), row))
    rows = [reused.get(_cell_key(c)) or fresh[_cell_key(c)] for c in todo]
    end_commit = origin.git_commit()
    if end_commit != prov["commit"]:
        prov["commit_at_end"] = end_commit
    doc = {"study": name, "description": getattr(mod, "DESCRIPTION", ""),
           "command": "python -m linattn.experiments " + name + (f" --workers {workers}" if workers > 1 else ""),
           "grid_size": len(grid), "cells_run": chosen if cells is not None else "all",
           "provenance": prov, "started": started,
           "elapsed_s": round(time.perf_counter() - t0, 1), "rows": rows}
    if hasattr(mod, "summarise") and cells is None:
        doc["summary"] = mod.summarise(rows)
    if out is None and cells is None:
        out = results_path(name)
    if out is not None:
        out = pathlib.Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return doc


def check_out(out) -> pathlib.Path:
    """``out`` as a path where a results file can be written: not a folder, no file among its parents.

    Raises
    ------
    ValueError
        ``out`` names a folder (or ends with a separator), or one of its parents is a file.
    """
    path = pathlib.Path(out)
    if str(out).endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"out must name a results file, got the folder {str(out)!r}")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"out {str(out)!r} lies under {str(parent)!r}, which is a file")
    return path


def train_char_lm(model_kwargs: dict, *, steps: int, lr: float, seed: int, batch_size: int = 32,
                  block_size: int = 128) -> dict:
    """Build, train and evaluate one character model on tiny Shakespeare with the studies' recipe.

    The recipe of the language-model studies (``charlm``, ``positions``, ``modern_lm``): AdamW with
    warm-up and a cosine decay to zero over ``steps``, batches drawn with ``seed``.

    Parameters
    ----------
    model_kwargs : dict
        Keyword arguments of :class:`linattn.TransformerLM` besides the vocabulary size.
    steps, lr, seed : int, float, int
        The budget, the peak learning rate and the seed of the weights and the batches.
    batch_size, block_size : int
        Windows per batch and characters per window.

    Returns
    -------
    dict
        ``val_loss`` (nats per character), ``per_position``, ``train_curve``, ``parameters``,
        ``diverged`` and ``n_windows``: what a study cell records.
    """
    from . import _lm
    return _lm.run(model_kwargs, steps=steps, lr=lr, seed=seed, batch_size=batch_size, block_size=block_size)


def _cell_key(cell: dict) -> str:
    return json.dumps(cell, sort_keys=True)


def _reusable_rows(mod, cells: list[dict]) -> dict:
    """Rows of the study named by ``mod.REUSE_FROM`` whose cell is one of ``cells``, keyed by cell.

    A copied row is marked ``reused_from`` with the source's study and commit; a row that the source
    had itself copied keeps the ``reused_from`` it has, which names where it was computed.
    """
    source = getattr(mod, "REUSE_FROM", None)
    if source is None:
        return {}
    try:
        doc = load_results(source)
    except FileNotFoundError:
        return {}
    wanted = {_cell_key(c) for c in cells}
    out = {}
    for row in doc["rows"]:
        key = _cell_key(row["cell"])
        if key in wanted and key not in out:
            out[key] = dict(row) if "reused_from" in row else dict(
                row, reused_from={"study": source, "commit": doc.get("provenance", {}).get("commit")})
    return out


def _worker(args):
    module, cells = args
    return _run_cells(module, cells, threads=1)


def _iter_rows(name: str, cells: list[dict], progress) -> Iterable[dict]:
    for i, cell in enumerate(cells):
        (row,) = _run_cells(_module_path(name), [cell], threads=1)
        if progress is not None:
            progress(_progress_line(i + 1, len(cells), row))
        yield row


def _progress_line(i: int, n: int, row: dict) -> str:
    return f"[{i}/{n}] {json.dumps(row['cell'], sort_keys=True)} {row['seconds']:.1f} s"


def load_results(name_or_path) -> dict:
    """The results document of a study (by name, from :func:`results_path`, or by path).

    Raises
    ------
    FileNotFoundError
        If there is no results file; the message gives the command that makes it.
    """
    path = pathlib.Path(name_or_path) if str(name_or_path).endswith(".json") else results_path(name_or_path)
    if not path.is_file():
        name = path.stem
        if name in STUDIES:
            raise FileNotFoundError(f"no results file {path}; run: python -m linattn.experiments {name}")
        raise FileNotFoundError(f"no results file {path}, and {name!r} is not a study of linattn.experiments "
                                f"(studies: {', '.join(sorted(STUDIES))}); the chapter that reads it says how "
                                f"it was made")
    return json.loads(path.read_text(encoding="utf-8"))


def check_cell(doc: dict, index: int) -> tuple[dict, dict]:
    """Re-run cell ``index`` of a results document here (one thread); returns (cached, recomputed) results.

    Raises
    ------
    ValueError
        An index that is not one of the document's rows.
    """
    rows = doc["rows"]
    if not (0 <= index < len(rows)):
        raise ValueError(f"index must be in [0, {len(rows)}), got {index}")
    threads = torch.get_num_threads()
    try:
        (fresh,) = _run_cells(_module_path(doc["study"]), [rows[index]["cell"]], threads=1)
    finally:
        torch.set_num_threads(threads)
    return rows[index]["result"], fresh["result"]


# The registered studies (modules of this package).
register("positions", "positions")
register("mqar", "mqar")
register("reassign", "reassign")
register("charlm", "charlm")
register("sp_exchange", "sp_exchange")
register("recall_conv_sweep", "recall_conv_sweep")
register("recall_conv", "recall_conv")
register("modern_lm_sweep", "modern_lm_sweep")
register("modern_lm", "modern_lm")
