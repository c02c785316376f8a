"""Tensors without values: ``device="meta"`` and ``FakeTensorMode`` (shape propagation, ``torch.export``).

The ops, ``LinearMixer`` and ``TransformerLM`` must run on them, giving the shapes and dtypes of a real
call: the value checks (gates, β, masks) have nothing to check there and step aside."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import linattn

from decay_cases import OPS, call, inputs


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", ["meta", "fake"])
@pytest.mark.parametrize("r", [1, 2])
def test_the_ops_run_on_tensors_without_values(op, device, r):
    real = {name: t.detach().float() for name, t in inputs(op, B=2, r=r, T=11).items()}
    want_out, want_S = call(op, real, chunk_size=4)
    mask = torch.ones(2, 11, dtype=torch.bool)
    if device == "meta":
        x = {name: t.to("meta") for name, t in real.items()}
        out, S = call(op, x, chunk_size=4, attention_mask=mask.to("meta"))
    else:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x = {name: mode.from_tensor(t) for name, t in real.items()}
            out, S = call(op, x, chunk_size=4, attention_mask=mode.from_tensor(mask))
    assert (out.shape, out.dtype, S.shape, S.dtype) == (want_out.shape, want_out.dtype, want_S.shape, want_S.dtype)


def test_linear_attention_runs_under_fake_tensor_mode():
    with FakeTensorMode():
        q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
        assert linattn.linear_attention(q, k, v, causal=True, chunk_size=4).shape == (1, 2, 9, 4)


@pytest.mark.parametrize("rule", ["retention", "gla", "delta", "gated_delta", "kda"])
@pytest.mark.parametrize("device", ["meta", "fake"])
def test_a_mixer_runs_and_decodes_on_tensors_without_values(rule, device):
    mixer = linattn.LinearMixer(16, 2, rule=rule)
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    if device == "meta":
        mixer = mixer.to("meta")
        y, state = mixer(x.to("meta"), return_state=True, attention_mask=mask.to("meta"))
        step = mixer(x[:, :1].to("meta"), state=state)
    else:
        with FakeTensorMode(allow_non_fake_inputs=True):
            y, state = mixer(torch.randn(2, 7, 16), return_state=True, attention_mask=torch.ones(2, 7, dtype=torch.bool))
            step = mixer(torch.randn(2, 1, 16), state=state)
    assert y.shape == (2, 7, 16) and step.shape == (2, 1, 16)


@pytest.mark.parametrize("attention", ["linear", "retention", "gla", "delta", "gated_delta", "softmax"])
@pytest.mark.parametrize("device", ["meta", "fake"])
def test_a_language_model_runs_on_tensors_without_values(attention, device):
    config = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=2, attention=attention)
    if device == "meta":
        with torch.device("meta"):
            model = linattn.TransformerLM(**config)
        logits, state = model(torch.randint(0, 40, (2, 9)).to("meta"), return_state=True)
    else:
        model = linattn.TransformerLM(**config)
        with FakeTensorMode(allow_non_fake_inputs=True):
            logits, state = model(torch.randint(0, 40, (2, 9)), return_state=True)
            model(torch.randint(0, 40, (2, 1)), state=state)
    assert logits.shape == (2, 9, 40)
