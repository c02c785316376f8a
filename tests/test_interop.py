"""linattn.interop.from_transformers: transformers' Qwen3-Next, Qwen3.5 and Kimi Linear layers, converted
to LinearMixer, give the outputs of the originals (forward, and one token at a time against
transformers' own cache), in float32 to a relative error of 1e-4.

The layers are built from tiny random configs (no weights downloaded, no network); every parameter
is drawn at random (transformers leaves some uninitialised), norms and gates included. The tests need
transformers >= 5 (``pip install transformers``): they skip without it, and ``.ci/run``'s second
stage installs it and runs them (marker ``transformers``).
"""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn.interop import SUPPORTED_LAYERS, from_transformers

TOL = 1e-4                       # the bound on the relative error in float32


@pytest.fixture(scope="module")
def tf():
    transformers = pytest.importorskip(
        "transformers", minversion="5.0",
        reason="the interop tests build tiny transformers layers: pip install transformers (>= 5)")
    transformers.utils.logging.set_verbosity_error()                   # "falling back to PyTorch" notes
    return transformers


QWEN_SIZES = dict(hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, vocab_size=16,
                  intermediate_size=16)


def _randomise(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn at random, at the scale it has in a trained layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.8, generator=g))             # A in [1, 16]
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return layer.eval()


def _layer(tf, kind: str, seed: int = 0):
    """(a tiny transformers layer of ``kind``, its config)."""
    if kind == "Qwen3NextGatedDeltaNet":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as cls

        config = tf.Qwen3NextConfig(**QWEN_SIZES)
    elif kind == "Qwen3_5GatedDeltaNet":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as cls

        config = tf.Qwen3_5TextConfig(**QWEN_SIZES)
    elif kind == "Qwen3_5MoeGatedDeltaNet":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as cls

        config = tf.Qwen3_5MoeTextConfig(**QWEN_SIZES)
    else:
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention as cls

        config = tf.KimiLinearConfig(
            hidden_size=24, num_hidden_layers=1, vocab_size=16, intermediate_size=16, num_attention_heads=2,
            num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            linear_attn_config={"kda_layers": [1], "full_attn_layers": [], "num_heads": 2, "head_dim": 8,
                                "short_conv_kernel_size": 4})
    torch.manual_seed(seed)
    return _randomise(cls(config, 0), seed), config


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("T", [1, 5, 64, 150])                             # one chunk, several, off the grid
@pytest.mark.parametrize("kind", SUPPORTED_LAYERS)
def test_converted_layer_gives_the_outputs_of_the_original(tf, kind, T):
    layer, _ = _layer(tf, kind)
    mixer = from_transformers(layer)
    x = torch.randn(3, T, 24, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        want, got = layer(x), mixer(x)
    assert got.shape == want.shape == (3, T, 24) and got.dtype == torch.float32
    assert _rel(got, want) <= TOL


@pytest.mark.parametrize("kind", SUPPORTED_LAYERS)
def test_converted_layer_decodes_token_by_token_as_transformers_does(tf, kind):
    """A prompt, then one token at a time: outputs against transformers' own cache at every step, and
    the recurrent state against the one transformers keeps, (B, H_v, Dk, Dv) in both."""
    from transformers.cache_utils import DynamicCache

    layer, config = _layer(tf, kind)
    mixer = from_transformers(layer)
    x = torch.randn(2, 80, 24, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=config)
    with torch.no_grad():
        want = [layer(x[:, :70], cache=cache)]
        got, state = mixer(x[:, :70], return_state=True)
        gots = [got]
        for t in range(70, 80):
            want.append(layer(x[:, t:t + 1], cache=cache))
            got, state = mixer(x[:, t:t + 1], state=state, return_state=True)
            gots.append(got)
            assert _rel(got, want[-1]) <= TOL, t
        full = layer(x)
    assert _rel(torch.cat(gots, dim=1), full) <= TOL
    kept = cache.get_recurrent_state(0, state_idx=0)
    assert kept.shape == state.S.shape and _rel(state.S, kept) <= TOL


def test_the_mapping_of_heads_sizes_and_gates(tf):
    """Qwen3-Next: 2 query/key heads of 16, 4 value heads of 8 (value head j reads key head j // 2), a SiLU
    gate of full rank, the layer's eps; Kimi: per-channel decay, a sigmoid gate of rank head_dim."""
    qwen = from_transformers(_layer(tf, "Qwen3NextGatedDeltaNet")[0])
    assert (qwen.rule, qwen.n_heads, qwen.n_v_heads, qwen.head_dim, qwen.v_head_dim) == ("gated_delta", 2, 4, 16, 8)
    assert (qwen.qk_norm, qwen.gate_activation, qwen.gate_rank, qwen.norm_eps) == ("fla", "silu", None, 1e-6)
    assert qwen.conv.channels == 2 * 16 + 2 * 16 + 4 * 8 and qwen.d_model == 24
    kimi = from_transformers(_layer(tf, "KimiLinearDeltaAttention")[0])
    assert (kimi.rule, kimi.n_heads, kimi.n_v_heads, kimi.head_dim, kimi.v_head_dim) == ("kda", 2, 2, 8, 8)
    assert (kimi.gate_activation, kimi.gate_rank, kimi.norm_eps) == ("sigmoid", 8, 1e-5)


def test_the_converted_layer_owns_its_weights_and_trains(tf):
    layer, _ = _layer(tf, "Qwen3NextGatedDeltaNet")
    mixer = from_transformers(layer)
    before = layer.in_proj_qkvz.weight.clone()
    with torch.no_grad():
        mixer.q_proj.weight.zero_()
    assert torch.equal(layer.in_proj_qkvz.weight, before)
    x = torch.randn(2, 9, 24)
    mixer(x).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixer.parameters())


def test_the_converted_layer_follows_the_dtype_of_the_original(tf):
    """(transformers computes the rule in float32 whatever the layer's dtype: the bound stays 1e-4)"""
    layer, _ = _layer(tf, "KimiLinearDeltaAttention")
    mixer = from_transformers(layer.double())
    assert all(p.dtype == torch.float64 for p in mixer.parameters())
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    with torch.no_grad():
        got = mixer(x)
        assert got.dtype == torch.float64 and _rel(got, layer(x)) <= TOL


def test_unsupported_layers_are_refused_by_name(tf):
    with pytest.raises(TypeError, match=r"layer must be one of transformers' Qwen3NextGatedDeltaNet.*got torch.nn.modules.linear.Linear"):
        from_transformers(torch.nn.Linear(4, 4))
    layer, _ = _layer(tf, "Qwen3NextGatedDeltaNet")
    layer.activation = "gelu"
    with pytest.raises(ValueError, match=r"activation='gelu'.* applies SiLU"):
        from_transformers(layer)


def test_interop_is_reached_from_a_plain_import():
    assert linattn.interop.from_transformers is from_transformers
    with pytest.raises(TypeError, match="layer must be one of"):
        linattn.interop.from_transformers("Qwen3NextGatedDeltaNet")
