"""GLA's chunk form with a hand-written backward, and the per-channel decayed scores it is built on.

References: the token-by-token recurrence (``method="recurrent"``) differentiated by autograd, in
float64; the decayed scores written out pair by pair from their definition; and the same chunk
equations differentiated op by op by autograd (the path ``torch.func`` takes).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import linattn
from linattn.ops import _common, decay as _decay
from linattn.ops.gla import chunk as _gla

F64 = dict(rtol=1e-9, atol=1e-10)
NAMES = ["out", "S", "dq", "dk", "dv", "dlog_g", "dS0"]


def _inputs(B, H, T, D, Dv, seed, strength=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, D, generator=g, dtype=torch.float64) + 2) * strength
    S0 = torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, log_g, S0)]


def _grads(xs, method, chunk_size, use=("out", "state")):
    q, k, v, log_g, S0 = xs
    out, S = linattn.gated_linear_attention(q, k, v, log_g, method=method, chunk_size=chunk_size, initial_state=S0,
                                            return_state=True)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    loss = sum([(out * w_out).sum()] * ("out" in use) + [(S * w_S).sum()] * ("state" in use))
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return [out, S, *(torch.zeros_like(x) if d is None else d for x, d in zip(xs, grads))]


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 70), chunk=st.sampled_from([1, 3, 8, 16, 48, 64]), seed=st.integers(0, 2**16),
       use=st.sampled_from([("out",), ("state",), ("out", "state")]))
def test_gradients_match_the_recurrence_in_float64(T, chunk, seed, use):
    xs = _inputs(2, 2, T, 5, 3, seed)
    got, ref = _grads(xs, "chunk", chunk, use), _grads(xs, "recurrent", chunk, use)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")


def test_the_hand_written_backward_is_the_one_used():
    xs = _inputs(1, 2, 20, 4, 3, 0)
    out = linattn.gated_linear_attention(*xs[:4], chunk_size=8)
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert "_GLAChunkBackward" in names
    assert "CatBackward0" not in names


def test_float32_gradients_have_float32_accuracy_like_op_by_op_autograd(monkeypatch):
    """Against float64 truth, the largest float32 error relative to the largest entry stays below 2e-6,
    for the Function and for autograd of the same chunk equations alike."""
    xs64 = _inputs(2, 3, 150, 16, 8, 1)
    truth = _grads(xs64, "recurrent", 64)
    xs = [x.detach().float().requires_grad_() for x in xs64]
    got = _grads(xs, "chunk", 64)
    monkeypatch.setattr(_gla._GLAChunk, "apply", _gla.gla_chunk_ops)
    ref = _grads(xs, "chunk", 64)
    for name, a, b, t in zip(NAMES, got, ref, truth):
        scale = t.abs().max().item()
        err_a, err_b = ((x.double() - t).abs().max().item() / scale for x in (a, b))
        assert err_b < 2e-6, (name, "reference", err_b)
        assert err_a < 2e-6, (name, err_a)


@pytest.mark.parametrize("numbers", [1, 4096, 1 << 30])
def test_groups_of_chunks_give_the_same_result(numbers, monkeypatch):
    """The passes over groups of chunks (one chunk per group, a ragged last group, one group)."""
    xs = _inputs(2, 3, 200, 8, 4, 5)
    ref = _grads(xs, "recurrent", 32)
    monkeypatch.setattr(_common, "GROUP_NUMBERS", numbers)
    got = _grads(xs, "chunk", 32)
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")


def test_second_derivatives_match_the_recurrence():
    """create_graph=True differentiates the chunk equations op by op: Hessians are right."""
    xs = _inputs(1, 1, 6, 2, 2, 11)
    w = torch.linspace(-1, 2, 12, dtype=torch.float64).reshape(1, 1, 6, 2)

    def loss(k, method):
        out, S = linattn.gated_linear_attention(xs[0], k, xs[2], xs[3], method=method, chunk_size=4,
                                                initial_state=xs[4], return_state=True)
        return (out * w).sum() + S.square().sum()

    hc = torch.autograd.functional.hessian(lambda k: loss(k, "chunk"), xs[1].detach())
    hr = torch.autograd.functional.hessian(lambda k: loss(k, "recurrent"), xs[1].detach())
    assert hr.abs().sum() > 1.0
    torch.testing.assert_close(hc, hr, **F64)
    got = []
    for method in ("chunk", "recurrent"):
        out = linattn.gated_linear_attention(*xs[:4], method=method, chunk_size=4, initial_state=xs[4])
        (dg,) = torch.autograd.grad(out.square().sum(), xs[3], create_graph=True)
        got.append(torch.autograd.grad(dg.sum(), xs[3])[0])
    torch.testing.assert_close(*got, **F64)


def test_torch_func_grad_and_jvp_still_work():
    xs = _inputs(1, 2, 14, 4, 3, 7)
    q, rest = xs[0].detach(), [x.detach() for x in xs[1:]]

    def f(q, method):
        out, S = linattn.gated_linear_attention(q, *rest[:3], method=method, chunk_size=4, initial_state=rest[3],
                                                return_state=True)
        return out.square().sum() + S.sum()

    torch.testing.assert_close(torch.func.grad(f)(q, "chunk"), torch.func.grad(f)(q, "recurrent"), **F64)
    t = torch.randn_like(q)
    _, jc = torch.func.jvp(lambda q: f(q, "chunk"), (q,), (t,))
    _, jr = torch.func.jvp(lambda q: f(q, "recurrent"), (q,), (t,))
    torch.testing.assert_close(jc, jr, **F64)


def test_inputs_and_initial_state_are_not_modified():
    xs = _inputs(1, 2, 19, 4, 3, 9)
    before = [x.detach().clone() for x in xs]
    _grads(xs, "chunk", 8)
    for x, b in zip(xs, before):
        assert torch.equal(x.detach(), b)


# ------------------------------------------------------------------ the decayed scores


def _scores_by_definition(x, y, g, strict):
    """``A[t, s] = Σ_d x_td y_sd exp(Σ_{s<r<=t} g_rd)`` pair by pair, in float64."""
    *lead, Cp, D = x.shape
    A = torch.zeros(*lead, Cp, Cp, dtype=torch.float64)
    for t in range(Cp):
        for s in range(t if strict else t + 1):
            A[..., t, s] = (x[..., t, :] * y[..., s, :] * g[..., s + 1:t + 1, :].sum(-2).exp()).sum(-1)
    return A


@pytest.mark.parametrize("Cp", [1, 2, 8, 16])
@pytest.mark.parametrize("strict", [False, True])
def test_fast_and_op_by_op_scores_match_the_definition(Cp, strict):
    gen = torch.Generator().manual_seed(Cp)
    x, y = (torch.randn(3, Cp, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -torch.rand(3, Cp, 4, generator=gen, dtype=torch.float64) * 2
    want = _scores_by_definition(x, y, g, strict)
    fast, products = _decay.scores_fast(x, y, strict, g)
    torch.testing.assert_close(fast, want, rtol=1e-12, atol=1e-14)
    by_cat = _decay.scores_by_cat(x, y, strict, _decay.decay_factors(g)[3])
    torch.testing.assert_close(by_cat, want, rtol=1e-12, atol=1e-14)
    fs, te, tot = products.ends()
    b = g.cumsum(-2)
    torch.testing.assert_close(fs, b.exp(), rtol=1e-12, atol=0)
    torch.testing.assert_close(te, (b[..., -1:, :] - b).exp(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(tot, b[..., -1:, :].exp(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("strict", [False, True])
def test_fast_scores_backward_matches_autograd(strict):
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randn(2, 16, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -torch.rand(2, 16, 3, generator=gen, dtype=torch.float64)
    dA = torch.randn(2, 16, 16, generator=gen, dtype=torch.float64).tril()
    leaves = [t.clone().requires_grad_() for t in (x, y, g)]
    fs, te, tot, levels = _decay.decay_factors(leaves[2])
    w_fs, w_te, w_tot = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (fs, te, tot))
    loss = ((_decay.scores_by_cat(leaves[0], leaves[1], strict, levels) * dA).sum()
            + (fs * w_fs).sum() + (te * w_te).sum() + (tot * w_tot).sum())
    want = torch.autograd.grad(loss, leaves)
    dx, dy, a_levels, b_levels, products = _decay.scores_fast_backward(dA, x, y, strict, g)
    fs, te, tot = products.ends()
    dg = _decay.level_products_backward(w_fs * fs, w_te * te, w_tot * tot, a_levels, b_levels)
    for a, b in zip((dx, dy, dg), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_strong_gates_underflow_to_exact_zeros_in_float32():
    """Per-token gates of 1e-12 over a chunk of 64: every factor is a product of numbers <= 1,
    so what underflows is 0, and the result is finite and equal to the float64 definition."""
    g = torch.full((1, 64, 2), math.log(1e-12))
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(1, 64, 2, generator=gen) for _ in range(2))
    A, products = _decay.scores_fast(x, y, False, g)
    assert torch.isfinite(A).all() and all(torch.isfinite(t).all() for t in products.ends())
    torch.testing.assert_close(A.double(), _scores_by_definition(x.double(), y.double(), g.double(), False),
                               rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("forward_numbers, backward_numbers", [(1 << 17, 1), (5000, 7)])
def test_the_backward_takes_the_forward_groups(forward_numbers, backward_numbers, monkeypatch):
    """GLA's backward works on the groups of chunks that its forward formed, even if GROUP_NUMBERS
    changed in between (it used to re-form them and leave some chunks' gradients uninitialised)."""
    xs = _inputs(2, 3, 200, 8, 5, 3)
    ref = _grads(xs, "recurrent", 16)
    q, k, v, log_g, S0 = xs
    monkeypatch.setattr(_common, "GROUP_NUMBERS", forward_numbers)
    out, S = linattn.gated_linear_attention(q, k, v, log_g, chunk_size=16, initial_state=S0, return_state=True)
    monkeypatch.setattr(_common, "GROUP_NUMBERS", backward_numbers)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    grads = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), xs)
    for name, a, b in zip(NAMES[2:], grads, ref[2:]):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")
