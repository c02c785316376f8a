"""The fused Triton kernel (linattn.kernels.triton_chunk) against its twin, linattn.ops.linear.

Without CUDA the kernels run in Triton's interpreter (NumPy on the CPU), so the shapes
are tiny. Triton decides interpreter-or-compiler when a function is decorated with
``@triton.jit``: its own library functions when Triton is imported, ours when
``linattn.kernels.triton_chunk`` is imported. The kernels call only Triton builtins, so
ours is the import that matters: the ``tk`` fixture sets ``TRITON_INTERPRET=1`` first,
then imports the module, or re-imports it if it was imported earlier in the other mode.
The variable stays set while this module's tests run (Triton reads it again at launch
time) and is restored afterwards.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

import linattn.kernels
from linattn.ops.linear.naive import naive_chunk_linear_attention as chunk_linear_attention

B, H, M, DV = 2, 2, 16, 33  # M != Dv, Dv not a power of two (like the values plus a ones column)


@pytest.fixture(scope="module")
def tk():
    """The kernel module, importable and runnable here (compiled on CUDA, else interpreted)."""
    interpret = not torch.cuda.is_available()
    with pytest.MonkeyPatch.context() as mp:
        if interpret:
            mp.setenv("TRITON_INTERPRET", "1")  # before Triton's first import, in case this is it
        pytest.importorskip("triton", reason="Triton is not installed (pip install 'linattn[triton]')")
        module = importlib.import_module("linattn.kernels.triton.chunk")
        if module._INTERPRETED != interpret:
            module = importlib.reload(module)
        yield module


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, dtype=torch.float32, m=M, dv=DV, b=B, h=H, seed=0):
    """Positive features (as elu+1 gives), signed values, a float32 initial state."""
    g = torch.Generator().manual_seed(seed)
    phi_q = F.elu(torch.randn(b, h, T, m, generator=g)) + 1                     # (B, H, T, M)
    phi_k = F.elu(torch.randn(b, h, T, m, generator=g)) + 1                     # (B, H, T, M)
    v = torch.randn(b, h, T, dv, generator=g)                                   # (B, H, T, Dv)
    S0 = torch.randn(b, h, m, dv, generator=g)                                  # (B, H, M, Dv)
    d_out = torch.randn(b, h, T, dv, generator=g)                               # upstream grads
    d_S = torch.randn(b, h, m, dv, generator=g)
    dev = _device()
    return ([x.to(dev, dtype) for x in (phi_q, phi_k, v)] + [S0.to(dev)],
            d_out.to(dev, dtype), d_S.to(dev))


def _run(fn, phi_q, phi_k, v, S0, chunk_size, d_out, d_S, dtype=None):
    """(out, S, dphi_q, dphi_k, dv, dS0) of ``fn``, for the loss Σ out·d_out + Σ S·d_S."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (phi_q, phi_k, v, S0)]
    out, S = fn(*leaves, chunk_size)
    loss = (out * d_out.to(out.dtype)).sum() + (S * d_S.to(S.dtype)).sum()
    return (out, S) + torch.autograd.grad(loss, leaves)


def _assert_rel(actual, expected, tol, what):
    """max |actual - expected| <= tol · max |expected| (errors relative to the tensor's scale)."""
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x scale {scale:.3g}"


NAMES = ("out", "S", "dphi_q", "dphi_k", "dv", "dS0")


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("T", [1, 17, 64, 100])
def test_float32_matches_reference(tk, T, chunk_size):
    inputs, d_out, d_S = _inputs(T)
    got = _run(tk.chunk_linear_attention_triton, *inputs, chunk_size, d_out, d_S)
    twin = _run(chunk_linear_attention, *inputs, chunk_size, d_out, d_S)
    exact = _run(chunk_linear_attention, *inputs, chunk_size, d_out, d_S, dtype=torch.float64)
    for name, a, b, c in zip(NAMES, got, twin, exact):
        assert a.dtype == torch.float32, name
        _assert_rel(a, b, 1e-5, f"{name} vs float32 twin")
        _assert_rel(a, c, 1e-5, f"{name} vs float64 twin")


def test_several_tiles_of_M_and_Dv(tk):
    """M = 80 and Dv = 65 exceed one 64-wide tile: the kernels loop over tiles and mask them."""
    inputs, d_out, d_S = _inputs(40, m=80, dv=65, b=1, h=1)
    got = _run(tk.chunk_linear_attention_triton, *inputs, 16, d_out, d_S)
    exact = _run(chunk_linear_attention, *inputs, 16, d_out, d_S, dtype=torch.float64)
    for name, a, c in zip(NAMES, got, exact):
        _assert_rel(a, c, 1e-5, name)


# Output and input grads are rounded to the input dtype once (half an ulp: 2^-11 for
# float16, 2^-8 for bfloat16, relative); allow about two ulps of the largest entry.
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_inputs(tk, dtype, tol):
    inputs, d_out, d_S = _inputs(40, dtype=dtype)
    got = _run(tk.chunk_linear_attention_triton, *inputs, 16, d_out, d_S)
    exact = _run(chunk_linear_attention, *inputs, 16, d_out, d_S, dtype=torch.float64)
    expected_dtypes = (dtype, torch.float32, dtype, dtype, dtype, torch.float32)
    for name, a, c, want in zip(NAMES, got, exact, expected_dtypes):
        assert a.dtype == want, f"{name}: dtype {a.dtype}, expected {want}"
        _assert_rel(a, c, 1e-5 if want == torch.float32 else tol, name)


def test_no_initial_state_and_one_output_used(tk):
    """S0=None means zeros; a loss on `out` only or on `S` only gives the twin's grads
    (for a loss on `S` only, zero for phi_q)."""
    (phi_q, phi_k, v, _), _, _ = _inputs(20)
    for use_out, use_S in ((True, False), (False, True)):
        grads = []
        for fn in (tk.chunk_linear_attention_triton, chunk_linear_attention):
            leaves = [x.detach().requires_grad_() for x in (phi_q, phi_k, v)]
            out, S = fn(*leaves, None, 16)
            loss = (out.sum() if use_out else 0) + ((S * S).sum() if use_S else 0)
            grads.append((out, S) + torch.autograd.grad(loss, leaves, materialize_grads=True))
        for name, a, b in zip(NAMES, *grads):
            _assert_rel(a, b, 1e-5, f"{name} (out used: {use_out}, S used: {use_S})")


def test_grads_only_where_required(tk):
    """Only v and S0 require grad: they get the twin's grads, the features get none."""
    inputs, d_out, d_S = _inputs(20)
    phi_q, phi_k, v, S0 = (x.detach() for x in inputs)
    results = []
    for fn in (tk.chunk_linear_attention_triton, chunk_linear_attention):
        v_, S0_ = v.clone().requires_grad_(), S0.clone().requires_grad_()
        out, S = fn(phi_q, phi_k, v_, S0_, 16)
        results.append(torch.autograd.grad((out * d_out).sum() + (S * d_S).sum(), (v_, S0_)))
    for name, a, b in zip(("dv", "dS0"), *results):
        _assert_rel(a, b, 1e-5, name)


def test_non_contiguous_inputs(tk):
    """A transposed view (B, T, H, M) → (B, H, T, M) gives the same numbers."""
    (phi_q, phi_k, v, S0), _, _ = _inputs(20)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (phi_q, phi_k, v)]
    assert not views[0].is_contiguous()
    got = tk.chunk_linear_attention_triton(*views, S0, 16)
    expected = chunk_linear_attention(phi_q, phi_k, v, S0, 16)
    for name, a, b in zip(("out", "S"), got, expected):
        _assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("chunk_size", [0, 8, 24, 48, -16])
def test_bad_chunk_size_raises(tk, chunk_size):
    (phi_q, phi_k, v, S0), _, _ = _inputs(4)
    with pytest.raises(ValueError, match="chunk_size"):
        tk.chunk_linear_attention_triton(phi_q, phi_k, v, S0, chunk_size)


@pytest.mark.parametrize("chunk_size", [32.0, True, None])
def test_non_int_chunk_size_raises(tk, chunk_size):
    (phi_q, phi_k, v, S0), _, _ = _inputs(4)
    with pytest.raises(TypeError, match="chunk_size"):
        tk.chunk_linear_attention_triton(phi_q, phi_k, v, S0, chunk_size)


def test_bad_inputs_raise(tk):
    (phi_q, phi_k, v, S0), _, _ = _inputs(4)
    f = tk.chunk_linear_attention_triton
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        f(phi_q.double(), phi_k.double(), v.double(), None, 16)
    with pytest.raises(TypeError, match="dtype"):
        f(phi_q, phi_k, v.half(), None, 16)
    with pytest.raises(ValueError, match="phi_q and phi_k"):
        f(phi_q, phi_k[..., :-1], v, None, 16)
    with pytest.raises(ValueError, match="v must be"):
        f(phi_q, phi_k, v[:, :, :-1], None, 16)
    with pytest.raises(ValueError, match="S0 must have shape"):
        f(phi_q, phi_k, v, S0[..., :-1], 16)
    with pytest.raises(ValueError, match="phi_q must be 4-D"):
        f(phi_q[0], phi_k, v, None, 16)


def test_float32_precision_follows_torch(tk):
    """Full float32 products by default; TF32 only when PyTorch's matmuls may use it."""
    previous = torch.get_float32_matmul_precision()
    try:
        assert tk._dot_precision(torch.float32) == "ieee" or previous != "highest"
        torch.set_float32_matmul_precision("high")
        assert tk._dot_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert tk._dot_precision(torch.bfloat16) == "tf32"


def test_triton_available_in_interpreter(tk, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert linattn.kernels.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert linattn.kernels.triton_available() == torch.cuda.is_available()


def test_kernels_package_does_not_need_triton(monkeypatch):
    """`import linattn.kernels` works without Triton, and then reports it unavailable."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    module = importlib.reload(linattn.kernels)
    assert module.triton_available() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cpu_tensors_without_interpreter_raise(tk, monkeypatch):
    monkeypatch.setattr(tk, "_INTERPRETED", False)  # as if imported without TRITON_INTERPRET=1
    (phi_q, phi_k, v, S0), _, _ = _inputs(4)
    with pytest.raises(ValueError, match="CUDA tensors.*TRITON_INTERPRET=1"):
        tk.chunk_linear_attention_triton(phi_q, phi_k, v, S0, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_with_a_float32_output(tk, dtype):
    """out_dtype=float32: half features and values in, float32 sums out (and a float32 upstream
    gradient in the backward): within float32 rounding of the float64 twin on the same inputs."""
    inputs, d_out, d_S = _inputs(40, dtype=dtype)
    fn = lambda *a: tk.chunk_linear_attention_triton(*a, out_dtype=torch.float32)  # noqa: E731
    got = _run(fn, *inputs, 16, d_out.float(), d_S)
    exact = _run(chunk_linear_attention, *inputs, 16, d_out.float(), d_S, dtype=torch.float64)
    expected_dtypes = (torch.float32, torch.float32, dtype, dtype, dtype, torch.float32)
    half_tol = 2e-3 if dtype == torch.float16 else 1.6e-2           # input grads: one rounding to dtype
    for name, a, c, want in zip(NAMES, got, exact, expected_dtypes):
        assert a.dtype == want, f"{name}: dtype {a.dtype}, expected {want}"
        _assert_rel(a, c, 1e-5 if want == torch.float32 else half_tol, name)
    with pytest.raises(TypeError, match="out_dtype"):
        tk.chunk_linear_attention_triton(*inputs, 16, out_dtype=torch.float64)


def test_linear_attention_half_inputs_through_the_fused_kernel(tk, monkeypatch, triton_backend):
    """The dispatch for float16 inputs: features and values read in float16, the normaliser kept
    in float32 (it passes 65504 here: T = 2048, elu+1 features of D = 16), output rounded once."""
    from linattn import backends

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 16, generator=g).to(_device(), torch.float16) for _ in range(3))
    exact = linattn.linear_attention(q.double(), k.double(), v.double(), causal=True)
    triton_backend(lambda tensors, chunk_size: None)
    calls = []
    real = tk.chunk_linear_attention_triton

    def spy(*args, **kwargs):
        calls.append((args[0].dtype, kwargs.get("out_dtype")))
        return real(*args, **kwargs)

    monkeypatch.setitem(vars(linattn.kernels), "chunk_linear_attention_triton", spy)
    out = linattn.linear_attention(q, k, v, causal=True, chunk_size=64)
    assert calls == [(torch.float16, torch.float32)] and out.dtype == torch.float16
    assert out.isfinite().all() and backends.last_backend() == "triton"
    _assert_rel(out, exact, 4e-3, "float16 output")          # features and output rounded to float16
