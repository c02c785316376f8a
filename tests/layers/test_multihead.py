"""LinearMultiheadAttention: nn.MultiheadAttention's call, linear attention's numbers."""
from __future__ import annotations

import pytest
import torch

from linattn.layers import LinearAttention, LinearMultiheadAttention
from refimpl import ref_linear_attention


def _heads(t, H):
    B, T, E = t.shape
    return t.view(B, T, H, E // H).transpose(1, 2)                          # (B, H, T, D)


def _mha_reference(layer, query, key, value, *, causal=False, attention_mask=None):
    """Projections, the float64 quadratic reference of tests/refimpl.py per head, output projection."""
    H = layer.num_heads
    q, k, v = _heads(layer.q_proj(query), H), _heads(layer.k_proj(key), H), _heads(layer.v_proj(value), H)
    y, _, _ = ref_linear_attention(q, k, v, causal=causal, attention_mask=attention_mask)
    B, _, Tq, _ = y.shape
    return layer.out_proj(y.transpose(1, 2).reshape(B, Tq, -1).to(query.dtype))


def test_multihead_wrapper_has_nn_multihead_attention_shapes():
    torch.manual_seed(0)
    ours = LinearMultiheadAttention(32, 4, batch_first=True)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    query, key = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, -3:] = True                                                    # True = padding, both
    for kwargs in ({}, {"key_padding_mask": padding}):
        out, weights = ours(query, key, key, need_weights=False, **kwargs)
        ref_out, ref_weights = theirs(query, key, key, need_weights=False, **kwargs)
        assert out.shape == ref_out.shape == (2, 5, 32) and weights is None and ref_weights is None
    x = torch.randn(2, 7, 32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    out, weights = ours(x, x, x, attn_mask=causal, is_causal=True)            # PyTorch's causal idiom
    assert out.shape == theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0].shape
    assert (ours.embed_dim, ours.num_heads, ours.head_dim, ours.batch_first) == (32, 4, 8, True)


def test_multihead_wrapper_equals_linear_attention_layer():
    torch.manual_seed(0)
    ours = LinearMultiheadAttention(24, 4, batch_first=True).double()
    layer = LinearAttention(24, 4, causal=True, bias=True).double()
    layer.load_state_dict(ours.state_dict())                                   # same parameters
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, :4] = False                                                        # left padding of row 0
    expected = layer(x, attention_mask=mask)
    by_flag, _ = ours(x, x, x, key_padding_mask=~mask, is_causal=True)
    by_mask, _ = ours(x, x, x, key_padding_mask=~mask, attn_mask=torch.ones(11, 11, dtype=torch.bool).triu(1))
    torch.testing.assert_close(by_flag, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(by_mask, expected, rtol=1e-12, atol=1e-12)


def test_multihead_wrapper_cross_attention_equals_reference():
    torch.manual_seed(0)
    ours = LinearMultiheadAttention(24, 3, batch_first=True).double()
    query = torch.randn(2, 4, 24, dtype=torch.float64)
    key, value = torch.randn(2, 9, 24, dtype=torch.float64), torch.randn(2, 9, 24, dtype=torch.float64)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 6:] = True
    out, _ = ours(query, key, value, key_padding_mask=padding)
    expected = _mha_reference(ours, query, key, value, attention_mask=~padding)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_multihead_wrapper_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="batch_first"):
        LinearMultiheadAttention(32, 4)                                        # must be said explicitly
    with pytest.raises(ValueError, match="batch first only: pass batch_first=True"):
        LinearMultiheadAttention(32, 4, batch_first=False)
    with pytest.raises(TypeError, match="dropout"):
        LinearMultiheadAttention(32, 4, batch_first=True, dropout=0.1)
    layer = LinearMultiheadAttention(32, 4, batch_first=True)
    x, y = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    cases = [
        (lambda: layer(x, x, x, need_weights=True), ValueError, "need_weights=True: linear attention never forms"),
        (lambda: layer(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.bool)), ValueError,
         r"attn_mask must be None or the \(5, 5\) causal mask"),
        (lambda: layer(x, x, x, attn_mask=torch.zeros(5, 5)), ValueError, "attn_mask must be None or"),
        (lambda: layer(x, x, x, attn_mask=[[0]]), TypeError, "attn_mask must be a torch.Tensor"),
        (lambda: layer(x, y, y, is_causal=True), ValueError, r"needs as many queries as keys, got Tq=5 and Tk=6"),
        (lambda: layer(x, y, x), ValueError, "key and value Tk"),
        (lambda: layer(x, x, x, key_padding_mask=torch.zeros(2, 5)), TypeError,
         r"key_padding_mask must be a bool tensor \(True = padding"),
        (lambda: layer(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
         r"key_padding_mask must have shape \(batch, seq\) = \(2, 5\)"),
        (lambda: layer(x[0], x[0], x[0]), ValueError, r"query must have shape \(batch, seq, embed_dim=32\)"),
        (lambda: layer(x, x.double(), x), TypeError, "key has dtype torch.float64"),
        (lambda: layer(x, x, x, is_causal=1), TypeError, "is_causal"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
