"""linattn.gated_delta_rule: one gate per head (Gated DeltaNet) or per key channel (Kimi Delta Attention).

The reference is written here from the recurrence, in float64, without linattn, in the Householder
form the papers use: S_t = (I − β_t k_t k_tᵀ) diag(α_t) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn import delta_rule, gated_delta_rule

TIGHT = dict(rtol=1e-9, atol=1e-9)
FLOAT32 = dict(rtol=2e-5, atol=2e-5)


def ref_gated_delta(q, k, v, log_g, beta, S0=None):
    """The token loop in float64; log_g (B, H, T) or (B, H, T, Dk). Returns (out, S_T)."""
    q, k, v, log_g, beta = (x.double() for x in (q, k, v, log_g, beta))
    B, H, T, Dk = k.shape
    if log_g.dim() == 3:
        log_g = log_g.unsqueeze(-1).expand(B, H, T, Dk)
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if S0 is None else S0.double()
    eye = torch.eye(Dk, dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, bt = k[:, :, t], beta[:, :, t, None, None]
        house = eye - bt * kt[..., :, None] * kt[..., None, :]                       # I − β k kᵀ
        S = house @ (log_g[:, :, t].exp()[..., :, None] * S) + bt * kt[..., :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    return torch.stack(outs, 2), S


def _inputs(B, H, T, D, Dv, *, per_channel, seed=0, dtype=torch.float64, decay_scale=1.0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    shape = (B, H, T, D) if per_channel else (B, H, T)
    log_g = F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 2) * decay_scale
    beta = 2 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, D, Dv, generator=g, dtype=torch.float64)
    xs = [x.to(dtype) for x in (q, k, v, log_g, beta, S0)]
    return [x.requires_grad_() for x in xs] if grad else xs


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("T,C", [(1, 64), (7, 4), (33, 8), (64, 16), (70, 64)])
def test_values_state_and_every_gradient_match_the_reference(per_channel, method, T, C):
    q, k, v, log_g, beta, S0 = _inputs(2, 2, T, 5, 3, per_channel=per_channel, grad=True)
    out, S = gated_delta_rule(q, k, v, log_g, beta, method=method, chunk_size=C, initial_state=S0, return_state=True)
    ref, ref_S = ref_gated_delta(q, k, v, log_g, beta, S0)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
    g = torch.Generator().manual_seed(1)
    w_out, w_S = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(S.shape, generator=g, dtype=S.dtype)
    inputs = (q, k, v, log_g, beta, S0)
    got = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), inputs)
    want = torch.autograd.grad((ref * w_out).sum() + (ref_S * w_S).sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "log_g", "beta", "initial_state"), got, want):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, name=name: f"d{name}: {m}")


@settings(max_examples=25)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 40), D=st.integers(1, 6), Dv=st.integers(1, 5),
       C=st.integers(1, 24), per_channel=st.booleans(), seed=st.integers(0, 10**6))
def test_property_chunk_equals_the_recurrence(B, H, T, D, Dv, C, per_channel, seed):
    q, k, v, log_g, beta, S0 = _inputs(B, H, T, D, Dv, per_channel=per_channel, seed=seed)
    out, S = gated_delta_rule(q, k, v, log_g, beta, chunk_size=C, initial_state=S0, return_state=True)
    ref, ref_S = ref_gated_delta(q, k, v, log_g, beta, S0)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_without_gates_it_is_the_delta_rule(per_channel):
    q, k, v, log_g, beta, S0 = _inputs(1, 2, 37, 6, 4, per_channel=per_channel)
    zeros = torch.zeros_like(log_g)
    for method in ("chunk", "recurrent"):
        a, Sa = gated_delta_rule(q, k, v, zeros, beta, method=method, chunk_size=8, initial_state=S0,
                                 return_state=True)
        b, Sb = delta_rule(q, k, v, beta, method=method, chunk_size=8, initial_state=S0, return_state=True)
        torch.testing.assert_close(a, b, **TIGHT)
        torch.testing.assert_close(Sa, Sb, **TIGHT)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_with_beta_zero_the_state_only_decays(per_channel):
    q, k, v, log_g, beta, S0 = _inputs(1, 2, 21, 4, 3, per_channel=per_channel)
    out, S = gated_delta_rule(q, k, v, log_g, torch.zeros_like(beta), chunk_size=8, initial_state=S0,
                              return_state=True)
    b = log_g.cumsum(2) if per_channel else log_g.cumsum(2).unsqueeze(-1).expand(*log_g.shape, 4)
    torch.testing.assert_close(S, b[:, :, -1].exp().unsqueeze(-1) * S0, **TIGHT)
    expected = torch.einsum("bhtd,bhde->bhte", q * b.exp(), S0)          # o_t = (diag(e^{b_t}) S0)ᵀ q_t
    torch.testing.assert_close(out, expected, **TIGHT)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("C", [64, 256])
def test_strong_decay_is_finite_and_exact(per_channel, C):
    """log α = −6 per token at C = 64 (and 256): a chunk's decay spans e^-378; nothing overflows."""
    T = 300
    q, k, v, _, beta, S0 = _inputs(1, 2, T, 8, 4, per_channel=per_channel, dtype=torch.float32)
    shape = (1, 2, T, 8) if per_channel else (1, 2, T)
    log_g = torch.full(shape, -6.0)
    xs = [x.clone().requires_grad_() for x in (q, k, v, log_g, beta, S0)]
    out, S = gated_delta_rule(*xs[:5], chunk_size=C, initial_state=xs[5], return_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(S).all()
    ref, ref_S = ref_gated_delta(*xs[:5], xs[5])
    torch.testing.assert_close(out.double(), ref, **FLOAT32)
    torch.testing.assert_close(S.double(), ref_S, **FLOAT32)
    got = torch.autograd.grad(out.sum(), xs)
    want = torch.autograd.grad(ref.sum(), xs)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), **FLOAT32)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_split_and_resume_equals_one_run(per_channel):
    q, k, v, log_g, beta, S0 = _inputs(2, 2, 50, 4, 3, per_channel=per_channel)
    full, S_full = gated_delta_rule(q, k, v, log_g, beta, chunk_size=8, initial_state=S0, return_state=True)
    cut = 23
    a, S_mid = gated_delta_rule(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], log_g[:, :, :cut], beta[:, :, :cut],
                                chunk_size=8, initial_state=S0, return_state=True)
    b, S_end = gated_delta_rule(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], log_g[:, :, cut:], beta[:, :, cut:],
                                chunk_size=8, initial_state=S_mid, return_state=True)
    torch.testing.assert_close(torch.cat([a, b], 2), full, **TIGHT)
    torch.testing.assert_close(S_end, S_full, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_half_inputs_compute_in_float32_with_a_float32_state(dtype, per_channel):
    q, k, v, log_g, beta, S0 = _inputs(1, 2, 200, 8, 8, per_channel=per_channel)
    half = [x.to(dtype) for x in (q, k, v, log_g, beta)]
    out, S = gated_delta_rule(*half, chunk_size=64, return_state=True)
    assert out.dtype == dtype and S.dtype == torch.float32
    ref, ref_S = ref_gated_delta(*(x.double() for x in half))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)                 # rounding the output only
    torch.testing.assert_close(S.double(), ref_S, rtol=1e-4, atol=1e-4)   # the state is float32


def test_feature_map_and_per_channel_gates_of_the_feature_dimension():
    q, k, v, _, beta, _ = _inputs(1, 2, 19, 4, 3, per_channel=False)
    phi = linattn.DPFPFeatures(1)                                         # Dk = 2 D = 8
    log_g = -torch.rand(1, 2, 19, 8, dtype=torch.float64)
    out = gated_delta_rule(q, k, v, log_g, beta / 4, feature_map=phi, chunk_size=8)
    ref, _ = ref_gated_delta(phi(q), phi(k), v, log_g, beta / 4)
    torch.testing.assert_close(out, ref, **TIGHT)
    with pytest.raises(ValueError, match=r"log_g must have shape .* = \(1, 2, 19, 8\) \(k has 4 dims, 8 features"):
        gated_delta_rule(q, k, v, log_g[..., :4], beta, feature_map=phi)


@pytest.mark.parametrize("args, error, match", [
    (dict(log_g=torch.zeros(1, 2, 9)), ValueError, r"log_g must have shape \(batch, heads, seq\) = \(1, 2, 10\)"),
    (dict(log_g=torch.zeros(1, 2, 10, 3)), ValueError, r"log_g must have shape .* = \(1, 2, 10, 4\), got \(1, 2, 10, 3\)"),
    (dict(log_g=torch.full((1, 2, 10), 0.5)), ValueError, r"log_g must be finite and <= 0.*got 0.5 at index \(0, 0, 0\)"),
    (dict(log_g=torch.full((1, 2, 10), -math.inf)), ValueError, r"log_g must be finite and <= 0"),
    (dict(log_g=torch.zeros(1, 2, 10, dtype=torch.float64)), TypeError, r"log_g has dtype torch.float64 but q has"),
    (dict(log_g=[0.0] * 10), TypeError, r"log_g must be a torch.Tensor"),
    (dict(beta=torch.full((1, 2, 10), 2.5)), ValueError, r"beta must be in \[0, 2\], got 2.5"),
    (dict(beta=torch.full((1, 2, 10), math.nan)), ValueError, r"beta must be in \[0, 2\], got nan"),
    (dict(beta=torch.zeros(1, 2)), ValueError, r"beta must have shape \(batch, heads, seq\) = \(1, 2, 10\)"),
    (dict(method="fused"), ValueError, r"unknown method 'fused'"),
    (dict(chunk_size=0), ValueError, r"chunk_size must be >= 1"),
    (dict(initial_state=torch.zeros(1, 2, 4, 5)), ValueError, r"initial_state must have shape \(B, H, Dk, Dv\) = \(1, 2, 4, 3\)"),
])
def test_bad_inputs_raise_informative_errors(args, error, match):
    q, k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 3)
    call = dict(log_g=torch.zeros(1, 2, 10), beta=torch.full((1, 2, 10), 0.5))
    call.update(args)
    log_g, beta = call.pop("log_g"), call.pop("beta")
    with pytest.raises(error, match=match):
        gated_delta_rule(q, k, v, log_g, beta, **call)
