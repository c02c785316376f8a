"""Structure of the book: table of contents, committed notebooks, citations.

These checks read files only (no notebook is executed here; CI runs nbval for that).
A missing _toc.yml, a listed chapter that does not exist, or a missing references.bib
is a failure, never a skip.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOC = ROOT / "_toc.yml"
BIB = ROOT / "chapters" / "references.bib"
COLAB_TAG = "colab-install"

# {cite}`a`, {cite:t}`a,b`, {cite:p}`a, b`, {cite:ps}`a` ... (MyST roles of sphinxcontrib-bibtex)
CITE_RE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]*)`")
BIB_KEY_RE = re.compile(r"^\s*@\s*(?!comment\b|string\b|preamble\b)\w+\s*[{(]\s*([^,\s]+)\s*,", re.I | re.M)


def _toc_files() -> list[str]:
    """Every document named in _toc.yml (root, files, and nested sections), in order."""
    toc = yaml.safe_load(TOC.read_text(encoding="utf-8"))
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


def _resolve(entry: str) -> pathlib.Path | None:
    """The file a toc entry refers to (the entry may omit or include the extension)."""
    path = ROOT / entry
    if path.suffix in (".ipynb", ".md") and path.is_file():
        return path
    for ext in (".ipynb", ".md"):
        candidate = ROOT / f"{entry}{ext}"
        if candidate.is_file():
            return candidate
    return None


def _notebooks() -> list[pathlib.Path]:
    """Every notebook of the book: those in the toc and any other under chapters/ (collection-safe)."""
    found: set[pathlib.Path] = set((ROOT / "chapters").glob("**/*.ipynb"))
    try:
        for entry in _toc_files():
            path = _resolve(entry)
            if path is not None and path.suffix == ".ipynb":
                found.add(path)
    except (OSError, yaml.YAMLError):
        pass  # test_toc_files_exist reports the broken toc
    return sorted(p for p in found if ".ipynb_checkpoints" not in p.parts)


def _markdown_files() -> list[pathlib.Path]:
    found: set[pathlib.Path] = set((ROOT / "chapters").glob("**/*.md"))
    try:
        for entry in _toc_files():
            path = _resolve(entry)
            if path is not None and path.suffix == ".md":
                found.add(path)
    except (OSError, yaml.YAMLError):
        pass
    return sorted(found)


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


NOTEBOOKS = _notebooks()
NB_IDS = [_rel(p) for p in NOTEBOOKS]


def test_toc_exists_and_parses():
    assert TOC.is_file(), "_toc.yml is missing"
    toc = yaml.safe_load(TOC.read_text(encoding="utf-8"))
    assert isinstance(toc, dict), "_toc.yml does not parse to a mapping"
    assert toc.get("root"), "_toc.yml has no root"
    assert _toc_files(), "_toc.yml lists no files"


def test_toc_files_exist():
    missing = [entry for entry in _toc_files() if _resolve(entry) is None]
    assert not missing, f"listed in _toc.yml but neither .ipynb nor .md exists: {missing}"


def test_toc_has_no_duplicates():
    files = [str(pathlib.PurePosixPath(f).with_suffix("")) for f in _toc_files()]
    dupes = sorted({f for f in files if files.count(f) > 1})
    assert not dupes, f"listed more than once in _toc.yml: {dupes}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_notebook_is_executed_in_order(path):
    nb = _load(path)
    counts = [c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts, f"{_rel(path)} has no code cells"
    unexecuted = [i for i, c in enumerate(counts) if c is None]
    assert not unexecuted, f"{_rel(path)}: code cells {unexecuted} have no execution_count (not executed)"
    assert counts == list(range(1, len(counts) + 1)), (
        f"{_rel(path)}: execution counts {counts} are not 1..{len(counts)} in order (run top to bottom in a fresh kernel)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_notebook_has_no_error_outputs(path):
    nb = _load(path)
    errors = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if out.get("output_type") == "error":
                errors.append((i, out.get("ename"), out.get("evalue")))
    assert not errors, f"{_rel(path)}: error outputs in cells {errors}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_notebook_first_cell_is_colab_install(path):
    nb = _load(path)
    assert nb["cells"], f"{_rel(path)} is empty"
    first = nb["cells"][0]
    assert first["cell_type"] == "code", f"{_rel(path)}: the first cell is not a code cell"
    tags = first.get("metadata", {}).get("tags", [])
    assert COLAB_TAG in tags, f"{_rel(path)}: the first cell is not tagged {COLAB_TAG!r} (tags: {tags})"
    tagged_elsewhere = [i for i, c in enumerate(nb["cells"][1:], 1)
                        if COLAB_TAG in c.get("metadata", {}).get("tags", [])]
    assert not tagged_elsewhere, f"{_rel(path)}: cells {tagged_elsewhere} are also tagged {COLAB_TAG!r}"
    # The repository URL is written once, in _config.yml; the cell is generated from it.
    source = first["source"] if isinstance(first["source"], str) else "".join(first["source"])
    assert source == _execute_script().colab_cell_source(ROOT), (
        f"{_rel(path)}: the Colab cell is not the one _config.yml gives; re-run .ci/execute_notebooks.py"
    )


def _execute_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / ".ci" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repository_url_is_written_in_one_place():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    url = config["repository"]["url"].rstrip("/")
    tracked = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "requirements.txt",
               *(ROOT / "chapters").glob("*.md"), *(ROOT / "linattn").rglob("*.py")]
    holders = [_rel(p) for p in tracked if url in p.read_text(encoding="utf-8")]
    assert holders == [], f"the repository URL is also written in {holders}; read it from _config.yml"


def _bib_keys() -> list[str]:
    return BIB_KEY_RE.findall(BIB.read_text(encoding="utf-8"))


def _citations(text: str) -> list[str]:
    keys = []
    for group in CITE_RE.findall(text):
        keys.extend(k.strip() for k in group.split(",") if k.strip())
    return keys


def test_bibliography_exists_and_keys_are_unique():
    assert BIB.is_file(), "chapters/references.bib is missing"
    keys = _bib_keys()
    assert keys, "chapters/references.bib has no entries"
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    assert not dupes, f"duplicate keys in references.bib: {dupes}"


def test_citation_regex_self_check():
    text = "see {cite}`a2020x` and {cite:t}`b, c_d` or {cite:p}`e-f,g:h` but not `{cite}` alone"
    assert _citations(text) == ["a2020x", "b", "c_d", "e-f", "g:h"]
    assert BIB_KEY_RE.findall("@article{k1,\n x={y}}\n@InProceedings{ k2 ,\n}\n@comment{no,}") == ["k1", "k2"]


def test_every_citation_is_in_references_bib():
    keys = set(_bib_keys())
    unknown: dict[str, list[str]] = {}
    for path in NOTEBOOKS:
        for cell in _load(path)["cells"]:
            if cell["cell_type"] == "markdown":
                for key in _citations(_source(cell)):
                    if key not in keys:
                        unknown.setdefault(_rel(path), []).append(key)
    for path in _markdown_files():
        for key in _citations(path.read_text(encoding="utf-8")):
            if key not in keys:
                unknown.setdefault(_rel(path), []).append(key)
    assert not unknown, f"cited but not in chapters/references.bib: {unknown}"
