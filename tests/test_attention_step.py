"""linear_attention_step (one token at a time) and LinearAttentionState."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import linattn
from refimpl import CAUSAL_METHODS, rand_qkv, ref_linear_attention, ref_phi

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _run_steps(q, k, v, state=None, **kw):
    outs = []
    for t in range(q.shape[2]):
        o, state = linattn.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, **kw)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def _cat_map(x):
    return torch.cat([F.elu(x) + 1, x.square()], dim=-1)  # M = 2D


def test_state_is_a_dataclass_with_S_and_z():
    assert dataclasses.is_dataclass(linattn.LinearAttentionState)
    names = {f.name for f in dataclasses.fields(linattn.LinearAttentionState)}
    assert {"S", "z"} <= names
    S, z = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    st = linattn.LinearAttentionState(S=S, z=z)
    assert st.S is S and st.z is z


@pytest.mark.parametrize("feature_map", ["elu+1", "relu", "custom-M2D", None])
@pytest.mark.parametrize("normalize", [True, False])
def test_steps_equal_causal_linear_attention(normalize, feature_map):
    fmap = _cat_map if feature_map == "custom-M2D" else feature_map
    B, H, T, D, Dv = 2, 3, 40, 5, 7
    q, k, v = rand_qkv(B, H, T, D, Dv, seed=1)
    if fmap is None and normalize:
        q, k = q.abs(), k.abs()  # already (nonnegative) features
    out, state = _run_steps(q, k, v, feature_map=fmap, normalize=normalize)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, feature_map=fmap, normalize=normalize)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, **TIGHT)
    M = ref_phi(fmap, torch.zeros(1, D, dtype=torch.float64)).shape[-1]
    assert state.S.shape == (B, H, M, Dv) and state.z.shape == (B, H, M)
    assert state.S.dtype == torch.float64 and state.z.dtype == torch.float64
    torch.testing.assert_close(state.S, S_ref, **TIGHT)
    torch.testing.assert_close(state.z, z_ref, **TIGHT)
    # and the package's own causal methods agree with the steps
    for method in CAUSAL_METHODS:
        full = linattn.linear_attention(q, k, v, causal=True, method=method, feature_map=fmap,
                                        normalize=normalize, chunk_size=16)
        torch.testing.assert_close(out, full, **TIGHT)


def test_one_step_formula_with_given_state():
    """out = phi(q)^T (S0 + phi(k) v^T) / max(phi(q).(z0 + phi(k)), eps); the new state is the updated sum."""
    g = torch.Generator().manual_seed(0)
    B, H, D, Dv = 2, 3, 4, 5
    q, k = (torch.randn(B, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, Dv, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64)
    z0 = torch.rand(B, H, D, generator=g, dtype=torch.float64) * 10  # large z0: it dominates the normaliser
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    S1 = S0 + fk[..., :, None] * v[..., None, :]
    z1 = z0 + fk
    num = torch.einsum("bhm,bhmv->bhv", fq, S1)
    den = (fq * z1).sum(-1, keepdim=True)
    out, st = linattn.linear_attention_step(q, k, v, linattn.LinearAttentionState(S=S0, z=z0))
    torch.testing.assert_close(out, num / den, **TIGHT)
    torch.testing.assert_close(st.S, S1, **TIGHT)
    torch.testing.assert_close(st.z, z1, **TIGHT)
    out_u, _ = linattn.linear_attention_step(q, k, v, linattn.LinearAttentionState(S=S0, z=z0), normalize=False)
    torch.testing.assert_close(out_u, num, **TIGHT)
    # the passed-in state is not modified in place
    out2, _ = linattn.linear_attention_step(q, k, v, linattn.LinearAttentionState(S=S0, z=z0))
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_step_does_not_mutate_state():
    q, k, v = rand_qkv(1, 2, 3, 4, 5, seed=2)
    _, st = _run_steps(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    S_before, z_before = st.S.clone(), st.z.clone()
    linattn.linear_attention_step(q[:, :, 2], k[:, :, 2], v[:, :, 2], st)
    assert torch.equal(st.S, S_before) and torch.equal(st.z, z_before)


def test_step_eps():
    """A tiny positive normaliser is used as it is; eps replaces only a zero or negative one."""
    g = torch.Generator().manual_seed(0)
    q = torch.rand(1, 1, 3, generator=g, dtype=torch.float64) * 1e-4
    k = torch.rand(1, 1, 3, generator=g, dtype=torch.float64) * 1e-4
    v = torch.randn(1, 1, 2, generator=g, dtype=torch.float64)
    for eps in (1e-6, 1e-2):
        out, _ = linattn.linear_attention_step(q, k, v, feature_map=None, eps=eps)
        torch.testing.assert_close(out, v, **TIGHT)                     # one token: its own value
        out, _ = linattn.linear_attention_step(q, -k, v, feature_map=None, eps=eps)
        torch.testing.assert_close(out, -(q * k).sum(-1, keepdim=True) * v / eps, **TIGHT)


@pytest.mark.parametrize("dtype,state_dtype", [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
])
def test_step_dtypes(dtype, state_dtype):
    q, k, v = rand_qkv(2, 2, 6, 8, 3, dtype=dtype, seed=3)
    out, st = _run_steps(q, k, v)
    assert out.dtype == dtype
    assert st.S.dtype == state_dtype and st.z.dtype == state_dtype
    assert st.S.shape == (2, 2, 8, 3) and st.z.shape == (2, 2, 8)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: TIGHT,
           torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]
    torch.testing.assert_close(out.double(), ref, **tol)
    stol = TIGHT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.S.double(), S_ref, **stol)
    torch.testing.assert_close(st.z.double(), z_ref, **stol)


def test_half_steps_long_sequence_stay_finite():
    """The float32 state keeps a float16 decode finite past z > 65504."""
    q, k, v = rand_qkv(1, 1, 1500, 8, 2, dtype=torch.float16, seed=4)
    k = k + 5  # phi(k) ~ 6 per dim: after 1500 tokens phi(q).z ~ 8 * 1.3 * 9000 > 65504
    out, st = _run_steps(q, k, v)
    assert torch.isfinite(out).all()
    assert st.z.dtype == torch.float32
    assert (st.z.double() * (F.elu(q[:, :, -1].double()) + 1)).sum() > 65504
    ref, _, _ = ref_linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("normalize", [True, False])
def test_steps_gradients(normalize):
    q, k, v = rand_qkv(1, 2, 12, 4, 3, seed=5, requires_grad=True)
    out, st = _run_steps(q, k, v, normalize=normalize)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, normalize=normalize)
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    gS = torch.randn(S_ref.shape, generator=gen, dtype=torch.float64)
    loss = (out * g).sum() + (st.S * gS).sum() + st.z.sum()
    loss_ref = (ref * g).sum() + (S_ref * gS).sum() + z_ref.sum()
    for a, b in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(loss_ref, (q, k, v))):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_resume_between_steps_and_linear_attention(method, normalize):
    """T=256: linear_attention on the first half, steps on the second (and the other way round) equals one run."""
    T, h = 256, 128
    q, k, v = rand_qkv(2, 2, T, 6, 4, seed=6)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, normalize=normalize)
    # linear_attention -> steps
    out1, st1 = linattn.linear_attention(q[:, :, :h], k[:, :, :h], v[:, :, :h], causal=True, method=method,
                                         normalize=normalize, return_state=True, chunk_size=64)
    out2, st2 = _run_steps(q[:, :, h:], k[:, :, h:], v[:, :, h:], st1, normalize=normalize)
    torch.testing.assert_close(torch.cat([out1, out2], 2), ref, **TIGHT)
    torch.testing.assert_close(st2.S, S_ref, **TIGHT)
    torch.testing.assert_close(st2.z, z_ref, **TIGHT)
    # steps -> linear_attention
    out1, st1 = _run_steps(q[:, :, :h], k[:, :, :h], v[:, :, :h], normalize=normalize)
    out2, st2 = linattn.linear_attention(q[:, :, h:], k[:, :, h:], v[:, :, h:], causal=True, method=method,
                                         normalize=normalize, initial_state=st1, return_state=True, chunk_size=64)
    torch.testing.assert_close(torch.cat([out1, out2], 2), ref, **TIGHT)
    torch.testing.assert_close(st2.S, S_ref, **TIGHT)
    torch.testing.assert_close(st2.z, z_ref, **TIGHT)


def test_steps_two_halves():
    """Steps alone: a state carried across the split (S AND z) equals one run; dropping z would not."""
    T, h = 256, 128
    q, k, v = rand_qkv(1, 3, T, 5, 4, seed=7)
    ref, _, _ = ref_linear_attention(q, k, v, causal=True)
    out1, st1 = _run_steps(q[:, :, :h], k[:, :, :h], v[:, :, :h])
    out2, _ = _run_steps(q[:, :, h:], k[:, :, h:], v[:, :, h:], st1)
    torch.testing.assert_close(torch.cat([out1, out2], 2), ref, **TIGHT)
    lost_z = linattn.LinearAttentionState(S=st1.S, z=torch.zeros_like(st1.z))
    out_bad, _ = _run_steps(q[:, :, h:], k[:, :, h:], v[:, :, h:], lost_z)
    assert (out_bad - ref[:, :, h:]).abs().max() > 0.1
