"""Packed batches (``cu_seqlens``, flash-linear-attention's meaning) in the layers: ShortConvolution,
LinearMixer (every rule, grouped queries, grouped values), LinearAttention and SoftmaxAttention.

The reference is one call per sequence: a packed call must give each sequence's outputs, its final
state (LinearMixer: ``S`` and the convolution's inputs, one per sequence, an empty sequence keeping its
initial state) and every gradient (inputs, initial states, parameters) as if it had run alone, in
float64, with empty sequences and lengths off the chunk grid (chunk_size 4).
"""
from __future__ import annotations

import pytest
import torch

from linattn.layers import RULES, LinearAttention, LinearMixer, ShortConvolution, SoftmaxAttention
from linattn.layers.positions import packed_positions
from linattn.state import MixerState

LENGTHS = [5, 0, 13, 1, 8, 0]          # empty sequences, one token, lengths off the chunk grid (4)
TOL = dict(rtol=1e-10, atol=1e-12)     # float64: the packed call and the per-sequence calls round alike


def _offsets(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype)


def _spans(lengths):
    cu = _offsets(lengths).tolist()
    return list(zip(cu[:-1], cu[1:]))


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=False)


def test_packed_positions_restart_at_every_sequence():
    cu = _offsets([3, 0, 2, 1], torch.int64)
    assert packed_positions(cu, 6).tolist() == [[0, 1, 2, 0, 1, 0]]


# ---------------------------------------------------------------------------------------
# ShortConvolution
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T_long", [5, 300])               # the shifted sum and F.conv1d's path
def test_short_convolution_restarts_at_each_sequence(with_state, T_long):
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    lengths = [3, 0, T_long, 1, 2]
    T, N = sum(lengths), len(lengths)
    u = torch.randn(1, T, 6, dtype=torch.float64, requires_grad=True)
    s0 = torch.randn(N, 6, 3, dtype=torch.float64, requires_grad=True) if with_state else None
    y, s = conv(u, None, s0, _offsets(lengths))
    assert y.shape == (1, T, 6) and s.shape == (N, 6, 3)
    w_out, w_state = torch.randn_like(y), torch.randn_like(s)
    loss = (y * w_out).sum() + (s * w_state).sum()
    inputs = [u, conv.weight] + ([s0] if with_state else [])
    got = _grads(loss, inputs)
    ref_loss = 0
    for i, (a, b) in enumerate(_spans(lengths)):
        prefix = None if s0 is None else s0[i:i + 1]
        if b == a:                                                  # an empty sequence keeps its state
            want_s = torch.zeros(1, 6, 3, dtype=torch.float64) if prefix is None else prefix
            torch.testing.assert_close(s[i:i + 1], want_s, **TOL)
            ref_loss = ref_loss + (want_s * w_state[i:i + 1]).sum()
            continue
        yi, si = conv(u[:, a:b], None, prefix)
        torch.testing.assert_close(y[:, a:b], yi, **TOL)
        torch.testing.assert_close(s[i:i + 1], si, **TOL)
        ref_loss = ref_loss + (yi * w_out[:, a:b]).sum() + (si * w_state[i:i + 1]).sum()
    for g, w in zip(got, _grads(ref_loss, inputs)):
        torch.testing.assert_close(g, w, **TOL)


# ---------------------------------------------------------------------------------------
# LinearMixer
# ---------------------------------------------------------------------------------------

HEADS = {"plain": {}, "grouped_queries": {"n_kv_heads": 2}, "grouped_values": {"n_v_heads": 8}}


def _mixer(rule, heads, seed=0):
    torch.manual_seed(seed)
    return LinearMixer(32, 4, rule=rule, chunk_size=4, **HEADS[heads]).double()


def _states(mixer, N, seed):
    g = torch.Generator().manual_seed(seed)
    Hs = mixer.n_v_heads
    S = 0.3 * torch.randn(N, Hs, mixer.head_dim, mixer.v_head_dim, dtype=torch.float64, generator=g)
    conv = torch.randn(N, mixer.conv.channels, mixer.conv_size - 1, dtype=torch.float64, generator=g)
    return S.requires_grad_(), conv.requires_grad_()


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("rule", RULES)
def test_mixer_packed_equals_one_call_per_sequence(rule, heads, with_state):
    """Outputs, final states (S and conv) and the gradients of x, the initial states and every parameter."""
    mixer = _mixer(rule, heads)
    T, N = sum(LENGTHS), len(LENGTHS)
    x = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    S0, c0 = _states(mixer, N, 2) if with_state else (None, None)
    state = MixerState(S0, c0) if with_state else None
    y, out = mixer(x, state=state, return_state=True, cu_seqlens=_offsets(LENGTHS))
    assert y.shape == (1, T, 32) and out.S.shape[0] == N and out.conv.shape[0] == N
    g = torch.Generator().manual_seed(3)
    w_y = torch.randn(y.shape, dtype=torch.float64, generator=g)
    w_S = torch.randn(out.S.shape, dtype=torch.float64, generator=g)
    w_c = torch.randn(out.conv.shape, dtype=torch.float64, generator=g)
    inputs = [x] + list(mixer.parameters()) + ([S0, c0] if with_state else [])
    got = _grads((y * w_y).sum() + (out.S * w_S).sum() + (out.conv * w_c).sum(), inputs)
    ref_loss = 0
    for i, (a, b) in enumerate(_spans(LENGTHS)):
        if b == a:                                              # an empty sequence returns its initial state
            S_i = S0[i:i + 1] if with_state else torch.zeros_like(out.S[i:i + 1])
            c_i = c0[i:i + 1] if with_state else torch.zeros_like(out.conv[i:i + 1])
            torch.testing.assert_close(out.S[i:i + 1], S_i, **TOL)
            torch.testing.assert_close(out.conv[i:i + 1], c_i, **TOL)
            ref_loss = ref_loss + (S_i * w_S[i:i + 1]).sum() + (c_i * w_c[i:i + 1]).sum()
            continue
        st = MixerState(S0[i:i + 1], c0[i:i + 1]) if with_state else None
        y_i, out_i = mixer(x[:, a:b], state=st, return_state=True)
        torch.testing.assert_close(y[:, a:b], y_i, **TOL)
        torch.testing.assert_close(out.S[i:i + 1], out_i.S, **TOL)
        torch.testing.assert_close(out.conv[i:i + 1], out_i.conv, **TOL)
        ref_loss = (ref_loss + (y_i * w_y[:, a:b]).sum() + (out_i.S * w_S[i:i + 1]).sum()
                    + (out_i.conv * w_c[i:i + 1]).sum())
    for got_g, want_g in zip(got, _grads(ref_loss, inputs)):
        torch.testing.assert_close(got_g, want_g, **TOL)


def test_mixer_packed_without_short_convolution_and_in_float32():
    torch.manual_seed(0)
    mixer = LinearMixer(32, 4, rule="gated_delta", n_v_heads=8, head_dim=16, v_head_dim=8, chunk_size=4,
                        short_conv=False)
    x = torch.randn(1, sum(LENGTHS), 32)
    y, out = mixer(x, return_state=True, cu_seqlens=_offsets(LENGTHS, torch.int64))
    assert out.conv is None and out.S.shape == (len(LENGTHS), 8, 16, 8)
    for i, (a, b) in enumerate(_spans(LENGTHS)):
        if b > a:
            y_i, out_i = mixer(x[:, a:b], return_state=True)
            torch.testing.assert_close(y[:, a:b], y_i, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out.S[i:i + 1], out_i.S, rtol=1e-5, atol=1e-6)


def test_mixer_packed_state_continues_each_sequence():
    """A packed prompt's states, then one packed token per sequence: as each sequence decoded alone."""
    mixer = _mixer("kda", "plain")
    lengths = [6, 3, 9]
    x = torch.randn(1, sum(lengths), 32, dtype=torch.float64)
    nxt = torch.randn(1, 3, 32, dtype=torch.float64)
    _, state = mixer(x, return_state=True, cu_seqlens=_offsets(lengths))
    y, _ = mixer(nxt, state=state, return_state=True, cu_seqlens=_offsets([1, 1, 1]))
    for i, (a, b) in enumerate(_spans(lengths)):
        _, s_i = mixer(x[:, a:b], return_state=True)
        torch.testing.assert_close(y[:, i:i + 1], mixer(nxt[:, i:i + 1], state=s_i), **TOL)


def test_mixer_refuses_bad_packings():
    mixer = _mixer("gated_delta", "plain")
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    cu = _offsets([4, 6])
    with pytest.raises(ValueError, match="B = 2"):
        mixer(torch.randn(2, 10, 32, dtype=torch.float64), cu_seqlens=cu)
    with pytest.raises(ValueError, match="attention_mask"):
        mixer(x, cu_seqlens=cu, attention_mask=torch.ones(1, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq = 10"):
        mixer(x, cu_seqlens=_offsets([4, 5]))
    with pytest.raises(TypeError, match="int32 or int64"):
        mixer(x, cu_seqlens=cu.float())
    _, state = mixer(x, return_state=True)                       # one state: the packing has two sequences
    with pytest.raises(ValueError, match="state.S must have shape"):
        mixer(x, state=state, cu_seqlens=cu)


# ---------------------------------------------------------------------------------------
# LinearAttention and SoftmaxAttention
# ---------------------------------------------------------------------------------------

ATTENTION_LAYERS = {
    "linear": lambda: LinearAttention(32, 4, causal=True, chunk_size=4),
    "linear_rope": lambda: LinearAttention(32, 4, causal=True, chunk_size=4, rope=True),
    "linear_gqa": lambda: LinearAttention(32, 4, n_kv_heads=2, causal=True, chunk_size=4),
    "softmax": lambda: SoftmaxAttention(32, 4, causal=True),
    "softmax_rope": lambda: SoftmaxAttention(32, 4, n_kv_heads=2, causal=True, rope=True),
}


@pytest.mark.parametrize("kind", list(ATTENTION_LAYERS))
def test_attention_layers_packed_equal_one_call_per_sequence(kind):
    torch.manual_seed(0)
    layer = ATTENTION_LAYERS[kind]().double()
    T = sum(LENGTHS)
    x = torch.randn(1, T, 32, dtype=torch.float64, requires_grad=True)
    y = layer(x, cu_seqlens=_offsets(LENGTHS))
    w = torch.randn_like(y)
    inputs = [x] + list(layer.parameters())
    got = _grads((y * w).sum(), inputs)
    ref_loss = 0
    for a, b in _spans(LENGTHS):
        if b > a:
            y_i = layer(x[:, a:b])                                  # positions from 0 (RoPE)
            torch.testing.assert_close(y[:, a:b], y_i, **TOL)
            ref_loss = ref_loss + (y_i * w[:, a:b]).sum()
    for got_g, want_g in zip(got, _grads(ref_loss, inputs)):
        torch.testing.assert_close(got_g, want_g, **TOL)


@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_attention_layers_refuse_packings_they_cannot_run(cls):
    x = torch.randn(1, 10, 32)
    cu = _offsets([4, 6])
    with pytest.raises(ValueError, match="causal"):
        cls(32, 4, causal=False)(x, cu_seqlens=cu)
    layer = cls(32, 4, causal=True)
    with pytest.raises(ValueError, match="training only"):
        layer(x, cu_seqlens=cu, return_state=True)
    with pytest.raises(ValueError, match="B = 2"):
        layer(torch.randn(2, 10, 32), cu_seqlens=cu)
