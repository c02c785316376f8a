"""python -m linattn.bench --decode: the bare updates compute what the library computes; the table and CLI."""
import json

import pytest
import torch

import linattn
from linattn import backends, bench
from linattn.kernels import cpu


def test_the_bare_step_computes_the_step_up_to_rounding():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    state = linattn.linear_attention_step(q, k, v)[1]
    q, k, v = (torch.randn(2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out, new = linattn.linear_attention_step(q, k, v, state)
    bare_out, S, z = bench.bare_linear_attention_step(q, k, v, state.S, state.z)
    for got, expected in ((bare_out, out), (S, new.S), (z, new.z)):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_the_bare_mixer_step_gives_the_mixer_s_numbers_bit_for_bit():
    torch.manual_seed(0)
    mixer = linattn.LinearMixer(64, 4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        _, state = mixer(torch.randn(2, 5, 64, generator=g), return_state=True)
        x = torch.randn(2, 1, 64, generator=g)
        y, new = mixer(x, state=state, return_state=True)
        bare_y, S, conv = bench.bare_mixer_step(mixer, x, state.S, state.conv)
    assert torch.equal(y, bare_y) and torch.equal(new.S, S) and torch.equal(new.conv, conv)


def test_run_decode_benchmark_pairs_every_round_and_formats_a_table():
    rows = bench.run_decode_benchmark(heads=2, head_dim=8, repeats=3, calls={"linear_attention_step": 2,
                                                                          "compiled_step": 2, "LinearMixer": 1},
                                      warmup=1)
    assert [r["subject"] for r in rows] == ["linear_attention_step", "compiled_step", "LinearMixer"]
    for r in rows:
        if r["subject"] == "compiled_step" and r["status"] != "ok":
            assert not cpu.cpu_kernel_available() and r["status"].startswith("skipped: ")
            continue
        assert len(r["times"]) == len(r["bare_times"]) == 3 and r["ratio"]["min"] <= r["ratio"]["median"]
        assert r["ratio"]["median"] <= r["ratio"]["max"] and (r["heads"], r["head_dim"]) == (2, 8)
    text = bench.format_decode_table(rows)
    assert "B=1 H=2 D=8 float32" in text and "3 rounds" in text
    assert "linear_attention_step" in text and "step / bare: median [min, max]" in text


def test_the_decode_command_line_writes_its_table_and_json(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert bench.main(["--decode", "--threads", "1", "--repeats", "1", "--heads", "2", "--head-dim", "8",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decode step, B=1 H=2 D=8" in out and "1 thread(s)" in out
    doc = json.loads(path.read_text())
    assert doc["metadata"]["heads"] == 2 and [r["subject"] for r in doc["results"]] == ["linear_attention_step",
                                                                                         "compiled_step", "LinearMixer"]


@pytest.mark.parametrize("extra", [["--decay"], ["--methods", "chunk"], ["--plot", "x.png"]])
def test_the_decode_mode_refuses_flags_that_do_not_apply(extra, capsys):
    with pytest.raises(SystemExit) as err:
        bench.main(["--decode", *extra])
    assert err.value.code == 2 and "--decode times CPU decoding steps" in capsys.readouterr().err


@pytest.mark.skipif(not cpu.cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
def test_the_compiled_decode_subject_runs_the_compiled_loop_and_gives_the_step_s_numbers():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 64, generator=g) for _ in range(3))
    state = linattn.linear_attention_step(q, k, v)[1]
    with torch.no_grad(), backends.use_backends("cpu"):
        y, new = linattn.linear_attention(q[:, :, None], k[:, :, None], v[:, :, None], causal=True,
                                          initial_state=state, return_state=True)
    assert backends.last_backend() == "cpu"
    out, expected = linattn.linear_attention_step(q, k, v, state)
    torch.testing.assert_close(y[:, :, 0], out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new.S, expected.S, rtol=1e-6, atol=1e-6)
    rows = bench.run_decode_benchmark(repeats=2, calls={"compiled_step": 2}, warmup=1, subjects=["compiled_step"])
    assert rows[0]["status"] == "ok" and rows[0]["ratio"]["median"] > 0


def test_the_decode_table_compares_the_two_steps_and_names_skipped_subjects():
    row = lambda name, ratio: {"subject": name, "status": "ok", "batch": 1, "heads": 8, "head_dim": 64,
                               "dtype": "float32", "threads": 1, "times": [1.0], "bare_times": [1.0],
                               "median_s": ratio * 1e-5, "bare_median_s": 1e-5,
                               "ratio": {"median": ratio, "min": ratio, "max": ratio}}
    text = bench.format_decode_table([row("linear_attention_step", 1.5), row("compiled_step", 3.0),
                                      {"subject": "LinearMixer", "status": "skipped: why"}])
    assert "compiled_step / linear_attention_step, their median times (separate rounds): 2.00" in text
    assert "LinearMixer: skipped: why" in text


def test_an_unknown_decode_subject_is_refused():
    with pytest.raises(ValueError, match="unknown decode subject 'step'"):
        bench.run_decode_benchmark(subjects=["step"])
