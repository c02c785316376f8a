"""scripts/ft_side_by_side.py, the harness of appendix A's side-by-side run (§A.1), without the peer's C++.

The peer (fast-transformers' CPU kernel) is not part of linattn; here a stand-in module with the
same two functions, written with torch operations, checks what the harness adds around them: the
autograd wrapper, elu+1 and the cumsum normaliser, against linattn's float64 quadratic form.
"""
import importlib.util
import json
import pathlib
import types

import pytest
import torch

import linattn

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ft_side_by_side.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("ft_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in():
    """causal_dot_product / causal_dot_backward with the peer's contract: write into the given outputs."""
    def product(Q, K, V, out):
        out.copy_(torch.tril(Q @ K.transpose(-1, -2)) @ V)

    def backward(Q, K, V, g, gQ, gK, gV):
        mask = torch.tril(torch.ones(Q.shape[2], Q.shape[2], dtype=torch.bool))
        A = (Q @ K.transpose(-1, -2)).masked_fill(~mask, 0)
        dA = (g @ V.transpose(-1, -2)).masked_fill(~mask, 0)
        gQ.copy_(dA @ K)
        gK.copy_(dA.transpose(-1, -2) @ Q)
        gV.copy_(A.transpose(-1, -2) @ g)

    return types.SimpleNamespace(causal_dot_product=product, causal_dot_backward=backward)


def test_the_peer_wrapper_matches_the_quadratic_form_in_values_and_gradients(script):
    peer = script.make_peer(_stand_in())
    assert script.check_peer(peer) < 1e-5
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 37, 8, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 37, 8, generator=g)
    ours = torch.autograd.grad((peer(q, k, v) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((linattn.linear_attention(q, k, v, causal=True, method="quadratic") * w).sum(),
                              (q, k, v))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_peer_source_comes_from_a_checkout_or_says_what_is_missing(script, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        script.peer_source(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="holds no fast_transformers/causal_product"):
        script.peer_source(tmp_path)
    path = tmp_path / script.PEER_FILE
    path.parent.mkdir(parents=True)
    path.write_text("// the peer\n")
    assert script.peer_source(tmp_path) == ("// the peer\n", "unknown")


def test_the_command_line_refuses_bad_sizes(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--ft-source", str(tmp_path), "--repeats", "0", "--out", str(tmp_path / "x.json")])
    assert "positive integers" in capsys.readouterr().err


def test_the_results_file_records_the_seed_of_the_inputs(script, tmp_path, monkeypatch):
    seen = {}

    def fake_run_benchmark(methods, seq_lens, **kwargs):
        seen.setdefault("seeds", []).append(kwargs["seed"])
        return []

    monkeypatch.setattr(script, "peer_source", lambda source: ("// the peer", "abc1234"))
    monkeypatch.setattr(script, "build_peer", lambda text, flags, build_dir: _stand_in())
    monkeypatch.setattr(script.cpu, "cpu_kernel_available", lambda: True)
    monkeypatch.setattr(script.bench, "run_benchmark", fake_run_benchmark)
    out = tmp_path / "side.json"
    assert script.main(["--ft-source", str(tmp_path), "--threads", "1", "--seq-lens", "64",
                        "--repeats", "1", "--seed", "7", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert seen["seeds"] == [7]
    assert doc["seeds"] == {"inputs": 7, "peer_check": 0} and "--seed 7" in doc["command"]
    with pytest.raises(SystemExit):
        script.main(["--ft-source", str(tmp_path), "--seed", "-1", "--out", str(out)])


def test_the_host_isa_names_the_widest_vector_set(script, monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx fma avx2\n")
    real = script.pathlib.Path
    monkeypatch.setattr(script.pathlib, "Path", lambda p: info if p == "/proc/cpuinfo" else real(p))
    assert script.host_isa() == {"vector_flags": ["avx2", "fma", "avx", "sse4_2"], "widest": "AVX2"}
