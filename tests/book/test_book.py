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

import booktools

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOC = ROOT / "_toc.yml"
BIB = ROOT / "chapters" / "references.bib"
COLAB_TAG = "colab-install"

# {cite}`a`, {cite:t}`a,b`, {cite:p}`a, b`, {cite:ps}`a` ... (MyST roles of sphinxcontrib-bibtex)
CITE_RE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]*)`")
BIB_KEY_RE = re.compile(r"^\s*@\s*(?!comment\b|string\b|preamble\b)\w+\s*[{(]\s*([^,\s]+)\s*,", re.I | re.M)


def _toc_files() -> list[str]:
    """Every document named in _toc.yml (root, files, and nested sections), in order."""
    return booktools.toc_entries()


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
    assert "remove-cell" in tags, f"{_rel(path)}: the Colab cell must be tagged 'remove-cell' (kept off the page)"
    tagged_elsewhere = [i for i, c in enumerate(nb["cells"][1:], 1)
                        if COLAB_TAG in c.get("metadata", {}).get("tags", [])]
    assert not tagged_elsewhere, f"{_rel(path)}: cells {tagged_elsewhere} are also tagged {COLAB_TAG!r}"
    # The repository URL is written once, in _config.yml; the cell is generated from it.
    source = first["source"] if isinstance(first["source"], str) else "".join(first["source"])
    assert source == _execute_script().colab_cell_source(ROOT), (
        f"{_rel(path)}: the Colab cell is not the one _config.yml gives; re-run .ci/execute_notebooks.py"
    )


def _execute_script():
    return booktools.execute_script()


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


def test_bibliography_parses_strictly():
    """Every entry is well formed (a missing brace would merge two entries and lose one)."""
    pybtex_database = pytest.importorskip("pybtex.database")
    from pybtex import errors

    errors.set_strict_mode(True)
    try:
        db = pybtex_database.parse_file(str(BIB))
    finally:
        errors.set_strict_mode(False)
    assert sorted(db.entries.keys()) == sorted(_bib_keys())
    for key, entry in db.entries.items():
        assert entry.fields.get("title") and entry.fields.get("year"), f"{key}: needs a title and a year"


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


# --------------------------------------------------------------------------- the book as a reader sees it

# Device-specific text: the committed outputs are CPU outputs and must read the same on any machine.
DEVICE_RE = re.compile(r"cuda|\bGPU\b|nvidia|tesla|geforce|\b(T4|A100|H100|V100|L4)\b|device\(type=", re.I)
LEVEL2_RE = re.compile(r"^##\s+(.*?)\s*$", re.M)
SUMMARY_BOX_RE = re.compile(r"^(```|:::)\{admonition\}\s*Summary\b", re.M | re.I)


def _output_texts(cell) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            texts.append("".join(out.get("text", "")))
        elif out.get("output_type") == "error":
            texts.append(f"{out.get('ename')}: {out.get('evalue')}")
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/"):
                texts.append("".join(value) if isinstance(value, list) else value)
    return texts


def _uses_cuda(nb) -> bool:
    """Whether any code cell after the Colab install cell mentions CUDA."""
    return any("cuda" in _source(c).lower() for c in nb["cells"][1:] if c["cell_type"] == "code")


# Chapters whose code runs on the CPU only: on Colab they must not take a GPU runtime from the
# reader's quota for nothing (and on the free tier risk "cannot connect to a GPU backend").
CPU_ONLY_CHAPTERS = {"01_softmax_attention", "02_kernel_trick", "03_associativity",
                     "04_causal_recurrence", "05_chunkwise"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_notebook_asks_colab_for_the_runtime_it_uses(path):
    nb = _load(path)
    meta = nb["metadata"]
    asks_gpu = meta.get("accelerator") == "GPU"
    assert "colab" in meta, f"{_rel(path)}: no metadata.colab"
    assert asks_gpu == bool(meta["colab"].get("gpuType")), (
        f"{_rel(path)}: metadata.accelerator {meta.get('accelerator')!r} and colab.gpuType "
        f"{meta['colab'].get('gpuType')!r} disagree")
    if _uses_cuda(nb):
        assert asks_gpu, f"{_rel(path)}: its code uses CUDA, but it does not ask Colab for a GPU"
    if path.stem in CPU_ONLY_CHAPTERS:
        assert not _uses_cuda(nb), f"{_rel(path)}: listed as CPU only, but its code mentions CUDA"
        assert not asks_gpu, f"{_rel(path)}: runs on the CPU only, but asks Colab for a GPU runtime"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_committed_outputs_are_device_neutral(path):
    """Outputs are computed on CPU; GPU-only cells print nothing there, so nothing names a device."""
    found = []
    for i, cell in enumerate(_load(path)["cells"]):
        for text in _output_texts(cell) if cell["cell_type"] == "code" else []:
            for match in DEVICE_RE.finditer(text):
                found.append((i, text[max(0, match.start() - 40):match.end() + 40]))
    assert not found, f"{_rel(path)}: device-specific text in committed outputs: {found}"


def test_device_regex_self_check():
    assert DEVICE_RE.search("Tesla T4, Triton kernels available: True")
    assert DEVICE_RE.search("device(type='cuda', index=0)")
    assert not DEVICE_RE.search("speed-up 4.1x at T = 4096 (chunk vs sdpa)")


def _appendix_notebooks() -> set[pathlib.Path]:
    """The notebooks listed under an appendix part of _toc.yml (a caption with "Appendix"/"Appendices")."""
    toc = yaml.safe_load(TOC.read_text(encoding="utf-8"))
    found = set()
    for part in toc.get("parts", []):
        if re.search(r"appendi", part.get("caption", ""), re.I):
            stack = list(part.get("chapters", []))
            while stack:
                entry = stack.pop()
                path = _resolve(entry["file"]) if entry.get("file") else None
                if path is not None and path.suffix == ".ipynb":
                    found.add(path)
                stack.extend(entry.get("sections", []))
    return found


# '# 11. Title' for a chapter, '# A. Title' for an appendix.
TITLE_RE = re.compile(r"#\s+(?:(?P<number>\d+)|(?P<letter>[A-Z]))\.\s+\S")


def test_title_regex_self_check():
    assert TITLE_RE.match("# 11. Performance").group("number") == "11"
    assert TITLE_RE.match("# A. Inside linattn on the CPU").group("letter") == "A"
    assert not TITLE_RE.match("# Performance") and not TITLE_RE.match("# AB. Title")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_chapter_opens_with_goals_and_prerequisites(path):
    cells = _load(path)["cells"]
    assert len(cells) > 1 and cells[1]["cell_type"] == "markdown", (
        f"{_rel(path)}: the cell after the Colab cell is not the chapter's opening text"
    )
    text = _source(cells[1])
    title = TITLE_RE.match(text)
    assert title, f"{_rel(path)}: the opening cell does not start with '# N. Title' (or '# A. Title' for an appendix)"
    if path in _appendix_notebooks():
        assert title.group("letter"), f"{_rel(path)}: an appendix opens with '# A. Title' (a letter), not a number"
    else:
        assert title.group("number"), f"{_rel(path)}: a chapter opens with '# N. Title' (a number); a letter is for appendices"
    goals = re.search(r"\*\*Learning goals\*\*:?\s*\n((?:\s*\n)*(?:[-*]\s+.+\n?)+)", text)
    assert goals, f"{_rel(path)}: no '**Learning goals**' followed by a bullet list in the opening cell"
    assert re.search(r"\*\*Prerequisites\*?\*?:?", text), f"{_rel(path)}: no '**Prerequisites**' in the opening cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_chapter_ends_with_summary_and_exercises(path):
    """The last sections are a summary and then exercises, whose solutions are folded: code cells with input and
    output collapsed, prose in a dropdown.

    An appendix (measurements in full, no new material to practise) may end with its summary and
    leave the exercises out; if it has exercises, they follow the same rules as a chapter's."""
    cells = _load(path)["cells"]
    marks = []  # (cell index, position, section), in reading order
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        marks += [(i, m.start(), m.group(1)) for m in LEVEL2_RE.finditer(text)]
        marks += [(i, m.start(), "Summary") for m in SUMMARY_BOX_RE.finditer(text)]
    names = [name for _, _, name in sorted(marks)]
    if path in _appendix_notebooks() and "Exercises" not in names:
        assert names[-1:] == ["Summary"], (
            f"{_rel(path)}: an appendix without exercises ends with its summary; its last section is {names[-1:]}")
        return
    assert names[-2:] == ["Summary", "Exercises"], (
        f"{_rel(path)}: the last sections are {names[-2:]}, not ['Summary', 'Exercises'] "
        "(a '## Summary' heading or a Summary admonition, then '## Exercises')"
    )
    start = max(i for i, _, name in marks if name == "Exercises")
    solutions = [(i, c.get("metadata", {}).get("tags", [])) for i, c in enumerate(cells[start + 1:], start + 1)
                 if c["cell_type"] == "code"]
    assert solutions, f"{_rel(path)}: the exercises have no solution cells"
    open_ = [i for i, tags in solutions if not {"hide-input", "hide-output"} <= set(tags)]
    assert not open_, f"{_rel(path)}: solution cells {open_} are not tagged 'hide-input' and 'hide-output'"
    shown = [i for i, c in enumerate(cells[start + 1:], start + 1) if c["cell_type"] == "markdown"
             and re.match(r"\*\*Solution \d+\.?\*\*\.?\s*\S", _source(c))]
    assert not shown, f"{_rel(path)}: solution text in cells {shown} is not folded (a ':::{{dropdown}} Solution N')"


def test_how_to_run_page_comes_first_and_is_linked_from_the_index():
    files = [str(pathlib.PurePosixPath(f).with_suffix("")) for f in _toc_files()]
    assert "chapters/how_to_run" in files, "chapters/how_to_run is not in _toc.yml"
    assert files.index("chapters/how_to_run") == 1, "the how-to-run page is not the first page after the root"
    index = (ROOT / "chapters" / "index.md").read_text(encoding="utf-8")
    assert "](how_to_run.md)" in index, "chapters/index.md does not link to how_to_run.md"
    page = (ROOT / "chapters" / "how_to_run.md").read_text(encoding="utf-8")
    # It describes what the execute script and the Colab cell really do.
    assert "execute_notebooks.py" in page and "NBVAL_IGNORE_OUTPUT" in page and "requirements.txt" in page
    for phrase in ("Colab", "GPU", "collapsed", "notation"):
        assert phrase.lower() in page.lower(), f"how_to_run.md does not mention {phrase!r}"


def _notation_rows() -> list[list[str]]:
    """The body rows of every table on the notation page (the page may hold one table per
    chapter group; each table's header row, the one above its ``|---|`` line, is left out)."""
    lines = (ROOT / "chapters" / "notation.md").read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.match(r"\|\s*:?-", line):
            continue
        if i + 1 < len(lines) and re.match(r"\|\s*:?-", lines[i + 1]):
            continue  # a header row
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_notation_gives_each_symbol_one_meaning():
    symbols = []
    for row in _notation_rows():
        symbols += [s.strip() for s in re.split(r",\s*(?=\$)", row[0]) if s.strip()]  # "$T$, $T_q$" -> 2
    dupes = sorted({s for s in symbols if symbols.count(s) > 1})
    assert symbols and not dupes, f"chapters/notation.md defines these symbols more than once: {dupes}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_plot_cells_label_axes_and_state_a_title(path):
    """A cell that draws a figure names its axes and gives it a title (units and wording: reviewers)."""
    bad = []
    for i, cell in enumerate(_load(path)["cells"]):
        src = _source(cell)
        if cell["cell_type"] != "code" or not any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
            continue
        missing = [what for what, pattern in (("x label", r"xlabel"), ("y label", r"ylabel"), ("title", r"title"))
                   if not re.search(pattern, src)]
        if missing:
            bad.append((i, missing))
    assert not bad, f"{_rel(path)}: plotting cells without {bad} (finish them with linattn.utils.finish_figure)"


def _png_size(data: str) -> tuple[int, int]:
    import base64
    import struct

    head = base64.b64decode("".join(data)[:64])
    return struct.unpack(">II", head[16:24])


# Figures that are shown scaled down at the column width (text below 7 pt); they need a
# narrower figsize (or linattn.utils.book_figure) and a re-run of their notebook.
KNOWN_WIDE_FIGURES: set[str] = set()


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="figure wider than the column (see KNOWN_WIDE_FIGURES)"))
    if p.stem in KNOWN_WIDE_FIGURES else p for p in NOTEBOOKS], ids=NB_IDS)
def test_committed_figures_are_readable_at_column_width(path):
    """At the book style's 110 dpi, a figure wider than the column is shrunk to fit it; its
    smallest text (9 pt legends) must stay at 7 pt or more."""
    from linattn.book import COLUMN_WIDTH_IN

    column_px = COLUMN_WIDTH_IN * 110
    widest = 0
    for cell in _load(path)["cells"]:
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                widest = max(widest, _png_size(out["data"]["image/png"])[0])
    smallest_pt = 9 * min(1.0, column_px / widest) if widest else 9
    assert smallest_pt >= 7, (
        f"{_rel(path)}: a figure {widest} px wide is shown at {column_px:.0f} px, its 9-pt text at "
        f"{smallest_pt:.1f} pt; use linattn.utils.book_figure (column width) and re-run the notebook"
    )


# --------------------------------------------------------------------------- printed lines and figure captions

# The book's text column shows about 80 characters of a code cell's output; longer lines are
# clipped on the page (a reader loses their end) or wrapped in a notebook viewer.
MAX_OUTPUT_LINE = 80


def _output_lines(cell) -> list[str]:
    """Every stored line a reader can see printed: stream text and text/plain results."""
    lines = []
    for out in cell.get("outputs", []):
        texts = []
        if out.get("output_type") == "stream":
            texts.append(out.get("text", ""))
        elif "text/plain" in out.get("data", {}):
            texts.append(out["data"]["text/plain"])
        for text in texts:
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_stored_output_lines_fit_the_column(path):
    """Every stored output line, NBVAL_IGNORE_OUTPUT cells included, is at most 80 characters."""
    long_lines = []
    for i, cell in enumerate(_load(path)["cells"]):
        if cell["cell_type"] == "code":
            long_lines += [(i, len(line), line[:60] + "…") for line in _output_lines(cell)
                           if len(line) > MAX_OUTPUT_LINE]
    assert not long_lines, (
        f"{_rel(path)}: {len(long_lines)} stored output lines are longer than {MAX_OUTPUT_LINE} "
        f"characters (cell, length, start): {long_lines}")


def test_output_line_check_self_check():
    cell = {"outputs": [{"output_type": "stream", "text": ["ok\n", "x" * 81 + "\n"]},
                        {"output_type": "execute_result", "data": {"text/plain": "y" * 80}},
                        {"output_type": "display_data", "data": {"image/png": "z" * 200}}]}
    assert [len(line) for line in _output_lines(cell)] == [2, 81, 80]


# An alt text that is only a file name (what Sphinx writes when a figure has none).
FILE_NAME_RE = re.compile(r"^\S+\.(png|jpe?g|svg|gif|pdf)$", re.I)


def _image_cells(nb) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and any(mime.startswith("image/") for o in c.get("outputs", []) for mime in o.get("data", {}))]


def _figure_problems(index: int, cell: dict) -> list[str]:
    """What a figure cell lacks: myst-nb's figure caption and name, and the image's alt text."""
    meta = cell.get("metadata", {}).get("mystnb", {})
    figure, image = meta.get("figure", {}), meta.get("image", {})
    problems = []
    if not str(figure.get("caption", "")).strip():
        problems.append(f"cell {index}: no metadata.mystnb.figure.caption")
    if not str(figure.get("name", "")).startswith("fig-"):
        problems.append(f"cell {index}: metadata.mystnb.figure.name is not 'fig-…' (got {figure.get('name')!r})")
    alt = str(image.get("alt", "")).strip()
    if not alt or FILE_NAME_RE.match(alt):
        problems.append(f"cell {index}: metadata.mystnb.image.alt is empty or a file name ({alt!r})")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NB_IDS)
def test_every_figure_has_a_caption_and_alt_text(path):
    """A cell that outputs an image carries, in its metadata, the caption myst-nb puts under the
    figure, a figure name to refer to it by, and the alt text a screen reader reads instead."""
    problems = [p for i, cell in _image_cells(_load(path)) for p in _figure_problems(i, cell)]
    assert not problems, f"{_rel(path)}: " + "; ".join(problems)


def test_figure_names_are_unique_in_the_book():
    names = [c["metadata"]["mystnb"]["figure"]["name"] for path in NOTEBOOKS for _, c in _image_cells(_load(path))
             if c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("name")]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"figure names used more than once (the build fails on them): {dupes}"


def test_figure_check_self_check():
    good = {"metadata": {"mystnb": {"figure": {"caption": "A caption.", "name": "fig-x"},
                                    "image": {"alt": "A line that rises."}}}}
    assert _figure_problems(0, good) == []
    bad = {"metadata": {"mystnb": {"image": {"alt": "3f2a9c.png"}}}}
    assert len(_figure_problems(0, bad)) == 3
