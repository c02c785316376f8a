"""chapters/_ext/local_mathjax.py without a browser: which MathJax a build uses, and the copy.

tests/book/test_site.py checks the real book in Chromium (published: CDN; offline: the copy); these
checks need neither Chromium nor the real MathJax, only Sphinx and a stand-in MathJax folder.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXT_DIR = ROOT / "chapters" / "_ext"
CDN = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"


@pytest.fixture(scope="module")
def ext():
    spec = importlib.util.spec_from_file_location("local_mathjax", EXT_DIR / "local_mathjax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mathjax(folder: pathlib.Path, version: str = "3.2.2") -> pathlib.Path:
    """A stand-in for the MathJax npm package's layout (es5/, LICENSE, package.json)."""
    (folder / "es5" / "output").mkdir(parents=True)
    (folder / "es5" / "tex-mml-chtml.js").write_text("/* stand-in */\n")
    (folder / "es5" / "output" / "font.woff").write_bytes(b"\0")
    (folder / "LICENSE").write_text("Apache License 2.0 (stand-in)\n")
    (folder / "package.json").write_text(json.dumps({"name": "mathjax", "version": version}))
    return folder


def test_which_mathjax_a_build_uses(ext, tmp_path):
    cache = _mathjax(tmp_path / "cache")
    other = _mathjax(tmp_path / "other")
    absent = tmp_path / "absent"
    env = ext.ENV
    assert ext.local_mathjax({}, default=absent) == (None, None)               # fresh clone: the CDN
    assert ext.local_mathjax({}, default=cache) == (cache, None)               # fetched once: the copy
    assert ext.local_mathjax({env: ""}, default=cache) == (None, None)         # set, empty: the CDN
    assert ext.local_mathjax({env: str(other)}, default=cache) == (other.resolve(), None)
    folder, warning = ext.local_mathjax({env: str(absent)}, default=cache)
    assert folder is None and env in warning and "no es5/tex-mml-chtml.js" in warning, warning
    old = _mathjax(tmp_path / "v2", version="2.7.9")
    folder, warning = ext.local_mathjax({env: str(old)}, default=cache)
    assert folder is None and "MathJax 2.7.9" in warning, warning
    assert ext.local_mathjax({}, default=old) == (None, None)                  # an unusable cache: the CDN


def _sphinx_build(tmp_path: pathlib.Path, mathjax_dir: str) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(EXT_DIR)!r})\n"
        "extensions = ['sphinx.ext.mathjax', 'local_mathjax']\n"
        "mathjax3_config = {'options': {}}\n")   # as jupyter-book sets it: MathJax 3 loaded with defer
    (src / "index.rst").write_text("Title\n=====\n\nEnergy :math:`E = mc^2`.\n\n.. toctree::\n\n   sub/page\n")
    (src / "sub").mkdir()
    (src / "sub" / "page.rst").write_text("Page\n====\n\nA square :math:`x^2`.\n")   # one level down
    env = {**os.environ, "LINATTN_MATHJAX_DIR": mathjax_dir}
    return subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "-q", str(src), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)


def _script_srcs(html: pathlib.Path) -> list[str]:
    return [s for s in re.findall(r'<script[^>]*src="([^"]+)"', html.read_text(encoding="utf-8")) if "mathjax" in s]


def test_a_build_with_the_local_copy_serves_it_from_static(tmp_path):
    mathjax = _mathjax(tmp_path / "mathjax")
    proc = _sphinx_build(tmp_path, str(mathjax))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert (out / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()
    assert (out / "_static" / "mathjax" / "output" / "font.woff").is_file()   # the whole es5 folder
    assert (out / "_static" / "mathjax" / "LICENSE").is_file()
    assert [s.split("?")[0] for s in _script_srcs(out / "index.html")] == ["_static/mathjax/tex-mml-chtml.js"]
    assert [s.split("?")[0] for s in _script_srcs(out / "sub" / "page.html")] == ["../_static/mathjax/tex-mml-chtml.js"]


def test_a_build_without_a_local_copy_loads_the_cdn(tmp_path):
    proc = _sphinx_build(tmp_path, "")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert _script_srcs(out / "index.html") == [CDN]
    assert not (out / "_static" / "mathjax").exists()


def test_a_variable_naming_no_copy_fails_a_strict_build(tmp_path):
    proc = _sphinx_build(tmp_path, str(tmp_path / "nowhere"))
    assert proc.returncode != 0
    assert "LINATTN_MATHJAX_DIR" in proc.stdout + proc.stderr
