"""The layers' and the model's constructor arguments (NumPy numbers, eps, feature maps by name) and the KV cache's checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import linattn
from linattn.layers import LinearAttention, SoftmaxAttention
from linattn.models import TransformerBlock, TransformerLM
from linattn.state import KVCache

VOCAB = 29


def _model(attention="linear", *, seed=0, max_len=64, **kwargs):
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, 32, 2, 4, attention=attention, max_len=max_len, chunk_size=8, **kwargs).eval()


def _ids(*shape, seed=1):
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------
# Constructor arguments: the functions' rules (NumPy scalars, eps, feature maps by name)
# ---------------------------------------------------------------------------------------


def test_linear_layer_refuses_an_eps_it_cannot_use_at_construction():
    with pytest.raises(ValueError, match=r"eps=1e-300 is not a normal torch.float32 number"):
        LinearAttention(32, 4, eps=1e-300)
    layer = LinearAttention(32, 4, eps=np.float64(1e-30))                # a NumPy float is a number
    assert type(layer.eps) is float and layer.eps == 1e-30
    assert torch.isfinite(layer(torch.randn(1, 3, 32))).all()


@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_layers_accept_numpy_sizes_and_flags_as_the_functions_do(cls):
    torch.manual_seed(0)
    ref = cls(32, 4, n_kv_heads=2, causal=True)
    torch.manual_seed(0)
    extra = {"chunk_size": np.int64(4), "normalize": np.bool_(True)} if cls is LinearAttention else {}
    layer = cls(np.int64(32), np.int32(4), n_kv_heads=np.int64(2), causal=np.bool_(True), bias=np.bool_(False),
                **extra)
    for name in ("d_model", "n_heads", "n_kv_heads", "head_dim"):
        assert type(getattr(layer, name)) is int, name
    assert type(layer.causal) is bool
    x = torch.randn(2, 7, 32)
    y, state = layer(x, return_state=np.bool_(True))
    torch.testing.assert_close(y, ref(x), rtol=1e-6, atol=1e-6)


def test_model_accepts_numpy_sizes_and_stores_python_ints():
    torch.manual_seed(0)
    model = TransformerLM(np.int64(VOCAB), np.int64(32), np.int64(2), np.int64(4), n_kv_heads=np.int64(2),
                          max_len=np.int64(16), mlp_ratio=np.int64(2), chunk_size=np.int64(8),
                          bias=np.bool_(False)).eval()
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_len", "mlp_ratio",
                 "chunk_size"):
        assert type(getattr(model.config, name)) is int, name
    assert type(model.config.bias) is bool
    assert TransformerBlock(16, 2, mlp_ratio=np.int64(3)).mlp[0].out_features == 48
    out = model.generate(_ids(1, 3), np.int64(2), temperature=np.float32(0.0), top_k=np.int64(3))
    assert out.shape == (1, 5)


@pytest.mark.parametrize("name", ["hedgehog", "performer"])
def test_feature_map_name_is_built_for_the_layer_head_dim(name):
    torch.manual_seed(0)
    layer = LinearAttention(24, 4, feature_map=name, causal=True).double()  # head_dim = 6
    phi = layer.feature_map
    assert isinstance(phi, torch.nn.Module) and phi.head_dim == 6
    if name == "performer":
        assert phi.projection is not None and phi.projection.shape[1] == 6  # drawn now, not at the first call
    else:
        assert any(p is phi.weight for p in layer.parameters())             # a learnable map trains
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    q = layer.q_proj(x).view(2, 5, 4, 6).transpose(1, 2)
    k = layer.k_proj(x).view(2, 5, 4, 6).transpose(1, 2)
    v = layer.v_proj(x).view(2, 5, 4, 6).transpose(1, 2)
    y = linattn.linear_attention(q, k, v, feature_map=phi, causal=True, method="quadratic")
    expected = layer.out_proj(y.transpose(1, 2).reshape(2, 5, 24))
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


def test_model_with_a_feature_map_that_needs_head_dim():
    model = _model(feature_map="hedgehog")                                   # head_dim = 8 in every block
    assert [b.attn.feature_map.head_dim for b in model.blocks] == [8, 8]
    assert model.blocks[0].attn.feature_map is not model.blocks[1].attn.feature_map
    assert model(_ids(2, 5)).shape == (2, 5, VOCAB)


# ---------------------------------------------------------------------------------------
# KVCache: one dtype, devices named, memory of its own
# ---------------------------------------------------------------------------------------


def _cache_parts(B=2, H=2, T=3, D=8):
    return torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.ones(B, T, dtype=torch.bool)


def test_kv_cache_refuses_keys_and_values_of_different_dtypes():
    k, v, mask = _cache_parts()
    with pytest.raises(TypeError, match=r"state.k and state.v must have one dtype, got torch.float32 and "
                                        r"torch.float64"):
        KVCache(k, v.double(), mask)


def test_kv_cache_device_errors_name_the_tensor_on_the_wrong_device():
    k, v, mask = _cache_parts()                                             # "meta": a second device on any machine
    with pytest.raises(ValueError, match=r"state.v is on meta but state.k is on cpu"):
        KVCache(k, v.to("meta"), mask)
    with pytest.raises(ValueError, match=r"state.attention_mask is on meta but state.k is on cpu"):
        KVCache(k, v, mask.to("meta"))
    layer = SoftmaxAttention(32, 4, n_kv_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"state.k is on meta but x is on cpu"):
        layer(torch.randn(2, 1, 32), state=KVCache(k.to("meta"), v.to("meta"), mask.to("meta")))
