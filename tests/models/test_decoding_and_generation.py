"""Decoding states (ownership, validation at every use, equality), compiled models, sampling and generate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from linattn import LinearAttentionState
from linattn.layers import LinearAttention, SoftmaxAttention
from linattn.models import TransformerLM
from linattn.state import DecodingState, KVCache
from linattn.models.generation import sample_next

VOCAB = 29


def _model(attention="linear", *, seed=0, max_len=64, **kwargs):
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, 32, 2, 4, attention=attention, max_len=max_len, chunk_size=8, **kwargs).eval()


def _ids(*shape, seed=1):
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _cache_parts(B=2, H=2, T=3, D=8):
    return torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.ones(B, T, dtype=torch.bool)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, LinearAttentionState):
        yield from (obj.S, obj.z)
    elif isinstance(obj, KVCache):
        yield from (obj.k, obj.v, obj.attention_mask)
    elif isinstance(obj, DecodingState):
        for s in obj.layers:
            yield from _tensors(s)
        yield obj.positions


def _storages(*objs) -> set[int]:
    return {t.untyped_storage().data_ptr() for obj in objs if obj is not None for t in _tensors(obj)}


def _mask(kind, B, T):
    if kind is None:
        return None
    m = torch.ones(B, T, dtype=torch.bool)
    m[0, :1] = False                                                         # left padding in row 0
    return m if kind == "bool" else m.long()


@pytest.mark.parametrize("mask_kind", [None, "bool", "int"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_returned_layer_state_shares_no_memory_with_any_input(cls, causal, n_kv_heads, T, mask_kind):
    torch.manual_seed(0)
    layer = cls(32, 4, n_kv_heads=n_kv_heads, causal=causal)
    x = torch.randn(2, T, 32)
    mask = _mask(mask_kind, 2, T)
    for prev in (None, layer(torch.randn(2, 3, 32), return_state=True)[1]):
        _, state = layer(x, attention_mask=mask, state=prev, return_state=True)
        assert not _storages(state) & _storages(x, mask, prev), "the returned state aliases an input"


def test_kv_cache_is_not_changed_by_editing_the_callers_mask():
    layer = SoftmaxAttention(32, 4, causal=True)
    mask = torch.tensor([[False, True, True]])
    _, cache = layer(torch.randn(1, 3, 32), attention_mask=mask, return_state=True)
    mask.fill_(True)                                                          # the caller reuses its buffer
    assert cache.attention_mask.tolist() == [[False, True, True]]


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_returned_decoding_state_shares_no_memory_with_any_input(attention):
    model = _model(attention, n_kv_heads=2)
    idx, mask = _ids(2, 4), torch.tensor([[False, True, True, True], [True] * 4])
    with torch.no_grad():
        _, s1 = model(idx, attention_mask=mask, return_state=True)
        assert not _storages(s1) & _storages(idx, mask)
        nxt = _ids(2, 1, seed=3)
        _, s2 = model(nxt, state=s1, return_state=True)
        assert not _storages(s2) & _storages(nxt, s1)


# ---------------------------------------------------------------------------------------
# A state is checked every time it is used, not only when it was built
# ---------------------------------------------------------------------------------------


def _linear_state(n_kv_heads=2):
    layer = LinearAttention(32, 4, n_kv_heads=n_kv_heads, causal=True)
    _, state = layer(torch.randn(2, 5, 32), return_state=True)
    return layer, state


@pytest.mark.parametrize("attr, value, error, match", [
    ("S", None, TypeError, r"state.S must be a torch.Tensor, got NoneType"),
    ("z", 3, TypeError, r"state.z must be a torch.Tensor, got int"),
    ("z", "long", TypeError, r"state.z must be a floating-point tensor, got dtype torch.int64"),
    ("S", "narrow", ValueError, r"state must have S of shape \(batch, n_kv_heads, M, head_dim\) = \(2, 2, 8, 8\)"),
    ("S", "3-D", ValueError, r"state.S must be 4-D"),
    ("S", "double", TypeError, r"state.S is torch.float64 but a layer fed torch.float32 keeps its state in "
                               r"torch.float32"),
    ("z", "meta", ValueError, r"state.z is on meta but x is on cpu"),
])
def test_a_mutated_linear_state_is_checked_when_it_is_used(attr, value, error, match):
    layer, state = _linear_state()
    t = getattr(state, attr)
    value = {"long": lambda: t.long(), "narrow": lambda: t[..., :4], "3-D": lambda: t[:, 0],
             "double": lambda: t.double(), "meta": lambda: t.to("meta")}.get(value, lambda: value)()
    setattr(state, attr, value)
    for T in (1, 4):                                                            # the step and the chunk paths
        with pytest.raises(error, match=match):
            layer(torch.randn(2, T, 32), state=state)


@pytest.mark.parametrize("attr, make, error, match", [
    ("k", lambda c: c.k[:, :, :2], ValueError, r"state.k and state.v must have one shape"),
    ("v", lambda c: c.v.double(), TypeError, r"state.k and state.v must have one dtype"),
    ("v", lambda c: None, TypeError, r"state.v must be a floating-point torch.Tensor, got NoneType"),
    ("attention_mask", lambda c: c.attention_mask[:, 1:], ValueError,
     r"state.attention_mask must have shape \(batch, seq\) = \(2, 5\)"),
    ("attention_mask", lambda c: c.attention_mask.long(), TypeError, r"state.attention_mask must be a bool"),
    ("attention_mask", lambda c: c.attention_mask.to("meta"), ValueError,
     r"state.attention_mask is on meta but state.k is on cpu"),
])
def test_a_mutated_kv_cache_is_checked_when_it_is_used(attr, make, error, match):
    layer = SoftmaxAttention(32, 4, n_kv_heads=2, causal=True)
    _, cache = layer(torch.randn(2, 5, 32), return_state=True)
    setattr(cache, attr, make(cache))
    with pytest.raises(error, match=match):
        layer(torch.randn(2, 1, 32), state=cache)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_a_mutated_decoding_state_is_checked_when_it_is_used(attention):
    model = _model(attention)
    with torch.no_grad():
        _, state = model(_ids(2, 5), return_state=True)
    nxt = _ids(2, 1, seed=2)
    good_layers, good_positions = list(state.layers), state.positions
    state.layers[0] = None                                    # was silently taken as "no earlier tokens"
    with pytest.raises(TypeError, match=r"state.layers\[0\] must be a LinearAttentionState, a MixerState or a KVCache, got NoneType"):
        model(nxt, state=state)
    state.layers = good_layers
    for positions, error, match in [
        (good_positions.int(), TypeError, r"state.positions must be an int64 tensor"),
        ([5, 5], TypeError, r"state.positions must be an int64 tensor"),
        (good_positions[:, None], ValueError, r"state.positions must have shape \(batch,\)"),
        (torch.tensor([5, -1]), ValueError, r"state.positions must be a count of tokens seen, >= 0, got -1"),
        (good_positions.to("meta"), ValueError, r"state.positions is on meta but idx is on cpu"),
    ]:
        state.positions = positions
        with pytest.raises(error, match=match):
            model(nxt, state=state)
    state.positions = good_positions
    setattr(state.layers[1], "S" if attention == "linear" else "k", None)    # checked again by the layer
    with pytest.raises(TypeError, match=r"state\.[Sk] must be a"):
        model(nxt, state=state)


def test_decoding_state_is_checked_when_built():
    with pytest.raises(TypeError, match=r"state.layers\[1\] must be a LinearAttentionState, a MixerState or a KVCache, got int"):
        DecodingState([KVCache(*_cache_parts()), 3], torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"state.positions must be an int64 tensor"):
        DecodingState([], torch.zeros(2))


# ---------------------------------------------------------------------------------------
# == between states is a bool
# ---------------------------------------------------------------------------------------


def _copy_cache(c, **replace):
    parts = {"k": c.k.clone(), "v": c.v.clone(), "attention_mask": c.attention_mask.clone(), **replace}
    return KVCache(**parts)


def test_kv_cache_equality_is_a_bool_by_value():
    layer = SoftmaxAttention(32, 4, n_kv_heads=2, causal=True)
    with torch.no_grad():
        _, c = layer(torch.randn(2, 5, 32), return_state=True)
    same = _copy_cache(c)
    assert (c == same) is True and (c != same) is False
    changed_v = c.v.clone()
    changed_v[1, 0, 4, 7] += 1e-6
    changed_mask = c.attention_mask.clone()
    changed_mask[0, 0] = False
    nan_k = c.k.clone()
    nan_k[0, 0, 0, 0] = float("nan")
    for other in (_copy_cache(c, v=changed_v), _copy_cache(c, attention_mask=changed_mask),
                  _copy_cache(c, k=c.k.double(), v=c.v.double()),            # same values, another dtype
                  _copy_cache(c, k=c.k[:, :, :4], v=c.v[:, :, :4], attention_mask=c.attention_mask[:, :4]),
                  KVCache(c.k.to("meta"), c.v.to("meta"), c.attention_mask.to("meta"))):
        assert (c == other) is False and (c != other) is True
    assert _copy_cache(c, k=nan_k) != _copy_cache(c, k=nan_k)                # torch.equal: NaN is unequal
    assert (c == "cache") is False and c in [1, same]


def test_decoding_state_equality_is_a_bool_by_value():
    model = _model("softmax")
    with torch.no_grad():
        _, a = model(_ids(2, 5), return_state=True)
        _, b = model(_ids(2, 5), return_state=True)                          # same input, new tensors
        _, c = model(_ids(2, 1, seed=4), state=a, return_state=True)
    assert (a == b) is True and (a != b) is False
    assert (a == c) is False
    assert (a == DecodingState(list(a.layers), a.positions + 1)) is False
    assert (a == DecodingState(a.layers[:1], a.positions)) is False
    assert (a == a.layers) is False


def test_decoding_state_equality_with_linear_layers():
    model = _model("linear")
    with torch.no_grad():
        _, a = model(_ids(2, 5), return_state=True)
        _, b = model(_ids(2, 5), return_state=True)
        _, c = model(_ids(2, 1, seed=4), state=a, return_state=True)
    assert (a == b) is True and (a == c) is False


# ---------------------------------------------------------------------------------------
# torch.compile: one graph, the same numbers, and bad ids / positions still refused
# ---------------------------------------------------------------------------------------


def _compiled(fn):
    """One graph (fullgraph: a graph break raises), static shapes (a recompile stays cheap)."""
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_model_compiles_to_one_graph_and_still_refuses_bad_ids(attention):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, 16, 1, 2, attention=attention, max_len=12, chunk_size=4).eval()
    compiled, loss = _compiled(model), _compiled(model.loss)
    idx = _ids(2, 10)
    with torch.no_grad():                                                   # inference graphs: faster to build
        torch.testing.assert_close(compiled(idx), model(idx), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss(idx, idx), model.loss(idx, idx), rtol=1e-6, atol=1e-6)
        for bad in (torch.full((2, 10), VOCAB), torch.full((2, 10), -1)):  # same shapes: no recompile
            with pytest.raises(RuntimeError, match=r"idx must be a tensor of token ids in \[0, 29\)"):
                compiled(bad)                                               # torch._assert_async in the graph
    with pytest.raises(ValueError, match=r"idx must be a tensor of token ids in \[0, 29\), got -1 at index \(0, 0\)"):
        model(torch.full((2, 10), -1))                                      # eagerly: the first bad entry


def test_compiled_model_still_refuses_positions_past_max_len():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, 16, 1, 2, attention="softmax", max_len=12).eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"the position of every token must be < max_len=12"):
        _compiled(model)(_ids(2, 13))
    with pytest.raises(ValueError, match=r"the position of every token must be < max_len=12.*got 12 at "
                                         r"index \(0, 12\)"):
        model(_ids(2, 13))


# ---------------------------------------------------------------------------------------
# generate: any temperature > 0, everything checked first, max_len exactly
# ---------------------------------------------------------------------------------------


def _sampling_probs(logits, temperature, top_k=None):
    """Independent float64 reference: softmax of the (top-k cut) logits over temperature."""
    logits = logits.double()
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values[:, top_k - 1:top_k]
        logits = torch.where(logits >= kth, logits, -torch.inf)
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 5e-324, 1e-30, np.float64(1e-300)])
def test_tiny_temperature_is_greedy_with_ties(temperature):
    model = _model("softmax")
    idx = _ids(3, 4)
    greedy = model.generate(idx, 6, temperature=0.0)
    out = model.generate(idx, 6, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, greedy)
    tied = torch.tensor([[1.0, 3.0, 3.0, -2.0]]).expand(4000, 4)           # two most likely tokens, tied
    draws = sample_next(tied, temperature, None, torch.Generator().manual_seed(0))[:, 0]
    counts = torch.bincount(draws, minlength=4)
    assert counts[0] == counts[3] == 0 and abs(int(counts[1]) - 2000) < 200   # uniform among the ties


@pytest.mark.parametrize("temperature, top_k", [(1e-300, 2), (1e300, None), (1e300, 2), (0.7, 3), (50.0, None)])
def test_sampling_draws_from_the_tempered_softmax(temperature, top_k):
    """Frequencies of many draws agree with the float64 reference (huge temperatures: uniform)."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.5, 1.5]])
    n = 20000
    draws = sample_next(logits.expand(n, 5), temperature, top_k, torch.Generator().manual_seed(1))
    freq = torch.bincount(draws[:, 0], minlength=5).double() / n
    if temperature < 1e-200:                                               # the limit: the argmax
        expected = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    else:
        expected = _sampling_probs(logits, temperature, top_k)[0]
    assert (freq - expected).abs().max() < 0.015, (freq, expected)


@pytest.mark.parametrize("max_new_tokens", [0, 3])
def test_generate_checks_every_argument_first(max_new_tokens):
    model = _model("linear", max_len=16)
    idx = _ids(2, 5)
    cases = [
        (lambda: model.generate(idx[0], max_new_tokens), ValueError, r"idx must have shape \(batch, seq\).*got \(5\)"),
        (lambda: model.generate(idx.tolist(), max_new_tokens), TypeError, r"idx must be an int64 .*got list"),
        (lambda: model.generate(idx.int(), max_new_tokens), TypeError, r"idx must be an int64"),
        (lambda: model.generate(torch.full((1, 3), VOCAB), max_new_tokens), ValueError,
         r"idx must be a tensor of token ids in \[0, 29\), got 29"),
        (lambda: model.generate(_ids(1, 17), max_new_tokens), ValueError, r"17 real tokens.*max_len=16"),
        (lambda: model.generate(idx, max_new_tokens, attention_mask=torch.ones(2, 4, dtype=torch.bool)),
         ValueError, r"attention_mask must have shape"),
        (lambda: model.generate(idx, max_new_tokens, attention_mask=torch.tensor([[True] * 4 + [False]] * 2)),
         ValueError, "left padding"),
        (lambda: model.generate(idx, max_new_tokens, temperature=float("nan")), ValueError, "temperature"),
        (lambda: model.generate(idx, max_new_tokens, temperature=10 ** 400), ValueError, "temperature"),
        (lambda: model.generate(idx, max_new_tokens, temperature="hot"), TypeError, "temperature"),
        (lambda: model.generate(idx, max_new_tokens, top_k=2.0), TypeError, "top_k"),
        (lambda: model.generate(idx, max_new_tokens, generator=7), TypeError, r"generator must be a torch.Generator"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_generate_fills_exactly_max_len_and_its_output_is_a_valid_input():
    model = _model("softmax", max_len=16)
    prompts = [_ids(6, seed=1), _ids(3, seed=2)]
    idx = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, 6 - len(p):], mask[i, 6 - len(p):] = p, True
    out = model.generate(idx, 10, temperature=0.0, attention_mask=mask)   # longest prompt 6 + 10 = max_len
    assert out.shape == (2, 16)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=torch.bool)], dim=1)
    with torch.no_grad():                                                  # positions 0 .. 15: all valid
        greedy_again = model(out, attention_mask=full_mask)[:, 5:-1].argmax(-1)
    assert torch.equal(greedy_again, out[:, 6:])                           # the output reproduces itself
    with pytest.raises(ValueError, match=r"6 real tokens plus max_new_tokens=11 makes 17 tokens.*max_len=16"):
        model.generate(idx, 11, temperature=0.0, attention_mask=mask)
    assert torch.equal(model.generate(_ids(1, 16), 0), _ids(1, 16))        # a full prompt, nothing to add
    with pytest.raises(ValueError, match=r"16 real tokens plus max_new_tokens=1"):
        model.generate(_ids(1, 16), 1)


def test_generate_returns_a_copy_of_the_prompt():
    model = _model("linear")
    idx = _ids(1, 4)
    for n in (0, 2):
        out = model.generate(idx, n, temperature=0.0)
        assert out.untyped_storage().data_ptr() != idx.untyped_storage().data_ptr()
