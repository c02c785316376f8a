"""The package's layout rules, read from the source: no import cycle, private names used only inside
the folder that defines them (chapters: public names only; a test: its own subject folder), no
module over 600 lines, docstrings that are contracts (at most 0.45 docstring and comment lines per
line of code, no measured time)."""
from __future__ import annotations

import ast
import io
import json
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "linattn"
MODULES = {}
for _path in sorted(PACKAGE.rglob("*.py")):
    _parts = list(_path.relative_to(ROOT).with_suffix("").parts)
    MODULES[".".join(_parts[:-1] if _parts[-1] == "__init__" else _parts)] = _path


def _imports(source: str, module: str, is_package: bool):
    """``(imported module, imported name or None, line)`` of every import, function-level ones included."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            yield from ((target, alias.name, node.lineno) for alias in node.names)


def _graph() -> dict:
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for target, attr, _ in _imports(path.read_text(), name, path.name == "__init__.py"):
            full = f"{target}.{attr}" if attr and f"{target}.{attr}" in MODULES else target
            if full in MODULES and full != name:
                deps.add(full)
        graph[name] = deps
    return graph


def _cycles(graph: dict) -> list:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _private_owner(full: str):
    """For ``a.b._c.d``: the folder (dotted) whose private name ``_c`` is, or None when nothing is private."""
    parts = full.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__") and i > 0:
            owner = ".".join(parts[:i])
            if owner not in MODULES:
                return None
            return owner if MODULES[owner].name == "__init__.py" else owner.rsplit(".", 1)[0]
    return None


def _crossings(source: str, module: str, is_package: bool, allowed) -> list:
    bad = []
    for target, attr, line in _imports(source, module, is_package):
        if not target.startswith("linattn"):
            continue
        owner = _private_owner(f"{target}.{attr}" if attr else target)
        if owner is not None and not allowed(owner):
            bad.append(f"{module}:{line}: {target}{'.' + attr if attr else ''}")
    return bad


def test_no_import_cycle_inside_linattn():
    assert _cycles(_graph()) == []


def test_no_private_name_is_imported_across_folders_of_the_package():
    bad = []
    for name, path in MODULES.items():
        folder = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        bad += _crossings(path.read_text(), name, path.name == "__init__.py",
                          lambda owner: folder == owner or folder.startswith(owner + "."))
    assert bad == []


def _private_uses(source: str) -> list:
    """``(module, private attribute, line)`` read through a name bound to a linattn module: ``m._x`` and
    ``monkeypatch.setattr(m, "_x", ...)``."""
    tree = ast.parse(source)
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("linattn"):
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in MODULES})
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            uses.append((bound[node.value.id], node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "setattr" and len(node.args) >= 2
              and isinstance(node.args[0], ast.Name) and node.args[0].id in bound
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            uses.append((bound[node.args[0].id], node.args[1].value, node.lineno))
    return [(m, a, line) for m, a, line in uses if a.startswith("_") and not a.startswith("__")]


def test_a_test_reaches_a_private_helper_only_in_its_own_subject_folder():
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        sub = path.parent.relative_to(ROOT / "tests").parts
        subject = "linattn" + "".join(f".{p}" for p in sub if p not in ("contracts",))

        def allowed(owner, subject=subject, contracts="contracts" in sub):
            return not contracts and (owner == subject or owner.startswith(subject + "."))

        source = path.read_text()
        bad += _crossings(source, f"tests.{path.stem}", False, allowed)
        for module, attr, line in _private_uses(source):
            owner = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
            if not allowed(owner):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}.{attr}")
    assert bad == []


def test_chapters_use_public_names_only():
    bad = []
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                bad += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"\blinattn(\.\w+)*\._[a-z]\w*", source)]
    assert bad == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_600_lines(name):
    assert len(MODULES[name].read_text().splitlines()) <= 600


def _doc_comment_code(source: str) -> tuple[int, int, int]:
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    comments, code = set(), set()
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    code -= docs
    return len(docs), len(comments - code), len(code)


def test_docstring_and_comment_lines_per_code_line_at_most_0_45():
    docs = comments = code = 0
    for path in MODULES.values():
        d, c, k = _doc_comment_code(path.read_text())
        docs, comments, code = docs + d, comments + c, code + k
    assert (docs + comments) / code <= 0.45, (docs, comments, code)


def test_no_docstring_quotes_a_measured_time():
    timed = re.compile(r"\d(\.\d+)?\s?(ms|µs|us|ns)\b|\d+(\.\d+)?\s?(seconds|milliseconds|microseconds)\b")
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                bad += [f"{name}.{getattr(node, 'name', '')}: {m.group(0)}" for m in timed.finditer(doc)]
    assert bad == []
