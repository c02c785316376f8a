"""linattn.bench: the command line end to end, the baselines, the memory guard, bad flags.

No assertion here is about speed (shared machines are noisy): only shapes, schema,
signs, statuses and the numbers the baselines compute.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import linattn
from linattn import bench

REPO = pathlib.Path(__file__).resolve().parents[2]
TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64 against float64: only summation order differs
TINY = dict(device="cpu", batch=1, heads=2, head_dim=8, repeats=1, warmup=0, matmul_size=128)

ROW_KEYS = {
    "method", "seq_len", "batch", "heads", "head_dim", "chunk_size", "dtype", "device", "status", "note",
    "fwd_s", "fwd_bwd_s", "peak_memory_bytes", "memory_pass", "predicted_memory_bytes", "max_memory_bytes",
    "fwd_flops", "fwd_gflops", "matmul_gflops", "matmul_fraction",
    # interleaved repetitions: every repetition, their spread, the yardstick's spread, threads, CPU/GPU
    "fwd_times", "fwd_bwd_times", "fwd_spread", "fwd_bwd_spread", "matmul_spread", "threads", "device_name",
    "backends",     # which backend ran each pass of linattn's chunk methods
}
MEASURED = ("fwd_s", "fwd_bwd_s", "peak_memory_bytes", "fwd_gflops", "matmul_fraction")


def _qkv(B, H, T, D, Dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, d, generator=gen, dtype=torch.float64, requires_grad=True)
                 for d in (D, D, Dv))


def _output_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), upstream))


# ------------------------------------------------------------------ command line, end to end


def test_cli_end_to_end_writes_json_table_and_plot(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "linattn.bench", "--device", "cpu", "--seq-lens", "64", "100",
           "--heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0",
           "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for word in ("fwd ms", "fwd+bwd ms", "GFLOP/s", "baseline_chunk", "sdpa", "cumsum", "chunk"):
        assert word in proc.stdout

    data = json.loads(out_json.read_text())
    meta = data["metadata"]
    for key in ("torch_version", "linattn_version", "device", "device_name", "cpu_count", "torch_threads",
                "dtype", "batch", "heads", "head_dim", "seq_lens", "methods", "repeats", "warmup",
                "chunk_size", "matmul_gflops", "date", "command"):
        assert key in meta, key
    assert meta["dtype"] == "float32" and meta["device"] == "cpu" and meta["seq_lens"] == [64, 100]
    assert meta["methods"] == list(bench.DEFAULT_METHODS) and meta["matmul_gflops"] > 0
    assert "cpu" in meta and "load_average" in meta

    results = data["results"]
    assert [(r["seq_len"], r["method"]) for r in results] == [(T, m) for T in (64, 100)
                                                              for m in bench.DEFAULT_METHODS]
    unavailable_here = {"fused"} | ({"chunk_cpu"} if bench.unavailable("chunk_cpu", torch.device("cpu"), 64) else set())
    for r in results:
        assert set(r) == ROW_KEYS
        expected = "unavailable" if r["method"] in unavailable_here else "ok"   # no CUDA in a CPU run
        assert r["status"] == expected, r["note"]
        if r["method"] == "chunk_torch":
            assert r["backends"] == {"fwd": "torch", "fwd+bwd": "torch"}      # pinned to the PyTorch chunk form
        elif r["method"] == "chunk":
            assert set(r["backends"]) == {"fwd", "fwd+bwd"} and set(r["backends"].values()) <= {"cpu", "torch"}
        elif r["method"] not in ("chunk_cpu",):
            assert r["backends"] is None
        assert r["fwd_flops"] > 0 and r["predicted_memory_bytes"] > 0
        if expected == "ok":
            assert all(r[key] > 0 for key in MEASURED), r
            assert r["memory_pass"] == "fwd+bwd"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ baselines against linattn


@pytest.mark.parametrize("T", [1, 37, 128])
@pytest.mark.parametrize("baseline", ["cumsum", "baseline_chunk C=1", "baseline_chunk C=16",
                                      "baseline_chunk C=64", "baseline_chunk C=200"])
def test_baselines_match_quadratic_outputs_and_gradients(baseline, T):
    if baseline == "cumsum":
        fn = bench.cumsum_linear_attention
    else:
        C = int(baseline.split("=")[1])
        fn = lambda q, k, v: bench.baseline_chunk_linear_attention(q, k, v, chunk_size=C)  # noqa: E731
    q, k, v = _qkv(2, 3, T, 8, 5)
    got = _output_and_grads(fn, q, k, v)
    want = _output_and_grads(lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, method="quadratic"),
                             q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, **TIGHT, msg=f"{baseline}, T={T}: {name} differs")


@pytest.mark.parametrize("fn", [bench.cumsum_linear_attention, bench.baseline_chunk_linear_attention])
def test_baselines_keep_half_dtype_and_reject_bad_input(fn):
    q, k, v = (x.detach().to(torch.bfloat16) for x in _qkv(1, 2, 20, 4, 4))
    out = fn(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 20, 4)
    ref = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, method="quadratic")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="k"):
        fn(q, k[:, :, :10], v)


# ------------------------------------------------------------------ bad flags


@pytest.mark.parametrize("argv", [
    ["--dtype", "float64"],
    ["--methods", "flash"],
    ["--methods"],
    ["--seq-lens", "0"],
    ["--seq-lens", "1k"],
    ["--repeats", "0"],
    ["--warmup", "-1"],
    ["--heads", "2.5"],
    ["--max-memory-gb", "0"],
    ["--max-memory-gb", "lots"],
    ["--device", "tpu"],
    ["--json", "/no/such/folder/out.json"],
    ["--json", ""],
    ["--json", "/tmp"],
    ["--plot", "out.txt"],
    ["--seed", "99999999999999999999"],
    ["--frobnicate"],
])
def test_bad_flags_give_a_clean_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m linattn.bench" in err and "error:" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda"])
    assert exc.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


# ------------------------------------------------------------------ function API and the memory guard


def test_memory_guard_marks_skipped_cells():
    shape = dict(batch=1, heads=2, head_dim=8)
    quad = bench.predict_memory("quadratic", 512, **shape)
    chunk = bench.predict_memory("chunk", 512, **shape)
    assert chunk < quad
    limit_gb = (chunk + quad) / 2 / 1e9
    results = bench.run_benchmark(["quadratic", "chunk"], [512], **TINY, max_memory_gb=limit_gb)
    by_method = {r["method"]: r for r in results}
    assert by_method["quadratic"]["status"] == "skipped"
    assert "predicted" in by_method["quadratic"]["note"]
    assert all(by_method["quadratic"][key] is None for key in MEASURED)
    assert by_method["chunk"]["status"] == "ok"
    assert by_method["chunk"]["max_memory_bytes"] == int(limit_gb * 1e9)
    table = bench.format_table(results)
    assert "skipped: predicted" in table


def test_run_benchmark_forward_only_and_prediction_bounds_measured_memory():
    methods = ["sdpa", "quadratic", "cumsum", "baseline_chunk", "chunk"]
    for backward in (True, False):
        results = bench.run_benchmark(methods, [50, 130], **TINY, backward=backward, chunk_size=16)
        for r in results:
            assert r["status"] == "ok", r["note"]
            assert r["fwd_s"] > 0 and r["peak_memory_bytes"] > 0
            assert r["peak_memory_bytes"] <= r["predicted_memory_bytes"], r   # the guard errs high
            if backward:
                assert r["memory_pass"] == "fwd+bwd" and r["fwd_bwd_s"] > 0
            else:
                assert r["memory_pass"] == "fwd" and r["fwd_bwd_s"] is None
    table = bench.format_table(results)
    assert len([line for line in table.splitlines() if line.lstrip().startswith(("50 ", "130 "))]) == 10


def test_a_failing_cell_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    real = bench.run.method_fn

    def broken(method, chunk_size):
        if method == "chunk":
            def fn(q, k, v):
                raise RuntimeError("out of memory (simulated)\nsecond line")
            return fn
        return real(method, chunk_size)

    monkeypatch.setattr(bench.run, "method_fn", broken)
    argv = ["--device", "cpu", "--seq-lens", "16", "--heads", "1", "--head-dim", "4", "--repeats", "1",
            "--warmup", "0", "--methods", "chunk", "baseline_chunk", "--no-progress"]
    assert bench.main(argv) == 1
    out = capsys.readouterr().out
    assert "failed: out of memory (simulated)" in out and "second line" not in out
    assert "baseline_chunk" in out


def test_fused_is_unavailable_on_cpu():
    (row,) = bench.run_benchmark(["fused"], [16], **TINY)
    assert row["status"] == "unavailable" and "CUDA" in row["note"]
    table = bench.format_table([row])
    # left out of the table, not printed as a row: named once, under it, with the reason
    assert "left out (cannot run here): fused: the Triton kernel runs on CUDA only" in table
    assert not any(line.split()[:2] == ["16", "fused"] for line in table.splitlines())


def test_forward_flops_share_one_count_per_problem():
    shape = dict(batch=2, heads=3, head_dim=8)
    counts = {m: bench.forward_flops(m, 100, **shape, chunk_size=16) for m in bench.METHODS}
    assert counts["sdpa"] == counts["quadratic"] == 2 * 3 * 100 * 101 * 16
    per_token = 2 * 16 * (8 + 8 + 1) + 4 * 8 * (8 + 1)
    assert {counts[m] for m in bench.LINEAR_METHODS} == {2 * 3 * 100 * per_token}


@pytest.mark.parametrize("kwargs, error", [
    (dict(methods=["flash"]), ValueError),
    (dict(methods=[]), ValueError),
    (dict(seq_lens=[]), ValueError),
    (dict(seq_lens=[0]), ValueError),
    (dict(seq_lens=[8.0]), TypeError),
    (dict(dtype="float64"), ValueError),
    (dict(repeats=0), ValueError),
    (dict(max_memory_gb=0), ValueError),
    (dict(device="meta"), ValueError),
    (dict(methods="chunk"), TypeError),
    (dict(seed=1.5), TypeError),
    (dict(seed=-1), ValueError),
    (dict(seed=2**63), ValueError),
])
def test_run_benchmark_rejects_bad_arguments(kwargs, error):
    args = dict(methods=["chunk"], seq_lens=[8], **TINY)
    args.update(kwargs)
    with pytest.raises(error):
        bench.run_benchmark(args.pop("methods"), args.pop("seq_lens"), **args)


# ------------------------------------------------------------------ --decay: flags, effective C, threads

DECAY_TINY = ["--decay", "--device", "cpu", "--heads", "1", "--head-dim", "4", "--repeats", "1", "--warmup", "0",
              "--no-backward", "--no-progress"]


@pytest.mark.parametrize("extra, flag", [
    (["--methods", "chunk"], "--methods"),
    (["--max-memory-gb", "1"], "--max-memory-gb"),
    (["--max-memory-gb", "inf"], "--max-memory-gb"),
    (["--plot", "out.png"], "--plot"),
    (["--reference", "chunk"], "--reference"),          # the default's name too, not only other methods
    (["--reference", "sdpa"], "--reference"),
])
def test_decay_refuses_flags_that_do_not_apply(extra, flag, capsys):
    """--methods and --max-memory-gb used to be ignored silently (exit 0) while --plot was
    refused: all three are refused alike, with argparse's usage message and status 2."""
    with pytest.raises(SystemExit) as exc:
        bench.main([*DECAY_TINY, "--seq-lens", "8", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m linattn.bench" in err and f"error: {flag} does not apply to --decay" in err


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "-2"], ["--threads", "two"], ["--threads"]])
def test_bad_threads_flag_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*DECAY_TINY, "--seq-lens", "8", *argv])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err


def test_decay_title_gives_the_effective_chunk_size(capsys):
    """T = 9 < chunk_size = 64: the functions use C = 9, and the title says so."""
    assert bench.main([*DECAY_TINY, "--seq-lens", "9"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert "C=9:" in title and "C=64" not in title
    rows = bench.run_decay_benchmark([9, 70], variants=["gla"], heads=1, head_dim=4, chunk_size=64, repeats=1,
                                     warmup=0, backward=False)
    assert [(r["seq_len"], r["chunk_size"], r["effective_chunk_size"]) for r in rows] == [
        (9, 64, 9), (9, 64, 9), (9, 64, 9), (70, 64, 64), (70, 64, 64), (70, 64, 64)]   # ungated, chunk, recurrent
    lines = bench.format_decay_table(rows).splitlines()
    assert "C=min(64, T)" in lines[0]
    assert lines[2].split()[:3] == ["T", "variant", "C"]
    assert lines[3].split()[:3] == ["9", "ungated", "9"] and lines[4].split()[:3] == ["9", "gla", "9"]
    assert lines[5].split()[:3] == ["70", "ungated", "64"] and lines[6].split()[:3] == ["70", "gla", "64"]


def test_decay_threads_are_pinned_recorded_and_restored(tmp_path, capsys):
    before = torch.get_num_threads()
    out_json = tmp_path / "decay.json"
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--threads", "1", "--json", str(out_json)]) == 0
    assert torch.get_num_threads() == before
    assert "1 thread," in capsys.readouterr().out.splitlines()[0]
    data = json.loads(out_json.read_text())
    assert data["metadata"]["threads"] == 1 and data["metadata"]["torch_threads"] == 1
    assert {r["threads"] for r in data["results"]} == {1}
    # without --threads, torch's setting is left alone and recorded as such
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["metadata"]["threads"] is None and data["metadata"]["torch_threads"] == before
    assert {r["threads"] for r in data["results"]} == {before}
    # the function API pins and restores too, and checks the value
    rows = bench.run_decay_benchmark([8], variants=["retention"], heads=1, head_dim=4, repeats=1, warmup=0,
                                     backward=False, threads=1)
    assert {r["threads"] for r in rows} == {1} and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        bench.run_decay_benchmark([8], threads=0)
    with pytest.raises(TypeError, match="threads"):
        bench.run_decay_benchmark([8], threads=1.5)


def test_baselines_without_causal_flag_name_themselves_on_length_mismatch():
    q, k, v = _qkv(1, 2, 10, 4, 4)
    for fn, name in ((bench.cumsum_linear_attention, "cumsum_linear_attention"),
                     (bench.baseline_chunk_linear_attention, "baseline_chunk_linear_attention")):
        with pytest.raises(ValueError, match=rf"^{name} is causal .*got q with seq 10 and k with seq 6$"):
            fn(q, k[:, :, :6], v[:, :, :6])


# ------------------------------------------------------------------ interleaving, spreads, peers, threads


def test_interleaved_rounds_rotate_the_order_and_drop_a_failing_function():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}

    def broken():
        calls.append("x")
        if calls.count("x") == 3:          # fails in its second timed round
            raise RuntimeError("boom")

    fns["x"] = broken
    errors = []
    times = bench.interleaved_times(fns, repeats=4, warmup=1, on_error=lambda n, e: errors.append((n, str(e))))
    assert calls[:4] == ["a", "b", "c", "x"]                             # the warm-up calls, once each
    rounds = calls[4:]
    assert sorted(rounds[:4]) == ["a", "b", "c", "x"]                     # every function once a round
    assert errors == [("x", "boom")] and len(times["x"]) == 1             # timed once, then dropped
    assert all(len(times[n]) == 4 for n in "abc")
    assert bench.summarise([1.0, 2.0, 4.0]) == {"median": 2.0, "min": 1.0, "max": 4.0, "spread": 1.5}
    assert bench.paired_ratios([2.0, 4.0, 9.0], [1.0, 4.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_table_shows_spreads_marks_noise_and_divides_by_the_reference_round_by_round():
    rows = bench.run_benchmark(["baseline_chunk", "chunk"], [32], **TINY | {"repeats": 3})
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert len(r["fwd_times"]) == len(r["fwd_bwd_times"]) == 3 and r["threads"] == torch.get_num_threads()
        assert r["fwd_spread"] == (max(r["fwd_times"]) - min(r["fwd_times"])) / r["fwd_s"]
    # a doctored noisy cell (one repetition 10x slower, as on a busy machine) is marked
    noisy = dict(by["baseline_chunk"], fwd_times=[1e-3, 1e-3, 1e-2], fwd_s=1e-3, fwd_spread=9.0)
    chunk = dict(by["chunk"], fwd_times=[1e-3, 2e-3, 1e-3])
    table = bench.format_table([noisy, chunk], reference="chunk")
    line = next(x for x in table.splitlines() if x.split()[:2] == ["32", "baseline_chunk"])
    assert "1.00 ±450%!" in line and "1.00 (0.5-10.0)" in line
    assert "1 thread" in table.splitlines()[0] and bench.cpu_name() in table.splitlines()[0]


def test_main_table_names_the_threads_and_the_cpu(capsys):
    argv = ["--device", "cpu", "--seq-lens", "16", "--heads", "1", "--head-dim", "4", "--repeats", "1",
            "--warmup", "0", "--methods", "baseline_chunk", "chunk", "--no-progress", "--threads", "1"]
    before = torch.get_num_threads()
    assert bench.main(argv) == 0 and torch.get_num_threads() == before
    title = capsys.readouterr().out.splitlines()[0]
    assert "1 thread," in title and bench.cpu_name() in title


def test_peers_are_timed_alongside_and_checked():
    peer = lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, method="quadratic")  # noqa: E731
    rows = bench.run_benchmark(["chunk"], [24], **TINY, peers={"my_peer": peer})
    assert [(r["method"], r["status"]) for r in rows] == [("chunk", "ok"), ("my_peer", "ok")]
    assert "my_peer" in bench.format_table(rows)
    with pytest.raises(ValueError, match="peers"):
        bench.run_benchmark(["chunk"], [8], **TINY, peers={"chunk": peer})
    with pytest.raises(ValueError, match="peers"):
        bench.run_benchmark(["chunk"], [8], **TINY, peers={"x": 3})


def test_compiled_baseline_matches_the_quadratic_form():
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(1, 2, 37, 8, 8))
    got = _output_and_grads(lambda q, k, v: bench.compiled_baseline_linear_attention(q, k, v, chunk_size=16), q, k, v)
    want = _output_and_grads(lambda q, k, v: linattn.linear_attention(q.double(), k.double(), v.double(),
                                                                      causal=True, method="quadratic").float(),
                             q, k, v)                                   # float64 inside, same upstream draw
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5)


def test_variants_flag_selects_decay_variants(capsys):
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--variants", "delta"]) == 0
    out = capsys.readouterr().out
    assert " delta " in out and "retention" not in out and "ungated" in out
    with pytest.raises(SystemExit):
        bench.main(["--variants", "delta"])


def test_gate_temperature_sets_the_gates_and_is_recorded(tmp_path, capsys):
    """--gate-temperature TAU: log_g = logsigmoid(x)/TAU (16 by default, GLA's), in the title, the rows and the JSON."""
    from linattn.bench.run import _decay_inputs
    for variant in ("gla", "gated_delta", "gated_delta_channel"):
        _, _, _, (g16, *_) = _decay_inputs(variant, 1, 2, 64, 4, torch.float32, torch.device("cpu"), 0)
        _, _, _, (g1, *_) = _decay_inputs(variant, 1, 2, 64, 4, torch.float32, torch.device("cpu"), 0, 1.0)
        torch.testing.assert_close(g1, g16 * 16)
    out_json = tmp_path / "decay.json"
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--variants", "gla", "--gate-temperature", "2",
                       "--json", str(out_json)]) == 0
    assert "gates logsigmoid(x)/2, C=8:" in capsys.readouterr().out.splitlines()[0]
    data = json.loads(out_json.read_text())
    assert data["metadata"]["gate_temperature"] == 2.0
    assert {r["gate_temperature"] for r in data["results"]} == {2.0}
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--variants", "gla"]) == 0
    assert "gates logsigmoid(x)/16, C=8:" in capsys.readouterr().out.splitlines()[0]
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--variants", "delta", "--gate-temperature", "2"]) == 0
    assert "gates" not in capsys.readouterr().out.splitlines()[0]          # no variant with these gates ran
    import numpy as np
    rows = bench.run_decay_benchmark([8], variants=["gla"], heads=1, head_dim=4, repeats=1, warmup=0,
                                     backward=False, gate_temperature=np.float32(2.0))
    assert {r["gate_temperature"] for r in rows} == {2.0}
    for bad in ("0", "-1", "inf", "nan", "1e-300"):
        with pytest.raises(SystemExit) as exc:
            bench.main([*DECAY_TINY, "--seq-lens", "8", "--gate-temperature", bad])
        assert exc.value.code == 2 and "--gate-temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--gate-temperature", "2"])
    assert exc.value.code == 2 and "--gate-temperature applies to --decay only" in capsys.readouterr().err
    for bad in (float("inf"), 1e-39):
        with pytest.raises(ValueError, match="gate_temperature"):
            bench.run_decay_benchmark([8], gate_temperature=bad)
    with pytest.raises(TypeError, match="gate_temperature"):
        bench.run_decay_benchmark([8], gate_temperature="16")


def test_machine_info_records_the_commit():
    """A cached measurement names the code it measured, as the studies' provenance does."""
    info = bench.machine_info("cpu")
    assert "commit" in info
    assert info["commit"] is None or len(info["commit"].split("+")[0]) == 40


def test_machine_info_records_the_cpu_capability():
    """Two CPUs named alike ("AMD EPYC") can run ATen's AVX2 or AVX-512 kernels: recorded."""
    info = bench.machine_info("cpu")
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


# ------------------------------------------------------------------ --decay with several chunk sizes


def test_decay_several_chunk_sizes_in_the_same_rounds():
    """Every chunk size gets its own ungated row and chunk rows; the loops run once, after them."""
    rows = bench.run_decay_benchmark([40], variants=["delta", "gla"], heads=1, head_dim=4, chunk_size=(16, 8, 16),
                                     repeats=2, warmup=0)
    assert [(r["variant"], r["method"], r["chunk_size"]) for r in rows] == [
        ("ungated", "chunk", 16), ("delta", "chunk", 16), ("gla", "chunk", 16),
        ("ungated", "chunk", 8), ("delta", "chunk", 8), ("gla", "chunk", 8),
        ("delta", "recurrent", 16), ("gla", "recurrent", 16)]                  # 16 twice: timed once
    assert all(len(r["fwd_bwd_times"]) == 2 and r["fwd_bwd_s"] > 0 for r in rows)
    assert [r["effective_chunk_size"] for r in rows[:6]] == [16, 16, 16, 8, 8, 8]
    rows = bench.run_decay_benchmark([40], variants=["delta"], heads=1, head_dim=4, chunk_size=[8], repeats=1,
                                     warmup=0, backward=False, recurrent=False)
    assert [(r["variant"], r["method"], r["chunk_size"]) for r in rows] == [("ungated", "chunk", 8),
                                                                            ("delta", "chunk", 8)]
    with pytest.raises(ValueError, match="chunk_size must be a positive int or a non-empty sequence"):
        bench.run_decay_benchmark([8], chunk_size=[])
    with pytest.raises(ValueError, match="chunk_size entries"):
        bench.run_decay_benchmark([8], chunk_size=[16, 0])
    with pytest.raises(TypeError, match="recurrent must be a bool"):
        bench.run_decay_benchmark([8], recurrent=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted on Linux")
def test_interleaved_times_counts_the_page_faults_of_each_timed_call():
    """A call that fills 32 MiB of fresh memory (mmapped by glibc) faults once per page of it; one
    that reuses its buffer hardly ever, after the warm-up."""
    buf = torch.empty(2 ** 23)
    fns = {"fresh": lambda: torch.empty(2 ** 23).fill_(1.0), "reused": lambda: buf.fill_(1.0)}
    faults = {"stale": [1]}
    times = bench.interleaved_times(fns, repeats=3, warmup=1, faults=faults)
    assert set(faults) == {"stale", "fresh", "reused"} and all(len(faults[n]) == 3 for n in fns)
    assert min(faults["fresh"]) >= 2 ** 25 // 2 ** 21           # one per page even with 2 MiB pages
    assert max(faults["reused"]) < min(faults["fresh"]) // 4
    assert all(len(times[n]) == 3 for n in fns)
    rows = bench.run_decay_benchmark([16], variants=["delta"], heads=1, head_dim=4, chunk_size=8, repeats=2,
                                     warmup=0, recurrent=False)
    assert all(len(r["fwd_minor_faults"]) == 2 and len(r["fwd_bwd_minor_faults"]) == 2 for r in rows)
    assert all(isinstance(n, int) and n >= 0 for r in rows for n in r["fwd_bwd_minor_faults"])
    with pytest.raises(TypeError, match="faults must be a dict"):
        bench.interleaved_times(fns, repeats=1, faults=[])


def _fake_decay_rows(times: dict) -> list[dict]:
    """Rows as run_decay_benchmark returns them, with given f+b times per (variant, method, C)."""
    rows = []
    for (variant, method, C), seconds in times.items():
        rows.append(dict(variant=variant, method=method, seq_len=256, batch=1, heads=1, head_dim=4, chunk_size=C,
                         effective_chunk_size=C, dtype="float32", device="cpu", device_name="cpu", threads=1,
                         gate_temperature=16.0, fwd_s=seconds[0] / 2, fwd_bwd_s=sorted(seconds)[1],
                         fwd_times=[x / 2 for x in seconds], fwd_bwd_times=seconds, fwd_spread=0.0,
                         fwd_bwd_spread=0.0))
    return rows


def test_decay_table_divides_by_the_ungated_update_at_the_same_chunk_size():
    """Round by round: each row over the ungated update at its own C, and over its own first C."""
    rows = _fake_decay_rows({
        ("ungated", "chunk", 64): [1.0, 2.0, 1.0], ("delta", "chunk", 64): [2.0, 3.0, 1.5],
        ("ungated", "chunk", 32): [0.5, 1.0, 2.0], ("delta", "chunk", 32): [1.5, 3.0, 2.0],
        ("delta", "recurrent", 64): [8.0, 8.0, 8.0]})
    lines = bench.format_decay_table(rows).splitlines()
    assert "chunk_size in 64/32" in lines[0] and "chunk vs recurrent" in lines[0]
    assert lines[2].split()[:3] == ["T", "variant", "C"] and lines[2].rstrip().endswith("f+b / C=64")
    assert [line.split()[:3] for line in lines[3:7]] == [["256", "ungated", "64"], ["256", "delta", "64"],
                                                         ["256", "ungated", "32"], ["256", "delta", "32"]]
    # delta at 64 over ungated at 64: 2, 1.5, 1.5 -> 1.50 (1.50-2.00); at 32 over ungated at 32: 3, 3, 1
    assert "1.50 (1.50-2.00)" in lines[4] and "3.00 (1.00-3.00)" in lines[6]
    # delta at 32 over delta at 64: 0.75, 1, 1.33 -> 1.00 (0.75-1.33); ungated 0.5, 0.5, 2 -> 0.5 (0.5-2.00)
    assert lines[6].rstrip().endswith("1.00 (0.75-1.33)") and lines[5].rstrip().endswith("0.5 (0.5-2.00)")
    assert lines[4].rstrip().endswith(" 1")
    assert "8000" in lines[4] and "8000" in lines[6]          # the one recurrent timing, in both rows of delta
    no_loops = [r for r in rows if r["method"] == "chunk"]
    text = bench.format_decay_table(no_loops)
    assert "rec f+b" not in text and "chunk forms" in text.splitlines()[0] and "timed once" not in text


def test_decay_cli_chunk_sizes_and_no_recurrent(tmp_path, capsys):
    out_json = tmp_path / "decay.json"
    assert bench.main([*DECAY_TINY, "--seq-lens", "40", "--variants", "delta", "--chunk-size", "16", "8",
                       "--no-recurrent", "--json", str(out_json)]) == 0
    assert "chunk_size in 16/8" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["metadata"]["chunk_size"] == [16, 8] and data["metadata"]["recurrent"] is False
    assert [(r["variant"], r["chunk_size"]) for r in data["results"]] == [
        ("ungated", 16), ("delta", 16), ("ungated", 8), ("delta", 8)]
    assert bench.main([*DECAY_TINY, "--seq-lens", "40", "--variants", "delta", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["metadata"]["chunk_size"] == 64     # one value: an int, as before


@pytest.mark.parametrize("argv, message", [
    (["--chunk-size", "16", "32"], "--chunk-size takes one value without --decay, got 2"),
    (["--no-recurrent"], "--no-recurrent applies to --decay only"),
])
def test_attention_bench_refuses_decay_only_chunk_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--seq-lens", "8", "--no-progress", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_interleaved_rounds_change_every_functions_neighbour():
    """Rotating one fixed order kept each function's predecessor (a call after the per-token loop
    is slower, and the ungated yardstick always came after one): each round's order is drawn anew,
    seeded, so every function meets several predecessors and a run repeats itself."""
    def log_of_run():
        calls = []
        fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
        bench.interleaved_times(fns, repeats=12, warmup=0)
        return calls
    calls = log_of_run()
    rounds = [calls[i:i + 4] for i in range(0, 48, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    for name in "abcd":
        before = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(before) >= 2, (name, before)
    assert log_of_run() == calls


def test_decay_table_with_coinciding_chunk_sizes_and_without_backward():
    """T = 16 below both sizes: the rows say which size was asked for; without f+b times the
    comparison column shows no ratio at all (not a 1 with nothing behind it); loops alone still
    get their rows."""
    rows = bench.run_decay_benchmark([16], variants=["gla"], heads=1, head_dim=4, chunk_size=[64, 32], repeats=2,
                                     warmup=0)
    lines = bench.format_decay_table(rows).splitlines()
    assert [line.split()[:4] for line in lines[3:7]] == [["16", "ungated", "16", "of"], ["16", "gla", "16", "of"],
                                                         ["16", "ungated", "16", "of"], ["16", "gla", "16", "of"]]
    assert " of 64 " in lines[3] and " of 32 " in lines[5]
    rows = bench.run_decay_benchmark([64], variants=["delta"], heads=1, head_dim=4, chunk_size=[32, 16], repeats=1,
                                     warmup=0, backward=False, recurrent=False)
    lines = bench.format_decay_table(rows).splitlines()
    assert all(line.rstrip().endswith("-") for line in lines[3:7]), lines
    loops = [r for r in bench.run_decay_benchmark([16], variants=["gla", "delta"], heads=1, head_dim=4, repeats=1,
                                                  warmup=0, backward=False) if r["method"] == "recurrent"]
    lines = bench.format_decay_table(loops).splitlines()
    assert [line.split()[:2] for line in lines[3:5]] == [["16", "gla"], ["16", "delta"]]


@pytest.mark.parametrize("bad", [(x for x in (8, 4)), {8, 4}, b"\x08\x04", 8.0, "8"])
def test_decay_chunk_size_of_the_wrong_type_names_what_it_needs(bad):
    with pytest.raises(TypeError, match="chunk_size must be a positive int or a non-empty list or tuple"):
        bench.run_decay_benchmark([8], chunk_size=bad)


def test_a_chunk_size_beyond_t_is_costed_as_the_block_the_methods_run():
    """FLOPs and the memory estimate use min(C, T): C=4096 at T=32 was credited with 4096-token blocks
    (a forward share of the matmul rate above 500 %, and cells skipped for 10³⁰ GB)."""
    rows = bench.run_benchmark(["chunk"], [32], device="cpu", heads=2, head_dim=8, repeats=1, chunk_size=4096,
                               max_memory_gb=1.0)
    (row,) = rows
    assert row["status"] == "ok" and row["chunk_size"] == 4096
    assert row["fwd_flops"] == bench.forward_flops("chunk", 32, batch=1, heads=2, head_dim=8, chunk_size=32)
    assert row["predicted_memory_bytes"] == bench.predict_memory("chunk", 32, batch=1, heads=2, head_dim=8,
                                                                 chunk_size=32)


def test_duplicate_sequence_lengths_are_measured_once():
    """Two rows of one (method, T) shared their ratio columns (cells are keyed by method and T)."""
    rows = bench.run_benchmark(["chunk", "cumsum"], [16, 16, 32], device="cpu", heads=1, head_dim=4, repeats=1)
    assert [(r["method"], r["seq_len"]) for r in rows] == [("chunk", 16), ("cumsum", 16), ("chunk", 32),
                                                           ("cumsum", 32)]


# ------------------------------------------------------------------ the reference, half inputs, peers


def test_a_reference_left_out_of_methods_is_timed_and_divides(capsys):
    """--methods chunk --reference sdpa used to print no ratio columns, and say nothing about it."""
    argv = ["--device", "cpu", "--seq-lens", "16", "--heads", "1", "--head-dim", "4", "--repeats", "1",
            "--warmup", "0", "--methods", "chunk", "--reference", "sdpa", "--no-progress", "--no-backward"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-2:] == ["/", "sdpa"] and "fwd / sdpa" in lines[2]
    assert [line.split()[1] for line in lines[3:5]] == ["chunk", "sdpa"]


def test_a_table_says_why_it_has_no_ratio_columns():
    rows = bench.run_benchmark(["chunk", "fused"], [16], **TINY)                # fused cannot run on the CPU
    table = bench.format_table(rows, reference="fused")
    assert "fwd / fused" not in table
    assert "no ratio columns: the reference fused did not run (unavailable: the Triton kernel runs on CUDA" in table
    assert "no ratio columns" not in bench.format_table(rows, reference="chunk")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunk_cpu_runs_half_inputs_as_the_compiled_path_does(dtype):
    """linear_attention computes half inputs' features in float32, which the compiled kernel takes: so does
    the bench's chunk_cpu (it used to be marked unavailable for half inputs)."""
    cpu = torch.device("cpu")
    assert bench.unavailable("chunk_cpu", cpu, 64, dtype) == bench.unavailable("chunk_cpu", cpu, 64, torch.float32)
    if bench.unavailable("chunk_cpu", cpu, 64, dtype) is not None:
        pytest.skip(f"the compiled CPU kernel is not built here: {bench.unavailable('chunk_cpu', cpu, 64)}")
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(1, 2, 37, 8, 8))
    got = _output_and_grads(bench.method_fn("chunk_cpu", 16), q, k, v)
    want = _output_and_grads(lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, chunk_size=16), q, k, v)
    assert got[0].dtype == dtype
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.02, atol=0.02)


def test_without_transformers_the_decay_bench_says_it_has_no_peer(monkeypatch, capsys):
    monkeypatch.setattr(bench.run, "transformers_gated_delta", lambda: None)
    assert bench.main([*DECAY_TINY, "--seq-lens", "8", "--variants", "gated_delta"]) == 0
    out = capsys.readouterr().out
    assert "transformers_gdn" not in out and "(no peer: transformers is not importable here; pip install" in out


@pytest.fixture
def transformers_peer():
    pytest.importorskip("transformers", minversion="5.0", reason="the peer is transformers' gated delta rule: "
                        "pip install transformers (>= 5)")
    return bench.peers.transformers_gated_delta()


@pytest.mark.transformers
def test_the_transformers_peer_computes_the_gated_delta_rule(transformers_peer):
    """Its (B, T, H, D) call through linattn's layout gives gated_delta_rule(q · D^-1/2, ...): values and grads."""
    peer, label = transformers_peer
    assert label.startswith("transformers ") and label.endswith("torch_chunk_gated_delta_rule")
    q, k, v, (log_g, beta) = bench.run._decay_inputs("gated_delta", 2, 3, 100, 16, torch.float32, torch.device("cpu"),
                                                     seed=0, gate_temperature=4.0)
    got = _output_and_grads(bench.peers.gated_delta_peer_call(peer, log_g, beta, 32), q, k, v)
    want = _output_and_grads(lambda q, k, v: linattn.gated_delta_rule(q * 16 ** -0.5, k, v, log_g, beta,
                                                                     chunk_size=32), q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.transformers
def test_the_decay_bench_times_the_transformers_peer_in_the_same_rounds(transformers_peer):
    rows = bench.run_decay_benchmark([40], variants=["gated_delta"], heads=2, head_dim=8, chunk_size=[16, 32],
                                     repeats=2, warmup=0, recurrent=False)
    peer_rows = [r for r in rows if r["variant"] == "transformers_gdn"]
    assert [r["chunk_size"] for r in peer_rows] == [16, 32]
    assert all(r["peer"] == transformers_peer[1] and len(r["fwd_times"]) == len(r["fwd_bwd_times"]) == 2
               for r in peer_rows)
    assert all(r["peer"] is None for r in rows if r["variant"] != "transformers_gdn")
    table = bench.format_decay_table(rows)
    header, *body = table.splitlines()[2:2 + 1 + len(rows)]
    assert header.split()[-4:] == ["fwd", "peer/linattn", "f+b", "peer/linattn"]
    peer_lines = [line for line in body if "transformers_gdn" in line]
    assert len(peer_lines) == 2 and all(re_ratio(line) for line in peer_lines)
    assert "torch_chunk_gated_delta_rule, on the gated_delta rows' inputs" in table
    assert not any(r["variant"] == "transformers_gdn" for r in bench.run_decay_benchmark(
        [40], variants=["gated_delta"], heads=2, head_dim=8, repeats=1, warmup=0, recurrent=False, peers=False))


def re_ratio(line: str) -> bool:
    """The line ends with two paired-ratio cells, ``median (min-max)``."""
    import re

    return re.search(r"\d\S* \(\S+-\S+\)\s+\d\S* \(\S+-\S+\)$", line) is not None
