"""Tests of hybrid TransformerLMs: one token mixer per layer, their decoding state, config, compile, autocast."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

import linattn
from linattn import (DecodingState, KVCache, LinearAttention, LinearAttentionState, LinearMixer, MixerState,
                     SoftmaxAttention, TransformerConfig, TransformerLM)
from linattn.models import ATTENTIONS

VOCAB = 23
HYBRID = ["gated_delta", "softmax", "linear", "kda", "retention", "gla", "delta"]


def _model(attention=tuple(HYBRID), *, n_kv_heads=None, positions="rope", seed=0, **kwargs):
    torch.manual_seed(seed)
    n_layers = 1 if isinstance(attention, str) else len(attention)
    return TransformerLM(VOCAB, 32, n_layers, 4, n_kv_heads=n_kv_heads, attention=attention, positions=positions,
                         chunk_size=8, **kwargs).eval()


def _ids(*shape, seed=1):
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_one_mixer_per_layer_and_a_plain_string_for_all():
    model = _model(HYBRID)
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds == [LinearMixer, SoftmaxAttention, LinearAttention, LinearMixer, LinearMixer, LinearMixer, LinearMixer]
    assert [b.attn.rule for b in model.blocks if isinstance(b.attn, LinearMixer)] == [
        "gated_delta", "kda", "retention", "gla", "delta"]
    assert model.config.attention == HYBRID and model.config.mixers() == HYBRID
    assert isinstance(model.config.attention, list)                      # a tuple is stored as a list
    every = TransformerLM(VOCAB, 32, 3, 4, attention="gated_delta")
    assert every.config.attention == "gated_delta" and every.config.mixers() == ["gated_delta"] * 3
    assert all(b.attn.rule == "gated_delta" for b in every.blocks)


@pytest.mark.parametrize("positions", ["rope", "none"])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_hybrid_decoding_equals_recomputation(n_kv_heads, positions):
    model = _model(n_kv_heads=n_kv_heads, positions=positions)
    idx = _ids(2, 19)
    with torch.no_grad():
        full = model(idx)
        logits, state = model(idx[:, :6], return_state=True)
        outs = [logits]
        for t in range(6, 19):
            logits, state = model(idx[:, t:t + 1], state=state, return_state=True)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)
    assert [type(s) for s in state.layers] == [MixerState, KVCache, LinearAttentionState] + [MixerState] * 4
    assert state.positions.tolist() == [19, 19]


def test_hybrid_left_padded_batch_equals_each_prompt_alone():
    model = _model()
    prompts = [_ids(n, seed=n) for n in (3, 10, 6)]
    T = 10
    idx = torch.full((3, T), 5)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):], mask[i, T - len(p):] = p, True
    out = model.generate(idx, 9, temperature=0.0, attention_mask=mask)
    with torch.no_grad():
        padded = model(idx, attention_mask=mask)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            torch.testing.assert_close(padded[i, T - len(p):], model(p[None])[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[i, T:], model.generate(p[None], 9, temperature=0.0)[0, len(p):])


@pytest.mark.parametrize("position", [1, 7, 20])
def test_decoding_state_nbytes_is_the_size_of_the_real_state(position):
    model = _model(n_kv_heads=2)
    with torch.no_grad():
        logits, state = model(_ids(3, 1), return_state=True)
        for t in range(1, position):
            logits, state = model(_ids(3, 1, seed=t), state=state, return_state=True)
    assert state.nbytes == model.decoding_state_nbytes(position, batch=3)
    fixed = sum(s.nbytes for s in state.layers if not isinstance(s, KVCache))
    cache = next(s for s in state.layers if isinstance(s, KVCache))
    assert cache.seq_len == position and fixed == model.decoding_state_nbytes(0, batch=3) - 3 * 8
    growth = model.decoding_state_nbytes(position + 1) - model.decoding_state_nbytes(position)
    assert growth == 2 * 2 * 8 * 4 + 1                                   # one key and one value per kv head, mask


def test_decoding_state_nbytes_of_a_linear_model_is_constant_and_checked():
    model = _model("gated_delta", max_len=50)
    assert model.decoding_state_nbytes(0) == model.decoding_state_nbytes(50)
    with pytest.raises(ValueError, match=r"position must be <= max_len=50, got 51"):
        model.decoding_state_nbytes(51)
    with pytest.raises(ValueError, match="position must be >= 0"):
        model.decoding_state_nbytes(-1)
    with pytest.raises(TypeError, match="batch must be an int"):
        model.decoding_state_nbytes(3, batch=1.0)


def test_config_rebuilds_an_equal_model():
    model = _model(HYBRID, n_kv_heads=2, short_conv=False, negative_eigenvalues=True, output_gate=False,
                   conv_size=3, qk_norm=False, output_norm=False)
    cfg = model.config
    assert (cfg.attention, cfg.positions, cfg.short_conv, cfg.conv_size, cfg.negative_eigenvalues) == (
        HYBRID, "rope", False, 3, True)
    torch.manual_seed(0)
    again = TransformerLM(**asdict(cfg)).eval()
    assert again.config == cfg
    a, b = model.state_dict(), again.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    idx = _ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(again(idx), model(idx), rtol=0, atol=0)


def test_mixer_options_reach_the_mixers_only():
    model = _model(HYBRID, short_conv=False, negative_eigenvalues=True, conv_size=5)
    mixers = {b.attn.rule: b.attn for b in model.blocks if isinstance(b.attn, LinearMixer)}
    assert all(m.conv is None for m in mixers.values())
    assert {r: m.negative_eigenvalues for r, m in mixers.items()} == {
        "gated_delta": True, "kda": True, "retention": False, "gla": False, "delta": True}
    assert all(m.conv.kernel_size == 5 for m in (b.attn for b in _model(HYBRID, conv_size=5).blocks)
               if isinstance(m, LinearMixer))


def test_the_state_must_match_each_layer():
    model = _model(["gated_delta", "softmax"])
    with torch.no_grad():
        _, state = model(_ids(2, 4), return_state=True)
    swapped = DecodingState([state.layers[1], state.layers[0]], state.positions)
    with pytest.raises(TypeError, match=r"state.layers\[0\] must be a MixerState for block 0 \(LinearMixer\), "
                                        r"got KVCache"):
        model(_ids(2, 1), state=swapped)
    state.layers[0].S = state.layers[0].S[:, :2]                        # mutated after it was returned
    with pytest.raises(ValueError, match=r"state.S must have shape"):
        model(_ids(2, 1), state=state)


def test_bad_attention_lists():
    with pytest.raises(ValueError, match=r"one token mixer per layer, n_layers=3 names, got a list of 2"):
        TransformerLM(VOCAB, 32, 3, 4, attention=["gated_delta", "softmax"])
    with pytest.raises(ValueError, match=r"attention\[1\] must be one of .*got 'mamba'"):
        TransformerLM(VOCAB, 32, 2, 4, attention=["gated_delta", "mamba"])
    with pytest.raises(TypeError, match=r"attention\[0\] must be a str"):
        TransformerLM(VOCAB, 32, 2, 4, attention=[None, "softmax"])
    with pytest.raises(TypeError, match="attention must be a str or a list of str"):
        TransformerLM(VOCAB, 32, 2, 4, attention={"softmax"})
    with pytest.raises(ValueError, match=r"attention must be one of .*'kda'.*got 'sparse'"):
        TransformerLM(VOCAB, 32, 2, 4, attention="sparse")
    with pytest.raises(ValueError, match="conv_size must be >= 2"):
        TransformerLM(VOCAB, 32, 2, 4, attention="gated_delta", conv_size=1)
    with pytest.raises(TypeError, match="short_conv must be a bool"):
        TransformerLM(VOCAB, 32, 2, 4, short_conv="yes")
    with pytest.raises(ValueError, match="causal only"):
        linattn.TransformerBlock(32, 4, attention="gated_delta")
    assert set(ATTENTIONS) == {"linear", "softmax", "retention", "gla", "delta", "gated_delta", "kda"}


def test_hybrid_compiles_to_one_graph():
    torch._dynamo.reset()
    model = _model(["gated_delta", "softmax", "linear"], n_kv_heads=2)
    idx = _ids(2, 12)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model(idx), rtol=1e-5, atol=1e-5)


def test_hybrid_trains_under_cpu_autocast_bfloat16():
    model = _model(["gated_delta", "softmax", "linear", "kda"], n_kv_heads=2).train()
    idx = _ids(2, 12)
    with torch.no_grad():
        want = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), _ids(2, 12, seed=5).flatten())
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    torch.testing.assert_close(logits.float(), want, rtol=0.05, atol=0.05)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_config_field_defaults_describe_the_modern_mixer():
    cfg = TransformerConfig(10, 8, 2, 2)
    assert (cfg.max_len, cfg.short_conv, cfg.conv_size, cfg.qk_norm, cfg.negative_eigenvalues, cfg.output_norm,
            cfg.output_gate) == (None, True, 4, True, False, True, True)
