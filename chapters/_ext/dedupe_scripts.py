"""A tiny Sphinx extension for the book's build: drop repeated ``<script>`` entries of a page.

sphinx-thebe 0.3.1 (loaded by every jupyter-book 1.0 build) registers an inline script that
declares ``const THEBE_JS_URL``; Sphinx 7.4 emits it twice per page (once registered with
filename ``None``, once with ``''``), and the browser reports a SyntaxError on the second
copy. This extension removes exact repeats (same file, or same inline body, and the same
attributes) from each page's script list, keeping the first. tests/book/test_site.py checks that
no page logs a JavaScript error.
"""
from __future__ import annotations


def _key(script) -> tuple:
    # An inline script's filename is None or '' depending on how it was registered (the
    # object's str() is then 'None' or ''): both mean "no file".
    filename = getattr(script, "filename", script) or ""
    attributes = getattr(script, "attributes", {}) or {}
    return filename, tuple(sorted((k, str(v)) for k, v in attributes.items()))


def _dedupe(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1.0"}
