"""The compiled CPU path (linattn.kernels.cpu) against float64 references, and its dispatch.

Every value and gradient is compared with the masked quadratic form in float64 (tests/refimpl.py)
or with the PyTorch chunk path's error against it. The kernel is built by the system's C++
compiler on first use; where there is none the kernel tests are skipped with that reason, and
the fallback tests (which need no compiler) still run.
"""
from __future__ import annotations

import math
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import linattn
from linattn import backends
from linattn.kernels import cpu
from linattn.kernels.cpu import runtime as cpu_runtime
from refimpl import ref_linear_attention

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(),
                                  reason=f"no C++ compiler for the CPU kernel: {cpu.build_info().get('error')}")


def _qkv(B, H, T, D, Dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype).requires_grad_() for x in (q, k, v))


def _features(q, k):
    return linattn.elu_plus_one(q), linattn.elu_plus_one(k)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 150), D=st.integers(1, 20),
       Dv=st.integers(1, 20), chunk_size=st.integers(1, 70), normalize=st.booleans(), with_state=st.booleans(),
       inside=st.booleans(), seed=st.integers(0, 2**16))
def test_property_values_state_and_every_gradient_match_float64(B, H, T, D, Dv, chunk_size, normalize, with_state,
                                                               inside, seed):
    """Outputs, final state and the gradients of q, k, v, S0 and z0 against the quadratic form
    (float64): ragged T, any chunk size, dimensions that are not whole vectors (padded inside),
    elu+1 applied outside or inside the kernel's Function (``feature_map="elu+1"``)."""
    q, k, v = _qkv(B, H, T, D, Dv, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    params = [q, k, v]
    S0 = z0 = None
    if with_state:
        S0 = torch.rand(B, H, D, Dv, generator=g, dtype=torch.float64).requires_grad_()
        z0 = torch.rand(B, H, D, generator=g, dtype=torch.float64).requires_grad_()
        params += [S0, z0]
    qk = (q, k) if inside else _features(q, k)
    out, S, z = cpu.causal_linear_attention_cpu(*qk, v, S0, z0, normalize=normalize, chunk_size=chunk_size,
                                                feature_map="elu+1" if inside else None)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, normalize=normalize,
                                             initial_state=None if S0 is None else (S0, z0))
    for got, want in ((out, ref), (S, S_ref), (z, z_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_S = torch.randn(S.shape, generator=g, dtype=torch.float64)
    w_z = torch.randn(z.shape, generator=g, dtype=torch.float64)
    loss = (out * w_out).sum() + (S * w_S).sum() + (z * w_z).sum()
    loss_ref = (ref * w_out).sum() + (S_ref * w_S).sum() + (z_ref * w_z).sum()
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@needs_kernel
@pytest.mark.parametrize("which", ["out", "S", "z"])
def test_gradients_of_each_output_alone(which):
    """Only one output used: the others' gradients are None (no zero tensors needed) and the
    gradients equal the float64 reference's."""
    q, k, v = _qkv(1, 2, 45, 6, 7, seed=3)
    outs = dict(zip(("out", "S", "z"), cpu.causal_linear_attention_cpu(*_features(q, k), v, chunk_size=16)))
    refs = dict(zip(("out", "S", "z"), ref_linear_attention(q, k, v, causal=True)))
    w = torch.randn(outs[which].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = torch.autograd.grad((outs[which] * w).sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad((refs[which] * w).sum(), (q, k, v), allow_unused=True)
    for g_, w_ in zip(got, want):
        if w_ is None or torch.count_nonzero(w_) == 0:
            assert g_ is None or torch.count_nonzero(g_) == 0
        else:
            torch.testing.assert_close(g_, w_, rtol=1e-9, atol=1e-10)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elu_plus_one_inside_is_the_same_arithmetic_as_outside(dtype):
    """feature_map="elu+1" (φ formed by the library, its chain rule in place) gives bit for bit what
    elu_plus_one's features give, at the edges of φ too: e^x underflowing, x = -0.0, 0, tiny, large."""
    q, k, v = (x.detach() for x in _qkv(1, 2, 40, 8, 8, seed=5, dtype=dtype))
    edges = torch.tensor([-200.0, -104.0, -17.0, -0.0, 0.0, 1e-30, 1e-8, 60.0], dtype=dtype)
    q[0, 0, 3], k[0, 1, 7] = edges, edges.flip(0)
    runs = []
    for inside in (True, False):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        args = (qq, kk) if inside else _features(qq, kk)
        out, S, z = cpu.causal_linear_attention_cpu(*args, vv, chunk_size=16,
                                                    feature_map="elu+1" if inside else None)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        runs.append((out, S, z, *torch.autograd.grad((out * w).sum() + S.sum() + z.sum(), (qq, kk, vv))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@needs_kernel
def test_float32_error_at_65536_tokens_is_no_larger_than_the_pytorch_paths():
    """Two-level sums (within blocks of C tokens, then across blocks): with positive terms, whose
    running sum grows linearly, the float32 relative error against float64 at T = 65536 stays at
    the PyTorch chunk path's level (one running sum of T terms is about 8x worse here)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.rand(1, 1, 65536, 16, generator=g, dtype=torch.float64) for _ in range(3))
    exact = linattn.linear_attention(q, k, v, causal=True, normalize=False, feature_map=None)   # float64
    q, k, v = q.float(), k.float(), v.float()
    ours = cpu.causal_linear_attention_cpu(q, k, v, normalize=False)[0]
    pytorch = linattn.linear_attention(q, k, v, causal=True, normalize=False, feature_map=None)
    err_ours = ((ours.double() - exact).abs() / exact).max().item()
    err_pytorch = ((pytorch.double() - exact).abs() / exact).max().item()
    assert err_ours <= 2 * err_pytorch and err_ours < 2e-6, (err_ours, err_pytorch)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_and_two_threads_give_identical_numbers(dtype):
    q, k, v = _qkv(2, 3, 300, 16, 32, seed=1, dtype=dtype)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, S, z = cpu.causal_linear_attention_cpu(*_features(q, k), v)
            results.append((out, S, z, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_token_never_changes_an_earlier_output(which, value):
    q, k, v = (x.detach() for x in _qkv(1, 2, 70, 8, 8, seed=2, dtype=torch.float32))
    clean = cpu.causal_linear_attention_cpu(*_features(q, k), v, chunk_size=16)[0]
    args = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    args[which][:, :, 37] = value                          # inside a block, not at its start
    dirty = cpu.causal_linear_attention_cpu(*_features(args["q"], args["k"]), args["v"], chunk_size=16)[0]
    assert torch.equal(dirty[:, :, :37], clean[:, :, :37])


@needs_kernel
def test_eps_replaces_only_a_zero_normaliser_and_tiny_ones_are_used_as_they_are():
    """ReLU features of a query orthogonal to every key: normaliser 0 -> output 0, finite
    gradients; a tiny positive normaliser (features 1e-30) gives the exact weighted average."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1e-30, 1e-30]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[[2.0], [4.0], [6.0]]]], dtype=torch.float64, requires_grad=True)
    out = cpu.causal_linear_attention_cpu(q, k, v)[0]
    ref = ref_linear_attention(q, k, v, causal=True, feature_map=None)[0]
    assert out[0, 0, 0, 0].item() == 0.0
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@needs_kernel
def test_states_own_their_memory_and_the_output_is_checked_for_in_place_changes():
    q, k, v = _qkv(1, 1, 20, 4, 4, seed=4)
    S0, z0 = torch.rand(1, 1, 4, 4, dtype=torch.float64), torch.rand(1, 1, 4, dtype=torch.float64)
    out, S, z = cpu.causal_linear_attention_cpu(*_features(q, k), v, S0, z0)
    for t in (S, z):
        assert t.is_contiguous()
        assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in (S0, z0, q, k, v, out))
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@needs_kernel
def test_second_derivatives_raise():
    q, k, v = _qkv(1, 1, 9, 4, 4)
    out = cpu.causal_linear_attention_cpu(*_features(q, k), v)[0]
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives .* are not supported"):
        torch.autograd.grad(gq.sum(), q)


@needs_kernel
def test_bad_inputs_are_refused():
    q, k, v = (x.detach() for x in _qkv(1, 1, 8, 4, 4))
    with pytest.raises(TypeError, match="float32, float64"):
        cpu.causal_linear_attention_cpu(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="expected phi_q"):
        cpu.causal_linear_attention_cpu(q, k[:, :, :4], v)
    with pytest.raises(ValueError, match="S0 must have shape"):
        cpu.causal_linear_attention_cpu(q, k, v, torch.zeros(1, 1, 4, 5, dtype=q.dtype))
    with pytest.raises(ValueError, match="chunk_size"):
        cpu.causal_linear_attention_cpu(q, k, v, chunk_size=0)


# ------------------------------------------------------------------ dispatch from linear_attention


@needs_kernel
def test_linear_attention_uses_the_kernel_unless_turned_off(monkeypatch):
    q, k, v = _qkv(1, 2, 33, 8, 8, dtype=torch.float32)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    assert "Cpu" not in type(linattn.linear_attention(q, k, v, causal=True).grad_fn).__name__
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    y, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
    assert "CpuEluCausal" in type(y.grad_fn).__name__                 # elu+1 applied inside the kernel's Function
    y_relu = linattn.linear_attention(q, k, v, causal=True, feature_map="relu")
    assert "CpuCausal" in type(y_relu.grad_fn).__name__                # other maps: features passed in
    torch.testing.assert_close(y_relu.double(), ref_linear_attention(q, k, v, causal=True, feature_map="relu")[0],
                               rtol=1e-5, atol=1e-6)
    mask = torch.ones(1, 33, dtype=torch.bool)
    mask[:, :5] = False
    y_mask = linattn.linear_attention(q, k, v, causal=True, attention_mask=mask)
    assert "CpuCausal" in type(y_mask.grad_fn).__name__
    torch.testing.assert_close(y_mask.double(), ref_linear_attention(q, k, v, causal=True, attention_mask=mask)[0],
                               rtol=1e-5, atol=1e-6)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.S.double(), S_ref, rtol=1e-5, atol=1e-5)
    # not for half inputs, other methods, or inside torch.func transforms
    assert "Cpu" not in type(linattn.linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                      causal=True).grad_fn).__name__
    assert backends.select("linear_attention", torch.zeros(1, 1, 4, 4, dtype=torch.float16)) == "torch"
    grads = torch.func.grad(lambda q_: linattn.linear_attention(q_, k, v, causal=True).sum())(q.detach())
    torch.testing.assert_close(grads, torch.autograd.grad(y.sum(), q)[0], rtol=1e-5, atol=1e-6)


@needs_kernel
def test_linear_attention_with_the_kernel_compiles_fullgraph(monkeypatch):
    """Under torch.compile the PyTorch path is traced (the kernel is not a traceable op)."""
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    q, k, v = (x.detach() for x in _qkv(1, 2, 20, 4, 4, dtype=torch.float32))
    fn = torch.compile(lambda q, k, v: linattn.linear_attention(q, k, v, causal=True), backend="eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), linattn.linear_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_pytorch_path_runs_with_one_warning(monkeypatch, tmp_path):
    """No compiler (or a failing build): not available, a RuntimeWarning once, the same numbers."""
    monkeypatch.setattr(cpu_runtime, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    assert cpu.cpu_kernel_available() is False and "compiler" in cpu.build_info()["error"]
    q, k, v = _qkv(1, 1, 10, 4, 4, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="CPU kernel is not available"):
        y = linattn.linear_attention(q, k, v, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linattn.linear_attention(q, k, v, causal=True)                      # warned once only
    torch.testing.assert_close(y.double(), ref_linear_attention(q, k, v, causal=True)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="not available"):
        cpu.causal_linear_attention_cpu(q, k, v)


def test_without_a_compiler_the_default_runs_the_pytorch_path_quietly(monkeypatch, tmp_path):
    """The compiled loops are on by default; where they cannot be built, the default says nothing."""
    monkeypatch.setattr(cpu_runtime, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    q, k, v = _qkv(1, 1, 10, 4, 4, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = linattn.linear_attention(q, k, v, causal=True)
    assert linattn.backends.last_backend() == "torch"
    torch.testing.assert_close(y.double(), ref_linear_attention(q, k, v, causal=True)[0], rtol=1e-5, atol=1e-6)


def test_a_failing_build_is_reported_not_raised(monkeypatch, tmp_path):
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fake 1.0'\n[ \"$1\" = --version ] && exit 0\necho broken >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_runtime, "_state", {})
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu.cpu_kernel_available() is False
    assert "broken" in cpu.build_info()["error"]
    assert not list((tmp_path / "cache").glob("*.so"))                       # no half-written library


@needs_kernel
def test_a_cached_library_that_does_not_load_is_rebuilt(tmp_path):
    """A cached .so that exists but fails to load (a truncated copy, a full disk) is built afresh, with
    the same flags, instead of falling back to another build or to the PyTorch path on every run."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "LINATTN_CACHE_DIR": str(tmp_path / "cache")}
    probe = ("import json, torch; from linattn.kernels import cpu; ok = cpu.cpu_kernel_available(); "
             "q = torch.rand(1, 2, 30, 8, generator=torch.Generator().manual_seed(0)); "
             "y = cpu.causal_linear_attention_cpu(q, q, q)[0] if ok else None; "
             "print(json.dumps({'ok': ok, 'flags': cpu.build_info().get('flags'), "
             "'y': None if y is None else y.double().sum().item()}))")

    def run():
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first["ok"]
    built = sorted((tmp_path / "cache").glob("*.so"))
    assert built
    whole = {path: path.read_bytes() for path in built}
    for damage in (lambda b: b"not a shared library", lambda b: b[:len(b) // 3]):   # garbage; truncated (SIGBUS)
        for path in built:                               # a new file in its place (never write over a mapped one)
            path.unlink()
            path.write_bytes(damage(whole[path]))
        again = run()
        assert again["ok"] and again["flags"] == first["flags"]
        assert again["y"] == first["y"]
        assert all(path.read_bytes()[:4] == b"\x7fELF" for path in built)


@needs_kernel
def test_a_chunk_size_beyond_the_sequence_is_the_sequence(monkeypatch):
    """chunk_size near 2⁶³ overflowed the kernel's block count (no block ran: uninitialised output)."""
    import sys

    q, k, v = _qkv(1, 2, 9, 4, 5, dtype=torch.float64)
    fq, fk = (x.detach() for x in _features(q, k))
    v = v.detach()
    ref = ref_linear_attention(fq, fk, v, feature_map=None, causal=True)[0]
    for C in (9, 10**6, 2**62, sys.maxsize, 2**63, 2**70):
        out = cpu.causal_linear_attention_cpu(fq, fk, v, chunk_size=C)[0]
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    out = linattn.linear_attention(fq, fk, v, causal=True, feature_map=None, chunk_size=sys.maxsize)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@needs_kernel
def test_the_direct_entry_point_checks_the_state_normalize_and_eps():
    q, k, v = _qkv(1, 1, 6, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="S0 must be on the CPU, got meta"):
        cpu.causal_linear_attention_cpu(q, k, v, S0=torch.zeros(1, 1, 4, 4, device="meta"))
    with pytest.raises(ValueError, match="z0 must be on the CPU, got meta"):
        cpu.causal_linear_attention_cpu(q, k, v, z0=torch.zeros(1, 1, 4, device="meta"))
    with pytest.raises(TypeError, match="z0 must be a floating-point tensor"):
        cpu.causal_linear_attention_cpu(q, k, v, z0=torch.zeros(1, 1, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="S0"):
        cpu.causal_linear_attention_cpu(q, k, v, S0=[[0.0]])
    with pytest.raises(TypeError, match="normalize must be a bool"):
        cpu.causal_linear_attention_cpu(q, k, v, normalize="no")
    for eps in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            cpu.causal_linear_attention_cpu(q, k, v, eps=eps)


def test_a_build_for_a_target_the_compiler_refuses_warns_and_builds_without_it(monkeypatch, tmp_path):
    fake = tmp_path / "fake-c++"                     # fails whenever -march is given, else hands over to c++
    fake.write_text("#!/bin/sh\ncase \"$*\" in *-march=*) echo 'bad -march value' >&2; exit 1;; esac\n"
                    "exec c++ \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_runtime, "_state", {})
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LINATTN_CPU_MARCH", "notacpu")
    if shutil.which("c++") is None:
        pytest.skip("no c++ to hand over to")
    with pytest.warns(RuntimeWarning, match="could not be built for the target asked for.*bad -march value"):
        assert cpu.cpu_kernel_available() is True
    assert not any(f.startswith("-march") for f in cpu.build_info()["flags"])


def test_an_empty_march_means_native(monkeypatch):
    monkeypatch.setenv("LINATTN_CPU_MARCH", "")
    assert cpu.target_flags() == ["-march=native"]
