"""The compiled token loop of retention and GLA (linattn.kernels.cpu_delta.cpp without the delta
correction), its dispatch, and how the CPU kernels run their threads.

With ``LINATTN_CPU_KERNEL=1``, :func:`linattn.retention` and :func:`linattn.gated_linear_attention`
(``method="chunk"``, CPU, float32/float64) run the recurrence ``S_t = diag(α_t) S_{t−1} + k_t v_tᵀ``
in the compiled library. Every value and gradient (``γ`` and ``log_g`` included) is compared with
the PyTorch recurrence (``method="recurrent"``) differentiated by autograd in float64; float32
against the float64 truth, next to the PyTorch recurrence's own error. Skipped with the reason
where no C++ compiler exists.
"""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import linattn
from linattn.kernels import cpu
from linattn.kernels.cpu import runtime as cpu_runtime

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(),
                                  reason=f"no C++ compiler for the CPU kernel: {cpu.build_info().get('error')}")
F64 = dict(rtol=1e-10, atol=1e-11)
NAMES = ["out", "S", "dq", "dk", "dv", "dgate", "dS0"]


def _inputs(kind, B, H, T, Dk, Dv, seed, dtype=torch.float64, with_state=True, depth=1.0):
    """q, k, v, the gate (retention: γ of shape (H,); gla: log_g (B, H, T, Dk)) and S0, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64) / Dk ** 0.5
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    if kind == "retention":
        gate = 1 - 0.5 * torch.rand(H, generator=g, dtype=torch.float64) ** 2
    else:
        gate = F.logsigmoid(torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64)) * depth
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64) if with_state else None
    return [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, gate, S0)]


def _run(kind, xs, method, chunk_size=16, create_graph=False):
    q, k, v, gate, S0 = xs
    fn = linattn.retention if kind == "retention" else linattn.gated_linear_attention
    out, S = fn(q, k, v, gate, method=method, chunk_size=chunk_size, initial_state=S0, return_state=True)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    wanted = [x for x in xs if x is not None]
    grads = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), wanted, create_graph=create_graph)
    return [out, S, *grads]


@pytest.fixture
def calls(monkeypatch):
    """Turns the kernel on and records the gate shape of each call."""
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    seen = []
    real = cpu.decay_cpu

    def spy(*args, **kwargs):
        seen.append(tuple(args[3].shape))
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu, "decay_cpu", spy)
    return seen


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla"])
@pytest.mark.parametrize("T, C, Dk, Dv", [(37, 8, 5, 7), (64, 64, 16, 16), (5, 64, 3, 40), (100, 1, 4, 17)])
def test_values_state_and_every_gradient_match_the_recurrence_in_float64(kind, T, C, Dk, Dv, calls, monkeypatch):
    """Ragged T, chunk sizes from 1 to beyond T, value widths that are not whole vectors."""
    xs = _inputs(kind, 2, 3, T, Dk, Dv, seed=T + Dv)
    got = _run(kind, xs, "chunk", C)
    assert calls == [(2, 3, T) if kind == "retention" else (2, 3, T, Dk)]
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    ref = _run(kind, xs, "recurrent")
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 90), Dk=st.integers(1, 12),
       Dv=st.integers(1, 20), C=st.integers(1, 70), kind=st.sampled_from(["retention", "gla"]),
       with_state=st.booleans(), depth=st.sampled_from([0.0, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_property_kernel_equals_the_recurrence(B, H, T, Dk, Dv, C, kind, with_state, depth, seed):
    xs = _inputs(kind, B, H, T, Dk, Dv, seed, with_state=with_state, depth=depth)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LINATTN_CPU_KERNEL", "force")
        got = _run(kind, xs, "chunk", C)
    ref = _run(kind, xs, "recurrent")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **F64)


@needs_kernel
def test_gates_at_the_ends_of_their_range(calls, monkeypatch):
    """γ = 1 (no decay), a γ near float32's smallest normal, and log_g far below LOG_G_FLOOR
    (exp gives 0; its gradient is 0, as the chunk form's clamp makes it)."""
    for kind, gate in (("retention", torch.tensor([1.0, 1e-37], dtype=torch.float64)),
                       ("gla", torch.full((1, 2, 20, 4), -0.1, dtype=torch.float64).index_fill_(2, torch.tensor([7]),
                                                                                              -5000.0))):
        xs = _inputs(kind, 1, 2, 20, 4, 5, seed=1)
        xs[3] = gate.requires_grad_()
        monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
        got = _run(kind, xs, "chunk", 8)
        monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
        ref = _run(kind, xs, "recurrent")
        for name, a, b in zip(NAMES, got, ref):
            torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{kind} {name}: {m}")
    assert len(calls) == 2


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla"])
def test_float32_has_the_accuracy_of_the_pytorch_recurrence(kind, calls, monkeypatch):
    """Against the float64 truth: within 2x the error of the PyTorch token loop in float32, and
    below 2e-6 of each result's largest entry."""
    xs64 = _inputs(kind, 2, 2, 300, 32, 32, seed=5, depth=0.05)
    truth = _run(kind, xs64, "recurrent")
    xs = [x.detach().float().requires_grad_() for x in xs64]
    got = _run(kind, xs, "chunk", 64)
    assert calls
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    loop = _run(kind, xs, "recurrent")
    for name, a, b, t in zip(NAMES, got, loop, truth):
        scale = t.abs().max().item()
        e_kernel, e_loop = ((x.double() - t).abs().max().item() / scale for x in (a, b))
        assert e_kernel < 2e-6 and e_kernel <= 2 * e_loop + 1e-7, (name, e_kernel, e_loop)


@needs_kernel
def test_off_by_default_and_for_other_dtypes_or_widths(calls, monkeypatch):
    xs = _inputs("gla", 1, 2, 20, 4, 4, seed=0)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    _run("gla", xs, "chunk")
    assert not calls
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    _run("gla", xs, "recurrent")                                    # the recurrent method stays PyTorch's
    assert not calls
    half = [x.detach().to(torch.bfloat16).requires_grad_() for x in xs]
    _run("gla", half, "chunk")                                      # bfloat16 computes in float32: the kernel
    assert calls == [(1, 2, 20, 4)]
    wide = _inputs("retention", 1, 1, 8, 2, 257, seed=0, dtype=torch.float32)
    _run("retention", wide, "chunk")                                # rows wider than 1 KiB (256 float32): PyTorch's path
    assert len(calls) == 1


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla"])
def test_second_derivatives_and_torch_func_use_the_op_by_op_forms(kind, calls, monkeypatch):
    xs = _inputs(kind, 1, 2, 12, 3, 4, seed=2)
    got = _run(kind, xs, "chunk", 4, create_graph=True)
    assert calls
    second = torch.autograd.grad(sum((g * g).sum() for g in got[2:]), xs)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    ref = _run(kind, xs, "recurrent", create_graph=True)
    expected = torch.autograd.grad(sum((g * g).sum() for g in ref[2:]), xs)
    for a, b in zip(second, expected):
        torch.testing.assert_close(a, b, **F64)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    calls.clear()
    q, k, v, gate, S0 = xs
    fn = linattn.retention if kind == "retention" else linattn.gated_linear_attention

    def loss(q):
        return fn(q, k, v, gate, initial_state=S0).sum()
    dq = torch.func.grad(loss)(q.detach())
    assert not calls                                                # torch.func sees every op instead
    torch.testing.assert_close(dq, torch.autograd.grad(loss(q), q)[0], **F64)


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla"])
def test_a_nan_reaches_no_earlier_output_and_threads_change_no_bit(kind, calls):
    xs = _inputs(kind, 2, 3, 50, 8, 8, seed=4, dtype=torch.float32)
    out = _run(kind, xs, "chunk", 16)[0]
    bad = [x.detach().clone() for x in xs]
    bad[2][:, :, 30] = float("nan")
    fn = linattn.retention if kind == "retention" else linattn.gated_linear_attention
    with torch.no_grad():
        out_bad = fn(*bad[:4], chunk_size=16, initial_state=bad[4])
    assert torch.equal(out_bad[:, :, :30], out[:, :, :30].detach())
    assert torch.isnan(out_bad[:, :, 30:]).all()
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run(kind, xs, "chunk", 16))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla"])
def test_inputs_are_not_modified_and_outputs_own_their_memory(kind, calls):
    xs = _inputs(kind, 1, 2, 33, 4, 5, seed=6)
    before = [x.detach().clone() for x in xs]
    out, S, *grads = _run(kind, xs, "chunk", 8)
    for x, b in zip(xs, before):
        assert torch.equal(x.detach(), b)
    pointers = {x.data_ptr() for x in xs}
    assert all(t.data_ptr() not in pointers for t in (out, S, *grads))
    assert out.is_contiguous() and S.is_contiguous()


@needs_kernel
@pytest.mark.parametrize("kind", ["retention", "gla", "delta"])
def test_a_forward_pass_without_gradients_gives_the_same_bits(kind, monkeypatch):
    """Without autograd the kernels keep no states for a backward pass: same outputs, bit for bit."""
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    if kind == "delta":
        g = torch.Generator().manual_seed(3)
        q, v = (torch.randn(1, 2, 70, 8, generator=g, requires_grad=True) for _ in range(2))
        k = F.normalize(torch.randn(1, 2, 70, 8, generator=g), dim=-1).requires_grad_()
        beta = torch.rand(1, 2, 70, generator=g)

        def call():
            return linattn.delta_rule(q, k, v, beta, chunk_size=16, return_state=True)
    else:
        q, k, v, gate, S0 = _inputs(kind, 1, 2, 70, 8, 8, seed=3, dtype=torch.float32)
        fn = linattn.retention if kind == "retention" else linattn.gated_linear_attention

        def call():
            return fn(q, k, v, gate, chunk_size=16, initial_state=S0, return_state=True)
    with_grad = call()
    assert with_grad[0].requires_grad
    with torch.no_grad():
        without = call()
    for a, b in zip(with_grad, without):
        assert torch.equal(a.detach(), b)


@needs_kernel
def test_the_openmp_runtime_and_threads_of_our_own_give_the_same_bits(monkeypatch):
    """The kernels run their heads on PyTorch's OpenMP threads where they find them (Linux), else on
    std::threads; every kernel gives the same bits either way."""
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    lib = cpu_runtime._library()
    runtime = cpu_runtime._torch_openmp()
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 45, 16, generator=g, requires_grad=True) for _ in range(3))
    log_g = (F.logsigmoid(torch.randn(2, 3, 45, 16, generator=g)) / 4).requires_grad_()
    beta = torch.rand(2, 3, 45, generator=g)

    def everything():
        outs = [linattn.linear_attention(q, k, v, causal=True, chunk_size=16),
                linattn.gated_linear_attention(q, k, v, log_g, chunk_size=16),
                linattn.retention(q, k, v, 0.9, chunk_size=16),
                linattn.gated_delta_rule(q, F.normalize(k, dim=-1), v, log_g, beta, chunk_size=16)]
        return outs + list(torch.autograd.grad(sum(o.square().sum() for o in outs), (q, k, v, log_g)))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = everything()
        lib.linattn_set_openmp(None, None, None)                     # std::threads of our own
        second = everything()
    finally:
        lib.linattn_set_openmp(*(runtime or (None, None, None)))
        torch.set_num_threads(threads)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    if runtime is not None:                                          # it is the runtime PyTorch loaded
        assert all(isinstance(address, int) and address for address in runtime)
        assert ctypes.cast(runtime[0], ctypes.c_void_p).value == runtime[0]


def test_log_gate_check_finds_every_bad_entry():
    q = torch.randn(1, 1, 6, 2)
    for bad in (float("nan"), float("inf"), -float("inf"), 0.25):
        log_g = torch.full((1, 1, 6, 2), -0.5)
        log_g[0, 0, 4, 1] = bad
        with pytest.raises(ValueError, match=r"log_g must be finite and <= 0 .*index \(0, 0, 4, 1\)"):
            linattn.gated_linear_attention(q, q, q, log_g)
        with pytest.raises(ValueError, match=r"log_g must be finite and <= 0 .*index \(0, 0, 4, 1\)"):
            linattn.gated_delta_rule(q, q, q, log_g, torch.ones(1, 1, 6))
    linattn.gated_linear_attention(q, q, q, torch.zeros(1, 1, 6, 2))   # 0 (no decay) is allowed


def _retention_in_child(q, expected, queue):
    queue.put(torch.equal(linattn.retention(q, q, q, 0.9, chunk_size=16), expected))


@needs_kernel
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork() here")
def test_a_forked_child_runs_the_kernels_on_threads_of_its_own(monkeypatch):
    """OpenMP's threads do not survive fork(): after the parent ran the kernels on them, a forked
    child must not wait for them (it did, for ever), but start threads of its own."""
    import multiprocessing

    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q = torch.randn(1, 4, 64, 16, generator=torch.Generator().manual_seed(9))
        expected = linattn.retention(q, q, q, 0.9, chunk_size=16)       # the parent's OpenMP threads start
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_retention_in_child, args=(q, expected, queue))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "the forked child hung in the kernel"
        assert child.exitcode == 0 and queue.get(timeout=5)
    finally:
        torch.set_num_threads(threads)


_FIRST_LOAD_IN_CHILD = """
import os, sys, time
os.environ["LINATTN_CPU_KERNEL"] = "force"
import torch
import linattn
torch.set_num_threads(2)
torch.exp(torch.randn(4_000_000))         # the parent's OpenMP threads start; the kernels are not loaded
pid = os.fork()
if pid == 0:
    q = torch.randn(1, 2, 8, 4)
    linattn.retention(q, q, q, 0.9)       # the first call loads the library in the child
    os._exit(0)
for _ in range(300):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.1)
os.kill(pid, 9)
sys.exit(7)
"""


@needs_kernel
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork() here")
def test_a_forked_child_that_loads_the_kernels_first_starts_threads_of_its_own():
    """The child of a parent that ran a parallel PyTorch operation but never the kernels: its first
    call loads the library, which must not take the parent's OpenMP threads (it hung, exit 7 here)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FIRST_LOAD_IN_CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
