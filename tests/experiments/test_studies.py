"""linattn.experiments: studies write results with their provenance; one cell re-runs to the cached value."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from linattn import experiments


@pytest.fixture
def toy():
    experiments.register("toy", "studies.toy_study")
    yield "toy"
    experiments.STUDIES.pop("toy", None)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_study_writes_its_results_with_provenance(toy, tmp_path, workers):
    out = tmp_path / "toy.json"
    doc = experiments.run_study(toy, workers=workers, out=out, progress=None)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(doc))
    assert [r["cell"] for r in saved["rows"]] == [{"seed": s, "n": n} for s in (0, 1) for n in (3, 5)]
    assert all(r["result"]["threads"] == 1 for r in saved["rows"])             # one thread per cell
    prov = saved["provenance"]
    assert prov["torch"] == torch.__version__ and prov["threads_per_worker"] == 1 and prov["cpu"]
    assert saved["command"].startswith("python -m linattn.experiments toy") and saved["summary"] == {"cells": 4}
    assert saved["grid_size"] == 4 and saved["started"] and saved["elapsed_s"] >= 0


def test_one_cell_reproduces_the_cached_value(toy, tmp_path):
    doc = experiments.run_study(toy, out=tmp_path / "toy.json", progress=None)
    threads = torch.get_num_threads()
    cached, fresh = experiments.check_cell(experiments.load_results(tmp_path / "toy.json"), 3)
    assert cached == fresh and torch.get_num_threads() == threads


def test_a_partial_run_writes_nothing_unless_asked(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(experiments, "results_path", lambda name: tmp_path / f"{name}.json")
    doc = experiments.run_study(toy, cells=[1], progress=None)
    assert [r["cell"] for r in doc["rows"]] == [{"seed": 0, "n": 5}] and not (tmp_path / "toy.json").exists()


def test_errors_name_what_is_wrong(toy, tmp_path):
    with pytest.raises(ValueError, match=r"unknown study 'nope'; known studies: .*toy"):
        experiments.run_study("nope")
    with pytest.raises(ValueError, match=r"cell index 9 is out of range for study 'toy' with 4 cells"):
        experiments.run_study(toy, cells=[9])
    with pytest.raises(ValueError, match=r"workers must be an int >= 1"):
        experiments.run_study(toy, workers=0)
    with pytest.raises(FileNotFoundError, match=rf"run: python -m linattn.experiments {toy}"):
        experiments.load_results(tmp_path / f"{toy}.json")
    with pytest.raises(FileNotFoundError, match=r"'missing' is not a study of linattn.experiments"):
        experiments.load_results(tmp_path / "missing.json")


def test_the_command_line_lists_the_studies():
    out = subprocess.run([sys.executable, "-m", "linattn.experiments"], capture_output=True, text=True, check=True)
    for name in experiments.STUDIES:
        assert name in out.stdout


def test_a_second_phase_reuses_identical_cells_of_the_first(toy, tmp_path, monkeypatch):
    first = experiments.run_study(toy, out=tmp_path / "toy.json", progress=None)
    mod = experiments.study(toy)
    monkeypatch.setattr(mod, "REUSE_FROM", str(tmp_path / "toy.json"), raising=False)
    monkeypatch.setattr(mod, "grid", lambda: [{"seed": 1, "n": 5}, {"seed": 7, "n": 3}])
    ran = []
    real = mod.run_cell
    monkeypatch.setattr(mod, "run_cell", lambda cell: ran.append(cell) or real(cell))
    second = experiments.run_study(toy, out=tmp_path / "toy2.json", progress=None)
    assert ran == [{"seed": 7, "n": 3}]                                   # only the new cell trained
    reused, new = second["rows"]
    assert reused["result"] == first["rows"][3]["result"] and reused["reused_from"]["study"].endswith("toy.json")
    assert "reused_from" not in new and new["cell"] == {"seed": 7, "n": 3}
    assert new["result"] == real({"seed": 7, "n": 3})


def test_a_row_copied_twice_keeps_where_it_was_computed(toy, tmp_path, monkeypatch):
    experiments.run_study(toy, out=tmp_path / "toy.json", progress=None)
    mod = experiments.study(toy)
    monkeypatch.setattr(mod, "grid", lambda: [{"seed": 1, "n": 5}])
    monkeypatch.setattr(mod, "REUSE_FROM", str(tmp_path / "toy.json"), raising=False)
    second = experiments.run_study(toy, out=tmp_path / "toy2.json", progress=None)
    monkeypatch.setattr(mod, "REUSE_FROM", str(tmp_path / "toy2.json"), raising=False)
    third = experiments.run_study(toy, out=tmp_path / "toy3.json", progress=None)
    (row,) = third["rows"]
    assert row["reused_from"] == second["rows"][0]["reused_from"]
    assert row["reused_from"]["study"].endswith("toy.json")              # not the copy it was read from


def test_the_studies_training_recipe_is_public():
    from linattn.experiments import _lm
    assert "train_char_lm" in experiments.__all__
    kwargs = dict(d_model=16, n_layers=1, n_heads=2, positions="learned", max_len=32, attention="linear")
    out = experiments.train_char_lm(kwargs, steps=2, lr=1e-2, seed=0, batch_size=2, block_size=32)
    assert out == _lm.run(kwargs, steps=2, lr=1e-2, seed=0, batch_size=2, block_size=32)


def test_provenance_is_taken_when_the_cells_start(toy, tmp_path, monkeypatch):
    commits = iter(["aaa", "bbb"])
    monkeypatch.setattr(experiments.origin, "git_commit", lambda: next(commits))
    doc = experiments.run_study(toy, out=tmp_path / "toy.json", progress=None)
    assert doc["provenance"]["commit"] == "aaa" and doc["provenance"]["commit_at_end"] == "bbb"


def test_load_results_names_the_command_only_for_a_registered_study(tmp_path):
    import pytest
    from linattn import experiments
    with pytest.raises(FileNotFoundError, match="run: python -m linattn.experiments positions"):
        experiments.load_results(tmp_path / "positions.json")
    with pytest.raises(FileNotFoundError, match="'ft_side_by_side' is not a study"):
        experiments.load_results(tmp_path / "ft_side_by_side.json")


# --------------------------------------------------------------------------- the command line's usage errors


def _usage_error(capsys, *argv) -> str:
    """The message of ``python -m linattn.experiments ARGV``'s usage error (exit status 2)."""
    from linattn.experiments.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def no_cell_may_run(toy, monkeypatch):
    def refuse(cell):
        raise AssertionError("a cell ran before the arguments were checked")

    monkeypatch.setattr(experiments.study(toy), "run_cell", refuse)
    return toy


def test_an_out_that_is_a_folder_fails_before_any_cell_runs(no_cell_may_run, tmp_path, capsys):
    assert "--out: out must name a results file, got the folder" in _usage_error(capsys, "toy", "--out", str(tmp_path))
    (tmp_path / "file").write_text("")
    assert "which is a file" in _usage_error(capsys, "toy", "--out", str(tmp_path / "file" / "toy.json"))
    with pytest.raises(ValueError, match="out must name a results file, got the folder"):
        experiments.run_study(no_cell_may_run, out=tmp_path, progress=None)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "argument --workers: expected an integer >= 1, got '0'"),
    (["--workers", "two"], "argument --workers: expected an integer >= 1, got 'two'"),
    (["--cells", "a,b"], "argument --cells: expected comma-separated grid indices such as 0,3,4, got 'a,b'"),
    (["--cells", "1,-2"], "argument --cells: expected comma-separated grid indices"),
    (["--cells", "0,4"], "--cells: grid index 4 is out of range: study 'toy' has 4 cells (0 to 3)"),
])
def test_bad_workers_and_cells_are_usage_errors(no_cell_may_run, capsys, argv, message):
    err = _usage_error(capsys, "toy", *argv)
    assert message in err and "usage: python -m linattn.experiments" in err and "Traceback" not in err


def test_a_study_that_starts_its_own_processes_refuses_workers(capsys):
    """sp_exchange's cells start P ranks each: a pool's daemonic worker may not (and the timings would share
    the cores), so --workers 2 is refused up front, by the command line and by run_study."""
    assert "--workers: study 'sp_exchange' runs its cells one at a time" in _usage_error(
        capsys, "sp_exchange", "--workers", "2")
    with pytest.raises(ValueError, match="study 'sp_exchange' runs its cells one at a time .* got 2"):
        experiments.run_study("sp_exchange", workers=2)
