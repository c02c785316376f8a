"""The built site in a real browser: every page of the HTML book, loaded in headless Chromium.

The module builds the book into a temporary directory (it never relies on an existing
``_build``), serves it on 127.0.0.1 and loads every HTML page the build produced (discovered
from the build output, so new chapters are covered without editing this file) in the
system's Chromium, driven by Playwright. For each page it checks:

* no JavaScript console errors, no uncaught exceptions and no HTTP error responses (one
  exception, explained where it is allowed: the browser's report of an external request
  this test refused, since it runs offline);
* every image has loaded (``complete`` and a non-zero ``naturalWidth``), has an alt text that
  is not its file name, and, if it belongs to the page's content, sits in a figure with a
  caption (checked page by page, one test per page of the toc);
* every math expression (``span.math``/``div.math``) is typeset by MathJax (CHTML output),
  with no MathJax error and no undefined macro, and no raw TeX delimiters left in the
  visible text;
* every internal link resolves to a file of the build (HTTP 200 from the test server) and
  every ``#anchor`` is an id on its target page; external links (never fetched: the test
  runs offline) are well formed;
* notebook pages carry a Colab launch button that opens exactly that notebook on the
  repository and branch configured in ``_config.yml``; other pages carry none.

MathJax: the book is built twice, as published and as read offline.

* Published (``LINATTN_MATHJAX_DIR=``, what a fresh clone builds): the pages load MathJax
  from its CDN. The browser here has no network, so the test intercepts that CDN address and
  serves the same files from a local copy of the MathJax npm package (``bash
  .ci/fetch_mathjax.sh`` puts it into ``.ci/cache/mathjax``; ``LINATTN_MATHJAX_DIR`` points
  elsewhere). Every other request that leaves 127.0.0.1 is refused and listed in the summary.
  All the checks above run on this build.
* Offline (``LINATTN_MATHJAX_DIR`` set to that copy): chapters/_ext/local_mathjax.py copies
  MathJax into the build, and every page is opened as a reader opens ``_build/html`` without
  a network, from ``file://`` with every other request refused: MathJax must come from the
  build itself, and every expression, image and console must pass the same checks.

``test_the_checks_catch_a_broken_page`` runs the same checks on a deliberately broken page,
so that none of them passes vacuously.

A full-page screenshot of every page of the published build and a ``summary.json`` with the counts are written to
``_build/test-artifacts/site`` (or ``$LINATTN_SITE_ARTIFACTS``).

Skipped, with the reason, where Chromium (``/usr/bin/chromium`` or ``$LINATTN_CHROMIUM``),
the ``playwright`` package or the local MathJax copy is missing; ``.ci/run`` installs all
three and sets ``LINATTN_REQUIRE_SITE_TEST=1``, which turns that skip into a failure.
"""
from __future__ import annotations

import functools
import html.parser
import http.server
import json
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

import booktools

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "_config.yml"
CHROMIUM = pathlib.Path(os.environ.get("LINATTN_CHROMIUM", "/usr/bin/chromium"))
MATHJAX_DIR = pathlib.Path(os.environ.get("LINATTN_MATHJAX_DIR") or ROOT / ".ci" / "cache" / "mathjax")
ARTIFACTS = pathlib.Path(os.environ.get("LINATTN_SITE_ARTIFACTS", ROOT / "_build" / "test-artifacts" / "site"))
# The one address the published pages load MathJax from (Sphinx's default mathjax_path).
CDN_PREFIX = "https://cdn.jsdelivr.net/npm/mathjax@3/"
# Where chapters/_ext/local_mathjax.py puts the copy in a build, relative to the HTML root.
LOCAL_SCRIPT = "_static/mathjax/tex-mml-chtml.js"

# Flags known to keep headless Chromium quiet on a machine with a closed network: without the
# background-networking ones it keeps trying to reach Google's services at every start.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 900}
PAGE_TIMEOUT_MS = 60_000
# Directories of the build output that hold assets, not pages.
ASSET_DIRS = {"_static", "_sources", "_images", "_downloads"}


# --------------------------------------------------------------------------- configuration

def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def _toc_files() -> list[str]:
    return [str(pathlib.PurePosixPath(f).with_suffix("")) if f.endswith((".md", ".ipynb")) else f
            for f in booktools.toc_entries()]


def _expected_colab_url(config: dict, pagename: str) -> str:
    """Where the Colab button of notebook ``pagename`` must point, computed from _config.yml alone."""
    repo = config["repository"]
    parts = urllib.parse.urlparse(repo["url"])
    assert parts.netloc == "github.com", f"_config.yml: Colab opens GitHub repositories only, not {repo['url']}"
    org, name = parts.path.strip("/").split("/")[:2]
    branch = repo.get("branch") or "master"  # jupyter-book's default
    book = str(repo.get("path_to_book") or "").strip("/")
    path = "/".join(p for p in (book, f"{pagename}.ipynb") if p)
    colab = config["launch_buttons"]["colab_url"].rstrip("/")
    return f"{colab}/github/{org}/{name.removesuffix('.git')}/blob/{branch}/{path}"


# --------------------------------------------------------------------------- static HTML helpers

class _StaticPage(html.parser.HTMLParser):
    """Ids, meta refresh target and script sources of an HTML file, without a browser."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.refresh: str | None = None
        self.scripts: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag == "meta" and (a.get("http-equiv") or "").lower() == "refresh":
            m = re.search(r"url\s*=\s*(\S+)", a.get("content") or "", re.I)
            self.refresh = m.group(1).strip("'\"") if m else None
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])


@functools.lru_cache(maxsize=None)
def _static(path: pathlib.Path) -> _StaticPage:
    parser = _StaticPage()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


# --------------------------------------------------------------------------- in-page probe

# Runs in the page once it has loaded, MathJax has finished and every image has settled.
PROBE_JS = r"""
(colabPrefix) => {
  const visibleText = (root) => {
    // Text a reader sees outside code, scripts and typeset math.
    const skip = 'pre, code, script, style, textarea, noscript, mjx-container, .MathJax, template';
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, {
      acceptNode: (n) => (n.parentElement && n.parentElement.closest(skip))
        ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT });
    const out = [];
    for (let n = walker.nextNode(); n; n = walker.nextNode()) out.push(n.nodeValue);
    return out.join(' ');
  };
  const text = visibleText(document.body);
  const rawTex = [];
  for (const re of [/\\\(|\\\)|\\\[|\\\]/g, /\$\$/g, /\$[^$\s][^$\n]*?[\\^_{}][^$\n]*?\$/g]) {
    for (const m of text.matchAll(re)) {
      rawTex.push(text.slice(Math.max(0, m.index - 40), m.index + m[0].length + 40));
    }
  }
  const mathSources = Array.from(document.querySelectorAll('span.math, div.math'));
  const mj = window.MathJax;
  // MathJax's own view of what it typeset: error nodes, and undefined macros, which its
  // noundefined extension renders as red text instead of an error.
  const internalErrors = [];
  if (mj && mj.startup && mj.startup.document && mj.startup.document.math) {
    for (const item of mj.startup.document.math) {
      item.root.walkTree((node) => {
        if (node.isKind('merror')) {
          internalErrors.push('error in TeX: ' + item.math);
        } else if (node.isKind('mtext') && node.attributes.get('mathcolor') === 'red') {
          const t = node.childNodes.map((c) => (c.getText ? c.getText() : '')).join('');
          if (t.startsWith('\\')) internalErrors.push('undefined macro ' + t + ' in ' + item.math);
        }
      });
    }
  }
  return {
    url: location.href,
    title: document.title,
    // Sphinx declares DOCUMENTATION_OPTIONS with `const`: a global binding, not a window property.
    pagename: (typeof DOCUMENTATION_OPTIONS !== 'undefined' && DOCUMENTATION_OPTIONS.pagename) || null,
    images: Array.from(document.images).map((img) => {
      const figure = img.closest('figure');
      const caption = figure ? figure.querySelector('figcaption') : null;
      return {
        src: img.currentSrc || img.src, complete: img.complete, naturalWidth: img.naturalWidth,
        alt: img.getAttribute('alt'),
        // A figure of the page's own content, inside the theme's <article> (not the icons of
        // its header bar, such as the launch menu's Colab logo): it needs a caption.
        inArticle: !!img.closest('article'),
        caption: caption ? caption.textContent.trim() : null };
    }),
    math: {
      mathjax: mj && mj.version ? mj.version : null,
      output: mj && mj.startup && mj.startup.output ? mj.startup.output.name : null,
      sources: mathSources.length,
      untypeset: mathSources.filter((el) => !el.querySelector('mjx-container'))
                            .map((el) => el.textContent.slice(0, 120)),
      containers: document.querySelectorAll('mjx-container').length,
      errors: Array.from(document.querySelectorAll('[data-mjx-error], mjx-merror:not([data-mjx-error])'))
                   .map((el) => el.getAttribute('data-mjx-error') || el.textContent.slice(0, 120))
                   .concat(internalErrors),
      rawTex: rawTex,
    },
    links: Array.from(document.querySelectorAll('a[href]')).map((a) => ({
      href: a.getAttribute('href'), resolved: a.href, text: a.textContent.trim().slice(0, 60) })),
    ids: Array.from(document.querySelectorAll('[id], a[name]')).map((el) => el.id || el.getAttribute('name')),
    colab: Array.from(document.querySelectorAll('a[href]'))
                .map((a) => a.href).filter((h) => h.startsWith(colabPrefix)),
    repoButtons: Array.from(document.querySelectorAll('a.btn-source-repository-button')).map((a) => a.href),
  };
}
"""

SETTLE_JS = r"""
async () => {
  // Wait for MathJax's initial typesetting (its startup promise), web fonts and every image.
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
    await window.MathJax.startup.promise;
  }
  await Promise.all(Array.from(document.images).map((img) => {
    if (img.loading === 'lazy') img.loading = 'eager';
    return img.complete ? null : new Promise((resolve) => {
      img.addEventListener('load', resolve, { once: true });
      img.addEventListener('error', resolve, { once: true });
    });
  }));
  await document.fonts.ready;
  return true;
}
"""


# --------------------------------------------------------------------------- fixtures

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass


def _unavailable(reason: str):
    """Skip (with the reason) where the browser tools are missing; in CI, where they must be there, fail."""
    if os.environ.get("LINATTN_REQUIRE_SITE_TEST") == "1":
        pytest.fail(f"LINATTN_REQUIRE_SITE_TEST=1 but {reason}")
    pytest.skip(f"browser test of the site not run: {reason}")


@pytest.fixture(scope="module")
def browser_tools():
    """Playwright, Chromium and the local MathJax copy, or a skip that says what to install."""
    missing = []
    if not CHROMIUM.is_file():
        missing.append(f"Chromium ({CHROMIUM}: apt-get install chromium, or set LINATTN_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright package (pip install -r requirements.txt)")
    if not (MATHJAX_DIR / "es5").is_dir():
        missing.append(f"a local MathJax copy in {MATHJAX_DIR} (bash .ci/fetch_mathjax.sh, needs npm)")
    if missing:
        _unavailable("it needs " + "; ".join(missing))
    return sync_playwright


def _build(out: pathlib.Path, mathjax_dir: str) -> tuple[pathlib.Path, float]:
    """A fresh build of the book into ``out`` with ``LINATTN_MATHJAX_DIR=mathjax_dir``; (html dir, seconds)."""
    exe = pathlib.Path(sys.executable).with_name("jupyter-book")
    cmd = [str(exe) if exe.is_file() else (shutil.which("jupyter-book") or "jupyter-book"),
           "build", str(ROOT), "--path-output", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "LINATTN_MATHJAX_DIR": mathjax_dir})
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, f"jupyter-book build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    html_dir = out / "_build" / "html"
    assert (html_dir / "index.html").is_file(), f"the build wrote no {html_dir / 'index.html'}"
    return html_dir, seconds


@pytest.fixture(scope="module")
def built_site(browser_tools, tmp_path_factory):
    """A fresh build of the book as published: MathJax from the CDN (the test never trusts an existing _build)."""
    return _build(tmp_path_factory.mktemp("site"), mathjax_dir="")


@pytest.fixture(scope="module")
def offline_site(browser_tools, tmp_path_factory):
    """A fresh build with the local MathJax copy, as a reader builds it to read offline."""
    return _build(tmp_path_factory.mktemp("offline-site"), mathjax_dir=str(MATHJAX_DIR))


@pytest.fixture(scope="module")
def server(built_site):
    html_dir, _ = built_site
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def _pages(html_dir: pathlib.Path) -> list[str]:
    """Every HTML page of the build (relative POSIX paths), assets excluded."""
    pages = []
    for path in html_dir.rglob("*.html"):
        rel = path.relative_to(html_dir)
        if rel.parts[0] not in ASSET_DIRS:
            pages.append(rel.as_posix())
    return sorted(pages)


def _mathjax_script(html_dir: pathlib.Path, pages: list[str]) -> str | None:
    """The MathJax script the built pages load (one for the whole book): a URL, or a path
    relative to ``html_dir`` (query string dropped) for a copy inside the build."""
    srcs = set()
    for page in pages:
        for src in _static(html_dir / page).scripts:
            if "mathjax" not in src.lower():
                continue
            if urllib.parse.urlsplit(src).scheme:
                srcs.add(src)
            else:
                srcs.add(posixpath.normpath(posixpath.join(posixpath.dirname(page), urllib.parse.urlsplit(src).path)))
    assert len(srcs) <= 1, f"the pages load MathJax from several addresses: {sorted(srcs)}"
    return srcs.pop() if srcs else None


def crawl_site(sync_playwright, html_dir: pathlib.Path, server: str, artifacts: pathlib.Path,
               colab_prefix: str, screenshots: bool = True) -> dict:
    """Load every page of ``html_dir`` (served at ``server``, an http:// or file:// prefix) once in
    Chromium; collect what the tests check."""
    pages = _pages(html_dir)
    assert pages, f"the build produced no pages in {html_dir}"

    # MathJax inside the build must be there; from the CDN, the local copy that stands in for the
    # CDN must serve the very file, and the major version, the pages ask for.
    script = _mathjax_script(html_dir, pages)
    mathjax_prefix = None
    if script is not None and not urllib.parse.urlsplit(script).scheme:
        assert (html_dir / script).is_file(), f"the pages load {script}, which is not in the build"
    elif script is not None:
        m = re.match(r"(https://[^/]+/npm/mathjax@(\d+)[^/]*/)(.*)$", script)
        assert m, f"unexpected MathJax address {script}; teach tests/book/test_site.py where it maps locally"
        mathjax_prefix, cdn_major, script_rel = m.group(1), m.group(2), m.group(3)
        local_version = json.loads((MATHJAX_DIR / "package.json").read_text())["version"]
        assert local_version.split(".")[0] == cdn_major, (
            f"the pages ask for MathJax {cdn_major}.x, the local copy is {local_version}")
        assert (MATHJAX_DIR / script_rel).is_file(), (
            f"the pages load {script_rel} from the CDN; the local copy {MATHJAX_DIR} lacks it")

    # Fresh artefacts: drop the screenshots of an earlier run (only the files this test writes).
    if screenshots:
        artifacts.mkdir(parents=True, exist_ok=True)
        for old in [*artifacts.glob("*.png"), artifacts / "summary.json"]:
            old.unlink(missing_ok=True)

    blocked: list[str] = []
    mathjax_served: list[str] = []
    mathjax_missing: list[str] = []

    def route(r):
        url = r.request.url
        if url.startswith(server):
            return r.continue_()
        if mathjax_prefix and url.startswith(mathjax_prefix):
            rel = urllib.parse.unquote(urllib.parse.urlsplit(url[len(mathjax_prefix):]).path)
            local = (MATHJAX_DIR / rel).resolve()
            if MATHJAX_DIR.resolve() in local.parents and local.is_file():
                mathjax_served.append(rel)
                # The CDN sends this header too: MathJax's web fonts are cross-origin requests.
                return r.fulfill(path=str(local), headers={"Access-Control-Allow-Origin": "*"})
            mathjax_missing.append(url)
            return r.fulfill(status=404, body="not in the local MathJax copy")
        blocked.append(url)
        return r.abort("blockedbyclient")

    results: dict[str, dict] = {}
    shot_seconds = 0.0
    start = time.perf_counter()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport=VIEWPORT, service_workers="block")
        context.route("**/*", route)
        for rel in pages:
            page = context.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            console: list[dict] = []
            page_errors: list[str] = []
            bad_responses: list[str] = []
            page.on("console", lambda msg, out=console: out.append(
                {"type": msg.type, "text": msg.text, "url": (msg.location or {}).get("url", "")}))
            page.on("pageerror", lambda exc, out=page_errors: out.append(str(exc)))
            page.on("response", lambda resp, out=bad_responses: out.append(f"{resp.status} {resp.url}")
                    if resp.status >= 400 else None)
            url = server + rel
            page.goto(url, wait_until="load")
            static = _static(html_dir / rel)
            if static.refresh is not None:  # a redirect page: it must land on its target
                target = urllib.parse.urljoin(url, static.refresh)
                page.wait_for_url(target, wait_until="load")
            page.evaluate(SETTLE_JS)
            data = page.evaluate(PROBE_JS, colab_prefix)
            shot = None
            if screenshots:
                shot = artifacts / (rel.replace("/", "__").removesuffix(".html") + ".png")
                shot_start = time.perf_counter()
                page.screenshot(path=str(shot), full_page=True)
                shot_seconds += time.perf_counter() - shot_start
                assert shot.is_file(), f"no screenshot written for {rel}"
            data.update(page=rel, redirect=static.refresh, page_errors=page_errors,
                        bad_responses=bad_responses, console=console, screenshot=str(shot) if shot else None)
            results[rel] = data
            page.close()
        context.close()
        browser.close()
    return {
        "html_dir": html_dir, "pages": pages, "results": results, "server": server,
        "blocked": blocked, "mathjax_served": mathjax_served, "mathjax_missing": mathjax_missing,
        "mathjax_script": script, "artifacts": artifacts,
        "seconds": {"browser": round(time.perf_counter() - start, 1),
                    "of_which_screenshots": round(shot_seconds, 1)},
    }


@pytest.fixture(scope="module")
def crawl(browser_tools, built_site, server):
    html_dir, build_seconds = built_site
    config = _config()
    result = crawl_site(browser_tools, html_dir, server, ARTIFACTS,
                        colab_prefix=config["launch_buttons"]["colab_url"].rstrip("/") + "/")
    result["config"] = config
    result["seconds"]["build"] = round(build_seconds, 1)
    return result


@pytest.fixture(scope="module")
def offline_crawl(browser_tools, offline_site):
    """Every page of the offline build, opened from file:// with every other request refused."""
    html_dir, _ = offline_site
    return crawl_site(browser_tools, html_dir, html_dir.as_uri() + "/", ARTIFACTS / "offline",  # no screenshots
                      colab_prefix=_config()["launch_buttons"]["colab_url"].rstrip("/") + "/", screenshots=False)


# --------------------------------------------------------------------------- link resolution

def _target_file(html_dir: pathlib.Path, server: str, url: str) -> pathlib.Path:
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    rel = path[len(urllib.parse.urlsplit(server).path):]
    target = html_dir / rel
    return target / "index.html" if rel == "" or rel.endswith("/") else target


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the test server is local: no proxy


@functools.lru_cache(maxsize=None)
def _http_status(url: str) -> int:
    try:
        with _DIRECT.open(urllib.request.Request(url, method="HEAD"), timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _check_links(crawl) -> tuple[list[str], dict]:
    """Problems with links and anchors, and the counts."""
    html_dir, server, results = crawl["html_dir"], crawl["server"], crawl["results"]
    # Ids as the browser saw them on the pages it loaded (final URL after any redirect).
    live_ids = {urllib.parse.urldefrag(r["url"])[0]: set(r["ids"]) for r in results.values()}
    problems: list[str] = []
    counts = {"internal_links": 0, "anchors": 0, "external_links": 0, "other_links": 0}
    for rel, r in results.items():
        for link in r["links"]:
            href, resolved = link["href"], link["resolved"]
            scheme = urllib.parse.urlsplit(resolved).scheme
            if resolved.startswith(server):
                counts["internal_links"] += 1
                base, fragment = urllib.parse.urldefrag(resolved)
                status = _http_status(base)
                if status != 200:
                    problems.append(f"{rel}: link {href!r} ({link['text']!r}) -> HTTP {status}")
                    continue
                if fragment:
                    counts["anchors"] += 1
                    target = _target_file(html_dir, server, base)
                    if target.suffix != ".html":
                        problems.append(f"{rel}: link {href!r} has an anchor into a non-HTML file")
                        continue
                    ids = live_ids.get(base)
                    if ids is None:
                        ids = _static(target).ids
                    if urllib.parse.unquote(fragment) not in ids:
                        problems.append(f"{rel}: link {href!r} ({link['text']!r}): no id "
                                        f"{urllib.parse.unquote(fragment)!r} on {target.relative_to(html_dir)}")
            elif scheme in ("http", "https"):
                counts["external_links"] += 1
                parts = urllib.parse.urlsplit(resolved)
                if not parts.netloc or "." not in parts.hostname or re.search(r"\s", href):
                    problems.append(f"{rel}: malformed external link {href!r}")
            elif scheme == "mailto":
                counts["other_links"] += 1
            else:
                counts["other_links"] += 1
                problems.append(f"{rel}: link {href!r} has an unexpected scheme {scheme!r}")
    return problems, counts


# --------------------------------------------------------------------------- tests

def _console_problems(crawl) -> list[str]:
    blocked = set(crawl["blocked"])
    problems = []
    for rel, r in crawl["results"].items():
        for msg in r["console"]:
            if msg["type"] != "error":
                continue
            # The only console error tolerated: Chromium's report of an external request this test
            # refused itself (the browser is offline on purpose; they are listed in summary.json).
            if msg["text"].startswith("Failed to load resource: net::ERR_BLOCKED_BY_CLIENT") and msg["url"] in blocked:
                continue
            problems.append(f"{rel}: console error: {msg['text']} ({msg['url']})")
        # No uncaught exception is tolerated. (jupyter-book 1.0's sphinx-thebe script, emitted twice
        # per page by Sphinx 7.4, used to raise a SyntaxError on every page: the book's build drops
        # the repeat with chapters/_ext/dedupe_scripts.py.)
        problems += [f"{rel}: uncaught exception: {e}" for e in r["page_errors"]]
        problems += [f"{rel}: HTTP error response: {b}" for b in r["bad_responses"]]
    problems += [f"a MathJax file the pages asked for is not in the local copy: {u}" for u in crawl["mathjax_missing"]]
    return problems


def _summary(crawl) -> dict:
    results = crawl["results"].values()
    _, link_counts = _check_links(crawl)
    notebook_pages = [r for r in results if r["colab"]]
    return {
        "pages": len(crawl["results"]),
        "redirect_pages": sum(1 for r in results if r["redirect"]),
        "images": sum(len(r["images"]) for r in results),
        "math_expressions": sum(r["math"]["sources"] for r in results),
        "mjx_containers": sum(r["math"]["containers"] for r in results),
        "pages_with_math": sum(1 for r in results if r["math"]["sources"]),
        **link_counts,
        "colab_buttons": sum(len(r["colab"]) for r in notebook_pages),
        "mathjax_version": next((r["math"]["mathjax"] for r in results if r["math"]["mathjax"]), None),
        "mathjax_script": crawl["mathjax_script"],
        "mathjax_files_served_locally": sorted(set(crawl["mathjax_served"])),
        "blocked_external_requests": sorted(set(crawl["blocked"])),
        "seconds": crawl["seconds"],
        "screenshots": str(crawl["artifacts"]),
    }


def test_site_summary(crawl, record_property):
    """Writes summary.json next to the screenshots; every page of the toc was built and loaded."""
    summary = _summary(crawl)
    (crawl["artifacts"] / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for key in ("pages", "images", "math_expressions", "internal_links", "anchors", "external_links",
                "colab_buttons"):
        record_property(key, summary[key])
    print(f"\nsite checked in Chromium: {json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)})}")
    missing = [f for f in _toc_files() if f"{f}.html" not in crawl["results"]]
    assert not missing, f"in _toc.yml but not a page of the build: {missing}"


def test_no_console_errors(crawl):
    problems = _console_problems(crawl)
    assert not problems, "JavaScript errors:\n" + "\n".join(problems)


def _image_problems(crawl) -> list[str]:
    return [f"{rel}: image not loaded: {img['src']} (alt {img['alt']!r})"
            for rel, r in crawl["results"].items() for img in r["images"]
            if not (img["complete"] and img["naturalWidth"] > 0)]


def _math_problems(crawl) -> list[str]:
    problems = []
    for rel, r in crawl["results"].items():
        math = r["math"]
        if math["sources"] and not math["mathjax"]:
            problems.append(f"{rel}: {math['sources']} math expressions but MathJax did not load")
            continue
        if math["mathjax"] and math["output"] != "CHTML":
            problems.append(f"{rel}: MathJax output {math['output']!r}, expected CHTML (tex-mml-chtml)")
        if math["containers"] < math["sources"]:
            problems.append(f"{rel}: {math['containers']} typeset expressions for {math['sources']} math sources")
        problems += [f"{rel}: not typeset: {src!r}" for src in math["untypeset"]]
        problems += [f"{rel}: MathJax error: {err!r}" for err in math["errors"]]
        problems += [f"{rel}: raw TeX left in the text: {raw!r}" for raw in math["rawTex"]]
    return problems


# An alt text that is only a file name or path: what Sphinx writes for a figure without one.
FILE_NAME_ALT_RE = re.compile(r"^\S+\.(png|jpe?g|svg|gif|pdf)$", re.I)


def _figure_text_problems(rel: str, r: dict) -> list[str]:
    """Images of a page without a useful alt text, and content images without a caption."""
    problems = []
    for img in r["images"]:
        alt = (img["alt"] or "").strip()
        if not alt or FILE_NAME_ALT_RE.match(alt):
            problems.append(f"{rel}: image {img['src']} has the alt text {img['alt']!r} (empty or a file name)")
        if img["inArticle"] and not img["caption"]:
            problems.append(f"{rel}: figure {img['src']} (alt {alt[:50]!r}) has no caption")
    return problems


def _toc_pages() -> list[str]:
    try:
        return [f"{f}.html" for f in _toc_files()]
    except Exception:  # a broken toc fails test_site_summary; collection must not break here
        return []


@pytest.mark.parametrize("page", _toc_pages())
def test_every_figure_has_alt_text_and_a_caption(crawl, page):
    """Every <img> has an alt text that describes it (not its file name); every figure of the
    page's content sits in a <figure> with a caption (myst-nb's mystnb.figure / mystnb.image
    cell metadata, see tests/book/test_book.py)."""
    assert page in crawl["results"], f"{page} is in _toc.yml but not a page of the build"
    problems = _figure_text_problems(page, crawl["results"][page])
    assert not problems, "\n".join(problems)


def test_every_image_loaded(crawl):
    problems = _image_problems(crawl)
    assert not problems, "\n".join(problems)


def test_every_math_expression_typeset(crawl):
    problems = _math_problems(crawl)
    assert not problems, "\n".join(problems)


def test_internal_links_and_anchors_resolve(crawl):
    problems, counts = _check_links(crawl)
    assert counts["internal_links"] > 0, "no internal links found at all"
    assert not problems, "\n".join(problems)


def test_colab_buttons_open_the_right_notebook(crawl):
    config = crawl["config"]
    repo_url = config["repository"]["url"].rstrip("/")
    book_dir = ROOT / str(config["repository"].get("path_to_book") or "")
    problems = []
    notebooks = 0
    for rel, r in crawl["results"].items():
        pagename = r["pagename"]
        is_notebook = pagename is not None and (book_dir / f"{pagename}.ipynb").is_file()
        if not is_notebook:
            if r["colab"]:
                problems.append(f"{rel}: not a notebook page, but has Colab links {r['colab']}")
            continue
        notebooks += 1
        expected = _expected_colab_url(config, pagename)
        if r["colab"] != [expected]:
            problems.append(f"{rel}: Colab links {r['colab']}, expected exactly [{expected!r}]")
        if r["repoButtons"] and any(h.rstrip("/") != repo_url for h in r["repoButtons"]):
            problems.append(f"{rel}: repository button {r['repoButtons']} is not {repo_url}")
    assert notebooks > 0, "no notebook page found in the build"
    assert not problems, "\n".join(problems)


def test_published_build_loads_mathjax_from_the_cdn(crawl):
    assert crawl["mathjax_script"] is not None and crawl["mathjax_script"].startswith(CDN_PREFIX), (
        f"the published pages load MathJax from {crawl['mathjax_script']!r}, not from {CDN_PREFIX}")
    assert crawl["mathjax_served"], "no page asked the CDN for MathJax"


def test_offline_build_reads_without_a_network(offline_crawl):
    """Built with the local MathJax, every page opened from file:// typesets its math with MathJax
    from the build itself (nothing asked of the network), and passes the console and image checks."""
    html_dir = offline_crawl["html_dir"]
    assert offline_crawl["mathjax_script"] == LOCAL_SCRIPT, offline_crawl["mathjax_script"]
    assert (html_dir / LOCAL_SCRIPT).with_name("LICENSE").is_file(), "MathJax's licence is not in the build"
    assert not offline_crawl["mathjax_served"], "the offline build asked the CDN for MathJax"
    assert not [u for u in offline_crawl["blocked"] if "mathjax" in u.lower()], offline_crawl["blocked"]
    assert sum(r["math"]["sources"] for r in offline_crawl["results"].values()) > 0, "no math found at all"
    problems = _math_problems(offline_crawl) + _console_problems(offline_crawl) + _image_problems(offline_crawl)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- self-check

BROKEN_PAGE = r"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>broken</title>
<script>window.MathJax = {"options": {"processHtmlClass": "tex2jax_process|mathjax_process|math|output_area"}}</script>
<script defer src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>
<script src="https://example.org/tracker.js"></script>
</head><body>
<p id="top">Fine: <span class="math notranslate nohighlight">\(x^2\)</span>.
Error: <span class="math notranslate nohighlight">\(\frac{1}\)</span>.
Undefined: <span class="math notranslate nohighlight">\(\undefinedmacro{x}\)</span>.
Left raw: <span class="mathjax_ignore">\(y\)</span> and $\beta_1$.</p>
<img alt="ok" src="ok.svg"><img alt="missing" src="missing.png">
<article><figure><img alt="A black square" src="ok.svg"><figcaption>A square.</figcaption></figure>
<img alt="_images/ok.svg" src="ok.svg"></article>
<a href="#top">ok anchor</a> <a href="ok.html#here">ok cross-page anchor</a>
<a href="#nowhere">bad anchor</a> <a href="gone.html">bad page</a> <a href="ok.html#absent">bad cross-page anchor</a>
<a href="https://example.org/x">external</a> <a href="https://exa mple.org/x">malformed</a>
<script>console.error("boom"); window.setTimeout(() => { throw new Error("uncaught"); }, 0);</script>
</body></html>
"""
OK_PAGE = '<!DOCTYPE html><html><head><title>ok</title></head><body><p id="here">ok</p></body></html>'
OK_SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


def test_the_checks_catch_a_broken_page(browser_tools, tmp_path):
    """The checks above are not vacuous: on a deliberately broken page each one reports its fault."""
    site = tmp_path / "html"
    site.mkdir()
    (site / "broken.html").write_text(BROKEN_PAGE, encoding="utf-8")
    (site / "ok.html").write_text(OK_PAGE, encoding="utf-8")
    (site / "ok.svg").write_text(OK_SVG, encoding="utf-8")
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        crawl = crawl_site(browser_tools, site, f"http://127.0.0.1:{httpd.server_address[1]}/",
                           tmp_path / "artifacts", colab_prefix="https://colab.invalid/")
        links, counts = _check_links(crawl)  # asks the server for each link target
    finally:
        httpd.shutdown()
        httpd.server_close()
    console = "\n".join(_console_problems(crawl))
    assert "console error: boom" in console and "uncaught exception: uncaught" in console, console
    assert "404" in console and "missing.png" in console, console
    assert "tracker.js" not in console, "a refused external request must not count as a page error"
    assert crawl["blocked"] == ["https://example.org/tracker.js"]
    images = _image_problems(crawl)
    assert len(images) == 1 and "missing.png" in images[0], images
    figures = _figure_text_problems("broken.html", crawl["results"]["broken.html"])
    assert len(figures) == 2 and all("_images/ok.svg" in p for p in figures), figures
    assert "(empty or a file name)" in figures[0] and "has no caption" in figures[1], figures
    math = "\n".join(_math_problems(crawl))
    assert r"MathJax error: 'Missing argument for \\frac'" in math, math
    assert r"MathJax error: 'undefined macro \\undefinedmacro" in math, math
    assert "raw TeX left in the text" in math and r"\\(y\\)" in math and "beta_1" in math, math
    assert "x^2" not in math, math
    assert counts == {"internal_links": 5, "anchors": 4, "external_links": 2, "other_links": 0}, counts
    assert len(links) == 4, links
    assert any("'#nowhere'" in p for p in links) and any("'ok.html#absent'" in p for p in links), links
    assert any("'gone.html'" in p and "HTTP 404" in p for p in links), links
    assert any("malformed external link 'https://exa mple.org/x'" in p for p in links), links
    assert crawl["results"]["broken.html"]["math"]["sources"] == 3
    assert len(list((tmp_path / "artifacts").glob("*.png"))) == 2
