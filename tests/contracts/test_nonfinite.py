"""Causality whatever the values: a NaN or infinity at a later position never changes an earlier output.

In chunked or masked-matrix code, ``tril(scores) @ V`` multiplies the zeros above the diagonal
with the later values: ``0 · NaN = NaN`` would then poison every earlier row of the chunk,
so a right-padded batch with garbage in its tail would corrupt real tokens, and the chunk and
quadratic forms would disagree with the token loop. The position holding the NaN may output
NaN itself (and so may the positions after it, which see it); no earlier position may.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import linattn

CAUSAL_METHODS = ("chunk", "quadratic", "recurrent")
BAD_VALUES = (math.nan, math.inf, -math.inf)


def _qkv(B, H, T, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))


def _poison(x, t, value, where="all"):
    """A copy of x with position t (and, for 'after', every position after it) set to value."""
    y = x.clone()
    if where == "after":
        y[:, :, t:] = value
    else:
        y[:, :, t] = value
    return y


def _decay_calls(q, k, v):
    B, H, T, D = q.shape
    g = torch.Generator().manual_seed(5)
    log_g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, D, generator=g, dtype=q.dtype)) / 4
    beta = torch.rand(B, H, T, generator=g, dtype=q.dtype)
    kn = torch.nn.functional.normalize(k, dim=-1)
    return {
        "retention": lambda q, k, v, m: linattn.retention(q, k, v, 0.9, method=m, chunk_size=8),
        "gla": lambda q, k, v, m: linattn.gated_linear_attention(q, k, v, log_g, method=m, chunk_size=8),
        "delta": lambda q, k, v, m: linattn.delta_rule(
            q, torch.nn.functional.normalize(k, dim=-1), v, beta, method=m, chunk_size=8),
        "gated_delta": lambda q, k, v, m: linattn.gated_delta_rule(
            q, torch.nn.functional.normalize(k, dim=-1), v, log_g[..., 0], beta, method=m, chunk_size=8),
        "gated_delta_channel": lambda q, k, v, m: linattn.gated_delta_rule(
            q, torch.nn.functional.normalize(k, dim=-1), v, log_g, beta, method=m, chunk_size=8),
    }


def _check_earlier_unchanged(run, q, k, v, t, which, value, where="all"):
    clean = run(q, k, v)
    args = {"q": q, "k": k, "v": v}
    args[which] = _poison(args[which], t, value, where)
    dirty = run(args["q"], args["k"], args["v"])
    assert torch.equal(dirty[:, :, :t], clean[:, :, :t]), (which, value, where)
    return clean, dirty


@pytest.mark.parametrize("method", CAUSAL_METHODS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["all", "after"])
def test_linear_attention(method, which, value, where):
    q, k, v = _qkv(2, 2, 29, 4, seed=0)
    for t in (0, 5, 8, 13, 28):   # first token, inside a chunk, a chunk start, the last token
        run = lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, method=method, chunk_size=8)
        _, dirty = _check_earlier_unchanged(run, q, k, v, t, which, value, where)
        if which == "v" or (which == "k" and value != -math.inf):   # (elu(-inf) + 1 = 0 is a finite feature)
            assert not torch.isfinite(dirty[:, :, t]).all()


@pytest.mark.parametrize("name", ["retention", "gla", "delta", "gated_delta", "gated_delta_channel"])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_decay_functions(name, method, which, value):
    q, k, v = _qkv(1, 2, 37, 4, seed=1)
    fn = _decay_calls(q, k, v)[name]
    for t in (0, 3, 16, 20, 36):
        _check_earlier_unchanged(lambda q, k, v: fn(q, k, v, method), q, k, v, t, which, value)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_softmax_attention(which, value):
    q, k, v = _qkv(2, 2, 17, 4, seed=2)
    for t in (0, 6, 16):
        _check_earlier_unchanged(lambda q, k, v: linattn.softmax_attention(q, k, v, causal=True), q, k, v, t,
                                 which, value)


@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_the_step_api(method):
    """Decoding token by token is causal by construction; it agrees with the chunk form on the clean prefix."""
    q, k, v = _qkv(1, 2, 12, 4, seed=3)
    v = _poison(v, 9, math.nan)
    full = linattn.linear_attention(q, k, v, causal=True, method=method, chunk_size=4)
    state, outs = None, []
    for t in range(12):
        y, state = linattn.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        outs.append(y)
    stepped = torch.stack(outs, dim=2)
    torch.testing.assert_close(stepped[:, :, :9], full[:, :, :9], rtol=1e-12, atol=1e-12)
    assert torch.isnan(stepped[:, :, 9:]).all() and not torch.isfinite(full[:, :, 9:]).all()


def test_padded_value_slots_never_matter():
    """Padded keys and values get zero weight, whatever they hold (NaN included)."""
    q, k, v = _qkv(2, 2, 10, 4, seed=4)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    mask[1, :2] = False
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :].expand(2, 2, 10)] = math.nan
    v2[~mask[:, None, :].expand(2, 2, 10)] = math.inf
    for causal in (False, True):
        for fn in (linattn.softmax_attention, linattn.linear_attention):
            clean = fn(q, k, v, causal=causal, attention_mask=mask)
            dirty = fn(q, k2, v2, causal=causal, attention_mask=mask)
            rows = torch.ones_like(clean, dtype=torch.bool) if not causal else mask[:, None, :, None].expand_as(clean)
            assert torch.equal(dirty[rows], clean[rows]), (fn.__name__, causal)


@pytest.mark.parametrize("name", ["linear", "softmax"])
def test_causal_layers(name):
    """A causal layer's earlier outputs ignore garbage in later positions of x (also a padded, cached one)."""
    torch.manual_seed(0)
    layer = (linattn.LinearAttention(16, 2, causal=True, chunk_size=4) if name == "linear"
             else linattn.SoftmaxAttention(16, 2, causal=True)).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    clean = layer(x)
    for t in (0, 5, 10):
        for value in BAD_VALUES:
            x2 = x.clone()
            x2[:, t:] = value
            assert torch.equal(layer(x2)[:, :t], clean[:, :t]), (t, value)
            # right padding marked in the mask: the padded garbage changes no real token's output
            mask = torch.arange(11) < t
            if t:
                assert torch.equal(layer(x2, attention_mask=mask.expand(2, 11))[:, :t],
                                   layer(x, attention_mask=mask.expand(2, 11))[:, :t])


@settings(max_examples=40)
@given(T=st.integers(1, 40), C=st.integers(1, 12), t=st.integers(0, 39), which=st.sampled_from("qkv"),
       value=st.sampled_from(BAD_VALUES), normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_property_future_positions_never_change_earlier_outputs(T, C, t, which, value, normalize, seed):
    """Every causal function, every method, any chunk size and any non-finite value at any later position."""
    t = t % T
    q, k, v = _qkv(1, 2, T, 3, seed=seed)
    calls = [lambda q, k, v, m=m: linattn.linear_attention(q, k, v, causal=True, method=m, chunk_size=C,
                                                          normalize=normalize) for m in CAUSAL_METHODS]
    calls.append(lambda q, k, v: linattn.softmax_attention(q, k, v, causal=True))
    decay = _decay_calls(q, k, v)
    calls += [lambda q, k, v, f=f: f(q, k, v, "chunk") for f in decay.values()]
    for run in calls:
        _check_earlier_unchanged(run, q, k, v, t, which, value, where="after")


@pytest.mark.parametrize("variant", ["delta", "gated per head", "gated per channel"])
def test_finite_inputs_that_overflow_inside_the_chunk_form_stay_causal(variant):
    """Unnormalised keys with β = 2 make the delta rule diverge: in float32 the recurrence reaches
    inf at some position. The chunk form's later infinities would reach earlier rows through the
    zeros of its causal masks (found by a new-user test: every output NaN from position 0); the
    chunk method now gives the recurrent form's outputs, finite before the divergence."""
    torch.manual_seed(0)
    B, H, T, D = 1, 1, 64, 8
    q, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    k = 3 * torch.randn(B, H, T, D)
    beta = torch.full((B, H, T), 2.0)
    if variant == "delta":
        run = lambda m: linattn.delta_rule(q, k, v, beta, method=m, chunk_size=64)
    else:
        log_g = torch.full((B, H, T, D) if variant.endswith("channel") else (B, H, T), -0.01)
        run = lambda m: linattn.gated_delta_rule(q, k, v, log_g, beta, method=m, chunk_size=64)
    rec, chunk = run("recurrent"), run("chunk")
    finite = torch.isfinite(rec[0, 0]).all(-1)
    first_bad = int((~finite).nonzero()[0])
    assert 0 < first_bad < T
    assert torch.isfinite(chunk[0, 0, :first_bad]).all()
    torch.testing.assert_close(chunk[0, 0, :first_bad], rec[0, 0, :first_bad], rtol=0, atol=0)
