"""The decay family: retention, gated linear attention and the delta rule (linattn.retention, .gla, .delta).

The references here are written from the recurrences in the papers, in float64, and do
not import linattn: retention and GLA as closed-form quadratic sums, the delta rule as a
token loop in its Householder form ``S_t = (I − β k kᵀ) S_{t-1} + β k vᵀ``.
"""
from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn import bench
from linattn import delta_rule, gated_linear_attention, retention

VARIANTS = ("retention", "gla", "delta")
TIGHT = dict(rtol=1e-9, atol=1e-9)      # float64 against float64: only the order of the sums differs
FLOAT32 = dict(rtol=2e-5, atol=2e-5)    # float32 forms against float64 (values of order 1-10)


# ------------------------------------------------------------------ float64 references


def ref_retention(q, k, v, gamma, S0=None):
    """o_t = Σ_{s<=t} γ^(t−s) (q_t·k_s) v_s + γ^(t+1) q_tᵀ S0; gamma (H,). Returns (out, S_T)."""
    q, k, v, gamma = q.double(), k.double(), v.double(), gamma.double()
    T = q.shape[2]
    t = torch.arange(T, dtype=torch.float64)
    expo = (t[:, None] - t[None, :]).clamp(min=0)                    # (T, T)
    decay = gamma.view(-1, 1, 1) ** expo * torch.ones(T, T, dtype=torch.float64).tril()   # (H, T, T)
    out = ((q @ k.transpose(-1, -2)) * decay) @ v
    S = (k * (gamma.view(-1, 1) ** (T - 1 - t)).unsqueeze(-1)).transpose(-1, -2) @ v
    if S0 is not None:
        S0 = S0.double()
        out = out + (q * (gamma.view(-1, 1) ** (t + 1)).unsqueeze(-1)) @ S0
        S = S + gamma.view(-1, 1, 1) ** T * S0
    return out, S


def ref_gla(q, k, v, log_g, S0=None):
    """o_t = Σ_{s<=t} Σ_d q_td k_sd exp(b_td − b_sd) v_s + (q_t ⊙ exp(b_t))ᵀ S0, b = cumsum(log_g)."""
    q, k, v, log_g = q.double(), k.double(), v.double(), log_g.double()
    T = q.shape[2]
    b = log_g.cumsum(2)                                              # (B, H, T, Dk)
    diff = b[:, :, :, None, :] - b[:, :, None, :, :]                 # (B, H, T, T, Dk), t - s
    keep = torch.ones(T, T, dtype=torch.bool).tril()[:, :, None]
    w = torch.where(keep, diff, torch.full_like(diff, -math.inf)).exp()
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :] * w).sum(-1)
    out = scores @ v
    S = (k * (b[:, :, -1:] - b).exp()).transpose(-1, -2) @ v
    if S0 is not None:
        S0 = S0.double()
        out = out + (q * b.exp()) @ S0
        S = S + b[:, :, -1].exp().unsqueeze(-1) * S0
    return out, S


def ref_gla_loop(q, k, v, log_g, S0=None):
    """S_t = diag(exp(log_g_t)) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, one token at a time.

    Used for the extreme decays: there the closed form above is accurate for values but
    not for the gradient of log_g, which it obtains as a small difference of large terms
    (through b_t − b_s); the loop differentiates each gate directly."""
    q, k, v, log_g = q.double(), k.double(), v.double(), log_g.double()
    B, H, T, Dk = k.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if S0 is None else S0.double()
    outs = []
    for t in range(T):
        S = log_g[:, :, t, :, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    return torch.stack(outs, 2), S


def ref_delta(q, k, v, beta, S0=None):
    """S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, one token at a time."""
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    B, H, T, Dk = k.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if S0 is None else S0.double()
    eye = torch.eye(Dk, dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, bt = k[:, :, t], beta[:, :, t, None, None]
        S = (eye - bt * kt[..., :, None] * kt[..., None, :]) @ S + bt * kt[..., :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    return torch.stack(outs, 2), S


REFS = {"retention": ref_retention, "gla": ref_gla, "delta": ref_delta}
FUNCS = {"retention": retention, "gla": gated_linear_attention, "delta": delta_rule}


def make_inputs(variant, B, H, T, D, Dv, *, seed=0, dtype=torch.float64, with_state=False, scale=1.0):
    """q, k, v, the variant's decay argument (γ (H,), log_g, or β) and S0 (or None)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, Dv)
    if variant == "retention":
        extra = torch.rand(H, generator=gen, dtype=torch.float64) * 0.5 + 0.5
        extra[0] = 1.0                                               # γ = 1 exactly in one head
    elif variant == "gla":
        extra = -torch.rand(B, H, T, D, generator=gen, dtype=torch.float64) * scale
        extra[..., 0] = 0.0                                          # no decay in one key dimension
    else:
        k = F.normalize(k, dim=-1)                                   # the usual (stable) setting
        extra = torch.rand(B, H, T, generator=gen, dtype=torch.float64) * 2
        extra[..., :1] = 2.0                                         # the ends of [0, 2]
        extra[..., 1:2] = 0.0
    S0 = randn(B, H, D, Dv) if with_state else None
    cast = (lambda x: x) if dtype == torch.float64 else (lambda x: x.to(dtype))
    return cast(q), cast(k), cast(v), extra if variant == "retention" else cast(extra), S0


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


# ------------------------------------------------------------------ chunk = recurrent = reference


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 40), D=st.integers(1, 8),
       Dv=st.integers(1, 6), chunk=st.integers(1, 24), seed=st.integers(0, 2**16), with_state=st.booleans())
def test_chunk_matches_recurrent_values_and_gradients(variant, B, H, T, D, Dv, chunk, seed, with_state):
    """Both forms give the same output, final state and gradients (q, k, v, γ/log_g/β, S0),
    over random shapes and ragged T (T need not be a multiple of the chunk size)."""
    fn = FUNCS[variant]
    inputs = make_inputs(variant, B, H, T, D, Dv, seed=seed, with_state=with_state, scale=3.0)
    upstream = torch.randn(B, H, T, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    up_state = torch.randn(B, H, D, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))
    results = []
    for method in ("chunk", "recurrent"):
        q, k, v, extra, S0 = leaves(*inputs)
        out, S = fn(q, k, v, extra, method=method, chunk_size=chunk, initial_state=S0, return_state=True)
        wrt = [x for x in (q, k, v, extra, S0) if x is not None]
        grads = torch.autograd.grad((out * upstream).sum() + (S * up_state).sum(), wrt)
        results.append((out, S, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 8), (48, 16), (50, 64), (65, 32)])
def test_matches_float64_reference(variant, method, T, chunk):
    """Output, final state and gradients equal the closed-form / Householder references."""
    inputs = make_inputs(variant, 2, 3, T, 5, 4, seed=T, with_state=True)
    q, k, v, extra, S0 = leaves(*inputs)
    out, S = FUNCS[variant](q, k, v, extra, method=method, chunk_size=chunk, initial_state=S0, return_state=True)
    ref_in = leaves(*inputs)
    ref_out, ref_S = REFS[variant](*ref_in)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
    upstream = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad((out * upstream).sum() + S.sum(), (q, k, v, extra, S0))
    want = torch.autograd.grad((ref_out * upstream).sum() + ref_S.sum(), ref_in)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_split_and_resume_equals_one_run(variant, method):
    """Running [0, s) then resuming from the returned state on [s, T) equals one run."""
    T, chunk = 45, 8
    q, k, v, extra, S0 = make_inputs(variant, 2, 2, T, 6, 3, seed=3, with_state=True)
    fn = FUNCS[variant]
    full, S_full = fn(q, k, v, extra, method=method, chunk_size=chunk, initial_state=S0, return_state=True)
    for split in (1, 16, 21):
        first, second = slice(0, split), slice(split, T)
        e1 = extra if variant == "retention" else extra[:, :, first]
        e2 = extra if variant == "retention" else extra[:, :, second]
        out1, S1 = fn(q[:, :, first], k[:, :, first], v[:, :, first], e1, method=method, chunk_size=chunk,
                      initial_state=S0, return_state=True)
        out2, S2 = fn(q[:, :, second], k[:, :, second], v[:, :, second], e2, method=method, chunk_size=chunk,
                      initial_state=S1, return_state=True)
        torch.testing.assert_close(torch.cat([out1, out2], dim=2), full, **TIGHT)
        torch.testing.assert_close(S2, S_full, **TIGHT)


# ------------------------------------------------------------------ special cases that reduce to known things


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("feature_map", [None, "elu+1"])
def test_no_decay_is_unnormalised_linear_attention(method, feature_map):
    """γ = 1 (retention) and log_g = 0 (GLA) reduce to linear_attention(causal, normalize=False),
    state included."""
    q, k, v, _, S0 = make_inputs("retention", 2, 3, 29, 5, 4, seed=11, with_state=True)
    M = 5
    state0 = linattn.LinearAttentionState(S0, torch.zeros(2, 3, M, dtype=torch.float64))
    want, want_state = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True, normalize=False,
                                                initial_state=state0, return_state=True)
    got, S = retention(q, k, v, 1.0, method=method, chunk_size=8, feature_map=feature_map,
                       initial_state=S0, return_state=True)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(S, want_state.S, **TIGHT)
    log_g = torch.zeros(2, 3, 29, M, dtype=torch.float64)
    got, S = gated_linear_attention(q, k, v, log_g, method=method, chunk_size=8, feature_map=feature_map,
                                    initial_state=S0, return_state=True)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(S, want_state.S, **TIGHT)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_delta_rule_beta_zero_leaves_state_unchanged(method):
    """β = 0 writes nothing: every output is S0ᵀq_t and the final state is S0."""
    q, k, v, _, S0 = make_inputs("delta", 2, 2, 23, 6, 3, seed=5, with_state=True)
    out, S = delta_rule(q, k, v, torch.zeros(2, 2, 23, dtype=torch.float64), method=method, chunk_size=8,
                        initial_state=S0, return_state=True)
    torch.testing.assert_close(out, q @ S0, **TIGHT)
    torch.testing.assert_close(S, S0, **TIGHT)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_delta_rule_beta_one_stores_values_under_orthonormal_keys(method):
    """With orthonormal keys and β = 1 the state recalls exactly the value written under each
    key, whatever it held before (what the delta rule is for)."""
    D, Dv = 6, 4
    gen = torch.Generator().manual_seed(2)
    keys = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))[0].T   # rows orthonormal
    k = keys.expand(1, 2, D, D).contiguous()
    v = torch.randn(1, 2, D, Dv, generator=gen, dtype=torch.float64)
    S0 = torch.randn(1, 2, D, Dv, generator=gen, dtype=torch.float64)
    _, S = delta_rule(k, k, v, torch.ones(1, 2, D, dtype=torch.float64), method=method, chunk_size=4,
                      initial_state=S0, return_state=True)
    torch.testing.assert_close(k @ S, v, **TIGHT)     # S ᵀ k_j = v_j for every j


def test_per_head_gamma_equals_one_head_at_a_time():
    q, k, v, _, _ = make_inputs("retention", 2, 3, 31, 4, 5, seed=4)
    gammas = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    out = retention(q, k, v, gammas, chunk_size=8)
    for h in range(3):
        one = retention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], float(gammas[h]), chunk_size=8)
        torch.testing.assert_close(out[:, h:h + 1], one, **TIGHT)
    # a float32 gamma tensor is fine for float64 inputs (cast to the computation dtype)
    torch.testing.assert_close(retention(q, k, v, gammas.float(), chunk_size=8),
                               retention(q, k, v, gammas.float().double(), chunk_size=8), **TIGHT)


@pytest.mark.parametrize("variant", VARIANTS)
def test_feature_map_is_applied_to_q_and_k_first(variant):
    """feature_map=φ equals passing φ(q), φ(k) with feature_map=None, also when φ changes the
    key dimension (then log_g and the state have the feature dimension)."""
    def phi(x):  # (…, D) -> (…, 2D), non-negative
        return torch.cat([F.relu(x), F.relu(-x)], dim=-1)

    def phi_unit(x):
        return F.normalize(phi(x), dim=-1)

    fmap = phi_unit if variant == "delta" else phi
    q, k, v, extra, _ = make_inputs(variant, 1, 2, 20, 3, 4, seed=6)
    if variant == "gla":
        extra = -torch.rand(1, 2, 20, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    S0 = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    got, S = FUNCS[variant](q, k, v, extra, feature_map=fmap, chunk_size=8, initial_state=S0, return_state=True)
    want, want_S = REFS[variant](fmap(q), fmap(k), v, extra, S0)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(S, want_S, **TIGHT)
    if variant == "retention":
        torch.testing.assert_close(retention(q, k, v, 0.8, feature_map="elu+1"),
                                   retention(F.elu(q) + 1, F.elu(k) + 1, v, 0.8), **TIGHT)


# ------------------------------------------------------------------ numerical safety


EXTREME = {
    "log -3 per token": lambda shape, gen: torch.full(shape, -3.0),
    "gate 1e-12 per token": lambda shape, gen: torch.full(shape, math.log(1e-12)),
    "mixed strong and none": lambda shape, gen: torch.tensor([-27.6, -3.0, 0.0, -1e-3])[
        torch.randint(0, 4, shape, generator=gen)],
    "strong then none": lambda shape, gen: torch.where(torch.arange(shape[2]).view(1, 1, -1, 1) < shape[2] // 2,
                                                       -27.6, 0.0).expand(shape),
}


@pytest.mark.parametrize("case", list(EXTREME))
@pytest.mark.parametrize("chunk", [64, 256])
def test_gla_extreme_decay_is_finite_and_exact_in_float32(case, chunk):
    """Per-token log-decays of −3 and −27.6 (g = 1e-12) at chunk sizes 64 and 256: finite
    outputs, states and gradients, equal to the float64 loop reference (both forms).

    The gradient of log_g is checked relative to its own (tiny) scale: the chunk form sums
    each exponent from its own terms, so the gradient of a 1e-12 gate is not rounding noise."""
    B, H, T, D, Dv = 1, 2, 200, 4, 3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=gen) for d in (D, D, Dv))
    log_g = EXTREME[case]((B, H, T, D), gen).float().contiguous()
    S0 = torch.randn(B, H, D, Dv, generator=gen)
    ins = leaves(*(x.double() for x in (q, k, v, log_g, S0)))
    ref_out, ref_S = ref_gla_loop(*ins)
    ref_grads = torch.autograd.grad(ref_out.sum() + ref_S.sum(), ins)
    for method in ("chunk", "recurrent"):
        xs = leaves(q, k, v, log_g, S0)
        out, S = gated_linear_attention(*xs[:4], method=method, chunk_size=chunk, initial_state=xs[4],
                                        return_state=True)
        grads = torch.autograd.grad(out.sum() + S.sum(), xs)
        for got, want in zip((out, S, *grads), (ref_out, ref_S, *ref_grads)):
            assert torch.isfinite(got).all()
            scale = want.abs().max().item()
            torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * max(scale, 1e-30))


@pytest.mark.parametrize("gamma", [math.exp(-3), 1e-12, "per-head"])
def test_retention_extreme_decay_is_finite_and_exact_in_float32(gamma):
    B, H, T, D, Dv = 1, 4, 200, 4, 3
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, d, generator=gen) for d in (D, D, Dv))
    S0 = torch.randn(B, H, D, Dv, generator=gen)
    g = torch.tensor([1e-12, math.exp(-3), 0.5, 1.0]) if gamma == "per-head" else gamma
    g64 = g.double() if isinstance(g, torch.Tensor) else torch.full((H,), g, dtype=torch.float64)
    ref_out, ref_S = ref_retention(q, k, v, g64, S0)
    for method in ("chunk", "recurrent"):
        xs = leaves(q, k, v, S0)
        out, S = retention(*xs[:3], g, method=method, chunk_size=64, initial_state=xs[3], return_state=True)
        grads = torch.autograd.grad(out.sum() + S.sum(), xs)
        assert all(torch.isfinite(x).all() for x in (out, S, *grads))
        torch.testing.assert_close(out.double(), ref_out, **FLOAT32)
        torch.testing.assert_close(S.double(), ref_S, rtol=2e-5, atol=2e-5 * ref_S.abs().max().item())


def _gla_huge_log_g(T, D, value, seed):
    """log_g of -0.1 and ``value`` (a huge negative gate, exp(value) = 0) mixed at random."""
    gen = torch.Generator().manual_seed(seed)
    strong = torch.rand(1, 2, T, D, generator=gen) < 0.3
    return torch.where(strong, torch.tensor(value), torch.tensor(-0.1))


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("value", [-1e38, -3.4e38, -1e4])
def test_gla_huge_negative_log_g_matches_recurrent_without_nan(chunk, value):
    """Regression: float32 range sums of log_g = -1e38 used to overflow to -inf and the 0/1
    segment-sum matmuls turned -inf · 0 into NaN (chunk form only). Any finite log_g <= 0 is
    accepted, so both forms must give finite values and gradients, equal to the float64 loop,
    and the gradient of a gate whose exp underflows is exactly 0 in both forms."""
    T, D, Dv = 64, 3, 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, T, d, generator=gen) for d in (D, D, Dv))
    log_g = _gla_huge_log_g(T, D, value, seed=5)
    S0 = torch.randn(1, 2, D, Dv, generator=gen)
    ins = leaves(*(x.double() for x in (q, k, v, log_g, S0)))
    ref_out, ref_S = ref_gla_loop(*ins)
    ref_grads = torch.autograd.grad(ref_out.sum() + ref_S.sum(), ins)
    for method in ("chunk", "recurrent"):
        xs = leaves(q, k, v, log_g, S0)
        out, S = gated_linear_attention(*xs[:4], method=method, chunk_size=chunk, initial_state=xs[4],
                                        return_state=True)
        grads = torch.autograd.grad(out.sum() + S.sum(), xs)
        for got, want in zip((out, S, *grads), (ref_out, ref_S, *ref_grads)):
            assert torch.isfinite(got).all(), method
            torch.testing.assert_close(got.double(), want, **FLOAT32)
        assert (grads[3][log_g == value] == 0).all(), method


@pytest.mark.parametrize("chunk", [5, 64])
def test_gla_floor_changes_nothing_that_underflow_did_not(chunk):
    """A gate of exp(-150) already underflows to exactly 0 in float32: replacing it by
    exp(-1e38) (clamped internally) gives bit-identical outputs and gradients."""
    T, D, Dv = 64, 3, 2
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, T, d, generator=gen) for d in (D, D, Dv))
    results = []
    for value in (-150.0, -1e38):
        log_g = _gla_huge_log_g(T, D, value, seed=7)
        xs = leaves(q, k, v, log_g)
        out = gated_linear_attention(*xs, chunk_size=chunk)
        results.append((out, *torch.autograd.grad(out.sum(), xs)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("gamma", [1e-38, 1e-45])
def test_retention_subnormal_gamma_matches_recurrent_with_gradients(chunk, gamma):
    """γ = 1e-38 and 1e-45 (float32 subnormals; 1/γ overflows for the latter): finite values
    and gradients, γ's included, equal to the float64 reference and the recurrent form. (The
    chain rule through log γ gave ∂/∂γ = -3 instead of -4.73 at γ = 1e-45.)"""
    B, H, T, D, Dv = 1, 2, 64, 3, 2
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, H, T, d, generator=gen) for d in (D, D, Dv))
    S0 = torch.randn(B, H, D, Dv, generator=gen)
    g = torch.tensor([gamma, 0.5])
    ins = leaves(*(x.double() for x in (q, k, v, g, S0)))
    ref_out, ref_S = ref_retention(ins[0], ins[1], ins[2], ins[3], ins[4])
    ref_grads = torch.autograd.grad(ref_out.sum() + ref_S.sum(), ins)
    for method in ("chunk", "recurrent"):
        xs = leaves(q, k, v, g, S0)
        out, S = retention(*xs[:4], method=method, chunk_size=chunk, initial_state=xs[4], return_state=True)
        grads = torch.autograd.grad(out.sum() + S.sum(), xs)
        for got, want in zip((out, S, *grads), (ref_out, ref_S, *ref_grads)):
            assert torch.isfinite(got).all(), method
            torch.testing.assert_close(got.double(), want, **FLOAT32)


@pytest.mark.parametrize("chunk", [5, 64])
def test_delta_rule_extreme_accepted_inputs_match_reference(chunk):
    """β at both ends of [0, 2], zero keys, subnormal keys and unit keys mixed: finite and
    equal to the float64 Householder loop (no exp anywhere, but the solve must not divide)."""
    B, H, T, D, Dv = 1, 2, 64, 4, 3
    gen = torch.Generator().manual_seed(9)
    q, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, Dv, generator=gen)
    k = F.normalize(torch.randn(B, H, T, D, generator=gen), dim=-1)
    k[:, :, ::7] = 0.0
    k[:, :, 3::7] = 1e-40
    beta = torch.rand(B, H, T, generator=gen) * 2
    beta[:, :, ::3], beta[:, :, 1::3] = 2.0, 0.0
    ins = leaves(*(x.double() for x in (q, k, v, beta)))
    ref_out, ref_S = ref_delta(*ins)
    ref_grads = torch.autograd.grad(ref_out.sum() + ref_S.sum(), ins)
    for method in ("chunk", "recurrent"):
        xs = leaves(q, k, v, beta)
        out, S = delta_rule(*xs, method=method, chunk_size=chunk, return_state=True)
        grads = torch.autograd.grad(out.sum() + S.sum(), xs)
        for got, want in zip((out, S, *grads), (ref_out, ref_S, *ref_grads)):
            assert torch.isfinite(got).all(), method
            scale = max(want.abs().max().item(), 1.0)
            torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_half_inputs_compute_in_float32(variant, dtype, method):
    """Half inputs: output in the input dtype, state in float32, and equal to the float32
    computation on the same (rounded) inputs up to the final rounding to ``dtype``."""
    q, k, v, extra, S0 = make_inputs(variant, 2, 2, 37, 8, 4, seed=9, dtype=dtype, with_state=True)
    out, S = FUNCS[variant](q, k, v, extra, method=method, chunk_size=16, initial_state=S0, return_state=True)
    assert out.dtype == dtype and S.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(S).all()
    e32 = extra if variant == "retention" else extra.float()
    out32, S32 = FUNCS[variant](q.float(), k.float(), v.float(), e32, method=method, chunk_size=16,
                                initial_state=S0.float(), return_state=True)
    eps = torch.finfo(dtype).eps       # one rounding to dtype: relative error <= eps / 2
    torch.testing.assert_close(out.float(), out32, rtol=eps, atol=1e-5)
    torch.testing.assert_close(S, S32)
    qg = q.detach().requires_grad_()
    (g,) = torch.autograd.grad(FUNCS[variant](qg, k, v, extra, method=method, chunk_size=16).float().sum(), qg)
    assert g.dtype == dtype and torch.isfinite(g).all()


def test_state_dtype_follows_the_inputs():
    for dtype, state_dtype in ((torch.float32, torch.float32), (torch.float64, torch.float64)):
        q, k, v, extra, _ = make_inputs("gla", 1, 1, 9, 3, 2, dtype=dtype)
        S0 = torch.randn(1, 1, 3, 2, dtype=torch.float64)               # cast to the state dtype
        out, S = gated_linear_attention(q, k, v, extra, initial_state=S0, return_state=True)
        assert out.dtype == dtype and S.dtype == state_dtype and S.shape == (1, 1, 3, 2)


@pytest.mark.parametrize("method", ["CHUNK", " Recurrent ", "Auto"])
def test_method_names_are_case_insensitive(method):
    q, k, v, extra, _ = make_inputs("delta", 1, 1, 10, 3, 2)
    torch.testing.assert_close(delta_rule(q, k, v, extra, method=method), ref_delta(q, k, v, extra)[0], **TIGHT)


# ------------------------------------------------------------------ bad inputs


def _args(variant="retention", T=6, D=3, dtype=torch.float32):
    q, k, v = (torch.randn(2, 3, T, d, dtype=dtype) for d in (D, D, 2))
    extra = {"retention": 0.9, "gla": -torch.rand(2, 3, T, D, dtype=dtype),
             "delta": torch.rand(2, 3, T, dtype=dtype)}[variant]
    return q, k, v, extra


def _with(variant, index, value):
    args = list(_args(variant))
    args[index] = value
    return args


BAD = [
    # (variant, args, kwargs, error, message)
    ("retention", _with("retention", 3, 0.0), {}, ValueError, r"gamma must be in \(0, 1\], got 0"),
    ("retention", _with("retention", 3, 1.5), {}, ValueError, r"gamma must be in \(0, 1\], got 1.5"),
    ("retention", _with("retention", 3, math.nan), {}, ValueError, r"gamma must be in \(0, 1\], got nan"),
    ("retention", _with("retention", 3, "0.9"), {}, TypeError, r"gamma must be a float or a tensor.*got str"),
    ("retention", _with("retention", 3, True), {}, TypeError, r"gamma must be a float or a tensor.*got bool"),
    ("retention", _with("retention", 3, torch.full((4,), 0.9)), {}, ValueError,
     r"gamma must be a float or a tensor of shape \(heads,\) = \(3,\), got shape \(4\)"),
    ("retention", _with("retention", 3, torch.tensor(0.9)), {}, ValueError, r"got shape \(\).*pass float\(gamma\)"),
    ("retention", _with("retention", 3, torch.tensor([0.9, 0.0, 0.5])), {}, ValueError,
     r"gamma must be in \(0, 1\], got 0.0 at index \(1,\)"),
    ("retention", _with("retention", 3, torch.tensor([1, 1, 1])), {}, TypeError, r"floating-point tensor.*int64"),
    ("gla", _with("gla", 3, torch.full((2, 3, 6, 3), 0.5)), {}, ValueError,
     r"log_g must be finite and <= 0.*got 0.5 at index \(0, 0, 0, 0\)"),
    ("gla", _with("gla", 3, torch.full((2, 3, 6, 3), -math.inf)), {}, ValueError, r"log_g must be finite.*got -inf"),
    ("gla", _with("gla", 3, torch.full((2, 3, 6, 3), math.nan)), {}, ValueError, r"log_g must be finite.*got nan"),
    ("gla", _with("gla", 3, torch.zeros(2, 3, 6)), {}, ValueError,
     r"log_g must have shape \(batch, heads, seq, key features\) = \(2, 3, 6, 3\), got \(2, 3, 6\)"),
    ("gla", _with("gla", 3, torch.zeros(2, 3, 6, 3, dtype=torch.float64)), {}, TypeError,
     r"log_g has dtype torch.float64 but q has dtype torch.float32"),
    ("gla", _with("gla", 3, [0.0]), {}, TypeError, r"log_g must be a torch.Tensor.*got list"),
    ("gla", _args("gla"), dict(feature_map=lambda x: torch.cat([x, x], -1).exp()), ValueError,
     r"log_g must have shape .* = \(2, 3, 6, 6\) \(k has 3 dims, 6 features after feature_map\), got \(2, 3, 6, 3\)"),
    ("delta", _with("delta", 3, torch.full((2, 3, 6), 2.5)), {}, ValueError, r"beta must be in \[0, 2\], got 2.5"),
    ("delta", _with("delta", 3, torch.full((2, 3, 6), -0.1)), {}, ValueError, r"beta must be in \[0, 2\], got -0.1"),
    ("delta", _with("delta", 3, torch.full((2, 3, 6), math.nan)), {}, ValueError, r"beta must be in \[0, 2\], got nan"),
    ("delta", _with("delta", 3, torch.rand(2, 3, 6, 1)), {}, ValueError,
     r"beta must have shape \(batch, heads, seq\) = \(2, 3, 6\), got \(2, 3, 6, 1\)"),
    ("delta", _with("delta", 3, 0.5), {}, TypeError, r"beta must be a torch.Tensor .*got float"),
    # shared arguments
    ("retention", _args(), dict(method="fast"), ValueError, r"unknown method 'fast'; expected one of 'auto', 'chunk'"),
    ("gla", _args("gla"), dict(method="quadratic"), ValueError, r"unknown method 'quadratic'"),
    ("delta", _args("delta"), dict(method=1), TypeError, r"method must be a str, got int"),
    ("retention", _args(), dict(chunk_size=0), ValueError, r"chunk_size must be >= 1, got 0"),
    ("retention", _args(), dict(chunk_size=8.0), TypeError, r"chunk_size must be an int, got float"),
    ("gla", _args("gla"), dict(return_state="yes"), TypeError, r"return_state must be a bool, got str"),
    ("gla", _args("gla"), dict(initial_state=torch.zeros(2, 3, 2, 3)), ValueError,
     r"initial_state must have shape \(B, H, Dk, Dv\) = \(2, 3, 3, 2\).*got \(2, 3, 2, 3\)"),
    ("delta", _args("delta"), dict(initial_state=torch.zeros(2, 3, 3, 2, dtype=torch.int32)), TypeError,
     r"initial_state must be a floating-point tensor"),
    ("retention", _args(), dict(initial_state=linattn.LinearAttentionState.zeros(2, 3, 3, 2)), TypeError,
     r"initial_state must be a torch.Tensor S .*got .*LinearAttentionState"),
    ("retention", _args(), dict(feature_map="nope"), ValueError, r"nope"),
    ("delta", [torch.randn(2, 3, 6, 3), torch.randn(2, 3, 5, 3), torch.randn(2, 3, 5, 2), torch.rand(2, 3, 6)], {},
     ValueError, r"delta_rule is causal \(it has no cross-attention form\) and needs as many queries as keys"),
    ("gla", [torch.randn(3, 6, 3), torch.randn(3, 6, 3), torch.randn(3, 6, 2), torch.zeros(3, 6, 3)], {},
     ValueError, r"q must be 4-D \(batch, heads, seq, dim\), got shape \(3, 6, 3\)"),
    ("retention", [torch.randn(2, 3, 6, 3), torch.randn(2, 3, 6, 3).double(), torch.randn(2, 3, 6, 2), 0.9], {},
     TypeError, r"k has dtype torch.float64 but q has dtype torch.float32"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fewer_keys_than_queries_names_the_function_not_a_causal_flag(variant):
    """The decay functions have no ``causal`` argument: the error must not suggest one."""
    q, k, v, extra = _args(variant)
    name = {"retention": "retention", "gla": "gated_linear_attention", "delta": "delta_rule"}[variant]
    with pytest.raises(ValueError) as exc:
        FUNCS[variant](q, k[:, :, :4], v[:, :, :4], extra)
    message = str(exc.value)
    assert message.startswith(f"{name} is causal (it has no cross-attention form) and needs as many queries as keys")
    assert "got q with seq 6 and k with seq 4" in message
    assert "causal=" not in message
    # linear_attention, which has the flag, keeps its own advice
    with pytest.raises(ValueError, match=r"causal=True needs as many queries as keys, got q with seq 6 and k with "
                                         r"seq 4; use causal=False for cross-attention"):
        linattn.linear_attention(q, k[:, :, :4], v[:, :, :4], causal=True)


@pytest.mark.parametrize("variant,args,kwargs,error,message", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_raise_informative_errors(variant, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        FUNCS[variant](*args, **kwargs)


# ------------------------------------------------------------------ benchmark


def test_decay_benchmark_runs_and_formats():
    """Tiny sizes, no timing assertions: the rows, the table and the CLI flag."""
    rows = bench.run_decay_benchmark([12], heads=2, head_dim=4, chunk_size=8, repeats=1, warmup=0,
                                     peers=False)                    # transformers' row, where installed: its own test
    assert [(r["variant"], r["method"]) for r in rows] == [("ungated", "chunk")] + [
        (v, m) for m in ("chunk", "recurrent") for v in bench.DECAY_VARIANTS]      # the loops after the chunks
    assert all(r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0 and r["seq_len"] == 12 for r in rows)
    table = bench.format_decay_table(rows)
    for word in ("retention", "gla", "delta", "fwd rec/chunk", "f+b rec/chunk", "f+b / ungated"):
        assert word in table
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = bench.main(["--decay", "--device", "cpu", "--seq-lens", "9", "--heads", "1", "--head-dim", "4",
                           "--repeats", "1", "--warmup", "0", "--no-backward", "--no-progress"])
    assert code == 0 and "chunk vs recurrent" in buf.getvalue() and "delta" in buf.getvalue()
    with pytest.raises(ValueError, match="unknown variant 'mamba'"):
        bench.run_decay_benchmark([8], variants=["mamba"])
