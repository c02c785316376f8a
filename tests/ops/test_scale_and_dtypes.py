"""``scale=`` on every op, and float32 gates and β next to half q, k, v.

``scale`` multiplies q before anything else (before φ): the reference is the unscaled call with q
pre-multiplied, values and gradients. Mixed dtypes: the reference is the call with q, k, v converted
to float32 first (what the op computes in), its output rounded to q's dtype.
"""
from __future__ import annotations

import pytest
import torch

import linattn

from decay_cases import OPS, call, inputs, assert_same_values_and_grads, loss_and_grads

TIGHT = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("feature_map", [None, "elu+1"])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_scale_equals_the_unscaled_call_with_q_premultiplied(op, feature_map, method):
    x = inputs(op, r=2, T=23)
    s = 0.37
    out, S = call(op, x, scale=s, feature_map=feature_map, method=method, chunk_size=8)
    ref_out, ref_S = call(op, x, q=x["q"] * s, feature_map=feature_map, method=method, chunk_size=8)
    grads, ref_grads = assert_same_values_and_grads(out, S, ref_out, ref_S, x, **TIGHT)


@pytest.mark.parametrize("op", OPS)
def test_scale_none_and_one_change_nothing(op):
    x = {name: t.detach() for name, t in inputs(op, T=9).items()}
    base = call(op, x)
    for scale in (None, 1, 1.0):
        got = call(op, x, scale=scale)
        assert all(torch.equal(a, b) for a, b in zip(got, base))


@pytest.mark.parametrize("causal,method", [(True, "chunk"), (True, "recurrent"), (False, "parallel")])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_scales_q_before_the_feature_map(causal, method, normalize):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 11, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    kw = dict(causal=causal, method=method, normalize=normalize, chunk_size=4)
    out = linattn.linear_attention(q, k, v, scale=0.5, **kw)
    ref = linattn.linear_attention(q * 0.5, k, v, **kw)
    torch.testing.assert_close(out, ref, **TIGHT)
    for a, b in zip(torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(ref.sum(), [q, k, v])):
        torch.testing.assert_close(a, b, **TIGHT)
    assert not torch.allclose(out, linattn.linear_attention(q, k, v, **kw))   # elu+1: scaling q changes the output


def test_linear_attention_step_scales_q_before_the_feature_map():
    q, k, v = (torch.randn(2, 2, 4, dtype=torch.float64) for _ in range(3))
    out, state = linattn.linear_attention_step(q, k, v, scale=0.25)
    ref, ref_state = linattn.linear_attention_step(q * 0.25, k, v)
    torch.testing.assert_close(out, ref, **TIGHT)
    assert state == ref_state


@pytest.mark.parametrize("scale,error,message", [
    (0.0, ValueError, r"scale must be a positive finite number, got 0.0"),
    (-1.0, ValueError, r"scale must be a positive finite number"),
    (float("nan"), ValueError, r"scale must be a positive finite number"),
    ("0.5", TypeError, r"scale must be a float, got str"),
    (1e-300, ValueError, r"scale=1e-300 is not a normal torch.float32 number"),
])
@pytest.mark.parametrize("op", ["retention", "kda", "linear_attention", "linear_attention_step"])
def test_bad_scales_raise_errors_that_name_it(op, scale, error, message):
    q = k = v = torch.randn(1, 2, 5, 4)
    with pytest.raises(error, match=message):
        if op == "linear_attention":
            linattn.linear_attention(q, k, v, causal=True, scale=scale)
        elif op == "linear_attention_step":
            linattn.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], scale=scale)
        else:
            call(op, {name: t.detach() for name, t in inputs(op, B=1, T=5, D=4, Dv=4, dtype=torch.float32).items()},
                 scale=scale)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_float32_gates_and_beta_with_half_q_k_v_compute_in_float32(op, half):
    x = inputs(op, r=2, T=21, dtype=torch.float32)
    h = {name: x[name].detach().to(half).requires_grad_() for name in ("q", "k", "v")}
    out, S = call(op, x, **h, chunk_size=8, scale=0.5)
    assert out.dtype == half and S.dtype == torch.float32
    wide = {name: t.float() for name, t in h.items()}                  # what the op computes with
    ref_out, ref_S = call(op, x, **wide, chunk_size=8, scale=0.5)
    torch.testing.assert_close(out, ref_out.to(half), rtol=0, atol=0)
    torch.testing.assert_close(S, ref_S, rtol=0, atol=0)
    leaves = {**x, **h}
    grads = loss_and_grads(out.float(), S, leaves)
    ref_grads = loss_and_grads(ref_out.to(half).float(), ref_S, {**x, **wide})
    for name in x:
        got = grads[name]
        assert got.dtype == (half if name in h else x[name].dtype), name
        torch.testing.assert_close(got, ref_grads[name].to(got.dtype), rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("op", ["gla", "delta", "gated_delta"])
def test_gates_wider_than_the_computation_are_refused(op):
    """float64 gates with float32 q would be rounded to float32: refused, naming both dtypes."""
    x = {name: t.detach() for name, t in inputs(op, T=5, dtype=torch.float32).items()}
    name = "log_g" if op != "delta" else "beta"
    with pytest.raises(TypeError, match=rf"{name} has dtype torch.float64 but q has dtype torch.float32; it must be q's"):
        call(op, x, **{name: x[name].double()})
