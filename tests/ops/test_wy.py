"""The hand-written backward of the WY chunk form (delta rule; gated delta rule with one gate per head, and per key channel).

References: the token-by-token recurrence (``method="recurrent"``) differentiated by autograd,
in float64; and the same chunk equations differentiated op by op by autograd (the path
``torch.func`` takes).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import linattn
from linattn.ops.wy import function as _wyf, linalg as _wyl, naive as _wyn, scan as _wys

F64 = dict(rtol=1e-9, atol=1e-10)


def _inputs(B, H, T, D, Dv, seed, beta_max=2.0, gated=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64) * beta_max
    S0 = torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64)
    shape = (B, H, T, D) if gated == "channel" else (B, H, T)
    log_g = F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 1)
    xs = [q, k, v, beta, S0] + ([log_g] if gated else [])
    return [x.requires_grad_() for x in xs]


def _call(xs, method, chunk_size, gated):
    q, k, v, beta, S0 = xs[:5]
    if gated:
        return linattn.gated_delta_rule(q, k, v, xs[5], beta, method=method, chunk_size=chunk_size,
                                        initial_state=S0, return_state=True)
    return linattn.delta_rule(q, k, v, beta, method=method, chunk_size=chunk_size, initial_state=S0,
                              return_state=True)


def _grads(xs, method, chunk_size, gated, use=("out", "state")):
    out, S = _call(xs, method, chunk_size, gated)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    loss = sum([(out * w_out).sum()] * ("out" in use) + [(S * w_S).sum()] * ("state" in use))
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return [out, S, *(torch.zeros_like(x) if d is None else d for x, d in zip(xs, grads))]


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 40), chunk=st.sampled_from([1, 3, 8, 16, 64]), gated=st.sampled_from([False, True, "channel"]),
       seed=st.integers(0, 2**16), use=st.sampled_from([("out",), ("state",), ("out", "state")]))
def test_gradients_match_the_recurrence_in_float64(T, chunk, gated, seed, use):
    xs = _inputs(2, 2, T, 5, 3, seed, gated=gated)
    got = _grads(xs, "chunk", chunk, gated, use)
    ref = _grads(xs, "recurrent", chunk, gated, use)
    for name, a, b in zip(["out", "S", "dq", "dk", "dv", "dbeta", "dS0", "dlog_g"], got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gated", [False, True, "channel"])
def test_the_hand_written_backward_is_the_one_used(gated):
    """Outside torch.func the chunk form's graph is one node of the Function, not op-by-op autograd."""
    xs = _inputs(1, 2, 20, 4, 3, 0, gated=gated)
    out, _ = _call(xs, "chunk", 8, gated)
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert ("_WYChannelChunkBackward" if gated == "channel" else "_WYChunkBackward") in names
    assert "LinalgSolveTriangularBackward0" not in names


@pytest.mark.parametrize("gated", [False, True, "channel"])
def test_float32_gradients_have_float32_accuracy_like_op_by_op_autograd(gated, monkeypatch):
    """Against float64 truth, float32 outputs and gradients have float32 accuracy: the largest error
    relative to the largest entry stays below 2e-6 (about 30 units of float32 rounding; measured:
    at most 8e-7 for both, against 6e-7 for autograd of the same chunk equations)."""
    xs64 = _inputs(2, 3, 100, 16, 8, 1, gated=gated)
    truth = _grads(xs64, "recurrent", 32, gated)
    xs = [x.detach().float().requires_grad_() for x in xs64]
    got = _grads(xs, "chunk", 32, gated)
    monkeypatch.setattr(_wyf._WYChunk, "apply", _wyn.wy_chunk_ops)
    monkeypatch.setattr(_wyf._WYChannelChunk, "apply", _wyn.wy_chunk_channel_ops)
    ref = _grads(xs, "chunk", 32, gated)
    for name, a, b, t in zip(["out", "S", "dq", "dk", "dv", "dbeta", "dS0", "dlog_g"], got, ref, truth):
        scale = t.abs().max().item()
        err_a, err_b = ((x.double() - t).abs().max().item() / scale for x in (a, b))
        assert err_b < 2e-6, (name, "reference", err_b)
        assert err_a < 2e-6, (name, err_a)


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_edge_writing_strengths(beta):
    xs = _inputs(1, 2, 33, 6, 4, 3)
    with torch.no_grad():
        xs[3].fill_(beta)
    got, ref = _grads(xs, "chunk", 16, False), _grads(xs, "recurrent", 16, False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("gated", [False, True, "channel"])
def test_second_derivatives_match_the_recurrence(gated):
    """create_graph=True: the backward differentiates the chunk equations through autograd, so a
    second derivative is right (found by a new-user test: with stored intermediates as constants,
    autograd.grad returned zeros or partial sums without raising)."""
    xs = _inputs(1, 1, 6, 2, 2, 11, gated=gated)
    w = torch.linspace(-1, 2, 12, dtype=torch.float64).reshape(1, 1, 6, 2)

    def loss(k, method, extra):
        out, S = _call([xs[0], k, *xs[2:]], method, 4, gated)
        return (out * w).sum() + S.square().sum() + extra * k.pow(3).sum()

    for extra in (0.0, 1.0):
        hc = torch.autograd.functional.hessian(lambda k: loss(k, "chunk", extra), xs[1].detach())
        hr = torch.autograd.functional.hessian(lambda k: loss(k, "recurrent", extra), xs[1].detach())
        assert hr.abs().sum() > 1.0
        torch.testing.assert_close(hc, hr, **F64)
    if gated:                                             # mixed: d/dlog_g of d(out.sum())/dlog_g
        got = []
        for method in ("chunk", "recurrent"):
            out, _ = _call(xs, method, 4, True)
            (dg,) = torch.autograd.grad(out.sum(), xs[5], create_graph=True)
            got.append(torch.autograd.grad(dg.sum(), xs[5])[0])
        torch.testing.assert_close(*got, **F64)


@pytest.mark.parametrize("gated", [False, True, "channel"])
def test_torch_func_grad_and_jvp_still_work(gated):
    xs = _inputs(1, 2, 14, 4, 3, 7, gated=gated)
    q, rest = xs[0].detach(), [x.detach() for x in xs[1:]]

    def f(q, method):
        out, S = _call([q, *rest], method, 4, gated)
        return out.square().sum() + S.sum()

    torch.testing.assert_close(torch.func.grad(f)(q, "chunk"), torch.func.grad(f)(q, "recurrent"), **F64)
    t = torch.randn_like(q)
    _, jc = torch.func.jvp(lambda q: f(q, "chunk"), (q,), (t,))
    _, jr = torch.func.jvp(lambda q: f(q, "recurrent"), (q,), (t,))
    torch.testing.assert_close(jc, jr, **F64)


@pytest.mark.parametrize("gated", [True, "channel"])
def test_inputs_and_initial_state_are_not_modified(gated):
    xs = _inputs(1, 2, 19, 4, 3, 9, gated=gated)
    before = [x.detach().clone() for x in xs]
    _grads(xs, "chunk", 8, gated)
    for x, b in zip(xs, before):
        assert torch.equal(x.detach(), b)


@pytest.mark.parametrize("C", [1, 2, 16, 17, 32, 64, 100])
def test_unit_lower_inverse(C):
    g = torch.Generator().manual_seed(C)
    M = (torch.randn(3, C, C, generator=g, dtype=torch.float64) * 0.3).tril(-1) + torch.eye(C, dtype=torch.float64)
    torch.testing.assert_close(_wyl.unit_lower_inverse(M) @ M, torch.eye(C, dtype=torch.float64).expand(3, C, C),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("numbers", [1, 4096, 1 << 30])
def test_per_channel_groups_of_chunks_give_the_same_result(numbers, monkeypatch):
    """The per-channel form's passes over groups of chunks (one chunk per group, a ragged last group, one group)."""
    from linattn.ops import _common
    xs = _inputs(2, 3, 150, 8, 4, 5, gated="channel")
    ref = _grads(xs, "recurrent", 32, "channel")
    monkeypatch.setattr(_common, "GROUP_NUMBERS", numbers)
    got = _grads(xs, "chunk", 32, "channel")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("gated", [False, True, "channel"])
def test_inference_without_gradients_takes_the_fast_forward(gated, monkeypatch):
    """Under torch.no_grad the Functions' forward runs (not the op-by-op form, which was slower than a
    whole forward and backward pass), and it still matches the recurrence in float64."""
    xs = _inputs(2, 3, 70, 8, 5, 11, gated=gated)

    def refuse(*args):
        raise AssertionError("the op-by-op form ran")
    with torch.no_grad():
        ref = _call(xs, "recurrent", 16, gated)
        monkeypatch.setattr(_wyf, "wy_chunk_ops", refuse)
        monkeypatch.setattr(_wyf, "wy_chunk_channel_ops", refuse)
        got = _call(xs, "chunk", 16, gated)
    for a, b in zip(got, ref):
        assert a.grad_fn is None
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("BH, N", [(1, 7), (3, 5), (2, 8)])
def test_chunk_major_rows_of_any_group(BH, N):
    """_rows / _set_rows read and write a group of head-major chunks (a slice of B·H·N) in a tensor stored
    chunk-major (N, B·H, …): within one head (a view) and across heads (a copy)."""
    head_major = torch.randn(BH * N, 3, 2, generator=torch.Generator().manual_seed(BH * N))
    chunk_major = head_major.view(BH, N, 3, 2).transpose(0, 1).contiguous()       # (N, BH, 3, 2)
    for start in range(BH * N):
        for stop in range(start + 1, BH * N + 1):
            grp = slice(start, stop)
            assert torch.equal(_wys.rows(chunk_major, grp, N), head_major[grp])
            written = torch.zeros_like(chunk_major)
            _wys.set_rows(written, grp, N, head_major[grp])
            expected = torch.zeros_like(head_major)
            expected[grp] = head_major[grp]
            assert torch.equal(written.transpose(0, 1).reshape(BH * N, 3, 2), expected)


@pytest.mark.parametrize("gated", [None, "head", "channel"])
def test_the_scans_write_chunk_major_contiguous_blocks(gated):
    """The forward and reverse scans keep U, the states and their gradients chunk-major: each chunk's
    block (B·H, ·, ·) is contiguous, so every product of the scan writes one contiguous block. Values
    against a token-free reference loop over heads and chunks in float64."""
    BH, N, C, Dk, Dv = 3, 4, 5, 6, 2
    g = torch.Generator().manual_seed(1)
    W, ke = (torch.randn(BH * N, C, Dk, generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    Ut_hm = torch.randn(BH * N, C, Dv, generator=g, dtype=torch.float64)
    tot = {None: None, "head": torch.rand(BH * N, 1, 1, generator=g, dtype=torch.float64),
           "channel": torch.rand(BH * N, Dk, 1, generator=g, dtype=torch.float64)}[gated]
    S0 = torch.randn(BH, Dk, Dv, generator=g, dtype=torch.float64)
    Ut = Ut_hm.view(BH, N, C, Dv).transpose(0, 1).contiguous()
    U, S_before, S = _wys.scan_chunks(W, Ut, ke, tot, S0, BH, N)
    PdO = torch.randn(N, BH, C, Dv, generator=g, dtype=torch.float64)
    QdO = torch.randn(BH * N, Dk, Dv, generator=g, dtype=torch.float64)
    dS = torch.randn(BH, Dk, Dv, generator=g, dtype=torch.float64)
    PdO_in = PdO.clone()
    dU, dS_after, dS0 = _wys.scan_chunks_backward(PdO, QdO, W, ke, tot, dS, BH, N)
    for x, shape in ((U, (N, BH, C, Dv)), (S_before, (N, BH, Dk, Dv)), (dU, (N, BH, C, Dv)),
                     (dS_after, (N, BH, Dk, Dv))):
        assert x.shape == shape and all(x[n].is_contiguous() for n in range(N))
    for h in range(BH):
        s, ds = S0[h], dS[h]
        for n in range(N):
            i = h * N + n
            decay = 1.0 if tot is None else tot[i]
            torch.testing.assert_close(S_before[n, h], s, **F64)
            u = Ut_hm[i] - W[i] @ s
            torch.testing.assert_close(U[n, h], u, **F64)
            s = decay * s + ke[i].T @ u
        torch.testing.assert_close(S[h], s, **F64)
        for n in range(N - 1, -1, -1):
            i = h * N + n
            decay = 1.0 if tot is None else tot[i]
            torch.testing.assert_close(dS_after[n, h], ds, **F64)
            du = PdO_in[n, h] + ke[i] @ ds
            torch.testing.assert_close(dU[n, h], du, **F64)
            ds = decay * ds + QdO[i] - W[i].T @ du
        torch.testing.assert_close(dS0[h], ds, **F64)


@pytest.mark.parametrize("gated", [False, True, "channel"])
@pytest.mark.parametrize("forward_numbers, backward_numbers", [(1 << 17, 1), (5000, 7), (1, 1 << 30)])
def test_the_backward_takes_the_forward_groups(gated, forward_numbers, backward_numbers, monkeypatch):
    """The backward pass works on the groups of chunks that the forward pass formed (and kept), even if
    GROUP_NUMBERS changed in between (found by a new-user test: it re-formed them, and a backward
    with more groups than the forward left chunks' gradients uninitialised)."""
    from linattn.ops import _common
    xs = _inputs(2, 3, 200, 8, 5, 3, gated=gated)
    ref = _grads(xs, "recurrent", 16, gated)
    monkeypatch.setattr(_common, "GROUP_NUMBERS", forward_numbers)
    out, S = _call(xs, "chunk", 16, gated)
    monkeypatch.setattr(_common, "GROUP_NUMBERS", backward_numbers)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    grads = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), xs)
    for name, a, b in zip(["dq", "dk", "dv", "dbeta", "dS0", "dlog_g"], grads, ref[2:]):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")
