"""``torch.jit.trace`` of the decay ops is refused with a message that says why and what to use; the
states load back with ``torch.load``'s default ``weights_only=True``."""
from __future__ import annotations

import io

import pytest
import torch

import linattn

from decay_cases import OPS, call, inputs


@pytest.mark.parametrize("op", OPS)
def test_tracing_a_decay_op_is_refused_with_a_clear_message(op):
    x = {name: t.detach().float() for name, t in inputs(op, T=6).items()}
    with pytest.raises(RuntimeError, match=r"cannot be recorded by torch.jit.trace.*use torch.compile or torch.export"):
        torch.jit.trace(lambda q, k, v: call(op, x, q=q, k=k, v=v)[0], (x["q"], x["k"], x["v"]))


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)                              # weights_only=True: the default


def test_states_load_with_weights_only():
    la = linattn.LinearAttentionState(torch.rand(1, 2, 3, 4), torch.rand(1, 2, 3))
    assert _round_trip(la) == la
    mixer_state = linattn.MixerState(torch.rand(1, 2, 4, 4), torch.rand(1, 24, 3))
    assert _round_trip(mixer_state) == mixer_state
    model = linattn.TransformerLM(vocab_size=30, d_model=16, n_layers=3, n_heads=2,
                                  attention=["linear", "gated_delta", "softmax"])
    _, state = model(torch.randint(0, 30, (2, 5)), return_state=True)
    loaded = _round_trip(state)
    assert isinstance(loaded, linattn.DecodingState) and loaded == state
    nxt = torch.randint(0, 30, (2, 1))
    torch.testing.assert_close(model(nxt, state=loaded), model(nxt, state=state), rtol=0, atol=0)
