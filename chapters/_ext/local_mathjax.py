"""A tiny Sphinx extension for the book's build: MathJax from a local copy, when there is one.

By default the pages load MathJax 3 from its CDN (Sphinx's ``mathjax_path``), so a book
opened without a network shows raw TeX. When a local copy of the MathJax npm package is
available, this extension copies its ``es5`` folder (and its licence) into the build's
``_static/mathjax`` and points ``mathjax_path`` there: the HTML then reads offline, from
``file://`` too. A local copy is available when

* ``LINATTN_MATHJAX_DIR`` names a folder holding ``es5/tex-mml-chtml.js`` (the npm package's
  layout, MathJax 3.x), or, with that variable unset,
* ``.ci/cache/mathjax`` of this repository holds one: ``bash .ci/fetch_mathjax.sh`` puts it
  there (``npm pack mathjax@3.2.2``, extracted; the folder is not committed).

``LINATTN_MATHJAX_DIR=`` (set, empty) keeps the CDN even where the cache exists; a fresh
clone has no cache, so the published site keeps the CDN. A variable that names no MathJax 3
copy is a build warning (an error under ``-W``), not a silent fallback.
tests/book/test_site.py checks both builds in a browser.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Mapping, Optional

from sphinx.util import logging

logger = logging.getLogger(__name__)

ENV = "LINATTN_MATHJAX_DIR"
DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[2] / ".ci" / "cache" / "mathjax"
SCRIPT = "tex-mml-chtml.js"          # the component Sphinx's default mathjax_path loads
STATIC_SUBDIR = "mathjax"            # the copy's folder inside the build's _static


def _problem(folder: pathlib.Path) -> Optional[str]:
    """Why ``folder`` is not a usable MathJax 3 copy, or None if it is one."""
    if not (folder / "es5" / SCRIPT).is_file():
        return f"no es5/{SCRIPT} in {folder}"
    try:
        version = json.loads((folder / "package.json").read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError):
        return f"no package.json with a version in {folder}"
    if not str(version).startswith("3."):
        return f"{folder} holds MathJax {version}; the book's pages are configured for MathJax 3"
    return None


def local_mathjax(environ: Mapping[str, str] = os.environ,
                  default: pathlib.Path = DEFAULT_DIR) -> tuple[Optional[pathlib.Path], Optional[str]]:
    """The local MathJax folder to use (or None for the CDN), and a warning to log (or None)."""
    value = environ.get(ENV)
    if value is None:
        return (default, None) if _problem(default) is None else (None, None)
    if value == "":
        return None, None
    folder = pathlib.Path(value).expanduser().resolve()
    problem = _problem(folder)
    if problem is not None:
        return None, f"{ENV}={value!r} names no MathJax 3 copy ({problem}); the pages load MathJax from the CDN"
    return folder, None


def _configure(app, config) -> None:
    folder, warning = local_mathjax()
    if warning:
        logger.warning(warning)
    if folder is not None:
        config.mathjax_path = f"{STATIC_SUBDIR}/{SCRIPT}"   # relative: Sphinx serves it from _static


def _copy(app) -> None:
    folder, _ = local_mathjax()
    if folder is None or app.builder.format != "html":
        return
    dest = pathlib.Path(app.builder.outdir) / "_static" / STATIC_SUBDIR
    shutil.copytree(folder / "es5", dest, dirs_exist_ok=True)
    if (folder / "LICENSE").is_file():  # MathJax is Apache-2.0: its licence travels with the copy
        shutil.copy2(folder / "LICENSE", dest / "LICENSE")


def setup(app):
    app.connect("config-inited", _configure)
    # Before the pages are written, so that Sphinx finds the file and adds its checksum to the URL.
    app.connect("builder-inited", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1.0"}
