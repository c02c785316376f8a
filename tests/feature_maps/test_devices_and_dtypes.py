"""Feature maps at the edges: distillation in inference mode, a map that changes device, dtype casts."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import HedgehogFeatures, PerformerFeatures, distill_feature_map


def _qk(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, 12, 4, generator=g), torch.randn(1, 2, 12, 4, generator=g)


def test_distillation_works_under_inference_mode_and_no_grad():
    q, k = _qk()
    ref_map = HedgehogFeatures(4)
    ref = distill_feature_map(ref_map, q, k, steps=5)
    for context in (torch.inference_mode, torch.no_grad):
        h = HedgehogFeatures(4)
        with context():
            history = distill_feature_map(h, q, k, steps=5)
        assert history == ref
        assert torch.equal(h.weight, ref_map.weight)


def test_a_feature_map_that_returns_another_device_is_refused():
    q, k = _qk()
    v = torch.randn(1, 2, 12, 3)
    to_meta = lambda x: x.to("meta")
    with pytest.raises(ValueError, match=r"feature_map returned features of q on meta, but q is on cpu"):
        linattn.linear_attention(q, k, v, feature_map=to_meta, causal=True)
    with pytest.raises(ValueError, match=r"feature_map returned features of q on meta"):
        linattn.retention(q, k, v, 0.5, feature_map=to_meta)
    with pytest.raises(ValueError, match=r"feature_map returned features of q on meta"):
        linattn.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], feature_map=to_meta)


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_float16", "double"])
def test_casting_a_module_does_not_round_the_performer_projection(cast):
    phi = PerformerFeatures(4, 16, seed=3)
    W = phi.projection.clone()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), phi)
    {"half": model.half, "bfloat16": model.bfloat16, "to_float16": lambda: model.to(torch.float16),
     "double": model.double}[cast]()
    assert phi.projection.dtype == torch.float64 and torch.equal(phi.projection, W)
    assert model[0].weight.dtype != torch.float32    # the rest of the module was cast
    x = torch.randn(3, 4).to(model[0].weight.dtype)
    torch.testing.assert_close(phi(x).float(), PerformerFeatures(4, 16, seed=3)(x.float()), rtol=1e-2, atol=1e-3)


def test_performer_projection_follows_the_module_device():
    phi = PerformerFeatures(4, 16, seed=3)
    phi.to("meta")
    assert phi.projection.device.type == "meta" and phi.projection.dtype == torch.float64


def test_performer_draw_is_a_function_of_the_seed_alone():
    torch.manual_seed(0)
    a = PerformerFeatures(8, 24, seed=7).projection
    torch.manual_seed(123)
    torch.randn(100)
    b = PerformerFeatures(8, 24, seed=7).projection
    c = PerformerFeatures(8, 24, seed=8).projection
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.random.get_rng_state()
    PerformerFeatures(8, 24, seed=9)
    assert torch.equal(torch.random.get_rng_state(), state)   # the global generator is untouched
