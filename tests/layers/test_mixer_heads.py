"""LinearMixer's head layouts and gates of today's models: grouped value heads (``n_v_heads``), key and
value head sizes of their own (``head_dim``, ``v_head_dim``) apart from ``d_model``, FLA's L2 norm,
the sigmoid and low-rank output gates, the norm's ε, and the short convolution's decoding path.

The float64 reference below is written from the docstring's equations: explicit loops over tokens and
value heads, value head ``j`` reading query/key head ``j // (H_v / H)``; it uses the layer's parameters
but none of linattn's functions.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import RULES, LinearMixer, ShortConvolution
from linattn.state import MixerState

GROUPED = dict(d_model=20, n_heads=2, n_v_heads=4, head_dim=6, v_head_dim=5)   # d_model != heads x sizes


def _mixer(rule, seed=0, **options):
    torch.manual_seed(seed)
    sizes = dict(GROUPED, **{k: options.pop(k) for k in list(options) if k in GROUPED})
    return LinearMixer(sizes.pop("d_model"), sizes.pop("n_heads"), rule=rule, chunk_size=4, **sizes,
                       **options).double()


def _x(B=2, T=11, d=20, seed=1):
    return torch.randn(B, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _conv(weight, u):
    """y_t = Σ_j w_j u_{t-K+1+j}, zeros before the first token."""
    C, _, K = weight.shape
    full = torch.cat([torch.zeros(u.shape[0], K - 1, C, dtype=u.dtype), u], dim=1)
    return sum(weight[:, 0, j] * full[:, j:j + u.shape[1]] for j in range(K))


def _linear(module, x):
    """x Wᵀ (+ b) of an nn.Linear, or of a stack of them (a low-rank projection)."""
    layers = module if isinstance(module, torch.nn.Sequential) else [module]
    for lin in layers:
        x = x @ lin.weight.T + (0 if lin.bias is None else lin.bias)
    return x


def ref_mixer(m: LinearMixer, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    H, Hv, Dk, Dv = m.n_heads, m.n_v_heads, m.head_dim, m.v_head_dim
    r = Hv // H
    q, k, v = _linear(m.q_proj, x), _linear(m.k_proj, x), _linear(m.v_proj, x)
    if m.conv is not None:
        q, k, v = F.silu(_conv(m.conv.weight, torch.cat([q, k, v], dim=-1))).split([H * Dk, H * Dk, Hv * Dv], dim=-1)
    q, k, v = q.view(B, T, H, Dk), k.view(B, T, H, Dk), v.view(B, T, Hv, Dv)
    if m.qk_norm == "fla":
        q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    elif m.qk_norm:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    q = q / math.sqrt(Dk)
    ones = torch.ones(B, T, Hv, Dk, dtype=x.dtype)
    if m.rule == "retention":
        alpha = ones * torch.tensor([1 - 2.0 ** (-5 - j) for j in range(Hv)], dtype=x.dtype)[:, None]
    elif m.rule == "gla":
        alpha = torch.sigmoid(_linear(m.a_proj, x)).pow(1 / 16).view(B, T, Hv, Dk)
    elif m.rule == "gated_delta":
        alpha = ones * torch.exp(-m.A_log.exp() * F.softplus(_linear(m.a_proj, x) + m.dt_bias))[..., None]
    elif m.rule == "kda":
        dt = F.softplus(_linear(m.a_proj, x) + m.dt_bias).view(B, T, Hv, Dk)
        alpha = torch.exp(-m.A_log.exp()[:, None] * dt)
    else:
        alpha = ones
    beta = torch.sigmoid(_linear(m.b_proj, x)) if m.b_proj is not None else None          # (B, T, H_v)
    o = torch.zeros(B, T, Hv, Dv, dtype=x.dtype)
    for b in range(B):
        for j in range(Hv):
            h = j // r                                                    # the query/key head value head j reads
            S = torch.zeros(Dk, Dv, dtype=x.dtype)
            for t in range(T):
                S = alpha[b, t, j][:, None] * S
                kt, vt = k[b, t, h], v[b, t, j]
                S = S + (torch.outer(kt, vt) if beta is None else beta[b, t, j] * torch.outer(kt, vt - S.T @ kt))
                o[b, t, j] = S.T @ q[b, t, h]
    if m.o_norm is not None:
        o = o / torch.sqrt(o.pow(2).mean(dim=-1, keepdim=True) + m.norm_eps) * m.o_norm
    if m.g_proj is not None:
        gate = _linear(m.g_proj, x).view(B, T, Hv, Dv)
        o = o * (torch.sigmoid(gate) if m.gate_activation == "sigmoid" else F.silu(gate))
    return _linear(m.out_proj, o.reshape(B, T, Hv * Dv))


@pytest.mark.parametrize("rule", RULES)
def test_grouped_value_heads_equal_their_equations(rule):
    m = _mixer(rule)
    assert m.q_proj.out_features == 2 * 6 and m.v_proj.out_features == 4 * 5 and m.out_proj.in_features == 4 * 5
    x = _x(T=9)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref_mixer(m, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [dict(qk_norm="fla"), dict(output_gate="sigmoid"),
                                     dict(output_gate="sigmoid", gate_rank=3), dict(gate_rank=2),
                                     dict(norm_eps=0.5), dict(n_v_heads=2, v_head_dim=7),
                                     dict(short_conv=False, output_gate=False, output_norm=False)])
@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_each_option_gives_its_equations_and_changes_the_output(rule, options):
    m, default = _mixer(rule, **options), _mixer(rule)
    x = _x(T=9)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref_mixer(m, x), rtol=1e-10, atol=1e-12)
        if m.v_proj.out_features == default.v_proj.out_features:
            assert not torch.allclose(m(x), default(x), atol=1e-8)


def test_fla_l2_norm_differs_from_f_normalize_only_near_zero():
    """x / sqrt(‖x‖² + 1e-6): equal to x / ‖x‖ up to ~1e-6 / ‖x‖² (the two agree on unit-size heads)."""
    m = _mixer("gated_delta", qk_norm="fla")
    t = torch.tensor([[3.0, 4.0], [3e-4, 4e-4]], dtype=torch.float64)
    torch.testing.assert_close(m._l2_normalize(t), t / torch.sqrt(torch.tensor([[25.0], [25e-8 + 1e-6]],
                                                                             dtype=torch.float64)))


@pytest.mark.parametrize("first", [1, 6])
@pytest.mark.parametrize("rule", RULES)
def test_grouped_value_heads_decode_one_token_at_a_time_as_the_forward_pass(rule, first):
    m = _mixer(rule, qk_norm="fla", output_gate="sigmoid", gate_rank=3)
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
    assert state.S.shape == (2, 4, 6, 5)                                 # one (Dk, Dv) state per value head
    assert state.conv.shape == (2, 2 * 6 + 2 * 6 + 4 * 5, 3)
    assert state.nbytes == m.decoding_state_nbytes(batch=2) == 8 * 2 * (4 * 6 * 5 + 44 * 3)


@pytest.mark.parametrize("rule", RULES)
def test_grouped_value_heads_skip_padding(rule):
    m = _mixer(rule)
    x = _x(T=7)
    pad = torch.randn(2, 3, 20, dtype=torch.float64)
    padded = torch.cat([pad[:1].expand(2, 3, 20), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 7] * 2)
    with torch.no_grad():
        got, state = m(padded, attention_mask=mask, return_state=True)
        want, want_state = m(x, return_state=True)
    torch.testing.assert_close(got[:, 3:], want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, want_state.S, rtol=1e-10, atol=1e-12)


def test_grouped_value_heads_state_is_checked():
    m = _mixer("gated_delta")
    x = _x(T=3)
    _, state = m(x, return_state=True)
    with pytest.raises(ValueError, match=r"state.S must have shape \(batch, n_v_heads, head_dim, v_head_dim\) = "
                                         r"\(2, 4, 6, 5\), got \(2, 2, 6, 5\)"):
        m(x, state=MixerState(state.S[:, :2].contiguous(), state.conv))


def test_bad_head_and_gate_arguments():
    with pytest.raises(ValueError, match=r"n_v_heads must be a multiple of n_heads .* n_heads=2 and n_v_heads=3"):
        LinearMixer(20, 2, n_v_heads=3, head_dim=4)
    with pytest.raises(ValueError, match="n_v_heads .* and n_kv_heads .* cannot both be set"):
        LinearMixer(32, 4, n_kv_heads=2, n_v_heads=8)
    with pytest.raises(ValueError, match="d_model must be divisible by n_heads"):
        LinearMixer(20, 3)                                                # no head_dim: d_model must divide
    LinearMixer(20, 3, head_dim=4)                                        # ... unless head_dim is given
    with pytest.raises(TypeError, match="v_head_dim must be an int"):
        LinearMixer(20, 2, head_dim=4, v_head_dim=4.0)
    with pytest.raises(ValueError, match=r"qk_norm must be True, False or one of \['fla'\], got 'l2'"):
        LinearMixer(32, 4, qk_norm="l2")
    with pytest.raises(TypeError, match="output_gate must be a bool or one of"):
        LinearMixer(32, 4, output_gate=1)
    with pytest.raises(ValueError, match=r"gate_rank=4 sizes the output gate, but output_gate=False"):
        LinearMixer(32, 4, output_gate=False, gate_rank=4)
    with pytest.raises(ValueError, match="norm_eps must be a positive finite number"):
        LinearMixer(32, 4, norm_eps=0.0)


def test_old_options_keep_their_meaning():
    """True is F.normalize and SiLU, full rank: what every earlier LinearMixer computed."""
    m = LinearMixer(32, 4, n_kv_heads=2)
    assert (m.qk_norm, m.gate_activation, m.n_v_heads, m.v_head_dim, m.norm_eps) == (True, "silu", 2, 8, 1e-5)
    assert isinstance(m.g_proj, torch.nn.Linear) and m.g_proj.out_features == 32


# ---------------------------------------------------------------------------------------
# The short convolution at decoding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 3, 16, 17, 300])
def test_short_convolution_equals_conv1d_for_every_length(dtype, T):
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).to(dtype)
    u = torch.randn(2, T, 6, dtype=dtype)
    state = torch.randn(2, 6, 3, dtype=dtype)
    with torch.no_grad():
        y, _ = conv(u, state=state)
        want = F.conv1d(torch.cat([state, u.transpose(1, 2)], dim=2), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(y, want, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decoding_step_multiplies_and_sums_instead_of_calling_conv1d(dtype, monkeypatch):
    """F.conv1d's depthwise float64 CPU path has a large fixed cost: one token is K multiply-adds."""
    m = LinearMixer(32, 4).to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    with torch.no_grad():
        _, state = m(x, return_state=True)

        def refuse(*args, **kwargs):
            raise AssertionError("F.conv1d called for a decoding step")

        monkeypatch.setattr(F, "conv1d", refuse)
        y = m(x[:, :1], state=state)
    assert y.shape == (2, 1, 32)


@pytest.mark.parametrize("rule", RULES)
def test_grouped_value_heads_reach_the_ops_without_repeated_queries_and_keys(rule, monkeypatch):
    """q and k keep their H heads on the way to linattn.ops (value head j reads head j // r there): the
    layer never materialises r copies of them."""
    import linattn.layers.mixer as mixer_module

    seen = []
    for name in ("retention", "gated_linear_attention", "delta_rule", "gated_delta_rule"):
        def spy(q, k, v, *args, _op=mixer_module._OPS[name], **kwargs):
            seen.append((q.shape[1], k.shape[1], v.shape[1]))
            return _op(q, k, v, *args, **kwargs)

        monkeypatch.setitem(mixer_module._OPS, name, spy)
    m = _mixer(rule)
    x = _x(T=5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 0] = False
    with torch.no_grad():
        m(x), m(x, attention_mask=mask), m(x[:, :1])
    assert seen == [(2, 2, 4)] * 3
