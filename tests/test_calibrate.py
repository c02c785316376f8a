"""linattn.calibrate and the calibrated "cpu" backend: LINATTN_CPU_KERNEL=1 runs a compiled loop only where the
calibration found it faster than the PyTorch chunk form; LINATTN_CPU_KERNEL=force and use_backends("cpu") run it
wherever it can run; last_backend() says which ran."""
import json

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import backends, calibrate
from linattn.kernels import cpu
from linattn.kernels.cpu import calibration

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")


@pytest.fixture
def own_calibration(monkeypatch, tmp_path):
    """A calibration file of our own, written where the library's would be."""
    path = tmp_path / "lib.so.calibration.json"
    monkeypatch.setattr(calibration, "calibration_path", lambda: path)
    monkeypatch.setattr(calibration, "_cache", {})

    def write(faster: dict, threads=None):
        threads = torch.get_num_threads() if threads is None else threads
        doc = {"threads": {str(threads): {op: {p: {"compiled_faster": faster[op, p]} for p in calibration.PASSES}
                                          for op in backends.OPS}}}
        path.write_text(json.dumps(doc))
        calibration._cache.clear()
    return write


def _qkv(grad, T=24):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, T, 8, generator=g).requires_grad_(grad) for _ in range(3)]


@needs_kernel
def test_by_default_the_compiled_loop_runs_exactly_where_it_was_calibrated_faster(own_calibration, monkeypatch):
    own_calibration({(op, p): op == "linear_attention" for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    q, k, v = _qkv(grad=True)
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "cpu"                            # calibrated faster: the default runs it
    linattn.delta_rule(q, F.normalize(k, dim=-1), v, torch.rand(1, 2, 24))
    assert backends.last_backend() == "torch"                          # calibrated slower: the PyTorch form
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")                      # off: never
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"


@needs_kernel
def test_a_loop_calibrated_slower_gives_way_to_the_pytorch_form_and_says_why(own_calibration, monkeypatch):
    # linear attention: compiled faster forward only; every other op faster in both passes
    own_calibration({(op, p): not (op == "linear_attention" and p == "forward+backward")
                     for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    q, k, v = _qkv(grad=True)
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"                          # forward+backward: slower here
    with torch.no_grad():
        linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "cpu"                            # forward only: faster here
    linattn.delta_rule(q, F.normalize(k, dim=-1), v, torch.rand(1, 2, 24))
    assert backends.last_backend() == "cpu"
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")                  # no calibration
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "cpu"
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    with backends.use_backends("cpu", "torch"):                         # pinned: runs wherever it can
        linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "cpu"
    with backends.use_backends("cpu", "torch", calibrated=True):
        linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"
    with pytest.raises(RuntimeError, match="slower than the PyTorch chunk form on this machine"):
        with backends.use_backends("cpu", calibrated=True):
            linattn.linear_attention(q, k, v, causal=True)


@needs_kernel
def test_no_verdict_yet_runs_the_calibrator_once_per_thread_count(own_calibration, monkeypatch):
    calls = []

    def fake(threads):
        calls.append(threads)
        own_calibration({(op, p): False for op in backends.OPS for p in calibration.PASSES}, threads)

    monkeypatch.setattr(backends, "_calibrator", [fake])
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    q, k, v = _qkv(grad=False)
    for _ in range(3):
        linattn.retention(q, k, v, 0.9)
        assert backends.last_backend() == "torch"
    assert calls == [torch.get_num_threads()]


@needs_kernel
def test_calibrate_cpu_kernels_times_both_forms_and_caches_the_verdicts(own_calibration, monkeypatch):
    monkeypatch.setattr(calibrate, "PROBLEM", dict(calibrate.PROBLEM, seq_len=16, heads=2, head_dim=8, rounds=2))
    doc = calibrate.calibrate_cpu_kernels(1)
    for op in backends.OPS:
        for p in calibration.PASSES:
            rec = doc["threads"]["1"][op][p]
            assert rec["compiled_s"] > 0 and rec["torch_s"] > 0
            assert rec["compiled_faster"] == (rec["torch_over_compiled"] > 1 and rec["compiled_s"] < rec["torch_s"])
            assert calibration.verdict(op, p == "forward+backward", 1) == rec["compiled_faster"]
    assert doc["problem"]["seq_len"] == 16 and "flags" in doc["build"]
    stamp = calibration.calibration_path().stat().st_mtime_ns
    assert calibrate.calibrate_cpu_kernels(1) == doc                    # cached: not measured again
    assert calibration.calibration_path().stat().st_mtime_ns == stamp


def test_use_backends_refuses_a_calibrated_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="calibrated must be a bool"):
        with backends.use_backends("torch", calibrated=1):
            pass


def test_force_puts_the_compiled_loops_in_the_default_order(monkeypatch):
    monkeypatch.setenv("LINATTN_DISABLE_TRITON", "1")
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    assert backends.default_backends() == ("cpu", "torch") and cpu.cpu_kernel_enabled()


@needs_kernel
def test_the_decay_bench_times_the_pytorch_forms_by_default_even_where_the_loops_were_faster(own_calibration,
                                                                                           monkeypatch):
    from linattn.bench import run_decay_benchmark
    own_calibration({(op, p): True for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    ran = []
    real_select = backends.select
    monkeypatch.setattr(backends, "select", lambda *a, **kw: ran.append(real_select(*a, **kw)) or ran[-1])
    rows = run_decay_benchmark(seq_lens=[32], variants=["delta"], batch=1, heads=1, head_dim=8, chunk_size=16,
                               repeats=1, warmup=0, recurrent=False)
    assert not any(r["cpu_kernel"] for r in rows)
    assert ran and set(ran) == {"torch"}                               # the study compares the PyTorch forms


@needs_kernel
def test_with_force_the_decay_bench_times_the_compiled_loops_even_where_calibrated_slower(own_calibration,
                                                                                         monkeypatch):
    from linattn.bench import run_decay_benchmark
    own_calibration({(op, p): False for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    ran = []
    real_select = backends.select
    monkeypatch.setattr(backends, "select", lambda *a, **kw: ran.append(real_select(*a, **kw)) or ran[-1])
    rows = run_decay_benchmark(seq_lens=[32], variants=["delta"], batch=1, heads=1, head_dim=8, chunk_size=16,
                               repeats=1, warmup=0, recurrent=False)
    assert all(r["cpu_kernel"] for r in rows)
    assert ran and set(ran) == {"cpu"}                                 # the loops ran, not the PyTorch form


def test_threads_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            calibrate.calibrate_cpu_kernels(bad)


@needs_kernel
def test_the_command_prints_every_op_and_pass(own_calibration, capsys):
    own_calibration({(op, p): True for op in backends.OPS for p in calibration.PASSES})
    for passes in json.loads(calibration.calibration_path().read_text())["threads"].values():
        for op in passes.values():
            for r in op.values():
                r["torch_over_compiled"] = 2.0
    calibration.calibration_path().write_text(json.dumps({"threads": {str(torch.get_num_threads()): passes}}))
    calibration._cache.clear()
    assert calibrate.main(["--threads", str(torch.get_num_threads())]) == 0
    out = capsys.readouterr().out
    assert out.count("  compiled\n") == 2 * len(backends.OPS) and "gated_delta_rule" in out


@pytest.mark.parametrize("content", ["[]", "null", '{"threads": []}', '{"threads": {"1": 5}}',
                                     '{"threads": {"1": {"delta_rule": {"forward": {}}}}}',
                                     '{"threads": {"1": {"delta_rule": {"forward": {"compiled_faster": "false"}}}}}'])
def test_a_file_that_is_not_a_calibration_counts_as_none(monkeypatch, tmp_path, content):
    path = tmp_path / "lib.so.calibration.json"
    path.write_text(content)
    monkeypatch.setattr(calibration, "calibration_path", lambda: path)
    monkeypatch.setattr(calibration, "_cache", {})
    assert calibration.verdict("delta_rule", False, 1) is None


def test_an_unwritable_calibration_warns_once_and_keeps_the_verdicts(monkeypatch, tmp_path):
    folder = tmp_path / "lib.so.calibration.json"
    folder.mkdir()                                       # a folder where the file should be: os.replace fails
    monkeypatch.setattr(calibration, "calibration_path", lambda: folder)
    monkeypatch.setattr(calibration, "_cache", {})
    monkeypatch.setattr(calibration, "_unwritable", set())
    results = {"delta_rule": {p: {"compiled_faster": True} for p in calibration.PASSES}}
    with pytest.warns(RuntimeWarning, match="could not be saved"):
        calibration.save_calibration(1, results, {})
    assert calibration.verdict("delta_rule", True, 1) is True
    assert list(tmp_path.iterdir()) == [folder] and not any(folder.iterdir())   # no temporary file left
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibration.save_calibration(1, results, {})     # warned once


@needs_kernel
def test_a_first_call_under_inference_mode_calibrates(own_calibration, monkeypatch):
    calls = []
    monkeypatch.setattr(backends, "_calibrator", [lambda n: calls.append(n) or calibrate.calibrate_cpu_kernels(n)])
    monkeypatch.setattr(calibrate, "PROBLEM", {**calibrate.PROBLEM, "seq_len": 32, "heads": 1, "rounds": 1})
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    q, k, v = _qkv(grad=False)
    with torch.inference_mode():
        out = linattn.linear_attention(q, k, v, causal=True)
    assert calls and torch.isfinite(out).all()


@needs_kernel
def test_a_gradient_through_the_initial_state_alone_follows_the_backward_verdict(own_calibration, monkeypatch):
    own_calibration({(op, p): p == "forward" for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    q, k, v = _qkv(grad=False)
    state = linattn.linear_attention(q, k, v, causal=True, return_state=True)[1]
    state = type(state)(state.S.clone().requires_grad_(), state.z.clone().requires_grad_())
    linattn.linear_attention(q, k, v, causal=True, initial_state=state)
    assert backends.last_backend() == "torch"


def test_use_backends_pins_only_the_calling_thread():
    import threading
    seen = []
    inside, release = threading.Event(), threading.Event()

    def pinned():
        with backends.use_backends("cpu", "torch"):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=pinned)
    t.start()
    inside.wait(5)
    seen.append(backends.enabled_backends())
    release.set()
    t.join()
    assert seen == [backends.default_backends()]


@needs_kernel
def test_a_first_call_inside_checkpoint_calibrates_apart_from_the_checkpoint(own_calibration, monkeypatch):
    """The calibration's own passes must not run through the caller's saved-tensor hooks (non-reentrant
    checkpoint counted them: 12 tensors saved against 10 on recomputation, and a CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(backends, "_calibrator", [calibrate.calibrate_cpu_kernels])
    monkeypatch.setattr(calibrate, "PROBLEM", {**calibrate.PROBLEM, "seq_len": 32, "heads": 1, "rounds": 1})
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    q, k, v = _qkv(grad=True)
    for op in (lambda q, k, v: linattn.linear_attention(q, k, v, causal=True),
               lambda q, k, v: linattn.delta_rule(q, F.normalize(k, dim=-1), v, torch.ones(1, 2, 24) / 2)):
        calibration._cache.clear()
        calibration.calibration_path().unlink(missing_ok=True)           # uncalibrated: the first call measures
        grads = torch.autograd.grad(checkpoint(op, q, k, v, use_reentrant=False).sum(), (q, k, v))
        assert calibration.verdict("delta_rule", True, torch.get_num_threads()) is not None
        with backends.use_backends("torch"):
            expected = torch.autograd.grad(op(q, k, v).sum(), (q, k, v))
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_malformed_entry_is_measured_again_and_never_read_as_faster(own_calibration, monkeypatch):
    own_calibration({(op, p): True for op in backends.OPS for p in calibration.PASSES})
    threads = torch.get_num_threads()
    path = calibration.calibration_path()
    doc = json.loads(path.read_text())
    doc["threads"][str(threads)]["linear_attention"] = None                # malformed: no verdict for this op
    path.write_text(json.dumps(doc))
    calibration._cache.clear()
    monkeypatch.setattr(backends, "_calibrator", [lambda n: None])           # a calibrator that measures nothing
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    q, k, v = _qkv(grad=False)
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"                              # no verdict: not taken as faster
    linattn.delta_rule(q, F.normalize(k, dim=-1), v, torch.ones(1, 2, 24) / 2)
    assert backends.last_backend() == "cpu"
    monkeypatch.setattr(calibrate, "PROBLEM", {**calibrate.PROBLEM, "seq_len": 16, "heads": 1, "head_dim": 8,
                                               "rounds": 1})
    doc = calibrate.calibrate_cpu_kernels(threads)                          # the entry is incomplete: measured
    assert isinstance(doc["threads"][str(threads)]["linear_attention"]["forward"]["compiled_faster"], bool)


@needs_kernel
@pytest.mark.parametrize("dtype, D", [(torch.float64, 8), (torch.float32, 128)])
def test_the_default_applies_the_verdicts_only_to_what_was_calibrated(own_calibration, monkeypatch, dtype, D):
    own_calibration({(op, p): True for op in backends.OPS for p in calibration.PASSES})
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, D, generator=g, dtype=dtype) for _ in range(3))
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"                              # float64, or a state beyond 64×64
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "cpu"


def test_the_calibration_file_is_readable_by_every_user(monkeypatch, tmp_path):
    path = tmp_path / "lib.so.calibration.json"
    monkeypatch.setattr(calibration, "calibration_path", lambda: path)
    monkeypatch.setattr(calibration, "_cache", {})
    calibration.save_calibration(1, {"delta_rule": {p: {"compiled_faster": True} for p in calibration.PASSES}}, {})
    assert path.stat().st_mode & 0o777 == 0o644
