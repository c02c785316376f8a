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
        (lambda: layer(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long)), TypeError,
         r"key_padding_mask must be a bool tensor \(True = padding.* or a float one"),
        (lambda: layer(x, x, x, key_padding_mask=torch.full((2, 5), -1.0)), ValueError,
         r"key_padding_mask must be 0 or -inf where it is a float mask .*, got -1.0"),
        (lambda: layer(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
         r"key_padding_mask must have shape \(batch, seq\) = \(2, 5\)"),
        (lambda: layer(x[0], x[0], x[0]), ValueError, r"query must have shape \(batch, seq, embed_dim=32\)"),
        (lambda: layer(x, x.double(), x), TypeError, "key has dtype torch.float64"),
        (lambda: layer(x, x, x, is_causal=1), TypeError, "is_causal"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---------------------------------------------------------------------------------------
# Inside nn.TransformerEncoderLayer and nn.TransformerEncoder
# ---------------------------------------------------------------------------------------


def _encoder_layer(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True).double()
    layer.self_attn = LinearMultiheadAttention(32, 4, batch_first=True).double()
    return layer


def _post_norm_block(layer, x, key_padding_mask=None, is_causal=False):
    """nn.TransformerEncoderLayer's equations (post-norm), with linattn's attention and a bool mask."""
    a, _ = layer.self_attn(x, x, x, key_padding_mask=key_padding_mask, is_causal=is_causal)
    h = layer.norm1(x + a)
    return layer.norm2(h + layer.linear2(layer.activation(layer.linear1(h))))


@pytest.fixture
def no_fused_path(monkeypatch):
    """PyTorch's fused inference kernels (softmax attention on packed weights) fail the test if called."""
    def fused(*args, **kwargs):
        raise AssertionError("PyTorch's fused softmax path ran in place of linear attention")

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", fused)
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", fused)


@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_in_an_encoder_layer_every_mode_runs_linear_attention(mode, no_fused_path):
    layer = _encoder_layer()
    layer.train(mode == "train")
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True                                                   # row 1: 3 padded keys
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        plain = layer(x)
        masked = layer(x, src_key_padding_mask=padding)                    # PyTorch passes it on as 0 / -inf
        causal = layer(x, src_mask=torch.nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64),
                       is_causal=True)
        torch.testing.assert_close(plain, _post_norm_block(layer, x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(masked, _post_norm_block(layer, x, padding), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(causal, _post_norm_block(layer, x, is_causal=True), rtol=1e-12, atol=1e-12)
        # padded keys change nothing for the real tokens of row 1
        torch.testing.assert_close(masked[1, :4], layer(x[1:, :4])[0], rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_a_transformer_encoder_of_linear_layers_stacks_them(mode, no_fused_path):
    layer = _encoder_layer()
    encoder = torch.nn.TransformerEncoder(layer, 2).train(mode == "train")
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 3:] = True                                                   # right padding of row 0
    with torch.set_grad_enabled(mode == "train"):
        got = encoder(x, src_key_padding_mask=padding)
        want = x
        for block in encoder.layers:
            want = _post_norm_block(block, want, padding)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert isinstance(encoder.layers[1].self_attn, LinearMultiheadAttention)
