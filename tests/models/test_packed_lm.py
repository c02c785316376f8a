"""TransformerLM on packed batches (``cu_seqlens``): each sequence's logits and the gradient of the loss
equal one call per sequence, in a hybrid model (LinearMixer rules, linear and softmax layers), with
RoPE or learned positions restarting at every sequence, empty sequences and lengths off the chunk grid.
"""
from __future__ import annotations

import pytest
import torch

import linattn

LENGTHS = [7, 0, 12, 1, 5]
TOL = dict(rtol=1e-10, atol=1e-12)


def _offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)


@pytest.mark.parametrize("positions", ["rope", "learned", "none"])
def test_packed_lm_equals_one_call_per_sequence(positions):
    torch.manual_seed(0)
    model = linattn.TransformerLM(50, 32, 4, 4, attention=["gated_delta", "linear", "softmax", "kda"],
                                  chunk_size=4, positions=positions, max_len=64).double()
    T = sum(LENGTHS)
    idx = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(2))
    cu = _offsets(LENGTHS)
    logits = model(idx, cu_seqlens=cu)
    params = list(model.parameters())
    got = torch.autograd.grad(model.loss(idx, targets, cu_seqlens=cu), params)
    ref = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            torch.testing.assert_close(logits[:, a:b], model(idx[:, a:b]), **TOL)
            ref = ref + model.loss(idx[:, a:b], targets[:, a:b]) * (b - a) / T   # the packed loss: a token mean
    for g, w in zip(got, torch.autograd.grad(ref, params)):
        torch.testing.assert_close(g, w, **TOL)


def test_packed_lm_differs_from_the_unpacked_row():
    """The packing is not ignored: the second sequence does not see the first."""
    torch.manual_seed(0)
    model = linattn.TransformerLM(50, 32, 1, 4, attention="gated_delta", chunk_size=4).double()
    idx = torch.randint(0, 50, (1, 9))
    assert not torch.allclose(model(idx, cu_seqlens=_offsets([4, 5]))[:, 4:], model(idx)[:, 4:])


def test_packed_lm_refuses_state_return_state_and_masks():
    model = linattn.TransformerLM(50, 32, 1, 4, attention="gated_delta")
    idx = torch.randint(0, 50, (1, 9))
    cu = _offsets([4, 5])
    with pytest.raises(ValueError, match="training only"):
        model(idx, cu_seqlens=cu, return_state=True)
    with pytest.raises(ValueError, match="attention_mask"):
        model(idx, cu_seqlens=cu, attention_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="B = 2"):
        model(idx.repeat(2, 1), cu_seqlens=cu)
