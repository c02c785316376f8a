"""linattn.backends: the default order from the environment, use_backends, last_backend, and the errors."""
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import backends
from linattn.kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")


def _qkv(T=20, D=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, D, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("cpu_kernel, no_triton, expected", [
    (None, None, ("triton", "cpu", "torch")), ("", None, ("triton", "cpu", "torch")), ("0", None, ("triton", "torch")),
    ("1", None, ("triton", "cpu", "torch")), ("1", "1", ("cpu", "torch")), ("0", "1", ("torch",))])
def test_the_default_order_comes_from_the_environment(cpu_kernel, no_triton, expected, monkeypatch):
    for name, value in (("LINATTN_CPU_KERNEL", cpu_kernel), ("LINATTN_DISABLE_TRITON", no_triton)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert backends.default_backends() == expected
    assert backends.enabled_backends() == expected


@pytest.mark.parametrize("name, value, expected", [("LINATTN_CPU_KERNEL", "true", ("triton", "torch")),
                                                   ("LINATTN_CPU_KERNEL", "yes", ("triton", "torch")),
                                                   ("LINATTN_DISABLE_TRITON", "on", ("triton", "cpu", "torch"))])
def test_an_unrecognised_environment_value_warns_and_counts_as_0(name, value, expected, monkeypatch):
    monkeypatch.setattr(backends, "_env_warned", set())
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    monkeypatch.delenv("LINATTN_DISABLE_TRITON", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.warns(RuntimeWarning, match=f"{name}='{value}' is not one of"):
        assert backends.default_backends() == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # once per value, not on every call
        backends.default_backends()


def test_use_backends_pins_an_order_and_nests(monkeypatch):
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "1")
    with backends.use_backends("torch") as order:
        assert order == ("torch",) and backends.enabled_backends() == ("torch",)
        with backends.use_backends("cpu", "torch", "cpu"):
            assert backends.enabled_backends() == ("cpu", "torch")
        assert backends.enabled_backends() == ("torch",)
    assert backends.enabled_backends() == ("triton", "cpu", "torch")


def test_use_backends_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        with backends.use_backends("cuda"):
            pass
    with pytest.raises(TypeError, match="must be a str"):
        with backends.use_backends(1):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with backends.use_backends():
            pass


def test_last_backend_names_the_torch_path_when_the_compiled_loops_are_off(monkeypatch):
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    q, k, v = _qkv()
    linattn.linear_attention(q, k, v, causal=True)
    assert backends.last_backend() == "torch"
    beta = torch.rand(1, 2, 20)
    linattn.delta_rule(q, F.normalize(k, dim=-1), v, beta)
    assert backends.last_backend() == "torch"


@needs_kernel
@pytest.mark.parametrize("op", ["linear", "retention", "gla", "delta", "gated_delta"])
def test_pinning_the_compiled_loops_runs_them_and_says_so(op, monkeypatch):
    monkeypatch.delenv("LINATTN_CPU_KERNEL", raising=False)
    q, k, v = _qkv(dtype=torch.float64)
    k = F.normalize(k, dim=-1)
    g = torch.Generator().manual_seed(1)
    log_g = F.logsigmoid(torch.randn(1, 2, 20, 4, generator=g, dtype=torch.float64))
    beta = torch.rand(1, 2, 20, generator=g, dtype=torch.float64)
    call = {"linear": lambda m: linattn.linear_attention(q, k, v, causal=True, method=m),
            "retention": lambda m: linattn.retention(q, k, v, 0.9, method=m),
            "gla": lambda m: linattn.gated_linear_attention(q, k, v, log_g, method=m),
            "delta": lambda m: linattn.delta_rule(q, k, v, beta, method=m),
            "gated_delta": lambda m: linattn.gated_delta_rule(q, k, v, log_g[..., 0], beta, method=m)}[op]
    with backends.use_backends("cpu"):
        got = call("chunk")
        assert backends.last_backend() == "cpu"
    reference = call("recurrent")
    assert backends.last_backend() == "torch"
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-12)


def test_a_pinned_backend_that_cannot_run_the_call_raises_saying_why():
    q, k, v = _qkv(dtype=torch.float16)
    with backends.use_backends("cpu"):
        with pytest.raises(RuntimeError, match=r"no enabled backend can run delta_rule.*cpu: needs CPU float32"):
            backends.select("delta_rule", q, k, v)
    with backends.use_backends("triton"):
        with pytest.raises(RuntimeError, match=r"triton: does not implement retention"):
            backends.select("retention", q, k, v)
    with backends.use_backends("triton", "torch"):
        assert backends.select("linear_attention", q.float(), k, v, chunk_size=64) == "torch"


@pytest.mark.triton
def test_fused_kernel_failure_falls_back_to_the_pytorch_path(monkeypatch, triton_backend):
    # On CUDA the Triton kernel runs automatically; it has not been exercised on every GPU, so a
    # kernel that fails to compile or launch must not take linear_attention down with it.
    # Triton is optional: this test must run without it, so it is made unimportable here and the
    # broken kernel is put straight into the module's namespace (monkeypatch.setattr would read
    # the old value first, and kernels.__getattr__ resolves that name by importing Triton).
    from linattn import backends, kernels

    calls = []

    def broken_kernel(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("out of shared memory (simulated)")

    monkeypatch.setitem(sys.modules, "triton", None)   # `import triton` raises ImportError
    monkeypatch.setitem(vars(kernels), "chunk_linear_attention_triton", broken_kernel)
    triton_backend(lambda tensors, chunk_size: backends._triton_failure[0] if backends._triton_failure else None)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0)) for _ in range(3))
    ref = linattn.linear_attention(q, k, v, causal=True, method="quadratic")
    with pytest.warns(RuntimeWarning, match="fused Triton kernel failed"):
        out = linattn.linear_attention(q, k, v, causal=True, chunk_size=16)
    assert len(calls) == 1, "the fused kernel was not tried"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert backends._triton_failure  # remembered: no second attempt, no second warning
    assert backends.last_backend() == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = linattn.linear_attention(q, k, v, causal=True, chunk_size=16)
    assert len(calls) == 1, "the failed kernel was tried again"
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.triton
def test_fused_kernel_can_be_disabled_by_environment(monkeypatch):
    from linattn import backends

    monkeypatch.setenv("LINATTN_DISABLE_TRITON", "1")
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    assert "triton" not in backends.default_backends()
    assert backends.select("linear_attention", torch.zeros(1, 1, 4, 4), chunk_size=16) == "torch"


@needs_kernel
@pytest.mark.parametrize("cpu_kernel", ["1", "force"])
def test_a_dispatch_mode_or_tensor_subclass_keeps_the_pytorch_path(cpu_kernel, monkeypatch):
    """The compiled loops read raw memory: FlopCounterMode must count the chunk form's FLOPs, and fake
    tensors (no memory at all) must get shapes, not a crash."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv("LINATTN_CPU_KERNEL", cpu_kernel)
    q, k, v = _qkv(T=64, D=8)
    with FlopCounterMode(display=False) as counter:
        linattn.linear_attention(q, k, v, causal=True, chunk_size=16)
    assert backends.last_backend() == "torch" and counter.get_total_flops() > 0
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        assert linattn.delta_rule(fq, fk, fv, mode.from_tensor(torch.rand(1, 2, 64))).shape == (1, 2, 64, 8)
    assert backends.last_backend() == "torch"


@needs_kernel
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bad", ["k", "v"])
def test_a_nan_key_or_value_leaves_the_earlier_gradients_finite_on_every_backend(bad, normalize, monkeypatch):
    """The compiled loop's normaliser backward spread a NaN value to every key's gradient; a NaN/inf
    key or value makes the last state non-finite, and the PyTorch path (causal around it) runs instead."""
    for env in ("0", "force"):
        monkeypatch.setenv("LINATTN_CPU_KERNEL", env)
        q, k, v = (x.requires_grad_() for x in _qkv(T=8, D=4, seed=1))
        {"k": k, "v": v}[bad].data[0, 0, 6] = float("nan")
        y = linattn.linear_attention(q, k, v, causal=True, normalize=normalize, chunk_size=4)
        y[:, :, :6].sum().backward()
        for t in (q, k, v):
            assert t.grad[:, :, :6].isfinite().all(), (env, bad, normalize)
        assert y[:, :, :6].isfinite().all() and y[:, 0, 6:].isnan().all()


def test_a_fork_while_another_thread_holds_the_build_lock_does_not_hang_the_child():
    import multiprocessing

    from linattn import calibrate
    from linattn.kernels.cpu import calibration, runtime

    def child():
        for module in (runtime, calibration, calibrate):
            with module._lock:
                pass

    with runtime._lock, calibration._lock, calibrate._lock:           # as while another thread builds
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
    proc.join(60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0
