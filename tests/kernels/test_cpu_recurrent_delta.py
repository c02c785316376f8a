"""The compiled token loop of the delta rule family (linattn.kernels.cpu_delta.cpp) and its dispatch.

With ``LINATTN_CPU_KERNEL=1``, :func:`linattn.delta_rule` and :func:`linattn.gated_delta_rule`
(``method="chunk"``, CPU, float32/float64) run the recurrence in the compiled library. Every value
and gradient is compared with the PyTorch recurrence (``method="recurrent"``) differentiated by
autograd in float64; float32 against the float64 truth, next to the PyTorch recurrence's own
error. Skipped with the reason where no C++ compiler exists.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import linattn
from linattn.kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.cpu_kernel_available(),
                                  reason=f"no C++ compiler for the CPU kernel: {cpu.build_info().get('error')}")
F64 = dict(rtol=1e-10, atol=1e-11)
NAMES = ["out", "S", "dq", "dk", "dv", "dbeta", "dS0", "dlog_g"]


def _inputs(gate, B, H, T, Dk, Dv, seed, dtype=torch.float64, with_state=True, depth=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64) if with_state else None
    shape = {"head": (B, H, T), "channel": (B, H, T, Dk)}.get(gate)
    log_g = None if shape is None else F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64)) * depth
    xs = [x for x in (q, k, v, beta, S0, log_g)]
    return [None if x is None else x.to(dtype).requires_grad_() for x in xs]


def _run(xs, method, chunk_size=16, create_graph=False):
    q, k, v, beta, S0, log_g = xs
    if log_g is None:
        out, S = linattn.delta_rule(q, k, v, beta, method=method, chunk_size=chunk_size, initial_state=S0,
                                    return_state=True)
    else:
        out, S = linattn.gated_delta_rule(q, k, v, log_g, beta, method=method, chunk_size=chunk_size,
                                          initial_state=S0, return_state=True)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    wanted = [x for x in xs if x is not None]
    grads = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), wanted, create_graph=create_graph)
    return [out, S, *grads]


@pytest.fixture
def calls(monkeypatch):
    """Turns the kernel on and counts its calls."""
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    seen = []
    real = cpu.delta_rule_cpu

    def spy(*args, **kwargs):
        seen.append(args[4] is None or tuple(args[4].shape))
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu, "delta_rule_cpu", spy)
    return seen


@needs_kernel
@pytest.mark.parametrize("gate", [None, "head", "channel"])
@pytest.mark.parametrize("T, C, Dk, Dv", [(37, 8, 5, 7), (64, 64, 16, 16), (5, 64, 3, 40), (100, 1, 4, 17)])
def test_values_state_and_every_gradient_match_the_recurrence_in_float64(gate, T, C, Dk, Dv, calls, monkeypatch):
    """Ragged T, chunk sizes from 1 to beyond T, value widths that are not whole vectors."""
    xs = _inputs(gate, 2, 3, T, Dk, Dv, seed=T + Dv)
    got = _run(xs, "chunk", C)
    assert calls, "the compiled loop was not used"
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    ref = _run(xs, "recurrent")
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 90), Dk=st.integers(1, 12),
       Dv=st.integers(1, 20), C=st.integers(1, 70), gate=st.sampled_from([None, "head", "channel"]),
       with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_property_kernel_equals_the_recurrence(B, H, T, Dk, Dv, C, gate, with_state, seed):
    xs = _inputs(gate, B, H, T, Dk, Dv, seed, with_state=with_state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LINATTN_CPU_KERNEL", "force")
        got = _run(xs, "chunk", C)
    ref = _run(xs, "recurrent")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **F64)


@needs_kernel
@pytest.mark.parametrize("gate", [None, "head", "channel"])
def test_float32_has_the_accuracy_of_the_pytorch_recurrence(gate, calls, monkeypatch):
    """Against the float64 truth: within 2x the error of the PyTorch token loop in float32, and
    below 2e-6 of each result's largest entry."""
    xs64 = _inputs(gate, 2, 2, 200, 32, 32, seed=5)
    truth = _run(xs64, "recurrent")
    xs = [None if x is None else x.detach().float().requires_grad_() for x in xs64]
    got = _run(xs, "chunk", 64)
    assert calls
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    loop = _run(xs, "recurrent")
    for name, a, b, t in zip(NAMES, got, loop, truth):
        scale = t.abs().max().item()
        e_kernel, e_loop = ((x.double() - t).abs().max().item() / scale for x in (a, b))
        assert e_kernel < 2e-6 and e_kernel <= 2 * e_loop + 1e-7, (name, e_kernel, e_loop)


@needs_kernel
def test_off_by_default_and_for_other_devices_or_dtypes(calls, monkeypatch):
    xs = _inputs("head", 1, 2, 20, 4, 4, seed=0)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    _run(xs, "chunk")
    assert not calls
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    _run(xs, "recurrent")                                           # the recurrent method stays PyTorch's
    assert not calls
    half = [None if x is None else x.detach().to(torch.bfloat16).requires_grad_() for x in xs]
    _run(half, "chunk")                                             # bfloat16 computes in float32: the kernel
    assert calls == [(1, 2, 20, 1)]
    wide = _inputs(None, 1, 1, 8, 2, 257, seed=0, dtype=torch.float32)
    _run(wide, "chunk")                                             # rows wider than 1 KiB (256 float32): PyTorch's path
    assert len(calls) == 1


@needs_kernel
@pytest.mark.parametrize("gate", [None, "head", "channel"])
def test_second_derivatives_and_torch_func_use_the_op_by_op_forms(gate, calls, monkeypatch):
    xs = _inputs(gate, 1, 2, 12, 3, 4, seed=2)
    got = _run(xs, "chunk", 4, create_graph=True)
    assert calls
    second = torch.autograd.grad(sum((g * g).sum() for g in got[2:]), [x for x in xs if x is not None])
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "0")
    ref = _run(xs, "recurrent", create_graph=True)
    expected = torch.autograd.grad(sum((g * g).sum() for g in ref[2:]), [x for x in xs if x is not None])
    for a, b in zip(second, expected):
        torch.testing.assert_close(a, b, **F64)
    monkeypatch.setenv("LINATTN_CPU_KERNEL", "force")
    calls.clear()
    q, k, v, beta, S0, log_g = xs

    def loss(q):
        if log_g is None:
            return linattn.delta_rule(q, k, v, beta, initial_state=S0).sum()
        return linattn.gated_delta_rule(q, k, v, log_g, beta, initial_state=S0).sum()
    dq = torch.func.grad(loss)(q.detach())
    assert not calls                                                # torch.func sees every op instead
    torch.testing.assert_close(dq, torch.autograd.grad(loss(q), q)[0], **F64)


@needs_kernel
def test_a_nan_reaches_no_earlier_output_and_threads_change_no_bit(calls, monkeypatch):
    xs = _inputs("channel", 2, 3, 50, 8, 8, seed=4, dtype=torch.float32)
    out = _run(xs, "chunk", 16)[0]
    bad = [None if x is None else x.detach().clone() for x in xs]
    bad[2][:, :, 30] = float("nan")
    with torch.no_grad():
        out_bad = linattn.gated_delta_rule(*bad[:3], bad[5], bad[3], chunk_size=16, initial_state=bad[4])
    assert torch.equal(out_bad[:, :, :30], out[:, :, :30].detach())
    assert torch.isnan(out_bad[:, :, 30:]).all()
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run(xs, "chunk", 16))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_kernel
def test_inputs_are_not_modified_and_outputs_own_their_memory(calls):
    xs = _inputs("head", 1, 2, 33, 4, 5, seed=6)
    before = [x.detach().clone() for x in xs]
    out, S, *grads = _run(xs, "chunk", 8)
    for x, b in zip(xs, before):
        assert torch.equal(x.detach(), b)
    pointers = {x.data_ptr() for x in xs}
    assert all(t.data_ptr() not in pointers for t in (out, S, *grads))
    assert out.is_contiguous() and S.is_contiguous()


@needs_kernel
def test_a_chunk_size_beyond_T_costs_what_chunk_size_T_does(calls, monkeypatch):
    """The backward pass keeps one block of states: a huge chunk_size must not size it (it did:
    chunk_size=2_000_000 at T=8 asked for gigabytes and aborted the process)."""
    xs = _inputs("head", 1, 2, 8, 64, 64, seed=7, dtype=torch.float32)
    huge = _run(xs, "chunk", 2_000_000)
    assert calls
    exact = _run(xs, "chunk", 8)
    for a, b in zip(huge, exact):
        assert torch.equal(a, b)
