"""Grouped value heads: v, β and the gates with HV = r·H heads, value head j reading q/k head j // r.

The reference is the same op called with q and k repeated to HV heads (``repeat_interleave``, the
convention of flash-linear-attention and transformers), in float64: values, states and the gradient
of every input must match it. The memory test checks that no repeated copy of q or k is kept.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import backends
from linattn.ops import _common

TIGHT = dict(rtol=1e-10, atol=1e-10)
OPS = ("retention", "gla", "gla_strong", "delta", "gated_delta", "kda", "kda_strong")


def _inputs(op, B=2, H=2, r=3, T=37, D=8, Dv=5, seed=0, dtype=torch.float64):
    """q, k with H heads; v, gates, β, S0 with HV = r·H heads (every one a leaf that requires grad)."""
    g = torch.Generator().manual_seed(seed)
    HV = H * r

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    x = dict(q=rand(B, H, T, D), k=rand(B, H, T, D), v=rand(B, HV, T, Dv), S0=rand(B, HV, D, Dv))
    strong = 8.0 if op.endswith("strong") else 0.5             # strong gates take the range-by-range path
    if op == "retention":
        x["gamma"] = (0.5 + 0.5 * torch.rand(HV, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    if op.startswith(("gla", "kda")):
        x["log_g"] = (-strong * torch.rand(B, HV, T, D, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    if op == "gated_delta":
        x["log_g"] = (-strong * torch.rand(B, HV, T, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    if op in ("delta", "gated_delta", "kda", "kda_strong"):
        x["beta"] = (2 * torch.rand(B, HV, T, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    return x


def _call(op, x, q, k, **kwargs):
    """The op on ``x`` with the given q and k (the delta rules get L2-normalised keys)."""
    kwargs = dict(initial_state=x["S0"], return_state=True, **kwargs)
    if op == "retention":
        return linattn.retention(q, k, x["v"], x["gamma"], **kwargs)
    if op.startswith("gla"):
        return linattn.gated_linear_attention(q, k, x["v"], x["log_g"], **kwargs)
    k = F.normalize(k, dim=-1)
    if op == "delta":
        return linattn.delta_rule(q, k, x["v"], x["beta"], **kwargs)
    return linattn.gated_delta_rule(q, k, x["v"], x["log_g"], x["beta"], **kwargs)


def _repeat(t, r):
    return t.repeat_interleave(r, dim=1)


def _values_and_grads(op, x, q, k, **kwargs):
    out, S = _call(op, x, q, k, **kwargs)
    g = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() + (
        S * torch.randn(S.shape, generator=g, dtype=S.dtype)).sum()
    leaves = list(x.values())
    return out, S, dict(zip(x, torch.autograd.grad(loss, leaves)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("method,chunk_size", [("chunk", 16), ("chunk", 64), ("recurrent", 64)])
def test_grouped_heads_equal_the_call_with_repeated_q_and_k(op, method, chunk_size):
    x = _inputs(op)
    r = x["v"].shape[1] // x["q"].shape[1]
    out, S, grads = _values_and_grads(op, x, x["q"], x["k"], method=method, chunk_size=chunk_size)
    ref_out, ref_S, ref_grads = _values_and_grads(op, x, _repeat(x["q"], r), _repeat(x["k"], r), method="recurrent")
    assert out.shape == x["v"].shape and S.shape == x["S0"].shape
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
    for name in x:
        assert grads[name].shape == x[name].shape, name
        torch.testing.assert_close(grads[name], ref_grads[name], **TIGHT, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("op", OPS)
def test_grouped_heads_with_groups_of_chunks_that_cross_heads(op, monkeypatch):
    """Small groups of chunks (a few rows each): a group spans several value heads and q/k heads."""
    monkeypatch.setattr(_common, "GROUP_NUMBERS", 700)
    x = _inputs(op, T=45)
    r = x["v"].shape[1] // x["q"].shape[1]
    out, S, grads = _values_and_grads(op, x, x["q"], x["k"], method="chunk", chunk_size=8)
    ref_out, ref_S, ref_grads = _values_and_grads(op, x, _repeat(x["q"], r), _repeat(x["k"], r), method="recurrent")
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
    for name in x:
        torch.testing.assert_close(grads[name], ref_grads[name], **TIGHT, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("op", ["gla", "delta", "gated_delta", "kda"])
def test_grouped_heads_second_derivatives_equal_the_repeated_call(op):
    """create_graph=True takes the op-by-op twin of the hand-written backward."""
    x = _inputs(op, B=1, H=1, r=2, T=9, D=3, Dv=2)

    def second(q, k):
        out, S = _call(op, x, q, k, chunk_size=4)
        g = torch.autograd.grad(out.square().sum() + S.square().sum(), [x["v"]], create_graph=True)[0]
        return torch.autograd.grad(g.square().sum(), [x["q"], x["v"]])

    got = second(x["q"], x["k"])
    ref = second(_repeat(x["q"], 2), _repeat(x["k"], 2))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("op", ["gla", "delta", "kda"])
def test_grouped_heads_under_forward_mode_ad(op):
    """A forward-mode dual takes the op-by-op form (autograd must see every op)."""
    import torch.autograd.forward_ad as fwAD

    x = {name: t.detach() for name, t in _inputs(op, B=1, H=2, r=2, T=11, D=4, Dv=3).items()}
    tangent = torch.randn_like(x["q"])

    def jvp(q_dual_fn):
        with fwAD.dual_level():
            q = fwAD.make_dual(x["q"], tangent)
            out, _ = _call(op, x, *q_dual_fn(q))
            return fwAD.unpack_dual(out)

    got = jvp(lambda q: (q, x["k"]))
    ref = jvp(lambda q: (_repeat(q, 2), _repeat(x["k"], 2)))
    torch.testing.assert_close(got.primal, ref.primal, **TIGHT)
    torch.testing.assert_close(got.tangent, ref.tangent, **TIGHT)


def _saved_storages(fn) -> list:
    """The tensors autograd saves for the backward pass of ``fn()`` (one per storage)."""
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(saved.values())


@pytest.mark.parametrize("op", ["retention", "gla", "delta", "gated_delta", "kda"])
def test_no_repeated_copy_of_q_or_k_is_kept_for_the_backward_pass(op):
    """The grouped call saves less than the repeated call, by at least the repeated q and k, and none of
    the tensors it saves holds q or k repeated."""
    x = _inputs(op, B=1, H=2, r=4, T=128, D=16, Dv=16, dtype=torch.float32)
    r = 4
    q_rep, k_rep = _repeat(x["q"], r), _repeat(x["k"], r)
    grouped = _saved_storages(lambda: _call(op, x, x["q"], x["k"], chunk_size=32))
    repeated = _saved_storages(lambda: _call(op, x, q_rep, k_rep, chunk_size=32))
    nbytes = [sum(t.untyped_storage().nbytes() for t in s) for s in (grouped, repeated)]
    extra = 2 * (r - 1) * x["q"].numel() * x["q"].element_size()          # q and k, r − 1 more copies
    assert nbytes[0] <= nbytes[1] - extra, nbytes
    k_norm = F.normalize(k_rep, dim=-1) if op != "retention" and op != "gla" else k_rep
    for t in grouped:
        for rep in (q_rep, k_rep, k_norm):
            assert not (t.shape == rep.shape and torch.equal(t, rep.detach())), f"a saved {tuple(t.shape)} repeats q or k"


@pytest.mark.parametrize("op", ["delta", "gated_delta", "gla", "retention"])
def test_the_compiled_cpu_path_declines_grouped_heads_visibly(op):
    """The CPU kernel has one q/k head per value head: inside use_backends("cpu") a grouped call is refused
    with the reason; with "torch" after it the PyTorch chunk form runs and last_backend() says so."""
    x = _inputs(op, B=1, H=1, r=2, T=8, D=4, Dv=3, dtype=torch.float32)
    with backends.use_backends("cpu"), pytest.raises(RuntimeError, match="grouped value heads"):
        _call(op, x, x["q"], x["k"])
    with backends.use_backends("cpu", "torch"):
        _call(op, x, x["q"], x["k"])
    assert backends.last_backend() == "torch"


def test_v_heads_must_be_a_multiple_of_the_qk_heads():
    q = k = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"v must have a multiple of the 2 heads of q and k.*v \(1, 3, 5, 4\)"):
        linattn.delta_rule(q, k, torch.randn(1, 3, 5, 4), torch.rand(1, 3, 5))
    with pytest.raises(ValueError, match=r"q, k and v must share batch and heads .*v may have a multiple"):
        linattn.gated_linear_attention(q, torch.randn(1, 1, 5, 4), torch.randn(1, 2, 5, 4), -torch.rand(1, 2, 5, 4))


@pytest.mark.parametrize("op,bad", [
    ("delta", dict(beta=torch.rand(1, 2, 5))),
    ("gated_delta", dict(log_g=-torch.rand(1, 2, 5))),
    ("gla", dict(log_g=-torch.rand(1, 2, 5, 4))),
    ("retention", dict(gamma=torch.full((2,), 0.9))),
    ("delta", dict(initial_state=torch.zeros(1, 2, 4, 4))),
])
def test_gates_beta_and_states_have_the_value_heads(op, bad):
    """v has 4 heads over q/k's 2: a gate, β or state with 2 heads is refused, naming the expected shape."""
    q = k = torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 4, 5, 4)
    args = dict(beta=torch.rand(1, 4, 5), log_g=-torch.rand(1, 4, 5), gamma=0.9)
    if op == "gla":
        args["log_g"] = -torch.rand(1, 4, 5, 4)
    args.update(bad)
    state = args.pop("initial_state", None)
    expected = {"beta": r"\(1, 4, 5\)", "log_g": r"\(1, 4, 5", "gamma": r"\(4,\)", "initial_state": r"\(1, 4, 4, 4\)"}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"{name} must .*{expected[name]}"):
        if op == "retention":
            linattn.retention(q, k, v, args["gamma"])
        elif op == "gla":
            linattn.gated_linear_attention(q, k, v, args["log_g"])
        elif op == "delta":
            linattn.delta_rule(q, k, v, args["beta"], initial_state=state)
        else:
            linattn.gated_delta_rule(q, k, v, args["log_g"], args["beta"])


@pytest.mark.parametrize("op", OPS)
def test_a_non_finite_value_in_one_grouped_head_stays_causal_like_the_repeated_call(op):
    """The chunk form's non-finite path (CausalPoison) with HV = r·H heads: a NaN in value head 1 at
    position 9 gives the NaNs of the repeated call, and nothing before position 9 changes."""
    x = {name: t.detach() for name, t in _inputs(op, r=2, T=21).items()}
    x["v"] = x["v"].clone()
    x["v"][0, 1, 9, 2] = float("nan")
    out, S = _call(op, x, x["q"], x["k"], chunk_size=8)
    ref_out, ref_S = _call(op, x, _repeat(x["q"], 2), _repeat(x["k"], 2), chunk_size=8)
    torch.testing.assert_close(out, ref_out, **TIGHT, equal_nan=True)
    torch.testing.assert_close(S, ref_S, **TIGHT, equal_nan=True)
    assert out[:, :, :9].isfinite().all() and out[1].isfinite().all() and out[0, 1, 9:].isnan().any()
