"""What ``linattn`` does in an environment that lacks numpy or matplotlib.

A package missing from the environment is simulated, not uninstalled: an import hook makes
it unimportable (as if it were not installed), in this process for matplotlib, in a fresh
interpreter for numpy (torch checks for numpy while it is being imported).
"""
from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

from linattn import book as utils

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUMPY_WARNING = "Failed to initialize NumPy"


class _Unimportable:
    """A meta-path finder that makes the packages it names (and their submodules) unimportable."""

    def __init__(self, *names: str):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _python_stderr(code: str, *, without: tuple[str, ...] = (), tmp_path: pathlib.Path) -> str:
    """What a fresh ``python -c code`` prints on stderr, with the packages ``without`` unimportable
    (Python's default warning filters, as a reader has them)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    # The same finder, defined and installed first in the fresh interpreter.
    blocker = f"import sys\n{inspect.getsource(_Unimportable)}\nsys.meta_path.insert(0, _Unimportable(*{without!r}))\n"
    source = (blocker if without else "") + code
    result = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


def _project() -> dict:
    """The ``[project]`` table of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11 (tomllib)")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in requirements]


# --------------------------------------------------------------------------- numpy


def test_import_linattn_prints_nothing(tmp_path):
    assert _python_stderr("import linattn", tmp_path=tmp_path) == ""


def test_without_numpy_only_torch_itself_warns(tmp_path):
    """The "Failed to initialize NumPy" warning comes from ``import torch`` (torch 2.13 imports
    torch.export, whose FunctionalTensor class probes NumPy), not from anything linattn imports:
    without numpy, ``import linattn`` prints exactly what ``import torch`` prints."""
    torch_only = _python_stderr("import torch", without=("numpy",), tmp_path=tmp_path)
    with_linattn = _python_stderr("import torch, linattn", without=("numpy",), tmp_path=tmp_path)
    assert with_linattn == torch_only
    if NUMPY_WARNING in torch_only:  # then a reader without numpy sees it: the package must require it
        assert "numpy" in _names(_project()["dependencies"]), (
            f"`import torch` warns {NUMPY_WARNING!r} without numpy: linattn must depend on numpy")


# --------------------------------------------------------------------------- matplotlib


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib unimportable for the test (modules already imported are put back afterwards)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Unimportable("matplotlib"), *sys.meta_path])


@pytest.mark.parametrize("call", [
    pytest.param(lambda: utils.use_book_style(), id="use_book_style"),
    pytest.param(lambda: utils.book_figure(), id="book_figure"),
    pytest.param(lambda: utils.finish_figure(object()), id="finish_figure"),
])
def test_plot_helpers_without_matplotlib_name_the_extra(no_matplotlib, call):
    with pytest.raises(ImportError, match=r'needs matplotlib.*pip install "linattn\[plot\]"') as info:
        call()
    assert info.value.name == "matplotlib"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_the_plot_extra_installs_matplotlib():
    # The extra the message above names.
    assert "matplotlib" in _names(_project()["optional-dependencies"]["plot"])


# --------------------------------------------------------------------------- transformers


def test_interop_imports_without_transformers(tmp_path):
    """transformers is optional: ``import linattn`` reaches ``linattn.interop`` without it, silently,
    and the interop tests skip naming the install."""
    code = ("import linattn\nassert linattn.interop.from_transformers\n"
            "import sys\nassert 'transformers' not in sys.modules")
    assert _python_stderr(code, without=("transformers",), tmp_path=tmp_path) == ""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    blocker = f"import sys\n{inspect.getsource(_Unimportable)}\nsys.meta_path.insert(0, _Unimportable('transformers'))\n"
    run = (blocker + "import pytest\nsys.exit(pytest.main(['-q', '-p', 'no:nbval', '-o', 'addopts=', '-rs', "
           f"{str(ROOT / 'tests' / 'test_interop.py')!r}]))")
    result = subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pip install transformers" in result.stdout and " passed" in result.stdout and "skipped" in result.stdout
