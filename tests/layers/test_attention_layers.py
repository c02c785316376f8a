"""Tests of linattn.layers: multi-head linear/softmax attention, the Transformer LM, decoding."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import data as tasks
from linattn.layers import LinearAttention, SoftmaxAttention
from linattn.models import TransformerBlock, TransformerLM
from linattn.state import DecodingState, KVCache

ATTENTIONS = ["linear", "softmax"]
KV_HEADS = [None, 2, 1]   # multi-head, grouped-query (2 groups of 2), multi-query
VOCAB = 29


def _model(attention, n_kv_heads=None, *, seed=0, dtype=torch.float32, max_len=64):
    torch.manual_seed(seed)
    model = TransformerLM(VOCAB, 32, 2, 4, n_kv_heads=n_kv_heads, attention=attention, max_len=max_len,
                          chunk_size=8)
    return model.to(dtype).eval()


def _ids(*shape, seed=1):
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _decode_all(model, idx, first):
    """Logits from one parallel pass over idx[:, :first], then one step per remaining token."""
    logits, state = model(idx[:, :first], return_state=True)
    outs = [logits]
    for t in range(first, idx.shape[1]):
        logits, state = model(idx[:, t:t + 1], state=state, return_state=True)
        outs.append(logits)
    return torch.cat(outs, dim=1), state


# ---------------------------------------------------------------------------------------
# Decoding from the state equals the parallel forward pass
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("first", [1, 6])
def test_token_by_token_decoding_matches_forward(attention, n_kv_heads, first):
    model = _model(attention, n_kv_heads)
    idx = _ids(3, 21)                                   # 21 > chunk_size: several chunks
    with torch.no_grad():
        full = model(idx)
        stepped, state = _decode_all(model, idx, first)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)
    assert state.positions.tolist() == [21, 21, 21]


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_layer_resumes_from_state(attention, n_kv_heads):
    """Layer level: two calls chained through the state equal one call (float64, causal)."""
    torch.manual_seed(0)
    cls = LinearAttention if attention == "linear" else SoftmaxAttention
    layer = cls(24, 4, n_kv_heads=n_kv_heads, causal=True).double()
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    y_full = layer(x)
    y1, state = layer(x[:, :9], return_state=True)
    y2 = layer(x[:, 9:], state=state)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y_full, rtol=1e-12, atol=1e-12)


def test_linear_layer_equals_per_head_reference():
    """LinearAttention = projections, φ, linattn.linear_attention per query head, output projection."""
    torch.manual_seed(0)
    layer = LinearAttention(24, 4, n_kv_heads=2, causal=True).double()
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    q = layer.q_proj(x).view(2, 10, 4, 6).transpose(1, 2)
    k = layer.k_proj(x).view(2, 10, 2, 6).transpose(1, 2).repeat_interleave(2, dim=1)
    v = layer.v_proj(x).view(2, 10, 2, 6).transpose(1, 2).repeat_interleave(2, dim=1)
    y = linattn.linear_attention(q, k, v, causal=True, method="quadratic")      # (B, H, T, D)
    expected = layer.out_proj(y.transpose(1, 2).reshape(2, 10, 24))
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_softmax_layer_equals_reference():
    torch.manual_seed(0)
    layer = SoftmaxAttention(24, 4, n_kv_heads=1, causal=True).double()
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    mask = torch.tensor([[False] * 3 + [True] * 7, [True] * 10])
    q = layer.q_proj(x).view(2, 10, 4, 6).transpose(1, 2)
    k = layer.k_proj(x).view(2, 10, 1, 6).transpose(1, 2).expand(2, 4, 10, 6)
    v = layer.v_proj(x).view(2, 10, 1, 6).transpose(1, 2).expand(2, 4, 10, 6)
    y = linattn.softmax_attention(q, k, v, causal=True, attention_mask=mask)   # zero rows with no key
    expected = layer.out_proj(y.transpose(1, 2).reshape(2, 10, 24))
    torch.testing.assert_close(layer(x, attention_mask=mask), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_non_causal_layer_sees_the_future(attention):
    torch.manual_seed(0)
    cls = LinearAttention if attention == "linear" else SoftmaxAttention
    layer = cls(16, 2)
    x = torch.randn(1, 6, 16)
    x2 = x.clone()
    x2[:, -1] += 1.0
    assert not torch.allclose(layer(x)[:, 0], layer(x2)[:, 0])       # the first token sees the last


# ---------------------------------------------------------------------------------------
# Padding and generation
# ---------------------------------------------------------------------------------------


def _left_padded(prompts, pad_id=0):
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):] = p
        mask[i, T - len(p):] = True
    return idx, mask


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(attention, n_kv_heads):
    model = _model(attention, n_kv_heads)
    prompts = [_ids(n, seed=n) for n in (4, 11, 1, 7)]
    idx, mask = _left_padded(prompts, pad_id=5)
    out = model.generate(idx, 12, temperature=0.0, attention_mask=mask)
    assert out.shape == (4, idx.shape[1] + 12)
    assert torch.equal(out[:, :idx.shape[1]], idx)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], 12, temperature=0.0)
        assert torch.equal(out[i, idx.shape[1]:], alone[0, len(p):]), f"prompt {i} (length {len(p)})"


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padding_tokens_do_not_change_logits(attention):
    """The logits of a left-padded prompt's real tokens do not depend on the pad ids."""
    model = _model(attention)
    idx, mask = _left_padded([_ids(5), _ids(9, seed=2)])
    other = idx.masked_fill(~mask, 17)
    with torch.no_grad():
        a, b = model(idx, attention_mask=mask), model(other, attention_mask=mask)
    torch.testing.assert_close(a[mask], b[mask], rtol=0, atol=1e-6)
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_is_seeded_and_respects_top_k(attention):
    model = _model(attention)
    idx = _ids(2, 3)
    a = model.generate(idx, 10, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 10, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    greedy = model.generate(idx, 10, temperature=0.0)
    top1 = model.generate(idx, 10, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy, top1)
    assert torch.equal(model.generate(idx, 0), idx)


def test_generate_stops_at_max_len():
    model = _model("linear", max_len=16)
    assert model.generate(_ids(1, 6), 10, temperature=0.0).shape == (1, 16)   # max_len tokens in all
    with pytest.raises(ValueError, match="max_len"):
        model.generate(_ids(1, 6), 11, temperature=0.0)
    with pytest.raises(ValueError, match="max_len"):
        model(_ids(1, 17))


# ---------------------------------------------------------------------------------------
# State size: constant for linear attention, growing for the KV cache
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
def test_state_size_is_constant_and_kv_cache_grows(n_kv_heads):
    B, H_kv, D, n_layers = 2, n_kv_heads or 4, 8, 2
    sizes = {}
    for attention in ATTENTIONS:
        model = _model(attention, n_kv_heads)
        with torch.no_grad():
            _, state = model(_ids(B, 3), return_state=True)
            sizes[attention] = [state.nbytes]
            for t in range(20):
                _, state = model(_ids(B, 1, seed=t), state=state, return_state=True)
                sizes[attention].append(state.nbytes)
        if attention == "linear":                                          # M = head_dim for elu+1
            assert all(s.S.shape == (B, H_kv, D, D) and s.z.shape == (B, H_kv, D) for s in state.layers)
        else:
            assert all(s.k.shape == s.v.shape == (B, H_kv, 23, D) for s in state.layers)
            assert all(s.attention_mask.shape == (B, 23) for s in state.layers)
    assert len(set(sizes["linear"])) == 1                                 # flat
    growth = [b - a for a, b in zip(sizes["softmax"], sizes["softmax"][1:])]
    # per token and layer: one key and one value (float32) per kv head, one mask byte per sequence
    assert growth == [n_layers * (2 * B * H_kv * D * 4 + B)] * 20


def test_grouped_heads_shrink_the_state():
    full = _model("linear")
    mqa = _model("linear", n_kv_heads=1)
    with torch.no_grad():
        _, s_full = full(_ids(1, 4), return_state=True)
        _, s_mqa = mqa(_ids(1, 4), return_state=True)
    assert s_full.nbytes - 8 == 4 * (s_mqa.nbytes - 8)                    # positions: one int64


# ---------------------------------------------------------------------------------------
# Training, dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_training_lowers_the_loss(attention):
    corpus = tasks.CharCorpus("to be, or not to be: that is the question. " * 20)
    torch.manual_seed(0)
    model = TransformerLM(corpus.vocab_size, 32, 2, 4, attention=attention, max_len=32, chunk_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    x_val, y_val = corpus.get_batch("val", 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.loss(x_val, y_val).item()
    for _ in range(30):
        x, y = corpus.get_batch("train", 8, 32, generator=g)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = model.loss(x_val, y_val).item()
    assert after < before - 1.0, (before, after)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_bfloat16_model_runs_and_decodes(attention):
    model = _model(attention, 2, dtype=torch.bfloat16)
    idx = _ids(2, 10)
    with torch.no_grad():
        full = model(idx)
        stepped, state = _decode_all(model, idx, 4)
    assert full.dtype == torch.bfloat16 and stepped.dtype == torch.bfloat16
    assert (stepped.float() - full.float()).abs().max() < 0.05
    layer_state = state.layers[0]
    if attention == "linear":
        assert layer_state.S.dtype == torch.float32                      # the state accumulates in float32
    else:
        assert layer_state.k.dtype == torch.bfloat16


def test_block_passes_state_through():
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, attention="linear", causal=True)
    x = torch.randn(1, 7, 16)
    y, state = block(x, return_state=True)
    assert y.shape == x.shape and isinstance(state, linattn.LinearAttentionState)
    with torch.no_grad():
        y2 = torch.cat([block(x[:, :4]), block(x[:, 4:], state=block(x[:, :4], return_state=True)[1])], dim=1)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------

VT = (ValueError, TypeError)


@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_bad_constructor_arguments(cls):
    with pytest.raises(ValueError, match=r"d_model.*divisible by n_heads.*d_model=30.*n_heads=4"):
        cls(30, 4)
    with pytest.raises(ValueError, match=r"n_heads must be divisible by n_kv_heads.*n_heads=4.*n_kv_heads=3"):
        cls(32, 4, n_kv_heads=3)
    with pytest.raises(TypeError, match="n_heads"):
        cls(32, 4.0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        cls(32, 4, n_kv_heads=0)
    with pytest.raises(TypeError, match="causal"):
        cls(32, 4, causal=1)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="attention"):
        TransformerLM(10, 32, 2, 4, attention="sparse")
    with pytest.raises(ValueError, match="d_model"):
        TransformerLM(10, 30, 2, 4)
    with pytest.raises(ValueError, match="feature_map"):
        TransformerLM(10, 32, 2, 4, feature_map="nope")
    with pytest.raises(TypeError, match="max_len"):
        TransformerLM(10, 32, 2, 4, max_len=16.0)
    with pytest.raises(ValueError, match="positions='learned' needs max_len"):   # rope and none need none
        TransformerLM(10, 32, 2, 4, positions="learned", max_len=None)


@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_bad_layer_inputs(cls):
    layer = cls(32, 4, n_kv_heads=2, causal=True)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, d_model=32\).*\(2, 5, 31\)"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"x must have shape.*\(5, 32\)"):
        layer(torch.randn(5, 32))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        layer(torch.ones(2, 5, 32, dtype=torch.long))
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        layer(x.double())
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, seq\) = \(2, 5\).*\(2, 4\)"):
        layer(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask must be a bool"):
        layer(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="return_state"):
        layer(x, return_state=1)


def test_bad_linear_state():
    layer = LinearAttention(32, 4, n_kv_heads=2, causal=True)
    x = torch.randn(2, 5, 32)
    _, state = layer(x, return_state=True)
    assert state.S.shape == (2, 2, 8, 8)
    with pytest.raises(TypeError, match="state must be a LinearAttentionState"):
        layer(x, state=KVCache(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8), torch.ones(2, 3, dtype=torch.bool)))
    wrong_heads = linattn.LinearAttentionState(torch.zeros(2, 4, 8, 8), torch.zeros(2, 4, 8))  # n_heads, not n_kv_heads
    with pytest.raises(ValueError, match=r"state must have S of shape \(batch, n_kv_heads, M, head_dim\) = \(2, 2, 8, 8\)"):
        layer(x, state=wrong_heads)
    with pytest.raises(ValueError, match="state"):
        layer(x[:1], state=state)                                           # batch 1, state for batch 2


def test_bad_kv_cache():
    layer = SoftmaxAttention(32, 4, n_kv_heads=2, causal=True)
    x = torch.randn(2, 5, 32)
    _, cache = layer(x, return_state=True)
    assert cache.k.shape == (2, 2, 5, 8)
    with pytest.raises(TypeError, match="state must be a KVCache"):
        layer(x, state=linattn.LinearAttentionState(torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8)))
    with pytest.raises(ValueError, match=r"state.k and state.v must have shape \(batch=2, n_kv_heads=2"):
        layer(x, state=KVCache(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), torch.ones(2, 3, dtype=torch.bool)))
    with pytest.raises(TypeError, match="state holds torch.float64"):
        layer(x, state=KVCache(cache.k.double(), cache.v.double(), cache.attention_mask))
    with pytest.raises(ValueError, match=r"state.attention_mask must have shape"):
        KVCache(cache.k, cache.v, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="state.k and state.v must have one shape"):
        KVCache(cache.k, cache.v[:, :, :3], cache.attention_mask)


def test_bad_model_inputs():
    model = _model("linear")
    with pytest.raises(TypeError, match="idx must be an int64"):
        model(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"idx must have shape \(batch, seq\)"):
        model(_ids(5))
    with pytest.raises(ValueError, match=r"idx must be a tensor of token ids in \[0, 29\), got 29 at index \(0, 0\)"):
        model(torch.full((1, 3), VOCAB))
    with pytest.raises(ValueError, match="attention_mask"):
        model(_ids(2, 5), attention_mask=torch.ones(2, 6, dtype=torch.bool))
    _, state = model(_ids(2, 5), return_state=True)
    with pytest.raises(TypeError, match="state must be a DecodingState"):
        model(_ids(2, 1), state=state.layers)
    with pytest.raises(ValueError, match="one layer state per block"):
        model(_ids(2, 1), state=DecodingState(state.layers[:1], state.positions))
    with pytest.raises(ValueError, match=r"state.positions .*shape \(batch,\) = \(3,\)"):
        model(_ids(3, 1), state=state)
    softmax = _model("softmax")
    with pytest.raises(TypeError, match=r"state.layers\[0\] must be a KVCache"):
        softmax(_ids(2, 1), state=state)                                    # a linear model's state
    with pytest.raises(ValueError, match="left padding"):
        model.generate(_ids(2, 5), 3, attention_mask=torch.tensor([[True] * 4 + [False]] * 2))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(_ids(2, 5), 3, temperature=-1.0)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(_ids(2, 5), 3.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(_ids(2, 5), 3, top_k=0)
    with pytest.raises(ValueError, match="targets"):
        model.loss(_ids(2, 5), _ids(2, 4))


def test_bad_linear_layer_options():
    with pytest.raises(ValueError, match="eps"):
        LinearAttention(32, 4, eps=0.0)
    with pytest.raises(TypeError, match="eps"):
        LinearAttention(32, 4, eps="small")
    with pytest.raises(TypeError, match="chunk_size"):
        LinearAttention(32, 4, chunk_size=8.0)
    with pytest.raises(TypeError, match="feature_map"):
        LinearAttention(32, 4, feature_map=3)


class _PositionalFeatures(torch.nn.Module):
    """A stand-in for cosFormer-like maps whose features depend on the position along dim 2."""

    position_dependent = True

    def forward(self, x, *, offset=0):
        pos = torch.arange(offset, offset + x.shape[-2], dtype=x.dtype)[:, None]
        return torch.nn.functional.elu(x) + 1 + 0.01 * pos


def test_position_dependent_feature_map_refuses_to_continue_a_state():
    layer = LinearAttention(16, 2, feature_map=_PositionalFeatures(), causal=True)
    x = torch.randn(1, 5, 16)
    y, state = layer(x, return_state=True)                             # a whole sequence is fine
    assert y.shape == x.shape
    with pytest.raises(ValueError, match="state cannot be continued with the position-dependent feature_map"):
        layer(x[:, :1], state=state)
