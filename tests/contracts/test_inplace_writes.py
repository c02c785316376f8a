"""Outputs and states may be written in place (a streaming reset ``S[0] = 0`` of a finished sequence),
with gradients enabled, for every op and through ``LinearMixer``'s state; the gradients stay right."""
from __future__ import annotations

import pytest
import torch

import linattn

from decay_cases import OPS, call, inputs


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("r", [1, 2])
def test_writing_into_outputs_and_states_keeps_the_gradients_right(op, method, r):
    x = inputs(op, B=2, r=r, T=13)
    out, S = call(op, x, method=method, chunk_size=4)
    S[0] = 0.0                                          # reset the first sequence's state
    out[1, :, :3] = 0.0
    loss = out.square().sum() + S.square().sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    ref_out, ref_S = call(op, x, method=method, chunk_size=4)
    keep_out = torch.ones_like(ref_out)
    keep_out[1, :, :3] = 0
    ref_loss = (ref_out * keep_out).square().sum() + ref_S[1].square().sum()
    ref_grads = torch.autograd.grad(ref_loss, list(x.values()))
    for name, a, b in zip(x, grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("rule", ["retention", "gla", "delta", "gated_delta", "kda"])
def test_a_mixer_state_can_be_reset_in_place(rule):
    mixer = linattn.LinearMixer(16, 2, rule=rule)
    x = torch.randn(2, 7, 16)
    y, state = mixer(x, return_state=True)
    state.S[0] = 0.0
    if state.conv is not None:
        state.conv[0] = 0.0
    y2 = mixer(x[:, :3], state=state)
    fresh = mixer(x[:1, :3])                             # the reset sequence starts over
    torch.testing.assert_close(y2[:1], fresh, rtol=1e-5, atol=1e-6)
    (y.sum() + y2.sum()).backward()
