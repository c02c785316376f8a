"""The padding mask: one name, one meaning (Hugging Face's ``attention_mask``: True or 1 = real token).

PyTorch's ``key_padding_mask`` (``nn.MultiheadAttention``) marks padding with True: accepting that
name with the opposite meaning would silently invert a mask, so it is refused everywhere by name.
"""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import distributed
from linattn.layers import LinearAttention, SoftmaxAttention
from linattn.models import TransformerBlock, TransformerLM

B, H, T, D = 2, 2, 7, 4


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))


MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])


def _calls():
    q, k, v = _qkv()
    x = torch.randn(B, T, 8, dtype=torch.float64)
    torch.manual_seed(0)
    lm = TransformerLM(11, 8, 1, 2, max_len=16).double()
    lin, soft, block = LinearAttention(8, 2).double(), SoftmaxAttention(8, 2).double(), TransformerBlock(8, 2).double()
    ids = torch.randint(11, (B, T))
    return {
        "softmax_attention": lambda **kw: linattn.softmax_attention(q, k, v, **kw),
        "linear_attention": lambda **kw: linattn.linear_attention(q, k, v, **kw),
        "local_state": lambda **kw: distributed.local_state(k, v, **kw),
        "LinearAttention": lambda **kw: lin(x, **kw),
        "SoftmaxAttention": lambda **kw: soft(x, **kw),
        "TransformerBlock": lambda **kw: block(x, **kw),
        "TransformerLM": lambda **kw: lm(ids, **kw),
        "generate": lambda **kw: lm.generate(ids, 2, temperature=0.0, **kw),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_the_old_name_is_refused_with_an_explanation(name):
    call = _calls()[name]
    with pytest.raises(TypeError, match=r"attention_mask.*not key_padding_mask.*opposite"):
        call(key_padding_mask=MASK.bool())


@pytest.mark.parametrize("name", [n for n in _calls() if n != "generate"])
def test_integer_masks_mean_what_bool_masks_mean(name):
    call = _calls()[name]
    ref = call(attention_mask=MASK.bool())
    for dtype in (torch.int64, torch.int32, torch.uint8):
        got = call(attention_mask=MASK.to(dtype))
        for a, b in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)


def test_generate_accepts_a_left_padding_integer_mask():
    lm = TransformerLM(11, 8, 1, 2, max_len=16).double()
    ids = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a = lm.generate(ids, 3, temperature=0.0, attention_mask=mask)
    b = lm.generate(ids, 3, temperature=0.0, attention_mask=mask.bool())
    assert torch.equal(a, b)


def test_true_marks_a_real_token():
    """Masking the last key of a non-causal call equals dropping it."""
    q, k, v = _qkv()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    for fn in (linattn.softmax_attention, linattn.linear_attention):
        got = fn(q, k, v, attention_mask=mask)
        assert torch.allclose(got, fn(q, k[:, :, :-1], v[:, :, :-1]), atol=1e-12)


@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor([[1, 2, 1, 1, 1, 1, 1], [1] * 7]), ValueError, r"attention_mask must be 0 or 1.*got 2 at index \(0, 1\)"),
    (torch.tensor([[1, -1, 1, 1, 1, 1, 1], [1] * 7]), ValueError, r"attention_mask must be 0 or 1"),
    (MASK.float(), TypeError, r"attention_mask must be a bool or integer \(0/1\) tensor.*float32"),
    (MASK.tolist(), TypeError, r"attention_mask must be a torch.Tensor.*list"),
    (MASK[:, :-1].bool(), ValueError, r"attention_mask must have shape \(batch, seq\) = \(2, 7\), got \(2, 6\)"),
])
@pytest.mark.parametrize("name", ["softmax_attention", "linear_attention", "LinearAttention", "TransformerLM"])
def test_bad_masks_are_refused(name, bad, error, match):
    with pytest.raises(error, match=match):
        _calls()[name](attention_mask=bad)
