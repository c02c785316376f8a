"""Tests of linattn.mixers: the short convolution, LinearMixer (every rule) and its MixerState.

The float64 references below are written from the docstrings' equations (explicit loops over
tokens and heads); they use the layer's parameters but none of linattn's functions.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.layers import RULES, LinearMixer, ShortConvolution, retnet_log_gammas
from linattn.state import MixerState

KV_HEADS = [None, 2]     # plain multi-head and grouped-query (2 groups of 2 query heads)


def _mixer(rule, *, n_kv_heads=None, seed=0, **options):
    torch.manual_seed(seed)
    return LinearMixer(32, 4, rule=rule, n_kv_heads=n_kv_heads, chunk_size=4, **options).double()


def _x(B=2, T=11, seed=1):
    return torch.randn(B, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------


def ref_short_conv(weight, u, prefix=None):
    """y_t = Σ_j w_j u_{t-K+1+j}, u of earlier calls in ``prefix`` (B, C, K-1), zeros before that."""
    C, _, K = weight.shape
    B, T, _ = u.shape
    past = torch.zeros(B, K - 1, C, dtype=u.dtype) if prefix is None else prefix.transpose(1, 2)
    full = torch.cat([past, u], dim=1)                                  # (B, K - 1 + T, C)
    y = torch.zeros_like(u)
    for t in range(T):
        for j in range(K):
            y[:, t] += weight[:, 0, j] * full[:, t + j]
    return y


def ref_mixer(m: LinearMixer, x: torch.Tensor) -> torch.Tensor:
    """The layer's equations, token by token, in float64 (no padding, no state)."""
    B, T, _ = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    G = H // Hkv
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    if m.conv is not None:
        u = F.silu(ref_short_conv(m.conv.weight, torch.cat([q, k, v], dim=-1)))
        q, k, v = u.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    if m.qk_norm:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    q = q / math.sqrt(D)
    ones = torch.ones(B, T, Hkv, D, dtype=x.dtype)
    if m.rule == "retention":
        gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(Hkv)], dtype=x.dtype)
        alpha = ones * gamma[:, None]
    elif m.rule == "gla":
        low = x @ m.a_proj[0].weight.T @ m.a_proj[1].weight.T + m.a_proj[1].bias
        alpha = torch.sigmoid(low).pow(1 / 16).view(B, T, Hkv, D)
    elif m.rule == "gated_delta":
        dt = F.softplus(x @ m.a_proj.weight.T + m.dt_bias)               # (B, T, H_kv)
        alpha = ones * torch.exp(-m.A_log.exp() * dt)[..., None]
    elif m.rule == "kda":
        dt = F.softplus(x @ m.a_proj[0].weight.T @ m.a_proj[1].weight.T + m.dt_bias).view(B, T, Hkv, D)
        alpha = torch.exp(-m.A_log.exp()[:, None] * dt)
    else:
        alpha = ones
    beta = None
    if m.rule in ("delta", "gated_delta", "kda"):
        beta = torch.sigmoid(x @ m.b_proj.weight.T) * (2 if m.negative_eigenvalues else 1)   # (B, T, H_kv)
    o = torch.zeros(B, T, H, D, dtype=x.dtype)
    for b in range(B):
        for g in range(Hkv):
            S = torch.zeros(D, D, dtype=x.dtype)
            for t in range(T):
                S = alpha[b, t, g][:, None] * S                          # diag(α_t) S
                kt, vt = k[b, t, g], v[b, t, g]
                if beta is None:
                    S = S + torch.outer(kt, vt)
                else:
                    S = S + beta[b, t, g] * torch.outer(kt, vt - S.T @ kt)
                for h in range(g * G, (g + 1) * G):
                    o[b, t, h] = S.T @ q[b, t, h]
    if m.o_norm is not None:
        o = o / torch.sqrt(o.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * m.o_norm
    if m.g_proj is not None:
        o = o * F.silu(x @ m.g_proj.weight.T).view(B, T, H, D)
    return o.reshape(B, T, H * D) @ m.out_proj.weight.T


# ---------------------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------------------


def test_short_convolution_equals_the_sliding_window_and_continues_from_its_state():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    u = torch.randn(2, 9, 6, dtype=torch.float64)
    with torch.no_grad():
        y, state = conv(u)
        torch.testing.assert_close(y, ref_short_conv(conv.weight, u), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state, u[:, -3:].transpose(1, 2), rtol=0, atol=0)     # the last K - 1 inputs
        y1, s1 = conv(u[:, :2])                                           # shorter than K - 1: zeros kept
        torch.testing.assert_close(s1, torch.cat([torch.zeros(2, 6, 1, dtype=torch.float64),
                                                  u[:, :2].transpose(1, 2)], dim=2), rtol=0, atol=0)
        y2, s2 = conv(u[:, 2:], state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, state, rtol=0, atol=0)


def test_short_convolution_skips_padding_wherever_it_is():
    """Each real token sees the real tokens before it: padding in front, behind or between is removed."""
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    u = torch.randn(1, 7, 5, dtype=torch.float64)
    mask = torch.tensor([[False, True, True, False, False, True, True]])
    with torch.no_grad():
        y, state = conv(u, attention_mask=mask)
        want, want_state = conv(u[:, mask[0]])
    torch.testing.assert_close(y[mask], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


def test_short_convolution_refuses_a_kernel_that_mixes_nothing():
    with pytest.raises(ValueError, match="kernel_size must be >= 2"):
        ShortConvolution(4, 1)
    with pytest.raises(TypeError, match="channels"):
        ShortConvolution(4.0)


def test_retnet_decays_and_mamba2_initialisation():
    torch.testing.assert_close(retnet_log_gammas(4, dtype=torch.float64),
                               torch.log(1 - 2.0 ** -(5 + torch.arange(4, dtype=torch.float64))))
    torch.manual_seed(0)
    m = LinearMixer(64, 8, rule="gated_delta")
    A, dt = m.A_log.exp(), F.softplus(m.dt_bias)
    assert ((A >= 1) & (A <= 16)).all()                                   # A ~ U(1, 16)
    assert ((dt >= 1e-3 - 1e-9) & (dt <= 0.1 + 1e-7)).all()               # softplus(dt_bias) = dt in [1e-3, 0.1]
    kda = LinearMixer(64, 8, rule="kda", n_kv_heads=2)
    assert kda.A_log.shape == (2,) and kda.dt_bias.shape == (2 * 8,)     # one A per head, dt_bias per channel


# ---------------------------------------------------------------------------------------
# The layer against its equations
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("rule", RULES)
def test_mixer_equals_its_equations(rule, n_kv_heads):
    m = _mixer(rule, n_kv_heads=n_kv_heads)
    x = _x(T=9)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref_mixer(m, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("switch", ["short_conv", "qk_norm", "output_norm", "output_gate", "negative_eigenvalues"])
@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_each_piece_is_switchable(rule, switch):
    """Turning one piece off (or β in (0, 2) on) gives the equations without it, and changes the output."""
    flip = {switch: switch == "negative_eigenvalues"}
    m, default = _mixer(rule, **flip), _mixer(rule)
    x = _x(T=9)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref_mixer(m, x), rtol=1e-10, atol=1e-12)
        assert not torch.allclose(m(x), default(x), atol=1e-6)


# ---------------------------------------------------------------------------------------
# Decoding and padding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", [1, 5])
@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("short_conv", [True, False])
@pytest.mark.parametrize("rule", RULES)
def test_decoding_one_token_at_a_time_equals_the_forward_pass(rule, short_conv, n_kv_heads, first):
    m = _mixer(rule, short_conv=short_conv, n_kv_heads=n_kv_heads)
    x = _x()
    with torch.no_grad():
        full, full_state = m(x, return_state=True)
        y, state = m(x[:, :first], return_state=True)
        outs = [y]
        for t in range(first, x.shape[1]):
            y, state = m(x[:, t:t + 1], state=state, return_state=True)
            outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, full_state.S, rtol=1e-10, atol=1e-12)
    assert (state.conv is None) == (not short_conv)
    if short_conv:
        torch.testing.assert_close(state.conv, full_state.conv, rtol=1e-12, atol=1e-12)
    assert state.S.shape == (2, n_kv_heads or 4, 8, 8)                   # one state per key-value head
    assert state.nbytes == full_state.nbytes == m.decoding_state_nbytes(batch=2)


def _pad(x, layout):
    """x (B, T, d) with padding inserted: returns (padded x with random pads, mask)."""
    B, T, d = x.shape
    rows, masks = [], []
    for b in range(B):
        lead, gap, tail = layout[b]
        real = x[b]
        parts = [torch.randn(lead, d, dtype=x.dtype), real[:3], torch.randn(gap, d, dtype=x.dtype), real[3:],
                 torch.randn(tail, d, dtype=x.dtype)]
        rows.append(torch.cat(parts))
        masks.append(torch.tensor([False] * lead + [True] * 3 + [False] * gap + [True] * (T - 3) + [False] * tail))
    return torch.stack(rows), torch.stack(masks)


@pytest.mark.parametrize("short_conv", [True, False])
@pytest.mark.parametrize("rule", RULES)
def test_padding_is_removed_left_right_and_between(rule, short_conv):
    """Real tokens' outputs and the returned state equal those of the unpadded batch (retention included:
    a fixed γ must not decay the state at a padded token)."""
    m = _mixer(rule, short_conv=short_conv)
    x = _x(T=8)
    torch.manual_seed(3)
    padded, mask = _pad(x, [(4, 0, 0), (0, 0, 4)])                        # left padding, right padding
    between, mask_between = _pad(x, [(1, 2, 1), (0, 4, 0)])               # padding inside as well
    with torch.no_grad():
        want, want_state = m(x, return_state=True)
        for xp, mp in ((padded, mask), (between, mask_between)):
            got, state = m(xp, attention_mask=mp, return_state=True)
            torch.testing.assert_close(got[mp].view(2, 8, 32), want, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(state.S, want_state.S, rtol=1e-10, atol=1e-12)
            if short_conv:
                torch.testing.assert_close(state.conv, want_state.conv, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", ["retention", "gated_delta"])
def test_a_right_padded_prompt_continues_as_the_prompt_alone(rule):
    m = _mixer(rule)
    x = _x(B=1, T=9)
    with torch.no_grad():
        want = m(x)
        padded = torch.cat([x[:, :6], torch.randn(1, 3, 32, dtype=torch.float64)], dim=1)
        mask = torch.tensor([[True] * 6 + [False] * 3])
        _, state = m(padded, attention_mask=mask, return_state=True)
        got = m(x[:, 6:], state=state)
    torch.testing.assert_close(got, want[:, 6:], rtol=1e-10, atol=1e-12)


def test_padded_tokens_with_nan_do_not_reach_real_tokens():
    m = _mixer("gated_delta")
    x = _x(T=8)
    padded = torch.cat([torch.full((2, 3, 32), float("nan"), dtype=torch.float64), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 8] * 2)
    with torch.no_grad():
        got, state = m(padded, attention_mask=mask, return_state=True)
        want = m(x)
    torch.testing.assert_close(got[:, 3:], want, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(state.S).all() and torch.isfinite(state.conv).all()


# ---------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------


def test_mixer_state_is_compared_by_value_and_owns_its_memory():
    m = _mixer("kda", n_kv_heads=2)
    x = _x()
    mask = torch.ones(2, 11, dtype=torch.bool)
    with torch.no_grad():
        _, a = m(x, return_state=True)
        _, b = m(x.clone(), attention_mask=mask, return_state=True)
        _, c = m(x[:, :1], state=a, return_state=True)
    assert (a == MixerState(a.S.clone(), a.conv.clone())) is True
    assert (a == MixerState(a.S.clone(), None)) is False
    assert (a == c) is False and (a == "state") is False
    assert a.nbytes == a.S.numel() * 8 + a.conv.numel() * 8
    inputs = [x, mask] + list(m.parameters())
    for s, given in ((a, []), (b, []), (c, [a.S, a.conv])):
        for t in (s.S, s.conv):
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert all(t.untyped_storage().data_ptr() != i.untyped_storage().data_ptr() for i in inputs + given)
    assert MixerState(a.S).conv is None


def test_mixer_state_checks_its_tensors():
    S = torch.zeros(2, 2, 8, 8)
    with pytest.raises(TypeError, match=r"state.S must be a torch.Tensor"):
        MixerState(None)
    with pytest.raises(ValueError, match=r"state.S must be 4-D"):
        MixerState(torch.zeros(2, 8, 8))
    with pytest.raises(ValueError, match=r"state.conv must be 3-D"):
        MixerState(S, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"state.conv and state.S must share dtype"):
        MixerState(S, torch.zeros(2, 48, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"one batch size"):
        MixerState(S, torch.zeros(3, 48, 3))


def test_layer_checks_the_state_at_every_use():
    m = LinearMixer(32, 4, n_kv_heads=2)
    x = torch.randn(2, 5, 32)
    _, state = m(x, return_state=True)
    assert state.S.shape == (2, 2, 8, 8) and state.conv.shape == (2, 64, 3)
    with pytest.raises(TypeError, match="state must be a MixerState"):
        m(x, state=linattn.LinearAttentionState(torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8)))
    with pytest.raises(ValueError, match=r"state.S must have shape .* = \(2, 2, 8, 8\), got \(2, 4, 8, 8\)"):
        m(x, state=MixerState(torch.zeros(2, 4, 8, 8), state.conv))
    with pytest.raises(ValueError, match=r"state.conv is None"):
        m(x, state=MixerState(state.S))
    with pytest.raises(ValueError, match=r"state.conv must have shape .* = \(2, 64, 3\)"):
        m(x, state=MixerState(state.S, torch.zeros(2, 64, 2)))
    with pytest.raises(ValueError, match="state.conv must be None"):
        LinearMixer(32, 4, n_kv_heads=2, short_conv=False)(x, state=state)
    with pytest.raises(TypeError, match="state.S is torch.float64"):
        m(x, state=MixerState(state.S.double(), state.conv.double()))
    state.conv = "gone"                                                   # mutated after it was built
    with pytest.raises(TypeError, match="state.conv must be a torch.Tensor"):
        m(x, state=state)


# ---------------------------------------------------------------------------------------
# Bad arguments, dtypes
# ---------------------------------------------------------------------------------------


def test_bad_mixer_arguments():
    with pytest.raises(ValueError, match=r"rule must be one of .*'gated_delta'.*got 'linear'"):
        LinearMixer(32, 4, rule="linear")
    with pytest.raises(TypeError, match="rule must be a str"):
        LinearMixer(32, 4, rule=None)
    with pytest.raises(ValueError, match=r"negative_eigenvalues=True .* rule='gla' has no β"):
        LinearMixer(32, 4, rule="gla", negative_eigenvalues=True)
    with pytest.raises(ValueError, match="conv_size must be >= 2"):
        LinearMixer(32, 4, conv_size=1)
    with pytest.raises(ValueError, match=r"d_model must be divisible by n_heads"):
        LinearMixer(30, 4)
    with pytest.raises(ValueError, match=r"n_heads must be divisible by n_kv_heads"):
        LinearMixer(32, 4, n_kv_heads=3)
    with pytest.raises(TypeError, match="short_conv must be a bool"):
        LinearMixer(32, 4, short_conv=1)
    m = LinearMixer(32, 4)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, d_model=32\)"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        m(torch.randn(2, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, seq\) = \(2, 5\)"):
        m(torch.randn(2, 5, 32), attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask.*not key_padding_mask"):
        m(torch.randn(2, 5, 32), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_a_nan_that_reaches_the_gates_is_refused():
    m = LinearMixer(32, 4)
    x = torch.randn(1, 5, 32)
    x[0, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="must be"):
        m(x)


@pytest.mark.parametrize("rule", RULES)
def test_autocast_bfloat16_forward_and_backward(rule):
    torch.manual_seed(0)
    m = LinearMixer(32, 4, rule=rule, n_kv_heads=2, chunk_size=4)
    x = torch.randn(2, 9, 32, requires_grad=True)
    with torch.no_grad():
        want = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = m(x, return_state=True)
    assert y.dtype == torch.bfloat16 and state.S.dtype == torch.float32 and state.conv.dtype == torch.float32
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.02)
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_half_precision_layer_keeps_a_float32_state():
    torch.manual_seed(0)
    m = LinearMixer(32, 4, chunk_size=4)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        want = m(x)
        half = m.to(torch.bfloat16)
        y, state = half(x.bfloat16(), return_state=True)
        y2 = half(x[:, :1].bfloat16(), state=state)
    assert y.dtype == torch.bfloat16 and state.S.dtype == torch.float32 and y2.shape == (2, 1, 32)
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.02)
