"""Defects a new user found by trying to break the package, each pinned by a test."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import distributed


def test_finite_inputs_whose_scores_overflow_stay_causal_in_the_decay_chunk_forms():
    """q_0·k_1 = 1e40 overflows float32; the masked pair must not turn output 0 into NaN."""
    q, k, v = torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1)
    q[..., 0, 0] = 1e20
    k[..., 1, 0] = 1e20
    calls = {
        "retention": lambda m: linattn.retention(q, k, v, 0.9, method=m),
        "gated_delta": lambda m: linattn.gated_delta_rule(q, k, v, torch.full((1, 1, 2), -0.1),
                                                          torch.tensor([[[0.5, 0.0]]]), method=m),
        "gla": lambda m: linattn.gated_linear_attention(q, k, v, torch.full((1, 1, 2, 1), -0.1), method=m),
        "delta": lambda m: linattn.delta_rule(q, k, v, torch.tensor([[[0.5, 0.0]]]), method=m),
    }
    for name, call in calls.items():
        chunk, rec = call("chunk"), call("recurrent")
        assert torch.equal(chunk[..., 0, :], rec[..., 0, :]), (name, chunk, rec)


@pytest.mark.parametrize("name", ["linear", "retention", "gla", "delta", "gated_delta", "gated_delta_channel",
                                  "softmax"])
def test_a_later_nan_leaves_earlier_outputs_bit_for_bit_unchanged(name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 3) for _ in range(3))
    beta, log_g = torch.rand(1, 2, 12), -torch.rand(1, 2, 12, 3)
    call = {
        "linear": lambda v: linattn.linear_attention(q, k, v, causal=True),
        "retention": lambda v: linattn.retention(q, k, v, 0.8),
        "gla": lambda v: linattn.gated_linear_attention(q, k, v, log_g),
        "delta": lambda v: linattn.delta_rule(q, F.normalize(k, dim=-1), v, beta),
        "gated_delta": lambda v: linattn.gated_delta_rule(q, F.normalize(k, dim=-1), v, log_g[..., 0], beta),
        "gated_delta_channel": lambda v: linattn.gated_delta_rule(q, F.normalize(k, dim=-1), v, log_g, beta),
        "softmax": lambda v: linattn.softmax_attention(q, k, v, causal=True),
    }[name]
    clean = call(v)
    for t, col in ((11, 0), (5, 2), (0, 1)):
        v2 = v.clone()
        v2[:, :, t, col] = float("nan")
        dirty = call(v2)
        assert torch.equal(dirty[:, :, :t], clean[:, :, :t]), (name, t)
        assert torch.isnan(dirty[:, :, t:, col]).all(), (name, t)


@pytest.mark.parametrize("name", ["LinearAttention", "LinearMultiheadAttention", "TransformerLM"])
def test_layers_refuse_cosformer_without_max_len_where_it_would_see_the_future(name):
    x = torch.randn(1, 10, 8)
    with pytest.raises(ValueError, match=r"CosFormerFeatures needs a fixed max_len"):
        if name == "LinearAttention":
            linattn.LinearAttention(8, 2, causal=True, feature_map="cosformer")(x)
        elif name == "LinearMultiheadAttention":
            linattn.LinearMultiheadAttention(8, 2, batch_first=True, feature_map="cosformer")(x, x, x, is_causal=True)
        else:
            linattn.TransformerLM(11, 8, 1, 2, feature_map="cosformer")(torch.randint(11, (1, 10)))
    with pytest.raises(ValueError, match=r"CosFormerFeatures needs a fixed max_len.*different lengths"):
        linattn.LinearMultiheadAttention(8, 2, batch_first=True, feature_map="cosformer")(x, x[:, :7], x[:, :7])
    layer = linattn.LinearAttention(8, 2, causal=True, feature_map=linattn.CosFormerFeatures(max_len=16))
    torch.testing.assert_close(layer(x)[:, :5], layer(x[:, :5]))                  # a fixed max_len: causal


@pytest.mark.parametrize("mha", [False, True])
def test_half_layers_compute_their_features_in_float32(mha):
    torch.manual_seed(0)
    if mha:
        layer = linattn.LinearMultiheadAttention(32, 2, batch_first=True, feature_map="performer")
        run = lambda m, x: m(x, x, x)[0]
    else:
        layer = linattn.LinearAttention(32, 2, feature_map="performer")
        run = lambda m, x: m(x)
    x = torch.randn(2, 20, 32) * 8
    ref = run(layer, x)
    half = copy.deepcopy(layer).half()
    q = half.q_proj(x.half()).float()                                    # the same float16 projections ...
    k = half.k_proj(x.half()).float()
    got = run(half, x.half())
    assert got.dtype == torch.float16
    assert (got.float() - ref).abs().max() < 0.1 * ref.abs().max()      # ... features in float32: close


def test_distillation_of_half_inputs_stays_finite():
    h = linattn.HedgehogFeatures(4)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 6, 4, generator=g), torch.randn(1, 1, 6, 4, generator=g)
    for scale in (3, 30):
        history = linattn.distill_feature_map(h, (q * scale).half(), (k * scale).half(), steps=3)
        assert all(math.isfinite(x) for x in history) and torch.isfinite(h.weight).all()
    with pytest.raises(TypeError, match=r"q and k must have one dtype, got q torch.float32 and k torch.float64"):
        linattn.distill_feature_map(h, q, k.double(), steps=1)
    with pytest.raises(ValueError, match=r"q and k must be on one device"):
        linattn.distill_feature_map(h, q, k.to("meta"), steps=1)


def test_softmax_decoding_and_generation_under_autocast():
    torch.manual_seed(0)
    attn = linattn.SoftmaxAttention(8, 2, causal=True)
    x = torch.randn(1, 4, 8)
    lm = linattn.TransformerLM(11, 16, 2, 2, attention=["gated_delta", "softmax"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, cache = attn(x, return_state=True)
        y2, cache = attn(x[:, :1], state=cache, return_state=True)
        out = lm.generate(torch.randint(11, (2, 4)), 3, temperature=0.0)
    assert cache.k.dtype == torch.bfloat16 and out.shape == (2, 7)
    with pytest.raises(TypeError, match=r"state holds torch.bfloat16 keys but this call's keys are torch.float32"):
        attn(x[:, :1], state=cache)                                      # autocast switched off in between


def test_retention_with_a_float_gamma_that_underflows():
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(ValueError, match=r"gamma must be a number that does not underflow to 0 in torch.float32"):
        linattn.retention(q, q, q, 1e-50)


def test_returned_states_are_contiguous_for_strided_inputs():
    q, k, v = (torch.randn(3, 2, 4).transpose(0, 1) for _ in range(3))      # (2, 3, 4), not contiguous
    _, st = linattn.linear_attention_step(q, k, v)
    _, st2 = linattn.linear_attention_step(q, k, v, linattn.LinearAttentionState(st.S.transpose(-1, -2).contiguous()
                                                                                 .transpose(-1, -2), st.z))
    assert st.S.is_contiguous() and st.z.is_contiguous() and st2.S.is_contiguous() and st2.z.is_contiguous()
    x = torch.randn(1, 2, 6, 4)
    S0 = torch.randn(1, 2, 4, 4).transpose(-1, -2)
    for fn in (lambda m: linattn.retention(x, x, x, 0.9, initial_state=S0, return_state=True, method=m),
               lambda m: linattn.delta_rule(x, x, x, torch.full((1, 2, 6), 0.1), initial_state=S0, return_state=True,
                                            method=m)):
        for method in ("chunk", "recurrent"):
            assert fn(method)[1].is_contiguous()


def test_language_model_loss_names_bad_targets():
    lm = linattn.TransformerLM(11, 8, 1, 2)
    idx = torch.randint(11, (2, 5))
    with pytest.raises(TypeError, match=r"idx must be an int64"):
        lm.loss([[1, 2]], idx)
    with pytest.raises(TypeError, match=r"targets must be an int64 \(torch.long\) tensor"):
        lm.loss(idx, idx.int())
    with pytest.raises(ValueError, match=r"targets must have the shape of idx \(2, 5\), got \(2, 4\)"):
        lm.loss(idx, idx[:, :4])
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 11\) or -100.*got 11"):
        lm.loss(idx, torch.full((2, 5), 11))
    masked = idx.clone()
    masked[:, :2] = -100
    assert torch.isfinite(lm.loss(idx, masked))


def test_integers_and_floats_from_numpy_are_accepted_and_seeds_are_checked_first():
    import random

    linattn.set_seed(np.int64(3))
    state = random.getstate()
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32 - 1\]"):
        linattn.set_seed(2**32)
    assert random.getstate() == state                                    # nothing was seeded
    phi = linattn.PerformerFeatures(np.int64(4), np.int32(8), seed=np.int64(1), scale=np.float32(0.5))
    assert type(phi.head_dim) is int and type(phi.scale) is float
    assert linattn.CosFormerFeatures(max_len=np.int64(8)).max_len == 8


def test_generate_refuses_a_position_dependent_map_before_it_starts():
    lm = linattn.TransformerLM(11, 8, 1, 2, feature_map=linattn.CosFormerFeatures(max_len=32))
    idx = torch.randint(11, (1, 4))
    assert lm.generate(idx, 1).shape == (1, 5)                           # one new token needs no decoding
    with pytest.raises(ValueError, match=r"generate cannot decode with the position-dependent feature_map"):
        lm.generate(idx, 2)


def test_distributed_calls_without_a_process_group_point_to_the_one_process_function():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match=r"or use linattn.softmax_attention in a single process"):
        linattn.ring_softmax_attention(q, q, q)
    with pytest.raises(RuntimeError, match=r"or use linattn.linear_attention in a single process"):
        linattn.sequence_parallel_linear_attention(q, q, q)


def test_meta_tensors_flow_through_the_causal_paths():
    q, k, v = (torch.empty(1, 2, 9, 4, device="meta") for _ in range(3))
    assert linattn.linear_attention(q, k, v, causal=True, chunk_size=4).device.type == "meta"
    assert linattn.softmax_attention(q, k, v, causal=True).device.type == "meta"
